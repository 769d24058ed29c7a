/*
 * The host backend's function table: buffer lifetime (regions, worker pool, LL state), handle
 * release, failure notification, the overflow flag, and the allocation helper the operations
 * share. Operations live in ht.c, ll.c and rm.c.
 */
#include <stdlib.h>

#include "host/host.h"

static epx_result_t host_buffer_create(epx_buffer_t buffer)
{
    epx_comm_t comm = buffer->comm;
    host_buffer_t *hb = calloc(1, sizeof(*hb));
    if (!hb)
        return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: cannot allocate the host buffer state", comm->rank);
    hb->buffer = buffer;
    hb->rank = comm->rank;
    hb->nranks = comm->nranks;
    epx_result_t res = host_peers_open(&hb->peers, comm);
    if (res != EPX_SUCCESS) goto err_free;
    res = host_shm_init(hb);
    if (res != EPX_SUCCESS) goto err_peers;
    if (buffer->config.modes & EPX_MODE_LL) {
        res = host_ll_init(hb);
        if (res != EPX_SUCCESS) goto err_shm;
    }
    buffer->backend_state = hb;
    return EPX_SUCCESS;

err_shm:
    host_shm_fini(hb);
err_peers:
    host_peers_close(&hb->peers);
err_free:
    free(hb);
    return res;
}

static void host_buffer_destroy(epx_buffer_t buffer)
{
    host_buffer_t *hb = buffer->backend_state;
    if (!hb) return;
    if (buffer->config.modes & EPX_MODE_LL) host_ll_fini(hb);
    host_shm_fini(hb);
    host_peers_close(&hb->peers);
    for (int k = 0; k < EPX_MAX_VIEW_AREAS; k++) free(hb->ht_view[k]);
    free(hb);
    buffer->backend_state = NULL;
}

/* The state of either kind of handle is one allocation (host_alloc_parts). */
static void host_handle_free(epx_handle_t handle)
{
    free(handle->backend_state);
    handle->backend_state = NULL;
}

static void host_fail_collective(epx_buffer_t buffer, uint64_t seq, epx_result_t res, void *stream)
{
    if (buffer->backend_state) host_fail(buffer->backend_state, seq, res);
}

static void host_begin_call_op(epx_buffer_t buffer, uint64_t seq, epx_call_kind_t kind)
{
    if (buffer->backend_state) host_begin_call(buffer->backend_state, seq, kind);
}

static epx_result_t host_end_call_op(epx_buffer_t buffer, uint64_t seq, epx_result_t res)
{
    return buffer->backend_state ? host_end_call(buffer->backend_state, seq, res) : res;
}

static void host_notify_destroy_op(epx_buffer_t buffer)
{
    if (buffer->backend_state) host_notify_destroy(buffer->backend_state);
}

static epx_result_t host_query_overflow(epx_buffer_t buffer, int *overflowed_out)
{
    *overflowed_out = atomic_exchange_explicit(&buffer->overflow, 0, memory_order_acq_rel) != 0;
    return EPX_SUCCESS;
}

static size_t part_bytes(size_t bytes)
{
    return (bytes + 15) & ~(size_t)15;
}

void *host_alloc_parts(int n, const size_t bytes[], void *parts[])
{
    size_t total = 0;
    for (int i = 0; i < n; i++) total += part_bytes(bytes[i]);
    uint8_t *block = calloc(1, total ? total : 1);
    if (!block) return NULL;
    for (size_t i = 0, offset = 0; i < (size_t)n; offset += part_bytes(bytes[i]), i++)
        parts[i] = block + offset;
    return block;
}

const epx_backend_ops_t epx_host_backend_ops = {
    .name = "host",
    .comm_init = NULL,
    .comm_destroy = NULL,
    .buffer_create = host_buffer_create,
    .buffer_destroy = host_buffer_destroy,
    .handle_free = host_handle_free,
    .fail_collective = host_fail_collective,
    .begin_call = host_begin_call_op,
    .notify_destroy = host_notify_destroy_op,
    .end_call = host_end_call_op,
    .layout = host_layout,
    .ht_dispatch = host_ht_dispatch,
    .ht_combine = host_ht_combine,
    .ll_dispatch = host_ll_dispatch,
    .ll_combine = host_ll_combine,
    .ll_get_combine_buffer = host_ll_get_combine_buffer,
    .hook_run = host_hook_run,
    .rm_dispatch = host_rm_dispatch,
    .rm_combine = host_rm_combine,
    .query_overflow = host_query_overflow,
    .ht_get_combine_input = host_ht_get_combine_input,
};
