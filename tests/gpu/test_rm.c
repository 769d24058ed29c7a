/*
 * Routing-map dispatch (with and without fused permute) and its combine on the cuda backend, R
 * ranks (processes) on the GPUs present, every output compared bit for bit with the reference
 * (tests/common/reference.c): pad_multiple 1/16/128, bf16 and fp8, probs and weighted combine,
 * upper bounds equal to / above / below the real count (overflow), ragged T with zero-token
 * ranks; capture without a bound refused naming the parameter; a graph captured with bounds that
 * differ from the previous eager counts, replayed with new routing. EPX_GPU_TEST_RANKS (default
 * "1,2,4,8"; one rank runs the whole-GPU, all-local path) and EPX_GPU_TEST_QUICK=1 (sanitizer
 * runs) shrink it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "gpu_test.h"

typedef struct setup {
    int R, E, K, device, rank;
    int64_t H, T_max;
    epx_comm_t comm;
    epx_buffer_t buf;
} setup_t;

static void *to_host(ref_arena_t *a, const void *dev, size_t bytes)
{
    void *h = ref_arena_alloc(a, bytes + 16);
    cudaMemcpy(h, dev, bytes, cudaMemcpyDeviceToHost);
    return h;
}

/* Host inputs of rank `me`: hidden, scales, routing map, probs. */
typedef struct inputs {
    uint8_t *hidden;
    float *sf, *probs;
    uint8_t *map;
} inputs_t;

static void make_inputs(const ref_problem_t *p, int me, ref_arena_t *a, inputs_t *in)
{
    const int64_t T = p->T[me], H = p->H, E = p->E, SG = H / 128;
    const size_t esz = epx_dtype_size(p->dtype);
    in->hidden = ref_arena_alloc(a, esz * (size_t)(T * H) + 16);
    in->sf = ref_arena_alloc(a, 4 * (size_t)(T * SG) + 16);
    in->map = ref_arena_alloc(a, (size_t)(T * E) + 16);
    in->probs = ref_arena_alloc(a, 4 * (size_t)(T * E) + 16);
    for (int64_t t = 0; t < T; t++) {
        ref_x_row(p, me, t, REF_TAG_X, in->hidden + (size_t)(t * H) * esz);
        ref_scales_row(p, me, t, REF_TAG_X, in->sf + t * SG);
        for (int e = 0; e < E; e++) {
            in->map[t * E + e] = ref_selected(p, me, t, e) ? 1 : 0;
            in->probs[t * E + e] = ref_prob(p, me, t, e);
        }
    }
}

/* One eager dispatch + combine, every output checked. */
static int rm_iteration(const setup_t *su, uint64_t gseed, int it)
{
    int rc = 0, R = su->R, K = su->K, E = su->E, rank = su->rank, dev = su->device;
    const int64_t H = su->H, SG = H / 128;
    ref_rm_plan_t pl = ref_rm_plan(it);
    if (H % 128 != 0) pl.dtype = EPX_DTYPE_BF16; /* fp8 needs a multiple of 128 */
    const bool permute = pl.permute, fp8 = pl.dtype == EPX_DTYPE_FP8_E4M3;
    const epx_dtype_t dtype = pl.dtype;
    const uint64_t seed = ref_hash(gseed, 0x67726d, (uint64_t)(R * 1000 + E), (uint64_t)H, (uint64_t)it);
    const size_t esz = epx_dtype_size(dtype);
    int64_t T[REF_MAX_RANKS], bounds[REF_MAX_RANKS];
    ref_gen_token_counts(seed, it, R, su->T_max, T);
    ref_problem_t p;
    ref_rm_recv_t rv = {0};
    ref_arena_t a = {0};
    gpu_arena_t da = {0};
    epx_handle_t handle = NULL;
    if (ref_problem_init(&p, R, E, K, H, su->T_max, dtype, seed, T, pl.routing))
        return ref_fail(rank, "problem init");
    const int64_t L = p.L, Ts = p.T[rank];
    if (ref_rm_bounds(&p, permute, pl.pad, pl.bound, bounds) ||
        ref_rm_dispatch(&p, rank, permute, pl.pad, bounds[rank], &rv)) {
        rc = ref_fail(rank, "reference dispatch");
        goto out;
    }
    const int64_t bound = bounds[rank], real = rv.real, rows = rv.rows, kept = real < rows ? real : rows;
    const bool overflow = bound >= 0 && real > bound;
    ref_set_case(
        "gpu rm R=%d E=%d K=%d H=%lld iter %d: %s, pad %d, %s, bound %s (%lld, real %lld), probs %d, "
        "weighted %d, routing %s, T[rank]=%lld",
        R, E, K, (long long)H, it, permute ? "permute" : "no permute", pl.pad, epx_dtype_name(dtype),
        ref_bound_name(pl.bound), (long long)bound, (long long)real, pl.with_probs, pl.weighted,
        ref_routing_name(pl.routing), (long long)Ts);

    inputs_t in;
    make_inputs(&p, rank, &a, &in);
    const int64_t pw = permute ? 1 : L;
    uint8_t *e_tok = ref_arena_alloc(&a, esz * (size_t)(rows * H) + 16);
    float *e_sf = ref_arena_alloc(&a, 4 * (size_t)(rows * SG) + 16);
    for (int64_t i = 0; i < rows; i++) {
        if (rv.src[i] < 0) continue;
        ref_x_row(&p, rv.src[i], rv.tok[i], REF_TAG_X, e_tok + (size_t)(i * H) * esz);
        ref_scales_row(&p, rv.src[i], rv.tok[i], REF_TAG_X, e_sf + i * SG);
    }
    /* Without a bound the outputs are a little larger than needed (rows past P are not read). */
    const int64_t cap_rows = bound >= 0 ? rows : rows + 3;
    void *d_hidden = gpu_alloc(&da, esz * (size_t)(Ts * H), in.hidden);
    void *d_sf = gpu_alloc(&da, 4 * (size_t)(Ts * SG), in.sf);
    void *d_map = gpu_alloc(&da, (size_t)(Ts * E), in.map);
    void *d_probs = gpu_alloc(&da, 4 * (size_t)(Ts * E), in.probs);
    void *o_tok = gpu_alloc(&da, esz * (size_t)(cap_rows * H), NULL);
    void *o_sf = gpu_alloc(&da, 4 * (size_t)(cap_rows * SG), NULL);
    void *o_probs = gpu_alloc(&da, 4 * (size_t)(cap_rows * pw), NULL);
    void *o_tpe = gpu_alloc(&da, 4 * (size_t)L, NULL);
    void *o_num = gpu_alloc(&da, 4, NULL);
    void *c_x = gpu_alloc(&da, 2 * (size_t)(cap_rows * H), NULL);
    void *c_out = gpu_alloc(&da, 2 * (size_t)(Ts * H), NULL);
    /* The optional local map on every other iteration (0xa5 fill shows unwritten rows). */
    const bool with_lmap = it % 2 == 0;
    const int64_t lmap_rows = (int64_t)R * su->T_max + 1;
    void *o_lmap = with_lmap ? gpu_alloc(&da, (size_t)(lmap_rows * L), NULL) : NULL;
    if (!c_out || (with_lmap && !o_lmap)) {
        rc = ref_fail(rank, "cudaMalloc");
        goto out;
    }
    epx_rm_dispatch_args_t args = EPX_RM_DISPATCH_ARGS_INIT;
    args.hidden = gpu_tensor(d_hidden, dtype, 2, Ts, H, 0, dev);
    if (fp8) args.scaling_factor = gpu_tensor(d_sf, EPX_DTYPE_FP32, 2, Ts, SG, 0, dev);
    args.routing_map = gpu_tensor(d_map, EPX_DTYPE_BOOL, 2, Ts, E, 0, dev);
    if (pl.with_probs) args.probs = gpu_tensor(d_probs, EPX_DTYPE_FP32, 2, Ts, E, 0, dev);
    args.permute = permute;
    args.pad_multiple = pl.pad;
    args.num_dispatched_tokens = permute ? -1 : bound;
    args.num_permuted_tokens = permute ? bound : -1;
    epx_rm_dispatch_outputs_t outs = EPX_RM_DISPATCH_OUTPUTS_INIT;
    outs.tokens = gpu_tensor(o_tok, dtype, 2, cap_rows, H, 0, dev);
    if (fp8) outs.scaling_factor = gpu_tensor(o_sf, EPX_DTYPE_FP32, 2, cap_rows, SG, 0, dev);
    if (pl.with_probs)
        outs.probs = permute ? gpu_tensor(o_probs, EPX_DTYPE_FP32, 1, cap_rows, 0, 0, dev)
                             : gpu_tensor(o_probs, EPX_DTYPE_FP32, 2, cap_rows, L, 0, dev);
    if (permute) outs.tokens_per_expert = gpu_tensor(o_tpe, EPX_DTYPE_INT32, 1, L, 0, 0, dev);
    outs.num_tokens = gpu_tensor(o_num, EPX_DTYPE_INT32, 1, 1, 0, 0, dev);
    if (with_lmap) outs.local_map = gpu_tensor(o_lmap, EPX_DTYPE_BOOL, 2, lmap_rows, L, 0, dev);
    CALL(epx_rm_dispatch(su->buf, &args, &outs));
    handle = outs.handle;
    if (cudaDeviceSynchronize() != cudaSuccess) {
        rc = ref_fail(rank, "cudaDeviceSynchronize after dispatch");
        goto out;
    }
    CHECK(outs.num_tokens_host == rows, "num_tokens_host = %lld, expected %lld",
          (long long)outs.num_tokens_host, (long long)rows);
    int32_t num = -1;
    cudaMemcpy(&num, o_num, 4, cudaMemcpyDeviceToHost);
    CHECK(num == real, "num_tokens[0] = %d, expected %lld", num, (long long)real);
    rc |=
        ref_check_bits(rank, "tokens", to_host(&a, o_tok, esz * (size_t)(rows * H)), e_tok, rows * H, esz, H);
    if (fp8)
        rc |= ref_check_bits(rank, "scaling_factor", to_host(&a, o_sf, 4 * (size_t)(rows * SG)), e_sf,
                             rows * SG, 4, SG);
    if (pl.with_probs)
        rc |= ref_check_bits(rank, "probs", to_host(&a, o_probs, 4 * (size_t)(rows * pw)), rv.probs,
                             rows * pw, 4, pw);
    if (permute)
        rc |= ref_check_bits(rank, "tokens_per_expert", to_host(&a, o_tpe, 4 * (size_t)L),
                             rv.tokens_per_expert, L, 4, L);
    if (with_lmap) {
        uint8_t *e_lmap = ref_arena_alloc(&a, (size_t)(lmap_rows * L));
        ref_rm_local_map(&p, rank, lmap_rows, e_lmap);
        rc |= ref_check_bits(rank, "local_map", to_host(&a, o_lmap, (size_t)(lmap_rows * L)), e_lmap,
                             lmap_rows * L, 1, L);
    }
    rc |= ref_check_overflow(rank, su->buf, overflow ? EPX_ERR_OVERFLOW : EPX_SUCCESS);
    epx_handle_info_t info;
    CALL(epx_handle_get_info(handle, &info));
    /* With a bound nothing waits for the real count: the handle covers the bound's rows. */
    CHECK(info.num_tokens == Ts && info.num_recv_tokens == (bound >= 0 ? bound : kept),
          "handle info {%lld, %lld}, expected {%lld, %lld}", (long long)info.num_tokens,
          (long long)info.num_recv_tokens, (long long)Ts, (long long)(bound >= 0 ? bound : kept));

    /* Combine: rows the handle does not cover, and padding rows, hold a value that would show. */
    {
        const uint64_t yseed = seed ^ 0x726d63ull;
        uint16_t *cx = ref_arena_alloc(&a, 2 * (size_t)(cap_rows * H) + 16);
        for (int64_t i = 0; i < cap_rows; i++)
            for (int64_t c = 0; c < H; c++)
                cx[i * H + c] = i < kept && rv.src[i] >= 0
                                    ? ref_y_bf16(yseed, rank, permute ? rv.j[i] : -1, rv.src[i], rv.tok[i], c)
                                    : 0x7f00;
        gpu_h2d(c_x, cx, 2 * (size_t)(cap_rows * H));
        uint16_t *exp = ref_arena_alloc(&a, 2 * (size_t)(Ts * H) + 16);
        epx_rm_combine_args_t cargs = EPX_RM_COMBINE_ARGS_INIT;
        cargs.handle = handle;
        cargs.x = gpu_tensor(c_x, EPX_DTYPE_BF16, 2, cap_rows, H, 0, dev);
        cargs.weighted = pl.weighted;
        epx_rm_combine_outputs_t couts = EPX_RM_COMBINE_OUTPUTS_INIT;
        couts.combined = gpu_tensor(c_out, EPX_DTYPE_BF16, 2, Ts, H, 0, dev);
        CALL(epx_rm_combine(su->buf, &cargs, &couts));
        if (cudaDeviceSynchronize() != cudaSuccess) {
            rc = ref_fail(rank, "cudaDeviceSynchronize after combine");
            goto out;
        }
        if (ref_rm_combine(&p, rank, permute, pl.pad, bounds, pl.weighted, yseed, exp)) {
            rc = ref_fail(rank, "reference combine");
            goto out;
        }
        rc |= ref_check_bits(rank, "combined", to_host(&a, c_out, 2 * (size_t)(Ts * H)), exp, Ts * H, 2, H);
    }
out:
    epx_handle_destroy(handle);
    gpu_arena_free(&da);
    ref_arena_free(&a);
    ref_rm_recv_free(&rv);
    ref_problem_free(&p);
    return rc;
}

/* Capture: refused without a bound (message names it); with bounds that differ from the
 * previous eager counts the shape is exactly the bound; replays with new routing written into
 * the same inputs are checked (dispatch outputs and the weighted combine of the output itself). */
static int rm_graph(const setup_t *su, uint64_t gseed)
{
    int rc = 0, R = su->R, K = su->K, E = su->E, rank = su->rank, dev = su->device;
    const int64_t H = su->H, Tm = su->T_max, pad = 16;
    const int64_t L = E / R, cap = R * Tm * (K < L ? K : L) + L * (REF_RM_MAX_PAD - 1);
    int64_t T[REF_MAX_RANKS], bounds[REF_MAX_RANKS];
    for (int r = 0; r < REF_MAX_RANKS; r++) T[r] = Tm; /* shapes are fixed by the graph */
    ref_arena_t a = {0};
    gpu_arena_t da = {0};
    epx_handle_t handle = NULL, eager = NULL;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    cudaStream_t st = NULL;
    ref_problem_t p0;
    if (ref_problem_init(&p0, R, E, K, H, Tm, EPX_DTYPE_BF16, gseed, T, REF_ROUTE_RANDOM))
        return ref_fail(rank, "problem init");
    ref_set_case("gpu rm graph R=%d E=%d K=%d H=%lld: eager", R, E, K, (long long)H);
    for (int r = 0; r < R; r++) {
        ref_rm_recv_t other;
        if (ref_rm_dispatch(&p0, r, true, (int)pad, -1, &other)) {
            ref_rm_recv_free(&other);
            ref_problem_free(&p0);
            return ref_fail(rank, "reference dispatch");
        }
        /* Differs from the eager count; rank 0's is below it (overflow on some replays). */
        bounds[r] = r == 0 ? (other.real > 2 ? other.real - 2 : 1) : other.real + 7 + r;
        if (bounds[r] > cap) bounds[r] = cap;
        ref_rm_recv_free(&other);
    }
    const int64_t B = bounds[rank], big = cap;
    inputs_t in;
    make_inputs(&p0, rank, &a, &in);
    void *d_hidden = gpu_alloc(&da, 2 * (size_t)(Tm * H), in.hidden);
    void *d_map = gpu_alloc(&da, (size_t)(Tm * E), in.map);
    void *d_probs = gpu_alloc(&da, 4 * (size_t)(Tm * E), in.probs);
    void *o_tok = gpu_alloc(&da, 2 * (size_t)(big * H), NULL);
    void *o_probs = gpu_alloc(&da, 4 * (size_t)big, NULL);
    void *o_tpe = gpu_alloc(&da, 4 * (size_t)L, NULL);
    void *o_num = gpu_alloc(&da, 4, NULL);
    void *c_out = gpu_alloc(&da, 2 * (size_t)(Tm * H), NULL);
    if (!c_out || cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess) {
        rc = ref_fail(rank, "cuda setup");
        goto out;
    }
    epx_rm_dispatch_args_t args = EPX_RM_DISPATCH_ARGS_INIT;
    args.hidden = gpu_tensor(d_hidden, EPX_DTYPE_BF16, 2, Tm, H, 0, dev);
    args.routing_map = gpu_tensor(d_map, EPX_DTYPE_BOOL, 2, Tm, E, 0, dev);
    args.probs = gpu_tensor(d_probs, EPX_DTYPE_FP32, 2, Tm, E, 0, dev);
    args.permute = 1;
    args.pad_multiple = (int32_t)pad;
    args.stream = st;
    epx_rm_dispatch_outputs_t outs = EPX_RM_DISPATCH_OUTPUTS_INIT;
    outs.tokens = gpu_tensor(o_tok, EPX_DTYPE_BF16, 2, big, H, 0, dev);
    outs.probs = gpu_tensor(o_probs, EPX_DTYPE_FP32, 1, big, 0, 0, dev);
    outs.tokens_per_expert = gpu_tensor(o_tpe, EPX_DTYPE_INT32, 1, L, 0, 0, dev);
    outs.num_tokens = gpu_tensor(o_num, EPX_DTYPE_INT32, 1, 1, 0, 0, dev);
    /* Eager first: the host learns a count that the captured call must not reuse. */
    CALL(epx_rm_dispatch(su->buf, &args, &outs));
    eager = outs.handle;
    epx_handle_destroy(eager); /* its slab goes back to the pool the capture takes from */
    eager = NULL;

    for (int pm = 0; pm < 2; pm++) {
        ref_set_case("gpu rm graph R=%d: capture without a bound (%s)", R, pm ? "permute" : "no permute");
        epx_rm_dispatch_args_t na = args;
        na.permute = pm;
        epx_rm_dispatch_outputs_t no = outs;
        if (!pm) { /* without permute: [N_r, H] tokens, no probs, no tokens_per_expert */
            no.tokens = gpu_tensor(o_tok, EPX_DTYPE_BF16, 2, R * Tm, H, 0, dev);
            memset(&no.probs, 0, sizeof(no.probs));
            memset(&no.tokens_per_expert, 0, sizeof(no.tokens_per_expert));
            memset(&na.probs, 0, sizeof(na.probs));
        }
        if (cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
            rc = ref_fail(rank, "cudaStreamBeginCapture");
            goto out;
        }
        epx_result_t res = epx_rm_dispatch(su->buf, &na, &no);
        char msg[1024];
        snprintf(msg, sizeof(msg), "%s", epx_last_error_message());
        cudaGraph_t g = NULL;
        cudaStreamEndCapture(st, &g);
        if (g) cudaGraphDestroy(g);
        (void)cudaGetLastError();
        if (res == EPX_SUCCESS) epx_handle_destroy(no.handle);
        const char *name = pm ? "num_permuted_tokens" : "num_dispatched_tokens";
        CHECK(res == EPX_ERR_GRAPH_CAPTURE && strstr(msg, name), "capture without %s: %s (%s)", name,
              epx_result_name(res), msg);
        if (rc) goto out;
    }

    ref_set_case("gpu rm graph R=%d: capture with bound %lld", R, (long long)B);
    args.num_permuted_tokens = B;
    if (cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
        rc = ref_fail(rank, "cudaStreamBeginCapture");
        goto out;
    }
    epx_result_t res = epx_rm_dispatch(su->buf, &args, &outs);
    if (res == EPX_SUCCESS) {
        handle = outs.handle;
        epx_rm_combine_args_t ca = EPX_RM_COMBINE_ARGS_INIT;
        ca.handle = handle;
        ca.x = gpu_tensor(o_tok, EPX_DTYPE_BF16, 2, B, H, 0, dev);
        ca.weighted = 1;
        ca.stream = st;
        epx_rm_combine_outputs_t co = EPX_RM_COMBINE_OUTPUTS_INIT;
        co.combined = gpu_tensor(c_out, EPX_DTYPE_BF16, 2, Tm, H, 0, dev);
        res = epx_rm_combine(su->buf, &ca, &co);
    }
    char msg[1024];
    snprintf(msg, sizeof(msg), "%s", epx_last_error_message());
    if (cudaStreamEndCapture(st, &graph) != cudaSuccess || res != EPX_SUCCESS) {
        rc = ref_fail(rank, "capture with a bound: %s (%s)", epx_result_name(res), msg);
        goto out;
    }
    CHECK(outs.num_tokens_host == B, "captured num_tokens_host = %lld, expected the bound %lld",
          (long long)outs.num_tokens_host, (long long)B);
    if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
        rc = ref_fail(rank, "cudaGraphInstantiate");
        goto out;
    }
    for (int replay = 0; replay < 3 && rc == 0; replay++) {
        ref_problem_t p;
        ref_rm_recv_t rv = {0};
        const uint64_t s2 = gseed + 7919ull * (uint64_t)(replay + 1);
        ref_set_case("gpu rm graph R=%d replay %d bound %lld", R, replay, (long long)B);
        if (ref_problem_init(&p, R, E, K, H, Tm, EPX_DTYPE_BF16, s2, T,
                             replay == 1 ? REF_ROUTE_SKEWED : REF_ROUTE_RANDOM) ||
            ref_rm_dispatch(&p, rank, true, (int)pad, B, &rv)) {
            rc = ref_fail(rank, "reference");
            break;
        }
        ref_arena_t ra = {0};
        inputs_t ri;
        make_inputs(&p, rank, &ra, &ri);
        gpu_h2d(d_hidden, ri.hidden, 2 * (size_t)(Tm * H));
        gpu_h2d(d_map, ri.map, (size_t)(Tm * E));
        gpu_h2d(d_probs, ri.probs, 4 * (size_t)(Tm * E));
        if (cudaGraphLaunch(exec, st) != cudaSuccess || cudaStreamSynchronize(st) != cudaSuccess) {
            rc = ref_fail(rank, "graph launch");
        } else {
            epx_result_t ae = epx_get_async_error(su->comm);
            CHECK(ae == EPX_SUCCESS, "async error after replay: %s (%s)", epx_result_name(ae),
                  epx_last_error_message());
            int32_t num = -1;
            cudaMemcpy(&num, o_num, 4, cudaMemcpyDeviceToHost);
            CHECK(num == rv.real, "replay num_tokens = %d, expected %lld", num, (long long)rv.real);
            epx_result_t q = epx_buffer_query_overflow(su->buf);
            CHECK(q == (rv.real > B ? EPX_ERR_OVERFLOW : EPX_SUCCESS),
                  "replay overflow query %s, real %lld bound %lld", epx_result_name(q), (long long)rv.real,
                  (long long)B);
            uint16_t *e_tok = ref_arena_alloc(&ra, 2 * (size_t)(B * H) + 16);
            for (int64_t i = 0; i < B; i++)
                if (rv.src[i] >= 0) ref_x_row(&p, rv.src[i], rv.tok[i], REF_TAG_X, e_tok + i * H);
            rc |= ref_check_bits(rank, "graph tokens", to_host(&ra, o_tok, 2 * (size_t)(B * H)), e_tok, B * H,
                                 2, H);
            rc |=
                ref_check_bits(rank, "graph probs", to_host(&ra, o_probs, 4 * (size_t)B), rv.probs, B, 4, 1);
            rc |= ref_check_bits(rank, "graph tokens_per_expert", to_host(&ra, o_tpe, 4 * (size_t)L),
                                 rv.tokens_per_expert, L, 4, L);
            /* Expected combine of the outputs themselves: for each selected expert ascending whose row
             * survived its rank's bound, acc += prob * hidden (fp32, no fma), one rounding. */
            uint8_t *kept = ref_arena_alloc(&ra, (size_t)(Tm * E) + 16);
            for (int r = 0; r < R; r++) {
                ref_rm_recv_t o = {0};
                if (ref_rm_dispatch(&p, r, true, (int)pad, bounds[r], &o) == 0)
                    for (int64_t i = 0; i < o.rows; i++)
                        if (o.src[i] == rank) kept[o.tok[i] * E + (int64_t)r * L + o.j[i]] = 1;
                ref_rm_recv_free(&o);
            }
            uint16_t *e_out = ref_arena_alloc(&ra, 2 * (size_t)(Tm * H) + 16);
            const uint16_t *hx = (const uint16_t *)ri.hidden;
            for (int64_t t = 0; t < Tm; t++)
                for (int64_t c = 0; c < H; c++) {
                    float acc = 0.0f;
                    for (int e = 0; e < E; e++)
                        if (kept[t * E + e])
                            acc =
                                ref_fadd(acc, ref_fmul(ri.probs[t * E + e], ref_bf16_to_f32(hx[t * H + c])));
                    e_out[t * H + c] = ref_f32_to_bf16(acc);
                }
            rc |= ref_check_bits(rank, "graph combined", to_host(&ra, c_out, 2 * (size_t)(Tm * H)), e_out,
                                 Tm * H, 2, H);
        }
        ref_arena_free(&ra);
        ref_rm_recv_free(&rv);
        ref_problem_free(&p);
    }
out:
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    epx_handle_destroy(handle);
    epx_handle_destroy(eager);
    if (st) cudaStreamDestroy(st);
    gpu_arena_free(&da);
    ref_arena_free(&a);
    ref_problem_free(&p0);
    return rc;
}

static int rank_main(int rank, int nranks, const epx_unique_id_t *id, void *vctx)
{
    const gpu_ctx_t *ctx = vctx;
    setup_t su = {0};
    su.R = nranks;
    su.rank = rank;
    if (gpu_test_comm(ctx, id, rank, nranks, 0, &su.comm, &su.device)) return 1;
    epx_topology_t topo;
    EXPECT_OK(epx_comm_get_topology(su.comm, &topo));
    if (rank == 0)
        printf("rm: %d ranks, %d per nvlink domain, %d domains\n", topo.nranks, topo.ranks_per_nvlink_domain,
               topo.num_nvlink_domains);
    EXPECT_TRUE(topo.ranks_per_nvlink_domain >= 1 &&
                topo.num_nvlink_domains * topo.ranks_per_nvlink_domain == nranks);
    int rc = 0;
    /* K > R and K <= R both occur over R = 2, 4, 8 (the unpermute area is separate or shared); at
     * R = 1, E = 64 reads the routing map 16 bytes at a time and E = 8 byte by byte. */
    const int Es[3] = {64, 8 * nranks, 8 * nranks};
    const int Ks[3] = {6, 3, 3};
    /* 100: not a multiple of 8 (the kernels' scalar paths), bf16 only, default dtypes. */
    const int64_t Hs[3] = {1024, 7168, 100};
    for (int ci = 0; ci < 3 && rc == 0; ci++) {
        su.E = Es[ci];
        su.K = Ks[ci];
        su.H = ctx->quick && ci < 2 ? 256 : Hs[ci];
        su.T_max = ctx->quick ? 12 : (ci ? 24 : 48);
        epx_buffer_config_t bc = epx_test_buffer_config(su.T_max, su.H, su.K, su.E, EPX_MODE_PERMUTE);
        bc.dispatch_dtypes =
            su.H % 128 == 0 ? EPX_DTYPE_BIT(EPX_DTYPE_BF16) | EPX_DTYPE_BIT(EPX_DTYPE_FP8_E4M3) : 0;
        bc.max_pad_multiple = REF_RM_MAX_PAD;
        EXPECT_OK(epx_buffer_create(su.comm, &bc, &su.buf));
        const int iters = ctx->quick ? 8 : (ci ? 16 : 2 * 4 * REF_BOUND_COUNT);
        for (int it = 0; it < iters && !(rc & 2); it++) rc |= rm_iteration(&su, ctx->seed + (uint64_t)ci, it);
        if (rc == 0 && !ctx->quick) rc = rm_graph(&su, ctx->seed + 17 + (uint64_t)ci);
        if (rc == 0) EXPECT_OK(epx_get_async_error(su.comm));
        EXPECT_OK(epx_buffer_destroy(su.buf));
    }
    EXPECT_OK(epx_comm_destroy(su.comm));
    return rc;
}

int main(void)
{
    gpu_ctx_t ctx;
    if (gpu_test_init(&ctx)) return EPX_TEST_SKIP;
    return gpu_test_each_nranks("rm", "1,2,4,8", rank_main, &ctx);
}
