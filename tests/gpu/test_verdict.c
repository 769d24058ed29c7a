/*
 * Every collective call succeeds on all ranks or fails on all, on the cuda backend, where only the
 * device knows why: a receiver whose outputs hold fewer rows than it receives (HT dispatch without
 * num_worst_tokens, routing-map dispatch without a bound) fails with EPX_ERR_INVALID_ARG and its
 * peers with EPX_ERR_REMOTE, none of them writing an output; and a bad value inside a device
 * tensor (a topk_idx id out of range or repeated, a routing_map row with more than K entries)
 * fails the rank that passed it with EPX_ERR_INVALID_ARG naming the tensor, row and slot, its
 * outputs poisoned (counts -1, bf16 rows NaN 0x7fc0, fp32 NaN). After each failure a round trip
 * works on every rank.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"
#include "gpu_test.h"

#define TIMEOUT_MS 30000
#define H          256
#define TM         32
#define K          2
#define E          8

typedef struct fixture {
    int rank, R, device;
    epx_comm_t comm;
    epx_buffer_t buf;
    gpu_arena_t da;
    void *x, *topk, *map, *rx, *out, *small;
} fixture_t;

static int64_t rows_all(const fixture_t *f)
{
    return (int64_t)f->R * TM;
}

/* Every token's copies come back summed: x * (number of ranks it went to), exact for these values. */
static int check_combined(fixture_t *f, const char *what)
{
    const int rank = f->rank, L = E / f->R;
    uint16_t got[TM * H];
    EXPECT_TRUE(cudaMemcpy(got, f->out, sizeof(got), cudaMemcpyDeviceToHost) == cudaSuccess);
    for (int t = 0; t < TM; t++) {
        const int r0 = (t % E) / L, r1 = ((t + 1) % E) / L, copies = r0 == r1 ? 1 : 2;
        for (int c = 0; c < H; c++) {
            const uint16_t want = epx_f32_to_bf16((float)(copies * (1 + (rank * TM + t + c) % 16)));
            if (got[t * H + c] != want)
                return ref_fail(rank, "%s: combined[%d][%d] = 0x%04x, expected 0x%04x", what, t, c,
                                got[t * H + c], want);
        }
    }
    return 0;
}

/* An eager HT dispatch into recv_x of `rows` rows (and recv_topk_idx when given). */
static epx_result_t ht_dispatch(fixture_t *f, const void *topk, void *rx, int64_t rows, epx_handle_t *h,
                                int64_t *n)
{
    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    a.x = gpu_tensor(f->x, EPX_DTYPE_BF16, 2, TM, H, 0, f->device);
    a.topk_idx = gpu_tensor((void *)topk, EPX_DTYPE_INT32, 2, TM, K, 0, f->device);
    epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
    o.recv_x = gpu_tensor(rx, EPX_DTYPE_BF16, 2, rows, H, 0, f->device);
    epx_result_t res = epx_ht_dispatch(f->buf, &a, &o);
    if (res == EPX_SUCCESS) {
        *h = o.handle;
        *n = o.num_recv_tokens_host;
    }
    return res;
}

static int ht_round_trip(fixture_t *f, const char *after)
{
    epx_handle_t h;
    int64_t n;
    EXPECT_OK(ht_dispatch(f, f->topk, f->rx, rows_all(f), &h, &n));
    epx_ht_combine_args_t ca = EPX_HT_COMBINE_ARGS_INIT;
    ca.handle = h;
    ca.x = gpu_tensor(f->rx, EPX_DTYPE_BF16, 2, n, H, 0, f->device);
    epx_ht_combine_outputs_t co = EPX_HT_COMBINE_OUTPUTS_INIT;
    co.combined_x = gpu_tensor(f->out, EPX_DTYPE_BF16, 2, TM, H, 0, f->device);
    EXPECT_OK(epx_ht_combine(f->buf, &ca, &co));
    EXPECT_OK(epx_handle_destroy(h));
    char what[96];
    snprintf(what, sizeof(what), "HT round trip after %s", after);
    return check_combined(f, what);
}

/* A routing-map dispatch without permute into `rows` rows, bounded at `bound` (-1: none). */
static epx_result_t rm_dispatch(fixture_t *f, const void *map, void *tokens, int64_t rows, int64_t bound,
                                epx_handle_t *h, int64_t *n)
{
    epx_rm_dispatch_args_t a = EPX_RM_DISPATCH_ARGS_INIT;
    a.hidden = gpu_tensor(f->x, EPX_DTYPE_BF16, 2, TM, H, 0, f->device);
    a.routing_map = gpu_tensor((void *)map, EPX_DTYPE_BOOL, 2, TM, E, 0, f->device);
    a.num_dispatched_tokens = bound;
    epx_rm_dispatch_outputs_t o = EPX_RM_DISPATCH_OUTPUTS_INIT;
    o.tokens = gpu_tensor(tokens, EPX_DTYPE_BF16, 2, rows, H, 0, f->device);
    epx_result_t res = epx_rm_dispatch(f->buf, &a, &o);
    if (res == EPX_SUCCESS) {
        *h = o.handle;
        *n = o.num_tokens_host;
    }
    return res;
}

static int rm_round_trip(fixture_t *f, const char *after)
{
    epx_handle_t h;
    int64_t n;
    EXPECT_OK(rm_dispatch(f, f->map, f->rx, rows_all(f), -1, &h, &n));
    epx_rm_combine_args_t ca = EPX_RM_COMBINE_ARGS_INIT;
    ca.handle = h;
    ca.x = gpu_tensor(f->rx, EPX_DTYPE_BF16, 2, n, H, 0, f->device);
    epx_rm_combine_outputs_t co = EPX_RM_COMBINE_OUTPUTS_INIT;
    co.combined = gpu_tensor(f->out, EPX_DTYPE_BF16, 2, TM, H, 0, f->device);
    EXPECT_OK(epx_rm_combine(f->buf, &ca, &co));
    EXPECT_OK(epx_handle_destroy(h));
    char what[96];
    snprintf(what, sizeof(what), "routing-map round trip after %s", after);
    return check_combined(f, what);
}

/* `bytes` of device memory still hold the allocation's 0xa5 fill: nothing was written. */
static int untouched(fixture_t *f, const void *p, size_t bytes, const char *what)
{
    const int rank = f->rank;
    uint8_t host[4096];
    for (size_t off = 0; off < bytes; off += sizeof(host)) {
        const size_t n = bytes - off < sizeof(host) ? bytes - off : sizeof(host);
        EXPECT_TRUE(cudaMemcpy(host, (const uint8_t *)p + off, n, cudaMemcpyDeviceToHost) == cudaSuccess);
        for (size_t i = 0; i < n; i++)
            if (host[i] != 0xa5) return ref_fail(rank, "%s: byte %zu was written", what, off + i);
    }
    return 0;
}

static int fixture_open(fixture_t *f, const gpu_ctx_t *ctx, const epx_unique_id_t *id, int rank, int R)
{
    memset(f, 0, sizeof(*f));
    f->rank = rank;
    f->R = R;
    if (gpu_test_comm(ctx, id, rank, R, TIMEOUT_MS, &f->comm, &f->device)) return 1;
    epx_buffer_config_t bc = epx_test_buffer_config(TM, H, K, E, EPX_MODE_HT | EPX_MODE_PERMUTE);
    EXPECT_OK(epx_buffer_create(f->comm, &bc, &f->buf));
    uint16_t hx[TM * H];
    int32_t topk[TM * K];
    uint8_t map[TM * E];
    memset(map, 0, sizeof(map));
    for (int t = 0; t < TM; t++) {
        for (int c = 0; c < H; c++) hx[t * H + c] = epx_f32_to_bf16((float)(1 + (rank * TM + t + c) % 16));
        topk[t * K] = t % E;
        topk[t * K + 1] = (t + 1) % E;
        map[t * E + t % E] = 1;
        map[t * E + (t + 1) % E] = 1;
    }
    f->x = gpu_alloc(&f->da, sizeof(hx), hx);
    f->topk = gpu_alloc(&f->da, sizeof(topk), topk);
    f->map = gpu_alloc(&f->da, sizeof(map), map);
    f->rx = gpu_alloc(&f->da, (size_t)rows_all(f) * H * 2, NULL);
    f->out = gpu_alloc(&f->da, (size_t)TM * H * 2, NULL);
    f->small = gpu_alloc(&f->da, (size_t)H * 2, NULL);
    EXPECT_TRUE(f->small != NULL);
    return ht_round_trip(f, "creation") || rm_round_trip(f, "creation");
}

/* The last rank's outputs hold one row (it receives more): it fails with EPX_ERR_INVALID_ARG, the
 * others with EPX_ERR_REMOTE, at once; no rank wrote its outputs (rx refilled with 0xa5 first). */
static int too_small(fixture_t *f, int rm)
{
    const int rank = f->rank, victim = f->R - 1;
    const size_t rx_bytes = (size_t)rows_all(f) * H * 2;
    EXPECT_TRUE(cudaMemset(f->rx, 0xa5, rx_bytes) == cudaSuccess);
    EXPECT_TRUE(cudaDeviceSynchronize() == cudaSuccess);
    void *dst = rank == victim ? f->small : f->rx;
    const int64_t rows = rank == victim ? 1 : rows_all(f);
    epx_handle_t h = NULL;
    int64_t n = 0;
    const double t0 = epx_test_now_s();
    const epx_result_t res = rm ? rm_dispatch(f, f->map, dst, rows, -1, &h, &n)
                                : ht_dispatch(f, f->topk, dst, rows, &h, &n);
    if (rank == victim) {
        EXPECT_RES(res, EPX_ERR_INVALID_ARG);
        EXPECT_MSG_HAS("outputs hold");
        EXPECT_MSG_HAS("EPX_ERR_REMOTE");
    } else {
        EXPECT_RES(res, EPX_ERR_REMOTE);
        EXPECT_MSG_HAS("row count");
    }
    EXPECT_TRUE(epx_test_now_s() - t0 < TIMEOUT_MS / 3000.0);
    if (untouched(f, dst, rank == victim ? (size_t)H * 2 : rx_bytes, rm ? "tokens" : "recv_x")) return 1;
    (void)epx_get_async_error(f->comm);
    const char *after = rm ? "an unbounded routing-map dispatch into too few rows"
                           : "an eager HT dispatch into too few rows";
    return ht_round_trip(f, after) || rm_round_trip(f, after);
}

/* Every 32-bit word of `bytes` bytes of device memory is `pat` (NaN or -1: poisoned). */
static int poisoned(fixture_t *f, const void *p, size_t bytes, uint32_t pat, const char *what)
{
    const int rank = f->rank;
    uint32_t host[1024];
    for (size_t off = 0; off < bytes; off += sizeof(host)) {
        const size_t n = bytes - off < sizeof(host) ? bytes - off : sizeof(host);
        EXPECT_TRUE(cudaMemcpy(host, (const uint8_t *)p + off, n, cudaMemcpyDeviceToHost) == cudaSuccess);
        for (size_t i = 0; i < n / 4; i++)
            if (host[i] != pat)
                return ref_fail(rank, "%s: word %zu = 0x%08x, expected poison 0x%08x", what, off / 4 + i, host[i],
                                pat);
    }
    return 0;
}

/* The last rank's topk_idx repeats an id in row 3 (slot 1) or holds E + 5 there. */
static void *bad_topk(fixture_t *f, int repeated)
{
    int32_t topk[TM * K];
    for (int t = 0; t < TM; t++) {
        topk[t * K] = t % E;
        topk[t * K + 1] = (t + 1) % E;
    }
    topk[3 * K + 1] = repeated ? topk[3 * K] : E + 5;
    return gpu_alloc(&f->da, sizeof(topk), topk);
}

/* A standalone layout with a repeated id on the last rank: its counts are all -1 and the async
 * error names topk_idx[3][1]; the other ranks' layouts are untouched by it. Runs first, while the
 * comm's (first-error) async record is still clear. */
static int layout_bad(fixture_t *f)
{
    const int rank = f->rank, victim = f->R - 1;
    void *topk = rank == victim ? bad_topk(f, 1) : f->topk;
    void *per_rank = gpu_alloc(&f->da, 4 * (size_t)f->R, NULL), *per_expert = gpu_alloc(&f->da, 4 * E, NULL);
    void *in_rank = gpu_alloc(&f->da, (size_t)TM * f->R, NULL);
    EXPECT_TRUE(topk && per_rank && per_expert && in_rank);
    epx_tensor_t idx = gpu_tensor(topk, EPX_DTYPE_INT32, 2, TM, K, 0, f->device);
    epx_layout_outputs_t o = EPX_LAYOUT_OUTPUTS_INIT;
    o.num_tokens_per_rank = gpu_tensor(per_rank, EPX_DTYPE_INT32, 1, f->R, 0, 0, f->device);
    o.num_tokens_per_expert = gpu_tensor(per_expert, EPX_DTYPE_INT32, 1, E, 0, 0, f->device);
    o.is_token_in_rank = gpu_tensor(in_rank, EPX_DTYPE_BOOL, 2, TM, f->R, 0, f->device);
    EXPECT_OK(epx_get_dispatch_layout(f->buf, &idx, &o, NULL));
    EXPECT_TRUE(cudaDeviceSynchronize() == cudaSuccess);
    if (rank == victim) {
        if (poisoned(f, per_rank, 4 * (size_t)f->R, 0xffffffffu, "layout num_tokens_per_rank") ||
            poisoned(f, per_expert, 4 * E, 0xffffffffu, "layout num_tokens_per_expert"))
            return 1;
        epx_result_t r = EPX_SUCCESS;
        for (int i = 0; i < 500 && r == EPX_SUCCESS; i++) {
            r = epx_get_async_error(f->comm);
            if (r == EPX_SUCCESS) usleep(2000);
        }
        EXPECT_RES(r, EPX_ERR_INVALID_ARG);
        EXPECT_MSG_HAS("topk_idx[3][1]");
    } else {
        int32_t cnt[E];
        EXPECT_TRUE(cudaMemcpy(cnt, per_expert, sizeof(cnt), cudaMemcpyDeviceToHost) == cudaSuccess);
        for (int e = 0; e < E; e++)
            if (cnt[e] != 2 * TM / E) return ref_fail(rank, "layout num_tokens_per_expert[%d] = %d", e, cnt[e]);
    }
    EXPECT_OK(epx_comm_barrier(f->comm));
    return ht_round_trip(f, "a layout with a repeated id");
}

/* HT dispatch with a bad id on the last rank (repeated, eager; out of range, static): it fails
 * with EPX_ERR_INVALID_ARG naming topk_idx[3][1] (eager: the call; static: the call succeeds on the
 * host and the device's record follows), the peers with EPX_ERR_REMOTE, and its outputs are
 * poisoned: recv_x NaN, recv_topk_idx -1, recv_topk_weights NaN, both counts -1. */
static int ht_bad(fixture_t *f, int repeated)
{
    const int rank = f->rank, victim = f->R - 1;
    const int64_t rows = rows_all(f), worst = repeated ? 0 : rows;
    void *topk = rank == victim ? bad_topk(f, repeated) : f->topk;
    float hw[TM * K];
    for (int i = 0; i < TM * K; i++) hw[i] = 0.5f;
    void *w = gpu_alloc(&f->da, sizeof(hw), hw), *ridx = gpu_alloc(&f->da, (size_t)rows * K * 4, NULL);
    void *rw = gpu_alloc(&f->da, (size_t)rows * K * 4, NULL), *cnt = gpu_alloc(&f->da, 4 * E, NULL);
    void *n_dev = gpu_alloc(&f->da, 16, NULL);
    EXPECT_TRUE(topk && w && ridx && rw && cnt && n_dev);
    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    a.x = gpu_tensor(f->x, EPX_DTYPE_BF16, 2, TM, H, 0, f->device);
    a.topk_idx = gpu_tensor(topk, EPX_DTYPE_INT32, 2, TM, K, 0, f->device);
    a.topk_weights = gpu_tensor(w, EPX_DTYPE_FP32, 2, TM, K, 0, f->device);
    a.num_worst_tokens = worst;
    epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
    o.recv_x = gpu_tensor(f->rx, EPX_DTYPE_BF16, 2, rows, H, 0, f->device);
    o.recv_topk_idx = gpu_tensor(ridx, EPX_DTYPE_INT32, 2, rows, K, 0, f->device);
    o.recv_topk_weights = gpu_tensor(rw, EPX_DTYPE_FP32, 2, rows, K, 0, f->device);
    o.num_recv_tokens_per_expert = gpu_tensor(cnt, EPX_DTYPE_INT32, 1, E / f->R, 0, 0, f->device);
    o.num_recv_tokens = gpu_tensor(n_dev, EPX_DTYPE_INT32, 1, 1, 0, 0, f->device);
    const double t0 = epx_test_now_s();
    const epx_result_t res = epx_ht_dispatch(f->buf, &a, &o);
    if (worst) {
        EXPECT_OK(res); /* static: no host wait, the record follows */
        EXPECT_OK(epx_handle_destroy(o.handle));
        EXPECT_TRUE(cudaDeviceSynchronize() == cudaSuccess);
    } else if (rank == victim) {
        EXPECT_RES(res, EPX_ERR_INVALID_ARG);
        EXPECT_MSG_HAS("topk_idx[3][1]");
        EXPECT_MSG_HAS("poisoned");
    } else {
        EXPECT_RES(res, EPX_ERR_REMOTE);
    }
    EXPECT_TRUE(epx_test_now_s() - t0 < TIMEOUT_MS / 3000.0);
    if (rank == victim &&
        (poisoned(f, f->rx, (size_t)rows * H * 2, 0x7fc07fc0u, "recv_x") ||
         poisoned(f, ridx, (size_t)rows * K * 4, 0xffffffffu, "recv_topk_idx") ||
         poisoned(f, rw, (size_t)rows * K * 4, 0x7fc00000u, "recv_topk_weights") ||
         poisoned(f, cnt, 4 * (size_t)(E / f->R), 0xffffffffu, "num_recv_tokens_per_expert") ||
         poisoned(f, n_dev, 4, 0xffffffffu, "num_recv_tokens")))
        return 1;
    EXPECT_OK(epx_comm_barrier(f->comm));
    return ht_round_trip(f, repeated ? "an HT dispatch with a repeated id" : "an HT dispatch with an id past E");
}

/* Routing-map dispatch without a bound, the last rank's row 3 with K + 1 true entries: it fails
 * with EPX_ERR_INVALID_ARG naming routing_map[3], the peers with EPX_ERR_REMOTE; its tokens are
 * NaN and its num_tokens -1. */
static int rm_bad(fixture_t *f)
{
    const int rank = f->rank, victim = f->R - 1;
    const int64_t rows = rows_all(f);
    uint8_t map[TM * E];
    EXPECT_TRUE(cudaMemcpy(map, f->map, sizeof(map), cudaMemcpyDeviceToHost) == cudaSuccess);
    map[3 * E + (3 + K) % E] = 1;
    void *bad_map = gpu_alloc(&f->da, sizeof(map), map), *n_dev = gpu_alloc(&f->da, 16, NULL);
    EXPECT_TRUE(bad_map && n_dev);
    epx_rm_dispatch_args_t a = EPX_RM_DISPATCH_ARGS_INIT;
    a.hidden = gpu_tensor(f->x, EPX_DTYPE_BF16, 2, TM, H, 0, f->device);
    a.routing_map = gpu_tensor(rank == victim ? bad_map : f->map, EPX_DTYPE_BOOL, 2, TM, E, 0, f->device);
    epx_rm_dispatch_outputs_t o = EPX_RM_DISPATCH_OUTPUTS_INIT;
    o.tokens = gpu_tensor(f->rx, EPX_DTYPE_BF16, 2, rows, H, 0, f->device);
    o.num_tokens = gpu_tensor(n_dev, EPX_DTYPE_INT32, 1, 1, 0, 0, f->device);
    const double t0 = epx_test_now_s();
    const epx_result_t res = epx_rm_dispatch(f->buf, &a, &o);
    if (rank == victim) {
        EXPECT_RES(res, EPX_ERR_INVALID_ARG);
        EXPECT_MSG_HAS("routing_map[3]");
        if (poisoned(f, f->rx, (size_t)rows * H * 2, 0x7fc07fc0u, "tokens") ||
            poisoned(f, n_dev, 4, 0xffffffffu, "num_tokens"))
            return 1;
    } else {
        EXPECT_RES(res, EPX_ERR_REMOTE);
    }
    EXPECT_TRUE(epx_test_now_s() - t0 < TIMEOUT_MS / 3000.0);
    EXPECT_OK(epx_comm_barrier(f->comm));
    return rm_round_trip(f, "a routing map with K + 1 entries") || ht_round_trip(f, "a bad routing map");
}

static int rank_main(int rank, int nranks, const epx_unique_id_t *id, void *vctx)
{
    fixture_t f;
    if (fixture_open(&f, vctx, id, rank, nranks)) return 1;
    int rc = layout_bad(&f);
    if (rc == 0) rc = too_small(&f, 0);
    if (rc == 0) rc = too_small(&f, 1);
    if (rc == 0) rc = ht_bad(&f, 1);
    if (rc == 0) rc = ht_bad(&f, 0);
    if (rc == 0) rc = rm_bad(&f);
    if (rc == 0) EXPECT_OK(epx_comm_barrier(f.comm));
    EXPECT_OK(epx_buffer_destroy(f.buf));
    gpu_arena_free(&f.da);
    EXPECT_OK(epx_comm_destroy(f.comm));
    return rc;
}

int main(void)
{
    gpu_ctx_t ctx;
    if (gpu_test_init(&ctx)) return EPX_TEST_SKIP;
    return gpu_test_each_nranks("verdict", "2,4", rank_main, &ctx);
}
