/*
 * epx-ceiling: GPU HT rows with their same-run ceiling. R forked ranks on the GPUs present time
 * dispatch (fresh routing, static mode), cached dispatch and combine with CUDA events, and the
 * same token bytes copied between the same ranks with plain stores over the same mappings
 * (epx_cuda_ht_ceiling), all ranks at once after a barrier. Prints median us, GB/s per rank and
 * the ratio to the ceiling.
 * Usage: epx-ceiling [-r ranks] [-t tokens] [-H hidden] [-k topk] [-E experts] [-s sms] [-n iters]
 *        [-d bf16|fp8]
 */
#include <cuda_runtime.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/internal.h"
#include "cuda/cuda.h"
#include "bench/bench.h"

typedef struct opts {
    int R, K, E, sms, iters, fp8;
    int64_t T, H;
} opts_t;

/* Per-rank medians written into shared memory for the parent's table. */
#define NUM_ROWS 7
typedef struct result {
    double us[NUM_ROWS]; /* dispatch, cached dispatch, combine, ceiling, and view mode's three */
    double bytes_disp, bytes_comb, bytes_ceil;
    int ok;
} result_t;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static epx_tensor_t dt(void *p, epx_dtype_t d, int64_t a, int64_t b, int dev)
{
    epx_tensor_t t = b ? epx_tensor_2d(p, d, a, b) : epx_tensor_1d(p, d, a);
    t.device_type = EPX_DEVICE_CUDA;
    t.device_id = dev;
    return t;
}

#define CK(call)                                                                                \
    do {                                                                                        \
        if ((call) != 0) {                                                                      \
            fprintf(stderr, "rank %d: %s failed: %s\n", rank, #call, epx_last_error_message()); \
            return 1;                                                                           \
        }                                                                                       \
    } while (0)

static int rank_main(int rank, const opts_t *o, const epx_unique_id_t *id, result_t *res)
{
    int ngpu = 0;
    cudaGetDeviceCount(&ngpu);
    const int dev = ngpu > 0 ? rank % ngpu : 0;
    cudaSetDevice(dev);
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    cfg.backend = EPX_BACKEND_CUDA;
    cfg.cuda_device = dev;
    epx_comm_t comm;
    CK(epx_comm_init(id, rank, o->R, &cfg, &comm));
    epx_buffer_config_t bc = EPX_BUFFER_CONFIG_INIT;
    bc.max_tokens = o->T;
    bc.hidden = o->H;
    bc.num_topk = o->K;
    bc.num_experts = o->E;
    bc.modes = EPX_MODE_HT;
    bc.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_BF16) | EPX_DTYPE_BIT(EPX_DTYPE_FP8_E4M3);
    bc.num_sms = o->sms;
    epx_buffer_t buf;
    CK(epx_buffer_create(comm, &bc, &buf));
    const int64_t T = o->T, H = o->H, K = o->K, S = H / 128, cap = (int64_t)o->R * T;
    const epx_dtype_t xd = o->fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
    const size_t es = o->fp8 ? 1 : 2;
    void *dx, *dxb, *ds, *dtopk, *drx, *drs, *dy, *dout, *dn;
    CK(cudaMalloc(&dx, (size_t)(T * H) * es));
    CK(cudaMalloc(&dxb, (size_t)(T * H) * 2));
    CK(cudaMalloc(&ds, (size_t)(T * S) * 4));
    CK(cudaMalloc(&dtopk, (size_t)(T * K) * 4));
    CK(cudaMalloc(&drx, (size_t)(cap * H) * es));
    CK(cudaMalloc(&drs, (size_t)(cap * S) * 4));
    CK(cudaMalloc(&dy, (size_t)(cap * H) * 2));
    CK(cudaMalloc(&dout, (size_t)(T * H) * 2));
    CK(cudaMalloc(&dn, 4));
    cudaMemset(dx, 0x31, (size_t)(T * H) * es);
    cudaMemset(dxb, 0x31, (size_t)(T * H) * 2);
    cudaMemset(ds, 0x3c, (size_t)(T * S) * 4);
    cudaMemset(dy, 0x31, (size_t)(cap * H) * 2);
    /* Uniform random top-k: K distinct experts per token. */
    int32_t *topk = malloc((size_t)(T * K) * 4);
    uint64_t st = 0x9e37ull * (uint64_t)(rank + 1);
    int64_t rows_sent = 0;
    for (int64_t t = 0; t < T; t++) {
        uint64_t ranks = 0;
        for (int k = 0; k < K;) {
            st = st * 6364136223846793005ull + 1442695040888963407ull;
            int e = (int)((st >> 33) % (uint64_t)o->E), dup = 0;
            for (int j = 0; j < k; j++) dup |= topk[t * K + j] == e;
            if (dup) continue;
            topk[t * K + k++] = e;
            ranks |= 1ull << (e / (o->E / o->R));
        }
        rows_sent += __builtin_popcountll(ranks);
    }
    cudaMemcpy(dtopk, topk, (size_t)(T * K) * 4, cudaMemcpyHostToDevice);
    free(topk);
    cudaStream_t stream;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);

    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    a.x = dt(dx, xd, T, H, dev);
    if (o->fp8) a.x_scales = dt(ds, EPX_DTYPE_FP32, T, S, dev);
    a.topk_idx = dt(dtopk, EPX_DTYPE_INT32, T, K, dev);
    a.num_worst_tokens = cap;
    a.stream = stream;
    epx_ht_dispatch_outputs_t out = EPX_HT_DISPATCH_OUTPUTS_INIT;
    out.recv_x = dt(drx, xd, cap, H, dev);
    if (o->fp8) out.recv_x_scales = dt(drs, EPX_DTYPE_FP32, cap, S, dev);
    out.num_recv_tokens = dt(dn, EPX_DTYPE_INT32, 1, 0, dev);
    epx_ht_dispatch_outputs_t oc = out;
    epx_handle_t handle = NULL;
    epx_tensor_t xb = dt(dxb, EPX_DTYPE_BF16, T, H, dev);
    epx_tensor_t xs = a.x;
    const int n = o->iters, warm = 3;
    double *samples = malloc(sizeof(double) * (size_t)(n + warm));
    epx_ht_dispatch_args_t av = a; /* view mode: outputs in the library's buffer */
    av.recv_in_buffer = 1;
    epx_ht_dispatch_outputs_t ov = EPX_HT_DISPATCH_OUTPUTS_INIT;
    ov.num_recv_tokens = out.num_recv_tokens;
    epx_handle_t vhandle = NULL;
    for (int which = 0; which < NUM_ROWS; which++) {
        for (int it = 0; it < n + warm; it++) {
            CK(epx_comm_barrier(comm));
            cudaEventRecord(e0, stream);
            if (which == 0) {
                if (handle) epx_handle_destroy(handle);
                CK(epx_ht_dispatch(buf, &a, &out));
                handle = out.handle;
            } else if (which == 1) {
                epx_ht_dispatch_args_t ac = a;
                ac.cached_handle = handle;
                ac.topk_idx.data = NULL;
                CK(epx_ht_dispatch(buf, &ac, &oc));
            } else if (which == 2) {
                epx_ht_combine_args_t ca = EPX_HT_COMBINE_ARGS_INIT;
                ca.handle = handle;
                ca.x = dt(dy, EPX_DTYPE_BF16, cap, H, dev);
                ca.stream = stream;
                epx_ht_combine_outputs_t co = EPX_HT_COMBINE_OUTPUTS_INIT;
                co.combined_x = dt(dout, EPX_DTYPE_BF16, T, H, dev);
                CK(epx_ht_combine(buf, &ca, &co));
            } else if (which == 3) {
                CK(epx_cuda_ht_ceiling(buf, handle, o->fp8 ? &xs : &xb, stream));
            } else if (which == 4) {
                if (vhandle) epx_handle_destroy(vhandle);
                epx_ht_dispatch_outputs_t ovn = ov;
                CK(epx_ht_dispatch(buf, &av, &ovn));
                vhandle = ovn.handle;
            } else if (which == 5) {
                epx_ht_dispatch_args_t ac = av;
                ac.cached_handle = vhandle;
                ac.topk_idx.data = NULL;
                epx_ht_dispatch_outputs_t ovc = EPX_HT_DISPATCH_OUTPUTS_INIT;
                CK(epx_ht_dispatch(buf, &ac, &ovc));
            } else {
                epx_tensor_t in_view;
                CK(epx_ht_get_combine_input(buf, vhandle, &in_view));
                epx_ht_combine_args_t ca = EPX_HT_COMBINE_ARGS_INIT;
                ca.handle = vhandle;
                ca.x_in_buffer = 1;
                ca.stream = stream;
                epx_ht_combine_outputs_t co = EPX_HT_COMBINE_OUTPUTS_INIT;
                co.combined_x = dt(dout, EPX_DTYPE_BF16, T, H, dev);
                CK(epx_ht_combine(buf, &ca, &co));
            }
            cudaEventRecord(e1, stream);
            if (cudaEventSynchronize(e1) != cudaSuccess) return 1;
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            samples[it] = ms * 1000.0;
        }
        CK(epx_get_async_error(comm));
        qsort(samples + warm, (size_t)n, sizeof(double), cmp_double);
        res->us[which] = samples[warm + n / 2];
    }
    free(samples);
    const double row = (double)H * (double)es + (o->fp8 ? (double)S * 4 : 0);
    res->bytes_disp = (double)rows_sent * row;
    res->bytes_comb = (double)rows_sent * (double)H * 2; /* what this rank sends back in combine */
    res->bytes_ceil = (double)rows_sent * (double)H * (double)es;
    res->ok = 1;
    CK(epx_comm_barrier(comm));
    epx_handle_destroy(handle);
    epx_handle_destroy(vhandle);
    CK(epx_buffer_destroy(buf));
    CK(epx_comm_destroy(comm));
    return 0;
}

int main(int argc, char **argv)
{
    opts_t o = {8, 8, 256, 16, 20, 0, 4096, 7168};
    int c;
    while ((c = getopt(argc, argv, "r:t:H:k:E:s:n:d:h")) != -1) {
        switch (c) {
        case 'r': o.R = atoi(optarg); break;
        case 't': o.T = atoll(optarg); break;
        case 'H': o.H = atoll(optarg); break;
        case 'k': o.K = atoi(optarg); break;
        case 'E': o.E = atoi(optarg); break;
        case 's': o.sms = atoi(optarg); break;
        case 'n': o.iters = atoi(optarg); break;
        case 'd': o.fp8 = strcmp(optarg, "fp8") == 0; break;
        default:
            fprintf(
                stderr,
                "usage: epx-ceiling [-r R] [-t T] [-H H] [-k K] [-E E] [-s sms] [-n iters] [-d bf16|fp8]\n");
            return c == 'h' ? 0 : 2;
        }
    }
    if (o.R < 1 || o.R > 64 || o.T < 1 || o.H < 128 || o.H % 128 || o.K < 1 || o.K > o.E || o.E % o.R ||
        o.iters < 1) {
        fprintf(stderr, "epx-ceiling: bad options\n");
        return 2;
    }
    result_t *res =
        mmap(NULL, sizeof(result_t) * (size_t)o.R, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (res == MAP_FAILED) return 1;
    memset(res, 0, sizeof(result_t) * (size_t)o.R);
    epx_unique_id_t id;
    if (epx_get_unique_id(&id) != EPX_SUCCESS) return 1;
    for (int r = 0; r < o.R; r++) {
        fflush(stdout);
        pid_t pid = fork();
        if (pid < 0) return 1;
        if (pid == 0) _exit(rank_main(r, &o, &id, &res[r]));
    }
    int failed = 0, status;
    while (wait(&status) > 0)
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed = 1;
    if (failed) {
        fprintf(stderr, "epx-ceiling: a rank failed\n");
        return 1;
    }
    /* Per-rank medians; the table shows the slowest rank (every rank waits for it). */
    double us[NUM_ROWS] = {0}, bd = 0, bc = 0, bcl = 0;
    for (int r = 0; r < o.R; r++) {
        for (int i = 0; i < NUM_ROWS; i++) us[i] = res[r].us[i] > us[i] ? res[r].us[i] : us[i];
        bd += res[r].bytes_disp / o.R;
        bc += res[r].bytes_comb / o.R;
        bcl += res[r].bytes_ceil / o.R;
    }
    const char *d = o.fp8 ? "fp8" : "bf16";
    printf("# R %d, T %lld, H %lld, top-%d, %d experts, %d SMs per rank, %d iterations (median of the "
           "slowest rank)\n",
           o.R, (long long)o.T, (long long)o.H, o.K, o.E, o.sms, o.iters);
    printf("%-22s %10s %12s %14s %12s %8s\n", "operation", "us", "GB/s/rank", "ceiling_us", "ceil_GB/s",
           "ratio");
    const double ceil_gbs = bcl / (us[3] * 1e3);
    /* Rows 4-6: view mode (recv_in_buffer / x_in_buffer), one pass over the bytes. */
    const char *names[NUM_ROWS] = {"dispatch", "cached dispatch", "combine (bf16)", "",
                                   "view dispatch", "view cached", "view combine"};
    for (int i = 0; i < NUM_ROWS; i++) {
        if (i == 3) continue; /* the ceiling itself */
        const int comb = i == 2 || i == 6;
        double bytes = comb ? bc : bd;
        double gbs = bytes / (us[i] * 1e3);
        /* The ceiling moves the dispatch's token bytes; combine moves bf16 rows, scaled alike. */
        double cgbs = ceil_gbs;
        printf("%-6s %-15s %10.1f %12.1f %14.1f %12.1f %8.2f\n", comb ? "bf16" : d, names[i], us[i], gbs,
               us[3], cgbs, gbs / cgbs);
    }
    return 0;
}
