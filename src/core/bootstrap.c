/*
 * Bootstrap collectives before any transport exists: the unique id and a TCP rendezvous shaped as
 * a star through rank 0 (rank 0 gathers every block and sends the whole array back), on the
 * socket layer of core/socket.c. Only small metadata travels here; every wait is bounded.
 */
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core/bootstrap.h"
#include "core/internal.h"
#include "core/socket.h"

#define BOOT_ID_MAGIC    0x45505849u /* "EPXI" */
#define BOOT_HELLO_MAGIC 0x4550584fu /* "EPXO" */
#define BOOT_DATA_MAGIC  0x45505844u /* "EPXD" */
#define BOOT_REPLY_MAGIC 0x45505852u /* "EPXR" */
/* After a failure, rank 0 keeps accepting this long so late ranks learn why instead of timing out. */
#define BOOT_TELL_GRACE_MS 1000
/* Non-root ranks wait this much past their own deadline for rank 0's verdict. */
#define BOOT_REPLY_MARGIN_MS 1000

/* Layout inside epx_unique_id_t. Peers of one job share the byte order (the magic checks it). */
typedef struct {
    uint32_t magic;
    uint32_t addr; /* IPv4, network order */
    uint64_t nonce;
    uint16_t port; /* network order */
} boot_id_t;
_Static_assert(sizeof(boot_id_t) <= EPX_UNIQUE_ID_BYTES, "unique id too small");

typedef struct {
    uint32_t magic;
    int32_t rank;
    int32_t nranks;
    uint32_t pad;
    uint64_t nonce;
} boot_hello_t;

/* A non-root rank's block header in an allgather. */
typedef struct {
    uint32_t magic;
    uint32_t pad;
    uint64_t seq;
    uint64_t bytes;
} boot_data_hdr_t;

/* Rank 0's verdict: after the rendezvous, and before the gathered array of an allgather. */
typedef struct {
    uint32_t magic;
    int32_t status;
    uint64_t seq;
    char message[240];
} boot_reply_t;

typedef struct {
    int rank, nranks;
    int64_t timeout_ms;
    uint64_t nonce;
    int *fds;     /* rank 0: [nranks] connection to each peer (fds[0] = -1); others: fds[0] to rank 0 */
    uint64_t seq; /* allgathers done */
    int broken;   /* a failed exchange left the streams out of step */
} boot_tcp_t;

static uint64_t make_nonce(void)
{
    uint64_t nonce = 0;
    if (getrandom(&nonce, sizeof(nonce), GRND_NONBLOCK) == (ssize_t)sizeof(nonce) && nonce) return nonce;
    static _Atomic uint64_t counter;
    nonce =
        epx_time_ns() ^ ((uint64_t)getpid() << 32) ^ (atomic_fetch_add(&counter, 1) * 0x9e3779b97f4a7c15ull);
    return nonce ? nonce : 1;
}

epx_result_t epx_bootstrap_unique_id(epx_unique_id_t *id_out)
{
    const epx_params_t *params;
    EPX_CHECK(epx_params_get(&params));
    struct sockaddr_in sa;
    EPX_CHECK(epx_socket_choose_address(params, &sa));
    int fd;
    EPX_CHECK(epx_socket_listen(&sa, SOMAXCONN, &fd));
    boot_id_t id = {BOOT_ID_MAGIC, sa.sin_addr.s_addr, make_nonce(), sa.sin_port};
    epx_result_t res = epx_socket_keep_listener(id.nonce, fd);
    if (res != EPX_SUCCESS) {
        close(fd);
        return res;
    }
    char where[64];
    epx_socket_format_addr(&sa, where, sizeof(where));
    EPX_INFO(EPX_SUBSYS_BOOTSTRAP, "unique id: rendezvous at %s", where);
    memset(id_out, 0, sizeof(*id_out));
    memcpy(id_out->internal, &id, sizeof(id));
    return EPX_SUCCESS;
}

/* ------------------------------------------------------------------ stream helpers ---- */

static epx_result_t send_all(const boot_tcp_t *s, int peer, const void *buf, size_t len, uint64_t deadline,
                             const char *what)
{
    int fd = s->fds[s->rank == 0 ? peer : 0];
    const char *p = buf;
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int ready = epx_socket_poll(fd, POLLOUT, deadline);
            if (ready > 0) continue;
            if (ready == 0)
                return epx_error(EPX_ERR_TIMEOUT,
                                 "rank %d: sending %s to rank %d did not finish within %lld ms", s->rank,
                                 what, peer, (long long)s->timeout_ms);
        }
        return epx_error(EPX_ERR_BOOTSTRAP, "rank %d: sending %s to rank %d failed: %s", s->rank, what, peer,
                         strerror(errno));
    }
    return EPX_SUCCESS;
}

static epx_result_t recv_all(const boot_tcp_t *s, int peer, void *buf, size_t len, uint64_t deadline,
                             const char *what)
{
    int fd = s->fds[s->rank == 0 ? peer : 0];
    char *p = buf;
    while (len > 0) {
        ssize_t n = recv(fd, p, len, 0);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
            continue;
        }
        if (n == 0)
            return epx_error(EPX_ERR_BOOTSTRAP,
                             "rank %d: rank %d closed the bootstrap connection before "
                             "sending %s",
                             s->rank, peer, what);
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int ready = epx_socket_poll(fd, POLLIN, deadline);
            if (ready > 0) continue;
            if (ready == 0)
                return epx_error(EPX_ERR_TIMEOUT, "rank %d: %s from rank %d did not arrive within %lld ms",
                                 s->rank, what, peer, (long long)s->timeout_ms);
        }
        return epx_error(EPX_ERR_BOOTSTRAP, "rank %d: receiving %s from rank %d failed: %s", s->rank, what,
                         peer, strerror(errno));
    }
    return EPX_SUCCESS;
}

/* Appends "a, b, c" of the ranks with missing[r] set (truncated with "..."). */
static void format_rank_list(const unsigned char *missing, int nranks, char *out, size_t cap)
{
    size_t len = 0;
    out[0] = '\0';
    for (int r = 0; r < nranks && len + 16 < cap; r++)
        if (missing[r]) len += (size_t)snprintf(out + len, cap - len, "%s%d", len ? ", " : "", r);
    if (len + 16 >= cap) snprintf(out + len, cap - len, ", ...");
}

/* ------------------------------------------------------------------- rendezvous ---- */

typedef struct {
    int fd;
    size_t got;
    boot_hello_t hello;
} pending_conn_t;

static void reply_all(boot_tcp_t *s, const int *fds, int count, epx_result_t status, uint64_t seq)
{
    boot_reply_t reply;
    memset(&reply, 0, sizeof(reply));
    reply.magic = BOOT_REPLY_MAGIC;
    reply.status = (int32_t)status;
    reply.seq = seq;
    if (status != EPX_SUCCESS) epx_error_copy(reply.message, sizeof(reply.message));
    uint64_t deadline = epx_deadline_after_ms(BOOT_TELL_GRACE_MS);
    /* Telling is best effort: a peer that is gone already knows something failed. */
    for (int i = 0; i < count; i++) {
        const char *p = (const char *)&reply;
        size_t len = sizeof(reply);
        while (fds[i] >= 0 && len > 0) {
            ssize_t n = send(fds[i], p, len, MSG_NOSIGNAL);
            if (n > 0) {
                p += n;
                len -= (size_t)n;
            } else if (n < 0 && errno == EINTR) {
                continue;
            } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) &&
                       epx_socket_poll(fds[i], POLLOUT, deadline) > 0) {
                continue;
            } else {
                break;
            }
        }
    }
}

/* Rank 0: accepts nranks-1 peers, checks their hellos, and tells every one of them the verdict. */
static epx_result_t root_rendezvous(boot_tcp_t *s, int listen_fd, uint64_t deadline)
{
    int nranks = s->nranks;
    epx_result_t res = EPX_SUCCESS;
    int joined = 0, npending = 0, nextra = 0, cap = nranks + 16;
    uint64_t give_up = deadline;
    pending_conn_t *pending = calloc((size_t)cap, sizeof(*pending));
    int *extra = calloc((size_t)cap, sizeof(*extra)); /* rejected peers still to be told */
    struct pollfd *pfds = calloc((size_t)cap + 1, sizeof(*pfds));
    unsigned char *missing = calloc((size_t)nranks, 1);
    if (!pending || !extra || !pfds || !missing) {
        res = epx_error(EPX_ERR_OUT_OF_MEMORY, "rank 0: rendezvous tables for %d ranks", nranks);
        goto out;
    }
    for (;;) {
        /* Done when every slot is filled; after a failure, when as many peers as expected came. */
        if (npending == 0 && (joined == nranks - 1 || (res != EPX_SUCCESS && joined + nextra >= nranks - 1)))
            break;
        if (epx_time_ns() >= give_up) break;
        int n = 0;
        pfds[n++] = (struct pollfd){listen_fd, POLLIN, 0};
        for (int i = 0; i < npending; i++) pfds[n++] = (struct pollfd){pending[i].fd, POLLIN, 0};
        int ready = poll(pfds, (nfds_t)n, epx_socket_remaining_ms(give_up));
        if (ready < 0 && errno != EINTR) {
            res = epx_error(EPX_ERR_SYSTEM, "rank 0: poll in the rendezvous failed: %s", strerror(errno));
            break;
        }
        if (ready <= 0) continue;
        /* Hellos first (indices shift as entries complete), then new connections. */
        for (int i = npending - 1; i >= 0; i--) {
            if (!pfds[1 + i].revents) continue;
            pending_conn_t *pc = &pending[i];
            ssize_t got = recv(pc->fd, (char *)&pc->hello + pc->got, sizeof(pc->hello) - pc->got, 0);
            if (got < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
            int drop = got <= 0;
            if (got > 0) pc->got += (size_t)got;
            if (!drop && pc->got < sizeof(pc->hello)) continue;
            /* Copy out before the slot is refilled from the end of the list. */
            const boot_hello_t hello = pc->hello;
            const boot_hello_t *h = &hello;
            size_t hello_got = pc->got;
            int fd = pc->fd;
            pending[i] = pending[--npending];
            if (drop || h->magic != BOOT_HELLO_MAGIC || h->nonce != s->nonce) {
                /* Not one of ours (a stale job or a port scan): ignore it. */
                EPX_WARN(EPX_SUBSYS_BOOTSTRAP,
                         "rank 0: ignoring a rendezvous connection that is not part of "
                         "this job (%s after %zu bytes)",
                         drop ? (got == 0 ? "closed" : strerror(errno)) : "wrong magic or nonce", hello_got);
                close(fd);
                continue;
            }
            epx_socket_set_nodelay(fd);
            epx_result_t bad = EPX_SUCCESS;
            char why[160];
            if (h->nranks != nranks) {
                bad = EPX_ERR_MISMATCH;
                snprintf(why, sizeof(why), "rank %d was told nranks = %d, rank 0 was told nranks = %d",
                         h->rank, h->nranks, nranks);
            } else if (h->rank <= 0 || h->rank >= nranks) {
                bad = EPX_ERR_BOOTSTRAP;
                snprintf(why, sizeof(why), "a peer joined the rendezvous as rank %d, outside [1, %d)",
                         h->rank, nranks);
            } else if (s->fds[h->rank] >= 0) {
                bad = EPX_ERR_BOOTSTRAP;
                snprintf(why, sizeof(why), "two processes joined the rendezvous as rank %d", h->rank);
            }
            if (bad == EPX_SUCCESS) {
                s->fds[h->rank] = fd;
                joined++;
                continue;
            }
            extra[nextra++] = fd;
            /* The first problem is the one every rank reports. */
            if (res == EPX_SUCCESS) {
                res = epx_error(bad, "%s", why);
                uint64_t grace = epx_deadline_after_ms(BOOT_TELL_GRACE_MS);
                if (grace < give_up) give_up = grace;
            }
        }
        if (pfds[0].revents) {
            for (;;) {
                if (npending + nextra >= cap) break; /* more connections than ranks: leave them queued */
                int fd = accept4(listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                if (fd < 0) break;
                pending[npending++] = (pending_conn_t){fd, 0, {0}};
            }
        }
    }
    if (res == EPX_SUCCESS && joined < nranks - 1) {
        char list[160];
        for (int r = 1; r < nranks; r++) missing[r] = s->fds[r] < 0;
        format_rank_list(missing, nranks, list, sizeof(list));
        res = epx_error(EPX_ERR_TIMEOUT,
                        "rank 0: %d of %d ranks did not join the rendezvous within %lld ms "
                        "(missing: %s)",
                        nranks - 1 - joined, nranks, (long long)s->timeout_ms, list);
    }
    reply_all(s, s->fds, nranks, res, 0);
    reply_all(s, extra, nextra, res, 0);
out:
    for (int i = 0; i < npending; i++) close(pending[i].fd);
    for (int i = 0; i < nextra; i++) close(extra[i]);
    free(missing);
    free(pfds);
    free(extra);
    free(pending);
    return res;
}

/* Non-root: connects to rank 0 (retrying while it is not listening yet), says hello, and waits for
 * rank 0's verdict on the whole rendezvous. */
static epx_result_t peer_rendezvous(boot_tcp_t *s, const struct sockaddr_in *root, uint64_t deadline)
{
    char where[64];
    epx_socket_format_addr(root, where, sizeof(where));
    int last_err = 0;
    uint32_t sleep_ms = 5;
    for (;;) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0)
            return epx_error(EPX_ERR_SYSTEM, "rank %d: socket() for the rendezvous failed: %s", s->rank,
                             strerror(errno));
        int rc = connect(fd, (const struct sockaddr *)root, sizeof(*root));
        if (rc != 0 && errno == EINPROGRESS) {
            int ready = epx_socket_poll(fd, POLLOUT, deadline);
            int err = 0;
            socklen_t len = sizeof(err);
            if (ready > 0 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0)
                rc = 0;
            else
                errno = ready == 0 ? ETIMEDOUT : (err ? err : errno);
        }
        if (rc == 0) {
            s->fds[0] = fd;
            break;
        }
        last_err = errno;
        close(fd);
        if (last_err != ECONNREFUSED && last_err != ETIMEDOUT && last_err != ECONNRESET &&
            last_err != EHOSTUNREACH && last_err != ENETUNREACH && last_err != EAGAIN && last_err != EINTR)
            return epx_error(EPX_ERR_BOOTSTRAP, "rank %d: cannot connect to rank 0 at %s: %s", s->rank, where,
                             strerror(last_err));
        int left = epx_socket_remaining_ms(deadline);
        if (left == 0)
            return epx_error(EPX_ERR_TIMEOUT, "rank %d: could not reach rank 0 at %s within %lld ms (%s)",
                             s->rank, where, (long long)s->timeout_ms, strerror(last_err));
        struct timespec ts = {0, (long)(sleep_ms < (uint32_t)left ? sleep_ms : (uint32_t)left) * 1000000L};
        nanosleep(&ts, NULL);
        if (sleep_ms < 100) sleep_ms *= 2;
    }
    epx_socket_set_nodelay(s->fds[0]);
    boot_hello_t hello = {BOOT_HELLO_MAGIC, s->rank, s->nranks, 0, s->nonce};
    EPX_CHECK(send_all(s, 0, &hello, sizeof(hello), deadline, "the rendezvous hello"));
    boot_reply_t reply;
    uint64_t reply_deadline = deadline + (uint64_t)BOOT_REPLY_MARGIN_MS * 1000000ull;
    EPX_CHECK(recv_all(s, 0, &reply, sizeof(reply), reply_deadline, "the rendezvous verdict"));
    reply.message[sizeof(reply.message) - 1] = '\0';
    if (reply.magic != BOOT_REPLY_MAGIC)
        return epx_error(EPX_ERR_BOOTSTRAP, "rank %d: rank 0 at %s answered with a bad magic 0x%08x", s->rank,
                         where, reply.magic);
    if (reply.status != EPX_SUCCESS)
        return epx_error((epx_result_t)reply.status, "rank %d: %s (reported by rank 0)", s->rank,
                         reply.message);
    return EPX_SUCCESS;
}

/* ------------------------------------------------------------------- collectives ---- */

static epx_result_t tcp_broken(const boot_tcp_t *s)
{
    return epx_error(EPX_ERR_BOOTSTRAP,
                     "rank %d: the bootstrap failed in an earlier collective and is out of "
                     "step",
                     s->rank);
}

/* Rank 0: receives every peer's header and block, whichever is ready first, so that a missing peer
 * is named together with every other missing one. */
static epx_result_t root_gather(boot_tcp_t *s, void *recv_buf, size_t bytes, uint64_t deadline)
{
    int nranks = s->nranks;
    epx_result_t res = EPX_SUCCESS;
    size_t total = sizeof(boot_data_hdr_t) + bytes;
    size_t *got = calloc((size_t)nranks, sizeof(*got));
    boot_data_hdr_t *hdrs = calloc((size_t)nranks, sizeof(*hdrs));
    struct pollfd *pfds = calloc((size_t)nranks, sizeof(*pfds));
    int *who = calloc((size_t)nranks, sizeof(*who));
    unsigned char *missing = calloc((size_t)nranks, 1);
    if (!got || !hdrs || !pfds || !who || !missing) {
        res = epx_error(EPX_ERR_OUT_OF_MEMORY, "rank 0: allgather tables for %d ranks", nranks);
        goto out;
    }
    for (;;) {
        int n = 0;
        for (int r = 1; r < nranks; r++)
            if (got[r] < total) {
                pfds[n] = (struct pollfd){s->fds[r], POLLIN, 0};
                who[n++] = r;
            }
        if (n == 0) break;
        int ready = poll(pfds, (nfds_t)n, epx_socket_remaining_ms(deadline));
        if (ready < 0 && errno == EINTR) continue;
        if (ready < 0) {
            res = epx_error(EPX_ERR_SYSTEM, "rank 0: poll in allgather %llu failed: %s",
                            (unsigned long long)s->seq, strerror(errno));
            goto out;
        }
        if (ready == 0) {
            if (epx_time_ns() < deadline) continue;
            char list[160];
            for (int i = 0; i < n; i++) missing[who[i]] = 1;
            format_rank_list(missing, nranks, list, sizeof(list));
            res = epx_error(EPX_ERR_TIMEOUT,
                            "rank 0: %d of %d ranks did not join bootstrap allgather %llu "
                            "within %lld ms (missing: %s)",
                            n, nranks, (unsigned long long)s->seq, (long long)s->timeout_ms, list);
            goto out;
        }
        for (int i = 0; i < n; i++) {
            if (!pfds[i].revents) continue;
            int r = who[i];
            char *dst;
            size_t want;
            if (got[r] < sizeof(boot_data_hdr_t)) {
                dst = (char *)&hdrs[r] + got[r];
                want = sizeof(boot_data_hdr_t) - got[r];
            } else {
                size_t off = got[r] - sizeof(boot_data_hdr_t);
                dst = (char *)recv_buf + (size_t)r * bytes + off;
                want = bytes - off;
            }
            ssize_t k = recv(s->fds[r], dst, want, 0);
            if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
            if (k <= 0) {
                res = epx_error(EPX_ERR_BOOTSTRAP, "rank 0: rank %d left bootstrap allgather %llu (%s)", r,
                                (unsigned long long)s->seq, k == 0 ? "connection closed" : strerror(errno));
                goto out;
            }
            got[r] += (size_t)k;
            if (got[r] == sizeof(boot_data_hdr_t)) {
                const boot_data_hdr_t *h = &hdrs[r];
                if (h->magic != BOOT_DATA_MAGIC || h->seq != s->seq) {
                    res = epx_error(EPX_ERR_BOOTSTRAP,
                                    "rank 0: rank %d sent allgather %llu (magic 0x%08x) "
                                    "while rank 0 is in allgather %llu",
                                    r, (unsigned long long)h->seq, h->magic, (unsigned long long)s->seq);
                    goto out;
                }
                if (h->bytes != bytes) {
                    res = epx_error(EPX_ERR_MISMATCH,
                                    "bootstrap allgather %llu: rank %d passed %llu bytes, rank 0 "
                                    "passed %zu",
                                    (unsigned long long)s->seq, r, (unsigned long long)h->bytes, bytes);
                    goto out;
                }
            }
        }
    }
out:
    free(missing);
    free(who);
    free(pfds);
    free(hdrs);
    free(got);
    return res;
}

static epx_result_t tcp_allgather(void *state, const void *send_buf, void *recv_buf, size_t bytes)
{
    boot_tcp_t *s = state;
    if (s->broken) return tcp_broken(s);
    uint64_t deadline = epx_deadline_after_ms(s->timeout_ms);
    uint64_t seq = s->seq;
    epx_result_t res = EPX_SUCCESS;
    if (s->nranks == 1) {
        if (bytes) memmove(recv_buf, send_buf, bytes);
        s->seq++;
        return EPX_SUCCESS;
    }
    if (s->rank == 0) {
        res = root_gather(s, recv_buf, bytes, deadline);
        if (res == EPX_SUCCESS && bytes) memmove(recv_buf, send_buf, bytes);
        /* The verdict goes to everyone; the array only when the gather succeeded. */
        uint64_t send_deadline = deadline;
        uint64_t min_deadline = epx_deadline_after_ms(BOOT_TELL_GRACE_MS);
        if (send_deadline < min_deadline) send_deadline = min_deadline;
        if (res != EPX_SUCCESS) {
            reply_all(s, s->fds, s->nranks, res, seq);
        } else {
            boot_reply_t reply;
            memset(&reply, 0, sizeof(reply));
            reply.magic = BOOT_REPLY_MAGIC;
            reply.status = EPX_SUCCESS;
            reply.seq = seq;
            for (int r = 1; r < s->nranks && res == EPX_SUCCESS; r++) {
                res = send_all(s, r, &reply, sizeof(reply), send_deadline, "the allgather verdict");
                if (res == EPX_SUCCESS)
                    res = send_all(s, r, recv_buf, bytes * (size_t)s->nranks, send_deadline,
                                   "the allgather result");
                /* Ranks not yet served learn of the failure instead of waiting for their deadline. */
                if (res != EPX_SUCCESS) reply_all(s, s->fds + r + 1, s->nranks - r - 1, res, seq);
            }
        }
    } else {
        boot_data_hdr_t hdr = {BOOT_DATA_MAGIC, 0, seq, bytes};
        res = send_all(s, 0, &hdr, sizeof(hdr), deadline, "an allgather header");
        if (res == EPX_SUCCESS) res = send_all(s, 0, send_buf, bytes, deadline, "an allgather block");
        boot_reply_t reply;
        uint64_t reply_deadline = deadline + (uint64_t)BOOT_REPLY_MARGIN_MS * 1000000ull;
        if (res == EPX_SUCCESS)
            res = recv_all(s, 0, &reply, sizeof(reply), reply_deadline, "the allgather verdict");
        if (res == EPX_SUCCESS) {
            reply.message[sizeof(reply.message) - 1] = '\0';
            if (reply.magic != BOOT_REPLY_MAGIC || reply.seq != seq)
                res = epx_error(EPX_ERR_BOOTSTRAP,
                                "rank %d: rank 0 answered allgather %llu with magic 0x%08x, "
                                "sequence %llu",
                                s->rank, (unsigned long long)seq, reply.magic, (unsigned long long)reply.seq);
            else if (reply.status != EPX_SUCCESS)
                res = epx_error((epx_result_t)reply.status, "rank %d: %s (reported by rank 0)", s->rank,
                                reply.message);
        }
        if (res == EPX_SUCCESS)
            res = recv_all(s, 0, recv_buf, bytes * (size_t)s->nranks, reply_deadline, "the allgather result");
    }
    if (res != EPX_SUCCESS) {
        s->broken = 1;
        return res;
    }
    s->seq++;
    return EPX_SUCCESS;
}

static epx_result_t tcp_barrier(void *state)
{
    boot_tcp_t *s = state;
    unsigned char *all = malloc((size_t)s->nranks);
    if (!all)
        return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: barrier array of %d bytes", s->rank, s->nranks);
    unsigned char one = 1;
    epx_result_t res = tcp_allgather(s, &one, all, 1);
    free(all);
    return res;
}

static void tcp_close(void *state)
{
    boot_tcp_t *s = state;
    if (!s) return;
    /* Plain close without SO_LINGER returns at once whatever the peer does. */
    for (int r = 0; r < s->nranks; r++)
        if (s->fds[r] >= 0) close(s->fds[r]);
    free(s->fds);
    free(s);
}

static const epx_bootstrap_ops_t tcp_ops = {tcp_allgather, tcp_barrier, tcp_close};

epx_result_t epx_bootstrap_tcp_create(const epx_unique_id_t *id, int rank, int nranks, int64_t timeout_ms,
                                      const epx_bootstrap_ops_t **ops_out, void **state_out)
{
    if (!id || !ops_out || !state_out)
        return epx_error(EPX_ERR_INVALID_ARG, "tcp bootstrap: id, ops_out and state_out must be non-NULL");
    if (nranks < 1 || rank < 0 || rank >= nranks)
        return epx_error(EPX_ERR_INVALID_ARG, "tcp bootstrap: rank %d is out of range [0, %d)", rank, nranks);
    if (timeout_ms < 1)
        return epx_error(EPX_ERR_INVALID_ARG, "tcp bootstrap: timeout %lld ms", (long long)timeout_ms);
    boot_id_t bid;
    memcpy(&bid, id->internal, sizeof(bid));
    if (bid.magic != BOOT_ID_MAGIC)
        return epx_error(EPX_ERR_INVALID_ARG,
                         "rank %d: the unique id has magic 0x%08x, not one made by "
                         "epx_get_unique_id",
                         rank, bid.magic);
    uint64_t deadline = epx_deadline_after_ms(timeout_ms);
    epx_result_t res = EPX_SUCCESS;
    boot_tcp_t *s = calloc(1, sizeof(*s));
    int *fds = calloc((size_t)nranks, sizeof(int));
    if (!s || !fds) {
        free(fds);
        free(s);
        return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: bootstrap state for %d ranks", rank, nranks);
    }
    for (int r = 0; r < nranks; r++) fds[r] = -1;
    s->rank = rank;
    s->nranks = nranks;
    s->timeout_ms = timeout_ms;
    s->nonce = bid.nonce;
    s->fds = fds;
    struct sockaddr_in root;
    memset(&root, 0, sizeof(root));
    root.sin_family = AF_INET;
    root.sin_addr.s_addr = bid.addr;
    root.sin_port = bid.port;
    if (rank == 0) {
        int listen_fd = epx_socket_take_listener(bid.nonce);
        if (listen_fd < 0)
            EPX_CHECK_GOTO(epx_socket_listen(&root, nranks < SOMAXCONN ? SOMAXCONN : nranks, &listen_fd), res,
                           err_free);
        if (nranks > 1) res = root_rendezvous(s, listen_fd, deadline);
        close(listen_fd);
        if (res != EPX_SUCCESS) goto err_close;
    } else {
        EPX_CHECK_GOTO(peer_rendezvous(s, &root, deadline), res, err_close);
    }
    EPX_INFO(EPX_SUBSYS_BOOTSTRAP, "rank %d: tcp rendezvous of %d ranks done", rank, nranks);
    *ops_out = &tcp_ops;
    *state_out = s;
    return EPX_SUCCESS;
err_close:
    for (int r = 0; r < nranks; r++)
        if (fds[r] >= 0) close(fds[r]);
err_free:
    free(fds);
    free(s);
    return res;
}
