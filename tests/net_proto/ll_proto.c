/*
 * The internode LL protocol of README.md on the host model: one thread per rank, node-shared memory with
 * C11 atomics inside a node, net.h between nodes. Every (token, selected expert) goes straight to slot
 * [local expert][source][index] of its owner, a count per (source, local expert) follows; every expert
 * output goes straight back to its source, which reduces over k ascending. The numeric helpers (bf16,
 * the fp8 cast, one fp32 product or add) are the pinned formats of tests/common/reference.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ll_proto.h"
#include "proto_impl.h"
#include "reference.h"

/* Signals of a rank: COUNT(j, s) for each local expert and source, then the combine's. */
#define SIG_COUNT(j, s) ((uint32_t)(j) * (uint32_t)run->R + (uint32_t)(s))
#define SIG_LL_COMBINE  ((uint32_t)run->L * (uint32_t)run->R)
#define COUNT_ANNOUNCED (1ull << 32) /* a count signal's high word holds count + 1 once announced */

typedef struct ll_run {
    const ll_config_t *cfg;
    ll_make_y_fn make_y;
    void *y_ctx;
    int64_t M;        /* rows per local expert: R * T_max */
    size_t msg;       /* one token message: int32 token, then x (bf16, or e4m3 and H/128 fp32 scales) */
    size_t off_slots; /* [L][R][T_max] messages (RECV) */
    size_t off_y;     /* [L][M][H] bf16 combine input (SEND) */
    size_t off_back;  /* [E][T_max][H] bf16 expert outputs back at the source (RECV) */
} ll_run_t;

typedef struct ll_rank {
    const ll_input_t *in;
    ll_output_t *out;
    int32_t *slot;                     /* [T, K] index of t among this rank's tokens to topk[t, k] */
    int32_t *to_expert;                /* [E] tokens of this rank to each expert */
    atomic_uint_fast64_t *local_count; /* [L][R] count + 1 from each source of this node (node-shared) */
} ll_rank_t;

static ll_run_t *llr(const run_t *run)
{
    return run->ll;
}
static ll_rank_t *llk(const rank_t *rk)
{
    return rk->ll;
}

/* Slot i of source s for local expert j; the staging of this rank's token t; an expert output's place. */
static uint64_t off_slot(const run_t *run, int j, int s, int64_t i)
{
    return llr(run)->off_slots +
           (((uint64_t)j * (uint64_t)run->R + (uint64_t)s) * (uint64_t)run->T_max + (uint64_t)i) *
               llr(run)->msg;
}
static uint64_t off_stage(const run_t *run, int64_t t)
{
    return (uint64_t)t * llr(run)->msg;
}
static uint64_t off_y(const run_t *run, int j, int64_t row)
{
    return llr(run)->off_y + ((uint64_t)j * (uint64_t)llr(run)->M + (uint64_t)row) * 2 * (uint64_t)run->H;
}
static uint64_t off_back(const run_t *run, int64_t e, int64_t t)
{
    return llr(run)->off_back + ((uint64_t)e * (uint64_t)run->T_max + (uint64_t)t) * 2 * (uint64_t)run->H;
}

static int same_node(const rank_t *rk, int peer)
{
    return peer / rk->run->P == rk->m;
}

/* Bytes one rank copies into another's memory inside the node (or its own). */
static void count_local(rank_t *rk, int peer, uint64_t bytes)
{
    if (peer == rk->r)
        rk->stats.self_bytes += bytes;
    else
        rk->stats.nvlink_bytes += bytes;
}

/* ---- dispatch -------------------------------------------------------------------------------------- */

/* Each (token, slot)'s index among this rank's tokens to its expert; the message of each token staged. */
static int layout(rank_t *rk)
{
    run_t *run = rk->run;
    ll_rank_t *lk = llk(rk);
    const ll_config_t *cfg = llr(run)->cfg;
    for (int64_t t = 0; t < lk->in->T; t++) {
        for (int k = 0; k < run->K; k++) {
            const int64_t e = lk->in->topk[t * run->K + k];
            lk->slot[t * run->K + k] = -1;
            if (e < 0) continue;
            if (e >= run->E)
                return proto_fail(rk, "dispatch: token %lld selects expert %lld", (long long)t, (long long)e);
            for (int k2 = 0; k2 < k; k2++)
                if (lk->in->topk[t * run->K + k2] == e)
                    return proto_fail(rk, "dispatch: token %lld selects expert %lld twice", (long long)t,
                                      (long long)e);
            lk->slot[t * run->K + k] = lk->to_expert[e]++;
        }
        uint8_t *msg = rk->send + off_stage(run, t);
        put32(msg, 0, (int32_t)t);
        if (cfg->fp8)
            ref_ll_cast(lk->in->x + t * run->H, run->H, cfg->round_scale != 0, msg + 4,
                        (float *)(void *)(msg + 4 + run->H));
        else
            memcpy(msg + 4, lk->in->x + t * run->H, 2 * (size_t)run->H);
    }
    return 0;
}

/* Every (token, selected expert) to slot [j][this rank][index] of the owner: a store inside the node, a
 * put (with a WEAK signal in LL_WEAK_SLOTS) across nodes. */
static int send_slots(rank_t *rk)
{
    run_t *run = rk->run;
    ll_rank_t *lk = llk(rk);
    const uint64_t msg = llr(run)->msg;
    const int weak_slots = llr(run)->cfg->variant == LL_WEAK_SLOTS;
    for (int64_t t = 0; t < lk->in->T; t++)
        for (int k = 0; k < run->K; k++) {
            const int32_t i = lk->slot[t * run->K + k];
            if (i < 0) continue;
            const int64_t e = lk->in->topk[t * run->K + k];
            const int d = (int)(e / run->L), j = (int)(e % run->L);
            if (same_node(rk, d)) {
                memcpy(run->ranks[d].recv + off_slot(run, j, rk->r, i), rk->send + off_stage(run, t), msg);
                count_local(rk, d, msg);
            } else if (proto_net_put(rk, "dispatch", CTX_DISPATCH, d, off_slot(run, j, rk->r, i),
                                     off_stage(run, t), msg, weak_slots ? (int)SIG_COUNT(j, rk->r) : -1,
                                     EPX_NET_SIGNAL_WEAK)) {
                return 1;
            }
        }
    return 0;
}

/* The count of this rank's tokens to every expert, after its slots: inside the node a release store of
 * count + 1; across nodes a signal whose high word becomes count + 1 and whose low word ends at count
 * (README.md, "Counts"). */
static int send_counts(rank_t *rk)
{
    run_t *run = rk->run;
    ll_rank_t *lk = llk(rk);
    const ll_variant_t v = llr(run)->cfg->variant;
    for (int e = 0; e < run->E; e++) {
        const int d = e / run->L, j = e % run->L;
        const uint64_t c = (uint64_t)lk->to_expert[e];
        if (same_node(rk, d)) {
            atomic_store_explicit(&llk(&run->ranks[d])->local_count[j * run->R + rk->r], c + 1,
                                  memory_order_release);
            continue;
        }
        if (v == LL_DROP_COUNT && rk->r == 0 && e == run->E - 1) continue;
        /* In LL_WEAK_SLOTS the slots' own signals bring the low word to c. */
        const uint64_t add = (c + 1) * COUNT_ANNOUNCED + (v == LL_WEAK_SLOTS ? 0 : c);
        const epx_net_signal_mode_t mode =
            v == LL_STRONG_COUNT || v == LL_DROP_COUNT ? EPX_NET_SIGNAL_STRONG : EPX_NET_SIGNAL_WEAK;
        const epx_net_status_t s =
            epx_net_signal_add(&rk->net, CTX_DISPATCH, d, SIG_COUNT(j, rk->r), add, mode);
        if (s != EPX_NET_OK)
            return proto_fail(rk, "dispatch: count of expert %d to peer %d: %s", e, d,
                              epx_net_status_name(s));
    }
    return 0;
}

/* The count from source s for local expert j, once every slot it covers is visible here. */
static int count_in(rank_t *rk, int j, int s, int32_t *count)
{
    run_t *run = rk->run;
    char stage[64];
    snprintf(stage, sizeof(stage), "dispatch: count of local expert %d", j);
    uint64_t v;
    if (same_node(rk, s)) {
        atomic_uint_fast64_t *word = &llk(rk)->local_count[j * run->R + s];
        char what[48];
        snprintf(what, sizeof(what), "the count of rank %d", s);
        if (proto_wait_local(rk, stage, word, 1, what)) return 1;
        v = atomic_load_explicit(word, memory_order_acquire) - 1;
    } else {
        epx_net_status_t st;
        if (proto_wait_signal(rk, stage, SIG_COUNT(j, s), COUNT_ANNOUNCED, s)) return 1;
        if ((st = epx_net_signal_read(&rk->net, SIG_COUNT(j, s), &v)) != EPX_NET_OK)
            return proto_fail(rk, "%s: reading signal %u: %s", stage, SIG_COUNT(j, s),
                              epx_net_status_name(st));
        v = (v >> 32) - 1;
    }
    if (v > (uint64_t)run->T_max)
        return proto_fail(rk, "%s: peer %d announces %llu tokens (T_max %lld)", stage, s,
                          (unsigned long long)v, (long long)run->T_max);
    if (!same_node(rk, s) && proto_wait_signal(rk, stage, SIG_COUNT(j, s), (v + 1) * COUNT_ANNOUNCED + v, s))
        return 1;
    *count = (int32_t)v;
    return 0;
}

/* Per local expert, sources ascending: the slots into packed rows, checked; the handle's ranges. */
static int receive(rank_t *rk)
{
    run_t *run = rk->run;
    const ll_run_t *lr = llr(run);
    ll_output_t *o = llk(rk)->out;
    const int64_t H = run->H, G = H / 128;
    for (int j = 0; j < run->L; j++) {
        int64_t rows = 0;
        for (int s = 0; s < run->R; s++) {
            int32_t c = 0;
            if (count_in(rk, j, s, &c)) return 1;
            for (int64_t i = 0; i < c; i++) {
                const uint8_t *msg = rk->recv + off_slot(run, j, s, i);
                const int32_t tok = get32(msg, 0);
                if (tok < 0 || tok >= run->T_max)
                    return proto_fail(rk,
                                      "dispatch: slot %lld of local expert %d from peer %d holds token %d",
                                      (long long)i, j, s, tok);
                const int64_t row = j * lr->M + rows + i;
                o->src[row] = s;
                o->tok[row] = tok;
                if (!lr->cfg->fp8) {
                    memcpy(o->x + row * H, msg + 4, 2 * (size_t)H);
                    continue;
                }
                memcpy(o->x8 + row * H, msg + 4, (size_t)H);
                for (int64_t g = 0; g < G; g++)
                    memcpy(o->scales + (j * G + g) * lr->M + rows + i, msg + 4 + H + 4 * g, 4);
            }
            o->range[j * run->R + s] = c ? (rows << 32) | c : 0;
            rows += c;
        }
        o->count[j] = (int32_t)rows;
    }
    return 0;
}

/* ---- combine --------------------------------------------------------------------------------------- */

/* Every received row's expert output straight back to its source, at [expert][token] there. */
static int send_back(rank_t *rk)
{
    run_t *run = rk->run;
    const ll_run_t *lr = llr(run);
    const ll_output_t *o = llk(rk)->out;
    const uint64_t bytes = 2 * (uint64_t)run->H;
    for (int j = 0; j < run->L; j++)
        for (int64_t i = 0; i < o->count[j]; i++) {
            const int s = o->src[j * lr->M + i];
            const int32_t t = o->tok[j * lr->M + i];
            const int64_t e = (int64_t)rk->r * run->L + j;
            uint16_t *y = (uint16_t *)(void *)(rk->send + off_y(run, j, i));
            lr->make_y(lr->y_ctx, rk->r, j, s, t, y);
            if (same_node(rk, s)) {
                memcpy(run->ranks[s].recv + off_back(run, e, t), y, bytes);
                count_local(rk, s, bytes);
            } else if (proto_net_put(rk, "combine", CTX_COMBINE, s, off_back(run, e, t), off_y(run, j, i),
                                     bytes, (int)SIG_LL_COMBINE, EPX_NET_SIGNAL_WEAK)) {
                return 1;
            }
        }
    return 0;
}

/* Waits for every expert output of this rank's tokens, then sums slots k ascending: acc += w * y. */
static int reduce(rank_t *rk)
{
    run_t *run = rk->run;
    const ll_rank_t *lk = llk(rk);
    const int64_t T = lk->in->T, H = run->H;
    uint64_t remote = 0;
    for (int64_t t = 0; t < T; t++)
        for (int k = 0; k < run->K; k++) {
            const int64_t e = lk->in->topk[t * run->K + k];
            remote += e >= 0 && !same_node(rk, (int)(e / run->L));
        }
    /* Node barrier 1: every rank of the node stored its outputs for this node's sources. */
    if (proto_node_barrier(rk, "combine", 1) || proto_wait_signal(rk, "combine", SIG_LL_COMBINE, remote, -2))
        return 1;
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = 0; c < H; c++) {
            float acc = 0.0f;
            for (int k = 0; k < run->K; k++) {
                const int64_t e = lk->in->topk[t * run->K + k];
                if (e < 0) continue;
                uint16_t y;
                memcpy(&y, rk->recv + off_back(run, e, t) + 2 * c, 2);
                acc = ref_fadd(acc, ref_fmul(lk->in->weights[t * run->K + k], ref_bf16_to_f32(y)));
            }
            lk->out->combined[t * H + c] = ref_f32_to_bf16(acc);
        }
    return 0;
}

static void *ll_rank_main(void *arg)
{
    rank_t *rk = arg;
    if (layout(rk) || send_slots(rk) || send_counts(rk) || receive(rk) ||
        proto_flush(rk, "dispatch", CTX_DISPATCH))
        return NULL;
    rk->stats.dispatch_net_bytes = rk->stats.net_bytes;
    if (send_back(rk) || reduce(rk) || proto_flush(rk, "combine", CTX_COMBINE)) return NULL;
    return NULL;
}

/* ---- the run --------------------------------------------------------------------------------------- */

void ll_output_free(ll_output_t *out, int R)
{
    for (int r = 0; r < R; r++) {
        free(out[r].count);
        free(out[r].x);
        free(out[r].x8);
        free(out[r].scales);
        free(out[r].src);
        free(out[r].tok);
        free(out[r].range);
        free(out[r].combined);
    }
    memset(out, 0, sizeof(*out) * (size_t)R);
}

static int setup_rank(run_t *run, rank_t *rk, ll_rank_t *lk, const ll_input_t *in, ll_output_t *out)
{
    const ll_config_t *cfg = llr(run)->cfg;
    const size_t rows = (size_t)run->L * (size_t)llr(run)->M, H = (size_t)run->H;
    rk->ll = lk;
    rk->error = out->error;
    rk->error_len = sizeof(out->error);
    lk->in = in;
    lk->out = out;
    lk->slot = calloc((size_t)in->T * (size_t)run->K + 1, sizeof(int32_t));
    lk->to_expert = calloc((size_t)run->E, sizeof(int32_t));
    lk->local_count = calloc((size_t)run->L * (size_t)run->R, sizeof(atomic_uint_fast64_t));
    out->count = proto_garbage((size_t)run->L * 4);
    out->x = cfg->fp8 ? NULL : proto_garbage(rows * H * 2);
    out->x8 = cfg->fp8 ? proto_garbage(rows * H) : NULL;
    out->scales = cfg->fp8 ? proto_garbage(rows * (H / 128) * 4) : NULL;
    out->src = proto_garbage(rows * 4);
    out->tok = proto_garbage(rows * 4);
    out->range = proto_garbage((size_t)run->L * (size_t)run->R * 8);
    out->combined = proto_garbage((size_t)in->T * H * 2);
    if (!lk->slot || !lk->to_expert || !lk->local_count || !out->count || (!cfg->fp8 && !out->x) ||
        (cfg->fp8 && (!out->x8 || !out->scales)) || !out->src || !out->tok || !out->range || !out->combined)
        return 1;
    for (int i = 0; i < run->L * run->R; i++) atomic_init(&lk->local_count[i], 0);
    return 0;
}

int ll_run(const ll_config_t *cfg, const ll_input_t *in, ll_make_y_fn make_y, void *y_ctx, ll_output_t *out,
           proto_stats_t *stats, char *err, size_t err_len)
{
    const int R = cfg->nodes * cfg->per_node;
    err[0] = '\0';
    if (cfg->nodes < 1 || cfg->per_node < 1 || R > 16 || cfg->E < 1 || cfg->E % R || cfg->K < 1 ||
        cfg->K > 64 || cfg->H < 1 || cfg->T_max < 1 || cfg->T_max > 0x7fffffff / R ||
        (cfg->fp8 && cfg->H % 128)) {
        snprintf(err, err_len, "bad config: %d x %d ranks, E %d, K %d, H %lld, T_max %lld, fp8 %d",
                 cfg->nodes, cfg->per_node, cfg->E, cfg->K, (long long)cfg->H, (long long)cfg->T_max,
                 cfg->fp8);
        return 1;
    }
    memset(out, 0, sizeof(*out) * (size_t)R);
    ll_run_t lr = {.cfg = cfg, .make_y = make_y, .y_ctx = y_ctx, .M = (int64_t)R * cfg->T_max};
    run_t run = {.N = cfg->nodes,
                 .P = cfg->per_node,
                 .R = R,
                 .E = cfg->E,
                 .L = cfg->E / R,
                 .K = cfg->K,
                 .H = cfg->H,
                 .T_max = cfg->T_max,
                 .timeout_ms = cfg->timeout_ms,
                 .err = err,
                 .err_len = err_len,
                 .ll = &lr};
    const size_t H = (size_t)cfg->H, T_max = (size_t)cfg->T_max;
    lr.msg = (4 + (cfg->fp8 ? H + 4 * (H / 128) : 2 * H) + 7) & ~(size_t)7;
    lr.off_slots = lr.msg * T_max;
    lr.off_y = lr.off_slots + lr.msg * (size_t)run.L * (size_t)R * T_max;
    lr.off_back = lr.off_y + 2 * H * (size_t)run.L * (size_t)lr.M;
    run.region_bytes = lr.off_back + 2 * H * (size_t)run.E * T_max;
    ll_rank_t *lk = calloc((size_t)R, sizeof(ll_rank_t));
    int rc = !lk || proto_run_open(&run, 2, (uint32_t)(run.L * R) + 1, cfg->mode, cfg->model_seed);
    for (int r = 0; !rc && r < R; r++) rc = setup_rank(&run, &run.ranks[r], &lk[r], &in[r], &out[r]);
    if (rc && !err[0]) snprintf(err, err_len, "setup failed");
    if (!rc) rc = proto_run_threads(&run, ll_rank_main, stats);
    for (int r = 0; lk && r < R; r++) {
        free(lk[r].slot);
        free(lk[r].to_expert);
        free(lk[r].local_count);
    }
    free(lk);
    proto_run_close(&run);
    return rc;
}
