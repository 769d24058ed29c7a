/*
 * What the GPU tests share: their main (GPU probe in a child, skip code, seed, EPX_GPU_TEST_QUICK,
 * the EPX_GPU_TEST_RANKS loop), a communicator on the rank's GPU, device tensors and device
 * allocations that are freed together.
 */
#ifndef EPX_GPU_TEST_H
#define EPX_GPU_TEST_H

#include <cuda_runtime.h>

#include "epx_test.h"
#include "reference.h"

/* In a function returning int with `rank` in scope: a failed CUDA call reports and returns 1. */
#define CUDA_OK(call)                                                                          \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) return ref_fail(rank, "%s: %s", #call, cudaGetErrorString(e_)); \
    } while (0)

/* Every GPU test's context; a test with more puts this first in its own struct. */
typedef struct gpu_ctx {
    uint64_t seed;
    int quick; /* EPX_GPU_TEST_QUICK=1: sanitizer runs shrink the cases */
    int ngpu;  /* GPUs present; rank r runs on GPU r % ngpu */
} gpu_ctx_t;

/* Probes the GPUs without initialising CUDA in this process and fills ctx. Returns 0, or
 * EPX_TEST_SKIP (after saying so) when there is none. */
int gpu_test_init(gpu_ctx_t *ctx);

/* Runs fn(rank, R, id, ctx) on R ranks for each R of EPX_GPU_TEST_RANKS (default default_ranks),
 * at most 500 s each, stopping at the first failure. Returns 0 when every run passed. */
int gpu_test_each_nranks(const char *name, const char *default_ranks, epx_test_rank_fn fn, gpu_ctx_t *ctx);

/* A cuda-backend communicator on this rank's GPU (*device_out); timeout_ms 0 keeps the default.
 * Sets the seed printed with failures. Returns 0, or 1 after reporting. */
int gpu_test_comm(const gpu_ctx_t *ctx, const epx_unique_id_t *id, int rank, int nranks, int timeout_ms,
                  epx_comm_t *comm_out, int *device_out);

/* A tensor of ndim (1-3) dimensions d0, d1, d2 in the memory of GPU `device`. */
epx_tensor_t gpu_tensor(void *data, epx_dtype_t dtype, int ndim, int64_t d0, int64_t d1, int64_t d2,
                        int device);

/* Device allocations of one case, freed together. */
typedef struct gpu_arena {
    void *p[48];
    int n;
} gpu_arena_t;

/* `bytes` (at least 16) of device memory filled with 0xa5, so unwritten output shows, then with a
 * copy of `init` when given. NULL when out of memory or of slots. */
void *gpu_alloc(gpu_arena_t *a, size_t bytes, const void *init);
/* Host-to-device copy that has landed when it returns: a plain cudaMemcpy from pageable memory may
 * return before its DMA completes, and a cudaStreamNonBlocking stream (graph replays, the library's
 * calls on the tests' own streams) does not wait for the legacy stream. Returns 0 on success. */
int gpu_h2d(void *dst, const void *src, size_t bytes);
void gpu_arena_free(gpu_arena_t *a);

#endif
