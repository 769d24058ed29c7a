/*
 * A CPU prototype of epx's internode LL protocol (README.md, "The LL protocol", is its specification):
 * N nodes of P ranks, each rank a thread; ranks of one node share memory, ranks of different nodes
 * talk only through net.h on the host model. No forwarding: every (token, selected expert) goes
 * straight to the slot of its owner, every expert output straight back to its source. One call runs
 * a few batches, two in flight on two buffers.
 */
#ifndef EPX_NET_LL_PROTO_H
#define EPX_NET_LL_PROTO_H

#include "proto.h"

/* The protocol in one of its two correct forms, or a deliberately wrong one. */
typedef enum ll_variant {
    /* Plain slot puts, then per (owner, local expert) one STRONG signal to the same peer, carrying
     * the count: it covers every earlier put of the context to that peer. */
    LL_STRONG_COUNT = 0,
    /* One WEAK put_signal per slot (+1), then per (owner, local expert) one WEAK signal announcing
     * the count; the receiver waits until the slots it counted match the count announced. */
    LL_WEAK_SLOTS = 1,
    /* Wrong: plain slot puts, then a WEAK count signal, which covers none of them. */
    LL_WRONG_WEAK_COUNT = 2,
    /* Rank 0 never signals its count for the last expert: the owner's wait must end at its deadline
     * with an error naming rank, expert and peer, and every other rank must leave its wait. */
    LL_DROP_COUNT = 3,
    /* Wrong: LL_STRONG_COUNT, but a batch reuses a buffer without waiting for the owners' credits, so
     * its counts and slots may land before an owner read the batch two back. */
    LL_WRONG_NO_CREDIT = 4,
} ll_variant_t;

typedef struct ll_config {
    proto_frame_t frame; /* H a multiple of 128 with fp8 */
    int fp8, round_scale;
    int batches; /* 1..8 dispatch + combine pairs; two buffers alternate, two batches in flight */
    ll_variant_t variant;
} ll_config_t;

/* Rank r's inputs. */
typedef struct ll_input {
    int64_t T;
    const uint16_t *x;    /* [T, H] bf16 */
    const int64_t *topk;  /* [T, K], -1 none, distinct experts per token */
    const float *weights; /* [T, K] combine weights */
} ll_input_t;

/* Rank r's combine input in batch b for local expert j and the row that holds (source src, token tok):
 * y [H]. */
typedef void (*ll_make_y_fn)(void *ctx, int b, int r, int j, int32_t src, int64_t tok, uint16_t *y);

/* Rank r's outputs (M = R * T_max rows per local expert; rows past count[j] unspecified). */
typedef struct ll_output {
    int32_t *count;     /* [L] recv_count */
    uint16_t *x;        /* [L, M, H] bf16 (without fp8) */
    uint8_t *x8;        /* [L, M, H] e4m3 (fp8) */
    float *scales;      /* storage [L, H/128, M] scale_inv (fp8) */
    int32_t *src;       /* [L, M] source rank */
    int32_t *tok;       /* [L, M] src_info: source token */
    int64_t *range;     /* [L, R] layout_range: (begin << 32) | count */
    uint16_t *combined; /* [T, H] */
    char error[256];    /* batch 0's: this rank's first error, "" when none; later batches' stay "" */
} ll_output_t;

/* Runs cfg->batches dispatches and combines, batch b's inputs and outputs at in[b * R + r] and
 * out[b * R + r] (free with ll_output_free(out, batches * R)); returns 0, or 1 with the first error
 * (rank, peer, stage) in err. */
int ll_run(const ll_config_t *cfg, const ll_input_t *in, ll_make_y_fn make_y, void *y_ctx, ll_output_t *out,
           proto_stats_t *stats, char *err, size_t err_len);
void ll_output_free(ll_output_t *out, int R);

#endif
