/*
 * Routing-map dispatch with and without permute (padding, upper bounds equal to / above / below the
 * real count, overflow) and its combine, on the host backend, checked against the reference for every
 * rank. With a bound the handle (and the combine input) has the bound's rows. Combine outputs are
 * compared bit for bit: the reference sums in the pinned fp32 order.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "epx_test.h"
#include "reference.h"

typedef struct rm_case {
    int R, E, K;
    int64_t H, T_max;
    int per_node; /* ranks per node (ref_run_split_cases), 0 = one node */
} rm_case_t;

static uint64_t g_seed;

static int rm_iteration(epx_buffer_t buf, const rm_case_t *rc_, int rank, int it)
{
    int rc = 0, R = rc_->R, K = rc_->K, E = rc_->E;
    int64_t H = rc_->H, SG = H / 128;
    const ref_rm_plan_t pl = ref_rm_plan(it);
    const bool permute = pl.permute, fp8 = pl.dtype == EPX_DTYPE_FP8_E4M3;
    const epx_dtype_t dtype = pl.dtype;
    uint64_t seed = ref_hash(g_seed, 0x524d, (uint64_t)(rc_->per_node * 10000000 + R * 100000 + E * 10 + K),
                             (uint64_t)H, (uint64_t)it);
    size_t esz = epx_dtype_size(dtype);
    int64_t T[REF_MAX_RANKS], bounds[REF_MAX_RANKS];
    ref_gen_token_counts(seed, it, R, rc_->T_max, T);
    ref_problem_t p;
    ref_rm_recv_t rv = {0};
    ref_arena_t a = {0};
    epx_handle_t handle = NULL;
    if (ref_problem_init(&p, R, E, K, H, rc_->T_max, dtype, seed, T, pl.routing)) {
        rc = ref_fail(rank, "reference setup failed");
        goto out;
    }
    if (rc_->per_node > 0) p.ranks_per_node = rc_->per_node;
    int64_t L = p.L, Ts = p.T[rank];
    if (ref_rm_bounds(&p, permute, pl.pad, pl.bound, bounds) ||
        ref_rm_dispatch(&p, rank, permute, pl.pad, bounds[rank], &rv)) {
        rc = ref_fail(rank, "reference setup failed");
        goto out;
    }
    const int64_t bound = bounds[rank], real = rv.real, rows = rv.rows, kept = real < rows ? real : rows;
    bool overflow = bound >= 0 && real > bound;
    ref_set_case(
        "rm R=%d (%d per node) E=%d K=%d H=%lld T_max=%lld iter %d: %s, pad %d, %s, bound %s (%lld, real "
        "%lld), probs %d, weighted %d, routing %s, T[0]=%lld",
        R, rc_->per_node ? rc_->per_node : R, E, K, (long long)H, (long long)rc_->T_max, it,
        permute ? "permute" : "no permute", pl.pad, epx_dtype_name(dtype), ref_bound_name(pl.bound),
        (long long)bound, (long long)real, pl.with_probs, pl.weighted, ref_routing_name(pl.routing),
        (long long)T[0]);

    /* ---- inputs ---- */
    uint8_t *hidden = ref_arena_alloc(&a, esz * (size_t)(Ts * H));
    float *sf = ref_arena_alloc(&a, 4 * (size_t)(Ts * SG));
    uint8_t *map = ref_arena_alloc(&a, (size_t)(Ts * E));
    float *probs = ref_arena_alloc(&a, 4 * (size_t)(Ts * E));
    for (int64_t t = 0; t < Ts; t++) {
        ref_x_row(&p, rank, t, REF_TAG_X, hidden + (size_t)(t * H) * esz);
        ref_scales_row(&p, rank, t, REF_TAG_X, sf + t * SG);
        for (int e = 0; e < E; e++) {
            map[t * E + e] = ref_selected(&p, rank, t, e) ? 1 : 0;
            probs[t * E + e] = ref_prob(&p, rank, t, e);
        }
    }

    /* ---- expected rows: real ones from the sources, zero rows for padding and past the real count ---- */
    int64_t pw = permute ? 1 : L;
    uint8_t *e_tok = ref_arena_alloc(&a, esz * (size_t)(rows * H));
    float *e_sf = ref_arena_alloc(&a, 4 * (size_t)(rows * SG));
    for (int64_t i = 0; i < rows; i++) {
        if (rv.src[i] < 0) continue;
        ref_x_row(&p, rv.src[i], rv.tok[i], REF_TAG_X, e_tok + (size_t)(i * H) * esz);
        ref_scales_row(&p, rv.src[i], rv.tok[i], REF_TAG_X, e_sf + i * SG);
    }

    /* ---- dispatch ---- */
    uint8_t *o_tok = ref_arena_garbage(&a, esz * (size_t)(rows * H));
    float *o_sf = ref_arena_garbage(&a, 4 * (size_t)(rows * SG));
    float *o_probs = ref_arena_garbage(&a, 4 * (size_t)(rows * pw));
    int32_t *o_tpe = ref_arena_garbage(&a, 4 * (size_t)L);
    int32_t *o_num = ref_arena_garbage(&a, 4);
    /* The optional local map on every other iteration (garbage shows unwritten rows). */
    const bool with_lmap = it % 2 == 0;
    const int64_t lmap_rows = (int64_t)R * rc_->T_max + 1;
    uint8_t *o_lmap = with_lmap ? ref_arena_garbage(&a, (size_t)(lmap_rows * L)) : NULL;
    epx_rm_dispatch_args_t args = EPX_RM_DISPATCH_ARGS_INIT;
    args.hidden = epx_tensor_2d(hidden, dtype, Ts, H);
    if (fp8) args.scaling_factor = epx_tensor_2d(sf, EPX_DTYPE_FP32, Ts, SG);
    args.routing_map = epx_tensor_2d(map, EPX_DTYPE_BOOL, Ts, E);
    if (pl.with_probs) args.probs = epx_tensor_2d(probs, EPX_DTYPE_FP32, Ts, E);
    args.permute = permute;
    args.pad_multiple = pl.pad;
    args.num_dispatched_tokens = permute ? -1 : bound;
    args.num_permuted_tokens = permute ? bound : -1;
    epx_rm_dispatch_outputs_t outs = EPX_RM_DISPATCH_OUTPUTS_INIT;
    outs.tokens = epx_tensor_2d(o_tok, dtype, rows, H);
    if (fp8) outs.scaling_factor = epx_tensor_2d(o_sf, EPX_DTYPE_FP32, rows, SG);
    if (pl.with_probs)
        outs.probs = permute ? epx_tensor_1d(o_probs, EPX_DTYPE_FP32, rows)
                             : epx_tensor_2d(o_probs, EPX_DTYPE_FP32, rows, L);
    if (permute) outs.tokens_per_expert = epx_tensor_1d(o_tpe, EPX_DTYPE_INT32, L);
    outs.num_tokens = epx_tensor_1d(o_num, EPX_DTYPE_INT32, 1);
    if (with_lmap) outs.local_map = epx_tensor_2d(o_lmap, EPX_DTYPE_BOOL, lmap_rows, L);
    CALL(epx_rm_dispatch(buf, &args, &outs));
    handle = outs.handle;
    CHECK(outs.num_tokens_host == rows, "num_tokens_host = %lld, expected %lld",
          (long long)outs.num_tokens_host, (long long)rows);
    CHECK(o_num[0] == real, "num_tokens[0] = %d, expected %lld", o_num[0], (long long)real);
    rc |= ref_check_bits(rank, "tokens", o_tok, e_tok, rows * H, esz, H);
    if (fp8) rc |= ref_check_bits(rank, "scaling_factor", o_sf, e_sf, rows * SG, 4, SG);
    if (pl.with_probs) rc |= ref_check_bits(rank, "probs", o_probs, rv.probs, rows * pw, 4, pw);
    if (permute) rc |= ref_check_bits(rank, "tokens_per_expert", o_tpe, rv.tokens_per_expert, L, 4, L);
    if (with_lmap) {
        uint8_t *e_lmap = ref_arena_alloc(&a, (size_t)(lmap_rows * L));
        ref_rm_local_map(&p, rank, lmap_rows, e_lmap);
        rc |= ref_check_bits(rank, "local_map", o_lmap, e_lmap, lmap_rows * L, 1, L);
    }
    rc |= ref_check_overflow(rank, buf, overflow ? EPX_ERR_OVERFLOW : EPX_SUCCESS);
    if (!handle) {
        rc = ref_fail(rank, "dispatch returned no handle");
        rc = 2; /* the peers go on to the combine; this rank cannot */
        goto out;
    }
    /* The handle covers the bound's rows when one is given (as on every backend), else the real ones. */
    rc |= ref_check_handle(rank, handle, Ts, rows, R, L);
    if (rc & 2) goto out;

    /* ---- combine: x has the handle's rows; rows past the real count (up to the bound) and padding
     * rows hold a value that would show if read ---- */
    {
        uint64_t yseed = seed ^ 0x726d63ull;
        uint16_t *cx = ref_arena_alloc(&a, 2 * (size_t)(rows * H));
        for (int64_t i = 0; i < rows; i++)
            for (int64_t c = 0; c < H; c++)
                cx[i * H + c] = i < kept && rv.src[i] >= 0
                                    ? ref_y_bf16(yseed, rank, permute ? rv.j[i] : -1, rv.src[i], rv.tok[i], c)
                                    : 0x7f00;
        uint16_t *out_x = ref_arena_garbage(&a, 2 * (size_t)(Ts * H));
        uint16_t *exp = ref_arena_alloc(&a, 2 * (size_t)(Ts * H));
        epx_rm_combine_args_t cargs = EPX_RM_COMBINE_ARGS_INIT;
        cargs.handle = handle;
        cargs.x = epx_tensor_2d(cx, EPX_DTYPE_BF16, rows, H);
        cargs.weighted = pl.weighted;
        epx_rm_combine_outputs_t couts = EPX_RM_COMBINE_OUTPUTS_INIT;
        couts.combined = epx_tensor_2d(out_x, EPX_DTYPE_BF16, Ts, H);
        CALL(epx_rm_combine(buf, &cargs, &couts));
        if (ref_rm_combine(&p, rank, permute, pl.pad, bounds, pl.weighted, yseed, exp)) {
            rc = ref_fail(rank, "reference combine failed");
            goto out;
        }
        rc |= ref_check_bits(rank, "combined", out_x, exp, Ts * H, 2, H);
    }
out:
    epx_handle_destroy(handle);
    ref_arena_free(&a);
    ref_rm_recv_free(&rv);
    ref_problem_free(&p);
    return rc;
}

static int rm_rank(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    const rm_case_t *c = ctx;
    ref_set_seed(g_seed);
    ref_set_case("rm R=%d E=%d K=%d H=%lld T_max=%lld: setup", nranks, c->E, c->K, (long long)c->H,
                 (long long)c->T_max);
    epx_buffer_config_t cfg = epx_test_buffer_config(c->T_max, c->H, c->K, c->E, EPX_MODE_PERMUTE);
    cfg.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_BF16) | EPX_DTYPE_BIT(EPX_DTYPE_FP8_E4M3);
    cfg.max_pad_multiple = REF_RM_MAX_PAD;
    ref_session_t s;
    if (ref_session_open_nodes(id, rank, nranks, c->per_node, &cfg, &s)) return 2;
    int rc = 0;
    /* Every (permute/pad, bound) pair once; dtype, probs and weighting vary with it. */
    int iters = 2 * 4 * REF_BOUND_COUNT;
    if (ref_fast_mode()) iters = 4 * REF_BOUND_COUNT;
    for (int it = 0; it < iters; it++) {
        rc |= rm_iteration(s.buf, c, rank, it);
        if (rc & 2) break;
    }
    ref_session_close(&s);
    return rc;
}

static const rm_case_t k_cases[] = {
    /* R, E, K, H, T_max */
    {1, 8, 2, 128, 32},  {1, 64, 8, 2048, 8}, {2, 64, 4, 256, 24}, {2, 8, 1, 128, 64},  {3, 48, 6, 128, 20},
    {3, 288, 9, 512, 6}, {4, 64, 8, 512, 16}, {4, 16, 3, 7168, 4}, {8, 64, 6, 128, 16}, {8, 256, 9, 256, 8},
};

/* Under every node split (R from the split): every (permute/pad, bound) pair, weighted or not. */
static const rm_case_t k_split_cases[] = {
    /* R, E, K, H, T_max, ranks per node */
    {0, 48, 6, 256, 16, 0},
    {0, 96, 9, 128, 8, 0},
    {0, 12, 3, 1152, 6, 0}, /* channels in chunks of 512, the last one short */
};

int main(void)
{
    g_seed = epx_test_seed();
    int rc = EPX_TEST_RUN_CASES("rm", k_cases, rm_rank, 300, g_seed);
    return rc | ref_run_split_cases("rm", k_split_cases, sizeof(k_split_cases) / sizeof(k_split_cases[0]),
                                    sizeof(rm_case_t), offsetof(rm_case_t, per_node), rm_rank, 300, g_seed);
}
