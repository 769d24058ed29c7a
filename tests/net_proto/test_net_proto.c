/*
 * The internode HT protocol (README.md) on the host model, bit for bit against the reference with
 * ranks_per_node set: node splits, ragged token counts, routings, with and without weights, normal
 * mode and strict mode over many seeds; and two wrong protocols that only strict mode catches.
 */
#include <stdio.h>
#include <stdlib.h>

#include "epx_test.h"
#include "proto_test.h"

#define H_HIDDEN 40

typedef struct one_case {
    proto_case_t base; /* variant: proto_variant_t */
    int with_weights, alignment, bias0, bias1;
} one_case_t;

/* One case's inputs, its protocol's configuration and, once it ran, outputs. */
typedef struct one_run {
    const one_case_t *c;
    proto_inputs_t d;
    proto_input_t in[REF_MAX_RANKS];
    proto_config_t cfg;
    proto_output_t out[REF_MAX_RANKS];
} one_run_t;

static void make_y(void *ctx, int r, int32_t src, int64_t tok, uint16_t *y)
{
    proto_y_row(ctx, r, -1, src, tok, y);
}

static int build(void *state)
{
    one_run_t *k = state;
    const one_case_t *c = k->c;
    if (proto_inputs_init(&k->d, &c->base, H_HIDDEN, c->base.iter, c->base.seed, 0x5eedull)) return 1;
    const uint64_t yseed = k->d.yseed;
    for (int s = 0; s < k->d.p.R; s++) {
        const int64_t T = k->d.p.T[s];
        uint16_t *b0 = c->bias0 ? proto_inputs_alloc(&k->d, T * H_HIDDEN, 2) : NULL;
        uint16_t *b1 = c->bias1 ? proto_inputs_alloc(&k->d, T * H_HIDDEN, 2) : NULL;
        if ((c->bias0 && !b0) || (c->bias1 && !b1)) return 1;
        for (int64_t t = 0; t < T; t++) {
            for (int64_t ch = 0; ch < H_HIDDEN; ch++) {
                if (b0) b0[t * H_HIDDEN + ch] = ref_gen_bf16(yseed, REF_TAG_BIAS0, s, t, ch);
                if (b1) b1[t * H_HIDDEN + ch] = ref_gen_bf16(yseed, REF_TAG_BIAS1, s, t, ch);
            }
        }
        k->in[s] = (proto_input_t){.T = T,
                                   .x = k->d.x[s],
                                   .topk = k->d.p.topk[s],
                                   .weights = k->d.p.weights[s],
                                   .bias0 = b0,
                                   .bias1 = b1};
    }
    k->cfg = (proto_config_t){.frame = proto_test_frame(&c->base, H_HIDDEN),
                              .with_weights = c->with_weights,
                              .alignment = c->alignment,
                              .variant = (proto_variant_t)c->base.variant};
    return 0;
}

/* Every output of every rank against the reference; 0 when all equal. */
static int check_outputs(void *state, int quiet)
{
    const one_run_t *k = state;
    const one_case_t *c = k->c;
    const ref_problem_t *p = &k->d.p;
    const proto_output_t *out = k->out;
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
            ref_ht_combine(p, s, k->d.yseed, c->bias0, c->bias1, cx, c->with_weights ? cw : NULL);
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

PROTO_ONE_RUN_CALLBACKS(one_run_t, proto_run, proto_output_free)
static const proto_case_ops_t ops = {build, protocol, check_outputs, release};

/* The case of seed index i on split `split`: parameters cycle so every split sees each of them. */
static one_case_t make_case(ref_split_t split, int i, epx_net_model_mode_t mode, uint64_t seed)
{
    return (one_case_t){.base = proto_test_case(split, i, mode, seed),
                        .with_weights = (i / 3) % 2 == 0,
                        .alignment = i % 5 == 4 ? 4 : 1,
                        .bias0 = i % 3 == 1,
                        .bias1 = i % 6 == 2};
}

/* Case i of the sweep, changed as a driver asks (proto_case_fn). */
static int run_case(const proto_change_t *change, ref_split_t split, int i, epx_net_model_mode_t mode,
                    uint64_t seed, int quiet, proto_result_t *res)
{
    one_case_t c = make_case(split, i, mode, seed);
    one_run_t k = {.c = &c};
    return proto_run_case(&ops, &k, &c.base, change, quiet, res, "weights %d align %d bias %d%d",
                          c.with_weights, c.alignment, c.bias0, c.bias1);
}

/* A wrong variant's runs: every rank holds 40 tokens, routed at random: more packets behind each count
 * message, more chances to read one too early. */
static proto_change_t wrong(proto_variant_t variant)
{
    return (proto_change_t){.variant = variant, .T_max = 40, .full = 1, .random = 1};
}

int main(void)
{
    const uint64_t seed = epx_test_seed();
    const int fast = ref_fast_mode();
    const proto_change_t put_order = wrong(PROTO_WRONG_PUT_ORDER), other_peer = wrong(PROTO_WRONG_OTHER_PEER);
    /* A lost count message: the forwarder's wait ends at its deadline with an error naming rank, stage and
     * peer; every other rank leaves its wait (the abort word) instead of waiting out its own. Rank 2 (node
     * 1, local 0) waits for the message: its error names the wait, whether its deadline or another rank's
     * (one whose wait began earlier) ended it. The ranks of its node wait for it at the notify barrier;
     * node 0's ranks fail too when a token of theirs needs node 1, else they finish. */
    const proto_change_t lost = {.variant = PROTO_DROP_NOTIFY, .T_max = 13, .full = 1};
    if (proto_bytes_test("bytes", run_case, 0, seed, 1) ||
        proto_lost_test("lost count message", run_case, &lost, 0, seed, proto_lost_at_rank2) ||
        proto_sweep("protocol", "", run_case, seed, 4, fast ? 8 : 24) ||
        proto_wrong_sweep("relying on put order", run_case, &put_order, seed, 48) ||
        proto_wrong_sweep("relying on a strong signal to another peer", run_case, &other_peer, seed, 96))
        return 1;
    printf("ok\n");
    return 0;
}
