/*
 * What the HT and routing-map combines share: the sender's opening and end, the reducer's opening
 * and end, and the per-token reduce (a token's bf16 rows summed in a pinned order in one fp32
 * accumulator per channel, each step rounded, no fma, one rounding to bf16 at the end).
 */
#ifndef EPX_KERNELS_COMBINE_CUH
#define EPX_KERNELS_COMBINE_CUH

#include "kernels/common.cuh"

/* reduce_token's vector path for a token of few rows (n <= kBatch / kChunks): each lane takes kChunks
 * 16-byte columns at once (32 apart), so that kChunks * n loads are in flight where one column would
 * have n. The same sums in the same order per column as the one-column path. */
template <int kChunks, int kBatch, typename RowOf, typename WeightOf>
__device__ __forceinline__ void reduce_token_wide(uint16_t *out, int64_t H, int n, RowOf row_of,
                                                  bool weighted, WeightOf weight_of, const uint16_t *bias0,
                                                  const uint16_t *bias1, int64_t bias_row, int lane)
{
    constexpr int kRows = kBatch / kChunks;
    const int64_t nv = H / 8;
    for (int64_t i0 = lane; i0 < nv; i0 += 32 * kChunks) {
        int4 v[kChunks][kRows];
#pragma unroll
        for (int c = 0; c < kChunks; c++)
#pragma unroll
            for (int u = 0; u < kRows; u++)
                if (u < n && i0 + 32 * c < nv) v[c][u] = ld_nc_v4((const int4 *)row_of(u) + i0 + 32 * c);
#pragma unroll
        for (int c = 0; c < kChunks; c++) {
            const int64_t i = i0 + 32 * c;
            if (i >= nv) break;
            float acc[8];
#pragma unroll
            for (int q = 0; q < 8; q++) acc[q] = 0.0f;
#pragma unroll
            for (int u = 0; u < kRows; u++)
                if (u < n) acc_add_bf16x8(acc, v[c][u], weighted, weighted ? weight_of(u) : 0.0f);
            if (bias0) acc_add_bf16x8(acc, ld_nc_v4((const int4 *)(bias0 + bias_row) + i), false, 0.0f);
            if (bias1) acc_add_bf16x8(acc, ld_nc_v4((const int4 *)(bias1 + bias_row) + i), false, 0.0f);
            st_na_bf16x8((int4 *)out + i, acc);
        }
    }
}

/* One warp reduces one token: out[h] = bf16(sum over d < n of (weight_of(d) *) row_of(d)[h], d
 * ascending, then + bias0[bias_row + h] + bias1[bias_row + h] where given). `vec`: 16-byte loads
 * (H % 8 == 0, everything aligned). kBatch rows' loads are in flight before their adds; kGuarded
 * predicates each batch row by row (short lists keep their loads in flight too; a token of at most
 * kBatch / 2 rows takes several columns at once, reduce_token_wide), else whole batches run first and
 * the rest one row at a time. */
template <int kBatch, bool kGuarded, typename RowOf, typename WeightOf>
__device__ __forceinline__ void reduce_token(uint16_t *out, int64_t H, bool vec, int n, RowOf row_of,
                                             bool weighted, WeightOf weight_of, const uint16_t *bias0,
                                             const uint16_t *bias1, int64_t bias_row, int lane)
{
    if constexpr (kGuarded && kBatch >= 4 && kBatch % 4 == 0) {
        if (vec && n <= kBatch / 2) {
            reduce_token_wide<2, kBatch>(out, H, n, row_of, weighted, weight_of, bias0, bias1, bias_row,
                                         lane);
            return;
        }
    }
    if (vec) {
        for (int64_t i = lane; i < H / 8; i += 32) {
            float acc[8];
#pragma unroll
            for (int q = 0; q < 8; q++) acc[q] = 0.0f;
            int d = 0;
            if (kGuarded) {
                for (; d < n; d += kBatch) {
                    int4 v[kBatch];
#pragma unroll
                    for (int u = 0; u < kBatch; u++)
                        if (d + u < n) v[u] = ld_nc_v4((const int4 *)row_of(d + u) + i);
#pragma unroll
                    for (int u = 0; u < kBatch; u++)
                        if (d + u < n)
                            acc_add_bf16x8(acc, v[u], weighted, weighted ? weight_of(d + u) : 0.0f);
                }
            } else {
                for (; d + kBatch <= n; d += kBatch) {
                    int4 v[kBatch];
#pragma unroll
                    for (int u = 0; u < kBatch; u++) v[u] = ld_nc_v4((const int4 *)row_of(d + u) + i);
#pragma unroll
                    for (int u = 0; u < kBatch; u++)
                        acc_add_bf16x8(acc, v[u], weighted, weighted ? weight_of(d + u) : 0.0f);
                }
                for (; d < n; d++)
                    acc_add_bf16x8(acc, ld_nc_v4((const int4 *)row_of(d) + i), weighted,
                                   weighted ? weight_of(d) : 0.0f);
            }
            if (bias0) acc_add_bf16x8(acc, ld_nc_v4((const int4 *)(bias0 + bias_row) + i), false, 0.0f);
            if (bias1) acc_add_bf16x8(acc, ld_nc_v4((const int4 *)(bias1 + bias_row) + i), false, 0.0f);
            st_na_bf16x8((int4 *)out + i, acc);
        }
    } else {
        for (int64_t h = lane; h < H; h += 32) {
            float acc = 0.0f;
            for (int d = 0; d < n; d++) {
                const float y = epx_bf16_to_f32(row_of(d)[h]);
                acc = __fadd_rn(acc, weighted ? __fmul_rn(weight_of(d), y) : y);
            }
            if (bias0) acc = __fadd_rn(acc, epx_bf16_to_f32(bias0[bias_row + h]));
            if (bias1) acc = __fadd_rn(acc, epx_bf16_to_f32(bias1[bias_row + h]));
            out[h] = epx_f32_to_bf16(acc);
        }
    }
}

/* A combine sender's opening (all threads): the received rows' source prefix into shared memory,
 * then every source's release of its combine area from the previous combine. Returns the block's
 * verdict. */
__device__ __forceinline__ const int &
open_combine_send(const epx_cuda_common_t *c, const int32_t *recv_prefix, int *prefix, uint64_t epoch)
{
    epx_cuda_ctrl_t *own = peer_ctrl(c, c->rank);
    const uint64_t prev = ld_volatile_u64(&own->comb_last);
    for (int r = threadIdx.x; r <= c->nranks; r += blockDim.x) prefix[r] = recv_prefix[r];
    return wait_peers(
        c, [&](int r) { return &own->comb_ack[r]; }, prev, epoch, EPX_CUDA_WAIT_COMBINE_ACK);
}

/* A combine sender's end: the last block tells every source its rows are in place. */
__device__ __forceinline__ void finish_combine_send(const epx_cuda_common_t *c, uint32_t *counter,
                                                    uint64_t epoch)
{
    if (last_block_arrive(counter))
        publish_peers(c, epoch, [&](int r) { st_release_sys(&peer_ctrl(c, r)->comb_flag[c->rank], epoch); });
}

/* A combine reducer's opening: every rank's rows for our tokens have arrived. */
__device__ __forceinline__ const int &open_combine_reduce(const epx_cuda_common_t *c, uint64_t epoch)
{
    epx_cuda_ctrl_t *own = peer_ctrl(c, c->rank);
    return wait_peers(
        c, [&](int r) { return &own->comb_flag[r]; }, epoch, epoch, EPX_CUDA_WAIT_COMBINE_DATA);
}

/* A combine reducer's end (last block): every rank may write its slice of our combine area
 * again, and the collective closes. */
__device__ __forceinline__ void finish_combine_reduce(const epx_cuda_common_t *c, uint32_t *counter,
                                                      uint64_t epoch)
{
    if (last_block_arrive(counter)) {
        epx_cuda_ctrl_t *own = peer_ctrl(c, c->rank);
        release_if_failed(c, epoch);
        release_peers(
            c, [&](int r) { return &peer_ctrl(c, r)->comb_ack[c->rank]; }, epoch);
        close_epoch(own, &own->comb_last, epoch);
    }
}

#endif /* EPX_KERNELS_COMBINE_CUH */
