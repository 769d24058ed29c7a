/*
 * Calls the ranks disagree on, refusals inside a capture and a peer that leaves, on the cuda
 * backend: an HT dispatch with bf16 on rank 0 and fp8 elsewhere, and a combine on rank 0 against a
 * dispatch elsewhere, fail every rank at once with EPX_ERR_MISMATCH naming the field or both calls;
 * an HT dispatch against LL dispatches and an LL dispatch against routing-map dispatches fail every
 * rank (LL on the device: recv_count -1) and leave every kind of call working; refused LL and
 * routing-map dispatches under capture fail the peers' calls;
 * a cached static dispatch that drops rows sets the overflow flag; a bad argument to a captured
 * static dispatch is refused, the peers return EPX_ERR_REMOTE and the capture ends cleanly; a rank
 * that destroys its buffer while the others wait in a dispatch makes them return EPX_ERR_REMOTE
 * long before the timeout. After each failure a round trip works on every rank.
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"
#include "gpu_test.h"

#define TIMEOUT_MS 30000
#define H          256
#define TM         32
#define K          2
#define E          8

typedef struct fixture {
    int rank, R, device;
    epx_comm_t comm;
    epx_buffer_t buf;
    gpu_arena_t da;
    void *x, *x8, *scales, *topk, *rx, *rx8, *rscales, *out;
    void *map, *w, *lrx, *lcnt; /* routing map, LL combine weights, LL recv_x and recv_count */
} fixture_t;

/* An HT dispatch of x (bf16) or x8 (fp8): eager (worst 0) or static, routed or cached. */
static epx_result_t dispatch(fixture_t *f, epx_dtype_t dtype, int64_t worst, epx_handle_t cached, int bad_k,
                             void *stream, epx_handle_t *handle_out, int64_t *nrecv_out)
{
    const int64_t rows = (int64_t)f->R * TM, fp8 = dtype == EPX_DTYPE_FP8_E4M3;
    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    a.x = gpu_tensor(fp8 ? f->x8 : f->x, dtype, 2, TM, H, 0, f->device);
    if (fp8) a.x_scales = gpu_tensor(f->scales, EPX_DTYPE_FP32, 2, TM, H / 128, 0, f->device);
    if (!cached) a.topk_idx = gpu_tensor(f->topk, EPX_DTYPE_INT32, 2, TM, bad_k ? K + 1 : K, 0, f->device);
    a.cached_handle = cached;
    a.num_worst_tokens = worst;
    a.stream = stream;
    epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
    o.recv_x = gpu_tensor(fp8 ? f->rx8 : f->rx, dtype, 2, rows, H, 0, f->device);
    if (fp8) o.recv_x_scales = gpu_tensor(f->rscales, EPX_DTYPE_FP32, 2, rows, H / 128, 0, f->device);
    epx_result_t res = epx_ht_dispatch(f->buf, &a, &o);
    if (res == EPX_SUCCESS) {
        if (handle_out) *handle_out = o.handle;
        if (nrecv_out) *nrecv_out = o.num_recv_tokens_host;
    }
    return res;
}

static epx_result_t combine(fixture_t *f, epx_handle_t handle, int64_t nrecv)
{
    epx_ht_combine_args_t ca = EPX_HT_COMBINE_ARGS_INIT;
    ca.handle = handle;
    ca.x = gpu_tensor(f->rx, EPX_DTYPE_BF16, 2, nrecv, H, 0, f->device);
    epx_ht_combine_outputs_t co = EPX_HT_COMBINE_OUTPUTS_INIT;
    co.combined_x = gpu_tensor(f->out, EPX_DTYPE_BF16, 2, TM, H, 0, f->device);
    return epx_ht_combine(f->buf, &ca, &co);
}

/* A bf16 dispatch and its combine of the received rows: every token comes back as the sum of its
 * copies, x * (number of ranks it went to), exact for these small values. */
static int round_trip(fixture_t *f, const char *after)
{
    const int rank = f->rank;
    epx_handle_t h;
    int64_t n;
    EXPECT_OK(dispatch(f, EPX_DTYPE_BF16, 0, NULL, 0, NULL, &h, &n));
    EXPECT_OK(combine(f, h, n));
    EXPECT_OK(epx_handle_destroy(h));
    uint16_t got[TM * H];
    EXPECT_TRUE(cudaMemcpy(got, f->out, sizeof(got), cudaMemcpyDeviceToHost) == cudaSuccess);
    const int L = E / f->R;
    for (int t = 0; t < TM; t++) {
        const int r0 = (t % E) / L, r1 = ((t + 1) % E) / L, copies = r0 == r1 ? 1 : 2;
        for (int c = 0; c < H; c++) {
            const uint16_t want = epx_f32_to_bf16((float)(copies * (1 + (rank * TM + t + c) % 16)));
            if (got[t * H + c] != want)
                return ref_fail(rank, "round trip after %s: combined_x[%d][%d] = 0x%04x, expected 0x%04x", after,
                                t, c, got[t * H + c], want);
        }
    }
    return 0;
}

/* An LL dispatch of x (bf16) into lrx and lcnt; `topk_cols` other than K is a bad argument. */
static epx_result_t ll_dispatch(fixture_t *f, int topk_cols, void *stream, epx_ll_handle_t *handle_out)
{
    const int64_t L = E / f->R;
    epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
    a.x = gpu_tensor(f->x, EPX_DTYPE_BF16, 2, TM, H, 0, f->device);
    a.topk_idx = gpu_tensor(f->topk, EPX_DTYPE_INT32, 2, TM, topk_cols, 0, f->device);
    a.stream = stream;
    epx_ll_dispatch_outputs_t o = EPX_LL_DISPATCH_OUTPUTS_INIT;
    o.recv_x = gpu_tensor(f->lrx, EPX_DTYPE_BF16, 3, L, (int64_t)f->R * TM, H, f->device);
    o.recv_count = gpu_tensor(f->lcnt, EPX_DTYPE_INT32, 1, L, 0, 0, f->device);
    epx_result_t res = epx_ll_dispatch(f->buf, &a, &o);
    if (res == EPX_SUCCESS && handle_out) *handle_out = o.handle;
    return res;
}

/* A routing-map dispatch without permute into rx; bound -1: none; `map_cols` other than E is a bad
 * argument. */
static epx_result_t rm_dispatch(fixture_t *f, int64_t bound, int map_cols, void *stream, epx_handle_t *handle_out,
                                int64_t *n_out)
{
    epx_rm_dispatch_args_t a = EPX_RM_DISPATCH_ARGS_INIT;
    a.hidden = gpu_tensor(f->x, EPX_DTYPE_BF16, 2, TM, H, 0, f->device);
    a.routing_map = gpu_tensor(f->map, EPX_DTYPE_BOOL, 2, TM, map_cols, 0, f->device);
    a.num_dispatched_tokens = bound;
    a.stream = stream;
    epx_rm_dispatch_outputs_t o = EPX_RM_DISPATCH_OUTPUTS_INIT;
    o.tokens = gpu_tensor(f->rx, EPX_DTYPE_BF16, 2, (int64_t)f->R * TM, H, 0, f->device);
    epx_result_t res = epx_rm_dispatch(f->buf, &a, &o);
    if (res == EPX_SUCCESS) {
        if (handle_out) *handle_out = o.handle;
        if (n_out) *n_out = o.num_tokens_host;
    }
    return res;
}

/* After a failed LL dispatch (seen on the device only) every recv_count is -1. */
static int ll_counts_poisoned(fixture_t *f, const char *what)
{
    const int rank = f->rank, L = E / f->R;
    int32_t cnt[E];
    EXPECT_TRUE(cudaDeviceSynchronize() == cudaSuccess);
    EXPECT_TRUE(cudaMemcpy(cnt, f->lcnt, (size_t)L * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
    for (int j = 0; j < L; j++)
        if (cnt[j] != -1) return ref_fail(rank, "%s: recv_count[%d] = %d, expected -1", what, j, cnt[j]);
    return 0;
}

/* An LL dispatch and its combine with weight 1 on both slots: every token comes back as 2 * x. */
static int ll_round_trip(fixture_t *f, const char *after)
{
    const int rank = f->rank;
    const int64_t L = E / f->R;
    epx_ll_handle_t h;
    EXPECT_OK(ll_dispatch(f, K, NULL, &h));
    epx_ll_combine_args_t ca = EPX_LL_COMBINE_ARGS_INIT;
    ca.handle = h;
    ca.y = gpu_tensor(f->lrx, EPX_DTYPE_BF16, 3, L, (int64_t)f->R * TM, H, f->device);
    ca.topk_idx = gpu_tensor(f->topk, EPX_DTYPE_INT32, 2, TM, K, 0, f->device);
    ca.topk_weights = gpu_tensor(f->w, EPX_DTYPE_FP32, 2, TM, K, 0, f->device);
    epx_ll_combine_outputs_t co = EPX_LL_COMBINE_OUTPUTS_INIT;
    co.combined_x = gpu_tensor(f->out, EPX_DTYPE_BF16, 2, TM, H, 0, f->device);
    EXPECT_OK(epx_ll_combine(f->buf, &ca, &co));
    uint16_t got[TM * H];
    EXPECT_TRUE(cudaMemcpy(got, f->out, sizeof(got), cudaMemcpyDeviceToHost) == cudaSuccess);
    for (int t = 0; t < TM; t++)
        for (int c = 0; c < H; c++) {
            const uint16_t want = epx_f32_to_bf16((float)(2 * (1 + (rank * TM + t + c) % 16)));
            if (got[t * H + c] != want)
                return ref_fail(rank, "LL round trip after %s: combined_x[%d][%d] = 0x%04x, expected 0x%04x",
                                after, t, c, got[t * H + c], want);
        }
    return 0;
}

/* Routing-map dispatch and combine: every token comes back as x * (number of ranks it went to). */
static int rm_round_trip(fixture_t *f, const char *after)
{
    const int rank = f->rank, L = E / f->R;
    epx_handle_t h;
    int64_t n;
    EXPECT_OK(rm_dispatch(f, -1, E, NULL, &h, &n));
    epx_rm_combine_args_t ca = EPX_RM_COMBINE_ARGS_INIT;
    ca.handle = h;
    ca.x = gpu_tensor(f->rx, EPX_DTYPE_BF16, 2, n, H, 0, f->device);
    epx_rm_combine_outputs_t co = EPX_RM_COMBINE_OUTPUTS_INIT;
    co.combined = gpu_tensor(f->out, EPX_DTYPE_BF16, 2, TM, H, 0, f->device);
    EXPECT_OK(epx_rm_combine(f->buf, &ca, &co));
    EXPECT_OK(epx_handle_destroy(h));
    uint16_t got[TM * H];
    EXPECT_TRUE(cudaMemcpy(got, f->out, sizeof(got), cudaMemcpyDeviceToHost) == cudaSuccess);
    for (int t = 0; t < TM; t++) {
        const int copies = (t % E) / L == ((t + 1) % E) / L ? 1 : 2;
        for (int c = 0; c < H; c++) {
            const uint16_t want = epx_f32_to_bf16((float)(copies * (1 + (rank * TM + t + c) % 16)));
            if (got[t * H + c] != want)
                return ref_fail(rank, "routing-map round trip after %s: combined[%d][%d] = 0x%04x, expected 0x%04x",
                                after, t, c, got[t * H + c], want);
        }
    }
    return 0;
}

/* Every kind of call works after `what`. */
static int all_round_trips(fixture_t *f, const char *what)
{
    return ll_round_trip(f, what) || round_trip(f, what) || rm_round_trip(f, what) || ll_round_trip(f, what);
}

static int fixture_open(fixture_t *f, const gpu_ctx_t *ctx, const epx_unique_id_t *id, int rank, int R)
{
    memset(f, 0, sizeof(*f));
    f->rank = rank;
    f->R = R;
    if (gpu_test_comm(ctx, id, rank, R, TIMEOUT_MS, &f->comm, &f->device)) return 1;
    epx_buffer_config_t bc = epx_test_buffer_config(TM, H, K, E, EPX_MODE_HT | EPX_MODE_LL | EPX_MODE_PERMUTE);
    bc.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_BF16) | EPX_DTYPE_BIT(EPX_DTYPE_FP8_E4M3);
    EXPECT_OK(epx_buffer_create(f->comm, &bc, &f->buf));
    const size_t rows = (size_t)R * TM;
    uint16_t hx[TM * H];
    uint8_t hx8[TM * H];
    float hs[TM * (H / 128)];
    int32_t topk[TM * K];
    uint8_t map[TM * E];
    float w[TM * K];
    memset(map, 0, sizeof(map));
    for (int i = 0; i < TM * K; i++) w[i] = 1.0f;
    for (int t = 0; t < TM; t++) {
        map[t * E + t % E] = 1;
        map[t * E + (t + 1) % E] = 1;
        for (int c = 0; c < H; c++) {
            hx[t * H + c] = epx_f32_to_bf16((float)(1 + (rank * TM + t + c) % 16));
            hx8[t * H + c] = epx_f32_to_fp8_e4m3((float)(1 + c % 8));
        }
        for (int g = 0; g < H / 128; g++) hs[t * (H / 128) + g] = 1.0f;
        topk[t * K] = t % E;
        topk[t * K + 1] = (t + 1) % E;
    }
    f->x = gpu_alloc(&f->da, sizeof(hx), hx);
    f->x8 = gpu_alloc(&f->da, sizeof(hx8), hx8);
    f->scales = gpu_alloc(&f->da, sizeof(hs), hs);
    f->topk = gpu_alloc(&f->da, sizeof(topk), topk);
    f->rx = gpu_alloc(&f->da, rows * H * 2, NULL);
    f->rx8 = gpu_alloc(&f->da, rows * H, NULL);
    f->rscales = gpu_alloc(&f->da, rows * (H / 128) * 4, NULL);
    f->out = gpu_alloc(&f->da, (size_t)TM * H * 2, NULL);
    f->map = gpu_alloc(&f->da, sizeof(map), map);
    f->w = gpu_alloc(&f->da, sizeof(w), w);
    f->lrx = gpu_alloc(&f->da, (size_t)E * TM * H * 2, NULL); /* L * R * TM rows */
    f->lcnt = gpu_alloc(&f->da, (size_t)E * 4, NULL);
    EXPECT_TRUE(f->out && f->map && f->w && f->lrx && f->lcnt);
    return all_round_trips(f, "creation");
}

/* Rank 0 dispatches bf16, the others fp8: every rank fails with EPX_ERR_MISMATCH about the dtype. */
static int dtype_mismatch(fixture_t *f)
{
    const int rank = f->rank;
    const double t0 = epx_test_now_s();
    EXPECT_RES(dispatch(f, rank == 0 ? EPX_DTYPE_BF16 : EPX_DTYPE_FP8_E4M3, 0, NULL, 0, NULL, NULL, NULL),
               EPX_ERR_MISMATCH);
    EXPECT_MSG_HAS("dtype");
    EXPECT_TRUE(epx_test_now_s() - t0 < TIMEOUT_MS / 3000.0);
    EXPECT_RES(epx_get_async_error(f->comm), EPX_ERR_MISMATCH);
    return round_trip(f, "a dtype mismatch");
}

/* Rank 0 combines (a handle of its own) while the others dispatch: every rank fails at once with
 * EPX_ERR_MISMATCH naming both calls. */
static int kind_mismatch(fixture_t *f)
{
    const int rank = f->rank;
    epx_handle_t h;
    int64_t n;
    EXPECT_OK(dispatch(f, EPX_DTYPE_BF16, 0, NULL, 0, NULL, &h, &n));
    EXPECT_OK(combine(f, h, n));
    const double t0 = epx_test_now_s();
    if (rank == 0)
        EXPECT_RES(combine(f, h, n), EPX_ERR_MISMATCH);
    else
        EXPECT_RES(dispatch(f, EPX_DTYPE_BF16, 0, NULL, 0, NULL, NULL, NULL), EPX_ERR_MISMATCH);
    EXPECT_MSG_HAS("HT combine");
    EXPECT_MSG_HAS("HT dispatch");
    EXPECT_TRUE(epx_test_now_s() - t0 < TIMEOUT_MS / 3000.0);
    EXPECT_OK(epx_handle_destroy(h));
    (void)epx_get_async_error(f->comm);
    return round_trip(f, "a combine against a dispatch");
}

/* A cached static dispatch bounded at one row drops the rest: the overflow flag is set. */
static int cached_overflow(fixture_t *f)
{
    epx_handle_t h;
    int64_t n;
    EXPECT_OK(dispatch(f, EPX_DTYPE_BF16, 0, NULL, 0, NULL, &h, &n));
    EXPECT_OK(epx_buffer_query_overflow(f->buf));
    EXPECT_TRUE(n > 1);
    EXPECT_OK(dispatch(f, EPX_DTYPE_BF16, 1, h, 0, NULL, NULL, NULL));
    EXPECT_TRUE(cudaDeviceSynchronize() == cudaSuccess);
    EXPECT_RES(epx_buffer_query_overflow(f->buf), EPX_ERR_OVERFLOW);
    EXPECT_OK(epx_buffer_query_overflow(f->buf)); /* the query cleared it */
    /* Uncached, for comparison, then cached within the bound: no overflow. */
    epx_handle_t h2;
    EXPECT_OK(dispatch(f, EPX_DTYPE_BF16, 1, NULL, 0, NULL, &h2, NULL));
    EXPECT_TRUE(cudaDeviceSynchronize() == cudaSuccess);
    EXPECT_RES(epx_buffer_query_overflow(f->buf), EPX_ERR_OVERFLOW);
    EXPECT_OK(dispatch(f, EPX_DTYPE_BF16, n, h, 0, NULL, NULL, NULL));
    EXPECT_TRUE(cudaDeviceSynchronize() == cudaSuccess);
    EXPECT_OK(epx_buffer_query_overflow(f->buf));
    EXPECT_OK(epx_handle_destroy(h2));
    EXPECT_OK(epx_handle_destroy(h));
    return round_trip(f, "cached overflow");
}

/* Rank 0 makes a static dispatch with a bad topk_idx while capturing its stream: refused, the
 * capture ends (a graph or a clean invalidation), the peers (not capturing) return EPX_ERR_REMOTE. */
static int captured_refusal(fixture_t *f)
{
    const int rank = f->rank;
    const double t0 = epx_test_now_s();
    if (rank == 0) {
        cudaStream_t st;
        EXPECT_TRUE(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) == cudaSuccess);
        EXPECT_TRUE(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal) == cudaSuccess);
        EXPECT_RES(dispatch(f, EPX_DTYPE_BF16, (int64_t)f->R * TM, NULL, 1, st, NULL, NULL),
                   EPX_ERR_INVALID_ARG);
        EXPECT_MSG_HAS("topk_idx");
        cudaGraph_t graph = NULL;
        const cudaError_t end = cudaStreamEndCapture(st, &graph);
        EXPECT_TRUE(end == cudaSuccess || end == cudaErrorStreamCaptureInvalidated);
        (void)cudaGetLastError();
        if (graph) cudaGraphDestroy(graph);
        enum cudaStreamCaptureStatus cs;
        EXPECT_TRUE(cudaStreamIsCapturing(st, &cs) == cudaSuccess && cs == cudaStreamCaptureStatusNone);
        EXPECT_TRUE(cudaStreamDestroy(st) == cudaSuccess);
    } else {
        EXPECT_RES(dispatch(f, EPX_DTYPE_BF16, 0, NULL, 0, NULL, NULL, NULL), EPX_ERR_REMOTE);
    }
    EXPECT_TRUE(epx_test_now_s() - t0 < TIMEOUT_MS / 3000.0);
    (void)epx_get_async_error(f->comm);
    return round_trip(f, "a refusal under capture");
}

/* Rank 0 makes an HT dispatch while the others make an LL dispatch: rank 0 returns
 * EPX_ERR_MISMATCH naming both calls, the others' device halves fail (recv_count -1); their LL
 * dispatch gives its slot back, so every kind of call works after it. */
static int ht_vs_ll(fixture_t *f)
{
    const int rank = f->rank;
    const double t0 = epx_test_now_s();
    if (rank == 0) {
        EXPECT_RES(dispatch(f, EPX_DTYPE_BF16, 0, NULL, 0, NULL, NULL, NULL), EPX_ERR_MISMATCH);
        EXPECT_MSG_HAS("LL dispatch");
    } else {
        EXPECT_OK(ll_dispatch(f, K, NULL, NULL)); /* no host wait: the device fails it */
        if (ll_counts_poisoned(f, "LL dispatch against an HT dispatch")) return 1;
    }
    EXPECT_TRUE(epx_test_now_s() - t0 < TIMEOUT_MS / 3000.0);
    return all_round_trips(f, "an HT dispatch against an LL dispatch");
}

/* Rank 0 makes an LL dispatch while the others make a routing-map dispatch: they return
 * EPX_ERR_MISMATCH, rank 0's device halves fail; every kind of call works after it. */
static int ll_vs_rm(fixture_t *f)
{
    const int rank = f->rank;
    const double t0 = epx_test_now_s();
    if (rank == 0) {
        EXPECT_OK(ll_dispatch(f, K, NULL, NULL));
        if (ll_counts_poisoned(f, "LL dispatch against a routing-map dispatch")) return 1;
    } else {
        EXPECT_RES(rm_dispatch(f, -1, E, NULL, NULL, NULL), EPX_ERR_MISMATCH);
        EXPECT_MSG_HAS("LL dispatch");
    }
    EXPECT_TRUE(epx_test_now_s() - t0 < TIMEOUT_MS / 3000.0);
    return all_round_trips(f, "an LL dispatch against a routing-map dispatch");
}

/* Rank 0 captures its stream and makes the call with a bad argument: refused with
 * EPX_ERR_INVALID_ARG, the capture ends cleanly (a graph or a clean invalidation). */
typedef epx_result_t (*captured_call_fn)(fixture_t *f, void *stream);

static int refuse_in_capture(fixture_t *f, captured_call_fn call, const char *needle)
{
    const int rank = f->rank;
    cudaStream_t st;
    EXPECT_TRUE(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) == cudaSuccess);
    EXPECT_TRUE(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal) == cudaSuccess);
    EXPECT_RES(call(f, st), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS(needle);
    cudaGraph_t graph = NULL;
    const cudaError_t end = cudaStreamEndCapture(st, &graph);
    EXPECT_TRUE(end == cudaSuccess || end == cudaErrorStreamCaptureInvalidated);
    (void)cudaGetLastError();
    if (graph) cudaGraphDestroy(graph);
    enum cudaStreamCaptureStatus cs;
    EXPECT_TRUE(cudaStreamIsCapturing(st, &cs) == cudaSuccess && cs == cudaStreamCaptureStatusNone);
    EXPECT_TRUE(cudaStreamDestroy(st) == cudaSuccess);
    (void)rank;
    return 0;
}

static epx_result_t bad_ll_call(fixture_t *f, void *stream)
{
    return ll_dispatch(f, K + 1, stream, NULL);
}

static epx_result_t bad_rm_call(fixture_t *f, void *stream)
{
    return rm_dispatch(f, (int64_t)f->R * TM, E + 1, stream, NULL, NULL);
}

/* A refused LL dispatch under capture on rank 0: the peers' LL dispatches fail on the device
 * (recv_count -1); a refused bounded routing-map dispatch under capture: the peers' unbounded
 * ones return EPX_ERR_REMOTE. Every kind of call works after each. */
static int captured_refusal_ll_rm(fixture_t *f)
{
    const int rank = f->rank;
    double t0 = epx_test_now_s();
    if (rank == 0) {
        if (refuse_in_capture(f, bad_ll_call, "topk_idx")) return 1;
    } else {
        EXPECT_OK(ll_dispatch(f, K, NULL, NULL));
        if (ll_counts_poisoned(f, "LL dispatch against a refusal under capture")) return 1;
    }
    EXPECT_TRUE(epx_test_now_s() - t0 < TIMEOUT_MS / 3000.0);
    if (all_round_trips(f, "an LL refusal under capture")) return 1;
    t0 = epx_test_now_s();
    if (rank == 0) {
        if (refuse_in_capture(f, bad_rm_call, "routing_map")) return 1;
    } else {
        EXPECT_RES(rm_dispatch(f, -1, E, NULL, NULL, NULL), EPX_ERR_REMOTE);
    }
    EXPECT_TRUE(epx_test_now_s() - t0 < TIMEOUT_MS / 3000.0);
    (void)epx_get_async_error(f->comm);
    return all_round_trips(f, "a routing-map refusal under capture");
}

/* The last rank destroys its buffer while the others wait in a dispatch for its rows. */
static int destroy_while_waited(fixture_t *f)
{
    const int rank = f->rank;
    if (rank == f->R - 1) {
        usleep(500 * 1000);
        EXPECT_OK(epx_buffer_destroy(f->buf));
        return 0;
    }
    const double t0 = epx_test_now_s();
    EXPECT_RES(dispatch(f, EPX_DTYPE_BF16, 0, NULL, 0, NULL, NULL, NULL), EPX_ERR_REMOTE);
    const double waited = epx_test_now_s() - t0;
    printf("rank %d: dispatch against a destroyed peer returned after %.2f s: %s\n", rank, waited,
           epx_last_error_message());
    EXPECT_MSG_HAS("peer");
    EXPECT_TRUE(waited < TIMEOUT_MS / 3000.0);
    EXPECT_OK(epx_buffer_destroy(f->buf));
    return 0;
}

static int rank_main(int rank, int nranks, const epx_unique_id_t *id, void *vctx)
{
    fixture_t f;
    if (fixture_open(&f, vctx, id, rank, nranks)) return 1;
    int rc = dtype_mismatch(&f);
    if (rc == 0) rc = kind_mismatch(&f);
    if (rc == 0) rc = cached_overflow(&f);
    if (rc == 0) rc = captured_refusal(&f);
    if (rc == 0) rc = ht_vs_ll(&f);
    if (rc == 0) rc = ll_vs_rm(&f);
    if (rc == 0) rc = captured_refusal_ll_rm(&f);
    if (rc == 0) rc = destroy_while_waited(&f);
    if (rc == 0) EXPECT_OK(epx_comm_barrier(f.comm));
    gpu_arena_free(&f.da);
    EXPECT_OK(epx_comm_destroy(f.comm));
    return rc;
}

int main(void)
{
    gpu_ctx_t ctx;
    if (gpu_test_init(&ctx)) return EPX_TEST_SKIP;
    return gpu_test_each_nranks("agreement", "2,4", rank_main, &ctx);
}
