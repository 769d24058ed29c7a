/*
 * The CPU fixture of the test GIN plugin's queue test: three ranks' buffers in one process and a
 * mover over them (memcpy and __atomic adds) that lands transfers when polled, after a seeded number
 * of polls when `lazy`, and can stall a peer or an operation or fail a peer, logging what landed.
 */
#ifndef EPX_GIN_PLUGIN_FIXTURE_H
#define EPX_GIN_PLUGIN_FIXTURE_H

#include <stdint.h>

#include "queue.h"

#define NR         3
#define CHUNK      32
#define CHUNKS     512
#define BUF        (CHUNK * CHUNKS)
#define NSIG       4
#define MAX_XFERS  1024
#define MAX_EVENTS 4096

typedef struct xfer {
    int used, landed, is_signal, polls_left;
    ginq_op_t op;
} xfer_t;

typedef struct event {
    int is_signal;
    uint64_t ordinal;
} event_t;

typedef struct mover {
    uint64_t rng;
    int lazy;
    int stall_peer;         /* transfers to this peer never land (a dead peer); -1: none */
    uint64_t stall_ordinal; /* this operation's transfers never land; 0: none */
    int fail_peer;          /* polls of transfers to this peer fail; -1: none */
    xfer_t xfers[MAX_XFERS];
    event_t log[MAX_EVENTS];
    int nlog;
    uint64_t put_issued[MAX_EVENTS]; /* ordinals of puts in the order the core started them */
    int nissued;
    int released, abandoned;
} mover_t;

typedef struct fixture {
    uint8_t src[NR][BUF];
    uint8_t dst[NR][BUF];
    uint64_t sig[NR][NSIG];
    void *src_bases[NR], *dst_bases[NR], *sig_bases[NR];
    ginq_region_t src_region, dst_region, sig_region;
    mover_t mover;
    ginq_mover_t iface;
} fixture_t;

/* Buffers filled from `seed` (source bytes differ per rank and offset), signals zero, mover idle. */
fixture_t *fixture_new(uint64_t seed, int lazy);
/* A context of rank 0 over the fixture's mover with the given faults; NULL (reason printed) on error. */
ginq_t *queue_new(fixture_t *f, int context, int capacity, const char *faults);
/* A put of chunk `chunk` (CHUNK bytes at the same offset in source and destination) to `peer`. */
ginq_desc_t put_desc(fixture_t *f, int peer, int chunk);
/* Adds a signal on word `id` of the signal region to d. */
void add_signal(fixture_t *f, ginq_desc_t *d, int id, ginq_signal_op_t op, uint64_t value, int weak);
/* Chunk `chunk` of rank 0's source has landed at `peer`. */
int chunk_landed(const fixture_t *f, int peer, int chunk);

#endif
