/*
 * Passes each rank's region descriptor (the host backend's memfd, the cuda backend's exported
 * CUDA allocation) to its peers: every rank listens on an abstract Unix socket named by a secret
 * drawn for the buffer, every peer connects and receives the descriptor with SCM_RIGHTS. Nothing is
 * named in a file system, so a crash leaves nothing. Also the agreement step and the fault point
 * that buffer creation shares between the backends.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <signal.h>

#include "core/internal.h"

#define SHARE_POLL_MS 20

typedef struct share {
    epx_comm_t comm;
    const epx_peers_t *peers;
    int rank, nranks;
    uint64_t secret[2];
    int listener;
    int *socks;  /* [nranks] our connection to each peer's listener */
    int *served; /* [nranks] peers that have our descriptor */
    uint64_t deadline;
} share_t;

/* Abstract names are visible in /proc/net/unix: the secret keeps them from being guessed
 * before they exist; the credentials check below keeps strangers out after. */
static socklen_t socket_name(const share_t *sh, int rank, struct sockaddr_un *addr)
{
    memset(addr, 0, sizeof(*addr));
    addr->sun_family = AF_UNIX;
    int n = snprintf(addr->sun_path + 1, sizeof(addr->sun_path) - 1, "epx-%016llx%016llx-%d",
                     (unsigned long long)sh->secret[0], (unsigned long long)sh->secret[1], rank);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* Rank 0 draws the buffer's secret and every rank learns it (collective). A local failure (memory,
 * getrandom) is agreed first, so that no rank waits in the allgather for one that never comes. */
static epx_result_t draw_secret(share_t *sh, epx_result_t ready)
{
    uint64_t mine[2] = {0, 0};
    uint64_t *all = ready == EPX_SUCCESS ? calloc((size_t)sh->nranks * 2, sizeof(uint64_t)) : NULL;
    epx_result_t local = ready;
    if (local == EPX_SUCCESS && (!all || !sh->socks))
        local = epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: cannot allocate the descriptor exchange's tables",
                          sh->rank);
    if (local == EPX_SUCCESS && sh->rank == 0 && getrandom(mine, sizeof(mine), 0) != (ssize_t)sizeof(mine))
        local = epx_error(EPX_ERR_SYSTEM, "rank %d: getrandom failed: %s", sh->rank, strerror(errno));
    if (local == EPX_SUCCESS && epx_fault_point(sh->rank, 0))
        local = epx_error(EPX_ERR_SYSTEM, "rank %d: the descriptor exchange failed by EPX_TEST_FAULT_SHM", sh->rank);
    epx_result_t res = epx_comm_agree(sh->comm, local, "prepare the descriptor exchange");
    if (res == EPX_SUCCESS) res = epx_comm_allgather(sh->comm, mine, all, sizeof(mine));
    if (res == EPX_SUCCESS) {
        sh->secret[0] = all[0];
        sh->secret[1] = all[1];
    }
    free(all);
    return res;
}

static epx_result_t open_listener(share_t *sh)
{
    struct sockaddr_un addr;
    socklen_t len = socket_name(sh, sh->rank, &addr);
    sh->listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (sh->listener < 0 || bind(sh->listener, (struct sockaddr *)&addr, len) != 0 ||
        listen(sh->listener, sh->nranks + 4) != 0)
        return epx_error(EPX_ERR_SYSTEM, "rank %d: cannot listen on the descriptor socket: %s", sh->rank,
                         strerror(errno));
    return EPX_SUCCESS;
}

static epx_result_t connect_peers(share_t *sh)
{
    for (int p = 0; p < sh->nranks; p++) {
        if (p == sh->rank) continue;
        struct sockaddr_un addr;
        socklen_t len = socket_name(sh, p, &addr);
        /* Non-blocking: a backlog filled by strangers fails here instead of hanging. */
        sh->socks[p] = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (sh->socks[p] >= 0 && connect(sh->socks[p], (struct sockaddr *)&addr, len) == 0) continue;
        /* Every listener was open when the step before was agreed: a refusal means peer p closed its
         * own, by dying or by giving up on this creation after a failure elsewhere. */
        if (sh->socks[p] >= 0 && errno == ECONNREFUSED)
            return epx_error(EPX_ERR_REMOTE,
                             "rank %d: peer %d (pid %d) %s before we connected to its descriptor socket",
                             sh->rank, p, (int)sh->peers->pid[p],
                             epx_peer_exited(sh->peers, p) ? "exited" : "left the buffer creation");
        return epx_error(EPX_ERR_SYSTEM, "rank %d: cannot connect to peer %d's descriptor socket: %s",
                         sh->rank, p, strerror(errno));
    }
    return EPX_SUCCESS;
}

/* The rank whose process is at the other end of `sock`, or -1 for a stranger. */
static int peer_of(const share_t *sh, int sock)
{
    struct ucred cred;
    socklen_t len = sizeof(cred);
    if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return -1;
    for (int p = 0; p < sh->nranks; p++)
        if (p != sh->rank && sh->peers->pid[p] == cred.pid) return p;
    return -1;
}

/* Waits up to one poll period on `fd`; EPX_ERR_REMOTE when any peer exited (`peer`, the one waited for,
 * named first), EPX_ERR_TIMEOUT past the deadline. Any peer: a dead one fails the exchange on every rank,
 * and the peer we wait for may be stuck on it (a rank that could not serve the dead one still serves the
 * others, but one that died before serving us never will). */
static epx_result_t wait_readable(const share_t *sh, int fd, int peer, const char *doing)
{
    for (int i = -1; i < sh->nranks; i++) {
        const int p = i < 0 ? peer : i;
        if (p < 0 || p == sh->rank || (i >= 0 && p == peer)) continue;
        if (epx_peer_exited(sh->peers, p))
            return epx_error(EPX_ERR_REMOTE, "rank %d: peer %d (pid %d) exited while we %s", sh->rank, p,
                             (int)sh->peers->pid[p], doing);
    }
    if (epx_time_ns() >= sh->deadline)
        return epx_error(EPX_ERR_TIMEOUT, "rank %d: no progress within %lld ms while we %s", sh->rank,
                         (long long)sh->comm->timeout_ms, doing);
    struct pollfd pfd = {fd, POLLIN, 0};
    (void)poll(&pfd, 1, SHARE_POLL_MS);
    return EPX_SUCCESS;
}

/* Accepts every peer once and hands it our descriptor; strangers are dropped. A peer we cannot send to
 * (it died or left after connecting) fails the exchange, but the others are still served first: they
 * wait for our descriptor, and would otherwise wait for it until the deadline. */
static epx_result_t serve_peers(share_t *sh, int own_fd)
{
    int32_t rank = sh->rank;
    epx_result_t failed = EPX_SUCCESS;
    char message[1024] = "";
    for (int left = sh->nranks - 1; left > 0;) {
        int sock = accept4(sh->listener, NULL, NULL, SOCK_CLOEXEC);
        if (sock < 0) {
            epx_result_t res = wait_readable(sh, sh->listener, -1, "handed our region to our peers");
            if (res != EPX_SUCCESS) return res;
            continue;
        }
        int p = peer_of(sh, sock);
        if (p >= 0 && !sh->served[p]) {
            char control[CMSG_SPACE(sizeof(int))] = {0};
            struct iovec iov = {&rank, sizeof(rank)};
            struct msghdr msg = {
                .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof(control)};
            struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
            cmsg->cmsg_level = SOL_SOCKET;
            cmsg->cmsg_type = SCM_RIGHTS;
            cmsg->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(cmsg), &own_fd, sizeof(int));
            if (sendmsg(sock, &msg, MSG_NOSIGNAL) != (ssize_t)sizeof(rank) && failed == EPX_SUCCESS) {
                failed = epx_error(EPX_ERR_SYSTEM, "rank %d: cannot send our region to peer %d: %s", sh->rank,
                                   p, strerror(errno));
                epx_error_copy(message, sizeof(message));
            }
            sh->served[p] = 1;
            left--;
        }
        close(sock);
    }
    if (failed != EPX_SUCCESS) epx_error_set_message(message);
    return failed;
}

/* Receives peer p's descriptor over our connection to it. */
static epx_result_t receive_peer(share_t *sh, int p, int *fd_out)
{
    if (peer_of(sh, sh->socks[p]) != p)
        return epx_error(EPX_ERR_SYSTEM, "rank %d: peer %d's descriptor socket is held by another process",
                         sh->rank, p);
    for (;;) {
        int32_t from = -1;
        char control[CMSG_SPACE(sizeof(int))] = {0};
        struct iovec iov = {&from, sizeof(from)};
        struct msghdr msg = {
            .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof(control)};
        ssize_t n = recvmsg(sh->socks[p], &msg, MSG_CMSG_CLOEXEC);
        struct cmsghdr *cmsg = n > 0 ? CMSG_FIRSTHDR(&msg) : NULL;
        if (cmsg && cmsg->cmsg_level == SOL_SOCKET && cmsg->cmsg_type == SCM_RIGHTS) {
            memcpy(fd_out, CMSG_DATA(cmsg), sizeof(int));
            if (n == (ssize_t)sizeof(from) && from == p) return EPX_SUCCESS;
            close(*fd_out);
            *fd_out = -1;
        }
        if (n >= 0 || (errno != EAGAIN && errno != EINTR))
            return epx_error(EPX_ERR_SYSTEM, "rank %d: peer %d sent no region descriptor (%s)", sh->rank, p,
                             n < 0 ? strerror(errno) : "bad message");
        epx_result_t res = wait_readable(sh, sh->socks[p], p, "waited for a peer's region");
        if (res != EPX_SUCCESS) return res;
    }
}

epx_result_t epx_comm_agree_settled(epx_comm_t comm, epx_result_t mine, const char *step, int *settled)
{
    int32_t *all = comm->agree_words, send = (int32_t)mine;
    /* The local failure's message survives the collective (which may log over it). */
    char message[1024];
    if (mine != EPX_SUCCESS) epx_error_copy(message, sizeof(message));
    epx_result_t res = epx_comm_allgather(comm, &send, all, sizeof(send));
    if (settled) *settled = res == EPX_SUCCESS;
    if (res == EPX_SUCCESS && mine != EPX_SUCCESS) {
        epx_error_set_message(message);
        res = mine;
    }
    for (int r = 0; res == EPX_SUCCESS && r < comm->nranks; r++)
        if (all[r] != EPX_SUCCESS)
            res = epx_error(EPX_ERR_REMOTE, "rank %d: peer %d failed to %s (%s)", comm->rank, r, step,
                            epx_result_str((epx_result_t)all[r]));
    return res;
}

epx_result_t epx_comm_agree(epx_comm_t comm, epx_result_t mine, const char *step)
{
    return epx_comm_agree_settled(comm, mine, step, NULL);
}

int epx_fault_point(int rank, int step)
{
    /* Read at buffer creation only: the fault-injection tests name a rank and a step to die at, or
     * (with ":fail") to fail at. */
    const char *spec = getenv("EPX_TEST_FAULT_SHM");
    int who = -1, at = -1, n = 0;
    if (!spec || sscanf(spec, "%d:%d%n", &who, &at, &n) != 2 || who != rank || at != step) return 0;
    if (!strcmp(spec + n, ":fail")) return 1;
    raise(SIGKILL);
    return 0;
}

epx_result_t epx_share_fds(epx_comm_t comm, const epx_peers_t *peers, int own_fd, int *fds, epx_result_t ready)
{
    share_t sh = {comm, peers, comm->rank, comm->nranks, {0, 0}, -1, NULL, NULL, 0};
    if (ready == EPX_SUCCESS && !fds)
        ready = epx_error(EPX_ERR_INVALID_ARG, "rank %d: no descriptor table", sh.rank);
    for (int p = 0; fds && p < sh.nranks; p++) fds[p] = -1; /* the contract holds on every path */
    if (ready == EPX_SUCCESS) sh.socks = malloc((size_t)sh.nranks * 2 * sizeof(int));
    if (sh.socks) {
        sh.served = sh.socks + sh.nranks;
        for (int p = 0; p < sh.nranks; p++) {
            sh.socks[p] = -1;
            sh.served[p] = 0;
        }
    }
    /* Each step is agreed, so that no rank waits for a peer that already gave up. */
    epx_result_t res = draw_secret(&sh, ready);
    if (res == EPX_SUCCESS) res = epx_comm_agree(comm, open_listener(&sh), "open its descriptor socket");
    if (res == EPX_SUCCESS) res = epx_comm_agree(comm, connect_peers(&sh), "connect to its peers' sockets");
    if (res == EPX_SUCCESS) {
        epx_fault_point(sh.rank, 2);
        sh.deadline = epx_deadline_after_ms(comm->timeout_ms);
        epx_result_t passed = serve_peers(&sh, own_fd);
        for (int p = 0; p < sh.nranks && passed == EPX_SUCCESS; p++)
            if (p != sh.rank) passed = receive_peer(&sh, p, &fds[p]);
        res = epx_comm_agree(comm, passed, "exchange region descriptors");
    }
    if (sh.listener >= 0) close(sh.listener);
    for (int p = 0; sh.socks && p < sh.nranks; p++)
        if (sh.socks[p] >= 0) close(sh.socks[p]);
    free(sh.socks);
    return res;
}

uint64_t epx_namespace_id(const char *kind)
{
    char path[64];
    struct stat st;
    snprintf(path, sizeof(path), "/proc/self/ns/%s", kind);
    if (stat(path, &st) != 0) return 0;
    return (uint64_t)st.st_dev << 32 ^ (uint64_t)st.st_ino;
}

epx_result_t epx_share_check_pid_ns(epx_comm_t comm)
{
    /* From the whole table (every rank has the same), so that every rank reaches the same verdict: two
     * known namespaces that differ (an unknown one, 0, is not counted). */
    const int rank = comm->rank;
    int first = -1;
    for (int r = 0; r < comm->nranks; r++) {
        if (comm->peers[r].pid_ns == 0) continue;
        if (first < 0) {
            first = r;
        } else if (comm->peers[r].pid_ns != comm->peers[first].pid_ns) {
            return epx_error(EPX_ERR_UNSUPPORTED,
                             "rank %d: ranks %d and %d run in different pid namespaces; ranks of one machine share "
                             "memory by passing descriptors to peers checked by pid, which needs one pid namespace "
                             "(run them in one container, or share the host's pid namespace)",
                             rank, first, r);
        }
    }
    return EPX_SUCCESS;
}
