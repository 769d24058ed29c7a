/*
 * HT dispatch and combine on the cuda backend, R ranks (processes) on the GPUs present: every
 * received row, scale, index, weight and count and every combined value is compared bit for bit
 * with the single-process reference (tests/common/reference.c). Cases: bf16 and fp8, H 7168 and
 * 2048, E 256, K 8, random and skewed routing with ragged and zero-token ranks, cached dispatch,
 * static mode captured in a CUDA graph and replayed with new inputs, static mode with rows dropped
 * past num_worst_tokens, 200 repeated iterations; view mode (outputs and combine input in the
 * library's buffer) for bf16 and fp8 with repeats, each rank rotating over three view areas on its
 * own, a view kept intact across a dispatch into another area, and a combine that reads the
 * dispatch view in place (x_in_buffer 2) on even ranks while odd ranks use the combine input.
 * EPX_GPU_TEST_RANKS (default "2,4,8") and EPX_GPU_TEST_QUICK=1 (sanitizer runs) shrink it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "gpu_test.h"

#define E_EXPERTS  256
#define TOPK       8
#define ALIGNMENT  4
#define VIEW_AREAS 3

static epx_comm_t epx_test_current_comm; /* the rank's comm, for epx_get_async_error */

typedef struct ht_case {
    int64_t H, T_max;
    epx_dtype_t dtype;
    ref_routing_t routing;
    int iter; /* token counts: 0 full, 1 with zero-token ranks, >1 random */
    int idx64;
    int repeats; /* eager dispatch+combine iterations whose hashes must match */
    int view;    /* recv_in_buffer dispatches and x_in_buffer combine (one pass over the bytes) */
} ht_case_t;

/* Host copies of one rank's inputs for problem p (x tagged `tag`). */
typedef struct inputs {
    void *x;
    float *scales;
    void *topk;
    uint16_t *bias0, *bias1;
} inputs_t;

static void make_inputs(const ref_problem_t *p, int me, uint64_t tag, uint64_t yseed, int idx64,
                        ref_arena_t *ar, inputs_t *in)
{
    const int64_t T = p->T[me], H = p->H;
    const size_t es = epx_dtype_size(p->dtype);
    in->x = ref_arena_alloc(ar, (size_t)(T * H) * es + 16);
    for (int64_t t = 0; t < T; t++) ref_x_row(p, me, t, tag, (uint8_t *)in->x + (size_t)(t * H) * es);
    in->scales = ref_arena_alloc(ar, (size_t)(T * (H / 128)) * 4 + 16);
    if (p->dtype == EPX_DTYPE_FP8_E4M3)
        for (int64_t t = 0; t < T; t++) ref_scales_row(p, me, t, tag, in->scales + t * (H / 128));
    in->topk = ref_arena_alloc(ar, (size_t)(T * p->K) * 8 + 16);
    ref_fill_topk(p, me, idx64 ? EPX_DTYPE_INT64 : EPX_DTYPE_INT32, in->topk);
    in->bias0 = ref_arena_alloc(ar, (size_t)(T * H) * 2 + 16);
    in->bias1 = ref_arena_alloc(ar, (size_t)(T * H) * 2 + 16);
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = 0; c < H; c++) {
            in->bias0[t * H + c] = ref_gen_bf16(yseed, REF_TAG_BIAS0, (uint64_t)me, (uint64_t)t, (uint64_t)c);
            in->bias1[t * H + c] = ref_gen_bf16(yseed, REF_TAG_BIAS1, (uint64_t)me, (uint64_t)t, (uint64_t)c);
        }
}

/* Frees what one case held and passes its result through. */
static int release(int rc, epx_handle_t handle, gpu_arena_t *da, ref_ht_recv_t *ref, ref_arena_t *ar,
                   ref_problem_t *p)
{
    if (handle) epx_handle_destroy(handle);
    gpu_arena_free(da);
    ref_ht_recv_free(ref);
    ref_arena_free(ar);
    ref_problem_free(p);
    return rc;
}

/* Eager (host-synchronising) dispatch, cached dispatch and combine of one problem, all checked. */
static int run_eager(epx_buffer_t buf, int rank, int R, const ht_case_t *cs, uint64_t seed, int device)
{
    int rc = 1;
    ref_arena_t ar = {0};
    gpu_arena_t da = {0};
    ref_problem_t p;
    ref_ht_recv_t ref = {0};
    epx_handle_t handle = NULL;
    int64_t T[REF_MAX_RANKS];
    ref_gen_token_counts(seed, cs->iter, R, cs->T_max, T);
    if (ref_problem_init(&p, R, E_EXPERTS, TOPK, cs->H, cs->T_max, cs->dtype, seed, T, cs->routing) != 0)
        return ref_fail(rank, "problem init");
    ref_set_case("eager R=%d H=%lld %s %s iter %d idx%s%s", R, (long long)cs->H, epx_dtype_name(cs->dtype),
                 ref_routing_name(cs->routing), cs->iter, cs->idx64 ? "64" : "32", cs->view ? " view" : "");
    const int64_t H = cs->H, K = TOPK, L = E_EXPERTS / R, Tm = T[rank], S = H / 128;
    const int fp8 = cs->dtype == EPX_DTYPE_FP8_E4M3;
    const size_t es = epx_dtype_size(cs->dtype);
    const uint64_t yseed = seed ^ 0x5eedull;
    if (ref_ht_dispatch(&p, rank, ALIGNMENT, &ref) != 0) {
        rc = ref_fail(rank, "reference dispatch");
        goto out;
    }
    inputs_t in, in2;
    make_inputs(&p, rank, REF_TAG_X, yseed, cs->idx64, &ar, &in);
    make_inputs(&p, rank, REF_TAG_X2, yseed, cs->idx64, &ar, &in2);
    const int64_t cap = (int64_t)R * cs->T_max;
    void *dx = gpu_alloc(&da, (size_t)(Tm * H) * es, NULL),
         *dscales = gpu_alloc(&da, (size_t)(Tm * S) * 4, NULL);
    void *dtopk = gpu_alloc(&da, (size_t)(Tm * K) * 8, NULL),
         *dw = gpu_alloc(&da, (size_t)(Tm * K) * 4, NULL);
    void *drx = gpu_alloc(&da, (size_t)(cap * H) * es, NULL),
         *drs = gpu_alloc(&da, (size_t)(cap * S) * 4, NULL);
    void *dridx = gpu_alloc(&da, (size_t)(cap * K) * 8, NULL),
         *drw = gpu_alloc(&da, (size_t)(cap * K) * 4, NULL);
    void *dpe = gpu_alloc(&da, (size_t)L * 4, NULL), *dn = gpu_alloc(&da, 4, NULL);
    void *dpm = gpu_alloc(&da, (size_t)(R * R) * 4, NULL);
    void *dy = gpu_alloc(&da, (size_t)(cap * H) * 2, NULL), *db0 = gpu_alloc(&da, (size_t)(Tm * H) * 2, NULL);
    void *db1 = gpu_alloc(&da, (size_t)(Tm * H) * 2, NULL),
         *dout = gpu_alloc(&da, (size_t)(Tm * H) * 2, NULL);
    void *doutw = gpu_alloc(&da, (size_t)(Tm * K) * 4, NULL);
    if (!doutw) {
        rc = ref_fail(rank, "cudaMalloc");
        goto out;
    }
    gpu_h2d(dx, in.x, (size_t)(Tm * H) * es);
    if (fp8) gpu_h2d(dscales, in.scales, (size_t)(Tm * S) * 4);
    gpu_h2d(dtopk, in.topk, (size_t)(Tm * K) * (cs->idx64 ? 8 : 4));
    gpu_h2d(dw, p.weights[rank], (size_t)(Tm * K) * 4);
    gpu_h2d(db0, in.bias0, (size_t)(Tm * H) * 2);
    gpu_h2d(db1, in.bias1, (size_t)(Tm * H) * 2);
    const epx_dtype_t idt = cs->idx64 ? EPX_DTYPE_INT64 : EPX_DTYPE_INT32;
    /* Received index dtype differs from the input's on purpose. */
    const epx_dtype_t ridt = cs->idx64 || cs->view ? EPX_DTYPE_INT32 : EPX_DTYPE_INT64;

    /* Host-side expectations. */
    const int64_t n = ref.n;
    uint8_t *ex = ref_arena_alloc(&ar, (size_t)(n * H) * es + 16);
    float *esc = ref_arena_alloc(&ar, (size_t)(n * S) * 4 + 16);
    uint8_t *ex2 = ref_arena_alloc(&ar, (size_t)(n * H) * es + 16);
    float *esc2 = ref_arena_alloc(&ar, (size_t)(n * S) * 4 + 16);
    for (int64_t i = 0; i < n; i++) {
        ref_x_row(&p, ref.src[i], ref.tok[i], REF_TAG_X, ex + (size_t)(i * H) * es);
        ref_x_row(&p, ref.src[i], ref.tok[i], REF_TAG_X2, ex2 + (size_t)(i * H) * es);
        if (fp8) {
            ref_scales_row(&p, ref.src[i], ref.tok[i], REF_TAG_X, esc + i * S);
            ref_scales_row(&p, ref.src[i], ref.tok[i], REF_TAG_X2, esc2 + i * S);
        }
    }
    void *eidx = ref_arena_alloc(&ar, (size_t)(n * K) * 8 + 16);
    for (int64_t i = 0; i < n * K; i++) {
        if (ridt == EPX_DTYPE_INT64)
            ((int64_t *)eidx)[i] = ref.idx[i];
        else
            ((int32_t *)eidx)[i] = (int32_t)ref.idx[i];
    }
    uint16_t *y = ref_arena_alloc(&ar, (size_t)(n * H) * 2 + 16);
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = 0; c < H; c++) y[i * H + c] = ref_y_bf16(yseed, rank, -1, ref.src[i], ref.tok[i], c);
    gpu_h2d(dy, y, (size_t)(n * H) * 2);
    uint16_t *eout = ref_arena_alloc(&ar, (size_t)(Tm * H) * 2 + 16);
    float *eoutw = ref_arena_alloc(&ar, (size_t)(Tm * K) * 4 + 16);
    ref_ht_combine(&p, rank, yseed, true, true, eout, eoutw);

    uint8_t *got = ref_arena_alloc(&ar, (size_t)(cap * H) * es + 16);
    int32_t *erpm = ref_arena_alloc(&ar, (size_t)(R * R) * 4 + 16);
    ref_rank_prefix(&p, erpm);

    /* Layout on the device against the reference. */
    {
        int32_t eper_rank[REF_MAX_RANKS], eper_expert[E_EXPERTS];
        uint8_t *ein = ref_arena_alloc(&ar, (size_t)(Tm * R) + 16);
        ref_layout(&p, rank, R, eper_rank, eper_expert, ein, NULL);
        void *dpr = gpu_alloc(&da, (size_t)R * 4, NULL), *dpx = gpu_alloc(&da, (size_t)E_EXPERTS * 4, NULL);
        void *din = gpu_alloc(&da, (size_t)(Tm * R), NULL);
        if (!din) {
            rc = ref_fail(rank, "cudaMalloc");
            goto out;
        }
        epx_tensor_t ti = gpu_tensor(dtopk, idt, 2, Tm, K, 0, device);
        epx_layout_outputs_t lo = EPX_LAYOUT_OUTPUTS_INIT;
        lo.num_tokens_per_rank = gpu_tensor(dpr, EPX_DTYPE_INT32, 1, R, 0, 0, device);
        lo.num_tokens_per_expert = gpu_tensor(dpx, EPX_DTYPE_INT32, 1, E_EXPERTS, 0, 0, device);
        lo.is_token_in_rank = gpu_tensor(din, EPX_DTYPE_BOOL, 2, Tm, R, 0, device);
        EXPECT_OK(epx_get_dispatch_layout(buf, &ti, &lo, NULL));
        cudaMemcpy(got, dpr, (size_t)R * 4, cudaMemcpyDeviceToHost);
        if (ref_check_bits(rank, "num_tokens_per_rank", got, eper_rank, R, 4, R)) goto out;
        cudaMemcpy(got, dpx, (size_t)E_EXPERTS * 4, cudaMemcpyDeviceToHost);
        if (ref_check_bits(rank, "num_tokens_per_expert", got, eper_expert, E_EXPERTS, 4, E_EXPERTS))
            goto out;
        cudaMemcpy(got, din, (size_t)(Tm * R), cudaMemcpyDeviceToHost);
        if (ref_check_bits(rank, "is_token_in_rank", got, ein, Tm * R, 1, R)) goto out;
    }
    uint64_t first_hash = 0;
    for (int it = 0; it < (cs->repeats > 0 ? cs->repeats : 1); it++) {
        epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
        a.x = gpu_tensor(dx, cs->dtype, 2, Tm, H, 0, device);
        if (fp8) a.x_scales = gpu_tensor(dscales, EPX_DTYPE_FP32, 2, Tm, S, 0, device);
        a.topk_idx = gpu_tensor(dtopk, idt, 2, Tm, K, 0, device);
        a.topk_weights = gpu_tensor(dw, EPX_DTYPE_FP32, 2, Tm, K, 0, device);
        a.expert_alignment = ALIGNMENT;
        epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
        a.recv_in_buffer = cs->view;
        /* Each rank rotates over the view areas on its own; the cached call takes the next one. */
        a.view_area = cs->view ? (rank + it) % VIEW_AREAS : 0;
        if (!cs->view) {
            o.recv_x = gpu_tensor(drx, cs->dtype, 2, cap, H, 0, device);
            if (fp8) o.recv_x_scales = gpu_tensor(drs, EPX_DTYPE_FP32, 2, cap, S, 0, device);
            o.recv_topk_idx = gpu_tensor(dridx, ridt, 2, cap, K, 0, device);
            o.recv_topk_weights = gpu_tensor(drw, EPX_DTYPE_FP32, 2, cap, K, 0, device);
        }
        o.num_recv_tokens_per_expert = gpu_tensor(dpe, EPX_DTYPE_INT32, 1, L, 0, 0, device);
        o.num_recv_tokens = gpu_tensor(dn, EPX_DTYPE_INT32, 1, 1, 0, 0, device);
        o.rank_prefix_matrix = gpu_tensor(dpm, EPX_DTYPE_INT32, 2, R, R, 0, device);
        /* The counts on the host too (the mapped block's copy); every other iteration without the
         * tensor, so the kernels count for the host array alone. */
        int32_t host_pe[E_EXPERTS];
        memset(host_pe, 0xa5, sizeof(host_pe));
        o.num_recv_tokens_per_expert_host = host_pe;
        const int host_only = it % 2 == 1;
        if (host_only) memset(&o.num_recv_tokens_per_expert, 0, sizeof(o.num_recv_tokens_per_expert));
        EXPECT_OK(epx_ht_dispatch(buf, &a, &o));
        handle = o.handle;
        if (cs->view) { /* the outputs are views of the library's buffer */
            if (!o.recv_x.data || o.recv_x.shape[0] != n || !o.recv_topk_idx.data ||
                !o.recv_topk_weights.data || o.recv_topk_idx.dtype != EPX_DTYPE_INT32 ||
                o.recv_x.device_type != EPX_DEVICE_CUDA || (fp8 && !o.recv_x_scales.data)) {
                rc = ref_fail(
                    rank, "view outputs: recv_x %p [%lld], recv_topk_idx %p %s, weights %p, scales %p",
                    o.recv_x.data, (long long)o.recv_x.shape[0], o.recv_topk_idx.data,
                    epx_dtype_name(o.recv_topk_idx.dtype), o.recv_topk_weights.data, o.recv_x_scales.data);
                goto out;
            }
            drx = o.recv_x.data;
            drs = o.recv_x_scales.data;
            dridx = o.recv_topk_idx.data;
            drw = o.recv_topk_weights.data;
        }
        if (o.num_recv_tokens_host != n) {
            rc = ref_fail(rank, "num_recv_tokens_host %lld, expected %lld", (long long)o.num_recv_tokens_host,
                          (long long)n);
            goto out;
        }
        int32_t nd = -1;
        cudaMemcpy(&nd, dn, 4, cudaMemcpyDeviceToHost);
        if (nd != n) {
            rc = ref_fail(rank, "num_recv_tokens tensor %d, expected %lld", nd, (long long)n);
            goto out;
        }
        cudaMemcpy(got, drx, (size_t)(n * H) * es, cudaMemcpyDeviceToHost);
        if (ref_check_bits(rank, "recv_x", got, ex, n * H, es, H)) goto out;
        uint64_t hash = epx_test_fnv(got, (size_t)(n * H) * es, EPX_TEST_FNV_INIT);
        if (fp8) {
            cudaMemcpy(got, drs, (size_t)(n * S) * 4, cudaMemcpyDeviceToHost);
            if (ref_check_bits(rank, "recv_x_scales", got, esc, n * S, 4, S)) goto out;
        }
        cudaMemcpy(got, dridx, (size_t)(n * K) * epx_dtype_size(ridt), cudaMemcpyDeviceToHost);
        if (ref_check_bits(rank, "recv_topk_idx", got, eidx, n * K, epx_dtype_size(ridt), K)) goto out;
        cudaMemcpy(got, drw, (size_t)(n * K) * 4, cudaMemcpyDeviceToHost);
        if (ref_check_bits(rank, "recv_topk_weights", got, ref.w, n * K, 4, K)) goto out;
        if (!host_only) {
            cudaMemcpy(got, dpe, (size_t)L * 4, cudaMemcpyDeviceToHost);
            if (ref_check_bits(rank, "num_recv_tokens_per_expert", got, ref.per_expert, L, 4, L)) goto out;
        }
        if (ref_check_bits(rank, "num_recv_tokens_per_expert_host", host_pe, ref.per_expert, L, 4, L))
            goto out;
        cudaMemcpy(got, dpm, (size_t)(R * R) * 4, cudaMemcpyDeviceToHost);
        if (ref_check_bits(rank, "rank_prefix_matrix", got, erpm, R * R, 4, R)) goto out;

        /* Cached dispatch with new x: recv_x (and scales) only. */
        gpu_h2d(dx, in2.x, (size_t)(Tm * H) * es);
        if (fp8) gpu_h2d(dscales, in2.scales, (size_t)(Tm * S) * 4);
        epx_ht_dispatch_args_t ac = EPX_HT_DISPATCH_ARGS_INIT;
        ac.x = a.x;
        ac.x_scales = a.x_scales;
        ac.cached_handle = handle;
        epx_ht_dispatch_outputs_t oc = EPX_HT_DISPATCH_OUTPUTS_INIT;
        ac.recv_in_buffer = cs->view;
        ac.view_area = cs->view ? (rank + it + 1) % VIEW_AREAS : 0;
        if (!cs->view) {
            oc.recv_x = o.recv_x;
            oc.recv_x_scales = o.recv_x_scales;
        }
        EXPECT_OK(epx_ht_dispatch(buf, &ac, &oc));
        if (cs->view && (!oc.recv_x.data || oc.recv_x.data == drx || (fp8 && !oc.recv_x_scales.data))) {
            rc = ref_fail(rank, "cached view recv_x %p, expected another area than %p", oc.recv_x.data, drx);
            goto out;
        }
        cudaMemcpy(got, oc.recv_x.data, (size_t)(n * H) * es, cudaMemcpyDeviceToHost);
        if (ref_check_bits(rank, "cached recv_x", got, ex2, n * H, es, H)) goto out;
        if (fp8) {
            cudaMemcpy(got, oc.recv_x_scales.data, (size_t)(n * S) * 4, cudaMemcpyDeviceToHost);
            if (ref_check_bits(rank, "cached recv_x_scales", got, esc2, n * S, 4, S)) goto out;
        }
        if (cs->view) { /* the first call's views, in their own area, are untouched */
            cudaMemcpy(got, drx, (size_t)(n * H) * es, cudaMemcpyDeviceToHost);
            if (ref_check_bits(rank, "recv_x after a dispatch into another area", got, ex, n * H, es, H))
                goto out;
        }
        gpu_h2d(dx, in.x, (size_t)(Tm * H) * es);
        if (fp8) gpu_h2d(dscales, in.scales, (size_t)(Tm * S) * 4);

        epx_ht_combine_args_t ca = EPX_HT_COMBINE_ARGS_INIT;
        ca.handle = handle;
        if (cs->view && !fp8 && rank % 2 == 0) {
            /* Even ranks write the expert outputs over the cached call's recv_x and combine it in
             * place (x_in_buffer 2); odd ranks use the combine input. */
            cudaMemcpy(oc.recv_x.data, dy, (size_t)(n * H) * 2, cudaMemcpyDeviceToDevice);
            ca.x = oc.recv_x;
            ca.x_in_buffer = 2;
        } else if (cs->view) { /* zero-copy: the expert outputs go into the library's rows */
            epx_tensor_t in_view;
            EXPECT_OK(epx_ht_get_combine_input(buf, handle, &in_view));
            if (!in_view.data || in_view.shape[0] != n || in_view.shape[1] != H) {
                rc = ref_fail(rank, "combine input view %p [%lld, %lld], expected [%lld, %lld]", in_view.data,
                              (long long)in_view.shape[0], (long long)in_view.shape[1], (long long)n,
                              (long long)H);
                goto out;
            }
            cudaMemcpy(in_view.data, dy, (size_t)(n * H) * 2, cudaMemcpyDeviceToDevice);
            ca.x_in_buffer = 1;
        } else {
            ca.x = gpu_tensor(dy, EPX_DTYPE_BF16, 2, n, H, 0, device);
        }
        ca.topk_weights = gpu_tensor(drw, EPX_DTYPE_FP32, 2, n, K, 0, device);
        ca.bias0 = gpu_tensor(db0, EPX_DTYPE_BF16, 2, Tm, H, 0, device);
        ca.bias1 = gpu_tensor(db1, EPX_DTYPE_BF16, 2, Tm, H, 0, device);
        epx_ht_combine_outputs_t co = EPX_HT_COMBINE_OUTPUTS_INIT;
        co.combined_x = gpu_tensor(dout, EPX_DTYPE_BF16, 2, Tm, H, 0, device);
        co.combined_topk_weights = gpu_tensor(doutw, EPX_DTYPE_FP32, 2, Tm, K, 0, device);
        EXPECT_OK(epx_ht_combine(buf, &ca, &co));
        cudaMemcpy(got, dout, (size_t)(Tm * H) * 2, cudaMemcpyDeviceToHost);
        if (ref_check_bits(rank, "combined_x", got, eout, Tm * H, 2, H)) goto out;
        hash = epx_test_fnv(got, (size_t)(Tm * H) * 2, hash);
        cudaMemcpy(got, doutw, (size_t)(Tm * K) * 4, cudaMemcpyDeviceToHost);
        if (ref_check_bits(rank, "combined_topk_weights", got, eoutw, Tm * K, 4, K)) goto out;
        if (it == 0) first_hash = hash;
        if (hash != first_hash) {
            rc = ref_fail(rank, "iteration %d: output hash %016llx differs from iteration 0's %016llx", it,
                          (unsigned long long)hash, (unsigned long long)first_hash);
            goto out;
        }
        EXPECT_OK(epx_handle_destroy(handle));
        handle = NULL;
    }
    rc = 0;
out:
    return release(rc, handle, &da, &ref, &ar, &p);
}

/* Static mode with num_worst_tokens below N_r (not captured): rows past the bound are dropped,
 * counts stay the real ones, the overflow flag is set, and combine (x with num_worst_tokens rows)
 * sums only the rows kept, weights included. */
static int run_overflow(epx_buffer_t buf, int rank, int R, int64_t H, int64_t T_max, uint64_t seed,
                        int device)
{
    int rc = 1;
    ref_arena_t ar = {0};
    gpu_arena_t da = {0};
    ref_problem_t p;
    ref_ht_recv_t ref = {0};
    epx_handle_t handle = NULL;
    int64_t T[REF_MAX_RANKS], worst[REF_MAX_RANKS], nrecv[REF_MAX_RANKS];
    ref_gen_token_counts(seed, 2, R, T_max, T);
    if (ref_problem_init(&p, R, E_EXPERTS, TOPK, H, T_max, EPX_DTYPE_BF16, seed, T, REF_ROUTE_RANDOM) != 0)
        return ref_fail(rank, "problem init");
    ref_set_case("overflow R=%d H=%lld", R, (long long)H);
    const int64_t K = TOPK, L = E_EXPERTS / R, Tm = T[rank];
    const uint64_t yseed = seed ^ 0x0fe1ull;
    /* Every rank's bound (3/4 of its N_r) and each source's rows per destination. */
    int32_t *per_rank = ref_arena_alloc(&ar, (size_t)(R * R) * 4);
    int32_t per_expert[E_EXPERTS];
    uint8_t *in_rank = ref_arena_alloc(&ar, (size_t)(Tm * R) + 16);
    for (int r = 0; r < R; r++) nrecv[r] = 0;
    for (int s = 0; s < R; s++) {
        uint8_t *tmp = ref_arena_alloc(&ar, (size_t)(T[s] * R) + 16);
        ref_layout(&p, s, R, per_rank + s * R, per_expert, tmp, NULL);
        for (int r = 0; r < R; r++) nrecv[r] += per_rank[s * R + r];
        if (s == rank) memcpy(in_rank, tmp, (size_t)(Tm * R));
    }
    for (int r = 0; r < R; r++) worst[r] = nrecv[r] * 3 / 4 > 0 ? nrecv[r] * 3 / 4 : 1;
    if (ref_ht_dispatch(&p, rank, 1, &ref) != 0 || ref.n != nrecv[rank]) {
        rc = ref_fail(rank, "reference dispatch");
        goto out;
    }
    const int64_t W = worst[rank], kept = ref.n < W ? ref.n : W;
    void *dx = gpu_alloc(&da, (size_t)(Tm * H) * 2, NULL),
         *dtopk = gpu_alloc(&da, (size_t)(Tm * K) * 4, NULL);
    void *dw = gpu_alloc(&da, (size_t)(Tm * K) * 4, NULL), *drx = gpu_alloc(&da, (size_t)(W * H) * 2, NULL);
    void *dridx = gpu_alloc(&da, (size_t)(W * K) * 4, NULL), *drw = gpu_alloc(&da, (size_t)(W * K) * 4, NULL);
    void *dpe = gpu_alloc(&da, (size_t)L * 4, NULL), *dn = gpu_alloc(&da, 4, NULL),
         *dy = gpu_alloc(&da, (size_t)(W * H) * 2, NULL);
    void *dout = gpu_alloc(&da, (size_t)(Tm * H) * 2, NULL),
         *doutw = gpu_alloc(&da, (size_t)(Tm * K) * 4, NULL);
    if (!doutw) {
        rc = ref_fail(rank, "cudaMalloc");
        goto out;
    }
    uint16_t *hx = ref_arena_alloc(&ar, (size_t)(Tm * H) * 2 + 16);
    int32_t *htopk = ref_arena_alloc(&ar, (size_t)(Tm * K) * 4 + 16);
    for (int64_t t = 0; t < Tm; t++) ref_x_row(&p, rank, t, REF_TAG_X, hx + t * H);
    ref_fill_topk(&p, rank, EPX_DTYPE_INT32, htopk);
    gpu_h2d(dx, hx, (size_t)(Tm * H) * 2);
    gpu_h2d(dtopk, htopk, (size_t)(Tm * K) * 4);
    gpu_h2d(dw, p.weights[rank], (size_t)(Tm * K) * 4);
    uint16_t *y = ref_arena_alloc(&ar, (size_t)(W * H) * 2 + 16);
    for (int64_t i = 0; i < kept; i++)
        for (int64_t c = 0; c < H; c++) y[i * H + c] = ref_y_bf16(yseed, rank, -1, ref.src[i], ref.tok[i], c);
    gpu_h2d(dy, y, (size_t)(W * H) * 2);

    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    a.x = gpu_tensor(dx, EPX_DTYPE_BF16, 2, Tm, H, 0, device);
    a.topk_idx = gpu_tensor(dtopk, EPX_DTYPE_INT32, 2, Tm, K, 0, device);
    a.topk_weights = gpu_tensor(dw, EPX_DTYPE_FP32, 2, Tm, K, 0, device);
    a.num_worst_tokens = W;
    epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
    o.recv_x = gpu_tensor(drx, EPX_DTYPE_BF16, 2, W, H, 0, device);
    o.recv_topk_idx = gpu_tensor(dridx, EPX_DTYPE_INT32, 2, W, K, 0, device);
    o.recv_topk_weights = gpu_tensor(drw, EPX_DTYPE_FP32, 2, W, K, 0, device);
    o.num_recv_tokens_per_expert = gpu_tensor(dpe, EPX_DTYPE_INT32, 1, L, 0, 0, device);
    o.num_recv_tokens = gpu_tensor(dn, EPX_DTYPE_INT32, 1, 1, 0, 0, device);
    EXPECT_OK(epx_ht_dispatch(buf, &a, &o));
    handle = o.handle;
    epx_ht_combine_args_t ca = EPX_HT_COMBINE_ARGS_INIT;
    ca.handle = handle;
    ca.x = gpu_tensor(dy, EPX_DTYPE_BF16, 2, W, H, 0, device);
    ca.topk_weights = gpu_tensor(drw, EPX_DTYPE_FP32, 2, W, K, 0, device);
    epx_ht_combine_outputs_t co = EPX_HT_COMBINE_OUTPUTS_INIT;
    co.combined_x = gpu_tensor(dout, EPX_DTYPE_BF16, 2, Tm, H, 0, device);
    co.combined_topk_weights = gpu_tensor(doutw, EPX_DTYPE_FP32, 2, Tm, K, 0, device);
    EXPECT_OK(epx_ht_combine(buf, &ca, &co));
    if (cudaDeviceSynchronize() != cudaSuccess) {
        rc = ref_fail(rank, "cudaDeviceSynchronize");
        goto out;
    }
    EXPECT_RES(epx_buffer_query_overflow(buf), ref.n > W ? EPX_ERR_OVERFLOW : EPX_SUCCESS);

    int32_t nd = -1;
    cudaMemcpy(&nd, dn, 4, cudaMemcpyDeviceToHost);
    if (nd != ref.n) {
        rc = ref_fail(rank, "num_recv_tokens tensor %d, expected the real N_r %lld", nd, (long long)ref.n);
        goto out;
    }
    uint8_t *got = ref_arena_alloc(&ar, (size_t)(W * H) * 2 + (size_t)(Tm * H) * 2 + 16);
    uint16_t *ex = ref_arena_alloc(&ar, (size_t)(W * H) * 2 + (size_t)(Tm * H) * 2 + 16);
    cudaMemcpy(got, dpe, (size_t)L * 4, cudaMemcpyDeviceToHost);
    if (ref_check_bits(rank, "num_recv_tokens_per_expert (every arriving token)", got, ref.per_expert, L, 4,
                       L))
        goto out;
    cudaMemcpy(got, drx, (size_t)(kept * H) * 2, cudaMemcpyDeviceToHost);
    for (int64_t i = 0; i < kept; i++) ref_x_row(&p, ref.src[i], ref.tok[i], REF_TAG_X, ex + i * H);
    if (ref_check_bits(rank, "recv_x (kept rows)", got, ex, kept * H, 2, H)) goto out;
    int32_t *eidx = ref_arena_alloc(&ar, (size_t)(kept * K) * 4 + 16);
    for (int64_t i = 0; i < kept * K; i++) eidx[i] = (int32_t)ref.idx[i];
    cudaMemcpy(got, dridx, (size_t)(kept * K) * 4, cudaMemcpyDeviceToHost);
    if (ref_check_bits(rank, "recv_topk_idx (kept rows)", got, eidx, kept * K, 4, K)) goto out;

    /* Combine: rank r's row of our token t counts when it landed below r's bound. */
    int64_t *run = ref_arena_alloc(&ar, (size_t)R * 8);
    for (int r = 0; r < R; r++)
        for (int s = 0; s < rank; s++) run[r] += per_rank[s * R + r];
    float *eoutw = ref_arena_alloc(&ar, (size_t)(Tm * K) * 4 + 16);
    for (int64_t t = 0; t < Tm; t++) {
        uint8_t landed[REF_MAX_RANKS];
        for (int r = 0; r < R; r++) landed[r] = in_rank[t * R + r] && run[r]++ < worst[r];
        for (int64_t c = 0; c < H; c++) {
            float acc = 0.0f;
            for (int r = 0; r < R; r++)
                if (landed[r]) acc = ref_fadd(acc, ref_bf16_to_f32(ref_y_bf16(yseed, r, -1, rank, t, c)));
            ex[t * H + c] = ref_f32_to_bf16(acc);
        }
        for (int64_t k = 0; k < K; k++) {
            const int64_t e = p.topk[rank][t * K + k];
            float acc = 0.0f;
            for (int r = 0; r < R; r++)
                if (landed[r]) acc = ref_fadd(acc, e >= 0 && e / L == r ? p.weights[rank][t * K + k] : 0.0f);
            eoutw[t * K + k] = acc;
        }
    }
    cudaMemcpy(got, dout, (size_t)(Tm * H) * 2, cudaMemcpyDeviceToHost);
    if (ref_check_bits(rank, "combined_x after overflow", got, ex, Tm * H, 2, H)) goto out;
    cudaMemcpy(got, doutw, (size_t)(Tm * K) * 4, cudaMemcpyDeviceToHost);
    if (ref_check_bits(rank, "combined_topk_weights after overflow", got, eoutw, Tm * K, 4, K)) goto out;
    rc = 0;
out:
    return release(rc, handle, &da, &ref, &ar, &p);
}

/* Static mode captured once in a CUDA graph (dispatch, then combine of recv_x itself), replayed
 * with new routing and data written into the same input tensors. */
static int run_graph(epx_buffer_t buf, int rank, int R, int64_t H, int64_t T_max, uint64_t seed, int device)
{
    int rc = 1;
    gpu_arena_t da = {0};
    const int64_t K = TOPK, cap = (int64_t)R * T_max, Tm = T_max;
    int64_t T[REF_MAX_RANKS];
    for (int r = 0; r < R; r++) T[r] = T_max; /* shapes are fixed by the graph */
    void *dx = gpu_alloc(&da, (size_t)(Tm * H) * 2, NULL),
         *dtopk = gpu_alloc(&da, (size_t)(Tm * K) * 4, NULL);
    void *drx = gpu_alloc(&da, (size_t)(cap * H) * 2, NULL), *dn = gpu_alloc(&da, 4, NULL);
    void *dout = gpu_alloc(&da, (size_t)(Tm * H) * 2, NULL);
    if (!dout) return ref_fail(rank, "cudaMalloc");
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    epx_handle_t handle = NULL;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;

    /* The default mode refuses capture, naming num_worst_tokens. */
    {
        CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
        a.x = gpu_tensor(dx, EPX_DTYPE_BF16, 2, Tm, H, 0, device);
        a.topk_idx = gpu_tensor(dtopk, EPX_DTYPE_INT32, 2, Tm, K, 0, device);
        a.stream = st;
        epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
        o.recv_x = gpu_tensor(drx, EPX_DTYPE_BF16, 2, cap, H, 0, device);
        epx_result_t res = epx_ht_dispatch(buf, &a, &o);
        cudaGraph_t g = NULL;
        cudaStreamEndCapture(st, &g);
        if (g) cudaGraphDestroy(g);
        (void)cudaGetLastError();
        EXPECT_RES(res, EPX_ERR_GRAPH_CAPTURE);
        EXPECT_MSG_HAS("num_worst_tokens");
    }

    CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    a.x = gpu_tensor(dx, EPX_DTYPE_BF16, 2, Tm, H, 0, device);
    a.topk_idx = gpu_tensor(dtopk, EPX_DTYPE_INT32, 2, Tm, K, 0, device);
    a.num_worst_tokens = cap;
    a.stream = st;
    epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
    o.recv_x = gpu_tensor(drx, EPX_DTYPE_BF16, 2, cap, H, 0, device);
    o.num_recv_tokens = gpu_tensor(dn, EPX_DTYPE_INT32, 1, 1, 0, 0, device);
    epx_result_t res = epx_ht_dispatch(buf, &a, &o);
    if (res == EPX_SUCCESS) {
        handle = o.handle;
        epx_ht_combine_args_t ca = EPX_HT_COMBINE_ARGS_INIT;
        ca.handle = handle;
        ca.x = gpu_tensor(drx, EPX_DTYPE_BF16, 2, cap, H, 0, device);
        ca.stream = st;
        epx_ht_combine_outputs_t co = EPX_HT_COMBINE_OUTPUTS_INIT;
        co.combined_x = gpu_tensor(dout, EPX_DTYPE_BF16, 2, Tm, H, 0, device);
        res = epx_ht_combine(buf, &ca, &co);
    }
    CUDA_OK(cudaStreamEndCapture(st, &graph));
    if (res != EPX_SUCCESS) {
        rc = ref_fail(rank, "capture: %s (%s)", epx_result_name(res), epx_last_error_message());
        goto out;
    }
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

    uint16_t *hx = malloc((size_t)(Tm * H) * 2), *got = malloc((size_t)(cap * H) * 2 + 16);
    int32_t *htopk = malloc((size_t)(Tm * K) * 4);
    uint16_t *eout = malloc((size_t)(Tm * H) * 2 + 16);
    for (int replay = 0; replay < 3 && hx && got && htopk && eout; replay++) {
        ref_problem_t p;
        ref_ht_recv_t ref = {0};
        const uint64_t s2 = seed + 7919ull * (uint64_t)(replay + 1);
        ref_set_case("graph R=%d H=%lld replay %d", R, (long long)H, replay);
        if (ref_problem_init(&p, R, E_EXPERTS, TOPK, H, T_max, EPX_DTYPE_BF16, s2, T,
                             replay == 1 ? REF_ROUTE_SKEWED : REF_ROUTE_RANDOM) != 0 ||
            ref_ht_dispatch(&p, rank, 1, &ref) != 0) {
            rc = ref_fail(rank, "reference");
            goto out;
        }
        for (int64_t t = 0; t < Tm; t++) ref_x_row(&p, rank, t, REF_TAG_X, hx + t * H);
        ref_fill_topk(&p, rank, EPX_DTYPE_INT32, htopk);
        gpu_h2d(dx, hx, (size_t)(Tm * H) * 2);
        gpu_h2d(dtopk, htopk, (size_t)(Tm * K) * 4);
        CUDA_OK(cudaGraphLaunch(exec, st));
        CUDA_OK(cudaStreamSynchronize(st));
        EXPECT_OK(epx_get_async_error(epx_test_current_comm));
        int32_t nd = -1;
        cudaMemcpy(&nd, dn, 4, cudaMemcpyDeviceToHost);
        int fail = nd != ref.n;
        if (fail) rc = ref_fail(rank, "graph N_r %d, expected %lld", nd, (long long)ref.n);
        cudaMemcpy(got, drx, (size_t)(ref.n * H) * 2, cudaMemcpyDeviceToHost);
        for (int64_t i = 0; i < ref.n && !fail; i++) {
            ref_x_row(&p, ref.src[i], ref.tok[i], REF_TAG_X, eout);
            fail = ref_check_bits(rank, "graph recv_x", got + i * H, eout, H, 2, H);
        }
        /* Combine of recv_x itself: each token's row summed once per receiving rank. */
        if (!fail) {
            cudaMemcpy(got, dout, (size_t)(Tm * H) * 2, cudaMemcpyDeviceToHost);
            int32_t per_rank[REF_MAX_RANKS], per_expert[E_EXPERTS];
            uint8_t *in_rank = malloc((size_t)(Tm * R) + 1);
            ref_layout(&p, rank, R, per_rank, per_expert, in_rank, NULL);
            for (int64_t t = 0; t < Tm; t++)
                for (int64_t c = 0; c < H; c++) {
                    float acc = 0.0f;
                    for (int r = 0; r < R; r++)
                        if (in_rank[t * R + r]) acc = ref_fadd(acc, ref_bf16_to_f32(hx[t * H + c]));
                    eout[t * H + c] = ref_f32_to_bf16(acc);
                }
            free(in_rank);
            fail = ref_check_bits(rank, "graph combined_x", got, eout, Tm * H, 2, H);
        }
        ref_ht_recv_free(&ref);
        ref_problem_free(&p);
        if (fail) goto out;
    }
    if (!hx || !got || !htopk || !eout) {
        rc = ref_fail(rank, "malloc");
        goto out;
    }
    free(hx);
    free(got);
    free(htopk);
    free(eout);
    rc = 0;
out:
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    if (handle) epx_handle_destroy(handle);
    cudaStreamDestroy(st);
    gpu_arena_free(&da);
    return rc;
}

static int rank_main(int rank, int nranks, const epx_unique_id_t *id, void *vctx)
{
    const gpu_ctx_t *ctx = vctx;
    epx_comm_t comm;
    int device;
    if (gpu_test_comm(ctx, id, rank, nranks, 0, &comm, &device)) return 1;
    epx_test_current_comm = comm;
    int rc = 0;
    /* 100: a hidden size that is not a multiple of 8 (the kernels' scalar paths: byte-wise row copies,
     * the scalar combine reduce), bf16 only (fp8 needs a multiple of 128), default dtypes. */
    const int64_t Hs[3] = {7168, 2048, 100};
    for (int hi = ctx->quick ? 1 : 0; hi < 3 && rc == 0; hi++) {
        const int64_t H = Hs[hi], T_max = ctx->quick ? 64 : (H == 7168 ? 128 : 256);
        const int fp8_ok = H % 128 == 0;
        epx_buffer_config_t bc = epx_test_buffer_config(T_max, H, TOPK, E_EXPERTS, EPX_MODE_HT);
        bc.dispatch_dtypes = fp8_ok ? EPX_DTYPE_BIT(EPX_DTYPE_BF16) | EPX_DTYPE_BIT(EPX_DTYPE_FP8_E4M3) : 0;
        bc.num_view_areas = VIEW_AREAS;
        epx_buffer_t buf;
        EXPECT_OK(epx_buffer_create(comm, &bc, &buf));
        ht_case_t cases[] = {
            {H, T_max, EPX_DTYPE_BF16, REF_ROUTE_RANDOM, 1, 0, 1},
            {H, T_max, EPX_DTYPE_FP8_E4M3, REF_ROUTE_SKEWED, 2, 1, 1},
            {H, T_max, EPX_DTYPE_FP8_E4M3, REF_ROUTE_RANDOM, 0, 0, 1},
            {H, T_max, EPX_DTYPE_BF16, REF_ROUTE_GROUPED, 3, 1, 1},
            {H, T_max, EPX_DTYPE_BF16, REF_ROUTE_RANDOM, 4, 0, 200},
            {H, T_max, EPX_DTYPE_BF16, REF_ROUTE_RANDOM, 1, 0, 3, 1},
            {H, T_max, EPX_DTYPE_FP8_E4M3, REF_ROUTE_SKEWED, 2, 1, 1, 1},
            {H, T_max, EPX_DTYPE_BF16, REF_ROUTE_GROUPED, 3, 1, 50, 1},
        };
        const int ncases = (int)(sizeof(cases) / sizeof(cases[0]));
        for (int i = 0; i < ncases && rc == 0; i++) {
            if (ctx->quick && i >= 2 && !cases[i].view) continue;
            if (cases[i].repeats > 3 && H != 2048) continue; /* long repeats at the smaller H */
            if (!fp8_ok && cases[i].dtype == EPX_DTYPE_FP8_E4M3) continue;
            rc =
                run_eager(buf, rank, nranks, &cases[i], ctx->seed + (uint64_t)i * 1000 + (uint64_t)H, device);
        }
        if (rc == 0 && H == 2048) rc = run_overflow(buf, rank, nranks, H, T_max, ctx->seed + 77, device);
        if (rc == 0 && !ctx->quick && H == 2048)
            rc = run_graph(buf, rank, nranks, H, T_max, ctx->seed, device);
        if (rc == 0) EXPECT_OK(epx_get_async_error(comm));
        /* Peers' last kernels may still write acks into our region: free it only after every rank
         * has synchronised its device work (destroy itself never waits on a peer). */
        if (rc == 0) EXPECT_OK(epx_comm_barrier(comm));
        EXPECT_OK(epx_buffer_destroy(buf));
    }
    EXPECT_OK(epx_comm_destroy(comm));
    return rc;
}

int main(void)
{
    gpu_ctx_t ctx;
    if (gpu_test_init(&ctx)) return EPX_TEST_SKIP;
    return gpu_test_each_nranks("ht ipc", "2,4,8", rank_main, &ctx);
}
