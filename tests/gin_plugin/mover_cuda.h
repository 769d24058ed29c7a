/*
 * The CUDA mover of the test GIN plugin: the queue core's mover (queue.h) for ranks that are
 * processes of one machine sharing GPUs, over the link (link.h).
 *  - Registration (collective, in regMrSym order): each rank exports its region (a VMM allocation as a
 *    POSIX fd passed over the link socket, a cudaMalloc allocation as a CUDA IPC handle; memory that
 *    allows neither, like NCCL's own signal buffer, stays unmapped) and maps the others'.
 *  - A put is a cudaMemcpyAsync from the local source into the peer's mapping on the mover's stream,
 *    complete when the event recorded after it has completed.
 *  - A signal add is applied by the rank that owns the signal word, never by the sender: the sender
 *    posts (region, offset, value) into the owner's mailbox; the owner's progress (cuda_mover_serve)
 *    reads the word, adds and writes it back with stream-ordered copies, then publishes the ticket as
 *    applied. One writer per word, so adders in several processes never lose each other's adds; the
 *    copies run on copy engines, so no SM is needed while the owner's kernel spins on the signal.
 * Calls to the mover functions come under the queue context's mutex; serve, register and deregister
 * take the mover's own mutex. Nothing here waits: peers are waited on only with deadlines.
 */
#ifndef EPX_GIN_PLUGIN_MOVER_CUDA_H
#define EPX_GIN_PLUGIN_MOVER_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "link.h"
#include "queue.h"

typedef struct cuda_mover cuda_mover_t;
typedef struct cuda_region cuda_region_t;

/* A mover over a connected link, for a queue context of `capacity` requests. */
int cuda_mover_create(link_t *link, int capacity, cuda_mover_t **out, char *err, size_t err_len);
void cuda_mover_interface(cuda_mover_t *m, ginq_mover_t *out);

/* Collective over the link: registers [data, data + size) (type GIN11_PTR_HOST or _CUDA) and maps
 * every peer's region of this registration. *out's core region (cuda_region_core) is what the queue
 * core checks offsets against. */
int cuda_mover_register(cuda_mover_t *m, void *data, size_t size, int type, cuda_region_t **out, char *err,
                        size_t err_len);
ginq_region_t *cuda_region_core(cuda_region_t *r);
/* Unmaps the peers' regions and frees r. */
void cuda_mover_deregister(cuda_mover_t *m, cuda_region_t *r);

/* Applies the signal adds peers posted to this rank, without blocking; 0, or -1 with a message. */
int cuda_mover_serve(cuda_mover_t *m, char *err, size_t err_len);
/* 1 when no posted add is waiting or being applied here. */
int cuda_mover_serve_idle(cuda_mover_t *m);
/* Tells every peer this rank posts nothing more; 1 once every peer has told this rank the same. */
void cuda_mover_mark_sender_done(cuda_mover_t *m);
int cuda_mover_peers_done(cuda_mover_t *m);

void cuda_mover_destroy(cuda_mover_t *m);

#endif
