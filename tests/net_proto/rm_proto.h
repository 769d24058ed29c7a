/*
 * A CPU prototype of epx's internode routing-map protocol (README.md, "The routing-map protocol", is its
 * specification): the routing-map dispatch with or without permute, and its combine, across N nodes of P
 * ranks, each rank a thread; ranks of one node share memory, ranks of different nodes talk only through
 * net.h on the host model. Tokens move as in the HT protocol (once per destination node, to the rank of
 * the same local index, which forwards inside its node). One call runs one dispatch and one combine.
 */
#ifndef EPX_NET_RM_PROTO_H
#define EPX_NET_RM_PROTO_H

#include "proto.h"

/* The protocol, or a deliberately wrong one. */
typedef enum rm_variant {
    RM_OK = 0,
    /* Packets go as plain puts before the count message (weak put_signal); the forwarder reads them
     * once the count message arrived, before their own signals: relies on put order. */
    RM_WRONG_PUT_ORDER = 1,
    /* A remote node's partial crosses as fp32 and joins the sum unrounded, not through bf16. */
    RM_WRONG_FP32_PARTIAL = 2,
    /* Rank 0 never sends its count message to the last node: a wait must end at its deadline with an
     * error naming rank, stage and peer, and every other rank must leave its wait. */
    RM_DROP_NOTIFY = 3,
} rm_variant_t;

typedef struct rm_config {
    proto_frame_t frame; /* K unused */
    int permute;
    int pad;        /* pad_multiple of each local expert's group, 1..1024 (1 without permute) */
    int with_probs; /* probs given, and the probs outputs written */
    int weighted;   /* the combine multiplies by the prob (permute and probs only) */
    rm_variant_t variant;
} rm_config_t;

/* Rank r's inputs. */
typedef struct rm_input {
    int64_t T;
    const uint16_t *x;          /* [T, H] bf16 */
    const uint8_t *routing_map; /* [T, E] 0 or 1 */
    const float *probs;         /* [T, E]; read when with_probs */
    int64_t bound;              /* num_permuted_tokens (permute) or num_dispatched_tokens; -1 none */
} rm_input_t;

/* The combine input of rank r for the row that holds (source src, token tok, local expert j; j = -1
 * without permute): y [H] bf16. */
typedef void (*rm_make_y_fn)(void *ctx, int r, int32_t src, int64_t tok, int j, uint16_t *y);

/* Rank r's outputs, sized for max(bound, the largest real count) rows; rows past `rows` unspecified. */
typedef struct rm_output {
    int64_t real;     /* num_tokens: N_r, or the padded total with permute */
    int64_t rows;     /* the bound when given, else real */
    int overflow;     /* real > bound: rows past the bound were dropped */
    uint16_t *tokens; /* [rows, H]; zero rows for padding and past real */
    float *probs;     /* [rows, L] without permute, [rows] with (with_probs); 0 on zero rows */
    int32_t *src;     /* [rows] the handle's row map: source rank, -1 for a zero row */
    int64_t *tok;     /* [rows] source token, 0 for a zero row */
    int32_t *j;       /* [rows] local expert of the row's group (permute, padding included), else -1 */
    int32_t *tokens_per_expert; /* [L] padded counts (permute) */
    uint16_t *combined;         /* [T, H] */
    char error[256];            /* this rank's first error, "" when none */
} rm_output_t;

/* Runs one dispatch and one combine. out[R] is filled (free with rm_output_free); returns 0, or 1 with the
 * first error (rank, peer, stage) in err. */
int rm_run(const rm_config_t *cfg, const rm_input_t *in, rm_make_y_fn make_y, void *y_ctx, rm_output_t *out,
           proto_stats_t *stats, char *err, size_t err_len);
void rm_output_free(rm_output_t *out, int R);

#endif
