/*
 * A bad id in a device topk_idx fails an LL call on the cuda backend like any other collective: the
 * last rank's topk_idx repeats an id in row 3 or holds E + 5 there. For an LL dispatch (eager or with
 * the receive hook) that rank's async error is EPX_ERR_INVALID_ARG naming topk_idx[3][1], every
 * peer's is EPX_ERR_REMOTE, every rank's recv_count is -1, the failing rank's recv_x is NaN and its
 * src_info -1, and the combine of that handle writes NaN rows everywhere. For an LL combine the same
 * errors, combined_x NaN on every rank. Then an LL round trip is exact on every rank. One comm per
 * case: a comm keeps its first async error.
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"
#include "gpu_test.h"

#define TIMEOUT_MS 30000
#define H          1024
#define TM         16
#define K          2
#define E          8

typedef struct ll_verdict_case {
    int R;
    int repeated; /* the bad id repeats slot 0's (else E + 5) */
    int hook;     /* the dispatch returns its receive half as a hook */
    int combine;  /* the bad id goes to the combine (the dispatch is good) */
    gpu_ctx_t gpu;
} ll_verdict_case_t;

typedef struct fixture {
    int rank, R, L, device;
    epx_comm_t comm;
    epx_buffer_t buf;
    gpu_arena_t da;
    cudaStream_t st;
    void *x, *topk, *bad, *w, *rx, *rc, *si, *lr, *out;
} fixture_t;

static int64_t rows_all(const fixture_t *f)
{
    return (int64_t)f->R * TM;
}

/* Token t selects experts t % E and (t + 1) % E; bad: row 3's slot 1 repeats slot 0 or is E + 5. */
static void fill_topk(int32_t *topk, int bad, int repeated)
{
    for (int t = 0; t < TM; t++) {
        topk[t * K] = t % E;
        topk[t * K + 1] = (t + 1) % E;
    }
    if (bad) topk[3 * K + 1] = repeated ? topk[3 * K] : E + 5;
}

static epx_result_t dispatch(fixture_t *f, const void *topk, int hook, epx_ll_dispatch_outputs_t *o)
{
    epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
    a.x = gpu_tensor(f->x, EPX_DTYPE_BF16, 2, TM, H, 0, f->device);
    a.topk_idx = gpu_tensor((void *)topk, EPX_DTYPE_INT32, 2, TM, K, 0, f->device);
    a.return_recv_hook = hook;
    a.stream = f->st;
    *o = (epx_ll_dispatch_outputs_t)EPX_LL_DISPATCH_OUTPUTS_INIT;
    o->recv_x = gpu_tensor(f->rx, EPX_DTYPE_BF16, 3, f->L, rows_all(f), H, f->device);
    o->recv_count = gpu_tensor(f->rc, EPX_DTYPE_INT32, 1, f->L, 0, 0, f->device);
    o->src_info = gpu_tensor(f->si, EPX_DTYPE_INT32, 2, f->L, rows_all(f), 0, f->device);
    o->layout_range = gpu_tensor(f->lr, EPX_DTYPE_INT64, 2, f->L, f->R, 0, f->device);
    epx_result_t res = epx_ll_dispatch(f->buf, &a, o);
    if (res == EPX_SUCCESS && hook) res = epx_hook_run(&o->hook, f->st);
    return res;
}

/* Combine of the received rows themselves (y = recv_x), weights 1: each token comes back as 2 x. */
static epx_result_t combine(fixture_t *f, const void *topk, const epx_ll_handle_t *handle)
{
    epx_ll_combine_args_t ca = EPX_LL_COMBINE_ARGS_INIT;
    ca.y = gpu_tensor(f->rx, EPX_DTYPE_BF16, 3, f->L, rows_all(f), H, f->device);
    ca.topk_idx = gpu_tensor((void *)topk, EPX_DTYPE_INT32, 2, TM, K, 0, f->device);
    ca.topk_weights = gpu_tensor(f->w, EPX_DTYPE_FP32, 2, TM, K, 0, f->device);
    ca.handle = *handle;
    ca.stream = f->st;
    epx_ll_combine_outputs_t co = EPX_LL_COMBINE_OUTPUTS_INIT;
    co.combined_x = gpu_tensor(f->out, EPX_DTYPE_BF16, 2, TM, H, 0, f->device);
    return epx_ll_combine(f->buf, &ca, &co);
}

static uint16_t x_value(int rank, int t, int c)
{
    return epx_f32_to_bf16((float)(1 + (rank * TM + t + c) % 16));
}

static int round_trip(fixture_t *f, const char *after)
{
    const int rank = f->rank;
    epx_ll_dispatch_outputs_t o;
    EXPECT_OK(dispatch(f, f->topk, 0, &o));
    EXPECT_OK(combine(f, f->topk, &o.handle));
    CUDA_OK(cudaStreamSynchronize(f->st));
    static uint16_t got[TM * H];
    CUDA_OK(cudaMemcpy(got, f->out, sizeof(got), cudaMemcpyDeviceToHost));
    for (int t = 0; t < TM; t++)
        for (int c = 0; c < H; c++) {
            const uint16_t want = epx_f32_to_bf16(2.0f * epx_bf16_to_f32(x_value(rank, t, c)));
            if (got[t * H + c] != want)
                return ref_fail(rank, "LL round trip after %s: combined_x[%d][%d] = 0x%04x, expected 0x%04x",
                                after, t, c, got[t * H + c], want);
        }
    return 0;
}

/* Every 32-bit word of `bytes` bytes of device memory is `pat`. */
static int all_words(int rank, const void *p, size_t bytes, uint32_t pat, const char *what)
{
    static uint32_t host[1 << 16];
    for (size_t off = 0; off < bytes; off += sizeof(host)) {
        const size_t n = bytes - off < sizeof(host) ? bytes - off : sizeof(host);
        CUDA_OK(cudaMemcpy(host, (const uint8_t *)p + off, n, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n / 4; i++)
            if (host[i] != pat)
                return ref_fail(rank, "%s: word %zu = 0x%08x, expected 0x%08x", what, off / 4 + i, host[i], pat);
    }
    return 0;
}

/* The comm's async error, waited for (the poller reports within a few ms). */
static epx_result_t async_error(fixture_t *f)
{
    epx_result_t r = EPX_SUCCESS;
    for (int i = 0; i < 1000 && r == EPX_SUCCESS; i++) {
        r = epx_get_async_error(f->comm);
        if (r == EPX_SUCCESS) usleep(2000);
    }
    return r;
}

static int fixture_open(fixture_t *f, const ll_verdict_case_t *cs, const epx_unique_id_t *id, int rank)
{
    memset(f, 0, sizeof(*f));
    f->rank = rank;
    f->R = cs->R;
    f->L = E / cs->R;
    if (gpu_test_comm(&cs->gpu, id, rank, cs->R, TIMEOUT_MS, &f->comm, &f->device)) return 1;
    epx_buffer_config_t bc = epx_test_buffer_config(TM, H, K, E, EPX_MODE_LL);
    bc.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_BF16);
    EXPECT_OK(epx_buffer_create(f->comm, &bc, &f->buf));
    CUDA_OK(cudaStreamCreateWithFlags(&f->st, cudaStreamNonBlocking));
    static uint16_t hx[TM * H];
    int32_t topk[TM * K], bad[TM * K];
    float w[TM * K];
    for (int t = 0; t < TM; t++)
        for (int c = 0; c < H; c++) hx[t * H + c] = x_value(rank, t, c);
    fill_topk(topk, 0, 0);
    fill_topk(bad, rank == cs->R - 1, cs->repeated);
    for (int i = 0; i < TM * K; i++) w[i] = 1.0f;
    const size_t rows = (size_t)rows_all(f) * (size_t)f->L;
    f->x = gpu_alloc(&f->da, sizeof(hx), hx);
    f->topk = gpu_alloc(&f->da, sizeof(topk), topk);
    f->bad = gpu_alloc(&f->da, sizeof(bad), bad);
    f->w = gpu_alloc(&f->da, sizeof(w), w);
    f->rx = gpu_alloc(&f->da, rows * H * 2, NULL);
    f->rc = gpu_alloc(&f->da, (size_t)f->L * 4, NULL);
    f->si = gpu_alloc(&f->da, rows * 4, NULL);
    f->lr = gpu_alloc(&f->da, (size_t)f->L * f->R * 8, NULL);
    f->out = gpu_alloc(&f->da, (size_t)TM * H * 2, NULL);
    EXPECT_TRUE(f->out != NULL);
    CUDA_OK(cudaDeviceSynchronize()); /* the arena's fills ran on the legacy stream */
    return round_trip(f, "creation");
}

/* The failing rank's async error names the slot; the peers' say REMOTE. */
static int check_errors(fixture_t *f)
{
    if (f->rank == f->R - 1) {
        EXPECT_RES(async_error(f), EPX_ERR_INVALID_ARG);
        EXPECT_MSG_HAS("topk_idx[3][1]");
        EXPECT_MSG_HAS("poisoned");
    } else {
        EXPECT_RES(async_error(f), EPX_ERR_REMOTE);
    }
    return 0;
}

static int run_case(fixture_t *f, const ll_verdict_case_t *cs)
{
    const int rank = f->rank, victim = f->R - 1;
    epx_ll_dispatch_outputs_t o;
    EXPECT_OK(dispatch(f, cs->combine ? f->topk : f->bad, cs->hook, &o));
    CUDA_OK(cudaStreamSynchronize(f->st));
    if (!cs->combine) {
        if (check_errors(f) || all_words(rank, f->rc, (size_t)f->L * 4, 0xffffffffu, "recv_count")) return 1;
        const size_t rows = (size_t)rows_all(f) * (size_t)f->L;
        if (rank == victim && (all_words(rank, f->rx, rows * H * 2, 0x7fc07fc0u, "recv_x") ||
                               all_words(rank, f->si, rows * 4, 0xffffffffu, "src_info")))
            return 1;
    }
    /* The combine of a failed dispatch, or a combine with the bad id: NaN rows on every rank. */
    EXPECT_OK(combine(f, cs->combine ? f->bad : f->topk, &o.handle));
    CUDA_OK(cudaStreamSynchronize(f->st));
    if (cs->combine && check_errors(f)) return 1;
    if (all_words(rank, f->out, (size_t)TM * H * 2, 0x7fc07fc0u, "combined_x")) return 1;
    EXPECT_OK(epx_comm_barrier(f->comm));
    return round_trip(f, cs->combine ? "an LL combine with a bad id" : "an LL dispatch with a bad id");
}

static int rank_main(int rank, int nranks, const epx_unique_id_t *id, void *vcase)
{
    const ll_verdict_case_t *cs = vcase;
    (void)nranks;
    ref_set_case("R=%d %s id, %s%s", cs->R, cs->repeated ? "repeated" : "out-of-range",
                 cs->combine ? "combine" : "dispatch", cs->hook ? " with hook" : "");
    fixture_t f;
    int rc = fixture_open(&f, cs, id, rank);
    if (rc == 0) rc = run_case(&f, cs);
    if (rc == 0) EXPECT_OK(epx_comm_barrier(f.comm));
    if (f.buf) EXPECT_OK(epx_buffer_destroy(f.buf));
    gpu_arena_free(&f.da);
    if (f.st) cudaStreamDestroy(f.st);
    if (f.comm) EXPECT_OK(epx_comm_destroy(f.comm));
    return rc;
}

int main(void)
{
    gpu_ctx_t gpu;
    if (gpu_test_init(&gpu)) return EPX_TEST_SKIP;
    ll_verdict_case_t cases[] = {
        {2, 1, 0, 0, gpu}, {2, 0, 1, 0, gpu}, {2, 1, 0, 1, gpu}, {4, 0, 0, 0, gpu},
        {4, 1, 1, 0, gpu}, {4, 0, 0, 1, gpu}, {2, 0, 0, 0, gpu}, {4, 1, 0, 0, gpu},
    };
    return EPX_TEST_RUN_CASES("ll verdict", cases, rank_main, 200, gpu.seed);
}
