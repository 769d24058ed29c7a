/*
 * Buffers: creation (every rank checks its config, then all compare them), destruction and the
 * overflow query.
 */
#include <stdlib.h>
#include <string.h>

#include "api/api.h"

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
    int32_t num_view_areas;
} create_msg_t;

static epx_result_t compare_configs(epx_comm_t comm, const create_msg_t *msgs)
{
    for (int r = 1; r < comm->nranks; r++) {
#define CMP_FIELD_(field, fmt, cast)                                                                        \
    if (msgs[r].field != msgs[0].field)                                                                     \
        return EPX_API_ERR(comm, EPX_ERR_MISMATCH, #field " differs: rank 0 has " fmt ", rank %d has " fmt, \
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
        CMP_FIELD_(num_view_areas, "%d", int)
#undef CMP_FIELD_
    }
    return EPX_SUCCESS;
}

/* epx_buffer_create with `comm` taken for this thread. */
static epx_result_t create(epx_comm_t comm, const epx_buffer_config_t *config, epx_buffer_t *buffer_out)
{
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
    /* Registered before the exchange so that no failure can follow the peers' success; nobody
     * holds the pointer until it is returned. */
    if (local == EPX_SUCCESS && (local = epx_api_register(buffer, EPX_API_BUFFER)) != EPX_SUCCESS) {
        free(buffer);
        buffer = NULL;
    }
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
        mine.num_view_areas = cfg.num_view_areas;
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
                              r, epx_result_str((epx_result_t)msgs[r].status));
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
    atomic_init(&buffer->busy, 0);
    EPX_CHECK_GOTO(buffer->ops->buffer_create(buffer), res, err_free_buffer);
    atomic_fetch_add(&comm->live_buffers, 1);
    *buffer_out = buffer;
    return EPX_SUCCESS;

err_free_msgs:
    free(msgs);
err_free_buffer:
    if (buffer) {
        epx_api_retire(buffer);
        buffer->magic = 0;
    }
    free(buffer);
    return res;
}

EPX_API epx_result_t epx_buffer_create(epx_comm_t comm, const epx_buffer_config_t *config,
                                       epx_buffer_t *buffer_out)
{
    epx_error_clear();
    if (!comm) return epx_error(EPX_ERR_INVALID_ARG, "comm is NULL");
    /* Refused before the exchange: a misuse stays local, the peers are not told. */
    EPX_CHECK(epx_api_enter_comm(comm, "epx_buffer_create"));
    epx_result_t res = create(comm, config, buffer_out);
    epx_api_leave_comm(comm);
    return res;
}

/* Destroy with `buffer` taken for this thread: on success it is retired and freed, never given
 * back. */
static epx_result_t destroy(epx_buffer_t buffer)
{
    epx_comm_t comm = buffer->comm;
    int handles = atomic_load(&buffer->live_handles);
    if (handles > 0) {
        epx_result_t res =
            ARG_ERR("the buffer still has %d live handles; destroy them (epx_handle_destroy) first", handles);
        epx_api_leave_buffer(buffer);
        return res;
    }
    epx_api_retire(buffer);
    /* Peers inside a collective on the buffer learn it now instead of at their timeout. */
    if (buffer->ops->notify_destroy) buffer->ops->notify_destroy(buffer);
    if (buffer->ops->buffer_destroy) buffer->ops->buffer_destroy(buffer);
    atomic_fetch_sub(&comm->live_buffers, 1);
    buffer->magic = 0;
    free(buffer);
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_buffer_destroy(epx_buffer_t buffer)
{
    epx_error_clear();
    if (!buffer) return EPX_SUCCESS;
    EPX_CHECK(epx_api_enter_buffer(buffer, "epx_buffer_destroy"));
    return destroy(buffer);
}

static epx_result_t query_overflow(epx_buffer_t buffer)
{
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

EPX_API epx_result_t epx_buffer_query_overflow(epx_buffer_t buffer)
{
    EPX_API_HOLDING_BUFFER(buffer, "epx_buffer_query_overflow", query_overflow(buffer));
}
