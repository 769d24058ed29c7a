/*
 * HT dispatch and combine on the host backend with 2 and 4 ranks: every received row, index,
 * weight and count, and every combined value, is recomputed from (rank, token, channel). Also a
 * cached dispatch and a static-shape dispatch whose bound drops rows on one rank.
 */
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "epx_test.h"

#define TM            24
#define HID           256
#define TOPK          4
#define LOCAL_EXPERTS 3
#define ALIGN         4

typedef struct world {
    int R, E;
    uint64_t seed;
    int64_t T[8];
    int64_t topk[8][TM][TOPK];
} world_t;

/* Every rank builds the same routing of every rank from the seed. */
static void make_world(world_t *w, int R, uint64_t seed)
{
    memset(w, 0, sizeof(*w));
    w->R = R;
    w->E = R * LOCAL_EXPERTS;
    w->seed = seed;
    for (int s = 0; s < R; s++) {
        uint64_t st = seed * 1000003ull + (uint64_t)s;
        w->T[s] = TM - (int64_t)(epx_test_rand(&st) % 6); /* ragged, and never above T_max */
        for (int64_t t = 0; t < w->T[s]; t++) {
            int n = 0;
            while (n < TOPK) {
                int64_t e = (int64_t)(epx_test_rand(&st) % (uint64_t)w->E);
                int dup = 0;
                for (int k = 0; k < n; k++) dup |= w->topk[s][t][k] == e;
                if (dup) continue;
                w->topk[s][t][n++] = e;
            }
            for (int k = 0; k < TOPK; k++)
                if (t == 1 || epx_test_rand(&st) % 5 == 0) w->topk[s][t][k] = -1; /* token 1 goes nowhere */
        }
    }
}

static int goes_to(const world_t *w, int s, int64_t t, int r)
{
    for (int k = 0; k < TOPK; k++)
        if (w->topk[s][t][k] >= 0 && w->topk[s][t][k] / LOCAL_EXPERTS == r) return 1;
    return 0;
}

/* Row of (s, t) on rank r, -1 if it is not sent there. */
static int64_t row_on(const world_t *w, int s, int64_t t, int r)
{
    if (!goes_to(w, s, t, r)) return -1;
    int64_t row = 0;
    for (int s2 = 0; s2 < w->R; s2++)
        for (int64_t t2 = 0; t2 < w->T[s2]; t2++) {
            if (s2 == s && t2 == t) return row;
            row += goes_to(w, s2, t2, r);
        }
    return -1;
}

static int64_t rows_on(const world_t *w, int r)
{
    int64_t n = 0;
    for (int s = 0; s < w->R; s++)
        for (int64_t t = 0; t < w->T[s]; t++) n += goes_to(w, s, t, r);
    return n;
}

static float xval(int s, int64_t t, int64_t h)
{
    return (float)((s * 37 + t * 11 + h * 3) % 61 - 30) / 16.0f;
}
static float wval(int s, int64_t t, int k)
{
    return 0.25f * (float)(k + 1) + (float)s + (float)t / 64.0f;
}
/* Expert output of rank r for the row of (s, t): rounded to bf16 like a real one. */
static uint16_t yval(int r, int s, int64_t t, int64_t h)
{
    return epx_f32_to_bf16(xval(s, t, h) * 1.37f + (float)r * 0.01f + (float)h * 0.003f);
}
static uint16_t bias_val(int which, int s, int64_t t, int64_t h)
{
    return epx_f32_to_bf16((float)which * 0.5f - (float)((t + h + s) % 7) * 0.0625f);
}

typedef struct recv_set {
    int64_t n;
    int32_t src[TM * 8];
    int32_t tok[TM * 8];
} recv_set_t;

static void list_rows(const world_t *w, int me, recv_set_t *rs)
{
    rs->n = 0;
    for (int s = 0; s < w->R; s++)
        for (int64_t t = 0; t < w->T[s]; t++)
            if (goes_to(w, s, t, me)) {
                rs->src[rs->n] = s;
                rs->tok[rs->n++] = (int32_t)t;
            }
}

/* Checks a combine's output on source `me`; rows of ranks at or past bound[r] were dropped. */
static int check_combined(const world_t *w, int me, const uint16_t *out, const float *out_w, int with_bias,
                          const int64_t *bound)
{
    for (int64_t t = 0; t < w->T[me]; t++) {
        for (int64_t h = 0; h < HID; h++) {
            float acc = 0.0f;
            for (int r = 0; r < w->R; r++) {
                int64_t row = row_on(w, me, t, r);
                if (row >= 0 && (!bound || row < bound[r])) acc += epx_bf16_to_f32(yval(r, me, t, h));
            }
            if (with_bias) {
                acc += epx_bf16_to_f32(bias_val(0, me, t, h));
                acc += epx_bf16_to_f32(bias_val(1, me, t, h));
            }
            if (out[t * HID + h] != epx_f32_to_bf16(acc)) {
                fprintf(stderr, "rank %d: combined[%lld][%lld] = %04x, expected %04x\n", me, (long long)t,
                        (long long)h, out[t * HID + h], epx_f32_to_bf16(acc));
                return 1;
            }
        }
        for (int k = 0; out_w && k < TOPK; k++) {
            float expected = w->topk[me][t][k] >= 0 ? wval(me, t, k) : 0.0f;
            if (out_w[t * TOPK + k] != expected) {
                fprintf(stderr, "rank %d: combined weight[%lld][%d] = %g, expected %g\n", me, (long long)t, k,
                        out_w[t * TOPK + k], expected);
                return 1;
            }
        }
    }
    return 0;
}

/* Fills the expert outputs of this rank's received rows. */
static void fill_y(int me, const recv_set_t *rs, int64_t rows, uint16_t *y)
{
    for (int64_t i = 0; i < rows; i++)
        for (int64_t h = 0; h < HID; h++) y[i * HID + h] = yval(me, rs->src[i], rs->tok[i], h);
}

/* Rows 0..n of recv_x and their local expert indices (int64 or int32) against the listed sources. */
static int check_rows(const world_t *w, int me, const recv_set_t *rs, int64_t n, const uint16_t *recv_x,
                      const void *recv_idx, int idx64)
{
    for (int64_t i = 0; i < n; i++) {
        const int s = rs->src[i];
        const int64_t t = rs->tok[i];
        for (int64_t h = 0; h < HID; h++) EXPECT_EQ_INT(recv_x[i * HID + h], epx_f32_to_bf16(xval(s, t, h)));
        for (int k = 0; k < TOPK; k++) {
            const int64_t e = w->topk[s][t][k], j = i * TOPK + k;
            EXPECT_EQ_INT(idx64 ? ((const int64_t *)recv_idx)[j] : ((const int32_t *)recv_idx)[j],
                          e >= 0 && e / LOCAL_EXPERTS == me ? e - me * LOCAL_EXPERTS : -1);
        }
    }
    return 0;
}

static int run_rank(int me, int R, const epx_unique_id_t *id, void *ctx)
{
    world_t *w = malloc(sizeof(*w));
    recv_set_t *rs = malloc(sizeof(*rs));
    if (!w || !rs) return 1;
    make_world(w, R, *(uint64_t *)ctx);
    list_rows(w, me, rs);
    const int64_t T = w->T[me], N = rs->n, cap = R * TM;

    epx_comm_t comm;
    EXPECT_OK(epx_test_host_comm(id, me, R, 20000, &comm));
    epx_buffer_config_t bc = epx_test_buffer_config(TM, HID, TOPK, w->E, EPX_MODE_HT);
    epx_buffer_t buf;
    EXPECT_OK(epx_buffer_create(comm, &bc, &buf));

    uint16_t *x = malloc(TM * HID * 2), *recv_x = malloc((size_t)cap * HID * 2);
    int64_t *topk = malloc(TM * TOPK * 8), *recv_idx = malloc((size_t)cap * TOPK * 8);
    float *weights = malloc(TM * TOPK * 4), *recv_w = malloc((size_t)cap * TOPK * 4);
    float *x32 = malloc(TM * HID * 4), *recv_x32 = malloc((size_t)cap * HID * 4);
    uint16_t *y = malloc((size_t)(cap + 8) * HID * 2), *out = malloc(TM * HID * 2);
    uint16_t *bias0 = malloc(TM * HID * 2), *bias1 = malloc(TM * HID * 2);
    int32_t *recv_idx32 = malloc((size_t)cap * TOPK * 4);
    float *out_w = malloc(TM * TOPK * 4);
    int32_t per_expert[LOCAL_EXPERTS], num_recv = -1;
    if (!x || !recv_x || !topk || !recv_idx || !weights || !recv_w || !x32 || !recv_x32 || !y || !out ||
        !bias0 || !bias1 || !recv_idx32 || !out_w)
        return 1;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < HID; h++) {
            x[t * HID + h] = epx_f32_to_bf16(xval(me, t, h));
            x32[t * HID + h] = -xval(me, t, h) * 3.0f + 0.125f;
            bias0[t * HID + h] = bias_val(0, me, t, h);
            bias1[t * HID + h] = bias_val(1, me, t, h);
        }
        for (int k = 0; k < TOPK; k++) {
            topk[t * TOPK + k] = w->topk[me][t][k];
            weights[t * TOPK + k] = wval(me, t, k);
        }
    }

    /* 1. Routed dispatch, exact output size: rows, local ids, weights, counts. */
    epx_ht_dispatch_args_t da = epx_test_ht_dispatch_args(x, topk, weights, T, HID, TOPK);
    da.expert_alignment = ALIGN;
    epx_ht_dispatch_outputs_t dout = epx_test_ht_dispatch_outputs(recv_x, recv_idx, recv_w, N, HID, TOPK);
    dout.num_recv_tokens_per_expert = epx_tensor_1d(per_expert, EPX_DTYPE_INT32, LOCAL_EXPERTS);
    dout.num_recv_tokens = epx_tensor_1d(&num_recv, EPX_DTYPE_INT32, 1);
    EXPECT_OK(epx_ht_dispatch(buf, &da, &dout));
    EXPECT_EQ_INT(dout.num_recv_tokens_host, N);
    EXPECT_EQ_INT(num_recv, N);
    if (check_rows(w, me, rs, N, recv_x, recv_idx, 1)) return 1;
    int32_t expected_count[LOCAL_EXPERTS] = {0};
    for (int64_t i = 0; i < N; i++)
        for (int k = 0; k < TOPK; k++) {
            const int64_t local = recv_idx[i * TOPK + k];
            EXPECT_TRUE(recv_w[i * TOPK + k] == (local >= 0 ? wval(rs->src[i], rs->tok[i], k) : 0.0f));
            if (local >= 0) expected_count[local]++;
        }
    for (int j = 0; j < LOCAL_EXPERTS; j++)
        EXPECT_EQ_INT(per_expert[j], (expected_count[j] + ALIGN - 1) / ALIGN * ALIGN);
    epx_handle_t handle = dout.handle;

    /* 2. Combine with weights and both biases. */
    fill_y(me, rs, N, y);
    epx_ht_combine_args_t ca = epx_test_ht_combine_args(handle, y, recv_w, N, HID, TOPK);
    ca.bias0 = epx_tensor_2d(bias0, EPX_DTYPE_BF16, T, HID);
    ca.bias1 = epx_tensor_2d(bias1, EPX_DTYPE_BF16, T, HID);
    epx_ht_combine_outputs_t co = epx_test_ht_combine_outputs(out, out_w, T, HID, TOPK);
    EXPECT_OK(epx_ht_combine(buf, &ca, &co));
    if (check_combined(w, me, out, out_w, 1, NULL)) return 1;

    /* 3. Cached dispatch of fp32 rows with the same routing. */
    epx_ht_dispatch_args_t cda = EPX_HT_DISPATCH_ARGS_INIT;
    cda.x = epx_tensor_2d(x32, EPX_DTYPE_FP32, T, HID);
    cda.cached_handle = handle;
    cda.expert_alignment = 1;
    epx_ht_dispatch_outputs_t cdo = EPX_HT_DISPATCH_OUTPUTS_INIT;
    cdo.recv_x = epx_tensor_2d(recv_x32, EPX_DTYPE_FP32, N, HID);
    EXPECT_OK(epx_ht_dispatch(buf, &cda, &cdo));
    for (int64_t i = 0; i < N; i++)
        for (int64_t h = 0; h < HID; h++)
            EXPECT_TRUE(recv_x32[i * HID + h] == -xval(rs->src[i], rs->tok[i], h) * 3.0f + 0.125f);
    EXPECT_OK(epx_handle_destroy(handle));

    /* 4. Static shape: rank 0's bound is two rows short (rows dropped, overflow flagged, real
     * count reported); the others have room to spare. The combine leaves dropped rows out. */
    int64_t bound[8];
    for (int r = 0; r < R; r++) {
        int64_t n = rows_on(w, r);
        bound[r] = r == 0 ? (n > 2 ? n - 2 : 1) : n + 3;
    }
    const int64_t W = bound[me], kept = N < W ? N : W;
    EXPECT_RES(epx_buffer_query_overflow(buf), EPX_SUCCESS);
    epx_ht_dispatch_args_t sa = da;
    sa.expert_alignment = 1;
    sa.num_worst_tokens = W;
    epx_ht_dispatch_outputs_t so = EPX_HT_DISPATCH_OUTPUTS_INIT;
    so.recv_x = epx_tensor_2d(recv_x, EPX_DTYPE_BF16, W, HID);
    so.recv_topk_idx = epx_tensor_2d(recv_idx32, EPX_DTYPE_INT32, W, TOPK);
    so.num_recv_tokens = epx_tensor_1d(&num_recv, EPX_DTYPE_INT32, 1);
    num_recv = -1;
    EXPECT_OK(epx_ht_dispatch(buf, &sa, &so));
    EXPECT_EQ_INT(so.num_recv_tokens_host, -1); /* static mode: the tensor has N_r */
    EXPECT_EQ_INT(num_recv, N);
    if (check_rows(w, me, rs, kept, recv_x, recv_idx32, 0)) return 1;
    EXPECT_RES(epx_buffer_query_overflow(buf), N > W ? EPX_ERR_OVERFLOW : EPX_SUCCESS);
    EXPECT_RES(epx_buffer_query_overflow(buf), EPX_SUCCESS);
    if (me == 0) EXPECT_TRUE(N > W); /* the case this step exists for */

    /* The handle has the bound's rows; rows past the real count (NaN here) contribute nothing. */
    epx_handle_info_t sinfo;
    EXPECT_OK(epx_handle_get_info(so.handle, &sinfo));
    EXPECT_EQ_INT(sinfo.num_recv_tokens, W);
    fill_y(me, rs, kept, y);
    for (int64_t i = kept * HID; i < W * HID; i++) y[i] = 0x7fc0;
    epx_ht_combine_args_t sca = EPX_HT_COMBINE_ARGS_INIT;
    sca.handle = so.handle;
    sca.x = epx_tensor_2d(y, EPX_DTYPE_BF16, W, HID);
    epx_ht_combine_outputs_t sco = EPX_HT_COMBINE_OUTPUTS_INIT;
    sco.combined_x = epx_tensor_2d(out, EPX_DTYPE_BF16, T, HID);
    EXPECT_OK(epx_ht_combine(buf, &sca, &sco));
    if (check_combined(w, me, out, NULL, 0, bound)) return 1;
    EXPECT_OK(epx_handle_destroy(so.handle));

    /* 5. Default mode with too small a recv_x fails on every rank (that rank with its own error,
     * the others naming it), writing nothing and making no handle; the next call still works. */
    if (rows_on(w, R - 1) > 0) { /* the same decision on every rank: the call is collective */
        epx_ht_dispatch_outputs_t small = EPX_HT_DISPATCH_OUTPUTS_INIT;
        memset(recv_x, 0xab, 2);
        small.recv_x = epx_tensor_2d(recv_x, EPX_DTYPE_BF16, me == R - 1 ? N - 1 : N, HID);
        epx_ht_dispatch_args_t ua = da;
        ua.topk_weights.data = NULL;
        epx_result_t res = epx_ht_dispatch(buf, &ua, &small);
        if (me == R - 1) {
            EXPECT_RES(res, EPX_ERR_INVALID_ARG);
            EXPECT_MSG_HAS("arrive");
        } else {
            char peer[32];
            snprintf(peer, sizeof(peer), "peer %d", R - 1);
            EXPECT_RES(res, EPX_ERR_REMOTE);
            EXPECT_MSG_HAS(peer);
        }
        EXPECT_EQ_INT(recv_x[0], 0xabab);
        EXPECT_TRUE(small.handle == NULL);
    }
    EXPECT_OK(epx_ht_dispatch(buf, &da, &dout));
    EXPECT_EQ_INT(dout.num_recv_tokens_host, N);
    EXPECT_OK(epx_handle_destroy(dout.handle));

    /* 6. Rank 0 fails its argument checks: it reports why, the others see EPX_ERR_REMOTE. */
    epx_ht_dispatch_args_t ba = da;
    int64_t saved = topk[0];
    if (me == 0) topk[0] = w->E; /* out of range */
    dout.handle = NULL;
    epx_result_t res = epx_ht_dispatch(buf, &ba, &dout);
    topk[0] = saved;
    EXPECT_RES(res, me == 0 ? EPX_ERR_INVALID_ARG : EPX_ERR_REMOTE);
    if (me != 0) EXPECT_MSG_HAS("peer 0");
    EXPECT_TRUE(dout.handle == NULL);

    /* 7. Ranks disagree on the dtype of x: every rank fails with EPX_ERR_MISMATCH. */
    epx_ht_dispatch_args_t ma = da;
    epx_ht_dispatch_outputs_t mo = dout;
    if (me == R - 1) {
        ma.x = epx_tensor_2d(x32, EPX_DTYPE_FP32, T, HID);
        mo.recv_x = epx_tensor_2d(recv_x32, EPX_DTYPE_FP32, N, HID);
    }
    EXPECT_RES(epx_ht_dispatch(buf, &ma, &mo), EPX_ERR_MISMATCH);
    EXPECT_MSG_HAS("dtype");

    /* 8. And everything still works afterwards. */
    EXPECT_OK(epx_ht_dispatch(buf, &da, &dout));
    EXPECT_EQ_INT(dout.num_recv_tokens_host, N);
    if (N > 0)
        EXPECT_EQ_INT(recv_x[(N - 1) * HID + 5], epx_f32_to_bf16(xval(rs->src[N - 1], rs->tok[N - 1], 5)));
    ca.handle = dout.handle;
    EXPECT_OK(epx_ht_combine(buf, &ca, &co));
    if (check_combined(w, me, out, out_w, 1, NULL)) return 1;
    EXPECT_OK(epx_handle_destroy(dout.handle));

    /* 9. The layout of no tokens, its empty tensors with NULL data (the API accepts that): counts of
     * zero, and no NULL handed to memset (the sanitizer builds abort on that, even for 0 bytes). */
    {
        int32_t per_rank[8], per_exp[64];
        memset(per_rank, 0xff, sizeof(per_rank));
        memset(per_exp, 0xff, sizeof(per_exp));
        const epx_tensor_t none = epx_tensor_2d(NULL, EPX_DTYPE_INT64, 0, TOPK);
        epx_layout_outputs_t lo = EPX_LAYOUT_OUTPUTS_INIT;
        lo.num_tokens_per_rank = epx_tensor_1d(per_rank, EPX_DTYPE_INT32, R);
        lo.num_tokens_per_expert = epx_tensor_1d(per_exp, EPX_DTYPE_INT32, w->E);
        lo.is_token_in_rank = epx_tensor_2d(NULL, EPX_DTYPE_BOOL, 0, R);
        EXPECT_TRUE(R <= 8 && w->E <= 64);
        EXPECT_OK(epx_get_dispatch_layout(buf, &none, &lo, NULL));
        for (int r = 0; r < R; r++) EXPECT_EQ_INT(per_rank[r], 0);
        for (int e = 0; e < w->E; e++) EXPECT_EQ_INT(per_exp[e], 0);
    }

    EXPECT_OK(epx_buffer_destroy(buf));
    EXPECT_OK(epx_comm_destroy(comm));
    free(out_w), free(recv_idx32), free(bias1), free(bias0), free(out), free(y), free(recv_x32), free(x32);
    free(recv_w), free(weights), free(recv_idx), free(topk), free(recv_x), free(x), free(rs), free(w);
    return 0;
}

int main(void)
{
    uint64_t seed = epx_test_seed();
    for (int R = 2; R <= 4; R += 2) {
        if (epx_test_run_ranks(R, run_rank, &seed, 120) != 0) {
            fprintf(stderr, "failed with %d ranks (seed %llu)\n", R, (unsigned long long)seed);
            return 1;
        }
    }
    printf("ok\n");
    return 0;
}
