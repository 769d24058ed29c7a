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

#define BOOT_DATA_MAGIC  0x45505844u /* "EPXD" */
/* After a failure, rank 0 keeps accepting this long (within its deadline) so late ranks learn why. */
#define BOOT_TELL_GRACE_MS 1000
/* Rank 0 gives its verdict this much (at most a tenth of the timeout) before the common deadline, so
 * that peers which started a little earlier still hear why instead of timing out themselves. */
#define BOOT_VERDICT_LEAD_MS 100

_Static_assert(sizeof(epx_boot_id_t) <= EPX_UNIQUE_ID_BYTES, "unique id too small");

/* A non-root rank's block header in an allgather. */
typedef struct {
    uint32_t magic;
    uint32_t pad;
    uint64_t seq;
    uint64_t bytes;
} boot_data_hdr_t;


/* What a rendezvous verdict's tag covers. */
typedef struct {
    int32_t status;
    int32_t rank;
    unsigned char nonce[EPX_BOOT_NONCE_BYTES];
    char message[sizeof(((boot_reply_t *)0)->message)];
} boot_verdict_signed_t;

typedef struct {
    int rank, nranks;
    int64_t timeout_ms;
    unsigned char secret[EPX_BOOT_SECRET_BYTES];
    int *fds;     /* rank 0: [nranks] connection to each peer (fds[0] = -1); others: fds[0] to rank 0 */
    unsigned char (*nonces)[EPX_BOOT_NONCE_BYTES]; /* rank 0: [nranks] each joined peer's hello nonce */
    uint64_t seq; /* allgathers done */
    int broken;   /* a failed exchange left the streams out of step */
    char broken_why[256]; /* the message of that failure, repeated by every later collective */
} boot_tcp_t;

/* The secret must be unguessable: no fallback to clocks or pids. */
static epx_result_t random_bytes(void *buf, size_t len)
{
    if (getrandom(buf, len, GRND_NONBLOCK) == (ssize_t)len) return EPX_SUCCESS;
    FILE *f = fopen("/dev/urandom", "rb");
    size_t got = f ? fread(buf, 1, len, f) : 0;
    if (f) fclose(f);
    if (got == len) return EPX_SUCCESS;
    return epx_error(EPX_ERR_SYSTEM,
                     "no random bytes for the unique id's secret (getrandom and /dev/urandom)");
}

/* The key of an id's kept listening socket: part of its secret. */
static uint64_t listener_key(const unsigned char *secret)
{
    uint64_t key;
    memcpy(&key, secret, sizeof(key));
    return key;
}

/* Constant time, so that the time to refuse tells nothing about the expected tag. */
static int tag_equal(const unsigned char *a, const unsigned char *b)
{
    unsigned diff = 0;
    for (int i = 0; i < EPX_BOOT_TAG_BYTES; i++) diff |= (unsigned)(a[i] ^ b[i]);
    return diff == 0;
}

void epx_boot_tag(const unsigned char secret[EPX_BOOT_SECRET_BYTES], char kind, const void *data, size_t len,
                  unsigned char tag_out[EPX_BOOT_TAG_BYTES])
{
    unsigned char buf[2 + 256];
    if (len > sizeof(buf) - 2) len = sizeof(buf) - 2; /* every signed struct is far smaller */
    buf[0] = (unsigned char)kind;
    memcpy(buf + 2, data, len);
    for (int half = 0; half < 2; half++) {
        buf[1] = (unsigned char)half;
        const uint64_t h = epx_siphash24(secret, buf, len + 2);
        memcpy(tag_out + 8 * half, &h, 8);
    }
}

void epx_boot_hello_sign(epx_boot_hello_t *h, const unsigned char secret[EPX_BOOT_SECRET_BYTES])
{
    epx_boot_tag(secret, 'H', h, offsetof(epx_boot_hello_t, tag), h->tag);
}

static int hello_authentic(const epx_boot_hello_t *h, const unsigned char *secret)
{
    unsigned char want[EPX_BOOT_TAG_BYTES];
    epx_boot_tag(secret, 'H', h, offsetof(epx_boot_hello_t, tag), want);
    return tag_equal(want, h->tag);
}

static void verdict_tag(const unsigned char *secret, const boot_reply_t *reply, int rank,
                        const unsigned char *nonce, unsigned char *tag_out)
{
    boot_verdict_signed_t v;
    memset(&v, 0, sizeof(v));
    v.status = reply->status;
    v.rank = rank;
    memcpy(v.nonce, nonce, sizeof(v.nonce));
    memcpy(v.message, reply->message, sizeof(v.message));
    epx_boot_tag(secret, 'V', &v, sizeof(v), tag_out);
}

/* The deadline by which rank 0 answers, a little before the one its peers wait for. */
static uint64_t verdict_deadline(uint64_t deadline, int64_t timeout_ms)
{
    int64_t lead = timeout_ms / 10 < BOOT_VERDICT_LEAD_MS ? timeout_ms / 10 : BOOT_VERDICT_LEAD_MS;
    return deadline - (uint64_t)lead * 1000000ull;
}

epx_result_t epx_bootstrap_unique_id(epx_unique_id_t *id_out)
{
    const epx_params_t *params;
    EPX_CHECK(epx_params_get(&params));
    epx_boot_id_t id;
    memset(&id, 0, sizeof(id));
    EPX_CHECK(random_bytes(id.secret, sizeof(id.secret)));
    struct sockaddr_in sa;
    EPX_CHECK(epx_socket_choose_address(params, &sa));
    int fd;
    EPX_CHECK(epx_socket_listen(&sa, SOMAXCONN, &fd));
    id.magic = EPX_BOOT_ID_MAGIC;
    id.addr = sa.sin_addr.s_addr;
    id.port = sa.sin_port;
    epx_result_t res = epx_socket_keep_listener(listener_key(id.secret), fd);
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
    uint64_t hello_deadline;
    epx_boot_hello_t hello;
} pending_conn_t;

/* Rank 0's verdict `status` (with this thread's error message when it failed) of exchange `seq`. */
static boot_reply_t verdict_of(epx_result_t status, uint64_t seq)
{
    boot_reply_t reply;
    memset(&reply, 0, sizeof(reply));
    reply.magic = BOOT_REPLY_MAGIC;
    reply.status = (int32_t)status;
    reply.seq = seq;
    if (status != EPX_SUCCESS) epx_error_copy(reply.message, sizeof(reply.message));
    return reply;
}

/* Sends `reply` to `fd` (none when fd < 0). `secret` given (a rendezvous verdict), the reply is first
 * signed over the peer's rank and hello nonce, its status and message. Telling is best effort: a peer
 * that is gone already knows something failed. */
static void send_verdict(int fd, boot_reply_t *reply, const unsigned char *secret, int rank,
                         const unsigned char *nonce, uint64_t deadline)
{
    if (fd < 0) return;
    if (secret) verdict_tag(secret, reply, rank, nonce, reply->tag);
    const char *p = (const char *)reply;
    size_t len = sizeof(*reply);
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) &&
                   epx_socket_poll(fd, POLLOUT, deadline) > 0) {
            continue;
        } else {
            return;
        }
    }
}

/* Rank 0: why an authenticated hello cannot join (a message naming the rank), or EPX_SUCCESS. */
static epx_result_t check_hello(const boot_tcp_t *s, const epx_boot_hello_t *h, char *why, size_t cap)
{
    if (h->nranks != s->nranks) {
        snprintf(why, cap, "rank %d was told nranks = %d, rank 0 was told nranks = %d", h->rank, h->nranks,
                 s->nranks);
        return EPX_ERR_MISMATCH;
    }
    if (h->rank <= 0 || h->rank >= s->nranks) {
        snprintf(why, cap, "a peer joined the rendezvous as rank %d, outside [1, %d)", h->rank, s->nranks);
        return EPX_ERR_BOOTSTRAP;
    }
    if (s->fds[h->rank] >= 0) {
        snprintf(why, cap, "two processes joined the rendezvous as rank %d", h->rank);
        return EPX_ERR_BOOTSTRAP;
    }
    return EPX_SUCCESS;
}

/* Rank 0: reads what `pc` has sent. 1: a whole hello that authenticates, 0: not yet, -1: dropped
 * (closed, broken, wrong secret, or more than a hello); nothing is ever sent to a dropped one. */
static int read_hello(const boot_tcp_t *s, pending_conn_t *pc)
{
    ssize_t got = recv(pc->fd, (char *)&pc->hello + pc->got, sizeof(pc->hello) - pc->got, 0);
    if (got < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    const char *why = got == 0 ? "closed" : "failed";
    if (got > 0) {
        pc->got += (size_t)got;
        if (pc->got < sizeof(pc->hello)) return 0;
        char more;
        why = NULL;
        if (pc->hello.magic != EPX_BOOT_HELLO_MAGIC || !hello_authentic(&pc->hello, s->secret))
            why = "did not authenticate";
        else if (recv(pc->fd, &more, 1, MSG_PEEK | MSG_DONTWAIT) > 0)
            why = "sent more than a hello";
        if (!why) return 1;
    }
    EPX_WARN(EPX_SUBSYS_BOOTSTRAP, "rank 0: dropping a rendezvous connection that %s after %zu bytes", why,
             pc->got);
    return -1;
}

/* Rank 0: accepts nranks-1 peers, checks their hellos, and tells every one of them the verdict. A
 * connection gets EPX_BOOT_HELLO_MS to authenticate and at most EPX_BOOT_PENDING_MAX wait at once
 * (the oldest makes room), so idle or hostile connections never hold the real ranks back. */
static epx_result_t root_rendezvous(boot_tcp_t *s, int listen_fd, uint64_t deadline)
{
    const int nranks = s->nranks, cap = EPX_BOOT_PENDING_MAX;
    const int64_t hello_ms = s->timeout_ms < EPX_BOOT_HELLO_MS ? s->timeout_ms : EPX_BOOT_HELLO_MS;
    epx_result_t res = EPX_SUCCESS;
    int joined = 0, npending = 0, nextra = 0, nrefused = 0; /* refused ranks of this job, in range */
    uint64_t give_up = verdict_deadline(deadline, s->timeout_ms);
    pending_conn_t *pending = calloc((size_t)cap, sizeof(*pending));
    pending_conn_t *extra = calloc((size_t)cap, sizeof(*extra)); /* refused peers still to be told */
    struct pollfd *pfds = calloc((size_t)cap + 1, sizeof(*pfds));
    unsigned char *missing = calloc((size_t)nranks, 1);
    if (!pending || !extra || !pfds || !missing) {
        res = epx_error(EPX_ERR_OUT_OF_MEMORY, "rank 0: rendezvous tables for %d ranks", nranks);
        goto out;
    }
    /* Done when every slot is filled; after a failure, when as many peers as expected came. */
    while (joined < nranks - 1 && (res == EPX_SUCCESS || joined + nrefused < nranks - 1)) {
        uint64_t now = epx_time_ns(), wake = give_up;
        if (now >= give_up) break;
        for (int i = npending - 1; i >= 0; i--) {
            if (now < pending[i].hello_deadline) {
                if (pending[i].hello_deadline < wake) wake = pending[i].hello_deadline;
                continue;
            }
            EPX_WARN(EPX_SUBSYS_BOOTSTRAP, "rank 0: dropping a rendezvous connection silent for %lld ms",
                     (long long)hello_ms);
            close(pending[i].fd);
            pending[i] = pending[--npending];
        }
        int n = 0;
        pfds[n++] = (struct pollfd){listen_fd, POLLIN, 0};
        for (int i = 0; i < npending; i++) pfds[n++] = (struct pollfd){pending[i].fd, POLLIN, 0};
        int ready = poll(pfds, (nfds_t)n, epx_socket_remaining_ms(wake));
        if (ready < 0 && errno != EINTR) {
            res = epx_error(EPX_ERR_SYSTEM, "rank 0: poll in the rendezvous failed: %s", strerror(errno));
            break;
        }
        if (ready <= 0) continue;
        /* Hellos first (backwards: a finished entry is refilled from the end), then new connections. */
        for (int i = npending - 1; i >= 0; i--) {
            if (!pfds[1 + i].revents) continue;
            int state = read_hello(s, &pending[i]);
            if (state == 0) continue;
            const epx_boot_hello_t hello = pending[i].hello;
            int fd = pending[i].fd;
            pending[i] = pending[--npending];
            if (state < 0) {
                close(fd);
                continue;
            }
            epx_socket_set_nodelay(fd);
            char why[160];
            epx_result_t bad = check_hello(s, &hello, why, sizeof(why));
            if (bad == EPX_SUCCESS) {
                s->fds[hello.rank] = fd;
                memcpy(s->nonces[hello.rank], hello.nonce, EPX_BOOT_NONCE_BYTES);
                joined++;
                continue;
            }
            nrefused += hello.rank > 0 && hello.rank < nranks;
            if (nextra < cap)
                extra[nextra++] = (pending_conn_t){fd, sizeof(hello), 0, hello};
            else
                close(fd);
            /* The first problem is the one every rank reports. */
            if (res == EPX_SUCCESS) {
                res = epx_error(bad, "%s", why);
                uint64_t grace = epx_deadline_after_ms(BOOT_TELL_GRACE_MS);
                if (grace < give_up) give_up = grace;
            }
        }
        for (int k = 0; pfds[0].revents && k < cap; k++) {
            int fd = accept4(listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd < 0) break;
            int slot = npending;
            if (npending == cap) {
                slot = 0;
                for (int i = 1; i < npending; i++)
                    if (pending[i].hello_deadline < pending[slot].hello_deadline) slot = i;
                EPX_WARN(EPX_SUBSYS_BOOTSTRAP,
                         "rank 0: %d rendezvous connections without a hello: dropping the oldest", cap);
                close(pending[slot].fd);
            } else {
                npending++;
            }
            pending[slot] = (pending_conn_t){fd, 0, epx_deadline_after_ms(hello_ms), {0}};
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
    /* Every verdict signed, a failure too: the peer that checks it knows rank 0 sent it. A refused peer
     * gets it over the rank and nonce of its hello, which authenticated. */
    boot_reply_t reply = verdict_of(res, 0);
    for (int r = 1; r < nranks; r++) send_verdict(s->fds[r], &reply, s->secret, r, s->nonces[r], deadline);
    for (int i = 0; i < nextra; i++)
        send_verdict(extra[i].fd, &reply, s->secret, extra[i].hello.rank, extra[i].hello.nonce, deadline);
out:
    for (int i = 0; i < npending; i++) close(pending[i].fd);
    for (int i = 0; i < nextra; i++) close(extra[i].fd);
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
    epx_boot_hello_t hello;
    memset(&hello, 0, sizeof(hello));
    hello.magic = EPX_BOOT_HELLO_MAGIC;
    hello.rank = s->rank;
    hello.nranks = s->nranks;
    EPX_CHECK(random_bytes(hello.nonce, sizeof(hello.nonce)));
    epx_boot_hello_sign(&hello, s->secret);
    EPX_CHECK(send_all(s, 0, &hello, sizeof(hello), deadline, "the rendezvous hello"));
    boot_reply_t reply;
    EPX_CHECK(recv_all(s, 0, &reply, sizeof(reply), deadline, "the rendezvous verdict"));
    reply.message[sizeof(reply.message) - 1] = '\0';
    if (reply.magic != BOOT_REPLY_MAGIC)
        return epx_error(EPX_ERR_BOOTSTRAP, "rank %d: rank 0 at %s answered with a bad magic 0x%08x", s->rank,
                         where, reply.magic);
    /* A verdict only from the real rank 0, success or failure: the one that holds the secret signed our
     * nonce with it. Another process on its port can neither pass us nor choose what we report. */
    unsigned char want[EPX_BOOT_TAG_BYTES];
    verdict_tag(s->secret, &reply, s->rank, hello.nonce, want);
    if (!tag_equal(want, reply.tag))
        return epx_error(EPX_ERR_BOOTSTRAP,
                         "rank %d: the process at %s answered the rendezvous without proof that it holds the "
                         "unique id's secret (not this job's rank 0: another process took its port?)",
                         s->rank, where);
    if (reply.status == EPX_SUCCESS) return EPX_SUCCESS;
    return epx_error(epx_result_is_failure(reply.status) ? (epx_result_t)reply.status : EPX_ERR_BOOTSTRAP,
                     "rank %d: %s (reported by rank 0)", s->rank, reply.message);
}

/* ------------------------------------------------------------------- collectives ---- */

static epx_result_t tcp_broken(const boot_tcp_t *s)
{
    return epx_error(EPX_ERR_BOOTSTRAP, "rank %d: the bootstrap failed in an earlier collective and is out of step (%s)",
                     s->rank, s->broken_why);
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
        res = root_gather(s, recv_buf, bytes, verdict_deadline(deadline, s->timeout_ms));
        if (res == EPX_SUCCESS && bytes) memmove(recv_buf, send_buf, bytes);
        /* The verdict goes to everyone; the array only when the gather succeeded. */
        if (res != EPX_SUCCESS) {
            boot_reply_t reply = verdict_of(res, seq);
            for (int r = 1; r < s->nranks; r++) send_verdict(s->fds[r], &reply, NULL, r, NULL, deadline);
        } else {
            boot_reply_t reply = verdict_of(EPX_SUCCESS, seq);
            for (int r = 1; r < s->nranks && res == EPX_SUCCESS; r++) {
                res = send_all(s, r, &reply, sizeof(reply), deadline, "the allgather verdict");
                if (res == EPX_SUCCESS)
                    res =
                        send_all(s, r, recv_buf, bytes * (size_t)s->nranks, deadline, "the allgather result");
                /* Ranks not yet served learn of the failure instead of waiting for their deadline. */
                if (res != EPX_SUCCESS) {
                    boot_reply_t failed = verdict_of(res, seq);
                    for (int q = r + 1; q < s->nranks; q++)
                        send_verdict(s->fds[q], &failed, NULL, q, NULL, deadline);
                }
            }
        }
    } else {
        boot_data_hdr_t hdr = {BOOT_DATA_MAGIC, 0, seq, bytes};
        res = send_all(s, 0, &hdr, sizeof(hdr), deadline, "an allgather header");
        if (res == EPX_SUCCESS) res = send_all(s, 0, send_buf, bytes, deadline, "an allgather block");
        boot_reply_t reply;
        if (res == EPX_SUCCESS)
            res = recv_all(s, 0, &reply, sizeof(reply), deadline, "the allgather verdict");
        if (res == EPX_SUCCESS) {
            reply.message[sizeof(reply.message) - 1] = '\0';
            if (reply.magic != BOOT_REPLY_MAGIC || reply.seq != seq)
                res = epx_error(EPX_ERR_BOOTSTRAP,
                                "rank %d: rank 0 answered allgather %llu with magic 0x%08x, "
                                "sequence %llu",
                                s->rank, (unsigned long long)seq, reply.magic, (unsigned long long)reply.seq);
            else if (reply.status != EPX_SUCCESS)
                res = epx_error(epx_result_is_failure(reply.status) ? (epx_result_t)reply.status
                                                                    : EPX_ERR_BOOTSTRAP,
                                "rank %d: %s (reported by rank 0)", s->rank, reply.message);
        }
        if (res == EPX_SUCCESS)
            res = recv_all(s, 0, recv_buf, bytes * (size_t)s->nranks, deadline, "the allgather result");
    }
    if (res != EPX_SUCCESS) {
        s->broken = 1;
        epx_error_copy(s->broken_why, sizeof(s->broken_why));
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
    epx_boot_id_t bid;
    memcpy(&bid, id->internal, sizeof(bid));
    if (bid.magic != EPX_BOOT_ID_MAGIC)
        return epx_error(EPX_ERR_INVALID_ARG,
                         "rank %d: the unique id has magic 0x%08x, not one made by "
                         "epx_get_unique_id",
                         rank, bid.magic);
    uint64_t deadline = epx_deadline_after_ms(timeout_ms);
    epx_result_t res = EPX_SUCCESS;
    boot_tcp_t *s = calloc(1, sizeof(*s));
    int *fds = calloc((size_t)nranks, sizeof(int));
    unsigned char(*nonces)[EPX_BOOT_NONCE_BYTES] = calloc((size_t)nranks, EPX_BOOT_NONCE_BYTES);
    if (!s || !fds || !nonces) {
        free(nonces);
        free(fds);
        free(s);
        return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: bootstrap state for %d ranks", rank, nranks);
    }
    for (int r = 0; r < nranks; r++) fds[r] = -1;
    s->rank = rank;
    s->nranks = nranks;
    s->timeout_ms = timeout_ms;
    memcpy(s->secret, bid.secret, sizeof(s->secret));
    s->fds = fds;
    s->nonces = nonces; /* the rendezvous's only */
    struct sockaddr_in root;
    memset(&root, 0, sizeof(root));
    root.sin_family = AF_INET;
    root.sin_addr.s_addr = bid.addr;
    root.sin_port = bid.port;
    /* A copy of rank 0's socket inherited from the process that made the id: only rank 0 keeps it. */
    int listen_fd = epx_socket_take_listener(listener_key(bid.secret));
    if (rank == 0) {
        if (listen_fd < 0)
            EPX_CHECK_GOTO(epx_socket_listen(&root, nranks < SOMAXCONN ? SOMAXCONN : nranks, &listen_fd), res,
                           err_free);
        if (nranks > 1) res = root_rendezvous(s, listen_fd, deadline);
        free(nonces);
        s->nonces = nonces = NULL;
        /* Nobody may connect after the rendezvous, whoever else still holds the socket. */
        epx_socket_stop_listener(listen_fd);
        if (res != EPX_SUCCESS) goto err_close;
    } else {
        if (listen_fd >= 0) close(listen_fd);
        free(nonces);
        s->nonces = nonces = NULL;
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
    free(nonces);
    free(fds);
    free(s);
    return res;
}
