/*
 * HT combine on the cuda backend. Default mode: each rank writes its rows into the source's area
 * [rank][token] and the source reduces in fp32 in the pinned order (ranks ascending, then the
 * biases). View mode (x_in_buffer): each rank posts the rows the caller wrote into its comb_x
 * area and each source pulls its tokens' rows from the peers and reduces the same way.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/combine.cuh"

/* Sums the token's per-slot weights over its n rows, ascending (weights_of(d): row d's [K]). */
template <typename WeightsOf>
__device__ __forceinline__ void reduce_weights(float *out, int K, int n, WeightsOf weights_of, int lane)
{
    for (int k = lane; k < K; k += 32) {
        float acc = 0.0f;
        for (int d = 0; d < n; d++) acc = __fadd_rn(acc, weights_of(d)[k]);
        out[k] = acc;
    }
}

/* Sender (the rank holding received rows): after every source released its combine area, one
 * warp per received row (the block's warps stride over the rows) writes it into the source's
 * slice [me][source token]. */
__global__ void __launch_bounds__(kBlockThreads)
    combine_send_kernel(const __grid_constant__ epx_cuda_combine_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const kernel_frame f(c);
    const int64_t row_bytes = c->hidden * 2;
    __shared__ int prefix[EPX_CUDA_MAX_RANKS + 1];
    post_call(c, f.epoch);
    const int &ok = open_combine_send(c, a.h.recv_prefix, prefix, f.epoch);
    const int64_t rows = ok ? *a.h.rows_valid : 0;
    /* Rows past rows_valid were dropped by a static bound: the source still counts us among the
     * token's ranks, so its slot gets zeros (+0.0f leaves an fp32 sum that started at +0.0f
     * unchanged, so the result equals skipping the rank). */
    const int64_t arrived = ok ? prefix[R] : 0;
    for (int64_t i = (int64_t)blockIdx.x * kBlockWarps + warp; i < arrived;
         i += (int64_t)gridDim.x * kBlockWarps) {
        const int s = source_of_row(prefix, R, i);
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
    finish_combine_send(c, &f.own->done_counter[DONE_HT_COMB_SEND], f.epoch);
}

/* Source side: after every rank's rows arrived, one warp per token (the block's warps stride over
 * the tokens) sums its ranks' rows ascending, + bias0, + bias1, in one fp32 accumulator, one
 * rounding; up to eight rows' loads are in flight before their adds (one at a time took 15% longer
 * on an H200, 8 ranks under MPS). The last block releases every rank's slice of our area and closes
 * the epoch. */
__global__ void __launch_bounds__(kBlockThreads)
    combine_reduce_kernel(const __grid_constant__ epx_cuda_combine_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const kernel_frame f(c);
    const int64_t H = c->hidden;
    __shared__ int src_rank[kBlockWarps][EPX_CUDA_MAX_RANKS];
    const int &ok = open_combine_reduce(c, f.epoch);
    const uint16_t *comb = (const uint16_t *)(f.region + c->lay.comb_x);
    const float *combw = (const float *)(f.region + c->lay.comb_w);
    const int64_t T = ok ? a.num_tokens : 0;
    const bool vec = (H % 8) == 0;
    for (int64_t t = (int64_t)blockIdx.x * kBlockWarps + warp; t < T; t += (int64_t)gridDim.x * kBlockWarps) {
        int n = 0;
        for (int r0 = 0; r0 < R; r0 += 32) {
            const int r = r0 + lane;
            const bool in = r < R && a.h.send_row[t * R + r] >= 0;
            const int pos = warp_slot(in, n);
            if (in) src_rank[warp][pos] = r;
        }
        __syncwarp();
        /* Rank r's row of token t sits at slot [r][t] of our area. */
        const auto slot_of = [&](int d) { return (int64_t)src_rank[warp][d] * c->max_tokens + t; };
        reduce_token<8, true>(
            a.combined_x + t * H, H, vec, n, [&](int d) { return comb + slot_of(d) * H; }, false,
            [](int) { return 0.0f; }, a.bias0, a.bias1, t * H, lane);
        if (a.combined_topk_weights)
            reduce_weights(
                a.combined_topk_weights + t * K, K, n, [&](int d) { return combw + slot_of(d) * K; }, lane);
        __syncwarp();
    }
    finish_combine_reduce(c, &f.own->done_counter[DONE_HT_COMB_REDUCE], f.epoch);
}

extern "C" int epx_cuda_launch_combine(const epx_cuda_combine_args_t *args, void *stream)
{
    return launch_pair(combine_send_kernel, combine_reduce_kernel, args, 0, stream);
}

/* ---------------------------------------------------------------------------- view mode ---- */

/* Expert side of a view-mode combine: the block's threads stage the weights (if any) in comb_w;
 * the last block's threads r < R tell source r how many rows we hold, where its tokens start and
 * where our rows are (comb_x, written by the caller, or the handle's dispatch view). */
__global__ void __launch_bounds__(kBlockThreads)
    combine_view_post_kernel(const __grid_constant__ epx_cuda_combine_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, me = c->rank;
    const kernel_frame f(c);
    const int64_t rows = *a.h.rows_valid;
    post_call(c, f.epoch);
    if (a.topk_weights) {
        float *w = (float *)(f.region + c->lay.comb_w);
        for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < rows * K;
             i += (int64_t)gridDim.x * blockDim.x)
            w[i] = a.topk_weights[i];
    }
    if (last_block_arrive(&f.own->view_done_counter[DONE_VIEW_COMB_POST])) {
        if (threadIdx.x < R) {
            epx_cuda_ctrl_t *peer = peer_ctrl(c, threadIdx.x);
            st_relaxed_sys(&peer->comb_rows[me], (uint64_t)rows);
            st_relaxed_sys(&peer->comb_base[me], (uint64_t)a.h.recv_prefix[threadIdx.x]);
            st_relaxed_sys(&peer->comb_xoff[me], a.x_off);
            st_release_sys(&peer->comb_flag[me], f.epoch);
        }
    }
}

/* Source side of a view-mode combine: threads r < R wait for peer r's post; then one warp per
 * token pulls its rows from the peers holding it (16-byte loads, up to eight ranks' loads in
 * flight before their adds, so a token of top-8 routing costs one round trip per chunk), adds in
 * rank order, biases, rounds once. The last block tells the peers we are done with their rows,
 * waits until every source is done with ours (the caller may then overwrite them), releases the
 * combine areas and closes the epoch. On an H200 with 8 ranks under MPS, side by side: 843 us with
 * eight loads in flight (100 registers, one block per SM), 901 with six, 953 with four (guarded),
 * 1228 with four unguarded at 40 registers (a tail of single loads). */
__global__ void __launch_bounds__(kBlockThreads, 1)
    combine_view_reduce_kernel(const __grid_constant__ epx_cuda_combine_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const kernel_frame f(c);
    const int64_t H = c->hidden;
    __shared__ int64_t peer_rows[EPX_CUDA_MAX_RANKS];
    __shared__ int64_t peer_base[EPX_CUDA_MAX_RANKS];
    __shared__ uint64_t peer_xoff[EPX_CUDA_MAX_RANKS];
    __shared__ const uint16_t *src_ptr[kBlockWarps][EPX_CUDA_MAX_RANKS];
    __shared__ const float *src_w[kBlockWarps][EPX_CUDA_MAX_RANKS];
    const int &ok = wait_peers(
        c, [&](int r) { return &f.own->comb_flag[r]; }, f.epoch, f.epoch, EPX_CUDA_WAIT_COMBINE_DATA,
        [&](int r) {
            peer_rows[r] = (int64_t)ld_volatile_u64(&f.own->comb_rows[r]);
            peer_base[r] = (int64_t)ld_volatile_u64(&f.own->comb_base[r]);
            peer_xoff[r] = ld_volatile_u64(&f.own->comb_xoff[r]);
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
            const int pos = warp_slot(in, n);
            if (in) {
                src_ptr[warp][pos] = (const uint16_t *)(c->peers[r] + peer_xoff[r]) + fin * H;
                src_w[warp][pos] = (const float *)(c->peers[r] + c->lay.comb_w) + fin * K;
            }
        }
        __syncwarp();
        reduce_token<8, true>(
            a.combined_x + t * H, H, vec, n, [&](int d) { return src_ptr[warp][d]; }, false,
            [](int) { return 0.0f; }, a.bias0, a.bias1, t * H, lane);
        if (a.combined_topk_weights)
            reduce_weights(
                a.combined_topk_weights + t * K, K, n, [&](int d) { return src_w[warp][d]; }, lane);
        __syncwarp();
    }
    if (last_block_arrive(&f.own->view_done_counter[DONE_VIEW_COMB_REDUCE])) {
        release_peers(
            c, [&](int r) { return &peer_ctrl(c, r)->comb_pulled[me]; }, f.epoch);
        const int &all_done = wait_peers(
            c, [&](int r) { return &f.own->comb_pulled[r]; }, f.epoch, f.epoch, EPX_CUDA_WAIT_COMBINE_ACK);
        /* Our area is free for the next writer (a default combine's peers) only now. */
        if (all_done)
            release_peers(
                c, [&](int r) { return &peer_ctrl(c, r)->comb_ack[me]; }, f.epoch);
        release_if_failed(c, f.epoch);
        close_epoch(f.own, &f.own->comb_last, f.epoch);
    }
}

extern "C" int epx_cuda_launch_combine_view(const epx_cuda_combine_args_t *args, void *stream)
{
    return launch_pair(combine_view_post_kernel, combine_view_reduce_kernel, args, 0, stream);
}
