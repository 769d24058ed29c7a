/*
 * The pinned details of docs/reference.md that every backend must share, on the host backend:
 * - combines compute acc += w * y as a multiply then an add, never fused (LL combine, weighted
 *   routing-map combine), with values whose fused and unfused results differ;
 * - in static mode an HT handle has num_worst_tokens rows (handle info, combine input view), rows
 *   past the real count contribute nothing, with and without overflow; a cached dispatch of a
 *   handle that dropped rows sets the overflow flag again (issue 11, defect 13);
 * - a routing-map handle (and its combine input) has the bound's rows when one is given, the real
 *   count without; rows past the real count are zero and contribute nothing to the combine;
 * - num_recv_tokens_per_expert counts every arriving token after an overflow; expert_alignment 0
 *   means 1; combine weights are summed as given (not masked by recv_topk_idx);
 * - num_tokens_per_domain counts tokens (not token-expert pairs) per domain;
 * - LL combines do not take a double-buffer slot: only dispatches do.
 */
#include <math.h>

#include "core/numeric.h"
#include "epx_test.h"

#define T 4
#define H 128
#define K 2
#define L 2
#define R 2
#define E (L * R)

static epx_comm_t pins_comm(int rank, int nranks, const epx_unique_id_t *id)
{
    epx_comm_t comm = NULL;
    return epx_test_host_comm(id, rank, nranks, 20000, &comm) == EPX_SUCCESS ? comm : NULL;
}

/* ------------------------------------------------------------------- unfused sums ---- */

/* w1 * 1 + w2 * y2 is exactly 0 unfused (w2 * y2 rounds to -w1) and -2^-27 fused. */
#define W1 (1.0f + 0x1p-7f + 0x1p-20f)
#define W2 (-(1.0f + 0x1p-20f))
#define Y1 0x3f80 /* bf16 1.0 */
#define Y2 0x3f81 /* bf16 1 + 2^-7 */

static int all_zero(const uint16_t *out, int64_t n, const char *what)
{
    for (int64_t i = 0; i < n; i++)
        if (out[i] != 0) {
            fprintf(stderr, "%s: element %lld is 0x%04x, the unfused sum is +0\n", what, (long long)i,
                    out[i]);
            return 0;
        }
    return 1;
}

/* One rank, two experts; token 0 selects both (weights W1, W2), the other tokens none. */
static int unfused_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    (void)ctx;
    /* The values must tell the two apart, or this test could not fail. */
    volatile float w2 = W2, y2 = epx_bf16_to_f32(Y2);
    EXPECT_TRUE(fmaf(w2, y2, W1) != 0.0f && W1 + w2 * y2 == 0.0f);
    epx_comm_t comm = pins_comm(rank, nranks, id);
    EXPECT_TRUE(comm != NULL);
    epx_buffer_config_t cfg = epx_test_buffer_config(T, H, K, 2, EPX_MODE_LL | EPX_MODE_PERMUTE);
    epx_buffer_t buf;
    EXPECT_OK(epx_buffer_create(comm, &cfg, &buf));
    static uint16_t x[T * H], ll_y[2 * T * H], out[T * H], rows[2 * T * H];
    int32_t topk[T * K], count[2];
    float w[T * K] = {W1, W2}, probs[T * 2] = {W1, W2};
    uint8_t map[T * 2] = {1, 1};
    for (int i = 0; i < T * K; i++) topk[i] = i < 2 ? i : -1;

    /* LL: slots k ascending, acc += w * y. */
    epx_ll_dispatch_args_t la = EPX_LL_DISPATCH_ARGS_INIT;
    la.x = epx_tensor_2d(x, EPX_DTYPE_BF16, T, H);
    la.topk_idx = epx_tensor_2d(topk, EPX_DTYPE_INT32, T, K);
    epx_ll_dispatch_outputs_t lo = EPX_LL_DISPATCH_OUTPUTS_INIT;
    lo.recv_x = epx_tensor_3d(ll_y, EPX_DTYPE_BF16, 2, T, H);
    lo.recv_count = epx_tensor_1d(count, EPX_DTYPE_INT32, 2);
    EXPECT_OK(epx_ll_dispatch(buf, &la, &lo));
    EXPECT_TRUE(count[0] == 1 && count[1] == 1);
    for (int h = 0; h < H; h++) {
        ll_y[h] = Y1;         /* expert 0, row 0 */
        ll_y[T * H + h] = Y2; /* expert 1, row 0 */
    }
    epx_ll_combine_args_t lc = EPX_LL_COMBINE_ARGS_INIT;
    lc.handle = lo.handle;
    lc.y = lo.recv_x;
    lc.topk_idx = la.topk_idx;
    lc.topk_weights = epx_tensor_2d(w, EPX_DTYPE_FP32, T, K);
    epx_ll_combine_outputs_t lco = EPX_LL_COMBINE_OUTPUTS_INIT;
    memset(out, 0xff, sizeof(out));
    lco.combined_x = epx_tensor_2d(out, EPX_DTYPE_BF16, T, H);
    EXPECT_OK(epx_ll_combine(buf, &lc, &lco));
    EXPECT_TRUE(all_zero(out, T * H, "ll combine"));

    /* Weighted combine with unpermute: local experts ascending, acc += prob * y. */
    epx_rm_dispatch_args_t ra = EPX_RM_DISPATCH_ARGS_INIT;
    ra.hidden = epx_tensor_2d(x, EPX_DTYPE_BF16, T, H);
    ra.routing_map = epx_tensor_2d(map, EPX_DTYPE_BOOL, T, 2);
    ra.probs = epx_tensor_2d(probs, EPX_DTYPE_FP32, T, 2);
    ra.permute = 1;
    epx_rm_dispatch_outputs_t ro = EPX_RM_DISPATCH_OUTPUTS_INIT;
    ro.tokens = epx_tensor_2d(rows, EPX_DTYPE_BF16, 2 * T, H);
    int32_t per_expert[2];
    ro.tokens_per_expert = epx_tensor_1d(per_expert, EPX_DTYPE_INT32, 2);
    EXPECT_OK(epx_rm_dispatch(buf, &ra, &ro));
    EXPECT_EQ_INT(ro.num_tokens_host, 2);
    for (int h = 0; h < H; h++) {
        rows[h] = Y1;
        rows[H + h] = Y2;
    }
    epx_rm_combine_args_t rc = EPX_RM_COMBINE_ARGS_INIT;
    rc.handle = ro.handle;
    rc.x = epx_tensor_2d(rows, EPX_DTYPE_BF16, 2, H);
    rc.weighted = 1;
    epx_rm_combine_outputs_t rco = EPX_RM_COMBINE_OUTPUTS_INIT;
    memset(out, 0xff, sizeof(out));
    rco.combined = epx_tensor_2d(out, EPX_DTYPE_BF16, T, H);
    EXPECT_OK(epx_rm_combine(buf, &rc, &rco));
    EXPECT_TRUE(all_zero(out, H, "weighted rm combine"));
    EXPECT_OK(epx_handle_destroy(ro.handle));
    EXPECT_OK(epx_buffer_destroy(buf));
    EXPECT_OK(epx_comm_destroy(comm));
    return 0;
}

/* ------------------------------------------------------------------- static mode ---- */

/* Token t of rank s selects expert 0 of rank (s + t) % R and, when t is even, expert 1 of the
 * other rank: odd tokens reach one rank, even tokens both. */
static int expert_of(int s, int t, int k)
{
    if (k == 0) return ((s + t) % R) * L;
    return t % 2 == 0 ? ((s + t + 1) % R) * L + 1 : -1;
}

static int reaches(int s, int t, int d)
{
    return expert_of(s, t, 0) / L == d || (expert_of(s, t, 1) >= 0 && expert_of(s, t, 1) / L == d);
}

/* Row of token t of source s on rank d, in (source, token) order. */
static int row_on(int s, int t, int d)
{
    int row = 0;
    for (int s2 = 0; s2 < R; s2++)
        for (int t2 = 0; t2 < T; t2++) {
            if (s2 == s && t2 == t) return row;
            row += reaches(s2, t2, d);
        }
    return -1;
}

static int64_t arriving_on(int d)
{
    int64_t n = 0;
    for (int s = 0; s < R; s++)
        for (int t = 0; t < T; t++) n += reaches(s, t, d);
    return n;
}

/* ctx: the static bound of every rank (0: default mode). */
static int static_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    const int64_t W = *(const int64_t *)ctx, N = arriving_on(rank), kept = W > 0 && W < N ? W : N;
    const int overflow = W > 0 && N > W;
    epx_comm_t comm = pins_comm(rank, nranks, id);
    EXPECT_TRUE(comm != NULL);
    epx_buffer_config_t cfg = epx_test_buffer_config(T, H, K, E, EPX_MODE_HT);
    epx_buffer_t buf;
    EXPECT_OK(epx_buffer_create(comm, &cfg, &buf));
    static uint16_t x[T * H], recv[R * T * H], out[T * H];
    int32_t topk[T * K], per_expert[L];
    float weights[T * K], ones[R * T * K], out_w[T * K];
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
            topk[t * K + k] = expert_of(rank, t, k);
            weights[t * K + k] = 0.25f;
        }
    for (int i = 0; i < R * T * K; i++) ones[i] = 1.0f;

    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    a.x = epx_tensor_2d(x, EPX_DTYPE_BF16, T, H);
    a.topk_idx = epx_tensor_2d(topk, EPX_DTYPE_INT32, T, K);
    a.topk_weights = epx_tensor_2d(weights, EPX_DTYPE_FP32, T, K);
    a.num_worst_tokens = W;
    a.expert_alignment = 0; /* means 1 */
    epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
    o.recv_x = epx_tensor_2d(recv, EPX_DTYPE_BF16, W > 0 ? W : N, H);
    o.num_recv_tokens_per_expert = epx_tensor_1d(per_expert, EPX_DTYPE_INT32, L);
    EXPECT_OK(epx_ht_dispatch(buf, &a, &o));
    EXPECT_EQ_INT(o.num_recv_tokens_host, W > 0 ? -1 : N); /* static mode: unknown at return */
    EXPECT_RES(epx_buffer_query_overflow(buf), overflow ? EPX_ERR_OVERFLOW : EPX_SUCCESS);
    /* Every arriving token counts, dropped or not, unaligned. */
    for (int j = 0; j < L; j++) {
        int expected = 0;
        for (int s = 0; s < R; s++)
            for (int t = 0; t < T; t++)
                for (int k = 0; k < K; k++) expected += expert_of(s, t, k) == rank * L + j;
        EXPECT_EQ_INT(per_expert[j], expected);
    }

    /* The handle and the combine input have the bound's rows. */
    epx_handle_info_t info;
    EXPECT_OK(epx_handle_get_info(o.handle, &info));
    EXPECT_EQ_INT(info.num_recv_tokens, W > 0 ? W : N);
    epx_tensor_t view;
    EXPECT_OK(epx_ht_get_combine_input(buf, o.handle, &view));
    EXPECT_EQ_INT(view.shape[0], W > 0 ? W : N);
    uint16_t *rows = view.data;
    for (int64_t i = 0; i < view.shape[0] * H; i++) rows[i] = i < kept * H ? 0x3f80 : 0x7fc0; /* 1, NaN */
    epx_ht_combine_args_t ca = EPX_HT_COMBINE_ARGS_INIT;
    ca.handle = o.handle;
    ca.x_in_buffer = 1;
    /* Weights as given, every slot 1 (not masked by recv_topk_idx). */
    ca.topk_weights = epx_tensor_2d(ones, EPX_DTYPE_FP32, info.num_recv_tokens, K);
    epx_ht_combine_outputs_t co = epx_test_ht_combine_outputs(out, out_w, T, H, K);
    EXPECT_OK(epx_ht_combine(buf, &ca, &co));
    for (int t = 0; t < T; t++) {
        int ranks = 0;
        for (int d = 0; d < R; d++) {
            const int64_t bound_d = W > 0 && W < arriving_on(d) ? W : arriving_on(d);
            ranks += reaches(rank, t, d) && row_on(rank, t, d) < bound_d;
        }
        for (int h = 0; h < H; h++) EXPECT_EQ_INT(out[t * H + h], epx_f32_to_bf16((float)ranks));
        for (int k = 0; k < K; k++) EXPECT_TRUE(out_w[t * K + k] == (float)ranks);
    }

    /* A cached dispatch of the same routing drops the same rows: the flag is set again. */
    epx_ht_dispatch_args_t cached = EPX_HT_DISPATCH_ARGS_INIT;
    cached.x = a.x;
    cached.cached_handle = o.handle;
    cached.num_worst_tokens = W;
    epx_ht_dispatch_outputs_t cached_out = EPX_HT_DISPATCH_OUTPUTS_INIT;
    cached_out.recv_x = o.recv_x;
    EXPECT_OK(epx_ht_dispatch(buf, &cached, &cached_out));
    EXPECT_EQ_INT(cached_out.num_recv_tokens_host, W > 0 ? -1 : N); /* as the routed dispatch */
    EXPECT_RES(epx_buffer_query_overflow(buf), overflow ? EPX_ERR_OVERFLOW : EPX_SUCCESS);

    /* num_tokens_per_domain with one rank per domain: tokens, not token-expert pairs. */
    if (W == 0) {
        int32_t per_rank[R], per_exp[E], per_domain[R];
        uint8_t in_rank[T * R];
        int32_t both[T * K] = {0, 1, 0, 1, 2, -1, 3, -1}; /* two tokens with both experts on rank 0 */
        epx_layout_outputs_t lo = EPX_LAYOUT_OUTPUTS_INIT;
        lo.num_tokens_per_rank = epx_tensor_1d(per_rank, EPX_DTYPE_INT32, R);
        lo.num_tokens_per_expert = epx_tensor_1d(per_exp, EPX_DTYPE_INT32, E);
        lo.is_token_in_rank = epx_tensor_2d(in_rank, EPX_DTYPE_BOOL, T, R);
        lo.num_tokens_per_domain = epx_tensor_1d(per_domain, EPX_DTYPE_INT32, R);
        epx_tensor_t idx = epx_tensor_2d(both, EPX_DTYPE_INT32, T, K);
        EXPECT_OK(epx_get_dispatch_layout(buf, &idx, &lo, NULL));
        EXPECT_TRUE(per_domain[0] == 2 && per_domain[1] == 2);
    }
    EXPECT_OK(epx_handle_destroy(o.handle));
    EXPECT_OK(epx_buffer_destroy(buf));
    EXPECT_OK(epx_comm_destroy(comm));
    return 0;
}

/* ------------------------------------------------------------- routing-map rows ---- */

/* A routing-map dispatch of expert_of's routing; bound -1: none (the same on every rank). */
typedef struct rm_pin {
    int permute, pad;
    int64_t bound;
} rm_pin_t;

#define RM_MAX_ROWS 16

static int selects(int s, int t, int e)
{
    return expert_of(s, t, 0) == e || expert_of(s, t, 1) == e;
}

/* Rank d's row for token t of source s: the HT row without permute, with permute the row in
 * expert e's group (groups padded to pad); -1 when the token does not go there. *real (when not
 * NULL): d's real row count (N_r, or P with padding). */
static int64_t rm_row_on(int d, int permute, int pad, int s, int t, int e, int64_t *real)
{
    if (!permute) {
        if (real) *real = arriving_on(d);
        return reaches(s, t, d) ? row_on(s, t, d) : -1;
    }
    int64_t row = 0, found = -1;
    for (int j = 0; j < L; j++) {
        int64_t n = 0;
        for (int s2 = 0; s2 < R; s2++)
            for (int t2 = 0; t2 < T; t2++)
                if (selects(s2, t2, d * L + j)) {
                    if (s2 == s && t2 == t && d * L + j == e) found = row + n;
                    n++;
                }
        row += (n + pad - 1) / pad * pad;
    }
    if (real) *real = row;
    return found;
}

static epx_result_t rm_pin_combine(epx_buffer_t buf, epx_handle_t handle, uint16_t *y, int64_t rows,
                                   uint16_t *out)
{
    epx_rm_combine_args_t a = EPX_RM_COMBINE_ARGS_INIT;
    a.handle = handle;
    a.x = epx_tensor_2d(y, EPX_DTYPE_BF16, rows, H);
    epx_rm_combine_outputs_t o = EPX_RM_COMBINE_OUTPUTS_INIT;
    o.combined = epx_tensor_2d(out, EPX_DTYPE_BF16, T, H);
    return epx_rm_combine(buf, &a, &o);
}

/* With a bound the handle covers the bound's rows (so does the combine input), rows past the real
 * count are zero and contribute nothing; without one it covers the real rows. */
static int rm_rows_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    const rm_pin_t *c = ctx;
    const int64_t B = c->bound;
    int64_t real;
    rm_row_on(rank, c->permute, c->pad, 0, 0, -1, &real);
    const int64_t rows = B >= 0 ? B : real, kept = rows < real ? rows : real;
    EXPECT_TRUE(rows <= RM_MAX_ROWS);
    epx_comm_t comm = pins_comm(rank, nranks, id);
    EXPECT_TRUE(comm != NULL);
    epx_buffer_config_t cfg = epx_test_buffer_config(T, H, K, E, EPX_MODE_PERMUTE);
    cfg.max_pad_multiple = 4;
    epx_buffer_t buf;
    EXPECT_OK(epx_buffer_create(comm, &cfg, &buf));
    static uint16_t x[T * H], tokens[RM_MAX_ROWS * H], y[RM_MAX_ROWS * H], out[T * H];
    uint8_t map[T * E] = {0};
    int32_t num_tokens = -1, per_expert[L];
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++)
            if (expert_of(rank, t, k) >= 0) map[t * E + expert_of(rank, t, k)] = 1;
    for (int i = 0; i < T * H; i++) x[i] = 0x3f80; /* 1 */
    for (int i = 0; i < RM_MAX_ROWS * H; i++) tokens[i] = 0x7fc0;

    epx_rm_dispatch_args_t a = EPX_RM_DISPATCH_ARGS_INIT;
    a.hidden = epx_tensor_2d(x, EPX_DTYPE_BF16, T, H);
    a.routing_map = epx_tensor_2d(map, EPX_DTYPE_BOOL, T, E);
    a.permute = c->permute;
    a.pad_multiple = c->pad;
    a.num_dispatched_tokens = c->permute ? -1 : B;
    a.num_permuted_tokens = c->permute ? B : -1;
    epx_rm_dispatch_outputs_t o = EPX_RM_DISPATCH_OUTPUTS_INIT;
    o.tokens = epx_tensor_2d(tokens, EPX_DTYPE_BF16, rows, H);
    o.num_tokens = epx_tensor_1d(&num_tokens, EPX_DTYPE_INT32, 1);
    if (c->permute) o.tokens_per_expert = epx_tensor_1d(per_expert, EPX_DTYPE_INT32, L);
    EXPECT_OK(epx_rm_dispatch(buf, &a, &o));
    EXPECT_EQ_INT(o.num_tokens_host, rows);
    EXPECT_EQ_INT(num_tokens, real);
    EXPECT_RES(epx_buffer_query_overflow(buf), real > rows ? EPX_ERR_OVERFLOW : EPX_SUCCESS);
    epx_handle_info_t info;
    EXPECT_OK(epx_handle_get_info(o.handle, &info));
    EXPECT_EQ_INT(info.num_tokens, T);
    EXPECT_EQ_INT(info.num_recv_tokens, rows);

    /* Rows holding a token are 1; padding and rows past the real count are 0. */
    char held[RM_MAX_ROWS] = {0};
    for (int s = 0; s < R; s++)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < (c->permute ? L : 1); j++) {
                int64_t row = rm_row_on(rank, c->permute, c->pad, s, t, rank * L + j, NULL);
                if (row >= 0 && row < rows) held[row] = 1;
            }
    for (int64_t i = 0; i < rows; i++)
        for (int h = 0; h < H; h++) EXPECT_EQ_INT(tokens[i * H + h], held[i] ? 0x3f80 : 0);

    /* Combine input: the handle's rows, 1 where a token is held, NaN elsewhere (it must not be read).
     * Fewer rows (only the real ones, when the bound is above them) are refused on every rank. */
    for (int64_t i = 0; i < rows; i++)
        for (int h = 0; h < H; h++) y[i * H + h] = held[i] ? 0x3f80 : 0x7fc0;
    if (kept < rows) {
        EXPECT_RES(rm_pin_combine(buf, o.handle, y, kept, out), EPX_ERR_INVALID_ARG);
        EXPECT_MSG_HAS("x.shape[0]");
    }
    memset(out, 0xff, sizeof(out));
    EXPECT_OK(rm_pin_combine(buf, o.handle, y, rows, out));
    for (int t = 0; t < T; t++) {
        /* Rows of token t that some rank kept: one per rank without permute, one per expert with. */
        int n = 0;
        for (int i = 0; i < (c->permute ? K : R); i++) {
            const int e = c->permute ? expert_of(rank, t, i) : -1, d = c->permute ? e / L : i;
            if (c->permute && e < 0) continue;
            int64_t real_d;
            const int64_t row = rm_row_on(d, c->permute, c->pad, rank, t, e, &real_d);
            n += row >= 0 && row < (B >= 0 ? B : real_d);
        }
        for (int h = 0; h < H; h++) EXPECT_EQ_INT(out[t * H + h], epx_f32_to_bf16((float)n));
    }
    EXPECT_OK(epx_handle_destroy(o.handle));
    EXPECT_OK(epx_buffer_destroy(buf));
    EXPECT_OK(epx_comm_destroy(comm));
    return 0;
}

/* ---------------------------------------------------------------------- LL slots ---- */

static int ll_dispatch(epx_buffer_t buf, uint16_t *x, int32_t *topk, uint16_t *recv, int32_t *count,
                       epx_ll_handle_t *handle_out)
{
    epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
    a.x = epx_tensor_2d(x, EPX_DTYPE_BF16, T, H);
    a.topk_idx = epx_tensor_2d(topk, EPX_DTYPE_INT32, T, K);
    epx_ll_dispatch_outputs_t o = EPX_LL_DISPATCH_OUTPUTS_INIT;
    o.recv_x = epx_tensor_3d(recv, EPX_DTYPE_BF16, L, R * T, H);
    o.recv_count = epx_tensor_1d(count, EPX_DTYPE_INT32, L);
    EXPECT_OK(epx_ll_dispatch(buf, &a, &o));
    *handle_out = o.handle;
    return 0;
}

static epx_result_t ll_combine(epx_buffer_t buf, epx_ll_handle_t handle, int32_t *topk, float *w, uint16_t *y,
                               uint16_t *out)
{
    epx_ll_combine_args_t a = EPX_LL_COMBINE_ARGS_INIT;
    a.handle = handle;
    a.y = epx_tensor_3d(y, EPX_DTYPE_BF16, L, R * T, H);
    a.topk_idx = epx_tensor_2d(topk, EPX_DTYPE_INT32, T, K);
    a.topk_weights = epx_tensor_2d(w, EPX_DTYPE_FP32, T, K);
    epx_ll_combine_outputs_t o = EPX_LL_COMBINE_OUTPUTS_INIT;
    o.combined_x = epx_tensor_2d(out, EPX_DTYPE_BF16, T, H);
    return epx_ll_combine(buf, &a, &o);
}

/* Two dispatches, then both combines (twice): combines take no slot; a third dispatch does. */
static int ll_slots_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    (void)ctx;
    epx_comm_t comm = pins_comm(rank, nranks, id);
    EXPECT_TRUE(comm != NULL);
    epx_buffer_config_t cfg = epx_test_buffer_config(T, H, K, E, EPX_MODE_LL);
    epx_buffer_t buf;
    EXPECT_OK(epx_buffer_create(comm, &cfg, &buf));
    static uint16_t x[T * H], recv_a[L * R * T * H], recv_b[L * R * T * H], out[T * H];
    int32_t topk[T * K], count[L];
    float w[T * K];
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
            topk[t * K + k] = expert_of(rank, t, k);
            w[t * K + k] = 1.0f;
        }
    epx_ll_handle_t ha, hb, hc;
    if (ll_dispatch(buf, x, topk, recv_a, count, &ha) || ll_dispatch(buf, x, topk, recv_b, count, &hb))
        return 1;
    for (int round = 0; round < 2; round++) {
        EXPECT_OK(ll_combine(buf, ha, topk, w, recv_a, out));
        EXPECT_OK(ll_combine(buf, hb, topk, w, recv_b, out));
    }
    if (ll_dispatch(buf, x, topk, recv_a, count, &hc)) return 1;
    EXPECT_RES(ll_combine(buf, ha, topk, w, recv_a, out), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("stale");
    EXPECT_OK(ll_combine(buf, hb, topk, w, recv_b, out));
    EXPECT_OK(ll_combine(buf, hc, topk, w, recv_a, out));
    EXPECT_OK(epx_buffer_destroy(buf));
    EXPECT_OK(epx_comm_destroy(comm));
    return 0;
}

int main(void)
{
    int failed = epx_test_run_ranks(1, unfused_body, NULL, 60);
    if (epx_test_set_env("EPX_RANKS_PER_NVLINK_DOMAIN", "1")) return 1;
    /* Each rank receives 6 rows: default mode, a bound above, and one that drops 2. */
    const int64_t bounds[] = {0, 8, 4};
    for (int i = 0; i < 3; i++) {
        if (arriving_on(0) != 6 || arriving_on(1) != 6) return 1;
        if (epx_test_run_ranks(R, static_body, (void *)&bounds[i], 60)) {
            fprintf(stderr, "pins: static mode with num_worst_tokens %lld: FAILED\n", (long long)bounds[i]);
            failed = 1;
        }
    }
    /* Routing map: 6 rows without permute, P = 8 with pad 4 (group 1: 2 rows, 2 padding); no
     * bound, a bound above, one that drops rows. */
    const rm_pin_t rm_pins[] = {{0, 1, -1}, {0, 1, 8}, {0, 1, 4}, {1, 4, -1}, {1, 4, 10}, {1, 4, 5}};
    for (size_t i = 0; i < sizeof(rm_pins) / sizeof(rm_pins[0]); i++)
        if (epx_test_run_ranks(R, rm_rows_body, (void *)&rm_pins[i], 60)) {
            fprintf(stderr, "pins: routing map, permute %d pad %d bound %lld: FAILED\n", rm_pins[i].permute,
                    rm_pins[i].pad, (long long)rm_pins[i].bound);
            failed = 1;
        }
    failed |= epx_test_run_ranks(R, ll_slots_body, NULL, 60);
    printf("pins: %s\n", failed ? "FAILED" : "ok");
    return failed;
}
