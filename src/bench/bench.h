/*
 * Hooks only the benchmark links (target epx_bench_hooks, src/bench/bench.c; never part of libepx):
 * the same-run ceiling and floor kernels that measure what the same traffic costs with no protocol.
 */
#ifndef EPX_BENCH_BENCH_H
#define EPX_BENCH_BENCH_H

#include "epx/epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Same-bytes ceiling for the benchmark: copies the rows a dispatch with `handle`'s routing
 * would move (x [T, H] in device memory, any dispatch dtype) into the same peers' slots through
 * the same mappings with plain stores, no synchronisation. Not collective by itself: the
 * caller brackets it with barriers and must not overlap it with dispatches on this buffer. */
epx_result_t epx_cuda_ht_ceiling(epx_buffer_t buffer, epx_handle_t handle, const epx_tensor_t *x, void *stream);

/* Benchmark floor: the stores of an LL dispatch (kind 0) or combine (kind 1) of the last handle's
 * routing, to the same peers' areas, with no wait, flag or epoch. Not collective. */
epx_result_t epx_cuda_ll_floor(epx_buffer_t buffer, int kind, const epx_ll_dispatch_args_t *dargs,
                               const epx_ll_handle_t *handle, void *stream);

/* The LL timeline: arm makes (once) and resets the buffer's stamp area on `stream`; from then on
 * every LL kernel of the buffer stamps its first block's start and its last warp's end (%globaltimer
 * ns, one clock for all ranks of a GPU). read waits for the device, copies the EPX_LL_STAMP_KERNELS
 * pairs into out[2k], out[2k + 1] (start, end; 0 where the kernel did not run) and turns the stamps
 * off. Not collective. */
epx_result_t epx_cuda_ll_stamps_arm(epx_buffer_t buffer, void *stream);
epx_result_t epx_cuda_ll_stamps_read(epx_buffer_t buffer, unsigned long long out[8]);

#ifdef __cplusplus
}
#endif

#endif /* EPX_BENCH_BENCH_H */
