/*
 * A rank killed between two HT rounds on the cuda backend: the surviving ranks' dispatch must
 * return EPX_ERR_TIMEOUT naming the dead peer within the deadline (device waits give up via
 * %globaltimer), epx_get_async_error must report it, and teardown must not hang.
 */
#include <cuda_runtime.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/internal.h"
#include "epx_test.h"

#define NRANKS     4
#define TIMEOUT_MS 3000
#define H          2048
#define TM         64
#define K          8
#define E          64

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static epx_tensor_t dt(void *p, epx_dtype_t d, int64_t a, int64_t b)
{
    epx_tensor_t t = epx_tensor_2d(p, d, a, b);
    t.device_type = EPX_DEVICE_CUDA;
    return t;
}

static epx_result_t round_trip(epx_buffer_t buf, void *dx, void *dtopk, void *drx, void *dout)
{
    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    a.x = dt(dx, EPX_DTYPE_BF16, TM, H);
    a.topk_idx = dt(dtopk, EPX_DTYPE_INT32, TM, K);
    epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
    o.recv_x = dt(drx, EPX_DTYPE_BF16, (int64_t)NRANKS * TM, H);
    epx_result_t res = epx_ht_dispatch(buf, &a, &o);
    if (res != EPX_SUCCESS) return res;
    epx_ht_combine_args_t ca = EPX_HT_COMBINE_ARGS_INIT;
    ca.handle = o.handle;
    ca.x = dt(drx, EPX_DTYPE_BF16, o.num_recv_tokens_host, H);
    epx_ht_combine_outputs_t co = EPX_HT_COMBINE_OUTPUTS_INIT;
    co.combined_x = dt(dout, EPX_DTYPE_BF16, TM, H);
    res = epx_ht_combine(buf, &ca, &co);
    epx_handle_destroy(o.handle);
    return res;
}

static int rank_main(int rank, const epx_unique_id_t *id)
{
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    cfg.backend = EPX_BACKEND_CUDA;
    cfg.cuda_device = 0;
    cfg.timeout_ms = TIMEOUT_MS;
    epx_comm_t comm;
    EXPECT_OK(epx_comm_init(id, rank, NRANKS, &cfg, &comm));
    epx_buffer_config_t bc = EPX_BUFFER_CONFIG_INIT;
    bc.max_tokens = TM;
    bc.hidden = H;
    bc.num_topk = K;
    bc.num_experts = E;
    bc.modes = EPX_MODE_HT;
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
    cudaMemcpy(dtopk, topk, sizeof(topk), cudaMemcpyHostToDevice);
    EXPECT_OK(round_trip(buf, dx, dtopk, drx, dout));

    if (rank == NRANKS - 1) kill(getpid(), SIGKILL); /* dies holding its mappings, mid-sequence */

    double t0 = now_s();
    epx_result_t res = round_trip(buf, dx, dtopk, drx, dout);
    double waited = now_s() - t0;
    printf("rank %d: second round returned %s after %.2f s: %s\n", rank, epx_result_name(res), waited,
           epx_last_error_message());
    fflush(stdout);
    EXPECT_RES(res, EPX_ERR_TIMEOUT);
    EXPECT_MSG_HAS("peer 3");
    /* Device deadline plus launch and polling slack. */
    EXPECT_TRUE(waited < TIMEOUT_MS / 1000.0 + 10.0);
    EXPECT_TRUE(waited > TIMEOUT_MS / 1000.0 * 0.9);
    EXPECT_RES(epx_get_async_error(comm), EPX_ERR_TIMEOUT);
    t0 = now_s();
    EXPECT_OK(epx_buffer_destroy(buf));
    EXPECT_OK(epx_comm_destroy(comm));
    EXPECT_TRUE(now_s() - t0 < 10.0);
    return 0;
}

static int gpu_count(void)
{
    pid_t pid = fork();
    if (pid < 0) return 0;
    if (pid == 0) {
        int n = 0;
        if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
        _exit(n > 100 ? 100 : n);
    }
    int status = 0;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 0;
    return WEXITSTATUS(status);
}

int main(void)
{
    if (gpu_count() <= 0) {
        printf("no usable GPU: skipped\n");
        return EPX_TEST_SKIP;
    }
    epx_unique_id_t id;
    EXPECT_OK(epx_get_unique_id(&id));
    pid_t pids[NRANKS];
    for (int r = 0; r < NRANKS; r++) {
        fflush(stdout);
        pids[r] = fork();
        if (pids[r] < 0) return 1;
        if (pids[r] == 0) _exit(rank_main(r, &id) == 0 ? 0 : 1);
    }
    int failed = 0;
    double t0 = now_s();
    for (int done = 0; done < NRANKS;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid > 0) {
            done++;
            for (int r = 0; r < NRANKS; r++) {
                if (pids[r] != pid) continue;
                int killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
                int ok = r == NRANKS - 1 ? killed : (WIFEXITED(status) && WEXITSTATUS(status) == 0);
                if (!ok) {
                    fprintf(stderr, "rank %d ended unexpectedly (status 0x%x)\n", r, status);
                    failed = 1;
                }
            }
            continue;
        }
        if (now_s() - t0 > 120.0) {
            fprintf(stderr, "surviving ranks hung; killing them\n");
            for (int r = 0; r < NRANKS; r++) kill(pids[r], SIGKILL);
            while (waitpid(-1, NULL, 0) > 0) {
            }
            return 1;
        }
        usleep(10000);
    }
    if (!failed) printf("killed rank: the others returned EPX_ERR_TIMEOUT in time\n");
    return failed;
}
