/*
 * Assertions and multi-process helpers of the epx tests, over the rank-forking harness
 * (tests/harness). A failed check prints where and why and makes the test (or rank) return 1;
 * EPX_TEST_SKIP (77) is CTest's skip code.
 */
#ifndef EPX_TEST_H
#define EPX_TEST_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epx/epx.h"
#include "epx_harness.h"

#define EPX_TEST_SKIP EPX_HARNESS_SKIP

#define EXPECT_TRUE(cond)                                                            \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            return 1;                                                                \
        }                                                                            \
    } while (0)

#define EXPECT_EQ_INT(a, b)                                                                               \
    do {                                                                                                  \
        long long epx_a_ = (long long)(a), epx_b_ = (long long)(b);                                       \
        if (epx_a_ != epx_b_) {                                                                           \
            fprintf(stderr, "%s:%d: %s == %s failed: %lld != %lld\n", __FILE__, __LINE__, #a, #b, epx_a_, \
                    epx_b_);                                                                              \
            return 1;                                                                                     \
        }                                                                                                 \
    } while (0)

/* Checks an epx call's result and prints the library's message when it differs. */
#define EXPECT_RES(call, expected)                                                                  \
    do {                                                                                            \
        epx_result_t epx_r_ = (call);                                                               \
        if (epx_r_ != (expected)) {                                                                 \
            fprintf(stderr, "%s:%d: %s returned %s, expected %s (%s)\n", __FILE__, __LINE__, #call, \
                    epx_result_name(epx_r_), epx_result_name(expected), epx_last_error_message());  \
            return 1;                                                                               \
        }                                                                                           \
    } while (0)

#define EXPECT_OK(call) EXPECT_RES(call, EPX_SUCCESS)

/* The message of the last failure contains `needle`. */
#define EXPECT_MSG_HAS(needle)                                                      \
    do {                                                                            \
        if (!strstr(epx_last_error_message(), (needle))) {                          \
            fprintf(stderr, "%s:%d: message '%s' lacks '%s'\n", __FILE__, __LINE__, \
                    epx_last_error_message(), (needle));                            \
            return 1;                                                               \
        }                                                                           \
    } while (0)

/* For rank bodies that check against the reference (reference.h), with `rank` and `int rc` in
 * scope. CALL runs an epx call; on failure it reports it, sets rc = 2 (the ranks are now out of
 * step: callers stop) and jumps to `out`. CHECK reports a false condition and sets rc's bit 0. */
#define CALL(expr)                                                                   \
    do {                                                                             \
        epx_result_t call_res_ = (expr);                                             \
        if (call_res_ != EPX_SUCCESS) {                                              \
            ref_fail(rank, "%s returned %s (%s)", #expr, epx_result_name(call_res_), \
                     epx_last_error_message());                                      \
            rc = 2;                                                                  \
            goto out;                                                                \
        }                                                                            \
    } while (0)
#define CHECK(cond, ...)                                \
    do {                                                \
        if (!(cond)) rc |= ref_fail(rank, __VA_ARGS__); \
    } while (0)

/* A rank's body: returns 0 on success. */
typedef int (*epx_test_rank_fn)(int rank, int nranks, const epx_unique_id_t *id, void *ctx);

/* Forks nranks processes that each run fn with a fresh unique id (epx_harness_run); waits at most
 * timeout_s seconds (then kills them and fails). Returns 0 when every rank returned 0, else 1,
 * printing which ranks failed. */
int epx_test_run_ranks(int nranks, epx_test_rank_fn fn, void *ctx, int timeout_s);

/* The main loop of a suite: runs fn on each of n cases (an array of `size`-byte structs whose
 * first member is the rank count `int R`), timeout_s each; names the failed cases with the seed
 * and prints "<name>: ok" or "<name>: FAILED". Returns 0 when every case passed. */
int epx_test_run_cases(const char *name, const void *cases, size_t n, size_t size, epx_test_rank_fn fn,
                       int timeout_s, uint64_t seed);
#define EPX_TEST_RUN_CASES(name, cases, fn, timeout_s, seed)                                               \
    epx_test_run_cases(name, cases, sizeof(cases) / sizeof((cases)[0]), sizeof((cases)[0]), fn, timeout_s, \
                       seed)

/* Deterministic 64-bit generator (splitmix64) for inputs and routing. */
static inline uint64_t epx_test_rand(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Seed from EPX_TEST_SEED or the clock; printed so a failure can be replayed. */
uint64_t epx_test_seed(void);

/* Sets (value != NULL) or unsets an environment variable and re-reads the library's parameters, so
 * ranks forked afterwards inherit them; 0 on success. */
int epx_test_set_env(const char *name, const char *value);

/* A buffer config with the given shape and EPX_MODE_* bits (0: all); the other fields default. */
epx_buffer_config_t epx_test_buffer_config(int64_t max_tokens, int64_t hidden, int num_topk, int num_experts,
                                           uint32_t modes);

/* A host-backend communicator with the given timeout (ms); the library's result, *comm_out set only on
 * success. */
epx_result_t epx_test_host_comm(const epx_unique_id_t *id, int rank, int nranks, int timeout_ms,
                                epx_comm_t *comm_out);

/* HT calls of the common case, bf16 rows with int64 topk_idx and fp32 weights (other fields at their
 * defaults): a dispatch of T tokens (x [T, H], topk_idx and topk_weights [T, K]) into N rows (recv_x
 * [N, H], recv_topk_idx and recv_topk_weights [N, K]), and the combine of N rows (x [N, H],
 * topk_weights [N, K]) under `handle` back into T tokens (combined_x [T, H], combined_topk_weights
 * [T, K]). */
epx_ht_dispatch_args_t epx_test_ht_dispatch_args(void *x, void *topk_idx, void *topk_weights, int64_t T,
                                                 int64_t H, int64_t K);
epx_ht_dispatch_outputs_t epx_test_ht_dispatch_outputs(void *recv_x, void *recv_topk_idx,
                                                       void *recv_topk_weights, int64_t N, int64_t H,
                                                       int64_t K);
epx_ht_combine_args_t epx_test_ht_combine_args(epx_handle_t handle, void *x, void *topk_weights, int64_t N,
                                               int64_t H, int64_t K);
epx_ht_combine_outputs_t epx_test_ht_combine_outputs(void *combined_x, void *combined_topk_weights, int64_t T,
                                                     int64_t H, int64_t K);

/* CLOCK_MONOTONIC in seconds, for checks that a call returned in time. */
double epx_test_now_s(void);

/* FNV-1a of n bytes continuing from h (start with EPX_TEST_FNV_INIT): repeated runs must match. */
#define EPX_TEST_FNV_INIT 1469598103934665603ull
uint64_t epx_test_fnv(const void *data, size_t n, uint64_t h);

#endif
