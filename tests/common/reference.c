/*
 * The tests' reference: each operation of docs/reference.md computed in one process from every
 * rank's inputs, in the pinned fp32 order (so combine results are compared bit for bit), plus
 * generators that make any input element from (seed, tag, rank, token, channel).
 */
#include "reference.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epx_test.h"

/* ------------------------------------------------------------------- numeric formats ---- */

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

float ref_bf16_to_f32(uint16_t v)
{
    return bits_f32((uint32_t)v << 16);
}

uint16_t ref_f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if (isnan(f)) return (uint16_t)((u >> 16) | 0x0040u);
    /* Add just under half an ulp, plus one when the kept lsb is odd: ties go to even. */
    uint32_t keep_lsb = (u >> 16) & 1u;
    return (uint16_t)((u + 0x7fffu + keep_lsb) >> 16);
}

float ref_fp8_to_f32(uint8_t v)
{
    int exp = (v >> 3) & 0xf, man = v & 0x7;
    if (exp == 0xf && man == 0x7) return NAN;
    double mag = exp == 0 ? man * 0x1p-9 : (1.0 + man / 8.0) * ldexp(1.0, exp - 7);
    return (float)((v & 0x80) ? -mag : mag);
}

uint8_t ref_f32_to_fp8(float f)
{
    if (isnan(f)) return 0x7f;
    uint8_t sign = signbit(f) ? 0x80 : 0x00;
    double a = fabs((double)f);
    if (a >= 448.0) return sign | 0x7e;
    if (a < 0x1p-6) {
        /* Subnormal spacing is 2^-9; a result of 8 is the smallest normal, code 0x08. */
        return sign | (uint8_t)nearbyint(a * 512.0);
    }
    int e2;
    double m = frexp(a, &e2); /* a = m * 2^e2, m in [0.5, 1) */
    int exp = e2 - 1;
    int man = (int)nearbyint((2.0 * m - 1.0) * 8.0);
    if (man == 8) {
        man = 0;
        exp++;
    }
    int code = ((exp + 7) << 3) | man;
    if (code > 0x7e) code = 0x7e;
    return sign | (uint8_t)code;
}

float ref_fadd(float a, float b)
{
    volatile double s = (double)a + (double)b;
    return (float)s;
}

float ref_fmul(float a, float b)
{
    volatile double m = (double)a * (double)b;
    return (float)m;
}

/* ------------------------------------------------------------------------ generators ---- */

static uint64_t mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t ref_hash(uint64_t seed, uint64_t tag, uint64_t a, uint64_t b, uint64_t c)
{
    uint64_t h = mix64(seed ^ (tag * 0xd6e8feb86659fd93ull));
    h = mix64(h ^ a);
    h = mix64(h ^ b);
    return mix64(h ^ c);
}

uint16_t ref_gen_bf16(uint64_t seed, uint64_t tag, uint64_t a, uint64_t b, uint64_t c)
{
    uint64_t g = ref_hash(seed, tag, a, b, (c / 128) | (1ull << 62));
    int base;
    switch (g % 8) {
    case 0: base = -20; break; /* whole group below the fp8 amax floor of 1e-4 */
    case 1: base = 6; break;
    default: base = (int)((g >> 8) % 7) - 3; break;
    }
    uint64_t h = ref_hash(seed, tag, a, b, c);
    if ((h & 63) == 0) return (h & 64) ? 0x8000 : 0x0000;
    int exp = base - (int)((h >> 8) % 4);
    uint16_t sign = (uint16_t)(((h >> 7) & 1u) << 15);
    return (uint16_t)(sign | (uint16_t)((exp + 127) << 7) | (uint16_t)((h >> 16) & 0x7f));
}

float ref_gen_f32(uint64_t seed, uint64_t tag, uint64_t a, uint64_t b, uint64_t c)
{
    uint64_t h = ref_hash(seed, tag, a, b, c);
    uint32_t exp = 117u + (uint32_t)((h >> 32) % 20);
    return bits_f32((uint32_t)((h & 1u) << 31) | (exp << 23) | (uint32_t)((h >> 1) & 0x7fffffu));
}

uint8_t ref_gen_fp8(uint64_t seed, uint64_t tag, uint64_t a, uint64_t b, uint64_t c)
{
    uint8_t v = (uint8_t)(ref_hash(seed, tag, a, b, c) >> 24);
    if ((v & 0x7f) == 0x7f) v ^= 0x01;
    return v;
}

float ref_gen_unit(uint64_t seed, uint64_t tag, uint64_t a, uint64_t b, uint64_t c)
{
    return (float)((ref_hash(seed, tag, a, b, c) >> 40) + 1) * 0x1p-24f;
}

uint16_t ref_y_bf16(uint64_t yseed, int r, int j, int s, int64_t t, int64_t c)
{
    return ref_gen_bf16(yseed, REF_TAG_Y, (uint64_t)r * 4096u + (uint64_t)(j + 1),
                        ((uint64_t)s << 32) | (uint64_t)t, (uint64_t)c);
}

const char *ref_routing_name(ref_routing_t routing)
{
    switch (routing) {
    case REF_ROUTE_RANDOM: return "random";
    case REF_ROUTE_SKEWED: return "skewed";
    case REF_ROUTE_GROUPED: return "grouped";
    default: return "?";
    }
}

void ref_gen_token_counts(uint64_t seed, int iter, int R, int64_t T_max, int64_t *T_out)
{
    for (int s = 0; s < R; s++) {
        if (iter == 0)
            T_out[s] = T_max;
        else if (iter == 1 && (s == 0 || s == R - 1))
            T_out[s] = 0;
        else
            T_out[s] = (int64_t)(ref_hash(seed, REF_TAG_TOKENS, (uint64_t)iter, (uint64_t)s, 0) %
                                 (uint64_t)(T_max + 1));
    }
}

void *ref_alloc(size_t bytes)
{
    return calloc(1, bytes ? bytes : 1);
}

static bool row_has(const int64_t *row, int K, int64_t e)
{
    for (int k = 0; k < K; k++)
        if (row[k] == e) return true;
    return false;
}

static void gen_route_row(const ref_problem_t *p, ref_routing_t routing, int s, int64_t t, int64_t *row)
{
    uint64_t st = ref_hash(p->seed, REF_TAG_ROUTE, (uint64_t)s, (uint64_t)t, 0);
    for (int k = 0; k < p->K; k++) row[k] = -1;
    if (routing == REF_ROUTE_SKEWED) {
        row[t % p->K] = (int64_t)(ref_hash(p->seed, REF_TAG_ROUTE, 1u << 20, 0, 0) % (uint64_t)p->E);
        return;
    }
    if (routing == REF_ROUTE_RANDOM && epx_test_rand(&st) % 16 == 0) return; /* sent nowhere */
    int64_t lo = 0, span = p->E, want = p->K;
    if (routing == REF_ROUTE_GROUPED) {
        lo = (int64_t)(epx_test_rand(&st) % (uint64_t)p->R) * p->L;
        span = p->L;
        want = p->K < p->L ? p->K : p->L;
    }
    for (int64_t k = 0; k < want; k++) {
        int64_t e;
        do {
            e = lo + (int64_t)(epx_test_rand(&st) % (uint64_t)span);
        } while (row_has(row, (int)k, e));
        row[k] = e;
    }
    /* Scatter -1 slots among the experts. */
    for (int k = p->K - 1; k > 0; k--) {
        int i = (int)(epx_test_rand(&st) % (uint64_t)(k + 1));
        int64_t tmp = row[k];
        row[k] = row[i];
        row[i] = tmp;
    }
    if (routing == REF_ROUTE_RANDOM)
        for (int k = 0; k < p->K; k++)
            if (epx_test_rand(&st) % 8 == 0) row[k] = -1;
}

int ref_problem_init(ref_problem_t *p, int R, int E, int K, int64_t H, int64_t T_max, epx_dtype_t dtype,
                     uint64_t seed, const int64_t *T, ref_routing_t routing)
{
    memset(p, 0, sizeof(*p));
    if (R < 1 || R > REF_MAX_RANKS || E % R != 0 || K < 1 || K > E) return 1;
    p->R = R;
    p->ranks_per_node = R;
    p->E = E;
    p->L = E / R;
    p->K = K;
    p->H = H;
    p->T_max = T_max;
    p->seed = seed;
    p->dtype = dtype;
    for (int s = 0; s < R; s++) {
        p->T[s] = T[s];
        p->topk[s] = ref_alloc(sizeof(int64_t) * (size_t)(T[s] * K));
        p->weights[s] = ref_alloc(sizeof(float) * (size_t)(T[s] * K));
        if (!p->topk[s] || !p->weights[s]) return 1;
        for (int64_t t = 0; t < T[s]; t++) {
            gen_route_row(p, routing, s, t, p->topk[s] + t * K);
            for (int k = 0; k < K; k++)
                p->weights[s][t * K + k] =
                    ref_gen_unit(seed, REF_TAG_WEIGHT, (uint64_t)s, (uint64_t)t, (uint64_t)k);
        }
    }
    return 0;
}

/* Frees the arrays of a reference result and zeroes the result (`size` bytes at `out`). */
static void free_result(void *out, size_t size, void *const *arrays, size_t n)
{
    for (size_t i = 0; i < n; i++) free(arrays[i]);
    memset(out, 0, size);
}
#define FREE_RESULT(out, ...)                                        \
    free_result((out), sizeof(*(out)), (void *const[]){__VA_ARGS__}, \
                sizeof((void *const[]){__VA_ARGS__}) / sizeof(void *))

void ref_problem_free(ref_problem_t *p)
{
    for (int s = 0; s < p->R; s++) {
        free(p->topk[s]);
        free(p->weights[s]);
    }
    memset(p, 0, sizeof(*p));
}

void ref_x_row(const ref_problem_t *p, int s, int64_t t, uint64_t tag, void *dst)
{
    for (int64_t c = 0; c < p->H; c++) {
        switch (p->dtype) {
        case EPX_DTYPE_BF16:
            ((uint16_t *)dst)[c] = ref_gen_bf16(p->seed, tag, (uint64_t)s, (uint64_t)t, (uint64_t)c);
            break;
        case EPX_DTYPE_FP32:
            ((float *)dst)[c] = ref_gen_f32(p->seed, tag, (uint64_t)s, (uint64_t)t, (uint64_t)c);
            break;
        default:
            ((uint8_t *)dst)[c] = ref_gen_fp8(p->seed, tag, (uint64_t)s, (uint64_t)t, (uint64_t)c);
            break;
        }
    }
}

void ref_scales_row(const ref_problem_t *p, int s, int64_t t, uint64_t tag, float *dst)
{
    for (int64_t g = 0; g < p->H / 128; g++)
        dst[g] =
            4.0f * ref_gen_unit(p->seed, REF_TAG_SCALE * 64 + tag, (uint64_t)s, (uint64_t)t, (uint64_t)g);
}

void ref_fill_topk(const ref_problem_t *p, int s, epx_dtype_t idx_dtype, void *dst)
{
    for (int64_t i = 0; i < p->T[s] * p->K; i++) {
        if (idx_dtype == EPX_DTYPE_INT64)
            ((int64_t *)dst)[i] = p->topk[s][i];
        else
            ((int32_t *)dst)[i] = (int32_t)p->topk[s][i];
    }
}

bool ref_selected(const ref_problem_t *p, int s, int64_t t, int e)
{
    return row_has(p->topk[s] + t * p->K, p->K, e);
}

float ref_prob(const ref_problem_t *p, int s, int64_t t, int e)
{
    return ref_gen_unit(p->seed, REF_TAG_PROB, (uint64_t)s, (uint64_t)t, (uint64_t)e);
}

/* Token t of rank s has at least one expert on rank r. */
static bool to_rank(const ref_problem_t *p, int s, int64_t t, int r)
{
    const int64_t *row = p->topk[s] + t * p->K;
    for (int k = 0; k < p->K; k++)
        if (row[k] >= 0 && row[k] / p->L == r) return true;
    return false;
}

/* -------------------------------------------------------------------------- layout ---- */

void ref_layout(const ref_problem_t *p, int s, int D, int32_t *per_rank, int32_t *per_expert,
                uint8_t *in_rank, int32_t *per_domain)
{
    memset(per_rank, 0, sizeof(int32_t) * (size_t)p->R);
    memset(per_expert, 0, sizeof(int32_t) * (size_t)p->E);
    if (per_domain) memset(per_domain, 0, sizeof(int32_t) * (size_t)(p->R / D));
    for (int64_t t = 0; t < p->T[s]; t++) {
        for (int k = 0; k < p->K; k++) {
            int64_t e = p->topk[s][t * p->K + k];
            if (e >= 0) per_expert[e]++;
        }
        for (int r = 0; r < p->R; r++) {
            bool in = to_rank(p, s, t, r);
            in_rank[t * p->R + r] = in ? 1 : 0;
            if (in) per_rank[r]++;
        }
        if (per_domain)
            for (int d = 0; d < p->R / D; d++) {
                bool in = false;
                for (int r = d * D; r < (d + 1) * D; r++) in = in || to_rank(p, s, t, r);
                if (in) per_domain[d]++;
            }
    }
}

void ref_rank_prefix(const ref_problem_t *p, int32_t *m)
{
    const int R = p->R;
    for (int s = 0; s < R; s++)
        for (int d = 0; d < R; d++) {
            int32_t n = s > 0 ? m[(s - 1) * R + d] : 0;
            for (int64_t t = 0; t < p->T[s]; t++) n += to_rank(p, s, t, d) ? 1 : 0;
            m[s * R + d] = n;
        }
}

/* ----------------------------------------------------------------------- HT dispatch ---- */

int ref_ht_dispatch(const ref_problem_t *p, int r, int alignment, ref_ht_recv_t *out)
{
    memset(out, 0, sizeof(*out));
    int64_t n = 0;
    for (int s = 0; s < p->R; s++)
        for (int64_t t = 0; t < p->T[s]; t++) n += to_rank(p, s, t, r);
    out->n = n;
    out->src = ref_alloc(sizeof(int32_t) * (size_t)n);
    out->tok = ref_alloc(sizeof(int64_t) * (size_t)n);
    out->idx = ref_alloc(sizeof(int64_t) * (size_t)(n * p->K));
    out->w = ref_alloc(sizeof(float) * (size_t)(n * p->K));
    out->per_expert = ref_alloc(sizeof(int32_t) * (size_t)p->L);
    if (!out->src || !out->tok || !out->idx || !out->w || !out->per_expert) return 1;
    int64_t i = 0;
    for (int s = 0; s < p->R; s++)
        for (int64_t t = 0; t < p->T[s]; t++) {
            if (!to_rank(p, s, t, r)) continue;
            out->src[i] = s;
            out->tok[i] = t;
            for (int k = 0; k < p->K; k++) {
                int64_t e = p->topk[s][t * p->K + k];
                bool here = e >= 0 && e / p->L == r;
                out->idx[i * p->K + k] = here ? e - (int64_t)r * p->L : -1;
                out->w[i * p->K + k] = here ? p->weights[s][t * p->K + k] : 0.0f;
                if (here) out->per_expert[e - (int64_t)r * p->L]++;
            }
            i++;
        }
    for (int j = 0; j < p->L; j++)
        out->per_expert[j] = (out->per_expert[j] + alignment - 1) / alignment * alignment;
    return 0;
}

void ref_ht_recv_free(ref_ht_recv_t *out)
{
    FREE_RESULT(out, out->src, out->tok, out->idx, out->w, out->per_expert);
}

/* One node's partial joins a combine element's sum (Pinned details, Sums; nodes ascending, only
 * nodes with a contribution): as is from the source's own node, rounded to bf16 from a remote one
 * (what crosses the network). With one node the sum is 0.0f + the partial: the flat sum. */
static float ref_add_node(float acc, float part, bool remote)
{
    return ref_fadd(acc, remote ? ref_bf16_to_f32(ref_f32_to_bf16(part)) : part);
}

void ref_ht_combine(const ref_problem_t *p, int s, uint64_t yseed, bool bias0, bool bias1, uint16_t *out,
                    float *out_w)
{
    /* Pinned order: per node ranks ascending, the node sum, then bias0, then bias1, one rounding. */
    for (int64_t t = 0; t < p->T[s]; t++) {
        bool dest[REF_MAX_RANKS];
        for (int r = 0; r < p->R; r++) dest[r] = to_rank(p, s, t, r);
        for (int64_t c = 0; c < p->H; c++) {
            float part[REF_MAX_RANKS] = {0};
            bool has[REF_MAX_RANKS] = {0};
            for (int r = 0; r < p->R; r++) {
                if (!dest[r]) continue;
                const int n = r / p->ranks_per_node;
                part[n] = ref_fadd(part[n], ref_bf16_to_f32(ref_y_bf16(yseed, r, -1, s, t, c)));
                has[n] = true;
            }
            float acc = 0.0f;
            for (int n = 0; n < p->R / p->ranks_per_node; n++)
                if (has[n]) acc = ref_add_node(acc, part[n], n != s / p->ranks_per_node);
            if (bias0)
                acc = ref_fadd(acc, ref_bf16_to_f32(ref_gen_bf16(yseed, REF_TAG_BIAS0, (uint64_t)s,
                                                                 (uint64_t)t, (uint64_t)c)));
            if (bias1)
                acc = ref_fadd(acc, ref_bf16_to_f32(ref_gen_bf16(yseed, REF_TAG_BIAS1, (uint64_t)s,
                                                                 (uint64_t)t, (uint64_t)c)));
            out[t * p->H + c] = ref_f32_to_bf16(acc);
        }
        if (!out_w) continue;
        /* Weights: flat over ranks on any split (one rank holds each slot's weight, exact). */
        for (int k = 0; k < p->K; k++) {
            int64_t e = p->topk[s][t * p->K + k];
            float acc = 0.0f;
            for (int r = 0; r < p->R; r++)
                if (dest[r])
                    acc = ref_fadd(acc, (e >= 0 && e / p->L == r) ? p->weights[s][t * p->K + k] : 0.0f);
            out_w[t * p->K + k] = acc;
        }
    }
}

/* ----------------------------------------------------------------------- LL dispatch ---- */

int ref_ll_dispatch(const ref_problem_t *p, int r, ref_ll_recv_t *out)
{
    memset(out, 0, sizeof(*out));
    int64_t rt = p->R * p->T_max;
    out->count = ref_alloc(sizeof(int32_t) * (size_t)p->L);
    out->src = ref_alloc(sizeof(int32_t) * (size_t)(p->L * rt));
    out->tok = ref_alloc(sizeof(int32_t) * (size_t)(p->L * rt));
    out->range = ref_alloc(sizeof(int64_t) * (size_t)(p->L * p->R));
    if (!out->count || !out->src || !out->tok || !out->range) return 1;
    for (int j = 0; j < p->L; j++) {
        int e = r * p->L + j;
        int32_t rows = 0;
        for (int s = 0; s < p->R; s++) {
            int32_t begin = rows, n = 0;
            for (int64_t t = 0; t < p->T[s]; t++) {
                if (!ref_selected(p, s, t, e)) continue;
                out->src[j * rt + rows] = s;
                out->tok[j * rt + rows] = (int32_t)t;
                rows++;
                n++;
            }
            out->range[j * p->R + s] = n ? ((int64_t)begin << 32) | n : 0;
        }
        out->count[j] = rows;
    }
    return 0;
}

void ref_ll_recv_free(ref_ll_recv_t *out)
{
    FREE_RESULT(out, out->count, out->src, out->tok, out->range);
}

void ref_ll_cast(const uint16_t *row, int64_t H, bool round_scale, uint8_t *q, float *scale_inv)
{
    for (int64_t g = 0; g < H / 128; g++) {
        float amax = 0.0f;
        for (int64_t c = g * 128; c < (g + 1) * 128; c++) {
            float v = fabsf(ref_bf16_to_f32(row[c]));
            if (v > amax) amax = v;
        }
        if (amax < 1e-4f) amax = 1e-4f;
        float si = amax / 448.0f;
        if (round_scale) {
            uint32_t b = f32_bits(si);
            if (b & 0x7fffffu) si = bits_f32((b & 0x7f800000u) + 0x00800000u);
        }
        scale_inv[g] = si;
        for (int64_t c = g * 128; c < (g + 1) * 128; c++) q[c] = ref_f32_to_fp8(ref_bf16_to_f32(row[c]) / si);
    }
}

void ref_ll_combine(const ref_problem_t *p, int s, uint64_t yseed, uint16_t *out)
{
    /* Pinned order: slots k ascending, acc += w * y in fp32, one rounding. */
    for (int64_t t = 0; t < p->T[s]; t++)
        for (int64_t c = 0; c < p->H; c++) {
            float acc = 0.0f;
            for (int k = 0; k < p->K; k++) {
                int64_t e = p->topk[s][t * p->K + k];
                if (e < 0) continue;
                float y = ref_bf16_to_f32(ref_y_bf16(yseed, (int)(e / p->L), (int)(e % p->L), s, t, c));
                acc = ref_fadd(acc, ref_fmul(p->weights[s][t * p->K + k], y));
            }
            out[t * p->H + c] = ref_f32_to_bf16(acc);
        }
}

/* ---------------------------------------------------------------- routing-map dispatch ---- */

int ref_rm_dispatch(const ref_problem_t *p, int r, bool permute, int pad, int64_t bound, ref_rm_recv_t *out)
{
    memset(out, 0, sizeof(*out));
    int L = p->L;
    out->tokens_per_expert = ref_alloc(sizeof(int32_t) * (size_t)L);
    if (!out->tokens_per_expert) return 1;
    /* Real rows first (unbounded), then cut or extend to the bound. */
    int64_t real = 0;
    if (!permute) {
        for (int s = 0; s < p->R; s++)
            for (int64_t t = 0; t < p->T[s]; t++) real += to_rank(p, s, t, r);
    } else {
        for (int j = 0; j < L; j++) {
            int64_t n = 0;
            for (int s = 0; s < p->R; s++)
                for (int64_t t = 0; t < p->T[s]; t++) n += ref_selected(p, s, t, r * L + j);
            out->tokens_per_expert[j] = (int32_t)((n + pad - 1) / pad * pad);
            real += out->tokens_per_expert[j];
        }
    }
    int64_t rows = bound >= 0 ? bound : real;
    int64_t pw = permute ? 1 : L;
    out->real = real;
    out->rows = rows;
    out->src = ref_alloc(sizeof(int32_t) * (size_t)rows);
    out->tok = ref_alloc(sizeof(int64_t) * (size_t)rows);
    out->j = ref_alloc(sizeof(int32_t) * (size_t)rows);
    out->probs = ref_alloc(sizeof(float) * (size_t)(rows * pw));
    if (!out->src || !out->tok || !out->j || !out->probs) return 1;
    for (int64_t i = 0; i < rows; i++) {
        out->src[i] = -1;
        out->j[i] = -1;
    }
    int64_t i = 0;
    if (!permute) {
        for (int s = 0; s < p->R; s++)
            for (int64_t t = 0; t < p->T[s]; t++) {
                if (!to_rank(p, s, t, r)) continue;
                if (i < rows) {
                    out->src[i] = s;
                    out->tok[i] = t;
                    for (int j = 0; j < L; j++)
                        out->probs[i * L + j] =
                            ref_selected(p, s, t, r * L + j) ? ref_prob(p, s, t, r * L + j) : 0.0f;
                }
                i++;
            }
        return 0;
    }
    for (int j = 0; j < L; j++) {
        int64_t group_end = i + out->tokens_per_expert[j];
        for (int s = 0; s < p->R; s++)
            for (int64_t t = 0; t < p->T[s]; t++) {
                if (!ref_selected(p, s, t, r * L + j)) continue;
                if (i < rows) {
                    out->src[i] = s;
                    out->tok[i] = t;
                    out->j[i] = j;
                    out->probs[i] = ref_prob(p, s, t, r * L + j);
                }
                i++;
            }
        for (; i < group_end; i++)
            if (i < rows) out->j[i] = j;
    }
    return 0;
}

void ref_rm_recv_free(ref_rm_recv_t *out)
{
    FREE_RESULT(out, out->src, out->tok, out->j, out->probs, out->tokens_per_expert);
}

void ref_rm_local_map(const ref_problem_t *p, int r, int64_t rows, uint8_t *out)
{
    memset(out, 0, (size_t)(rows * p->L));
    int64_t n = 0;
    for (int s = 0; s < p->R; s++)
        for (int64_t t = 0; t < p->T[s]; t++) {
            bool any = false;
            for (int l = 0; l < p->L; l++)
                if (ref_selected(p, s, t, r * p->L + l)) out[n * p->L + l] = 1, any = true;
            n += any;
        }
}

int ref_rm_combine(const ref_problem_t *p, int s, bool permute, int pad, const int64_t *bounds, bool weighted,
                   uint64_t yseed, uint16_t *out)
{
    /* Pinned order: per node ranks ascending, then (with permute) local experts ascending, into the
     * node's partial (a rank's rows for one token appear in ascending group order, so walking its rows
     * in order keeps that order); each complete node then joins the sum (ref_add_node). */
    const int64_t TH = p->T[s] * p->H;
    const int P = p->ranks_per_node;
    float *acc = ref_alloc(sizeof(float) * (size_t)TH), *part = ref_alloc(sizeof(float) * (size_t)TH);
    bool *has = ref_alloc((size_t)p->T[s]);
    int rc = !acc || !part || !has;
    for (int r = 0; r < p->R && !rc; r++) {
        if (r % P == 0) {
            memset(part, 0, sizeof(float) * (size_t)TH);
            memset(has, 0, (size_t)p->T[s]);
        }
        ref_rm_recv_t rv;
        rc = ref_rm_dispatch(p, r, permute, pad, bounds ? bounds[r] : -1, &rv);
        int64_t lim = rc ? 0 : rv.real < rv.rows ? rv.real : rv.rows;
        for (int64_t i = 0; i < lim; i++) {
            if (rv.src[i] != s) continue;
            int64_t t = rv.tok[i];
            float w = permute && weighted ? ref_prob(p, s, t, r * p->L + rv.j[i]) : 1.0f;
            for (int64_t c = 0; c < p->H; c++) {
                float y = ref_bf16_to_f32(ref_y_bf16(yseed, r, permute ? rv.j[i] : -1, s, t, c));
                float term = permute && weighted ? ref_fmul(w, y) : y;
                part[t * p->H + c] = ref_fadd(part[t * p->H + c], term);
            }
            has[t] = true;
        }
        ref_rm_recv_free(&rv);
        if (rc || r % P != P - 1) continue;
        /* Node r / P is complete: it joins each token it contributed to. */
        for (int64_t t = 0; t < p->T[s]; t++)
            for (int64_t c = 0; has[t] && c < p->H; c++)
                acc[t * p->H + c] = ref_add_node(acc[t * p->H + c], part[t * p->H + c], r / P != s / P);
    }
    for (int64_t i = 0; !rc && i < TH; i++) out[i] = ref_f32_to_bf16(acc[i]);
    free(has);
    free(part);
    free(acc);
    return rc;
}

ref_rm_plan_t ref_rm_plan(int it)
{
    static const int pads[4] = {0, 1, 16, 128}; /* 0: without permute */
    const int cfg = it % 4;
    ref_rm_plan_t pl;
    pl.permute = pads[cfg] > 0;
    pl.pad = pl.permute ? pads[cfg] : 1;
    pl.bound = (ref_bound_t)((it / 4) % REF_BOUND_COUNT);
    pl.dtype = (cfg + (int)pl.bound + it / 16) % 2 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
    pl.with_probs = it % 3 != 2;
    pl.weighted = pl.permute && pl.with_probs && (it / 2) % 2;
    pl.routing = (ref_routing_t)((it / 3) % REF_ROUTE_COUNT);
    return pl;
}

const char *ref_bound_name(ref_bound_t bound)
{
    static const char *const names[REF_BOUND_COUNT] = {"none", "equal", "above", "below"};
    return bound >= 0 && bound < REF_BOUND_COUNT ? names[bound] : "?";
}

int ref_rm_bounds(const ref_problem_t *p, bool permute, int pad, ref_bound_t mode, int64_t *bounds)
{
    const int64_t kl = p->K < p->L ? p->K : p->L;
    const int64_t cap = permute ? p->R * p->T_max * kl + p->L * (REF_RM_MAX_PAD - 1) : p->R * p->T_max;
    for (int r = 0; r < p->R; r++) {
        ref_rm_recv_t other;
        const int bad = ref_rm_dispatch(p, r, permute, pad, -1, &other);
        const int64_t real = other.real;
        ref_rm_recv_free(&other);
        if (bad) return 1;
        int64_t b = real;
        switch (mode) {
        case REF_BOUND_NONE: b = -1; break;
        case REF_BOUND_EQUAL: break;
        case REF_BOUND_ABOVE: b = real + 5; break;
        default: b = real >= 2 ? real - (real / 3 > 1 ? real / 3 : 1) : real; break;
        }
        if (mode != REF_BOUND_NONE) b = b < 1 ? 1 : b > cap ? cap : b;
        bounds[r] = b;
    }
    return 0;
}
