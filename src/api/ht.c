/*
 * The HT entry points: dispatch layout, dispatch (routed or cached, caller's outputs or views of
 * the buffer), combine and the combine input view. Each checks every argument it can against the
 * buffer before the backend runs; a collective call that fails its checks tells the peers.
 */
#include <stdio.h>
#include <string.h>

#include "api/api.h"

EPX_API epx_result_t epx_get_dispatch_layout(epx_buffer_t buffer, const epx_tensor_t *topk_idx,
                                             epx_layout_outputs_t *outputs, void *stream)
{
    epx_error_clear();
    EPX_CHECK(epx_api_check_buffer(buffer));
    epx_comm_t comm = buffer->comm;
    const epx_buffer_config_t *cfg = &buffer->config;
    EPX_CHECK(epx_api_check_mode(buffer, EPX_MODE_HT, "epx_get_dispatch_layout"));
    if (!buffer->ops->layout) return epx_api_unsupported(buffer, "epx_get_dispatch_layout");
    if (!topk_idx) return ARG_ERR("topk_idx is NULL");
    epx_layout_outputs_t o = {.size = sizeof(o), .version = EPX_VERSION_CODE};
    EPX_CHECK(epx_api_read_struct(comm, &o, sizeof(o), outputs, "outputs"));

    CHECK_TENSOR(topk_idx, "topk_idx", INDEX_DTYPES, 2, {EPX_ANY_DIM, cfg->num_topk}, "T,K", 0);
    int64_t T = topk_idx->shape[0];
    EPX_CHECK(epx_api_check_tokens(buffer, "topk_idx", T));
    CHECK_TENSOR(&o.num_tokens_per_rank, "outputs.num_tokens_per_rank", BIT(INT32), 1, {comm->nranks}, "R",
                 0);
    CHECK_TENSOR(&o.num_tokens_per_expert, "outputs.num_tokens_per_expert", BIT(INT32), 1, {cfg->num_experts},
                 "E", 0);
    CHECK_TENSOR(&o.is_token_in_rank, "outputs.is_token_in_rank", BIT(BOOL), 2, {T, comm->nranks}, "T,R",
                 EPX_TENSOR_MIN_ROWS);
    CHECK_TENSOR(&o.num_tokens_per_domain, "outputs.num_tokens_per_domain", BIT(INT32), 1,
                 {comm->num_domains}, "R/D", EPX_TENSOR_OPTIONAL);
    EPX_CHECK(epx_api_check_topk_idx(comm, topk_idx, cfg->num_experts, "topk_idx"));
    return buffer->ops->layout(buffer, topk_idx, &o, stream);
}

/* ----------------------------------------------------------------------------------- HT ---- */

static epx_result_t ht_dispatch_check(epx_buffer_t buffer, const epx_ht_dispatch_args_t *args,
                                      const epx_ht_dispatch_outputs_t *outputs, epx_ht_dispatch_args_t *a,
                                      epx_ht_dispatch_outputs_t *o)
{
    epx_comm_t comm = buffer->comm;
    const epx_buffer_config_t *cfg = &buffer->config;
    const int64_t H = cfg->hidden, K = cfg->num_topk, L = buffer->num_local_experts;
    READ_CALL(EPX_MODE_HT, "epx_ht_dispatch", ht_dispatch);
    epx_handle_t cached = a->cached_handle;
    if (cached)
        EPX_CHECK(epx_api_check_handle(buffer, cached, EPX_HANDLE_HT, "args.cached_handle"));
    else if (o->size < EPX_STRUCT_END(epx_ht_dispatch_outputs_t, handle))
        return ARG_ERR("outputs->size = %zu does not reach outputs.handle (%zu bytes needed)", o->size,
                       EPX_STRUCT_END(epx_ht_dispatch_outputs_t, handle));

    EPX_CHECK(epx_api_check_dispatch_dtype(buffer, &a->x, "x", EPX_API_DISPATCH_DTYPES));
    CHECK_TENSOR(&a->x, "x", EPX_API_DISPATCH_DTYPES & cfg->dispatch_dtypes, 2, {EPX_ANY_DIM, H}, "T,H",
                 EPX_TENSOR_TOKENS);
    const int64_t T = a->x.shape[0];
    const bool fp8 = a->x.dtype == EPX_DTYPE_FP8_E4M3;
    EPX_CHECK(epx_api_check_tokens(buffer, "x", T));
    if (cached && T != cached->num_tokens)
        return ARG_ERR("x has %lld tokens but args.cached_handle was dispatched with %lld", (long long)T,
                       (long long)cached->num_tokens);
    if (fp8)
        CHECK_TENSOR(&a->x_scales, "x_scales", BIT(FP32), 2, {T, H / 128}, "T,H/128", 0);
    else if (epx_api_present(&a->x_scales))
        return ARG_ERR("x_scales is given but x is %s (scales go with fp8_e4m3 only)",
                       epx_dtype_str(a->x.dtype));
    if (a->expert_alignment == 0) a->expert_alignment = 1;
    if (a->expert_alignment < 0)
        return ARG_ERR("args.expert_alignment = %d must be >= 1", a->expert_alignment);
    if (a->num_worst_tokens < 0)
        return ARG_ERR("args.num_worst_tokens = %lld must be >= 0 (0: not static)",
                       (long long)a->num_worst_tokens);
    if (cached) {
        memset(&a->topk_idx, 0, sizeof(a->topk_idx));
        memset(&a->topk_weights, 0, sizeof(a->topk_weights));
    } else {
        CHECK_TENSOR(&a->topk_idx, "topk_idx", INDEX_DTYPES, 2, {T, K}, "T,K", 0);
        CHECK_TENSOR(&a->topk_weights, "topk_weights", BIT(FP32), 2, {T, K}, "T,K", EPX_TENSOR_OPTIONAL);
    }

    if (a->recv_in_buffer) {
        /* View mode: the library sets these four to views of its buffer. */
        const epx_tensor_t *views[] = {&o->recv_x, &o->recv_x_scales, &o->recv_topk_idx,
                                       &o->recv_topk_weights};
        const char *names[] = {"recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights"};
        for (int i = 0; i < 4; i++)
            if (views[i]->data)
                return ARG_ERR("outputs.%s.data = %p must be NULL with args.recv_in_buffer (the library "
                               "sets it to a view of its buffer)",
                               names[i], views[i]->data);
        const int64_t cap = (int64_t)comm->nranks * cfg->max_tokens;
        if (a->num_worst_tokens > cap)
            return ARG_ERR("args.num_worst_tokens = %lld is above the %lld rows (R * max_tokens) the buffer "
                           "holds for args.recv_in_buffer",
                           (long long)a->num_worst_tokens, (long long)cap);
        if (!cached) {
            CHECK_TENSOR(&o->num_recv_tokens_per_expert, "outputs.num_recv_tokens_per_expert", BIT(INT32), 1,
                         {L}, "L", EPX_TENSOR_OPTIONAL);
            CHECK_TENSOR(&o->num_recv_tokens, "outputs.num_recv_tokens", BIT(INT32), 1, {1}, "1",
                         EPX_TENSOR_OPTIONAL);
            EPX_CHECK(epx_api_check_topk_idx(comm, &a->topk_idx, cfg->num_experts, "topk_idx"));
        } else {
            memset(&o->num_recv_tokens_per_expert, 0, sizeof(o->num_recv_tokens_per_expert));
            memset(&o->num_recv_tokens, 0, sizeof(o->num_recv_tokens));
        }
        return EPX_SUCCESS;
    }

    /* Rows the outputs need when that is known before communicating. */
    const bool is_static = a->num_worst_tokens > 0;
    const int64_t rows =
        is_static ? a->num_worst_tokens : (cached && cached->num_recv > 0 ? cached->num_recv : 0);
    const char *rows_name = is_static ? "num_worst_tokens" : "N_r";
    char dims[64];
    snprintf(dims, sizeof(dims), "%s,H", rows_name);
    CHECK_TENSOR(&o->recv_x, "outputs.recv_x", EPX_DTYPE_BIT(a->x.dtype), 2, {rows, H}, dims,
                 EPX_TENSOR_MIN_ROWS | EPX_TENSOR_TOKENS);
    snprintf(dims, sizeof(dims), "%s,H/128", rows_name);
    if (fp8)
        CHECK_TENSOR(&o->recv_x_scales, "outputs.recv_x_scales", BIT(FP32), 2, {rows, H / 128}, dims,
                     EPX_TENSOR_MIN_ROWS);
    else
        memset(&o->recv_x_scales, 0, sizeof(o->recv_x_scales)); /* fp8 only: not written */
    if (cached) {
        /* A cached dispatch writes recv_x (and its scales) only. */
        memset(&o->recv_topk_idx, 0, sizeof(o->recv_topk_idx));
        memset(&o->recv_topk_weights, 0, sizeof(o->recv_topk_weights));
        memset(&o->num_recv_tokens_per_expert, 0, sizeof(o->num_recv_tokens_per_expert));
        memset(&o->num_recv_tokens, 0, sizeof(o->num_recv_tokens));
        return EPX_SUCCESS;
    }
    snprintf(dims, sizeof(dims), "%s,K", rows_name);
    CHECK_TENSOR(&o->recv_topk_idx, "outputs.recv_topk_idx", INDEX_DTYPES, 2, {rows, K}, dims,
                 EPX_TENSOR_MIN_ROWS | EPX_TENSOR_OPTIONAL);
    CHECK_TENSOR(&o->recv_topk_weights, "outputs.recv_topk_weights", BIT(FP32), 2, {rows, K}, dims,
                 EPX_TENSOR_MIN_ROWS | EPX_TENSOR_OPTIONAL);
    if (epx_api_present(&o->recv_topk_weights) && !epx_api_present(&a->topk_weights))
        return ARG_ERR("outputs.recv_topk_weights is requested but args.topk_weights is absent");
    CHECK_TENSOR(&o->num_recv_tokens_per_expert, "outputs.num_recv_tokens_per_expert", BIT(INT32), 1, {L},
                 "L", EPX_TENSOR_OPTIONAL);
    CHECK_TENSOR(&o->num_recv_tokens, "outputs.num_recv_tokens", BIT(INT32), 1, {1}, "1",
                 EPX_TENSOR_OPTIONAL);
    /* Values last: the shape checks above are cheaper. */
    EPX_CHECK(epx_api_check_topk_idx(comm, &a->topk_idx, cfg->num_experts, "topk_idx"));
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_ht_dispatch(epx_buffer_t buffer, const epx_ht_dispatch_args_t *args,
                                     epx_ht_dispatch_outputs_t *outputs)
{
    uint64_t seq;
    EPX_CHECK(epx_api_collective_begin(buffer, &seq));
    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
    epx_result_t res = ht_dispatch_check(buffer, args, outputs, &a, &o);
    if (res != EPX_SUCCESS) return epx_api_fail_collective(buffer, seq, res);
    epx_handle_t handle = a.cached_handle;
    if (!handle) {
        handle = epx_api_handle_new(buffer, EPX_HANDLE_HT, a.x.shape[0], a.x.dtype, 0);
        if (!handle)
            return epx_api_fail_collective(
                buffer, seq, EPX_API_ERR(buffer->comm, EPX_ERR_OUT_OF_MEMORY, "no memory for an HT handle"));
    }
    res = buffer->ops->ht_dispatch(buffer, seq, &a, &o, handle);
    if (res != EPX_SUCCESS) {
        if (!a.cached_handle) epx_api_handle_discard(handle);
        return res;
    }
    if (!a.cached_handle) {
        atomic_fetch_add(&buffer->live_handles, 1);
        o.handle = handle;
    }
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

static epx_result_t ht_combine_check(epx_buffer_t buffer, const epx_ht_combine_args_t *args,
                                     const epx_ht_combine_outputs_t *outputs, epx_ht_combine_args_t *a,
                                     epx_ht_combine_outputs_t *o)
{
    epx_comm_t comm = buffer->comm;
    const int64_t H = buffer->config.hidden, K = buffer->config.num_topk;
    READ_CALL(EPX_MODE_HT, "epx_ht_combine", ht_combine);
    EPX_CHECK(epx_api_check_handle(buffer, a->handle, EPX_HANDLE_HT, "args.handle"));
    const int64_t T = a->handle->num_tokens, N = a->handle->num_recv > 0 ? a->handle->num_recv : 0;
    if (a->x_in_buffer) {
        if (!buffer->ops->ht_get_combine_input) return epx_api_unsupported(buffer, "args.x_in_buffer");
        memset(&a->x, 0, sizeof(a->x)); /* ignored: the rows are in the buffer */
    } else {
        CHECK_TENSOR(&a->x, "x", BIT(BF16), 2, {N, H}, "N_r,H", EPX_TENSOR_MIN_ROWS | EPX_TENSOR_TOKENS);
    }
    CHECK_TENSOR(&a->topk_weights, "topk_weights", BIT(FP32), 2, {N, K}, "N_r,K",
                 EPX_TENSOR_MIN_ROWS | EPX_TENSOR_OPTIONAL);
    CHECK_TENSOR(&a->bias0, "bias0", BIT(BF16), 2, {T, H}, "T,H", EPX_TENSOR_OPTIONAL | EPX_TENSOR_TOKENS);
    CHECK_TENSOR(&a->bias1, "bias1", BIT(BF16), 2, {T, H}, "T,H", EPX_TENSOR_OPTIONAL | EPX_TENSOR_TOKENS);
    CHECK_TENSOR(&o->combined_x, "outputs.combined_x", BIT(BF16), 2, {T, H}, "T,H",
                 EPX_TENSOR_MIN_ROWS | EPX_TENSOR_TOKENS);
    CHECK_TENSOR(&o->combined_topk_weights, "outputs.combined_topk_weights", BIT(FP32), 2, {T, K}, "T,K",
                 EPX_TENSOR_MIN_ROWS | EPX_TENSOR_OPTIONAL);
    if (epx_api_present(&o->combined_topk_weights) && !epx_api_present(&a->topk_weights))
        return ARG_ERR("outputs.combined_topk_weights is requested but args.topk_weights is absent");
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_ht_combine(epx_buffer_t buffer, const epx_ht_combine_args_t *args,
                                    epx_ht_combine_outputs_t *outputs)
{
    uint64_t seq;
    EPX_CHECK(epx_api_collective_begin(buffer, &seq));
    epx_ht_combine_args_t a = EPX_HT_COMBINE_ARGS_INIT;
    epx_ht_combine_outputs_t o = EPX_HT_COMBINE_OUTPUTS_INIT;
    epx_result_t res = ht_combine_check(buffer, args, outputs, &a, &o);
    if (res != EPX_SUCCESS) return epx_api_fail_collective(buffer, seq, res);
    return buffer->ops->ht_combine(buffer, seq, &a, &o);
}

EPX_API epx_result_t epx_ht_get_combine_input(epx_buffer_t buffer, epx_handle_t handle,
                                              epx_tensor_t *view_out)
{
    epx_error_clear();
    EPX_CHECK(epx_api_check_buffer(buffer));
    epx_comm_t comm = buffer->comm;
    EPX_CHECK(epx_api_check_mode(buffer, EPX_MODE_HT, "epx_ht_get_combine_input"));
    if (!buffer->ops->ht_get_combine_input) return epx_api_unsupported(buffer, "epx_ht_get_combine_input");
    if (!view_out) return ARG_ERR("view_out is NULL");
    EPX_CHECK(epx_api_check_handle(buffer, handle, EPX_HANDLE_HT, "handle"));
    epx_tensor_t view;
    memset(&view, 0, sizeof(view));
    EPX_CHECK(buffer->ops->ht_get_combine_input(buffer, handle, &view));
    *view_out = view;
    return EPX_SUCCESS;
}
