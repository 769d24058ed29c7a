/*
 * The GIN transport's host side: the NCCL communicator, the regions (symmetric windows), the device
 * communicator and the net.h handle a kernel takes, made from an epx communicator's bootstrap; and their
 * bounded teardown. Internal to libepx (the cuda backend is its user). No NCCL type appears here: only
 * src/net/gin_host.c and the CUDA files that include src/net/gin.cuh see NCCL's headers. In a build
 * without NCCL and the cuda backend, src/core/network.c answers every call with EPX_ERR_UNSUPPORTED and
 * the reason (epx_net_gin_unavailable).
 */
#ifndef EPX_NET_GIN_HOST_H
#define EPX_NET_GIN_HOST_H

#include <stdint.h>

#include "core/internal.h"
#include "net/net.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EPX_GIN_MAX_REGIONS 16 /* = EPX_NET_GIN_MAX_REGIONS of src/net/gin.cuh */

typedef struct epx_gin_open_args {
    /* A caller's ncclComm_t over the same ranks in the same order, used as is and never finalized,
     * destroyed or aborted by epx; NULL: epx creates one (unique id from rank 0 over the bootstrap, non-
     * blocking). A caller's blocking communicator makes its collective steps only as bounded as NCCL
     * makes them: the deadline is checked between them. */
    void *nccl_comm;
    int32_t nregions;                          /* 1 .. EPX_GIN_MAX_REGIONS */
    uint64_t region_bytes[EPX_GIN_MAX_REGIONS]; /* each >= 1, equal on every rank */
    int32_t contexts;                          /* GIN contexts wanted, >= 1; NCCL may give fewer */
    int32_t nsignals;                          /* net.h signals, >= 1 */
    int64_t timeout_ms;                        /* every wait of open and close; <= 0: the comm's */
} epx_gin_open_args_t;

typedef struct epx_gin epx_gin_t;

/* Checks `comm` and `args` (the same in every build): EPX_ERR_INVALID_ARG naming the first bad one.
 * Defined in src/core/network.c. */
epx_result_t epx_gin_check_args(epx_comm_t comm, const epx_gin_open_args_t *args, epx_gin_t **out);

/* Collective over `comm` (a cuda-backend communicator; every rank calls it with the same args): the NCCL
 * communicator (non-blocking init, polled until ready or the deadline, aborted past it), each region
 * allocated with ncclMemAlloc and registered as a symmetric window in order, the device communicator with
 * GIN (contexts, signals, one counter per context), the handle's state in device memory and a
 * device-visible abort word. Every rank reaches the same verdict: a rank that fails its local steps before
 * NCCL is involved tells the others through the bootstrap (they return EPX_ERR_REMOTE). [out] out, written
 * on success only. Errors: EPX_ERR_INVALID_ARG, EPX_ERR_UNSUPPORTED (no NCCL or no cuda backend in this
 * build, not a cuda-backend comm, NCCL without GIN), EPX_ERR_TIMEOUT (a step passed the deadline: the NCCL
 * communicator is aborted), EPX_ERR_REMOTE, EPX_ERR_CUDA, EPX_ERR_OUT_OF_MEMORY; each message names the
 * rank, the NCCL call and NCCL's last error. */
epx_result_t epx_gin_open(epx_comm_t comm, const epx_gin_open_args_t *args, epx_gin_t **out);

/* The net.h handle (transport GIN, impl and abort word in device memory) for a kernel's arguments. */
epx_net_t epx_gin_net(const epx_gin_t *g);
/* This rank's region `region` (device memory of region_bytes[region] bytes); NULL out of range. */
void *epx_gin_region(const epx_gin_t *g, int region);
/* Sets the abort word: every wait and flush of the handle ends with EPX_NET_ABORTED. */
void epx_gin_abort(epx_gin_t *g);

/* Never blocks: EPX_ERR_REMOTE when a peer process on this machine has exited or NCCL reports an
 * asynchronous error (the abort word is then set, so the kernels' waits end), else EPX_SUCCESS. */
epx_result_t epx_gin_poll(epx_gin_t *g);

/* A kernel's net.h status turned into an epx error naming `what` (a wait, a post): EPX_SUCCESS for
 * EPX_NET_OK; EPX_ERR_REMOTE when a peer has exited or NCCL has an asynchronous error (named), else
 * EPX_ERR_TIMEOUT for EPX_NET_TIMEOUT and EPX_NET_ABORTED, EPX_ERR_INVALID_ARG for EPX_NET_INVALID,
 * EPX_ERR_INTERNAL for the rest. */
epx_result_t epx_gin_wait_result(epx_gin_t *g, epx_net_status_t status, const char *what);

/* Ends what epx_gin_open made, bounded by its deadline (the open args' timeout): the abort word is set
 * first (the caller's kernels must have ended, or their waits end now); then, with every peer alive, the
 * device communicator, the windows, the memory, ncclCommFinalize polled until done, ncclCommDestroy;
 * with a peer gone, NCCL's asynchronous error, or a step past the deadline, ncclCommAbort and then the
 * memory. A caller's ncclComm_t is never finalized or aborted: with a peer gone its windows and their
 * memory are left to the caller's abort. Not collective in the sense of waiting for peers beyond the
 * deadline. Frees `g` in every case (NULL is accepted). Returns the first failure: EPX_ERR_REMOTE (a peer
 * gone: the communicator was aborted), EPX_ERR_TIMEOUT, or NCCL's or CUDA's error. */
epx_result_t epx_gin_close(epx_gin_t *g);

#ifdef __cplusplus
}
#endif

#endif
