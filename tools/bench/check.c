/*
 * epx-bench checks: every output of a timed call is compared with the value recomputed from the
 * inputs (inputs.c). Mismatches are counted per output; the first few are printed.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "tool.h"

void check_fail(bench_check_t *ck, const char *field, int64_t row, int64_t col, double got, double want)
{
    if (ck->bad++ < 5)
        fprintf(stderr, "rank %d: %s: %s[%lld][%lld] = %g, expected %g\n", ck->rank, ck->what, field,
                (long long)row, (long long)col, got, want);
}

void check_x_row(bench_check_t *ck, const char *field, epx_dtype_t dtype, const void *row_data, int64_t row,
                 int src, int64_t token, int64_t H)
{
    for (int64_t c = 0; c < H; c++) {
        if (dtype == EPX_DTYPE_FP8_E4M3) {
            uint8_t got = ((const uint8_t *)row_data)[c], want = fp8_byte_of(src, token, c);
            if (got != want) check_fail(ck, field, row, c, got, want);
        } else {
            uint16_t got = ((const uint16_t *)row_data)[c];
            uint16_t want = epx_f32_to_bf16(value_of(src, token, c, -1));
            if (got != want) check_fail(ck, field, row, c, epx_bf16_to_f32(got), epx_bf16_to_f32(want));
        }
    }
}

void check_scales_row(bench_check_t *ck, const char *field, const float *got, int64_t row, int src,
                      int64_t token, int64_t G)
{
    for (int64_t g = 0; g < G; g++)
        if (got[g] != scale_of(src, token, g)) check_fail(ck, field, row, g, got[g], scale_of(src, token, g));
}

static void check_combined_row(bench_check_t *ck, const uint16_t *got_row, int64_t t, const float *acc,
                               int64_t H)
{
    for (int64_t c = 0; c < H; c++) {
        uint16_t want = epx_f32_to_bf16(acc[c]);
        if (got_row[c] != want) check_fail(ck, "combined", t, c, epx_bf16_to_f32(got_row[c]), acc[c]);
    }
}

void check_ht_recv(bench_check_t *ck, const bench_routing_t *rt, epx_dtype_t dtype, int64_t H, int64_t n,
                   const void *x, const float *scales, const int32_t *topk)
{
    const int64_t G = H / 128, esz = (int64_t)epx_dtype_size(dtype);
    const int K = rt->K, L = rt->L, me = rt->me;
    for (int64_t i = 0; i < n; i++) {
        int s = rt->ht_src[i];
        int64_t t = rt->ht_tok[i];
        check_x_row(ck, "recv_x", dtype, (const uint8_t *)x + i * H * esz, i, s, t, H);
        if (scales) check_scales_row(ck, "recv_x_scales", scales + i * G, i, s, t, G);
        const int32_t *idx = rt->topk + ((int64_t)s * rt->T + t) * K;
        for (int k = 0; topk && k < K; k++) {
            int32_t want = idx[k] / L == me ? idx[k] - me * L : -1;
            if (topk[i * K + k] != want) check_fail(ck, "recv_topk_idx", i, k, topk[i * K + k], want);
        }
    }
}

/* Adds a node's partial sum to the token's accumulator and clears it: another node's partial crosses
 * the network as bf16, the token's own node's stays fp32 (docs/reference.md, Sums). */
static void add_node_partial(float *acc, float *part, int64_t H, int remote)
{
    for (int64_t c = 0; c < H; c++) {
        acc[c] += remote ? epx_bf16_to_f32(epx_f32_to_bf16(part[c])) : part[c];
        part[c] = 0;
    }
}

void check_ht_combined(bench_check_t *ck, const bench_routing_t *rt, int64_t H, const uint16_t *combined)
{
    float *acc = malloc((size_t)H * 2 * sizeof(float)), *part = acc + H;
    if (!acc) {
        check_fail(ck, "combined (out of memory)", 0, 0, 0, 0);
        return;
    }
    const int P = rt->ranks_per_node > 0 ? rt->ranks_per_node : rt->R;
    for (int64_t t = 0; t < rt->T; t++) {
        memset(acc, 0, (size_t)H * 2 * sizeof(float));
        for (int n = 0; n < rt->R / P; n++) {
            int any = 0;
            for (int r = n * P; r < n * P + P; r++)
                if (token_on_rank(rt, rt->me, t, r)) {
                    any = 1;
                    for (int64_t c = 0; c < H; c++) part[c] += value_of(rt->me, t, c, r);
                }
            if (any) add_node_partial(acc, part, H, n != rt->me / P);
        }
        check_combined_row(ck, combined + t * H, t, acc, H);
    }
    free(acc);
}

/* Expected fp8 cast of one bf16 value group (REFERENCE.md, LL fp8 cast). */
static float ll_scale_inv(int src, int64_t t, int64_t g)
{
    float amax = 1e-4f;
    for (int64_t c = g * 128; c < (g + 1) * 128; c++) {
        float v = fabsf(epx_bf16_to_f32(epx_f32_to_bf16(value_of(src, t, c, -1))));
        if (v > amax) amax = v;
    }
    return amax / 448.0f;
}

void check_ll_recv(bench_check_t *ck, const bench_routing_t *rt, int fp8, int64_t H, int64_t slots,
                   const int32_t *count, const void *x, const float *scales)
{
    const int64_t G = H / 128;
    const uint8_t *vx = x;
    for (int j = 0; j < rt->L; j++) {
        int64_t want_count = rt->exp_off[j + 1] - rt->exp_off[j];
        if (count[j] != want_count) {
            check_fail(ck, "recv_count", j, 0, count[j], (double)want_count);
            continue;
        }
        for (int64_t i = 0; i < want_count; i++) {
            int s = rt->exp_src[rt->exp_off[j] + i];
            int64_t t = rt->exp_tok[rt->exp_off[j] + i], r = (int64_t)j * slots + i;
            if (!fp8) {
                check_x_row(ck, "recv_x", EPX_DTYPE_BF16, vx + r * H * 2, r, s, t, H);
                continue;
            }
            for (int64_t g = 0; g < G; g++) {
                float scale_inv = ll_scale_inv(s, t, g), got_scale = scales[((int64_t)j * G + g) * slots + i];
                if (got_scale != scale_inv) check_fail(ck, "recv_scales", r, g, got_scale, scale_inv);
                for (int64_t c = g * 128; c < (g + 1) * 128; c++) {
                    float v = epx_bf16_to_f32(epx_f32_to_bf16(value_of(s, t, c, -1)));
                    uint8_t want = epx_f32_to_fp8_e4m3(v / scale_inv), got = vx[r * H + c];
                    if (got != want) check_fail(ck, "recv_x", r, c, got, want);
                }
            }
        }
    }
}

/* The token's selected experts in ascending order, with the slot k that selected each. */
static int sorted_experts(const bench_routing_t *rt, int64_t t, int32_t *e_out, int *k_out)
{
    const int32_t *idx = rt->topk + ((int64_t)rt->me * rt->T + t) * rt->K;
    int n = 0;
    for (int k = 0; k < rt->K; k++) {
        if (idx[k] < 0) continue;
        int i = n++;
        for (; i > 0 && e_out[i - 1] > idx[k]; i--) {
            e_out[i] = e_out[i - 1];
            k_out[i] = k_out[i - 1];
        }
        e_out[i] = idx[k];
        k_out[i] = k;
    }
    return n;
}

/* Ranks ascending, then local experts ascending: the token's experts in ascending order. */
void check_weighted_combined(bench_check_t *ck, const bench_routing_t *rt, int64_t H, const uint16_t *combined,
                             int tree)
{
    float *acc = malloc((size_t)H * 2 * sizeof(float)), *part = acc + H;
    if (!acc) {
        check_fail(ck, "combined (out of memory)", 0, 0, 0, 0);
        return;
    }
    const int P = tree && rt->ranks_per_node > 0 ? rt->ranks_per_node : rt->R;
    int32_t e[64];
    int ks[64];
    for (int64_t t = 0; t < rt->T; t++) {
        memset(acc, 0, (size_t)H * 2 * sizeof(float));
        int n = sorted_experts(rt, t, e, ks);
        for (int i = 0; i < n; i++) {
            float w = weight_of(rt->me, t, ks[i]);
            for (int64_t c = 0; c < H; c++) part[c] += w * value_of(rt->me, t, c, e[i]);
            const int node = e[i] / rt->L / P;
            if (i + 1 == n || e[i + 1] / rt->L / P != node) add_node_partial(acc, part, H, node != rt->me / P);
        }
        check_combined_row(ck, combined + t * H, t, acc, H);
    }
    free(acc);
}

void check_rm_tokens(bench_check_t *ck, const bench_routing_t *rt, epx_dtype_t dtype, int64_t H,
                     const int64_t *group_start, const void *tokens, const float *probs, const float *scales)
{
    const int64_t G = H / 128, esz = (int64_t)epx_dtype_size(dtype);
    for (int j = 0; j < rt->L; j++)
        for (int64_t r = group_start[j]; r < group_start[j + 1]; r++) {
            int64_t i = rt->exp_off[j] + r - group_start[j];
            const uint8_t *got = (const uint8_t *)tokens + r * H * esz;
            if (i < rt->exp_off[j + 1]) {
                int s = rt->exp_src[i];
                int64_t t = rt->exp_tok[i];
                check_x_row(ck, "tokens", dtype, got, r, s, t, H);
                float want = weight_of(s, t, rt->exp_k[i]);
                if (probs[r] != want) check_fail(ck, "probs", r, 0, probs[r], want);
                if (scales) check_scales_row(ck, "scaling_factor", scales + r * G, r, s, t, G);
            } else {
                for (int64_t c = 0; c < H * esz; c++)
                    if (got[c]) check_fail(ck, "tokens (padding)", r, c, got[c], 0);
                if (probs[r] != 0.0f) check_fail(ck, "probs (padding)", r, 0, probs[r], 0);
            }
        }
}
