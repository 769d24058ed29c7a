/*
 * Smoke test of the host backend's LL and routing-map operations on 2 and 4 forked ranks: every
 * output is recomputed from inputs built from (rank, token, channel) and a routing drawn from a
 * seed all ranks share, so each rank can also recompute its peers' inputs.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "epx_test.h"

#define T_MAX        8
#define HID          512
#define TOPK         3
#define NEXP         8
#define GARBAGE_BF16 0x7fc0u /* NaN: any read of a row that should not be read shows */

typedef struct world {
    int R, L;
    uint64_t seed;
    int T[4];
    int64_t topk[4][T_MAX * TOPK];
} world_t;

static void world_make(world_t *w, int R, uint64_t seed)
{
    w->R = R;
    w->L = NEXP / R;
    w->seed = seed;
    for (int s = 0; s < R; s++) {
        uint64_t st = seed ^ (0x1234567ull * (uint64_t)(s + 1));
        w->T[s] = 1 + (int)(epx_test_rand(&st) % T_MAX);
        for (int t = 0; t < w->T[s]; t++) {
            int64_t *row = &w->topk[s][t * TOPK];
            for (int k = 0; k < TOPK; k++) row[k] = -1;
            int n = (int)(epx_test_rand(&st) % (TOPK + 1)); /* 0 selects nothing */
            for (int i = 0; i < n; i++) {
                int64_t e;
                int dup;
                do {
                    e = (int64_t)(epx_test_rand(&st) % NEXP);
                    dup = 0;
                    for (int k = 0; k < TOPK; k++) dup |= row[k] == e;
                } while (dup);
                int k;
                do k = (int)(epx_test_rand(&st) % TOPK);
                while (row[k] >= 0);
                row[k] = e;
            }
        }
    }
}

static int selects(const world_t *w, int s, int t, int64_t e)
{
    for (int k = 0; k < TOPK; k++)
        if (w->topk[s][t * TOPK + k] == e) return 1;
    return 0;
}

/* Exact in bf16; the magnitude differs per 128-channel group so fp8 scales differ. */
static float xval(int s, int t, int h)
{
    int n = (s * 131 + t * 17 + h * 7) % 61 - 30;
    return (float)n / 16.0f * (float)(h / 128 + 1);
}
static float weight(int t, int k)
{
    return 0.5f + 0.25f * (float)k + 0.125f * (float)(t % 3);
}
static float prob(int s, int t, int64_t e)
{
    return 0.0625f * (float)(e + 1) + 0.01f * (float)(t + s);
}
static float expert_scale(int64_t e)
{
    return (float)(e % 4 + 1);
}

static epx_result_t make_buffer(int rank, int nranks, const epx_unique_id_t *id, epx_comm_t *comm,
                                epx_buffer_t *buf)
{
    epx_result_t res = epx_test_host_comm(id, rank, nranks, 20000, comm);
    if (res != EPX_SUCCESS) return res;
    epx_buffer_config_t bc = epx_test_buffer_config(T_MAX, HID, TOPK, NEXP, EPX_MODE_LL | EPX_MODE_PERMUTE);
    bc.max_pad_multiple = 16;
    return epx_buffer_create(*comm, &bc, buf);
}

/* ------------------------------------------------------------------------------ LL ---- */

typedef struct ll_out {
    uint8_t *recv_x; /* bf16 or fp8 */
    void *scales;
    int32_t recv_count[NEXP], src_info[NEXP * 4 * T_MAX];
    int64_t layout_range[NEXP * 4];
    epx_ll_dispatch_outputs_t o;
} ll_out_t;

static void ll_out_init(ll_out_t *lo, const world_t *w, int fp8, int ue8m0)
{
    int64_t RT = (int64_t)w->R * T_MAX;
    memset(lo, 0, sizeof(*lo));
    size_t esize = fp8 ? 1 : 2;
    lo->recv_x = calloc((size_t)(w->L * RT * HID), esize);
    lo->o = (epx_ll_dispatch_outputs_t)EPX_LL_DISPATCH_OUTPUTS_INIT;
    lo->o.recv_x = epx_tensor_3d(lo->recv_x, fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16, w->L, RT, HID);
    if (fp8) {
        int64_t groups = ue8m0 ? HID / 512 : HID / 128;
        lo->scales = calloc((size_t)(w->L * groups * RT), 4);
        lo->o.recv_scales =
            epx_tensor_3d(lo->scales, ue8m0 ? EPX_DTYPE_INT32 : EPX_DTYPE_FP32, w->L, groups, RT);
    }
    lo->o.recv_count = epx_tensor_1d(lo->recv_count, EPX_DTYPE_INT32, w->L);
    lo->o.src_info = epx_tensor_2d(lo->src_info, EPX_DTYPE_INT32, w->L, RT);
    lo->o.layout_range = epx_tensor_2d(lo->layout_range, EPX_DTYPE_INT64, w->L, w->R);
}

static void ll_out_free(ll_out_t *lo)
{
    free(lo->recv_x);
    free(lo->scales);
}

static float pow2_ceil_ref(float v)
{
    int ex;
    float m = frexpf(v, &ex);
    return m == 0.5f ? v : ldexpf(1.0f, ex);
}

/* Checks rank me's LL dispatch outputs against the packed layout recomputed from the world. */
static int ll_check_dispatch(const world_t *w, int me, const ll_out_t *lo, int fp8, int round, int ue8m0)
{
    int64_t RT = (int64_t)w->R * T_MAX;
    for (int j = 0; j < w->L; j++) {
        int64_t e = (int64_t)me * w->L + j, row = 0;
        for (int s = 0; s < w->R; s++) {
            int64_t begin = row;
            for (int t = 0; t < w->T[s]; t++) {
                if (!selects(w, s, t, e)) continue;
                EXPECT_EQ_INT(lo->src_info[j * RT + row], t);
                for (int g = 0; g < HID / 128; g++) {
                    float amax = 0.0f;
                    for (int h = g * 128; h < (g + 1) * 128; h++) amax = fmaxf(amax, fabsf(xval(s, t, h)));
                    float si = fmaxf(amax, 1e-4f) / 448.0f;
                    if (round) si = pow2_ceil_ref(si);
                    for (int h = g * 128; h < (g + 1) * 128; h++) {
                        int64_t at = (j * RT + row) * HID + h;
                        if (fp8)
                            EXPECT_EQ_INT(lo->recv_x[at], epx_f32_to_fp8_e4m3(xval(s, t, h) / si));
                        else
                            EXPECT_EQ_INT(((uint16_t *)lo->recv_x)[at], epx_f32_to_bf16(xval(s, t, h)));
                    }
                    if (fp8 && ue8m0) {
                        uint32_t word =
                            (uint32_t)((int32_t *)lo->scales)[(j * (HID / 512) + g / 4) * RT + row];
                        uint32_t bits;
                        memcpy(&bits, &si, 4);
                        EXPECT_EQ_INT((word >> (8 * (g % 4))) & 0xffu, (bits >> 23) & 0xffu);
                    } else if (fp8) {
                        EXPECT_TRUE(((float *)lo->scales)[(j * (HID / 128) + g) * RT + row] == si);
                    }
                }
                row++;
            }
            int64_t count = row - begin;
            EXPECT_EQ_INT(lo->layout_range[j * w->R + s], count ? (begin << 32) | count : 0);
        }
        EXPECT_EQ_INT(lo->recv_count[j], row);
    }
    return 0;
}

/* y for rank me from its bf16 dispatch output: row * expert_scale(e); unused rows are NaN. */
static void ll_make_y(const world_t *w, int me, const ll_out_t *lo, uint16_t *y)
{
    int64_t RT = (int64_t)w->R * T_MAX;
    for (int64_t i = 0; i < w->L * RT * HID; i++) y[i] = GARBAGE_BF16;
    for (int j = 0; j < w->L; j++)
        for (int64_t row = 0; row < lo->recv_count[j]; row++)
            for (int h = 0; h < HID; h++) {
                int64_t at = (j * RT + row) * HID + h;
                float v =
                    epx_bf16_to_f32(((uint16_t *)lo->recv_x)[at]) * expert_scale((int64_t)me * w->L + j);
                y[at] = epx_f32_to_bf16(v);
            }
}

static int ll_check_combine(const world_t *w, int me, const uint16_t *out)
{
    for (int t = 0; t < w->T[me]; t++)
        for (int h = 0; h < HID; h++) {
            float acc = 0.0f;
            for (int k = 0; k < TOPK; k++) {
                int64_t e = w->topk[me][t * TOPK + k];
                if (e < 0) continue;
                float y = epx_bf16_to_f32(epx_f32_to_bf16(xval(me, t, h) * expert_scale(e)));
                acc += weight(t, k) * y;
            }
            if (out[t * HID + h] != epx_f32_to_bf16(acc)) {
                fprintf(stderr, "rank %d: ll combined[%d][%d] = 0x%04x, expected 0x%04x\n", me, t, h,
                        out[t * HID + h], epx_f32_to_bf16(acc));
                return 1;
            }
        }
    return 0;
}

typedef struct ll_in {
    uint16_t x[T_MAX * HID];
    float weights[T_MAX * TOPK];
    epx_ll_dispatch_args_t d;
    epx_ll_combine_args_t c;
} ll_in_t;

static void ll_in_init(ll_in_t *in, world_t *w, int me)
{
    for (int t = 0; t < w->T[me]; t++) {
        for (int h = 0; h < HID; h++) in->x[t * HID + h] = epx_f32_to_bf16(xval(me, t, h));
        for (int k = 0; k < TOPK; k++) in->weights[t * TOPK + k] = weight(t, k);
    }
    in->d = (epx_ll_dispatch_args_t)EPX_LL_DISPATCH_ARGS_INIT;
    in->d.x = epx_tensor_2d(in->x, EPX_DTYPE_BF16, w->T[me], HID);
    in->d.topk_idx = epx_tensor_2d(w->topk[me], EPX_DTYPE_INT64, w->T[me], TOPK);
    in->c = (epx_ll_combine_args_t)EPX_LL_COMBINE_ARGS_INIT;
    in->c.topk_idx = in->d.topk_idx;
    in->c.topk_weights = epx_tensor_2d(in->weights, EPX_DTYPE_FP32, w->T[me], TOPK);
}

static int ll_tests(const world_t *w_in, int me, epx_buffer_t buf)
{
    world_t wcopy = *w_in, *w = &wcopy;
    int64_t RT = (int64_t)w->R * T_MAX, ysize = w->L * RT * HID;
    static ll_in_t in;
    ll_in_init(&in, w, me);
    uint16_t *y = malloc((size_t)ysize * 2), *out = malloc((size_t)T_MAX * HID * 2);
    int32_t stats[NEXP] = {0}, expect_stats[NEXP] = {0};
    EXPECT_TRUE(y && out);

    /* 1. bf16, no hook; combine copying y. */
    ll_out_t a;
    ll_out_init(&a, w, 0, 0);
    in.d.cumulative_recv_stats = epx_tensor_1d(stats, EPX_DTYPE_INT32, w->L);
    EXPECT_OK(epx_ll_dispatch(buf, &in.d, &a.o));
    if (ll_check_dispatch(w, me, &a, 0, 0, 0)) return 1;
    for (int j = 0; j < w->L; j++) expect_stats[j] += a.recv_count[j];
    for (int j = 0; j < w->L; j++) EXPECT_EQ_INT(stats[j], expect_stats[j]);
    ll_make_y(w, me, &a, y);
    epx_ll_combine_outputs_t co = EPX_LL_COMBINE_OUTPUTS_INIT;
    co.combined_x = epx_tensor_2d(out, EPX_DTYPE_BF16, w->T[me], HID);
    in.c.handle = a.o.handle;
    in.c.y = epx_tensor_3d(y, EPX_DTYPE_BF16, w->L, RT, HID);
    memset(out, 0xff, (size_t)T_MAX * HID * 2);
    EXPECT_OK(epx_ll_combine(buf, &in.c, &co));
    if (ll_check_combine(w, me, out)) return 1;

    /* 2. fp8, plain scales and rounded ue8m0 scales. */
    for (int variant = 0; variant < 2; variant++) {
        ll_out_t f;
        ll_out_init(&f, w, 1, variant);
        in.d.use_fp8 = 1;
        in.d.round_scale = variant;
        in.d.use_ue8m0 = variant;
        EXPECT_OK(epx_ll_dispatch(buf, &in.d, &f.o));
        if (ll_check_dispatch(w, me, &f, 1, variant, variant)) return 1;
        for (int j = 0; j < w->L; j++) expect_stats[j] += f.recv_count[j];
        ll_out_free(&f);
    }
    for (int j = 0; j < w->L; j++) EXPECT_EQ_INT(stats[j], expect_stats[j]);
    in.d.use_fp8 = in.d.round_scale = in.d.use_ue8m0 = 0;
    in.d.cumulative_recv_stats = (epx_tensor_t){0};

    /* 3. Two dispatches in flight with hooks, then their combines: zero-copy with a hook for
     * the first, plain for the second. */
    ll_out_t b1, b2;
    ll_out_init(&b1, w, 0, 0);
    ll_out_init(&b2, w, 0, 0);
    in.d.return_recv_hook = 1;
    EXPECT_OK(epx_ll_dispatch(buf, &in.d, &b1.o));
    EXPECT_OK(epx_ll_dispatch(buf, &in.d, &b2.o));
    EXPECT_TRUE(b1.o.handle.slot != b2.o.handle.slot);
    EXPECT_OK(epx_hook_run(&b1.o.hook, NULL));
    EXPECT_OK(epx_hook_run(&b2.o.hook, NULL));
    EXPECT_RES(epx_hook_run(&b1.o.hook, NULL), EPX_ERR_INVALID_ARG); /* a hook runs once */
    in.d.return_recv_hook = 0;
    if (ll_check_dispatch(w, me, &b1, 0, 0, 0) || ll_check_dispatch(w, me, &b2, 0, 0, 0)) return 1;

    epx_tensor_t view;
    EXPECT_OK(epx_ll_get_combine_buffer(buf, &b1.o.handle, &view));
    EXPECT_EQ_INT(view.shape[0], w->L);
    EXPECT_EQ_INT(view.shape[1], RT);
    EXPECT_EQ_INT(view.shape[2], HID);
    ll_make_y(w, me, &b1, view.data);
    in.c.handle = b1.o.handle;
    in.c.y = (epx_tensor_t){0};
    in.c.zero_copy = 1;
    in.c.return_recv_hook = 1;
    memset(out, 0xff, (size_t)T_MAX * HID * 2);
    EXPECT_OK(epx_ll_combine(buf, &in.c, &co));
    EXPECT_OK(epx_hook_run(&co.hook, NULL));
    if (ll_check_combine(w, me, out)) return 1;

    ll_make_y(w, me, &b2, y);
    in.c.handle = b2.o.handle;
    in.c.y = epx_tensor_3d(y, EPX_DTYPE_BF16, w->L, RT, HID);
    in.c.zero_copy = 0;
    in.c.return_recv_hook = 0;
    memset(out, 0xff, (size_t)T_MAX * HID * 2);
    EXPECT_OK(epx_ll_combine(buf, &in.c, &co));
    if (ll_check_combine(w, me, out)) return 1;

    /* 4. A third dispatch reuses the first one's slot: the first handle is stale now, on every
     * rank alike, and the buffer still works afterwards. */
    ll_out_t c3;
    ll_out_init(&c3, w, 0, 0);
    EXPECT_OK(epx_ll_dispatch(buf, &in.d, &c3.o));
    EXPECT_EQ_INT(c3.o.handle.slot, b1.o.handle.slot);
    in.c.handle = b1.o.handle;
    ll_make_y(w, me, &b1, y);
    EXPECT_RES(epx_ll_combine(buf, &in.c, &co), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("stale");
    in.c.handle = c3.o.handle;
    ll_make_y(w, me, &c3, y);
    memset(out, 0xff, (size_t)T_MAX * HID * 2);
    EXPECT_OK(epx_ll_combine(buf, &in.c, &co));
    if (ll_check_combine(w, me, out)) return 1;

    ll_out_free(&a);
    ll_out_free(&b1);
    ll_out_free(&b2);
    ll_out_free(&c3);
    free(y);
    free(out);
    return 0;
}

/* ------------------------------------------------------------------- routing map ---- */

/* Row of (s, t) on rank r in the permuted layout with r's pad, or -1 when not there; also the
 * real row count P_r. Recomputed here independently of the library's bookkeeping. */
static int64_t rm_permuted_row(const world_t *w, int r, int pad, int s_q, int t_q, int64_t e_q,
                               int64_t *P_out)
{
    int64_t row = 0, found = -1;
    for (int j = 0; j < w->L; j++) {
        int64_t e = (int64_t)r * w->L + j, n = 0;
        for (int s = 0; s < w->R; s++)
            for (int t = 0; t < w->T[s]; t++)
                if (selects(w, s, t, e)) {
                    if (e == e_q && s == s_q && t == t_q) found = row + n;
                    n++;
                }
        row += (n + pad - 1) / pad * pad;
    }
    if (P_out) *P_out = row;
    return found;
}

/* Even ranks: a bound below P (rows dropped); odd ranks: above P (zero rows follow). */
static int64_t rm_bound(int r, int64_t P, int64_t cap)
{
    if (r % 2 == 0) return P > 16 ? P - 13 : 3;
    return P + 5 < cap ? P + 5 : cap;
}

static int has_rank(const world_t *w, int s, int t, int r)
{
    for (int k = 0; k < TOPK; k++)
        if (w->topk[s][t * TOPK + k] >= 0 && w->topk[s][t * TOPK + k] / w->L == r) return 1;
    return 0;
}

/* Routing-map combine of `rows` rows of x into out [T, HID]. */
static epx_result_t rm_combine(epx_buffer_t buf, epx_handle_t handle, uint16_t *x, int64_t rows, int weighted,
                               uint16_t *out, int64_t T)
{
    epx_rm_combine_args_t ca = EPX_RM_COMBINE_ARGS_INIT;
    ca.handle = handle;
    ca.x = epx_tensor_2d(x, EPX_DTYPE_BF16, rows, HID);
    ca.weighted = weighted;
    epx_rm_combine_outputs_t co = EPX_RM_COMBINE_OUTPUTS_INIT;
    co.combined = epx_tensor_2d(out, EPX_DTYPE_BF16, T, HID);
    return epx_rm_combine(buf, &ca, &co);
}

static int rm_tests(const world_t *w, int me, epx_buffer_t buf)
{
    int L = w->L, T = w->T[me];
    static uint16_t hidden[T_MAX * HID];
    static uint8_t map[T_MAX * NEXP];
    static float probs[T_MAX * NEXP];
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < HID; h++) hidden[t * HID + h] = epx_f32_to_bf16(xval(me, t, h));
        for (int e = 0; e < NEXP; e++) {
            map[t * NEXP + e] = (uint8_t)selects(w, me, t, e);
            probs[t * NEXP + e] = prob(me, t, e);
        }
    }
    int64_t cap = (int64_t)w->R * T_MAX * (TOPK < L ? TOPK : L) + L * 15;
    uint16_t *tokens = malloc((size_t)cap * HID * 2), *x = malloc((size_t)cap * HID * 2);
    uint16_t *out = malloc((size_t)T_MAX * HID * 2);
    float *oprobs = malloc((size_t)cap * (L > HID / 128 ? L : HID / 128) * sizeof(float));
    int32_t tpe[NEXP], ntok = -1;
    EXPECT_TRUE(tokens && x && out && oprobs);

    epx_rm_dispatch_args_t da = EPX_RM_DISPATCH_ARGS_INIT;
    da.hidden = epx_tensor_2d(hidden, EPX_DTYPE_BF16, T, HID);
    da.routing_map = epx_tensor_2d(map, EPX_DTYPE_BOOL, T, NEXP);
    da.probs = epx_tensor_2d(probs, EPX_DTYPE_FP32, T, NEXP);

    /* 0. Rank 0 passes fp8, the others bf16: every rank reports the mismatch, and the next
     * calls work. */
    {
        static uint8_t hidden8[T_MAX * HID];
        static float scales[T_MAX * (HID / 128)];
        epx_rm_dispatch_args_t bad = da;
        if (me == 0) {
            bad.hidden = epx_tensor_2d(hidden8, EPX_DTYPE_FP8_E4M3, T, HID);
            bad.scaling_factor = epx_tensor_2d(scales, EPX_DTYPE_FP32, T, HID / 128);
        }
        epx_rm_dispatch_outputs_t o = EPX_RM_DISPATCH_OUTPUTS_INIT;
        o.tokens = epx_tensor_2d(tokens, bad.hidden.dtype, cap, HID);
        o.scaling_factor =
            me == 0 ? epx_tensor_2d(oprobs, EPX_DTYPE_FP32, cap, HID / 128) : (epx_tensor_t){0};
        EXPECT_RES(epx_rm_dispatch(buf, &bad, &o), EPX_ERR_MISMATCH);
        EXPECT_MSG_HAS("dtype");
    }

    /* 1. Without permute: HT order, probs [N, L]; unweighted combine of row * (r + 1). */
    {
        int64_t N = 0;
        int any_short = 0; /* some rank receives a row, so its output one row short is refused */
        for (int r = 0; r < w->R; r++) {
            int64_t n = 0;
            for (int s = 0; s < w->R; s++)
                for (int t = 0; t < w->T[s]; t++) n += has_rank(w, s, t, r);
            if (r == me) N = n;
            any_short |= n > 0;
        }
        epx_rm_dispatch_outputs_t o = EPX_RM_DISPATCH_OUTPUTS_INIT;
        /* Without a bound, a too small output is refused with nothing written; the call has one
         * outcome, so a rank that receives nothing hears of the refusal as its peer's failure. */
        o.tokens = epx_tensor_2d(tokens, EPX_DTYPE_BF16, N > 0 ? N - 1 : 0, HID);
        tokens[0] = GARBAGE_BF16;
        if (N > 0) {
            EXPECT_RES(epx_rm_dispatch(buf, &da, &o), EPX_ERR_INVALID_ARG);
            EXPECT_EQ_INT(tokens[0], GARBAGE_BF16);
        } else if (any_short) {
            EXPECT_RES(epx_rm_dispatch(buf, &da, &o), EPX_ERR_REMOTE);
            EXPECT_EQ_INT(tokens[0], GARBAGE_BF16);
        } else {
            EXPECT_OK(epx_rm_dispatch(buf, &da, &o));
            EXPECT_OK(epx_handle_destroy(o.handle));
        }
        o.tokens = epx_tensor_2d(tokens, EPX_DTYPE_BF16, N, HID);
        o.probs = epx_tensor_2d(oprobs, EPX_DTYPE_FP32, N, L);
        o.num_tokens = epx_tensor_1d(&ntok, EPX_DTYPE_INT32, 1);
        EXPECT_OK(epx_rm_dispatch(buf, &da, &o));
        EXPECT_EQ_INT(o.num_tokens_host, N);
        EXPECT_EQ_INT(ntok, N);
        int64_t row = 0;
        for (int s = 0; s < w->R; s++)
            for (int t = 0; t < w->T[s]; t++) {
                if (!has_rank(w, s, t, me)) continue;
                for (int h = 0; h < HID; h++)
                    EXPECT_EQ_INT(tokens[row * HID + h], epx_f32_to_bf16(xval(s, t, h)));
                for (int j = 0; j < L; j++) {
                    int64_t e = (int64_t)me * L + j;
                    EXPECT_TRUE(oprobs[row * L + j] == (selects(w, s, t, e) ? prob(s, t, e) : 0.0f));
                }
                row++;
            }
        for (int64_t i = 0; i < N * HID; i++)
            x[i] = epx_f32_to_bf16(epx_bf16_to_f32(tokens[i]) * (float)(me + 1));
        EXPECT_OK(rm_combine(buf, o.handle, x, N, 0, out, T));
        for (int t = 0; t < T; t++)
            for (int h = 0; h < HID; h++) {
                float acc = 0.0f;
                for (int r = 0; r < w->R; r++)
                    if (has_rank(w, me, t, r))
                        acc += epx_bf16_to_f32(epx_f32_to_bf16(xval(me, t, h) * (float)(r + 1)));
                EXPECT_EQ_INT(out[t * HID + h], epx_f32_to_bf16(acc));
            }
        EXPECT_OK(epx_handle_destroy(o.handle));
    }

    /* 2. With permute, pad 16: no bound, then a per-rank bound. Weighted unpermute each time. */
    for (int bounded = 0; bounded < 2; bounded++) {
        int64_t P;
        rm_permuted_row(w, me, 16, 0, 0, -1, &P);
        int64_t B = !bounded ? -1 : rm_bound(me, P, cap);
        int64_t rows = B >= 0 ? B : P;
        da.permute = 1;
        da.pad_multiple = 16;
        da.num_permuted_tokens = B;
        for (int64_t i = 0; i < rows * HID; i++) tokens[i] = GARBAGE_BF16;
        epx_rm_dispatch_outputs_t o = EPX_RM_DISPATCH_OUTPUTS_INIT;
        o.tokens = epx_tensor_2d(tokens, EPX_DTYPE_BF16, rows, HID);
        o.probs = epx_tensor_1d(oprobs, EPX_DTYPE_FP32, rows);
        o.tokens_per_expert = epx_tensor_1d(tpe, EPX_DTYPE_INT32, L);
        o.num_tokens = epx_tensor_1d(&ntok, EPX_DTYPE_INT32, 1);
        EXPECT_OK(epx_rm_dispatch(buf, &da, &o));
        EXPECT_EQ_INT(o.num_tokens_host, rows);
        EXPECT_EQ_INT(ntok, P);
        EXPECT_RES(epx_buffer_query_overflow(buf), B >= 0 && B < P ? EPX_ERR_OVERFLOW : EPX_SUCCESS);
        EXPECT_RES(epx_buffer_query_overflow(buf), EPX_SUCCESS); /* the query cleared it */
        char *filled = calloc((size_t)rows + 1, 1);
        EXPECT_TRUE(filled != NULL);
        for (int j = 0; j < L; j++) {
            int64_t e = (int64_t)me * L + j, n = 0;
            for (int s = 0; s < w->R; s++)
                for (int t = 0; t < w->T[s]; t++) {
                    if (!selects(w, s, t, e)) continue;
                    n++;
                    int64_t row = rm_permuted_row(w, me, 16, s, t, e, NULL);
                    if (row >= rows) continue;
                    filled[row] = 1;
                    for (int h = 0; h < HID; h++)
                        EXPECT_EQ_INT(tokens[row * HID + h], epx_f32_to_bf16(xval(s, t, h)));
                    EXPECT_TRUE(oprobs[row] == prob(s, t, e));
                }
            EXPECT_EQ_INT(tpe[j], (n + 15) / 16 * 16);
        }
        for (int64_t row = 0; row < rows; row++) {
            if (filled[row]) continue;
            for (int h = 0; h < HID; h++) EXPECT_EQ_INT(tokens[row * HID + h], 0);
            EXPECT_TRUE(oprobs[row] == 0.0f);
        }
        /* y = row * (j + 1) over the handle's rows (the bound's, when given); padding rows and rows
         * past P are NaN, so reading one shows. */
        int64_t kept = rows < P ? rows : P;
        for (int64_t i = 0; i < rows * HID; i++) x[i] = GARBAGE_BF16;
        for (int j = 0; j < L; j++)
            for (int64_t row = 0; row < kept; row++) {
                int64_t e = (int64_t)me * L + j;
                int hit = 0;
                for (int s = 0; s < w->R && !hit; s++)
                    for (int t = 0; t < w->T[s] && !hit; t++)
                        hit = selects(w, s, t, e) && rm_permuted_row(w, me, 16, s, t, e, NULL) == row;
                if (!hit) continue;
                for (int h = 0; h < HID; h++)
                    x[row * HID + h] =
                        epx_f32_to_bf16(epx_bf16_to_f32(tokens[row * HID + h]) * (float)(j + 1));
            }
        free(filled);
        epx_handle_info_t info;
        EXPECT_OK(epx_handle_get_info(o.handle, &info));
        EXPECT_EQ_INT(info.num_recv_tokens, rows);
        EXPECT_OK(rm_combine(buf, o.handle, x, rows, 1, out, T));
        for (int t = 0; t < T; t++)
            for (int h = 0; h < HID; h++) {
                float acc = 0.0f;
                for (int r = 0; r < w->R; r++) {
                    int64_t P_r, B_r;
                    rm_permuted_row(w, r, 16, 0, 0, -1, &P_r);
                    B_r = !bounded ? P_r : rm_bound(r, P_r, cap);
                    for (int j = 0; j < L; j++) {
                        int64_t e = (int64_t)r * L + j;
                        if (!selects(w, me, t, e) || rm_permuted_row(w, r, 16, me, t, e, NULL) >= B_r)
                            continue;
                        acc += prob(me, t, e) *
                               epx_bf16_to_f32(epx_f32_to_bf16(xval(me, t, h) * (float)(j + 1)));
                    }
                }
                if (out[t * HID + h] != epx_f32_to_bf16(acc)) {
                    fprintf(stderr, "rank %d: unpermuted[%d][%d] = 0x%04x, expected 0x%04x (bounded %d)\n",
                            me, t, h, out[t * HID + h], epx_f32_to_bf16(acc), bounded);
                    return 1;
                }
            }
        EXPECT_OK(epx_handle_destroy(o.handle));
    }
    free(tokens);
    free(x);
    free(out);
    free(oprobs);
    return 0;
}

/* No tokens on any rank, every empty tensor with NULL data (the API accepts it): LL dispatch and
 * combine, routing-map dispatch (with and without permute) and combine succeed, receive nothing and
 * never hand NULL to memcpy or memset (the sanitizer builds abort on that, even for 0 bytes). */
static int empty_tests(const world_t *w, int me, epx_buffer_t buf)
{
    const int64_t RT = (int64_t)w->R * T_MAX;
    uint16_t *y = calloc((size_t)(w->L * RT * HID), 2);
    EXPECT_TRUE(y != NULL);
    ll_out_t lo;
    ll_out_init(&lo, w, 0, 0);
    memset(lo.recv_count, 0xff, sizeof(lo.recv_count));
    epx_ll_dispatch_args_t d = EPX_LL_DISPATCH_ARGS_INIT;
    d.x = epx_tensor_2d(NULL, EPX_DTYPE_BF16, 0, HID);
    d.topk_idx = epx_tensor_2d(NULL, EPX_DTYPE_INT64, 0, TOPK);
    EXPECT_OK(epx_ll_dispatch(buf, &d, &lo.o));
    for (int j = 0; j < w->L; j++) EXPECT_EQ_INT(lo.recv_count[j], 0);
    epx_ll_combine_args_t c = EPX_LL_COMBINE_ARGS_INIT;
    c.handle = lo.o.handle;
    c.y = epx_tensor_3d(y, EPX_DTYPE_BF16, w->L, RT, HID);
    c.topk_idx = d.topk_idx;
    c.topk_weights = epx_tensor_2d(NULL, EPX_DTYPE_FP32, 0, TOPK);
    epx_ll_combine_outputs_t co = EPX_LL_COMBINE_OUTPUTS_INIT;
    co.combined_x = epx_tensor_2d(NULL, EPX_DTYPE_BF16, 0, HID);
    EXPECT_OK(epx_ll_combine(buf, &c, &co));
    ll_out_free(&lo);
    free(y);

    for (int permute = 0; permute < 2; permute++) {
        int32_t tpe[NEXP], ntok = -1;
        epx_rm_dispatch_args_t da = EPX_RM_DISPATCH_ARGS_INIT;
        da.hidden = epx_tensor_2d(NULL, EPX_DTYPE_BF16, 0, HID);
        da.routing_map = epx_tensor_2d(NULL, EPX_DTYPE_BOOL, 0, NEXP);
        da.permute = permute;
        da.pad_multiple = 4;
        epx_rm_dispatch_outputs_t o = EPX_RM_DISPATCH_OUTPUTS_INIT;
        o.tokens = epx_tensor_2d(NULL, EPX_DTYPE_BF16, 0, HID);
        if (permute) o.tokens_per_expert = epx_tensor_1d(tpe, EPX_DTYPE_INT32, w->L);
        o.num_tokens = epx_tensor_1d(&ntok, EPX_DTYPE_INT32, 1);
        EXPECT_OK(epx_rm_dispatch(buf, &da, &o));
        EXPECT_EQ_INT(ntok, 0);
        for (int j = 0; permute && j < w->L; j++) EXPECT_EQ_INT(tpe[j], 0);
        epx_rm_combine_args_t ca = EPX_RM_COMBINE_ARGS_INIT;
        ca.handle = o.handle;
        ca.x = epx_tensor_2d(NULL, EPX_DTYPE_BF16, 0, HID);
        epx_rm_combine_outputs_t rco = EPX_RM_COMBINE_OUTPUTS_INIT;
        rco.combined = epx_tensor_2d(NULL, EPX_DTYPE_BF16, 0, HID);
        EXPECT_OK(epx_rm_combine(buf, &ca, &rco));
        EXPECT_OK(epx_handle_destroy(o.handle));
    }
    return 0;
}

static int rank_main(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    world_t w;
    world_make(&w, nranks, *(const uint64_t *)ctx);
    epx_comm_t comm = NULL;
    epx_buffer_t buf = NULL;
    EXPECT_OK(make_buffer(rank, nranks, id, &comm, &buf));
    if (ll_tests(&w, rank, buf)) return 1;
    if (rm_tests(&w, rank, buf)) return 1;
    if (empty_tests(&w, rank, buf)) return 1;
    EXPECT_OK(epx_buffer_destroy(buf));
    EXPECT_OK(epx_comm_destroy(comm));
    return 0;
}

int main(void)
{
    uint64_t seed = epx_test_seed();
    for (int nranks = 2; nranks <= 4; nranks += 2) {
        if (epx_test_run_ranks(nranks, rank_main, &seed, 120)) {
            fprintf(stderr, "failed with %d ranks, seed %llu\n", nranks, (unsigned long long)seed);
            return 1;
        }
    }
    printf("host ll/rm smoke: passed\n");
    return 0;
}
