/*
 * A rank that stays alive but skips the second of two HT rounds on the cuda backend: the other
 * ranks' dispatch must return EPX_ERR_TIMEOUT naming the silent peer at the deadline (device waits
 * give up via %globaltimer), epx_get_async_error must report it, and teardown must not hang. (A
 * peer whose process exits is noticed at once instead: test_peer_exit.c.)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"
#include "gpu_test.h"

#define NRANKS     4
#define TIMEOUT_MS 3000
#define H          2048
#define TM         64
#define K          8
#define E          64

static epx_result_t round_trip(epx_buffer_t buf, void *dx, void *dtopk, void *drx, void *dout)
{
    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    a.x = gpu_tensor(dx, EPX_DTYPE_BF16, 2, TM, H, 0, 0);
    a.topk_idx = gpu_tensor(dtopk, EPX_DTYPE_INT32, 2, TM, K, 0, 0);
    epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
    o.recv_x = gpu_tensor(drx, EPX_DTYPE_BF16, 2, (int64_t)NRANKS * TM, H, 0, 0);
    epx_result_t res = epx_ht_dispatch(buf, &a, &o);
    if (res != EPX_SUCCESS) return res;
    epx_ht_combine_args_t ca = EPX_HT_COMBINE_ARGS_INIT;
    ca.handle = o.handle;
    ca.x = gpu_tensor(drx, EPX_DTYPE_BF16, 2, o.num_recv_tokens_host, H, 0, 0);
    epx_ht_combine_outputs_t co = EPX_HT_COMBINE_OUTPUTS_INIT;
    co.combined_x = gpu_tensor(dout, EPX_DTYPE_BF16, 2, TM, H, 0, 0);
    res = epx_ht_combine(buf, &ca, &co);
    epx_handle_destroy(o.handle);
    return res;
}

static int rank_main(int rank, int nranks, const epx_unique_id_t *id, void *ctx, void *result)
{
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    cfg.backend = EPX_BACKEND_CUDA;
    cfg.cuda_device = 0;
    cfg.timeout_ms = TIMEOUT_MS;
    epx_comm_t comm;
    EXPECT_OK(epx_comm_init(id, rank, NRANKS, &cfg, &comm));
    epx_buffer_config_t bc = epx_test_buffer_config(TM, H, K, E, EPX_MODE_HT);
    bc.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_BF16);
    epx_buffer_t buf;
    EXPECT_OK(epx_buffer_create(comm, &bc, &buf));
    void *dx, *dtopk, *drx, *dout;
    EXPECT_TRUE(cudaMalloc(&dx, (size_t)TM * H * 2) == cudaSuccess);
    EXPECT_TRUE(cudaMalloc(&dtopk, (size_t)TM * K * 4) == cudaSuccess);
    EXPECT_TRUE(cudaMalloc(&drx, (size_t)NRANKS * TM * H * 2) == cudaSuccess);
    EXPECT_TRUE(cudaMalloc(&dout, (size_t)TM * H * 2) == cudaSuccess);
    cudaMemset(dx, 0x3f, (size_t)TM * H * 2);
    int32_t topk[TM * K];
    for (int t = 0; t < TM; t++)
        for (int k = 0; k < K; k++) topk[t * K + k] = (t * 7 + k * (E / K)) % E; /* distinct per token */
    gpu_h2d(dtopk, topk, sizeof(topk));
    EXPECT_OK(round_trip(buf, dx, dtopk, drx, dout));

    if (rank == NRANKS - 1) {
        /* Silent until the others gave up and tore down, then a teardown of its own. */
        usleep((useconds_t)(TIMEOUT_MS + 4000) * 1000u);
        EXPECT_OK(epx_buffer_destroy(buf));
        EXPECT_OK(epx_comm_destroy(comm));
        return 0;
    }

    double t0 = epx_test_now_s();
    epx_result_t res = round_trip(buf, dx, dtopk, drx, dout);
    double waited = epx_test_now_s() - t0;
    printf("rank %d: second round returned %s after %.2f s: %s\n", rank, epx_result_name(res), waited,
           epx_last_error_message());
    fflush(stdout);
    EXPECT_RES(res, EPX_ERR_TIMEOUT);
    EXPECT_MSG_HAS("peer 3");
    /* Device deadline plus launch and polling slack. */
    EXPECT_TRUE(waited < TIMEOUT_MS / 1000.0 + 10.0);
    EXPECT_TRUE(waited > TIMEOUT_MS / 1000.0 * 0.9);
    EXPECT_RES(epx_get_async_error(comm), EPX_ERR_TIMEOUT);
    t0 = epx_test_now_s();
    EXPECT_OK(epx_buffer_destroy(buf));
    EXPECT_OK(epx_comm_destroy(comm));
    EXPECT_TRUE(epx_test_now_s() - t0 < 10.0);
    return 0;
}

int main(void)
{
    if (epx_harness_gpu_count() <= 0) {
        printf("no usable GPU: skipped\n");
        return EPX_TEST_SKIP;
    }
    if (epx_harness_run_simple("ht timeout", NRANKS, rank_main, NULL, 120.0) != 0) return 1;
    printf("silent rank: the others returned EPX_ERR_TIMEOUT in time\n");
    return 0;
}
