/*
 * The collective entry points. Every rank makes these calls on a buffer in the same order, so
 * each numbers its call, checks its arguments (api/ht.c, api/ll.c, api/rm.c) and, when a check
 * fails, tells the peers, which then return EPX_ERR_REMOTE instead of waiting; only then does
 * the backend run. Handles and [out] fields are written on success only.
 */
#include <string.h>

#include "api/api.h"

/* Clears the thread's error, checks the buffer and numbers the call. */
static epx_result_t collective_begin(epx_buffer_t buffer, uint64_t *seq_out)
{
    epx_error_clear();
    EPX_CHECK(epx_api_check_buffer(buffer));
    *seq_out = ++buffer->seq;
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_ht_dispatch(epx_buffer_t buffer, const epx_ht_dispatch_args_t *args,
                                     epx_ht_dispatch_outputs_t *outputs)
{
    uint64_t seq;
    EPX_CHECK(collective_begin(buffer, &seq));
    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
    epx_result_t res = epx_api_check_ht_dispatch(buffer, args, outputs, &a, &o);
    if (res != EPX_SUCCESS) return epx_buffer_fail_collective(buffer, seq, res, a.stream);
    epx_handle_t handle = a.cached_handle;
    if (!handle)
        EPX_CHECK(epx_api_handle_new(buffer, seq, EPX_HANDLE_HT, a.x.shape[0], a.x.dtype, 0, a.stream, &handle));
    res = buffer->ops->ht_dispatch(buffer, seq, &a, &o, handle);
    if (!a.cached_handle) res = epx_api_handle_filled(handle, res);
    EPX_CHECK(res);
    if (!a.cached_handle) o.handle = handle;
    if (a.recv_in_buffer) {
        WRITE_OUT(outputs, &o, epx_ht_dispatch_outputs_t, recv_x);
        WRITE_OUT(outputs, &o, epx_ht_dispatch_outputs_t, recv_x_scales);
        WRITE_OUT(outputs, &o, epx_ht_dispatch_outputs_t, recv_topk_idx);
        WRITE_OUT(outputs, &o, epx_ht_dispatch_outputs_t, recv_topk_weights);
    }
    WRITE_OUT(outputs, &o, epx_ht_dispatch_outputs_t, num_recv_tokens_host);
    WRITE_OUT(outputs, &o, epx_ht_dispatch_outputs_t, handle);
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_ht_combine(epx_buffer_t buffer, const epx_ht_combine_args_t *args,
                                    epx_ht_combine_outputs_t *outputs)
{
    uint64_t seq;
    EPX_CHECK(collective_begin(buffer, &seq));
    epx_ht_combine_args_t a = EPX_HT_COMBINE_ARGS_INIT;
    epx_ht_combine_outputs_t o = EPX_HT_COMBINE_OUTPUTS_INIT;
    epx_result_t res = epx_api_check_ht_combine(buffer, args, outputs, &a, &o);
    if (res != EPX_SUCCESS) return epx_buffer_fail_collective(buffer, seq, res, a.stream);
    return buffer->ops->ht_combine(buffer, seq, &a, &o);
}

EPX_API epx_result_t epx_ll_dispatch(epx_buffer_t buffer, const epx_ll_dispatch_args_t *args,
                                     epx_ll_dispatch_outputs_t *outputs)
{
    uint64_t seq;
    EPX_CHECK(collective_begin(buffer, &seq));
    buffer->ll_dispatches++; /* failed calls too: every rank keeps the same LL slot order */
    epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
    epx_ll_dispatch_outputs_t o = EPX_LL_DISPATCH_OUTPUTS_INIT;
    epx_result_t res = epx_api_check_ll_dispatch(buffer, args, outputs, &a, &o);
    if (res != EPX_SUCCESS) return epx_buffer_fail_collective(buffer, seq, res, a.stream);
    EPX_CHECK(buffer->ops->ll_dispatch(buffer, seq, &a, &o));
    WRITE_OUT(outputs, &o, epx_ll_dispatch_outputs_t, handle);
    if (a.return_recv_hook) WRITE_OUT(outputs, &o, epx_ll_dispatch_outputs_t, hook);
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_ll_combine(epx_buffer_t buffer, const epx_ll_combine_args_t *args,
                                    epx_ll_combine_outputs_t *outputs)
{
    uint64_t seq;
    EPX_CHECK(collective_begin(buffer, &seq));
    epx_ll_combine_args_t a = EPX_LL_COMBINE_ARGS_INIT;
    epx_ll_combine_outputs_t o = EPX_LL_COMBINE_OUTPUTS_INIT;
    epx_result_t res = epx_api_check_ll_combine(buffer, seq, args, outputs, &a, &o);
    if (res != EPX_SUCCESS) return epx_buffer_fail_collective(buffer, seq, res, a.stream);
    EPX_CHECK(buffer->ops->ll_combine(buffer, seq, &a, &o));
    if (a.return_recv_hook) WRITE_OUT(outputs, &o, epx_ll_combine_outputs_t, hook);
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_rm_dispatch(epx_buffer_t buffer, const epx_rm_dispatch_args_t *args,
                                     epx_rm_dispatch_outputs_t *outputs)
{
    uint64_t seq;
    EPX_CHECK(collective_begin(buffer, &seq));
    epx_rm_dispatch_args_t a = EPX_RM_DISPATCH_ARGS_INIT;
    epx_rm_dispatch_outputs_t o = EPX_RM_DISPATCH_OUTPUTS_INIT;
    epx_result_t res = epx_api_check_rm_dispatch(buffer, args, outputs, &a, &o);
    if (res != EPX_SUCCESS) return epx_buffer_fail_collective(buffer, seq, res, a.stream);
    epx_handle_t handle;
    EPX_CHECK(epx_api_handle_new(buffer, seq, EPX_HANDLE_RM, a.hidden.shape[0], a.hidden.dtype,
                                 a.permute ? 1 : 0, a.stream, &handle));
    EPX_CHECK(epx_api_handle_filled(handle, buffer->ops->rm_dispatch(buffer, seq, &a, &o, handle)));
    o.handle = handle;
    WRITE_OUT(outputs, &o, epx_rm_dispatch_outputs_t, num_tokens_host);
    WRITE_OUT(outputs, &o, epx_rm_dispatch_outputs_t, handle);
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_rm_combine(epx_buffer_t buffer, const epx_rm_combine_args_t *args,
                                    epx_rm_combine_outputs_t *outputs)
{
    uint64_t seq;
    EPX_CHECK(collective_begin(buffer, &seq));
    epx_rm_combine_args_t a = EPX_RM_COMBINE_ARGS_INIT;
    epx_rm_combine_outputs_t o = EPX_RM_COMBINE_OUTPUTS_INIT;
    epx_result_t res = epx_api_check_rm_combine(buffer, args, outputs, &a, &o);
    if (res != EPX_SUCCESS) return epx_buffer_fail_collective(buffer, seq, res, a.stream);
    return buffer->ops->rm_combine(buffer, seq, &a, &o);
}
