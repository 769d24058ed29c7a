/*
 * epx-bench inputs: token values, fp8 bytes, scales and weights made from (rank, token, channel),
 * and the routing of every rank, so that every output can be recomputed on any rank.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "tool.h"

static uint32_t mix3(uint32_t a, uint32_t b, uint32_t c)
{
    uint32_t h = a * 0x9e3779b1u ^ (b + 0x7f4a7c15u) * 0x85ebca77u ^ (c + 0x165667b1u) * 0xc2b2ae3du;
    h ^= h >> 15;
    h *= 0x2c1b3c6du;
    h ^= h >> 12;
    h *= 0x297a2d39u;
    return h ^ (h >> 15);
}

/* Token values are multiples of 1/8 in [-4, 4) and weights multiples of 1/16 in (0, 1], so every
 * product and partial sum below is exact in fp32 and the reference matches any summation
 * hardware bit for bit. tag < 0: the dispatched x; tag >= 0: a combine input (rank or expert). */
float value_of(int src, int64_t token, int64_t channel, int tag)
{
    uint32_t h = mix3((uint32_t)src + 256u * (uint32_t)(tag + 1), (uint32_t)token, (uint32_t)channel);
    return (float)((int)(h % 64) - 32) / 8.0f;
}

uint8_t fp8_byte_of(int src, int64_t token, int64_t channel)
{
    uint32_t h = mix3((uint32_t)src, (uint32_t)token, (uint32_t)channel);
    return (uint8_t)((h % 0x7f) | ((h >> 16) & 0x80)); /* any finite e4m3, never NaN */
}

float scale_of(int src, int64_t token, int64_t group)
{
    return 1.0f + (float)(mix3((uint32_t)src + 77u, (uint32_t)token, (uint32_t)group) % 16) / 16.0f;
}

float weight_of(int src, int64_t token, int k)
{
    return (float)(1 + mix3((uint32_t)src + 99u, (uint32_t)token, (uint32_t)k) % 16) / 16.0f;
}

void routing_free(bench_routing_t *rt)
{
    free(rt->topk);
    free(rt->ht_src);
    free(rt->ht_tok);
    free(rt->exp_off);
    free(rt->exp_src);
    free(rt->exp_tok);
    free(rt->exp_k);
    memset(rt, 0, sizeof(*rt));
}

int token_on_rank(const bench_routing_t *rt, int s, int64_t t, int r)
{
    const int32_t *idx = rt->topk + ((int64_t)s * rt->T + t) * rt->K;
    for (int k = 0; k < rt->K; k++)
        if (idx[k] >= 0 && idx[k] / rt->L == r) return 1;
    return 0;
}

/* K distinct experts per token, uniformly, from a generator seeded by (seed, rank, token). */
static void draw_topk(bench_routing_t *rt, uint64_t seed)
{
    for (int s = 0; s < rt->R; s++)
        for (int64_t t = 0; t < rt->T; t++) {
            uint64_t state = seed ^ ((uint64_t)s << 40) ^ (uint64_t)t;
            int32_t *idx = rt->topk + ((int64_t)s * rt->T + t) * rt->K;
            for (int k = 0; k < rt->K;) {
                uint64_t z = (state += 0x9e3779b97f4a7c15ull);
                z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
                z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
                int32_t e = (int32_t)((z ^ (z >> 31)) % (uint64_t)rt->E);
                int dup = 0;
                for (int i = 0; i < k; i++) dup |= idx[i] == e;
                if (!dup) idx[k++] = e;
            }
        }
}

int routing_build(bench_routing_t *rt, const bench_opts_t *opt, int me, int64_t T, int experts)
{
    memset(rt, 0, sizeof(*rt));
    rt->T = T;
    rt->R = opt->nranks;
    rt->K = opt->topk;
    rt->E = experts;
    rt->L = experts / opt->nranks;
    rt->me = me;
    int64_t slots = (int64_t)rt->R * T * rt->K;
    rt->topk = malloc((size_t)(slots ? slots : 1) * sizeof(int32_t));
    rt->ht_src = malloc((size_t)(rt->R * T + 1) * sizeof(int32_t));
    rt->ht_tok = malloc((size_t)(rt->R * T + 1) * sizeof(int32_t));
    rt->exp_off = calloc((size_t)rt->L + 1, sizeof(int64_t));
    rt->exp_src = malloc((size_t)(slots + 1) * sizeof(int32_t));
    rt->exp_tok = malloc((size_t)(slots + 1) * sizeof(int32_t));
    rt->exp_k = malloc((size_t)(slots + 1) * sizeof(int32_t));
    int64_t *fill = calloc((size_t)rt->L, sizeof(int64_t));
    if (!rt->topk || !rt->ht_src || !rt->ht_tok || !rt->exp_off || !rt->exp_src || !rt->exp_tok ||
        !rt->exp_k || !fill) {
        free(fill);
        routing_free(rt);
        fprintf(stderr, "rank %d: out of memory for the routing of %lld tokens\n", me, (long long)T);
        return -1;
    }
    draw_topk(rt, opt->seed);
    for (int s = 0; s < rt->R; s++)
        for (int64_t t = 0; t < T; t++) {
            const int32_t *idx = rt->topk + ((int64_t)s * T + t) * rt->K;
            if (token_on_rank(rt, s, t, me)) {
                rt->ht_src[rt->n_ht] = s;
                rt->ht_tok[rt->n_ht++] = (int32_t)t;
            }
            for (int k = 0; k < rt->K; k++)
                if (idx[k] / rt->L == me) rt->exp_off[idx[k] % rt->L + 1]++;
        }
    for (int j = 0; j < rt->L; j++) rt->exp_off[j + 1] += rt->exp_off[j];
    for (int s = 0; s < rt->R; s++)
        for (int64_t t = 0; t < T; t++) {
            const int32_t *idx = rt->topk + ((int64_t)s * T + t) * rt->K;
            for (int k = 0; k < rt->K; k++) {
                if (idx[k] / rt->L != me) continue;
                int j = idx[k] % rt->L;
                int64_t row = rt->exp_off[j] + fill[j]++;
                rt->exp_src[row] = s;
                rt->exp_tok[row] = (int32_t)t;
                rt->exp_k[row] = k;
            }
        }
    free(fill);
    for (int64_t t = 0; t < T; t++) {
        for (int r = 0; r < rt->R; r++) rt->sent_rank_rows += token_on_rank(rt, me, t, r);
        rt->sent_expert_rows += rt->K;
    }
    return 0;
}

void routing_legs(bench_routing_t *rt, int ranks_per_node)
{
    const int P = ranks_per_node, me = rt->me;
    rt->net_rank_rows = rt->nvl_rank_rows = rt->net_expert_rows = rt->nvl_expert_rows = 0;
    rt->ranks_per_node = P > 0 && P < rt->R ? P : rt->R;
    if (rt->ranks_per_node == rt->R) return;
    const int node = me / P;
    for (int s = 0; s < rt->R; s++) {
        /* My tokens, and those I forward: a source of another node with my local index. */
        if (s != me && (s / P == node || s % P != me % P)) continue;
        for (int64_t t = 0; t < rt->T; t++) {
            for (int r = node * P; r < node * P + P; r++) rt->nvl_rank_rows += r != me && token_on_rank(rt, s, t, r);
            if (s != me) continue;
            for (int n = 0; n < rt->R / P; n++) {
                int hit = 0;
                for (int r = n * P; r < n * P + P && n != node; r++) hit |= token_on_rank(rt, me, t, r);
                rt->net_rank_rows += hit;
            }
            const int32_t *idx = rt->topk + ((int64_t)me * rt->T + t) * rt->K;
            for (int k = 0; k < rt->K; k++) {
                const int owner = idx[k] < 0 ? me : idx[k] / rt->L;
                rt->net_expert_rows += owner / P != node;
                rt->nvl_expert_rows += owner / P == node && owner != me;
            }
        }
    }
}

void fill_x(void *x, float *scales, epx_dtype_t dtype, int me, int64_t T, int64_t H)
{
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = 0; c < H; c++) {
            if (dtype == EPX_DTYPE_FP8_E4M3)
                ((uint8_t *)x)[t * H + c] = fp8_byte_of(me, t, c);
            else
                ((uint16_t *)x)[t * H + c] = epx_f32_to_bf16(value_of(me, t, c, -1));
        }
    if (dtype == EPX_DTYPE_FP8_E4M3)
        for (int64_t t = 0; t < T; t++)
            for (int64_t g = 0; g < H / 128; g++) scales[t * (H / 128) + g] = scale_of(me, t, g);
}

void fill_topk(const bench_routing_t *rt, int32_t *idx, float *w)
{
    for (int64_t t = 0; t < rt->T; t++)
        for (int k = 0; k < rt->K; k++) {
            idx[t * rt->K + k] = rt->topk[((int64_t)rt->me * rt->T + t) * rt->K + k];
            w[t * rt->K + k] = weight_of(rt->me, t, k);
        }
}

int64_t row_bytes(epx_dtype_t dtype, int64_t H)
{
    return dtype == EPX_DTYPE_FP8_E4M3 ? H + H / 128 * (int64_t)sizeof(float) : H * 2;
}

/* The routing-map rows take -L local experts per rank when given, the others -E experts. */
int experts_of(const bench_opts_t *opt, int group)
{
    if (group == GROUP_PERMUTE && opt->local_experts > 0) return opt->local_experts * opt->nranks;
    return opt->experts;
}

int op_inputs(const bench_op_t *o, bench_mem_t *m, epx_dtype_t dtype, bench_inputs_t *in)
{
    bench_rank_t *b = o->b;
    const int64_t T = o->T, H = o->H, G = o->G, K = o->rt->K;
    const size_t esz = epx_dtype_size(dtype), x_bytes = (size_t)(T * H) * esz, s_bytes = (size_t)(T * G) * 4;
    const int fp8 = dtype == EPX_DTYPE_FP8_E4M3;
    in->x = dev_take(b, m, x_bytes);
    in->x_scales = fp8 ? dev_take(b, m, s_bytes) : NULL;
    in->topk = dev_take(b, m, (size_t)(T * K) * sizeof(int32_t));
    in->w = dev_take(b, m, (size_t)(T * K) * sizeof(float));
    in->htopk = host_take(m, (size_t)(T * K) * sizeof(int32_t));
    in->hw = host_take(m, (size_t)(T * K) * sizeof(float));
    void *hx = malloc(x_bytes ? x_bytes : 1);
    float *hs = fp8 ? malloc(s_bytes ? s_bytes : 1) : NULL;
    int rc = -1;
    if (!m->failed && hx && (hs || !fp8)) {
        fill_x(hx, hs, dtype, b->rank, T, H);
        fill_topk(o->rt, in->htopk, in->hw);
        rc = mem_put(b, in->x, hx, x_bytes) || (fp8 && mem_put(b, in->x_scales, hs, s_bytes)) ||
                     mem_put(b, in->topk, in->htopk, (size_t)(T * K) * sizeof(int32_t)) ||
                     mem_put(b, in->w, in->hw, (size_t)(T * K) * sizeof(float))
                 ? -1
                 : 0;
    }
    free(hs);
    free(hx);
    return rc;
}
