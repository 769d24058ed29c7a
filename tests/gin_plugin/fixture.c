/*
 * The queue test's CPU fixture and mover (fixture.h). Mover calls come under the context's mutex.
 */
#include "fixture.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epx_test.h"

static uint8_t *at(const ginq_region_t *region, int rank, uint64_t off)
{
    return (uint8_t *)((void **)region->mover_data)[rank] + off;
}

static int start(mover_t *m, const ginq_op_t *op, int is_signal, uint64_t *token)
{
    for (int i = 0; i < MAX_XFERS; i++) {
        if (m->xfers[i].used) continue;
        xfer_t *x = &m->xfers[i];
        memset(x, 0, sizeof(*x));
        x->used = 1;
        x->is_signal = is_signal;
        x->op = *op;
        x->polls_left = m->lazy ? (int)(epx_test_rand(&m->rng) % 4) : 0;
        if (!is_signal && m->nissued < MAX_EVENTS) m->put_issued[m->nissued++] = op->ordinal;
        *token = (uint64_t)i;
        return 0;
    }
    return -1;
}

static int start_or_say(mover_t *m, const ginq_op_t *op, int is_signal, uint64_t *token, char *msg,
                        size_t len)
{
    if (!start(m, op, is_signal, token)) return 0;
    snprintf(msg, len, "test mover: out of transfer slots");
    return -1;
}

static int mover_start_put(void *state, const ginq_op_t *op, uint64_t *token, char *msg, size_t len)
{
    return start_or_say(state, op, 0, token, msg, len);
}

static int mover_start_signal(void *state, const ginq_op_t *op, uint64_t *token, char *msg, size_t len)
{
    return start_or_say(state, op, 1, token, msg, len);
}

static int mover_poll(void *state, uint64_t token, char *msg, size_t len)
{
    mover_t *m = state;
    xfer_t *x = &m->xfers[token];
    const ginq_desc_t *d = &x->op.desc;
    if (!x->used || x->landed || d->peer == m->fail_peer) {
        if (d->peer == m->fail_peer)
            snprintf(msg, len, "peer %d unreachable", d->peer);
        else
            snprintf(msg, len, "test mover: token %llu polled after it landed", (unsigned long long)token);
        return -1;
    }
    if (d->peer == m->stall_peer || x->op.ordinal == m->stall_ordinal) return 0;
    if (x->polls_left > 0) {
        x->polls_left--;
        return 0;
    }
    if (x->is_signal) {
        __atomic_fetch_add((uint64_t *)at(d->signal, d->peer, d->signal_off), x->op.signal_add,
                           __ATOMIC_RELEASE);
    } else {
        memcpy(at(d->dst, d->peer, d->dst_off), at(d->src, x->op.rank, d->src_off), d->bytes);
    }
    x->landed = 1;
    if (m->nlog < MAX_EVENTS) m->log[m->nlog++] = (event_t){x->is_signal, x->op.ordinal};
    return 1;
}

static void mover_release(void *state, uint64_t token, int abandoned)
{
    mover_t *m = state;
    m->xfers[token].used = 0;
    m->released++;
    m->abandoned += abandoned;
}

fixture_t *fixture_new(uint64_t seed, int lazy)
{
    fixture_t *f = calloc(1, sizeof(*f));
    if (!f) return NULL;
    for (int r = 0; r < NR; r++) {
        f->src_bases[r] = f->src[r];
        f->dst_bases[r] = f->dst[r];
        f->sig_bases[r] = f->sig[r];
        for (int i = 0; i < BUF; i++)
            f->src[r][i] = (uint8_t)(seed * 13 + (uint64_t)r * 101 + (uint64_t)i * 7 + 1);
    }
    f->src_region = (ginq_region_t){BUF, f->src_bases};
    f->dst_region = (ginq_region_t){BUF, f->dst_bases};
    f->sig_region = (ginq_region_t){sizeof(f->sig[0]), f->sig_bases};
    f->mover.rng = seed;
    f->mover.lazy = lazy;
    f->mover.stall_peer = -1;
    f->mover.fail_peer = -1;
    f->iface = (ginq_mover_t){&f->mover, mover_start_put, mover_start_signal, mover_poll, mover_release};
    return f;
}

ginq_t *queue_new(fixture_t *f, int context, int capacity, const char *faults)
{
    ginq_config_t cfg = {.rank = 0, .nranks = NR, .context = context, .capacity = capacity};
    char err[256];
    ginq_t *q = NULL;
    if (ginq_faults_parse(faults, &cfg.faults, err, sizeof(err)) != GINQ_OK ||
        ginq_create(&cfg, &f->iface, err, sizeof(err), &q) != GINQ_OK) {
        fprintf(stderr, "queue_new: %s\n", err);
        return NULL;
    }
    return q;
}

ginq_desc_t put_desc(fixture_t *f, int peer, int chunk)
{
    return (ginq_desc_t){.peer = peer,
                         .src = &f->src_region,
                         .src_off = (uint64_t)chunk * CHUNK,
                         .dst = &f->dst_region,
                         .dst_off = (uint64_t)chunk * CHUNK,
                         .bytes = CHUNK};
}

void add_signal(fixture_t *f, ginq_desc_t *d, int id, ginq_signal_op_t op, uint64_t value, int weak)
{
    d->signal_op = op;
    d->signal = &f->sig_region;
    d->signal_off = (uint64_t)id * sizeof(uint64_t);
    d->signal_value = value;
    d->signal_weak = weak;
}

int chunk_landed(const fixture_t *f, int peer, int chunk)
{
    return !memcmp(&f->dst[peer][chunk * CHUNK], &f->src[0][chunk * CHUNK], CHUNK);
}
