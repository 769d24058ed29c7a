/*
 * The internode LL protocol of README.md on the host model: one thread per rank, node-shared memory with
 * C11 atomics inside a node, net.h between nodes. Every (token, selected expert) goes straight to slot
 * [local expert][source][index] of its owner, a count per (source, local expert) follows; every expert
 * output goes straight back to its source, which reduces over k ascending. Two buffers alternate, so two
 * batches are in flight; an owner's credit frees a buffer for the batch after next. The numeric helpers
 * (bf16, the fp8 cast, one fp32 product or add) are the pinned formats of tests/common/reference.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ll_proto.h"
#include "proto_impl.h"
#include "reference.h"

/* Signals of a rank, per buffer u: COUNT(u, j, s) for each local expert and source, COMBINE(u), CREDIT(u). */
#define SIG_COUNT(u, j, s) \
    (((uint32_t)(u) * (uint32_t)run->L + (uint32_t)(j)) * (uint32_t)run->R + (uint32_t)(s))
#define SIG_LL_COMBINE(u) (2u * (uint32_t)run->L * (uint32_t)run->R + (uint32_t)(u))
#define SIG_CREDIT(u)     (2u * (uint32_t)run->L * (uint32_t)run->R + 2u + (uint32_t)(u))
#define COUNT_ANNOUNCED   (1ull << 32) /* a count's high word grows by count + 1 once announced */

typedef struct ll_run {
    const ll_config_t *cfg;
    ll_make_y_fn make_y;
    void *y_ctx;
    int64_t M;        /* rows per local expert: R * T_max */
    size_t msg;       /* one token message: int32 token, then x (bf16, or e4m3 and H/128 fp32 scales) */
    size_t off_slots; /* [2][L][R][T_max] messages (RECV) */
    size_t off_y;     /* [2][L][M][H] bf16 combine input (SEND) */
    size_t off_back;  /* [2][E][T_max][H] bf16 expert outputs back at the source (RECV) */
    size_t buf_stage, buf_slots, buf_y, buf_back; /* one buffer's part */
    const ll_input_t *in;
    ll_output_t *out;
} ll_run_t;

typedef struct ll_rank {
    const ll_input_t *in; /* the current batch's */
    ll_output_t *out;
    int b, u;                             /* the current batch and its buffer b % 2 */
    int32_t *slot;                        /* [T_max, K] index of t among this rank's tokens to topk[t, k] */
    int32_t *to_expert;                   /* [E] tokens of this rank to each expert */
    uint64_t *count_seen;                 /* [2][L][R] what the count signals held after their last use */
    uint64_t combine_seen[2];             /* the same for COMBINE(u) */
    atomic_uint_fast64_t *local_count;    /* [2][L][R] (use << 32) | count from each source of the node */
    atomic_uint_fast64_t local_credit[2]; /* credits for buffer u from the ranks of the node */
} ll_rank_t;

static ll_run_t *llr(const run_t *run)
{
    return run->ll;
}
static ll_rank_t *llk(const rank_t *rk)
{
    return rk->ll;
}

/* In buffer u: slot i of source s for local expert j; the staging of this rank's token t; the combine
 * input row of local expert j; expert e's output for this rank's token t. */
static uint64_t off_slot(const run_t *run, int u, int j, int s, int64_t i)
{
    const ll_run_t *lr = llr(run);
    return lr->off_slots + (uint64_t)u * lr->buf_slots +
           (((uint64_t)j * (uint64_t)run->R + (uint64_t)s) * (uint64_t)run->T_max + (uint64_t)i) * lr->msg;
}
static uint64_t off_stage(const run_t *run, int u, int64_t t)
{
    return (uint64_t)u * llr(run)->buf_stage + (uint64_t)t * llr(run)->msg;
}
static uint64_t off_y(const run_t *run, int u, int j, int64_t row)
{
    const ll_run_t *lr = llr(run);
    return lr->off_y + (uint64_t)u * lr->buf_y +
           ((uint64_t)j * (uint64_t)lr->M + (uint64_t)row) * 2 * (uint64_t)run->H;
}
static uint64_t off_back(const run_t *run, int u, int64_t e, int64_t t)
{
    const ll_run_t *lr = llr(run);
    return lr->off_back + (uint64_t)u * lr->buf_back +
           ((uint64_t)e * (uint64_t)run->T_max + (uint64_t)t) * 2 * (uint64_t)run->H;
}

static int same_node(const rank_t *rk, int peer)
{
    return peer / rk->run->P == rk->m;
}

/* `bytes` from this rank's SEND at src to peer's RECV at dst: a store inside the node, a put with a WEAK
 * signal (sig >= 0) or without across nodes. */
static int deliver(rank_t *rk, const char *stage, uint32_t ctx, int peer, uint64_t dst, uint64_t src,
                   uint64_t bytes, int sig)
{
    if (!same_node(rk, peer))
        return proto_net_put(rk, stage, ctx, peer, dst, src, bytes, sig, EPX_NET_SIGNAL_WEAK);
    memcpy(rk->run->ranks[peer].recv + dst, rk->send + src, bytes);
    proto_count_local(rk, peer, bytes);
    return 0;
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
        uint8_t *msg = rk->send + off_stage(run, lk->u, t);
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
    const int weak_slots = llr(run)->cfg->variant == LL_WEAK_SLOTS, u = lk->u;
    for (int64_t t = 0; t < lk->in->T; t++)
        for (int k = 0; k < run->K; k++) {
            const int32_t i = lk->slot[t * run->K + k];
            if (i < 0) continue;
            const int64_t e = lk->in->topk[t * run->K + k];
            const int d = (int)(e / run->L), j = (int)(e % run->L);
            if (deliver(rk, "dispatch", CTX_DISPATCH, d, off_slot(run, u, j, rk->r, i), off_stage(run, u, t),
                        msg, weak_slots ? (int)SIG_COUNT(u, j, rk->r) : -1))
                return 1;
        }
    return 0;
}

/* The count of this rank's tokens to every expert, after its slots: inside the node a release store of
 * (use << 32) | count, use = b / 2 + 1; across nodes a signal whose high word grows by count + 1 and
 * whose low word by count (README.md, "Counts"). */
static int send_counts(rank_t *rk)
{
    run_t *run = rk->run;
    ll_rank_t *lk = llk(rk);
    const ll_variant_t v = llr(run)->cfg->variant;
    for (int e = 0; e < run->E; e++) {
        const int d = e / run->L, j = e % run->L;
        const uint64_t c = (uint64_t)lk->to_expert[e];
        if (same_node(rk, d)) {
            atomic_store_explicit(&llk(&run->ranks[d])->local_count[(lk->u * run->L + j) * run->R + rk->r],
                                  (uint64_t)(lk->b / 2 + 1) * COUNT_ANNOUNCED + c, memory_order_release);
            continue;
        }
        if (v == LL_DROP_COUNT && rk->r == 0 && e == run->E - 1) continue;
        /* In LL_WEAK_SLOTS the slots' own signals bring the low word to c. */
        const uint64_t add = (c + 1) * COUNT_ANNOUNCED + (v == LL_WEAK_SLOTS ? 0 : c);
        const epx_net_signal_mode_t mode =
            v == LL_WEAK_SLOTS || v == LL_WRONG_WEAK_COUNT ? EPX_NET_SIGNAL_WEAK : EPX_NET_SIGNAL_STRONG;
        const epx_net_status_t s =
            epx_net_signal_add(&rk->net, CTX_DISPATCH, d, SIG_COUNT(lk->u, j, rk->r), add, mode);
        if (s != EPX_NET_OK)
            return proto_fail(rk, "dispatch: count of expert %d to peer %d: %s", e, d,
                              epx_net_status_name(s));
    }
    return 0;
}

/* The count from source s for local expert j, once every slot it covers is visible here. A remote count
 * signal is read relative to what it held after the buffer's last use. */
static int count_in(rank_t *rk, int j, int s, int32_t *count)
{
    run_t *run = rk->run;
    ll_rank_t *lk = llk(rk);
    const size_t at = ((size_t)lk->u * run->L + j) * run->R + s;
    const uint32_t sig = SIG_COUNT(lk->u, j, s);
    char stage[64];
    snprintf(stage, sizeof(stage), "dispatch %d: count of local expert %d", lk->b, j);
    uint64_t v;
    if (same_node(rk, s)) {
        const uint64_t use = (uint64_t)(lk->b / 2 + 1);
        char what[48];
        snprintf(what, sizeof(what), "the count of rank %d", s);
        if (proto_wait_local(rk, stage, &lk->local_count[at], use * COUNT_ANNOUNCED, what)) return 1;
        v = atomic_load_explicit(&lk->local_count[at], memory_order_acquire);
        if (v >> 32 != use)
            return proto_fail(rk, "%s: rank %d's count is of use %llu, not %llu", stage, s,
                              (unsigned long long)(v >> 32), (unsigned long long)use);
        v &= 0xffffffffu;
    } else {
        epx_net_status_t st;
        if (proto_wait_signal(rk, stage, sig, lk->count_seen[at] + COUNT_ANNOUNCED, s)) return 1;
        if ((st = epx_net_signal_read(&rk->net, sig, &v)) != EPX_NET_OK)
            return proto_fail(rk, "%s: reading signal %u: %s", stage, sig, epx_net_status_name(st));
        v = ((v - lk->count_seen[at]) >> 32) - 1;
    }
    if (v > (uint64_t)run->T_max)
        return proto_fail(rk, "%s: peer %d announces %llu tokens (T_max %lld)", stage, s,
                          (unsigned long long)v, (long long)run->T_max);
    if (!same_node(rk, s)) {
        lk->count_seen[at] += (v + 1) * COUNT_ANNOUNCED + v;
        if (proto_wait_signal(rk, stage, sig, lk->count_seen[at], s)) return 1;
    }
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
                const uint8_t *msg = rk->recv + off_slot(run, llk(rk)->u, j, s, i);
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

/* Buffer u is read: a credit to every rank (every rank is a source of every owner), unless no later batch
 * uses the buffer. Across nodes a WEAK signal without bytes: it orders nothing, it only says so. */
static int give_credits(rank_t *rk)
{
    run_t *run = rk->run;
    ll_rank_t *lk = llk(rk);
    if (lk->b + 2 >= llr(run)->cfg->batches || llr(run)->cfg->variant == LL_WRONG_NO_CREDIT) return 0;
    for (int s = 0; s < run->R; s++) {
        if (same_node(rk, s)) {
            atomic_fetch_add_explicit(&llk(&run->ranks[s])->local_credit[lk->u], 1, memory_order_release);
            continue;
        }
        const epx_net_status_t st =
            epx_net_signal_add(&rk->net, CTX_DISPATCH, s, SIG_CREDIT(lk->u), 1, EPX_NET_SIGNAL_WEAK);
        if (st != EPX_NET_OK)
            return proto_fail(rk, "dispatch %d: credit to peer %d: %s", lk->b, s, epx_net_status_name(st));
    }
    return 0;
}

/* Before batch b reuses buffer u: every owner has read it for batch b - 2 (its credit arrived). */
static int take_credits(rank_t *rk)
{
    run_t *run = rk->run;
    ll_rank_t *lk = llk(rk);
    if (lk->b < 2 || llr(run)->cfg->variant == LL_WRONG_NO_CREDIT) return 0;
    const uint64_t uses = (uint64_t)(lk->b / 2);
    char stage[48];
    snprintf(stage, sizeof(stage), "dispatch %d: credits of buffer %d", lk->b, lk->u);
    return proto_wait_local(rk, stage, &lk->local_credit[lk->u], uses * (uint64_t)run->P, "the credits") ||
           proto_wait_signal(rk, stage, SIG_CREDIT(lk->u), uses * (uint64_t)(run->R - run->P), -2);
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
            const int u = llk(rk)->u;
            lr->make_y(lr->y_ctx, llk(rk)->b, rk->r, j, s, t,
                       (uint16_t *)(void *)(rk->send + off_y(run, u, j, i)));
            if (deliver(rk, "combine", CTX_COMBINE, s, off_back(run, u, e, t), off_y(run, u, j, i), bytes,
                        (int)SIG_LL_COMBINE(u)))
                return 1;
        }
    return 0;
}

/* Waits for every expert output of this rank's tokens, then sums slots k ascending: acc += w * y. */
static int reduce(rank_t *rk)
{
    run_t *run = rk->run;
    ll_rank_t *lk = llk(rk);
    const int64_t T = lk->in->T, H = run->H;
    uint64_t remote = 0;
    for (int64_t t = 0; t < T; t++)
        for (int k = 0; k < run->K; k++) {
            const int64_t e = lk->in->topk[t * run->K + k];
            remote += e >= 0 && !same_node(rk, (int)(e / run->L));
        }
    /* Node barrier b + 1: every rank of the node stored its outputs for this node's sources. */
    lk->combine_seen[lk->u] += remote;
    if (proto_node_barrier(rk, "combine", (uint64_t)lk->b + 1) ||
        proto_wait_signal(rk, "combine", SIG_LL_COMBINE(lk->u), lk->combine_seen[lk->u], -2))
        return 1;
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = 0; c < H; c++) {
            float acc = 0.0f;
            for (int k = 0; k < run->K; k++) {
                const int64_t e = lk->in->topk[t * run->K + k];
                if (e < 0) continue;
                uint16_t y;
                memcpy(&y, rk->recv + off_back(run, lk->u, e, t) + 2 * c, 2);
                acc = ref_fadd(acc, ref_fmul(lk->in->weights[t * run->K + k], ref_bf16_to_f32(y)));
            }
            lk->out->combined[t * H + c] = ref_f32_to_bf16(acc);
        }
    return 0;
}

/* Makes batch b the current one. */
static void batch(rank_t *rk, int b)
{
    const run_t *run = rk->run;
    ll_rank_t *lk = llk(rk);
    lk->b = b;
    lk->u = b % 2;
    lk->in = &llr(run)->in[b * run->R + rk->r];
    lk->out = &llr(run)->out[b * run->R + rk->r];
}

/* The send half of batch b's dispatch (the slots and counts), once the buffer is free. */
static int dispatch_send(rank_t *rk, int b)
{
    batch(rk, b);
    memset(llk(rk)->to_expert, 0, sizeof(int32_t) * (size_t)rk->run->E);
    const uint64_t before = rk->stats.net_bytes;
    const int rc = take_credits(rk) || layout(rk) || send_slots(rk) || send_counts(rk);
    rk->stats.dispatch_net_bytes += rk->stats.net_bytes - before;
    return rc;
}

/* The receive half of batch b's dispatch, its credits, and its combine. */
static int receive_combine(rank_t *rk, int b)
{
    batch(rk, b);
    return receive(rk) || give_credits(rk) || proto_flush(rk, "dispatch", CTX_DISPATCH) || send_back(rk) ||
           reduce(rk) || proto_flush(rk, "combine", CTX_COMBINE);
}

/* Two batches in flight: batch b + 1 is sent before batch b is received and combined. */
static void *ll_rank_main(void *arg)
{
    rank_t *rk = arg;
    const int B = llr(rk->run)->cfg->batches;
    for (int b = 0; b < B; b++)
        if (dispatch_send(rk, b) || (b > 0 && receive_combine(rk, b - 1))) return NULL;
    receive_combine(rk, B - 1);
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

/* Batch b's outputs of one rank, garbage until written. */
static int setup_output(const run_t *run, const ll_input_t *in, ll_output_t *out)
{
    const ll_config_t *cfg = llr(run)->cfg;
    const size_t rows = (size_t)run->L * (size_t)llr(run)->M, H = (size_t)run->H;
    out->count = proto_garbage((size_t)run->L * 4);
    out->x = cfg->fp8 ? NULL : proto_garbage(rows * H * 2);
    out->x8 = cfg->fp8 ? proto_garbage(rows * H) : NULL;
    out->scales = cfg->fp8 ? proto_garbage(rows * (H / 128) * 4) : NULL;
    out->src = proto_garbage(rows * 4);
    out->tok = proto_garbage(rows * 4);
    out->range = proto_garbage((size_t)run->L * (size_t)run->R * 8);
    out->combined = proto_garbage((size_t)in->T * H * 2);
    return !out->count || (!cfg->fp8 && !out->x) || (cfg->fp8 && (!out->x8 || !out->scales)) || !out->src ||
           !out->tok || !out->range || !out->combined;
}

/* A rank's state; its first error goes to batch 0's output. */
static int setup_rank(run_t *run, rank_t *rk, ll_rank_t *lk)
{
    const size_t counts = 2 * (size_t)run->L * (size_t)run->R;
    rk->ll = lk;
    rk->error = llr(run)->out[rk->r].error;
    rk->error_len = sizeof(llr(run)->out[rk->r].error);
    lk->slot = calloc((size_t)run->T_max * (size_t)run->K, sizeof(int32_t));
    lk->to_expert = calloc((size_t)run->E, sizeof(int32_t));
    lk->count_seen = calloc(counts, sizeof(uint64_t));
    lk->local_count = calloc(counts, sizeof(atomic_uint_fast64_t));
    if (!lk->slot || !lk->to_expert || !lk->count_seen || !lk->local_count) return 1;
    for (size_t i = 0; i < counts; i++) atomic_init(&lk->local_count[i], 0);
    atomic_init(&lk->local_credit[0], 0);
    atomic_init(&lk->local_credit[1], 0);
    return 0;
}

int ll_run(const ll_config_t *cfg, const ll_input_t *in, ll_make_y_fn make_y, void *y_ctx, ll_output_t *out,
           proto_stats_t *stats, char *err, size_t err_len)
{
    ll_run_t lr = {.cfg = cfg, .make_y = make_y, .y_ctx = y_ctx, .in = in, .out = out};
    run_t run = {.ll = &lr};
    if (proto_run_init(&run, &cfg->frame, err, err_len)) return 1;
    const int R = run.R;
    if ((cfg->fp8 && run.H % 128) || cfg->batches < 1 || cfg->batches > 8) {
        snprintf(err, err_len, "bad config: fp8 %d with H %lld, %d batches", cfg->fp8, (long long)run.H,
                 cfg->batches);
        return 1;
    }
    const int outs = cfg->batches * R;
    for (int i = 0; i < outs; i++)
        if (in[i].T < 0 || in[i].T > run.T_max) {
            snprintf(err, err_len, "bad input: batch %d, rank %d has %lld tokens (T_max %lld)", i / R, i % R,
                     (long long)in[i].T, (long long)run.T_max);
            return 1;
        }
    memset(out, 0, sizeof(*out) * (size_t)outs);
    lr.M = (int64_t)R * run.T_max;
    const size_t H = (size_t)run.H, T_max = (size_t)run.T_max;
    lr.msg = (4 + (cfg->fp8 ? H + 4 * (H / 128) : 2 * H) + 7) & ~(size_t)7;
    lr.buf_stage = lr.msg * T_max;
    lr.buf_slots = lr.msg * (size_t)run.L * (size_t)R * T_max;
    lr.buf_y = 2 * H * (size_t)run.L * (size_t)lr.M;
    lr.buf_back = 2 * H * (size_t)run.E * T_max;
    lr.off_slots = 2 * lr.buf_stage;
    lr.off_y = lr.off_slots + 2 * lr.buf_slots;
    lr.off_back = lr.off_y + 2 * lr.buf_y;
    run.region_bytes = lr.off_back + 2 * lr.buf_back;
    ll_rank_t *lk = calloc((size_t)R, sizeof(ll_rank_t));
    int rc = !lk || proto_run_open(&run, 2, 2 * (uint32_t)(run.L * R) + 4);
    for (int r = 0; !rc && r < R; r++) rc = setup_rank(&run, &run.ranks[r], &lk[r]);
    for (int i = 0; !rc && i < outs; i++) rc = setup_output(&run, &in[i], &out[i]);
    if (rc && !err[0]) snprintf(err, err_len, "setup failed");
    if (!rc) rc = proto_run_threads(&run, ll_rank_main, stats);
    for (int r = 0; lk && r < R; r++) {
        free(lk[r].slot);
        free(lk[r].to_expert);
        free(lk[r].count_seen);
        free(lk[r].local_count);
    }
    free(lk);
    proto_run_close(&run);
    return rc;
}
