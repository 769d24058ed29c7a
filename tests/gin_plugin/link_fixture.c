/*
 * The link test's multi-process fixture and CPU mover (link_fixture.h).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "link_fixture.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "epx_test.h"

#define WAIT_S 20.0

static void nap(void)
{
    usleep(200);
}

int lt_join(lt_shared_t *sh, int rank, uint64_t deadline_ms, uint64_t slots, int absent, link_t *l, char *err,
            size_t err_len)
{
    char msg[256] = "";
    int sock = -1;
    link_handle_t h;
    memset(l, 0, sizeof(*l));
    l->sock = -1;
    if (link_listen(&h, &sock, msg, sizeof(msg))) {
        fprintf(stderr, "rank %d: %s\n", rank, msg);
        return 1;
    }
    sh->handle[rank] = h;
    sh->pid[rank] = (int32_t)getpid();
    __atomic_fetch_add(&sh->joined, 1, __ATOMIC_ACQ_REL);
    if (absent) {
        /* Bound but silent: datagrams queue up unread until the process ends. */
        return 0;
    }
    double end = epx_test_now_s() + WAIT_S;
    while (__atomic_load_n(&sh->joined, __ATOMIC_ACQUIRE) < sh->nranks) {
        if (epx_test_now_s() > end) {
            fprintf(stderr, "rank %d: the handles were not all published within %.0f s\n", rank, WAIT_S);
            close(sock);
            return 1;
        }
        nap();
    }
    void *handles[LT_MAX_RANKS];
    for (int r = 0; r < sh->nranks; r++) handles[r] = &sh->handle[r];
    if (link_connect(l, sock, h.serial, handles, sh->nranks, rank, slots, deadline_ms, msg, sizeof(msg))) {
        if (err)
            snprintf(err, err_len, "%s", msg);
        else
            fprintf(stderr, "rank %d: %s\n", rank, msg);
        link_close(l);
        return 2;
    }
    return 0;
}

static int wait_count(int *counter, int value, const char *what, int index)
{
    double end = epx_test_now_s() + WAIT_S;
    while (__atomic_load_n(counter, __ATOMIC_ACQUIRE) < value) {
        if (epx_test_now_s() > end) {
            fprintf(stderr, "pid %d: %s %d not reached within %.0f s\n", (int)getpid(), what, index, WAIT_S);
            return 1;
        }
        nap();
    }
    return 0;
}

int lt_barrier(lt_shared_t *sh, int index, int count)
{
    __atomic_fetch_add(&sh->arrived[index], 1, __ATOMIC_ACQ_REL);
    return wait_count(&sh->arrived[index], count, "barrier", index);
}

int lt_wait_marker(lt_shared_t *sh, int rank, int value)
{
    return wait_count(&sh->marker[rank], value, "marker of rank", rank);
}

uint8_t lt_src_byte(int rank, uint64_t seed, uint64_t off)
{
    return (uint8_t)(seed * 29 + (uint64_t)rank * 151 + off * 13 + 5);
}

uint64_t lt_sig(lt_mover_t *m, int word)
{
    return __atomic_load_n(&m->sig[word], __ATOMIC_ACQUIRE);
}

/* ---- the mover: puts land at once, adds go through the owner's mailbox ---------------------------- */

static int take(lt_mover_t *m, int is_signal, int peer, uint64_t *token, char *msg, size_t len)
{
    for (int i = 0; i < LT_XFERS; i++) {
        if (m->xfers[i].used) continue;
        m->xfers[i] = (lt_xfer_t){.used = 1, .is_signal = is_signal, .peer = peer};
        *token = (uint64_t)i;
        return 0;
    }
    snprintf(msg, len, "link test mover: all %d transfer slots in use", LT_XFERS);
    return -1;
}

static int start_put(void *state, const ginq_op_t *op, uint64_t *token, char *msg, size_t len)
{
    lt_mover_t *m = state;
    const ginq_desc_t *d = &op->desc;
    const lt_region_t *src = d->src->mover_data, *dst = d->dst->mover_data;
    if (!dst->peer[d->peer]) {
        snprintf(msg, len, "region #%llu is not mapped for peer %d", (unsigned long long)dst->serial,
                 d->peer);
        return -1;
    }
    if (take(m, 0, d->peer, token, msg, len)) return -1;
    memcpy(dst->peer[d->peer] + d->dst_off, src->local + d->src_off, d->bytes);
    return 0;
}

static int start_signal(void *state, const ginq_op_t *op, uint64_t *token, char *msg, size_t len)
{
    lt_mover_t *m = state;
    const ginq_desc_t *d = &op->desc;
    const lt_region_t *sig = d->signal->mover_data;
    uint64_t ticket;
    if (take(m, 1, d->peer, token, msg, len)) return -1;
    if (link_add_post(m->link, d->peer, sig->serial, d->signal_off, op->signal_add, &ticket, msg, len)) {
        m->xfers[*token].used = 0;
        return -1;
    }
    m->xfers[*token].ticket = ticket;
    return 0;
}

static int poll_xfer(void *state, uint64_t token, char *msg, size_t len)
{
    lt_mover_t *m = state;
    const lt_xfer_t *x = &m->xfers[token];
    return x->is_signal ? link_add_poll(m->link, x->peer, x->ticket, msg, len) : 1;
}

static void release_xfer(void *state, uint64_t token, int abandoned)
{
    lt_mover_t *m = state;
    m->xfers[token].used = 0;
}

/* The owner's side: applies what every sender published, in ticket order; refuses an add outside the
 * signal region with the reason. */
static int serve(void *state, char *err, size_t err_len)
{
    lt_mover_t *m = state;
    pthread_mutex_lock(&m->serve_mutex);
    for (int s = 0; s < m->nranks; s++) {
        link_slot_t slot;
        uint64_t ticket;
        int took;
        while ((took = link_add_take(m->link, s, &slot, &ticket)) > 0) {
            if (took == 1 &&
                (slot.region != LT_SIG_REGION || slot.offset % 8 || slot.offset / 8 >= LT_NSIG)) {
                char why[160];
                snprintf(why, sizeof(why), "rank %d: no signal region #%llu with a word at offset %llu",
                         m->rank, (unsigned long long)slot.region, (unsigned long long)slot.offset);
                link_add_refuse(m->link, s, ticket, why);
                m->refused++;
            } else if (took == 1) {
                __atomic_fetch_add(&m->sig[slot.offset / 8], slot.value, __ATOMIC_RELEASE);
                m->served++;
            }
            link_add_applied(m->link, s, ticket);
        }
    }
    pthread_mutex_unlock(&m->serve_mutex);
    (void)err;
    (void)err_len;
    return 0;
}

static int serve_idle(void *state)
{
    lt_mover_t *m = state;
    pthread_mutex_lock(&m->serve_mutex);
    int idle = link_inbox_idle(m->link);
    pthread_mutex_unlock(&m->serve_mutex);
    return idle;
}

int lt_mover_init(lt_mover_t *m, link_t *l, uint64_t seed)
{
    memset(m, 0, sizeof(*m));
    m->link = l;
    m->rank = l->rank;
    m->nranks = l->nranks;
    for (uint64_t i = 0; i < LT_DATA; i++) m->src[i] = lt_src_byte(m->rank, seed, i);
    pthread_mutex_init(&m->serve_mutex, NULL);
    int fd = memfd_create("epx-gin-link-test", MFD_CLOEXEC), fds[LT_MAX_RANKS] = {-1, -1, -1, -1};
    link_msg_t mine = {.serial = 100, .kind = 1}, all[LT_MAX_RANKS];
    char msg[256] = "";
    if (fd < 0 || ftruncate(fd, LT_DATA)) {
        fprintf(stderr, "rank %d: memfd: %s\n", m->rank, strerror(errno));
        if (fd >= 0) close(fd);
        return 1;
    }
    mine.words[0] = LT_DATA;
    int rc = link_exchange(l, &mine, fd, all, fds, msg, sizeof(msg));
    if (rc) fprintf(stderr, "rank %d: region exchange: %s\n", m->rank, msg);
    for (int r = 0; r < m->nranks; r++) {
        int use = r == m->rank ? fd : fds[r];
        if (!rc && (use < 0 || all[r].words[0] != LT_DATA)) {
            fprintf(stderr, "rank %d: rank %d sent no region fd\n", m->rank, r);
            rc = 1;
        }
        void *p = rc ? MAP_FAILED : mmap(NULL, LT_DATA, PROT_READ | PROT_WRITE, MAP_SHARED, use, 0);
        if (!rc && p == MAP_FAILED) {
            fprintf(stderr, "rank %d: mapping rank %d's region: %s\n", m->rank, r, strerror(errno));
            rc = 1;
        }
        if (p != MAP_FAILED) m->data[r] = p;
        if (r != m->rank && fds[r] >= 0) close(fds[r]);
    }
    close(fd);
    m->src_region = (lt_region_t){{LT_DATA, &m->src_region}, 1, m->src, {NULL}};
    m->dst_region = (lt_region_t){{LT_DATA, &m->dst_region}, 2, m->data[m->rank], {NULL}};
    m->sig_region = (lt_region_t){{sizeof(m->sig), &m->sig_region}, LT_SIG_REGION, (uint8_t *)m->sig, {NULL}};
    for (int r = 0; r < m->nranks; r++) m->dst_region.peer[r] = m->data[r];
    m->iface = (ginq_mover_t){m, start_put, start_signal, poll_xfer, release_xfer};
    m->server = (gin_server_t){m, serve, serve_idle, NULL};
    return rc;
}

void lt_mover_fini(lt_mover_t *m)
{
    for (int r = 0; r < LT_MAX_RANKS; r++)
        if (m->data[r]) munmap(m->data[r], LT_DATA);
    pthread_mutex_destroy(&m->serve_mutex);
}
