/*
 * The internode HT protocol (README.md) on the host model, bit for bit against the reference with
 * ranks_per_node set: node splits, ragged token counts, routings, with and without weights, normal
 * mode and strict mode over many seeds; and two wrong protocols that only strict mode catches.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epx_test.h"
#include "proto_test.h"

#define H_HIDDEN   40
#define TIMEOUT_MS 20000

typedef struct one_case {
    ref_split_t split;
    int K;
    int64_t T_max;
    int iter; /* token counts (ref_gen_token_counts): 1 gives the first and last rank none */
    ref_routing_t routing;
    int with_weights, alignment, bias0, bias1;
    epx_net_model_mode_t mode;
    proto_variant_t variant;
    uint64_t seed;
} one_case_t;

typedef struct inputs {
    ref_problem_t p;
    uint64_t yseed;
    proto_input_t in[REF_MAX_RANKS];
    uint16_t *x[REF_MAX_RANKS], *b0[REF_MAX_RANKS], *b1[REF_MAX_RANKS];
} inputs_t;

static void make_y(void *ctx, int r, int32_t src, int64_t tok, uint16_t *y)
{
    const inputs_t *d = ctx;
    for (int64_t c = 0; c < d->p.H; c++) y[c] = ref_y_bf16(d->yseed, r, -1, src, tok, c);
}

static void free_inputs(inputs_t *d)
{
    for (int r = 0; r < d->p.R; r++) {
        free(d->x[r]);
        free(d->b0[r]);
        free(d->b1[r]);
    }
    ref_problem_free(&d->p);
}

static int make_inputs(const one_case_t *c, inputs_t *d)
{
    memset(d, 0, sizeof(*d));
    if (proto_test_problem(&d->p, c->split, c->K, H_HIDDEN, c->T_max, c->iter, c->routing, c->seed)) return 1;
    const int64_t *T = d->p.T;
    d->yseed = c->seed ^ 0x5eedull;
    for (int s = 0; s < d->p.R; s++) {
        const size_t n = (size_t)(T[s] * H_HIDDEN) + 1;
        d->x[s] = calloc(n, 2);
        d->b0[s] = c->bias0 ? calloc(n, 2) : NULL;
        d->b1[s] = c->bias1 ? calloc(n, 2) : NULL;
        if (!d->x[s] || (c->bias0 && !d->b0[s]) || (c->bias1 && !d->b1[s])) return 1;
        for (int64_t t = 0; t < T[s]; t++) {
            ref_x_row(&d->p, s, t, REF_TAG_X, d->x[s] + t * H_HIDDEN);
            for (int64_t ch = 0; ch < H_HIDDEN; ch++) {
                if (c->bias0) d->b0[s][t * H_HIDDEN + ch] = ref_gen_bf16(d->yseed, REF_TAG_BIAS0, s, t, ch);
                if (c->bias1) d->b1[s][t * H_HIDDEN + ch] = ref_gen_bf16(d->yseed, REF_TAG_BIAS1, s, t, ch);
            }
        }
        d->in[s] = (proto_input_t){.T = T[s],
                                   .x = d->x[s],
                                   .topk = d->p.topk[s],
                                   .weights = d->p.weights[s],
                                   .bias0 = d->b0[s],
                                   .bias1 = d->b1[s]};
    }
    return 0;
}

/* Every output of every rank against the reference; 0 when all equal. */
static int check_outputs(const one_case_t *c, const inputs_t *d, const proto_output_t *out, int quiet)
{
    const ref_problem_t *p = &d->p;
    int bad = 0;
    uint16_t *xrow = malloc(2 * H_HIDDEN);
    if (!xrow) return 1;
    for (int r = 0; r < p->R && !bad; r++) {
        ref_ht_recv_t rv;
        if (ref_ht_dispatch(p, r, c->alignment, &rv)) {
            free(xrow);
            return 1;
        }
        if (out[r].n != rv.n) {
            if (!quiet) ref_fail(r, "N_r %lld, reference %lld", (long long)out[r].n, (long long)rv.n);
            bad = 1;
        } else {
            bad |= proto_same_bits(quiet, r, "recv_src", out[r].src, rv.src, rv.n, 4, 1);
            bad |= proto_same_bits(quiet, r, "recv_tok", out[r].tok, rv.tok, rv.n, 8, 1);
            bad |= proto_same_bits(quiet, r, "recv_topk_idx", out[r].idx, rv.idx, rv.n * p->K, 8, p->K);
            if (c->with_weights)
                bad |= proto_same_bits(quiet, r, "recv_topk_weights", out[r].w, rv.w, rv.n * p->K, 4, p->K);
            bad |= proto_same_bits(quiet, r, "num_recv_tokens_per_expert", out[r].per_expert, rv.per_expert,
                                   p->L, 4, p->L);
            for (int64_t i = 0; i < rv.n && !bad; i++) {
                ref_x_row(p, rv.src[i], rv.tok[i], REF_TAG_X, xrow);
                bad |=
                    proto_same_bits(quiet, r, "recv_x", out[r].x + i * H_HIDDEN, xrow, H_HIDDEN, 2, H_HIDDEN);
            }
        }
        ref_ht_recv_free(&rv);
    }
    for (int s = 0; s < p->R && !bad; s++) {
        uint16_t *cx = calloc((size_t)(p->T[s] * H_HIDDEN) + 1, 2);
        float *cw = calloc((size_t)(p->T[s] * p->K) + 1, 4);
        if (!cx || !cw) bad = 1;
        if (!bad) {
            ref_ht_combine(p, s, d->yseed, c->bias0, c->bias1, cx, c->with_weights ? cw : NULL);
            bad |=
                proto_same_bits(quiet, s, "combined_x", out[s].combined, cx, p->T[s] * H_HIDDEN, 2, H_HIDDEN);
            if (c->with_weights)
                bad |= proto_same_bits(quiet, s, "combined_topk_weights", out[s].combined_w, cw,
                                       p->T[s] * p->K, 4, p->K);
        }
        free(cx);
        free(cw);
    }
    free(xrow);
    return bad;
}

static proto_config_t config_of(const one_case_t *c)
{
    return (proto_config_t){
        .frame = proto_test_frame(c->split, c->K, H_HIDDEN, c->T_max, c->mode, c->seed, TIMEOUT_MS),
        .with_weights = c->with_weights,
        .alignment = c->alignment,
        .variant = c->variant};
}

/* Runs one case. Returns 0 when the protocol ran and matched, 1 when it failed (reported unless quiet),
 * 2 when the test itself could not run. */
static int run_case(const one_case_t *c, int quiet, proto_stats_t *stats_out)
{
    inputs_t d;
    ref_set_seed(c->seed);
    ref_set_case("%dx%d K %d T_max %lld iter %d %s weights %d align %d bias %d%d %s variant %d",
                 c->split.nodes, c->split.per_node, c->K, (long long)c->T_max, c->iter,
                 ref_routing_name(c->routing), c->with_weights, c->alignment, c->bias0, c->bias1,
                 proto_mode_name(c->mode), (int)c->variant);
    if (make_inputs(c, &d)) {
        free_inputs(&d);
        fprintf(stderr, "cannot build the problem\n");
        return 2;
    }
    const proto_config_t cfg = config_of(c);
    proto_output_t out[REF_MAX_RANKS];
    proto_stats_t stats;
    char err[512] = "";
    int rc = proto_run(&cfg, d.in, make_y, &d, out, &stats, err, sizeof(err));
    if (rc) {
        if (!quiet) ref_fail(-1, "protocol failed: %s", err);
    } else {
        rc = check_outputs(c, &d, out, quiet);
        if (stats_out) *stats_out = stats;
    }
    proto_output_free(out, d.p.R);
    free_inputs(&d);
    return rc;
}

/* The case of seed index i on split `split`: parameters cycle so every split sees each of them. */
static one_case_t make_case(ref_split_t split, int i, epx_net_model_mode_t mode, uint64_t seed)
{
    static const int64_t t_max[] = {1, 6, 13};
    return (one_case_t){.split = split,
                        .K = 2 + i % 4,
                        .T_max = t_max[i % 3],
                        .iter = i % 4,
                        .routing = (ref_routing_t)((i / 2) % REF_ROUTE_COUNT),
                        .with_weights = (i / 3) % 2 == 0,
                        .alignment = i % 5 == 4 ? 4 : 1,
                        .bias0 = i % 3 == 1,
                        .bias1 = i % 6 == 2,
                        .mode = mode,
                        .variant = PROTO_OK,
                        .seed = seed};
}

static int sweep_case(const void *arg, ref_split_t split, int i, epx_net_model_mode_t mode, uint64_t seed,
                      int quiet)
{
    (void)arg;
    const one_case_t c = make_case(split, i, mode, seed);
    return run_case(&c, quiet, NULL);
}

/* arg: the wrong variant. */
static int wrong_case(const void *arg, ref_split_t split, int i, epx_net_model_mode_t mode, uint64_t seed,
                      int quiet)
{
    one_case_t c = make_case(split, i, mode, seed);
    c.variant = *(const proto_variant_t *)arg;
    c.iter = 0;   /* every rank holds T_max tokens */
    c.T_max = 40; /* more packets behind each count message: more chances to read one too early */
    c.routing = REF_ROUTE_RANDOM;
    return run_case(&c, quiet, NULL);
}

/* A lost count message: the forwarder's wait ends at its deadline with an error naming rank, stage and
 * peer; every other rank leaves its wait (the abort word) instead of waiting out its own. */
static int test_lost_message(uint64_t seed)
{
    one_case_t c = make_case((ref_split_t){2, 2}, 0, EPX_NET_MODEL_STRICT, seed);
    c.variant = PROTO_DROP_NOTIFY;
    c.T_max = 13;
    c.iter = 0;
    inputs_t d;
    if (make_inputs(&c, &d)) {
        free_inputs(&d);
        return 1;
    }
    proto_config_t cfg = config_of(&c);
    cfg.frame.timeout_ms = PROTO_LOST_TIMEOUT;
    proto_output_t out[REF_MAX_RANKS];
    proto_stats_t stats;
    char err[512] = "";
    const double t0 = epx_test_now_s();
    const int rc = proto_run(&cfg, d.in, make_y, &d, out, &stats, err, sizeof(err));
    const double took = epx_test_now_s() - t0;
    printf("lost count message: failed after %.2f s: %s\n", took, err);
    /* Rank 2 (node 1, local 0) waits for the message: its error names the wait, whether its deadline or
     * another rank's (one whose wait began earlier) ended it. The ranks of its node wait for it at the
     * notify barrier; node 0's ranks fail too when a token of theirs needs node 1, else they finish. */
    const int named = proto_lost_at_rank2(out[2].error, out[3].error);
    proto_output_free(out, d.p.R);
    free_inputs(&d);
    return proto_expect_lost(rc, took, err, named);
}

/* Bytes on the network and inside nodes for one case, against one put per remote destination rank. */
static int test_bytes(uint64_t seed)
{
    one_case_t c = make_case((ref_split_t){2, 3}, 0, EPX_NET_MODEL_NORMAL, seed);
    c.K = 4;
    c.T_max = 13;
    c.iter = 0;
    c.routing = REF_ROUTE_RANDOM;
    proto_stats_t st;
    EXPECT_EQ_INT(run_case(&c, 0, &st), 0);
    char label[96];
    snprintf(label, sizeof(label), "2x3 ranks, 13 tokens each, H %d, K %d, weights", H_HIDDEN, c.K);
    return proto_check_forwarded_bytes(label, &st);
}

int main(void)
{
    const uint64_t seed = epx_test_seed();
    const int fast = ref_fast_mode();
    static const proto_variant_t put_order = PROTO_WRONG_PUT_ORDER, other_peer = PROTO_WRONG_OTHER_PEER;
    if (test_bytes(seed) || test_lost_message(seed) ||
        proto_sweep("protocol", "", sweep_case, seed, 4, fast ? 8 : 24) ||
        proto_wrong_sweep("relying on put order", wrong_case, &put_order, seed, 48) ||
        proto_wrong_sweep("relying on a strong signal to another peer", wrong_case, &other_peer, seed, 96))
        return 1;
    printf("ok\n");
    return 0;
}
