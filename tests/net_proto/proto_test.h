/*
 * What the HT, LL and routing-map protocol tests share: the fields every case has and how a sweep cycles
 * them, the inputs every case builds, one case's run from its inputs to its verdict, the node splits they
 * sweep, the sweep of correct runs, the normal-against-strict runs of a wrong protocol, a run that lost a
 * message, and the bytes of one run. A case runner returns 0 (ran and matched), 1 (failed) or 2 (could
 * not run).
 */
#ifndef EPX_NET_PROTO_TEST_H
#define EPX_NET_PROTO_TEST_H

#include "proto.h"
#include "reference.h"

#if defined(__SANITIZE_THREAD__)
#define PROTO_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PROTO_TSAN 1
#endif
#endif

#define PROTO_TEST_E       24
#define PROTO_TEST_TIMEOUT 20000 /* ms, the deadline of a run that should finish */
#define PROTO_LOST_TIMEOUT 300   /* ms, the deadline of a run that lost a message */

/* What every test's case holds; a test's own case type holds one as `base`, and its own fields after. */
typedef struct proto_case {
    ref_split_t split;
    int K;
    int64_t T_max;
    int iter; /* token counts (ref_gen_token_counts): 1 gives the first and last rank none */
    ref_routing_t routing;
    epx_net_model_mode_t mode;
    int variant;         /* the test's own variant: proto_variant_t, ll_variant_t or rm_variant_t */
    uint64_t timeout_ms; /* 0: PROTO_TEST_TIMEOUT */
    uint64_t seed;
} proto_case_t;

/* Case i of a sweep on `split`: K, T_max, token counts and routing cycle so that every split sees each of
 * them; variant 0. A test may cycle some of them its own way. */
proto_case_t proto_test_case(ref_split_t split, int i, epx_net_model_mode_t mode, uint64_t seed);

/* The frame of a case with hidden size H: E = PROTO_TEST_E, the model seeded with the case's seed. */
proto_frame_t proto_test_frame(const proto_case_t *c, int64_t H);

/* How a driver's run differs from the case a test's sweep makes; a field left 0 changes nothing. */
typedef struct proto_change {
    int variant; /* the test's own (a wrong or dropping one) */
    int K;
    int64_t T_max;
    int full;   /* every rank holds T_max tokens (the token counts of iteration 0) */
    int random; /* random routing */
    uint64_t timeout_ms;
} proto_change_t;

/* What a run left besides its verdict. */
typedef struct proto_result {
    char name[256]; /* the case, as failures name it */
    int failed;     /* the protocol's own verdict: 0, or 1 with its first error in err */
    char err[512];
    char error[REF_MAX_RANKS][256]; /* each rank's first error (batch 0's with batches), "" when none */
    proto_stats_t stats;
    double took; /* seconds the protocol ran */
} proto_result_t;

/* The inputs every case builds: the reference problem, the seed of the combine inputs and every rank's x
 * ([T, H] bf16, the reference's rows); and the test's own buffers of them (proto_inputs_alloc), freed with
 * them. A test's state of a case holds them. */
typedef struct proto_inputs {
    ref_problem_t p;
    uint64_t yseed;
    uint16_t *x[REF_MAX_RANKS];
    void *owned[4 * REF_MAX_RANKS]; /* x, and up to three buffers of each rank for the test */
    int n_owned;
} proto_inputs_t;

/* Builds them for case c with hidden size H: E = PROTO_TEST_E, bf16, token counts of iteration `iter`,
 * nodes of split.per_node ranks, the problem seeded with `seed` and the combine inputs with seed ^ ysalt.
 * Returns 0, or 1 (free them still). */
int proto_inputs_init(proto_inputs_t *in, const proto_case_t *c, int64_t H, int iter, uint64_t seed,
                      uint64_t ysalt);
/* n zeroed elements of `size` bytes (at least one), freed with the inputs; NULL when out of memory. */
void *proto_inputs_alloc(proto_inputs_t *in, int64_t n, size_t size);
void proto_inputs_free(proto_inputs_t *in);

/* Rank r's combine input y [H] for the row of (source src, token tok, local expert j; -1 for none). */
void proto_y_row(const proto_inputs_t *in, int r, int j, int32_t src, int64_t tok, uint16_t *y);

/* How proto_run_case builds, runs, checks and frees one case of a test. `state`: the test's own for the
 * case, zeroed but for what names the case, so that release frees whatever build or protocol got to. */
typedef struct proto_case_ops {
    int (*build)(void *state);                         /* the inputs: 0, or 1 */
    int (*protocol)(void *state, proto_result_t *res); /* the run: 0, or 1; into res its err, stats, errors */
    int (*check)(void *state, int quiet); /* the outputs against the reference: 0 when all equal */
    void (*release)(void *state);
} proto_case_ops_t;

/* Runs case c changed by `change` (NULL: none): named for failures (its fields, then the test's own from
 * fmt), built, run, and checked against the reference when the protocol did not fail. Returns 0 when it
 * ran and matched, 1 when it failed (reported unless quiet), 2 when the test itself could not run. res
 * (NULL: not wanted): what the run left. */
int proto_run_case(const proto_case_ops_t *ops, void *state, proto_case_t *c, const proto_change_t *change,
                   int quiet, proto_result_t *res, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));

/* The callbacks `protocol` and `release` of a test whose protocol runs one dispatch and one combine (HT,
 * routing map): they differ between such tests only in the protocol's types. The test's state type
 * `state_t` holds the protocol's configuration `cfg` (its build makes it), its inputs `d` and `in` and its
 * outputs `out`; make_y is the test's, `run` (proto_run, rm_run) and `free_outputs` the protocol's. */
#define PROTO_ONE_RUN_CALLBACKS(state_t, run, free_outputs)                                                 \
    static int protocol(void *state, proto_result_t *res)                                                   \
    {                                                                                                       \
        state_t *k = state;                                                                                 \
        const int rc = run(&k->cfg, k->in, make_y, &k->d, k->out, &res->stats, res->err, sizeof(res->err)); \
        for (int r = 0; r < k->d.p.R; r++)                                                                  \
            snprintf(res->error[r], sizeof(res->error[r]), "%s", k->out[r].error);                          \
        return rc;                                                                                          \
    }                                                                                                       \
    static void release(void *state)                                                                        \
    {                                                                                                       \
        state_t *k = state;                                                                                 \
        free_outputs(k->out, k->d.p.R);                                                                     \
        proto_inputs_free(&k->d);                                                                           \
    }

/* A test's case i of its sweep on `split` in `mode`, changed by `change` (NULL: none), run by
 * proto_run_case. */
typedef int (*proto_case_fn)(const proto_change_t *change, ref_split_t split, int i,
                             epx_net_model_mode_t mode, uint64_t seed, int quiet, proto_result_t *res);

/* Cases 0..normal_cases-1 in normal mode, then strict_seeds in strict mode, on every split; none may fail.
 * `what` and `note` go into the summary line. Returns 0, or 1 when a check failed or a case could not run. */
int proto_sweep(const char *what, const char *note, proto_case_fn run_case, uint64_t seed, int normal_cases,
                int strict_seeds);

/* A wrong protocol (`change`) on 2x3 ranks, quiet, over `seeds` seeds: it must pass in normal mode
 * (in-order delivery hides its bug) and fail in strict mode in some (strict runs skipped under
 * ThreadSanitizer, which reports their bug as a data race). Returns 0, or 1. */
int proto_wrong_sweep(const char *name, proto_case_fn run_case, const proto_change_t *change, uint64_t seed,
                      int seeds);

/* Whether the waiting rank's error in a run that lost a message names its wait. */
typedef int (*proto_named_fn)(const proto_result_t *res);

/* A lost message: case i on 2x2 ranks in strict mode, changed by `change` (the test's dropping variant),
 * with the deadline PROTO_LOST_TIMEOUT. The run fails at that deadline (within a margin: every other rank
 * leaves its wait through the abort word instead of waiting out its own), with a timeout in its error,
 * and `named`. `what` starts the printed line. Returns 0, or 1. */
int proto_lost_test(const char *what, proto_case_fn run_case, const proto_change_t *change, int i,
                    uint64_t seed, proto_named_fn named);

/* Rank 2 of a 2x2 split (node 1, local 0) lost its count message: its error names its notify wait, and
 * rank 3, which waits for it at the node's barrier, failed too. */
int proto_lost_at_rank2(const proto_result_t *res);

/* The bytes of one run: case i on 2x3 ranks in normal mode with K 4, 13 tokens on every rank and random
 * routing, which must pass; printed after `what`, and checked: both legs used, and with `forwarded` (HT,
 * routing map: a token crosses once per node) no more dispatch bytes on the network than one packet per
 * remote destination rank. Returns 0, or 1. */
int proto_bytes_test(const char *what, proto_case_fn run_case, int i, uint64_t seed, int forwarded);

#endif
