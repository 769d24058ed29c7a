/*
 * Routing-map dispatch (with or without fused permute) and its combine on the cuda backend.
 * The sender scans its bool routing map per 32-token tile (rows by ballot prefix, never atomics,
 * so every order is the pinned one), writes each token once per destination rank into the
 * receiver's [source][row] slice with the token's local expert ids and their rows among the
 * source's tokens of that expert. The receiver's copy-out writes every row straight to its
 * final place: HT order, or its expert group(s) of the padded permuted layout. A rank's own
 * tokens are never copied into its own slice: its copy-out reads them from `hidden`. Combine
 * pushes remote rows back into the source's area; the source reduces in fp32 in the pinned
 * order, reading its own rows straight from the permuted input. Copies keep 8 independent
 * 16-byte loads in flight per lane (bandwidth needs bytes in flight, not threads).
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/combine.cuh"

#define RM_UNROLL 8

/* Copies n rows of `bytes`: src[d] (NULL: zeros) to dst[d], the rows' vectors flattened so a
 * lane has RM_UNROLL loads in flight even across short rows. */
static __device__ __forceinline__ void rm_copy_pairs(const uint8_t *const *src, uint8_t *const *dst, int n,
                                                     int64_t bytes, int lane)
{
    if (n == 0) return;
    uintptr_t align = 0;
    for (int d = 0; d < n; d++) align |= (uintptr_t)src[d] | (uintptr_t)dst[d];
    if ((bytes & 15) == 0 && (align & 15) == 0 && (bytes >> 4) * n < 0x7fffffff) {
        /* 32-bit index math: a 64-bit division per vector costs more registers than the data */
        const uint32_t n16 = (uint32_t)(bytes >> 4), total = n16 * (uint32_t)n;
        for (uint32_t i = lane; i < total; i += 32 * RM_UNROLL) {
            int4 v[RM_UNROLL];
#pragma unroll
            for (int u = 0; u < RM_UNROLL; u++) {
                const uint32_t j = i + u * 32, d = j / n16;
                if (j < total) {
                    const int4 *s = (const int4 *)src[d];
                    v[u] = s ? ld_nc_v4(s + (j - d * n16)) : make_int4(0, 0, 0, 0);
                }
            }
#pragma unroll
            for (int u = 0; u < RM_UNROLL; u++) {
                const uint32_t j = i + u * 32, d = j / n16;
                if (j < total) st_na_v4((int4 *)dst[d] + (j - d * n16), v[u]);
            }
        }
    } else {
        for (int d = 0; d < n; d++) copy_fanout<RM_UNROLL, true>(src[d], &dst[d], 1, bytes, lane);
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

/* The 16 map bytes of experts [e0, e0 + 16) of a token's row as four words (zeros past E). */
static __device__ __forceinline__ uint4 rm_map16(const uint8_t *row, int e0, int E, bool vec, bool live)
{
    uint4 w = make_uint4(0, 0, 0, 0);
    if (!live) return w;
    if (vec) return *(const uint4 *)(row + e0);
    uint32_t q4[4] = {0, 0, 0, 0};
    for (int q = 0; q < 16 && e0 + q < E; q++) q4[q >> 2] |= (uint32_t)row[e0 + q] << (8 * (q & 3));
    return make_uint4(q4[0], q4[1], q4[2], q4[3]);
}

/* One block per tile of 32 tokens (grid-strided), lane = token. The block's warps split the experts
 * in chunks (a multiple of 16 each): every warp counts its chunk's entries per token, a prefix over the
 * warps gives each token's entries before the chunk, then every warp walks its chunk: experts in
 * ascending order (the first K selected ones), each with its row among the tile's tokens of that
 * expert. Warp 0 then does the ranks. A warp walks E / 16 experts, not E: the walk is a chain of
 * ballots and stores, one latency each. */
__global__ void __launch_bounds__(kBlockThreads) rm_scan_kernel(const __grid_constant__ epx_cuda_rm_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, L = c->num_local_experts, E = a.num_experts;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t ntiles = rm_tiles(a.num_tokens), W = E + R;
    int32_t *cnt = rm_scratch(c);
    /* 16 map bytes per load where rows are 16-byte aligned. */
    const bool vec = (E & 15) == 0 && ((uintptr_t)a.routing_map & 15) == 0;
    const int chunk = (E + kBlockWarps * 16 - 1) / (kBlockWarps * 16) * 16;
    const int e_begin = warp * chunk < E ? warp * chunk : E, e_end = e_begin + chunk < E ? e_begin + chunk : E;
    __shared__ int part[kBlockWarps][32];        /* entries of warp w's chunk, per token */
    __shared__ unsigned long long ranks_of[32]; /* destination ranks, per token */
    for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        const int64_t t = tile * 32 + lane;
        const bool live = t < a.num_tokens;
        const uint8_t *row = a.routing_map + (live ? t : 0) * E;
        int mine = 0;
        for (int e0 = e_begin; e0 < e_end; e0 += 16) {
            const uint4 w = rm_map16(row, e0, E, vec, live);
            /* nonzero bytes: 0xff per byte that differs from 0 (bytes past E are zeros) */
            mine += (__popc(__vcmpne4(w.x, 0)) + __popc(__vcmpne4(w.y, 0)) + __popc(__vcmpne4(w.z, 0)) +
                     __popc(__vcmpne4(w.w, 0))) >> 3;
        }
        part[warp][lane] = mine;
        if (warp == 0) ranks_of[lane] = 0;
        __syncthreads();
        /* seen: the token's entries before the one at hand, in ascending expert order */
        int seen = 0, total = 0;
        for (int w = 0; w < kBlockWarps; w++) {
            const int n = part[w][lane];
            seen += w < warp ? n : 0;
            total += n;
        }
        uint64_t rmask = 0;
        for (int e0 = e_begin; e0 < e_end; e0 += 16) {
            const uint4 w4 = rm_map16(row, e0, E, vec, live);
            const uint32_t w[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
            for (int q = 0; q < 16; q++) {
                const int e = e0 + q;
                if (e >= e_end) break;
                const bool set = ((w[q >> 2] >> (8 * (q & 3))) & 0xffu) != 0;
                const bool v = set && seen < K;
                /* The token's first entry past K: the row is bad, the call fails on the device. */
                if (set && seen == K && atomicCAS((unsigned long long *)a.h.bad, 0ull, (unsigned long long)(1 + t)) == 0ull)
                    a.h.bad[1] = e;
                const unsigned b = __ballot_sync(kFullMask, v);
                if (lane == 0) cnt[tile * W + e] = __popc(b);
                if (v) {
                    a.h.src_sel[t * K + seen] = e;
                    a.h.src_within[t * K + seen] = __popc(b & lanemask_lt());
                    a.h.src_prob[t * K + seen] = a.probs ? a.probs[t * E + e] : 0.0f;
                    rmask |= 1ull << (e / L);
                }
                seen += set;
            }
        }
        if (rmask) atomicOr(&ranks_of[lane], (unsigned long long)rmask);
        __syncthreads();
        if (warp == 0) {
            if (live)
                for (int k = total < K ? total : K; k < K; k++) {
                    a.h.src_sel[t * K + k] = -1;
                    a.h.src_within[t * K + k] = 0;
                    a.h.src_prob[t * K + k] = 0.0f;
                }
            const uint64_t rm = ranks_of[lane];
            for (int r = 0; r < R; r++) {
                const bool v = (rm >> r) & 1;
                const unsigned b = __ballot_sync(kFullMask, v);
                if (lane == 0) cnt[tile * W + E + r] = __popc(b);
                if (live) a.h.send_row[t * R + r] = v ? __popc(b & lanemask_lt()) : -1;
            }
        }
        __syncthreads(); /* part and ranks_of are the next tile's */
    }
}

/* One warp per column (expert, then rank): the exclusive prefix over tiles, 32 tiles per step
 * by shuffles (a serial walk costs one memory latency per tile), and the column's total. */
__global__ void __launch_bounds__(kBlockThreads)
    rm_prefix_kernel(const __grid_constant__ epx_cuda_rm_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int64_t W = a.num_experts + c->nranks, ntiles = rm_tiles(a.num_tokens);
    const int lane = threadIdx.x & 31;
    int32_t *cnt = rm_scratch(c), *tot = rm_totals(c, a.num_experts);
    for (int64_t col = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; col < W;
         col += (int64_t)gridDim.x * blockDim.x / 32) {
        int32_t run = 0;
        for (int64_t t0 = 0; t0 < ntiles; t0 += 32) {
            const int64_t tile = t0 + lane;
            const int32_t v = tile < ntiles ? cnt[tile * W + col] : 0;
            int32_t incl = v;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int32_t y = __shfl_up_sync(kFullMask, incl, o);
                if (lane >= o) incl += y;
            }
            if (tile < ntiles) cnt[tile * W + col] = run + incl - v;
            run += __shfl_sync(kFullMask, incl, 31);
        }
        if (lane == 0) tot[col] = run;
    }
}

/* Sender. Threads r < R wait until receiver r released our slice (previous dispatch). Then one
 * warp per token (grid-strided) writes metadata and the row into each destination's slice; the
 * last block publishes the per-expert counts, the signature and the row count, then the epoch. */
__global__ void __launch_bounds__(kBlockThreads) rm_send_kernel(const __grid_constant__ epx_cuda_rm_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, L = c->num_local_experts, E = a.num_experts, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t W = E + R;
    const kernel_frame f(c);
    const uint64_t prev = ld_volatile_u64(&f.own->disp_last);
    const int32_t *base = rm_scratch(c);
    __shared__ int dst_rank[kBlockWarps][EPX_CUDA_MAX_RANKS];
    __shared__ uint8_t *dst_ptr[kBlockWarps][EPX_CUDA_MAX_RANKS];
    __shared__ int64_t dst_slot[kBlockWarps][EPX_CUDA_MAX_RANKS];
    post_call(c, f.epoch);
    const gate_unless bad{refuse_bad(c, a.h.bad, f.epoch, EPX_CUDA_WAIT_BAD_MAP)};
    const int &ok = wait_peers(
        c, [&](int r) { return &f.own->disp_ack[r]; }, prev, f.epoch, EPX_CUDA_WAIT_DISPATCH_ACK, no_arrival(),
        bad);
    const int ns = a.scales ? a.num_scales : 0;
    if (ok) {
        for (int64_t t = (int64_t)blockIdx.x * kBlockWarps + warp; t < a.num_tokens;
             t += (int64_t)gridDim.x * kBlockWarps) {
            const int64_t tile = t / 32;
            int n = 0, ncopy = 0;
            for (int r0 = 0; r0 < R; r0 += 32) {
                const int r = r0 + lane;
                const int row = r < R ? a.h.send_row[t * R + r] : -1;
                const unsigned b = __ballot_sync(kFullMask, row >= 0);
                const unsigned bc = __ballot_sync(kFullMask, row >= 0 && r != me);
                if (row >= 0) {
                    const int pos = n + __popc(b & lanemask_lt());
                    const int64_t slot = (int64_t)me * c->max_tokens + row + base[tile * W + E + r];
                    dst_rank[warp][pos] = r;
                    dst_slot[warp][pos] = slot;
                    /* our own copy-out reads the row from hidden */
                    if (r != me)
                        dst_ptr[warp][ncopy + __popc(bc & lanemask_lt())] =
                            c->peers[r] + c->lay.disp_x + slot * c->lay.x_stride;
                }
                n += __popc(b);
                ncopy += __popc(bc);
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
                if (r != me)
                    for (int j = lane; j < ns; j += 32)
                        ((float *)(peer + c->lay.disp_scales))[slot * ns + j] = a.scales[t * ns + j];
            }
            copy_fanout<RM_UNROLL, true>(a.hidden + t * a.row_bytes, dst_ptr[warp], ncopy, a.row_bytes, lane);
            __syncwarp();
        }
    }
    if (last_block_arrive(&f.own->done_counter[EPX_CUDA_RM_DONE_SEND])) {
        __shared__ int good;
        if (threadIdx.x == 0) good = !epoch_failed(c, f.epoch);
        __syncthreads();
        const int32_t *tot = rm_totals(c, E);
        if (good) {
            for (int i = threadIdx.x; i < E; i += blockDim.x)
                ((int32_t *)(c->peers[i / L] + c->lay.rm_cnt))[me * L + i % L] = tot[i];
        }
        __threadfence_system();
        __syncthreads();
        if (good && threadIdx.x < R) {
            epx_cuda_ctrl_t *peer = peer_ctrl(c, threadIdx.x);
            st_relaxed_sys(&peer->disp_count[me], (uint64_t)tot[E + threadIdx.x]);
            st_release_sys(&peer->disp_flag[me], f.epoch);
        }
    }
}

/* ---------------------------------------------------------------------- receiver ---- */

/* Receiver. Threads s < R wait for source s's epoch, row count and signature; thread j < L (then
 * thread 0) finds local expert j's padded group start and each source's first row inside the
 * group (dynamic shared memory). Then one warp per received row (grid-strided) copies it once to
 * its HT row or to each of its groups; each warp then zeroes 32-row stretches of padding and rows
 * past the real count. The last block writes counts, the handle's totals, releases every source's
 * slice and closes the epoch. */
__global__ void __launch_bounds__(kBlockThreads) rm_recv_kernel(const __grid_constant__ epx_cuda_rm_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, L = c->num_local_experts, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const kernel_frame f(c);
    extern __shared__ int rm_smem[];
    int *gb = rm_smem;      /* [L + 1] padded group starts */
    int *cntj = gb + L + 1; /* [L] real rows per group */
    int *sb = cntj + L;     /* [R][L] first row of source s in group j */
    __shared__ int prefix[EPX_CUDA_MAX_RANKS + 1];
    __shared__ int cnt[EPX_CUDA_MAX_RANKS];
    __shared__ uint8_t *dst_ptr[kBlockWarps][EPX_MAX_TOPK];
    __shared__ int64_t dst_row[kBlockWarps][EPX_MAX_TOPK];
    __shared__ float dst_w[kBlockWarps][EPX_MAX_TOPK];
    const bool bad = *(const volatile int64_t *)a.h.bad != 0; /* our routing map: the sender refused */
    /* Source s's rows are usable when its call (dtype, permute, probs) matches ours (the wait
     * compares the call words). */
    const int &ok = wait_peers(
        c, [&](int s) { return &f.own->disp_flag[s]; }, f.epoch, f.epoch, EPX_CUDA_WAIT_DISPATCH_DATA,
        [&](int s) {
            cnt[s] = (int)ld_volatile_u64(&f.own->disp_count[s]);
            return true;
        });
    if (threadIdx.x == 0) {
        prefix[0] = 0;
        for (int r = 0; r < R; r++) prefix[r + 1] = prefix[r] + (ok ? cnt[r] : 0);
    }
    if (a.permute) {
        const int32_t *rc = (const int32_t *)(f.region + c->lay.rm_cnt);
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
    /* Without a bound the outputs must hold every row, else we refuse the call and write nothing
     * (the host reports it; the peers fail with EPX_ERR_REMOTE before writing: accept_counts); with
     * one, rows past it are dropped. */
    const bool fits = a.bounded || real <= a.limit;
    const bool writable = accept_counts(c, f.epoch, ok, fits, !a.bounded);
    const bool counted = ok && (writable || !fits); /* N_r is ours to report */
    const int64_t lim = writable ? a.limit : 0;
    const int ns = a.out_scales ? a.num_scales : 0;
    const uint8_t *dx = f.region + c->lay.disp_x;
    const float *dscales = (const float *)(f.region + c->lay.disp_scales);
    const int32_t *didx = (const int32_t *)(f.region + c->lay.disp_idx);
    const float *dw = (const float *)(f.region + c->lay.disp_w);
    const int32_t *dwithin = (const int32_t *)(f.region + c->lay.rm_within);
    const int32_t *dsrc = (const int32_t *)(f.region + c->lay.disp_src);
    const int64_t nrows = writable ? total : 0;
    for (int64_t i = (int64_t)blockIdx.x * kBlockWarps + warp; i < nrows;
         i += (int64_t)gridDim.x * kBlockWarps) {
        const int s = source_of_row(prefix, R, i);
        const int64_t slot = (int64_t)s * c->max_tokens + (i - prefix[s]);
        const int64_t t = dsrc[slot];
        /* Our own tokens were not copied into our slice: read them where they are. */
        const uint8_t *src = s == me ? a.hidden + t * a.row_bytes : dx + slot * c->lay.x_stride;
        const float *sscales = s == me ? a.scales + t * a.num_scales : dscales + slot * ns;
        if (lane == 0) {
            a.h.recv_src[i] = (int32_t)t;
            if (s == me) a.h.local_row[t] = (int32_t)i;
        }
        if (a.local_map) /* every received row, whatever the bound: its local experts */
            for (int j = lane; j < L; j += 32) {
                uint8_t sel = 0;
                for (int k = 0; k < K; k++) sel |= didx[slot * K + k] == j;
                a.local_map[i * L + j] = sel;
            }
        if (!a.permute) {
            if (i >= lim) continue;
            uint8_t *dst = a.tokens + i * a.row_bytes;
            copy_fanout<RM_UNROLL, true>(src, &dst, 1, a.row_bytes, lane);
            for (int j = lane; j < ns; j += 32) a.out_scales[i * ns + j] = sscales[j];
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
            const unsigned b = __ballot_sync(kFullMask, keep);
            if (keep) {
                const int pos = n + __popc(b & lanemask_lt());
                dst_ptr[warp][pos] = a.tokens + row * a.row_bytes;
                dst_row[warp][pos] = row;
                dst_w[warp][pos] = dw[slot * K + k];
            }
            n += __popc(b);
        }
        __syncwarp();
        copy_fanout<RM_UNROLL, true>(src, dst_ptr[warp], n, a.row_bytes, lane);
        for (int d = 0; d < n; d++) {
            const int64_t row = dst_row[warp][d];
            for (int j = lane; j < ns; j += 32) a.out_scales[row * ns + j] = sscales[j];
            if (a.out_probs && lane == 0) a.out_probs[row] = dst_w[warp][d];
        }
        __syncwarp();
    }
    /* The local map's rows after the received ones select nothing. */
    if (a.local_map && writable)
        for (int64_t b = total * L + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < a.local_map_rows * L;
             b += (int64_t)gridDim.x * blockDim.x)
            a.local_map[b] = 0;
    /* Zero rows: padding inside the groups and, with a bound, everything between the real count
     * and the bound (without one, rows past the real count are left alone). */
    const int pw = a.permute ? 1 : L;
    const int64_t zlim = a.bounded || real > lim ? lim : real;
    for (int64_t r0 = ((int64_t)blockIdx.x * kBlockWarps + warp) * 32; r0 < zlim;
         r0 += (int64_t)gridDim.x * kBlockWarps * 32) {
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
        unsigned b = __ballot_sync(kFullMask, zero);
        while (b) {
            const int q = __ffs(b) - 1;
            b &= b - 1;
            const int64_t row = r0 + q;
            uint8_t *dst = a.tokens + row * a.row_bytes;
            copy_fanout<RM_UNROLL, true>(NULL, &dst, 1, a.row_bytes, lane);
            for (int j = lane; j < ns; j += 32) a.out_scales[row * ns + j] = 0.0f;
            if (a.out_probs)
                for (int j = lane; j < pw; j += 32) a.out_probs[row * pw + j] = 0.0f;
        }
    }
    if (bad) {
        /* The outputs never look like data: every row they hold, every count. */
        const int64_t rows = a.limit;
        poison_rows(a.tokens, rows, a.row_bytes, nan_pattern((int)(a.row_bytes / c->hidden)));
        poison_rows(a.out_scales, ns ? rows : 0, ns * 4, nan_pattern(4));
        poison_rows(a.out_probs, rows, (a.permute ? 1 : L) * 4, nan_pattern(4));
        poison_counts(a.tokens_per_expert, L);
        poison_counts(a.num_tokens_out, 1);
    }
    if (last_block_arrive(&f.own->done_counter[EPX_CUDA_RM_DONE_RECV])) {
        if (threadIdx.x == 0) {
            a.h.bad[0] = 0; /* every block read it at its start */
            c->host->num_recv = counted ? real : -1;
            if (counted && a.bounded && real > a.limit) c->host->overflow = 1;
            if (writable && a.num_tokens_out) *a.num_tokens_out = (int32_t)real;
            a.h.meta[0] = (int32_t)nrows;
            a.h.meta[1] = (int32_t)(nrows < lim ? nrows : lim);
        }
        for (int r = threadIdx.x; r <= R; r += blockDim.x) a.h.recv_prefix[r] = writable ? prefix[r] : 0;
        if (writable && a.permute && a.tokens_per_expert)
            for (int j = threadIdx.x; j < L; j += blockDim.x) a.tokens_per_expert[j] = gb[j + 1] - gb[j];
        finish_dispatch_recv(c, f.epoch);
    }
}

static size_t rm_recv_smem(const epx_cuda_rm_args_t *a)
{
    const size_t L = (size_t)a->c.num_local_experts, R = (size_t)a->c.nranks;
    return (2 * L + 1 + R * L) * sizeof(int);
}

extern "C" int epx_cuda_launch_rm_dispatch(const epx_cuda_rm_args_t *args, void *stream)
{
    const int nb = args->c.num_blocks;
    /* Neither the scan nor the prefix waits on anything: a block per tile, a warp per column, beyond the
     * rank's share of SMs (they finish whatever the other ranks run). */
    const int64_t ntiles = (args->num_tokens + 31) / 32, ncols = args->num_experts + args->c.nranks;
    const int scan_blocks = (int)(ntiles < 1 ? 1 : ntiles < 4096 ? ntiles : 4096);
    const int prefix_blocks = (int)((ncols + kBlockWarps - 1) / kBlockWarps);
    int err = launch_kernel(rm_scan_kernel, *args, scan_blocks, kBlockThreads, 0, stream);
    if (err != cudaSuccess) return err;
    if ((err = launch_kernel(rm_prefix_kernel, *args, prefix_blocks, kBlockThreads, 0, stream)) != cudaSuccess)
        return err;
    if ((err = launch_kernel(rm_send_kernel, *args, nb, kBlockThreads, 0, stream)) != cudaSuccess) return err;
    const size_t smem = rm_recv_smem(args);
    /* The 48 KB that need no opt-in cover static and dynamic shared memory together. */
    cudaFuncAttributes fa;
    if ((err = cudaFuncGetAttributes(&fa, rm_recv_kernel)) != cudaSuccess) return err;
    if (smem + fa.sharedSizeBytes > 48 * 1024) {
        err = cudaFuncSetAttribute(rm_recv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (err != cudaSuccess) return err;
    }
    return launch_kernel(rm_recv_kernel, *args, nb, kBlockThreads, smem, stream);
}

/* ----------------------------------------------------------------------- combine ---- */

/* Sender of combine (the rank holding rows): after threads r < R saw source r release its combine
 * area, one warp per row received from another rank (grid-strided) writes it back into the
 * source's area: [me][token] without permute, [token][k] with (k = the expert's place in the
 * token's selection), the row's copies flattened into one copy. Our own rows stay where they are
 * (the reduce reads them). A remote row dropped by the bound goes back as zeros: the accumulator
 * never holds -0 (it starts at +0), so adding +0 (or w * 0, finite w) leaves it unchanged. */
__global__ void __launch_bounds__(kBlockThreads)
    rm_comb_send_kernel(const __grid_constant__ epx_cuda_rm_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const kernel_frame f(c);
    const int64_t row_bytes = c->hidden * 2;
    __shared__ int prefix[EPX_CUDA_MAX_RANKS + 1];
    __shared__ const uint8_t *src_ptr[kBlockWarps][EPX_MAX_TOPK];
    __shared__ uint8_t *dst_ptr[kBlockWarps][EPX_MAX_TOPK];
    post_call(c, f.epoch);
    const int &ok = open_combine_send(c, a.h.recv_prefix, prefix, f.epoch);
    const int64_t rows = ok ? a.h.meta[0] : 0, kept = a.h.meta[1];
    /* Rows in HT order, our own block [prefix[me], prefix[me + 1]) skipped. */
    const int64_t own_lo = prefix[me], own_n = prefix[me + 1] - prefix[me];
    const int64_t remote = rows - own_n;
    for (int64_t q = (int64_t)blockIdx.x * kBlockWarps + warp; q < remote;
         q += (int64_t)gridDim.x * kBlockWarps) {
        const int64_t i = q < own_lo ? q : q + own_n;
        const int s = source_of_row(prefix, R, i);
        const int64_t t = a.h.recv_src[i];
        uint8_t *peer = c->peers[s];
        if (!a.permute) {
            uint8_t *dst = peer + c->lay.comb_x + ((int64_t)me * c->max_tokens + t) * row_bytes;
            copy_fanout<RM_UNROLL, true>(i < kept ? (const uint8_t *)(a.x + i * c->hidden) : NULL, &dst, 1,
                                         row_bytes, lane);
            continue;
        }
        int n = 0;
        for (int k0 = 0; k0 < K; k0 += 32) {
            const int k = k0 + lane;
            const int32_t pr = k < K ? a.h.perm_row[i * K + k] : -1;
            const int pos = warp_slot(pr != -1, n);
            if (pr != -1) {
                src_ptr[warp][pos] = pr >= 0 ? (const uint8_t *)(a.x + (int64_t)pr * c->hidden) : NULL;
                dst_ptr[warp][pos] = peer + c->lay.rm_comb + (t * K + k) * row_bytes;
            }
        }
        __syncwarp();
        rm_copy_pairs(src_ptr[warp], dst_ptr[warp], n, row_bytes, lane);
        __syncwarp();
    }
    finish_combine_send(c, &f.own->done_counter[EPX_CUDA_RM_DONE_COMB_SEND], f.epoch);
}

/* Source side: threads r < R wait for rank r's rows, then one warp per token (grid-strided) sums
 * its rows in one fp32 accumulator: ranks ascending (without permute) or the token's experts ascending, which
 * is ranks then local experts ascending (with permute); one rounding to bf16. Our own rows are read from the
 * combine input x (no push), rows dropped there are skipped. Each lane loads a vector of up to RM_UNROLL rows
 * before adding them in order, so the loads overlap. */
__global__ void __launch_bounds__(kBlockThreads)
    rm_comb_reduce_kernel(const __grid_constant__ epx_cuda_rm_args_t a)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, L = c->num_local_experts, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const kernel_frame f(c);
    const int64_t H = c->hidden;
    __shared__ const uint16_t
        *src_row[kBlockWarps][EPX_MAX_TOPK > EPX_CUDA_MAX_RANKS ? EPX_MAX_TOPK : EPX_CUDA_MAX_RANKS];
    __shared__ float src_w[kBlockWarps][EPX_MAX_TOPK];
    const int &ok = open_combine_reduce(c, f.epoch);
    const uint16_t *comb = (const uint16_t *)(f.region + c->lay.comb_x);
    const uint16_t *pcomb = (const uint16_t *)(f.region + c->lay.rm_comb);
    const int64_t T = ok ? a.num_tokens : 0;
    const int64_t rows = a.h.meta[0], kept = a.h.meta[1];
    const bool weighted = a.permute && a.weighted;
    const bool vec = (H & 7) == 0 && (((uintptr_t)a.x | (uintptr_t)a.combined) & 15) == 0;
    for (int64_t t = (int64_t)blockIdx.x * kBlockWarps + warp; t < T; t += (int64_t)gridDim.x * kBlockWarps) {
        int n = 0;
        if (!a.permute) {
            for (int r0 = 0; r0 < R; r0 += 32) {
                const int r = r0 + lane;
                bool in = r < R && a.h.send_row[t * R + r] >= 0;
                const uint16_t *p = NULL;
                if (in && r == me) {
                    const int64_t i = a.h.local_row[t];
                    in = i >= 0 && i < kept; /* a row past the bound was dropped: nothing to add */
                    p = a.x + i * H;
                } else if (in) {
                    p = comb + ((int64_t)r * c->max_tokens + t) * H;
                }
                const int pos = warp_slot(in, n);
                if (in) src_row[warp][pos] = p;
            }
        } else {
            for (int k0 = 0; k0 < K; k0 += 32) {
                const int k = k0 + lane;
                const int e = k < K ? a.h.src_sel[t * K + k] : -1;
                bool in = e >= 0;
                const uint16_t *p = NULL;
                if (in && e / L == me) {
                    /* local_row is only written by a dispatch that received rows */
                    const int64_t i = a.h.local_row[t];
                    const int32_t pr = i >= 0 && i < rows ? a.h.perm_row[i * K + k] : -1;
                    in = pr >= 0; /* -2: dropped by the bound, nothing to add */
                    p = a.x + (int64_t)pr * H;
                } else if (in) {
                    p = pcomb + (t * K + k) * H;
                }
                const int pos = warp_slot(in, n);
                if (in) {
                    src_row[warp][pos] = p;
                    src_w[warp][pos] = a.h.src_prob[t * K + k];
                }
            }
        }
        __syncwarp();
        reduce_token<RM_UNROLL, true>(
            a.combined + t * H, H, vec, n, [&](int d) { return src_row[warp][d]; }, weighted,
            [&](int d) { return src_w[warp][d]; }, nullptr, nullptr, 0, lane);
        __syncwarp();
    }
    finish_combine_reduce(c, &f.own->done_counter[EPX_CUDA_RM_DONE_COMB_REDUCE], f.epoch);
}

extern "C" int epx_cuda_launch_rm_combine(const epx_cuda_rm_args_t *args, void *stream)
{
    return launch_pair(rm_comb_send_kernel, rm_comb_reduce_kernel, args, 0, stream);
}
