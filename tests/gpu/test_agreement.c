/*
 * Calls the ranks disagree on, refusals inside a capture and a peer that leaves, on the cuda
 * backend: an HT dispatch with bf16 on rank 0 and fp8 elsewhere, and a combine on rank 0 against a
 * dispatch elsewhere, fail every rank at once with EPX_ERR_MISMATCH naming the field or both calls;
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

static int fixture_open(fixture_t *f, const gpu_ctx_t *ctx, const epx_unique_id_t *id, int rank, int R)
{
    memset(f, 0, sizeof(*f));
    f->rank = rank;
    f->R = R;
    if (gpu_test_comm(ctx, id, rank, R, TIMEOUT_MS, &f->comm, &f->device)) return 1;
    epx_buffer_config_t bc = epx_test_buffer_config(TM, H, K, E, EPX_MODE_HT);
    bc.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_BF16) | EPX_DTYPE_BIT(EPX_DTYPE_FP8_E4M3);
    EXPECT_OK(epx_buffer_create(f->comm, &bc, &f->buf));
    const size_t rows = (size_t)R * TM;
    uint16_t hx[TM * H];
    uint8_t hx8[TM * H];
    float hs[TM * (H / 128)];
    int32_t topk[TM * K];
    for (int t = 0; t < TM; t++) {
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
    EXPECT_TRUE(f->out != NULL);
    return round_trip(f, "creation");
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
