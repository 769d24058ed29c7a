/*
 * What the LL kernels share, within one node (src/kernels/ll.cu) and across nodes (src/kernels/ll_net.cu):
 * the LL ctrl, staged top-k ids, the fp8 cast and fan-out, warp copies, the benchmark timeline and the
 * poisoned outputs of a refused call.
 */
#ifndef EPX_KERNELS_LL_COMMON_CUH
#define EPX_KERNELS_LL_COMMON_CUH

#include "kernels/common.cuh"

enum { LL_DONE_DISP_SEND = 0, LL_DONE_DISP_RECV = 1, LL_DONE_COMB_SEND = 2, LL_DONE_COMB_RECV = 3 };

/* The receiver's row map packs a row's source and slot as s * 64 + k (k < EPX_MAX_TOPK). */
static_assert(EPX_MAX_TOPK == 64, "meta packs k in 6 bits");

__device__ __forceinline__ epx_cuda_ll_ctrl_t *ll_ctrl(const epx_cuda_ll_args_t &a, int r)
{
    return (epx_cuda_ll_ctrl_t *)(a.c.peers[r] + a.ll.ctrl);
}

__device__ __forceinline__ int64_t ll_topk(const epx_cuda_ll_args_t &a, int64_t i)
{
    return topk_at(a.topk_idx, a.idx_is_64, i);
}

/* The benchmark timeline of one kernel (a.stamps set): thread 0 of each block lowers the start at
 * entry, lane 0 of each warp raises the end on every way out (the destructor). */
struct ll_stamp {
    unsigned long long *p;
    __device__ __forceinline__ ll_stamp(const epx_cuda_ll_args_t &a, int kernel)
        : p(a.stamps ? a.stamps + 2 * kernel : nullptr)
    {
        if (p && threadIdx.x == 0) atomicMin(p, (unsigned long long)globaltimer_ns());
    }
    __device__ __forceinline__ ~ll_stamp()
    {
        if (p && (threadIdx.x & 31) == 0) atomicMax(p + 1, (unsigned long long)globaltimer_ns());
    }
};

/* Warp copy of `bytes` (16-byte vectors when aligned): kBatch vectors per lane are loaded before any
 * is stored. The dispatch's receive copies local rows with 8 (one latency for an fp8 row of up to
 * 4 KiB, two for 7 KiB: measured faster than 4); the combine's send stores into peers' memory with 4
 * (16 measured slower there: the stores, not the loads, bound it). */
template <int kBatch>
__device__ __forceinline__ void warp_copy(uint8_t *dst, const uint8_t *src, int64_t bytes, int lane)
{
    if (((bytes | (int64_t)(uintptr_t)dst | (int64_t)(uintptr_t)src) & 15) == 0) {
        const int64_t n16 = bytes >> 4;
        for (int64_t base = 0; base < n16; base += 32 * kBatch) {
            int4 v[kBatch];
#pragma unroll
            for (int u = 0; u < kBatch; u++) {
                const int64_t i = base + 32 * u + lane;
                if (i < n16) v[u] = ld_nc_v4((const int4 *)src + i);
            }
#pragma unroll
            for (int u = 0; u < kBatch; u++) {
                const int64_t i = base + 32 * u + lane;
                if (i < n16) st_na_v4((int4 *)dst + i, v[u]);
            }
        }
    } else {
        for (int64_t i = lane; i < bytes; i += 32) dst[i] = src[i];
    }
}

/* Casts 16 bf16 channels (two 16-byte loads) to 16 fp8 bytes; the 8 lanes of one 128-channel
 * group agree on its scale_inv (lanes 8g..8g+7 of the warp hold group g of the step). */
__device__ __forceinline__ int4 ll_cast16(int4 v0, int4 v1, int round_scale, float *scale_out)
{
    const uint32_t w[8] = {(uint32_t)v0.x, (uint32_t)v0.y, (uint32_t)v0.z, (uint32_t)v0.w,
                           (uint32_t)v1.x, (uint32_t)v1.y, (uint32_t)v1.z, (uint32_t)v1.w};
    float f[16];
#pragma unroll
    for (int q = 0; q < 8; q++) {
        f[2 * q] = epx_bf16_to_f32(w[q]);
        f[2 * q + 1] = epx_bf16_to_f32(w[q] >> 16);
    }
    float amax = 0.0f;
#pragma unroll
    for (int q = 0; q < 16; q++) amax = fmaxf(amax, fabsf(f[q]));
#pragma unroll
    for (int off = 4; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
    amax = fmaxf(amax, 1e-4f);
    float scale_inv = __fdiv_rn(amax, 448.0f);
    if (round_scale) {
        const uint32_t b = __float_as_uint(scale_inv);
        if (b & 0x7fffffu) scale_inv = __uint_as_float((b & 0x7f800000u) + 0x00800000u);
    }
    uint32_t o[4] = {0, 0, 0, 0};
#pragma unroll
    for (int q = 0; q < 16; q++)
        o[q >> 2] |= (uint32_t)epx_f32_to_fp8_e4m3(__fdiv_rn(f[q], scale_inv)) << (8 * (q & 3));
    *scale_out = scale_inv;
    return make_int4((int)o[0], (int)o[1], (int)o[2], (int)o[3]);
}

/* Writes channels [lo, hi) (multiples of 512, or H) of token t's row once per destination in
 * `rows` (n of them): bf16 bytes, or the fp8 cast (done once, fanned out) with its fp32 scales
 * after the H bytes. 16-byte stores. */
__device__ __forceinline__ void ll_fan_out(const epx_cuda_ll_args_t &a, const uint16_t *xrow,
                                           uint8_t *const *rows, int n, int64_t lo, int64_t hi, int lane)
{
    const int64_t H = a.c.hidden;
    if (a.use_fp8) {
        /* H % 128 == 0: a step of 512 channels is 4 whole groups, 16 channels per lane. */
        for (int64_t c0 = lo; c0 < hi; c0 += 512) {
            const int64_t c = c0 + lane * 16;
            const bool active = c < hi;
            int4 v0 = make_int4(0, 0, 0, 0), v1 = v0;
            if (active) {
                v0 = ld_nc_v4((const int4 *)(xrow + c));
                v1 = ld_nc_v4((const int4 *)(xrow + c) + 1);
            }
            float scale_inv;
            const int4 q = ll_cast16(v0, v1, a.round_scale, &scale_inv);
            if (active) {
                for (int d = 0; d < n; d++) {
                    st_na_v4((int4 *)(rows[d] + c), q);
                    if ((lane & 7) == 0) ((float *)(rows[d] + H))[c >> 7] = scale_inv;
                }
            }
        }
        return;
    }
    if ((((H * 2) | (int64_t)(uintptr_t)xrow) & 15) != 0) {
        for (int64_t i = lo + lane; i < hi; i += 32)
            for (int d = 0; d < n; d++) ((uint16_t *)rows[d])[i] = xrow[i];
        return;
    }
    const int64_t n16 = hi / 8;
    const int4 *src = (const int4 *)xrow;
    int64_t i = lo / 8 + lane;
    for (; i + 96 < n16; i += 128) {
        const int4 v0 = ld_nc_v4(src + i), v1 = ld_nc_v4(src + i + 32);
        const int4 v2 = ld_nc_v4(src + i + 64), v3 = ld_nc_v4(src + i + 96);
        for (int d = 0; d < n; d++) {
            int4 *dst = (int4 *)rows[d];
            st_na_v4(dst + i, v0);
            st_na_v4(dst + i + 32, v1);
            st_na_v4(dst + i + 64, v2);
            st_na_v4(dst + i + 96, v3);
        }
    }
    for (; i < n16; i += 32) {
        const int4 v = ld_nc_v4(src + i);
        for (int d = 0; d < n; d++) st_na_v4((int4 *)rows[d] + i, v);
    }
}

/* Tokens of the call that select expert e, each once (one warp, every lane gets the count). */
template <typename Topk>
__device__ __forceinline__ int ll_expert_count(Topk topk, int64_t e, int64_t T, int K, int lane)
{
    int n = 0;
    for (int64_t t = lane; t < T; t += 32) {
        bool hit = false;
        for (int k = 0; k < K && !hit; k++) hit = topk(t * K + k) == e;
        n += hit;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) n += __shfl_xor_sync(kFullMask, n, off);
    return n;
}

/* Token t's rows (one warp, all lanes): sel[k] its expert in slot k (first occurrence only, else -1),
 * pos[k] how many earlier tokens select sel[k] (its row in the expert's slice from us). `topk(i)`
 * reads entry i of the call's ids; sel and pos are the warp's shared arrays of EPX_MAX_TOPK. */
template <typename Topk>
__device__ __forceinline__ void ll_positions(Topk topk, int64_t t, int K, int E, int *sel, int *pos, int lane)
{
    for (int k = lane; k < K; k += 32) {
        const int64_t v = topk(t * K + k);
        bool first = v >= 0 && v < E;
        for (int q = 0; q < k && first; q++) first = topk(t * K + q) != v;
        sel[k] = first ? (int)v : -1;
        pos[k] = 0;
    }
    __syncwarp();
    /* Lane u looks at earlier tokens u, u + 32, ...: a bit per slot of t they share. */
    for (int64_t u = lane; u < t; u += 32) {
        uint64_t mask = 0;
        for (int q = 0; q < K; q++) {
            const int64_t v = topk(u * K + q);
            if (v < 0) continue;
            for (int k = 0; k < K; k++)
                if (sel[k] == v) mask |= 1ull << k;
        }
        while (mask) {
            const int k = __ffsll((long long)mask) - 1;
            mask &= mask - 1;
            atomicAdd(&pos[k], 1);
        }
    }
    __syncwarp();
}

/* topk_idx entries a send kernel stages in shared memory (a call with more reads global memory). */
constexpr int kLlStage = 2048;

/* Stages the call's topk_idx in `buf` as int32 (an id outside [-1, E) becomes -2, which is as bad),
 * so that the id checks, the counts and the row positions read shared memory instead of chains of
 * global loads. Returns buf, or NULL (the same in every thread) when the call has more than
 * kLlStage entries. All threads. */
__device__ __forceinline__ const int32_t *ll_stage_topk(const epx_cuda_ll_args_t &a, int32_t *buf)
{
    const int64_t n = a.num_tokens * a.c.num_topk;
    if (n > kLlStage) return nullptr;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const int64_t v = ll_topk(a, i);
        buf[i] = v < -1 || v >= a.num_experts ? -2 : (int32_t)v;
    }
    __syncthreads();
    return buf;
}

/* True in a receive half whose send half refused the call (`epoch`: the slot's call). */
__device__ __forceinline__ bool ll_refused(const epx_cuda_ll_args_t &a, uint64_t epoch, int which)
{
    return ld_volatile_u64(&ll_ctrl(a, a.c.rank)->refused[a.slot][which]) == epoch;
}

/* The receive outputs of a dispatch this rank refused never look like data: rows and scales NaN,
 * src_info -1 (recv_count is -1 like after every failed receive). */
__device__ __forceinline__ void ll_poison_recv(const epx_cuda_ll_args_t &a)
{
    const int64_t L = a.c.num_local_experts, RT = (int64_t)a.c.nranks * a.c.max_tokens, H = a.c.hidden;
    poison_rows(a.recv_x, L * RT, a.use_fp8 ? H : 2 * H, nan_pattern(a.use_fp8 ? 1 : 2));
    if (a.use_fp8)
        poison_rows(a.recv_scales, L * RT, a.use_ue8m0 ? H / 512 * 4 : H / 128 * 4,
                    a.use_ue8m0 ? 0xffffffffu : nan_pattern(4)); /* ue8m0 NaN: 0xff */
    poison_rows(a.src_info, a.src_info ? L * RT : 0, 4, kPoisonIndex);
}

/* A dispatch receiver's body (all threads; `ok` the block's verdict on its waits): block b serves local
 * experts b, b + gridDim.x, ...; thread 0 turns the counts (`counts` [R][L], the slot's) into each
 * source's first row and the block's warps copy the slice rows (`disp` [L][R][T_max] rows, the slot's)
 * out packed (warp w: rows w, w + 16, ...), with scales in the grouped-GEMM layout, src_info and the
 * private (t, s, k) map for the combine. A failed receive writes recv_count -1. */
__device__ __forceinline__ void ll_unpack(const epx_cuda_ll_args_t &a, bool ok, const int32_t *counts,
                                          const uint8_t *disp)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, L = c->num_local_experts, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t H = c->hidden, RT = (int64_t)R * c->max_tokens, stride = (int64_t)a.ll.row_stride;
    const int64_t G = H / 128, xb = a.use_fp8 ? H : 2 * H;
    uint8_t *region = c->peers[me];
    __shared__ int prefix[EPX_CUDA_MAX_RANKS + 1];
    __shared__ int cnt[EPX_CUDA_MAX_RANKS];
    int32_t *rcount = (int32_t *)(region + a.ll.rcount) + (int64_t)a.slot * L;
    int2 *meta = (int2 *)(region + a.ll.meta) + (int64_t)a.slot * L * RT;
    for (int j = blockIdx.x; j < L; j += gridDim.x) {
        if ((int)threadIdx.x < R)
            cnt[threadIdx.x] = ok ? ld_volatile_i32(&counts[(int64_t)threadIdx.x * L + j]) : 0;
        __syncthreads();
        if (threadIdx.x == 0) {
            prefix[0] = 0;
            for (int s = 0; s < R; s++) prefix[s + 1] = prefix[s] + cnt[s];
            const int total = prefix[R];
            /* A failed receive must not look like an empty expert: -1 (the error record says why). */
            a.recv_count[j] = ok ? total : -1;
            rcount[j] = total;
            if (a.cumulative && ok) a.cumulative[j] += total;
        }
        __syncthreads();
        if (a.layout_range && (int)threadIdx.x < R) {
            const int s = threadIdx.x;
            a.layout_range[(int64_t)j * R + s] = cnt[s] ? ((int64_t)prefix[s] << 32) | cnt[s] : 0;
        }
        const int total = prefix[R];
        for (int q = warp; q < total; q += kBlockWarps) {
            const int s = source_of_row(prefix, R, q);
            const uint8_t *src = disp + (((int64_t)j * R + s) * c->max_tokens + (q - prefix[s])) * stride;
            const int64_t out_row = (int64_t)j * RT + q;
            /* The row's (t, k) and, for rows of up to 64 scale groups, its scales are loaded before
             * the copy's loads, so all are in flight together. */
            const float *sc = (const float *)(src + H);
            const int2 tk = lane == 0 ? *(const int2 *)(src + stride - 16) : make_int2(0, 0);
            float sc0 = 0.0f, sc1 = 0.0f;
            const bool early = a.use_fp8 && !a.use_ue8m0 && G <= 64;
            if (early) {
                if (lane < G) sc0 = sc[lane];
                if (lane + 32 < G) sc1 = sc[lane + 32];
            }
            warp_copy<8>((uint8_t *)a.recv_x + out_row * xb, src, xb, lane);
            if (early) {
                float *out = (float *)a.recv_scales + (int64_t)j * G * RT + q;
                if (lane < G) out[(int64_t)lane * RT] = sc0;
                if (lane + 32 < G) out[(int64_t)(lane + 32) * RT] = sc1;
            } else if (a.use_fp8) {
                if (a.use_ue8m0) {
                    for (int64_t g4 = lane; g4 < G / 4; g4 += 32) {
                        uint32_t packed = 0;
#pragma unroll
                        for (int u = 0; u < 4; u++)
                            packed |= ((__float_as_uint(sc[g4 * 4 + u]) >> 23) & 0xffu) << (8 * u);
                        ((int32_t *)a.recv_scales)[((int64_t)j * (H / 512) + g4) * RT + q] = (int32_t)packed;
                    }
                } else {
                    for (int64_t g = lane; g < G; g += 32)
                        ((float *)a.recv_scales)[((int64_t)j * G + g) * RT + q] = sc[g];
                }
            }
            if (lane == 0) {
                if (a.src_info) a.src_info[out_row] = tk.x;
                meta[(int64_t)j * RT + q] = make_int2(tk.x, s * 64 + tk.y);
            }
        }
        __syncthreads();
    }
}

/* A combine source's body (all threads): warps take (token, 1024-channel chunk) items, grid-strided, and
 * sum w[t,k] * y(t, k) over the slots k ascending from `area` ([T_max][K][H] bf16, the slot's) in one
 * fp32 accumulator per channel (no fma), one rounding to bf16; the rows' loads are issued before the
 * ordered sums. Without `ok` it writes bf16 NaN rows, never plausible values. */
__device__ __forceinline__ void ll_reduce(const epx_cuda_ll_args_t &a, bool ok, const uint16_t *area)
{
    const epx_cuda_common_t *c = &a.c;
    const int K = c->num_topk, E = a.num_experts;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t H = c->hidden, T = a.num_tokens;
    __shared__ float wsel[kBlockWarps][EPX_MAX_TOPK];
    __shared__ int ksel[kBlockWarps][EPX_MAX_TOPK];
    const bool vec = (H & 7) == 0 && ((uintptr_t)a.combined_x & 15) == 0;
    const int64_t chunk = vec ? 1024 : 32, nch = (H + chunk - 1) / chunk;
    const int64_t items = T * nch;
    for (int64_t it = (int64_t)blockIdx.x * kBlockWarps + warp; it < items;
         it += (int64_t)gridDim.x * kBlockWarps) {
        const int64_t t = it / nch, h0 = (it % nch) * chunk;
        if (!ok) {
            for (int64_t h = h0 + lane; h < H && h < h0 + chunk; h += 32) a.combined_x[t * H + h] = 0x7fc0;
            continue;
        }
        int n = 0;
        for (int k0 = 0; k0 < K; k0 += 32) {
            const int k = k0 + lane;
            const int64_t e = k < K ? ll_topk(a, t * K + k) : -1;
            const bool in = e >= 0 && e < E;
            const int at = warp_slot(in, n);
            if (in) {
                ksel[warp][at] = k;
                wsel[warp][at] = a.topk_weights[t * K + k];
            }
        }
        __syncwarp();
        const uint16_t *rows = area + t * K * H;
        if (vec) {
            /* Lane covers channels h0 + 8 * (lane + 32 m), m < 4. */
            float acc[4][8];
#pragma unroll
            for (int m = 0; m < 4; m++)
#pragma unroll
                for (int q = 0; q < 8; q++) acc[m][q] = 0.0f;
            for (int d0 = 0; d0 < n; d0 += 2) {
                int4 v[2][4];
#pragma unroll
                for (int u = 0; u < 2; u++)
#pragma unroll
                    for (int m = 0; m < 4; m++) {
                        const int64_t h = h0 + 8 * (lane + 32 * m);
                        v[u][m] = make_int4(0, 0, 0, 0);
                        if (d0 + u < n && h < H)
                            v[u][m] = ld_nc_v4((const int4 *)(rows + (int64_t)ksel[warp][d0 + u] * H + h));
                    }
#pragma unroll
                for (int u = 0; u < 2; u++) {
                    if (d0 + u >= n) break;
                    const float w = wsel[warp][d0 + u];
#pragma unroll
                    for (int m = 0; m < 4; m++) acc_add_bf16x8(acc[m], v[u][m], true, w);
                }
            }
#pragma unroll
            for (int m = 0; m < 4; m++) {
                const int64_t h = h0 + 8 * (lane + 32 * m);
                if (h >= H) continue;
                st_na_bf16x8((int4 *)(a.combined_x + t * H + h), acc[m]);
            }
        } else {
            const int64_t h = h0 + lane;
            if (h < H) {
                float acc = 0.0f;
                for (int d = 0; d < n; d++)
                    acc = __fadd_rn(
                        acc, __fmul_rn(wsel[warp][d], epx_bf16_to_f32(rows[(int64_t)ksel[warp][d] * H + h])));
                a.combined_x[t * H + h] = epx_f32_to_bf16(acc);
            }
        }
        __syncwarp();
    }
}

#endif /* EPX_KERNELS_LL_COMMON_CUH */
