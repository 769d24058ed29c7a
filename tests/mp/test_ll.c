/*
 * LL dispatch (bf16, fp8, round_scale, ue8m0; with and without hook) and LL combine (with and without
 * zero-copy, double buffering, a stale third slot) on the host backend, checked against the reference
 * for every rank. Combine outputs are compared bit for bit: the reference sums in the pinned fp32 order.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "epx_test.h"
#include "reference.h"

typedef struct ll_case {
    int R, E, K;
    int64_t H, T_max;
    int iters;
    int per_node; /* ranks per node (ref_run_split_cases), 0 = one node */
} ll_case_t;

enum { LL_BF16 = 0, LL_FP8 = 1, LL_FP8_ROUND = 2, LL_FP8_UE8M0 = 3 };
static const char *const k_mode_names[] = {"bf16", "fp8", "fp8+round_scale", "fp8+round_scale+ue8m0"};

static uint64_t g_seed;

/* One LL batch of this rank: inputs, caller outputs and the reference's view of them. */
typedef struct ll_io {
    ref_problem_t p;
    ref_ll_recv_t rv;
    int mode;
    int64_t RT, SG;
    epx_tensor_t topk_t;
    uint16_t *x;
    uint8_t *recv_x;
    void *recv_scales;
    int32_t *count, *src_info;
    int64_t *range;
    epx_ll_dispatch_outputs_t outs;
    ref_arena_t a;
} ll_io_t;

static int ll_setup(ll_io_t *io, const ll_case_t *lc, int rank, uint64_t seed, int iter,
                    ref_routing_t routing, int mode, epx_dtype_t idx_dtype)
{
    memset(io, 0, sizeof(*io));
    int64_t T[REF_MAX_RANKS];
    ref_gen_token_counts(seed, iter, lc->R, lc->T_max, T);
    if (ref_problem_init(&io->p, lc->R, lc->E, lc->K, lc->H, lc->T_max, EPX_DTYPE_BF16, seed, T, routing) ||
        ref_ll_dispatch(&io->p, rank, &io->rv))
        return ref_fail(rank, "reference setup failed");
    ref_problem_t *p = &io->p;
    int64_t Ts = p->T[rank], H = p->H, L = p->L;
    io->mode = mode;
    io->RT = p->R * p->T_max;
    io->SG = H / 128;
    void *topk = ref_arena_alloc(&io->a, 8 * (size_t)(Ts * p->K));
    ref_fill_topk(p, rank, idx_dtype, topk);
    io->topk_t = epx_tensor_2d(topk, idx_dtype, Ts, p->K);
    io->x = ref_arena_alloc(&io->a, 2 * (size_t)(Ts * H));
    for (int64_t t = 0; t < Ts; t++) ref_x_row(p, rank, t, REF_TAG_X, io->x + t * H);
    size_t esz = mode == LL_BF16 ? 2 : 1;
    io->recv_x = ref_arena_garbage(&io->a, esz * (size_t)(L * io->RT * H));
    io->recv_scales = ref_arena_garbage(&io->a, 4 * (size_t)(L * io->SG * io->RT));
    io->count = ref_arena_garbage(&io->a, 4 * (size_t)L);
    io->src_info = ref_arena_garbage(&io->a, 4 * (size_t)(L * io->RT));
    io->range = ref_arena_garbage(&io->a, 8 * (size_t)(L * p->R));
    return 0;
}

static void ll_free(ll_io_t *io)
{
    ref_arena_free(&io->a);
    ref_ll_recv_free(&io->rv);
    ref_problem_free(&io->p);
}

static int ll_dispatch(epx_buffer_t buf, ll_io_t *io, int rank, bool hook, int32_t *stats, int32_t *exp_stats)
{
    int rc = 0;
    ref_problem_t *p = &io->p;
    int64_t Ts = p->T[rank], H = p->H, L = p->L;
    epx_ll_dispatch_args_t args = EPX_LL_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(io->x, EPX_DTYPE_BF16, Ts, H);
    args.topk_idx = io->topk_t;
    args.cumulative_recv_stats = epx_tensor_1d(stats, EPX_DTYPE_INT32, L);
    args.use_fp8 = io->mode != LL_BF16;
    args.round_scale = io->mode == LL_FP8_ROUND || io->mode == LL_FP8_UE8M0;
    args.use_ue8m0 = io->mode == LL_FP8_UE8M0;
    args.return_recv_hook = hook;
    epx_ll_dispatch_outputs_t *o = &io->outs;
    *o = (epx_ll_dispatch_outputs_t)EPX_LL_DISPATCH_OUTPUTS_INIT;
    o->recv_x =
        epx_tensor_3d(io->recv_x, io->mode == LL_BF16 ? EPX_DTYPE_BF16 : EPX_DTYPE_FP8_E4M3, L, io->RT, H);
    if (io->mode == LL_FP8_UE8M0)
        o->recv_scales = epx_tensor_3d(io->recv_scales, EPX_DTYPE_INT32, L, H / 512, io->RT);
    else if (io->mode != LL_BF16)
        o->recv_scales = epx_tensor_3d(io->recv_scales, EPX_DTYPE_FP32, L, io->SG, io->RT);
    o->recv_count = epx_tensor_1d(io->count, EPX_DTYPE_INT32, L);
    o->src_info = epx_tensor_2d(io->src_info, EPX_DTYPE_INT32, L, io->RT);
    o->layout_range = epx_tensor_2d(io->range, EPX_DTYPE_INT64, L, p->R);
    CALL(epx_ll_dispatch(buf, &args, o));
    CHECK(o->handle.num_tokens == Ts, "handle.num_tokens = %d, expected %lld", o->handle.num_tokens,
          (long long)Ts);
    for (int j = 0; j < L; j++) exp_stats[j] = (int32_t)((uint32_t)exp_stats[j] + (uint32_t)io->rv.count[j]);
out:
    return rc;
}

/* Compares the outputs of a completed dispatch; rows past recv_count are not looked at. */
static int ll_check_dispatch(ll_io_t *io, int rank)
{
    int rc = 0;
    ref_problem_t *p = &io->p;
    int64_t H = p->H, L = p->L, RT = io->RT, SG = io->SG;
    const ref_ll_recv_t *rv = &io->rv;
    if (ref_check_bits(rank, "recv_count", io->count, rv->count, L, 4, L)) return 1;
    rc |= ref_check_bits(rank, "layout_range", io->range, rv->range, L * p->R, 8, p->R);
    uint16_t *row = malloc(2 * (size_t)H);
    uint8_t *q = malloc((size_t)H);
    float *si = malloc(4 * (size_t)SG);
    if (!row || !q || !si) {
        rc = ref_fail(rank, "out of memory");
        goto out;
    }
    for (int64_t j = 0; j < L && !rc; j++) {
        int64_t n = rv->count[j];
        char what[64];
        snprintf(what, sizeof(what), "src_info[%lld]", (long long)j);
        rc |= ref_check_bits(rank, what, io->src_info + j * RT, rv->tok + j * RT, n, 4, n);
        for (int64_t i = 0; i < n && !rc; i++) {
            ref_x_row(p, rv->src[j * RT + i], rv->tok[j * RT + i], REF_TAG_X, row);
            snprintf(what, sizeof(what), "recv_x[%lld][%lld]", (long long)j, (long long)i);
            if (io->mode == LL_BF16) {
                rc |= ref_check_bits(rank, what, (uint16_t *)io->recv_x + (j * RT + i) * H, row, H, 2, H);
                continue;
            }
            ref_ll_cast(row, H, io->mode != LL_FP8, q, si);
            rc |= ref_check_bits(rank, what, io->recv_x + (j * RT + i) * H, q, H, 1, H);
            for (int64_t g = 0; g < SG && !rc; g++) {
                if (io->mode == LL_FP8_UE8M0) {
                    if (g % 4) continue;
                    uint32_t want = 0;
                    for (int b = 0; b < 4; b++) {
                        uint32_t bits;
                        memcpy(&bits, &si[g + b], 4);
                        want |= ((bits >> 23) & 0xffu) << (8 * b);
                    }
                    uint32_t got = ((uint32_t *)io->recv_scales)[(j * (H / 512) + g / 4) * RT + i];
                    if (got != want)
                        rc |= ref_fail(rank, "ue8m0 recv_scales[%lld][%lld][%lld] = 0x%08x, expected 0x%08x",
                                       (long long)j, (long long)i, (long long)(g / 4), got, want);
                } else {
                    float got = ((float *)io->recv_scales)[(j * SG + g) * RT + i];
                    if (memcmp(&got, &si[g], 4) != 0)
                        rc |= ref_fail(rank, "recv_scales[%lld][%lld][%lld] = %a, expected %a", (long long)j,
                                       (long long)i, (long long)g, (double)got, (double)si[g]);
                }
            }
        }
    }
out:
    free(row);
    free(q);
    free(si);
    return rc;
}

/* The zero-copy view of a batch's combine input, checked for shape. */
static int ll_get_view(epx_buffer_t buf, ll_io_t *io, int rank, uint16_t **y_out)
{
    int rc = 0;
    epx_tensor_t view;
    CALL(epx_ll_get_combine_buffer(buf, &io->outs.handle, &view));
    if (!view.data || view.dtype != EPX_DTYPE_BF16 || view.ndim != 3 || view.shape[0] != io->p.L ||
        view.shape[1] != io->RT || view.shape[2] != io->p.H) {
        rc = ref_fail(rank, "combine buffer view: data %p dtype %d ndim %d shape [%lld, %lld, %lld]",
                      view.data, (int)view.dtype, view.ndim, (long long)view.shape[0],
                      (long long)view.shape[1], (long long)view.shape[2]);
        rc = 2;
    }
    *y_out = view.data;
out:
    return rc;
}

/* Rows past recv_count hold a huge value that would show in any sum that read them. */
static void ll_fill_y(const ll_io_t *io, int rank, uint64_t yseed, uint16_t *y)
{
    int64_t H = io->p.H, RT = io->RT;
    for (int64_t j = 0; j < io->p.L; j++)
        for (int64_t i = 0; i < RT; i++)
            for (int64_t c = 0; c < H; c++)
                y[(j * RT + i) * H + c] =
                    i < io->rv.count[j]
                        ? ref_y_bf16(yseed, rank, (int)j, io->rv.src[j * RT + i], io->rv.tok[j * RT + i], c)
                        : 0x7f00;
}

/* Combine of a batch; `expect` other than success checks the refusal (a stale handle). With
 * `prefilled`, the zero-copy view already holds y. */
static int ll_combine(epx_buffer_t buf, ll_io_t *io, int rank, bool zero_copy, bool hook, uint64_t yseed,
                      epx_result_t expect, bool prefilled)
{
    int rc = 0;
    ref_problem_t *p = &io->p;
    int64_t Ts = p->T[rank], H = p->H, L = p->L, RT = io->RT;
    ref_arena_t a = {0};
    uint16_t *y = NULL;
    if (zero_copy && !prefilled) {
        rc = ll_get_view(buf, io, rank, &y);
        if (rc) goto out;
    } else if (!zero_copy) {
        y = ref_arena_alloc(&a, 2 * (size_t)(L * RT * H));
    }
    if (y) ll_fill_y(io, rank, yseed, y);
    uint16_t *out_x = ref_arena_garbage(&a, 2 * (size_t)(Ts * H));
    uint16_t *exp = ref_arena_alloc(&a, 2 * (size_t)(Ts * H));
    epx_ll_combine_args_t args = EPX_LL_COMBINE_ARGS_INIT;
    args.handle = io->outs.handle;
    if (!zero_copy) args.y = epx_tensor_3d(y, EPX_DTYPE_BF16, L, RT, H);
    args.topk_idx = io->topk_t;
    args.topk_weights = epx_tensor_2d(p->weights[rank], EPX_DTYPE_FP32, Ts, p->K);
    args.zero_copy = zero_copy;
    args.return_recv_hook = hook;
    epx_ll_combine_outputs_t outs = EPX_LL_COMBINE_OUTPUTS_INIT;
    outs.combined_x = epx_tensor_2d(out_x, EPX_DTYPE_BF16, Ts, H);
    epx_result_t res = epx_ll_combine(buf, &args, &outs);
    if (expect != EPX_SUCCESS) {
        CHECK(res == expect, "combine of a stale handle returned %s, expected %s", epx_result_name(res),
              epx_result_name(expect));
        goto out;
    }
    CALL(res);
    if (hook) CALL(epx_hook_run(&outs.hook, NULL));
    ref_ll_combine(p, rank, yseed, exp);
    rc |= ref_check_bits(rank, "combined_x", out_x, exp, Ts * H, 2, H);
out:
    ref_arena_free(&a);
    return rc;
}

static int check_stats(int rank, const int32_t *stats, const int32_t *exp, int64_t L)
{
    return ref_check_bits(rank, "cumulative_recv_stats", stats, exp, L, 4, L);
}

static int ll_rank(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    const ll_case_t *lc = ctx;
    int rc = 0;
    ref_session_t s = {0};
    int64_t L = lc->E / nranks;
    int32_t *stats = calloc((size_t)L, 4), *exp_stats = calloc((size_t)L, 4);
    ll_io_t io[3];
    memset(io, 0, sizeof(io));
    ref_set_seed(g_seed);
    ref_set_case("ll R=%d (%d per node) E=%d K=%d H=%lld T_max=%lld: setup", nranks,
                 lc->per_node ? lc->per_node : nranks, lc->E, lc->K, (long long)lc->H, (long long)lc->T_max);
    if (!stats || !exp_stats) {
        rc = ref_fail(rank, "out of memory");
        goto out;
    }
    /* The stats start just below INT32_MAX, so the adds wrap (modulo 2^32, docs/reference.md). */
    for (int64_t j = 0; j < L; j++) stats[j] = exp_stats[j] = INT32_MAX - (int32_t)(j % 3);
    const epx_buffer_config_t cfg = epx_test_buffer_config(lc->T_max, lc->H, lc->K, lc->E, EPX_MODE_LL);
    if (ref_session_open_nodes(id, rank, nranks, lc->per_node, &cfg, &s)) {
        rc = 2;
        goto out;
    }
    epx_buffer_t buf = s.buf;

    int iters = lc->iters;
    if (ref_fast_mode()) iters = (iters + 1) / 2;
    for (int it = 0; it < iters && !(rc & 2); it++) {
        uint64_t seed = ref_hash(g_seed, 0x4c4c,
                                 (uint64_t)(lc->per_node * 10000000 + nranks * 100000 + lc->E * 10 + lc->K),
                                 (uint64_t)lc->H, (uint64_t)it);
        int mode = it % 4;
        if (mode == LL_FP8_UE8M0 && lc->H % 512 != 0) mode = LL_FP8_ROUND;
        bool hook = (it / 4) % 2, zero_copy = ((it / 4) + (it % 2)) % 2, combine_hook = (it / 2) % 2;
        ref_routing_t routing = (ref_routing_t)(it % REF_ROUTE_COUNT);
        epx_dtype_t idx_dtype = (it / 2) % 2 ? EPX_DTYPE_INT64 : EPX_DTYPE_INT32;
        int64_t T[REF_MAX_RANKS];
        ref_gen_token_counts(seed, it, nranks, lc->T_max, T);
        ref_set_case("ll R=%d (%d per node) E=%d K=%d H=%lld T_max=%lld iter %d: %s, hook %d, zero_copy %d, "
                     "combine hook %d, routing %s, topk_idx %s, T[0]=%lld",
                     nranks, lc->per_node ? lc->per_node : nranks, lc->E, lc->K, (long long)lc->H,
                     (long long)lc->T_max, it, k_mode_names[mode], hook, zero_copy, combine_hook,
                     ref_routing_name(routing), epx_dtype_name(idx_dtype), (long long)T[0]);
        if (ll_setup(&io[0], lc, rank, seed, it, routing, mode, idx_dtype)) {
            rc |= 2;
            break;
        }
        rc |= ll_dispatch(buf, &io[0], rank, hook, stats, exp_stats);
        if (rc & 2) break;
        if (hook) {
            CALL(epx_hook_run(&io[0].outs.hook, NULL));
            epx_result_t again = epx_hook_run(&io[0].outs.hook, NULL);
            CHECK(again == EPX_ERR_INVALID_ARG,
                  "second run of a dispatch hook returned %s, expected ERR_INVALID_ARG",
                  epx_result_name(again));
        }
        rc |= ll_check_dispatch(&io[0], rank);
        rc |= check_stats(rank, stats, exp_stats, L);
        rc |= ll_combine(buf, &io[0], rank, zero_copy, combine_hook, seed ^ 0x79ull, EPX_SUCCESS, false);
        ll_free(&io[0]);
    }
    if (rc & 2) goto out;

    /* Two batches in flight through hooks (both sends issued before either receive), then combined. */
    {
        uint64_t sa = ref_hash(g_seed, 0x4c4c41, (uint64_t)nranks, (uint64_t)lc->E, 0);
        uint64_t sb = ref_hash(g_seed, 0x4c4c42, (uint64_t)nranks, (uint64_t)lc->E, 0);
        ref_set_case("ll R=%d E=%d K=%d H=%lld: two batches in flight through hooks", nranks, lc->E, lc->K,
                     (long long)lc->H);
        if (ll_setup(&io[0], lc, rank, sa, 5, REF_ROUTE_RANDOM, LL_BF16, EPX_DTYPE_INT32) ||
            ll_setup(&io[1], lc, rank, sb, 6, REF_ROUTE_GROUPED, LL_FP8, EPX_DTYPE_INT64)) {
            rc |= 2;
            goto out;
        }
        rc |= ll_dispatch(buf, &io[0], rank, true, stats, exp_stats);
        if (rc & 2) goto out;
        rc |= ll_dispatch(buf, &io[1], rank, true, stats, exp_stats);
        if (rc & 2) goto out;
        CHECK(io[0].outs.handle.slot != io[1].outs.handle.slot, "two consecutive dispatches share slot %d",
              io[0].outs.handle.slot);
        CALL(epx_hook_run(&io[0].outs.hook, NULL));
        CALL(epx_hook_run(&io[1].outs.hook, NULL));
        rc |= ll_check_dispatch(&io[0], rank);
        rc |= ll_check_dispatch(&io[1], rank);
        rc |= check_stats(rank, stats, exp_stats, L);
        /* Both zero-copy views taken and filled before either combine: the slots must not alias. */
        uint16_t *ya = NULL, *yb = NULL;
        rc |= ll_get_view(buf, &io[0], rank, &ya);
        if (rc & 2) goto out;
        rc |= ll_get_view(buf, &io[1], rank, &yb);
        if (rc & 2) goto out;
        ll_fill_y(&io[0], rank, sa ^ 1, ya);
        ll_fill_y(&io[1], rank, sb ^ 1, yb);
        rc |= ll_combine(buf, &io[0], rank, true, false, sa ^ 1, EPX_SUCCESS, true);
        if (rc & 2) goto out;
        rc |= ll_combine(buf, &io[1], rank, true, true, sb ^ 1, EPX_SUCCESS, true);
        if (rc & 2) goto out;
        ll_free(&io[0]);
        ll_free(&io[1]);
    }

    /* A third dispatch reuses the first one's slot: the first handle is stale, the other two combine. */
    {
        uint64_t s3[3];
        for (int i = 0; i < 3; i++)
            s3[i] = ref_hash(g_seed, 0x4c4c33, (uint64_t)nranks, (uint64_t)lc->E, (uint64_t)i);
        ref_set_case("ll R=%d E=%d K=%d H=%lld: third dispatch reuses the first slot", nranks, lc->E, lc->K,
                     (long long)lc->H);
        for (int i = 0; i < 3; i++) {
            if (ll_setup(&io[i], lc, rank, s3[i], 2 + i, (ref_routing_t)i, i == 2 ? LL_FP8_ROUND : LL_BF16,
                         EPX_DTYPE_INT32)) {
                rc |= 2;
                goto out;
            }
            rc |= ll_dispatch(buf, &io[i], rank, false, stats, exp_stats);
            if (rc & 2) goto out;
        }
        CHECK(io[0].outs.handle.slot == io[2].outs.handle.slot, "third dispatch took slot %d, first had %d",
              io[2].outs.handle.slot, io[0].outs.handle.slot);
        for (int i = 0; i < 3; i++) rc |= ll_check_dispatch(&io[i], rank);
        rc |= check_stats(rank, stats, exp_stats, L);
        rc |= ll_combine(buf, &io[0], rank, false, false, s3[0], EPX_ERR_INVALID_ARG, false);
        rc |= ll_combine(buf, &io[1], rank, false, false, s3[1] ^ 1, EPX_SUCCESS, false);
        if (rc & 2) goto out;
        rc |= ll_combine(buf, &io[2], rank, true, true, s3[2] ^ 1, EPX_SUCCESS, false);
    }
out:
    for (int i = 0; i < 3; i++) ll_free(&io[i]);
    ref_session_close(&s);
    free(stats);
    free(exp_stats);
    return rc;
}

/* The reference's own conversions against known codes, so a reference bug cannot mirror a library one. */
static int check_reference_numerics(void)
{
    struct {
        float f;
        uint8_t code;
    } fp8[] = {
        {1.0f, 0x38},      {1.0625f, 0x38}, {1.1875f, 0x3a}, {-2.0f, 0xc0},    {448.0f, 0x7e},
        {1000.0f, 0x7e},   {-500.0f, 0xfe}, {0x1p-9f, 0x01}, {0x1p-10f, 0x00}, {0x1.8p-10f, 0x01},
        {0x1.ep-7f, 0x08}, {-0.0f, 0x80},   {240.0f, 0x77},  {0x1p-6f, 0x08},  {464.0f, 0x7e},
    };
    for (size_t i = 0; i < sizeof(fp8) / sizeof(fp8[0]); i++)
        if (ref_f32_to_fp8(fp8[i].f) != fp8[i].code) {
            fprintf(stderr, "reference fp8(%a) = 0x%02x, expected 0x%02x\n", (double)fp8[i].f,
                    ref_f32_to_fp8(fp8[i].f), fp8[i].code);
            return 1;
        }
    for (int v = 0; v < 256; v++) {
        if ((v & 0x7f) == 0x7f) continue;
        if (ref_f32_to_fp8(ref_fp8_to_f32((uint8_t)v)) != v) {
            fprintf(stderr, "reference fp8 code 0x%02x does not round-trip\n", v);
            return 1;
        }
    }
    if (ref_f32_to_bf16(1.0f) != 0x3f80 || ref_f32_to_bf16(0x1.01p0f) != 0x3f80 ||
        ref_f32_to_bf16(0x1.03p0f) != 0x3f82 || ref_f32_to_bf16(0x1.0101p0f) != 0x3f81) {
        fprintf(stderr, "reference bf16 rounding is wrong\n");
        return 1;
    }
    /* The pinned cast: 448 * 2^-3 maps to scale 2^-3 exactly; round_scale lifts 3/448 to 2^-7. */
    uint16_t row[128];
    uint8_t q[128];
    float si;
    for (int c = 0; c < 128; c++) row[c] = ref_f32_to_bf16(c == 5 ? -56.0f : 1.0f);
    ref_ll_cast(row, 128, false, q, &si);
    if (si != 0.125f || q[5] != 0xfe || q[0] != 0x50) {
        fprintf(stderr, "reference fp8 cast: scale %a q[5] 0x%02x q[0] 0x%02x\n", (double)si, q[5], q[0]);
        return 1;
    }
    for (int c = 0; c < 128; c++) row[c] = ref_f32_to_bf16(c == 7 ? 3.0f : 0.0f);
    ref_ll_cast(row, 128, true, q, &si);
    if (si != 0x1p-7f || q[7] != ref_f32_to_fp8(384.0f) || q[0] != 0x00) {
        fprintf(stderr, "reference fp8 cast with round_scale: scale %a q[7] 0x%02x\n", (double)si, q[7]);
        return 1;
    }
    return 0;
}

static const ll_case_t k_cases[] = {
    /* R, E, K, H, T_max, iterations (8 covers every mode with and without hook) */
    {1, 64, 8, 512, 16, 16}, {1, 288, 9, 7168, 4, 8}, {2, 256, 9, 1024, 8, 16}, {2, 64, 1, 2048, 32, 8},
    {3, 288, 9, 256, 6, 16}, {3, 288, 1, 512, 12, 8}, {4, 64, 1, 512, 24, 16},  {4, 288, 8, 512, 8, 16},
    {4, 256, 9, 7168, 2, 8}, {8, 64, 8, 512, 8, 16},  {8, 288, 9, 1024, 4, 16}, {8, 256, 1, 128, 6, 8},
};

/* Under every node split (R from the split): LL combines are reduced on the source, over slots, on any
 * split; every mode with and without hooks, zero-copy, two batches in flight, a stale slot. */
static const ll_case_t k_split_cases[] = {
    /* R, E, K, H, T_max, iterations, ranks per node */
    {0, 48, 8, 512, 8, 8, 0},
    {0, 96, 1, 1024, 6, 8, 0},
    {0, 288, 9, 7168, 2, 8, 0},
};

int main(void)
{
    g_seed = epx_test_seed();
    if (check_reference_numerics()) return 1;
    int rc = EPX_TEST_RUN_CASES("ll", k_cases, ll_rank, 300, g_seed);
    return rc | ref_run_split_cases("ll", k_split_cases, sizeof(k_split_cases) / sizeof(k_split_cases[0]),
                                    sizeof(ll_case_t), offsetof(ll_case_t, per_node), ll_rank, 300, g_seed);
}
