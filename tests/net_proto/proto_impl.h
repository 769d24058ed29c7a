/*
 * Internals of the protocol prototypes (README.md): the regions, signals, node-shared memory and
 * per-rank state of the HT protocol (proto.c), the run's setup and threads (proto_run.c), and the
 * waits, puts and errors every prototype shares (proto_common.c), the LL protocol (ll_proto.c) included;
 * the count messages, node table and region layout that the HT and routing-map (rm_proto.c) protocols share.
 */
#ifndef EPX_NET_PROTO_IMPL_H
#define EPX_NET_PROTO_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "proto.h"

enum { REGION_SEND = 0, REGION_RECV = 1 };
enum { CTX_DISPATCH = 0, CTX_COMBINE = 1 };
enum { SIG_NOTIFY = 0 };
#define SIG_DISPATCH(m) (1u + (uint32_t)(m))
#define SIG_COMBINE(m)  (1u + (uint32_t)run->N + (uint32_t)(m))
#define SIG_DOORBELL    (1u + 2u * (uint32_t)run->N) /* PROTO_WRONG_OTHER_PEER only */

/* What the ranks of one node share (stands for NVLink-visible memory). */
typedef struct node_shared {
    atomic_uint_fast64_t barrier;  /* arrivals; barrier g is passed at g * P */
    atomic_uint_fast64_t doorbell; /* PROTO_WRONG_OTHER_PEER */
    int32_t *per_rank;             /* [R][P]: tokens of source s to local rank q */
    int32_t *per_expert;           /* [R][P * L]: tokens of source s selecting each expert of the node */
} node_shared_t;

typedef struct run run_t;

typedef struct rank {
    run_t *run;
    int r, m, l;
    epx_net_t net;
    uint8_t *send, *recv;
    const proto_input_t *in;
    proto_output_t *out;
    uint16_t *y; /* [N_r, H] combine input, node-visible */
    /* The source's layout. */
    uint32_t *node_mask;     /* [T][N] local ranks of node n that need token t */
    int32_t *rank_index;     /* [T][R] index of t among this rank's tokens to rank d */
    int32_t *to_rank;        /* [R] */
    int32_t *to_node;        /* [N] tokens with a destination on node n */
    int32_t *per_expert;     /* [E] */
    int32_t *remote_packets; /* [N] packets from the source (n, l), from its count message */
    float *own_part;         /* [T, H] own node's partial */
    float *own_part_w;       /* [T, K] */
    proto_stats_t stats;
    char *error; /* this rank's first error, error_len bytes */
    size_t error_len;
    void *ll; /* the LL protocol's per-rank state */
    void *rm; /* the routing-map protocol's */
    pthread_t thread;
} rank_t;

struct run {
    const proto_config_t *cfg; /* the HT protocol's */
    const proto_frame_t *frame;
    int N, P, R, L, K, E;
    int64_t H, T_max;
    size_t cmsg, hdr, dpkt, cpkt; /* record sizes */
    size_t off_dispatch, off_combine, region_bytes;
    uint64_t timeout_ms; /* every wait */
    proto_make_y_fn make_y;
    void *y_ctx;
    epx_net_model_t *model;
    int32_t abort_word;
    pthread_mutex_t err_lock;
    int mutex_ready;
    char *err;
    size_t err_len;
    int failed;
    node_shared_t *nodes;
    rank_t *ranks;
    void *ll; /* the LL protocol's run */
    void *rm; /* the routing-map protocol's */
};

/* A rank's thread: dispatch, then combine (README.md); errors go to the run. */
void *proto_rank_main(void *arg);

/* ---- the run (proto_run.c) ----------------------------------------------------------------------- */

/* Garbage, so that a row nobody wrote cannot pass for a right one; NULL when out of memory. */
void *proto_garbage(size_t bytes);
/* The run's frame: its sizes (L = E / R), ranks and deadline, and where its error goes. Returns 0, or 1
 * naming a bad frame in err. */
int proto_run_init(run_t *run, const proto_frame_t *frame, char *err, size_t err_len);
/* The model (the frame's mode and seed, progress_in_wait, the run's abort word), the node-shared barriers
 * and every rank's SEND and RECV regions of run->region_bytes (garbage), registered in that order, and
 * its handle. After proto_run_init, with region_bytes set. Returns 0, or 1 with the reason in run->err. */
int proto_run_open(run_t *run, uint32_t ncontexts, uint32_t nsignals);
/* One thread per rank running rank_main, joined; then nothing may be left in flight. Returns 0, or 1
 * with the run's first error in run->err. Sums the ranks' stats into *stats. */
int proto_run_threads(run_t *run, void *(*rank_main)(void *), proto_stats_t *stats);
/* The node tables (per_rank, per_expert) of every node, zeroed. Returns 0, or 1 (out of memory). */
int proto_run_tables(run_t *run);
/* A source's layout arrays (node_mask, rank_index, to_rank, to_node, per_expert, remote_packets) for T
 * tokens, zeroed. Returns 0, or 1 (out of memory; free them still). */
int proto_layout_alloc(rank_t *rk, int64_t T);
void proto_layout_free(rank_t *rk);
/* Frees what proto_run_open and proto_run_tables made (a partly opened run too). */
void proto_run_close(run_t *run);

/* ---- shared by the protocols (proto_common.c) ---------------------------------------------------- */

static inline int32_t get32(const uint8_t *p, size_t word)
{
    int32_t v;
    memcpy(&v, p + 4 * word, 4);
    return v;
}
static inline void put32(uint8_t *p, size_t word, int32_t v)
{
    memcpy(p + 4 * word, &v, 4);
}

/* Records this rank's first error and the run's first, and sets the abort word so that every wait of
 * the run ends. Returns 1. */
__attribute__((format(printf, 2, 3))) int proto_fail(rank_t *rk, const char *fmt, ...);
/* Every wait ends this long after it began (EPX_TIMEOUT_MS's role). */
uint64_t proto_deadline(const rank_t *rk);
/* A put from SEND at src to peer's RECV at dst, with a signal (sig >= 0) or without; counts net bytes. */
int proto_net_put(rank_t *rk, const char *stage, uint32_t ctx, int peer, uint64_t dst, uint64_t src,
                  uint64_t bytes, int sig, epx_net_signal_mode_t mode);
/* Waits for signal `sig` to reach `target`; the puts it counts come from `peer`, or (peer < 0) from the
 * ranks of this local index on the other nodes (peer -1) or from every rank of the other nodes (-2). */
int proto_wait_signal(rank_t *rk, const char *stage, uint32_t sig, uint64_t target, int peer);
int proto_flush(rank_t *rk, const char *stage, uint32_t ctx);
/* Bytes this rank copied into the memory of `peer`, a rank of its node (itself included). */
void proto_count_local(rank_t *rk, int peer, uint64_t bytes);
/* A wait on node-shared memory: until *word >= target (acquire); `what` names the word. */
int proto_wait_local(rank_t *rk, const char *stage, atomic_uint_fast64_t *word, uint64_t target,
                     const char *what);
/* Node barrier number `generation` (1, 2, ...) of this rank's node. */
int proto_node_barrier(rank_t *rk, const char *stage, uint64_t generation);

/* ---- count messages, node table and regions of the HT and routing-map protocols (proto_common.c) -- */

/* Region layout, the same in SEND and RECV: count messages [N] (run->cmsg each), token packets
 * [N][T_max] (run->dpkt) from run->off_dispatch, partials [N][T_max] (run->cpkt) from run->off_combine. */
static inline uint64_t proto_off_notify(const run_t *run, int n)
{
    return (uint64_t)n * run->cmsg;
}
static inline uint64_t proto_off_packet(const run_t *run, int n, int64_t j)
{
    return run->off_dispatch + ((uint64_t)n * (uint64_t)run->T_max + (uint64_t)j) * run->dpkt;
}
static inline uint64_t proto_off_partial(const run_t *run, int n, int64_t j)
{
    return run->off_combine + ((uint64_t)n * (uint64_t)run->T_max + (uint64_t)j) * run->cpkt;
}

/* The source's counts for its own node (to_rank, per_expert of its layout) into the node table. */
void proto_publish_own_counts(rank_t *rk);
/* The count message for node n (packets, per_rank[P], per_expert[P * L]) packed at SEND.notify[n] and put
 * to the forwarder (n, l) at RECV.notify[m], with a WEAK signal (sig >= 0) or without. */
int proto_send_counts(rank_t *rk, int n, int sig);
/* After the count messages of the remote sources of this local index landed: each checked (packets within
 * T_max, per_rank within packets, per_expert within its rank's count), remote_packets[n] set and the counts
 * copied into the node table. Returns 0, or 1 (an error naming rank, peer and field). */
int proto_counts_in(rank_t *rk);
/* Row of source s's first token among the rows of local rank q of node m (the sum of the earlier sources'
 * per_rank counts in the node table). */
int64_t proto_row_base(const run_t *run, int m, int q, int s);

#endif
