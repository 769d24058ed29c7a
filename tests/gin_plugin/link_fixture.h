/*
 * The multi-process fixture of the link test (test_link.c): a block shared by the forked ranks (their
 * listen handles, a bounded barrier, markers), the join that gives each rank a connected link, and a
 * CPU mover over the link for the queue core: puts are memcpy into the peer's shared-memory region
 * (a memfd passed over the link at setup), signal adds go through the owner's mailbox and are applied
 * by the owner's server, as the CUDA mover does with copies.
 */
#ifndef EPX_GIN_PLUGIN_LINK_FIXTURE_H
#define EPX_GIN_PLUGIN_LINK_FIXTURE_H

#include <pthread.h>
#include <stdint.h>

#include "link.h"
#include "queue.h"
#include "teardown.h"

#define LT_MAX_RANKS  4
#define LT_DATA       4096 /* bytes of each rank's put destination */
#define LT_NSIG       8    /* signal words per rank */
#define LT_SIG_REGION 7    /* the serial adds name the signal region by */
#define LT_XFERS      512

/* Anonymous shared memory, mapped before the ranks fork. */
typedef struct lt_shared {
    int nranks;
    int joined;     /* ranks that published their handle */
    int arrived[8]; /* barrier counts, one per barrier index */
    int32_t pid[LT_MAX_RANKS];
    link_handle_t handle[LT_MAX_RANKS];
    int marker[LT_MAX_RANKS]; /* per-case progress flags */
} lt_shared_t;

/* Every rank of a case calls it: listens, publishes its handle, waits (bounded) for the others' and
 * connects with the given deadline and ring slots. absent: this rank listens and publishes but never
 * connects (returns 0 after publishing, *l not connected). Returns 0, or 1 with a message printed;
 * on a failed connect the message is in err (when err != NULL) and 2 is returned. */
int lt_join(lt_shared_t *sh, int rank, uint64_t deadline_ms, uint64_t slots, int absent, link_t *l, char *err,
            size_t err_len);

/* Bounded barrier `index` (each used once per case) over the ranks that call it: 0, or 1 after 20 s. */
int lt_barrier(lt_shared_t *sh, int index, int count);

/* Waits (bounded, 20 s) until sh->marker[rank] >= value; 0, or 1. */
int lt_wait_marker(lt_shared_t *sh, int rank, int value);

/* A region as the CPU mover sees it: where it lies here and at each peer. */
typedef struct lt_region {
    ginq_region_t core; /* core.mover_data == this */
    uint64_t serial;
    uint8_t *local;
    uint8_t *peer[LT_MAX_RANKS];
} lt_region_t;

typedef struct lt_xfer {
    int used, is_signal, peer;
    uint64_t ticket;
} lt_xfer_t;

/* One rank's mover and server over a connected link. */
typedef struct lt_mover {
    link_t *link;
    int rank, nranks;
    uint8_t *data[LT_MAX_RANKS]; /* every rank's data region (memfd), mapped here */
    uint8_t src[LT_DATA];        /* this rank's put sources */
    uint64_t sig[LT_NSIG];       /* this rank's signal words, written only by its server */
    lt_region_t src_region, dst_region, sig_region;
    lt_xfer_t xfers[LT_XFERS];
    pthread_mutex_t serve_mutex;
    uint64_t served, refused;
    ginq_mover_t iface;
    gin_server_t server;
} lt_mover_t;

/* Collective: creates this rank's data region, passes its fd to every peer over the link and maps
 * theirs; sources filled from (rank, seed). 0, or 1 with a message printed. */
int lt_mover_init(lt_mover_t *m, link_t *l, uint64_t seed);
void lt_mover_fini(lt_mover_t *m);
/* The source byte `off` of `rank` for `seed`. */
uint8_t lt_src_byte(int rank, uint64_t seed, uint64_t off);
/* A signal word of this rank, as a kernel reads it. */
uint64_t lt_sig(lt_mover_t *m, int word);

#endif
