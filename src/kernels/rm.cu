/*
 * Routing-map dispatch (with or without fused permute) and its combine on the cuda backend.
 * The sender scans its bool routing map per 32-token tile (rows by ballot prefix, never atomics,
 * so every order is the pinned one), writes each token once per destination rank into the
 * receiver's [source][row] slice with the token's local expert ids and their rows among the
 * source's tokens of that expert. The receiver's copy-out writes every row straight to its
 * final place: HT order, or its expert group(s) of the padded permuted layout. Combine pushes
 * rows back into the source's area, the source reduces in fp32 in the pinned order.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/sync.cuh"

#define RM_THREADS      512
#define RM_WARPS        (RM_THREADS / 32)
#define RM_UNROLL       4
#define RM_MAX_TOPK     64
#define RM_RES_MISMATCH 9 /* EPX_ERR_MISMATCH */

static __device__ __forceinline__ unsigned rm_lanemask_lt(void)
{
    unsigned m;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
    return m;
}

/* Copies `bytes` from src to each of n destinations (src == NULL: zeros), reading every 16-byte
 * vector once. */
static __device__ __forceinline__ void rm_copy(const uint8_t *src, uint8_t *const *dst, int n, int64_t bytes,
                                               int lane)
{
    if (n == 0) return;
    uintptr_t align = (uintptr_t)src;
    for (int d = 0; d < n; d++) align |= (uintptr_t)dst[d];
    if ((bytes & 15) == 0 && (align & 15) == 0) {
        const int4 *s = (const int4 *)src;
        const int64_t n16 = bytes >> 4;
        for (int64_t i = lane; i < n16; i += 32 * RM_UNROLL) {
            int4 v[RM_UNROLL];
#pragma unroll
            for (int u = 0; u < RM_UNROLL; u++)
                if (i + u * 32 < n16) v[u] = s ? ld_nc_v4(s + i + u * 32) : make_int4(0, 0, 0, 0);
            for (int d = 0; d < n; d++) {
                int4 *o = (int4 *)dst[d];
#pragma unroll
                for (int u = 0; u < RM_UNROLL; u++)
                    if (i + u * 32 < n16) st_na_v4(o + i + u * 32, v[u]);
            }
        }
    } else {
        for (int64_t i = lane; i < bytes; i += 32) {
            const uint8_t v = src ? src[i] : 0;
            for (int d = 0; d < n; d++) dst[d][i] = v;
        }
    }
}

static __device__ __forceinline__ int64_t rm_tiles(int64_t T)
{
    return (T + 31) / 32;
}

/* Scratch of the owner: tile counts [tiles][E + R] (turned into exclusive bases), then totals
 * [E + R] at row T_max/32 + 1 - 1. */
static __device__ __forceinline__ int32_t *rm_scratch(const epx_cuda_common_t *c)
{
    return (int32_t *)(c->peers[c->rank] + c->lay.rm_scratch);
}
static __device__ __forceinline__ int32_t *rm_totals(const epx_cuda_common_t *c, int E)
{
    return rm_scratch(c) + rm_tiles(c->max_tokens) * (int64_t)(E + c->nranks);
}

/* ------------------------------------------------------------------------ sender scan ---- */

/* One warp per tile of 32 tokens, lane = token: experts in ascending order (the first K selected
 * ones), each with its row among the tile's tokens of that expert; ranks likewise. */
__global__ void __launch_bounds__(RM_THREADS) rm_scan_kernel(const __grid_constant__ epx_cuda_rm_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, L = c->num_local_experts, E = a.num_experts;
    const int lane = threadIdx.x & 31;
    const int64_t ntiles = rm_tiles(a.num_tokens), W = E + R;
    int32_t *cnt = rm_scratch(c);
    const bool word = (E & 3) == 0 && ((uintptr_t)a.routing_map & 3) == 0;
    for (int64_t tile = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; tile < ntiles;
         tile += (int64_t)gridDim.x * blockDim.x / 32) {
        const int64_t t = tile * 32 + lane;
        const bool live = t < a.num_tokens;
        const uint8_t *row = a.routing_map + (live ? t : 0) * E;
        int nsel = 0;
        uint64_t rmask = 0;
        for (int e0 = 0; e0 < E; e0 += 4) {
            uint32_t bytes = 0;
            if (live) {
                if (word) {
                    bytes = *(const uint32_t *)(row + e0);
                } else {
                    for (int q = 0; q < 4 && e0 + q < E; q++) bytes |= (uint32_t)row[e0 + q] << (8 * q);
                }
            }
            for (int q = 0; q < 4 && e0 + q < E; q++) {
                const int e = e0 + q;
                const bool v = ((bytes >> (8 * q)) & 0xffu) != 0 && nsel < K;
                const unsigned b = __ballot_sync(0xffffffffu, v);
                if (lane == 0) cnt[tile * W + e] = __popc(b);
                if (v) {
                    a.h.src_sel[t * K + nsel] = e;
                    a.h.src_within[t * K + nsel] = __popc(b & rm_lanemask_lt());
                    a.h.src_prob[t * K + nsel] = a.probs ? a.probs[t * E + e] : 0.0f;
                    rmask |= 1ull << (e / L);
                    nsel++;
                }
            }
        }
        if (live)
            for (int k = nsel; k < K; k++) {
                a.h.src_sel[t * K + k] = -1;
                a.h.src_within[t * K + k] = 0;
                a.h.src_prob[t * K + k] = 0.0f;
            }
        for (int r = 0; r < R; r++) {
            const bool v = (rmask >> r) & 1;
            const unsigned b = __ballot_sync(0xffffffffu, v);
            if (lane == 0) cnt[tile * W + E + r] = __popc(b);
            if (live) a.h.send_row[t * R + r] = v ? __popc(b & rm_lanemask_lt()) : -1;
        }
    }
}

/* One block: per column (expert, then rank) the exclusive prefix over tiles, and the totals. */
__global__ void __launch_bounds__(1024) rm_prefix_kernel(const __grid_constant__ epx_cuda_rm_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int64_t W = a.num_experts + c->nranks, ntiles = rm_tiles(a.num_tokens);
    int32_t *cnt = rm_scratch(c), *tot = rm_totals(c, a.num_experts);
    for (int64_t col = threadIdx.x; col < W; col += blockDim.x) {
        int32_t run = 0;
        for (int64_t tile = 0; tile < ntiles; tile++) {
            const int32_t v = cnt[tile * W + col];
            cnt[tile * W + col] = run;
            run += v;
        }
        tot[col] = run;
    }
}

/* Sender. Prologue: every receiver released our slice (previous dispatch). Then one warp per
 * token writes metadata and the row into each destination's slice; the last block publishes
 * the per-expert counts, the signature and the row count, then the epoch. */
__global__ void __launch_bounds__(RM_THREADS) rm_send_kernel(const __grid_constant__ epx_cuda_rm_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, L = c->num_local_experts, E = a.num_experts, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t W = E + R;
    epx_cuda_ctrl_t *own = ctrl_of(c->peers[me]);
    const uint64_t epoch = ld_volatile_u64(&own->epoch) + 1;
    const uint64_t prev = ld_volatile_u64(&own->disp_last);
    const int32_t *base = rm_scratch(c);
    __shared__ int ok;
    __shared__ int dst_rank[RM_WARPS][EPX_CUDA_MAX_RANKS];
    __shared__ uint8_t *dst_ptr[RM_WARPS][EPX_CUDA_MAX_RANKS];
    __shared__ int64_t dst_slot[RM_WARPS][EPX_CUDA_MAX_RANKS];
    if (threadIdx.x == 0) ok = 1;
    __syncthreads();
    if (threadIdx.x < R &&
        !wait_flag_geq(c, &own->disp_ack[threadIdx.x], prev, epoch, threadIdx.x, EPX_CUDA_WAIT_DISPATCH_ACK))
        ok = 0;
    __syncthreads();
    const int ns = a.scales ? a.num_scales : 0;
    if (ok) {
        for (int64_t t = (int64_t)blockIdx.x * RM_WARPS + warp; t < a.num_tokens;
             t += (int64_t)gridDim.x * RM_WARPS) {
            const int64_t tile = t / 32;
            int n = 0;
            for (int r0 = 0; r0 < R; r0 += 32) {
                const int r = r0 + lane;
                const int row = r < R ? a.h.send_row[t * R + r] : -1;
                const unsigned b = __ballot_sync(0xffffffffu, row >= 0);
                if (row >= 0) {
                    const int pos = n + __popc(b & rm_lanemask_lt());
                    const int64_t slot = (int64_t)me * c->max_tokens + row + base[tile * W + E + r];
                    dst_rank[warp][pos] = r;
                    dst_slot[warp][pos] = slot;
                    dst_ptr[warp][pos] = c->peers[r] + c->lay.disp_x + slot * c->lay.x_stride;
                }
                n += __popc(b);
            }
            __syncwarp();
            for (int d = 0; d < n; d++) {
                const int r = dst_rank[warp][d];
                const int64_t slot = dst_slot[warp][d];
                uint8_t *peer = c->peers[r];
                for (int k = lane; k < K; k += 32) {
                    const int e = a.h.src_sel[t * K + k];
                    const bool here = e >= 0 && e / L == r;
                    ((int32_t *)(peer + c->lay.disp_idx))[slot * K + k] = here ? e % L : -1;
                    ((float *)(peer + c->lay.disp_w))[slot * K + k] = here ? a.h.src_prob[t * K + k] : 0.0f;
                    ((int32_t *)(peer + c->lay.rm_within))[slot * K + k] =
                        here ? a.h.src_within[t * K + k] + base[tile * W + e] : 0;
                }
                if (lane == 0) ((int32_t *)(peer + c->lay.disp_src))[slot] = (int32_t)t;
                for (int j = lane; j < ns; j += 32)
                    ((float *)(peer + c->lay.disp_scales))[slot * ns + j] = a.scales[t * ns + j];
            }
            rm_copy(a.hidden + t * a.row_bytes, dst_ptr[warp], n, a.row_bytes, lane);
            __syncwarp();
        }
    }
    if (last_block_arrive(&own->done_counter[EPX_CUDA_RM_DONE_SEND])) {
        __shared__ int good;
        if (threadIdx.x == 0) good = !epoch_failed(c, epoch);
        __syncthreads();
        const int32_t *tot = rm_totals(c, E);
        if (good) {
            for (int i = threadIdx.x; i < E; i += blockDim.x)
                ((int32_t *)(c->peers[i / L] + c->lay.rm_cnt))[me * L + i % L] = tot[i];
            if (threadIdx.x < R) ((uint64_t *)(c->peers[threadIdx.x] + c->lay.rm_sig))[me] = a.sig;
        }
        __threadfence_system();
        __syncthreads();
        if (good && threadIdx.x < R) {
            epx_cuda_ctrl_t *peer = ctrl_of(c->peers[threadIdx.x]);
            st_relaxed_sys(&peer->disp_count[me], (uint64_t)tot[E + threadIdx.x]);
            st_release_sys(&peer->disp_flag[me], epoch);
        }
    }
}

/* ---------------------------------------------------------------------- receiver ---- */

/* Receiver. Prologue: every source's epoch, row count and signature; per local expert the
 * padded group starts and each source's first row inside the group (dynamic shared memory).
 * Then one warp per received row copies it once to its HT row or to each of its groups; warps
 * zero padding rows and rows past the real count. The last block writes counts, the handle's
 * totals, releases every source's slice and closes the epoch. */
__global__ void __launch_bounds__(RM_THREADS) rm_recv_kernel(const __grid_constant__ epx_cuda_rm_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, L = c->num_local_experts, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint8_t *region = c->peers[me];
    epx_cuda_ctrl_t *own = ctrl_of(region);
    const uint64_t epoch = ld_volatile_u64(&own->epoch) + 1;
    extern __shared__ int rm_smem[];
    int *gb = rm_smem;      /* [L + 1] padded group starts */
    int *cntj = gb + L + 1; /* [L] real rows per group */
    int *sb = cntj + L;     /* [R][L] first row of source s in group j */
    __shared__ int ok;
    __shared__ int prefix[EPX_CUDA_MAX_RANKS + 1];
    __shared__ int cnt[EPX_CUDA_MAX_RANKS];
    __shared__ uint8_t *dst_ptr[RM_WARPS][RM_MAX_TOPK];
    __shared__ int64_t dst_row[RM_WARPS][RM_MAX_TOPK];
    __shared__ float dst_w[RM_WARPS][RM_MAX_TOPK];
    if (threadIdx.x == 0) ok = 1;
    __syncthreads();
    if (threadIdx.x < R) {
        const int s = threadIdx.x;
        if (wait_flag_geq(c, &own->disp_flag[s], epoch, epoch, s, EPX_CUDA_WAIT_DISPATCH_DATA)) {
            cnt[s] = (int)ld_volatile_u64(&own->disp_count[s]);
            const uint64_t sig = ld_volatile_u64((const uint64_t *)(region + c->lay.rm_sig) + s);
            if (sig != a.sig) {
                record_error(c, epoch, RM_RES_MISMATCH, s, EPX_CUDA_WAIT_DISPATCH_DATA, sig, a.sig);
                ok = 0;
            }
        } else {
            ok = 0;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        prefix[0] = 0;
        for (int r = 0; r < R; r++) prefix[r + 1] = prefix[r] + (ok ? cnt[r] : 0);
    }
    if (a.permute) {
        const int32_t *rc = (const int32_t *)(region + c->lay.rm_cnt);
        for (int j = threadIdx.x; j < L; j += blockDim.x) {
            int run = 0;
            for (int s = 0; s < R; s++) {
                sb[s * L + j] = run;
                run += ok ? ld_volatile_i32(&rc[s * L + j]) : 0;
            }
            cntj[j] = run;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            const int pad = a.pad_multiple > 1 ? a.pad_multiple : 1;
            gb[0] = 0;
            for (int j = 0; j < L; j++) gb[j + 1] = gb[j] + (cntj[j] + pad - 1) / pad * pad;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < R * L; i += blockDim.x) sb[i] += gb[i % L];
    }
    __syncthreads();
    const int64_t total = prefix[R];
    const int64_t real = a.permute ? gb[L] : total;
    /* Without a bound the outputs must hold every row, else nothing is written (the host
     * reports it); with one, rows past it are dropped. */
    const bool writable = ok && (a.bounded || real <= a.limit);
    const int64_t lim = writable ? a.limit : 0;
    const int ns = a.out_scales ? a.num_scales : 0;
    const uint8_t *dx = region + c->lay.disp_x;
    const float *dscales = (const float *)(region + c->lay.disp_scales);
    const int32_t *didx = (const int32_t *)(region + c->lay.disp_idx);
    const float *dw = (const float *)(region + c->lay.disp_w);
    const int32_t *dwithin = (const int32_t *)(region + c->lay.rm_within);
    const int32_t *dsrc = (const int32_t *)(region + c->lay.disp_src);
    const int64_t nrows = ok ? total : 0;
    for (int64_t i = (int64_t)blockIdx.x * RM_WARPS + warp; i < nrows; i += (int64_t)gridDim.x * RM_WARPS) {
        int s = 0;
        while (s + 1 < R && prefix[s + 1] <= i) s++;
        const int64_t slot = (int64_t)s * c->max_tokens + (i - prefix[s]);
        const uint8_t *src = dx + slot * c->lay.x_stride;
        if (lane == 0) a.h.recv_src[i] = dsrc[slot];
        if (!a.permute) {
            if (i >= lim) continue;
            uint8_t *dst = a.tokens + i * a.row_bytes;
            rm_copy(src, &dst, 1, a.row_bytes, lane);
            for (int j = lane; j < ns; j += 32) a.out_scales[i * ns + j] = dscales[slot * ns + j];
            if (a.out_probs)
                for (int j = lane; j < L; j += 32) {
                    float p = 0.0f;
                    for (int k = 0; k < K; k++)
                        if (didx[slot * K + k] == j) p = dw[slot * K + k];
                    a.out_probs[i * L + j] = p;
                }
            continue;
        }
        int n = 0;
        for (int k0 = 0; k0 < K; k0 += 32) {
            const int k = k0 + lane;
            const int loc = k < K ? didx[slot * K + k] : -1;
            int64_t row = -1;
            if (loc >= 0) row = (int64_t)sb[s * L + loc] + dwithin[slot * K + k];
            const bool keep = loc >= 0 && row < lim;
            if (k < K) a.h.perm_row[i * K + k] = loc < 0 ? -1 : (keep ? (int32_t)row : EPX_CUDA_RM_DROPPED);
            const unsigned b = __ballot_sync(0xffffffffu, keep);
            if (keep) {
                const int pos = n + __popc(b & rm_lanemask_lt());
                dst_ptr[warp][pos] = a.tokens + row * a.row_bytes;
                dst_row[warp][pos] = row;
                dst_w[warp][pos] = dw[slot * K + k];
            }
            n += __popc(b);
        }
        __syncwarp();
        rm_copy(src, dst_ptr[warp], n, a.row_bytes, lane);
        for (int d = 0; d < n; d++) {
            const int64_t row = dst_row[warp][d];
            for (int j = lane; j < ns; j += 32) a.out_scales[row * ns + j] = dscales[slot * ns + j];
            if (a.out_probs && lane == 0) a.out_probs[row] = dst_w[warp][d];
        }
        __syncwarp();
    }
    /* Zero rows: padding inside the groups and, with a bound, everything between the real count
     * and the bound (without one, rows past the real count are left alone). */
    const int pw = a.permute ? 1 : L;
    const int64_t zlim = a.bounded || real > lim ? lim : real;
    for (int64_t r0 = ((int64_t)blockIdx.x * RM_WARPS + warp) * 32; r0 < zlim;
         r0 += (int64_t)gridDim.x * RM_WARPS * 32) {
        const int64_t r = r0 + lane;
        bool zero = false;
        if (r < zlim) {
            if (r >= real) {
                zero = true;
            } else if (a.permute) {
                int lo = 0, hi = L - 1; /* last group with gb[j] <= r */
                while (lo < hi) {
                    const int mid = (lo + hi + 1) / 2;
                    if (gb[mid] <= r)
                        lo = mid;
                    else
                        hi = mid - 1;
                }
                zero = r - gb[lo] >= cntj[lo];
            }
        }
        unsigned b = __ballot_sync(0xffffffffu, zero);
        while (b) {
            const int q = __ffs(b) - 1;
            b &= b - 1;
            const int64_t row = r0 + q;
            uint8_t *dst = a.tokens + row * a.row_bytes;
            rm_copy(NULL, &dst, 1, a.row_bytes, lane);
            for (int j = lane; j < ns; j += 32) a.out_scales[row * ns + j] = 0.0f;
            if (a.out_probs)
                for (int j = lane; j < pw; j += 32) a.out_probs[row * pw + j] = 0.0f;
        }
    }
    if (last_block_arrive(&own->done_counter[EPX_CUDA_RM_DONE_RECV])) {
        if (threadIdx.x == 0) {
            c->host->num_recv = ok ? real : -1;
            if (ok && a.bounded && real > a.limit) c->host->overflow = 1;
            if (writable && a.num_tokens_out) *a.num_tokens_out = (int32_t)real;
            a.h.meta[0] = (int32_t)nrows;
            a.h.meta[1] = (int32_t)(nrows < lim ? nrows : lim);
        }
        for (int r = threadIdx.x; r <= R; r += blockDim.x) a.h.recv_prefix[r] = ok ? prefix[r] : 0;
        if (writable && a.permute && a.tokens_per_expert)
            for (int j = threadIdx.x; j < L; j += blockDim.x) a.tokens_per_expert[j] = gb[j + 1] - gb[j];
        __syncthreads();
        if (threadIdx.x < R) st_release_sys(&ctrl_of(c->peers[threadIdx.x])->disp_ack[me], epoch);
        if (threadIdx.x == 0) {
            own->disp_last = epoch;
            own->epoch = epoch;
            __threadfence_system();
        }
    }
}

static size_t rm_recv_smem(const epx_cuda_rm_args_t *a)
{
    const size_t L = (size_t)a->c.num_local_experts, R = (size_t)a->c.nranks;
    return (2 * L + 1 + R * L) * sizeof(int);
}

extern "C" int epx_cuda_launch_rm_dispatch(const epx_cuda_rm_args_t *args, void *stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    const int nb = args->c.num_blocks;
    rm_scan_kernel<<<nb, RM_THREADS, 0, s>>>(*args);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return (int)err;
    rm_prefix_kernel<<<1, 1024, 0, s>>>(*args);
    if ((err = cudaGetLastError()) != cudaSuccess) return (int)err;
    rm_send_kernel<<<nb, RM_THREADS, 0, s>>>(*args);
    if ((err = cudaGetLastError()) != cudaSuccess) return (int)err;
    const size_t smem = rm_recv_smem(args);
    /* The 48 KB that need no opt-in cover static and dynamic shared memory together. */
    cudaFuncAttributes fa;
    if ((err = cudaFuncGetAttributes(&fa, rm_recv_kernel)) != cudaSuccess) return (int)err;
    if (smem + fa.sharedSizeBytes > 48 * 1024) {
        err = cudaFuncSetAttribute(rm_recv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (err != cudaSuccess) return (int)err;
    }
    rm_recv_kernel<<<nb, RM_THREADS, smem, s>>>(*args);
    return (int)cudaGetLastError();
}

/* ----------------------------------------------------------------------- combine ---- */

/* Sender of combine (the rank holding rows): after each source released its combine area, one
 * warp per received row writes it back into the source's area: [me][token] without permute,
 * [token][k] with (k = the expert's place in the token's selection). A row dropped by the bound
 * goes back as zeros: adding +0 leaves the fp32 sum unchanged, so it contributes nothing. */
__global__ void __launch_bounds__(RM_THREADS)
    rm_comb_send_kernel(const __grid_constant__ epx_cuda_rm_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    epx_cuda_ctrl_t *own = ctrl_of(c->peers[me]);
    const uint64_t epoch = ld_volatile_u64(&own->epoch) + 1;
    const uint64_t prev = ld_volatile_u64(&own->comb_last);
    const int64_t row_bytes = c->hidden * 2;
    __shared__ int ok;
    __shared__ int prefix[EPX_CUDA_MAX_RANKS + 1];
    if (threadIdx.x == 0) ok = 1;
    for (int r = threadIdx.x; r <= R; r += blockDim.x) prefix[r] = a.h.recv_prefix[r];
    __syncthreads();
    if (threadIdx.x < R &&
        !wait_flag_geq(c, &own->comb_ack[threadIdx.x], prev, epoch, threadIdx.x, EPX_CUDA_WAIT_COMBINE_ACK))
        ok = 0;
    __syncthreads();
    const int64_t rows = ok ? a.h.meta[0] : 0, kept = a.h.meta[1];
    for (int64_t i = (int64_t)blockIdx.x * RM_WARPS + warp; i < rows; i += (int64_t)gridDim.x * RM_WARPS) {
        int s = 0;
        while (s + 1 < R && prefix[s + 1] <= i) s++;
        const int64_t t = a.h.recv_src[i];
        uint8_t *peer = c->peers[s];
        if (!a.permute) {
            uint8_t *dst = peer + c->lay.comb_x + ((int64_t)me * c->max_tokens + t) * row_bytes;
            rm_copy(i < kept ? (const uint8_t *)(a.x + i * c->hidden) : NULL, &dst, 1, row_bytes, lane);
            continue;
        }
        for (int k = 0; k < K; k++) {
            const int32_t pr = a.h.perm_row[i * K + k];
            if (pr == -1) continue;
            uint8_t *dst = peer + c->lay.rm_comb + (t * K + k) * row_bytes;
            rm_copy(pr >= 0 ? (const uint8_t *)(a.x + (int64_t)pr * c->hidden) : NULL, &dst, 1, row_bytes,
                    lane);
        }
    }
    if (last_block_arrive(&own->done_counter[EPX_CUDA_RM_DONE_COMB_SEND])) {
        if (!epoch_failed(c, epoch) && threadIdx.x < R)
            st_release_sys(&ctrl_of(c->peers[threadIdx.x])->comb_flag[me], epoch);
    }
}

static __device__ __forceinline__ uint32_t rm_f32_to_bf16(float f)
{
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x40u) & 0xffffu;
    return ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & 0xffffu;
}

/* acc += w * y (weighted) or acc += y for 8 bf16 channels, rounding each step (no fma). */
static __device__ __forceinline__ void rm_acc8(float *acc, int4 v, bool weighted, float w)
{
    const uint32_t q[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float lo = __uint_as_float(q[i] << 16), hi = __uint_as_float(q[i] & 0xffff0000u);
        acc[2 * i] = __fadd_rn(acc[2 * i], weighted ? __fmul_rn(w, lo) : lo);
        acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], weighted ? __fmul_rn(w, hi) : hi);
    }
}

/* Source side: wait for every rank's rows, then one warp per token sums its rows in one fp32
 * accumulator: ranks ascending (without permute) or the token's experts ascending, which is
 * ranks then local experts ascending (with permute); one rounding to bf16. */
__global__ void __launch_bounds__(RM_THREADS)
    rm_comb_reduce_kernel(const __grid_constant__ epx_cuda_rm_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint8_t *region = c->peers[me];
    epx_cuda_ctrl_t *own = ctrl_of(region);
    const uint64_t epoch = ld_volatile_u64(&own->epoch) + 1;
    const int64_t H = c->hidden;
    __shared__ int ok;
    __shared__ const uint16_t
        *src_row[RM_WARPS][RM_MAX_TOPK > EPX_CUDA_MAX_RANKS ? RM_MAX_TOPK : EPX_CUDA_MAX_RANKS];
    __shared__ float src_w[RM_WARPS][RM_MAX_TOPK];
    if (threadIdx.x == 0) ok = 1;
    __syncthreads();
    if (threadIdx.x < R && !wait_flag_geq(c, &own->comb_flag[threadIdx.x], epoch, epoch, threadIdx.x,
                                          EPX_CUDA_WAIT_COMBINE_DATA))
        ok = 0;
    __syncthreads();
    const uint16_t *comb = (const uint16_t *)(region + c->lay.comb_x);
    const uint16_t *pcomb = (const uint16_t *)(region + c->lay.rm_comb);
    const int64_t T = ok ? a.num_tokens : 0;
    const bool weighted = a.permute && a.weighted;
    for (int64_t t = (int64_t)blockIdx.x * RM_WARPS + warp; t < T; t += (int64_t)gridDim.x * RM_WARPS) {
        int n = 0;
        if (!a.permute) {
            for (int r0 = 0; r0 < R; r0 += 32) {
                const int r = r0 + lane;
                const bool in = r < R && a.h.send_row[t * R + r] >= 0;
                const unsigned b = __ballot_sync(0xffffffffu, in);
                if (in)
                    src_row[warp][n + __popc(b & rm_lanemask_lt())] =
                        comb + ((int64_t)r * c->max_tokens + t) * H;
                n += __popc(b);
            }
        } else {
            for (int k0 = 0; k0 < K; k0 += 32) {
                const int k = k0 + lane;
                const bool in = k < K && a.h.src_sel[t * K + k] >= 0;
                const unsigned b = __ballot_sync(0xffffffffu, in);
                if (in) {
                    const int pos = n + __popc(b & rm_lanemask_lt());
                    src_row[warp][pos] = pcomb + (t * K + k) * H;
                    src_w[warp][pos] = a.h.src_prob[t * K + k];
                }
                n += __popc(b);
            }
        }
        __syncwarp();
        if ((H & 7) == 0) {
            for (int64_t i = lane; i < H / 8; i += 32) {
                float acc[8];
#pragma unroll
                for (int q = 0; q < 8; q++) acc[q] = 0.0f;
                for (int d = 0; d < n; d++)
                    rm_acc8(acc, ld_nc_v4((const int4 *)src_row[warp][d] + i), weighted,
                            weighted ? src_w[warp][d] : 0.0f);
                int4 o;
                o.x = (int)(rm_f32_to_bf16(acc[0]) | (rm_f32_to_bf16(acc[1]) << 16));
                o.y = (int)(rm_f32_to_bf16(acc[2]) | (rm_f32_to_bf16(acc[3]) << 16));
                o.z = (int)(rm_f32_to_bf16(acc[4]) | (rm_f32_to_bf16(acc[5]) << 16));
                o.w = (int)(rm_f32_to_bf16(acc[6]) | (rm_f32_to_bf16(acc[7]) << 16));
                st_na_v4((int4 *)(a.combined + t * H) + i, o);
            }
        } else {
            for (int64_t h = lane; h < H; h += 32) {
                float acc = 0.0f;
                for (int d = 0; d < n; d++) {
                    const float y = __uint_as_float((uint32_t)src_row[warp][d][h] << 16);
                    acc = __fadd_rn(acc, weighted ? __fmul_rn(src_w[warp][d], y) : y);
                }
                a.combined[t * H + h] = (uint16_t)rm_f32_to_bf16(acc);
            }
        }
        __syncwarp();
    }
    if (last_block_arrive(&own->done_counter[EPX_CUDA_RM_DONE_COMB_REDUCE])) {
        if (threadIdx.x < R) st_release_sys(&ctrl_of(c->peers[threadIdx.x])->comb_ack[me], epoch);
        if (threadIdx.x == 0) {
            own->comb_last = epoch;
            own->epoch = epoch;
            __threadfence_system();
        }
    }
}

extern "C" int epx_cuda_launch_rm_combine(const epx_cuda_rm_args_t *args, void *stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    rm_comb_send_kernel<<<args->c.num_blocks, RM_THREADS, 0, s>>>(*args);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return (int)err;
    rm_comb_reduce_kernel<<<args->c.num_blocks, RM_THREADS, 0, s>>>(*args);
    return (int)cudaGetLastError();
}
