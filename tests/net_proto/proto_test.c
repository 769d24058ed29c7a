/*
 * The cases, inputs, runs and drivers the HT, LL and routing-map protocol tests share (proto_test.h).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epx_test.h"
#include "proto_test.h"

static const ref_split_t splits[] = {{2, 2}, {2, 3}, {3, 2}, {4, 1}, {1, 4}};
#define NSPLITS ((int)(sizeof(splits) / sizeof(splits[0])))

proto_case_t proto_test_case(ref_split_t split, int i, epx_net_model_mode_t mode, uint64_t seed)
{
    static const int64_t t_max[] = {1, 6, 13};
    return (proto_case_t){.split = split,
                          .K = 2 + i % 4,
                          .T_max = t_max[i % 3],
                          .iter = i % 4,
                          .routing = (ref_routing_t)((i / 2) % REF_ROUTE_COUNT),
                          .mode = mode,
                          .seed = seed};
}

proto_frame_t proto_test_frame(const proto_case_t *c, int64_t H)
{
    return (proto_frame_t){.nodes = c->split.nodes,
                           .per_node = c->split.per_node,
                           .E = PROTO_TEST_E,
                           .K = c->K,
                           .H = H,
                           .T_max = c->T_max,
                           .mode = c->mode,
                           .model_seed = c->seed,
                           .timeout_ms = c->timeout_ms ? c->timeout_ms : PROTO_TEST_TIMEOUT};
}

static void change_case(proto_case_t *c, const proto_change_t *change)
{
    if (!change) return;
    if (change->variant) c->variant = change->variant;
    if (change->K) c->K = change->K;
    if (change->T_max) c->T_max = change->T_max;
    if (change->full) c->iter = 0;
    if (change->random) c->routing = REF_ROUTE_RANDOM;
    if (change->timeout_ms) c->timeout_ms = change->timeout_ms;
}

int proto_inputs_init(proto_inputs_t *in, const proto_case_t *c, int64_t H, int iter, uint64_t seed,
                      uint64_t ysalt)
{
    const int R = c->split.nodes * c->split.per_node;
    int64_t T[REF_MAX_RANKS];
    memset(in, 0, sizeof(*in));
    ref_gen_token_counts(seed, iter, R, c->T_max, T);
    if (ref_problem_init(&in->p, R, PROTO_TEST_E, c->K, H, c->T_max, EPX_DTYPE_BF16, seed, T, c->routing))
        return 1;
    in->p.ranks_per_node = c->split.per_node;
    in->yseed = seed ^ ysalt;
    for (int s = 0; s < R; s++) {
        in->x[s] = proto_inputs_alloc(in, T[s] * H, 2);
        if (!in->x[s]) return 1;
        for (int64_t t = 0; t < T[s]; t++) ref_x_row(&in->p, s, t, REF_TAG_X, in->x[s] + t * H);
    }
    return 0;
}

void *proto_inputs_alloc(proto_inputs_t *in, int64_t n, size_t size)
{
    const int cap = (int)(sizeof(in->owned) / sizeof(in->owned[0]));
    void *b = in->n_owned < cap ? calloc((size_t)n + 1, size) : NULL;
    if (b) in->owned[in->n_owned++] = b;
    return b;
}

void proto_inputs_free(proto_inputs_t *in)
{
    for (int i = 0; i < in->n_owned; i++) free(in->owned[i]);
    ref_problem_free(&in->p);
    memset(in, 0, sizeof(*in));
}

void proto_y_row(const proto_inputs_t *in, int r, int j, int32_t src, int64_t tok, uint16_t *y)
{
    for (int64_t c = 0; c < in->p.H; c++) y[c] = ref_y_bf16(in->yseed, r, j, src, tok, c);
}

static const char *mode_name(epx_net_model_mode_t mode)
{
    return mode == EPX_NET_MODEL_STRICT ? "strict" : "normal";
}

int proto_run_case(const proto_case_ops_t *ops, void *state, proto_case_t *c, const proto_change_t *change,
                   int quiet, proto_result_t *res, const char *fmt, ...)
{
    change_case(c, change);
    proto_result_t own;
    if (!res) res = &own;
    memset(res, 0, sizeof(*res));
    char fields[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(fields, sizeof(fields), fmt, ap);
    va_end(ap);
    snprintf(res->name, sizeof(res->name), "%dx%d K %d T_max %lld iter %d %s %s %s variant %d",
             c->split.nodes, c->split.per_node, c->K, (long long)c->T_max, c->iter,
             ref_routing_name(c->routing), fields, mode_name(c->mode), c->variant);
    ref_set_seed(c->seed);
    ref_set_case("%s", res->name);
    int rc = 2;
    if (ops->build(state)) {
        fprintf(stderr, "cannot build the problem\n");
    } else {
        const double t0 = epx_test_now_s();
        res->failed = ops->protocol(state, res);
        res->took = epx_test_now_s() - t0;
        if (res->failed && !quiet) ref_fail(-1, "protocol failed: %s", res->err);
        rc = res->failed ? 1 : ops->check(state, quiet);
    }
    ops->release(state);
    return rc;
}

int proto_sweep(const char *what, const char *note, proto_case_fn run_case, uint64_t seed, int normal_cases,
                int strict_seeds)
{
    int failed = 0, runs = 0;
    for (int sp = 0; sp < NSPLITS; sp++) {
        for (int i = 0; i < normal_cases + strict_seeds; i++) {
            const epx_net_model_mode_t mode = i < normal_cases ? EPX_NET_MODEL_NORMAL : EPX_NET_MODEL_STRICT;
            const int rc = run_case(NULL, splits[sp], i, mode, seed + (uint64_t)(sp * 1000 + i), 0, NULL);
            if (rc == 2) return 1;
            failed += rc;
            runs++;
        }
    }
    printf("%s: %d runs over %d splits (%d normal, %d strict seeds each%s), %d failed\n", what, runs, NSPLITS,
           normal_cases, strict_seeds, note, failed);
    EXPECT_EQ_INT(failed, 0);
    return 0;
}

int proto_wrong_sweep(const char *name, proto_case_fn run_case, const proto_change_t *change, uint64_t seed,
                      int seeds)
{
    const ref_split_t split = {2, 3};
    int normal_failed = 0;
#ifndef PROTO_TSAN
    int strict_caught = 0;
#endif
    for (int i = 0; i < seeds; i++) {
        int rc = run_case(change, split, i, EPX_NET_MODEL_NORMAL, seed + (uint64_t)i, 1, NULL);
        if (rc == 2) return 1;
        normal_failed += rc;
#ifndef PROTO_TSAN
        rc = run_case(change, split, i, EPX_NET_MODEL_STRICT, seed + (uint64_t)i, 1, NULL);
        if (rc == 2) return 1;
        strict_caught += rc;
#endif
    }
#ifdef PROTO_TSAN
    printf("%s: passes normal mode over %d seeds; strict runs skipped under ThreadSanitizer (their bug is a "
           "data race it reports)\n",
           name, seeds);
    EXPECT_EQ_INT(normal_failed, 0);
#else
    printf("%s: %d of %d seeds fail in normal mode, %d of %d caught in strict mode\n", name, normal_failed,
           seeds, strict_caught, seeds);
    EXPECT_EQ_INT(normal_failed, 0);
    EXPECT_TRUE(strict_caught > 0);
#endif
    return 0;
}

int proto_lost_test(const char *what, proto_case_fn run_case, const proto_change_t *change, int i,
                    uint64_t seed, proto_named_fn named)
{
    proto_change_t lost = *change;
    lost.timeout_ms = PROTO_LOST_TIMEOUT;
    proto_result_t res;
    /* Quiet: the run's failure is the point; its verdict is the protocol's own, not the reference check's. */
    if (run_case(&lost, (ref_split_t){2, 2}, i, EPX_NET_MODEL_STRICT, seed, 1, &res) == 2) return 1;
    printf("%s: failed after %.2f s: %s\n", what, res.took, res.err);
    EXPECT_EQ_INT(res.failed, 1);
    EXPECT_TRUE(named(&res) && strstr(res.err, "EPX_NET_TIMEOUT") != NULL);
    EXPECT_TRUE(res.took >= PROTO_LOST_TIMEOUT / 1000.0 && res.took < 5.0);
    return 0;
}

int proto_lost_at_rank2(const proto_result_t *res)
{
    return strstr(res->error[2], "rank 2: notify: waiting for signal 0 to reach 1 (at 0) from peers 0: ") !=
               NULL &&
           res->error[2][0] && res->error[3][0];
}

int proto_bytes_test(const char *what, proto_case_fn run_case, int i, uint64_t seed, int forwarded)
{
    static const proto_change_t bytes = {.K = 4, .T_max = 13, .full = 1, .random = 1};
    proto_result_t res;
    EXPECT_EQ_INT(run_case(&bytes, (ref_split_t){2, 3}, i, EPX_NET_MODEL_NORMAL, seed, 0, &res), 0);
    const proto_stats_t *st = &res.stats;
    printf("%s, %s: network %llu (dispatch %llu, combine %llu), within nodes %llu (+ %llu %s)", what,
           res.name, (unsigned long long)st->net_bytes, (unsigned long long)st->dispatch_net_bytes,
           (unsigned long long)(st->net_bytes - st->dispatch_net_bytes), (unsigned long long)st->nvlink_bytes,
           (unsigned long long)st->self_bytes,
           forwarded ? "to or from a rank's own rows" : "to a rank's own slots and outputs");
    if (forwarded)
        printf("; one packet per remote destination rank would put %llu dispatch bytes",
               (unsigned long long)st->flat_net_bytes);
    printf("\n");
    EXPECT_TRUE(st->net_bytes > 0 && st->nvlink_bytes > 0);
    if (forwarded) EXPECT_TRUE(st->dispatch_net_bytes <= st->flat_net_bytes);
    return 0;
}
