/*
 * The bootstrap over caller-supplied collectives (epx_comm_init_callbacks): MPI, torch.distributed
 * or a launcher of the caller's own stand in for the TCP rendezvous.
 */
#include <stdlib.h>

#include "core/bootstrap.h"
#include "core/internal.h"

typedef struct {
    epx_bootstrap_callbacks_t cb;
    int rank, nranks;
} boot_cb_t;

static epx_result_t cb_allgather(void *state, const void *send_buf, void *recv_buf, size_t bytes)
{
    boot_cb_t *s = state;
    int rc = s->cb.allgather(s->cb.ctx, send_buf, recv_buf, bytes);
    if (rc != 0)
        return epx_error(EPX_ERR_BOOTSTRAP,
                         "rank %d: the caller's allgather callback returned %d (%zu bytes per "
                         "rank)",
                         s->rank, rc, bytes);
    return EPX_SUCCESS;
}

static epx_result_t cb_barrier(void *state)
{
    boot_cb_t *s = state;
    int rc = s->cb.barrier(s->cb.ctx);
    if (rc != 0)
        return epx_error(EPX_ERR_BOOTSTRAP, "rank %d: the caller's barrier callback returned %d", s->rank,
                         rc);
    return EPX_SUCCESS;
}

static void cb_close(void *state)
{
    free(state);
}

static const epx_bootstrap_ops_t cb_ops = {cb_allgather, cb_barrier, cb_close};

epx_result_t epx_bootstrap_callbacks_create(const epx_bootstrap_callbacks_t *callbacks, int rank, int nranks,
                                            const epx_bootstrap_ops_t **ops_out, void **state_out)
{
    if (!callbacks) return epx_error(EPX_ERR_INVALID_ARG, "callbacks is NULL");
    if (!callbacks->allgather || !callbacks->barrier)
        return epx_error(EPX_ERR_INVALID_ARG, "callbacks->%s is NULL",
                         !callbacks->allgather ? "allgather" : "barrier");
    if (nranks < 1 || rank < 0 || rank >= nranks)
        return epx_error(EPX_ERR_INVALID_ARG, "callback bootstrap: rank %d is out of range [0, %d)", rank,
                         nranks);
    boot_cb_t *s = calloc(1, sizeof(*s));
    if (!s) return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: callback bootstrap state", rank);
    s->cb = *callbacks;
    s->rank = rank;
    s->nranks = nranks;
    *ops_out = &cb_ops;
    *state_out = s;
    return EPX_SUCCESS;
}
