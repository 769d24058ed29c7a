/*
 * cuda backend HT operations: layout, dispatch and combine launches, the host wait of the
 * default (non-static) dispatch mode, error reporting, and view mode (outputs and combine input in
 * the registered region). Kernels: src/kernels (HT).
 */
#include <string.h>

#include "cuda/cuda.h"

/* After the host wait: the device error recorded since the call's mark as the call's result (a bad
 * topk_idx id of the call is one: the device refused the call on every rank). A bad id that a
 * standalone layout found is not this call's: the poller reports it. */
static epx_result_t ht_wait(const epx_cuda_op_t *op, const char *what)
{
    return epx_cuda_op_wait(op, what);
}

/* The layout kernel's arguments every caller shares; outputs stay NULL (skipped). */
static void layout_args(epx_buffer_t buffer, const epx_tensor_t *topk_idx, epx_cuda_layout_args_t *a)
{
    const cuda_buffer_t *cb = buffer->backend_state;
    memset(a, 0, sizeof(*a));
    a->topk_idx = topk_idx->data;
    a->idx_is_64 = topk_idx->dtype == EPX_DTYPE_INT64;
    a->num_tokens = topk_idx->shape[0];
    a->num_topk = buffer->config.num_topk;
    a->num_experts = buffer->config.num_experts;
    a->nranks = buffer->comm->nranks;
    a->num_local_experts = buffer->num_local_experts;
    a->host = cb->host_dev;
    a->rank = buffer->comm->rank;
}

epx_result_t epx_cuda_layout(epx_buffer_t buffer, const epx_tensor_t *topk_idx, epx_layout_outputs_t *outputs,
                             void *stream)
{
    epx_cuda_op_t op;
    EPX_CHECK(epx_cuda_op_begin(&op, buffer, 0, stream));
    epx_cuda_layout_args_t a;
    layout_args(buffer, topk_idx, &a);
    a.num_tokens_per_rank = outputs->num_tokens_per_rank.data;
    a.num_tokens_per_expert = outputs->num_tokens_per_expert.data;
    a.is_token_in_rank = outputs->is_token_in_rank.data;
    a.num_tokens_per_domain = outputs->num_tokens_per_domain.data;
    a.ranks_per_domain = buffer->comm->ranks_per_domain;
    return epx_cuda_op_launched(&op, epx_cuda_launch_layout(&a, stream), "layout kernel launch");
}

static int64_t rows_of(const epx_tensor_t *t, int64_t cap)
{
    return t->data && t->shape[0] < cap ? t->shape[0] : cap;
}

static epx_tensor_t device_view(const cuda_buffer_t *cb, void *data, epx_dtype_t dtype, int64_t rows,
                                int64_t cols)
{
    epx_tensor_t t = epx_tensor_2d(data, dtype, rows, cols);
    t.device_type = EPX_DEVICE_CUDA;
    t.device_id = cb->device;
    return t;
}

/* After the host wait of a default-mode dispatch: the per-expert counts the kernels left in the mapped
 * block, to the caller's host array. */
static void copy_host_counts(const cuda_buffer_t *cb, const epx_cuda_dispatch_args_t *a,
                             epx_ht_dispatch_outputs_t *o)
{
    if (!a->host_expert_counts) return;
    const volatile int32_t *src = EPX_CUDA_HOST_COUNTS(cb->host);
    for (int j = 0; j < cb->buffer->num_local_experts; j++) o->num_recv_tokens_per_expert_host[j] = src[j];
}

/* The four row outputs of a view-mode dispatch: views of our region's final-layout areas. */
static void set_views(const cuda_buffer_t *cb, const epx_ht_dispatch_args_t *args,
                      epx_ht_dispatch_outputs_t *o, int64_t rows)
{
    const epx_buffer_config_t *cfg = &cb->buffer->config;
    const int64_t H = cfg->hidden, K = cfg->num_topk;
    uint8_t *area = cb->region + (uint64_t)args->view_area * cb->lay.view_stride;
    o->recv_x = device_view(cb, area + cb->lay.view_x, args->x.dtype, rows, H);
    if (args->x.dtype == EPX_DTYPE_FP8_E4M3)
        o->recv_x_scales = device_view(cb, area + cb->lay.view_scales, EPX_DTYPE_FP32, rows, H / 128);
    if (args->cached_handle) return;
    o->recv_topk_idx = device_view(cb, area + cb->lay.view_idx, EPX_DTYPE_INT32, rows, K);
    if (args->topk_weights.data)
        o->recv_topk_weights = device_view(cb, area + cb->lay.view_w, EPX_DTYPE_FP32, rows, K);
}

/* View mode (recv_in_buffer): one kernel pair writes every row once into its final place. */
static epx_result_t ht_dispatch_view(epx_cuda_op_t *op, const epx_ht_dispatch_args_t *args,
                                     epx_ht_dispatch_outputs_t *outputs, epx_handle_t handle,
                                     epx_cuda_dispatch_args_t *a)
{
    cuda_buffer_t *cb = op->cb;
    epx_buffer_t buffer = cb->buffer;
    const int me = buffer->comm->rank, cached = args->cached_handle != NULL;
    const int is_static = args->num_worst_tokens > 0;
    const int64_t cap_rows = (int64_t)buffer->comm->nranks * buffer->config.max_tokens;
    a->view = 1;
    a->view_area = args->view_area;
    if (!cached) {
        a->num_recv_tokens_per_expert = outputs->num_recv_tokens_per_expert.data;
        a->num_recv_tokens = outputs->num_recv_tokens.data;
        a->rank_prefix_matrix = outputs->rank_prefix_matrix.data;
        if (!is_static && outputs->num_recv_tokens_per_expert_host)
            a->host_expert_counts = EPX_CUDA_HOST_COUNTS(cb->host_dev);
    }
    a->capacity = is_static && args->num_worst_tokens < cap_rows ? args->num_worst_tokens : cap_rows;
    a->static_mode = is_static;
    a->expert_alignment = args->expert_alignment > 0 ? args->expert_alignment : 1;
    if (!is_static) ((volatile epx_cuda_host_block_t *)cb->host)->num_recv = -1;
    EPX_CHECK(epx_cuda_op_launched(op, epx_cuda_launch_dispatch_view(a, op->stream),
                                   "view dispatch kernel launch"));
    EPX_TRACE(EPX_SUBSYS_HT, "rank %d: view dispatch epoch %llu T %lld%s%s", me,
              (unsigned long long)op->epoch, (long long)args->x.shape[0], cached ? " cached" : "",
              is_static ? " static" : "");
    if (is_static) {
        outputs->num_recv_tokens_host = -1;
        if (!cached) handle->num_recv = args->num_worst_tokens;
        set_views(cb, args, outputs, args->num_worst_tokens);
        return EPX_SUCCESS;
    }
    EPX_CHECK(ht_wait(op, "epx_ht_dispatch"));
    const int64_t n = ((volatile epx_cuda_host_block_t *)cb->host)->num_recv;
    if (n < 0)
        return epx_error(EPX_ERR_REMOTE, "rank %d: view dispatch epoch %llu was abandoned on the device", me,
                         (unsigned long long)op->epoch);
    outputs->num_recv_tokens_host = n;
    if (!cached) handle->num_recv = n;
    copy_host_counts(cb, a, outputs);
    set_views(cb, args, outputs, n);
    return EPX_SUCCESS;
}

epx_result_t epx_cuda_ht_dispatch(epx_buffer_t buffer, uint64_t seq, const epx_ht_dispatch_args_t *args,
                                  epx_ht_dispatch_outputs_t *outputs, epx_handle_t handle)
{
    cuda_buffer_t *cb = buffer->backend_state;
    const int me = buffer->comm->rank;
    const int is_static = args->num_worst_tokens > 0;
    const int cached = args->cached_handle != NULL;
    epx_cuda_op_t op;
    EPX_CHECK(epx_cuda_op_begin(&op, buffer, seq, args->stream));
    if (!is_static && op.capturing)
        return epx_error(
            EPX_ERR_GRAPH_CAPTURE,
            "rank %d: epx_ht_dispatch without num_worst_tokens waits on the host "
            "for N_r, which stream capture forbids; pass num_worst_tokens > 0 (static mode) to capture "
            "it",
            me);
    const int64_t T = args->x.shape[0], H = buffer->config.hidden;
    cuda_handle_t *h = NULL;
    epx_result_t res = EPX_SUCCESS;
    if (cached) {
        h = handle->backend_state;
        if (!h)
            return epx_cuda_op_refuse(
                &op, epx_error(EPX_ERR_INVALID_ARG, "rank %d: args.cached_handle has no device state", me));
    } else {
        res = epx_cuda_handle_get(cb, EPX_HANDLE_HT, op.capturing, &h);
        if (res != EPX_SUCCESS) return epx_cuda_op_refuse(&op, res);
        h->no_host_wait = is_static;
        h->seq = seq;
        handle->backend_state = h;
        epx_cuda_layout_args_t la;
        layout_args(buffer, &args->topk_idx, &la);
        la.send_row = h->dev.ht.send_row;
        la.num_tokens_per_rank = h->dev.ht.send_count;
        la.host = NULL; /* a bad id fails the dispatch on the device (error record) instead */
        la.bad = h->dev.ht.bad;
        la.ranks_per_domain = buffer->comm->nranks;
        res = epx_cuda_check(epx_cuda_launch_layout(&la, args->stream), "layout kernel launch", me);
        if (res != EPX_SUCCESS) return epx_cuda_op_refuse(&op, res);
    }

    epx_cuda_dispatch_args_t a;
    memset(&a, 0, sizeof(a));
    epx_cuda_fill_common(cb, &a.c);
    a.h = h->dev.ht;
    a.num_tokens = T;
    a.cached = cached;
    a.c.call_sig =
        epx_cuda_sig(EPX_CUDA_CALL_HT_DISPATCH, args->x.dtype,
                     (cached ? EPX_CUDA_SIG_CACHED : 0) | (args->recv_in_buffer ? EPX_CUDA_SIG_VIEW : 0),
                     cached ? h->seq : 0);
    a.x = args->x.data;
    a.row_bytes = H * (int64_t)epx_dtype_bytes(args->x.dtype);
    if (args->x.dtype == EPX_DTYPE_FP8_E4M3) {
        a.x_scales = args->x_scales.data;
        a.num_scales = (int32_t)(H / 128);
        a.recv_scales = outputs->recv_x_scales.data;
    }
    a.topk_idx = args->topk_idx.data;
    a.idx_is_64 = args->topk_idx.dtype == EPX_DTYPE_INT64;
    a.topk_weights = args->topk_weights.data;
    if (args->recv_in_buffer) return ht_dispatch_view(&op, args, outputs, handle, &a);
    a.recv_x = outputs->recv_x.data;
    int64_t cap = outputs->recv_x.shape[0];
    if (a.recv_scales) cap = rows_of(&outputs->recv_x_scales, cap);
    if (!cached) {
        a.recv_topk_idx = outputs->recv_topk_idx.data;
        a.recv_idx_is_64 = outputs->recv_topk_idx.dtype == EPX_DTYPE_INT64;
        a.recv_topk_weights = outputs->recv_topk_weights.data;
        a.num_recv_tokens_per_expert = outputs->num_recv_tokens_per_expert.data;
        if (!is_static && outputs->num_recv_tokens_per_expert_host)
            a.host_expert_counts = EPX_CUDA_HOST_COUNTS(cb->host_dev);
        a.num_recv_tokens = outputs->num_recv_tokens.data;
        a.rank_prefix_matrix = outputs->rank_prefix_matrix.data;
        cap = rows_of(&outputs->recv_topk_idx, cap);
        cap = rows_of(&outputs->recv_topk_weights, cap);
    }
    if (is_static && args->num_worst_tokens < cap) cap = args->num_worst_tokens;
    a.capacity = cap;
    a.static_mode = is_static;
    a.expert_alignment = args->expert_alignment > 0 ? args->expert_alignment : 1;
    if (!is_static) ((volatile epx_cuda_host_block_t *)cb->host)->num_recv = -1;
    EPX_CHECK(
        epx_cuda_op_launched(&op, epx_cuda_launch_dispatch(&a, args->stream), "dispatch kernel launch"));
    EPX_TRACE(EPX_SUBSYS_HT, "rank %d: dispatch seq %llu epoch %llu T %lld%s%s", me, (unsigned long long)seq,
              (unsigned long long)op.epoch, (long long)T, cached ? " cached" : "",
              is_static ? " static" : "");
    if (is_static) {
        /* No host synchronisation: N_r goes to the num_recv_tokens tensor; combine takes rows from
         * the device. */
        outputs->num_recv_tokens_host = -1;
        if (!cached) handle->num_recv = args->num_worst_tokens;
        return EPX_SUCCESS;
    }
    EPX_CHECK(ht_wait(&op, "epx_ht_dispatch"));
    const int64_t n = ((volatile epx_cuda_host_block_t *)cb->host)->num_recv;
    if (n < 0) /* the device gave up without a record of its own: teardown's abort flag */
        return epx_error(EPX_ERR_REMOTE, "rank %d: dispatch epoch %llu was abandoned on the device", me,
                         (unsigned long long)op.epoch);
    if (n > cap)
        return epx_error(EPX_ERR_INVALID_ARG,
                         "rank %d: outputs hold %lld rows but N_r = %lld tokens arrived; nothing "
                         "was written and the peers' calls fail with EPX_ERR_REMOTE",
                         me, (long long)cap, (long long)n);
    outputs->num_recv_tokens_host = n;
    if (!cached) handle->num_recv = n;
    copy_host_counts(cb, &a, outputs);
    return EPX_SUCCESS;
}

epx_result_t epx_cuda_ht_combine(epx_buffer_t buffer, uint64_t seq, const epx_ht_combine_args_t *args,
                                 epx_ht_combine_outputs_t *outputs)
{
    cuda_buffer_t *cb = buffer->backend_state;
    const int me = buffer->comm->rank;
    cuda_handle_t *h = args->handle->backend_state;
    epx_cuda_op_t op;
    EPX_CHECK(epx_cuda_op_begin(&op, buffer, seq, args->stream));
    if (!h)
        return epx_cuda_op_refuse(
            &op, epx_error(EPX_ERR_INVALID_ARG, "rank %d: args.handle has no device state", me));
    epx_cuda_combine_args_t a;
    memset(&a, 0, sizeof(a));
    epx_cuda_fill_common(cb, &a.c);
    a.h = h->dev.ht;
    a.num_tokens = args->handle->num_tokens;
    a.x = args->x.data;
    a.topk_weights = args->topk_weights.data;
    a.bias0 = args->bias0.data;
    a.bias1 = args->bias1.data;
    a.combined_x = outputs->combined_x.data;
    a.combined_topk_weights = outputs->combined_topk_weights.data;
    a.in_buffer = args->x_in_buffer != 0;
    /* x_in_buffer 2: x is the recv_x of a view area (the API checked which and whose). */
    a.x_off = cb->lay.comb_x;
    if (args->x_in_buffer == 2) a.x_off = (uint64_t)((const uint8_t *)args->x.data - cb->region);
    a.c.call_sig = epx_cuda_sig(EPX_CUDA_CALL_HT_COMBINE, 0, a.in_buffer ? EPX_CUDA_SIG_VIEW : 0, h->seq);
    if (a.in_buffer)
        EPX_CHECK(epx_cuda_op_launched(&op, epx_cuda_launch_combine_view(&a, args->stream),
                                       "view combine kernel launch"));
    else
        EPX_CHECK(
            epx_cuda_op_launched(&op, epx_cuda_launch_combine(&a, args->stream), "combine kernel launch"));
    EPX_TRACE(EPX_SUBSYS_HT, "rank %d: combine seq %llu epoch %llu", me, (unsigned long long)seq,
              (unsigned long long)op.epoch);
    /* Eager (non-static) handles report errors synchronously; static ones through the poller. */
    if (h->no_host_wait || op.capturing) return EPX_SUCCESS;
    return ht_wait(&op, "epx_ht_combine");
}

epx_result_t epx_cuda_ht_get_combine_input(epx_buffer_t buffer, epx_handle_t handle, epx_tensor_t *view_out)
{
    cuda_buffer_t *cb = buffer->backend_state;
    const int64_t rows = handle->num_recv > 0 ? handle->num_recv : 0;
    if (!handle->backend_state)
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d: the handle has no device state", buffer->comm->rank);
    if (rows > (int64_t)buffer->comm->nranks * buffer->config.max_tokens)
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d: the handle's %lld rows exceed the %lld combine rows",
                         buffer->comm->rank, (long long)rows,
                         (long long)buffer->comm->nranks * buffer->config.max_tokens);
    /* No wait: the combine that read the previous rows ended (on its stream) after every source. */
    *view_out = device_view(cb, cb->region + cb->lay.comb_x, EPX_DTYPE_BF16, rows, buffer->config.hidden);
    return EPX_SUCCESS;
}
