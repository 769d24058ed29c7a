/*
 * epx_buffer_refuse_collective: a collective call that its caller (a binding that converts and
 * checks its inputs first) refused before making it. It takes the call's place as the library's
 * own checks would have refused it: numbered, counted (the LL slot) and told to the peers.
 */
#include "api/api.h"

/* Runs the checks of `op` on no arguments. They refuse at their first read (args is NULL), after
 * counting what every call of the kind counts, failed ones included (an LL dispatch's slot), so
 * the refusal leaves the buffer as a call refused by them does. Their message is replaced. */
#define REFUSED_CHECKS(op, OP)                                                \
    case EPX_COLLECTIVE_##OP: {                                               \
        epx_##op##_args_t a = EPX_##OP##_ARGS_INIT;                           \
        epx_##op##_outputs_t o = EPX_##OP##_OUTPUTS_INIT;                     \
        (void)epx_api_check_##op(buffer, seq, NULL, NULL, &a, &o);            \
        return "epx_" #op;                                                    \
    }

/* Counts call `seq` as a refused call of `kind`; returns the entry point's name (NULL: no kind). */
static const char *count_refused(epx_buffer_t buffer, uint64_t seq, epx_collective_t kind)
{
    switch (kind) {
        REFUSED_CHECKS(ht_dispatch, HT_DISPATCH)
        REFUSED_CHECKS(ht_combine, HT_COMBINE)
        REFUSED_CHECKS(ll_dispatch, LL_DISPATCH)
        REFUSED_CHECKS(ll_combine, LL_COMBINE)
        REFUSED_CHECKS(rm_dispatch, RM_DISPATCH)
        REFUSED_CHECKS(rm_combine, RM_COMBINE)
    }
    return NULL;
}

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
    const char *op = count_refused(buffer, seq, kind);
    if (!is_failure(code)) code = EPX_ERR_INVALID_ARG;
    if (reason)
        epx_error(code, "%s", reason);
    else
        epx_error(code, "rank %d: the caller refused its %s call", buffer->comm->rank, op);
    return epx_buffer_fail_collective(buffer, seq, code, stream);
}

EPX_API epx_result_t epx_buffer_refuse_collective(epx_buffer_t buffer, epx_collective_t kind,
                                                  epx_result_t code, const char *reason, void *stream)
{
    EPX_API_HOLDING_BUFFER(buffer, "epx_buffer_refuse_collective",
                           refuse_collective(buffer, kind, code, reason, stream));
}
