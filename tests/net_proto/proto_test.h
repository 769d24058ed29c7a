/*
 * What the HT, LL and routing-map protocol tests share: the node splits they sweep, each case's reference problem,
 * the sweep of correct runs, the normal-against-strict runs of a wrong protocol, and the checks on a
 * run that lost a message. A case runner returns 0 (ran and matched), 1 (failed) or 2 (could not run).
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
#define PROTO_LOST_TIMEOUT 300 /* ms, the deadline of a run that lost a message */

/* Case i of a sweep on `split` in `mode`, reported unless quiet. arg: the test's own. */
typedef int (*proto_case_fn)(const void *arg, ref_split_t split, int i, epx_net_model_mode_t mode,
                             uint64_t seed, int quiet);

/* The reference problem of one case: E = PROTO_TEST_E, bf16, token counts of iteration `iter`, nodes of
 * split.per_node ranks. Returns 0, or 1 (free it still). */
int proto_test_problem(ref_problem_t *p, ref_split_t split, int K, int64_t H, int64_t T_max, int iter,
                       ref_routing_t routing, uint64_t seed);

/* The frame of one case: E = PROTO_TEST_E, the model seeded with the case's seed. */
proto_frame_t proto_test_frame(ref_split_t split, int K, int64_t H, int64_t T_max, epx_net_model_mode_t mode,
                               uint64_t seed, uint64_t timeout_ms);

const char *proto_mode_name(epx_net_model_mode_t mode);

/* Cases 0..normal_cases-1 in normal mode, then strict_seeds in strict mode, on every split; none may fail.
 * `what` and `note` go into the summary line. Returns 0, or 1 when a check failed or a case could not run. */
int proto_sweep(const char *what, const char *note, proto_case_fn run_case, uint64_t seed, int normal_cases,
                int strict_seeds);

/* A wrong protocol on 2x3 ranks, quiet, over `seeds` seeds: it must pass in normal mode (in-order delivery
 * hides its bug) and fail in strict mode in some (strict runs skipped under ThreadSanitizer, which reports
 * their bug as a data race). Returns 0, or 1. */
int proto_wrong_sweep(const char *name, proto_case_fn run_case, const void *arg, uint64_t seed, int seeds);

/* A run that lost a message failed (rc 1) at its deadline, PROTO_LOST_TIMEOUT, after `took` seconds, with
 * a timeout in its error `err`; `named`: the waiting rank's error names its wait. Returns 0, or 1. */
int proto_expect_lost(int rc, double took, const char *err, int named);

/* Rank 2 of a 2x2 split (node 1, local 0) lost its count message: its error names its notify wait, and
 * rank 3, which waits for it at the node's barrier, failed too. */
int proto_lost_at_rank2(const char *error2, const char *error3);

/* The bytes of a forwarded run (HT, routing map) after `label`: printed, and checked (both legs used;
 * no more dispatch bytes on the network than one packet per remote destination rank). Returns 0, or 1. */
int proto_check_forwarded_bytes(const char *label, const proto_stats_t *st);

#endif
