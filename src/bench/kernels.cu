/*
 * The benchmark's HT ceiling kernel: the real sender's row writer (kernels/ht.cuh) without its
 * metadata, waits or flags, so the bytes and their stores are exactly the dispatch's. The LL
 * floor stays a flag of the LL send kernels, which it shares the stores of.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "bench/bench_kernels.h"
#include "kernels/ht.cuh"

/* One warp per token (the block's warps stride over the tokens), as in dispatch_send_kernel. */
__global__ void __launch_bounds__(kBlockThreads)
    ceiling_copy_kernel(const __grid_constant__ epx_cuda_dispatch_args_t a)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    ht_send_rows<false, false>(a, nullptr, nullptr, warp, lane);
}

extern "C" int epx_cuda_launch_ceiling_copy(const epx_cuda_dispatch_args_t *args, void *stream)
{
    return launch_kernel(ceiling_copy_kernel, *args, args->c.num_blocks, kBlockThreads, 0, stream);
}
