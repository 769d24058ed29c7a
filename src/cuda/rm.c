/*
 * cuda backend routing-map dispatch (with or without fused permute) and its combine: the
 * region areas they add, launches, the host wait when no upper bound is given (refused under
 * stream capture) and error reporting. Kernels: src/kernels (routing map).
 */
#include <cuda_runtime.h>
#include <string.h>

#include "cuda/cuda.h"

static uint64_t rm_align(uint64_t v)
{
    return (v + 255) / 256 * 256;
}

uint64_t epx_cuda_rm_layout(epx_buffer_t b, epx_cuda_layout_t *lay, uint64_t off)
{
    if (!(b->config.modes & EPX_MODE_PERMUTE)) return off;
    const uint64_t R = (uint64_t)b->comm->nranks, T = (uint64_t)b->config.max_tokens;
    const uint64_t H = (uint64_t)b->config.hidden, K = (uint64_t)b->config.num_topk;
    const uint64_t L = (uint64_t)b->num_local_experts, E = (uint64_t)b->config.num_experts;
    lay->rm_within = off;
    off = rm_align(off + R * T * K * 4);
    lay->rm_cnt = off;
    off = rm_align(off + R * L * 4);
    /* Unpermute rows are [token][k]; the HT combine area [R][T_max] holds them when K <= R. */
    if (K <= R) {
        lay->rm_comb = lay->comb_x;
    } else {
        lay->rm_comb = off;
        off = rm_align(off + T * K * H * 2);
    }
    lay->rm_scratch = off;
    off = rm_align(off + ((T + 31) / 32 + 1) * (E + R) * 4);
    return off;
}

/* One rank alone has no peer kernels to stay co-resident with and nothing to overlap the
 * permute with: unless num_sms was asked for, its kernels take the whole GPU (as a framework's
 * gather would) instead of the communication share. */
static epx_result_t rm_grid(cuda_buffer_t *cb, epx_cuda_common_t *c)
{
    epx_buffer_t b = cb->buffer;
    if (b->comm->nranks != 1 || b->config.num_sms > 0) return EPX_SUCCESS;
    int sms = 0;
    EPX_CHECK(epx_cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, cb->device),
                             "cudaDeviceGetAttribute", b->comm->rank));
    if (sms > c->num_blocks) c->num_blocks = sms;
    return EPX_SUCCESS;
}

/* The arguments both routing-map kernels share; a failure is refused. */
static epx_result_t rm_args(const epx_cuda_op_t *op, const cuda_handle_t *h, int64_t num_tokens,
                            epx_cuda_rm_args_t *a)
{
    memset(a, 0, sizeof(*a));
    epx_cuda_fill_common(op->cb, &a->c);
    epx_result_t res = rm_grid(op->cb, &a->c);
    if (res != EPX_SUCCESS) return epx_cuda_op_refuse(op, res);
    a->h = h->dev.rm;
    a->num_tokens = num_tokens;
    a->num_experts = op->cb->buffer->config.num_experts;
    return EPX_SUCCESS;
}

static int64_t rm_rows(const epx_tensor_t *t, int64_t cap)
{
    return t->data && t->shape[0] < cap ? t->shape[0] : cap;
}

epx_result_t epx_cuda_rm_dispatch(epx_buffer_t buffer, uint64_t seq, const epx_rm_dispatch_args_t *args,
                                  epx_rm_dispatch_outputs_t *outputs, epx_handle_t handle)
{
    cuda_buffer_t *cb = buffer->backend_state;
    const int me = buffer->comm->rank;
    const int permute = args->permute != 0;
    const int64_t bound = permute ? args->num_permuted_tokens : args->num_dispatched_tokens;
    const int bounded = bound >= 0;
    const char *bound_name = permute ? "num_permuted_tokens" : "num_dispatched_tokens";
    epx_cuda_op_t op;
    EPX_CHECK(epx_cuda_op_begin(&op, buffer, seq, args->stream));
    if (!bounded && op.capturing)
        return epx_error(EPX_ERR_GRAPH_CAPTURE,
                         "rank %d: epx_rm_dispatch%s without args.%s waits on the host for the row count, "
                         "which stream capture forbids; pass args.%s (an upper bound) to capture it",
                         me, permute ? " with permute" : "", bound_name, bound_name);
    if (!(buffer->config.modes & EPX_MODE_PERMUTE) || cb->lay.rm_scratch == 0)
        return epx_cuda_op_refuse(
            &op, epx_error(EPX_ERR_INTERNAL, "rank %d: the buffer's region has no routing-map areas", me));
    cuda_handle_t *h = NULL;
    epx_result_t res = epx_cuda_handle_get(cb, EPX_HANDLE_RM, op.capturing, &h);
    if (res != EPX_SUCCESS) return epx_cuda_op_refuse(&op, res);
    h->no_host_wait = bounded;
    h->has_probs = args->probs.data != NULL;
    h->seq = seq;
    handle->backend_state = h; /* freed through handle_free if this call fails */

    const int64_t H = buffer->config.hidden;
    const int fp8 = args->hidden.dtype == EPX_DTYPE_FP8_E4M3;
    epx_cuda_rm_args_t a;
    EPX_CHECK(rm_args(&op, h, args->hidden.shape[0], &a));
    a.permute = permute;
    a.pad_multiple = permute && args->pad_multiple > 1 ? args->pad_multiple : 1;
    a.c.call_sig = epx_cuda_sig(EPX_CUDA_CALL_RM_DISPATCH, args->hidden.dtype,
                                (permute ? EPX_CUDA_SIG_PERMUTE : 0) | (h->has_probs ? EPX_CUDA_SIG_PROBS : 0), 0);
    a.hidden = args->hidden.data;
    a.row_bytes = H * (int64_t)epx_dtype_bytes(args->hidden.dtype);
    if (fp8) {
        a.scales = args->scaling_factor.data;
        a.num_scales = (int32_t)(H / 128);
        a.out_scales = outputs->scaling_factor.data;
    }
    a.routing_map = args->routing_map.data;
    a.probs = args->probs.data;
    a.tokens = outputs->tokens.data;
    a.out_probs = outputs->probs.data;
    a.tokens_per_expert = permute ? outputs->tokens_per_expert.data : NULL;
    a.num_tokens_out = outputs->num_tokens.data;
    a.local_map = outputs->local_map.data;
    a.local_map_rows = a.local_map ? outputs->local_map.shape[0] : 0;
    int64_t cap = outputs->tokens.shape[0];
    if (a.out_scales) cap = rm_rows(&outputs->scaling_factor, cap);
    cap = rm_rows(&outputs->probs, cap);
    a.limit = bounded ? bound : cap;
    a.bounded = bounded;
    if (!bounded) ((volatile epx_cuda_host_block_t *)cb->host)->num_recv = -1;
    EPX_CHECK(epx_cuda_op_launched(&op, epx_cuda_launch_rm_dispatch(&a, args->stream),
                                   "routing-map dispatch launch"));
    EPX_TRACE(EPX_SUBSYS_PERMUTE, "rank %d: routing-map dispatch seq %llu epoch %llu T %lld%s bound %lld", me,
              (unsigned long long)seq, (unsigned long long)op.epoch, (long long)a.num_tokens,
              permute ? " permute" : "", (long long)bound);
    if (bounded) {
        /* The bound decides the shape; the real count goes to the num_tokens tensor. */
        outputs->num_tokens_host = bound;
        handle->num_recv = bound;
        return EPX_SUCCESS;
    }
    EPX_CHECK(epx_cuda_op_wait(&op, "epx_rm_dispatch"));
    const int64_t n = ((volatile epx_cuda_host_block_t *)cb->host)->num_recv;
    if (n < 0)
        return epx_error(EPX_ERR_INTERNAL,
                         "rank %d: routing-map dispatch epoch %llu finished without a row count", me,
                         (unsigned long long)op.epoch);
    if (n > cap)
        return epx_error(
            EPX_ERR_INVALID_ARG,
            "rank %d: routing-map dispatch receives %lld rows (%s), the outputs hold %lld; nothing "
            "was written and the peers' calls fail with EPX_ERR_REMOTE",
            me, (long long)n, permute ? "P" : "N_r", (long long)cap);
    outputs->num_tokens_host = n;
    handle->num_recv = n;
    return EPX_SUCCESS;
}

epx_result_t epx_cuda_rm_combine(epx_buffer_t buffer, uint64_t seq, const epx_rm_combine_args_t *args,
                                 epx_rm_combine_outputs_t *outputs)
{
    const int me = buffer->comm->rank;
    epx_handle_t handle = args->handle;
    cuda_handle_t *h = handle->backend_state;
    epx_cuda_op_t op;
    EPX_CHECK(epx_cuda_op_begin(&op, buffer, seq, args->stream));
    epx_result_t res = EPX_SUCCESS;
    if (!h)
        res =
            epx_error(EPX_ERR_INVALID_ARG, "rank %d: routing-map combine: the handle holds no dispatch", me);
    else if (handle->permute && args->weighted && !h->has_probs)
        res = epx_error(EPX_ERR_INVALID_ARG, "rank %d: weighted routing-map combine needs probs at dispatch",
                        me);
    if (res != EPX_SUCCESS) return epx_cuda_op_refuse(&op, res);
    epx_cuda_rm_args_t a;
    EPX_CHECK(rm_args(&op, h, handle->num_tokens, &a));
    a.permute = handle->permute;
    a.x = args->x.data;
    a.combined = outputs->combined.data;
    a.weighted = handle->permute && args->weighted;
    a.c.call_sig = epx_cuda_sig(EPX_CUDA_CALL_RM_COMBINE, 0, 0, h->seq);
    EPX_CHECK(epx_cuda_op_launched(&op, epx_cuda_launch_rm_combine(&a, args->stream),
                                   "routing-map combine launch"));
    EPX_TRACE(EPX_SUBSYS_PERMUTE, "rank %d: routing-map combine seq %llu epoch %llu%s", me,
              (unsigned long long)seq, (unsigned long long)op.epoch, a.weighted ? " weighted" : "");
    /* Bounded (capturable) handles report device errors through the poller, like captured calls. */
    if (h->no_host_wait || op.capturing) return EPX_SUCCESS;
    return epx_cuda_op_wait(&op, "epx_rm_combine");
}
