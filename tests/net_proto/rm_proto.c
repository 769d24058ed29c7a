/*
 * The internode routing-map protocol of README.md on the host model: one thread per rank, node-shared
 * memory with C11 atomics inside a node, net.h (registered regions, weak put_signal) between nodes. The
 * count messages, node table and region layout are the HT protocol's (proto_common.c); the packets carry
 * the token's indices per local rank (without permute) or per local expert (with permute) and the node's
 * probs, and every rank places rows by its local experts' groups, padded, up to its bound. The numeric
 * helpers (bf16 rounding, one fp32 product or add) are the pinned formats of tests/common/reference.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto_impl.h"
#include "reference.h"
#include "rm_proto.h"

#define POISON_BF16 0x7f00 /* y of a row that holds no token: large, so that reading it would show */

typedef struct rm_run {
    const rm_config_t *cfg;
    rm_make_y_fn make_y;
    void *y_ctx;
    const rm_input_t *in;
    rm_output_t *out;
    int nidx;      /* index words of a packet: P * L with permute, else P */
    size_t probs;  /* byte offset of a packet's probs [P * L] (with_probs) */
    size_t xbytes; /* of a partial: 2 * H (bf16), 4 * H in RM_WRONG_FP32_PARTIAL */
    int64_t cap;   /* rows every output and y is sized for */
} rm_run_t;

typedef struct rm_rank {
    const rm_input_t *in;
    rm_output_t *out;
    int32_t *expert_index; /* [T, E] index of t among this rank's tokens selecting e, -1 none */
    int64_t *base;         /* [P * L][R] with permute, [P][R] without: row of source s's first token */
    int64_t rows_of[16];   /* [P] rows of each local rank: its bound, else its real count */
    int32_t *own_rows;     /* [T] rows of this node that hold token t and were kept */
    float *acc;            /* [H] */
} rm_rank_t;

static const rm_run_t *rmr(const run_t *run)
{
    return run->rm;
}
static rm_rank_t *rmk(const rank_t *rk)
{
    return rk->rm;
}

/* ---- dispatch -------------------------------------------------------------------------------------- */

/* Step 1: destinations, masks, per-destination and per-expert indices and counts of this rank's tokens. */
static void layout(rank_t *rk)
{
    run_t *run = rk->run;
    rm_rank_t *k = rmk(rk);
    const int E = run->E;
    for (int64_t t = 0; t < k->in->T; t++) {
        uint32_t dest = 0;
        for (int e = 0; e < E; e++) {
            k->expert_index[t * E + e] = -1;
            if (!k->in->routing_map[t * E + e]) continue;
            k->expert_index[t * E + e] = rk->per_expert[e]++;
            dest |= 1u << (e / run->L);
        }
        for (int d = 0; d < run->R; d++) {
            if (!(dest >> d & 1)) continue;
            rk->rank_index[t * run->R + d] = rk->to_rank[d]++;
            rk->node_mask[t * run->N + d / run->P] |= 1u << (d % run->P);
            if (d / run->P != rk->m) rk->stats.flat_net_bytes += run->dpkt;
        }
        for (int n = 0; n < run->N; n++) rk->to_node[n] += rk->node_mask[t * run->N + n] != 0;
    }
}

/* Packet j for node n, packed at SEND.dispatch[n][j]: token t, its mask, its indices, the node's probs
 * (0 where t does not select the expert), x. */
static uint8_t *pack_packet(rank_t *rk, int n, int64_t j, int64_t t)
{
    run_t *run = rk->run;
    const rm_rank_t *k = rmk(rk);
    const int PL = run->P * run->L;
    const uint32_t mask = rk->node_mask[t * run->N + n];
    uint8_t *pkt = rk->send + proto_off_packet(run, n, j);
    put32(pkt, 0, (int32_t)t);
    put32(pkt, 1, (int32_t)mask);
    for (int i = 0; i < rmr(run)->nidx; i++)
        put32(pkt, 2 + (size_t)i,
              rmr(run)->cfg->permute ? k->expert_index[t * run->E + n * PL + i]
              : (mask >> i & 1)      ? rk->rank_index[t * run->R + n * run->P + i]
                                     : -1);
    for (int i = 0; rmr(run)->cfg->with_probs && i < PL; i++) {
        const int64_t e = t * run->E + n * PL + i;
        const float p = k->in->routing_map[e] ? k->in->probs[e] : 0.0f;
        memcpy(pkt + rmr(run)->probs + 4 * (size_t)i, &p, 4);
    }
    memcpy(pkt + run->hdr, k->in->x + t * run->H, 2 * (size_t)run->H);
    return pkt;
}

/* Steps 2 and 3 for node n: its packets packed, ascending tokens; to a remote node each put to the
 * forwarder (n, l) at RECV.dispatch[m][j], with a WEAK signal (sig >= 0) or without. */
static int send_packets(rank_t *rk, int n, int sig)
{
    run_t *run = rk->run;
    int64_t j = 0;
    for (int64_t t = 0; t < rmk(rk)->in->T; t++) {
        if (!rk->node_mask[t * run->N + n]) continue;
        pack_packet(rk, n, j, t);
        if (n != rk->m &&
            proto_net_put(rk, "dispatch", CTX_DISPATCH, n * run->P + rk->l, proto_off_packet(run, rk->m, j),
                          proto_off_packet(run, n, j), run->dpkt, sig, EPX_NET_SIGNAL_WEAK))
            return 1;
        j++;
    }
    return 0;
}

/* Steps 2 to 4: every node's packets and the remote nodes' count messages, in the variant's order; then
 * the count messages of this local index in, checked, into the node table. */
static int exchange_counts(rank_t *rk)
{
    run_t *run = rk->run;
    const rm_variant_t v = rmr(run)->cfg->variant;
    if (send_packets(rk, rk->m, -1)) return 1;
    for (int n = 0; n < run->N; n++) {
        if (n == rk->m) continue;
        const int dropped = v == RM_DROP_NOTIFY && rk->r == 0 && n == run->N - 1;
        if (v == RM_WRONG_PUT_ORDER ? send_packets(rk, n, -1) || proto_send_counts(rk, n, SIG_NOTIFY)
                                    : (!dropped && proto_send_counts(rk, n, SIG_NOTIFY)) ||
                                          send_packets(rk, n, (int)SIG_DISPATCH(rk->m)))
            return 1;
    }
    if (run->N > 1 && proto_wait_signal(rk, "notify", SIG_NOTIFY, (uint64_t)(run->N - 1), -1)) return 1;
    return proto_counts_in(rk);
}

/* A zero row of this rank's outputs (padding of group j, or past the real count with j = -1). */
static void zero_row(rank_t *rk, int64_t row, int j)
{
    const run_t *run = rk->run;
    rm_output_t *o = rmk(rk)->out;
    memset(o->tokens + row * run->H, 0, 2 * (size_t)run->H);
    o->src[row] = -1;
    o->tok[row] = 0;
    o->j[row] = j;
    const int64_t pw = rmr(run)->cfg->permute ? 1 : run->L;
    for (int64_t i = 0; rmr(run)->cfg->with_probs && i < pw; i++) o->probs[row * pw + i] = 0.0f;
}

/* Step 5: from the node table, the first row of each source on each local rank (per local expert's group
 * with permute, groups padded), each local rank's rows; this rank's counts and zero rows. */
static int offsets(rank_t *rk)
{
    run_t *run = rk->run;
    rm_rank_t *k = rmk(rk);
    const node_shared_t *node = &run->nodes[rk->m];
    const int P = run->P, L = run->L, R = run->R, permute = rmr(run)->cfg->permute;
    const int64_t pad = rmr(run)->cfg->pad;
    for (int q = 0; q < P; q++) {
        const int own = q == rk->l;
        int64_t real = 0;
        for (int j = 0; permute && j < L; j++) {
            int64_t c = 0;
            for (int s = 0; s < R; s++) {
                k->base[((size_t)q * L + j) * R + s] = real + c;
                c += node->per_expert[(size_t)s * P * L + q * L + j];
            }
            const int64_t g = (c + pad - 1) / pad * pad;
            if (own) k->out->tokens_per_expert[j] = (int32_t)g;
            real += g;
        }
        for (int s = 0; !permute && s < R; s++) k->base[(size_t)q * R + s] = proto_row_base(run, rk->m, q, s);
        if (!permute) real = proto_row_base(run, rk->m, q, R);
        const int64_t bound = rmr(run)->in[rk->m * P + q].bound;
        k->rows_of[q] = bound >= 0 ? bound : real;
        if (k->rows_of[q] > rmr(run)->cap)
            return proto_fail(rk, "dispatch: local rank %d has %lld rows, more than the %lld sized for", q,
                              (long long)k->rows_of[q], (long long)rmr(run)->cap);
        if (!own) continue;
        k->out->real = real;
        k->out->rows = k->rows_of[q];
        k->out->overflow = real > k->out->rows;
    }
    /* Zero rows: each group's padding (permute), then past the real count; clipped to the bound. */
    const int64_t rows = k->out->rows;
    for (int j = 0; permute && j < L; j++) {
        int64_t c = 0;
        for (int s = 0; s < R; s++) c += node->per_expert[(size_t)s * P * L + rk->l * L + j];
        const int64_t begin = k->base[((size_t)rk->l * L + j) * R];
        for (int64_t i = begin + c; i < begin + k->out->tokens_per_expert[j] && i < rows; i++)
            zero_row(rk, i, j);
    }
    for (int64_t i = k->out->real; i < rows; i++) zero_row(rk, i, -1);
    return 0;
}

/* The index word of local rank q (and local expert j with permute) in a packet. */
static int32_t packet_index(const run_t *run, const uint8_t *pkt, int q, int j)
{
    return get32(pkt, 2 + (size_t)(rmr(run)->cfg->permute ? q * run->L + j : q));
}

/* Checks packet j from source s (a network read when s is on another node): token below T_max, mask
 * non-empty within P ranks, each index -1 or below the count s announced for that rank (expert), an index
 * for exactly the masked ranks. Returns 0, or 1 (an error naming rank, peer, stage and field). */
static int check_packet(rank_t *rk, const char *stage, int s, int64_t j, const uint8_t *pkt)
{
    run_t *run = rk->run;
    const node_shared_t *node = &run->nodes[rk->m];
    const int32_t tok = get32(pkt, 0);
    const uint32_t mask = (uint32_t)get32(pkt, 1);
    if (tok < 0 || tok >= run->T_max || !mask || mask >> run->P)
        return proto_fail(rk, "%s: packet %lld from peer %d has token %d, mask 0x%x", stage, (long long)j, s,
                          tok, mask);
    const int permute = rmr(run)->cfg->permute;
    for (int q = 0; q < run->P; q++) {
        int any = 0;
        for (int e = 0; e < (permute ? run->L : 1); e++) {
            const int32_t i = packet_index(run, pkt, q, e);
            const int32_t n = permute ? node->per_expert[((size_t)s * run->P + q) * run->L + e]
                                      : node->per_rank[(size_t)s * run->P + q];
            if (i < -1 || i >= n)
                return proto_fail(rk,
                                  "%s: packet %lld from peer %d has index %d for local rank %d, expert %d "
                                  "(%d announced)",
                                  stage, (long long)j, s, i, q, permute ? e : -1, n);
            any |= i >= 0;
        }
        if (any != (int)(mask >> q & 1))
            return proto_fail(rk,
                              "%s: packet %lld from peer %d: mask 0x%x and its indices for local rank %d "
                              "disagree",
                              stage, (long long)j, s, mask, q);
    }
    return 0;
}

/* Row of (source s, local rank q, local expert j) for index i, or -1 when it is past q's bound (dropped). */
static int64_t row_of(const rank_t *rk, int s, int q, int j, int32_t i)
{
    const run_t *run = rk->run;
    const rm_rank_t *k = rmk(rk);
    const int64_t row = (rmr(run)->cfg->permute ? k->base[((size_t)q * run->L + j) * run->R + s]
                                                : k->base[(size_t)q * run->R + s]) +
                        i;
    return row < k->rows_of[q] ? row : -1;
}

/* Steps 6 and 7: packet j from source s, checked, to the rows of the local ranks of its mask. */
static int place(rank_t *rk, int s, int64_t j, const uint8_t *pkt)
{
    run_t *run = rk->run;
    const int permute = rmr(run)->cfg->permute, with_probs = rmr(run)->cfg->with_probs;
    if (check_packet(rk, "forward", s, j, pkt)) return 1;
    const int32_t tok = get32(pkt, 0);
    const uint32_t mask = (uint32_t)get32(pkt, 1);
    for (int q = 0; q < run->P; q++) {
        if (!(mask >> q & 1)) continue;
        const int d = rk->m * run->P + q;
        rm_output_t *o = rmk(&run->ranks[d])->out;
        for (int e = 0; e < (permute ? run->L : 1); e++) {
            const int32_t i = packet_index(run, pkt, q, e);
            const int64_t row = i < 0 ? -1 : row_of(rk, s, q, e, i);
            if (row < 0) continue;
            memcpy(o->tokens + row * run->H, pkt + run->hdr, 2 * (size_t)run->H);
            o->src[row] = s;
            o->tok[row] = tok;
            o->j[row] = permute ? e : -1;
            const size_t pbytes = with_probs ? 4 * (permute ? 1 : (size_t)run->L) : 0;
            if (with_probs)
                memcpy(permute ? o->probs + row : o->probs + row * run->L,
                       pkt + rmr(run)->probs + 4 * (size_t)(q * run->L + (permute ? e : 0)), pbytes);
            proto_count_local(rk, d, 2 * (uint64_t)run->H + pbytes);
        }
    }
    return 0;
}

/* Steps 6 and 7: this rank's packets for its own node, then each remote node's once all of them landed. */
static int place_all(rank_t *rk)
{
    run_t *run = rk->run;
    const rm_variant_t v = rmr(run)->cfg->variant;
    for (int64_t j = 0; j < rk->to_node[rk->m]; j++)
        if (place(rk, rk->r, j, rk->send + proto_off_packet(run, rk->m, j))) return 1;
    for (int n = 0; n < run->N; n++) {
        if (n == rk->m) continue;
        const int s = n * run->P + rk->l;
        if (v != RM_WRONG_PUT_ORDER &&
            proto_wait_signal(rk, "forward", SIG_DISPATCH(n), (uint64_t)rk->remote_packets[n], s))
            return 1;
        for (int64_t j = 0; j < rk->remote_packets[n]; j++)
            if (place(rk, s, j, rk->recv + proto_off_packet(run, n, j))) return 1;
    }
    return 0;
}

/* ---- combine --------------------------------------------------------------------------------------- */

/* This node's fp32 partial of packet j from source s: 0 + the kept rows of its masked ranks, ascending,
 * and with permute their experts ascending (w * y when weighted). Returns the rows it added, or -1 (a bad
 * packet, reported). */
static int node_partial(rank_t *rk, int s, int64_t j, const uint8_t *pkt, float *part)
{
    run_t *run = rk->run;
    const rm_config_t *cfg = rmr(run)->cfg;
    if (check_packet(rk, "combine", s, j, pkt)) return -1;
    const uint32_t mask = (uint32_t)get32(pkt, 1);
    int rows = 0;
    for (int64_t c = 0; c < run->H; c++) part[c] = 0.0f;
    for (int q = 0; q < run->P; q++) {
        if (!(mask >> q & 1)) continue;
        const rank_t *peer = &run->ranks[rk->m * run->P + q];
        for (int e = 0; e < (cfg->permute ? run->L : 1); e++) {
            const int32_t i = packet_index(run, pkt, q, e);
            const int64_t row = i < 0 ? -1 : row_of(rk, s, q, e, i);
            if (row < 0) continue;
            float w = 1.0f;
            if (cfg->weighted) memcpy(&w, pkt + rmr(run)->probs + 4 * (size_t)(q * run->L + e), 4);
            const uint16_t *y = peer->y + row * run->H;
            for (int64_t c = 0; c < run->H; c++) {
                const float v = ref_bf16_to_f32(y[c]);
                part[c] = ref_fadd(part[c], cfg->weighted ? ref_fmul(w, v) : v);
            }
            proto_count_local(rk, peer->r, 2 * (uint64_t)run->H);
            rows++;
        }
    }
    return rows;
}

/* Combine step 2: per received packet the node's partial, as bf16, and its row count back to its source
 * at RECV.combine[m][token]. */
static int combine_forward(rank_t *rk)
{
    run_t *run = rk->run;
    const int fp32 = rmr(run)->cfg->variant == RM_WRONG_FP32_PARTIAL;
    float *part = rmk(rk)->acc;
    for (int n = 0; n < run->N; n++) {
        if (n == rk->m) continue;
        const int s = n * run->P + rk->l;
        for (int64_t j = 0; j < rk->remote_packets[n]; j++) {
            const uint8_t *pkt = rk->recv + proto_off_packet(run, n, j);
            const int rows = node_partial(rk, s, j, pkt, part);
            if (rows < 0) return 1;
            uint8_t *dst = rk->send + proto_off_partial(run, n, j);
            for (int64_t c = 0; c < run->H; c++) {
                const uint16_t b = ref_f32_to_bf16(part[c]);
                memcpy(dst + (fp32 ? 4 : 2) * c, fp32 ? (const void *)&part[c] : (const void *)&b,
                       fp32 ? 4 : 2);
            }
            put32(dst + rmr(run)->xbytes, 0, rows);
            if (proto_net_put(rk, "combine", CTX_COMBINE, s, proto_off_partial(run, rk->m, get32(pkt, 0)),
                              proto_off_partial(run, n, j), run->cpkt, (int)SIG_COMBINE(rk->m),
                              EPX_NET_SIGNAL_WEAK))
                return 1;
        }
    }
    return 0;
}

/* Combine steps 3 and 4: own node's partials in fp32, then per token the sum over the nodes that kept a
 * row of it, ascending (remote partials through bf16), one rounding. */
static int combine_sum(rank_t *rk)
{
    run_t *run = rk->run;
    rm_rank_t *k = rmk(rk);
    const int64_t T = k->in->T, H = run->H;
    const int fp32 = rmr(run)->cfg->variant == RM_WRONG_FP32_PARTIAL;
    const int32_t most = rmr(run)->cfg->permute ? run->P * run->L : run->P;
    for (int64_t j = 0; j < rk->to_node[rk->m]; j++) {
        const uint8_t *pkt = rk->send + proto_off_packet(run, rk->m, j);
        const int32_t t = get32(pkt, 0);
        if ((k->own_rows[t] = node_partial(rk, rk->r, j, pkt, rk->own_part + t * H)) < 0) return 1;
    }
    for (int n = 0; n < run->N; n++)
        if (n != rk->m &&
            proto_wait_signal(rk, "combine", SIG_COMBINE(n), (uint64_t)rk->to_node[n], n * run->P + rk->l))
            return 1;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t c = 0; c < H; c++) k->acc[c] = 0.0f;
        for (int n = 0; n < run->N; n++) {
            if (!rk->node_mask[t * run->N + n]) continue;
            if (n == rk->m) {
                for (int64_t c = 0; k->own_rows[t] && c < H; c++)
                    k->acc[c] = ref_fadd(k->acc[c], rk->own_part[t * H + c]);
                continue;
            }
            const uint8_t *part = rk->recv + proto_off_partial(run, n, t);
            const int32_t rows = get32(part + rmr(run)->xbytes, 0);
            if (rows < 0 || rows > most)
                return proto_fail(rk,
                                  "combine: the partial of token %lld from peer %d adds %d rows (at most %d)",
                                  (long long)t, n * run->P + rk->l, rows, most);
            for (int64_t c = 0; rows && c < H; c++) {
                float v;
                if (fp32) {
                    memcpy(&v, part + 4 * c, 4);
                } else {
                    uint16_t b;
                    memcpy(&b, part + 2 * c, 2);
                    v = ref_bf16_to_f32(b);
                }
                k->acc[c] = ref_fadd(k->acc[c], v);
            }
        }
        for (int64_t c = 0; c < H; c++) k->out->combined[t * H + c] = ref_f32_to_bf16(k->acc[c]);
    }
    return 0;
}

/* ---- a rank -------------------------------------------------------------------------------------- */

static void *rm_rank_main(void *arg)
{
    rank_t *rk = arg;
    run_t *run = rk->run;
    rm_rank_t *k = rmk(rk);
    layout(rk);
    proto_publish_own_counts(rk); /* they need nothing from the network */
    if (exchange_counts(rk) || proto_node_barrier(rk, "notify", 1) || offsets(rk) || place_all(rk) ||
        proto_flush(rk, "dispatch", CTX_DISPATCH) || proto_node_barrier(rk, "dispatch", 2))
        return NULL;
    rk->stats.dispatch_net_bytes = rk->stats.net_bytes;

    const rm_output_t *o = k->out;
    for (int64_t i = 0; i < o->rows; i++) {
        uint16_t *y = rk->y + i * run->H;
        if (o->src[i] >= 0) {
            rmr(run)->make_y(rmr(run)->y_ctx, rk->r, o->src[i], o->tok[i], o->j[i], y);
            continue;
        }
        for (int64_t c = 0; c < run->H; c++) y[c] = POISON_BF16;
    }
    if (proto_node_barrier(rk, "combine", 3) || combine_forward(rk) || combine_sum(rk) ||
        proto_flush(rk, "combine", CTX_COMBINE) || proto_node_barrier(rk, "combine", 4))
        return NULL;
    return NULL;
}

/* ---- the run --------------------------------------------------------------------------------------- */

void rm_output_free(rm_output_t *out, int R)
{
    for (int r = 0; r < R; r++) {
        free(out[r].tokens);
        free(out[r].probs);
        free(out[r].src);
        free(out[r].tok);
        free(out[r].j);
        free(out[r].tokens_per_expert);
        free(out[r].combined);
    }
    memset(out, 0, sizeof(*out) * (size_t)R);
}

/* A rank's state and outputs, garbage until written; its first error goes to its output. */
static int setup_rank(run_t *run, rank_t *rk, rm_rank_t *k)
{
    const rm_run_t *rr = rmr(run);
    const size_t cap = (size_t)rr->cap, H = (size_t)run->H, T = (size_t)rr->in[rk->r].T;
    rm_output_t *o = &rr->out[rk->r];
    rk->rm = k;
    k->in = &rr->in[rk->r];
    k->out = o;
    rk->error = o->error;
    rk->error_len = sizeof(o->error);
    rk->y = proto_garbage(cap * H * 2);
    rk->own_part = calloc(T * H + 1, sizeof(float));
    k->expert_index = calloc(T * (size_t)run->E + 1, sizeof(int32_t));
    k->base = calloc((size_t)run->P * (size_t)run->L * (size_t)run->R, sizeof(int64_t));
    k->own_rows = calloc(T + 1, sizeof(int32_t));
    k->acc = calloc(H, sizeof(float));
    o->tokens = proto_garbage(cap * H * 2);
    o->probs = rr->cfg->with_probs ? proto_garbage(cap * (rr->cfg->permute ? 1 : (size_t)run->L) * 4) : NULL;
    o->src = proto_garbage(cap * 4);
    o->tok = proto_garbage(cap * 8);
    o->j = proto_garbage(cap * 4);
    o->tokens_per_expert = proto_garbage((size_t)run->L * 4);
    o->combined = proto_garbage(T * H * 2);
    return proto_layout_alloc(rk, (int64_t)T) || !rk->y || !rk->own_part || !k->expert_index || !k->base ||
           !k->own_rows || !k->acc || !o->tokens || (rr->cfg->with_probs && !o->probs) || !o->src ||
           !o->tok || !o->j || !o->tokens_per_expert || !o->combined;
}

static size_t align8(size_t n)
{
    return (n + 7) & ~(size_t)7;
}

int rm_run(const rm_config_t *cfg, const rm_input_t *in, rm_make_y_fn make_y, void *y_ctx, rm_output_t *out,
           proto_stats_t *stats, char *err, size_t err_len)
{
    rm_run_t rr = {.cfg = cfg, .make_y = make_y, .y_ctx = y_ctx, .in = in, .out = out};
    run_t run = {.rm = &rr};
    if (proto_run_init(&run, &cfg->frame, err, err_len)) return 1;
    const int R = run.R, P = run.P, L = run.L;
    if (cfg->pad < 1 || cfg->pad > 1024 || (!cfg->permute && cfg->pad != 1) ||
        (cfg->weighted && (!cfg->permute || !cfg->with_probs))) {
        snprintf(err, err_len, "bad config: permute %d, pad %d, probs %d, weighted %d", cfg->permute,
                 cfg->pad, cfg->with_probs, cfg->weighted);
        return 1;
    }
    /* Real rows: without permute at most R * T_max, with it each group at most R * T_max padded. */
    rr.cap = cfg->permute ? (int64_t)L * ((int64_t)R * run.T_max + cfg->pad - 1) : (int64_t)R * run.T_max;
    for (int r = 0; r < R; r++) {
        if (in[r].T < 0 || in[r].T > run.T_max || in[r].bound < -1 || in[r].bound > ((int64_t)1 << 30)) {
            snprintf(err, err_len, "bad input: rank %d has %lld tokens (T_max %lld), bound %lld", r,
                     (long long)in[r].T, (long long)run.T_max, (long long)in[r].bound);
            return 1;
        }
        if (in[r].bound > rr.cap) rr.cap = in[r].bound;
    }
    memset(out, 0, sizeof(*out) * (size_t)R);
    const size_t H = (size_t)run.H, PL = (size_t)P * (size_t)L;
    rr.nidx = cfg->permute ? P * L : P;
    rr.probs = 4 * (2 + (size_t)rr.nidx);
    rr.xbytes = (cfg->variant == RM_WRONG_FP32_PARTIAL ? 4 : 2) * H;
    run.cmsg = align8(4 * (1 + (size_t)P + PL));
    run.hdr = align8(rr.probs + (cfg->with_probs ? 4 * PL : 0));
    run.dpkt = align8(run.hdr + 2 * H);
    run.cpkt = align8(rr.xbytes + 4);
    run.off_dispatch = run.cmsg * (size_t)run.N;
    run.off_combine = run.off_dispatch + run.dpkt * (size_t)run.N * (size_t)run.T_max;
    run.region_bytes = run.off_combine + run.cpkt * (size_t)run.N * (size_t)run.T_max;
    rm_rank_t *k = calloc((size_t)R, sizeof(rm_rank_t));
    int rc = !k || proto_run_open(&run, 2, 1 + 2 * (uint32_t)run.N) || proto_run_tables(&run);
    for (int r = 0; !rc && r < R; r++) rc = setup_rank(&run, &run.ranks[r], &k[r]);
    if (rc && !err[0]) snprintf(err, err_len, "setup failed");
    if (!rc) rc = proto_run_threads(&run, rm_rank_main, stats);
    for (int r = 0; k && run.ranks && r < R; r++) {
        rank_t *rk = &run.ranks[r];
        proto_layout_free(rk);
        free(rk->y);
        free(rk->own_part);
        free(k[r].expert_index);
        free(k[r].base);
        free(k[r].own_rows);
        free(k[r].acc);
    }
    free(k);
    proto_run_close(&run);
    return rc;
}
