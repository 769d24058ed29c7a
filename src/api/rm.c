/*
 * The routing-map entry points: dispatch (with or without permute, with optional static bounds)
 * and its combine.
 */
#include <stdio.h>
#include <string.h>

#include "api/api.h"

#define RM_DTYPES (BIT(BF16) | BIT(FP8_E4M3))

static epx_result_t rm_dispatch_check(epx_buffer_t buffer, const epx_rm_dispatch_args_t *args,
                                      const epx_rm_dispatch_outputs_t *outputs, epx_rm_dispatch_args_t *a,
                                      epx_rm_dispatch_outputs_t *o)
{
    epx_comm_t comm = buffer->comm;
    const epx_buffer_config_t *cfg = &buffer->config;
    const int64_t H = cfg->hidden, K = cfg->num_topk, E = cfg->num_experts, L = buffer->num_local_experts;
    READ_CALL(EPX_MODE_PERMUTE, "epx_rm_dispatch", rm_dispatch);
    if (o->size < EPX_STRUCT_END(epx_rm_dispatch_outputs_t, handle))
        return ARG_ERR("outputs->size = %zu does not reach outputs.handle (%zu bytes needed)", o->size,
                       EPX_STRUCT_END(epx_rm_dispatch_outputs_t, handle));

    EPX_CHECK(epx_api_check_dispatch_dtype(buffer, &a->hidden, "hidden", RM_DTYPES));
    CHECK_TENSOR(&a->hidden, "hidden", RM_DTYPES & cfg->dispatch_dtypes, 2, {EPX_ANY_DIM, H}, "T,H",
                 EPX_TENSOR_TOKENS);
    const int64_t T = a->hidden.shape[0];
    const bool fp8 = a->hidden.dtype == EPX_DTYPE_FP8_E4M3;
    EPX_CHECK(epx_api_check_tokens(buffer, "hidden", T));
    if (fp8)
        CHECK_TENSOR(&a->scaling_factor, "scaling_factor", BIT(FP32), 2, {T, H / 128}, "T,H/128", 0);
    else if (epx_api_present(&a->scaling_factor))
        return ARG_ERR("scaling_factor is given but hidden is %s (scales go with fp8_e4m3 only)",
                       epx_dtype_str(a->hidden.dtype));
    CHECK_TENSOR(&a->routing_map, "routing_map", BIT(BOOL), 2, {T, E}, "T,E", 0);
    CHECK_TENSOR(&a->probs, "probs", BIT(FP32), 2, {T, E}, "T,E", EPX_TENSOR_OPTIONAL);

    /* Bounds may not exceed what the buffer can ever produce (docs/reference.md, pinned). */
    const int64_t cap_plain = (int64_t)comm->nranks * cfg->max_tokens;
    const int64_t cap_permuted = cap_plain * (K < L ? K : L) + L * (cfg->max_pad_multiple - 1);
    if (a->permute && (a->pad_multiple < 1 || a->pad_multiple > cfg->max_pad_multiple))
        return ARG_ERR("args.pad_multiple = %d is out of range [1, %d] (config.max_pad_multiple)",
                       a->pad_multiple, cfg->max_pad_multiple);
    if (a->num_dispatched_tokens < -1 || a->num_dispatched_tokens > cap_plain)
        return ARG_ERR(
            "args.num_dispatched_tokens = %lld is neither -1 nor in [0, %lld] (nranks * max_tokens)",
            (long long)a->num_dispatched_tokens, (long long)cap_plain);
    if (a->num_permuted_tokens < -1 || a->num_permuted_tokens > cap_permuted)
        return ARG_ERR(
            "args.num_permuted_tokens = %lld is neither -1 nor in [0, %lld] (nranks * max_tokens * "
            "min(K, L) + L * (max_pad_multiple - 1))",
            (long long)a->num_permuted_tokens, (long long)cap_permuted);

    const int64_t bound = a->permute ? a->num_permuted_tokens : a->num_dispatched_tokens;
    const int64_t rows = bound > 0 ? bound : 0;
    const char *rows_name = bound >= 0 ? (a->permute ? "num_permuted_tokens" : "num_dispatched_tokens")
                                       : (a->permute ? "P" : "N_r");
    char dims[64];
    snprintf(dims, sizeof(dims), "%s,H", rows_name);
    CHECK_TENSOR(&o->tokens, "outputs.tokens", EPX_DTYPE_BIT(a->hidden.dtype), 2, {rows, H}, dims,
                 EPX_TENSOR_MIN_ROWS | EPX_TENSOR_TOKENS);
    snprintf(dims, sizeof(dims), "%s,H/128", rows_name);
    if (fp8)
        CHECK_TENSOR(&o->scaling_factor, "outputs.scaling_factor", BIT(FP32), 2, {rows, H / 128}, dims,
                     EPX_TENSOR_MIN_ROWS);
    else
        memset(&o->scaling_factor, 0, sizeof(o->scaling_factor)); /* fp8 only: not written */
    if (a->permute) {
        CHECK_TENSOR(&o->probs, "outputs.probs", BIT(FP32), 1, {rows}, rows_name,
                     EPX_TENSOR_MIN_ROWS | EPX_TENSOR_OPTIONAL);
        CHECK_TENSOR(&o->tokens_per_expert, "outputs.tokens_per_expert", BIT(INT32), 1, {L}, "L", 0);
    } else {
        snprintf(dims, sizeof(dims), "%s,L", rows_name);
        CHECK_TENSOR(&o->probs, "outputs.probs", BIT(FP32), 2, {rows, L}, dims,
                     EPX_TENSOR_MIN_ROWS | EPX_TENSOR_OPTIONAL);
        memset(&o->tokens_per_expert, 0, sizeof(o->tokens_per_expert)); /* permute only: not written */
    }
    if (epx_api_present(&o->probs) && !epx_api_present(&a->probs))
        return ARG_ERR("outputs.probs is requested but args.probs is absent");
    CHECK_TENSOR(&o->num_tokens, "outputs.num_tokens", BIT(INT32), 1, {1}, "1", EPX_TENSOR_OPTIONAL);
    EPX_CHECK(epx_api_check_routing_map(comm, &a->routing_map, K, "routing_map"));
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_rm_dispatch(epx_buffer_t buffer, const epx_rm_dispatch_args_t *args,
                                     epx_rm_dispatch_outputs_t *outputs)
{
    uint64_t seq;
    EPX_CHECK(epx_api_collective_begin(buffer, &seq));
    epx_rm_dispatch_args_t a = EPX_RM_DISPATCH_ARGS_INIT;
    epx_rm_dispatch_outputs_t o = EPX_RM_DISPATCH_OUTPUTS_INIT;
    epx_result_t res = rm_dispatch_check(buffer, args, outputs, &a, &o);
    if (res != EPX_SUCCESS) return epx_api_fail_collective(buffer, seq, res);
    epx_handle_t handle =
        epx_api_handle_new(buffer, EPX_HANDLE_RM, a.hidden.shape[0], a.hidden.dtype, a.permute ? 1 : 0);
    if (!handle)
        return epx_api_fail_collective(
            buffer, seq,
            EPX_API_ERR(buffer->comm, EPX_ERR_OUT_OF_MEMORY, "no memory for a routing-map handle"));
    res = buffer->ops->rm_dispatch(buffer, seq, &a, &o, handle);
    if (res != EPX_SUCCESS) {
        epx_api_handle_discard(handle);
        return res;
    }
    atomic_fetch_add(&buffer->live_handles, 1);
    o.handle = handle;
    WRITE_OUT(outputs, &o, epx_rm_dispatch_outputs_t, num_tokens_host);
    WRITE_OUT(outputs, &o, epx_rm_dispatch_outputs_t, handle);
    return EPX_SUCCESS;
}

static epx_result_t rm_combine_check(epx_buffer_t buffer, const epx_rm_combine_args_t *args,
                                     const epx_rm_combine_outputs_t *outputs, epx_rm_combine_args_t *a,
                                     epx_rm_combine_outputs_t *o)
{
    epx_comm_t comm = buffer->comm;
    const int64_t H = buffer->config.hidden;
    READ_CALL(EPX_MODE_PERMUTE, "epx_rm_combine", rm_combine);
    EPX_CHECK(epx_api_check_handle(buffer, a->handle, EPX_HANDLE_RM, "args.handle"));
    const int64_t T = a->handle->num_tokens, N = a->handle->num_recv > 0 ? a->handle->num_recv : 0;
    if (a->weighted && !a->handle->permute)
        return ARG_ERR("args.weighted needs a handle from a dispatch with permute");
    const char *dims = a->handle->permute ? "P,H" : "N_r,H";
    CHECK_TENSOR(&a->x, "x", BIT(BF16), 2, {N, H}, dims, EPX_TENSOR_MIN_ROWS | EPX_TENSOR_TOKENS);
    CHECK_TENSOR(&o->combined, "outputs.combined", BIT(BF16), 2, {T, H}, "T,H",
                 EPX_TENSOR_MIN_ROWS | EPX_TENSOR_TOKENS);
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_rm_combine(epx_buffer_t buffer, const epx_rm_combine_args_t *args,
                                    epx_rm_combine_outputs_t *outputs)
{
    uint64_t seq;
    EPX_CHECK(epx_api_collective_begin(buffer, &seq));
    epx_rm_combine_args_t a = EPX_RM_COMBINE_ARGS_INIT;
    epx_rm_combine_outputs_t o = EPX_RM_COMBINE_OUTPUTS_INIT;
    epx_result_t res = rm_combine_check(buffer, args, outputs, &a, &o);
    if (res != EPX_SUCCESS) return epx_api_fail_collective(buffer, seq, res);
    return buffer->ops->rm_combine(buffer, seq, &a, &o);
}
