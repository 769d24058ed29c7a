/*
 * HT dispatch on the cuda backend (ranks whose regions are load/store reachable). Each sender
 * writes every token once per destination rank straight into the receiver's area: in the default
 * mode its rank-major slice [source][row], the row being the token's prefix over
 * is_token_in_rank (no count exchange first), and the receiver packs the slices into the caller's
 * outputs; in view mode (recv_in_buffer) the row's final place, after the senders exchanged
 * counts, and the receiver only collects metadata. One row writer (ht.cuh) serves both modes.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/ht.cuh"

/* ------------------------------------------------------------------------------- sender ---- */

/* A sender's end: the last block hands every receiver our row count for it and (routed) our whole row
 * of counts for the rank prefix matrix, then the epoch. */
__device__ __forceinline__ void ht_finish_send(const epx_cuda_dispatch_args_t &a, uint32_t *counter,
                                               uint64_t epoch)
{
    const epx_cuda_common_t *c = &a.c;
    if (last_block_arrive(counter))
        publish_peers(c, epoch, [&](int r) {
            epx_cuda_ctrl_t *peer = peer_ctrl(c, r);
            if (!a.cached)
                for (int d = 0; d < c->nranks; d++)
                    *(volatile int32_t *)&peer->disp_rows[c->rank][d] = a.h.send_count[d];
            st_relaxed_sys(&peer->disp_count[c->rank], (uint64_t)a.h.send_count[r]);
            st_release_sys(&peer->disp_flag[c->rank], epoch);
        });
}

/* Default sender. Threads r < R wait until receiver r released our slice of its area (previous
 * dispatch); then the block's warps write tokens (ht_send_rows); the last block publishes. */
__global__ void __launch_bounds__(kBlockThreads)
    dispatch_send_kernel(const __grid_constant__ epx_cuda_dispatch_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const kernel_frame f(c);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint64_t prev = ld_volatile_u64(&f.own->disp_last);
    post_call(c, f.epoch);
    const gate_unless bad{refuse_bad(c, a.cached ? nullptr : a.h.bad, f.epoch, EPX_CUDA_WAIT_BAD_EXPERT)};
    const int &ok = wait_peers(
        c, [&](int r) { return &f.own->disp_ack[r]; }, prev, f.epoch, EPX_CUDA_WAIT_DISPATCH_ACK, no_arrival(),
        bad);
    if (ok) ht_send_rows<false>(a, nullptr, nullptr, warp, lane);
    ht_finish_send(a, &f.own->done_counter[DONE_HT_SEND], f.epoch);
}

/* View-mode sender. Block 0's threads r < R tell peer r that our views of its earlier rows are
 * dead (our consumers ran before this kernel on our stream) and which view area our outputs go
 * to; threads r < R wait until receiver r said the same, block 0's post our per-destination
 * counts, and each reads from destination r the counts of the lower-ranked sources: their sum is
 * where our rows start in r's area. Then the block's warps write every token's rows once, into
 * their final rows. */
__global__ void __launch_bounds__(kBlockThreads)
    dispatch_view_send_kernel(const __grid_constant__ epx_cuda_dispatch_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, me = c->rank;
    const kernel_frame f(c);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint64_t closed = f.epoch - 1;
    const uint64_t prev = ld_volatile_u64(&f.own->view_last);
    __shared__ int counted;
    __shared__ int64_t base[EPX_CUDA_MAX_RANKS];
    __shared__ uint64_t area_off[EPX_CUDA_MAX_RANKS];
    if (threadIdx.x == 0) counted = 1;
    post_call(c, f.epoch);
    if (blockIdx.x == 0 && threadIdx.x < R) {
        epx_cuda_ctrl_t *peer = peer_ctrl(c, threadIdx.x);
        st_release_sys(&peer->view_area[me], f.epoch << 8 | (uint64_t)a.view_area);
        if (ld_volatile_u64(&peer->view_ack[me]) < closed) st_release_sys(&peer->view_ack[me], closed);
    }
    const gate_unless bad{refuse_bad(c, a.cached ? nullptr : a.h.bad, f.epoch, EPX_CUDA_WAIT_BAD_EXPERT)};
    const int &acked = wait_peers(
        c, [&](int r) { return &f.own->view_ack[r]; }, prev, f.epoch, EPX_CUDA_WAIT_DISPATCH_ACK, no_arrival(),
        bad);
    if (acked && blockIdx.x == 0 && threadIdx.x < R) {
        epx_cuda_ctrl_t *peer = peer_ctrl(c, threadIdx.x);
        st_relaxed_sys(&peer->disp_count[me], (uint64_t)a.h.send_count[threadIdx.x]);
        st_release_sys(&peer->cnt_flag[me], f.epoch);
    }
    if (acked && threadIdx.x < R) {
        epx_cuda_ctrl_t *peer = peer_ctrl(c, threadIdx.x);
        const uint64_t *posted = &f.own->view_area[threadIdx.x];
        if (wait_flag_geq(c, posted, f.epoch << 8, f.epoch, threadIdx.x, EPX_CUDA_WAIT_DISPATCH_ACK))
            area_off[threadIdx.x] = (ld_volatile_u64(posted) & 0xff) * c->lay.view_stride;
        else
            counted = 0;
        int64_t sum = 0;
        for (int s = 0; s < me; s++) {
            if (!wait_flag_geq(c, &peer->cnt_flag[s], f.epoch, f.epoch, s, EPX_CUDA_WAIT_DISPATCH_DATA)) {
                counted = 0;
                break;
            }
            sum += (int64_t)ld_volatile_u64(&peer->disp_count[s]);
        }
        base[threadIdx.x] = sum;
    }
    __syncthreads();
    if (acked && counted) ht_send_rows<true>(a, base, area_off, warp, lane);
    ht_finish_send(a, &f.own->view_done_counter[DONE_VIEW_SEND], f.epoch);
}

/* ----------------------------------------------------------------------------- receiver ---- */

/* A receiver's opening (all threads): zeroes the block's per-expert counts, waits for every
 * source's rows (thread s < R: source s) and prefixes their counts (a failed block counts none).
 * Returns the block's verdict. */
__device__ __forceinline__ const int &ht_open_recv(const epx_cuda_dispatch_args_t &a, int *expert_cnt,
                                                   bool want_counts, int *prefix, uint64_t epoch)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks;
    epx_cuda_ctrl_t *own = peer_ctrl(c, c->rank);
    __shared__ int cnt[EPX_CUDA_MAX_RANKS];
    if (want_counts)
        for (int j = threadIdx.x; j < c->num_local_experts; j += blockDim.x) expert_cnt[j] = 0;
    const int &ok = wait_peers(
        c, [&](int s) { return &own->disp_flag[s]; }, epoch, epoch, EPX_CUDA_WAIT_DISPATCH_DATA,
        [&](int s) {
            cnt[s] = (int)ld_volatile_u64(&own->disp_count[s]);
            return true;
        });
    if (threadIdx.x == 0) {
        prefix[0] = 0;
        for (int r = 0; r < R; r++) prefix[r + 1] = prefix[r] + (ok ? cnt[r] : 0);
    }
    __syncthreads();
    return ok;
}

/* A receiver's end: the block's per-expert counts go to the rank's scratch; the last block
 * publishes N_r (-1 after a failure) and, when `good`, the call's counts (aligned per expert),
 * the handle's rows and source prefix; it clears the scratch, releases every source (also after
 * a failure, so all ranks stay in step) and closes the collective. */
__device__ __forceinline__ void ht_finish_recv(const epx_cuda_dispatch_args_t &a, uint32_t *counter, bool ok,
                                               bool good, int64_t total, int64_t rows_valid,
                                               const int *prefix, const int *expert_cnt, bool want_counts,
                                               uint64_t epoch, uint64_t *also_last)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, L = c->num_local_experts;
    int32_t *scratch = (int32_t *)(c->peers[c->rank] + c->lay.expert_scratch);
    if (want_counts) {
        __syncthreads();
        for (int j = threadIdx.x; j < L; j += blockDim.x)
            if (expert_cnt[j]) atomicAdd(&scratch[j], expert_cnt[j]);
    }
    if (last_block_arrive(counter)) {
        if (threadIdx.x == 0) {
            if (!a.cached) a.h.bad[0] = 0; /* every block read it at its start */
            c->host->num_recv = ok ? total : -1;
            if (ok && a.static_mode && total > a.capacity) c->host->overflow = 1;
            if (a.num_recv_tokens && good) *a.num_recv_tokens = (int32_t)total;
            if (!a.cached) *a.h.rows_valid = (int32_t)rows_valid;
        }
        if (!a.cached)
            for (int r = threadIdx.x; r <= R; r += blockDim.x) a.h.recv_prefix[r] = good ? prefix[r] : 0;
        if (a.rank_prefix_matrix && good) {
            /* Column d: every source's row count for d (each row arrived before its source's flag). */
            epx_cuda_ctrl_t *own = peer_ctrl(c, c->rank);
            for (int d = threadIdx.x; d < R; d += blockDim.x) {
                int32_t sum = 0;
                for (int s = 0; s < R; s++)
                    a.rank_prefix_matrix[s * R + d] = sum += ld_volatile_i32(&own->disp_rows[s][d]);
            }
        }
        if (want_counts) {
            const int al = a.expert_alignment > 1 ? a.expert_alignment : 1;
            for (int j = threadIdx.x; j < L; j += blockDim.x) {
                const int v = ld_volatile_i32(&scratch[j]);
                if (good && a.num_recv_tokens_per_expert) a.num_recv_tokens_per_expert[j] = (v + al - 1) / al * al;
                if (good && a.host_expert_counts) a.host_expert_counts[j] = (v + al - 1) / al * al;
                scratch[j] = 0;
            }
        }
        finish_dispatch_recv(c, epoch, also_last);
    }
}

/* Default mode's copy-out: one warp per output row (the block's warps stride over the rows)
 * copies it out of its source's slice with its scales, ids and weights. Rows dropped by the static
 * bound (past `rows`) still count per expert (pinned) and keep their source token, so combine can
 * clear their slot on the source. */
__device__ __forceinline__ void ht_copy_out(const epx_cuda_dispatch_args_t &a, uint8_t *region,
                                            const int *prefix, int64_t meta_rows, int64_t rows,
                                            int *expert_cnt, bool want_counts)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, L = c->num_local_experts;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int ns = a.x_scales ? a.num_scales : 0;
    for (int64_t i = (int64_t)blockIdx.x * kBlockWarps + warp; i < meta_rows;
         i += (int64_t)gridDim.x * kBlockWarps) {
        const int s = source_of_row(prefix, R, i);
        const int64_t slot = (int64_t)s * c->max_tokens + (i - prefix[s]);
        const bool kept = i < rows;
        if (kept) {
            uint8_t *dst = a.recv_x + i * a.row_bytes;
            copy_fanout<4, false>(region + c->lay.disp_x + slot * c->lay.x_stride, &dst, 1, a.row_bytes,
                                  lane);
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
}

/* View mode's collection: the rows are already in place; one warp per row keeps its source index
 * for combine and counts it per local expert. */
__device__ __forceinline__ void ht_collect_view(const epx_cuda_dispatch_args_t &a, const uint8_t *region,
                                                int64_t total, int *expert_cnt, bool want_counts)
{
    const epx_cuda_common_t *c = &a.c;
    const int K = c->num_topk, L = c->num_local_experts;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (a.cached) return;
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

/* The outputs of a call whose topk_idx held a bad value (the send kernel refused it): every row the
 * outputs hold (views: the rows the call would return) and every count. */
__device__ __forceinline__ void ht_poison(const epx_cuda_dispatch_args_t &a, uint8_t *region, bool view)
{
    const epx_cuda_common_t *c = &a.c;
    const int K = c->num_topk;
    const int64_t rows = view ? (a.static_mode ? a.capacity : 0) : a.capacity;
    const int ns = a.x_scales ? a.num_scales : 0;
    poison_rows(view ? region + c->lay.view_x : a.recv_x, rows, a.row_bytes,
                nan_pattern((int)(a.row_bytes / c->hidden)));
    poison_rows(view ? (float *)(region + c->lay.view_scales) : a.recv_scales, ns ? rows : 0, ns * 4,
                nan_pattern(4));
    poison_rows(view ? (float *)(region + c->lay.view_w) : a.recv_topk_weights, rows, K * 4, nan_pattern(4));
    poison_rows(view ? (void *)(region + c->lay.view_idx) : a.recv_topk_idx, rows,
                K * (!view && a.recv_idx_is_64 ? 8 : 4), kPoisonIndex);
    poison_counts(a.num_recv_tokens_per_expert, c->num_local_experts);
    poison_counts(a.num_recv_tokens, 1);
    poison_counts(a.rank_prefix_matrix, (int64_t)c->nranks * c->nranks);
}

/* Receiver of either mode: threads s < R wait for source s's rows (ht_open_recv), the block's warps
 * copy rows out (default) or collect their metadata (view), the last block publishes. The default
 * mode first settles the row count with the peers (accept_counts): when N_r exceeds our outputs we
 * refuse and write nothing (the host call fails with EPX_ERR_INVALID_ARG), and a peer's refusal
 * fails ours (EPX_ERR_REMOTE) before we write anything; static mode keeps the first `capacity`
 * rows and only posts its acceptance. The view mode releases the default areas at once (it did not touch
 * them) and its own at our next view dispatch. */
template <bool kView>
__global__ void __launch_bounds__(kBlockThreads)
    dispatch_recv_kernel(const __grid_constant__ epx_cuda_dispatch_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const kernel_frame f(c);
    extern __shared__ int expert_cnt[]; /* [L] */
    __shared__ int prefix[EPX_CUDA_MAX_RANKS + 1];
    const bool want_counts = !a.cached && (a.num_recv_tokens_per_expert || a.host_expert_counts);
    const bool bad = !a.cached && *(const volatile int64_t *)a.h.bad != 0;
    const int &ok = ht_open_recv(a, expert_cnt, want_counts, prefix, f.epoch);
    const int64_t total = prefix[c->nranks];
    /* View mode: our outputs' area. */
    uint8_t *area = f.region + (kView ? (uint64_t)a.view_area * c->lay.view_stride : 0);
    if (bad) ht_poison(a, area, kView);
    if (kView) {
        const int64_t rows = total < a.capacity ? total : a.capacity;
        ht_collect_view(a, area, total, expert_cnt, want_counts);
        ht_finish_recv(a, &f.own->view_done_counter[DONE_VIEW_RECV], ok, ok, total, ok ? rows : 0, prefix,
                       expert_cnt, want_counts, f.epoch, &f.own->view_last);
    } else {
        const bool fits = a.static_mode || total <= a.capacity;
        const bool agreed = accept_counts(c, f.epoch, ok, fits, !a.static_mode);
        const int64_t rows = agreed ? (total < a.capacity ? total : a.capacity) : 0;
        ht_copy_out(a, f.region, prefix, (agreed && !a.cached) ? total : rows, rows, expert_cnt, want_counts);
        ht_finish_recv(a, &f.own->done_counter[DONE_HT_RECV], ok && (agreed || !fits), agreed, total, rows,
                       prefix, expert_cnt, want_counts, f.epoch, nullptr);
    }
}

extern "C" int epx_cuda_launch_dispatch(const epx_cuda_dispatch_args_t *args, void *stream)
{
    return launch_pair(dispatch_send_kernel, dispatch_recv_kernel<false>, args,
                       (size_t)args->c.num_local_experts * sizeof(int), stream);
}

extern "C" int epx_cuda_launch_dispatch_view(const epx_cuda_dispatch_args_t *args, void *stream)
{
    return launch_pair(dispatch_view_send_kernel, dispatch_recv_kernel<true>, args,
                       (size_t)args->c.num_local_experts * sizeof(int), stream);
}
