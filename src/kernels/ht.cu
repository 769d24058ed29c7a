/*
 * HT layout, dispatch and combine kernels of the cuda backend (ranks whose regions are
 * load/store reachable). Dispatch: each sender writes every token once per destination rank
 * straight into the receiver's rank-major area [source][row], the row being the token's prefix
 * over is_token_in_rank (no count exchange needed first); the receiver packs the slices into the
 * caller's outputs. Combine: each rank writes its rows into the source's area [rank][token] and
 * the source reduces in fp32 in the pinned order. No templates: every kernel moves bytes.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/common.cuh"

/* ----------------------------------------------------------------------------- layout ---- */

/* One block: tiles of blockDim tokens; per tile and rank a ballot gives each token's row in the
 * rank's slice (prefix over is_token_in_rank), so rows come out in ascending token order. */
__global__ void __launch_bounds__(1024) layout_kernel(const __grid_constant__ epx_cuda_layout_args_t a)
{
    const int R = a.nranks, K = a.num_topk, L = a.num_local_experts, E = a.num_experts;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const int D = a.ranks_per_domain > 0 ? a.ranks_per_domain : R;
    __shared__ int warp_cnt[32][EPX_CUDA_MAX_RANKS];
    __shared__ int base[EPX_CUDA_MAX_RANKS];
    __shared__ int dom_cnt[EPX_CUDA_MAX_RANKS];
    for (int i = threadIdx.x; i < R; i += blockDim.x) {
        base[i] = 0;
        dom_cnt[i] = 0;
    }
    if (a.num_tokens_per_expert)
        for (int i = threadIdx.x; i < E; i += blockDim.x) a.num_tokens_per_expert[i] = 0;
    __syncthreads();
    for (int64_t tile = 0; tile < a.num_tokens; tile += blockDim.x) {
        const int64_t t = tile + threadIdx.x;
        uint64_t mask = 0;
        if (t < a.num_tokens) {
            for (int k = 0; k < K; k++) {
                const int64_t e = topk_checked(a.topk_idx, a.idx_is_64, t, K, k, E, a.host);
                if (e < 0) continue;
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
    for (int r = threadIdx.x; r < R; r += blockDim.x)
        if (a.num_tokens_per_rank) a.num_tokens_per_rank[r] = base[r];
    if (a.num_tokens_per_domain)
        for (int d = threadIdx.x; d < R / D; d += blockDim.x) a.num_tokens_per_domain[d] = dom_cnt[d];
}

extern "C" int epx_cuda_launch_layout(const epx_cuda_layout_args_t *args, void *stream)
{
    layout_kernel<<<1, 1024, 0, (cudaStream_t)stream>>>(*args);
    return (int)cudaGetLastError();
}

/* ---------------------------------------------------------------------------- dispatch ---- */

/* Sender. Block prologue: wait until every receiver released our slice of its area (previous
 * dispatch). Then one warp per token: collect its destinations, write metadata and the row into
 * each destination's slice. The last block publishes counts and the epoch to every receiver. */
__global__ void __launch_bounds__(kBlockThreads)
    dispatch_send_kernel(const __grid_constant__ epx_cuda_dispatch_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, L = c->num_local_experts, me = c->rank;
    const int E = L * R;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    epx_cuda_ctrl_t *own = peer_ctrl(c, me);
    const uint64_t epoch = ld_volatile_u64(&own->epoch) + 1;
    const uint64_t prev = ld_volatile_u64(&own->disp_last);
    __shared__ int dst_rank[kBlockWarps][EPX_CUDA_MAX_RANKS];
    __shared__ uint8_t *dst_ptr[kBlockWarps][EPX_CUDA_MAX_RANKS];
    __shared__ int64_t dst_slot[kBlockWarps][EPX_CUDA_MAX_RANKS];
    const int &ok =
        wait_peers(c, [&](int r) { return &own->disp_ack[r]; }, prev, epoch, EPX_CUDA_WAIT_DISPATCH_ACK);
    const int ns = a.x_scales ? a.num_scales : 0;
    if (ok) {
        for (int64_t t = (int64_t)blockIdx.x * kBlockWarps + warp; t < a.num_tokens;
             t += (int64_t)gridDim.x * kBlockWarps) {
            int n = 0;
            for (int r0 = 0; r0 < R; r0 += 32) {
                const int r = r0 + lane;
                const int row = r < R ? a.h.send_row[t * R + r] : -1;
                const unsigned b = __ballot_sync(kFullMask, row >= 0);
                if (row >= 0) {
                    const int pos = n + __popc(b & lanemask_lt());
                    const int64_t slot = (int64_t)me * c->max_tokens + row;
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
                uint8_t *base = c->peers[r];
                if (!a.cached) {
                    for (int k = lane; k < K; k += 32) {
                        const int64_t e = topk_at(a.topk_idx, a.idx_is_64, t * K + k);
                        const int loc = (expert_ok(e, E) && e / L == r) ? (int)(e % L) : -1;
                        ((int32_t *)(base + c->lay.disp_idx))[slot * K + k] = loc;
                        ((float *)(base + c->lay.disp_w))[slot * K + k] =
                            (a.topk_weights && loc >= 0) ? a.topk_weights[t * K + k] : 0.0f;
                    }
                    if (lane == 0) ((int32_t *)(base + c->lay.disp_src))[slot] = (int32_t)t;
                }
                for (int j = lane; j < ns; j += 32)
                    ((float *)(base + c->lay.disp_scales))[slot * ns + j] = a.x_scales[t * ns + j];
            }
            copy_fanout<4, false>(a.x + t * a.row_bytes, dst_ptr[warp], n, a.row_bytes, lane);
            __syncwarp();
        }
    }
    if (last_block_arrive(&own->done_counter[DONE_HT_SEND]))
        publish_peers(c, epoch, [&](int r) {
            epx_cuda_ctrl_t *peer = peer_ctrl(c, r);
            st_relaxed_sys(&peer->disp_count[me], (uint64_t)a.h.send_count[r]);
            st_release_sys(&peer->disp_flag[me], epoch);
        });
}

/* Receiver. Block prologue: wait for every source's epoch, prefix the counts. Then one warp per
 * output row copies it out of its source slice. The last block writes N_r, the per-expert
 * counts, releases every source's slice and closes the epoch (also after a failure, so all
 * ranks stay in step). */
__global__ void __launch_bounds__(kBlockThreads)
    dispatch_recv_kernel(const __grid_constant__ epx_cuda_dispatch_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, L = c->num_local_experts, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint8_t *region = c->peers[me];
    epx_cuda_ctrl_t *own = ctrl_of(region);
    const uint64_t epoch = ld_volatile_u64(&own->epoch) + 1;
    extern __shared__ int expert_cnt[]; /* [L] */
    __shared__ int prefix[EPX_CUDA_MAX_RANKS + 1];
    __shared__ int cnt[EPX_CUDA_MAX_RANKS];
    const bool want_counts = !a.cached && a.num_recv_tokens_per_expert;
    if (want_counts)
        for (int j = threadIdx.x; j < L; j += blockDim.x) expert_cnt[j] = 0;
    const int &ok = wait_peers(
        c, [&](int r) { return &own->disp_flag[r]; }, epoch, epoch, EPX_CUDA_WAIT_DISPATCH_DATA,
        [&](int r) {
            cnt[r] = (int)ld_volatile_u64(&own->disp_count[r]);
            return true;
        });
    if (threadIdx.x == 0) {
        prefix[0] = 0;
        for (int r = 0; r < R; r++) prefix[r + 1] = prefix[r] + (ok ? cnt[r] : 0);
    }
    __syncthreads();
    const int64_t total = prefix[R];
    /* The default mode writes nothing when N_r exceeds the outputs (the host call fails); static
     * mode keeps the first `capacity` rows. */
    const bool fits = ok && (a.static_mode || total <= a.capacity);
    const int64_t rows = fits ? (total < a.capacity ? total : a.capacity) : 0;
    /* Rows dropped by the static bound still count per expert (pinned) and keep their source
     * token, so combine can clear their slot on the source. */
    const int64_t meta_rows = (fits && !a.cached) ? total : rows;
    const int ns = a.x_scales ? a.num_scales : 0;
    for (int64_t i = (int64_t)blockIdx.x * kBlockWarps + warp; i < meta_rows;
         i += (int64_t)gridDim.x * kBlockWarps) {
        int s = 0;
        while (s + 1 < R && prefix[s + 1] <= i) s++;
        const int64_t slot = (int64_t)s * c->max_tokens + (i - prefix[s]);
        const bool kept = i < rows;
        if (kept) {
            uint8_t *dst = a.recv_x + i * a.row_bytes;
            copy_fanout<4, false>(region + c->lay.disp_x + slot * c->lay.x_stride, &dst, 1, a.row_bytes, lane);
            for (int j = lane; j < ns; j += 32)
                a.recv_scales[i * ns + j] = ((const float *)(region + c->lay.disp_scales))[slot * ns + j];
        }
        if (!a.cached) {
            for (int k = lane; k < K; k += 32) {
                const int32_t loc = ((const int32_t *)(region + c->lay.disp_idx))[slot * K + k];
                if (kept && a.recv_topk_idx) {
                    if (a.recv_idx_is_64)
                        ((int64_t *)a.recv_topk_idx)[i * K + k] = loc;
                    else
                        ((int32_t *)a.recv_topk_idx)[i * K + k] = loc;
                }
                if (kept && a.recv_topk_weights)
                    a.recv_topk_weights[i * K + k] = ((const float *)(region + c->lay.disp_w))[slot * K + k];
                if (want_counts && loc >= 0 && loc < L) atomicAdd(&expert_cnt[loc], 1);
            }
            if (lane == 0) a.h.recv_src[i] = ((const int32_t *)(region + c->lay.disp_src))[slot];
        }
    }
    int32_t *scratch = (int32_t *)(region + c->lay.expert_scratch);
    if (want_counts) {
        __syncthreads();
        for (int j = threadIdx.x; j < L; j += blockDim.x)
            if (expert_cnt[j]) atomicAdd(&scratch[j], expert_cnt[j]);
    }
    if (last_block_arrive(&own->done_counter[DONE_HT_RECV])) {
        if (threadIdx.x == 0) {
            c->host->num_recv = ok ? total : -1;
            if (ok && a.static_mode && total > a.capacity) c->host->overflow = 1;
            if (a.num_recv_tokens && fits) *a.num_recv_tokens = (int32_t)total;
            if (!a.cached) *a.h.rows_valid = (int32_t)rows;
        }
        if (!a.cached)
            for (int r = threadIdx.x; r <= R; r += blockDim.x) a.h.recv_prefix[r] = fits ? prefix[r] : 0;
        if (want_counts) {
            const int al = a.expert_alignment > 1 ? a.expert_alignment : 1;
            for (int j = threadIdx.x; j < L; j += blockDim.x) {
                const int v = ld_volatile_i32(&scratch[j]);
                if (fits) a.num_recv_tokens_per_expert[j] = (v + al - 1) / al * al;
                scratch[j] = 0;
            }
        }
        finish_dispatch_recv(c, epoch);
    }
}

extern "C" int epx_cuda_launch_dispatch(const epx_cuda_dispatch_args_t *args, void *stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    dispatch_send_kernel<<<args->c.num_blocks, kBlockThreads, 0, s>>>(*args);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return (int)err;
    const size_t smem = (size_t)args->c.num_local_experts * sizeof(int);
    if (smem > 48 * 1024) {
        err = cudaFuncSetAttribute(dispatch_recv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)smem);
        if (err != cudaSuccess) return (int)err;
    }
    dispatch_recv_kernel<<<args->c.num_blocks, kBlockThreads, smem, s>>>(*args);
    return (int)cudaGetLastError();
}

/* ----------------------------------------------------------------------------- combine ---- */

/* Sender of combine (rank holding received rows): after each source released its combine area,
 * one warp per received row writes it into the source's slice [me][source token]. */
__global__ void __launch_bounds__(kBlockThreads)
    combine_send_kernel(const __grid_constant__ epx_cuda_combine_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    epx_cuda_ctrl_t *own = peer_ctrl(c, me);
    const uint64_t epoch = ld_volatile_u64(&own->epoch) + 1;
    const uint64_t prev = ld_volatile_u64(&own->comb_last);
    const int64_t row_bytes = c->hidden * 2;
    __shared__ int prefix[EPX_CUDA_MAX_RANKS + 1];
    for (int r = threadIdx.x; r <= R; r += blockDim.x) prefix[r] = a.h.recv_prefix[r];
    const int &ok =
        wait_peers(c, [&](int r) { return &own->comb_ack[r]; }, prev, epoch, EPX_CUDA_WAIT_COMBINE_ACK);
    const int64_t rows = ok ? *a.h.rows_valid : 0;
    /* Rows past rows_valid were dropped by a static bound: the source still counts us among the
     * token's ranks, so its slot gets zeros (+0.0f leaves an fp32 sum that started at +0.0f
     * unchanged, so the result equals skipping the rank). */
    const int64_t arrived = ok ? prefix[R] : 0;
    for (int64_t i = (int64_t)blockIdx.x * kBlockWarps + warp; i < arrived;
         i += (int64_t)gridDim.x * kBlockWarps) {
        int s = 0;
        while (s + 1 < R && prefix[s + 1] <= i) s++;
        const int64_t t = a.h.recv_src[i];
        const int64_t slot = (int64_t)me * c->max_tokens + t;
        uint8_t *base = c->peers[s];
        uint8_t *dst = base + c->lay.comb_x + slot * row_bytes;
        float *dst_w = (float *)(base + c->lay.comb_w) + slot * K;
        if (i < rows) {
            copy_fanout<4, false>((const uint8_t *)(a.x + i * c->hidden), &dst, 1, row_bytes, lane);
            if (a.topk_weights)
                for (int k = lane; k < K; k += 32) dst_w[k] = a.topk_weights[i * K + k];
        } else {
            for (int64_t b = lane; b < row_bytes / 2; b += 32) ((uint16_t *)dst)[b] = 0;
            for (int k = lane; k < K; k += 32) dst_w[k] = 0.0f;
        }
    }
    if (last_block_arrive(&own->done_counter[DONE_HT_COMB_SEND]))
        publish_peers(c, epoch, [&](int r) { st_release_sys(&peer_ctrl(c, r)->comb_flag[me], epoch); });
}

__device__ __forceinline__ void acc_add8(float *acc, int4 v)
{
    const uint32_t w[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
#pragma unroll
    for (int q = 0; q < 4; q++) {
        acc[2 * q] = __fadd_rn(acc[2 * q], epx_bf16_to_f32(w[q]));
        acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], epx_bf16_to_f32(w[q] >> 16));
    }
}

/* Source side: wait for every rank's rows, then one warp per token sums its ranks' rows
 * ascending, + bias0, + bias1, in one fp32 accumulator, one rounding. The last block releases
 * every rank's slice of our area and closes the epoch. */
__global__ void __launch_bounds__(kBlockThreads)
    combine_reduce_kernel(const __grid_constant__ epx_cuda_combine_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint8_t *region = c->peers[me];
    epx_cuda_ctrl_t *own = ctrl_of(region);
    const uint64_t epoch = ld_volatile_u64(&own->epoch) + 1;
    const int64_t H = c->hidden;
    __shared__ int src_rank[kBlockWarps][EPX_CUDA_MAX_RANKS];
    const int &ok =
        wait_peers(c, [&](int r) { return &own->comb_flag[r]; }, epoch, epoch, EPX_CUDA_WAIT_COMBINE_DATA);
    const uint16_t *comb = (const uint16_t *)(region + c->lay.comb_x);
    const float *combw = (const float *)(region + c->lay.comb_w);
    const int64_t T = ok ? a.num_tokens : 0;
    const bool vec = (H % 8) == 0;
    for (int64_t t = (int64_t)blockIdx.x * kBlockWarps + warp; t < T; t += (int64_t)gridDim.x * kBlockWarps) {
        int n = 0;
        for (int r0 = 0; r0 < R; r0 += 32) {
            const int r = r0 + lane;
            const bool in = r < R && a.h.send_row[t * R + r] >= 0;
            const unsigned b = __ballot_sync(kFullMask, in);
            if (in) src_rank[warp][n + __popc(b & lanemask_lt())] = r;
            n += __popc(b);
        }
        __syncwarp();
        if (vec) {
            const int64_t n8 = H / 8;
            for (int64_t i = lane; i < n8; i += 32) {
                float acc[8];
#pragma unroll
                for (int q = 0; q < 8; q++) acc[q] = 0.0f;
                for (int d = 0; d < n; d++) {
                    const int64_t slot = (int64_t)src_rank[warp][d] * c->max_tokens + t;
                    acc_add8(acc, ld_nc_v4((const int4 *)(comb + slot * H) + i));
                }
                if (a.bias0) acc_add8(acc, ld_nc_v4((const int4 *)(a.bias0 + t * H) + i));
                if (a.bias1) acc_add8(acc, ld_nc_v4((const int4 *)(a.bias1 + t * H) + i));
                st_na_bf16x8((int4 *)(a.combined_x + t * H) + i, acc);
            }
        } else {
            for (int64_t h = lane; h < H; h += 32) {
                float acc = 0.0f;
                for (int d = 0; d < n; d++) {
                    const int64_t slot = (int64_t)src_rank[warp][d] * c->max_tokens + t;
                    acc = __fadd_rn(acc, epx_bf16_to_f32(comb[slot * H + h]));
                }
                if (a.bias0) acc = __fadd_rn(acc, epx_bf16_to_f32(a.bias0[t * H + h]));
                if (a.bias1) acc = __fadd_rn(acc, epx_bf16_to_f32(a.bias1[t * H + h]));
                a.combined_x[t * H + h] = epx_f32_to_bf16(acc);
            }
        }
        if (a.combined_topk_weights)
            for (int k = lane; k < K; k += 32) {
                float acc = 0.0f;
                for (int d = 0; d < n; d++)
                    acc = __fadd_rn(acc, combw[((int64_t)src_rank[warp][d] * c->max_tokens + t) * K + k]);
                a.combined_topk_weights[t * K + k] = acc;
            }
        __syncwarp();
    }
    if (last_block_arrive(&own->done_counter[DONE_HT_COMB_REDUCE])) finish_combine_reduce(c, epoch);
}

extern "C" int epx_cuda_launch_combine(const epx_cuda_combine_args_t *args, void *stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    combine_send_kernel<<<args->c.num_blocks, kBlockThreads, 0, s>>>(*args);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return (int)err;
    combine_reduce_kernel<<<args->c.num_blocks, kBlockThreads, 0, s>>>(*args);
    return (int)cudaGetLastError();
}

/* --------------------------------------------------------------------- failure, ceiling ---- */

/* This rank skipped collective `epoch`: tell every peer (they return EPX_ERR_REMOTE), release
 * both our areas' slices as if consumed, and close the epoch. */
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
    fail_kernel<<<1, EPX_CUDA_MAX_RANKS, 0, (cudaStream_t)stream>>>(*c);
    return (int)cudaGetLastError();
}

/* The same token rows as dispatch_send_kernel to the same slots through the same mappings,
 * with plain copies: no waits, no metadata, no flags. */
__global__ void __launch_bounds__(kBlockThreads)
    ceiling_copy_kernel(const __grid_constant__ epx_cuda_dispatch_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __shared__ uint8_t *dst_ptr[kBlockWarps][EPX_CUDA_MAX_RANKS];
    for (int64_t t = (int64_t)blockIdx.x * kBlockWarps + warp; t < a.num_tokens;
         t += (int64_t)gridDim.x * kBlockWarps) {
        int n = 0;
        for (int r0 = 0; r0 < R; r0 += 32) {
            const int r = r0 + lane;
            const int row = r < R ? a.h.send_row[t * R + r] : -1;
            const unsigned b = __ballot_sync(kFullMask, row >= 0);
            if (row >= 0)
                dst_ptr[warp][n + __popc(b & lanemask_lt())] =
                    c->peers[r] + c->lay.disp_x + ((int64_t)me * c->max_tokens + row) * c->lay.x_stride;
            n += __popc(b);
        }
        __syncwarp();
        copy_fanout<4, false>(a.x + t * a.row_bytes, dst_ptr[warp], n, a.row_bytes, lane);
        __syncwarp();
    }
}

extern "C" int epx_cuda_launch_ceiling_copy(const epx_cuda_dispatch_args_t *args, void *stream)
{
    ceiling_copy_kernel<<<args->c.num_blocks, kBlockThreads, 0, (cudaStream_t)stream>>>(*args);
    return (int)cudaGetLastError();
}

/* ------------------------------------------------------------------------ view mode ---- */

/* Sender of a view-mode dispatch. Prologue: tell every peer that our views of its earlier rows
 * are dead (our consumers ran before this kernel on our stream), wait until every receiver said
 * the same, post our per-destination counts (block 0), then read from each destination the
 * counts of the lower-ranked sources: their sum is where our rows start there. Then one warp per
 * token writes each of its rows once, into its final row. */
__global__ void __launch_bounds__(kBlockThreads)
    dispatch_view_send_kernel(const __grid_constant__ epx_cuda_dispatch_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, L = c->num_local_experts, me = c->rank;
    const int E = L * R;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    epx_cuda_ctrl_t *own = peer_ctrl(c, me);
    const uint64_t closed = ld_volatile_u64(&own->epoch);
    const uint64_t epoch = closed + 1;
    const uint64_t prev = ld_volatile_u64(&own->view_last);
    __shared__ int counted;
    __shared__ int64_t base[EPX_CUDA_MAX_RANKS];
    __shared__ int dst_rank[kBlockWarps][EPX_CUDA_MAX_RANKS];
    __shared__ int64_t dst_row[kBlockWarps][EPX_CUDA_MAX_RANKS];
    __shared__ uint8_t *dst_ptr[kBlockWarps][EPX_CUDA_MAX_RANKS];
    if (threadIdx.x == 0) counted = 1;
    if (blockIdx.x == 0 && threadIdx.x < R) {
        epx_cuda_ctrl_t *peer = peer_ctrl(c, threadIdx.x);
        if (ld_volatile_u64(&peer->view_ack[me]) < closed) st_release_sys(&peer->view_ack[me], closed);
    }
    const int &acked =
        wait_peers(c, [&](int r) { return &own->view_ack[r]; }, prev, epoch, EPX_CUDA_WAIT_DISPATCH_ACK);
    if (acked && blockIdx.x == 0 && threadIdx.x < R) {
        epx_cuda_ctrl_t *peer = peer_ctrl(c, threadIdx.x);
        st_relaxed_sys(&peer->disp_count[me], (uint64_t)a.h.send_count[threadIdx.x]);
        st_release_sys(&peer->cnt_flag[me], epoch);
    }
    if (acked && threadIdx.x < R) {
        epx_cuda_ctrl_t *peer = peer_ctrl(c, threadIdx.x);
        int64_t sum = 0;
        for (int s = 0; s < me; s++) {
            if (!wait_flag_geq(c, &peer->cnt_flag[s], epoch, epoch, s, EPX_CUDA_WAIT_DISPATCH_DATA)) {
                counted = 0;
                break;
            }
            sum += (int64_t)ld_volatile_u64(&peer->disp_count[s]);
        }
        base[threadIdx.x] = sum;
    }
    __syncthreads();
    const bool ok = acked && counted;
    const int ns = a.x_scales ? a.num_scales : 0;
    const int64_t cap = (int64_t)R * c->max_tokens;
    if (ok) {
        for (int64_t t = (int64_t)blockIdx.x * kBlockWarps + warp; t < a.num_tokens;
             t += (int64_t)gridDim.x * kBlockWarps) {
            int n = 0;
            for (int r0 = 0; r0 < R; r0 += 32) {
                const int r = r0 + lane;
                const int row = r < R ? a.h.send_row[t * R + r] : -1;
                const int64_t fin = row >= 0 ? base[r] + row : -1;
                const unsigned b = __ballot_sync(kFullMask, fin >= 0 && fin < cap);
                if (fin >= 0 && fin < cap) {
                    const int pos = n + __popc(b & lanemask_lt());
                    dst_rank[warp][pos] = r;
                    dst_row[warp][pos] = fin;
                    dst_ptr[warp][pos] = c->peers[r] + c->lay.view_x + fin * a.row_bytes;
                }
                n += __popc(b);
            }
            __syncwarp();
            for (int d = 0; d < n; d++) {
                const int r = dst_rank[warp][d];
                const int64_t fin = dst_row[warp][d];
                uint8_t *rb = c->peers[r];
                if (!a.cached) {
                    for (int k = lane; k < K; k += 32) {
                        const int64_t e = topk_at(a.topk_idx, a.idx_is_64, t * K + k);
                        const int loc = (expert_ok(e, E) && e / L == r) ? (int)(e % L) : -1;
                        ((int32_t *)(rb + c->lay.view_idx))[fin * K + k] = loc;
                        ((float *)(rb + c->lay.view_w))[fin * K + k] =
                            (a.topk_weights && loc >= 0) ? a.topk_weights[t * K + k] : 0.0f;
                    }
                    if (lane == 0) ((int32_t *)(rb + c->lay.view_src))[fin] = (int32_t)t;
                }
                for (int j = lane; j < ns; j += 32)
                    ((float *)(rb + c->lay.view_scales))[fin * ns + j] = a.x_scales[t * ns + j];
            }
            copy_fanout<4, false>(a.x + t * a.row_bytes, dst_ptr[warp], n, a.row_bytes, lane);
            __syncwarp();
        }
    }
    if (last_block_arrive(&own->view_done_counter[DONE_VIEW_SEND]))
        publish_peers(c, epoch, [&](int r) {
            epx_cuda_ctrl_t *peer = peer_ctrl(c, r);
            st_relaxed_sys(&peer->disp_count[me], (uint64_t)a.h.send_count[r]);
            st_release_sys(&peer->disp_flag[me], epoch);
        });
}

/* Receiver of a view-mode dispatch: the rows are in place once every source's flag arrived; it
 * keeps the source index per row for combine and counts per local expert. The default areas were
 * not touched, so they are released at once; the view areas at our next view dispatch. */
__global__ void __launch_bounds__(kBlockThreads)
    dispatch_view_recv_kernel(const __grid_constant__ epx_cuda_dispatch_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, L = c->num_local_experts, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint8_t *region = c->peers[me];
    epx_cuda_ctrl_t *own = ctrl_of(region);
    const uint64_t epoch = ld_volatile_u64(&own->epoch) + 1;
    extern __shared__ int expert_cnt[]; /* [L] */
    __shared__ int prefix[EPX_CUDA_MAX_RANKS + 1];
    __shared__ int cnt[EPX_CUDA_MAX_RANKS];
    const bool want_counts = !a.cached && a.num_recv_tokens_per_expert;
    if (want_counts)
        for (int j = threadIdx.x; j < L; j += blockDim.x) expert_cnt[j] = 0;
    const int &ok = wait_peers(
        c, [&](int r) { return &own->disp_flag[r]; }, epoch, epoch, EPX_CUDA_WAIT_DISPATCH_DATA,
        [&](int r) {
            cnt[r] = (int)ld_volatile_u64(&own->disp_count[r]);
            return true;
        });
    if (threadIdx.x == 0) {
        prefix[0] = 0;
        for (int r = 0; r < R; r++) prefix[r + 1] = prefix[r] + (ok ? cnt[r] : 0);
    }
    __syncthreads();
    const int64_t total = prefix[R];
    const int64_t rows = total < a.capacity ? total : a.capacity;
    if (!a.cached) {
        for (int64_t i = (int64_t)blockIdx.x * kBlockWarps + warp; i < total;
             i += (int64_t)gridDim.x * kBlockWarps) {
            if (want_counts)
                for (int k = lane; k < K; k += 32) {
                    const int32_t loc = ((const int32_t *)(region + c->lay.view_idx))[i * K + k];
                    if (loc >= 0 && loc < L) atomicAdd(&expert_cnt[loc], 1);
                }
            if (lane == 0) a.h.recv_src[i] = ((const int32_t *)(region + c->lay.view_src))[i];
        }
    }
    int32_t *scratch = (int32_t *)(region + c->lay.expert_scratch);
    if (want_counts) {
        __syncthreads();
        for (int j = threadIdx.x; j < L; j += blockDim.x)
            if (expert_cnt[j]) atomicAdd(&scratch[j], expert_cnt[j]);
    }
    if (last_block_arrive(&own->view_done_counter[DONE_VIEW_RECV])) {
        if (threadIdx.x == 0) {
            c->host->num_recv = ok ? total : -1;
            if (ok && a.static_mode && total > a.capacity) c->host->overflow = 1;
            if (a.num_recv_tokens && ok) *a.num_recv_tokens = (int32_t)total;
            if (!a.cached) *a.h.rows_valid = ok ? (int32_t)rows : 0;
        }
        if (!a.cached)
            for (int r = threadIdx.x; r <= R; r += blockDim.x) a.h.recv_prefix[r] = ok ? prefix[r] : 0;
        if (want_counts) {
            const int al = a.expert_alignment > 1 ? a.expert_alignment : 1;
            for (int j = threadIdx.x; j < L; j += blockDim.x) {
                const int v = ld_volatile_i32(&scratch[j]);
                if (ok) a.num_recv_tokens_per_expert[j] = (v + al - 1) / al * al;
                scratch[j] = 0;
            }
        }
        finish_dispatch_recv(c, epoch, &own->view_last);
    }
}

extern "C" int epx_cuda_launch_dispatch_view(const epx_cuda_dispatch_args_t *args, void *stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    dispatch_view_send_kernel<<<args->c.num_blocks, kBlockThreads, 0, s>>>(*args);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return (int)err;
    const size_t smem = (size_t)args->c.num_local_experts * sizeof(int);
    if (smem > 48 * 1024) {
        err = cudaFuncSetAttribute(dispatch_view_recv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)smem);
        if (err != cudaSuccess) return (int)err;
    }
    dispatch_view_recv_kernel<<<args->c.num_blocks, kBlockThreads, smem, s>>>(*args);
    return (int)cudaGetLastError();
}

/* Expert side of a view-mode combine: stage the weights (if any) next to the rows the caller
 * wrote into comb_x, then tell every source how many rows we hold and where its tokens start. */
__global__ void __launch_bounds__(kBlockThreads)
    combine_view_post_kernel(const __grid_constant__ epx_cuda_combine_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, me = c->rank;
    uint8_t *region = c->peers[me];
    epx_cuda_ctrl_t *own = ctrl_of(region);
    const uint64_t epoch = ld_volatile_u64(&own->epoch) + 1;
    const int64_t rows = *a.h.rows_valid;
    if (a.topk_weights) {
        float *w = (float *)(region + c->lay.comb_w);
        for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < rows * K;
             i += (int64_t)gridDim.x * blockDim.x)
            w[i] = a.topk_weights[i];
    }
    if (last_block_arrive(&own->view_done_counter[DONE_VIEW_COMB_POST])) {
        if (threadIdx.x < R) {
            epx_cuda_ctrl_t *peer = peer_ctrl(c, threadIdx.x);
            st_relaxed_sys(&peer->comb_rows[me], (uint64_t)rows);
            st_relaxed_sys(&peer->comb_base[me], (uint64_t)a.h.recv_prefix[threadIdx.x]);
            st_release_sys(&peer->comb_flag[me], epoch);
        }
    }
}

/* Source side of a view-mode combine: pull each token's rows from the peers holding it (16-byte
 * loads, every rank's load in flight before the sum), add in rank order, biases, round once.
 * The last block tells the peers we are done with their rows, waits until every source is done
 * with ours (the caller may then overwrite them), releases the combine areas and closes the epoch. */
__global__ void __launch_bounds__(kBlockThreads)
    combine_view_reduce_kernel(const __grid_constant__ epx_cuda_combine_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint8_t *region = c->peers[me];
    epx_cuda_ctrl_t *own = ctrl_of(region);
    const uint64_t epoch = ld_volatile_u64(&own->epoch) + 1;
    const int64_t H = c->hidden;
    __shared__ int64_t peer_rows[EPX_CUDA_MAX_RANKS];
    __shared__ int64_t peer_base[EPX_CUDA_MAX_RANKS];
    __shared__ const uint16_t *src_ptr[kBlockWarps][EPX_CUDA_MAX_RANKS];
    __shared__ const float *src_w[kBlockWarps][EPX_CUDA_MAX_RANKS];
    const int &ok = wait_peers(
        c, [&](int r) { return &own->comb_flag[r]; }, epoch, epoch, EPX_CUDA_WAIT_COMBINE_DATA,
        [&](int r) {
            peer_rows[r] = (int64_t)ld_volatile_u64(&own->comb_rows[r]);
            peer_base[r] = (int64_t)ld_volatile_u64(&own->comb_base[r]);
            return true;
        });
    const int64_t T = ok ? a.num_tokens : 0;
    const bool vec = (H % 8) == 0;
    for (int64_t t = (int64_t)blockIdx.x * kBlockWarps + warp; t < T; t += (int64_t)gridDim.x * kBlockWarps) {
        int n = 0;
        for (int r0 = 0; r0 < R; r0 += 32) {
            const int r = r0 + lane;
            const int row = r < R ? a.h.send_row[t * R + r] : -1;
            const int64_t fin = row >= 0 ? peer_base[r] + row : -1;
            /* A row past the holder's rows was dropped by its static bound: it adds nothing. */
            const bool in = fin >= 0 && fin < peer_rows[r];
            const unsigned b = __ballot_sync(kFullMask, in);
            if (in) {
                const int pos = n + __popc(b & lanemask_lt());
                src_ptr[warp][pos] = (const uint16_t *)(c->peers[r] + c->lay.comb_x) + fin * H;
                src_w[warp][pos] = (const float *)(c->peers[r] + c->lay.comb_w) + fin * K;
            }
            n += __popc(b);
        }
        __syncwarp();
        if (vec) {
            const int64_t n8 = H / 8;
            for (int64_t i = lane; i < n8; i += 32) {
                float acc[8];
#pragma unroll
                for (int q = 0; q < 8; q++) acc[q] = 0.0f;
                int d = 0;
                /* Four ranks' loads in flight before their adds (the sum order stays ascending). */
                for (; d + 4 <= n; d += 4) {
                    int4 v[4];
#pragma unroll
                    for (int u = 0; u < 4; u++) v[u] = ld_nc_v4((const int4 *)src_ptr[warp][d + u] + i);
#pragma unroll
                    for (int u = 0; u < 4; u++) acc_add8(acc, v[u]);
                }
                for (; d < n; d++) acc_add8(acc, ld_nc_v4((const int4 *)src_ptr[warp][d] + i));
                if (a.bias0) acc_add8(acc, ld_nc_v4((const int4 *)(a.bias0 + t * H) + i));
                if (a.bias1) acc_add8(acc, ld_nc_v4((const int4 *)(a.bias1 + t * H) + i));
                st_na_bf16x8((int4 *)(a.combined_x + t * H) + i, acc);
            }
        } else {
            for (int64_t h = lane; h < H; h += 32) {
                float acc = 0.0f;
                for (int d = 0; d < n; d++)
                    acc = __fadd_rn(acc, epx_bf16_to_f32(src_ptr[warp][d][h]));
                if (a.bias0) acc = __fadd_rn(acc, epx_bf16_to_f32(a.bias0[t * H + h]));
                if (a.bias1) acc = __fadd_rn(acc, epx_bf16_to_f32(a.bias1[t * H + h]));
                a.combined_x[t * H + h] = epx_f32_to_bf16(acc);
            }
        }
        if (a.combined_topk_weights)
            for (int k = lane; k < K; k += 32) {
                float acc = 0.0f;
                for (int d = 0; d < n; d++) acc = __fadd_rn(acc, src_w[warp][d][k]);
                a.combined_topk_weights[t * K + k] = acc;
            }
        __syncwarp();
    }
    if (last_block_arrive(&own->view_done_counter[DONE_VIEW_COMB_REDUCE])) {
        release_peers(c, [&](int r) { return &peer_ctrl(c, r)->comb_pulled[me]; }, epoch);
        const int &all_done =
            wait_peers(c, [&](int r) { return &own->comb_pulled[r]; }, epoch, epoch, EPX_CUDA_WAIT_COMBINE_ACK);
        /* Our area is free for the next writer (a default combine's peers) only now. */
        if (all_done) release_peers(c, [&](int r) { return &peer_ctrl(c, r)->comb_ack[me]; }, epoch);
        close_epoch(own, &own->comb_last, epoch);
    }
}

extern "C" int epx_cuda_launch_combine_view(const epx_cuda_combine_args_t *args, void *stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    combine_view_post_kernel<<<args->c.num_blocks, kBlockThreads, 0, s>>>(*args);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return (int)err;
    combine_view_reduce_kernel<<<args->c.num_blocks, kBlockThreads, 0, s>>>(*args);
    return (int)cudaGetLastError();
}
