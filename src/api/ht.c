/*
 * HT calls: the dispatch layout, the checks of HT dispatch (routed or cached, caller's outputs or
 * views of the buffer) and HT combine, and the combine input view.
 */
#include <stdio.h>
#include <string.h>

#include "api/api.h"

static epx_result_t get_dispatch_layout(epx_buffer_t buffer, const epx_tensor_t *topk_idx,
                                        epx_layout_outputs_t *outputs, void *stream)
{
    EPX_CHECK(epx_api_check_mode(buffer, EPX_MODE_HT, "epx_get_dispatch_layout"));
    epx_comm_t comm = buffer->comm;
    const epx_buffer_config_t *cfg = &buffer->config;
    if (!buffer->ops->layout) return epx_api_unsupported(buffer, "epx_get_dispatch_layout");
    if (!topk_idx) return ARG_ERR("topk_idx is NULL");
    epx_layout_outputs_t o = EPX_LAYOUT_OUTPUTS_INIT;
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

EPX_API epx_result_t epx_get_dispatch_layout(epx_buffer_t buffer, const epx_tensor_t *topk_idx,
                                             epx_layout_outputs_t *outputs, void *stream)
{
    EPX_API_HOLDING_BUFFER(buffer, "epx_get_dispatch_layout",
                           get_dispatch_layout(buffer, topk_idx, outputs, stream));
}

/* ----------------------------------------------------------------------------------- HT ---- */

EPX_API_CHECK_FN(ht_dispatch)
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

    EPX_CHECK(epx_api_check_dispatch_x(buffer, &a->x, "x", EPX_API_DISPATCH_DTYPES));
    const int64_t T = a->x.shape[0];
    if (cached && T != cached->num_tokens)
        return ARG_ERR("x has %lld tokens but args.cached_handle was dispatched with %lld", (long long)T,
                       (long long)cached->num_tokens);
    EPX_CHECK(epx_api_check_x_scales(buffer, &a->x, "x", &a->x_scales, "x_scales"));
    if (a->expert_alignment == 0) a->expert_alignment = 1;
    if (a->expert_alignment < 0)
        return ARG_ERR("args.expert_alignment = %d must be >= 0 (0 means 1)", a->expert_alignment);
    if (a->num_worst_tokens < 0)
        return ARG_ERR("args.num_worst_tokens = %lld must be >= 0 (0: not static)",
                       (long long)a->num_worst_tokens);
    if (cached && cached->is_static) {
        /* A static handle's cached dispatch is static too: the same rows, no host synchronisation. */
        if (a->num_worst_tokens == 0) a->num_worst_tokens = cached->num_recv;
        if (a->num_worst_tokens != cached->num_recv)
            return ARG_ERR("args.num_worst_tokens = %lld differs from the %lld that args.cached_handle's "
                           "(static) dispatch used: pass 0 or the same bound",
                           (long long)a->num_worst_tokens, (long long)cached->num_recv);
    }
    /* Written only where the host waits for the counts: default mode, with top-k. */
    if (cached || a->num_worst_tokens > 0) o->num_recv_tokens_per_expert_host = NULL;
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
        if (a->view_area < 0 || a->view_area >= cfg->num_view_areas)
            return ARG_ERR("args.view_area = %d is out of range [0, %d) (config.num_view_areas)",
                           a->view_area, cfg->num_view_areas);
        const int64_t cap = (int64_t)comm->nranks * cfg->max_tokens;
        if (a->num_worst_tokens > cap)
            return ARG_ERR("args.num_worst_tokens = %lld is above the %lld rows (R * max_tokens) the buffer "
                           "holds for args.recv_in_buffer",
                           (long long)a->num_worst_tokens, (long long)cap);
        if (!cached) {
            CHECK_TENSOR(&o->num_recv_tokens_per_expert, "outputs.num_recv_tokens_per_expert", BIT(INT32), 1,
                         {L}, "L", EPX_TENSOR_OPTIONAL);
            CHECK_TENSOR(&o->rank_prefix_matrix, "outputs.rank_prefix_matrix", BIT(INT32), 2,
                         {comm->nranks, comm->nranks}, "R,R", EPX_TENSOR_OPTIONAL);
            CHECK_TENSOR(&o->num_recv_tokens, "outputs.num_recv_tokens", BIT(INT32), 1, {1}, "1",
                         EPX_TENSOR_OPTIONAL);
            EPX_CHECK(epx_api_check_topk_idx(comm, &a->topk_idx, cfg->num_experts, "topk_idx"));
        } else {
            memset(&o->num_recv_tokens_per_expert, 0, sizeof(o->num_recv_tokens_per_expert));
            memset(&o->num_recv_tokens, 0, sizeof(o->num_recv_tokens));
            memset(&o->rank_prefix_matrix, 0, sizeof(o->rank_prefix_matrix));
        }
        return EPX_SUCCESS;
    }

    /* Rows the outputs need when that is known before communicating. */
    const bool is_static = a->num_worst_tokens > 0;
    const int64_t rows =
        is_static ? a->num_worst_tokens : (cached && cached->num_recv > 0 ? cached->num_recv : 0);
    const char *rows_name = is_static ? "num_worst_tokens" : "N_r";
    EPX_CHECK(epx_api_check_recv_rows(comm, &o->recv_x, "outputs.recv_x", &o->recv_x_scales,
                                      "outputs.recv_x_scales", a->x.dtype, rows, rows_name, H));
    if (cached) {
        /* A cached dispatch writes recv_x (and its scales) only. */
        memset(&o->recv_topk_idx, 0, sizeof(o->recv_topk_idx));
        memset(&o->recv_topk_weights, 0, sizeof(o->recv_topk_weights));
        memset(&o->num_recv_tokens_per_expert, 0, sizeof(o->num_recv_tokens_per_expert));
        memset(&o->num_recv_tokens, 0, sizeof(o->num_recv_tokens));
        memset(&o->rank_prefix_matrix, 0, sizeof(o->rank_prefix_matrix));
        return EPX_SUCCESS;
    }
    char dims[64];
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
    CHECK_TENSOR(&o->rank_prefix_matrix, "outputs.rank_prefix_matrix", BIT(INT32), 2,
                 {comm->nranks, comm->nranks}, "R,R", EPX_TENSOR_OPTIONAL);
    /* Values last: the shape checks above are cheaper. */
    EPX_CHECK(epx_api_check_topk_idx(comm, &a->topk_idx, cfg->num_experts, "topk_idx"));
    return EPX_SUCCESS;
}

/* x_in_buffer = 2: x must be, whole, the bf16 recv_x that the latest view-mode dispatch into one of
 * the buffer's areas returned, and that dispatch must have used `handle`. */
static epx_result_t check_x_view(epx_buffer_t buffer, epx_handle_t handle, const epx_tensor_t *x)
{
    epx_comm_t comm = buffer->comm;
    const int64_t H = buffer->config.hidden;
    for (int k = 0; k < buffer->config.num_view_areas; k++) {
        if (!x->data || buffer->view_areas[k].x != x->data) continue;
        if (buffer->view_areas[k].handle_id != handle->id)
            return ARG_ERR("x is the dispatch view of view area %d, which holds the rows of another handle's "
                           "dispatch (args.x_in_buffer = 2 needs this handle's)",
                           k);
        if (buffer->view_areas[k].dtype != EPX_DTYPE_BF16)
            return ARG_ERR("x is the dispatch view of view area %d, which holds %s rows (combine takes bf16)",
                           k, epx_dtype_name(buffer->view_areas[k].dtype));
        const int64_t rows = buffer->view_areas[k].rows;
        if (x->ndim != 2 || x->shape[0] != rows || x->shape[1] != H)
            return ARG_ERR("args.x_in_buffer = 2 needs x to be the whole recv_x view of view area %d, [%lld, %lld]; "
                           "x has %d dimensions, %lld rows (a slice or a reshape of the view is not it)",
                           k, (long long)rows, (long long)H, (int)x->ndim,
                           (long long)(x->ndim > 0 ? x->shape[0] : 0));
        CHECK_TENSOR(x, "x (args.x_in_buffer = 2)", BIT(BF16), 2, {rows, H}, "rows,H", 0);
        return EPX_SUCCESS;
    }
    return ARG_ERR("args.x_in_buffer = 2 but x (data %p) is not the recv_x of the latest view-mode dispatch "
                   "into any view area of this buffer (a later view-mode dispatch into its area, one that failed "
                   "included, leaves the area's earlier views unspecified)",
                   x->data);
}

EPX_API_CHECK_FN(ht_combine)
{
    epx_comm_t comm = buffer->comm;
    const int64_t H = buffer->config.hidden, K = buffer->config.num_topk;
    READ_CALL(EPX_MODE_HT, "epx_ht_combine", ht_combine);
    EPX_CHECK(epx_api_check_handle(buffer, a->handle, EPX_HANDLE_HT, "args.handle"));
    const int64_t T = a->handle->num_tokens, N = a->handle->num_recv > 0 ? a->handle->num_recv : 0;
    if (a->x_in_buffer < 0 || a->x_in_buffer > 2)
        return ARG_ERR("args.x_in_buffer = %d must be 0, 1 (the combine input view) or 2 (x is the handle's "
                       "dispatch view)",
                       a->x_in_buffer);
    if (a->x_in_buffer) {
        if (!buffer->ops->ht_get_combine_input) return epx_api_unsupported(buffer, "args.x_in_buffer");
        if (a->x_in_buffer == 2)
            EPX_CHECK(check_x_view(buffer, a->handle, &a->x));
        else
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

static epx_result_t ht_get_combine_input(epx_buffer_t buffer, epx_handle_t handle, epx_tensor_t *view_out)
{
    EPX_CHECK(epx_api_check_mode(buffer, EPX_MODE_HT, "epx_ht_get_combine_input"));
    epx_comm_t comm = buffer->comm;
    if (!buffer->ops->ht_get_combine_input) return epx_api_unsupported(buffer, "epx_ht_get_combine_input");
    if (!view_out) return ARG_ERR("view_out is NULL");
    EPX_CHECK(epx_api_check_handle(buffer, handle, EPX_HANDLE_HT, "handle"));
    epx_tensor_t view;
    memset(&view, 0, sizeof(view));
    EPX_CHECK(buffer->ops->ht_get_combine_input(buffer, handle, &view));
    *view_out = view;
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_ht_get_combine_input(epx_buffer_t buffer, epx_handle_t handle,
                                              epx_tensor_t *view_out)
{
    EPX_API_HOLDING_BUFFER(buffer, "epx_ht_get_combine_input",
                           ht_get_combine_input(buffer, handle, view_out));
}
