/*
 * The kernels outside any data path: the dispatch layout (notify: per-rank rows, counts per rank,
 * expert and domain, from topk_idx) and the failure release a rank runs instead of a collective
 * it skipped, for every family's areas.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/common.cuh"

/* One block walks tiles of blockDim tokens, thread = token: it checks the token's ids and counts
 * them; per rank a warp ballot counts the tile's tokens going there, threads r < R prefix those
 * counts over the warps, and each token gets its row in the rank's slice (prefix over
 * is_token_in_rank), so rows come out in ascending token order. A bad id reads as -1; inside a
 * dispatch it goes to the handle's bad word (the dispatch then fails on the device), in a
 * standalone layout every count output becomes -1. */
/* Ids of a tile the layout stages in shared memory (up to 1024 tokens x 8: wider top-k reads global
 * memory), so that the per-id checks (a row's earlier ids, for repeats) read shared memory. */
constexpr int kLayoutStageK = 8;

__global__ void __launch_bounds__(1024) layout_kernel(const __grid_constant__ epx_cuda_layout_args_t a)
{
    const int R = a.nranks, K = a.num_topk, L = a.num_local_experts, E = a.num_experts;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const int D = a.ranks_per_domain > 0 ? a.ranks_per_domain : R;
    __shared__ int warp_cnt[32][EPX_CUDA_MAX_RANKS];
    __shared__ int base[EPX_CUDA_MAX_RANKS];
    __shared__ int dom_cnt[EPX_CUDA_MAX_RANKS];
    /* The tile's ids as int32, an id outside [-1, E) as -2 (as bad), when K <= kLayoutStageK. */
    __shared__ int32_t staged[1024 * kLayoutStageK];
    const bool stage = K <= kLayoutStageK && blockDim.x <= 1024;
    for (int i = threadIdx.x; i < R; i += blockDim.x) {
        base[i] = 0;
        dom_cnt[i] = 0;
    }
    if (a.num_tokens_per_expert)
        for (int i = threadIdx.x; i < E; i += blockDim.x) a.num_tokens_per_expert[i] = 0;
    if (a.bad && threadIdx.x == 0) a.bad[0] = 0; /* one block: cleared before any thread checks */
    __syncthreads();
    bool saw_bad = false;
    for (int64_t tile = 0; tile < a.num_tokens; tile += blockDim.x) {
        const int64_t t = tile + threadIdx.x;
        if (stage) {
            const int64_t rows = a.num_tokens - tile < (int64_t)blockDim.x ? a.num_tokens - tile : blockDim.x;
            for (int64_t i = threadIdx.x; i < rows * K; i += blockDim.x) {
                const int64_t v = topk_at(a.topk_idx, a.idx_is_64, tile * K + i);
                staged[i] = v < -1 || v >= E ? -2 : (int32_t)v;
            }
            __syncthreads();
        }
        uint64_t mask = 0;
        if (t < a.num_tokens) {
            for (int k = 0; k < K; k++) {
                /* A bad staged id is checked again on the caller's tensor, which reports it. */
                const int64_t v = stage ? staged[threadIdx.x * K + k] : 0;
                const int64_t e = stage && !topk_bad(staged, 0, threadIdx.x, K, k, E, v)
                                      ? v
                                      : topk_checked(a.topk_idx, a.idx_is_64, t, K, k, E, a.host, a.bad);
                if (e < 0) {
                    saw_bad |= (stage ? v : topk_at(a.topk_idx, a.idx_is_64, t * K + k)) != -1;
                    continue;
                }
                mask |= 1ull << (e / L);
                if (a.num_tokens_per_expert) atomicAdd(&a.num_tokens_per_expert[e], 1);
            }
            if (a.is_token_in_rank)
                for (int r = 0; r < R; r++) a.is_token_in_rank[t * R + r] = (uint8_t)((mask >> r) & 1);
            if (a.num_tokens_per_domain)
                for (int d = 0; d < R / D; d++)
                    if ((mask >> (d * D)) & (D == 64 ? ~0ull : ((1ull << D) - 1))) atomicAdd(&dom_cnt[d], 1);
        }
        for (int r = 0; r < R; r++) {
            unsigned b = __ballot_sync(kFullMask, (mask >> r) & 1);
            if (lane == 0) warp_cnt[warp][r] = __popc(b);
        }
        __syncthreads();
        if (threadIdx.x < R) {
            int r = threadIdx.x, run = base[r];
            for (int w = 0; w < nwarps; w++) {
                int cnt = warp_cnt[w][r];
                warp_cnt[w][r] = run;
                run += cnt;
            }
            base[r] = run;
        }
        __syncthreads();
        for (int r = 0; r < R; r++) {
            bool in = (mask >> r) & 1;
            unsigned b = __ballot_sync(kFullMask, in);
            if (t < a.num_tokens && a.send_row)
                a.send_row[t * R + r] = in ? warp_cnt[warp][r] + __popc(b & lanemask_lt()) : -1;
        }
        __syncthreads();
    }
    const bool poison = __syncthreads_or(saw_bad) && !a.bad;
    for (int r = threadIdx.x; r < R; r += blockDim.x)
        if (a.num_tokens_per_rank) a.num_tokens_per_rank[r] = poison ? -1 : base[r];
    if (a.num_tokens_per_domain)
        for (int d = threadIdx.x; d < R / D; d += blockDim.x) a.num_tokens_per_domain[d] = poison ? -1 : dom_cnt[d];
    if (poison && a.num_tokens_per_expert)
        for (int i = threadIdx.x; i < E; i += blockDim.x) a.num_tokens_per_expert[i] = -1;
}

extern "C" int epx_cuda_launch_layout(const epx_cuda_layout_args_t *args, void *stream)
{
    return launch_kernel(layout_kernel, *args, 1, 1024, 0, stream);
}

/* ----------------------------------------------------------------------------- failure ---- */

/* This rank skipped collective `epoch`: thread r tells peer r (it returns EPX_ERR_REMOTE) and
 * releases our slices of its areas as if consumed; thread 0 closes the epoch. */
__global__ void fail_kernel(const __grid_constant__ epx_cuda_common_t c)
{
    epx_cuda_ctrl_t *own = peer_ctrl(&c, c.rank);
    const uint64_t epoch = ld_volatile_u64(&own->epoch) + 1;
    if ((int)threadIdx.x < c.nranks) {
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
