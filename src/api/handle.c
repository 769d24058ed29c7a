/*
 * Handles of HT and routing-map dispatches: made by the dispatch entry points, read and destroyed
 * by the caller; the backend's per-handle state goes with them.
 */
#include <stdlib.h>

#include "api/api.h"

epx_result_t epx_api_handle_new(epx_buffer_t buffer, uint64_t seq, epx_handle_kind_t kind, int64_t T,
                                epx_dtype_t dtype, int32_t permute, void *stream, epx_handle_t *handle_out)
{
    epx_handle_t h = calloc(1, sizeof(*h));
    if (!h)
        return epx_buffer_fail_collective(buffer, seq,
                                          EPX_API_ERR(buffer->comm, EPX_ERR_OUT_OF_MEMORY,
                                                      "no memory for %s handle",
                                                      kind == EPX_HANDLE_HT ? "an HT" : "a routing-map"),
                                          stream);
    /* Registered now, while a failure can still be told to the peers; the caller gets the
     * pointer only on success. */
    epx_result_t res = epx_api_register(h, EPX_API_HANDLE);
    if (res != EPX_SUCCESS) {
        free(h);
        return epx_buffer_fail_collective(buffer, seq, res, stream);
    }
    h->magic = EPX_HANDLE_MAGIC;
    h->kind = kind;
    h->buffer = buffer;
    h->num_tokens = T;
    h->num_recv = -1; /* unknown until the backend fills it */
    h->permute = permute;
    h->x_dtype = dtype;
    h->id = seq;
    *handle_out = h;
    return EPX_SUCCESS;
}

epx_result_t epx_api_handle_filled(epx_handle_t h, epx_result_t res)
{
    if (res == EPX_SUCCESS) {
        atomic_fetch_add(&h->buffer->live_handles, 1);
        return EPX_SUCCESS;
    }
    if (h->backend_state && h->buffer->ops->handle_free) {
        char message[1024];
        epx_error_copy(message, sizeof(message));
        h->buffer->ops->handle_free(h);
        epx_error_set_message(message);
    }
    epx_api_retire(h);
    h->magic = 0;
    free(h);
    return res;
}

EPX_API epx_result_t epx_handle_get_info(epx_handle_t handle, epx_handle_info_t *info_out)
{
    epx_buffer_t buffer;
    EPX_CHECK(epx_api_enter_handle(handle, "epx_handle_get_info", &buffer));
    if (!info_out) {
        epx_api_leave_buffer(buffer);
        return epx_error(EPX_ERR_INVALID_ARG, "info_out is NULL");
    }
    epx_handle_info_t info;
    info.num_tokens = handle->num_tokens;
    info.num_recv_tokens = handle->num_recv;
    info.num_ranks = buffer->comm->nranks;
    info.num_local_experts = buffer->num_local_experts;
    epx_api_leave_buffer(buffer);
    *info_out = info;
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_handle_destroy(epx_handle_t handle)
{
    epx_error_clear();
    if (!handle) return EPX_SUCCESS;
    epx_buffer_t buffer;
    EPX_CHECK(epx_api_enter_handle(handle, "epx_handle_destroy", &buffer));
    epx_api_retire(handle);
    if (buffer->ops->handle_free) buffer->ops->handle_free(handle);
    atomic_fetch_sub(&buffer->live_handles, 1);
    handle->magic = 0;
    free(handle);
    epx_api_leave_buffer(buffer);
    return EPX_SUCCESS;
}
