/*
 * The bootstrap: the collectives a communicator has before any transport exists, over a TCP
 * rendezvous through rank 0 (core/bootstrap.c on the socket layer of core/socket.c) or over the
 * caller's callbacks. Only core/comm.c and the API's epx_get_unique_id reach it.
 */
#ifndef EPX_CORE_BOOTSTRAP_H
#define EPX_CORE_BOOTSTRAP_H

#include "core/internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* All are bounded by the communicator's timeout. */
struct epx_bootstrap_ops {
    epx_result_t (*allgather)(void *state, const void *send, void *recv, size_t bytes);
    epx_result_t (*barrier)(void *state);
    void (*close)(void *state); /* never blocks on a peer */
};

/* Binds rank 0's rendezvous socket (kept for a rank 0 in this process or a forked child) and
 * writes the id naming it. */
epx_result_t epx_bootstrap_unique_id(epx_unique_id_t *id_out);
/* TCP rendezvous through rank 0. */
epx_result_t epx_bootstrap_tcp_create(const epx_unique_id_t *id, int rank, int nranks, int64_t timeout_ms,
                                      const epx_bootstrap_ops_t **ops_out, void **state_out);
/* Caller-supplied callbacks. */
epx_result_t epx_bootstrap_callbacks_create(const epx_bootstrap_callbacks_t *callbacks, int rank, int nranks,
                                            const epx_bootstrap_ops_t **ops_out, void **state_out);

#ifdef __cplusplus
}
#endif

#endif /* EPX_CORE_BOOTSTRAP_H */
