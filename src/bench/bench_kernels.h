/*
 * Kernels only the benchmark links (target epx_bench_hooks): the same-bytes ceiling of an HT
 * dispatch. Declared here rather than in the host-kernel contract, which libepx implements.
 */
#ifndef EPX_BENCH_BENCH_KERNELS_H
#define EPX_BENCH_BENCH_KERNELS_H

#include "kernels/contract.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Same-bytes ceiling: every row the dispatch with `args` would move, copied with plain 16-byte
 * stores from the `x` rows to the peers' dispatch areas through the same mappings, no metadata,
 * no flags. Enqueues on `stream`; returns a cudaError_t value (0 = success). */
int epx_cuda_launch_ceiling_copy(const epx_cuda_dispatch_args_t *args, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* EPX_BENCH_BENCH_KERNELS_H */
