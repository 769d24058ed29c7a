/*
 * epx_buffer_refuse_collective: a collective call that its caller (a binding that converts and
 * checks its inputs first) refused before making it. It takes the call's place as the library's
 * own checks would have refused it: numbered, counted (the LL slot) and told to the peers.
 */
#include "api/api.h"

/* The entry point of each kind, for messages. */
static const char *const call_names[] = {
    [EPX_COLLECTIVE_HT_DISPATCH] = "epx_ht_dispatch", [EPX_COLLECTIVE_HT_COMBINE] = "epx_ht_combine",
    [EPX_COLLECTIVE_LL_DISPATCH] = "epx_ll_dispatch", [EPX_COLLECTIVE_LL_COMBINE] = "epx_ll_combine",
    [EPX_COLLECTIVE_RM_DISPATCH] = "epx_rm_dispatch", [EPX_COLLECTIVE_RM_COMBINE] = "epx_rm_combine",
};

static bool is_failure(epx_result_t code)
{
    switch (code) {
#define EPX_FAILURE_CASE_(name, value, text) case EPX_##name:
        EPX_RESULT_MAP(EPX_FAILURE_CASE_)
#undef EPX_FAILURE_CASE_
        return code != EPX_SUCCESS;
    }
    return false;
}

static epx_result_t refuse_collective(epx_buffer_t buffer, epx_collective_t kind, epx_result_t code,
                                      const char *reason, void *stream)
{
    if (kind < EPX_COLLECTIVE_HT_DISPATCH || kind > EPX_COLLECTIVE_RM_COMBINE)
        return EPX_API_ERR(buffer->comm, EPX_ERR_INVALID_ARG,
                           "epx_buffer_refuse_collective: kind = %d is not an epx_collective_t", (int)kind);
    const uint64_t seq = ++buffer->seq; /* as api/collective.c numbers every call */
    /* What a refused call counts besides its number: an LL dispatch its slot (api/ll.c counts it
     * before any check), so every rank keeps the same slot order. */
    if (kind == EPX_COLLECTIVE_LL_DISPATCH) buffer->ll_dispatches++;
    if (!is_failure(code)) code = EPX_ERR_INVALID_ARG;
    if (reason)
        epx_error(code, "%s", reason);
    else
        epx_error(code, "rank %d: the caller refused its %s call", buffer->comm->rank, call_names[kind]);
    return epx_buffer_fail_collective(buffer, seq, code, stream);
}

EPX_API epx_result_t epx_buffer_refuse_collective(epx_buffer_t buffer, epx_collective_t kind,
                                                  epx_result_t code, const char *reason, void *stream)
{
    EPX_API_HOLDING_BUFFER(buffer, "epx_buffer_refuse_collective",
                           refuse_collective(buffer, kind, code, reason, stream));
}
