/*
 * The host model of epx's network interface (net.h): N emulated ranks in one process, each with
 * registered regions and a signal array; posts queue per (source rank, context) and a progress
 * function delivers them. It is the semantic reference the cuda `loop` transport and the GIN
 * transport must match, and a test instrument only: never a production path.
 */
#ifndef EPX_NET_LOOP_MODEL_H
#define EPX_NET_LOOP_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "net/net.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EPX_NET_MODEL_MAX_RANKS   64
#define EPX_NET_MODEL_MAX_REGIONS 16

typedef enum epx_net_model_mode {
    /* Every (source, context) queue delivers whole operations in post order. */
    EPX_NET_MODEL_NORMAL = 0,
    /* A seeded choice among every step the rules allow: sources read late, puts of a context land in
     * any order, weak signals delayed past later operations, strong signals only after every earlier
     * put of their context to their peer (puts to other peers may still be in flight). */
    EPX_NET_MODEL_STRICT = 1,
} epx_net_model_mode_t;

typedef struct epx_net_model_config {
    int nranks;         /* 1..EPX_NET_MODEL_MAX_RANKS */
    uint32_t ncontexts; /* >= 1 */
    uint32_t nsignals;  /* >= 1, per rank */
    epx_net_model_mode_t mode;
    uint64_t seed; /* strict mode's choices */
    /* Non-zero: every poll of a wait runs one progress step, so one thread can post and wait. Zero:
     * some other thread calls epx_net_model_progress. */
    int progress_in_wait;
    const int32_t *abort_word; /* copied into every handle; may be NULL */
} epx_net_model_config_t;

typedef struct epx_net_model epx_net_model_t;

/* [out] model_out on EPX_NET_OK. EPX_NET_INVALID names the bad field (epx_net_model_message()). */
epx_net_status_t epx_net_model_create(const epx_net_model_config_t *config, epx_net_model_t **model_out);
/* Frees the model and every operation still queued (their bytes never land). NULL is a no-op. */
void epx_net_model_destroy(epx_net_model_t *model);

/* Registers `bytes` at `base` for `rank`; [out] region_out is its index, counted per rank from 0 in
 * registration order (register in the same order on every rank for symmetric indices). */
epx_net_status_t epx_net_model_register(epx_net_model_t *model, int rank, void *base, size_t bytes,
                                        uint32_t *region_out);

/* [out] net_out: rank's handle on the model (transport EPX_NET_TRANSPORT_MODEL). */
epx_net_status_t epx_net_model_handle(epx_net_model_t *model, int rank, epx_net_t *net_out);

/* Runs up to `max_steps` delivery steps; returns how many ran (0: nothing is pending). A step is one
 * whole operation in normal mode; one source read, landing or signal in strict mode. */
size_t epx_net_model_progress(epx_net_model_t *model, size_t max_steps);

/* Operations posted and not yet complete (bytes landed and signal added). */
size_t epx_net_model_pending(epx_net_model_t *model);

/* Why the calling thread's last failed model call failed. */
const char *epx_net_model_message(void);

#ifdef __cplusplus
}
#endif

#endif
