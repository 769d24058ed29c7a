/*
 * A peer process that exits is noticed at once on the cuda backend: of 3 ranks, the last calls
 * _exit 300 ms after buffer creation while the others are in an HT dispatch (eager: the call returns
 * the error) or an LL dispatch (the error comes through epx_get_async_error after a sync). The
 * survivors get EPX_ERR_REMOTE naming "peer 2 (pid P) exited" within 1 s of the exit although
 * EPX_TIMEOUT_MS is 20000, an LL survivor's recv_count is -1, and teardown does not hang.
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"
#include "gpu_test.h"

#define NRANKS     3
#define TIMEOUT_MS 20000
#define EXIT_AFTER 0.3 /* seconds between the barrier and the last rank's _exit */
#define H          1024
#define TM         32
#define K          2
#define E          6

typedef struct exit_case {
    int R;
    int ll; /* the survivors are in an LL dispatch (else HT) */
    gpu_ctx_t gpu;
} exit_case_t;

typedef struct fixture {
    int rank, device;
    epx_comm_t comm;
    epx_buffer_t buf;
    gpu_arena_t da;
    cudaStream_t st;
    void *x, *topk, *rx, *rc;
} fixture_t;

static epx_result_t ht_dispatch(fixture_t *f, epx_handle_t *h)
{
    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    a.x = gpu_tensor(f->x, EPX_DTYPE_BF16, 2, TM, H, 0, f->device);
    a.topk_idx = gpu_tensor(f->topk, EPX_DTYPE_INT32, 2, TM, K, 0, f->device);
    a.stream = f->st;
    epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
    o.recv_x = gpu_tensor(f->rx, EPX_DTYPE_BF16, 2, (int64_t)NRANKS * TM, H, 0, f->device);
    epx_result_t res = epx_ht_dispatch(f->buf, &a, &o);
    if (res == EPX_SUCCESS) *h = o.handle;
    return res;
}

static epx_result_t ll_dispatch(fixture_t *f)
{
    const int L = E / NRANKS;
    epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
    a.x = gpu_tensor(f->x, EPX_DTYPE_BF16, 2, TM, H, 0, f->device);
    a.topk_idx = gpu_tensor(f->topk, EPX_DTYPE_INT32, 2, TM, K, 0, f->device);
    a.stream = f->st;
    epx_ll_dispatch_outputs_t o = EPX_LL_DISPATCH_OUTPUTS_INIT;
    o.recv_x = gpu_tensor(f->rx, EPX_DTYPE_BF16, 3, L, (int64_t)NRANKS * TM, H, f->device);
    o.recv_count = gpu_tensor(f->rc, EPX_DTYPE_INT32, 1, L, 0, 0, f->device);
    return epx_ll_dispatch(f->buf, &a, &o);
}

static int fixture_open(fixture_t *f, const exit_case_t *cs, const epx_unique_id_t *id, int rank)
{
    memset(f, 0, sizeof(*f));
    f->rank = rank;
    if (gpu_test_comm(&cs->gpu, id, rank, NRANKS, TIMEOUT_MS, &f->comm, &f->device)) return 1;
    epx_buffer_config_t bc = epx_test_buffer_config(TM, H, K, E, cs->ll ? EPX_MODE_LL : EPX_MODE_HT);
    bc.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_BF16);
    EXPECT_OK(epx_buffer_create(f->comm, &bc, &f->buf));
    CUDA_OK(cudaStreamCreateWithFlags(&f->st, cudaStreamNonBlocking));
    int32_t topk[TM * K];
    for (int t = 0; t < TM; t++) {
        topk[t * K] = t % E;
        topk[t * K + 1] = (t + 1) % E; /* every rank receives from every rank */
    }
    f->x = gpu_alloc(&f->da, (size_t)TM * H * 2, NULL);
    f->topk = gpu_alloc(&f->da, sizeof(topk), topk);
    f->rx = gpu_alloc(&f->da, (size_t)E * NRANKS * TM * H * 2, NULL);
    f->rc = gpu_alloc(&f->da, (size_t)E * 4, NULL);
    EXPECT_TRUE(f->rc != NULL);
    CUDA_OK(cudaDeviceSynchronize());
    return 0;
}

/* The error in the thread's message names the exited peer. */
static int names_exit(int rank)
{
    char want[32];
    snprintf(want, sizeof(want), "peer %d (pid", NRANKS - 1);
    if (!strstr(epx_last_error_message(), want) || !strstr(epx_last_error_message(), "exited"))
        return ref_fail(rank, "message '%s' does not say that peer %d exited", epx_last_error_message(), NRANKS - 1);
    return 0;
}

static int survive(fixture_t *f, const exit_case_t *cs)
{
    const int rank = f->rank;
    const double t0 = epx_test_now_s();
    epx_result_t res;
    if (cs->ll) {
        EXPECT_OK(ll_dispatch(f)); /* asynchronous: the failure comes through the poller */
        CUDA_OK(cudaStreamSynchronize(f->st));
        res = EPX_SUCCESS;
        while (res == EPX_SUCCESS && epx_test_now_s() - t0 < EXIT_AFTER + 5.0) {
            res = epx_get_async_error(f->comm);
            if (res == EPX_SUCCESS) usleep(1000);
        }
    } else {
        epx_handle_t h = NULL;
        res = ht_dispatch(f, &h);
        if (res == EPX_SUCCESS) epx_handle_destroy(h);
    }
    const double waited = epx_test_now_s() - t0;
    printf("rank %d: %s dispatch: %s after %.3f s: %s\n", rank, cs->ll ? "LL" : "HT", epx_result_name(res), waited,
           epx_last_error_message());
    fflush(stdout);
    EXPECT_RES(res, EPX_ERR_REMOTE);
    if (names_exit(rank)) return 1;
    if (waited > EXIT_AFTER + 1.0)
        return ref_fail(rank, "the exit was noticed %.3f s after it (EPX_TIMEOUT_MS %d)", waited - EXIT_AFTER,
                        TIMEOUT_MS);
    if (cs->ll) {
        int32_t cnt[E];
        CUDA_OK(cudaMemcpy(cnt, f->rc, (size_t)(E / NRANKS) * 4, cudaMemcpyDeviceToHost));
        for (int j = 0; j < E / NRANKS; j++)
            if (cnt[j] != -1) return ref_fail(rank, "LL recv_count[%d] = %d after the exit, expected -1", j, cnt[j]);
    } else {
        EXPECT_RES(epx_get_async_error(f->comm), EPX_ERR_REMOTE);
        if (names_exit(rank)) return 1;
    }
    if (!cs->ll) { /* a later call fails at once as well */
        const double t1 = epx_test_now_s();
        epx_handle_t h = NULL;
        EXPECT_RES(ht_dispatch(f, &h), EPX_ERR_REMOTE);
        EXPECT_TRUE(epx_test_now_s() - t1 < 1.0);
    }
    return 0;
}

static int rank_main(int rank, int nranks, const epx_unique_id_t *id, void *vcase)
{
    const exit_case_t *cs = vcase;
    (void)nranks;
    ref_set_case("%s dispatch, peer %d exits", cs->ll ? "LL" : "HT", NRANKS - 1);
    fixture_t f;
    int rc = fixture_open(&f, cs, id, rank);
    if (rc == 0) EXPECT_OK(epx_comm_barrier(f.comm));
    if (rc == 0 && rank == NRANKS - 1) {
        usleep((useconds_t)(EXIT_AFTER * 1e6));
        _exit(0); /* holding its mappings and its buffer, mid-sequence */
    }
    if (rc == 0) rc = survive(&f, cs);
    const double t0 = epx_test_now_s();
    if (f.buf) EXPECT_OK(epx_buffer_destroy(f.buf));
    gpu_arena_free(&f.da);
    if (f.st) cudaStreamDestroy(f.st);
    if (f.comm) EXPECT_OK(epx_comm_destroy(f.comm));
    EXPECT_TRUE(epx_test_now_s() - t0 < 10.0);
    return rc;
}

int main(void)
{
    gpu_ctx_t gpu;
    if (gpu_test_init(&gpu)) return EPX_TEST_SKIP;
    exit_case_t cases[] = {{NRANKS, 0, gpu}, {NRANKS, 1, gpu}};
    return EPX_TEST_RUN_CASES("peer exit", cases, rank_main, 120, gpu.seed);
}
