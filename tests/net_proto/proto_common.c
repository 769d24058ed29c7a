/*
 * What every protocol prototype of this directory shares (README.md): error recording with the run's
 * abort word, bounded waits on signals and node-shared words, node barriers, puts between the
 * registered regions and flush; the count messages and node table of the HT and routing-map protocols.
 */
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>

#include "proto_impl.h"

/* Records this rank's first error (in its output) and the run's first, and aborts every wait of the run. */
int proto_fail(rank_t *rk, const char *fmt, ...)
{
    run_t *run = rk->run;
    char *own = rk->error;
    if (!own[0]) {
        int n = snprintf(own, rk->error_len, "rank %d: ", rk->r);
        va_list ap;
        va_start(ap, fmt);
        if (n >= 0 && (size_t)n < rk->error_len) vsnprintf(own + n, rk->error_len - (size_t)n, fmt, ap);
        va_end(ap);
    }
    pthread_mutex_lock(&run->err_lock);
    if (!run->failed) snprintf(run->err, run->err_len, "%s", own);
    run->failed = 1;
    pthread_mutex_unlock(&run->err_lock);
    __atomic_store_n(&run->abort_word, 1, __ATOMIC_RELEASE);
    return 1;
}

/* Every wait ends this long after it began (EPX_TIMEOUT_MS's role). */
uint64_t proto_deadline(const rank_t *rk)
{
    return epx_net_now_ns() + rk->run->timeout_ms * 1000000ull;
}

void proto_count_local(rank_t *rk, int peer, uint64_t bytes)
{
    if (peer == rk->r)
        rk->stats.self_bytes += bytes;
    else
        rk->stats.nvlink_bytes += bytes;
}

/* ---- the network legs ---------------------------------------------------------------------------- */

/* A put from SEND to peer's RECV, with a signal (sig >= 0) or without. */
int proto_net_put(rank_t *rk, const char *stage, uint32_t ctx, int peer, uint64_t dst, uint64_t src,
                  uint64_t bytes, int sig, epx_net_signal_mode_t mode)
{
    epx_net_status_t s = sig < 0 ? epx_net_put(&rk->net, ctx, peer, REGION_RECV, dst, REGION_SEND, src, bytes)
                                 : epx_net_put_signal(&rk->net, ctx, peer, REGION_RECV, dst, REGION_SEND, src,
                                                      bytes, (uint32_t)sig, 1, mode);
    if (s != EPX_NET_OK)
        return proto_fail(rk, "%s: put of %llu bytes to peer %d: %s (%s)", stage, (unsigned long long)bytes,
                          peer, epx_net_status_name(s), epx_net_model_message());
    rk->stats.net_bytes += bytes;
    return 0;
}

/* The one polling loop of every wait: until read() gives at least `target`, the abort word is set or the
 * deadline passes. Each poll runs one model step (progress_in_wait) and yields, so that waiting ranks do
 * not starve the ones with work on a loaded machine. [out] *last: the value last read. */
typedef epx_net_status_t (*read_fn)(rank_t *rk, const void *what, uint64_t *value);

static epx_net_status_t wait_value(rank_t *rk, read_fn read, const void *what, uint64_t target,
                                   uint64_t *last)
{
    const uint64_t end = proto_deadline(rk);
    for (;;) {
        const epx_net_status_t s = read(rk, what, last);
        if (s != EPX_NET_OK) return s;
        if (*last >= target) return EPX_NET_OK;
        if (epx_net_aborted(&rk->net)) return EPX_NET_ABORTED;
        if (epx_net_now_ns() > end) return EPX_NET_TIMEOUT;
        epx_net_poll(&rk->net);
        sched_yield();
    }
}

static epx_net_status_t read_signal(rank_t *rk, const void *sig, uint64_t *value)
{
    return epx_net_signal_read(&rk->net, *(const uint32_t *)sig, value);
}

static epx_net_status_t read_word(rank_t *rk, const void *word, uint64_t *value)
{
    *value = atomic_load_explicit((atomic_uint_fast64_t *)word, memory_order_acquire);
    return EPX_NET_OK;
}

/* Waits for signal `sig` to reach `target`; the puts it counts come from `peer`, or (peer < 0) from the
 * ranks of this local index on the other nodes (peer -1) or from every rank of the other nodes (-2). */
int proto_wait_signal(rank_t *rk, const char *stage, uint32_t sig, uint64_t target, int peer)
{
    run_t *run = rk->run;
    uint64_t v = 0;
    const epx_net_status_t s = wait_value(rk, read_signal, &sig, target, &v);
    if (s == EPX_NET_OK) return 0;
    char from[160];
    int len = snprintf(from, sizeof(from), peer >= 0 ? "peer %d" : "peers", peer);
    for (int d = 0; peer < 0 && d < run->R && len > 0 && (size_t)len < sizeof(from); d++)
        if (d / run->P != rk->m && (peer == -2 || d % run->P == rk->l))
            len += snprintf(from + len, sizeof(from) - (size_t)len, " %d", d);
    return proto_fail(rk, "%s: waiting for signal %u to reach %llu (at %llu) from %s: %s", stage, sig,
                      (unsigned long long)target, (unsigned long long)v, from, epx_net_status_name(s));
}

int proto_flush(rank_t *rk, const char *stage, uint32_t ctx)
{
    epx_net_status_t s = epx_net_flush(&rk->net, ctx, proto_deadline(rk));
    return s == EPX_NET_OK
               ? 0
               : proto_fail(rk, "%s: flush of context %u: %s", stage, ctx, epx_net_status_name(s));
}

/* A wait on node-shared memory: until *word >= target (acquire). */
int proto_wait_local(rank_t *rk, const char *stage, atomic_uint_fast64_t *word, uint64_t target,
                     const char *what)
{
    uint64_t v = 0;
    const epx_net_status_t s = wait_value(rk, read_word, word, target, &v);
    if (s == EPX_NET_OK) return 0;
    return proto_fail(rk, "%s: waiting for %s of node %d (%llu of %llu): %s", stage, what, rk->m,
                      (unsigned long long)v, (unsigned long long)target, epx_net_status_name(s));
}

int proto_node_barrier(rank_t *rk, const char *stage, uint64_t generation)
{
    node_shared_t *node = &rk->run->nodes[rk->m];
    atomic_fetch_add_explicit(&node->barrier, 1, memory_order_acq_rel);
    return proto_wait_local(rk, stage, &node->barrier, generation * (uint64_t)rk->run->P, "the node's ranks");
}

/* ---- count messages and the node table (HT and routing-map) --------------------------------------- */

/* Copies source s's counts for node m into the node table. */
static void publish_counts(run_t *run, int m, int s, const int32_t *per_rank, const int32_t *per_expert)
{
    node_shared_t *node = &run->nodes[m];
    memcpy(node->per_rank + (size_t)s * run->P, per_rank, sizeof(int32_t) * (size_t)run->P);
    memcpy(node->per_expert + (size_t)s * run->P * run->L, per_expert,
           sizeof(int32_t) * (size_t)(run->P * run->L));
}

void proto_publish_own_counts(rank_t *rk)
{
    const run_t *run = rk->run;
    publish_counts(rk->run, rk->m, rk->r, rk->to_rank + rk->m * run->P,
                   rk->per_expert + rk->m * run->P * run->L);
}

int proto_send_counts(rank_t *rk, int n, int sig)
{
    run_t *run = rk->run;
    uint8_t *msg = rk->send + proto_off_notify(run, n);
    put32(msg, 0, rk->to_node[n]);
    for (int q = 0; q < run->P; q++) put32(msg, 1 + (size_t)q, rk->to_rank[n * run->P + q]);
    for (int i = 0; i < run->P * run->L; i++)
        put32(msg, 1 + (size_t)run->P + (size_t)i, rk->per_expert[n * run->P * run->L + i]);
    return proto_net_put(rk, "notify", CTX_DISPATCH, n * run->P + rk->l, proto_off_notify(run, rk->m),
                         proto_off_notify(run, n), run->cmsg, sig, EPX_NET_SIGNAL_WEAK);
}

int proto_counts_in(rank_t *rk)
{
    run_t *run = rk->run;
    int32_t per_rank[32], per_expert[32 * 64]; /* P <= 16, P * L <= E <= 2048 */
    for (int n = 0; n < run->N; n++) {
        if (n == rk->m) continue;
        const int s = n * run->P + rk->l;
        const uint8_t *msg = rk->recv + proto_off_notify(run, n);
        const int32_t packets = get32(msg, 0);
        if (packets < 0 || packets > run->T_max)
            return proto_fail(rk, "notify: peer %d announces %d packets (T_max %lld)", s, packets,
                              (long long)run->T_max);
        for (int q = 0; q < run->P; q++) {
            per_rank[q] = get32(msg, 1 + (size_t)q);
            if (per_rank[q] < 0 || per_rank[q] > packets)
                return proto_fail(rk, "notify: peer %d announces %d tokens for local rank %d of %d packets",
                                  s, per_rank[q], q, packets);
        }
        for (int i = 0; i < run->P * run->L; i++) {
            per_expert[i] = get32(msg, 1 + (size_t)run->P + (size_t)i);
            if (per_expert[i] < 0 || per_expert[i] > per_rank[i / run->L])
                return proto_fail(rk, "notify: peer %d announces %d tokens for expert %d", s, per_expert[i],
                                  i);
        }
        rk->remote_packets[n] = packets;
        publish_counts(run, rk->m, s, per_rank, per_expert);
    }
    return 0;
}

int64_t proto_row_base(const run_t *run, int m, int q, int s)
{
    int64_t base = 0;
    for (int s2 = 0; s2 < s; s2++) base += run->nodes[m].per_rank[(size_t)s2 * run->P + q];
    return base;
}
