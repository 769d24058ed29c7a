/*
 * The test GIN plugin's host plumbing between ranks of one machine (link.h): abstract unix datagram
 * sockets named from (pid, serial) for collective exchanges that may carry a file descriptor, and the
 * inbound signal mailboxes in POSIX shared memory. No CUDA.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "link.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static uint64_t next_serial = 1; /* atomic: several communicators may listen from several threads */

uint64_t link_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000ull + (uint64_t)ts.tv_nsec / 1000000ull;
}

static socklen_t sock_name(struct sockaddr_un *addr, pid_t pid, uint64_t serial)
{
    memset(addr, 0, sizeof(*addr));
    addr->sun_family = AF_UNIX;
    /* Abstract namespace: sun_path[0] == 0, nothing to unlink, gone with the process. */
    int n = snprintf(addr->sun_path + 1, sizeof(addr->sun_path) - 1, "epx-gin-test-%d-%llu", (int)pid,
                     (unsigned long long)serial);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static void mbox_name(char *out, size_t len, pid_t pid, uint64_t serial)
{
    snprintf(out, len, "/epx-gin-test-%d-%llu", (int)pid, (unsigned long long)serial);
}

int link_listen(link_handle_t *handle, int *sock_out, char *err, size_t err_len)
{
    uint64_t serial = __atomic_fetch_add(&next_serial, 1, __ATOMIC_RELAXED);
    int sock = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    struct sockaddr_un addr;
    socklen_t alen = sock_name(&addr, getpid(), serial);
    if (sock < 0 || bind(sock, (struct sockaddr *)&addr, alen)) {
        snprintf(err, err_len, "listen: cannot bind the exchange socket epx-gin-test-%d-%llu: %s",
                 (int)getpid(), (unsigned long long)serial, strerror(errno));
        if (sock >= 0) close(sock);
        return -1;
    }
    memset(handle, 0, sizeof(*handle));
    handle->magic = LINK_MAGIC;
    handle->pid = (int32_t)getpid();
    handle->uid = (uint32_t)getuid();
    handle->serial = serial;
    *sock_out = sock;
    return 0;
}

link_ring_t *link_ring(link_mailbox_t *m, int sender)
{
    return (link_ring_t *)(m + 1) + sender;
}

link_slot_t *link_slot(link_mailbox_t *m, int sender, uint64_t ticket)
{
    link_slot_t *slots = (link_slot_t *)((link_ring_t *)(m + 1) + m->nranks);
    return slots + (size_t)sender * m->slots + (ticket & (m->slots - 1));
}

static size_t mbox_bytes(int nranks, uint64_t slots)
{
    return sizeof(link_mailbox_t) + (size_t)nranks * sizeof(link_ring_t) +
           (size_t)nranks * (size_t)slots * sizeof(link_slot_t);
}

int link_peer_alive(const link_t *l, int peer)
{
    pid_t pid = l->peers[peer].pid;
    if (kill(pid, 0) != 0 && errno == ESRCH) return 0;
    /* kill() still reaches a zombie: an exited peer whose parent has not reaped it yet is gone too. */
    char path[64], text[512];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno != ENOENT && errno != ESRCH;
    ssize_t n = read(fd, text, sizeof(text) - 1);
    close(fd);
    if (n <= 0) return 0;
    text[n] = '\0';
    /* The command name may hold spaces and parentheses: the state follows the last ')'. */
    const char *paren = strrchr(text, ')');
    return !(paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X'));
}

int link_add_post(link_t *l, int peer, uint64_t region, uint64_t offset, uint64_t value, uint64_t *ticket,
                  char *err, size_t err_len)
{
    link_mailbox_t *box = l->peers[peer].mbox;
    link_ring_t *ring = link_ring(box, l->rank);
    uint64_t t = l->peers[peer].next_ticket;
    if (t - __atomic_load_n(&ring->applied, __ATOMIC_ACQUIRE) >= box->slots) {
        snprintf(err, err_len, "mailbox of peer %d full (%llu adds not applied)", peer,
                 (unsigned long long)box->slots);
        return -1;
    }
    link_slot_t *slot = link_slot(box, l->rank, t);
    slot->region = region;
    slot->offset = offset;
    slot->value = value;
    __atomic_store_n(&slot->seq, t + 1, __ATOMIC_RELEASE);
    l->peers[peer].next_ticket = t + 1;
    *ticket = t;
    return 0;
}

int link_add_poll(link_t *l, int peer, uint64_t ticket, char *err, size_t err_len)
{
    link_ring_t *ring = link_ring(l->peers[peer].mbox, l->rank);
    /* The first refused ticket and every later one fail: the owner publishes those as applied unapplied. */
    uint64_t refused = __atomic_load_n(&ring->refused, __ATOMIC_ACQUIRE);
    if (refused && ticket + 1 >= refused) {
        snprintf(err, err_len, "peer %d refused the signal add: %.150s", peer, ring->reason);
        return -1;
    }
    if (__atomic_load_n(&ring->applied, __ATOMIC_ACQUIRE) > ticket) return 1;
    if (!link_peer_alive(l, peer)) {
        /* It may have applied the add, then exited, after the check above: the ring outlives it. */
        if (__atomic_load_n(&ring->applied, __ATOMIC_ACQUIRE) > ticket) return 1;
        snprintf(err, err_len, "peer %d (pid %d) is gone", peer, (int)l->peers[peer].pid);
        return -1;
    }
    return 0;
}

int link_add_take(link_t *l, int sender, link_slot_t *slot, uint64_t *ticket)
{
    uint64_t t = l->peers[sender].expected;
    const link_slot_t *s = link_slot(l->inbox, sender, t);
    if (__atomic_load_n(&s->seq, __ATOMIC_ACQUIRE) != t + 1) return 0;
    *slot = *s;
    *ticket = t;
    l->peers[sender].expected = t + 1;
    return __atomic_load_n(&link_ring(l->inbox, sender)->refused, __ATOMIC_RELAXED) ? 2 : 1;
}

void link_add_refuse(link_t *l, int sender, uint64_t ticket, const char *why)
{
    link_ring_t *ring = link_ring(l->inbox, sender);
    if (__atomic_load_n(&ring->refused, __ATOMIC_RELAXED)) return;
    snprintf(ring->reason, sizeof(ring->reason), "%s", why);
    __atomic_store_n(&ring->refused, ticket + 1, __ATOMIC_RELEASE);
}

void link_add_applied(link_t *l, int sender, uint64_t ticket)
{
    __atomic_store_n(&link_ring(l->inbox, sender)->applied, ticket + 1, __ATOMIC_RELEASE);
}

int link_inbox_idle(link_t *l)
{
    for (int s = 0; s < l->nranks; s++) {
        uint64_t t = l->peers[s].expected;
        if (__atomic_load_n(&link_slot(l->inbox, s, t)->seq, __ATOMIC_ACQUIRE) == t + 1) return 0;
    }
    return 1;
}

void link_mark_sender_done(link_t *l)
{
    for (int p = 0; p < l->nranks; p++)
        __atomic_store_n(&link_ring(l->peers[p].mbox, l->rank)->sender_done, 1, __ATOMIC_RELEASE);
}

int link_peers_done(const link_t *l)
{
    for (int s = 0; s < l->nranks; s++)
        if (!__atomic_load_n(&link_ring(l->inbox, s)->sender_done, __ATOMIC_ACQUIRE) && link_peer_alive(l, s))
            return 0;
    return 1;
}

static int map_mailbox(const char *name, int create, size_t len, link_mailbox_t **out, size_t *len_out,
                       char *err, size_t err_len)
{
    int fd = shm_open(name, create ? O_RDWR | O_CREAT | O_EXCL : O_RDWR, 0600);
    if (fd < 0 || (create && ftruncate(fd, (off_t)len))) {
        snprintf(err, err_len, "%s mailbox %s: %s", create ? "cannot create" : "cannot open", name,
                 strerror(errno));
        if (fd >= 0) close(fd);
        if (fd >= 0 && create) shm_unlink(name);
        return -1;
    }
    if (!create) {
        struct stat st;
        if (fstat(fd, &st) || (size_t)st.st_size < sizeof(link_mailbox_t)) {
            snprintf(err, err_len, "mailbox %s is truncated", name);
            close(fd);
            return -1;
        }
        len = (size_t)st.st_size;
    }
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        snprintf(err, err_len, "cannot map mailbox %s: %s", name, strerror(errno));
        return -1;
    }
    *out = p;
    *len_out = len;
    return 0;
}

int link_connect(link_t *l, int sock, uint64_t serial, void *const handles[], int nranks, int rank,
                 uint64_t slots, uint64_t deadline_ms, char *err, size_t err_len)
{
    memset(l, 0, sizeof(*l));
    l->sock = sock;
    l->serial = serial;
    l->rank = rank;
    l->nranks = nranks;
    l->deadline_ms = deadline_ms;
    l->peers = calloc((size_t)nranks, sizeof(*l->peers));
    if (!l->peers) {
        snprintf(err, err_len, "connect: out of memory");
        return -1;
    }
    for (int r = 0; r < nranks; r++) {
        const link_handle_t *h = handles[r];
        if (!h || h->magic != LINK_MAGIC || h->uid != (uint32_t)getuid()) {
            snprintf(err, err_len,
                     "connect: rank %d's handle is not this plugin's (another plugin, or another user)", r);
            return -1;
        }
        l->peers[r].pid = h->pid;
        l->peers[r].serial = h->serial;
    }
    if (l->peers[rank].pid != getpid() || l->peers[rank].serial != serial) {
        snprintf(err, err_len, "connect: handle of rank %d (this rank) is not the one listen gave", rank);
        return -1;
    }
    uint64_t pow2 = 1;
    while (pow2 < slots) pow2 <<= 1;
    l->inbox_len = mbox_bytes(nranks, pow2);
    mbox_name(l->inbox_name, sizeof(l->inbox_name), getpid(), serial);
    if (map_mailbox(l->inbox_name, 1, l->inbox_len, &l->inbox, &l->inbox_len, err, err_len)) {
        l->inbox_name[0] = '\0';
        return -1;
    }
    l->inbox->nranks = nranks;
    l->inbox->owner_pid = (int32_t)getpid();
    l->inbox->slots = pow2;
    __atomic_store_n(&l->inbox->magic, LINK_MAGIC, __ATOMIC_RELEASE);
    l->peers[rank].mbox = l->inbox;

    /* Every peer has created its mailbox before it says hello. */
    link_msg_t hello = {.serial = 0, .rank = rank}, *all = calloc((size_t)nranks, sizeof(*all));
    int *fds = calloc((size_t)nranks, sizeof(*fds));
    int rc = all && fds ? link_exchange(l, &hello, -1, all, fds, err, err_len) : -1;
    if (!all || !fds) snprintf(err, err_len, "connect: out of memory");
    free(all);
    free(fds);
    if (rc) return -1;
    for (int r = 0; r < nranks && !rc; r++) {
        if (r == rank) continue;
        char name[64];
        mbox_name(name, sizeof(name), l->peers[r].pid, l->peers[r].serial);
        rc = map_mailbox(name, 0, 0, &l->peers[r].mbox, &l->peers[r].mbox_len, err, err_len);
        if (!rc && (__atomic_load_n(&l->peers[r].mbox->magic, __ATOMIC_ACQUIRE) != LINK_MAGIC ||
                    l->peers[r].mbox->nranks != nranks ||
                    l->peers[r].mbox_len < mbox_bytes(nranks, l->peers[r].mbox->slots))) {
            snprintf(err, err_len, "connect: mailbox %s of rank %d does not describe %d ranks", name, r,
                     nranks);
            rc = -1;
        }
    }
    if (rc) return -1;
    /* Once every peer has mapped this rank's mailbox its name can go: a rank killed later leaves nothing
     * behind in /dev/shm. */
    link_msg_t mapped = {.serial = LINK_SERIAL_MAPPED, .rank = rank};
    all = calloc((size_t)nranks, sizeof(*all));
    fds = calloc((size_t)nranks, sizeof(*fds));
    rc = all && fds ? link_exchange(l, &mapped, -1, all, fds, err, err_len) : -1;
    if (!all || !fds) snprintf(err, err_len, "connect: out of memory");
    free(all);
    free(fds);
    if (!rc) {
        shm_unlink(l->inbox_name);
        l->inbox_name[0] = '\0';
    }
    return rc;
}

static int send_one(link_t *l, int peer, const link_msg_t *msg, int fd)
{
    struct sockaddr_un addr;
    socklen_t alen = sock_name(&addr, l->peers[peer].pid, l->peers[peer].serial);
    struct iovec iov = {(void *)msg, sizeof(*msg)};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct msghdr mh = {.msg_name = &addr, .msg_namelen = alen, .msg_iov = &iov, .msg_iovlen = 1};
    if (fd >= 0) {
        memset(&ctl, 0, sizeof(ctl));
        mh.msg_control = ctl.buf;
        mh.msg_controllen = sizeof(ctl.buf);
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    ssize_t n = sendmsg(l->sock, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n == (ssize_t)sizeof(*msg)) return 1;
    /* EAGAIN: the peer's queue is full; ECONNREFUSED / ENOENT: not bound yet or gone: retry until the
     * deadline, the liveness check names a dead peer. */
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNREFUSED || errno == ENOENT)
               ? 0
               : -1;
}

/* Receives one datagram; 1 with msg (and *fd, -1 when none), 0 when none is queued, -1 on error. */
static int recv_one(link_t *l, link_msg_t *msg, int *fd)
{
    struct iovec iov = {msg, sizeof(*msg)};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct msghdr mh = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof(ctl.buf)};
    ssize_t n = recvmsg(l->sock, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -1;
    *fd = -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) memcpy(fd, CMSG_DATA(c), sizeof(int));
    if (n != (ssize_t)sizeof(*msg) || msg->magic != LINK_MAGIC || msg->rank < 0 || msg->rank >= l->nranks) {
        if (*fd >= 0) close(*fd);
        *fd = -1;
        return 2; /* not ours: dropped */
    }
    return 1;
}

static int take_stashed(link_t *l, uint64_t serial, link_msg_t *all, int *fds, char *got)
{
    int n = 0;
    for (link_stash_t **p = &l->stash; *p;) {
        link_stash_t *s = *p;
        if (s->msg.serial == serial && !got[s->msg.rank]) {
            all[s->msg.rank] = s->msg;
            fds[s->msg.rank] = s->fd;
            got[s->msg.rank] = 1;
            n++;
            *p = s->next;
            free(s);
        } else {
            p = &s->next;
        }
    }
    return n;
}

int link_exchange(link_t *l, const link_msg_t *mine, int fd, link_msg_t *all, int *fds, char *err,
                  size_t err_len)
{
    int nr = l->nranks, rc = -1;
    char *sent = calloc((size_t)nr, 1), *got = calloc((size_t)nr, 1);
    if (!sent || !got) {
        snprintf(err, err_len, "exchange: out of memory");
        goto out;
    }
    link_msg_t msg = *mine;
    msg.magic = LINK_MAGIC;
    msg.rank = l->rank;
    for (int r = 0; r < nr; r++) fds[r] = -1;
    all[l->rank] = msg;
    sent[l->rank] = got[l->rank] = 1;
    int nsent = 1, ngot = 1 + take_stashed(l, msg.serial, all, fds, got);
    /* A peer that sent its message and exited between our last receive and the liveness check is not
     * missing: its datagram is queued. One more pass over the queue comes before a gone peer fails. */
    int seen_gone = 0;
    uint64_t end = link_now_ms() + l->deadline_ms;
    while (nsent < nr || ngot < nr) {
        for (int r = 0; r < nr; r++) {
            if (sent[r]) continue;
            int s = send_one(l, r, &msg, fd);
            if (s < 0) {
                snprintf(err, err_len, "exchange %llu: send to rank %d (pid %d) failed: %s",
                         (unsigned long long)msg.serial, r, (int)l->peers[r].pid, strerror(errno));
                goto out;
            }
            if (s) sent[r] = 1, nsent++;
        }
        link_msg_t in;
        int in_fd = -1, s;
        while ((s = recv_one(l, &in, &in_fd)) > 0) {
            if (s == 2) continue;
            if (in.serial == msg.serial && !got[in.rank]) {
                all[in.rank] = in;
                fds[in.rank] = in_fd;
                got[in.rank] = 1;
                ngot++;
            } else {
                link_stash_t *st = malloc(sizeof(*st));
                if (!st) {
                    if (in_fd >= 0) close(in_fd);
                    snprintf(err, err_len, "exchange: out of memory");
                    goto out;
                }
                st->msg = in;
                st->fd = in_fd;
                st->next = l->stash;
                l->stash = st;
            }
        }
        if (s < 0) {
            snprintf(err, err_len, "exchange %llu: receive failed: %s", (unsigned long long)msg.serial,
                     strerror(errno));
            goto out;
        }
        if (nsent == nr && ngot == nr) break;
        int gone = -1;
        for (int r = 0; r < nr && gone < 0; r++)
            if ((!sent[r] || !got[r]) && !link_peer_alive(l, r)) gone = r;
        if (gone >= 0 && !seen_gone) {
            seen_gone = 1;
            continue;
        }
        if (gone >= 0) {
            snprintf(err, err_len, "exchange %llu: rank %d (pid %d) is gone", (unsigned long long)msg.serial, gone,
                     (int)l->peers[gone].pid);
            goto out;
        }
        if (link_now_ms() >= end) {
            int missing = -1;
            for (int r = 0; r < nr && missing < 0; r++)
                if (!sent[r] || !got[r]) missing = r;
            snprintf(err, err_len, "exchange %llu: rank %d (pid %d) did not answer within %llu ms",
                     (unsigned long long)msg.serial, missing, (int)l->peers[missing].pid,
                     (unsigned long long)l->deadline_ms);
            goto out;
        }
        struct timespec nap = {0, 100000};
        nanosleep(&nap, NULL);
    }
    rc = 0;
out:
    if (rc)
        for (int r = 0; r < nr; r++)
            if (fds[r] >= 0) close(fds[r]), fds[r] = -1;
    free(sent);
    free(got);
    return rc;
}

void link_close(link_t *l)
{
    if (l->peers) {
        for (int r = 0; r < l->nranks; r++)
            if (r != l->rank && l->peers[r].mbox) munmap(l->peers[r].mbox, l->peers[r].mbox_len);
    }
    if (l->inbox) munmap(l->inbox, l->inbox_len);
    if (l->inbox_name[0]) shm_unlink(l->inbox_name);
    while (l->stash) {
        link_stash_t *s = l->stash;
        l->stash = s->next;
        if (s->fd >= 0) close(s->fd);
        free(s);
    }
    if (l->sock >= 0) close(l->sock);
    free(l->peers);
    memset(l, 0, sizeof(*l));
    l->sock = -1;
}
