/*
 * LL calls: the checks of dispatch and combine over the buffer's two slots, the zero-copy combine
 * buffer, and the receive hooks that complete either half later.
 */
#include <string.h>

#include "api/api.h"

EPX_API_CHECK_FN(ll_dispatch)
{
    buffer->ll_dispatches++; /* before any check: every rank keeps the same LL slot order */
    epx_comm_t comm = buffer->comm;
    const epx_buffer_config_t *cfg = &buffer->config;
    const int64_t H = cfg->hidden, K = cfg->num_topk, L = buffer->num_local_experts;
    const int64_t rows = (int64_t)comm->nranks * cfg->max_tokens;
    READ_CALL(EPX_MODE_LL, "epx_ll_dispatch", ll_dispatch);
    const size_t need = a->return_recv_hook ? EPX_STRUCT_END(epx_ll_dispatch_outputs_t, hook)
                                            : EPX_STRUCT_END(epx_ll_dispatch_outputs_t, handle);
    if (o->size < need)
        return ARG_ERR("outputs->size = %zu does not reach outputs.%s (%zu bytes needed)", o->size,
                       a->return_recv_hook ? "hook" : "handle", need);

    if (a->use_fp8 && H % 128 != 0)
        return ARG_ERR("args.use_fp8 needs hidden %% 128 == 0 (the cast works on 128 channels); hidden = %lld",
                       (long long)H);
    if (a->round_scale && !a->use_fp8) return ARG_ERR("args.round_scale needs args.use_fp8");
    if (a->use_ue8m0 && !a->use_fp8) return ARG_ERR("args.use_ue8m0 needs args.use_fp8");
    if (a->use_ue8m0 && !a->round_scale) return ARG_ERR("args.use_ue8m0 needs args.round_scale");
    if (a->use_ue8m0 && H % 512 != 0)
        return ARG_ERR("args.use_ue8m0 needs hidden %% 512 == 0; hidden = %lld", (long long)H);

    CHECK_TENSOR(&a->x, "x", BIT(BF16), 2, {EPX_ANY_DIM, H}, "T,H", EPX_TENSOR_TOKENS);
    const int64_t T = a->x.shape[0];
    EPX_CHECK(epx_api_check_tokens(buffer, "x", T));
    CHECK_TENSOR(&a->topk_idx, "topk_idx", INDEX_DTYPES, 2, {T, K}, "T,K", 0);
    CHECK_TENSOR(&a->cumulative_recv_stats, "cumulative_recv_stats", BIT(INT32), 1, {L}, "L",
                 EPX_TENSOR_OPTIONAL);

    CHECK_TENSOR(&o->recv_x, "outputs.recv_x", a->use_fp8 ? BIT(FP8_E4M3) : BIT(BF16), 3, {L, rows, H},
                 "L,R*T_max,H", EPX_TENSOR_TOKENS);
    if (a->use_ue8m0)
        CHECK_TENSOR(&o->recv_scales, "outputs.recv_scales", BIT(INT32), 3, {L, H / 512, rows},
                     "L,H/512,R*T_max", 0);
    else if (a->use_fp8)
        CHECK_TENSOR(&o->recv_scales, "outputs.recv_scales", BIT(FP32), 3, {L, H / 128, rows},
                     "L,H/128,R*T_max", 0);
    else
        memset(&o->recv_scales, 0, sizeof(o->recv_scales)); /* fp8 only: not written */
    CHECK_TENSOR(&o->recv_count, "outputs.recv_count", BIT(INT32), 1, {L}, "L", 0);
    CHECK_TENSOR(&o->src_info, "outputs.src_info", BIT(INT32), 2, {L, rows}, "L,R*T_max",
                 EPX_TENSOR_OPTIONAL);
    CHECK_TENSOR(&o->layout_range, "outputs.layout_range", BIT(INT64), 2, {L, comm->nranks}, "L,R",
                 EPX_TENSOR_OPTIONAL);
    EPX_CHECK(epx_api_check_topk_idx(comm, &a->topk_idx, cfg->num_experts, "topk_idx"));
    return EPX_SUCCESS;
}

EPX_API_CHECK_FN(ll_combine)
{
    epx_comm_t comm = buffer->comm;
    const epx_buffer_config_t *cfg = &buffer->config;
    const int64_t H = cfg->hidden, K = cfg->num_topk, L = buffer->num_local_experts;
    const int64_t rows = (int64_t)comm->nranks * cfg->max_tokens;
    READ_CALL(EPX_MODE_LL, "epx_ll_combine", ll_combine);
    if (a->return_recv_hook && o->size < EPX_STRUCT_END(epx_ll_combine_outputs_t, hook))
        return ARG_ERR("outputs->size = %zu does not reach outputs.hook (%zu bytes needed)", o->size,
                       EPX_STRUCT_END(epx_ll_combine_outputs_t, hook));
    EPX_CHECK(epx_api_check_ll_handle(buffer, &a->handle, seq, "args.handle"));
    const int64_t T = a->handle.num_tokens;
    if (a->zero_copy)
        memset(&a->y, 0, sizeof(a->y)); /* read from the library's own region */
    else
        CHECK_TENSOR(&a->y, "y", BIT(BF16), 3, {L, rows, H}, "L,R*T_max,H", EPX_TENSOR_TOKENS);
    CHECK_TENSOR(&a->topk_idx, "topk_idx", INDEX_DTYPES, 2, {T, K}, "T,K", 0);
    CHECK_TENSOR(&a->topk_weights, "topk_weights", BIT(FP32), 2, {T, K}, "T,K", 0);
    CHECK_TENSOR(&o->combined_x, "outputs.combined_x", BIT(BF16), 2, {T, H}, "T,H",
                 EPX_TENSOR_MIN_ROWS | EPX_TENSOR_TOKENS);
    EPX_CHECK(epx_api_check_topk_idx(comm, &a->topk_idx, cfg->num_experts, "topk_idx"));
    return EPX_SUCCESS;
}

static epx_result_t ll_get_combine_buffer(epx_buffer_t buffer, const epx_ll_handle_t *handle,
                                          epx_tensor_t *view_out)
{
    EPX_CHECK(epx_api_check_mode(buffer, EPX_MODE_LL, "epx_ll_get_combine_buffer"));
    epx_comm_t comm = buffer->comm;
    if (!buffer->ops->ll_get_combine_buffer) return epx_api_unsupported(buffer, "epx_ll_get_combine_buffer");
    if (!handle) return ARG_ERR("handle is NULL");
    if (!view_out) return ARG_ERR("view_out is NULL");
    EPX_CHECK(epx_api_check_ll_handle(buffer, handle, buffer->seq + 1, "handle"));
    epx_tensor_t view;
    memset(&view, 0, sizeof(view));
    EPX_CHECK(buffer->ops->ll_get_combine_buffer(buffer, handle, &view));
    *view_out = view;
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_ll_get_combine_buffer(epx_buffer_t buffer, const epx_ll_handle_t *handle,
                                               epx_tensor_t *view_out)
{
    EPX_API_HOLDING_BUFFER(buffer, "epx_ll_get_combine_buffer",
                           ll_get_combine_buffer(buffer, handle, view_out));
}

static epx_result_t hook_run(const epx_hook_t *hook, void *stream)
{
    /* Hooks come only from LL calls: a buffer without LL has none to run (nor the state to run one). */
    EPX_CHECK(epx_api_check_mode(hook->buffer, EPX_MODE_LL, "epx_hook_run"));
    if (!hook->buffer->ops->hook_run) return epx_api_unsupported(hook->buffer, "epx_hook_run");
    epx_result_t res = hook->buffer->ops->hook_run(hook, stream);
    /* The receive half ends the hook's call (a hook the backend refused as stale ends nothing). */
    if (res == EPX_ERR_INVALID_ARG || !hook->buffer->ops->end_call) return res;
    return hook->buffer->ops->end_call(hook->buffer, hook->seq, res);
}

EPX_API epx_result_t epx_hook_run(const epx_hook_t *hook, void *stream)
{
    epx_error_clear();
    if (!hook) return epx_error(EPX_ERR_INVALID_ARG, "hook is NULL");
    if (!hook->buffer) return epx_error(EPX_ERR_INVALID_ARG, "hook->buffer is NULL (not a hook from a call)");
    EPX_API_HOLDING_BUFFER(hook->buffer, "epx_hook_run", hook_run(hook, stream));
}
