/*
 * The internode HT protocol of README.md on the host model: one thread per rank, node-shared memory
 * with C11 atomics inside a node, net.h (registered regions, weak put_signal) between nodes. The
 * numeric helpers (bf16 rounding, one fp32 add) are the pinned formats of tests/common/reference.c.
 */
#include "proto_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reference.h"

/* ---- dispatch -------------------------------------------------------------------------------------- */

/* Step 1: destinations, masks, per-destination indices and counts of this rank's tokens. */
static void layout(rank_t *rk)
{
    run_t *run = rk->run;
    const int64_t T = rk->in->T;
    const uint64_t pkt_bytes = run->dpkt;
    for (int64_t t = 0; t < T; t++) {
        uint32_t dest = 0;
        for (int k = 0; k < run->K; k++) {
            const int64_t e = rk->in->topk[t * run->K + k];
            if (e < 0) continue;
            dest |= 1u << (e / run->L);
            rk->per_expert[e]++;
        }
        for (int d = 0; d < run->R; d++) {
            if (!(dest >> d & 1)) continue;
            rk->rank_index[t * run->R + d] = rk->to_rank[d]++;
            rk->node_mask[t * run->N + d / run->P] |= 1u << (d % run->P);
            if (d / run->P != rk->m) rk->stats.flat_net_bytes += pkt_bytes;
        }
        for (int n = 0; n < run->N; n++) rk->to_node[n] += rk->node_mask[t * run->N + n] != 0;
    }
}

/* Step 3: the packets for node n, ascending tokens, packet j to RECV.dispatch[m][j] of (n, l). */
static int send_packets(rank_t *rk, int n, int sig)
{
    run_t *run = rk->run;
    int64_t j = 0;
    for (int64_t t = 0; t < rk->in->T; t++) {
        const uint32_t mask = rk->node_mask[t * run->N + n];
        if (!mask) continue;
        uint8_t *pkt = rk->send + proto_off_packet(run, n, j);
        put32(pkt, 0, (int32_t)t);
        put32(pkt, 1, (int32_t)mask);
        for (int q = 0; q < run->P; q++)
            put32(pkt, 2 + (size_t)q, (mask >> q & 1) ? rk->rank_index[t * run->R + n * run->P + q] : -1);
        for (int k = 0; k < run->K; k++)
            put32(pkt, 2 + (size_t)run->P + (size_t)k, (int32_t)rk->in->topk[t * run->K + k]);
        if (run->cfg->with_weights)
            memcpy(pkt + 4 * (2 + (size_t)run->P + (size_t)run->K), rk->in->weights + t * run->K,
                   sizeof(float) * (size_t)run->K);
        memcpy(pkt + run->hdr, rk->in->x + t * run->H, 2 * (size_t)run->H);
        if (proto_net_put(rk, "dispatch", CTX_DISPATCH, n * run->P + rk->l, proto_off_packet(run, rk->m, j),
                          proto_off_packet(run, n, j), run->dpkt, sig, EPX_NET_SIGNAL_WEAK))
            return 1;
        j++;
    }
    return 0;
}

/* Steps 2 and 3 for every remote node, in the order and with the signals of the variant. */
static int send_all(rank_t *rk)
{
    run_t *run = rk->run;
    const proto_variant_t v = run->cfg->variant;
    for (int n = 0; n < run->N; n++) {
        if (n == rk->m) continue;
        const int dropped = v == PROTO_DROP_NOTIFY && rk->r == 0 && n == run->N - 1;
        if ((v == PROTO_OK || v == PROTO_DROP_NOTIFY) &&
            ((!dropped && proto_send_counts(rk, n, SIG_NOTIFY)) ||
             send_packets(rk, n, (int)SIG_DISPATCH(rk->m))))
            return 1;
        if (v == PROTO_WRONG_PUT_ORDER && (send_packets(rk, n, -1) || proto_send_counts(rk, n, SIG_NOTIFY)))
            return 1;
        if (v == PROTO_WRONG_OTHER_PEER && (send_packets(rk, n, -1) || proto_send_counts(rk, n, -1)))
            return 1;
    }
    if (v != PROTO_WRONG_OTHER_PEER) return 0;
    for (int n = 0; n < run->N; n++) {
        if (n == rk->m) continue;
        epx_net_status_t s =
            epx_net_signal_add(&rk->net, CTX_DISPATCH, n * run->P, SIG_DOORBELL, 1, EPX_NET_SIGNAL_STRONG);
        if (s != EPX_NET_OK)
            return proto_fail(rk, "notify: doorbell to peer %d: %s", n * run->P, epx_net_status_name(s));
    }
    return 0;
}

/* Step 4: the count messages of the remote sources of this local index (once the variant's wait says they
 * landed), checked, into the node table. */
static int counts_in(rank_t *rk)
{
    run_t *run = rk->run;
    node_shared_t *node = &run->nodes[rk->m];
    if (run->cfg->variant == PROTO_WRONG_OTHER_PEER) {
        if (rk->l == 0 && run->N > 1) {
            if (proto_wait_signal(rk, "notify", SIG_DOORBELL, (uint64_t)((run->N - 1) * run->P), -2))
                return 1;
            atomic_store_explicit(&node->doorbell, 1, memory_order_release);
        }
        if (run->N > 1 && proto_wait_local(rk, "notify", &node->doorbell, 1, "the doorbell of local rank 0"))
            return 1;
    } else if (run->N > 1 && proto_wait_signal(rk, "notify", SIG_NOTIFY, (uint64_t)(run->N - 1), -1)) {
        return 1;
    }
    return proto_counts_in(rk);
}

/* Step 5: this rank's row count and per-expert counts, from the node table. */
static void offsets(rank_t *rk)
{
    run_t *run = rk->run;
    const node_shared_t *node = &run->nodes[rk->m];
    rk->out->n = proto_row_base(run, rk->m, rk->l, run->R);
    for (int j = 0; j < run->L; j++) {
        int64_t c = 0;
        for (int s = 0; s < run->R; s++)
            c += node->per_expert[(size_t)s * run->P * run->L + rk->l * run->L + j];
        const int a = run->cfg->alignment;
        rk->out->per_expert[j] = (int32_t)((c + a - 1) / a * a);
    }
}

/* One received row on local rank q of this node: x, source, token, top-k remapped, weights. */
static void write_row(rank_t *rk, int q, int64_t row, int s, int64_t tok, const int32_t *topk, const float *w,
                      const void *x)
{
    run_t *run = rk->run;
    const int d = rk->m * run->P + q;
    proto_output_t *o = run->ranks[d].out;
    memcpy(o->x + row * run->H, x, 2 * (size_t)run->H);
    o->src[row] = s;
    o->tok[row] = tok;
    for (int k = 0; k < run->K; k++) {
        const int here = topk[k] >= 0 && topk[k] / run->L == d;
        o->idx[row * run->K + k] = here ? topk[k] - (int64_t)d * run->L : -1;
        if (w) o->w[row * run->K + k] = here ? w[k] : 0.0f;
    }
    proto_count_local(rk, d, 2 * (uint64_t)run->H + 4 * (uint64_t)run->K * (w ? 2 : 1));
}

/* Step 6: this rank's tokens for its own node, stored straight into the local ranks' outputs. */
static void local_legs(rank_t *rk)
{
    run_t *run = rk->run;
    int32_t topk[64];
    float w[64];
    for (int64_t t = 0; t < rk->in->T; t++) {
        const uint32_t mask = rk->node_mask[t * run->N + rk->m];
        for (int k = 0; k < run->K; k++) topk[k] = (int32_t)rk->in->topk[t * run->K + k];
        if (run->cfg->with_weights) memcpy(w, rk->in->weights + t * run->K, sizeof(float) * (size_t)run->K);
        for (int q = 0; q < run->P; q++)
            if (mask >> q & 1)
                write_row(rk, q,
                          proto_row_base(run, rk->m, q, rk->r) +
                              rk->rank_index[t * run->R + rk->m * run->P + q],
                          rk->r, t, topk, run->cfg->with_weights ? w : NULL, rk->in->x + t * run->H);
    }
}

/* Step 7: every packet from the source (n, l) of each remote node n, checked, to the ranks of its mask. */
static int forward(rank_t *rk)
{
    run_t *run = rk->run;
    int32_t topk[64];
    float w[64];
    int64_t base[32];
    for (int n = 0; n < run->N; n++) {
        if (n == rk->m) continue;
        const int s = n * run->P + rk->l;
        if ((run->cfg->variant == PROTO_OK || run->cfg->variant == PROTO_DROP_NOTIFY) &&
            proto_wait_signal(rk, "forward", SIG_DISPATCH(n), (uint64_t)rk->remote_packets[n], s))
            return 1;
        for (int q = 0; q < run->P; q++) base[q] = proto_row_base(run, rk->m, q, s);
        for (int64_t j = 0; j < rk->remote_packets[n]; j++) {
            const uint8_t *pkt = rk->recv + proto_off_packet(run, n, j);
            const int32_t tok = get32(pkt, 0);
            const uint32_t mask = (uint32_t)get32(pkt, 1);
            if (tok < 0 || tok >= run->T_max || !mask || mask >> run->P)
                return proto_fail(rk, "forward: packet %lld from peer %d has token %d, mask 0x%x",
                                  (long long)j, s, tok, mask);
            for (int k = 0; k < run->K; k++) {
                topk[k] = get32(pkt, 2 + (size_t)run->P + (size_t)k);
                if (topk[k] < -1 || topk[k] >= run->E)
                    return proto_fail(rk, "forward: packet %lld from peer %d has expert %d", (long long)j, s,
                                      topk[k]);
            }
            if (run->cfg->with_weights)
                memcpy(w, pkt + 4 * (2 + (size_t)run->P + (size_t)run->K), sizeof(float) * (size_t)run->K);
            for (int q = 0; q < run->P; q++) {
                if (!(mask >> q & 1)) continue;
                const int32_t ri = get32(pkt, 2 + (size_t)q);
                if (ri < 0 || ri >= run->nodes[rk->m].per_rank[(size_t)s * run->P + q])
                    return proto_fail(rk, "forward: packet %lld from peer %d has index %d for local rank %d",
                                      (long long)j, s, ri, q);
                write_row(rk, q, base[q] + ri, s, tok, topk, run->cfg->with_weights ? w : NULL,
                          pkt + run->hdr);
            }
        }
    }
    return 0;
}

/* ---- combine --------------------------------------------------------------------------------------- */

/* The fp32 partial of this node for one token: 0 + y rows of the masked local ranks, ascending. */
static void node_partial(rank_t *rk, uint32_t mask, const int64_t *rows, float *part, float *part_w)
{
    run_t *run = rk->run;
    for (int64_t c = 0; c < run->H; c++) part[c] = 0.0f;
    for (int k = 0; part_w && k < run->K; k++) part_w[k] = 0.0f;
    for (int q = 0; q < run->P; q++) {
        if (!(mask >> q & 1)) continue;
        const rank_t *peer = &run->ranks[rk->m * run->P + q];
        const uint16_t *y = peer->y + rows[q] * run->H;
        for (int64_t c = 0; c < run->H; c++) part[c] = ref_fadd(part[c], ref_bf16_to_f32(y[c]));
        for (int k = 0; part_w && k < run->K; k++)
            part_w[k] = ref_fadd(part_w[k], peer->out->w[rows[q] * run->K + k]);
        proto_count_local(rk, rk->m * run->P + q, 2 * (uint64_t)run->H + (part_w ? 4 * (uint64_t)run->K : 0));
    }
}

/* Combine step 2: per received packet the node's partial, as bf16, back to its source. */
static int combine_forward(rank_t *rk)
{
    run_t *run = rk->run;
    float *part = malloc(sizeof(float) * (size_t)run->H);
    float part_w[64];
    int64_t rows[32];
    if (!part) return proto_fail(rk, "combine: out of memory");
    for (int n = 0; n < run->N; n++) {
        if (n == rk->m) continue;
        const int s = n * run->P + rk->l;
        for (int64_t j = 0; j < rk->remote_packets[n]; j++) {
            const uint8_t *pkt = rk->recv + proto_off_packet(run, n, j);
            const int32_t tok = get32(pkt, 0);
            const uint32_t mask = (uint32_t)get32(pkt, 1);
            for (int q = 0; q < run->P; q++)
                rows[q] = (mask >> q & 1) ? proto_row_base(run, rk->m, q, s) + get32(pkt, 2 + (size_t)q) : 0;
            node_partial(rk, mask, rows, part, run->cfg->with_weights ? part_w : NULL);
            uint8_t *dst = rk->send + proto_off_partial(run, n, j);
            for (int64_t c = 0; c < run->H; c++) {
                const uint16_t b = ref_f32_to_bf16(part[c]);
                memcpy(dst + 2 * c, &b, 2);
            }
            if (run->cfg->with_weights) memcpy(dst + 2 * run->H, part_w, sizeof(float) * (size_t)run->K);
            if (proto_net_put(rk, "combine", CTX_COMBINE, s, proto_off_partial(run, rk->m, tok),
                              proto_off_partial(run, n, j), run->cpkt, (int)SIG_COMBINE(rk->m),
                              EPX_NET_SIGNAL_WEAK)) {
                free(part);
                return 1;
            }
        }
    }
    free(part);
    return 0;
}

/* Combine steps 3 and 4: own node's partials in fp32, then the sum over nodes ascending. */
static int combine_sum(rank_t *rk)
{
    run_t *run = rk->run;
    const int64_t T = rk->in->T, H = run->H;
    const int K = run->K, with_w = run->cfg->with_weights;
    int64_t rows[32];
    for (int64_t t = 0; t < T; t++) {
        const uint32_t mask = rk->node_mask[t * run->N + rk->m];
        if (!mask) continue;
        for (int q = 0; q < run->P; q++)
            rows[q] = (mask >> q & 1) ? proto_row_base(run, rk->m, q, rk->r) +
                                            rk->rank_index[t * run->R + rk->m * run->P + q]
                                      : 0;
        node_partial(rk, mask, rows, rk->own_part + t * H, with_w ? rk->own_part_w + t * K : NULL);
    }
    for (int n = 0; n < run->N; n++)
        if (n != rk->m &&
            proto_wait_signal(rk, "combine", SIG_COMBINE(n), (uint64_t)rk->to_node[n], n * run->P + rk->l))
            return 1;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t c = 0; c < H; c++) {
            float acc = 0.0f;
            for (int n = 0; n < run->N; n++) {
                if (!rk->node_mask[t * run->N + n]) continue;
                float part;
                if (n == rk->m) {
                    part = rk->own_part[t * H + c];
                } else {
                    uint16_t b;
                    memcpy(&b, rk->recv + proto_off_partial(run, n, t) + 2 * c, 2);
                    part = ref_bf16_to_f32(b);
                }
                acc = ref_fadd(acc, part);
            }
            if (rk->in->bias0) acc = ref_fadd(acc, ref_bf16_to_f32(rk->in->bias0[t * H + c]));
            if (rk->in->bias1) acc = ref_fadd(acc, ref_bf16_to_f32(rk->in->bias1[t * H + c]));
            rk->out->combined[t * H + c] = ref_f32_to_bf16(acc);
        }
        for (int k = 0; with_w && k < K; k++) {
            float acc = 0.0f;
            for (int n = 0; n < run->N; n++) {
                if (!rk->node_mask[t * run->N + n]) continue;
                float part;
                if (n == rk->m)
                    part = rk->own_part_w[t * K + k];
                else
                    memcpy(&part, rk->recv + proto_off_partial(run, n, t) + 2 * H + 4 * (size_t)k, 4);
                acc = ref_fadd(acc, part);
            }
            rk->out->combined_w[t * K + k] = acc;
        }
    }
    return 0;
}

/* ---- a rank -------------------------------------------------------------------------------------- */

void *proto_rank_main(void *arg)
{
    rank_t *rk = arg;
    run_t *run = rk->run;
    layout(rk);
    proto_publish_own_counts(rk); /* they need nothing from the network */
    if (send_all(rk) || counts_in(rk) || proto_node_barrier(rk, "notify", 1)) return NULL;
    offsets(rk);
    local_legs(rk);
    if (forward(rk) || proto_flush(rk, "dispatch", CTX_DISPATCH) || proto_node_barrier(rk, "dispatch", 2))
        return NULL;
    rk->stats.dispatch_net_bytes = rk->stats.net_bytes;

    for (int64_t i = 0; i < rk->out->n; i++)
        run->make_y(run->y_ctx, rk->r, rk->out->src[i], rk->out->tok[i], rk->y + i * run->H);
    if (proto_node_barrier(rk, "combine", 3) || combine_forward(rk) || combine_sum(rk) ||
        proto_flush(rk, "combine", CTX_COMBINE) || proto_node_barrier(rk, "combine", 4))
        return NULL;
    return NULL;
}
