/*
 * epx-rm-bench: GPU routing-map dispatch with fused permute and combine with unpermute, next to
 * same-run ceilings. R forked ranks time, with CUDA events after a barrier, the bounded (host-free)
 * dispatch with permute and the weighted combine with unpermute, the HT plain-copy ceiling of the
 * same token bytes over the same mappings (R > 1), and a local device copy of the permuted bytes.
 * Usage: epx-rm-bench [-r ranks] [-t tokens] [-H hidden] [-k topk] [-L local experts] [-p pad]
 *        [-s sms] [-n iters]
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
    int R, K, L, pad, sms, iters;
    int64_t T, H;
} opts_t;

enum { OP_DISPATCH = 0, OP_COMBINE = 1, OP_CEIL = 2, OP_COPY = 3, OP_COUNT = 4 };

typedef struct result {
    double us[OP_COUNT];
    double rows_perm; /* P rows this rank received (permuted, without padding) */
    double rows_sent; /* token rows this rank sent (once per destination rank) */
    int D, domains;
    int sms; /* device SMs (a lone rank's routing-map kernels take them all unless -s) */
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
    cudaDeviceGetAttribute(&res->sms, cudaDevAttrMultiProcessorCount, dev);
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    cfg.backend = EPX_BACKEND_CUDA;
    cfg.cuda_device = dev;
    epx_comm_t comm;
    CK(epx_comm_init(id, rank, o->R, &cfg, &comm));
    epx_topology_t topo;
    CK(epx_comm_get_topology(comm, &topo));
    res->D = topo.ranks_per_nvlink_domain;
    res->domains = topo.num_nvlink_domains;
    const int64_t T = o->T, H = o->H, K = o->K, L = o->L, E = L * o->R;
    /* Output rows: the buffer's capacity, capped near twice the balanced count (memory: 8 ranks
     * share one GPU). */
    int64_t cap = (int64_t)o->R * T * (K < L ? K : L) + L * (o->pad - 1);
    if (cap > 2 * T * K + L * o->pad) cap = 2 * T * K + L * o->pad;
    epx_buffer_config_t bc = EPX_BUFFER_CONFIG_INIT;
    bc.max_tokens = T;
    bc.hidden = H;
    bc.num_topk = (int32_t)K;
    bc.num_experts = (int32_t)E;
    bc.modes = EPX_MODE_HT | EPX_MODE_PERMUTE; /* HT for the same-bytes ceiling */
    bc.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_BF16);
    bc.max_pad_multiple = o->pad;
    bc.num_sms = o->sms;
    epx_buffer_t buf;
    CK(epx_buffer_create(comm, &bc, &buf));

    /* Uniform random top-k: K distinct experts per token, as a routing map and as topk_idx. */
    uint8_t *map = calloc((size_t)(T * E), 1);
    float *probs = malloc((size_t)(T * E) * 4);
    int32_t *topk = malloc((size_t)(T * K) * 4);
    if (!map || !probs || !topk) return 1;
    uint64_t st = 0x9e37ull * (uint64_t)(rank + 1);
    for (int64_t i = 0; i < T * E; i++) probs[i] = 1.0f / (float)(1 + i % 7);
    int64_t rows_sent = 0;
    for (int64_t t = 0; t < T; t++) {
        uint64_t ranks = 0;
        for (int k = 0; k < K;) {
            st = st * 6364136223846793005ull + 1442695040888963407ull;
            const int e = (int)((st >> 33) % (uint64_t)E);
            if (map[t * E + e]) continue;
            map[t * E + e] = 1;
            topk[t * K + k++] = e;
            ranks |= 1ull << (e / L);
        }
        rows_sent += __builtin_popcountll(ranks);
    }
    void *dx, *dmap, *dprobs, *dtopk, *dtok, *dprow, *dtpe, *dn, *dout, *drx, *dcopy;
    CK(cudaMalloc(&dx, (size_t)(T * H) * 2));
    CK(cudaMalloc(&dmap, (size_t)(T * E)));
    CK(cudaMalloc(&dprobs, (size_t)(T * E) * 4));
    CK(cudaMalloc(&dtopk, (size_t)(T * K) * 4));
    CK(cudaMalloc(&dtok, (size_t)(cap * H) * 2));
    CK(cudaMalloc(&dprow, (size_t)cap * 4));
    CK(cudaMalloc(&dtpe, (size_t)L * 4));
    CK(cudaMalloc(&dn, 4));
    CK(cudaMalloc(&dout, (size_t)(T * H) * 2));
    CK(cudaMalloc(&drx, (size_t)((int64_t)o->R * T * H) * 2));
    CK(cudaMalloc(&dcopy, (size_t)(cap * H) * 2));
    cudaMemset(dx, 0x31, (size_t)(T * H) * 2);
    cudaMemcpy(dmap, map, (size_t)(T * E), cudaMemcpyHostToDevice);
    cudaMemcpy(dprobs, probs, (size_t)(T * E) * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(dtopk, topk, (size_t)(T * K) * 4, cudaMemcpyHostToDevice);
    free(map);
    free(probs);
    free(topk);
    cudaStream_t stream;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);

    epx_rm_dispatch_args_t a = EPX_RM_DISPATCH_ARGS_INIT;
    a.hidden = dt(dx, EPX_DTYPE_BF16, T, H, dev);
    a.routing_map = dt(dmap, EPX_DTYPE_BOOL, T, E, dev);
    a.probs = dt(dprobs, EPX_DTYPE_FP32, T, E, dev);
    a.permute = 1;
    a.pad_multiple = o->pad;
    a.stream = stream;
    epx_rm_dispatch_outputs_t out = EPX_RM_DISPATCH_OUTPUTS_INIT;
    out.tokens = dt(dtok, EPX_DTYPE_BF16, cap, H, dev);
    out.probs = dt(dprow, EPX_DTYPE_FP32, cap, 0, dev);
    out.tokens_per_expert = dt(dtpe, EPX_DTYPE_INT32, L, 0, dev);
    out.num_tokens = dt(dn, EPX_DTYPE_INT32, 1, 0, dev);
    /* One eager call learns P; the timed calls use it as the bound (no host wait). */
    CK(epx_rm_dispatch(buf, &a, &out));
    const int64_t P = out.num_tokens_host;
    CK(epx_handle_destroy(out.handle));
    a.num_permuted_tokens = P;
    epx_handle_t handle = NULL, ht = NULL;
    if (o->R > 1) {
        epx_ht_dispatch_args_t ha = EPX_HT_DISPATCH_ARGS_INIT;
        ha.x = a.hidden;
        ha.topk_idx = dt(dtopk, EPX_DTYPE_INT32, T, K, dev);
        ha.num_worst_tokens = (int64_t)o->R * T;
        ha.stream = stream;
        epx_ht_dispatch_outputs_t ho = EPX_HT_DISPATCH_OUTPUTS_INIT;
        ho.recv_x = dt(drx, EPX_DTYPE_BF16, (int64_t)o->R * T, H, dev);
        CK(epx_ht_dispatch(buf, &ha, &ho));
        ht = ho.handle;
        cudaStreamSynchronize(stream);
    }
    int32_t real = 0;
    cudaMemcpy(&real, dn, 4, cudaMemcpyDeviceToHost);
    const int n = o->iters, warm = 3;
    double *samples = malloc(sizeof(double) * (size_t)(n + warm));
    for (int op = 0; op < OP_COUNT; op++) {
        if (op == OP_CEIL && !ht) continue;
        for (int it = 0; it < n + warm; it++) {
            if (op == OP_DISPATCH && handle) { /* outside the timed window: it synchronises */
                CK(epx_handle_destroy(handle));
                handle = NULL;
            }
            CK(epx_comm_barrier(comm));
            cudaEventRecord(e0, stream);
            if (op == OP_DISPATCH) {
                CK(epx_rm_dispatch(buf, &a, &out));
                handle = out.handle;
            } else if (op == OP_COMBINE) {
                epx_rm_combine_args_t ca = EPX_RM_COMBINE_ARGS_INIT;
                ca.handle = handle;
                ca.x = dt(dtok, EPX_DTYPE_BF16, P, H, dev);
                ca.weighted = 1;
                ca.stream = stream;
                epx_rm_combine_outputs_t co = EPX_RM_COMBINE_OUTPUTS_INIT;
                co.combined = dt(dout, EPX_DTYPE_BF16, T, H, dev);
                CK(epx_rm_combine(buf, &ca, &co));
            } else if (op == OP_CEIL) {
                CK(epx_cuda_ht_ceiling(buf, ht, &a.hidden, stream));
            } else {
                CK(cudaMemcpyAsync(dcopy, dtok, (size_t)(real * H) * 2, cudaMemcpyDeviceToDevice, stream));
            }
            cudaEventRecord(e1, stream);
            if (cudaEventSynchronize(e1) != cudaSuccess) return 1;
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            samples[it] = ms * 1000.0;
        }
        CK(epx_get_async_error(comm));
        qsort(samples + warm, (size_t)n, sizeof(double), cmp_double);
        res->us[op] = samples[warm + n / 2];
    }
    free(samples);
    res->rows_perm = real;
    res->rows_sent = (double)rows_sent;
    res->ok = 1;
    CK(epx_comm_barrier(comm));
    CK(epx_handle_destroy(handle));
    CK(epx_handle_destroy(ht));
    CK(epx_buffer_destroy(buf));
    CK(epx_comm_destroy(comm));
    return 0;
}

int main(int argc, char **argv)
{
    opts_t o = {8, 8, 8, 1, 0, 20, 4096, 7168};
    int c;
    while ((c = getopt(argc, argv, "r:t:H:k:L:p:s:n:h")) != -1) {
        switch (c) {
        case 'r': o.R = atoi(optarg); break;
        case 't': o.T = atoll(optarg); break;
        case 'H': o.H = atoll(optarg); break;
        case 'k': o.K = atoi(optarg); break;
        case 'L': o.L = atoi(optarg); break;
        case 'p': o.pad = atoi(optarg); break;
        case 's': o.sms = atoi(optarg); break;
        case 'n': o.iters = atoi(optarg); break;
        default:
            fprintf(stderr,
                    "usage: epx-rm-bench [-r R] [-t T] [-H H] [-k K] [-L local experts] [-p pad] [-s sms] "
                    "[-n iters]\n");
            return c == 'h' ? 0 : 2;
        }
    }
    if (o.R < 1 || o.R > 64 || o.T < 1 || o.H < 1 || o.K < 1 || o.K > 64 || o.L < 1 || o.K > o.L * o.R ||
        o.pad < 1 || o.iters < 1) {
        fprintf(stderr, "epx-rm-bench: bad options\n");
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
        fprintf(stderr, "epx-rm-bench: a rank failed\n");
        return 1;
    }
    /* The slowest rank's medians (every rank waits for it); bytes averaged over ranks. */
    double us[OP_COUNT] = {0}, perm = 0, sent = 0;
    for (int r = 0; r < o.R; r++) {
        for (int i = 0; i < OP_COUNT; i++) us[i] = res[r].us[i] > us[i] ? res[r].us[i] : us[i];
        perm += res[r].rows_perm / o.R;
        sent += res[r].rows_sent / o.R;
    }
    const double row = (double)o.H * 2;
    printf(
        "# R %d (%d per nvlink domain, %d domains), T %lld, H %lld, top-%d, %d local experts (E %d), pad %d, "
        "%d iterations, bf16\n",
        o.R, res[0].D, res[0].domains, (long long)o.T, (long long)o.H, o.K, o.L, o.L * o.R, o.pad, o.iters);
    if (o.R == 1 && o.sms == 0) printf("# one rank: routing-map kernels on all %d SMs\n", res[0].sms);
    printf("%-28s %10s %10s %s\n", "operation", "us", "GB/s", "bytes");
    printf("%-28s %10.1f %10.1f %s\n", "dispatch with permute", us[OP_DISPATCH],
           perm * row / (us[OP_DISPATCH] * 1e3), "permuted rows written per rank");
    printf("%-28s %10.1f %10.1f %s\n", "combine with unpermute", us[OP_COMBINE],
           perm * row / (us[OP_COMBINE] * 1e3), "permuted rows read per rank");
    if (o.R > 1)
        printf("%-28s %10.1f %10.1f %s\n", "ceiling: ht plain copy", us[OP_CEIL],
               sent * row / (us[OP_CEIL] * 1e3), "token rows sent per rank (once per rank)");
    printf("%-28s %10.1f %10.1f %s\n", "ceiling: local device copy", us[OP_COPY],
           perm * row / (us[OP_COPY] * 1e3), "permuted bytes, read + write not doubled");
    printf("ratios: dispatch / local copy %.2f, combine / local copy %.2f\n", us[OP_DISPATCH] / us[OP_COPY],
           us[OP_COMBINE] / us[OP_COPY]);
    return 0;
}
