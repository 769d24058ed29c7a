/*
 * Hooks only the benchmark links (target epx_bench_hooks, kept out of libepx): the same-bytes
 * ceiling of an HT dispatch and the floor of an LL dispatch or combine, on the cuda backend's
 * internal state.
 */
#include <cuda_runtime.h>
#include <string.h>

#include "bench/bench.h"
#include "bench/bench_kernels.h"
#include "cuda/cuda.h"

epx_result_t epx_cuda_ht_ceiling(epx_buffer_t buffer, epx_handle_t handle, const epx_tensor_t *x,
                                 void *stream)
{
    cuda_buffer_t *cb = buffer->backend_state;
    cuda_handle_t *h = handle ? handle->backend_state : NULL;
    if (!cb || !h || h->kind != EPX_HANDLE_HT)
        return epx_error(EPX_ERR_INVALID_ARG, "ceiling needs a cuda buffer and one of its HT handles");
    if (x->shape[0] != handle->num_tokens)
        return epx_error(EPX_ERR_INVALID_ARG, "ceiling: x has %lld rows, the handle %lld",
                         (long long)x->shape[0], (long long)handle->num_tokens);
    const int64_t row_bytes = buffer->config.hidden * (int64_t)epx_dtype_bytes(x->dtype);
    if ((uint64_t)row_bytes > cb->lay.x_stride) /* the slots are sized for the buffer's dtypes */
        return epx_error(EPX_ERR_INVALID_ARG, "ceiling: rows of %s are %lld bytes, the dispatch slots %llu",
                         epx_dtype_str(x->dtype), (long long)row_bytes, (unsigned long long)cb->lay.x_stride);
    epx_cuda_dispatch_args_t a;
    memset(&a, 0, sizeof(a));
    epx_cuda_fill_common(cb, &a.c);
    a.h = h->dev.ht;
    a.num_tokens = handle->num_tokens;
    a.x = x->data;
    a.row_bytes = row_bytes;
    return epx_cuda_check(epx_cuda_launch_ceiling_copy(&a, stream), "ceiling kernel launch",
                          buffer->comm->rank);
}

epx_result_t epx_cuda_ll_floor(epx_buffer_t buffer, int kind, const epx_ll_dispatch_args_t *dargs,
                               const epx_ll_handle_t *handle, void *stream)
{
    cuda_buffer_t *cb = buffer->backend_state;
    if (!cb || !cb->ll)
        return epx_error(EPX_ERR_INVALID_ARG, "ll floor needs a cuda buffer created with EPX_MODE_LL");
    /* Its stores go through the node's mapped regions: across nodes there are none to go through. */
    if (buffer->comm->num_nodes > 1)
        return epx_error(EPX_ERR_UNSUPPORTED, "ll floor: the ranks span %d nodes; the floor runs within one node",
                         buffer->comm->num_nodes);
    epx_cuda_ll_args_t a;
    int slot = handle ? handle->slot : 0;
    if (slot < 0 || slot > 1) slot = 0;
    epx_cuda_ll_fill(cb, slot, &a);
    a.floor_only = 1;
    if (kind == 0) {
        if (!dargs) return epx_error(EPX_ERR_INVALID_ARG, "ll floor: dispatch arguments are NULL");
        epx_cuda_ll_dispatch_args(dargs, &a);
        return epx_cuda_check(epx_cuda_launch_ll_dispatch_send(&a, stream), "ll floor launch",
                              buffer->comm->rank);
    }
    EPX_CHECK(epx_cuda_ll_check_handle(cb, handle, "ll floor"));
    a.y = epx_cuda_ll_zc_ptr(cb, slot);
    return epx_cuda_check(epx_cuda_launch_ll_combine_send(&a, stream), "ll floor launch", buffer->comm->rank);
}

epx_result_t epx_cuda_ll_stamps_arm(epx_buffer_t buffer, void *stream)
{
    cuda_buffer_t *cb = buffer->backend_state;
    if (!cb || !cb->ll) return epx_error(EPX_ERR_INVALID_ARG, "ll stamps need a cuda buffer with EPX_MODE_LL");
    const int me = buffer->comm->rank;
    static const unsigned long long fresh[2 * EPX_LL_STAMP_KERNELS] = {~0ull, 0, ~0ull, 0, ~0ull, 0, ~0ull, 0};
    if (!cb->ll_stamps)
        EPX_CHECK(epx_cuda_check(cudaMalloc((void **)&cb->ll_stamps, sizeof(fresh)), "cudaMalloc(ll stamps)", me));
    return epx_cuda_check(cudaMemcpyAsync(cb->ll_stamps, fresh, sizeof(fresh), cudaMemcpyHostToDevice,
                                          (cudaStream_t)stream),
                          "ll stamps reset", me);
}

epx_result_t epx_cuda_ll_stamps_read(epx_buffer_t buffer, unsigned long long out[8])
{
    cuda_buffer_t *cb = buffer->backend_state;
    if (!cb || !cb->ll_stamps) return epx_error(EPX_ERR_INVALID_ARG, "ll stamps were not armed on this buffer");
    const int me = buffer->comm->rank;
    unsigned long long *dev = cb->ll_stamps;
    cb->ll_stamps = NULL; /* later calls stamp nothing */
    epx_result_t res = epx_cuda_check(cudaDeviceSynchronize(), "ll stamps: device synchronisation", me);
    if (res == EPX_SUCCESS)
        res = epx_cuda_check(cudaMemcpy(out, dev, 2 * EPX_LL_STAMP_KERNELS * sizeof(*out), cudaMemcpyDeviceToHost),
                             "ll stamps read", me);
    (void)cudaFree(dev);
    for (int k = 0; k < EPX_LL_STAMP_KERNELS && res == EPX_SUCCESS; k++)
        if (out[2 * k] == ~0ull) out[2 * k] = out[2 * k + 1] = 0;
    return res;
}
