/*
 * Routing-map calls: the checks of dispatch (with or without permute, with optional static
 * bounds) and of its combine.
 */
#include <stdio.h>
#include <string.h>

#include "api/api.h"

#define RM_DTYPES (BIT(BF16) | BIT(FP8_E4M3))

EPX_API_CHECK_FN(rm_dispatch)
{
    epx_comm_t comm = buffer->comm;
    const epx_buffer_config_t *cfg = &buffer->config;
    const int64_t H = cfg->hidden, K = cfg->num_topk, E = cfg->num_experts, L = buffer->num_local_experts;
    READ_CALL(EPX_MODE_PERMUTE, "epx_rm_dispatch", rm_dispatch);
    if (o->size < EPX_STRUCT_END(epx_rm_dispatch_outputs_t, handle))
        return ARG_ERR("outputs->size = %zu does not reach outputs.handle (%zu bytes needed)", o->size,
                       EPX_STRUCT_END(epx_rm_dispatch_outputs_t, handle));

    EPX_CHECK(epx_api_check_dispatch_x(buffer, &a->hidden, "hidden", RM_DTYPES));
    const int64_t T = a->hidden.shape[0];
    EPX_CHECK(epx_api_check_x_scales(buffer, &a->hidden, "hidden", &a->scaling_factor, "scaling_factor"));
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
    EPX_CHECK(epx_api_check_recv_rows(comm, &o->tokens, "outputs.tokens", &o->scaling_factor,
                                      "outputs.scaling_factor", a->hidden.dtype, rows, rows_name, H));
    if (a->permute) {
        CHECK_TENSOR(&o->probs, "outputs.probs", BIT(FP32), 1, {rows}, rows_name,
                     EPX_TENSOR_MIN_ROWS | EPX_TENSOR_OPTIONAL);
        CHECK_TENSOR(&o->tokens_per_expert, "outputs.tokens_per_expert", BIT(INT32), 1, {L}, "L", 0);
    } else {
        char dims[64];
        snprintf(dims, sizeof(dims), "%s,L", rows_name);
        CHECK_TENSOR(&o->probs, "outputs.probs", BIT(FP32), 2, {rows, L}, dims,
                     EPX_TENSOR_MIN_ROWS | EPX_TENSOR_OPTIONAL);
        memset(&o->tokens_per_expert, 0, sizeof(o->tokens_per_expert)); /* permute only: not written */
    }
    if (epx_api_present(&o->probs) && !epx_api_present(&a->probs))
        return ARG_ERR("outputs.probs is requested but args.probs is absent");
    CHECK_TENSOR(&o->num_tokens, "outputs.num_tokens", BIT(INT32), 1, {1}, "1", EPX_TENSOR_OPTIONAL);
    /* Callers built before local_map existed pass a shorter struct: read over zeros, it is absent. */
    CHECK_TENSOR(&o->local_map, "outputs.local_map", BIT(BOOL), 2, {cap_plain, L}, "R*T_max,L",
                 EPX_TENSOR_MIN_ROWS | EPX_TENSOR_OPTIONAL);
    EPX_CHECK(epx_api_check_routing_map(comm, &a->routing_map, K, "routing_map"));
    return EPX_SUCCESS;
}

EPX_API_CHECK_FN(rm_combine)
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
