/*
 * LL dispatch and combine kernels of the cuda backend. Dispatch: one warp per token finds its row in
 * each selected expert's per-(slot, local expert, source) slice of the receiver (earlier tokens
 * selecting that expert), casts the token once (bf16 or fp8 with scales) and writes it to every
 * destination, so no count exchange is needed; the receiver packs the slices in (source, token)
 * order. Combine: the expert rank writes each row back into the source's (slot, token, k) area;
 * the source sums in k order.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/ll_common.cuh"

/* Dispatch slice of (slot, local expert j, source s) in rank r's region. */
__device__ __forceinline__ uint8_t *ll_slice(const epx_cuda_ll_args_t &a, int r, int j, int s)
{
    const int64_t T = a.c.max_tokens;
    return a.c.peers[r] + a.ll.disp +
           ((((int64_t)a.slot * a.c.num_local_experts + j) * a.c.nranks + s) * T) * (int64_t)a.ll.row_stride;
}

/* Releases what a receive half that never ran (or this rank's failed call) would have released. */
__device__ __forceinline__ void ll_drops(const epx_cuda_ll_args_t &a)
{
    const int me = a.c.rank;
    epx_cuda_ll_ctrl_t *own = ll_ctrl(a, me);
    if ((int)threadIdx.x < a.c.nranks) {
        epx_cuda_ll_ctrl_t *peer = ll_ctrl(a, threadIdx.x);
        if (a.drop_disp)
            st_release_sys(&peer->disp_ack[a.slot][me], ld_volatile_u64(&own->disp_epoch[a.slot]));
        if (a.drop_comb)
            st_release_sys(&peer->comb_ack[a.slot][me], ld_volatile_u64(&own->comb_epoch[a.slot]));
    }
}

/* A send half's end: the last block publishes `epoch` to every rank through flag_of(r) (unless
 * this rank failed it), remembers it as the slot's last use and closes the collective. */
template <typename FlagOf>
__device__ __forceinline__ void ll_finish_send(const epx_cuda_ll_args_t &a, bool ok, uint64_t epoch,
                                               uint32_t *counter, FlagOf flag_of, uint64_t *slot_epoch)
{
    if (last_block_arrive(counter)) {
        if (ok) publish_peers(&a.c, epoch, [&](int r) { st_release_sys(flag_of(r), epoch); });
        release_if_failed(&a.c, epoch); /* a peer's call of another kind (mismatch) waits for nothing */
        close_epoch(peer_ctrl(&a.c, a.c.rank), slot_epoch, epoch);
    }
}

/* ---------------------------------------------------------------------------- dispatch ---- */

/* Benchmark floor: the same bytes to the same peers' slices with plain 16-byte copies (a row of
 * token t goes to row t of the slice; no cast, no positions, no waits or flags). */
__device__ __forceinline__ void ll_dispatch_floor(const epx_cuda_ll_args_t &a)
{
    const int K = a.c.num_topk, L = a.c.num_local_experts, me = a.c.rank, E = a.num_experts;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t H = a.c.hidden, T = a.num_tokens;
    const int64_t bytes = a.use_fp8 ? (H + (H / 128) * 4 + 15) / 16 * 16 : H * 2;
    const int64_t stride = (int64_t)a.ll.row_stride;
    __shared__ uint8_t *dst[kBlockWarps][EPX_MAX_TOPK];
    for (int64_t t = (int64_t)blockIdx.x * kBlockWarps + warp; t < T; t += (int64_t)gridDim.x * kBlockWarps) {
        int n = 0;
        for (int k0 = 0; k0 < K; k0 += 32) {
            const int k = k0 + lane;
            const int64_t e = k < K ? ll_topk(a, t * K + k) : -1;
            const bool in = e >= 0 && e < E;
            const int at = warp_slot(in, n);
            if (in) dst[warp][at] = ll_slice(a, (int)(e / L), (int)(e % L), me) + t * stride;
        }
        __syncwarp();
        const int4 *src = (const int4 *)(a.x + t * H);
        for (int64_t i = lane; i < bytes / 16; i += 32) {
            const int4 v = ld_nc_v4(src + i);
            for (int d = 0; d < n; d++) st_na_v4((int4 *)dst[warp][d] + i, v);
        }
        __syncwarp();
    }
}

/* Refuses an LL call whose topk_idx holds a bad id (block_first_bad: every block checks every row,
 * so all agree; over the staged copy when there is one): the call's error record
 * (EPX_ERR_INVALID_ARG naming the slot), our fail word to every peer, and the slot's refused word
 * that our receive half reads (ll_refused). Returns the gate of the call's waits, shut on a
 * refusal. */
__device__ __forceinline__ gate_unless ll_refuse(const epx_cuda_ll_args_t &a, uint64_t epoch, int half,
                                                 const int32_t *staged)
{
    int64_t value = 0;
    const int64_t where = staged ? block_first_bad(staged, 0, a.num_tokens, a.c.num_topk, a.num_experts, &value)
                                 : block_first_bad(a.topk_idx, a.idx_is_64, a.num_tokens, a.c.num_topk,
                                                   a.num_experts, &value);
    if (where && staged) /* the id as the caller passed it, not its staged stand-in */
        value = ll_topk(a, (where - 1) / EPX_MAX_TOPK * a.c.num_topk + (where - 1) % EPX_MAX_TOPK);
    const bool refused = refuse_at(&a.c, where, value, epoch, EPX_CUDA_WAIT_BAD_EXPERT);
    if (refused && blockIdx.x == 0 && threadIdx.x == 0)
        st_volatile_u64(&ll_ctrl(a, a.c.rank)->refused[a.slot][half], epoch);
    return gate_unless{refused};
}

/* Sender: every block checks every token's ids first; a bad one refuses the call (nothing is sent,
 * the peers' receive halves fail on our fail word). Else threads r < R wait until rank r read the
 * slot's previous rows. Then (1) one warp per expert counts the tokens that select it and writes
 * the count to the expert's rank; (2) one warp per token (or per part of its channels) finds, for
 * each expert it selects, how many earlier tokens select that expert (its row in the slice), casts
 * the token once and writes it to every destination. The last block publishes the epoch to every
 * rank. */
__device__ __forceinline__ void ll_dispatch_send(const epx_cuda_ll_args_t &a)
{
    const ll_stamp stamp(a, EPX_LL_STAMP_DISP_SEND);
    if (a.floor_only) {
        ll_dispatch_floor(a);
        return;
    }
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, L = c->num_local_experts, me = c->rank, E = a.num_experts;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t T = a.num_tokens, stride = (int64_t)a.ll.row_stride;
    const int64_t gwarp = (int64_t)blockIdx.x * kBlockWarps + warp, nwarps = (int64_t)gridDim.x * kBlockWarps;
    const kernel_frame f(c);
    epx_cuda_ll_ctrl_t *lown = ll_ctrl(a, me);
    const uint64_t prev = ld_volatile_u64(&lown->disp_epoch[a.slot]);
    __shared__ int sel[kBlockWarps][EPX_MAX_TOPK]; /* the token's experts, first occurrence only (else -1) */
    __shared__ int pos[kBlockWarps][EPX_MAX_TOPK]; /* earlier tokens selecting sel[k] */
    __shared__ uint8_t *rows[kBlockWarps][EPX_MAX_TOPK];
    __shared__ int32_t staged_buf[kLlStage];
    post_call(c, f.epoch);
    ll_drops(a);
    const int32_t *staged = ll_stage_topk(a, staged_buf);
    /* Past the check every id is in [-1, E): the staged copy holds them as they are. */
    auto topk = [&](int64_t i) -> int64_t { return staged ? (int64_t)staged[i] : ll_topk(a, i); };
    const gate_unless gate = ll_refuse(a, f.epoch, 0, staged);
    const int &ok = wait_peers(
        c, [&](int r) { return &lown->disp_ack[a.slot][r]; }, prev, f.epoch, EPX_CUDA_WAIT_DISPATCH_ACK,
        no_arrival(), gate);
    if (ok) {
        /* (1) Counts: tokens selecting e (each token once). */
        for (int64_t e = gwarp; e < E; e += nwarps) {
            const int n = ll_expert_count(topk, e, T, K, lane);
            if (lane == 0)
                ((int32_t *)(c->peers[e / L] + a.ll.cnt))[((int64_t)a.slot * R + me) * L + e % L] = n;
        }
        /* (2) Rows: one warp per (token, part of its channels); parts when tokens are fewer than
         * warps. Every part finds the token's rows; part 0 writes (t, k). */
        const int64_t H = c->hidden, steps = (H + 511) / 512;
        int64_t parts = T > 0 ? nwarps / T : 1;
        parts = parts < 1 ? 1 : (parts > steps ? steps : parts);
        for (int64_t it = gwarp; it < T * parts; it += nwarps) {
            const int64_t t = it / parts, part = it % parts;
            const int64_t lo = steps * part / parts * 512, hi_ = steps * (part + 1) / parts * 512;
            const int64_t hi = hi_ < H ? hi_ : H;
            ll_positions(topk, t, K, E, sel[warp], pos[warp], lane);
            int n = 0;
            for (int k0 = 0; k0 < K; k0 += 32) {
                const int k = k0 + lane;
                const int e = k < K ? sel[warp][k] : -1;
                const int at = warp_slot(e >= 0, n);
                if (e >= 0) {
                    uint8_t *row = ll_slice(a, e / L, e % L, me) + (int64_t)pos[warp][k] * stride;
                    rows[warp][at] = row;
                    if (part == 0) *(int2 *)(row + stride - 16) = make_int2((int)t, k);
                }
            }
            __syncwarp();
            ll_fan_out(a, a.x + t * H, rows[warp], n, lo, hi, lane);
            __syncwarp();
        }
    }
    ll_finish_send(
        a, ok, f.epoch, &lown->done_counter[a.slot][LL_DONE_DISP_SEND],
        [&](int r) { return &ll_ctrl(a, r)->disp_flag[a.slot][me]; }, &lown->disp_epoch[a.slot]);
}

/* Receiver: after its threads s < R saw source s's epoch, each block unpacks its experts' rows
 * (ll_unpack). The last block releases the slot to every source. After our own refusal nothing is
 * waited for and the outputs are poisoned. */
__device__ __forceinline__ void ll_dispatch_recv(const epx_cuda_ll_args_t &a)
{
    const ll_stamp stamp(a, EPX_LL_STAMP_DISP_RECV);
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, L = c->num_local_experts, me = c->rank;
    const int64_t RT = (int64_t)R * c->max_tokens, stride = (int64_t)a.ll.row_stride;
    uint8_t *region = c->peers[me];
    epx_cuda_ll_ctrl_t *lown = ll_ctrl(a, me);
    const uint64_t epoch = ld_volatile_u64(&lown->disp_epoch[a.slot]);
    const int first_expert = (int)blockIdx.x < L ? me * L + (int)blockIdx.x : -1;
    const bool refused = ll_refused(a, epoch, 0);
    const int &ok = wait_peers(
        c, [&](int r) { return &lown->disp_flag[a.slot][r]; }, epoch, epoch, EPX_CUDA_WAIT_DISPATCH_DATA,
        no_arrival(), gate_unless{refused}, first_expert);
    const int32_t *counts = (const int32_t *)(region + a.ll.cnt) + (int64_t)a.slot * R * L;
    ll_unpack(a, ok, counts, region + a.ll.disp + (int64_t)a.slot * L * RT * stride);
    if (refused) ll_poison_recv(a);
    if (last_block_arrive(&lown->done_counter[a.slot][LL_DONE_DISP_RECV])) {
        release_if_failed(c, epoch); /* also when only this half saw the failure */
        release_peers(
            c, [&](int r) { return &ll_ctrl(a, r)->disp_ack[a.slot][me]; }, epoch);
    }
}

/* ----------------------------------------------------------------------------- combine ---- */

/* Expert side: every block checks this rank's topk_idx of the call (its receive half reads it); a
 * bad id refuses the call (nothing sent). Else after threads r < R saw rank r read the slot's
 * previous combine rows, block b's warps send the rows of local experts b, b + gridDim.x, ... (warp
 * w: rows w, w + 16, ...) to their sources' (slot, t, k) places. The last block publishes the epoch
 * to every rank (a source may get no row from us). */
__device__ __forceinline__ void ll_combine_send(const epx_cuda_ll_args_t &a)
{
    const ll_stamp stamp(a, EPX_LL_STAMP_COMB_SEND);
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, L = c->num_local_experts, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t H = c->hidden, RT = (int64_t)R * c->max_tokens;
    const kernel_frame f(c);
    epx_cuda_ll_ctrl_t *lown = ll_ctrl(a, me);
    const uint64_t prev = ld_volatile_u64(&lown->comb_epoch[a.slot]);
    gate_unless gate{false}; /* the benchmark floor checks nothing */
    __shared__ int32_t staged_buf[kLlStage];
    if (!a.floor_only) {
        post_call(c, f.epoch);
        ll_drops(a);
        gate = ll_refuse(a, f.epoch, 1, ll_stage_topk(a, staged_buf));
    }
    /* The benchmark floor neither waits nor publishes: its gate stays shut, its rows go anyway. */
    const int &ok = wait_peers(
        c, [&](int r) { return &lown->comb_ack[a.slot][r]; }, prev, f.epoch, EPX_CUDA_WAIT_COMBINE_ACK,
        no_arrival(), [&] { return !a.floor_only && gate(); });
    const int32_t *rcount = (const int32_t *)(f.region + a.ll.rcount) + (int64_t)a.slot * L;
    const int2 *meta = (const int2 *)(f.region + a.ll.meta) + (int64_t)a.slot * L * RT;
    if (ok || a.floor_only) {
        for (int j = blockIdx.x; j < L; j += gridDim.x) {
            const int total = rcount[j];
            for (int q = warp; q < total; q += kBlockWarps) {
                const int2 m = meta[(int64_t)j * RT + q];
                const int s = m.y >> 6, k = m.y & 63;
                uint8_t *dst =
                    c->peers[s] + a.ll.comb + ((((int64_t)a.slot * c->max_tokens + m.x) * K + k) * H) * 2;
                warp_copy<4>(dst, (const uint8_t *)(a.y + ((int64_t)j * RT + q) * H), H * 2, lane);
            }
        }
    }
    if (a.floor_only) return;
    ll_finish_send(
        a, ok, f.epoch, &lown->done_counter[a.slot][LL_DONE_COMB_SEND],
        [&](int r) { return &ll_ctrl(a, r)->comb_flag[a.slot][me]; }, &lown->comb_epoch[a.slot]);
}

/* Source side: after threads r < R saw rank r's epoch, the sums (ll_reduce). A receive that failed
 * (or whose dispatch failed on this rank) writes bf16 NaN rows. The last block releases the slot's
 * combine area to every rank. */
__device__ __forceinline__ void ll_combine_recv(const epx_cuda_ll_args_t &a)
{
    const ll_stamp stamp(a, EPX_LL_STAMP_COMB_RECV);
    const epx_cuda_common_t *c = &a.c;
    const int K = c->num_topk, me = c->rank;
    const int64_t H = c->hidden;
    uint8_t *region = c->peers[me];
    epx_cuda_ll_ctrl_t *lown = ll_ctrl(a, me);
    const uint64_t epoch = ld_volatile_u64(&lown->comb_epoch[a.slot]);
    const uint64_t disp_epoch = ld_volatile_u64(&lown->disp_epoch[a.slot]);
    /* A dispatch that failed on this rank left nothing to combine, a combine it refused gets
     * nothing: no waits. */
    const int &ok = wait_peers(
        c, [&](int r) { return &lown->comb_flag[a.slot][r]; }, epoch, epoch, EPX_CUDA_WAIT_COMBINE_DATA,
        no_arrival(), [&] { return !epoch_failed(c, disp_epoch) && !ll_refused(a, epoch, 1); });
    const uint16_t *area = (const uint16_t *)(region + a.ll.comb) + (int64_t)a.slot * c->max_tokens * K * H;
    ll_reduce(a, ok, area);
    if (last_block_arrive(&lown->done_counter[a.slot][LL_DONE_COMB_RECV])) {
        release_if_failed(c, epoch); /* also when only this half saw the failure */
        release_peers(
            c, [&](int r) { return &ll_ctrl(a, r)->comb_ack[a.slot][me]; }, epoch);
    }
}

/* ----------------------------------------------------------------------------- kernels ---- */

/* One kernel per operation, launched once per half (a.phase): a profiler that times an operation
 * by kernel name finds one kernel for it (DeepEP's LL test looks for exactly one kernel named
 * `...::dispatch` and one `...::combine`, launched twice per call with a receive hook). */
namespace epx_ll {
__global__ void __launch_bounds__(kBlockThreads) dispatch(const __grid_constant__ epx_cuda_ll_args_t a)
{
    if (a.phase == EPX_LL_PHASE_SEND)
        ll_dispatch_send(a);
    else
        ll_dispatch_recv(a);
}

__global__ void __launch_bounds__(kBlockThreads) combine(const __grid_constant__ epx_cuda_ll_args_t a)
{
    if (a.phase == EPX_LL_PHASE_SEND)
        ll_combine_send(a);
    else
        ll_combine_recv(a);
}
} // namespace epx_ll

static int ll_launch(void (*kernel)(epx_cuda_ll_args_t), const epx_cuda_ll_args_t *args, int32_t phase,
                     void *stream)
{
    epx_cuda_ll_args_t half = *args;
    half.phase = phase;
    return launch_kernel(kernel, half, args->c.num_blocks, kBlockThreads, 0, stream);
}

extern "C" int epx_cuda_launch_ll_dispatch_send(const epx_cuda_ll_args_t *args, void *stream)
{
    return ll_launch(epx_ll::dispatch, args, EPX_LL_PHASE_SEND, stream);
}

extern "C" int epx_cuda_launch_ll_dispatch_recv(const epx_cuda_ll_args_t *args, void *stream)
{
    return ll_launch(epx_ll::dispatch, args, EPX_LL_PHASE_RECV, stream);
}

extern "C" int epx_cuda_launch_ll_combine_send(const epx_cuda_ll_args_t *args, void *stream)
{
    return ll_launch(epx_ll::combine, args, EPX_LL_PHASE_SEND, stream);
}

extern "C" int epx_cuda_launch_ll_combine_recv(const epx_cuda_ll_args_t *args, void *stream)
{
    return ll_launch(epx_ll::combine, args, EPX_LL_PHASE_RECV, stream);
}

/* --------------------------------------------------------------------------- failure ---- */

/* Runs before the ctrl's fail kernel closes the failed epoch: peers that ran the call recorded it
 * as the slot's last use and will wait for our release of exactly that epoch (thread r releases
 * peer r). */
__global__ void ll_fail_kernel(const __grid_constant__ epx_cuda_ll_args_t a)
{
    const int me = a.c.rank;
    const uint64_t epoch = ld_volatile_u64(&peer_ctrl(&a.c, me)->epoch) + 1;
    if ((int)threadIdx.x < a.c.nranks) {
        epx_cuda_ll_ctrl_t *peer = ll_ctrl(a, threadIdx.x);
        if (a.drop_disp) st_release_sys(&peer->disp_ack[a.slot][me], epoch);
        st_release_sys(&peer->comb_ack[0][me], epoch);
        st_release_sys(&peer->comb_ack[1][me], epoch);
    }
}

extern "C" int epx_cuda_launch_ll_fail(const epx_cuda_ll_args_t *args, void *stream)
{
    return launch_kernel(ll_fail_kernel, *args, 1, EPX_CUDA_MAX_RANKS, 0, stream);
}
