/*
 * A CPU prototype of epx's internode HT protocol (README.md in this directory is its specification):
 * N nodes of P ranks, each rank a thread; ranks of one node share memory, ranks of different nodes
 * talk only through net.h on the host model. One call runs one dispatch and one combine.
 */
#ifndef EPX_NET_PROTO_H
#define EPX_NET_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include "net/loop_model.h"

/* The protocol, or a deliberately wrong one the strict model must catch. */
typedef enum proto_variant {
    PROTO_OK = 0,
    /* Packets go as plain puts before the count message (weak put_signal); the forwarder reads them once
     * the count message arrived: relies on put order. */
    PROTO_WRONG_PUT_ORDER = 1,
    /* Packets and count messages as plain puts, then one STRONG signal per source to local rank 0 of
     * each remote node, which tells its node: relies on a strong signal covering puts to other peers. */
    PROTO_WRONG_OTHER_PEER = 2,
    /* The protocol, but rank 0 never sends its count message to the last node: a wait must end at its
     * deadline with an error naming rank, stage and peer, and every other rank must leave its wait. */
    PROTO_DROP_NOTIFY = 3,
} proto_variant_t;

/* What a run of either protocol (this one, ll_proto.h's) is made of. */
typedef struct proto_frame {
    int nodes, per_node; /* N, P; N * P <= 16 */
    int E, K;            /* E a multiple of N * P, at most 2048; K at most 64 */
    int64_t H, T_max;
    epx_net_model_mode_t mode;
    uint64_t model_seed;
    uint64_t timeout_ms; /* every wait */
} proto_frame_t;

typedef struct proto_config {
    proto_frame_t frame;
    int with_weights;
    int alignment; /* of the per-expert counts */
    proto_variant_t variant;
} proto_config_t;

/* Rank r's inputs. */
typedef struct proto_input {
    int64_t T;
    const uint16_t *x;     /* [T, H] bf16 */
    const int64_t *topk;   /* [T, K], -1 none */
    const float *weights;  /* [T, K]; read when with_weights */
    const uint16_t *bias0; /* [T, H] or NULL */
    const uint16_t *bias1; /* [T, H] or NULL */
} proto_input_t;

/* The combine input of rank r for the row that holds (source src, token tok): y [H] bf16. */
typedef void (*proto_make_y_fn)(void *ctx, int r, int32_t src, int64_t tok, uint16_t *y);

/* Rank r's outputs; arrays sized for R * T_max rows, rows past n unspecified. */
typedef struct proto_output {
    int64_t n;           /* N_r */
    uint16_t *x;         /* [rows, H] */
    int32_t *src;        /* [rows] */
    int64_t *tok;        /* [rows] */
    int64_t *idx;        /* [rows, K] local expert or -1 */
    float *w;            /* [rows, K] (with_weights) */
    int32_t *per_expert; /* [L] */
    uint16_t *combined;  /* [T, H] */
    float *combined_w;   /* [T, K] (with_weights) */
    char error[256];     /* this rank's first error, "" when none */
} proto_output_t;

typedef struct proto_stats {
    uint64_t net_bytes;      /* put through the network */
    uint64_t nvlink_bytes;   /* copied between ranks of one node */
    uint64_t self_bytes;     /* a rank's copies to or from its own rows */
    uint64_t flat_net_bytes; /* dispatch bytes one packet per remote destination rank would put */
    uint64_t dispatch_net_bytes;
} proto_stats_t;

/* Runs one dispatch and one combine. out[R] is filled (free with proto_output_free); returns 0, or 1
 * with the first error (rank, peer, stage) in err. */
int proto_run(const proto_config_t *cfg, const proto_input_t *in, proto_make_y_fn make_y, void *y_ctx,
              proto_output_t *out, proto_stats_t *stats, char *err, size_t err_len);
void proto_output_free(proto_output_t *out, int R);

/* For the tests: n elements of `elem` bytes compared bit for bit, 0 when equal; the first mismatches
 * printed (rank, what, row of `row` elements) unless quiet (a wrong protocol's mismatches are
 * expected). */
int proto_same_bits(int quiet, int rank, const char *what, const void *got, const void *expected, int64_t n,
                    size_t elem, int64_t row);

#endif
