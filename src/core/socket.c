/*
 * The socket layer under the TCP rendezvous: the listening sockets kept from epx_get_unique_id,
 * the choice of the rendezvous address, and bounded polling.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <limits.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/internal.h"
#include "core/socket.h"

/* ------------------------------------------------------------- listening sockets ---- */

/* Sockets bound by epx_get_unique_id, so that rank 0 in this process or a forked child reuses
 * them (the id is usually created before the ranks exist). A forked launcher keeps its copy: rank 0
 * shuts the socket down when the rendezvous ends, which stops it in every process holding it, and
 * the next visit to the table closes copies that no longer listen. A rank 0 that died before its
 * rendezvous ended stops nothing, so a copy is also closed once it is older than EPX_TIMEOUT_MS
 * plus a second: by then every rendezvous on it has ended (closing this process's copy leaves a
 * child's intact; a rank 0 that starts later binds the id's address again). */
typedef struct {
    uint64_t key;
    int fd;
    uint64_t created_ns;
} listen_entry_t;

static pthread_mutex_t listen_lock_g = PTHREAD_MUTEX_INITIALIZER;
static listen_entry_t *listen_table_g;
static size_t listen_count_g, listen_cap_g;

/* Closes the kept sockets that were shut down elsewhere or outlived every rendezvous; called
 * with the lock held. */
static void sweep_listeners(void)
{
    const epx_params_t *params;
    const uint64_t max_age_ns =
        (uint64_t)((epx_params_get(&params) == EPX_SUCCESS ? params->timeout_ms : 100000) + 1000) * 1000000ull;
    const uint64_t now = epx_time_ns();
    for (size_t i = listen_count_g; i-- > 0;) {
        int listening = 0;
        socklen_t len = sizeof(listening);
        if (getsockopt(listen_table_g[i].fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) == 0 && listening &&
            now - listen_table_g[i].created_ns < max_age_ns)
            continue;
        close(listen_table_g[i].fd);
        listen_table_g[i] = listen_table_g[--listen_count_g];
    }
}

epx_result_t epx_socket_keep_listener(uint64_t key, int fd)
{
    epx_result_t res = EPX_SUCCESS;
    pthread_mutex_lock(&listen_lock_g);
    sweep_listeners();
    if (listen_count_g == listen_cap_g) {
        size_t cap = listen_cap_g ? listen_cap_g * 2 : 8;
        listen_entry_t *grown = realloc(listen_table_g, cap * sizeof(*grown));
        if (!grown) {
            res = epx_error(EPX_ERR_OUT_OF_MEMORY, "cannot grow the table of rendezvous sockets to %zu", cap);
            goto out;
        }
        listen_table_g = grown;
        listen_cap_g = cap;
    }
    listen_table_g[listen_count_g].key = key;
    listen_table_g[listen_count_g].fd = fd;
    listen_table_g[listen_count_g].created_ns = epx_time_ns();
    listen_count_g++;
out:
    pthread_mutex_unlock(&listen_lock_g);
    return res;
}

int epx_socket_take_listener(uint64_t key)
{
    int fd = -1;
    pthread_mutex_lock(&listen_lock_g);
    for (size_t i = 0; i < listen_count_g; i++)
        if (listen_table_g[i].key == key) {
            fd = listen_table_g[i].fd;
            listen_table_g[i] = listen_table_g[--listen_count_g];
            break;
        }
    sweep_listeners();
    pthread_mutex_unlock(&listen_lock_g);
    return fd;
}

void epx_socket_stop_listener(int fd)
{
    /* On Linux, shutdown of a listening socket ends the listen for every descriptor sharing it. */
    shutdown(fd, SHUT_RDWR);
    close(fd);
}

/* ----------------------------------------------------------------- address choice ---- */

void epx_socket_format_addr(const struct sockaddr_in *sa, char *out, size_t cap)
{
    char ip[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &sa->sin_addr, ip, sizeof(ip));
    snprintf(out, cap, "%s:%u", ip, (unsigned)ntohs(sa->sin_port));
}

static epx_result_t parse_addr(const char *text, struct sockaddr_in *sa)
{
    char ip[INET_ADDRSTRLEN + 1];
    const char *colon = strrchr(text, ':');
    const char *port_text = colon ? colon + 1 : NULL;
    size_t ip_len = colon ? (size_t)(colon - text) : 0;
    if (!colon || ip_len == 0 || ip_len >= sizeof(ip) || *port_text == '\0' || strlen(port_text) > 5)
        goto bad;
    for (const char *c = port_text; *c; c++)
        if (*c < '0' || *c > '9') goto bad;
    long port = strtol(port_text, NULL, 10);
    if (port > 65535) goto bad;
    memcpy(ip, text, ip_len);
    ip[ip_len] = '\0';
    memset(sa, 0, sizeof(*sa));
    sa->sin_family = AF_INET;
    sa->sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, ip, &sa->sin_addr) != 1) goto bad;
    return EPX_SUCCESS;
bad:
    return epx_error(EPX_ERR_INVALID_ARG, "EPX_BOOTSTRAP_ADDR='%s' is not an IPv4 address and port (ip:port)",
                     text);
}

/* NCCL's interface list: comma-separated prefixes, "=" before the list for exact names, "^" before
 * that to exclude the listed ones instead of keeping them. */
int epx_socket_ifname_matches(const char *spec, const char *name)
{
    int exclude = spec[0] == '^';
    spec += exclude;
    int exact = spec[0] == '=';
    spec += exact;
    for (const char *tok = spec; *tok;) {
        size_t len = strcspn(tok, ",");
        if (len && (exact ? strlen(name) == len && !strncmp(name, tok, len) : !strncmp(name, tok, len)))
            return !exclude;
        tok += len + (tok[len] == ',');
    }
    return exclude;
}

/* The launcher says every process of the job is on this node (torchrun, Open MPI, Slurm). */
static int job_is_single_node(void)
{
    static const char *const pairs[][2] = {{"LOCAL_WORLD_SIZE", "WORLD_SIZE"},
                                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE"}};
    for (size_t i = 0; i < sizeof(pairs) / sizeof(pairs[0]); i++) {
        const char *local = getenv(pairs[i][0]), *world = getenv(pairs[i][1]);
        if (local && world && *local && atoi(local) > 0 && atoi(local) == atoi(world)) return 1;
    }
    const char *nodes = getenv("SLURM_JOB_NUM_NODES");
    return nodes && atoi(nodes) == 1;
}

epx_result_t epx_socket_choose_address(const epx_params_t *params, struct sockaddr_in *sa)
{
    if (params->bootstrap_addr[0]) return parse_addr(params->bootstrap_addr, sa);
    memset(sa, 0, sizeof(*sa));
    sa->sin_family = AF_INET;
    sa->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const char *spec = params->socket_ifname;
    if (!spec[0] && job_is_single_node()) return EPX_SUCCESS;
    struct ifaddrs *list = NULL;
    if (getifaddrs(&list) != 0) {
        if (spec[0])
            return epx_error(EPX_ERR_SYSTEM, "getifaddrs failed looking for EPX_SOCKET_IFNAME=%s: %s", spec,
                             strerror(errno));
        return EPX_SUCCESS;
    }
    /* A named loopback interface counts only when nothing else matches. */
    int found = 0, found_loopback = 0;
    struct in_addr loopback = sa->sin_addr;
    for (struct ifaddrs *ifa = list; ifa && !found; ifa = ifa->ifa_next) {
        if (!ifa->ifa_addr || ifa->ifa_addr->sa_family != AF_INET || !(ifa->ifa_flags & IFF_UP)) continue;
        if (!epx_socket_ifname_matches(spec[0] ? spec : "^docker,lo", ifa->ifa_name)) continue;
        struct in_addr addr = ((const struct sockaddr_in *)ifa->ifa_addr)->sin_addr;
        if (ifa->ifa_flags & IFF_LOOPBACK) {
            if (!found_loopback) loopback = addr;
            found_loopback = 1;
            continue;
        }
        sa->sin_addr = addr;
        found = 1;
    }
    freeifaddrs(list);
    if (!found) sa->sin_addr = loopback;
    if (!found && !found_loopback && spec[0])
        return epx_error(EPX_ERR_INVALID_ARG,
                         "EPX_SOCKET_IFNAME=%s matches no interface that is up with an IPv4 address", spec);
    return EPX_SUCCESS;
}

/* Binds and listens on `sa` (its port is updated when 0). */
epx_result_t epx_socket_listen(struct sockaddr_in *sa, int backlog, int *fd_out)
{
    char where[64];
    epx_socket_format_addr(sa, where, sizeof(where));
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return epx_error(EPX_ERR_SYSTEM, "socket() for the rendezvous failed: %s", strerror(errno));
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, (const struct sockaddr *)sa, sizeof(*sa)) != 0) {
        int err = errno;
        close(fd);
        /* Rank 0 binds the id's address itself when the id was made elsewhere: the process that made
         * it still listens there, or it is gone and some other process took its port meanwhile. */
        return epx_error(
            EPX_ERR_SYSTEM, "cannot bind the rendezvous socket to %s: %s%s", where, strerror(err),
            err == EADDRINUSE ? " (is the process that created the unique id, when it is not rank 0 "
                                "or its parent, still listening there, or did another process take the "
                                "port after it exited?)"
                              : "");
    }
    if (listen(fd, backlog) != 0) {
        int err = errno;
        close(fd);
        return epx_error(EPX_ERR_SYSTEM, "cannot listen on %s: %s", where, strerror(err));
    }
    socklen_t len = sizeof(*sa);
    getsockname(fd, (struct sockaddr *)sa, &len);
    *fd_out = fd;
    return EPX_SUCCESS;
}

int epx_socket_remaining_ms(uint64_t deadline)
{
    uint64_t now = epx_time_ns();
    if (now >= deadline) return 0;
    uint64_t ms = (deadline - now + 999999) / 1000000;
    return ms > INT_MAX ? INT_MAX : (int)ms;
}

/* 1: ready, 0: deadline passed, -1: poll failed (errno). */
int epx_socket_poll(int fd, short events, uint64_t deadline)
{
    for (;;) {
        struct pollfd p = {fd, events, 0};
        int n = poll(&p, 1, epx_socket_remaining_ms(deadline));
        if (n > 0) return 1;
        if (n == 0 && epx_time_ns() >= deadline) return 0;
        if (n < 0 && errno != EINTR) return -1;
    }
}

void epx_socket_set_nodelay(int fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}
