/*
 * epx_buffer_refuse_collective: a collective call that its caller (a binding that converts and
 * checks its inputs first) refused before making it. It takes the call's place as the library's
 * own checks would have refused it: numbered, counted (the LL slot) and told to the peers.
 */
#include "api/api.h"

/* The public kinds are the library's call kinds, value for value. */
_Static_assert((int)EPX_COLLECTIVE_HT_DISPATCH == (int)EPX_CALL_HT_DISPATCH &&
                   (int)EPX_COLLECTIVE_HT_COMBINE == (int)EPX_CALL_HT_COMBINE &&
                   (int)EPX_COLLECTIVE_LL_DISPATCH == (int)EPX_CALL_LL_DISPATCH &&
                   (int)EPX_COLLECTIVE_LL_COMBINE == (int)EPX_CALL_LL_COMBINE &&
                   (int)EPX_COLLECTIVE_RM_DISPATCH == (int)EPX_CALL_RM_DISPATCH &&
                   (int)EPX_COLLECTIVE_RM_COMBINE == (int)EPX_CALL_RM_COMBINE,
               "epx_collective_t and epx_call_kind_t differ");

static epx_result_t refuse_collective(epx_buffer_t buffer, epx_collective_t kind, epx_result_t code,
                                      const char *reason, void *stream)
{
    if (kind < EPX_COLLECTIVE_HT_DISPATCH || kind > EPX_COLLECTIVE_RM_COMBINE)
        return EPX_API_ERR(buffer->comm, EPX_ERR_INVALID_ARG,
                           "epx_buffer_refuse_collective: kind = %d is not an epx_collective_t", (int)kind);
    const uint64_t seq = epx_api_collective_begin(buffer, (epx_call_kind_t)kind);
    /* What a refused call counts besides its number: an LL dispatch its slot (api/ll.c counts it
     * before any check), so every rank keeps the same slot order. */
    if (kind == EPX_COLLECTIVE_LL_DISPATCH) buffer->ll_dispatches++;
    if (!epx_result_is_failure(code)) code = EPX_ERR_INVALID_ARG;
    if (reason)
        epx_error(code, "%s", reason);
    else
        epx_error(code, "rank %d: the caller refused its %s call", buffer->comm->rank, epx_call_name(kind));
    return epx_buffer_fail_collective(buffer, seq, code, stream);
}

EPX_API epx_result_t epx_buffer_refuse_collective(epx_buffer_t buffer, epx_collective_t kind,
                                                  epx_result_t code, const char *reason, void *stream)
{
    EPX_API_HOLDING_BUFFER(buffer, "epx_buffer_refuse_collective",
                           refuse_collective(buffer, kind, code, reason, stream));
}
