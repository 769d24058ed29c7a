/*
 * epx-ll-bench: GPU LL rows with their same-run floor. R forked ranks on the GPUs present time LL
 * dispatch (fp8 or bf16) and combine (bf16) whole, then their send and receive halves in hook mode,
 * and a floor kernel that makes the same stores to the same peers with no wait or flag
 * (epx_cuda_ll_floor), every timed call started on all ranks after a barrier. Prints the median us of
 * the slowest rank and the GB/s a rank sends.
 * Usage: epx-ll-bench [-r ranks] [-t tokens] [-H hidden] [-k topk] [-E experts] [-s sms] [-n iters]
 *        [-d fp8|bf16]
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

enum { D_FULL, D_SEND, D_RECV, D_FLOOR, C_FULL, C_SEND, C_RECV, C_FLOOR, NROWS };

typedef struct opts {
    int R, K, E, sms, iters, fp8;
    int64_t T, H;
} opts_t;

typedef struct result {
    double us[NROWS];
    double bytes_disp, bytes_comb; /* what this rank sends */
    int ok;
} result_t;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static epx_tensor_t dt(void *p, epx_dtype_t d, int nd, int64_t a, int64_t b, int64_t c, int dev)
{
    epx_tensor_t t = nd == 1   ? epx_tensor_1d(p, d, a)
                     : nd == 2 ? epx_tensor_2d(p, d, a, b)
                               : epx_tensor_3d(p, d, a, b, c);
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

/* Times one enqueue after a barrier of all ranks; the sample is the event-measured device time. */
#define TIMED(row, body)                                       \
    do {                                                       \
        CK(epx_comm_barrier(comm));                            \
        cudaEventRecord(e0, stream);                           \
        body;                                                  \
        cudaEventRecord(e1, stream);                           \
        if (cudaEventSynchronize(e1) != cudaSuccess) return 1; \
        float ms_ = 0;                                         \
        cudaEventElapsedTime(&ms_, e0, e1);                    \
        samples[(row) * (n + warm) + it] = ms_ * 1000.0;       \
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
    bc.modes = EPX_MODE_LL;
    bc.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_BF16);
    bc.num_sms = o->sms;
    epx_buffer_t buf;
    CK(epx_buffer_create(comm, &bc, &buf));
    const int64_t T = o->T, H = o->H, K = o->K, L = o->E / o->R, RT = (int64_t)o->R * T;
    void *dx, *dtopk, *dw, *drx, *drs, *drc, *dy, *dout;
    CK(cudaMalloc(&dx, (size_t)(T * H) * 2));
    CK(cudaMalloc(&dtopk, (size_t)(T * K) * 4));
    CK(cudaMalloc(&dw, (size_t)(T * K) * 4));
    CK(cudaMalloc(&drx, (size_t)(L * RT * H) * 2));
    CK(cudaMalloc(&drs, (size_t)(L * (H / 128) * RT) * 4 + 16));
    CK(cudaMalloc(&drc, (size_t)L * 4));
    CK(cudaMalloc(&dy, (size_t)(L * RT * H) * 2));
    CK(cudaMalloc(&dout, (size_t)(T * H) * 2));
    cudaMemset(dx, 0x31, (size_t)(T * H) * 2);
    cudaMemset(dw, 0, (size_t)(T * K) * 4);
    cudaMemset(dy, 0x31, (size_t)(L * RT * H) * 2);
    /* Uniform random top-k: K distinct experts per token. */
    int32_t *topk = malloc((size_t)(T * K) * 4);
    if (!topk) return 1;
    uint64_t st = 0x9e37ull * (uint64_t)(rank + 1);
    for (int64_t t = 0; t < T; t++)
        for (int k = 0; k < K;) {
            st = st * 6364136223846793005ull + 1442695040888963407ull;
            int e = (int)((st >> 33) % (uint64_t)o->E), dup = 0;
            for (int j = 0; j < k; j++) dup |= topk[t * K + j] == e;
            if (!dup) topk[t * K + k++] = e;
        }
    cudaMemcpy(dtopk, topk, (size_t)(T * K) * 4, cudaMemcpyHostToDevice);
    free(topk);
    cudaStream_t stream;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);

    epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
    a.x = dt(dx, EPX_DTYPE_BF16, 2, T, H, 0, dev);
    a.topk_idx = dt(dtopk, EPX_DTYPE_INT32, 2, T, K, 0, dev);
    a.use_fp8 = o->fp8;
    a.stream = stream;
    epx_ll_dispatch_outputs_t out = EPX_LL_DISPATCH_OUTPUTS_INIT;
    out.recv_x = dt(drx, o->fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16, 3, L, RT, H, dev);
    if (o->fp8) out.recv_scales = dt(drs, EPX_DTYPE_FP32, 3, L, H / 128, RT, dev);
    out.recv_count = dt(drc, EPX_DTYPE_INT32, 1, L, 0, 0, dev);
    epx_ll_combine_args_t ca = EPX_LL_COMBINE_ARGS_INIT;
    ca.y = dt(dy, EPX_DTYPE_BF16, 3, L, RT, H, dev);
    ca.topk_idx = a.topk_idx;
    ca.topk_weights = dt(dw, EPX_DTYPE_FP32, 2, T, K, 0, dev);
    ca.stream = stream;
    epx_ll_combine_outputs_t co = EPX_LL_COMBINE_OUTPUTS_INIT;
    co.combined_x = dt(dout, EPX_DTYPE_BF16, 2, T, H, 0, dev);

    const int n = o->iters, warm = 5;
    double *samples = malloc(sizeof(double) * (size_t)(n + warm) * NROWS);
    if (!samples) return 1;
    for (int it = 0; it < n + warm; it++) {
        a.return_recv_hook = 0;
        ca.return_recv_hook = 0;
        TIMED(D_FULL, CK(epx_ll_dispatch(buf, &a, &out)));
        ca.handle = out.handle;
        TIMED(C_FULL, CK(epx_ll_combine(buf, &ca, &co)));
        a.return_recv_hook = 1;
        ca.return_recv_hook = 1;
        TIMED(D_SEND, CK(epx_ll_dispatch(buf, &a, &out)));
        TIMED(D_RECV, CK(epx_hook_run(&out.hook, stream)));
        ca.handle = out.handle;
        TIMED(C_SEND, CK(epx_ll_combine(buf, &ca, &co)));
        TIMED(C_RECV, CK(epx_hook_run(&co.hook, stream)));
        TIMED(D_FLOOR, CK(epx_cuda_ll_floor(buf, 0, &a, &out.handle, stream)));
        TIMED(C_FLOOR, CK(epx_cuda_ll_floor(buf, 1, &a, &out.handle, stream)));
    }
    CK(epx_get_async_error(comm));
    for (int r = 0; r < NROWS; r++) {
        double *s = samples + r * (n + warm) + warm;
        qsort(s, (size_t)n, sizeof(double), cmp_double);
        res->us[r] = s[n / 2];
    }
    free(samples);
    /* Rows this rank sends: one per (token, selected expert), each way. */
    const double pairs = (double)(T * K);
    res->bytes_disp = pairs * (o->fp8 ? (double)H + (double)(H / 128) * 4 : (double)H * 2);
    res->bytes_comb = pairs * (double)H * 2;
    res->ok = 1;
    CK(epx_comm_barrier(comm));
    CK(epx_buffer_destroy(buf));
    CK(epx_comm_destroy(comm));
    return 0;
}

int main(int argc, char **argv)
{
    opts_t o = {8, 8, 256, 16, 50, 1, 128, 7168};
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
            fprintf(stderr, "usage: epx-ll-bench [-r R] [-t T] [-H H] [-k K] [-E E] [-s sms] [-n iters] "
                            "[-d fp8|bf16]\n");
            return c == 'h' ? 0 : 2;
        }
    }
    if (o.R < 1 || o.R > 64 || o.T < 1 || o.H < 128 || o.H % 128 || o.K < 1 || o.K > o.E || o.E % o.R ||
        o.iters < 1) {
        fprintf(stderr, "epx-ll-bench: bad options\n");
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
        fprintf(stderr, "epx-ll-bench: a rank failed\n");
        return 1;
    }
    double us[NROWS] = {0}, bd = 0, bcm = 0;
    for (int r = 0; r < o.R; r++) {
        for (int i = 0; i < NROWS; i++) us[i] = res[r].us[i] > us[i] ? res[r].us[i] : us[i];
        bd += res[r].bytes_disp / o.R;
        bcm += res[r].bytes_comb / o.R;
    }
    printf("# LL: R %d, T %lld per rank, H %lld, top-%d, %d experts, %d SMs per rank, %d iterations "
           "(median of the slowest rank)\n",
           o.R, (long long)o.T, (long long)o.H, o.K, o.E, o.sms, o.iters);
    printf("%-30s %10s %12s %10s %8s\n", "operation", "us", "GB/s/rank", "floor_us", "ratio");
    static const char *names[NROWS] = {
        "dispatch",       "dispatch send half (hook)", "dispatch recv half (hook)", "dispatch floor",
        "combine (bf16)", "combine send half (hook)",  "combine recv half (hook)",  "combine floor"};
    for (int i = 0; i < NROWS; i++) {
        const int comb = i >= C_FULL;
        const double bytes = comb ? bcm : bd, floor_us = us[comb ? C_FLOOR : D_FLOOR];
        char name[64];
        snprintf(name, sizeof(name), "%s%s", comb ? "" : (o.fp8 ? "fp8 " : "bf16 "), names[i]);
        printf("%-30s %10.1f %12.1f %10.1f %8.2f\n", name, us[i], bytes / (us[i] * 1e3), floor_us,
               us[i] > 0 ? floor_us / us[i] : 0.0);
    }
    return 0;
}
