/*
 * Internals of the protocol prototype shared by its steps (proto.c) and its setup (proto_run.c): the
 * regions, signals, node-shared memory and per-rank state of README.md.
 */
#ifndef EPX_NET_PROTO_IMPL_H
#define EPX_NET_PROTO_IMPL_H

#include <pthread.h>
#include <stdatomic.h>

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
    pthread_t thread;
} rank_t;

struct run {
    const proto_config_t *cfg;
    int N, P, R, L, K, E;
    int64_t H, T_max;
    size_t cmsg, hdr, dpkt, cpkt; /* record sizes */
    size_t off_dispatch, off_combine, region_bytes;
    proto_make_y_fn make_y;
    void *y_ctx;
    epx_net_model_t *model;
    int32_t abort_word;
    pthread_mutex_t err_lock;
    char *err;
    size_t err_len;
    int failed;
    node_shared_t *nodes;
    rank_t *ranks;
};

/* A rank's thread: dispatch, then combine (README.md); errors go to the run. */
void *proto_rank_main(void *arg);

#endif
