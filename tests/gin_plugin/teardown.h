/*
 * Closing one context of the test GIN plugin (closeColl), apart from CUDA so that the CPU tests run the
 * same sequence: drain this rank's operations, tell every peer this rank posts nothing more, keep
 * applying the peers' signal adds until each has said the same (or is gone), then the queue core's
 * close fails whatever is left. Every step is bounded by one deadline.
 */
#ifndef EPX_GIN_PLUGIN_TEARDOWN_H
#define EPX_GIN_PLUGIN_TEARDOWN_H

#include <stddef.h>
#include <stdint.h>

#include "link.h"
#include "queue.h"

/* The receiving side of a mover: applies the adds peers posted to this rank. */
typedef struct gin_server {
    void *state;
    /* Applies what is published, without blocking; 0, or -1 with a message. */
    int (*serve)(void *state, char *err, size_t err_len);
    /* 1 when no published add is waiting or being applied. */
    int (*idle)(void *state);
    /* Optional: where warnings go (a failed serve, peers that did not finish). */
    void (*warn)(const char *msg);
} gin_server_t;

/* Closes context `context` of rank `rank` within deadline_ms (never past it, plus one pass): GINQ_OK when
 * everything drained; otherwise the core's close result (GINQ_ETIMEDOUT for what was abandoned,
 * GINQ_EFAILED for a context in error) with the message naming rank, context and operation in err. The
 * context is left closed, not destroyed. */
ginq_result_t gin_teardown(ginq_t *q, link_t *l, const gin_server_t *srv, int rank, int context,
                           uint64_t deadline_ms, char *err, size_t err_len);

#endif
