/*
 * Single-process reference of the epx operations, written from docs/reference.md (pinned details
 * included) without the library's code, plus the input generators and comparison helpers of the
 * multi-process suites. Every rank builds the same problem from a seed and asks for its own outputs.
 */
#ifndef EPX_TEST_REFERENCE_H
#define EPX_TEST_REFERENCE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "epx/epx.h"
#include "epx_test.h"

#define REF_MAX_RANKS 16

/* ------------------------------------------------------------------- numeric formats ---- */

float ref_bf16_to_f32(uint16_t v);
uint16_t ref_f32_to_bf16(float f); /* round to nearest even */
float ref_fp8_to_f32(uint8_t v);   /* e4m3 "fn": no inf, 0x7f/0xff NaN */
uint8_t ref_f32_to_fp8(float f);   /* round to nearest even, saturating at +-448 */
/* One fp32 operation, correctly rounded and immune to contraction into an fma (computed in
 * double, which is exact for these, then rounded once). */
float ref_fadd(float a, float b);
float ref_fmul(float a, float b);

/* ------------------------------------------------------------------------ generators ---- */

enum {
    REF_TAG_ROUTE = 1,
    REF_TAG_X = 2,
    REF_TAG_X2 = 3, /* second x for cached dispatch / a second LL batch */
    REF_TAG_SCALE = 4,
    REF_TAG_WEIGHT = 5,
    REF_TAG_PROB = 6,
    REF_TAG_Y = 7,
    REF_TAG_BIAS0 = 8,
    REF_TAG_BIAS1 = 9,
    REF_TAG_TOKENS = 10,
};

uint64_t ref_hash(uint64_t seed, uint64_t tag, uint64_t a, uint64_t b, uint64_t c);
/* Finite bf16 with a per-128-channel magnitude (some groups tiny, so the fp8 amax floor
 * matters), an occasional signed zero. */
uint16_t ref_gen_bf16(uint64_t seed, uint64_t tag, uint64_t a, uint64_t b, uint64_t c);
float ref_gen_f32(uint64_t seed, uint64_t tag, uint64_t a, uint64_t b, uint64_t c);   /* finite */
uint8_t ref_gen_fp8(uint64_t seed, uint64_t tag, uint64_t a, uint64_t b, uint64_t c); /* not NaN */
float ref_gen_unit(uint64_t seed, uint64_t tag, uint64_t a, uint64_t b, uint64_t c);  /* (0, 1] */
/* The bf16 a combine input holds on rank r for (source s, token t), local expert j (-1: HT and
 * routing map without permute), channel c. */
uint16_t ref_y_bf16(uint64_t yseed, int r, int j, int s, int64_t t, int64_t c);

typedef enum ref_routing {
    REF_ROUTE_RANDOM = 0,  /* K distinct experts, some slots -1, some tokens with none */
    REF_ROUTE_SKEWED = 1,  /* every token to one expert (same on all ranks), other slots -1 */
    REF_ROUTE_GROUPED = 2, /* all of a token's experts on one rank */
    REF_ROUTE_COUNT = 3,
} ref_routing_t;
const char *ref_routing_name(ref_routing_t routing);

/* Ragged token counts for iteration `iter`: iteration 0 is all T_max, iteration 1 gives rank 0
 * (and, with more ranks, the last rank) no token, later ones are random in [0, T_max]. */
void ref_gen_token_counts(uint64_t seed, int iter, int R, int64_t T_max, int64_t *T_out);

/* Every rank's inputs. Routing is materialised; x, scales, probs come from the generators. */
typedef struct ref_problem {
    int R, E, L, K;
    int64_t H, T_max;
    uint64_t seed;
    epx_dtype_t dtype; /* of x / hidden */
    /* Nodes are blocks of this many consecutive ranks (R, set by ref_problem_init: one node). HT and
     * routing-map combines sum per node, then over nodes with remote partials through bf16. */
    int ranks_per_node;
    int64_t T[REF_MAX_RANKS];
    int64_t *topk[REF_MAX_RANKS];  /* [T, K], -1 = none */
    float *weights[REF_MAX_RANKS]; /* [T, K] */
} ref_problem_t;

int ref_problem_init(ref_problem_t *p, int R, int E, int K, int64_t H, int64_t T_max, epx_dtype_t dtype,
                     uint64_t seed, const int64_t *T, ref_routing_t routing);
void ref_problem_free(ref_problem_t *p);
/* Row t of rank s's x in p->dtype (H elements); tag REF_TAG_X or REF_TAG_X2. */
void ref_x_row(const ref_problem_t *p, int s, int64_t t, uint64_t tag, void *dst);
/* Row t of rank s's fp8 scales (H/128 floats). */
void ref_scales_row(const ref_problem_t *p, int s, int64_t t, uint64_t tag, float *dst);
/* Whole inputs of rank s, in caller-chosen index dtype (int32 or int64). */
void ref_fill_topk(const ref_problem_t *p, int s, epx_dtype_t idx_dtype, void *dst);
bool ref_selected(const ref_problem_t *p, int s, int64_t t, int e);
/* probs[t, e] of the routing-map input (also set where not selected). */
float ref_prob(const ref_problem_t *p, int s, int64_t t, int e);

/* Owner of a zero-size tensor still needs a non-NULL pointer ("absent" is data == NULL). */
void *ref_alloc(size_t bytes);

/* -------------------------------------------------------------------------- layout ---- */

/* Rank s's layout; D = ranks per NVLink domain (per_domain may be NULL). */
void ref_layout(const ref_problem_t *p, int s, int D, int32_t *per_rank, int32_t *per_expert,
                uint8_t *in_rank, int32_t *per_domain);

/* DeepEP's rank prefix matrix [R, R]: m[s, d] = tokens ranks 0..s send to rank d. */
void ref_rank_prefix(const ref_problem_t *p, int32_t *m);

/* ----------------------------------------------------------------------- HT dispatch ---- */

typedef struct ref_ht_recv {
    int64_t n;           /* N_r */
    int32_t *src;        /* [n] source rank of each row */
    int64_t *tok;        /* [n] source token */
    int64_t *idx;        /* [n, K] local expert id or -1 */
    float *w;            /* [n, K] */
    int32_t *per_expert; /* [L], rounded up to the alignment */
} ref_ht_recv_t;

int ref_ht_dispatch(const ref_problem_t *p, int r, int alignment, ref_ht_recv_t *out);
void ref_ht_recv_free(ref_ht_recv_t *out);
/* Rank s's HT combine output [T_s, H] (and combined weights [T_s, K] when out_w != NULL), with
 * rank r's combine input row for (s, t) = ref_y_bf16(yseed, r, -1, s, t, c), weight rows as
 * received, biases ref_gen_bf16(yseed, REF_TAG_BIAS0/1, s, t, c). */
void ref_ht_combine(const ref_problem_t *p, int s, uint64_t yseed, bool bias0, bool bias1, uint16_t *out,
                    float *out_w);

/* ----------------------------------------------------------------------- LL dispatch ---- */

typedef struct ref_ll_recv {
    int32_t *count; /* [L] */
    int32_t *src;   /* [L, R*T_max] source rank */
    int32_t *tok;   /* [L, R*T_max] source token (src_info) */
    int64_t *range; /* [L, R] (begin << 32) | count */
} ref_ll_recv_t;

int ref_ll_dispatch(const ref_problem_t *p, int r, ref_ll_recv_t *out);
void ref_ll_recv_free(ref_ll_recv_t *out);
/* The pinned fp8 cast of one bf16 token row: q [H], scale_inv [H/128]. */
void ref_ll_cast(const uint16_t *row, int64_t H, bool round_scale, uint8_t *q, float *scale_inv);
/* Rank s's LL combine [T_s, H]; rank r's y row of local expert j for (s, t) is
 * ref_y_bf16(yseed, r, j, s, t, c). */
void ref_ll_combine(const ref_problem_t *p, int s, uint64_t yseed, uint16_t *out);

/* ---------------------------------------------------------------- routing-map dispatch ---- */

typedef struct ref_rm_recv {
    int64_t real;               /* N_r, or P with permute */
    int64_t rows;               /* rows described: the bound when given, else real */
    int32_t *src;               /* [rows] source rank, -1 for a zero row (padding, past real) */
    int64_t *tok;               /* [rows] */
    int32_t *j;                 /* [rows] local expert of the group (permute), else -1 */
    float *probs;               /* [rows, L] without permute, [rows] with */
    int32_t *tokens_per_expert; /* [L] padded counts (permute) */
} ref_rm_recv_t;

/* bound < 0: none. */
int ref_rm_dispatch(const ref_problem_t *p, int r, bool permute, int pad, int64_t bound, ref_rm_recv_t *out);
void ref_rm_recv_free(ref_rm_recv_t *out);
/* Rank r's optional local map ([rows, L] bytes, rows >= every received token): row i for the i-th token
 * received in HT order (sources ascending, their tokens ascending, whatever the bound), 1 at the local
 * experts it selected; the rows after them 0. */
void ref_rm_local_map(const ref_problem_t *p, int r, int64_t rows, uint8_t *out);
/* Rank s's combine [T_s, H]; bounds [R] (entries < 0: none) as every rank passed them; rank r's
 * row for (s, t, j) holds ref_y_bf16(yseed, r, permute ? j : -1, s, t, c). */
int ref_rm_combine(const ref_problem_t *p, int s, bool permute, int pad, const int64_t *bounds, bool weighted,
                   uint64_t yseed, uint16_t *out);

/* The case of routing-map iteration `it` shared by the host and cuda suites: permute and padding,
 * bound mode, dtype, probs and weighting cycle so that every (pad, bound) pair occurs. */
#define REF_RM_MAX_PAD 128 /* the buffers' max_pad_multiple */
typedef enum ref_bound {
    REF_BOUND_NONE = 0,  /* no upper bound (-1) */
    REF_BOUND_EQUAL = 1, /* the real count */
    REF_BOUND_ABOVE = 2,
    REF_BOUND_BELOW = 3, /* overflow */
    REF_BOUND_COUNT = 4,
} ref_bound_t;
typedef struct ref_rm_plan {
    bool permute;
    int pad; /* 1 without permute */
    ref_bound_t bound;
    epx_dtype_t dtype;
    bool with_probs, weighted;
    ref_routing_t routing;
} ref_rm_plan_t;
ref_rm_plan_t ref_rm_plan(int it);
const char *ref_bound_name(ref_bound_t bound);
/* The bound each rank passes (bounds[R], -1 for none), from its real count and capped at the
 * buffer's capacity. Returns 0, or 1 when the reference fails. */
int ref_rm_bounds(const ref_problem_t *p, bool permute, int pad, ref_bound_t mode, int64_t *bounds);

/* ----------------------------------------------------------------- checking helpers ---- */

/* Seed and case printed with every failure of this process. */
void ref_set_seed(uint64_t seed);
void ref_set_case(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Prints "FAIL seed ... rank ... case ...: <message>" and returns 1. */
int ref_fail(int rank, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Compare `n` elements of `elem` bytes bit for bit, reporting the first difference as
 * what[i / row_elems][i % row_elems]; returns 0 when equal. */
int ref_check_bits(int rank, const char *what, const void *got, const void *expected, int64_t n, size_t elem,
                   int64_t row_elems);

/* The overflow flag reads `expected` (EPX_ERR_OVERFLOW or EPX_SUCCESS), then reads clear. Returns 0
 * or 1 (reported). */
int ref_check_overflow(int rank, epx_buffer_t buf, epx_result_t expected);
/* The handle describes T tokens, n_recv received rows, R ranks and L local experts. Returns 0, 1
 * (a mismatch) or 2 (the query failed), reported. */
int ref_check_handle(int rank, epx_handle_t handle, int64_t T, int64_t n_recv, int R, int64_t L);

/* Frees everything it handed out at once; exits the (test) process when memory runs out. */
typedef struct ref_arena {
    void *ptrs[96];
    int n;
} ref_arena_t;
void *ref_arena_alloc(ref_arena_t *a, size_t bytes);   /* zeroed */
void *ref_arena_garbage(ref_arena_t *a, size_t bytes); /* filled with 0xa5 */
void ref_arena_free(ref_arena_t *a);

/* A rank's communicator on the host backend (bounded timeout) and one buffer on it. */
typedef struct ref_session {
    epx_comm_t comm;
    epx_buffer_t buf;
} ref_session_t;
/* Opens both (collective); returns 0, or 2 after reporting (the ranks are out of step). */
int ref_session_open(const epx_unique_id_t *id, int rank, int nranks, const epx_buffer_config_t *cfg,
                     ref_session_t *s);
void ref_session_close(ref_session_t *s);

/* True under AddressSanitizer or with CI_FAST set: suites shrink their cases. */
bool ref_fast_mode(void);

/* ------------------------------------------------------------ node splits (nodes.c) ---- */

/* The node splits the suites run besides one node: EPX_TEST_NODE_SPLITS, "NxP,..." (N nodes of P
 * ranks, N * P <= REF_MAX_RANKS; empty: none), else "1x4,2x2,4x1,2x3,3x2". */
#define REF_MAX_SPLITS 16
typedef struct ref_split {
    int nodes, per_node;
} ref_split_t;
/* Returns the number of splits written to out[REF_MAX_SPLITS], or -1 after naming a bad entry. */
int ref_node_splits(ref_split_t *out);
/* As ref_session_open, on nodes of `per_node` consecutive ranks (EPX_NODE_ID set in this rank before
 * its init; 0: unset, one node), and checks that the communicator reports that split. */
int ref_session_open_nodes(const epx_unique_id_t *id, int rank, int nranks, int per_node,
                           const epx_buffer_config_t *cfg, ref_session_t *s);
/* Runs every case of `cases` (n structs of `size` bytes, first members the rank count `int R` and the
 * expert count `int E`) under every split: R becomes N * P and the int at `per_node_offset` P. A case
 * whose E the split's ranks do not divide is skipped (named). Returns 0 when all passed. */
int ref_run_split_cases(const char *name, const void *cases, size_t n, size_t size, size_t per_node_offset,
                        epx_test_rank_fn fn, int timeout_s, uint64_t seed);

#endif
