/*
 * The HT row writer: one warp per token writes the token's copies into its destinations' areas,
 * for the default and view-mode dispatch senders and, without metadata, the benchmark's
 * same-bytes ceiling (which must move exactly the rows the real sender moves).
 */
#ifndef EPX_KERNELS_HT_CUH
#define EPX_KERNELS_HT_CUH

#include "kernels/common.cuh"

/* One warp per token (the block's warps stride over the tokens): finds the token's destinations,
 * writes its remapped ids, weights and source index (unless cached) and its scales at its row
 * there (kMeta), and fans its bytes out to all of them, each 16-byte vector read once. The row is
 * the sender's slice [me][row] of the disp_* areas, or in view mode base[r] + row of the view_*
 * arrays of the area at byte offset area_off[r] past area 0 (rows past the area are not sent). */
template <bool kView, bool kMeta = true>
__device__ __forceinline__ void ht_send_rows(const epx_cuda_dispatch_args_t &a, const int64_t *base,
                                             const uint64_t *area_off, int warp, int lane)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, L = c->num_local_experts, me = c->rank;
    const int E = L * R;
    const int ns = a.x_scales ? a.num_scales : 0;
    const int64_t cap = (int64_t)R * c->max_tokens;
    const uint64_t x_area = kView ? c->lay.view_x : c->lay.disp_x;
    const uint64_t idx_area = kView ? c->lay.view_idx : c->lay.disp_idx;
    const uint64_t w_area = kView ? c->lay.view_w : c->lay.disp_w;
    const uint64_t src_area = kView ? c->lay.view_src : c->lay.disp_src;
    const uint64_t scales_area = kView ? c->lay.view_scales : c->lay.disp_scales;
    __shared__ int dst_rank[kBlockWarps][EPX_CUDA_MAX_RANKS];
    __shared__ uint8_t *dst_ptr[kBlockWarps][EPX_CUDA_MAX_RANKS];
    __shared__ int64_t dst_row[kBlockWarps][EPX_CUDA_MAX_RANKS];
    for (int64_t t = (int64_t)blockIdx.x * kBlockWarps + warp; t < a.num_tokens;
         t += (int64_t)gridDim.x * kBlockWarps) {
        int n = 0;
        for (int r0 = 0; r0 < R; r0 += 32) {
            const int r = r0 + lane;
            const int row = r < R ? a.h.send_row[t * R + r] : -1;
            const int64_t at = kView ? (row >= 0 ? base[r] + row : -1) : (int64_t)me * c->max_tokens + row;
            const bool in = kView ? at >= 0 && at < cap : row >= 0;
            const int pos = warp_slot(in, n);
            if (in) {
                if (kMeta) {
                    dst_rank[warp][pos] = r;
                    dst_row[warp][pos] = at;
                }
                dst_ptr[warp][pos] = c->peers[r] + (kView ? area_off[r] : 0) + x_area +
                                     at * (kView ? a.row_bytes : (int64_t)c->lay.x_stride);
            }
        }
        __syncwarp();
        for (int d = 0; d < n && kMeta; d++) {
            const int r = dst_rank[warp][d];
            const int64_t row = dst_row[warp][d];
            uint8_t *peer = c->peers[r] + (kView ? area_off[r] : 0);
            if (!a.cached) {
                for (int k = lane; k < K; k += 32) {
                    const int64_t e = topk_at(a.topk_idx, a.idx_is_64, t * K + k);
                    const int loc = (expert_ok(e, E) && e / L == r) ? (int)(e % L) : -1;
                    ((int32_t *)(peer + idx_area))[row * K + k] = loc;
                    ((float *)(peer + w_area))[row * K + k] =
                        (a.topk_weights && loc >= 0) ? a.topk_weights[t * K + k] : 0.0f;
                }
                if (lane == 0) ((int32_t *)(peer + src_area))[row] = (int32_t)t;
            }
            for (int j = lane; j < ns; j += 32)
                ((float *)(peer + scales_area))[row * ns + j] = a.x_scales[t * ns + j];
        }
        copy_fanout<4, false>(a.x + t * a.row_bytes, dst_ptr[warp], n, a.row_bytes, lane);
        __syncwarp();
    }
}

#endif /* EPX_KERNELS_HT_CUH */
