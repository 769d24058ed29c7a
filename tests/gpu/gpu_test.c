/* What the GPU tests share (see gpu_test.h). */
#include "gpu_test.h"

#include <stdio.h>
#include <stdlib.h>

int gpu_test_init(gpu_ctx_t *ctx)
{
    ctx->ngpu = epx_harness_gpu_count();
    if (ctx->ngpu <= 0) {
        printf("no usable GPU: skipped\n");
        return EPX_TEST_SKIP;
    }
    const char *quick = getenv("EPX_GPU_TEST_QUICK");
    ctx->quick = quick && atoi(quick) != 0;
    ctx->seed = epx_test_seed();
    return 0;
}

typedef struct each {
    epx_test_rank_fn fn;
    gpu_ctx_t *ctx;
} each_t;

static int run_each(int nranks, void *arg)
{
    const each_t *e = arg;
    return epx_test_run_ranks(nranks, e->fn, e->ctx, 500);
}

int gpu_test_each_nranks(const char *name, const char *default_ranks, epx_test_rank_fn fn, gpu_ctx_t *ctx)
{
    each_t e = {fn, ctx};
    return epx_harness_each_nranks(name, "EPX_GPU_TEST_RANKS", default_ranks, REF_MAX_RANKS, run_each, &e);
}

int gpu_test_comm(const gpu_ctx_t *ctx, const epx_unique_id_t *id, int rank, int nranks, int timeout_ms,
                  epx_comm_t *comm_out, int *device_out)
{
    ref_set_seed(ctx->seed);
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    cfg.backend = EPX_BACKEND_CUDA;
    cfg.cuda_device = epx_harness_rank_device(rank, ctx->ngpu);
    if (timeout_ms > 0) cfg.timeout_ms = timeout_ms;
    *device_out = cfg.cuda_device;
    epx_result_t res = epx_comm_init(id, rank, nranks, &cfg, comm_out);
    if (res != EPX_SUCCESS)
        return ref_fail(rank, "epx_comm_init: %s (%s)", epx_result_name(res), epx_last_error_message());
    return 0;
}

epx_tensor_t gpu_tensor(void *data, epx_dtype_t dtype, int ndim, int64_t d0, int64_t d1, int64_t d2,
                        int device)
{
    epx_tensor_t t = ndim == 1   ? epx_tensor_1d(data, dtype, d0)
                     : ndim == 2 ? epx_tensor_2d(data, dtype, d0, d1)
                                 : epx_tensor_3d(data, dtype, d0, d1, d2);
    t.device_type = EPX_DEVICE_CUDA;
    t.device_id = device;
    return t;
}

void *gpu_alloc(gpu_arena_t *a, size_t bytes, const void *init)
{
    void *p = NULL;
    const size_t n = bytes < 16 ? 16 : bytes;
    if (a->n == (int)(sizeof(a->p) / sizeof(a->p[0])) || cudaMalloc(&p, n) != cudaSuccess) return NULL;
    a->p[a->n++] = p;
    cudaMemset(p, 0xa5, n);
    if (init && bytes) cudaMemcpy(p, init, bytes, cudaMemcpyHostToDevice);
    if (cudaDeviceSynchronize() != cudaSuccess) return NULL; /* the fill and copy land before use */
    return p;
}

int gpu_h2d(void *dst, const void *src, size_t bytes)
{
    if (!bytes) return 0;
    if (cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice) != cudaSuccess) return 1;
    return cudaDeviceSynchronize() != cudaSuccess;
}

void gpu_arena_free(gpu_arena_t *a)
{
    for (int i = 0; i < a->n; i++) cudaFree(a->p[i]);
    a->n = 0;
}
