/*
 * The collective entry points. Every rank makes these calls on a buffer in the same order, so
 * each numbers its call, checks its arguments (api/ht.c, api/ll.c, api/rm.c) and, when a check
 * fails, tells the peers, which then return EPX_ERR_REMOTE instead of waiting; only then does
 * the backend run. Handles and [out] fields are written on success only.
 */
#include <string.h>

#include "api/api.h"

uint64_t epx_api_collective_begin(epx_buffer_t buffer, epx_call_kind_t kind)
{
    const uint64_t seq = ++buffer->seq;
    if (buffer->ops->begin_call) buffer->ops->begin_call(buffer, seq, kind);
    return seq;
}

/* The backend's result of call `seq`, through its end step (ops->end_call). */
static epx_result_t collective_end(epx_buffer_t buffer, uint64_t seq, epx_result_t res)
{
    return buffer->ops->end_call ? buffer->ops->end_call(buffer, seq, res) : res;
}

/* `res`: the verdict of the call's checks. `stream` is read only after they ran, so a refusal is
 * told to the peers on the call's stream as far as it could be read. */
static epx_result_t collective_checked(epx_buffer_t buffer, uint64_t seq, epx_result_t res,
                                       void *const *stream)
{
    return res == EPX_SUCCESS ? EPX_SUCCESS : epx_buffer_fail_collective(buffer, seq, res, *stream);
}

/* The start of every entry point: number the call, then read and check the caller's structs into
 * the copies `a` and `o` (declared here with `seq`) over their defaults. */
#define COLLECTIVE_ENTER(op, OP)                                  \
    const uint64_t seq = epx_api_collective_begin(buffer, EPX_CALL_##OP); \
    epx_##op##_args_t a = EPX_##OP##_ARGS_INIT;                   \
    epx_##op##_outputs_t o = EPX_##OP##_OUTPUTS_INIT;             \
    EPX_CHECK(                                                    \
        collective_checked(buffer, seq, epx_api_check_##op(buffer, seq, args, outputs, &a, &o), &a.stream))

/* An entry point whose backend writes every output itself (the combines of HT and routing-map). */
#define COLLECTIVE_PLAIN(op, OP)                                               \
    static epx_result_t op(epx_buffer_t buffer, const epx_##op##_args_t *args, \
                           epx_##op##_outputs_t *outputs)                      \
    {                                                                          \
        COLLECTIVE_ENTER(op, OP);                                              \
        return collective_end(buffer, seq, buffer->ops->op(buffer, seq, &a, &o)); \
    }                                                                          \
    COLLECTIVE_ENTRY(op)

/* The public entry point of `op`: the buffer is taken for this thread before the call is numbered,
 * so a refused concurrent entry consumes no sequence number and tells no peer. */
#define COLLECTIVE_ENTRY(op)                                                          \
    EPX_API epx_result_t epx_##op(epx_buffer_t buffer, const epx_##op##_args_t *args, \
                                  epx_##op##_outputs_t *outputs)                      \
    {                                                                                 \
        EPX_API_HOLDING_BUFFER(buffer, "epx_" #op, op(buffer, args, outputs));        \
    }

static epx_result_t ht_dispatch(epx_buffer_t buffer, const epx_ht_dispatch_args_t *args,
                                epx_ht_dispatch_outputs_t *outputs)
{
    COLLECTIVE_ENTER(ht_dispatch, HT_DISPATCH);
    epx_handle_t handle = a.cached_handle;
    if (!handle)
        EPX_CHECK(
            epx_api_handle_new(buffer, seq, EPX_HANDLE_HT, a.x.shape[0], a.x.dtype, 0, a.stream, &handle));
    if (!a.cached_handle) handle->is_static = a.num_worst_tokens > 0;
    /* The call may rewrite its view area whatever its outcome. */
    if (a.recv_in_buffer) buffer->view_areas[a.view_area].x = NULL;
    epx_result_t res = collective_end(buffer, seq, buffer->ops->ht_dispatch(buffer, seq, &a, &o, handle));
    if (!a.cached_handle) res = epx_api_handle_filled(handle, res);
    EPX_CHECK(res);
    if (!a.cached_handle) o.handle = handle;
    if (a.recv_in_buffer) {
        buffer->view_areas[a.view_area].x = o.recv_x.data;
        buffer->view_areas[a.view_area].handle_id = handle->id;
        buffer->view_areas[a.view_area].rows = o.recv_x.shape[0];
        buffer->view_areas[a.view_area].dtype = o.recv_x.dtype;
        WRITE_OUT(outputs, &o, epx_ht_dispatch_outputs_t, recv_x);
        WRITE_OUT(outputs, &o, epx_ht_dispatch_outputs_t, recv_x_scales);
        WRITE_OUT(outputs, &o, epx_ht_dispatch_outputs_t, recv_topk_idx);
        WRITE_OUT(outputs, &o, epx_ht_dispatch_outputs_t, recv_topk_weights);
    }
    WRITE_OUT(outputs, &o, epx_ht_dispatch_outputs_t, num_recv_tokens_host);
    WRITE_OUT(outputs, &o, epx_ht_dispatch_outputs_t, handle);
    return EPX_SUCCESS;
}
COLLECTIVE_ENTRY(ht_dispatch)

/* epx_ht_combine */
COLLECTIVE_PLAIN(ht_combine, HT_COMBINE)

/* An LL entry point: the backend fills `o`; on success the hook is written when the call asked for one,
 * and `write_more` writes the op's other [out] fields. The LL slot is counted by the checks, failed calls
 * too. */
#define COLLECTIVE_LL(op, OP, write_more)                                           \
    static epx_result_t op(epx_buffer_t buffer, const epx_##op##_args_t *args,      \
                           epx_##op##_outputs_t *outputs)                           \
    {                                                                               \
        COLLECTIVE_ENTER(op, OP);                                                   \
        EPX_CHECK(collective_end(buffer, seq, buffer->ops->op(buffer, seq, &a, &o))); \
        write_more;                                                                 \
        if (a.return_recv_hook) WRITE_OUT(outputs, &o, epx_##op##_outputs_t, hook); \
        return EPX_SUCCESS;                                                         \
    }                                                                               \
    COLLECTIVE_ENTRY(op)

COLLECTIVE_LL(ll_dispatch, LL_DISPATCH, WRITE_OUT(outputs, &o, epx_ll_dispatch_outputs_t, handle))
COLLECTIVE_LL(ll_combine, LL_COMBINE, (void)0)

static epx_result_t rm_dispatch(epx_buffer_t buffer, const epx_rm_dispatch_args_t *args,
                                epx_rm_dispatch_outputs_t *outputs)
{
    COLLECTIVE_ENTER(rm_dispatch, RM_DISPATCH);
    epx_handle_t handle;
    EPX_CHECK(epx_api_handle_new(buffer, seq, EPX_HANDLE_RM, a.hidden.shape[0], a.hidden.dtype,
                                 a.permute ? 1 : 0, a.stream, &handle));
    EPX_CHECK(epx_api_handle_filled(
        handle, collective_end(buffer, seq, buffer->ops->rm_dispatch(buffer, seq, &a, &o, handle))));
    o.handle = handle;
    WRITE_OUT(outputs, &o, epx_rm_dispatch_outputs_t, num_tokens_host);
    WRITE_OUT(outputs, &o, epx_rm_dispatch_outputs_t, handle);
    return EPX_SUCCESS;
}
COLLECTIVE_ENTRY(rm_dispatch)

/* epx_rm_combine */
COLLECTIVE_PLAIN(rm_combine, RM_COMBINE)
