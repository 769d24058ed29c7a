/*
 * LL dispatch and combine on a buffer whose ranks span nodes: the protocol of src/kernels/ll.cu with
 * every byte and every flag through the network transport (net.h, GIN's ordering rules), to the node's
 * own ranks too. The rows go as puts from our SEND region into the peers' RECV regions; each half ends
 * with one STRONG signal per peer (it covers every earlier put of its context to that peer), so a
 * waiter that sees the signal reach its target sees every row and count of the call. Signals count
 * events and are never reset: the k-th dispatch of a slot waits for DISP(slot, s) >= k, a sender's k-th
 * dispatch of a slot waits until every receiver acknowledged the k - 1 before (DACK), the same for the
 * combine (COMB, CACK). The counts of a slot's calls live in our ctrl (net_disp, net_comb), advanced by
 * the kernels, so graph replays stay in step. A call that fails on any rank tells every peer (FAIL) and
 * marks the buffer failed: the counts are then out of step, so every later LL call fails at once
 * (bounded, poisoned outputs) and the buffer must be destroyed.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/ll_common.cuh"

namespace
{

/* The contexts of a slot's dispatch and combine (EPX_LL_NET_CONTEXTS of them; where the transport gave
 * fewer, several share one: contexts only add freedom, so sharing one never breaks a rule). */
__device__ __forceinline__ uint32_t ctx_dispatch(const epx_cuda_ll_args_t &a)
{
    return (uint32_t)a.slot % a.net.ncontexts;
}
__device__ __forceinline__ uint32_t ctx_combine(const epx_cuda_ll_args_t &a)
{
    return (2u + (uint32_t)a.slot) % a.net.ncontexts;
}

__device__ __forceinline__ uint64_t recv_off(const epx_cuda_ll_args_t &a, uint64_t area)
{
    return (uint64_t)a.slot * a.nl.recv_slot + area;
}
__device__ __forceinline__ uint64_t send_off(const epx_cuda_ll_args_t &a, uint64_t area)
{
    return (uint64_t)a.slot * a.nl.send_slot + area;
}

/* Waits until our signal `sig` reaches `target`, like wait_flag_geq for a peer's word: gives up (and
 * records why) when `peer` signalled a failure (EPX_ERR_REMOTE), the transport's abort word is set (a
 * peer process gone: EPX_ERR_REMOTE), a transport error (EPX_ERR_INTERNAL), the deadline
 * (EPX_ERR_TIMEOUT); silently on the host's abort flag or another block's failure of the epoch. */
__device__ bool net_wait(const epx_cuda_ll_args_t &a, uint32_t sig, uint64_t target, uint64_t epoch, int peer,
                         int what, int expert)
{
    const epx_cuda_common_t *c = &a.c;
    const uint32_t fail = EPX_LL_NET_SIG_FAIL(c->nranks, peer);
    const uint64_t start = globaltimer_ns();
    for (uint32_t it = 0;; it++) {
        uint64_t v = 0, f = 0;
        epx_net_status_t s = epx_net_signal_read(&a.net, sig, &v);
        if (s == EPX_NET_OK && v >= target) return true;
        if (s == EPX_NET_OK) s = epx_net_signal_read(&a.net, fail, &f);
        if (s != EPX_NET_OK) {
            record_error(c, epoch, EPX_ERR_INTERNAL, peer, what, (uint64_t)s, target, expert);
            return false;
        }
        if (f != 0 || epx_net_aborted(&a.net)) {
            record_error(c, epoch, EPX_ERR_REMOTE, peer, what, v, target, expert);
            return false;
        }
        if ((it & 31u) == 31u) {
            if (epoch_failed(c, epoch) || ld_volatile_i32(&c->host->abort_flag)) return false;
            if (globaltimer_ns() - start > c->timeout_ns) {
                record_error(c, epoch, EPX_ERR_TIMEOUT, peer, what, v, target, expert);
                return false;
            }
        }
        epx_net_poll(&a.net);
    }
}

/* wait_peers over signals (all threads): thread r < R waits for sig_of(r) >= target unless `go` is false.
 * Returns the block's verdict. */
template <typename SigOf>
__device__ __forceinline__ bool net_wait_peers(const epx_cuda_ll_args_t &a, SigOf sig_of, uint64_t target,
                                               uint64_t epoch, int what, bool go, int expert = -1)
{
    __shared__ int ok;
    if (threadIdx.x == 0) ok = go;
    __syncthreads();
    if (go && (int)threadIdx.x < a.c.nranks &&
        !net_wait(a, sig_of((int)threadIdx.x), target, epoch, (int)threadIdx.x, what, expert))
        ok = 0;
    __syncthreads();
    return ok != 0;
}

/* Posts one operation; a refused post records EPX_ERR_INTERNAL (the layout and the transport disagree). */
__device__ __forceinline__ void net_check(const epx_cuda_ll_args_t &a, epx_net_status_t s, uint64_t epoch,
                                          int peer, int what)
{
    if (s != EPX_NET_OK)
        record_error(&a.c, epoch, s == EPX_NET_ABORTED ? EPX_ERR_REMOTE : EPX_ERR_INTERNAL, peer, what,
                     (uint64_t)s, 0);
}

/* Thread r < R adds 1 to signal sig_of(r)'s at rank r on `ctx` (STRONG: it lands after every earlier put
 * of the context to r), or, when this rank failed `epoch`, adds 1 to our FAIL signal at every rank and
 * marks the buffer failed. Last block only. */
template <typename SigOf>
__device__ __forceinline__ void net_end(const epx_cuda_ll_args_t &a, uint32_t ctx, uint64_t epoch, int what,
                                        SigOf sig_of)
{
    const epx_cuda_common_t *c = &a.c;
    __shared__ int failed;
    __syncthreads();
    if (threadIdx.x == 0)
        failed = epoch_failed(c, epoch) || ld_volatile_u64(&ll_ctrl(a, c->rank)->net_failed) != 0;
    __syncthreads();
    const int r = (int)threadIdx.x;
    if (r < c->nranks) {
        const uint32_t sig = failed ? EPX_LL_NET_SIG_FAIL(c->nranks, c->rank) : sig_of(r);
        net_check(a, epx_net_signal_add(&a.net, ctx, r, sig, 1, EPX_NET_SIGNAL_STRONG), epoch, r, what);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        /* Our puts' sources may be reused once the flush returns. */
        net_check(a, epx_net_flush(&a.net, ctx, globaltimer_ns() + c->timeout_ns), epoch, c->rank, what);
        epx_cuda_ll_ctrl_t *own = ll_ctrl(a, c->rank);
        if ((failed || epoch_failed(c, epoch)) && ld_volatile_u64(&own->net_failed) == 0)
            st_volatile_u64(&own->net_failed, epoch);
    }
}

/* The opening every send half shares: the bad-id check over the staged ids (a refusal records
 * EPX_ERR_INVALID_ARG and the slot's refused word; the peers learn it from our FAIL signal at the end),
 * the failed-buffer check, and the drops of the slot's receive halves that never ran: they consume
 * what they would have read (so a later put cannot be overtaken by an old one) and acknowledge it.
 * Returns whether the call may go on (the same in every thread). */
__device__ bool net_open(const epx_cuda_ll_args_t &a, uint64_t epoch, int which, const int32_t *staged)
{
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, me = c->rank;
    epx_cuda_ll_ctrl_t *own = ll_ctrl(a, me);
    int64_t value = 0;
    const int64_t where =
        staged ? block_first_bad(staged, 0, a.num_tokens, c->num_topk, a.num_experts, &value)
               : block_first_bad(a.topk_idx, a.idx_is_64, a.num_tokens, c->num_topk, a.num_experts, &value);
    if (where && staged)
        value = ll_topk(a, (where - 1) / EPX_MAX_TOPK * c->num_topk + (where - 1) % EPX_MAX_TOPK);
    const uint64_t failed_at = ld_volatile_u64(&own->net_failed);
    if (blockIdx.x == 0 && threadIdx.x == 0 && where) {
        record_error(c, epoch, EPX_ERR_INVALID_ARG, me, EPX_CUDA_WAIT_BAD_EXPERT, (uint64_t)value,
                     (uint64_t)where);
        st_volatile_u64(&own->refused[a.slot][which], epoch);
    }
    /* A failed buffer runs nothing and records nothing new: the record of the first failure stays for
     * the host (the next call is refused there once it has seen it). */
    if (where || failed_at) return false;
    const uint64_t nd = ld_volatile_u64(&own->net_disp[a.slot]), nc = ld_volatile_u64(&own->net_comb[a.slot]);
    bool ok = true;
    if (a.drop_disp) {
        ok = net_wait_peers(
            a, [&](int r) { return EPX_LL_NET_SIG_DISP(R, a.slot, r); }, nd, epoch,
            EPX_CUDA_WAIT_DISPATCH_DATA, true);
        if (ok && blockIdx.x == 0 && (int)threadIdx.x < R)
            net_check(a,
                      epx_net_signal_add(&a.net, ctx_dispatch(a), (int)threadIdx.x,
                                         EPX_LL_NET_SIG_DACK(R, a.slot, me), 1, EPX_NET_SIGNAL_STRONG),
                      epoch, (int)threadIdx.x, EPX_CUDA_WAIT_DISPATCH_ACK);
    }
    if (ok && a.drop_comb) {
        ok = net_wait_peers(
            a, [&](int r) { return EPX_LL_NET_SIG_COMB(R, a.slot, r); }, nc, epoch,
            EPX_CUDA_WAIT_COMBINE_DATA, true);
        if (ok && blockIdx.x == 0 && (int)threadIdx.x < R)
            net_check(a,
                      epx_net_signal_add(&a.net, ctx_combine(a), (int)threadIdx.x,
                                         EPX_LL_NET_SIG_CACK(R, a.slot, me), 1, EPX_NET_SIGNAL_STRONG),
                      epoch, (int)threadIdx.x, EPX_CUDA_WAIT_COMBINE_ACK);
    }
    return ok;
}

/* ---------------------------------------------------------------------------- dispatch ---- */

/* Sender: after the opening, threads r < R wait until rank r read the slot's previous rows (DACK). Then
 * (1) one warp per expert counts its tokens into SEND's counts; (2) one warp per (token, part of its
 * channels) finds each selected expert's row (ll_positions), casts its part once into SEND's message of
 * the token and puts it to every destination's slice (lane d: destination d), part 0 also the (t, k)
 * trailer. The last block puts each rank its L counts and signals DISP. */
__device__ void net_dispatch_send(const epx_cuda_ll_args_t &a)
{
    const ll_stamp stamp(a, EPX_LL_STAMP_DISP_SEND);
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, L = c->num_local_experts, me = c->rank, E = a.num_experts;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t T = a.num_tokens, H = c->hidden, Tm = c->max_tokens;
    const uint64_t stride = a.ll.row_stride;
    const int64_t gwarp = (int64_t)blockIdx.x * kBlockWarps + warp, nwarps = (int64_t)gridDim.x * kBlockWarps;
    const kernel_frame f(c);
    epx_cuda_ll_ctrl_t *own = ll_ctrl(a, me);
    const uint64_t n_prev = ld_volatile_u64(&own->net_disp[a.slot]);
    __shared__ int sel[kBlockWarps][EPX_MAX_TOPK];
    __shared__ int pos[kBlockWarps][EPX_MAX_TOPK];
    __shared__ int32_t staged_buf[kLlStage];
    const int32_t *staged = ll_stage_topk(a, staged_buf);
    auto topk = [&](int64_t i) -> int64_t { return staged ? (int64_t)staged[i] : ll_topk(a, i); };
    bool ok = net_open(a, f.epoch, 0, staged);
    ok = net_wait_peers(
        a, [&](int r) { return EPX_LL_NET_SIG_DACK(R, a.slot, r); }, n_prev, f.epoch,
        EPX_CUDA_WAIT_DISPATCH_ACK, ok);
    const uint32_t ctx = ctx_dispatch(a);
    if (ok) {
        int32_t *cnt = (int32_t *)(a.net_send + send_off(a, a.nl.s_cnt));
        for (int64_t e = gwarp; e < E; e += nwarps) {
            const int n = ll_expert_count(topk, e, T, K, lane);
            if (lane == 0) cnt[e] = n;
        }
        const bool fp8 = a.use_fp8 != 0;
        const int64_t steps = (H + 511) / 512;
        int64_t parts = T > 0 ? nwarps / T : 1;
        parts = parts < 1 ? 1 : (parts > steps ? steps : parts);
        for (int64_t it = gwarp; it < T * parts; it += nwarps) {
            const int64_t t = it / parts, part = it % parts;
            const int64_t lo = steps * part / parts * 512, hi_ = steps * (part + 1) / parts * 512;
            const int64_t hi = hi_ < H ? hi_ : H;
            ll_positions(topk, t, K, E, sel[warp], pos[warp], lane);
            const uint64_t msg = send_off(a, a.nl.s_msg) + (uint64_t)t * stride;
            uint8_t *row = a.net_send + msg;
            ll_fan_out(a, a.x + t * H, &row, 1, lo, hi, lane);
            if (part == 0)
                for (int k = lane; k < K; k += 32)
                    *(int2 *)(a.net_send + send_off(a, a.nl.s_tail) + ((uint64_t)t * K + k) * 16) =
                        make_int2((int)t, k);
            __syncwarp();
            __threadfence();
            /* Lane k puts the part to slot k's expert (first occurrences only). */
            for (int k = lane; k < K; k += 32) {
                const int e = sel[warp][k];
                if (e < 0) continue;
                const int dr = e / L, j = e % L;
                const uint64_t dst =
                    recv_off(a, a.nl.r_disp) +
                    (((uint64_t)j * R + me) * (uint64_t)Tm + (uint64_t)pos[warp][k]) * stride;
                const uint64_t bl = fp8 ? (uint64_t)lo : 2 * (uint64_t)lo,
                               bh = fp8 ? (uint64_t)hi : 2 * (uint64_t)hi;
                net_check(a,
                          epx_net_put(&a.net, ctx, dr, EPX_LL_NET_RECV, dst + bl, EPX_LL_NET_SEND, msg + bl,
                                      bh - bl),
                          f.epoch, dr, EPX_CUDA_WAIT_DISPATCH_DATA);
                if (fp8) { /* the part's scales after the H bytes */
                    const uint64_t sl = (uint64_t)H + (uint64_t)lo / 128 * 4,
                                   sh = (uint64_t)H + (uint64_t)hi / 128 * 4;
                    net_check(a,
                              epx_net_put(&a.net, ctx, dr, EPX_LL_NET_RECV, dst + sl, EPX_LL_NET_SEND,
                                          msg + sl, sh - sl),
                              f.epoch, dr, EPX_CUDA_WAIT_DISPATCH_DATA);
                }
                if (part == 0)
                    net_check(a,
                              epx_net_put(&a.net, ctx, dr, EPX_LL_NET_RECV, dst + stride - 16,
                                          EPX_LL_NET_SEND,
                                          send_off(a, a.nl.s_tail) + ((uint64_t)t * K + k) * 16, 16),
                              f.epoch, dr, EPX_CUDA_WAIT_DISPATCH_DATA);
            }
            __syncwarp();
        }
    }
    if (last_block_arrive(&own->done_counter[a.slot][LL_DONE_DISP_SEND])) {
        if (ok && !epoch_failed(c, f.epoch) && (int)threadIdx.x < R) {
            const int r = (int)threadIdx.x;
            net_check(a,
                      epx_net_put(&a.net, ctx, r, EPX_LL_NET_RECV,
                                  recv_off(a, a.nl.r_cnt) + (uint64_t)me * L * 4, EPX_LL_NET_SEND,
                                  send_off(a, a.nl.s_cnt) + (uint64_t)r * L * 4, (uint64_t)L * 4),
                      f.epoch, r, EPX_CUDA_WAIT_DISPATCH_DATA);
        }
        net_end(a, ctx, f.epoch, EPX_CUDA_WAIT_DISPATCH_DATA,
                [&](int r) { return EPX_LL_NET_SIG_DISP(R, a.slot, me); });
        if (threadIdx.x == 0) st_volatile_u64(&own->net_disp[a.slot], n_prev + 1);
        close_epoch(peer_ctrl(c, me), &own->disp_epoch[a.slot], f.epoch);
    }
}

/* Receiver: threads s < R wait for DISP(slot, s) to reach the slot's dispatch count, then ll_unpack over
 * RECV; the last block acknowledges to every source (DACK). A refused or failed call waits for nothing and
 * poisons. */
__device__ void net_dispatch_recv(const epx_cuda_ll_args_t &a)
{
    const ll_stamp stamp(a, EPX_LL_STAMP_DISP_RECV);
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, L = c->num_local_experts, me = c->rank;
    epx_cuda_ll_ctrl_t *own = ll_ctrl(a, me);
    const uint64_t epoch = ld_volatile_u64(&own->disp_epoch[a.slot]);
    const uint64_t n = ld_volatile_u64(&own->net_disp[a.slot]);
    const bool refused = ll_refused(a, epoch, 0);
    const bool go = !refused && !epoch_failed(c, epoch) && ld_volatile_u64(&own->net_failed) == 0;
    const int first_expert = (int)blockIdx.x < L ? me * L + (int)blockIdx.x : -1;
    const bool ok = net_wait_peers(
        a, [&](int s) { return EPX_LL_NET_SIG_DISP(R, a.slot, s); }, n, epoch, EPX_CUDA_WAIT_DISPATCH_DATA,
        go, first_expert);
    ll_unpack(a, ok, (const int32_t *)(a.net_recv + recv_off(a, a.nl.r_cnt)),
              a.net_recv + recv_off(a, a.nl.r_disp));
    if (refused) ll_poison_recv(a);
    if (last_block_arrive(&own->done_counter[a.slot][LL_DONE_DISP_RECV]))
        net_end(a, ctx_dispatch(a), epoch, EPX_CUDA_WAIT_DISPATCH_ACK,
                [&](int r) { return EPX_LL_NET_SIG_DACK(R, a.slot, me); });
}

/* ----------------------------------------------------------------------------- combine ---- */

/* Expert side: after the opening, threads r < R wait until source r read the slot's previous combine
 * rows (CACK). Block b's warps take the rows of local experts b, b + gridDim.x, ... 32 at a time: each
 * row goes into SEND's combine area (unless the caller wrote it there: zero-copy), then lane i puts row
 * i to its source's (t, k) place. The last block signals COMB to every rank. */
__device__ void net_combine_send(const epx_cuda_ll_args_t &a)
{
    const ll_stamp stamp(a, EPX_LL_STAMP_COMB_SEND);
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, K = c->num_topk, L = c->num_local_experts, me = c->rank;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t H = c->hidden, RT = (int64_t)R * c->max_tokens;
    const kernel_frame f(c);
    epx_cuda_ll_ctrl_t *own = ll_ctrl(a, me);
    const uint64_t n_prev = ld_volatile_u64(&own->net_comb[a.slot]);
    __shared__ int32_t staged_buf[kLlStage];
    bool ok = net_open(a, f.epoch, 1, ll_stage_topk(a, staged_buf));
    ok = net_wait_peers(
        a, [&](int r) { return EPX_LL_NET_SIG_CACK(R, a.slot, r); }, n_prev, f.epoch,
        EPX_CUDA_WAIT_COMBINE_ACK, ok);
    const uint32_t ctx = ctx_combine(a);
    const int32_t *rcount = (const int32_t *)(f.region + a.ll.rcount) + (int64_t)a.slot * L;
    const int2 *meta = (const int2 *)(f.region + a.ll.meta) + (int64_t)a.slot * L * RT;
    const uint64_t zc = send_off(a, a.nl.s_zc), rb = 2 * (uint64_t)H;
    const bool copy = (const uint8_t *)a.y != a.net_send + zc;
    if (ok) {
        for (int j = blockIdx.x; j < L; j += gridDim.x) {
            const int total = rcount[j];
            for (int q0 = warp * 32; q0 < total; q0 += kBlockWarps * 32) {
                const int nq = total - q0 < 32 ? total - q0 : 32;
                if (copy)
                    for (int i = 0; i < nq; i++) {
                        const uint64_t row = (uint64_t)j * RT + q0 + i;
                        warp_copy<4>(a.net_send + zc + row * rb, (const uint8_t *)a.y + row * rb, (int64_t)rb,
                                     lane);
                    }
                __syncwarp();
                __threadfence();
                if (lane < nq) {
                    const int2 m = meta[(int64_t)j * RT + q0 + lane];
                    const int s = m.y >> 6, k = m.y & 63;
                    const uint64_t row = (uint64_t)j * RT + q0 + lane;
                    net_check(a,
                              epx_net_put(&a.net, ctx, s, EPX_LL_NET_RECV,
                                          recv_off(a, a.nl.r_comb) + ((uint64_t)m.x * K + k) * rb,
                                          EPX_LL_NET_SEND, zc + row * rb, rb),
                              f.epoch, s, EPX_CUDA_WAIT_COMBINE_DATA);
                }
                __syncwarp();
            }
        }
    }
    if (last_block_arrive(&own->done_counter[a.slot][LL_DONE_COMB_SEND])) {
        net_end(a, ctx, f.epoch, EPX_CUDA_WAIT_COMBINE_DATA,
                [&](int r) { return EPX_LL_NET_SIG_COMB(R, a.slot, me); });
        if (threadIdx.x == 0) st_volatile_u64(&own->net_comb[a.slot], n_prev + 1);
        close_epoch(peer_ctrl(c, me), &own->comb_epoch[a.slot], f.epoch);
    }
}

/* Source side: threads r < R wait for COMB(slot, r) to reach the slot's combine count, then ll_reduce over
 * RECV; the last block acknowledges to every expert rank (CACK). */
__device__ void net_combine_recv(const epx_cuda_ll_args_t &a)
{
    const ll_stamp stamp(a, EPX_LL_STAMP_COMB_RECV);
    const epx_cuda_common_t *c = &a.c;
    const int R = c->nranks, me = c->rank;
    epx_cuda_ll_ctrl_t *own = ll_ctrl(a, me);
    const uint64_t epoch = ld_volatile_u64(&own->comb_epoch[a.slot]);
    const uint64_t disp_epoch = ld_volatile_u64(&own->disp_epoch[a.slot]);
    const uint64_t n = ld_volatile_u64(&own->net_comb[a.slot]);
    const bool go = !epoch_failed(c, disp_epoch) && !ll_refused(a, epoch, 1) && !epoch_failed(c, epoch) &&
                    ld_volatile_u64(&own->net_failed) == 0;
    const bool ok = net_wait_peers(
        a, [&](int r) { return EPX_LL_NET_SIG_COMB(R, a.slot, r); }, n, epoch, EPX_CUDA_WAIT_COMBINE_DATA,
        go);
    ll_reduce(a, ok, (const uint16_t *)(a.net_recv + recv_off(a, a.nl.r_comb)));
    if (last_block_arrive(&own->done_counter[a.slot][LL_DONE_COMB_RECV]))
        net_end(a, ctx_combine(a), epoch, EPX_CUDA_WAIT_COMBINE_ACK,
                [&](int r) { return EPX_LL_NET_SIG_CACK(R, a.slot, me); });
}

} // namespace

/* ----------------------------------------------------------------------------- kernels ---- */

namespace epx_ll_net
{
__global__ void __launch_bounds__(kBlockThreads) dispatch(const __grid_constant__ epx_cuda_ll_args_t a)
{
    if (a.phase == EPX_LL_PHASE_SEND)
        net_dispatch_send(a);
    else
        net_dispatch_recv(a);
}

__global__ void __launch_bounds__(kBlockThreads) combine(const __grid_constant__ epx_cuda_ll_args_t a)
{
    if (a.phase == EPX_LL_PHASE_SEND)
        net_combine_send(a);
    else
        net_combine_recv(a);
}
} // namespace epx_ll_net

extern "C" int epx_cuda_launch_ll_net(const epx_cuda_ll_args_t *args, int dispatch, int32_t phase,
                                      void *stream)
{
    epx_cuda_ll_args_t one = *args;
    one.phase = phase;
    return launch_kernel(dispatch ? epx_ll_net::dispatch : epx_ll_net::combine, one, args->c.num_blocks,
                         kBlockThreads, 0, stream);
}
