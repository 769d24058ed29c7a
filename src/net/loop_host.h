/*
 * The `loop` test transport's host side (src/net/loop.h says what it is): each rank's regions and signal
 * words in device memory, exported to every other rank of the machine through CUDA IPC and mapped there
 * into the transport's own state, never into a kernel's arguments; the net.h handle kernels take; the
 * bounded teardown. Internal to libepx and built with the cuda backend; its only users are tests and
 * the emulated-node runs. Every rank of the communicator must be a process on this machine.
 */
#ifndef EPX_NET_LOOP_HOST_H
#define EPX_NET_LOOP_HOST_H

#include <stdint.h>

#include "core/internal.h"
#include "net/loop.h"
#include "net/net.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct epx_loop_open_args {
    int32_t nregions;                                /* 1 .. EPX_NET_LOOP_MAX_REGIONS */
    uint64_t region_bytes[EPX_NET_LOOP_MAX_REGIONS]; /* each >= 1, equal on every rank */
    int32_t contexts;                                /* 1 .. EPX_NET_LOOP_MAX_CONTEXTS */
    int32_t nsignals;                                /* >= 1 */
    int32_t strict;                                  /* 1: strict mode (src/net/loop.h) */
    int64_t timeout_ms;                              /* every wait of open and close; <= 0: the comm's */
} epx_loop_open_args_t;

typedef struct epx_loop epx_loop_t;

/* Collective over `comm` (a cuda-backend communicator whose ranks are processes of this machine; every
 * rank calls it with the same args): regions and signal words allocated and zeroed, exported, mapped by
 * every other rank, the device state and a device-visible abort word. Every rank reaches the same verdict
 * (a rank that fails tells the others: they return EPX_ERR_REMOTE). [out] out, written on success only.
 * Errors: EPX_ERR_INVALID_ARG (naming the argument), EPX_ERR_MISMATCH (ranks disagree on the shape),
 * EPX_ERR_UNSUPPORTED (not a cuda-backend comm, ranks on another host), EPX_ERR_REMOTE, EPX_ERR_CUDA,
 * EPX_ERR_OUT_OF_MEMORY, EPX_ERR_TIMEOUT. */
epx_result_t epx_loop_open(epx_comm_t comm, const epx_loop_open_args_t *args, epx_loop_t **out);
/* The net.h handle (transport LOOP, impl and abort word in device memory) for a kernel's arguments. */
epx_net_t epx_loop_net(const epx_loop_t *l);
/* This rank's region `region` (device memory); NULL out of range. */
void *epx_loop_region(const epx_loop_t *l, int region);
/* Sets the abort word: every wait and flush of the handle ends with EPX_NET_ABORTED. */
void epx_loop_abort(epx_loop_t *l);
/* Never blocks: EPX_ERR_REMOTE when a peer process has exited (the abort word is then set). */
epx_result_t epx_loop_poll(epx_loop_t *l);
/* A kernel's net.h status as an epx error naming `what`, as epx_gin_wait_result does. */
epx_result_t epx_loop_wait_result(epx_loop_t *l, epx_net_status_t status, const char *what);
/* Sets the abort word (the caller's kernels must have ended, or their waits end now); with every peer
 * alive, a bootstrap barrier (no rank unmaps what another still writes, bounded by the comm's timeout),
 * then unmaps and frees; with a peer gone, unmaps and frees at once. Frees `l` in every case (NULL is
 * accepted). Returns EPX_ERR_REMOTE when a peer was gone, the barrier's error, or EPX_SUCCESS. */
epx_result_t epx_loop_close(epx_loop_t *l);

#ifdef __cplusplus
}
#endif

#endif
