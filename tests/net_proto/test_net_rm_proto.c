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

#define H_HIDDEN 40

typedef struct one_case {
    proto_case_t base; /* variant: rm_variant_t */
    int permute, pad, with_probs, weighted;
    ref_bound_t bound;
} one_case_t;

/* One case's inputs, its protocol's configuration and, once it ran, outputs. */
typedef struct one_run {
    const one_case_t *c;
    proto_inputs_t d;
    int64_t bounds[REF_MAX_RANKS];
    rm_input_t in[REF_MAX_RANKS];
    rm_config_t cfg;
    rm_output_t out[REF_MAX_RANKS];
} one_run_t;

static void make_y(void *ctx, int r, int32_t src, int64_t tok, int j, uint16_t *y)
{
    proto_y_row(ctx, r, j, src, tok, y);
}

static int build(void *state)
{
    one_run_t *k = state;
    const one_case_t *c = k->c;
    const ref_problem_t *p = &k->d.p;
    if (proto_inputs_init(&k->d, &c->base, H_HIDDEN, c->base.iter, c->base.seed, 0x726d5eedull) ||
        ref_rm_bounds(p, c->permute, c->pad, c->bound, k->bounds))
        return 1;
    const int E = p->E;
    for (int s = 0; s < p->R; s++) {
        const int64_t T = p->T[s];
        uint8_t *map = proto_inputs_alloc(&k->d, T * E, 1);
        float *probs = proto_inputs_alloc(&k->d, T * E, 4);
        if (!map || !probs) return 1;
        for (int64_t t = 0; t < T; t++) {
            for (int e = 0; e < E; e++) {
                map[t * E + e] = ref_selected(p, s, t, e);
                probs[t * E + e] = ref_prob(p, s, t, e);
            }
        }
        k->in[s] = (rm_input_t){.T = T,
                                .x = k->d.x[s],
                                .routing_map = map,
                                .probs = c->with_probs ? probs : NULL,
                                .bound = k->bounds[s]};
    }
    k->cfg = (rm_config_t){.frame = proto_test_frame(&c->base, H_HIDDEN),
                           .permute = c->permute,
                           .pad = c->pad,
                           .with_probs = c->with_probs,
                           .weighted = c->weighted,
                           .variant = (rm_variant_t)c->base.variant};
    return 0;
}

/* One rank's dispatch outputs against ref_rm_dispatch; 0 when all equal. */
static int check_dispatch(const one_run_t *k, int r, int quiet)
{
    const one_case_t *c = k->c;
    const ref_problem_t *p = &k->d.p;
    const rm_output_t *o = &k->out[r];
    ref_rm_recv_t rv;
    if (ref_rm_dispatch(p, r, c->permute, c->pad, k->bounds[r], &rv)) {
        ref_rm_recv_free(&rv);
        return 1;
    }
    int bad = 0;
    const int overflow = k->bounds[r] >= 0 && rv.real > k->bounds[r];
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
static int check_outputs(void *state, int quiet)
{
    const one_run_t *k = state;
    const one_case_t *c = k->c;
    const ref_problem_t *p = &k->d.p;
    int bad = 0;
    for (int r = 0; r < p->R && !bad; r++) bad |= check_dispatch(k, r, quiet);
    for (int s = 0; s < p->R && !bad; s++) {
        uint16_t *cx = calloc((size_t)(p->T[s] * H_HIDDEN) + 1, 2);
        bad = !cx || ref_rm_combine(p, s, c->permute, c->pad, k->bounds, c->weighted, k->d.yseed, cx) ||
              proto_same_bits(quiet, s, "combined", k->out[s].combined, cx, p->T[s] * H_HIDDEN, 2, H_HIDDEN);
        free(cx);
    }
    return bad;
}

PROTO_ONE_RUN_CALLBACKS(one_run_t, rm_run, rm_output_free)
static const proto_case_ops_t ops = {build, protocol, check_outputs, release};

/* The case of seed index i on split `split`: ref_rm_plan(i)'s permute, padding, bound, probs, weighting
 * and routing (every (padding, bound) pair within 16 indices), in bf16; K (every value with every padding),
 * T_max and token counts cycle. */
static one_case_t make_case(ref_split_t split, int i, epx_net_model_mode_t mode, uint64_t seed)
{
    const ref_rm_plan_t pl = ref_rm_plan(i);
    one_case_t c = {.base = proto_test_case(split, i, mode, seed),
                    .permute = pl.permute,
                    .pad = pl.pad,
                    .with_probs = pl.with_probs,
                    .weighted = pl.weighted,
                    .bound = pl.bound};
    c.base.K = 2 + (i + i / 4) % 4;
    c.base.iter = (i / 3) % 4;
    c.base.routing = pl.routing;
    return c;
}

/* Case i of the sweep, changed as a driver asks (proto_case_fn). */
static int run_case(const proto_change_t *change, ref_split_t split, int i, epx_net_model_mode_t mode,
                    uint64_t seed, int quiet, proto_result_t *res)
{
    one_case_t c = make_case(split, i, mode, seed);
    one_run_t k = {.c = &c};
    return proto_run_case(&ops, &k, &c.base, change, quiet, res,
                          "permute %d pad %d bound %s probs %d weighted %d", c.permute, c.pad,
                          ref_bound_name(c.bound), c.with_probs, c.weighted);
}

/* A wrong variant's runs: every rank holds 40 tokens, random routing over K 4: many packets behind each
 * count message, and node partials of several rows. */
static proto_change_t wrong(rm_variant_t variant)
{
    return (proto_change_t){.variant = variant, .K = 4, .T_max = 40, .full = 1, .random = 1};
}

/* Remote partials added in fp32: the sums differ from the pinned tree, in normal and strict mode alike,
 * and the reference check catches every run. */
static int test_fp32_partial(uint64_t seed, int seeds)
{
    const proto_change_t fp32 = wrong(RM_WRONG_FP32_PARTIAL);
    int caught = 0, runs = 0;
    for (int i = 0; i < seeds; i++)
        for (int strict = 0; strict < 2; strict++) {
            const int rc =
                run_case(&fp32, (ref_split_t){2, 3}, i, strict ? EPX_NET_MODEL_STRICT : EPX_NET_MODEL_NORMAL,
                         seed + (uint64_t)i, 1, NULL);
            if (rc == 2) return 1;
            caught += rc;
            runs++;
        }
    printf("remote partials added in fp32: %d of %d runs caught by the reference check\n", caught, runs);
    EXPECT_EQ_INT(caught, runs);
    return 0;
}

int main(void)
{
    const uint64_t seed = epx_test_seed();
    const int fast = ref_fast_mode();
    const proto_change_t put_order = wrong(RM_WRONG_PUT_ORDER);
    /* A lost count message: the forwarder's wait ends at its deadline with an error naming rank, stage and
     * peer; every other rank leaves its wait (the abort word) instead of waiting out its own. Rank 2 (node
     * 1, local 0) waits for the message; the ranks of its node wait for it at the notify barrier. */
    const proto_change_t lost = {.variant = RM_DROP_NOTIFY, .T_max = 13, .full = 1};
    if (proto_bytes_test("bytes", run_case, 1, seed, 1) ||
        proto_lost_test("lost count message", run_case, &lost, 1, seed, proto_lost_at_rank2) ||
        proto_sweep("routing-map protocol", "", run_case, seed, 8, fast ? 8 : 24) ||
        proto_wrong_sweep("routing map, relying on put order", run_case, &put_order, seed, 48) ||
        test_fp32_partial(seed, 4))
        return 1;
    printf("ok\n");
    return 0;
}
