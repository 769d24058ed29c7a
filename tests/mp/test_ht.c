/*
 * HT layout, dispatch (default, cached, static-shape with overflow, views of the library's buffer) and
 * combine (caller rows or rows written into the buffer) on the host backend:
 * every rank builds all ranks' inputs from one seed and checks its own outputs against the reference.
 * Combine outputs are compared bit for bit: the reference sums in the pinned fp32 order.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "epx_test.h"
#include "reference.h"

typedef struct ht_case {
    int R, E, K;
    int64_t H, T_max;
    int domain_cap; /* EPX_RANKS_PER_NVLINK_DOMAIN for the run, 0 = unset */
    int iters;
    int per_node; /* ranks per node (ref_run_split_cases), 0 = one node */
} ht_case_t;

static uint64_t g_seed;

/* Rank's x of one tag (with fp8 scales) and the rows (and scales) it must receive for rv. */
typedef struct x_rows {
    uint8_t *x, *e_x;
    float *xs, *e_xs;
} x_rows_t;

static void make_x(ref_arena_t *a, const ref_problem_t *p, int rank, const ref_ht_recv_t *rv, uint64_t tag,
                   x_rows_t *o)
{
    const int64_t Ts = p->T[rank], H = p->H, SG = H / 128, N = rv->n;
    const size_t esz = epx_dtype_size(p->dtype);
    o->x = ref_arena_alloc(a, esz * (size_t)(Ts * H));
    o->xs = ref_arena_alloc(a, sizeof(float) * (size_t)(Ts * SG));
    for (int64_t t = 0; t < Ts; t++) {
        ref_x_row(p, rank, t, tag, o->x + (size_t)(t * H) * esz);
        ref_scales_row(p, rank, t, tag, o->xs + t * SG);
    }
    o->e_x = ref_arena_alloc(a, esz * (size_t)(N * H));
    o->e_xs = ref_arena_alloc(a, sizeof(float) * (size_t)(N * SG));
    for (int64_t i = 0; i < N; i++) {
        ref_x_row(p, rv->src[i], rv->tok[i], tag, o->e_x + (size_t)(i * H) * esz);
        ref_scales_row(p, rv->src[i], rv->tok[i], tag, o->e_xs + i * SG);
    }
}

/* A dispatch of in->x (and its scales for fp8); topk_t.data NULL for a cached dispatch. */
static epx_ht_dispatch_args_t dispatch_args(const ref_problem_t *p, int rank, const x_rows_t *in,
                                            epx_tensor_t topk_t, bool with_weights, int alignment)
{
    const int64_t Ts = p->T[rank], H = p->H, K = p->K;
    epx_ht_dispatch_args_t args = EPX_HT_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(in->x, p->dtype, Ts, H);
    if (p->dtype == EPX_DTYPE_FP8_E4M3) args.x_scales = epx_tensor_2d(in->xs, EPX_DTYPE_FP32, Ts, H / 128);
    args.topk_idx = topk_t;
    if (with_weights) args.topk_weights = epx_tensor_2d(p->weights[rank], EPX_DTYPE_FP32, Ts, K);
    args.expert_alignment = alignment;
    return args;
}

/* Caller outputs of `rows` rows, garbage-filled so unwritten rows show; indices and weights only
 * `with_idx`. */
typedef struct recv_bufs {
    uint8_t *rx;
    float *rxs, *rw;
    void *ridx;
    int32_t *rpe, *nrecv, *rpm, *hpe; /* hpe: num_recv_tokens_per_expert_host */
} recv_bufs_t;

static epx_ht_dispatch_outputs_t caller_outputs(ref_arena_t *a, const ref_problem_t *p, int64_t rows,
                                                epx_dtype_t idx_dtype, bool with_idx, recv_bufs_t *b)
{
    const int64_t H = p->H, SG = H / 128, K = p->K, L = p->L;
    b->rx = ref_arena_garbage(a, epx_dtype_size(p->dtype) * (size_t)(rows * H));
    b->rxs = ref_arena_garbage(a, sizeof(float) * (size_t)(rows * SG));
    b->ridx = ref_arena_garbage(a, 8 * (size_t)(rows * K));
    b->rw = ref_arena_garbage(a, sizeof(float) * (size_t)(rows * K));
    b->rpe = ref_arena_garbage(a, 4 * (size_t)L);
    b->nrecv = ref_arena_garbage(a, 4);
    b->rpm = ref_arena_garbage(a, 4 * (size_t)(p->R * p->R));
    b->hpe = ref_arena_garbage(a, 4 * (size_t)L);
    epx_ht_dispatch_outputs_t outs = EPX_HT_DISPATCH_OUTPUTS_INIT;
    outs.recv_x = epx_tensor_2d(b->rx, p->dtype, rows, H);
    if (p->dtype == EPX_DTYPE_FP8_E4M3) outs.recv_x_scales = epx_tensor_2d(b->rxs, EPX_DTYPE_FP32, rows, SG);
    if (with_idx) {
        outs.recv_topk_idx = epx_tensor_2d(b->ridx, idx_dtype, rows, K);
        outs.recv_topk_weights = epx_tensor_2d(b->rw, EPX_DTYPE_FP32, rows, K);
    }
    outs.num_recv_tokens_per_expert = epx_tensor_1d(b->rpe, EPX_DTYPE_INT32, L);
    outs.num_recv_tokens = epx_tensor_1d(b->nrecv, EPX_DTYPE_INT32, 1);
    outs.rank_prefix_matrix = epx_tensor_2d(b->rpm, EPX_DTYPE_INT32, p->R, p->R);
    outs.num_recv_tokens_per_expert_host = b->hpe;
    return outs;
}

/* The most rows any rank receives (-1 when the reference fails). */
static int64_t max_recv(const ref_problem_t *p)
{
    int64_t most = 0;
    for (int r = 0; r < p->R; r++) {
        ref_ht_recv_t other;
        const int bad = ref_ht_dispatch(p, r, 1, &other);
        if (!bad && other.n > most) most = other.n;
        ref_ht_recv_free(&other);
        if (bad) return -1;
    }
    return most;
}

/* View areas of every buffer here: each rank's view dispatches rotate over them. */
static const int k_areas = 3;

static void fill_idx(const int64_t *src, int64_t n, epx_dtype_t dtype, void *dst)
{
    for (int64_t i = 0; i < n; i++) {
        if (dtype == EPX_DTYPE_INT64)
            ((int64_t *)dst)[i] = src[i];
        else
            ((int32_t *)dst)[i] = (int32_t)src[i];
    }
}

/* Combine inputs of this rank: rows < n from the mapping, the rest a huge value that would show. */
static uint16_t *combine_input(ref_arena_t *a, const ref_ht_recv_t *rv, int64_t cap_rows, int rank,
                               uint64_t yseed, int64_t H)
{
    uint16_t *x = ref_arena_alloc(a, sizeof(uint16_t) * (size_t)(cap_rows * H));
    for (int64_t i = 0; i < cap_rows; i++)
        for (int64_t c = 0; c < H; c++)
            x[i * H + c] = i < rv->n ? ref_y_bf16(yseed, rank, -1, rv->src[i], rv->tok[i], c) : 0x7f00;
    return x;
}

static int run_combine(epx_buffer_t buf, const ref_problem_t *p, int rank, const ref_ht_recv_t *rv,
                       epx_handle_t h, int64_t cap_rows, bool with_weights, bool bias0, bool bias1,
                       uint64_t yseed, int in_buffer, const epx_tensor_t *x_view)
{
    int rc = 0;
    ref_arena_t a = {0};
    int64_t Ts = p->T[rank], H = p->H, K = p->K;
    uint16_t *cx = combine_input(&a, rv, cap_rows, rank, yseed, H);
    float *cw = ref_arena_alloc(&a, sizeof(float) * (size_t)(cap_rows * K));
    memcpy(cw, rv->w, sizeof(float) * (size_t)(rv->n * K));
    uint16_t *b0 = ref_arena_alloc(&a, sizeof(uint16_t) * (size_t)(Ts * H));
    uint16_t *b1 = ref_arena_alloc(&a, sizeof(uint16_t) * (size_t)(Ts * H));
    for (int64_t t = 0; t < Ts; t++)
        for (int64_t c = 0; c < H; c++) {
            b0[t * H + c] = ref_gen_bf16(yseed, REF_TAG_BIAS0, (uint64_t)rank, (uint64_t)t, (uint64_t)c);
            b1[t * H + c] = ref_gen_bf16(yseed, REF_TAG_BIAS1, (uint64_t)rank, (uint64_t)t, (uint64_t)c);
        }
    uint16_t *out = ref_arena_garbage(&a, sizeof(uint16_t) * (size_t)(Ts * H));
    float *out_w = ref_arena_garbage(&a, sizeof(float) * (size_t)(Ts * K));
    uint16_t *exp = ref_arena_alloc(&a, sizeof(uint16_t) * (size_t)(Ts * H));
    float *exp_w = ref_arena_alloc(&a, sizeof(float) * (size_t)(Ts * K));

    epx_ht_combine_args_t args = EPX_HT_COMBINE_ARGS_INIT;
    args.handle = h;
    if (in_buffer == 2) {
        /* The expert outputs overwrite the dispatch view (bf16 recv_x of this handle) in place. */
        memcpy(x_view->data, cx, sizeof(uint16_t) * (size_t)(rv->n * H));
        args.x = *x_view;
        args.x_in_buffer = 2;
    } else if (in_buffer) {
        /* Zero-copy: the expert outputs go straight into the library's rows. */
        epx_tensor_t view;
        CALL(epx_ht_get_combine_input(buf, h, &view));
        CHECK(view.dtype == EPX_DTYPE_BF16 && view.ndim == 2 && view.shape[0] >= rv->n &&
                  view.shape[1] == H && view.data != NULL,
              "combine input view %s [%lld, %lld] at %p, expected bf16 [>= %lld, %lld]",
              epx_dtype_name(view.dtype), (long long)view.shape[0], (long long)view.shape[1], view.data,
              (long long)rv->n, (long long)H);
        if (rc) goto out;
        memcpy(view.data, cx, sizeof(uint16_t) * (size_t)(rv->n * H));
        args.x_in_buffer = 1;
    } else {
        args.x = epx_tensor_2d(cx, EPX_DTYPE_BF16, cap_rows, H);
    }
    if (with_weights) args.topk_weights = epx_tensor_2d(cw, EPX_DTYPE_FP32, cap_rows, K);
    if (bias0) args.bias0 = epx_tensor_2d(b0, EPX_DTYPE_BF16, Ts, H);
    if (bias1) args.bias1 = epx_tensor_2d(b1, EPX_DTYPE_BF16, Ts, H);
    epx_ht_combine_outputs_t outs = EPX_HT_COMBINE_OUTPUTS_INIT;
    outs.combined_x = epx_tensor_2d(out, EPX_DTYPE_BF16, Ts, H);
    if (with_weights) outs.combined_topk_weights = epx_tensor_2d(out_w, EPX_DTYPE_FP32, Ts, K);
    CALL(epx_ht_combine(buf, &args, &outs));

    ref_ht_combine(p, rank, yseed, bias0, bias1, exp, with_weights ? exp_w : NULL);
    rc |= ref_check_bits(rank, "combined_x", out, exp, Ts * H, 2, H);
    if (with_weights) rc |= ref_check_bits(rank, "combined_topk_weights", out_w, exp_w, Ts * K, 4, K);
out:
    ref_arena_free(&a);
    return rc;
}

static int ht_iteration(epx_buffer_t buf, const ht_case_t *hc, int rank, int D, int it)
{
    int rc = 0, R = hc->R, K = hc->K;
    int64_t H = hc->H, SG = H / 128;
    uint64_t seed =
        ref_hash(g_seed, 0x4854, (uint64_t)(hc->per_node * 10000000 + R * 100000 + hc->E * 10 + K),
                 (uint64_t)hc->H, (uint64_t)it);
    static const epx_dtype_t dtypes[3] = {EPX_DTYPE_BF16, EPX_DTYPE_FP32, EPX_DTYPE_FP8_E4M3};
    epx_dtype_t dtype = dtypes[it % 3];
    ref_routing_t routing = (ref_routing_t)((it / 3) % REF_ROUTE_COUNT);
    epx_dtype_t idx_dtype = it % 2 ? EPX_DTYPE_INT64 : EPX_DTYPE_INT32;
    epx_dtype_t out_idx_dtype = (it / 2) % 2 ? EPX_DTYPE_INT64 : EPX_DTYPE_INT32;
    int alignment = (it / 4) % 2 ? 4 : 1;
    bool with_weights = it % 5 != 4, bias0 = it % 3 != 1, bias1 = it % 4 != 2;
    bool fp8 = dtype == EPX_DTYPE_FP8_E4M3;
    size_t esz = epx_dtype_size(dtype);
    int64_t T[REF_MAX_RANKS];
    ref_gen_token_counts(seed, it, R, hc->T_max, T);
    ref_set_case("ht R=%d (%d per node) E=%d K=%d H=%lld T_max=%lld iter %d: x %s, routing %s, topk_idx %s, "
                 "recv_topk_idx %s, alignment %d, weights %d, bias %d%d, T[0]=%lld",
                 R, hc->per_node ? hc->per_node : R, hc->E, K, (long long)H, (long long)hc->T_max, it,
                 epx_dtype_name(dtype), ref_routing_name(routing), epx_dtype_name(idx_dtype),
                 epx_dtype_name(out_idx_dtype), alignment, with_weights, bias0, bias1, (long long)T[0]);

    ref_problem_t p;
    ref_ht_recv_t rv = {0};
    ref_arena_t a = {0};
    epx_handle_t handle = NULL, shandle = NULL;
    if (ref_problem_init(&p, R, hc->E, K, H, hc->T_max, dtype, seed, T, routing) ||
        ref_ht_dispatch(&p, rank, alignment, &rv)) {
        rc = ref_fail(rank, "reference setup failed");
        goto out;
    }
    if (hc->per_node > 0) p.ranks_per_node = hc->per_node;
    int64_t Ts = p.T[rank], L = p.L, N = rv.n;

    /* ---- layout ---- */
    void *topk = ref_arena_alloc(&a, 8 * (size_t)(Ts * K));
    ref_fill_topk(&p, rank, idx_dtype, topk);
    epx_tensor_t topk_t = epx_tensor_2d(topk, idx_dtype, Ts, K);
    {
        int ndom = R / D;
        int32_t *per_rank = ref_arena_garbage(&a, 4 * (size_t)R),
                *per_expert = ref_arena_garbage(&a, 4 * (size_t)hc->E);
        uint8_t *in_rank = ref_arena_garbage(&a, (size_t)(Ts * R));
        int32_t *per_dom = ref_arena_garbage(&a, 4 * (size_t)ndom);
        int32_t *e_rank = ref_arena_alloc(&a, 4 * (size_t)R),
                *e_expert = ref_arena_alloc(&a, 4 * (size_t)hc->E);
        uint8_t *e_in = ref_arena_alloc(&a, (size_t)(Ts * R));
        int32_t *e_dom = ref_arena_alloc(&a, 4 * (size_t)ndom);
        epx_layout_outputs_t lo = EPX_LAYOUT_OUTPUTS_INIT;
        lo.num_tokens_per_rank = epx_tensor_1d(per_rank, EPX_DTYPE_INT32, R);
        lo.num_tokens_per_expert = epx_tensor_1d(per_expert, EPX_DTYPE_INT32, hc->E);
        lo.is_token_in_rank = epx_tensor_2d(in_rank, EPX_DTYPE_BOOL, Ts, R);
        if (ndom > 1) lo.num_tokens_per_domain = epx_tensor_1d(per_dom, EPX_DTYPE_INT32, ndom);
        CALL(epx_get_dispatch_layout(buf, &topk_t, &lo, NULL));
        ref_layout(&p, rank, D, e_rank, e_expert, e_in, ndom > 1 ? e_dom : NULL);
        rc |= ref_check_bits(rank, "num_tokens_per_rank", per_rank, e_rank, R, 4, R);
        rc |= ref_check_bits(rank, "num_tokens_per_expert", per_expert, e_expert, hc->E, 4, hc->E);
        rc |= ref_check_bits(rank, "is_token_in_rank", in_rank, e_in, Ts * R, 1, R);
        if (ndom > 1) rc |= ref_check_bits(rank, "num_tokens_per_domain", per_dom, e_dom, ndom, 4, ndom);
    }

    /* ---- dispatch, default mode ---- */
    x_rows_t in;
    make_x(&a, &p, rank, &rv, REF_TAG_X, &in);
    int32_t *e_rpm = ref_arena_alloc(&a, 4 * (size_t)(R * R));
    ref_rank_prefix(&p, e_rpm);
    void *e_idx = ref_arena_alloc(&a, 8 * (size_t)(N * K));
    fill_idx(rv.idx, N * K, out_idx_dtype, e_idx);
    size_t isz = epx_dtype_size(out_idx_dtype);
    {
        recv_bufs_t b;
        epx_ht_dispatch_args_t args = dispatch_args(&p, rank, &in, topk_t, with_weights, alignment);
        epx_ht_dispatch_outputs_t outs = caller_outputs(&a, &p, N, out_idx_dtype, with_weights, &b);
        /* Odd iterations: the counts on the host only, without the tensor. */
        const bool host_only = it % 2 == 1;
        if (host_only) memset(&outs.num_recv_tokens_per_expert, 0, sizeof(outs.num_recv_tokens_per_expert));
        CALL(epx_ht_dispatch(buf, &args, &outs));
        handle = outs.handle;
        CHECK(handle != NULL, "dispatch returned no handle");
        CHECK(outs.num_recv_tokens_host == N, "num_recv_tokens_host = %lld, expected %lld",
              (long long)outs.num_recv_tokens_host, (long long)N);
        CHECK(b.nrecv[0] == N, "num_recv_tokens[0] = %d, expected %lld", b.nrecv[0], (long long)N);
        rc |= ref_check_bits(rank, "recv_x", b.rx, in.e_x, N * H, esz, H);
        if (fp8) rc |= ref_check_bits(rank, "recv_x_scales", b.rxs, in.e_xs, N * SG, 4, SG);
        if (with_weights) {
            rc |= ref_check_bits(rank, "recv_topk_idx", b.ridx, e_idx, N * K, isz, K);
            rc |= ref_check_bits(rank, "recv_topk_weights", b.rw, rv.w, N * K, 4, K);
        }
        if (!host_only)
            rc |= ref_check_bits(rank, "num_recv_tokens_per_expert", b.rpe, rv.per_expert, L, 4, L);
        rc |= ref_check_bits(rank, "num_recv_tokens_per_expert_host", b.hpe, rv.per_expert, L, 4, L);
        rc |= ref_check_bits(rank, "rank_prefix_matrix", b.rpm, e_rpm, R * R, 4, R);
        if (!handle) goto out;
        rc |= ref_check_handle(rank, handle, Ts, N, R, L);
        if (rc & 2) goto out;
    }

    /* ---- combine (weights and biases as this iteration says) ---- */
    rc |=
        run_combine(buf, &p, rank, &rv, handle, N, with_weights, bias0, bias1, seed ^ 0x636f6d62ull, 0, NULL);
    if (rc & 2) goto out;

    /* ---- cached dispatch with new x: only recv_x (and scales) are written ---- */
    {
        x_rows_t in2;
        make_x(&a, &p, rank, &rv, REF_TAG_X2, &in2);
        uint8_t *rx = ref_arena_garbage(&a, esz * (size_t)(N * H));
        float *rxs = ref_arena_garbage(&a, sizeof(float) * (size_t)(N * SG));
        const epx_tensor_t none = {0};
        epx_ht_dispatch_args_t args = dispatch_args(&p, rank, &in2, none, false, 1);
        args.cached_handle = handle;
        epx_ht_dispatch_outputs_t outs = EPX_HT_DISPATCH_OUTPUTS_INIT;
        outs.recv_x = epx_tensor_2d(rx, dtype, N, H);
        if (fp8) outs.recv_x_scales = epx_tensor_2d(rxs, EPX_DTYPE_FP32, N, SG);
        CALL(epx_ht_dispatch(buf, &args, &outs));
        CHECK(outs.handle == NULL, "cached dispatch wrote a new handle");
        rc |= ref_check_bits(rank, "cached recv_x", rx, in2.e_x, N * H, esz, H);
        if (fp8) rc |= ref_check_bits(rank, "cached recv_x_scales", rxs, in2.e_xs, N * SG, 4, SG);
    }
    epx_handle_destroy(handle);
    handle = NULL;

    const int64_t maxN = max_recv(&p);
    if (maxN < 0) {
        rc = ref_fail(rank, "reference setup failed");
        goto out;
    }
    /* ---- static-shape mode: one W for all ranks; odd iterations make the busiest ranks overflow ---- */
    {
        bool want_overflow = it % 2 == 1;
        int64_t W = want_overflow ? maxN - 2 - maxN / 4 : maxN + 3;
        if (W < 1) W = 1;
        if (W > R * hc->T_max) W = R * hc->T_max;
        bool over = N > W;
        int64_t valid = over ? W : N;
        recv_bufs_t b;
        epx_ht_dispatch_args_t args = dispatch_args(&p, rank, &in, topk_t, true, alignment);
        args.num_worst_tokens = W;
        epx_ht_dispatch_outputs_t outs = caller_outputs(&a, &p, W, out_idx_dtype, true, &b);
        int32_t *hpe_before = ref_arena_alloc(&a, 4 * (size_t)L);
        memcpy(hpe_before, b.hpe, 4 * (size_t)L);
        CALL(epx_ht_dispatch(buf, &args, &outs));
        shandle = outs.handle;
        ref_set_case(
            "ht R=%d E=%d K=%d H=%lld iter %d static W=%lld N=%lld: x %s, routing %s, recv_topk_idx %s", R,
            hc->E, K, (long long)H, it, (long long)W, (long long)N, epx_dtype_name(dtype),
            ref_routing_name(routing), epx_dtype_name(out_idx_dtype));
        CHECK(outs.num_recv_tokens_host == -1, "static num_recv_tokens_host = %lld, expected -1",
              (long long)outs.num_recv_tokens_host);
        CHECK(b.nrecv[0] == N, "static num_recv_tokens[0] = %d, expected %lld", b.nrecv[0], (long long)N);
        rc |= ref_check_bits(rank, "static recv_x", b.rx, in.e_x, valid * H, esz, H);
        if (fp8) rc |= ref_check_bits(rank, "static recv_x_scales", b.rxs, in.e_xs, valid * SG, 4, SG);
        rc |= ref_check_bits(rank, "static recv_topk_idx", b.ridx, e_idx, valid * K, isz, K);
        rc |= ref_check_bits(rank, "static recv_topk_weights", b.rw, rv.w, valid * K, 4, K);
        /* Per-expert counts after an overflow are not pinned; without one they are the real counts. */
        if (!over)
            rc |= ref_check_bits(rank, "static num_recv_tokens_per_expert", b.rpe, rv.per_expert, L, 4, L);
        /* The matrix counts tokens sent, before any bound: the same with or without an overflow. */
        rc |= ref_check_bits(rank, "static rank_prefix_matrix", b.rpm, e_rpm, R * R, 4, R);
        /* Static mode does not wait for the counts: the host array stays as it was. */
        rc |= ref_check_bits(rank, "static num_recv_tokens_per_expert_host (untouched)", b.hpe, hpe_before, L,
                             4, L);
        rc |= ref_check_overflow(rank, buf, over ? EPX_ERR_OVERFLOW : EPX_SUCCESS);
        /* Combine after a static dispatch that kept every row (every rank must take part). */
        if (!want_overflow && shandle)
            rc |= run_combine(buf, &p, rank, &rv, shandle, W, true, true, false, seed ^ 0x737461ull, 0, NULL);
    }
    epx_handle_destroy(shandle);
    shandle = NULL;

    /* ---- view mode: outputs are views of the library's buffer; combine reads rows written there.
     * Odd iterations run it in static mode (no overflow), every third one adds a cached dispatch. ---- */
    {
        const bool is_static = it % 2 == 1;
        int64_t W = maxN + 1 < R * hc->T_max ? maxN + 1 : R * hc->T_max;
        if (W < 1) W = 1;
        const int64_t rows = is_static ? W : N;
        void *e_idx32 = ref_arena_alloc(&a, 4 * (size_t)(N * K));
        fill_idx(rv.idx, N * K, EPX_DTYPE_INT32, e_idx32);
        int32_t *rpe = ref_arena_garbage(&a, 4 * (size_t)L);
        int32_t *rpm = ref_arena_garbage(&a, 4 * (size_t)(R * R));
        int32_t *hpe = ref_arena_garbage(&a, 4 * (size_t)L), *hpe_before = ref_arena_alloc(&a, 4 * (size_t)L);
        memcpy(hpe_before, hpe, 4 * (size_t)L);
        epx_ht_dispatch_args_t args = dispatch_args(&p, rank, &in, topk_t, with_weights, alignment);
        args.num_worst_tokens = is_static ? W : 0;
        args.recv_in_buffer = 1;
        /* Each rank picks its own view area (k_areas of them), another one every iteration. */
        const int area = (rank + it) % k_areas;
        args.view_area = area;
        epx_ht_dispatch_outputs_t outs = EPX_HT_DISPATCH_OUTPUTS_INIT;
        outs.num_recv_tokens_per_expert = epx_tensor_1d(rpe, EPX_DTYPE_INT32, L);
        outs.rank_prefix_matrix = epx_tensor_2d(rpm, EPX_DTYPE_INT32, R, R);
        outs.num_recv_tokens_per_expert_host = hpe;
        CALL(epx_ht_dispatch(buf, &args, &outs));
        handle = outs.handle;
        ref_set_case("ht R=%d E=%d K=%d H=%lld iter %d view mode%s W=%lld N=%lld: x %s, routing %s", R, hc->E,
                     K, (long long)H, it, is_static ? " static" : "", (long long)W, (long long)N,
                     epx_dtype_name(dtype), ref_routing_name(routing));
        CHECK(outs.num_recv_tokens_host == (is_static ? -1 : N),
              "view num_recv_tokens_host = %lld, expected %lld", (long long)outs.num_recv_tokens_host,
              (long long)(is_static ? -1 : N));
        CHECK(outs.recv_x.data && outs.recv_x.dtype == dtype && outs.recv_x.shape[0] == rows &&
                  outs.recv_x.shape[1] == H,
              "view recv_x %s [%lld, %lld] at %p, expected %s [%lld, %lld]",
              epx_dtype_name(outs.recv_x.dtype), (long long)outs.recv_x.shape[0],
              (long long)outs.recv_x.shape[1], outs.recv_x.data, epx_dtype_name(dtype), (long long)rows,
              (long long)H);
        CHECK(outs.recv_topk_idx.data && outs.recv_topk_idx.dtype == EPX_DTYPE_INT32 &&
                  outs.recv_topk_idx.shape[0] == rows && outs.recv_topk_idx.shape[1] == K,
              "view recv_topk_idx is not int32 [%lld, %d]", (long long)rows, K);
        CHECK(!fp8 || (outs.recv_x_scales.data && outs.recv_x_scales.shape[0] == rows),
              "view recv_x_scales missing for fp8");
        CHECK((outs.recv_topk_weights.data != NULL) == with_weights, "view recv_topk_weights %s",
              with_weights ? "missing" : "given without topk_weights");
        if (rc) goto out;
        rc |= ref_check_bits(rank, "view recv_x", outs.recv_x.data, in.e_x, N * H, esz, H);
        if (fp8)
            rc |= ref_check_bits(rank, "view recv_x_scales", outs.recv_x_scales.data, in.e_xs, N * SG, 4, SG);
        rc |= ref_check_bits(rank, "view recv_topk_idx", outs.recv_topk_idx.data, e_idx32, N * K, 4, K);
        if (with_weights)
            rc |= ref_check_bits(rank, "view recv_topk_weights", outs.recv_topk_weights.data, rv.w, N * K, 4,
                                 K);
        rc |= ref_check_bits(rank, "view num_recv_tokens_per_expert", rpe, rv.per_expert, L, 4, L);
        rc |= ref_check_bits(rank, "view rank_prefix_matrix", rpm, e_rpm, R * R, 4, R);
        rc |= ref_check_bits(rank,
                             is_static ? "view static num_recv_tokens_per_expert_host (untouched)"
                                       : "view num_recv_tokens_per_expert_host",
                             hpe, is_static ? hpe_before : rv.per_expert, L, 4, L);

        rc |= run_combine(buf, &p, rank, &rv, handle, rows, with_weights, bias0, bias1, seed ^ 0x766965ull, 1,
                          NULL);
        if (rc & 2) goto out;
        /* A second zero-copy combine on the same rows' place: peers must have let go of the first. */
        rc |=
            run_combine(buf, &p, rank, &rv, handle, rows, false, !bias0, false, seed ^ 0x766966ull, 1, NULL);
        if (rc & 2) goto out;

        if (it % 3 == 0) {
            x_rows_t in2;
            make_x(&a, &p, rank, &rv, REF_TAG_X2, &in2);
            const epx_tensor_t none = {0};
            epx_ht_dispatch_args_t cargs = dispatch_args(&p, rank, &in2, none, false, 0);
            cargs.cached_handle = handle;
            /* A static handle's cached call is static whether it names the bound again or passes 0. */
            cargs.num_worst_tokens = is_static && it != 3 ? W : 0;
            cargs.recv_in_buffer = 1;
            cargs.view_area = (area + 1) % k_areas; /* another area: the first call's views stay */
            epx_ht_dispatch_outputs_t couts = EPX_HT_DISPATCH_OUTPUTS_INIT;
            if (is_static && it == 3) {
                /* Another bound with a static handle: refused on every rank, nothing written. */
                const int64_t other = W > 1 ? W - 1 : W + 1; /* 0 would mean "the handle's" */
                cargs.num_worst_tokens = other;
                epx_result_t r = epx_ht_dispatch(buf, &cargs, &couts);
                CHECK(r == EPX_ERR_INVALID_ARG && strstr(epx_last_error_message(), "num_worst_tokens"),
                      "cached static dispatch with num_worst_tokens %lld (handle's %lld): %s (%s), expected "
                      "ERR_INVALID_ARG naming num_worst_tokens",
                      (long long)other, (long long)W, epx_result_name(r), epx_last_error_message());
                CHECK(couts.recv_x.data == NULL, "a refused cached dispatch wrote outputs");
                cargs.num_worst_tokens = 0;
            }
            CALL(epx_ht_dispatch(buf, &cargs, &couts));
            CHECK(couts.recv_x.data && couts.recv_x.shape[0] == rows && couts.recv_topk_idx.data == NULL &&
                      couts.recv_x.data != outs.recv_x.data &&
                      couts.num_recv_tokens_host == (is_static ? -1 : N),
                  "cached view outputs: recv_x %p rows %lld (want %lld; first call's %p), recv_topk_idx %p, "
                  "num_recv_tokens_host %lld",
                  couts.recv_x.data, (long long)couts.recv_x.shape[0], (long long)rows, outs.recv_x.data,
                  couts.recv_topk_idx.data, (long long)couts.num_recv_tokens_host);
            if (rc) goto out;
            rc |= ref_check_bits(rank, "cached view recv_x", couts.recv_x.data, in2.e_x, N * H, esz, H);
            if (fp8)
                rc |= ref_check_bits(rank, "cached view recv_x_scales", couts.recv_x_scales.data, in2.e_xs,
                                     N * SG, 4, SG);
            rc |= ref_check_bits(rank, "first view recv_x after a dispatch into another area",
                                 outs.recv_x.data, in.e_x, N * H, esz, H);
            /* Combine reading the cached call's recv_x in place (x_in_buffer 2) on even ranks, the
             * combine input (1) on odd ones. */
            if (!fp8 && dtype == EPX_DTYPE_BF16) {
                const int mode = rank % 2 == 0 ? 2 : 1;
                rc |= run_combine(buf, &p, rank, &rv, handle, rows, with_weights, bias0, false,
                                  seed ^ 0x766967ull, mode, &couts.recv_x);
                if (rc & 2) goto out;
            }
        }

        /* Bad view areas and an x_in_buffer 2 whose x is no dispatch view: refused on every rank. */
        if (it == 1) {
            epx_ht_dispatch_args_t bad = args;
            bad.view_area = k_areas;
            epx_ht_dispatch_outputs_t bouts = EPX_HT_DISPATCH_OUTPUTS_INIT;
            epx_result_t r = epx_ht_dispatch(buf, &bad, &bouts);
            CHECK(r == EPX_ERR_INVALID_ARG && strstr(epx_last_error_message(), "view_area"),
                  "view_area %d: %s (%s), expected ERR_INVALID_ARG naming view_area", k_areas,
                  epx_result_name(r), epx_last_error_message());
            CHECK(bouts.handle == NULL && bouts.recv_x.data == NULL, "a refused dispatch wrote outputs");
            uint16_t row[8] = {0};
            epx_ht_combine_args_t cb = EPX_HT_COMBINE_ARGS_INIT;
            cb.handle = handle;
            cb.x = epx_tensor_2d(row, EPX_DTYPE_BF16, 1, H);
            cb.x_in_buffer = 2;
            epx_ht_combine_outputs_t cbo = EPX_HT_COMBINE_OUTPUTS_INIT;
            uint16_t *cout = ref_arena_garbage(&a, sizeof(uint16_t) * (size_t)(p.T[rank] * H));
            cbo.combined_x = epx_tensor_2d(cout, EPX_DTYPE_BF16, p.T[rank], H);
            r = epx_ht_combine(buf, &cb, &cbo);
            CHECK(r == EPX_ERR_INVALID_ARG && strstr(epx_last_error_message(), "x_in_buffer"),
                  "x_in_buffer 2 with caller memory: %s (%s), expected ERR_INVALID_ARG naming x_in_buffer",
                  epx_result_name(r), epx_last_error_message());
            /* A slice of the view (one row short) is not the view either; a rank with no row passes caller
             * memory again, so every rank makes the call. */
            const int sliced = dtype == EPX_DTYPE_BF16 && rows > 0;
            if (sliced) {
                cb.x = outs.recv_x;
                cb.x.shape[0] = rows - 1;
            }
            r = epx_ht_combine(buf, &cb, &cbo);
            CHECK(r == EPX_ERR_INVALID_ARG && strstr(epx_last_error_message(), "x_in_buffer") &&
                      (!sliced || strstr(epx_last_error_message(), "whole recv_x view")),
                  "x_in_buffer 2 with %s: %s (%s), expected ERR_INVALID_ARG naming x_in_buffer",
                  sliced ? "a slice of the view" : "caller memory", epx_result_name(r), epx_last_error_message());
        }

        /* Caller memory with recv_in_buffer is refused on every rank (each fails its own checks). */
        if (it == 0) {
            uint8_t one[16];
            args.num_worst_tokens = 0;
            outs = (epx_ht_dispatch_outputs_t)EPX_HT_DISPATCH_OUTPUTS_INIT;
            outs.recv_x = epx_tensor_2d(one, dtype, 1, H);
            epx_result_t r = epx_ht_dispatch(buf, &args, &outs);
            CHECK(r == EPX_ERR_INVALID_ARG && strstr(epx_last_error_message(), "recv_in_buffer"),
                  "recv_x given with recv_in_buffer: %s (%s), expected ERR_INVALID_ARG naming recv_in_buffer",
                  epx_result_name(r), epx_last_error_message());
        }
    }
out:
    epx_handle_destroy(shandle);
    epx_handle_destroy(handle);
    ref_arena_free(&a);
    ref_ht_recv_free(&rv);
    ref_problem_free(&p);
    return rc;
}

static int ht_rank(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    const ht_case_t *hc = ctx;
    int rc = 0;
    ref_session_t s = {0};
    ref_set_seed(g_seed);
    ref_set_case("ht R=%d E=%d K=%d H=%lld T_max=%lld domain cap %d: setup", nranks, hc->E, hc->K,
                 (long long)hc->H, (long long)hc->T_max, hc->domain_cap);
    if (hc->domain_cap > 0) {
        char v[16];
        snprintf(v, sizeof(v), "%d", hc->domain_cap);
        setenv("EPX_RANKS_PER_NVLINK_DOMAIN", v, 1);
    } else {
        unsetenv("EPX_RANKS_PER_NVLINK_DOMAIN");
    }
    CALL(epx_params_reload());
    epx_buffer_config_t cfg = epx_test_buffer_config(hc->T_max, hc->H, hc->K, hc->E, EPX_MODE_HT);
    cfg.num_view_areas = k_areas;
    if (ref_session_open_nodes(id, rank, nranks, hc->per_node, &cfg, &s)) return 2;
    epx_topology_t topo;
    CALL(epx_comm_get_topology(s.comm, &topo));
    int D = topo.ranks_per_nvlink_domain;
    CHECK(topo.rank == rank && topo.nranks == nranks && topo.backend == EPX_BACKEND_HOST,
          "topology rank %d nranks %d backend %d", topo.rank, topo.nranks, (int)topo.backend);
    if (D < 1 || nranks % D != 0 || topo.num_nvlink_domains != nranks / D ||
        (hc->domain_cap > 0 && D > hc->domain_cap)) {
        rc = ref_fail(rank, "topology: %d ranks per domain, %d domains (cap %d)", D, topo.num_nvlink_domains,
                      hc->domain_cap);
        goto out;
    }
    int iters = hc->iters;
    if (ref_fast_mode()) iters = (iters + 2) / 3;
    for (int it = 0; it < iters; it++) {
        rc |= ht_iteration(s.buf, hc, rank, D, it);
        if (rc & 2) break; /* a failed call leaves the ranks out of step */
    }
out:
    ref_session_close(&s);
    return rc;
}

static const ht_case_t k_cases[] = {
    /* R, E, K, H, T_max, domain cap, iterations (9 covers every dtype x routing pair once) */
    {1, 8, 1, 128, 64, 0, 18},  {1, 288, 5, 2048, 16, 0, 9},  {2, 64, 6, 2048, 32, 0, 18},
    {2, 8, 2, 7168, 8, 1, 9},   {2, 256, 9, 128, 160, 0, 9},  {3, 288, 9, 128, 96, 0, 18},
    {3, 288, 3, 7168, 6, 0, 9}, {4, 256, 8, 7168, 12, 2, 9},  {4, 64, 7, 128, 128, 0, 18},
    {4, 8, 4, 2048, 48, 1, 9},  {8, 288, 9, 2048, 24, 4, 18}, {8, 8, 3, 128, 48, 2, 18},
    {8, 256, 4, 7168, 4, 0, 9}, {8, 64, 1, 7168, 2, 2, 9},
};

/* Under every node split (R from the split; D is the node unless capped): iterations 0-5 take every
 * dtype, static mode with and without overflow, views, cached views and x_in_buffer 2; 9, every
 * dtype x routing pair. */
static const ht_case_t k_split_cases[] = {
    /* R, E, K, H, T_max, domain cap, iterations, ranks per node */
    {0, 48, 6, 256, 24, 0, 9, 0},
    {0, 288, 9, 128, 32, 0, 9, 0},
    {0, 96, 8, 2048, 6, 0, 6, 0},
    {0, 12, 3, 7168, 4, 1, 6, 0},
};

int main(void)
{
    g_seed = epx_test_seed();
    int rc = EPX_TEST_RUN_CASES("ht", k_cases, ht_rank, 300, g_seed);
    return rc | ref_run_split_cases("ht", k_split_cases, sizeof(k_split_cases) / sizeof(k_split_cases[0]),
                                    sizeof(ht_case_t), offsetof(ht_case_t, per_node), ht_rank, 300, g_seed);
}
