/*
 * The kernels outside any data path: the dispatch layout (notify: per-rank rows, counts per rank,
 * expert and domain, from topk_idx) and the failure release a rank runs instead of a collective
 * it skipped, for every family's areas.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/common.cuh"

/* One block walks tiles of kLayoutThreads tokens, thread = token: it checks the token's ids and counts
 * them; per rank a warp ballot says which of the warp's tokens go there, one warp per rank scans the
 * warps' counts (a prefix over the warps), and each warp then writes its tokens' rows in the rank's slice (prefix over
 * is_token_in_rank, so rows come out in ascending token order) and is_token_in_rank, lanes over
 * consecutive [token][rank] elements (coalesced stores). A bad id reads as -1; inside a dispatch it goes
 * to the handle's bad word (the dispatch then fails on the device), in a standalone layout every count
 * output becomes -1. */
constexpr int kLayoutThreads = 1024;
constexpr int kLayoutWarps = kLayoutThreads / 32;
static_assert(kLayoutWarps == 32, "the rank prefix scans one warp count per lane");
/* Top-k widths up to this keep a row's ids in registers (checked for repeats there); wider ones read
 * global memory for each check. */
constexpr int kLayoutStageK = 8;
/* Experts counted in shared memory (written once at the end) when E is at most this. */
constexpr int kLayoutHist = 4096;

__global__ void __launch_bounds__(kLayoutThreads)
    layout_kernel(const __grid_constant__ epx_cuda_layout_args_t a)
{
    const int R = a.nranks, K = a.num_topk, L = a.num_local_experts, E = a.num_experts;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int D = a.ranks_per_domain > 0 ? a.ranks_per_domain : R;
    /* The warp's count, then its base (a padded row: the scan reads a column without bank conflicts). */
    __shared__ int warp_cnt[kLayoutWarps][EPX_CUDA_MAX_RANKS + 1];
    __shared__ uint32_t warp_ball[kLayoutWarps][EPX_CUDA_MAX_RANKS]; /* the warp's lanes going to rank r */
    __shared__ int base[EPX_CUDA_MAX_RANKS];
    __shared__ int dom_cnt[EPX_CUDA_MAX_RANKS];
    __shared__ int hist[kLayoutHist];
    const bool stage = K <= kLayoutStageK;
    const bool smem_hist = a.num_tokens_per_expert && E <= kLayoutHist;
    for (int i = threadIdx.x; i < R; i += blockDim.x) {
        base[i] = 0;
        dom_cnt[i] = 0;
    }
    if (smem_hist)
        for (int i = threadIdx.x; i < E; i += blockDim.x) hist[i] = 0;
    else if (a.num_tokens_per_expert)
        for (int i = threadIdx.x; i < E; i += blockDim.x) a.num_tokens_per_expert[i] = 0;
    if (a.bad && threadIdx.x == 0) a.bad[0] = 0; /* one block: cleared before any thread checks */
    __syncthreads();
    bool saw_bad = false;
    for (int64_t tile = 0; tile < a.num_tokens; tile += blockDim.x) {
        const int64_t t = tile + threadIdx.x;
        uint64_t mask = 0;
        /* A good id: its rank joins the token's mask, its expert's count grows. */
        auto take = [&](int64_t e) {
            mask |= 1ull << ((int)e / L);
            if (smem_hist)
                atomicAdd(&hist[e], 1);
            else if (a.num_tokens_per_expert)
                atomicAdd(&a.num_tokens_per_expert[e], 1);
        };
        if (t < a.num_tokens) {
            if (stage) {
                /* The row's ids, all loads in flight together (one block has few warps to hide their
                 * latency with); an id outside [-1, E) reads as -2. */
                int32_t ids[kLayoutStageK];
#pragma unroll
                for (int k = 0; k < kLayoutStageK; k++) {
                    const int64_t v = k < K ? topk_at(a.topk_idx, a.idx_is_64, t * K + k) : -1;
                    ids[k] = v < -1 || v >= E ? -2 : (int32_t)v;
                }
#pragma unroll
                for (int k = 0; k < kLayoutStageK; k++) {
                    if (k >= K) break;
                    const int32_t v = ids[k];
                    bool bad = v == -2;
#pragma unroll
                    for (int j = 0; j < kLayoutStageK; j++)
                        if (j < k && v >= 0 && ids[j] == v) bad = true;
                    int64_t e = v;
                    /* A bad id is checked again on the caller's tensor, which reports it. */
                    if (bad) e = topk_checked(a.topk_idx, a.idx_is_64, t, K, k, E, a.host, a.bad);
                    if (e >= 0)
                        take(e);
                    else
                        saw_bad |= bad;
                }
            } else {
                for (int k = 0; k < K; k++) {
                    const int64_t e = topk_checked(a.topk_idx, a.idx_is_64, t, K, k, E, a.host, a.bad);
                    if (e >= 0)
                        take(e);
                    else
                        saw_bad |= topk_at(a.topk_idx, a.idx_is_64, t * K + k) != -1;
                }
            }
            if (a.num_tokens_per_domain)
                for (int d = 0; d < R / D; d++)
                    if ((mask >> (d * D)) & (D == 64 ? ~0ull : ((1ull << D) - 1))) atomicAdd(&dom_cnt[d], 1);
        }
        for (int r = 0; r < R; r++) {
            const unsigned b = __ballot_sync(kFullMask, (mask >> r) & 1);
            if (lane == 0) {
                warp_ball[warp][r] = b;
                warp_cnt[warp][r] = __popc(b);
            }
        }
        __syncthreads();
        /* Rank r's prefix over the warps: warp r % kLayoutWarps scans it, lane w holding warp w's count. */
        for (int r = warp; r < R; r += kLayoutWarps) {
            const int cnt = warp_cnt[lane][r];
            int incl = cnt;
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const int up = __shfl_up_sync(kFullMask, incl, d);
                if (lane >= d) incl += up;
            }
            const int run = base[r];
            warp_cnt[lane][r] = run + incl - cnt;
            __syncwarp();
            if (lane == 31) base[r] = run + incl;
        }
        __syncthreads();
        /* The warp's 32 tokens x R elements of send_row and is_token_in_rank, lane by lane. */
        const int64_t first = tile + (int64_t)warp * 32;
        for (int i = lane; i < 32 * R; i += 32) {
            const int tok = i / R, r = i - tok * R;
            if (first + tok >= a.num_tokens) break;
            const uint32_t b = warp_ball[warp][r];
            const bool in = (b >> tok) & 1;
            if (a.send_row)
                a.send_row[(first + tok) * R + r] =
                    in ? warp_cnt[warp][r] + __popc(b & ((1u << tok) - 1u)) : -1;
            if (a.is_token_in_rank) a.is_token_in_rank[(first + tok) * R + r] = (uint8_t)in;
        }
        __syncthreads();
    }
    const bool poison = __syncthreads_or(saw_bad) && !a.bad;
    for (int r = threadIdx.x; r < R; r += blockDim.x)
        if (a.num_tokens_per_rank) a.num_tokens_per_rank[r] = poison ? -1 : base[r];
    if (a.num_tokens_per_domain)
        for (int d = threadIdx.x; d < R / D; d += blockDim.x)
            a.num_tokens_per_domain[d] = poison ? -1 : dom_cnt[d];
    if (a.num_tokens_per_expert && (poison || smem_hist))
        for (int i = threadIdx.x; i < E; i += blockDim.x) a.num_tokens_per_expert[i] = poison ? -1 : hist[i];
}

extern "C" int epx_cuda_launch_layout(const epx_cuda_layout_args_t *args, void *stream)
{
    return launch_kernel(layout_kernel, *args, 1, kLayoutThreads, 0, stream);
}

/* ----------------------------------------------------------------------------- failure ---- */

/* This rank skipped collective `epoch`: thread r tells peer r (it returns EPX_ERR_REMOTE) and
 * releases our slices of its areas as if consumed; thread 0 closes the epoch. */
__global__ void fail_kernel(const __grid_constant__ epx_cuda_common_t c)
{
    epx_cuda_ctrl_t *own = peer_ctrl(&c, c.rank);
    const uint64_t epoch = ld_volatile_u64(&own->epoch) + 1;
    if ((int)threadIdx.x < c.nranks && c.peers[threadIdx.x]) { /* across nodes only our own is mapped */
        epx_cuda_ctrl_t *peer = peer_ctrl(&c, threadIdx.x);
        st_release_sys(&peer->fail[c.rank], epoch);
        st_release_sys(&peer->disp_ack[c.rank], epoch);
        st_release_sys(&peer->comb_ack[c.rank], epoch);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        own->epoch = epoch;
        __threadfence_system();
    }
}

extern "C" int epx_cuda_launch_fail(const epx_cuda_common_t *c, void *stream)
{
    return launch_kernel(fail_kernel, *c, 1, EPX_CUDA_MAX_RANKS, 0, stream);
}
