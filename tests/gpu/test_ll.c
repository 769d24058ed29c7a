/*
 * LL dispatch and combine on the cuda backend, R ranks (processes) on the GPUs present: packed rows,
 * fp8 bytes and scales (fp32 and ue8m0), recv_count, src_info, layout_range, cumulative stats and
 * every combined value compared bit for bit with the single-process reference. Cases: bf16, fp8,
 * fp8+round_scale, fp8+ue8m0, with and without hooks and zero-copy, full, ragged and zero-token
 * ranks, E 64/256/288, K 1/8/9, H 2048/7168; double buffering with a stale handle; dispatch, stand-in
 * expert and combine captured in one CUDA graph and replayed with new tokens and routing; repeated
 * iterations with matching hashes (EPX_GPU_TEST_LL_ITERS, default 20); a receive whose peer never
 * sends (recv_count -1, EPX_ERR_TIMEOUT, NaN combine rows). EPX_GPU_TEST_RANKS
 * (default "2,4,8") and EPX_GPU_TEST_QUICK=1 (sanitizer runs) shrink it. EPX_GPU_TEST_NODES=1 runs the
 * same across nodes instead: every split of EPX_TEST_NODE_SPLITS (EPX_NODE_ID per rank; the network
 * transport from EPX_NET_TRANSPORT, e.g. loop), the failed receive on 2 nodes of 1.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"
#include "gpu_test.h"

typedef struct ctx {
    gpu_ctx_t gpu; /* first: the shared main passes &ctx.gpu */
    int iters;     /* EPX_GPU_TEST_LL_ITERS */
    int per_node;  /* > 0: ranks form nodes of this many (EPX_NODE_ID), the LL path across nodes */
} ctx_t;

/* This rank's node id under the context's split (before its comm exists); 0, or 1 after reporting. */
static int set_node(const ctx_t *ctx, int rank)
{
    char node[32];
    snprintf(node, sizeof(node), "ll-node%d", ctx->per_node > 0 ? rank / ctx->per_node : 0);
    if (epx_test_set_env("EPX_NODE_ID", ctx->per_node > 0 ? node : NULL))
        return ref_fail(rank, "cannot set EPX_NODE_ID");
    /* Over GIN, NCCL runs the test GIN plugin (EPX_GIN_TEST_PLUGIN) through its proxy path, one host id per
     * emulated node. */
    const char *t = getenv("EPX_NET_TRANSPORT"), *plugin = getenv("EPX_GIN_TEST_PLUGIN");
    if (ctx->per_node > 0 && t && !strcmp(t, "gin")) {
        if (!plugin || !*plugin) return ref_fail(rank, "EPX_NET_TRANSPORT=gin needs EPX_GIN_TEST_PLUGIN");
        if (setenv("NCCL_HOSTID", node, 1) || setenv("NCCL_NET_PLUGIN", plugin, 1) ||
            setenv("NCCL_GIN_TYPE", "2", 0) || setenv("NCCL_SOCKET_IFNAME", "lo", 0) ||
            setenv("NCCL_NVLS_ENABLE", "0", 1))
            return ref_fail(rank, "cannot set NCCL's environment");
    }
    return 0;
}

/* One buffer configuration and the device tensors sized for it. */
typedef struct cfg {
    int E, K;
    int64_t H, T_max;
    int R, L, device;
    int64_t RT;
    cudaStream_t st;
    void *x, *topk, *w, *rx, *rs, *rc, *si, *lr, *cum, *y, *out;
} cfg_t;

typedef struct ll_case {
    int fp8, round_scale, ue8m0;
    int hook_dispatch, hook_combine, zero_copy;
    int iter; /* token counts: 0 full, 1 zero-token ranks, >1 random */
    ref_routing_t routing;
    int idx64;
    int repeats;
} ll_case_t;

/* Fills g for cf = {E, K, H, T_max} on nranks ranks, creates the LL buffer (*buf, NULL when that
 * fails) and g's device tensors. Returns 0, or 1 after reporting. */
static int cfg_open(cfg_t *g, epx_comm_t comm, int rank, int nranks, int device, const int64_t cf[4],
                    epx_buffer_t *buf)
{
    memset(g, 0, sizeof(*g));
    *buf = NULL;
    g->E = (int)cf[0];
    g->K = (int)cf[1];
    g->H = cf[2];
    g->T_max = cf[3];
    g->R = nranks;
    g->L = g->E / nranks;
    g->RT = (int64_t)nranks * g->T_max;
    g->device = device;
    epx_buffer_config_t bc = epx_test_buffer_config(g->T_max, g->H, g->K, g->E, EPX_MODE_LL);
    bc.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_BF16);
    EXPECT_OK(epx_buffer_create(comm, &bc, buf));
    const int64_t H = g->H, T = g->T_max, K = g->K, L = g->L, RT = g->RT;
    void **ps[] = {&g->x, &g->topk, &g->w, &g->rx, &g->rs, &g->rc, &g->si, &g->lr, &g->cum, &g->y, &g->out};
    size_t sz[] = {(size_t)(T * H) * 2 + 16,
                   (size_t)(T * K) * 8 + 16,
                   (size_t)(T * K) * 4 + 16,
                   (size_t)(L * RT * H) * 2,
                   (size_t)(L * (H / 128) * RT) * 4 + 16,
                   (size_t)L * 4,
                   (size_t)(L * RT) * 4,
                   (size_t)(L * g->R) * 8,
                   (size_t)L * 4,
                   (size_t)(L * RT * H) * 2,
                   (size_t)(T * H) * 2 + 16};
    for (size_t i = 0; i < sizeof(ps) / sizeof(ps[0]); i++) {
        if (cudaMalloc(ps[i], sz[i]) != cudaSuccess) return ref_fail(rank, "cudaMalloc of %zu bytes", sz[i]);
        cudaMemset(*ps[i], 0xa5, sz[i]);
    }
    CUDA_OK(cudaStreamCreateWithFlags(&g->st, cudaStreamNonBlocking));
    CUDA_OK(cudaDeviceSynchronize()); /* the memsets ran on the legacy stream */
    return 0;
}

static void cfg_free(cfg_t *g)
{
    void *ps[] = {g->x, g->topk, g->w, g->rx, g->rs, g->rc, g->si, g->lr, g->cum, g->y, g->out};
    for (size_t i = 0; i < sizeof(ps) / sizeof(ps[0]); i++) cudaFree(ps[i]);
    if (g->st) cudaStreamDestroy(g->st);
}

/* Host-to-device copy ordered on the stream the library calls use. A plain cudaMemcpy from pageable
 * memory may return before its DMA lands, and a cudaStreamNonBlocking stream does not wait for the
 * legacy stream: a kernel could read the rows before they arrive. */
static int h2d(const cfg_t *g, void *dst, const void *src, size_t bytes)
{
    if (!bytes) return 0;
    if (cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, g->st) != cudaSuccess) return 1;
    return cudaStreamSynchronize(g->st) != cudaSuccess;
}

/* After a failed check: the device error record (if any) reaches the comm through the poller
 * within a few ms; name it so a failed receive is not mistaken for wrong data. */
static void note_async(epx_buffer_t buf, int rank)
{
    epx_result_t r = EPX_SUCCESS;
    for (int i = 0; i < 50 && r == EPX_SUCCESS; i++) {
        r = epx_get_async_error(buf->comm);
        if (r == EPX_SUCCESS) usleep(2000);
    }
    if (r != EPX_SUCCESS)
        fprintf(stderr, "rank %d: async error: %s: %s\n", rank, epx_result_name(r), epx_last_error_message());
}

/* Uploads rank `me`'s x (tag REF_TAG_X), topk_idx and weights of problem p. */
static int upload_inputs(const cfg_t *g, const ref_problem_t *p, int rank, int idx64)
{
    const int64_t T = p->T[rank], H = g->H, K = g->K;
    uint16_t *hx = malloc((size_t)(T * H) * 2 + 16);
    void *ht = malloc((size_t)(T * K) * 8 + 16);
    if (!hx || !ht) {
        free(hx);
        free(ht);
        return ref_fail(rank, "malloc");
    }
    for (int64_t t = 0; t < T; t++) ref_x_row(p, rank, t, REF_TAG_X, hx + t * H);
    ref_fill_topk(p, rank, idx64 ? EPX_DTYPE_INT64 : EPX_DTYPE_INT32, ht);
    int bad = h2d(g, g->x, hx, (size_t)(T * H) * 2) ||
              h2d(g, g->topk, ht, (size_t)(T * K) * (idx64 ? 8 : 4)) ||
              h2d(g, g->w, p->weights[rank], (size_t)(T * K) * 4);
    free(hx);
    free(ht);
    return bad ? ref_fail(rank, "upload of the inputs") : 0;
}

static void dispatch_args(const cfg_t *g, const ll_case_t *cs, int64_t T, epx_ll_dispatch_args_t *a,
                          epx_ll_dispatch_outputs_t *o)
{
    const int d = g->device;
    const int64_t H = g->H, L = g->L, RT = g->RT;
    a->x = gpu_tensor(g->x, EPX_DTYPE_BF16, 2, T, H, 0, d);
    a->topk_idx = gpu_tensor(g->topk, cs->idx64 ? EPX_DTYPE_INT64 : EPX_DTYPE_INT32, 2, T, g->K, 0, d);
    a->cumulative_recv_stats = gpu_tensor(g->cum, EPX_DTYPE_INT32, 1, L, 0, 0, d);
    a->use_fp8 = cs->fp8;
    a->round_scale = cs->round_scale;
    a->use_ue8m0 = cs->ue8m0;
    a->return_recv_hook = cs->hook_dispatch;
    a->stream = g->st;
    o->recv_x = gpu_tensor(g->rx, cs->fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16, 3, L, RT, H, d);
    if (cs->ue8m0)
        o->recv_scales = gpu_tensor(g->rs, EPX_DTYPE_INT32, 3, L, H / 512, RT, d);
    else if (cs->fp8)
        o->recv_scales = gpu_tensor(g->rs, EPX_DTYPE_FP32, 3, L, H / 128, RT, d);
    o->recv_count = gpu_tensor(g->rc, EPX_DTYPE_INT32, 1, L, 0, 0, d);
    o->src_info = gpu_tensor(g->si, EPX_DTYPE_INT32, 2, L, RT, 0, d);
    o->layout_range = gpu_tensor(g->lr, EPX_DTYPE_INT64, 2, L, g->R, 0, d);
}

/* Combine of g's y rows (not zero-copy) into g->out for T tokens, on g's stream. */
static void combine_args(const cfg_t *g, int64_t T, const epx_tensor_t *topk_idx, epx_ll_combine_args_t *ca,
                         epx_ll_combine_outputs_t *co)
{
    *ca = (epx_ll_combine_args_t)EPX_LL_COMBINE_ARGS_INIT;
    ca->y = gpu_tensor(g->y, EPX_DTYPE_BF16, 3, g->L, g->RT, g->H, g->device);
    ca->topk_idx = *topk_idx;
    ca->topk_weights = gpu_tensor(g->w, EPX_DTYPE_FP32, 2, T, g->K, 0, g->device);
    ca->stream = g->st;
    *co = (epx_ll_combine_outputs_t)EPX_LL_COMBINE_OUTPUTS_INIT;
    co->combined_x = gpu_tensor(g->out, EPX_DTYPE_BF16, 2, T, g->H, 0, g->device);
}

/* Checks rank's received rows, scales and metadata against the reference; hashes recv_x. */
static int check_dispatch(const cfg_t *g, const ref_problem_t *p, const ll_case_t *cs, int rank,
                          const ref_ll_recv_t *ref, uint64_t *hash)
{
    const int64_t H = g->H, L = g->L, RT = g->RT, G = H / 128, R = g->R;
    const size_t es = cs->fp8 ? 1 : 2;
    int rc = 1;
    int32_t *cnt = malloc((size_t)L * 4), *si = malloc((size_t)(L * RT) * 4);
    int64_t *lr = malloc((size_t)(L * R) * 8);
    uint8_t *row = malloc((size_t)RT * H * es + 16), *exp = malloc((size_t)H * 2 + 16);
    uint16_t *xrow = malloc((size_t)H * 2 + 16);
    float *sc = malloc((size_t)(L * G * RT) * 4 + 16), *esc = malloc((size_t)G * 4 + 16);
    if (!cnt || !si || !lr || !row || !exp || !xrow || !sc || !esc) {
        rc = ref_fail(rank, "malloc");
        goto out;
    }
    cudaMemcpy(cnt, g->rc, (size_t)L * 4, cudaMemcpyDeviceToHost);
    if (ref_check_bits(rank, "recv_count", cnt, ref->count, L, 4, L)) goto out;
    cudaMemcpy(lr, g->lr, (size_t)(L * R) * 8, cudaMemcpyDeviceToHost);
    if (ref_check_bits(rank, "layout_range", lr, ref->range, L * R, 8, R)) goto out;
    cudaMemcpy(si, g->si, (size_t)(L * RT) * 4, cudaMemcpyDeviceToHost);
    if (cs->fp8) cudaMemcpy(sc, g->rs, (size_t)(L * G * RT) * 4, cudaMemcpyDeviceToHost);
    for (int64_t j = 0; j < L; j++) {
        const int64_t n = cnt[j];
        if (ref_check_bits(rank, "src_info", si + j * RT, ref->tok + j * RT, n, 4, RT)) goto out;
        cudaMemcpy(row, (uint8_t *)g->rx + (size_t)(j * RT * H) * es, (size_t)(n * H) * es,
                   cudaMemcpyDeviceToHost);
        *hash = epx_test_fnv(row, (size_t)(n * H) * es, *hash);
        for (int64_t q = 0; q < n; q++) {
            ref_x_row(p, ref->src[j * RT + q], ref->tok[j * RT + q], REF_TAG_X, xrow);
            char what[64];
            snprintf(what, sizeof(what), "recv_x[%lld][%lld]", (long long)j, (long long)q);
            if (!cs->fp8) {
                if (ref_check_bits(rank, what, row + (size_t)(q * H) * 2, xrow, H, 2, H)) goto out;
                continue;
            }
            ref_ll_cast(xrow, H, cs->round_scale != 0, exp, esc);
            if (ref_check_bits(rank, what, row + (size_t)(q * H), exp, H, 1, H)) goto out;
            for (int64_t gi = 0; gi < G; gi++) {
                if (cs->ue8m0) {
                    const uint32_t word = ((const uint32_t *)sc)[(j * (H / 512) + gi / 4) * RT + q];
                    uint32_t bits;
                    memcpy(&bits, &esc[gi], 4);
                    if (((word >> (8 * (gi % 4))) & 0xffu) != ((bits >> 23) & 0xffu)) {
                        rc = ref_fail(rank,
                                      "ue8m0 scale of expert %lld row %lld group %lld: byte %u, expected %u",
                                      (long long)j, (long long)q, (long long)gi,
                                      (word >> (8 * (gi % 4))) & 0xffu, (bits >> 23) & 0xffu);
                        goto out;
                    }
                } else if (ref_check_bits(rank, "recv_scales", &sc[(j * G + gi) * RT + q], &esc[gi], 1, 4,
                                          1)) {
                    goto out;
                }
            }
        }
    }
    rc = 0;
out:
    free(cnt);
    free(si);
    free(lr);
    free(row);
    free(exp);
    free(xrow);
    free(sc);
    free(esc);
    return rc;
}

/* y rows of rank's local experts as ref_ll_combine expects them, written to `dst` (device). */
static int upload_y(const cfg_t *g, int rank, const ref_ll_recv_t *ref, uint64_t yseed, void *dst)
{
    const int64_t H = g->H, RT = g->RT;
    uint16_t *rows = malloc((size_t)RT * H * 2 + 16);
    if (!rows) return ref_fail(rank, "malloc");
    for (int j = 0; j < g->L; j++) {
        const int64_t n = ref->count[j];
        for (int64_t q = 0; q < n; q++)
            for (int64_t c = 0; c < H; c++)
                rows[q * H + c] = ref_y_bf16(yseed, rank, j, ref->src[j * RT + q], ref->tok[j * RT + q], c);
        if (h2d(g, (uint16_t *)dst + (size_t)(j * RT * H), rows, (size_t)(n * H) * 2)) {
            free(rows);
            return ref_fail(rank, "upload of y rows");
        }
    }
    free(rows);
    return 0;
}

/* The way out of a run: frees its host copies and its reference, and returns `rc`. */
static int run_free(int rc, uint16_t *eout, uint16_t *got, ref_ll_recv_t *ref, ref_problem_t *p)
{
    free(eout);
    free(got);
    ref_ll_recv_free(ref);
    ref_problem_free(p);
    return rc;
}

static int run_case(epx_buffer_t buf, cfg_t *g, int rank, const ll_case_t *cs, uint64_t seed)
{
    ref_problem_t p;
    ref_ll_recv_t ref = {0};
    int64_t T[REF_MAX_RANKS];
    int rc = 1;
    uint16_t *eout = NULL, *got = NULL;
    ref_gen_token_counts(seed, cs->iter, g->R, g->T_max, T);
    if (ref_problem_init(&p, g->R, g->E, g->K, g->H, g->T_max, EPX_DTYPE_BF16, seed, T, cs->routing) != 0)
        return ref_fail(rank, "problem init");
    ref_set_case("R=%d E=%d K=%d H=%lld %s%s%s hook %d/%d zc %d iter %d %s idx%s x%d", g->R, g->E, g->K,
                 (long long)g->H, cs->fp8 ? "fp8" : "bf16", cs->round_scale ? "+round_scale" : "",
                 cs->ue8m0 ? "+ue8m0" : "", cs->hook_dispatch, cs->hook_combine, cs->zero_copy, cs->iter,
                 ref_routing_name(cs->routing), cs->idx64 ? "64" : "32", cs->repeats);
    const int64_t H = g->H, Tm = T[rank];
    const uint64_t yseed = seed ^ 0x11ull;
    if (ref_ll_dispatch(&p, rank, &ref) != 0 || upload_inputs(g, &p, rank, cs->idx64) != 0) {
        rc = ref_fail(rank, "reference or upload");
        goto out;
    }
    eout = malloc((size_t)(Tm * H) * 2 + 16);
    got = malloc((size_t)(Tm * H) * 2 + 16);
    if (!eout || !got) {
        rc = ref_fail(rank, "malloc");
        goto out;
    }
    ref_ll_combine(&p, rank, yseed, eout);
    CUDA_OK(cudaMemsetAsync(g->cum, 0, (size_t)g->L * 4, g->st));
    if (!cs->zero_copy && upload_y(g, rank, &ref, yseed, g->y) != 0) goto out;
    uint64_t first = 0;
    const int reps = cs->repeats > 0 ? cs->repeats : 1;
    for (int it = 0; it < reps; it++) {
        epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
        epx_ll_dispatch_outputs_t o = EPX_LL_DISPATCH_OUTPUTS_INIT;
        dispatch_args(g, cs, Tm, &a, &o);
        EXPECT_OK(epx_ll_dispatch(buf, &a, &o));
        if (cs->hook_dispatch) EXPECT_OK(epx_hook_run(&o.hook, g->st));
        CUDA_OK(cudaStreamSynchronize(g->st));
        uint64_t hash = EPX_TEST_FNV_INIT;
        if (it == 0 || it == reps - 1) {
            if (check_dispatch(g, &p, cs, rank, &ref, &hash)) {
                note_async(buf, rank);
                goto out;
            }
        } else {
            /* Between the first and last iteration only the hash of the packed rows is compared. */
            for (int j = 0; j < g->L; j++) {
                uint8_t *tmp = malloc((size_t)ref.count[j] * (size_t)H * 2 + 16);
                if (!tmp) return ref_fail(rank, "malloc");
                const size_t es = cs->fp8 ? 1 : 2;
                cudaMemcpy(tmp, (uint8_t *)g->rx + (size_t)(j * g->RT * H) * es,
                           (size_t)(ref.count[j] * H) * es, cudaMemcpyDeviceToHost);
                hash = epx_test_fnv(tmp, (size_t)(ref.count[j] * H) * es, hash);
                free(tmp);
            }
        }
        epx_ll_combine_args_t ca;
        epx_ll_combine_outputs_t co;
        combine_args(g, Tm, &a.topk_idx, &ca, &co);
        ca.handle = o.handle;
        if (cs->zero_copy) {
            memset(&ca.y, 0, sizeof(ca.y));
            epx_tensor_t view;
            EXPECT_OK(epx_ll_get_combine_buffer(buf, &o.handle, &view));
            if (view.shape[0] != g->L || view.shape[1] != g->RT || view.shape[2] != H ||
                view.dtype != EPX_DTYPE_BF16)
                return ref_fail(rank, "combine view has shape [%lld, %lld, %lld]", (long long)view.shape[0],
                                (long long)view.shape[1], (long long)view.shape[2]);
            if (upload_y(g, rank, &ref, yseed, view.data) != 0) goto out;
            ca.zero_copy = 1;
        }
        ca.return_recv_hook = cs->hook_combine;
        EXPECT_OK(epx_ll_combine(buf, &ca, &co));
        if (cs->hook_combine) {
            EXPECT_OK(epx_hook_run(&co.hook, g->st));
            EXPECT_RES(epx_hook_run(&co.hook, g->st), EPX_ERR_INVALID_ARG); /* a hook runs once */
        }
        CUDA_OK(cudaStreamSynchronize(g->st));
        EXPECT_OK(epx_get_async_error(buf->comm));
        cudaMemcpy(got, g->out, (size_t)(Tm * H) * 2, cudaMemcpyDeviceToHost);
        if (ref_check_bits(rank, "combined_x", got, eout, Tm * H, 2, H)) {
            note_async(buf, rank);
            goto out;
        }
        hash = epx_test_fnv(got, (size_t)(Tm * H) * 2, hash);
        if (it == 0) first = hash;
        if (hash != first) {
            rc = ref_fail(rank, "iteration %d: hash %016llx differs from iteration 0's %016llx", it,
                          (unsigned long long)hash, (unsigned long long)first);
            goto out;
        }
    }
    /* Cumulative stats: every iteration added recv_count. */
    {
        int32_t cum[1024];
        const int n = g->L < 1024 ? g->L : 1024;
        cudaMemcpy(cum, g->cum, (size_t)n * 4, cudaMemcpyDeviceToHost);
        for (int j = 0; j < n; j++)
            if (cum[j] != ref.count[j] * reps) {
                rc = ref_fail(rank, "cumulative_recv_stats[%d] = %d, expected %d", j, cum[j],
                              ref.count[j] * reps);
                goto out;
            }
    }
    rc = 0;
out:
    return run_free(rc, eout, got, &ref, &p);
}

/* Two dispatches in flight (hooks run later, in order), their combines, then a third dispatch
 * that reuses the first slot: the first handle is stale on every rank, and the calls after it
 * still work. Outputs of the two batches land in different tensors. */
static int run_double(epx_buffer_t buf, cfg_t *g, int rank, uint64_t seed)
{
    const int64_t H = g->H, L = g->L, RT = g->RT, Tm = g->T_max;
    int64_t T[REF_MAX_RANKS];
    for (int r = 0; r < g->R; r++) T[r] = Tm;
    ref_problem_t p;
    ref_set_case("double buffering R=%d E=%d H=%lld", g->R, g->E, (long long)H);
    if (ref_problem_init(&p, g->R, g->E, g->K, H, Tm, EPX_DTYPE_BF16, seed, T, REF_ROUTE_RANDOM) != 0)
        return ref_fail(rank, "problem init");
    int rc = 1;
    void *rx2 = NULL, *rc2 = NULL, *out2 = NULL;
    uint16_t *eout = malloc((size_t)(Tm * H) * 2 + 16), *got = malloc((size_t)(Tm * H) * 2 + 16);
    ref_ll_recv_t ref = {0};
    if (!eout || !got || ref_ll_dispatch(&p, rank, &ref) != 0 || upload_inputs(g, &p, rank, 0) != 0 ||
        cudaMalloc(&rx2, (size_t)(L * RT * H) * 2) != cudaSuccess ||
        cudaMalloc(&rc2, (size_t)L * 4) != cudaSuccess ||
        cudaMalloc(&out2, (size_t)(Tm * H) * 2) != cudaSuccess) {
        rc = ref_fail(rank, "setup");
        goto out;
    }
    const uint64_t yseed = seed ^ 0x22ull;
    ref_ll_combine(&p, rank, yseed, eout);
    if (upload_y(g, rank, &ref, yseed, g->y) != 0) goto out;
    ll_case_t cs = {0};
    cs.hook_dispatch = 1;
    epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
    epx_ll_dispatch_outputs_t o1 = EPX_LL_DISPATCH_OUTPUTS_INIT, o2 = EPX_LL_DISPATCH_OUTPUTS_INIT;
    dispatch_args(g, &cs, Tm, &a, &o1);
    dispatch_args(g, &cs, Tm, &a, &o2);
    a.cumulative_recv_stats.data = NULL;
    o2.recv_x.data = rx2;
    o2.recv_count.data = rc2;
    o2.src_info.data = NULL;
    o2.layout_range.data = NULL;
    EXPECT_OK(epx_ll_dispatch(buf, &a, &o1));
    EXPECT_OK(epx_ll_dispatch(buf, &a, &o2));
    if (o1.handle.slot == o2.handle.slot)
        return ref_fail(rank, "two dispatches in flight share slot %d", o1.handle.slot);
    EXPECT_OK(epx_hook_run(&o1.hook, g->st));
    EXPECT_OK(epx_hook_run(&o2.hook, g->st));
    epx_ll_combine_args_t ca;
    epx_ll_combine_outputs_t co;
    combine_args(g, Tm, &a.topk_idx, &ca, &co);
    ca.handle = o1.handle;
    EXPECT_OK(epx_ll_combine(buf, &ca, &co));
    ca.handle = o2.handle;
    co.combined_x.data = out2;
    EXPECT_OK(epx_ll_combine(buf, &ca, &co));
    CUDA_OK(cudaStreamSynchronize(g->st));
    EXPECT_OK(epx_get_async_error(buf->comm));
    void *outs[2] = {g->out, out2};
    for (int i = 0; i < 2; i++) {
        cudaMemcpy(got, outs[i], (size_t)(Tm * H) * 2, cudaMemcpyDeviceToHost);
        if (ref_check_bits(rank, i ? "combined_x (second batch)" : "combined_x (first batch)", got, eout,
                           Tm * H, 2, H))
            goto out;
    }
    int32_t cnt[1024];
    cudaMemcpy(cnt, rc2, (size_t)(L < 1024 ? L : 1024) * 4, cudaMemcpyDeviceToHost);
    if (ref_check_bits(rank, "recv_count (second batch)", cnt, ref.count, L < 1024 ? L : 1024, 4, L))
        goto out;

    /* A third dispatch reuses the first slot: the first handle is stale. */
    epx_ll_dispatch_outputs_t o3 = EPX_LL_DISPATCH_OUTPUTS_INIT;
    cs.hook_dispatch = 0;
    dispatch_args(g, &cs, Tm, &a, &o3);
    a.cumulative_recv_stats.data = NULL;
    EXPECT_OK(epx_ll_dispatch(buf, &a, &o3));
    if (o3.handle.slot != o1.handle.slot)
        return ref_fail(rank, "third dispatch took slot %d", o3.handle.slot);
    ca.handle = o1.handle;
    co.combined_x.data = g->out;
    EXPECT_RES(epx_ll_combine(buf, &ca, &co), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("stale");
    ca.handle = o3.handle;
    EXPECT_OK(epx_ll_combine(buf, &ca, &co));
    CUDA_OK(cudaStreamSynchronize(g->st));
    EXPECT_OK(epx_get_async_error(buf->comm));
    cudaMemcpy(got, g->out, (size_t)(Tm * H) * 2, cudaMemcpyDeviceToHost);
    if (ref_check_bits(rank, "combined_x after a stale handle", got, eout, Tm * H, 2, H)) goto out;
    rc = 0;
out:
    cudaFree(rx2);
    cudaFree(rc2);
    cudaFree(out2);
    return run_free(rc, eout, got, &ref, &p);
}

/* Dispatch, a stand-in expert (y = recv_x) and combine captured in one graph, replayed with new
 * tokens and routing written into the same input tensors; checked after every replay. */
static int run_graph(epx_buffer_t buf, cfg_t *g, int rank, uint64_t seed)
{
    const int64_t H = g->H, K = g->K, L = g->L, RT = g->RT, Tm = g->T_max;
    int64_t T[REF_MAX_RANKS];
    for (int r = 0; r < g->R; r++) T[r] = Tm; /* shapes are fixed by the graph */
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    int rc = 1;
    ll_case_t cs = {0};
    epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
    epx_ll_dispatch_outputs_t o = EPX_LL_DISPATCH_OUTPUTS_INIT;
    dispatch_args(g, &cs, Tm, &a, &o);
    a.cumulative_recv_stats.data = NULL;
    epx_ll_combine_args_t ca;
    epx_ll_combine_outputs_t co;
    combine_args(g, Tm, &a.topk_idx, &ca, &co);
    CUDA_OK(cudaStreamBeginCapture(g->st, cudaStreamCaptureModeThreadLocal));
    epx_result_t res = epx_ll_dispatch(buf, &a, &o);
    if (res == EPX_SUCCESS) {
        cudaMemcpyAsync(g->y, g->rx, (size_t)(L * RT * H) * 2, cudaMemcpyDeviceToDevice, g->st);
        ca.handle = o.handle;
        res = epx_ll_combine(buf, &ca, &co);
    }
    CUDA_OK(cudaStreamEndCapture(g->st, &graph));
    if (res != EPX_SUCCESS)
        return ref_fail(rank, "capture: %s (%s)", epx_result_name(res), epx_last_error_message());
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    uint16_t *hx = malloc((size_t)(Tm * H) * 2 + 16), *eout = malloc((size_t)(Tm * H) * 2 + 16);
    uint16_t *got = malloc((size_t)(Tm * H) * 2 + 16);
    for (int replay = 0; replay < 3; replay++) {
        ref_problem_t p;
        ref_ll_recv_t ref = {0};
        ref_set_case("graph R=%d E=%d H=%lld replay %d", g->R, g->E, (long long)H, replay);
        if (!hx || !eout || !got ||
            ref_problem_init(&p, g->R, g->E, g->K, H, Tm, EPX_DTYPE_BF16,
                             seed + 7919ull * (uint64_t)(replay + 1), T,
                             replay == 1 ? REF_ROUTE_SKEWED : REF_ROUTE_RANDOM) != 0) {
            rc = ref_fail(rank, "setup");
            goto out;
        }
        int fail = ref_ll_dispatch(&p, rank, &ref) != 0 || upload_inputs(g, &p, rank, 0) != 0;
        if (!fail && cudaGraphLaunch(exec, g->st) != cudaSuccess) fail = ref_fail(rank, "cudaGraphLaunch");
        if (!fail && cudaStreamSynchronize(g->st) != cudaSuccess)
            fail = ref_fail(rank, "cudaStreamSynchronize");
        if (!fail && epx_get_async_error(buf->comm) != EPX_SUCCESS)
            fail = ref_fail(rank, "async error: %s", epx_last_error_message());
        if (!fail) {
            uint64_t h = 0;
            fail = check_dispatch(g, &p, &cs, rank, &ref, &h);
        }
        if (!fail) {
            /* y row of (s, t) is t's own x row: out[t] = sum_k w[t,k] * x[t] in k order. */
            for (int64_t t = 0; t < Tm; t++) ref_x_row(&p, rank, t, REF_TAG_X, hx + t * H);
            for (int64_t t = 0; t < Tm; t++)
                for (int64_t c = 0; c < H; c++) {
                    float acc = 0.0f;
                    for (int64_t k = 0; k < K; k++)
                        if (p.topk[rank][t * K + k] >= 0)
                            acc = ref_fadd(
                                acc, ref_fmul(p.weights[rank][t * K + k], ref_bf16_to_f32(hx[t * H + c])));
                    eout[t * H + c] = ref_f32_to_bf16(acc);
                }
            cudaMemcpy(got, g->out, (size_t)(Tm * H) * 2, cudaMemcpyDeviceToHost);
            fail = ref_check_bits(rank, "graph combined_x", got, eout, Tm * H, 2, H);
        }
        ref_ll_recv_free(&ref);
        ref_problem_free(&p);
        if (fail) goto out;
    }
    rc = 0;
out:
    free(hx);
    free(eout);
    free(got);
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    return rc;
}

static int rank_main(int rank, int nranks, const epx_unique_id_t *id, void *vctx)
{
    const ctx_t *ctx = vctx;
    epx_comm_t comm;
    int device;
    if (set_node(ctx, rank) || gpu_test_comm(&ctx->gpu, id, rank, nranks, 0, &comm, &device)) return 1;
    if (ctx->per_node > 0) {
        epx_node_topology_t nt = EPX_NODE_TOPOLOGY_INIT;
        EXPECT_OK(epx_comm_get_node_topology(comm, &nt));
        if (nt.num_nodes != nranks / ctx->per_node || nt.node != rank / ctx->per_node)
            return ref_fail(rank, "node topology: node %d of %d, expected %d of %d", nt.node, nt.num_nodes,
                            rank / ctx->per_node, nranks / ctx->per_node);
    }
    /* E, K, H, T_max. */
    /* The last: a hidden size that is not a multiple of 8 (the kernels' scalar paths), bf16 cases only. */
    static const int64_t cfgs[][4] = {
        {256, 8, 7168, 128}, {288, 9, 2048, 128}, {64, 1, 2048, 96}, {64, 8, 100, 32}};
    static const int64_t quick_cfg[4] = {64, 8, 2048, 16};
    const int ncfg = ctx->gpu.quick ? 1 : (int)(sizeof(cfgs) / sizeof(cfgs[0]));
    int rc = 0;
    for (int ci = 0; ci < ncfg && rc == 0; ci++) {
        cfg_t g;
        epx_buffer_t buf;
        rc = cfg_open(&g, comm, rank, nranks, device, ctx->gpu.quick ? quick_cfg : cfgs[ci], &buf);
        /* fp8, round_scale, ue8m0, hook d/c, zero-copy, iter, routing, idx64, repeats */
        const ll_case_t cases[] = {
            {0, 0, 0, 0, 0, 0, 0, REF_ROUTE_RANDOM, 0, 1}, {1, 0, 0, 1, 0, 1, 1, REF_ROUTE_SKEWED, 1, 1},
            {1, 1, 0, 0, 1, 1, 2, REF_ROUTE_RANDOM, 0, 1}, {1, 1, 1, 1, 1, 0, 3, REF_ROUTE_GROUPED, 1, 1},
            {0, 0, 0, 1, 1, 1, 4, REF_ROUTE_RANDOM, 0, 1}, {1, 1, 1, 0, 0, 0, 1, REF_ROUTE_RANDOM, 0, 1},
        };
        const int ncases = ctx->gpu.quick ? 2 : (int)(sizeof(cases) / sizeof(cases[0]));
        for (int i = 0; i < ncases && rc == 0; i++) {
            if (cases[i].fp8 && g.H % 128 != 0) continue; /* fp8 needs a multiple of 128 */
            rc = run_case(buf, &g, rank, &cases[i], ctx->gpu.seed + (uint64_t)ci * 100 + (uint64_t)i);
        }
        if (rc == 0) rc = run_double(buf, &g, rank, ctx->gpu.seed + 77);
        if (rc == 0 && (ctx->gpu.quick || ci == 2)) rc = run_graph(buf, &g, rank, ctx->gpu.seed + 99);
        if (rc == 0 && !ctx->gpu.quick && ci == 2) {
            const ll_case_t rep = {0, 0, 0, 1, 1, 1, 2, REF_ROUTE_RANDOM, 0, ctx->iters};
            rc = run_case(buf, &g, rank, &rep, ctx->gpu.seed + 1234);
        }
        if (rc == 0) EXPECT_OK(epx_get_async_error(comm));
        cfg_free(&g);
        if (!buf) return 1;
        EXPECT_OK(epx_buffer_destroy(buf));
    }
    EXPECT_OK(epx_comm_destroy(comm));
    return rc;
}

/* Across nodes, after a device failure: the buffer refuses the next LL call with a message saying so and
 * leaves its outputs untouched, and destroy is bounded. Returns rc, or 1 after reporting. */
static int after_net_failure(epx_buffer_t buf, cfg_t *g, int rank, epx_ll_combine_args_t *ca,
                             epx_ll_combine_outputs_t *co, int rc)
{
    CUDA_OK(cudaMemset(g->out, 0x11, 2));
    CUDA_OK(cudaDeviceSynchronize());
    const epx_result_t r = epx_ll_combine(buf, ca, co);
    if (r == EPX_SUCCESS || !strstr(epx_last_error_message(), "destroy the buffer"))
        rc = ref_fail(rank, "combine on a failed buffer across nodes: %s ('%s'), expected a refusal",
                      epx_result_name(r), epx_last_error_message());
    uint16_t got = 0;
    cudaMemcpy(&got, g->out, 2, cudaMemcpyDeviceToHost);
    if (rc == 0 && got != 0x1111) rc = ref_fail(rank, "the refused combine wrote its output (0x%x)", got);
    return rc;
}

/* A receive that fails must say so: rank 1 skips the second round, so rank 0's dispatch times out
 * (recv_count -1 on every expert, EPX_ERR_TIMEOUT through epx_get_async_error) and its combine
 * writes NaN rows instead of stale or zero values. */
#define LL_FAIL_TIMEOUT_MS 1500 /* 10 s in quick (sanitizer) runs, where kernels are slow */

/* The fault cases' round: bf16, no hooks, full ranks. */
static const ll_case_t fault_case = {0, 0, 0, 0, 0, 0, 0, REF_ROUTE_RANDOM, 0, 1};

/* The opening of a fault case: this rank's node, a comm with `timeout_ms`, a small LL buffer and one good
 * round. Returns -1 when the comm could not be made (reported), else 0 or 1 (the buffer may be NULL). */
static int fault_open(const ctx_t *ctx, const epx_unique_id_t *id, int rank, int nranks, int timeout_ms,
                      uint64_t seed, epx_comm_t *comm, cfg_t *g, epx_buffer_t *buf)
{
    static const int64_t cf[4] = {16, 4, 1024, 8}; /* E, K, H, T_max */
    int device;
    *buf = NULL;
    memset(g, 0, sizeof(*g));
    if (set_node(ctx, rank) || gpu_test_comm(&ctx->gpu, id, rank, nranks, timeout_ms, comm, &device))
        return -1;
    int rc = cfg_open(g, *comm, rank, nranks, device, cf, buf);
    if (rc == 0) rc = run_case(*buf, g, rank, &fault_case, seed);
    return rc;
}

/* Rank 0 dispatches (asynchronous), synchronises and polls the comm's async error for up to `polls`
 * times 2 ms; returns the error (EPX_SUCCESS if none came). */
static epx_result_t dispatch_until_error(epx_buffer_t buf, cfg_t *g, int rank, epx_ll_dispatch_args_t *a,
                                         epx_ll_dispatch_outputs_t *o, int polls)
{
    dispatch_args(g, &fault_case, g->T_max, a, o);
    a->cumulative_recv_stats.data = NULL;
    EXPECT_OK(epx_ll_dispatch(buf, a, o)); /* asynchronous: the failure comes later */
    CUDA_OK(cudaStreamSynchronize(g->st));
    epx_result_t r = EPX_SUCCESS;
    for (int i = 0; i < polls && r == EPX_SUCCESS; i++) {
        r = epx_get_async_error(buf->comm);
        if (r == EPX_SUCCESS) usleep(2000);
    }
    return r;
}

static int fail_main(int rank, int nranks, const epx_unique_id_t *id, void *vctx)
{
    const ctx_t *ctx = vctx;
    const int timeout_ms = ctx->gpu.quick ? 10000 : LL_FAIL_TIMEOUT_MS;
    epx_comm_t comm;
    cfg_t g;
    epx_buffer_t buf;
    ref_set_case("failed receive R=%d", nranks);
    int rc = fault_open(ctx, id, rank, nranks, timeout_ms, ctx->gpu.seed + 4242, &comm, &g, &buf);
    if (rc < 0) return 1;
    if (rc == 0 && rank == 0) {
        epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
        epx_ll_dispatch_outputs_t o = EPX_LL_DISPATCH_OUTPUTS_INIT;
        const epx_result_t r = dispatch_until_error(buf, &g, rank, &a, &o, 500);
        int32_t cnt[64];
        cudaMemcpy(cnt, g.rc, (size_t)g.L * 4, cudaMemcpyDeviceToHost);
        for (int j = 0; j < g.L && rc == 0; j++)
            if (cnt[j] != -1)
                rc = ref_fail(rank, "failed dispatch: recv_count[%d] = %d, expected -1", j, cnt[j]);
        if (rc == 0 && r != EPX_ERR_TIMEOUT)
            rc = ref_fail(rank, "failed dispatch: async error %s, expected ERR_TIMEOUT", epx_result_name(r));
        if (rc == 0 && !strstr(epx_last_error_message(), "peer 1"))
            rc = ref_fail(rank, "failed dispatch: message '%s' does not name peer 1",
                          epx_last_error_message());
        if (rc == 0) {
            epx_ll_combine_args_t ca;
            epx_ll_combine_outputs_t co;
            combine_args(&g, g.T_max, &a.topk_idx, &ca, &co);
            ca.handle = o.handle;
            if (ctx->per_node > 0) { /* across nodes the failed buffer refuses every later call */
                rc = after_net_failure(buf, &g, rank, &ca, &co, rc);
            } else {
                EXPECT_OK(epx_ll_combine(buf, &ca, &co));
                CUDA_OK(cudaStreamSynchronize(g.st));
                uint16_t *got = malloc((size_t)(g.T_max * g.H) * 2);
                if (!got) return ref_fail(rank, "malloc");
                cudaMemcpy(got, g.out, (size_t)(g.T_max * g.H) * 2, cudaMemcpyDeviceToHost);
                for (int64_t i = 0; i < g.T_max * g.H && rc == 0; i++)
                    if (got[i] != 0x7fc0)
                        rc = ref_fail(
                            rank,
                            "combine after a failed dispatch: combined_x[%lld][%lld] = 0x%x, expected NaN",
                            (long long)(i / g.H), (long long)(i % g.H), got[i]);
                free(got);
            }
        }
    } else if (rc == 0) {
        usleep((useconds_t)(timeout_ms + 2500) * 1000u); /* rank 0 gives up meanwhile */
    }
    cfg_free(&g);
    if (!buf) return 1;
    EXPECT_OK(epx_buffer_destroy(buf));
    EXPECT_OK(epx_comm_destroy(comm));
    return rc;
}

/* Across nodes, a rank killed between calls: rank 1 of 2 (one per node) exits after a good round
 * without destroying anything; rank 0's next dispatch must end with EPX_ERR_REMOTE naming peer 1 well
 * inside the comm's timeout (the watcher sees the process gone and aborts the transport's waits), its
 * combine must be refused (the buffer failed) with its output untouched, and its destroy must return
 * within the timeout. */
static int kill_main(int rank, int nranks, const epx_unique_id_t *id, void *vctx)
{
    const ctx_t *ctx = vctx;
    const int timeout_ms = 20000;
    epx_comm_t comm;
    cfg_t g;
    epx_buffer_t buf;
    ref_set_case("killed peer across nodes R=%d", nranks);
    int rc = fault_open(ctx, id, rank, nranks, timeout_ms, ctx->gpu.seed + 4343, &comm, &g, &buf);
    if (rc < 0) return 1;
    if (rc == 0 && rank == 1) {
        fflush(stdout);
        _exit(0); /* killed: nothing torn down */
    }
    if (rc == 0) {
        usleep(200 * 1000); /* the peer is gone */
        const uint64_t t0 = epx_time_ns();
        epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
        epx_ll_dispatch_outputs_t o = EPX_LL_DISPATCH_OUTPUTS_INIT;
        const epx_result_t r = dispatch_until_error(buf, &g, rank, &a, &o, 2000);
        const double ms = (double)(epx_time_ns() - t0) / 1e6;
        printf("ll: killed peer reported in %.1f ms: %s\n", ms, epx_last_error_message());
        if (r != EPX_ERR_REMOTE)
            rc = ref_fail(rank, "killed peer: async error %s, expected ERR_REMOTE", epx_result_name(r));
        if (rc == 0 && !strstr(epx_last_error_message(), "peer 1"))
            rc = ref_fail(rank, "killed peer: message '%s' does not name peer 1", epx_last_error_message());
        if (rc == 0 && ms > timeout_ms / 2)
            rc = ref_fail(rank, "killed peer: reported after %.0f ms (timeout %d ms)", ms, timeout_ms);
        if (rc == 0) {
            epx_ll_combine_args_t ca;
            epx_ll_combine_outputs_t co;
            combine_args(&g, g.T_max, &a.topk_idx, &ca, &co);
            ca.handle = o.handle;
            uint16_t before = 0, after = 0;
            CUDA_OK(cudaMemcpy(g.out, &before, 2, cudaMemcpyHostToDevice));
            if (epx_ll_combine(buf, &ca, &co) == EPX_SUCCESS ||
                !strstr(epx_last_error_message(), "destroy the buffer"))
                rc = ref_fail(rank, "combine after a killed peer: not refused ('%s')",
                              epx_last_error_message());
            CUDA_OK(cudaStreamSynchronize(g.st));
            cudaMemcpy(&after, g.out, 2, cudaMemcpyDeviceToHost);
            if (rc == 0 && after != before)
                rc = ref_fail(rank, "combine after a killed peer wrote its output");
        }
    }
    cfg_free(&g);
    if (!buf) return 1;
    const uint64_t t1 = epx_time_ns();
    epx_buffer_destroy(buf); /* its verdict names the dead peer; bounded is what counts */
    epx_comm_destroy(comm);
    const double dms = (double)(epx_time_ns() - t1) / 1e6;
    printf("ll: destroy after a killed peer took %.1f ms\n", dms);
    if (rc == 0 && dms > timeout_ms + 5000) rc = ref_fail(rank, "destroy took %.0f ms", dms);
    return rc;
}

int main(void)
{
    ctx_t ctx;
    if (gpu_test_init(&ctx.gpu)) return EPX_TEST_SKIP;
    const char *iters = getenv("EPX_GPU_TEST_LL_ITERS");
    ctx.iters = iters && atoi(iters) > 0 ? atoi(iters) : 20;
    ctx.per_node = 0;
    const char *nodes = getenv("EPX_GPU_TEST_NODES");
    if (nodes && atoi(nodes) != 0) {
        /* Across nodes: every split of EPX_TEST_NODE_SPLITS (ranks of one node each) on the network path. */
        ref_split_t splits[REF_MAX_SPLITS];
        const int n = ref_node_splits(splits);
        if (n < 0) return 1;
        for (int i = 0; i < n; i++) {
            ctx.per_node = splits[i].per_node;
            const int R = splits[i].nodes * splits[i].per_node;
            printf("ll: %d node(s) of %d ranks (%s)\n", splits[i].nodes, splits[i].per_node,
                   getenv("EPX_NET_TRANSPORT") ? getenv("EPX_NET_TRANSPORT") : "no transport set");
            fflush(stdout);
            if (epx_test_run_ranks(R, rank_main, &ctx, 500) != 0) {
                fprintf(stderr, "ll: %dx%d failed\n", splits[i].nodes, splits[i].per_node);
                return 1;
            }
        }
        ctx.per_node = 1;
    } else if (gpu_test_each_nranks("ll", "2,4,8", rank_main, &ctx.gpu)) {
        return 1;
    }
    printf("ll: failed receive, 2 ranks%s\n", ctx.per_node ? " on 2 nodes" : "");
    fflush(stdout);
    if (epx_test_run_ranks(2, fail_main, &ctx, 200) != 0) {
        fprintf(stderr, "ll: failed-receive check failed\n");
        return 1;
    }
    printf("ll: failed receive passed\n");
    if (ctx.per_node) {
        printf("ll: killed peer, 2 ranks on 2 nodes\n");
        fflush(stdout);
        if (epx_test_run_ranks(2, kill_main, &ctx, 200) != 0) {
            fprintf(stderr, "ll: killed-peer check failed\n");
            return 1;
        }
        printf("ll: killed peer passed\n");
    }
    return 0;
}
