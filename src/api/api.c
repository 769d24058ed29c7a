/*
 * The public entry points for dtypes, buffers, handles, layout, HT, LL and routing-map calls.
 * Each clears the thread's error, checks every argument it can against the buffer and only then
 * calls the backend; collective calls number themselves first so a rank that fails its checks
 * can tell its peers (they return EPX_ERR_REMOTE instead of waiting).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/check.h"

#define BIT(d) EPX_DTYPE_BIT(EPX_DTYPE_##d)
#define INDEX_DTYPES (BIT(INT32) | BIT(INT64))
#define HT_DTYPES (BIT(BF16) | BIT(FP32) | BIT(FP8_E4M3))
#define RM_DTYPES (BIT(BF16) | BIT(FP8_E4M3))

/* Checks tensor `t` against a spec written inline; the enclosing function has `comm`. */
#define CHECK_TENSOR(t, ...) EPX_CHECK(epx_api_check_tensor(comm, (t), &(epx_tensor_spec_t){__VA_ARGS__}))
#define ARG_ERR(...) EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, __VA_ARGS__)

/* Writes one [out] field back when the caller's struct is large enough to hold it. */
#define WRITE_OUT(dst, src, type, field)                                                                     \
    do {                                                                                                     \
        if ((src)->size >= EPX_STRUCT_END(type, field)) (dst)->field = (src)->field;                         \
    } while (0)

/* ------------------------------------------------------------------------------- dtypes ---- */

EPX_API size_t epx_dtype_size(epx_dtype_t dtype) { return epx_dtype_bytes(dtype); }

EPX_API const char *epx_dtype_name(epx_dtype_t dtype) { return epx_dtype_str(dtype); }

/* ------------------------------------------------------------------------------ helpers ---- */

static const char *mode_name(uint32_t mode)
{
    switch (mode) {
    case EPX_MODE_HT: return "EPX_MODE_HT";
    case EPX_MODE_LL: return "EPX_MODE_LL";
    case EPX_MODE_PERMUTE: return "EPX_MODE_PERMUTE";
    default: return "?";
    }
}

static epx_result_t check_buffer(epx_buffer_t buffer)
{
    if (!buffer) return epx_error(EPX_ERR_INVALID_ARG, "buffer is NULL");
    if (buffer->magic != EPX_BUFFER_MAGIC)
        return epx_error(EPX_ERR_INVALID_ARG,
                         "buffer %p is not a live epx buffer (destroyed, or not made by "
                         "epx_buffer_create)",
                         (void *)buffer);
    return EPX_SUCCESS;
}

static epx_result_t check_mode(epx_buffer_t buffer, uint32_t mode, const char *op)
{
    epx_comm_t comm = buffer->comm;
    if (buffer->config.modes & mode) return EPX_SUCCESS;
    char modes[64] = "";
    for (uint32_t m = 1; m <= EPX_MODE_PERMUTE; m <<= 1)
        if (buffer->config.modes & m) {
            if (modes[0]) strcat(modes, "|");
            strcat(modes, mode_name(m));
        }
    return ARG_ERR("%s needs a buffer created with %s; this buffer's modes are %s", op, mode_name(mode),
                   modes);
}

static epx_result_t unsupported(epx_buffer_t buffer, const char *op)
{
    return EPX_API_ERR(buffer->comm, EPX_ERR_UNSUPPORTED, "the %s backend does not implement %s",
                       buffer->ops->name, op);
}

/* Tells the peers that this rank failed collective call `seq`, keeping the message of the
 * failure for the caller. */
static epx_result_t fail_collective(epx_buffer_t buffer, uint64_t seq, epx_result_t res)
{
    char message[1024];
    epx_error_copy(message, sizeof(message));
    if (buffer->ops->fail_collective) buffer->ops->fail_collective(buffer, seq, res);
    epx_error_set_message(message);
    return res;
}

static epx_result_t check_tokens(epx_buffer_t buffer, const char *name, int64_t T)
{
    epx_comm_t comm = buffer->comm;
    if (T > buffer->config.max_tokens)
        return ARG_ERR("%s has %lld tokens, more than the buffer's max_tokens = %lld", name, (long long)T,
                       (long long)buffer->config.max_tokens);
    return EPX_SUCCESS;
}

/* The dtype of dispatched data must be one the buffer was sized for. */
static epx_result_t check_dispatch_dtype(epx_buffer_t buffer, const epx_tensor_t *x, const char *name,
                                         uint32_t call_dtypes)
{
    epx_comm_t comm = buffer->comm;
    if (x->dtype > EPX_DTYPE_INVALID && x->dtype < EPX_DTYPE_COUNT_ &&
        (call_dtypes & EPX_DTYPE_BIT(x->dtype)) &&
        !(buffer->config.dispatch_dtypes & EPX_DTYPE_BIT(x->dtype))) {
        char allowed[96];
        return ARG_ERR(
            "%s has dtype %s, which the buffer was not created for (config.dispatch_dtypes allows %s)", name,
            epx_dtype_name(x->dtype),
            epx_api_dtype_list(buffer->config.dispatch_dtypes, allowed, sizeof(allowed)));
    }
    return EPX_SUCCESS;
}

static epx_result_t check_handle(epx_buffer_t buffer, epx_handle_t handle, epx_handle_kind_t kind,
                                 const char *name)
{
    epx_comm_t comm = buffer->comm;
    static const char *kinds[] = {"?", "HT", "routing-map"};
    if (!handle) return ARG_ERR("%s is NULL", name);
    if (handle->magic != EPX_HANDLE_MAGIC)
        return ARG_ERR("%s = %p is not a live handle (destroyed, or not made by a dispatch)", name,
                       (void *)handle);
    int have = handle->kind == EPX_HANDLE_RM ? 2 : handle->kind == EPX_HANDLE_HT ? 1 : 0;
    if (handle->kind != kind)
        return ARG_ERR("%s is a %s handle; this call needs a %s handle", name, kinds[have], kinds[kind]);
    if (handle->buffer != buffer)
        return ARG_ERR("%s belongs to another buffer (%p, not %p)", name, (void *)handle->buffer,
                       (void *)buffer);
    return EPX_SUCCESS;
}

/* `next_seq`: the first sequence number a dispatch of this buffer has not used yet. */
static epx_result_t check_ll_handle(epx_buffer_t buffer, const epx_ll_handle_t *h, uint64_t next_seq,
                                    const char *name)
{
    epx_comm_t comm = buffer->comm;
    if (h->slot != 0 && h->slot != 1) return ARG_ERR("%s.slot = %d is not 0 or 1", name, h->slot);
    if (h->num_tokens < 0 || h->num_tokens > buffer->config.max_tokens)
        return ARG_ERR("%s.num_tokens = %d is out of range [0, %lld]", name, h->num_tokens,
                       (long long)buffer->config.max_tokens);
    if (h->seq == 0 || h->seq >= next_seq)
        return ARG_ERR("%s.seq = %llu is not a dispatch made on this buffer (%llu collective calls so far)",
                       name, (unsigned long long)h->seq, (unsigned long long)(next_seq - 1));
    return EPX_SUCCESS;
}

static epx_handle_t handle_new(epx_buffer_t buffer, epx_handle_kind_t kind, int64_t T, epx_dtype_t dtype,
                               int32_t permute)
{
    epx_handle_t h = calloc(1, sizeof(*h));
    if (!h) return NULL;
    h->magic = EPX_HANDLE_MAGIC;
    h->kind = kind;
    h->buffer = buffer;
    h->num_tokens = T;
    h->num_recv = -1; /* unknown until the backend fills it */
    h->permute = permute;
    h->x_dtype = dtype;
    return h;
}

/* Frees a handle the backend failed to fill (keeping the failure's message). */
static void handle_discard(epx_handle_t h)
{
    if (h->backend_state && h->buffer->ops->handle_free) {
        char message[1024];
        epx_error_copy(message, sizeof(message));
        h->buffer->ops->handle_free(h);
        epx_error_set_message(message);
    }
    h->magic = 0;
    free(h);
}

/* ------------------------------------------------------------------------------ buffers ---- */

/* What each rank tells the others at buffer creation: its local verdict and its config. */
typedef struct create_msg {
    int32_t status;
    int32_t num_topk;
    int64_t max_tokens;
    int64_t hidden;
    int32_t num_experts;
    uint32_t modes;
    uint32_t dispatch_dtypes;
    int32_t max_pad_multiple;
    int32_t num_sms;
    int32_t chunk_tokens;
} create_msg_t;

static epx_result_t compare_configs(epx_comm_t comm, const create_msg_t *msgs)
{
    for (int r = 1; r < comm->nranks; r++) {
#define CMP_FIELD_(field, fmt, cast)                                                                         \
    if (msgs[r].field != msgs[0].field)                                                                      \
        return EPX_API_ERR(comm, EPX_ERR_MISMATCH, #field " differs: rank 0 has " fmt ", rank %d has " fmt,  \
                           (cast)msgs[0].field, r, (cast)msgs[r].field);
        CMP_FIELD_(max_tokens, "%lld", long long)
        CMP_FIELD_(hidden, "%lld", long long)
        CMP_FIELD_(num_topk, "%d", int)
        CMP_FIELD_(num_experts, "%d", int)
        CMP_FIELD_(modes, "0x%x", unsigned)
        CMP_FIELD_(dispatch_dtypes, "0x%x", unsigned)
        CMP_FIELD_(max_pad_multiple, "%d", int)
        CMP_FIELD_(num_sms, "%d", int)
        CMP_FIELD_(chunk_tokens, "%d", int)
#undef CMP_FIELD_
    }
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_buffer_create(epx_comm_t comm, const epx_buffer_config_t *config,
                                       epx_buffer_t *buffer_out)
{
    epx_error_clear();
    if (!comm) return epx_error(EPX_ERR_INVALID_ARG, "comm is NULL");
    if (comm->magic != EPX_COMM_MAGIC)
        return epx_error(EPX_ERR_INVALID_ARG, "comm %p is not a live communicator", (void *)comm);

    /* Every rank takes part in the exchange even when its own checks failed, so that peers
     * learn of it at once instead of waiting for a timeout. */
    epx_buffer_config_t cfg;
    epx_buffer_t buffer = NULL;
    epx_result_t local;
    if (!buffer_out)
        local = ARG_ERR("buffer_out is NULL");
    else
        local = epx_api_buffer_config_normalize(comm, config, comm->nranks, &cfg);
    if (local == EPX_SUCCESS && (!comm->ops || !comm->ops->buffer_create))
        local = EPX_API_ERR(comm, EPX_ERR_UNSUPPORTED, "the %s backend does not implement buffers",
                            comm->ops ? comm->ops->name : "(none)");
    if (local == EPX_SUCCESS && !(buffer = calloc(1, sizeof(*buffer))))
        local = EPX_API_ERR(comm, EPX_ERR_OUT_OF_MEMORY, "no memory for a buffer object");
    char local_message[1024];
    epx_error_copy(local_message, sizeof(local_message));

    create_msg_t mine;
    memset(&mine, 0, sizeof(mine));
    mine.status = local;
    if (local == EPX_SUCCESS) {
        mine.max_tokens = cfg.max_tokens;
        mine.hidden = cfg.hidden;
        mine.num_topk = cfg.num_topk;
        mine.num_experts = cfg.num_experts;
        mine.modes = cfg.modes;
        mine.dispatch_dtypes = cfg.dispatch_dtypes;
        mine.max_pad_multiple = cfg.max_pad_multiple;
        mine.num_sms = cfg.num_sms;
        mine.chunk_tokens = cfg.chunk_tokens;
    }
    epx_result_t res;
    create_msg_t *msgs = calloc((size_t)comm->nranks, sizeof(*msgs));
    if (!msgs) {
        res = EPX_API_ERR(comm, EPX_ERR_OUT_OF_MEMORY, "no memory to exchange buffer configs of %d ranks",
                          comm->nranks);
        goto err_free_buffer;
    }
    EPX_CHECK_GOTO(epx_comm_allgather(comm, &mine, msgs, sizeof(mine)), res, err_free_msgs);
    if (local != EPX_SUCCESS) {
        epx_error_set_message(local_message);
        res = local;
        goto err_free_msgs;
    }
    for (int r = 0; r < comm->nranks; r++)
        if (msgs[r].status != EPX_SUCCESS) {
            res = EPX_API_ERR(comm, EPX_ERR_REMOTE, "rank %d rejected its epx_buffer_create arguments (%s)",
                              r, epx_result_name((epx_result_t)msgs[r].status));
            goto err_free_msgs;
        }
    EPX_CHECK_GOTO(compare_configs(comm, msgs), res, err_free_msgs);
    free(msgs);

    buffer->magic = EPX_BUFFER_MAGIC;
    buffer->comm = comm;
    buffer->config = cfg;
    buffer->num_local_experts = cfg.num_experts / comm->nranks;
    buffer->ops = comm->ops;
    buffer->backend_state = NULL;
    buffer->seq = 0;
    atomic_init(&buffer->live_handles, 0);
    atomic_init(&buffer->overflow, 0);
    EPX_CHECK_GOTO(buffer->ops->buffer_create(buffer), res, err_free_buffer);
    atomic_fetch_add(&comm->live_buffers, 1);
    *buffer_out = buffer;
    return EPX_SUCCESS;

err_free_msgs:
    free(msgs);
err_free_buffer:
    if (buffer) buffer->magic = 0;
    free(buffer);
    return res;
}

EPX_API epx_result_t epx_buffer_destroy(epx_buffer_t buffer)
{
    epx_error_clear();
    if (!buffer) return EPX_SUCCESS;
    EPX_CHECK(check_buffer(buffer));
    epx_comm_t comm = buffer->comm;
    int handles = atomic_load(&buffer->live_handles);
    if (handles > 0)
        return ARG_ERR("the buffer still has %d live handles; destroy them (epx_handle_destroy) first",
                       handles);
    if (buffer->ops->buffer_destroy) buffer->ops->buffer_destroy(buffer);
    atomic_fetch_sub(&comm->live_buffers, 1);
    buffer->magic = 0;
    free(buffer);
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_buffer_query_overflow(epx_buffer_t buffer)
{
    epx_error_clear();
    EPX_CHECK(check_buffer(buffer));
    int overflowed = 0;
    if (buffer->ops->query_overflow)
        EPX_CHECK(buffer->ops->query_overflow(buffer, &overflowed));
    else
        overflowed = atomic_exchange(&buffer->overflow, 0);
    if (overflowed)
        return EPX_API_ERR(
            buffer->comm, EPX_ERR_OVERFLOW,
            "a call with an upper bound on this buffer dropped rows past the bound since the last "
            "query");
    return EPX_SUCCESS;
}

/* ------------------------------------------------------------------------------ handles ---- */

EPX_API epx_result_t epx_handle_get_info(epx_handle_t handle, epx_handle_info_t *info_out)
{
    epx_error_clear();
    if (!handle) return epx_error(EPX_ERR_INVALID_ARG, "handle is NULL");
    if (handle->magic != EPX_HANDLE_MAGIC)
        return epx_error(EPX_ERR_INVALID_ARG, "handle %p is not a live handle", (void *)handle);
    if (!info_out) return epx_error(EPX_ERR_INVALID_ARG, "info_out is NULL");
    epx_handle_info_t info;
    info.num_tokens = handle->num_tokens;
    info.num_recv_tokens = handle->num_recv;
    info.num_ranks = handle->buffer->comm->nranks;
    info.num_local_experts = handle->buffer->num_local_experts;
    *info_out = info;
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_handle_destroy(epx_handle_t handle)
{
    epx_error_clear();
    if (!handle) return EPX_SUCCESS;
    if (handle->magic != EPX_HANDLE_MAGIC)
        return epx_error(EPX_ERR_INVALID_ARG, "handle %p is not a live handle (destroyed twice?)",
                         (void *)handle);
    epx_buffer_t buffer = handle->buffer;
    if (buffer->ops->handle_free) buffer->ops->handle_free(handle);
    atomic_fetch_sub(&buffer->live_handles, 1);
    handle->magic = 0;
    free(handle);
    return EPX_SUCCESS;
}

/* ------------------------------------------------------------------------------- layout ---- */

EPX_API epx_result_t epx_get_dispatch_layout(epx_buffer_t buffer, const epx_tensor_t *topk_idx,
                                             epx_layout_outputs_t *outputs, void *stream)
{
    epx_error_clear();
    EPX_CHECK(check_buffer(buffer));
    epx_comm_t comm = buffer->comm;
    const epx_buffer_config_t *cfg = &buffer->config;
    EPX_CHECK(check_mode(buffer, EPX_MODE_HT, "epx_get_dispatch_layout"));
    if (!buffer->ops->layout) return unsupported(buffer, "epx_get_dispatch_layout");
    if (!topk_idx) return ARG_ERR("topk_idx is NULL");
    epx_layout_outputs_t o = {.size = sizeof(o), .version = EPX_VERSION_CODE};
    EPX_CHECK(epx_api_read_struct(comm, &o, sizeof(o), outputs, "outputs"));

    CHECK_TENSOR(topk_idx, "topk_idx", INDEX_DTYPES, 2, {EPX_ANY_DIM, cfg->num_topk}, "T,K", 0);
    int64_t T = topk_idx->shape[0];
    EPX_CHECK(check_tokens(buffer, "topk_idx", T));
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
    EPX_CHECK(epx_api_read_struct(comm, a, sizeof(*a), args, "args"));
    EPX_CHECK(epx_api_read_struct(comm, o, sizeof(*o), outputs, "outputs"));
    EPX_CHECK(check_mode(buffer, EPX_MODE_HT, "epx_ht_dispatch"));
    if (!buffer->ops->ht_dispatch) return unsupported(buffer, "epx_ht_dispatch");
    epx_handle_t cached = a->cached_handle;
    if (cached)
        EPX_CHECK(check_handle(buffer, cached, EPX_HANDLE_HT, "args.cached_handle"));
    else if (o->size < EPX_STRUCT_END(epx_ht_dispatch_outputs_t, handle))
        return ARG_ERR("outputs->size = %zu does not reach outputs.handle (%zu bytes needed)", o->size,
                       EPX_STRUCT_END(epx_ht_dispatch_outputs_t, handle));

    EPX_CHECK(check_dispatch_dtype(buffer, &a->x, "x", HT_DTYPES));
    CHECK_TENSOR(&a->x, "x", HT_DTYPES & cfg->dispatch_dtypes, 2, {EPX_ANY_DIM, H}, "T,H", EPX_TENSOR_TOKENS);
    const int64_t T = a->x.shape[0];
    const bool fp8 = a->x.dtype == EPX_DTYPE_FP8_E4M3;
    EPX_CHECK(check_tokens(buffer, "x", T));
    if (cached && T != cached->num_tokens)
        return ARG_ERR("x has %lld tokens but args.cached_handle was dispatched with %lld", (long long)T,
                       (long long)cached->num_tokens);
    if (fp8)
        CHECK_TENSOR(&a->x_scales, "x_scales", BIT(FP32), 2, {T, H / 128}, "T,H/128", 0);
    else if (epx_api_present(&a->x_scales))
        return ARG_ERR("x_scales is given but x is %s (scales go with fp8_e4m3 only)",
                       epx_dtype_name(a->x.dtype));
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
    epx_error_clear();
    EPX_CHECK(check_buffer(buffer));
    const uint64_t seq = ++buffer->seq;
    epx_ht_dispatch_args_t a = {.size = sizeof(a), .version = EPX_VERSION_CODE};
    epx_ht_dispatch_outputs_t o = {.size = sizeof(o), .version = EPX_VERSION_CODE};
    epx_result_t res = ht_dispatch_check(buffer, args, outputs, &a, &o);
    if (res != EPX_SUCCESS) return fail_collective(buffer, seq, res);
    epx_handle_t handle = a.cached_handle;
    if (!handle) {
        handle = handle_new(buffer, EPX_HANDLE_HT, a.x.shape[0], a.x.dtype, 0);
        if (!handle)
            return fail_collective(
                buffer, seq, EPX_API_ERR(buffer->comm, EPX_ERR_OUT_OF_MEMORY, "no memory for an HT handle"));
    }
    res = buffer->ops->ht_dispatch(buffer, seq, &a, &o, handle);
    if (res != EPX_SUCCESS) {
        if (!a.cached_handle) handle_discard(handle);
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
    EPX_CHECK(epx_api_read_struct(comm, a, sizeof(*a), args, "args"));
    EPX_CHECK(epx_api_read_struct(comm, o, sizeof(*o), outputs, "outputs"));
    EPX_CHECK(check_mode(buffer, EPX_MODE_HT, "epx_ht_combine"));
    if (!buffer->ops->ht_combine) return unsupported(buffer, "epx_ht_combine");
    EPX_CHECK(check_handle(buffer, a->handle, EPX_HANDLE_HT, "args.handle"));
    const int64_t T = a->handle->num_tokens, N = a->handle->num_recv > 0 ? a->handle->num_recv : 0;
    if (a->x_in_buffer) {
        if (!buffer->ops->ht_get_combine_input) return unsupported(buffer, "args.x_in_buffer");
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
    epx_error_clear();
    EPX_CHECK(check_buffer(buffer));
    const uint64_t seq = ++buffer->seq;
    epx_ht_combine_args_t a = {.size = sizeof(a), .version = EPX_VERSION_CODE};
    epx_ht_combine_outputs_t o = {.size = sizeof(o), .version = EPX_VERSION_CODE};
    epx_result_t res = ht_combine_check(buffer, args, outputs, &a, &o);
    if (res != EPX_SUCCESS) return fail_collective(buffer, seq, res);
    return buffer->ops->ht_combine(buffer, seq, &a, &o);
}

EPX_API epx_result_t epx_ht_get_combine_input(epx_buffer_t buffer, epx_handle_t handle,
                                              epx_tensor_t *view_out)
{
    epx_error_clear();
    EPX_CHECK(check_buffer(buffer));
    epx_comm_t comm = buffer->comm;
    EPX_CHECK(check_mode(buffer, EPX_MODE_HT, "epx_ht_get_combine_input"));
    if (!buffer->ops->ht_get_combine_input) return unsupported(buffer, "epx_ht_get_combine_input");
    if (!view_out) return ARG_ERR("view_out is NULL");
    EPX_CHECK(check_handle(buffer, handle, EPX_HANDLE_HT, "handle"));
    epx_tensor_t view;
    memset(&view, 0, sizeof(view));
    EPX_CHECK(buffer->ops->ht_get_combine_input(buffer, handle, &view));
    *view_out = view;
    return EPX_SUCCESS;
}

/* ----------------------------------------------------------------------------------- LL ---- */

static epx_result_t ll_dispatch_check(epx_buffer_t buffer, const epx_ll_dispatch_args_t *args,
                                      const epx_ll_dispatch_outputs_t *outputs, epx_ll_dispatch_args_t *a,
                                      epx_ll_dispatch_outputs_t *o)
{
    epx_comm_t comm = buffer->comm;
    const epx_buffer_config_t *cfg = &buffer->config;
    const int64_t H = cfg->hidden, K = cfg->num_topk, L = buffer->num_local_experts;
    const int64_t rows = (int64_t)comm->nranks * cfg->max_tokens;
    EPX_CHECK(epx_api_read_struct(comm, a, sizeof(*a), args, "args"));
    EPX_CHECK(epx_api_read_struct(comm, o, sizeof(*o), outputs, "outputs"));
    EPX_CHECK(check_mode(buffer, EPX_MODE_LL, "epx_ll_dispatch"));
    if (!buffer->ops->ll_dispatch) return unsupported(buffer, "epx_ll_dispatch");
    const size_t need = a->return_recv_hook ? EPX_STRUCT_END(epx_ll_dispatch_outputs_t, hook)
                                            : EPX_STRUCT_END(epx_ll_dispatch_outputs_t, handle);
    if (o->size < need)
        return ARG_ERR("outputs->size = %zu does not reach outputs.%s (%zu bytes needed)", o->size,
                       a->return_recv_hook ? "hook" : "handle", need);

    if (a->round_scale && !a->use_fp8) return ARG_ERR("args.round_scale needs args.use_fp8");
    if (a->use_ue8m0 && !a->use_fp8) return ARG_ERR("args.use_ue8m0 needs args.use_fp8");
    if (a->use_ue8m0 && !a->round_scale) return ARG_ERR("args.use_ue8m0 needs args.round_scale");
    if (a->use_ue8m0 && H % 512 != 0)
        return ARG_ERR("args.use_ue8m0 needs hidden %% 512 == 0; hidden = %lld", (long long)H);

    CHECK_TENSOR(&a->x, "x", BIT(BF16), 2, {EPX_ANY_DIM, H}, "T,H", EPX_TENSOR_TOKENS);
    const int64_t T = a->x.shape[0];
    EPX_CHECK(check_tokens(buffer, "x", T));
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

EPX_API epx_result_t epx_ll_dispatch(epx_buffer_t buffer, const epx_ll_dispatch_args_t *args,
                                     epx_ll_dispatch_outputs_t *outputs)
{
    epx_error_clear();
    EPX_CHECK(check_buffer(buffer));
    const uint64_t seq = ++buffer->seq;
    buffer->ll_dispatches++; /* failed calls too: every rank keeps the same LL slot order */
    epx_ll_dispatch_args_t a = {.size = sizeof(a), .version = EPX_VERSION_CODE};
    epx_ll_dispatch_outputs_t o = {.size = sizeof(o), .version = EPX_VERSION_CODE};
    epx_result_t res = ll_dispatch_check(buffer, args, outputs, &a, &o);
    if (res != EPX_SUCCESS) return fail_collective(buffer, seq, res);
    EPX_CHECK(buffer->ops->ll_dispatch(buffer, seq, &a, &o));
    WRITE_OUT(outputs, &o, epx_ll_dispatch_outputs_t, handle);
    if (a.return_recv_hook) WRITE_OUT(outputs, &o, epx_ll_dispatch_outputs_t, hook);
    return EPX_SUCCESS;
}

static epx_result_t ll_combine_check(epx_buffer_t buffer, uint64_t seq, const epx_ll_combine_args_t *args,
                                     const epx_ll_combine_outputs_t *outputs, epx_ll_combine_args_t *a,
                                     epx_ll_combine_outputs_t *o)
{
    epx_comm_t comm = buffer->comm;
    const epx_buffer_config_t *cfg = &buffer->config;
    const int64_t H = cfg->hidden, K = cfg->num_topk, L = buffer->num_local_experts;
    const int64_t rows = (int64_t)comm->nranks * cfg->max_tokens;
    EPX_CHECK(epx_api_read_struct(comm, a, sizeof(*a), args, "args"));
    EPX_CHECK(epx_api_read_struct(comm, o, sizeof(*o), outputs, "outputs"));
    EPX_CHECK(check_mode(buffer, EPX_MODE_LL, "epx_ll_combine"));
    if (!buffer->ops->ll_combine) return unsupported(buffer, "epx_ll_combine");
    if (a->return_recv_hook && o->size < EPX_STRUCT_END(epx_ll_combine_outputs_t, hook))
        return ARG_ERR("outputs->size = %zu does not reach outputs.hook (%zu bytes needed)", o->size,
                       EPX_STRUCT_END(epx_ll_combine_outputs_t, hook));
    EPX_CHECK(check_ll_handle(buffer, &a->handle, seq, "args.handle"));
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

EPX_API epx_result_t epx_ll_combine(epx_buffer_t buffer, const epx_ll_combine_args_t *args,
                                    epx_ll_combine_outputs_t *outputs)
{
    epx_error_clear();
    EPX_CHECK(check_buffer(buffer));
    const uint64_t seq = ++buffer->seq;
    epx_ll_combine_args_t a = {.size = sizeof(a), .version = EPX_VERSION_CODE};
    epx_ll_combine_outputs_t o = {.size = sizeof(o), .version = EPX_VERSION_CODE};
    epx_result_t res = ll_combine_check(buffer, seq, args, outputs, &a, &o);
    if (res != EPX_SUCCESS) return fail_collective(buffer, seq, res);
    EPX_CHECK(buffer->ops->ll_combine(buffer, seq, &a, &o));
    if (a.return_recv_hook) WRITE_OUT(outputs, &o, epx_ll_combine_outputs_t, hook);
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_ll_get_combine_buffer(epx_buffer_t buffer, const epx_ll_handle_t *handle,
                                               epx_tensor_t *view_out)
{
    epx_error_clear();
    EPX_CHECK(check_buffer(buffer));
    epx_comm_t comm = buffer->comm;
    EPX_CHECK(check_mode(buffer, EPX_MODE_LL, "epx_ll_get_combine_buffer"));
    if (!buffer->ops->ll_get_combine_buffer) return unsupported(buffer, "epx_ll_get_combine_buffer");
    if (!handle) return ARG_ERR("handle is NULL");
    if (!view_out) return ARG_ERR("view_out is NULL");
    EPX_CHECK(check_ll_handle(buffer, handle, buffer->seq + 1, "handle"));
    epx_tensor_t view;
    memset(&view, 0, sizeof(view));
    EPX_CHECK(buffer->ops->ll_get_combine_buffer(buffer, handle, &view));
    *view_out = view;
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_hook_run(const epx_hook_t *hook, void *stream)
{
    epx_error_clear();
    if (!hook) return epx_error(EPX_ERR_INVALID_ARG, "hook is NULL");
    if (!hook->buffer) return epx_error(EPX_ERR_INVALID_ARG, "hook->buffer is NULL (not a hook from a call)");
    EPX_CHECK(check_buffer(hook->buffer));
    if (!hook->buffer->ops->hook_run) return unsupported(hook->buffer, "epx_hook_run");
    return hook->buffer->ops->hook_run(hook, stream);
}

/* -------------------------------------------------------------------------- routing map ---- */

static epx_result_t rm_dispatch_check(epx_buffer_t buffer, const epx_rm_dispatch_args_t *args,
                                      const epx_rm_dispatch_outputs_t *outputs, epx_rm_dispatch_args_t *a,
                                      epx_rm_dispatch_outputs_t *o)
{
    epx_comm_t comm = buffer->comm;
    const epx_buffer_config_t *cfg = &buffer->config;
    const int64_t H = cfg->hidden, K = cfg->num_topk, E = cfg->num_experts, L = buffer->num_local_experts;
    EPX_CHECK(epx_api_read_struct(comm, a, sizeof(*a), args, "args"));
    EPX_CHECK(epx_api_read_struct(comm, o, sizeof(*o), outputs, "outputs"));
    EPX_CHECK(check_mode(buffer, EPX_MODE_PERMUTE, "epx_rm_dispatch"));
    if (!buffer->ops->rm_dispatch) return unsupported(buffer, "epx_rm_dispatch");
    if (o->size < EPX_STRUCT_END(epx_rm_dispatch_outputs_t, handle))
        return ARG_ERR("outputs->size = %zu does not reach outputs.handle (%zu bytes needed)", o->size,
                       EPX_STRUCT_END(epx_rm_dispatch_outputs_t, handle));

    EPX_CHECK(check_dispatch_dtype(buffer, &a->hidden, "hidden", RM_DTYPES));
    CHECK_TENSOR(&a->hidden, "hidden", RM_DTYPES & cfg->dispatch_dtypes, 2, {EPX_ANY_DIM, H}, "T,H",
                 EPX_TENSOR_TOKENS);
    const int64_t T = a->hidden.shape[0];
    const bool fp8 = a->hidden.dtype == EPX_DTYPE_FP8_E4M3;
    EPX_CHECK(check_tokens(buffer, "hidden", T));
    if (fp8)
        CHECK_TENSOR(&a->scaling_factor, "scaling_factor", BIT(FP32), 2, {T, H / 128}, "T,H/128", 0);
    else if (epx_api_present(&a->scaling_factor))
        return ARG_ERR("scaling_factor is given but hidden is %s (scales go with fp8_e4m3 only)",
                       epx_dtype_name(a->hidden.dtype));
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
    epx_error_clear();
    EPX_CHECK(check_buffer(buffer));
    const uint64_t seq = ++buffer->seq;
    epx_rm_dispatch_args_t a = EPX_RM_DISPATCH_ARGS_INIT;
    epx_rm_dispatch_outputs_t o = {.size = sizeof(o), .version = EPX_VERSION_CODE};
    epx_result_t res = rm_dispatch_check(buffer, args, outputs, &a, &o);
    if (res != EPX_SUCCESS) return fail_collective(buffer, seq, res);
    epx_handle_t handle =
        handle_new(buffer, EPX_HANDLE_RM, a.hidden.shape[0], a.hidden.dtype, a.permute ? 1 : 0);
    if (!handle)
        return fail_collective(
            buffer, seq,
            EPX_API_ERR(buffer->comm, EPX_ERR_OUT_OF_MEMORY, "no memory for a routing-map handle"));
    res = buffer->ops->rm_dispatch(buffer, seq, &a, &o, handle);
    if (res != EPX_SUCCESS) {
        handle_discard(handle);
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
    EPX_CHECK(epx_api_read_struct(comm, a, sizeof(*a), args, "args"));
    EPX_CHECK(epx_api_read_struct(comm, o, sizeof(*o), outputs, "outputs"));
    EPX_CHECK(check_mode(buffer, EPX_MODE_PERMUTE, "epx_rm_combine"));
    if (!buffer->ops->rm_combine) return unsupported(buffer, "epx_rm_combine");
    EPX_CHECK(check_handle(buffer, a->handle, EPX_HANDLE_RM, "args.handle"));
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
    epx_error_clear();
    EPX_CHECK(check_buffer(buffer));
    const uint64_t seq = ++buffer->seq;
    epx_rm_combine_args_t a = {.size = sizeof(a), .version = EPX_VERSION_CODE};
    epx_rm_combine_outputs_t o = {.size = sizeof(o), .version = EPX_VERSION_CODE};
    epx_result_t res = rm_combine_check(buffer, args, outputs, &a, &o);
    if (res != EPX_SUCCESS) return fail_collective(buffer, seq, res);
    return buffer->ops->rm_combine(buffer, seq, &a, &o);
}
