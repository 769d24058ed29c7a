/*
 * The host model of epx's network interface (net.h, loop_model.h): the semantic reference the cuda
 * `loop` transport and the GIN transport must match, and a test instrument, never a production
 * path. Posts queue per (source rank, context); progress delivers them, in post order (normal mode)
 * or by a seeded choice among every step the ordering rules allow (strict mode). One mutex guards
 * the queues; signals are atomics so waiters read them without it.
 */
#include "net/loop_model.h"

#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A queued operation moves through: source read (local completion), landing (bytes at the peer),
 * signal (added at the peer). Operations without bytes skip the first two, without a signal the last. */
typedef struct model_op {
    epx_net_op_t op;
    uint8_t *payload; /* the source bytes, once read */
    uint8_t sourced, landed, signalled;
} model_op_t;

typedef struct op_queue {
    model_op_t *ops; /* post order; complete operations are removed */
    size_t count, cap;
} op_queue_t;

typedef struct model_region {
    uint8_t *base;
    size_t bytes;
} model_region_t;

/* Strict mode's candidate steps. */
enum { STEP_SOURCE, STEP_LAND, STEP_SIGNAL };
typedef struct model_step {
    uint32_t queue, index, what;
} model_step_t;

struct epx_net_model {
    pthread_mutex_t lock;
    epx_net_model_config_t cfg;
    uint64_t rng;
    size_t next_queue; /* normal mode's round robin */
    uint32_t nregions[EPX_NET_MODEL_MAX_RANKS];
    model_region_t regions[EPX_NET_MODEL_MAX_RANKS][EPX_NET_MODEL_MAX_REGIONS];
    uint64_t *signals;   /* [rank * nsignals + id] */
    op_queue_t *queues;  /* [rank * ncontexts + ctx] */
    model_step_t *steps; /* strict mode's scratch */
    size_t steps_cap;
};

static _Thread_local char model_msg[256];

const char *epx_net_model_message(void)
{
    return model_msg;
}

__attribute__((format(printf, 2, 3))) static epx_net_status_t fail(epx_net_status_t s, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(model_msg, sizeof(model_msg), fmt, ap);
    va_end(ap);
    return s;
}

static uint64_t next_random(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int has_bytes(const epx_net_op_t *op)
{
    return op->kind != EPX_NET_OP_SIGNAL;
}

static int has_signal(const epx_net_op_t *op)
{
    return op->kind != EPX_NET_OP_PUT;
}

static int op_complete(const model_op_t *m)
{
    return (!has_bytes(&m->op) || m->landed) && (!has_signal(&m->op) || m->signalled);
}

epx_net_status_t epx_net_model_create(const epx_net_model_config_t *config, epx_net_model_t **model_out)
{
    if (!config || !model_out) return fail(EPX_NET_INVALID, "net model: config and model_out must be set");
    if (config->nranks < 1 || config->nranks > EPX_NET_MODEL_MAX_RANKS)
        return fail(EPX_NET_INVALID, "net model: nranks %d out of range 1..%d", config->nranks,
                    EPX_NET_MODEL_MAX_RANKS);
    if (config->ncontexts < 1) return fail(EPX_NET_INVALID, "net model: ncontexts must be at least 1");
    if (config->nsignals < 1) return fail(EPX_NET_INVALID, "net model: nsignals must be at least 1");
    if (config->mode != EPX_NET_MODEL_NORMAL && config->mode != EPX_NET_MODEL_STRICT)
        return fail(EPX_NET_INVALID, "net model: mode %d is neither normal nor strict", (int)config->mode);
    epx_net_model_t *m = calloc(1, sizeof(*m));
    if (!m) return fail(EPX_NET_NO_MEMORY, "net model: out of memory");
    m->cfg = *config;
    m->rng = config->seed;
    m->signals = calloc((size_t)config->nranks * config->nsignals, sizeof(uint64_t));
    m->queues = calloc((size_t)config->nranks * config->ncontexts, sizeof(op_queue_t));
    if (!m->signals || !m->queues || pthread_mutex_init(&m->lock, NULL) != 0) {
        free(m->signals);
        free(m->queues);
        free(m);
        return fail(EPX_NET_NO_MEMORY, "net model: out of memory");
    }
    *model_out = m;
    return EPX_NET_OK;
}

void epx_net_model_destroy(epx_net_model_t *model)
{
    if (!model) return;
    for (size_t q = 0; q < (size_t)model->cfg.nranks * model->cfg.ncontexts; q++) {
        for (size_t i = 0; i < model->queues[q].count; i++) free(model->queues[q].ops[i].payload);
        free(model->queues[q].ops);
    }
    pthread_mutex_destroy(&model->lock);
    free(model->steps);
    free(model->queues);
    free(model->signals);
    free(model);
}

static int rank_ok(const epx_net_model_t *m, int rank)
{
    return rank >= 0 && rank < m->cfg.nranks;
}

epx_net_status_t epx_net_model_register(epx_net_model_t *model, int rank, void *base, size_t bytes,
                                        uint32_t *region_out)
{
    if (!model || !region_out)
        return fail(EPX_NET_INVALID, "net model register: model and region_out must be set");
    if (!rank_ok(model, rank)) return fail(EPX_NET_INVALID, "net model register: rank %d out of range", rank);
    if (!base && bytes) return fail(EPX_NET_INVALID, "net model register: base is NULL for %zu bytes", bytes);
    pthread_mutex_lock(&model->lock);
    uint32_t n = model->nregions[rank];
    if (n == EPX_NET_MODEL_MAX_REGIONS) {
        pthread_mutex_unlock(&model->lock);
        return fail(EPX_NET_INVALID, "net model register: rank %d already has %d regions", rank,
                    EPX_NET_MODEL_MAX_REGIONS);
    }
    model->regions[rank][n] = (model_region_t){base, bytes};
    model->nregions[rank] = n + 1;
    pthread_mutex_unlock(&model->lock);
    *region_out = n;
    return EPX_NET_OK;
}

epx_net_status_t epx_net_model_handle(epx_net_model_t *model, int rank, epx_net_t *net_out)
{
    if (!model || !net_out) return fail(EPX_NET_INVALID, "net model handle: model and net_out must be set");
    if (!rank_ok(model, rank)) return fail(EPX_NET_INVALID, "net model handle: rank %d out of range", rank);
    *net_out = (epx_net_t){.transport = EPX_NET_TRANSPORT_MODEL,
                           .rank = rank,
                           .nranks = model->cfg.nranks,
                           .ncontexts = model->cfg.ncontexts,
                           .nsignals = model->cfg.nsignals,
                           .impl = model,
                           .abort_word = model->cfg.abort_word};
    return EPX_NET_OK;
}

/* Region `region` of `rank` holds [offset, offset + bytes); with the lock held. */
static int range_ok(const epx_net_model_t *m, int rank, uint32_t region, uint64_t offset, uint64_t bytes)
{
    if (region >= m->nregions[rank]) return 0;
    const uint64_t size = m->regions[rank][region].bytes;
    return offset <= size && bytes <= size - offset;
}

/* Checks a post against the model's shape and regions, with the lock held. */
static epx_net_status_t check_op(const epx_net_model_t *m, int rank, const epx_net_op_t *op)
{
    if (op->kind < EPX_NET_OP_PUT || op->kind > EPX_NET_OP_SIGNAL)
        return fail(EPX_NET_INVALID, "rank %d: operation kind %u unknown", rank, op->kind);
    if (op->ctx >= m->cfg.ncontexts)
        return fail(EPX_NET_INVALID, "rank %d: context %u out of range (%u contexts)", rank, op->ctx,
                    m->cfg.ncontexts);
    if (!rank_ok(m, op->peer))
        return fail(EPX_NET_INVALID, "rank %d: peer %d out of range (%d ranks)", rank, op->peer,
                    m->cfg.nranks);
    if (has_bytes(op) && !range_ok(m, rank, op->src_region, op->src_offset, op->bytes))
        return fail(EPX_NET_INVALID, "rank %d: source region %u [%llu, +%llu) not registered", rank,
                    op->src_region, (unsigned long long)op->src_offset, (unsigned long long)op->bytes);
    if (has_bytes(op) && !range_ok(m, op->peer, op->dst_region, op->dst_offset, op->bytes))
        return fail(EPX_NET_INVALID, "rank %d: destination region %u [%llu, +%llu) of peer %d not registered",
                    rank, op->dst_region, (unsigned long long)op->dst_offset, (unsigned long long)op->bytes,
                    op->peer);
    if (has_signal(op) && op->signal >= m->cfg.nsignals)
        return fail(EPX_NET_INVALID, "rank %d: signal %u out of range (%u signals)", rank, op->signal,
                    m->cfg.nsignals);
    if (has_signal(op) && op->signal_mode != EPX_NET_SIGNAL_STRONG && op->signal_mode != EPX_NET_SIGNAL_WEAK)
        return fail(EPX_NET_INVALID, "rank %d: signal mode %u is neither strong nor weak", rank,
                    op->signal_mode);
    return EPX_NET_OK;
}

epx_net_status_t epx_net_model_post(void *impl, int rank, const epx_net_op_t *op)
{
    epx_net_model_t *m = impl;
    if (!m || !op) return fail(EPX_NET_INVALID, "net model post: model and op must be set");
    if (!rank_ok(m, rank)) return fail(EPX_NET_INVALID, "net model post: rank %d out of range", rank);
    pthread_mutex_lock(&m->lock);
    epx_net_status_t s = check_op(m, rank, op);
    op_queue_t *q = &m->queues[(size_t)rank * m->cfg.ncontexts + op->ctx];
    if (s == EPX_NET_OK && q->count == q->cap) {
        size_t cap = q->cap ? 2 * q->cap : 16;
        model_op_t *ops = realloc(q->ops, cap * sizeof(*ops));
        if (ops) {
            q->ops = ops;
            q->cap = cap;
        } else {
            s = fail(EPX_NET_NO_MEMORY, "rank %d: out of memory queueing an operation", rank);
        }
    }
    if (s == EPX_NET_OK) q->ops[q->count++] = (model_op_t){.op = *op};
    pthread_mutex_unlock(&m->lock);
    return s;
}

epx_net_status_t epx_net_model_signal_read(void *impl, int rank, uint32_t signal, uint64_t *value_out)
{
    epx_net_model_t *m = impl;
    if (!m || !value_out) return fail(EPX_NET_INVALID, "net model read: model and value_out must be set");
    if (!rank_ok(m, rank)) return fail(EPX_NET_INVALID, "net model read: rank %d out of range", rank);
    if (signal >= m->cfg.nsignals)
        return fail(EPX_NET_INVALID, "rank %d: signal %u out of range (%u signals)", rank, signal,
                    m->cfg.nsignals);
    *value_out = __atomic_load_n(&m->signals[(size_t)rank * m->cfg.nsignals + signal], __ATOMIC_ACQUIRE);
    return EPX_NET_OK;
}

/* The three steps of an operation, with the lock held. A source read that cannot allocate leaves the
 * operation unsourced (it is tried again later); it returns 0 then. */
static int do_source(epx_net_model_t *m, int rank, model_op_t *o)
{
    if (o->op.bytes) {
        o->payload = malloc(o->op.bytes);
        if (!o->payload) return 0;
        memcpy(o->payload, m->regions[rank][o->op.src_region].base + o->op.src_offset, o->op.bytes);
    }
    o->sourced = 1;
    return 1;
}

static void do_land(epx_net_model_t *m, model_op_t *o)
{
    if (o->op.bytes)
        memcpy(m->regions[o->op.peer][o->op.dst_region].base + o->op.dst_offset, o->payload, o->op.bytes);
    free(o->payload);
    o->payload = NULL;
    o->landed = 1;
}

static void do_signal(epx_net_model_t *m, model_op_t *o)
{
    __atomic_fetch_add(&m->signals[(size_t)o->op.peer * m->cfg.nsignals + o->op.signal], o->op.signal_add,
                       __ATOMIC_RELEASE);
    o->signalled = 1;
}

static void remove_complete(op_queue_t *q)
{
    size_t kept = 0;
    for (size_t i = 0; i < q->count; i++)
        if (!op_complete(&q->ops[i])) q->ops[kept++] = q->ops[i];
    q->count = kept;
}

epx_net_status_t epx_net_model_flush(void *impl, int rank, uint32_t ctx)
{
    epx_net_model_t *m = impl;
    if (!m) return fail(EPX_NET_INVALID, "net model flush: model must be set");
    if (!rank_ok(m, rank)) return fail(EPX_NET_INVALID, "net model flush: rank %d out of range", rank);
    if (ctx >= m->cfg.ncontexts)
        return fail(EPX_NET_INVALID, "rank %d: flush of context %u out of range (%u contexts)", rank, ctx,
                    m->cfg.ncontexts);
    epx_net_status_t s = EPX_NET_OK;
    pthread_mutex_lock(&m->lock);
    op_queue_t *q = &m->queues[(size_t)rank * m->cfg.ncontexts + ctx];
    for (size_t i = 0; i < q->count && s == EPX_NET_OK; i++) {
        model_op_t *o = &q->ops[i];
        if (has_bytes(&o->op) && !o->sourced && !do_source(m, rank, o))
            s = fail(EPX_NET_NO_MEMORY, "rank %d: out of memory reading a put's source", rank);
    }
    pthread_mutex_unlock(&m->lock);
    return s;
}

/* Normal mode: the next non-empty queue (round robin) completes its oldest operation. */
static size_t step_normal(epx_net_model_t *m)
{
    const size_t nq = (size_t)m->cfg.nranks * m->cfg.ncontexts;
    for (size_t k = 0; k < nq; k++) {
        const size_t qi = (m->next_queue + k) % nq;
        op_queue_t *q = &m->queues[qi];
        if (!q->count) continue;
        model_op_t *o = &q->ops[0];
        if (has_bytes(&o->op)) {
            if (!o->sourced && !do_source(m, (int)(qi / m->cfg.ncontexts), o)) return 0;
            if (!o->landed) do_land(m, o);
        }
        if (has_signal(&o->op) && !o->signalled) do_signal(m, o);
        remove_complete(q);
        m->next_queue = (qi + 1) % nq;
        return 1;
    }
    return 0;
}

/* The steps the rules allow for operation `i` of queue `q`, appended to m->steps. */
static void allowed_steps(epx_net_model_t *m, uint32_t qi, uint32_t i, size_t *n)
{
    const op_queue_t *q = &m->queues[qi];
    const model_op_t *o = &q->ops[i];
    if (has_bytes(&o->op) && !o->sourced) m->steps[(*n)++] = (model_step_t){qi, i, STEP_SOURCE};
    if (has_bytes(&o->op) && o->sourced && !o->landed) m->steps[(*n)++] = (model_step_t){qi, i, STEP_LAND};
    if (!has_signal(&o->op) || o->signalled || (has_bytes(&o->op) && !o->landed)) return;
    if (o->op.signal_mode == EPX_NET_SIGNAL_STRONG)
        for (uint32_t j = 0; j < i; j++)
            if (has_bytes(&q->ops[j].op) && !q->ops[j].landed && q->ops[j].op.peer == o->op.peer) return;
    m->steps[(*n)++] = (model_step_t){qi, i, STEP_SIGNAL};
}

/* Strict mode: one step drawn among all allowed ones; a weak signal drawn while other steps exist
 * is drawn again with probability 3/4, so weak signals tend to trail later operations. */
static size_t step_strict(epx_net_model_t *m)
{
    const size_t nq = (size_t)m->cfg.nranks * m->cfg.ncontexts;
    size_t total = 0;
    for (size_t qi = 0; qi < nq; qi++) total += m->queues[qi].count;
    if (!total) return 0;
    if (total * 2 > m->steps_cap) {
        model_step_t *steps = realloc(m->steps, total * 2 * sizeof(*steps));
        if (!steps) return 0;
        m->steps = steps;
        m->steps_cap = total * 2;
    }
    size_t n = 0;
    for (uint32_t qi = 0; qi < nq; qi++)
        for (uint32_t i = 0; i < m->queues[qi].count; i++) allowed_steps(m, qi, i, &n);
    if (!n) return 0;
    model_step_t st = m->steps[next_random(&m->rng) % n];
    const int weak_signal =
        st.what == STEP_SIGNAL && m->queues[st.queue].ops[st.index].op.signal_mode == EPX_NET_SIGNAL_WEAK;
    if (weak_signal && n > 1 && next_random(&m->rng) % 4 != 0) st = m->steps[next_random(&m->rng) % n];
    op_queue_t *q = &m->queues[st.queue];
    model_op_t *o = &q->ops[st.index];
    switch (st.what) {
    case STEP_SOURCE:
        if (!do_source(m, (int)(st.queue / m->cfg.ncontexts), o)) return 0;
        break;
    case STEP_LAND: do_land(m, o); break;
    default: do_signal(m, o); break;
    }
    remove_complete(q);
    return 1;
}

size_t epx_net_model_progress(epx_net_model_t *model, size_t max_steps)
{
    if (!model) return 0;
    size_t done = 0;
    pthread_mutex_lock(&model->lock);
    while (done < max_steps) {
        const size_t ran = model->cfg.mode == EPX_NET_MODEL_STRICT ? step_strict(model) : step_normal(model);
        if (!ran) break;
        done += ran;
    }
    pthread_mutex_unlock(&model->lock);
    return done;
}

size_t epx_net_model_pending(epx_net_model_t *model)
{
    if (!model) return 0;
    size_t total = 0;
    pthread_mutex_lock(&model->lock);
    for (size_t qi = 0; qi < (size_t)model->cfg.nranks * model->cfg.ncontexts; qi++)
        total += model->queues[qi].count;
    pthread_mutex_unlock(&model->lock);
    return total;
}

void epx_net_model_poll(void *impl)
{
    epx_net_model_t *m = impl;
    if (m && m->cfg.progress_in_wait)
        epx_net_model_progress(m, 1);
    else
        sched_yield();
}
