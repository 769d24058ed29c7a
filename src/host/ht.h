/*
 * Host backend, HT: what the dispatch (ht.c) and the combine (ht_combine.c) share: the state an HT
 * handle keeps on this rank, and the checks that every rank published the same call.
 */
#ifndef EPX_HOST_HT_H
#define EPX_HOST_HT_H

#include "host/host.h"

/* What an HT handle keeps on this rank: one allocation with its arrays (host_alloc_parts). */
typedef struct host_ht_state {
    uint64_t dispatch_seq; /* call that made the routing (same on every rank) */
    int32_t nranks;
    int64_t num_tokens;      /* T dispatched from this rank */
    int64_t num_recv;        /* rows kept on this rank (N_r, or the static bound when lower) */
    int64_t num_arriving;    /* N_r: rows past num_recv were dropped (a cached dispatch drops them too) */
    int64_t *recv_prefix;    /* [R + 1]: first kept row of each source */
    int32_t *recv_src_rank;  /* [num_recv] */
    int32_t *recv_src_token; /* [num_recv] */
    int32_t *token_rows;     /* [T * R]: row of own token t on rank r, -1 when not sent (or dropped) */
} host_ht_state_t;

/* Every rank sees the same publications, so every rank reaches the same verdict in these. */

/* Rank p made operation `op` (named `what` in the message). */
epx_result_t host_ht_check_op(const host_buffer_t *hb, const host_pub_t *pub, int p, int32_t op,
                              const char *what);
/* Rank p published the same `word` as rank 0: a flag named `flag`, or (with `handle`) the dispatch
 * call its handle comes from. */
epx_result_t host_ht_check_same(const host_buffer_t *hb, const host_pub_t *pubs, int p, int word,
                                const char *flag, const char *handle);
/* A rank that asks for `output` (word `wants`) needs every rank to pass topk_weights (word `has`). */
epx_result_t host_ht_check_weights(const host_buffer_t *hb, const host_pub_t *pubs, int wants, int has,
                                   const char *output);

#endif
