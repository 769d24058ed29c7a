/*
 * The internode routing-map protocol (README.md, "The routing-map protocol") on the host model, bit for
 * bit against the reference with ranks_per_node set: node splits, ragged token counts, routings, permute
 * with several paddings and without, upper bounds none, equal, above and below the real count (rows
 * dropped), probs and weighted combine, normal mode and strict mode over many seeds; a wrong protocol
 * that only strict mode catches, one whose sums the reference check catches, and a lost count message.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epx_test.h"
#include "proto_test.h"
#include "rm_proto.h"

#define H_HIDDEN   40
#define TIMEOUT_MS 20000

typedef struct one_case {
    ref_split_t split;
    int K;
    int64_t T_max;
    int iter; /* token counts (ref_gen_token_counts): 1 gives the first and last rank none */
    ref_routing_t routing;
    int permute, pad, with_probs, weighted;
    ref_bound_t bound;
    epx_net_model_mode_t mode;
    rm_variant_t variant;
    uint64_t seed;
} one_case_t;

typedef struct inputs {
    ref_problem_t p;
    uint64_t yseed;
    int64_t bounds[REF_MAX_RANKS];
    rm_input_t in[REF_MAX_RANKS];
    uint16_t *x[REF_MAX_RANKS];
    uint8_t *map[REF_MAX_RANKS];
    float *probs[REF_MAX_RANKS];
} inputs_t;

static void make_y(void *ctx, int r, int32_t src, int64_t tok, int j, uint16_t *y)
{
    const inputs_t *d = ctx;
    for (int64_t c = 0; c < d->p.H; c++) y[c] = ref_y_bf16(d->yseed, r, j, src, tok, c);
}

static void free_inputs(inputs_t *d)
{
    for (int r = 0; r < d->p.R; r++) {
        free(d->x[r]);
        free(d->map[r]);
        free(d->probs[r]);
    }
    ref_problem_free(&d->p);
}

static int make_inputs(const one_case_t *c, inputs_t *d)
{
    memset(d, 0, sizeof(*d));
    if (proto_test_problem(&d->p, c->split, c->K, H_HIDDEN, c->T_max, c->iter, c->routing, c->seed) ||
        ref_rm_bounds(&d->p, c->permute, c->pad, c->bound, d->bounds))
        return 1;
    const int E = d->p.E;
    d->yseed = c->seed ^ 0x726d5eedull;
    for (int s = 0; s < d->p.R; s++) {
        const int64_t T = d->p.T[s];
        d->x[s] = calloc((size_t)(T * H_HIDDEN) + 1, 2);
        d->map[s] = calloc((size_t)(T * E) + 1, 1);
        d->probs[s] = calloc((size_t)(T * E) + 1, 4);
        if (!d->x[s] || !d->map[s] || !d->probs[s]) return 1;
        for (int64_t t = 0; t < T; t++) {
            ref_x_row(&d->p, s, t, REF_TAG_X, d->x[s] + t * H_HIDDEN);
            for (int e = 0; e < E; e++) {
                d->map[s][t * E + e] = ref_selected(&d->p, s, t, e);
                d->probs[s][t * E + e] = ref_prob(&d->p, s, t, e);
            }
        }
        d->in[s] = (rm_input_t){.T = T,
                                .x = d->x[s],
                                .routing_map = d->map[s],
                                .probs = c->with_probs ? d->probs[s] : NULL,
                                .bound = d->bounds[s]};
    }
    return 0;
}

/* One rank's dispatch outputs against ref_rm_dispatch; 0 when all equal. */
static int check_dispatch(const one_case_t *c, const inputs_t *d, int r, const rm_output_t *o, int quiet)
{
    const ref_problem_t *p = &d->p;
    ref_rm_recv_t rv;
    if (ref_rm_dispatch(p, r, c->permute, c->pad, d->bounds[r], &rv)) {
        ref_rm_recv_free(&rv);
        return 1;
    }
    int bad = 0;
    const int overflow = d->bounds[r] >= 0 && rv.real > d->bounds[r];
    if (o->real != rv.real || o->rows != rv.rows || o->overflow != overflow) {
        if (!quiet)
            ref_fail(r, "num_tokens %lld, rows %lld, overflow %d; reference %lld, %lld, %d",
                     (long long)o->real, (long long)o->rows, o->overflow, (long long)rv.real,
                     (long long)rv.rows, overflow);
        bad = 1;
    }
    const int64_t n = rv.rows, pw = c->permute ? 1 : p->L;
    if (!bad) {
        bad |= proto_same_bits(quiet, r, "row src", o->src, rv.src, n, 4, 1);
        bad |= proto_same_bits(quiet, r, "row tok", o->tok, rv.tok, n, 8, 1);
        bad |= proto_same_bits(quiet, r, "row local expert", o->j, rv.j, n, 4, 1);
        if (c->with_probs) bad |= proto_same_bits(quiet, r, "probs", o->probs, rv.probs, n * pw, 4, pw);
        if (c->permute)
            bad |= proto_same_bits(quiet, r, "tokens_per_expert", o->tokens_per_expert, rv.tokens_per_expert,
                                   p->L, 4, p->L);
    }
    uint16_t xrow[H_HIDDEN];
    for (int64_t i = 0; i < n && !bad; i++) {
        memset(xrow, 0, sizeof(xrow));
        if (rv.src[i] >= 0) ref_x_row(p, rv.src[i], rv.tok[i], REF_TAG_X, xrow);
        bad |= proto_same_bits(quiet, r, "tokens", o->tokens + i * H_HIDDEN, xrow, H_HIDDEN, 2, H_HIDDEN);
    }
    ref_rm_recv_free(&rv);
    return bad;
}

/* Every output of every rank against the reference; 0 when all equal. */
static int check_outputs(const one_case_t *c, const inputs_t *d, const rm_output_t *out, int quiet)
{
    const ref_problem_t *p = &d->p;
    int bad = 0;
    for (int r = 0; r < p->R && !bad; r++) bad |= check_dispatch(c, d, r, &out[r], quiet);
    for (int s = 0; s < p->R && !bad; s++) {
        uint16_t *cx = calloc((size_t)(p->T[s] * H_HIDDEN) + 1, 2);
        bad = !cx || ref_rm_combine(p, s, c->permute, c->pad, d->bounds, c->weighted, d->yseed, cx) ||
              proto_same_bits(quiet, s, "combined", out[s].combined, cx, p->T[s] * H_HIDDEN, 2, H_HIDDEN);
        free(cx);
    }
    return bad;
}

static rm_config_t config_of(const one_case_t *c)
{
    return (rm_config_t){
        .frame = proto_test_frame(c->split, c->K, H_HIDDEN, c->T_max, c->mode, c->seed, TIMEOUT_MS),
        .permute = c->permute,
        .pad = c->pad,
        .with_probs = c->with_probs,
        .weighted = c->weighted,
        .variant = c->variant};
}

/* Runs one case. Returns 0 when the protocol ran and matched, 1 when it failed (reported unless quiet),
 * 2 when the test itself could not run. */
static int run_case(const one_case_t *c, int quiet, proto_stats_t *stats_out)
{
    inputs_t d;
    ref_set_seed(c->seed);
    ref_set_case("%dx%d K %d T_max %lld iter %d %s permute %d pad %d bound %s probs %d weighted %d %s "
                 "variant %d",
                 c->split.nodes, c->split.per_node, c->K, (long long)c->T_max, c->iter,
                 ref_routing_name(c->routing), c->permute, c->pad, ref_bound_name(c->bound), c->with_probs,
                 c->weighted, proto_mode_name(c->mode), (int)c->variant);
    if (make_inputs(c, &d)) {
        free_inputs(&d);
        fprintf(stderr, "cannot build the problem\n");
        return 2;
    }
    const rm_config_t cfg = config_of(c);
    rm_output_t out[REF_MAX_RANKS];
    proto_stats_t stats;
    char err[512] = "";
    int rc = rm_run(&cfg, d.in, make_y, &d, out, &stats, err, sizeof(err));
    if (rc) {
        if (!quiet) ref_fail(-1, "protocol failed: %s", err);
    } else {
        rc = check_outputs(c, &d, out, quiet);
        if (stats_out) *stats_out = stats;
    }
    rm_output_free(out, d.p.R);
    free_inputs(&d);
    return rc;
}

/* The case of seed index i on split `split`: ref_rm_plan(i)'s permute, padding, bound, probs, weighting
 * and routing (every (padding, bound) pair within 16 indices), in bf16; K (every value with every padding),
 * T_max and token counts cycle. */
static one_case_t make_case(ref_split_t split, int i, epx_net_model_mode_t mode, uint64_t seed)
{
    static const int64_t t_max[] = {1, 6, 13};
    const ref_rm_plan_t pl = ref_rm_plan(i);
    return (one_case_t){.split = split,
                        .K = 2 + (i + i / 4) % 4,
                        .T_max = t_max[i % 3],
                        .iter = (i / 3) % 4,
                        .routing = pl.routing,
                        .permute = pl.permute,
                        .pad = pl.pad,
                        .with_probs = pl.with_probs,
                        .weighted = pl.weighted,
                        .bound = pl.bound,
                        .mode = mode,
                        .variant = RM_OK,
                        .seed = seed};
}

static int sweep_case(const void *arg, ref_split_t split, int i, epx_net_model_mode_t mode, uint64_t seed,
                      int quiet)
{
    (void)arg;
    const one_case_t c = make_case(split, i, mode, seed);
    return run_case(&c, quiet, NULL);
}

/* arg: the wrong variant. Every rank holds 40 tokens, random routing over K 4: many packets behind each
 * count message, and node partials of several rows. */
static int wrong_case(const void *arg, ref_split_t split, int i, epx_net_model_mode_t mode, uint64_t seed,
                      int quiet)
{
    one_case_t c = make_case(split, i, mode, seed);
    c.variant = *(const rm_variant_t *)arg;
    c.iter = 0;
    c.T_max = 40;
    c.K = 4;
    c.routing = REF_ROUTE_RANDOM;
    return run_case(&c, quiet, NULL);
}

/* Remote partials added in fp32: the sums differ from the pinned tree, in normal and strict mode alike,
 * and the reference check catches every run. */
static int test_fp32_partial(uint64_t seed, int seeds)
{
    static const rm_variant_t v = RM_WRONG_FP32_PARTIAL;
    int caught = 0, runs = 0;
    for (int i = 0; i < seeds; i++)
        for (int strict = 0; strict < 2; strict++) {
            const int rc =
                wrong_case(&v, (ref_split_t){2, 3}, i, strict ? EPX_NET_MODEL_STRICT : EPX_NET_MODEL_NORMAL,
                           seed + (uint64_t)i, 1);
            if (rc == 2) return 1;
            caught += rc;
            runs++;
        }
    printf("remote partials added in fp32: %d of %d runs caught by the reference check\n", caught, runs);
    EXPECT_EQ_INT(caught, runs);
    return 0;
}

/* A lost count message: the forwarder's wait ends at its deadline with an error naming rank, stage and
 * peer; every other rank leaves its wait (the abort word) instead of waiting out its own. */
static int test_lost_message(uint64_t seed)
{
    one_case_t c = make_case((ref_split_t){2, 2}, 1, EPX_NET_MODEL_STRICT, seed);
    c.variant = RM_DROP_NOTIFY;
    c.T_max = 13;
    c.iter = 0;
    inputs_t d;
    if (make_inputs(&c, &d)) {
        free_inputs(&d);
        return 1;
    }
    rm_config_t cfg = config_of(&c);
    cfg.frame.timeout_ms = PROTO_LOST_TIMEOUT;
    rm_output_t out[REF_MAX_RANKS];
    proto_stats_t stats;
    char err[512] = "";
    const double t0 = epx_test_now_s();
    const int rc = rm_run(&cfg, d.in, make_y, &d, out, &stats, err, sizeof(err));
    const double took = epx_test_now_s() - t0;
    printf("lost count message: failed after %.2f s: %s\n", took, err);
    /* Rank 2 (node 1, local 0) waits for the message; the ranks of its node wait for it at the notify
     * barrier. */
    const int named = proto_lost_at_rank2(out[2].error, out[3].error);
    rm_output_free(out, d.p.R);
    free_inputs(&d);
    return proto_expect_lost(rc, took, err, named);
}

/* Bytes on the network and inside nodes for one case, against one packet per remote destination rank. */
static int test_bytes(uint64_t seed)
{
    one_case_t c = make_case((ref_split_t){2, 3}, 1, EPX_NET_MODEL_NORMAL, seed);
    c.K = 4;
    c.T_max = 13;
    c.iter = 0;
    c.routing = REF_ROUTE_RANDOM;
    proto_stats_t st;
    EXPECT_EQ_INT(run_case(&c, 0, &st), 0);
    char label[96];
    snprintf(label, sizeof(label), "2x3 ranks, 13 tokens each, H %d, K %d, permute, pad %d, probs %d", H_HIDDEN,
             c.K, c.pad, c.with_probs);
    return proto_check_forwarded_bytes(label, &st);
}

int main(void)
{
    const uint64_t seed = epx_test_seed();
    const int fast = ref_fast_mode();
    static const rm_variant_t put_order = RM_WRONG_PUT_ORDER;
    if (test_bytes(seed) || test_lost_message(seed) ||
        proto_sweep("routing-map protocol", "", sweep_case, seed, 8, fast ? 8 : 24) ||
        proto_wrong_sweep("routing map, relying on put order", wrong_case, &put_order, seed, 48) ||
        test_fp32_partial(seed, 4))
        return 1;
    printf("ok\n");
    return 0;
}
