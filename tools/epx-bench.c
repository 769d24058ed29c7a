/*
 * epx-bench: times HT, LL and routing-map (permute) dispatch/combine over R forked local ranks
 * (host backend, or the GPU when the cuda backend and a device are there) and checks every
 * output against values recomputed from the inputs, which are built from (rank, token, channel).
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef EPX_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "core/internal.h"
#include "epx/epx.h"

#define BENCH_MAX_SIZES    64
#define BENCH_MAX_RANKS    256
#define BENCH_PAD_MULTIPLE 16

enum { OP_HT = 0, OP_LL = 1, OP_PERMUTE = 2, OP_COUNT = 3 };
static const char *const op_names[OP_COUNT] = {"ht", "ll", "permute"};

enum { ROW_PENDING = 0, ROW_OK, ROW_FAIL, ROW_UNSUPPORTED, ROW_ERROR };

typedef struct bench_opts {
    int64_t tok_begin, tok_end, tok_factor;
    int tokens_given;
    int64_t hidden;
    int topk, experts, iters, warmup, nranks;
    int ops[OP_COUNT], nops;
    epx_dtype_t dtype;
    epx_backend_t backend;
    uint64_t seed;
    int64_t sizes[OP_COUNT][BENCH_MAX_SIZES];
    int nsizes;
} bench_opts_t;

/* What one rank reports for one row (one operation at one size). */
typedef struct bench_cell {
    int32_t status;
    double median_us;
    int64_t bytes;
} bench_cell_t;

/* Shared (MAP_SHARED) between the parent and the ranks: a barrier, the abort flag and results. */
typedef struct bench_shared {
    atomic_uint bar_count;
    atomic_uint bar_gen;
    atomic_int abort_flag;
    atomic_int reported[]; /* [nrows], followed by the cells [nrows][nranks] */
} bench_shared_t;

typedef struct bench_rank {
    const bench_opts_t *opt;
    bench_shared_t *sh;
    bench_cell_t *cells;
    int rank, nranks, gpu, device;
    int64_t timeout_ms;
    void *stream;
    epx_comm_t comm;
} bench_rank_t;

/* ------------------------------------------------------------------- input patterns ---- */

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
static float value_of(int src, int64_t token, int64_t channel, int tag)
{
    uint32_t h = mix3((uint32_t)src + 256u * (uint32_t)(tag + 1), (uint32_t)token, (uint32_t)channel);
    return (float)((int)(h % 64) - 32) / 8.0f;
}

static uint8_t fp8_byte_of(int src, int64_t token, int64_t channel)
{
    uint32_t h = mix3((uint32_t)src, (uint32_t)token, (uint32_t)channel);
    return (uint8_t)((h % 0x7f) | ((h >> 16) & 0x80)); /* any finite e4m3, never NaN */
}

static float scale_of(int src, int64_t token, int64_t group)
{
    return 1.0f + (float)(mix3((uint32_t)src + 77u, (uint32_t)token, (uint32_t)group) % 16) / 16.0f;
}

static float weight_of(int src, int64_t token, int k)
{
    return (float)(1 + mix3((uint32_t)src + 99u, (uint32_t)token, (uint32_t)k) % 16) / 16.0f;
}

/* ------------------------------------------------------------------------- routing ---- */

/* Routing of every rank (each rank recomputes all of it) and what rank `me` should receive. */
typedef struct bench_routing {
    int64_t T;
    int R, K, E, L, me;
    int32_t *topk;    /* [R][T][K] */
    int64_t n_ht;     /* rows HT and routing-map dispatch deliver to me */
    int32_t *ht_src;  /* [n_ht] source rank, HT order */
    int32_t *ht_tok;  /* [n_ht] source token */
    int64_t *exp_off; /* [L + 1] rows per local expert (source rank, then token order) */
    int32_t *exp_src; /* [exp_off[L]] */
    int32_t *exp_tok;
    int32_t *exp_k;           /* slot k of that expert in the source token's topk */
    int64_t sent_rank_rows;   /* my tokens times their destination ranks */
    int64_t sent_expert_rows; /* my tokens times their selected experts */
} bench_routing_t;

static void routing_free(bench_routing_t *rt)
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

static int token_on_rank(const bench_routing_t *rt, int s, int64_t t, int r)
{
    const int32_t *idx = rt->topk + ((int64_t)s * rt->T + t) * rt->K;
    for (int k = 0; k < rt->K; k++)
        if (idx[k] >= 0 && idx[k] / rt->L == r) return 1;
    return 0;
}

static int routing_build(bench_routing_t *rt, const bench_opts_t *opt, int me, int64_t T)
{
    memset(rt, 0, sizeof(*rt));
    rt->T = T;
    rt->R = opt->nranks;
    rt->K = opt->topk;
    rt->E = opt->experts;
    rt->L = opt->experts / opt->nranks;
    rt->me = me;
    int64_t slots = (int64_t)rt->R * T * rt->K;
    rt->topk = malloc((size_t)(slots ? slots : 1) * sizeof(int32_t));
    rt->ht_src = malloc((size_t)(rt->R * T + 1) * sizeof(int32_t));
    rt->ht_tok = malloc((size_t)(rt->R * T + 1) * sizeof(int32_t));
    rt->exp_off = calloc((size_t)rt->L + 1, sizeof(int64_t));
    rt->exp_src = malloc((size_t)(slots + 1) * sizeof(int32_t));
    rt->exp_tok = malloc((size_t)(slots + 1) * sizeof(int32_t));
    rt->exp_k = malloc((size_t)(slots + 1) * sizeof(int32_t));
    if (!rt->topk || !rt->ht_src || !rt->ht_tok || !rt->exp_off || !rt->exp_src || !rt->exp_tok ||
        !rt->exp_k) {
        routing_free(rt);
        fprintf(stderr, "rank %d: out of memory for the routing of %lld tokens\n", me, (long long)T);
        return -1;
    }
    /* K distinct experts per token, uniformly, from a generator seeded by (seed, rank, token). */
    for (int s = 0; s < rt->R; s++)
        for (int64_t t = 0; t < T; t++) {
            uint64_t state = opt->seed ^ ((uint64_t)s << 40) ^ (uint64_t)t;
            int32_t *idx = rt->topk + ((int64_t)s * T + t) * rt->K;
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
    int64_t *fill = calloc((size_t)rt->L, sizeof(int64_t));
    if (!fill) {
        routing_free(rt);
        return -1;
    }
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

/* --------------------------------------------------------- memory on host or device ---- */

static void *mem_alloc(bench_rank_t *b, size_t bytes)
{
    if (bytes == 0) bytes = 1;
#ifdef EPX_HAVE_CUDA
    if (b->gpu) {
        void *p = NULL;
        if (cudaMalloc(&p, bytes) != cudaSuccess) {
            fprintf(stderr, "rank %d: cudaMalloc of %zu bytes failed\n", b->rank, bytes);
            return NULL;
        }
        return p;
    }
#endif
    void *p = calloc(1, bytes);
    if (!p) fprintf(stderr, "rank %d: out of memory allocating %zu bytes\n", b->rank, bytes);
    return p;
}

static void mem_free(bench_rank_t *b, void *p)
{
#ifdef EPX_HAVE_CUDA
    if (b->gpu) {
        if (p) cudaFree(p);
        return;
    }
#endif
    free(p);
}

/* Copies host staging to tensor memory. */
static int mem_put(bench_rank_t *b, void *dst, const void *src, size_t bytes)
{
#ifdef EPX_HAVE_CUDA
    if (b->gpu) return cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice) == cudaSuccess ? 0 : -1;
#endif
    memcpy(dst, src, bytes);
    return 0;
}

/* A host-readable view of tensor memory; release with mem_view_release. */
static const void *mem_view(bench_rank_t *b, const void *src, size_t bytes)
{
#ifdef EPX_HAVE_CUDA
    if (b->gpu) {
        void *p = malloc(bytes ? bytes : 1);
        if (p && (cudaStreamSynchronize((cudaStream_t)b->stream) != cudaSuccess ||
                  cudaMemcpy(p, src, bytes, cudaMemcpyDeviceToHost) != cudaSuccess)) {
            free(p);
            p = NULL;
        }
        if (!p) fprintf(stderr, "rank %d: cannot read back %zu bytes from the device\n", b->rank, bytes);
        return p;
    }
#endif
    return src;
}

static void mem_view_release(bench_rank_t *b, const void *view)
{
    if (b->gpu) free((void *)view);
}

static epx_tensor_t tensor(bench_rank_t *b, void *data, epx_dtype_t dtype, int ndim, int64_t d0, int64_t d1,
                           int64_t d2)
{
    epx_tensor_t t = ndim == 1   ? epx_tensor_1d(data, dtype, d0)
                     : ndim == 2 ? epx_tensor_2d(data, dtype, d0, d1)
                                 : epx_tensor_3d(data, dtype, d0, d1, d2);
    if (b->gpu) {
        t.device_type = EPX_DEVICE_CUDA;
        t.device_id = b->device;
    }
    return t;
}

/* -------------------------------------------------------------- barrier and timing ---- */

static int bench_barrier(bench_rank_t *b)
{
    bench_shared_t *sh = b->sh;
    unsigned gen = atomic_load(&sh->bar_gen);
    if (atomic_fetch_add(&sh->bar_count, 1) == (unsigned)b->nranks - 1) {
        atomic_store(&sh->bar_count, 0);
        atomic_fetch_add(&sh->bar_gen, 1);
        return 0;
    }
    uint64_t deadline = epx_deadline_after_ms(b->timeout_ms);
    for (uint32_t i = 0; atomic_load(&sh->bar_gen) == gen; i++) {
        if (atomic_load(&sh->abort_flag)) return -1;
        if (epx_time_ns() > deadline) {
            fprintf(stderr, "rank %d: peers did not reach the barrier within %lld ms\n", b->rank,
                    (long long)b->timeout_ms);
            atomic_store(&sh->abort_flag, 1);
            return -1;
        }
        epx_backoff(i);
    }
    return 0;
}

/* Times one collective call on this rank. GPU: CUDA events on the rank's stream. */
typedef struct bench_timer {
    uint64_t t0;
#ifdef EPX_HAVE_CUDA
    cudaEvent_t start, stop;
#endif
} bench_timer_t;

static int timer_init(bench_rank_t *b, bench_timer_t *tm)
{
#ifdef EPX_HAVE_CUDA
    if (b->gpu && (cudaEventCreate(&tm->start) != cudaSuccess || cudaEventCreate(&tm->stop) != cudaSuccess))
        return -1;
#endif
    return 0;
}

static void timer_fini(bench_rank_t *b, bench_timer_t *tm)
{
#ifdef EPX_HAVE_CUDA
    if (b->gpu) {
        cudaEventDestroy(tm->start);
        cudaEventDestroy(tm->stop);
    }
#endif
}

static void timer_start(bench_rank_t *b, bench_timer_t *tm)
{
#ifdef EPX_HAVE_CUDA
    if (b->gpu) {
        cudaEventRecord(tm->start, (cudaStream_t)b->stream);
        return;
    }
#endif
    tm->t0 = epx_time_ns();
}

static double timer_stop_us(bench_rank_t *b, bench_timer_t *tm)
{
#ifdef EPX_HAVE_CUDA
    if (b->gpu) {
        float ms = 0.0f;
        cudaEventRecord(tm->stop, (cudaStream_t)b->stream);
        cudaEventSynchronize(tm->stop);
        cudaEventElapsedTime(&ms, tm->start, tm->stop);
        return (double)ms * 1000.0;
    }
#endif
    return (double)(epx_time_ns() - tm->t0) / 1000.0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void report(bench_rank_t *b, int row, int status, double median_us, int64_t bytes)
{
    bench_cell_t *cell = &b->cells[(int64_t)row * b->nranks + b->rank];
    cell->status = status;
    cell->median_us = median_us;
    cell->bytes = bytes;
    atomic_fetch_add(&b->sh->reported[row], 1);
}

/* ----------------------------------------------------------------------- checking ---- */

/* Counts mismatches and prints the first few (rank, op, where, got, want). */
typedef struct bench_check {
    const char *what;
    int rank;
    int64_t bad;
} bench_check_t;

static void check_fail(bench_check_t *ck, const char *field, int64_t row, int64_t col, double got,
                       double want)
{
    if (ck->bad++ < 5)
        fprintf(stderr, "rank %d: %s: %s[%lld][%lld] = %g, expected %g\n", ck->rank, ck->what, field,
                (long long)row, (long long)col, got, want);
}

/* Row of x as token (src, token) was dispatched, compared with the received row. */
static void check_x_row(bench_check_t *ck, const char *field, epx_dtype_t dtype, const void *row_data,
                        int64_t row, int src, int64_t token, int64_t H)
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

static void check_combined_row(bench_check_t *ck, const uint16_t *got_row, int64_t t, const float *acc,
                               int64_t H)
{
    for (int64_t c = 0; c < H; c++) {
        uint16_t want = epx_f32_to_bf16(acc[c]);
        if (got_row[c] != want) check_fail(ck, "combined", t, c, epx_bf16_to_f32(got_row[c]), acc[c]);
    }
}

/* Fills the dispatched x (and fp8 scales) of this rank into host staging. */
static void fill_x(void *x, float *scales, epx_dtype_t dtype, int me, int64_t T, int64_t H)
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

static void fill_topk(const bench_routing_t *rt, int32_t *idx, float *w)
{
    for (int64_t t = 0; t < rt->T; t++)
        for (int k = 0; k < rt->K; k++) {
            idx[t * rt->K + k] = rt->topk[((int64_t)rt->me * rt->T + t) * rt->K + k];
            w[t * rt->K + k] = weight_of(rt->me, t, k);
        }
}

static int64_t row_bytes(epx_dtype_t dtype, int64_t H)
{
    return dtype == EPX_DTYPE_FP8_E4M3 ? H + H / 128 * (int64_t)sizeof(float) : H * 2;
}

/* -------------------------------------------------------------------- the operations ---- */

/* Everything one (op, size) run allocates; freed in one place. */
typedef struct bench_mem {
    void *dev[12];
    void *host[8];
} bench_mem_t;

static void *dev_take(bench_rank_t *b, bench_mem_t *m, size_t bytes)
{
    for (int i = 0; i < 12; i++)
        if (!m->dev[i]) return m->dev[i] = mem_alloc(b, bytes);
    return NULL;
}

static void *host_take(bench_mem_t *m, size_t bytes)
{
    for (int i = 0; i < 8; i++)
        if (!m->host[i]) return m->host[i] = calloc(1, bytes ? bytes : 1);
    return NULL;
}

static void mem_release_all(bench_rank_t *b, bench_mem_t *m)
{
    for (int i = 11; i >= 0; i--) mem_free(b, m->dev[i]);
    for (int i = 7; i >= 0; i--) free(m->host[i]);
}

/* Result of timing one op: -1 fatal (abort the bench), else per-row status. */
typedef struct bench_times {
    double *dispatch_us, *combine_us;
} bench_times_t;

static int fatal(bench_rank_t *b, const char *call, epx_result_t res)
{
    fprintf(stderr, "rank %d: %s failed: %s (%s)\n", b->rank, call, epx_result_name(res),
            epx_last_error_message());
    atomic_store(&b->sh->abort_flag, 1);
    return -1;
}

/* HT dispatch + combine at T tokens. Returns 0, 1 (unsupported) or -1 (fatal). */
static int run_ht(bench_rank_t *b, epx_buffer_t buf, const bench_routing_t *rt, int row, int64_t T_max)
{
    const bench_opts_t *opt = b->opt;
    const int64_t T = rt->T, H = opt->hidden, G = H / 128, cap = (int64_t)rt->R * T_max;
    const int K = rt->K, L = rt->L, me = b->rank, fp8 = opt->dtype == EPX_DTYPE_FP8_E4M3;
    const size_t esz = epx_dtype_size(opt->dtype);
    bench_mem_t m = {0};
    int rc = -1;
    double *times = calloc((size_t)(2 * opt->iters), sizeof(double));
    void *x = dev_take(b, &m, (size_t)(T * H) * esz);
    float *x_scales = dev_take(b, &m, (size_t)(T * G) * sizeof(float));
    int32_t *topk = dev_take(b, &m, (size_t)(T * K) * sizeof(int32_t));
    void *recv_x = dev_take(b, &m, (size_t)(cap * H) * esz);
    float *recv_scales = dev_take(b, &m, (size_t)(cap * G) * sizeof(float));
    int32_t *recv_topk = dev_take(b, &m, (size_t)(cap * K) * sizeof(int32_t));
    int32_t *recv_per_expert = dev_take(b, &m, (size_t)L * sizeof(int32_t));
    uint16_t *y = dev_take(b, &m, (size_t)((rt->n_ht ? rt->n_ht : 1) * H) * 2);
    uint16_t *combined = dev_take(b, &m, (size_t)(T * H) * 2);
    void *hx = host_take(&m, (size_t)(T * H) * esz);
    float *hscales = host_take(&m, (size_t)(T * G) * sizeof(float));
    int32_t *htopk = host_take(&m, (size_t)(T * K) * sizeof(int32_t));
    float *hw = host_take(&m, (size_t)(T * K) * sizeof(float));
    uint16_t *hy = host_take(&m, (size_t)((rt->n_ht ? rt->n_ht : 1) * H) * 2);
    float *acc = host_take(&m, (size_t)H * sizeof(float));
    if (!times || !combined || !acc) goto out;

    fill_x(hx, hscales, opt->dtype, me, T, H);
    fill_topk(rt, htopk, hw);
    /* Combine input: the row received from (s, t) as this rank's "expert output" for it. */
    for (int64_t i = 0; i < rt->n_ht; i++)
        for (int64_t c = 0; c < H; c++)
            hy[i * H + c] = epx_f32_to_bf16(value_of(rt->ht_src[i], rt->ht_tok[i], c, me));
    if (mem_put(b, x, hx, (size_t)(T * H) * esz) ||
        mem_put(b, topk, htopk, (size_t)(T * K) * sizeof(int32_t)) ||
        mem_put(b, y, hy, (size_t)(rt->n_ht * H) * 2) ||
        (fp8 && mem_put(b, x_scales, hscales, (size_t)(T * G) * sizeof(float))))
        goto out;

    bench_timer_t tm;
    if (timer_init(b, &tm)) goto out;
    epx_ht_dispatch_outputs_t dout = EPX_HT_DISPATCH_OUTPUTS_INIT;
    int unsupported = 0, combine_unsupported = 0;
    for (int it = 0; it < opt->warmup + opt->iters; it++) {
        epx_ht_dispatch_args_t da = EPX_HT_DISPATCH_ARGS_INIT;
        da.x = tensor(b, x, opt->dtype, 2, T, H, 0);
        if (fp8) da.x_scales = tensor(b, x_scales, EPX_DTYPE_FP32, 2, T, G, 0);
        da.topk_idx = tensor(b, topk, EPX_DTYPE_INT32, 2, T, K, 0);
        da.expert_alignment = 1;
        da.stream = b->stream;
        epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
        o.recv_x = tensor(b, recv_x, opt->dtype, 2, cap, H, 0);
        if (fp8) o.recv_x_scales = tensor(b, recv_scales, EPX_DTYPE_FP32, 2, cap, G, 0);
        o.recv_topk_idx = tensor(b, recv_topk, EPX_DTYPE_INT32, 2, cap, K, 0);
        o.num_recv_tokens_per_expert = tensor(b, recv_per_expert, EPX_DTYPE_INT32, 1, L, 0, 0);
        if (bench_barrier(b)) goto out_timer;
        timer_start(b, &tm);
        epx_result_t res = epx_ht_dispatch(buf, &da, &o);
        double us = timer_stop_us(b, &tm);
        if (res == EPX_ERR_UNSUPPORTED) {
            unsupported = 1;
            break;
        }
        if (res != EPX_SUCCESS) {
            fatal(b, "epx_ht_dispatch", res);
            goto out_timer;
        }
        dout = o;
        if (it >= opt->warmup) times[it - opt->warmup] = us;
        if (combine_unsupported) {
            epx_handle_destroy(o.handle);
            continue;
        }
        epx_ht_combine_args_t ca = EPX_HT_COMBINE_ARGS_INIT;
        ca.handle = o.handle;
        ca.x = tensor(b, y, EPX_DTYPE_BF16, 2, rt->n_ht, H, 0);
        ca.stream = b->stream;
        epx_ht_combine_outputs_t co = EPX_HT_COMBINE_OUTPUTS_INIT;
        co.combined_x = tensor(b, combined, EPX_DTYPE_BF16, 2, T, H, 0);
        if (bench_barrier(b)) {
            epx_handle_destroy(o.handle);
            goto out_timer;
        }
        timer_start(b, &tm);
        res = epx_ht_combine(buf, &ca, &co);
        double cus = timer_stop_us(b, &tm);
        epx_handle_destroy(o.handle);
        if (res == EPX_ERR_UNSUPPORTED) {
            combine_unsupported = 1;
        } else if (res != EPX_SUCCESS) {
            fatal(b, "epx_ht_combine", res);
            goto out_timer;
        }
        if (it >= opt->warmup) times[opt->iters + it - opt->warmup] = cus;
    }
    if (unsupported) {
        report(b, row, ROW_UNSUPPORTED, 0, 0);
        report(b, row + 1, ROW_UNSUPPORTED, 0, 0);
        rc = 0;
        goto out_timer;
    }

    /* Check the last iteration's outputs. */
    bench_check_t ckd = {"ht-dispatch", me, 0}, ckc = {"ht-combine", me, 0};
    if (dout.num_recv_tokens_host != rt->n_ht)
        check_fail(&ckd, "num_recv_tokens", 0, 0, (double)dout.num_recv_tokens_host, (double)rt->n_ht);
    int64_t n = rt->n_ht < dout.num_recv_tokens_host ? rt->n_ht : dout.num_recv_tokens_host;
    const uint8_t *vx = mem_view(b, recv_x, (size_t)(n * H) * esz);
    const int32_t *vtopk = mem_view(b, recv_topk, (size_t)(n * K) * sizeof(int32_t));
    const int32_t *vper = mem_view(b, recv_per_expert, (size_t)L * sizeof(int32_t));
    const float *vscales = fp8 ? mem_view(b, recv_scales, (size_t)(n * G) * sizeof(float)) : NULL;
    const uint16_t *vcomb = mem_view(b, combined, (size_t)(T * H) * 2);
    if (!vx || !vtopk || !vper || !vcomb || (fp8 && !vscales)) goto out_views;
    for (int64_t i = 0; i < n; i++) {
        int s = rt->ht_src[i];
        int64_t t = rt->ht_tok[i];
        check_x_row(&ckd, "recv_x", opt->dtype, vx + i * H * (int64_t)esz, i, s, t, H);
        for (int64_t g = 0; fp8 && g < G; g++)
            if (vscales[i * G + g] != scale_of(s, t, g))
                check_fail(&ckd, "recv_x_scales", i, g, vscales[i * G + g], scale_of(s, t, g));
        const int32_t *idx = rt->topk + ((int64_t)s * T + t) * K;
        for (int k = 0; k < K; k++) {
            int32_t want = idx[k] / L == me ? idx[k] - me * L : -1;
            if (vtopk[i * K + k] != want) check_fail(&ckd, "recv_topk_idx", i, k, vtopk[i * K + k], want);
        }
    }
    for (int j = 0; j < L; j++)
        if (vper[j] != rt->exp_off[j + 1] - rt->exp_off[j])
            check_fail(&ckd, "num_recv_tokens_per_expert", j, 0, vper[j],
                       (double)(rt->exp_off[j + 1] - rt->exp_off[j]));
    for (int64_t t = 0; t < T && !combine_unsupported; t++) {
        memset(acc, 0, (size_t)H * sizeof(float));
        for (int r = 0; r < rt->R; r++)
            if (token_on_rank(rt, me, t, r))
                for (int64_t c = 0; c < H; c++) acc[c] += value_of(me, t, c, r);
        check_combined_row(&ckc, vcomb + t * H, t, acc, H);
    }
    report(b, row, ckd.bad ? ROW_FAIL : ROW_OK, median(times, opt->iters),
           rt->sent_rank_rows * row_bytes(opt->dtype, H));
    report(b, row + 1,
           combine_unsupported ? ROW_UNSUPPORTED
           : ckc.bad           ? ROW_FAIL
                               : ROW_OK,
           median(times + opt->iters, opt->iters), rt->sent_rank_rows * H * 2);
    rc = 0;
out_views:
    if (rc) fprintf(stderr, "rank %d: cannot read the ht outputs back\n", me);
    if (vcomb) mem_view_release(b, vcomb);
    if (vscales) mem_view_release(b, vscales);
    if (vper) mem_view_release(b, vper);
    if (vtopk) mem_view_release(b, vtopk);
    if (vx) mem_view_release(b, vx);
out_timer:
    timer_fini(b, &tm);
out:
    if (rc && !atomic_load(&b->sh->abort_flag)) atomic_store(&b->sh->abort_flag, 1);
    free(times);
    mem_release_all(b, &m);
    return rc;
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

static int run_ll(bench_rank_t *b, epx_buffer_t buf, const bench_routing_t *rt, int row, int64_t T_max)
{
    const bench_opts_t *opt = b->opt;
    const int64_t T = rt->T, H = opt->hidden, G = H / 128, slots = (int64_t)rt->R * T_max;
    const int K = rt->K, L = rt->L, me = b->rank, fp8 = opt->dtype == EPX_DTYPE_FP8_E4M3;
    const epx_dtype_t recv_dtype = fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
    const size_t resz = epx_dtype_size(recv_dtype);
    bench_mem_t m = {0};
    int rc = -1;
    double *times = calloc((size_t)(2 * opt->iters), sizeof(double));
    uint16_t *x = dev_take(b, &m, (size_t)(T * H) * 2);
    int32_t *topk = dev_take(b, &m, (size_t)(T * K) * sizeof(int32_t));
    float *w = dev_take(b, &m, (size_t)(T * K) * sizeof(float));
    void *recv_x = dev_take(b, &m, (size_t)(L * slots * H) * resz);
    float *recv_scales = dev_take(b, &m, (size_t)(L * G * slots) * sizeof(float));
    int32_t *recv_count = dev_take(b, &m, (size_t)L * sizeof(int32_t));
    uint16_t *y = dev_take(b, &m, (size_t)(L * slots * H) * 2);
    uint16_t *combined = dev_take(b, &m, (size_t)(T * H) * 2);
    uint16_t *hx = host_take(&m, (size_t)(T * H) * 2);
    int32_t *htopk = host_take(&m, (size_t)(T * K) * sizeof(int32_t));
    float *hw = host_take(&m, (size_t)(T * K) * sizeof(float));
    uint16_t *hrow = host_take(&m, (size_t)H * 2);
    float *acc = host_take(&m, (size_t)H * sizeof(float));
    if (!times || !combined || !acc) goto out;

    fill_x(hx, NULL, EPX_DTYPE_BF16, me, T, H);
    fill_topk(rt, htopk, hw);
    if (mem_put(b, x, hx, (size_t)(T * H) * 2) ||
        mem_put(b, topk, htopk, (size_t)(T * K) * sizeof(int32_t)) ||
        mem_put(b, w, hw, (size_t)(T * K) * sizeof(float)))
        goto out;
    /* Combine input: only the valid rows of each local expert, in the dispatch's packed layout. */
    for (int j = 0; j < L; j++)
        for (int64_t i = rt->exp_off[j]; i < rt->exp_off[j + 1]; i++) {
            for (int64_t c = 0; c < H; c++)
                hrow[c] = epx_f32_to_bf16(value_of(rt->exp_src[i], rt->exp_tok[i], c, me * L + j));
            if (mem_put(b, y + ((int64_t)j * slots + i - rt->exp_off[j]) * H, hrow, (size_t)H * 2)) goto out;
        }

    bench_timer_t tm;
    if (timer_init(b, &tm)) goto out;
    int unsupported = 0, combine_unsupported = 0;
    for (int it = 0; it < opt->warmup + opt->iters; it++) {
        epx_ll_dispatch_args_t da = EPX_LL_DISPATCH_ARGS_INIT;
        da.x = tensor(b, x, EPX_DTYPE_BF16, 2, T, H, 0);
        da.topk_idx = tensor(b, topk, EPX_DTYPE_INT32, 2, T, K, 0);
        da.use_fp8 = fp8;
        da.stream = b->stream;
        epx_ll_dispatch_outputs_t o = EPX_LL_DISPATCH_OUTPUTS_INIT;
        o.recv_x = tensor(b, recv_x, recv_dtype, 3, L, slots, H);
        if (fp8) o.recv_scales = tensor(b, recv_scales, EPX_DTYPE_FP32, 3, L, G, slots);
        o.recv_count = tensor(b, recv_count, EPX_DTYPE_INT32, 1, L, 0, 0);
        if (bench_barrier(b)) goto out_timer;
        timer_start(b, &tm);
        epx_result_t res = epx_ll_dispatch(buf, &da, &o);
        double us = timer_stop_us(b, &tm);
        if (res == EPX_ERR_UNSUPPORTED) {
            unsupported = 1;
            break;
        }
        if (res != EPX_SUCCESS) {
            fatal(b, "epx_ll_dispatch", res);
            goto out_timer;
        }
        if (it >= opt->warmup) times[it - opt->warmup] = us;
        if (combine_unsupported) continue;
        epx_ll_combine_args_t ca = EPX_LL_COMBINE_ARGS_INIT;
        ca.handle = o.handle;
        ca.y = tensor(b, y, EPX_DTYPE_BF16, 3, L, slots, H);
        ca.topk_idx = da.topk_idx;
        ca.topk_weights = tensor(b, w, EPX_DTYPE_FP32, 2, T, K, 0);
        ca.stream = b->stream;
        epx_ll_combine_outputs_t co = EPX_LL_COMBINE_OUTPUTS_INIT;
        co.combined_x = tensor(b, combined, EPX_DTYPE_BF16, 2, T, H, 0);
        if (bench_barrier(b)) goto out_timer;
        timer_start(b, &tm);
        res = epx_ll_combine(buf, &ca, &co);
        double cus = timer_stop_us(b, &tm);
        if (res == EPX_ERR_UNSUPPORTED) {
            combine_unsupported = 1;
        } else if (res != EPX_SUCCESS) {
            fatal(b, "epx_ll_combine", res);
            goto out_timer;
        }
        if (it >= opt->warmup) times[opt->iters + it - opt->warmup] = cus;
    }
    if (unsupported) {
        report(b, row, ROW_UNSUPPORTED, 0, 0);
        report(b, row + 1, ROW_UNSUPPORTED, 0, 0);
        rc = 0;
        goto out_timer;
    }

    bench_check_t ckd = {"ll-dispatch", me, 0}, ckc = {"ll-combine", me, 0};
    const int32_t *vcount = mem_view(b, recv_count, (size_t)L * sizeof(int32_t));
    const uint8_t *vx = mem_view(b, recv_x, (size_t)(L * slots * H) * resz);
    const float *vscales = fp8 ? mem_view(b, recv_scales, (size_t)(L * G * slots) * sizeof(float)) : NULL;
    const uint16_t *vcomb = mem_view(b, combined, (size_t)(T * H) * 2);
    if (!vcount || !vx || !vcomb || (fp8 && !vscales)) goto out_views;
    for (int j = 0; j < L; j++) {
        int64_t want_count = rt->exp_off[j + 1] - rt->exp_off[j];
        if (vcount[j] != want_count) {
            check_fail(&ckd, "recv_count", j, 0, vcount[j], (double)want_count);
            continue;
        }
        for (int64_t i = 0; i < want_count; i++) {
            int s = rt->exp_src[rt->exp_off[j] + i];
            int64_t t = rt->exp_tok[rt->exp_off[j] + i], r = (int64_t)j * slots + i;
            if (!fp8) {
                check_x_row(&ckd, "recv_x", EPX_DTYPE_BF16, vx + r * H * 2, r, s, t, H);
                continue;
            }
            for (int64_t g = 0; g < G; g++) {
                float scale_inv = ll_scale_inv(s, t, g),
                      got_scale = vscales[((int64_t)j * G + g) * slots + i];
                if (got_scale != scale_inv) check_fail(&ckd, "recv_scales", r, g, got_scale, scale_inv);
                for (int64_t c = g * 128; c < (g + 1) * 128; c++) {
                    float v = epx_bf16_to_f32(epx_f32_to_bf16(value_of(s, t, c, -1)));
                    uint8_t want = epx_f32_to_fp8_e4m3(v / scale_inv), got = vx[r * H + c];
                    if (got != want) check_fail(&ckd, "recv_x", r, c, got, want);
                }
            }
        }
    }
    for (int64_t t = 0; t < T && !combine_unsupported; t++) {
        memset(acc, 0, (size_t)H * sizeof(float));
        for (int k = 0; k < K; k++) {
            int32_t e = htopk[t * K + k];
            if (e < 0) continue;
            for (int64_t c = 0; c < H; c++) acc[c] += hw[t * K + k] * value_of(me, t, c, e);
        }
        check_combined_row(&ckc, vcomb + t * H, t, acc, H);
    }
    report(b, row, ckd.bad ? ROW_FAIL : ROW_OK, median(times, opt->iters),
           rt->sent_expert_rows * row_bytes(recv_dtype, H));
    report(b, row + 1,
           combine_unsupported ? ROW_UNSUPPORTED
           : ckc.bad           ? ROW_FAIL
                               : ROW_OK,
           median(times + opt->iters, opt->iters), rt->sent_expert_rows * H * 2);
    rc = 0;
out_views:
    if (rc) fprintf(stderr, "rank %d: cannot read the ll outputs back\n", me);
    if (vcomb) mem_view_release(b, vcomb);
    if (vscales) mem_view_release(b, vscales);
    if (vx) mem_view_release(b, vx);
    if (vcount) mem_view_release(b, vcount);
out_timer:
    timer_fini(b, &tm);
out:
    if (rc && !atomic_load(&b->sh->abort_flag)) atomic_store(&b->sh->abort_flag, 1);
    free(times);
    mem_release_all(b, &m);
    return rc;
}

static int run_permute(bench_rank_t *b, epx_buffer_t buf, const bench_routing_t *rt, int row)
{
    const bench_opts_t *opt = b->opt;
    const int64_t T = rt->T, H = opt->hidden, G = H / 128;
    const int K = rt->K, L = rt->L, E = rt->E, me = b->rank, fp8 = opt->dtype == EPX_DTYPE_FP8_E4M3;
    const size_t esz = epx_dtype_size(opt->dtype);
    bench_mem_t m = {0};
    int rc = -1;
    /* Padded group starts of the permuted layout. */
    int64_t *group_start = calloc((size_t)L + 1, sizeof(int64_t));
    double *times = calloc((size_t)(2 * opt->iters), sizeof(double));
    if (!group_start || !times) goto out;
    for (int j = 0; j < L; j++) {
        int64_t n = rt->exp_off[j + 1] - rt->exp_off[j];
        group_start[j + 1] =
            group_start[j] + (n + BENCH_PAD_MULTIPLE - 1) / BENCH_PAD_MULTIPLE * BENCH_PAD_MULTIPLE;
    }
    const int64_t P = group_start[L];
    void *x = dev_take(b, &m, (size_t)(T * H) * esz);
    float *x_scales = dev_take(b, &m, (size_t)(T * G) * sizeof(float));
    uint8_t *map = dev_take(b, &m, (size_t)(T * E));
    float *probs = dev_take(b, &m, (size_t)(T * E) * sizeof(float));
    void *tokens = dev_take(b, &m, (size_t)((P ? P : 1) * H) * esz);
    float *tok_scales = dev_take(b, &m, (size_t)((P ? P : 1) * G) * sizeof(float));
    float *tok_probs = dev_take(b, &m, (size_t)(P ? P : 1) * sizeof(float));
    int32_t *per_expert = dev_take(b, &m, (size_t)L * sizeof(int32_t));
    uint16_t *y = dev_take(b, &m, (size_t)((P ? P : 1) * H) * 2);
    uint16_t *combined = dev_take(b, &m, (size_t)(T * H) * 2);
    void *hx = host_take(&m, (size_t)(T * H) * esz);
    float *hscales = host_take(&m, (size_t)(T * G) * sizeof(float));
    uint8_t *hmap = host_take(&m, (size_t)(T * E));
    float *hprobs = host_take(&m, (size_t)(T * E) * sizeof(float));
    uint16_t *hy = host_take(&m, (size_t)((P ? P : 1) * H) * 2);
    float *acc = host_take(&m, (size_t)H * sizeof(float));
    if (!combined || !acc) goto out;

    fill_x(hx, hscales, opt->dtype, me, T, H);
    for (int64_t t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
            int32_t e = rt->topk[((int64_t)me * T + t) * K + k];
            hmap[t * E + e] = 1;
            hprobs[t * E + e] = weight_of(me, t, k);
        }
    /* Combine input in the permuted layout; padding rows stay zero. */
    for (int j = 0; j < L; j++)
        for (int64_t i = rt->exp_off[j]; i < rt->exp_off[j + 1]; i++)
            for (int64_t c = 0; c < H; c++)
                hy[(group_start[j] + i - rt->exp_off[j]) * H + c] =
                    epx_f32_to_bf16(value_of(rt->exp_src[i], rt->exp_tok[i], c, me * L + j));
    if (mem_put(b, x, hx, (size_t)(T * H) * esz) || mem_put(b, map, hmap, (size_t)(T * E)) ||
        mem_put(b, probs, hprobs, (size_t)(T * E) * sizeof(float)) ||
        mem_put(b, y, hy, (size_t)(P * H) * 2) ||
        (fp8 && mem_put(b, x_scales, hscales, (size_t)(T * G) * sizeof(float))))
        goto out;

    bench_timer_t tm;
    if (timer_init(b, &tm)) goto out;
    epx_rm_dispatch_outputs_t dout = EPX_RM_DISPATCH_OUTPUTS_INIT;
    int unsupported = 0, combine_unsupported = 0;
    for (int it = 0; it < opt->warmup + opt->iters; it++) {
        epx_rm_dispatch_args_t da = EPX_RM_DISPATCH_ARGS_INIT;
        da.hidden = tensor(b, x, opt->dtype, 2, T, H, 0);
        if (fp8) da.scaling_factor = tensor(b, x_scales, EPX_DTYPE_FP32, 2, T, G, 0);
        da.routing_map = tensor(b, map, EPX_DTYPE_BOOL, 2, T, E, 0);
        da.probs = tensor(b, probs, EPX_DTYPE_FP32, 2, T, E, 0);
        da.permute = 1;
        da.pad_multiple = BENCH_PAD_MULTIPLE;
        da.stream = b->stream;
        epx_rm_dispatch_outputs_t o = EPX_RM_DISPATCH_OUTPUTS_INIT;
        o.tokens = tensor(b, tokens, opt->dtype, 2, P, H, 0);
        if (fp8) o.scaling_factor = tensor(b, tok_scales, EPX_DTYPE_FP32, 2, P, G, 0);
        o.probs = tensor(b, tok_probs, EPX_DTYPE_FP32, 1, P, 0, 0);
        o.tokens_per_expert = tensor(b, per_expert, EPX_DTYPE_INT32, 1, L, 0, 0);
        if (bench_barrier(b)) goto out_timer;
        timer_start(b, &tm);
        epx_result_t res = epx_rm_dispatch(buf, &da, &o);
        double us = timer_stop_us(b, &tm);
        if (res == EPX_ERR_UNSUPPORTED) {
            unsupported = 1;
            break;
        }
        if (res != EPX_SUCCESS) {
            fatal(b, "epx_rm_dispatch", res);
            goto out_timer;
        }
        dout = o;
        if (it >= opt->warmup) times[it - opt->warmup] = us;
        if (combine_unsupported) {
            epx_handle_destroy(o.handle);
            continue;
        }
        epx_rm_combine_args_t ca = EPX_RM_COMBINE_ARGS_INIT;
        ca.handle = o.handle;
        ca.x = tensor(b, y, EPX_DTYPE_BF16, 2, P, H, 0);
        ca.weighted = 1;
        ca.stream = b->stream;
        epx_rm_combine_outputs_t co = EPX_RM_COMBINE_OUTPUTS_INIT;
        co.combined = tensor(b, combined, EPX_DTYPE_BF16, 2, T, H, 0);
        if (bench_barrier(b)) {
            epx_handle_destroy(o.handle);
            goto out_timer;
        }
        timer_start(b, &tm);
        res = epx_rm_combine(buf, &ca, &co);
        double cus = timer_stop_us(b, &tm);
        epx_handle_destroy(o.handle);
        if (res == EPX_ERR_UNSUPPORTED) {
            combine_unsupported = 1;
        } else if (res != EPX_SUCCESS) {
            fatal(b, "epx_rm_combine", res);
            goto out_timer;
        }
        if (it >= opt->warmup) times[opt->iters + it - opt->warmup] = cus;
    }
    if (unsupported) {
        report(b, row, ROW_UNSUPPORTED, 0, 0);
        report(b, row + 1, ROW_UNSUPPORTED, 0, 0);
        rc = 0;
        goto out_timer;
    }

    bench_check_t ckd = {"permute-dispatch", me, 0}, ckc = {"permute-combine", me, 0};
    if (dout.num_tokens_host != P)
        check_fail(&ckd, "num_tokens", 0, 0, (double)dout.num_tokens_host, (double)P);
    const uint8_t *vtok = mem_view(b, tokens, (size_t)(P * H) * esz);
    const float *vprobs = mem_view(b, tok_probs, (size_t)P * sizeof(float));
    const int32_t *vper = mem_view(b, per_expert, (size_t)L * sizeof(int32_t));
    const float *vscales = fp8 ? mem_view(b, tok_scales, (size_t)(P * G) * sizeof(float)) : NULL;
    const uint16_t *vcomb = mem_view(b, combined, (size_t)(T * H) * 2);
    if (!vtok || !vprobs || !vper || !vcomb || (fp8 && !vscales)) goto out_views;
    for (int j = 0; j < L; j++) {
        if (vper[j] != group_start[j + 1] - group_start[j])
            check_fail(&ckd, "tokens_per_expert", j, 0, vper[j],
                       (double)(group_start[j + 1] - group_start[j]));
        for (int64_t r = group_start[j]; r < group_start[j + 1]; r++) {
            int64_t i = rt->exp_off[j] + r - group_start[j];
            const uint8_t *got = vtok + r * H * (int64_t)esz;
            if (i < rt->exp_off[j + 1]) {
                int s = rt->exp_src[i];
                int64_t t = rt->exp_tok[i];
                check_x_row(&ckd, "tokens", opt->dtype, got, r, s, t, H);
                float want = weight_of(s, t, rt->exp_k[i]);
                if (vprobs[r] != want) check_fail(&ckd, "probs", r, 0, vprobs[r], want);
                for (int64_t g = 0; fp8 && g < G; g++)
                    if (vscales[r * G + g] != scale_of(s, t, g))
                        check_fail(&ckd, "scaling_factor", r, g, vscales[r * G + g], scale_of(s, t, g));
            } else {
                for (int64_t c = 0; c < H * (int64_t)esz; c++)
                    if (got[c]) check_fail(&ckd, "tokens (padding)", r, c, got[c], 0);
                if (vprobs[r] != 0.0f) check_fail(&ckd, "probs (padding)", r, 0, vprobs[r], 0);
            }
        }
    }
    for (int64_t t = 0; t < T && !combine_unsupported; t++) {
        memset(acc, 0, (size_t)H * sizeof(float));
        /* ranks ascending, then local experts ascending: experts in ascending order */
        for (int e = 0; e < E; e++) {
            if (!hmap[t * E + e]) continue;
            float wt = hprobs[t * E + e];
            for (int64_t c = 0; c < H; c++) acc[c] += wt * value_of(me, t, c, e);
        }
        check_combined_row(&ckc, vcomb + t * H, t, acc, H);
    }
    report(b, row, ckd.bad ? ROW_FAIL : ROW_OK, median(times, opt->iters),
           rt->sent_rank_rows * row_bytes(opt->dtype, H));
    report(b, row + 1,
           combine_unsupported ? ROW_UNSUPPORTED
           : ckc.bad           ? ROW_FAIL
                               : ROW_OK,
           median(times + opt->iters, opt->iters), rt->sent_expert_rows * H * 2);
    rc = 0;
out_views:
    if (rc) fprintf(stderr, "rank %d: cannot read the permute outputs back\n", me);
    if (vcomb) mem_view_release(b, vcomb);
    if (vscales) mem_view_release(b, vscales);
    if (vper) mem_view_release(b, vper);
    if (vprobs) mem_view_release(b, vprobs);
    if (vtok) mem_view_release(b, vtok);
out_timer:
    timer_fini(b, &tm);
out:
    if (rc && !atomic_load(&b->sh->abort_flag)) atomic_store(&b->sh->abort_flag, 1);
    free(times);
    free(group_start);
    mem_release_all(b, &m);
    return rc;
}

/* --------------------------------------------------------------------------- ranks ---- */

static int run_op(bench_rank_t *b, int op_slot, int op)
{
    const bench_opts_t *opt = b->opt;
    int row0 = op_slot * opt->nsizes * 2;
    int64_t T_max = 0;
    for (int i = 0; i < opt->nsizes; i++)
        if (opt->sizes[op][i] > T_max) T_max = opt->sizes[op][i];
    static const uint32_t modes[OP_COUNT] = {EPX_MODE_HT, EPX_MODE_LL, EPX_MODE_PERMUTE};
    epx_buffer_config_t cfg = EPX_BUFFER_CONFIG_INIT;
    cfg.max_tokens = T_max;
    cfg.hidden = opt->hidden;
    cfg.num_topk = opt->topk;
    cfg.num_experts = opt->experts;
    cfg.modes = modes[op];
    cfg.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_BF16) | EPX_DTYPE_BIT(opt->dtype);
    cfg.max_pad_multiple = BENCH_PAD_MULTIPLE;
    epx_buffer_t buf = NULL;
    epx_result_t res = epx_buffer_create(b->comm, &cfg, &buf);
    if (res == EPX_ERR_UNSUPPORTED) {
        for (int i = 0; i < opt->nsizes * 2; i++) report(b, row0 + i, ROW_UNSUPPORTED, 0, 0);
        return 0;
    }
    if (res != EPX_SUCCESS) return fatal(b, "epx_buffer_create", res);
    int rc = 0;
    for (int i = 0; i < opt->nsizes && rc == 0; i++) {
        bench_routing_t rt;
        if (routing_build(&rt, opt, b->rank, opt->sizes[op][i])) {
            atomic_store(&b->sh->abort_flag, 1);
            rc = -1;
            break;
        }
        int row = row0 + 2 * i;
        rc = op == OP_HT   ? run_ht(b, buf, &rt, row, T_max)
             : op == OP_LL ? run_ll(b, buf, &rt, row, T_max)
                           : run_permute(b, buf, &rt, row);
        routing_free(&rt);
    }
    epx_buffer_destroy(buf);
    return rc;
}

static int rank_main(bench_rank_t *b, const epx_unique_id_t *id)
{
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    cfg.backend = b->gpu ? EPX_BACKEND_CUDA : EPX_BACKEND_HOST;
    cfg.cuda_device = b->gpu ? b->device : -1;
#ifdef EPX_HAVE_CUDA
    if (b->gpu) {
        cudaStream_t stream;
        if (cudaSetDevice(b->device) != cudaSuccess || cudaStreamCreate(&stream) != cudaSuccess) {
            fprintf(stderr, "rank %d: cannot use cuda device %d\n", b->rank, b->device);
            atomic_store(&b->sh->abort_flag, 1);
            return 1;
        }
        b->stream = stream;
    }
#endif
    epx_result_t res = epx_comm_init(id, b->rank, b->nranks, &cfg, &b->comm);
    if (res != EPX_SUCCESS) return fatal(b, "epx_comm_init", res) ? 1 : 0;
    int rc = 0;
    for (int i = 0; i < b->opt->nops && rc == 0; i++) rc = run_op(b, i, b->opt->ops[i]);
    epx_comm_destroy(b->comm);
#ifdef EPX_HAVE_CUDA
    if (b->gpu) cudaStreamDestroy((cudaStream_t)b->stream);
#endif
    return rc ? 1 : 0;
}

/* -------------------------------------------------------------------------- parent ---- */

/* CUDA must not be initialised in the parent before it forks the ranks: ask a child. */
static int probe_gpu_count(void)
{
#ifdef EPX_HAVE_CUDA
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        int n = epx_cuda_device_count();
        _exit(n > 100 ? 100 : n);
    }
    if (pid < 0) return 0;
    int status = 0;
    for (int i = 0; i < 60000; i++) {
        pid_t got = waitpid(pid, &status, WNOHANG);
        if (got == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 0;
        if (got < 0 && errno != EINTR) return 0;
        usleep(1000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
#endif
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: epx-bench [options]\n"
               "  -t N        tokens per rank (default 256 for ht and permute, 128 for ll)\n"
               "  -b N -e N -f F  sweep tokens per rank from -b to -e, multiplying by F (default 2)\n"
               "  -H N        hidden size (default 7168)\n"
               "  -k N        top-k (default 8)\n"
               "  -E N        experts (default 256; a multiple of the rank count)\n"
               "  -n N        timed iterations (default 10)\n"
               "  -w N        warm-up iterations (default 2)\n"
               "  -r N        ranks (default EPX_BENCH_RANKS, else the GPU count, else 4)\n"
               "  -o LIST     operations: ht,ll,permute (default all)\n"
               "  -d DTYPE    dispatch dtype: bf16 or fp8 (default bf16)\n"
               "  -B BACKEND  auto, host or cuda (default auto: cuda when built with it and a GPU is there)\n"
               "  -s SEED     routing seed (default 1)\n"
               "  --env       print the environment variables of the library and exit\n"
               "  -h          this help\n");
}

static int parse_int(const char *text, const char *flag, int64_t min, int64_t *out)
{
    char *end = NULL;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (errno || end == text || *end || v < min) {
        fprintf(stderr, "epx-bench: %s '%s' is not an integer >= %lld\n", flag, text, (long long)min);
        return -1;
    }
    *out = v;
    return 0;
}

static int parse_args(int argc, char **argv, bench_opts_t *opt, int *print_env)
{
    static const struct option longs[] = {
        {"env", no_argument, NULL, 'V'}, {"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};
    int64_t v, begin = 0, end = 0;
    opt->tok_factor = 2;
    opt->hidden = 7168;
    opt->topk = 8;
    opt->experts = 256;
    opt->iters = 10;
    opt->warmup = 2;
    opt->dtype = EPX_DTYPE_BF16;
    opt->backend = EPX_BACKEND_AUTO;
    opt->seed = 1;
    for (int i = 0; i < OP_COUNT; i++) opt->ops[opt->nops++] = i;
    const char *env_ranks = getenv("EPX_BENCH_RANKS");
    if (env_ranks && *env_ranks) {
        if (parse_int(env_ranks, "EPX_BENCH_RANKS", 1, &v)) return -1;
        opt->nranks = (int)v;
    }
    int c;
    while ((c = getopt_long(argc, argv, "t:b:e:f:H:k:E:n:w:r:o:d:B:s:h", longs, NULL)) != -1) {
        switch (c) {
        case 't':
        case 'b':
            if (parse_int(optarg, c == 't' ? "-t" : "-b", 1, &begin)) return -1;
            if (c == 't') end = begin;
            opt->tokens_given = 1;
            break;
        case 'e':
            if (parse_int(optarg, "-e", 1, &end)) return -1;
            opt->tokens_given = 1;
            break;
        case 'f':
            if (parse_int(optarg, "-f", 1, &opt->tok_factor)) return -1;
            break;
        case 'H':
            if (parse_int(optarg, "-H", 1, &opt->hidden)) return -1;
            break;
        case 'k':
            if (parse_int(optarg, "-k", 1, &v)) return -1;
            opt->topk = (int)(v > 64 ? 65 : v);
            break;
        case 'E':
            if (parse_int(optarg, "-E", 1, &v)) return -1;
            opt->experts = (int)(v > 1 << 20 ? 1 << 20 : v);
            break;
        case 'n':
            if (parse_int(optarg, "-n", 1, &v)) return -1;
            opt->iters = (int)(v > 1000000 ? 1000000 : v);
            break;
        case 'w':
            if (parse_int(optarg, "-w", 0, &v)) return -1;
            opt->warmup = (int)(v > 1000000 ? 1000000 : v);
            break;
        case 'r':
            if (parse_int(optarg, "-r", 1, &v)) return -1;
            opt->nranks = (int)(v > BENCH_MAX_RANKS ? BENCH_MAX_RANKS + 1 : v);
            break;
        case 's':
            if (parse_int(optarg, "-s", 0, &v)) return -1;
            opt->seed = (uint64_t)v;
            break;
        case 'o': {
            char copy[128], *save = NULL;
            snprintf(copy, sizeof(copy), "%s", optarg);
            opt->nops = 0;
            for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
                int found = -1;
                for (int i = 0; i < OP_COUNT; i++)
                    if (strcmp(tok, op_names[i]) == 0) found = i;
                for (int i = 0; i < opt->nops; i++)
                    if (opt->ops[i] == found) found = -2;
                if (found == -1) {
                    fprintf(stderr, "epx-bench: -o: unknown operation '%s' (ht, ll, permute)\n", tok);
                    return -1;
                }
                if (found >= 0) opt->ops[opt->nops++] = found;
            }
            if (opt->nops == 0) {
                fprintf(stderr, "epx-bench: -o names no operation\n");
                return -1;
            }
            break;
        }
        case 'd':
            if (strcmp(optarg, "bf16") == 0)
                opt->dtype = EPX_DTYPE_BF16;
            else if (strcmp(optarg, "fp8") == 0 || strcmp(optarg, "fp8_e4m3") == 0)
                opt->dtype = EPX_DTYPE_FP8_E4M3;
            else {
                fprintf(stderr, "epx-bench: -d '%s' is not bf16 or fp8\n", optarg);
                return -1;
            }
            break;
        case 'B':
            if (strcmp(optarg, "auto") == 0)
                opt->backend = EPX_BACKEND_AUTO;
            else if (strcmp(optarg, "host") == 0)
                opt->backend = EPX_BACKEND_HOST;
            else if (strcmp(optarg, "cuda") == 0)
                opt->backend = EPX_BACKEND_CUDA;
            else {
                fprintf(stderr, "epx-bench: -B '%s' is not auto, host or cuda\n", optarg);
                return -1;
            }
            break;
        case 'V': *print_env = 1; break;
        case 'h': usage(stdout); exit(0);
        default: usage(stderr); return -1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "epx-bench: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (opt->tokens_given) {
        if (!begin) begin = end;
        if (!end) end = begin;
        if (end < begin) {
            fprintf(stderr, "epx-bench: -e %lld is below -b %lld\n", (long long)end, (long long)begin);
            return -1;
        }
        for (int64_t t = begin; t <= end && opt->nsizes < BENCH_MAX_SIZES; t *= opt->tok_factor) {
            for (int op = 0; op < OP_COUNT; op++) opt->sizes[op][opt->nsizes] = t;
            opt->nsizes++;
            if (opt->tok_factor == 1) break;
        }
    } else {
        opt->sizes[OP_HT][0] = opt->sizes[OP_PERMUTE][0] = 256;
        opt->sizes[OP_LL][0] = 128;
        opt->nsizes = 1;
    }
    return 0;
}

static int check_opts(const bench_opts_t *opt)
{
    if (opt->nranks > BENCH_MAX_RANKS) {
        fprintf(stderr, "epx-bench: at most %d ranks\n", BENCH_MAX_RANKS);
        return -1;
    }
    if (opt->topk > 64 || opt->topk > opt->experts) {
        fprintf(stderr, "epx-bench: top-k %d must be at most 64 and at most the %d experts\n", opt->topk,
                opt->experts);
        return -1;
    }
    if (opt->experts % opt->nranks) {
        fprintf(stderr, "epx-bench: %d experts do not divide among %d ranks\n", opt->experts, opt->nranks);
        return -1;
    }
    if (opt->dtype == EPX_DTYPE_FP8_E4M3 && opt->hidden % 128) {
        fprintf(stderr, "epx-bench: fp8 needs a hidden size that is a multiple of 128, not %lld\n",
                (long long)opt->hidden);
        return -1;
    }
    return 0;
}

static const char *status_text(int status)
{
    switch (status) {
    case ROW_OK: return "ok";
    case ROW_FAIL: return "FAIL";
    case ROW_UNSUPPORTED: return "unsupported";
    default: return "error";
    }
}

/* One row from every rank's cell: the slowest rank's median, with its bytes; the check is ok
 * only when every rank's is. */
static int print_row(const bench_opts_t *opt, const bench_cell_t *cells, int row, int op)
{
    static const char *const suffix[2] = {"dispatch", "combine"};
    int status = ROW_OK, slowest = 0;
    for (int r = 0; r < opt->nranks; r++) {
        int s = cells[r].status;
        if (s == ROW_PENDING || s == ROW_ERROR)
            status = ROW_ERROR;
        else if (s == ROW_FAIL && status != ROW_ERROR)
            status = ROW_FAIL;
        else if (s == ROW_UNSUPPORTED && status == ROW_OK)
            status = ROW_UNSUPPORTED;
        if (cells[r].median_us > cells[slowest].median_us) slowest = r;
    }
    char name[32];
    snprintf(name, sizeof(name), "%s-%s", op_names[op], suffix[row % 2]);
    const char *dtype = row % 2 ? "bf16" : epx_dtype_name(opt->dtype);
    int64_t tokens = opt->sizes[op][(row / 2) % opt->nsizes];
    printf("%-17s %5d %7lld %7lld %5d %8d %-9s", name, opt->nranks, (long long)tokens, (long long)opt->hidden,
           opt->topk, opt->experts, dtype);
    const bench_cell_t *c = &cells[slowest];
    if (status == ROW_OK || status == ROW_FAIL)
        printf(" %11.1f %12lld %9.2f  %s\n", c->median_us, (long long)c->bytes,
               c->median_us > 0 ? (double)c->bytes / (c->median_us * 1e3) : 0.0, status_text(status));
    else
        printf(" %11s %12s %9s  %s\n", "-", "-", "-", status_text(status));
    fflush(stdout);
    return status == ROW_OK || status == ROW_UNSUPPORTED ? 0 : 1;
}

int main(int argc, char **argv)
{
    bench_opts_t opt;
    memset(&opt, 0, sizeof(opt));
    int print_env = 0;
    if (parse_args(argc, argv, &opt, &print_env)) return 2;
    if (print_env) {
        epx_params_print(stdout);
        return 0;
    }
    const epx_params_t *params = NULL;
    if (epx_params_get(&params) != EPX_SUCCESS) {
        fprintf(stderr, "epx-bench: %s\n", epx_last_error_message());
        return 2;
    }
    int ngpus = opt.backend == EPX_BACKEND_HOST ? 0 : probe_gpu_count();
    if (opt.backend == EPX_BACKEND_CUDA && ngpus == 0) {
        fprintf(stderr, "epx-bench: -B cuda, but %s\n",
#ifdef EPX_HAVE_CUDA
                "no usable CUDA device was found"
#else
                "this build has no cuda backend"
#endif
        );
        return 2;
    }
    int gpu = ngpus > 0;
    if (opt.nranks == 0) opt.nranks = gpu ? ngpus : 4;
    if (check_opts(&opt)) return 2;

    const int nrows = opt.nops * opt.nsizes * 2;
    size_t cells_offset = (sizeof(bench_shared_t) + (size_t)nrows * sizeof(atomic_int) + 63) & ~(size_t)63;
    size_t shared_bytes = cells_offset + (size_t)nrows * (size_t)opt.nranks * sizeof(bench_cell_t);
    bench_shared_t *sh = mmap(NULL, shared_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) {
        perror("epx-bench: mmap");
        return 2;
    }
    bench_cell_t *cells = (bench_cell_t *)((char *)sh + cells_offset);

    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    printf("# epx-bench %s: backend %s, %d ranks (forked processes; %s), iterations %d after %d warm-up, "
           "seed %llu\n",
           epx_version(), gpu ? "cuda" : "host", opt.nranks,
           gpu ? "GPUs shared round-robin"
               : (opt.nranks > cores ? "more ranks than cores" : "one core or more each"),
           opt.iters, opt.warmup, (unsigned long long)opt.seed);
    if (!gpu) printf("# host: %ld cores\n", cores);
    printf("# time_us: median over iterations of each rank's time for one barrier-aligned call (%s); the\n"
           "#   slowest rank's median is shown, with that rank's bytes and GB/s\n",
           gpu ? "CUDA events" : "CLOCK_MONOTONIC");
    printf(
        "# bytes: dispatch = token bytes the rank sends (ht, permute: once per destination rank; ll: once\n"
        "#   per selected expert; fp8 rows include their scales); combine = bf16 bytes the rank receives\n"
        "#   (ht: once per rank; ll, permute: once per selected expert); permute pads groups to %d rows\n",
        BENCH_PAD_MULTIPLE);
    printf("%-17s %5s %7s %7s %5s %8s %-9s %11s %12s %9s  %s\n", "op", "ranks", "tokens", "hidden", "topk",
           "experts", "dtype", "time_us", "bytes", "GB/s", "check");
    fflush(stdout);
    fflush(stderr);

    epx_unique_id_t id;
    if (epx_get_unique_id(&id) != EPX_SUCCESS) {
        fprintf(stderr, "epx-bench: epx_get_unique_id: %s\n", epx_last_error_message());
        return 2;
    }
    pid_t pids[BENCH_MAX_RANKS];
    int alive = 0;
    for (int r = 0; r < opt.nranks; r++) {
        pid_t pid = fork();
        if (pid < 0) {
            perror("epx-bench: fork");
            atomic_store(&sh->abort_flag, 1);
            break;
        }
        if (pid == 0) {
            bench_rank_t b = {&opt, sh,  cells, r, opt.nranks, gpu, gpu ? r % ngpus : -1, params->timeout_ms,
                              NULL, NULL};
            int rc = rank_main(&b, &id);
            fflush(stdout);
            fflush(stderr);
            _exit(rc);
        }
        pids[alive++] = pid;
    }

    /* Print rows as every rank reports them; give up when no rank reports for longer than the
     * library's own timeout plus a margin. */
    int failed = alive < opt.nranks, next = 0, remaining = alive;
    int64_t stall_ms = params->timeout_ms + 30000;
    uint64_t last_progress = epx_time_ns();
    int last_seen = 0;
    while (next < nrows) {
        while (next < nrows && atomic_load(&sh->reported[next]) == opt.nranks) {
            failed |=
                print_row(&opt, cells + (int64_t)next * opt.nranks, next, opt.ops[next / (2 * opt.nsizes)]);
            next++;
        }
        int seen = 0;
        for (int i = next; i < nrows; i++) seen += atomic_load(&sh->reported[i]);
        if (seen != last_seen || next == nrows) {
            last_seen = seen;
            last_progress = epx_time_ns();
        }
        int status;
        pid_t pid = remaining ? waitpid(-1, &status, WNOHANG) : -1;
        if (pid > 0) {
            remaining--;
            if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
                failed = 1;
                atomic_store(&sh->abort_flag, 1);
            }
            continue;
        }
        if (next < nrows && remaining == 0) break;
        if (epx_time_ns() - last_progress > (uint64_t)stall_ms * 1000000ull) {
            fprintf(stderr, "epx-bench: no rank reported for %lld ms; stopping the ranks\n",
                    (long long)stall_ms);
            for (int i = 0; i < alive; i++) kill(pids[i], SIGKILL);
            failed = 1;
            break;
        }
        if (next < nrows) usleep(1000);
    }
    for (; next < nrows; next++)
        failed |= print_row(&opt, cells + (int64_t)next * opt.nranks, next, opt.ops[next / (2 * opt.nsizes)]);
    /* Reap the ranks; one that does not leave within the stall limit is killed. */
    uint64_t reap_deadline = epx_deadline_after_ms(stall_ms);
    while (remaining > 0) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid < 0 && errno != EINTR) break;
        if (pid > 0) {
            remaining--;
            if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed = 1;
            continue;
        }
        if (epx_time_ns() > reap_deadline) {
            fprintf(stderr, "epx-bench: ranks did not exit; killing them\n");
            for (int i = 0; i < alive; i++) kill(pids[i], SIGKILL);
            reap_deadline = UINT64_MAX;
            failed = 1;
        }
        usleep(1000);
    }
    munmap(sh, shared_bytes);
    if (failed) fprintf(stderr, "epx-bench: FAILED (a check failed or a rank reported an error)\n");
    return failed ? 1 : 0;
}
