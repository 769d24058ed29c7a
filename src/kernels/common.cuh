/*
 * The device layer every kernel family of the cuda backend builds on: block shape and lane masks,
 * 16-byte vector copies, the named memory-ordering helpers, the bounded peer wait with its error
 * record, top-k id checks, and the frame of a collective kernel (open by waiting on the peers'
 * words, end with the last block releasing them and closing the collective's epoch).
 */
#ifndef EPX_KERNELS_COMMON_CUH
#define EPX_KERNELS_COMMON_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "core/limits.h"
#include "core/numeric.h"
#include "epx/epx.h"
#include "kernels/contract.h"

/* ------------------------------------------------------------------- block shape, lanes ---- */

/* Threads of every collective kernel's block (launch bounds, warp-strided loops). */
constexpr int kBlockThreads = 512;
constexpr int kBlockWarps = kBlockThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;

/* done_counter slots of epx_cuda_ctrl_t (the routing-map kernels use 4..7, see contract.h) and
 * view_done_counter slots of the HT view kernels. */
enum { DONE_HT_SEND = 0, DONE_HT_RECV = 1, DONE_HT_COMB_SEND = 2, DONE_HT_COMB_REDUCE = 3 };
enum { DONE_VIEW_SEND = 0, DONE_VIEW_RECV = 1, DONE_VIEW_COMB_POST = 2, DONE_VIEW_COMB_REDUCE = 3 };

__device__ __forceinline__ unsigned lanemask_lt(void)
{
    unsigned m;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
    return m;
}

/* One step of a warp-wide compaction (all lanes): returns this lane's place among the lanes kept
 * so far, ascending lane order (meaningful where `keep`), and adds this step's kept lanes to n. */
__device__ __forceinline__ int warp_slot(bool keep, int &n)
{
    const unsigned b = __ballot_sync(kFullMask, keep);
    const int pos = n + __popc(b & lanemask_lt());
    n += __popc(b);
    return pos;
}

/* The source s whose rows [prefix[s], prefix[s + 1]) hold row i (R <= 64: a walk beats a search). */
template <typename Index> __device__ __forceinline__ int source_of_row(const int *prefix, int R, Index i)
{
    int s = 0;
    while (s + 1 < R && prefix[s + 1] <= i) s++;
    return s;
}

/* ------------------------------------------------------------------------ memory ordering ---- */

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t *p)
{
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t *p, uint64_t v)
{
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(uint64_t *p, uint64_t v)
{
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ int32_t ld_volatile_i32(const int32_t *p)
{
    int32_t v;
    asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint64_t ld_volatile_u64(const uint64_t *p)
{
    uint64_t v;
    asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_volatile_i32(int32_t *p, int32_t v)
{
    asm volatile("st.volatile.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_volatile_u64(uint64_t *p, uint64_t v)
{
    asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* Every earlier write of this thread is visible system-wide before the add. */
__device__ __forceinline__ unsigned atomic_add_release_sys(unsigned *p, unsigned v)
{
    __threadfence_system();
    return atomicAdd(p, v);
}

__device__ __forceinline__ uint64_t globaltimer_ns(void)
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* -------------------------------------------------------------------------- vector copies ---- */

/* Read-only 16-byte load that skips L1 (data written by another kernel or rank before an
 * acquire we already did). */
__device__ __forceinline__ int4 ld_nc_v4(const int4 *p)
{
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ void st_na_v4(int4 *p, int4 v)
{
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
                 : "memory");
}

/* acc[0..7] += (w *) the 8 bf16 channels of v, each step rounded (no fma). */
__device__ __forceinline__ void acc_add_bf16x8(float *acc, int4 v, bool weighted, float w)
{
    const uint32_t q[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float lo = epx_bf16_to_f32(q[i]), hi = epx_bf16_to_f32(q[i] >> 16);
        acc[2 * i] = __fadd_rn(acc[2 * i], weighted ? __fmul_rn(w, lo) : lo);
        acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], weighted ? __fmul_rn(w, hi) : hi);
    }
}

/* Eight fp32 values rounded once each to bf16 (core/numeric.h), as one 16-byte store. */
__device__ __forceinline__ void st_na_bf16x8(int4 *p, const float *v)
{
    int4 o;
    o.x = (int)epx_f32x2_to_bf16x2(v[0], v[1]);
    o.y = (int)epx_f32x2_to_bf16x2(v[2], v[3]);
    o.z = (int)epx_f32x2_to_bf16x2(v[4], v[5]);
    o.w = (int)epx_f32x2_to_bf16x2(v[6], v[7]);
    st_na_v4(p, o);
}

/* Warp copy of `bytes` from src to each of n destinations, reading every 16-byte vector once with
 * kUnroll vectors in flight per lane (bytes in flight, not threads, set the bandwidth). With
 * kZeroFill, src == NULL writes zeros. */
template <int kUnroll, bool kZeroFill>
__device__ __forceinline__ void copy_fanout(const uint8_t *src, uint8_t *const *dst, int n, int64_t bytes,
                                            int lane)
{
    if (n == 0) return;
    uintptr_t align = (uintptr_t)src;
    for (int d = 0; d < n; d++) align |= (uintptr_t)dst[d];
    if ((bytes & 15) == 0 && (align & 15) == 0) {
        const int4 *s = (const int4 *)src;
        const int64_t n16 = bytes >> 4;
        for (int64_t i = lane; i < n16; i += 32 * kUnroll) {
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; u++)
                if (i + u * 32 < n16)
                    v[u] = (!kZeroFill || s) ? ld_nc_v4(s + i + u * 32) : make_int4(0, 0, 0, 0);
            for (int d = 0; d < n; d++) {
                int4 *o = (int4 *)dst[d];
#pragma unroll
                for (int u = 0; u < kUnroll; u++)
                    if (i + u * 32 < n16) st_na_v4(o + i + u * 32, v[u]);
            }
        }
    } else {
        for (int64_t i = lane; i < bytes; i += 32) {
            const uint8_t v = (!kZeroFill || src) ? src[i] : 0;
            for (int d = 0; d < n; d++) dst[d][i] = v;
        }
    }
}

/* ------------------------------------------------------------------------- ctrl and errors ---- */

__device__ __forceinline__ epx_cuda_ctrl_t *ctrl_of(uint8_t *region)
{
    return (epx_cuda_ctrl_t *)region;
}

__device__ __forceinline__ epx_cuda_ctrl_t *peer_ctrl(const epx_cuda_common_t *c, int r)
{
    return ctrl_of(c->peers[r]);
}

/* Where a collective kernel of this rank stands: the rank's region and ctrl, and the epoch of the
 * collective the kernel runs (one past the last one closed). */
struct kernel_frame {
    uint8_t *region;
    epx_cuda_ctrl_t *own;
    uint64_t epoch;
    __device__ __forceinline__ explicit kernel_frame(const epx_cuda_common_t *c)
        : region(c->peers[c->rank]), own(ctrl_of(region)), epoch(ld_volatile_u64(&own->epoch) + 1)
    {
    }
};

/* Records the first failure of `epoch` (the device-local claim word picks one writer), then
 * publishes it to the host with the code written last. */
__device__ inline void record_error(const epx_cuda_common_t *c, uint64_t epoch, epx_result_t code, int peer,
                                    int what, uint64_t seen, uint64_t expected, int expert = -1)
{
    epx_cuda_ctrl_t *own = peer_ctrl(c, c->rank);
    unsigned long long *claim = (unsigned long long *)&own->err_epoch;
    unsigned long long old = atomicAdd(claim, 0ull);
    while (old < epoch) {
        unsigned long long prev = atomicCAS(claim, old, (unsigned long long)epoch);
        if (prev == old) {
            epx_cuda_err_record_t *rec = &c->host->err;
            /* A record of an earlier epoch may be there: hide it while the fields change, so the
             * host never pairs its code with our fields. */
            st_volatile_i32(&rec->code, 0);
            __threadfence_system();
            st_volatile_i32(&rec->rank, c->rank);
            st_volatile_i32(&rec->peer, peer);
            st_volatile_i32(&rec->channel, (int32_t)blockIdx.x);
            st_volatile_i32(&rec->what, what);
            st_volatile_u64(&rec->epoch, epoch);
            st_volatile_u64(&rec->seen, seen);
            st_volatile_u64(&rec->expected, expected);
            st_volatile_i32(&rec->expert, expert);
            __threadfence_system();
            st_volatile_i32(&rec->code, (int32_t)code);
            __threadfence_system();
            return;
        }
        old = prev;
    }
}

/* True when some block of this rank already failed `epoch`: give up without waiting. */
__device__ __forceinline__ bool epoch_failed(const epx_cuda_common_t *c, uint64_t epoch)
{
    return ld_volatile_u64(&peer_ctrl(c, c->rank)->err_epoch) >= epoch;
}

/* The call's first kernel (block 0, threads r < R) posts this rank's call word for `epoch` to
 * every peer (contract.h: EPX_CUDA_SIG_BITS). */
__device__ __forceinline__ void post_call(const epx_cuda_common_t *c, uint64_t epoch)
{
    if (c->call_sig != 0 && blockIdx.x == 0 && (int)threadIdx.x < c->nranks)
        st_release_sys(&peer_ctrl(c, threadIdx.x)->call[epoch & 1][c->rank],
                       epoch << EPX_CUDA_SIG_BITS | c->call_sig);
}

/* False (recorded as EPX_ERR_MISMATCH, the peer's signature as `seen`, ours as `expected`) when
 * peer's call word for `epoch` is there and differs from ours. A word of another epoch says
 * nothing: the peer has not started the call, or this kernel belongs to no call (hooks). */
__device__ __forceinline__ bool call_agrees(const epx_cuda_common_t *c, int peer, uint64_t epoch, int expert)
{
    if (c->call_sig == 0) return true;
    const uint64_t w = ld_acquire_sys(&peer_ctrl(c, c->rank)->call[epoch & 1][peer]);
    if (w >> EPX_CUDA_SIG_BITS != epoch || (w & EPX_CUDA_SIG_MASK) == c->call_sig) return true;
    record_error(c, epoch, EPX_ERR_MISMATCH, peer, EPX_CUDA_WAIT_CALL, w & EPX_CUDA_SIG_MASK, c->call_sig,
                 expert);
    return false;
}

/* Spins until *flag >= target. Gives up on the deadline (EPX_ERR_TIMEOUT), on the peer's
 * failure word reaching `epoch` (EPX_ERR_REMOTE; for a release of an earlier epoch, target < epoch,
 * also when it is there: the peer failed or left the call before we write into its region), on a
 * peer's call of the same epoch that differs from ours (EPX_ERR_MISMATCH), on the abort flag, or
 * when another block of this rank already failed the epoch. Returns true when the flag arrived. */
__device__ inline bool wait_flag_geq(const epx_cuda_common_t *c, const uint64_t *flag, uint64_t target,
                                     uint64_t epoch, int peer, int what, int expert = -1)
{
    const uint64_t *fail = &peer_ctrl(c, c->rank)->fail[peer];
    uint64_t v = ld_acquire_sys(flag);
    if (v >= target) {
        if (target < epoch && ld_volatile_u64(fail) >= epoch) {
            record_error(c, epoch, EPX_ERR_REMOTE, peer, what, v, target, expert);
            return false;
        }
        return call_agrees(c, peer, epoch, expert);
    }
    const uint64_t start = globaltimer_ns();
    for (uint32_t it = 1;; it++) {
        v = ld_acquire_sys(flag);
        if (v >= target) return call_agrees(c, peer, epoch, expert);
        if ((it & 63u) == 0) {
            if (ld_volatile_u64(fail) >= epoch) {
                record_error(c, epoch, EPX_ERR_REMOTE, peer, what, v, target, expert);
                return false;
            }
            if (!call_agrees(c, peer, epoch, expert)) return false;
            if (epoch_failed(c, epoch) || ld_volatile_i32(&c->host->abort_flag)) return false;
            if (globaltimer_ns() - start > c->timeout_ns) {
                record_error(c, epoch, EPX_ERR_TIMEOUT, peer, what, v, target, expert);
                return false;
            }
        }
    }
}

/* ---------------------------------------------------------------------------- top-k ids ---- */

__device__ __forceinline__ int64_t topk_at(const void *idx, int is64, int64_t i)
{
    return is64 ? ((const int64_t *)idx)[i] : (int64_t)((const int32_t *)idx)[i];
}

/* Expert id valid for routing (invalid device ids are reported and treated as -1). */
__device__ __forceinline__ bool expert_ok(int64_t e, int E)
{
    return e >= 0 && e < E;
}

/* Slot k of token t of a device topk_idx [T][K], checked: an id outside [-1, E) or a repeat of an
 * earlier slot's id is recorded for the host (which cannot read device ids; `host` may be NULL)
 * and reads as -1. */
/* True when id `e` of slot k of token t is outside [-1, E) or repeats an earlier slot's id. */
__device__ __forceinline__ bool topk_bad(const void *idx, int is64, int64_t t, int K, int k, int E, int64_t e)
{
    bool bad = e < -1 || e >= E;
    for (int j = 0; j < k && !bad && e >= 0; j++) bad = topk_at(idx, is64, t * K + j) == e;
    return bad;
}

__device__ __forceinline__ int64_t topk_checked(const void *idx, int is64, int64_t t, int K, int k, int E,
                                                epx_cuda_host_block_t *host, int64_t *bad_word = nullptr)
{
    const int64_t e = topk_at(idx, is64, t * K + k);
    if (!topk_bad(idx, is64, t, K, k, E, e)) return e;
    const int64_t where = 1 + t * EPX_MAX_TOPK + k;
    if (host) {
        host->bad_value = e;
        host->bad_where = where;
    }
    if (bad_word && atomicCAS((unsigned long long *)bad_word, 0ull, (unsigned long long)where) == 0ull)
        bad_word[1] = e;
    return -1;
}

/* A rank whose own device input held a bad value (`where` != 0, the same in all threads) fails the
 * call on the device: block 0 records EPX_ERR_INVALID_ARG (`what`, `value` as `seen`, `where` as
 * `expected`) and posts its fail word for `epoch` to every peer, whose waits on us then return
 * EPX_ERR_REMOTE. refuse_bad: the same from a bad word [where, value] written by an earlier kernel
 * of the call (NULL: none checked). */
__device__ __forceinline__ bool refuse_at(const epx_cuda_common_t *c, int64_t where, int64_t value,
                                          uint64_t epoch, int what)
{
    if (where == 0) return false;
    if (blockIdx.x == 0) {
        if (threadIdx.x == 0)
            record_error(c, epoch, EPX_ERR_INVALID_ARG, c->rank, what, (uint64_t)value, (uint64_t)where);
        if ((int)threadIdx.x < c->nranks && (int)threadIdx.x != c->rank)
            st_release_sys(&peer_ctrl(c, threadIdx.x)->fail[c->rank], epoch);
    }
    return true;
}

__device__ __forceinline__ bool refuse_bad(const epx_cuda_common_t *c, const int64_t *bad, uint64_t epoch,
                                           int what)
{
    if (!bad) return false;
    const int64_t where = *(const volatile int64_t *)bad;
    return refuse_at(c, where, where ? bad[1] : 0, epoch, what);
}

/* The first bad slot of a device topk_idx [T][K] in row-major order (1 + t * EPX_MAX_TOPK + k, 0 =
 * none) and its id in *value, the same answer in every thread of every block: each block checks
 * every row itself, so blocks agree without a grid-wide step (LL calls: T is small, a thread or two
 * per row). Call once per kernel, all threads. */
__device__ inline int64_t block_first_bad(const void *idx, int is64, int64_t T, int K, int E, int64_t *value)
{
    __shared__ unsigned long long first;
    if (threadIdx.x == 0) first = ~0ull;
    __syncthreads();
    for (int64_t t = threadIdx.x; t < T; t += blockDim.x)
        for (int k = 0; k < K; k++)
            if (topk_bad(idx, is64, t, K, k, E, topk_at(idx, is64, t * K + k))) {
                atomicMin(&first, (unsigned long long)(1 + t * EPX_MAX_TOPK + k));
                break;
            }
    __syncthreads();
    const unsigned long long w = first;
    if (w == ~0ull) return 0;
    const int64_t at = (int64_t)w - 1;
    *value = topk_at(idx, is64, at / EPX_MAX_TOPK * K + at % EPX_MAX_TOPK);
    return (int64_t)w;
}

/* Gates of wait_peers: true lets the waits run. */
struct gate_unless {
    bool refused;
    __device__ bool operator()() const
    {
        return !refused;
    }
};

/* ------------------------------------------------------------------------------ poison ---- */

/* The NaN of an element of `elem` bytes (1: fp8 e4m3 0x7f, 2: bf16 0x7fc0, 4: fp32 0x7fc00000) over
 * 32 bits; kPoisonIndex: -1 for int32 and int64 ids. */
__device__ __forceinline__ uint32_t nan_pattern(int elem)
{
    return elem == 1 ? 0x7f7f7f7fu : (elem == 2 ? 0x7fc07fc0u : 0x7fc00000u);
}
constexpr uint32_t kPoisonIndex = 0xffffffffu;

/* Outputs of a call that saw a bad value never look like data: `rows` rows of `row_bytes` bytes
 * are filled with the 32-bit pattern `pat` (nan_pattern, kPoisonIndex), spread over the grid's
 * threads. */
__device__ inline void poison_rows(void *base, int64_t rows, int64_t row_bytes, uint32_t pat)
{
    if (!base || rows <= 0) return;
    const int64_t bytes = rows * row_bytes;
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, n = (int64_t)gridDim.x * blockDim.x;
    if ((bytes & 3) == 0 && ((uintptr_t)base & 3) == 0) {
        for (int64_t i = tid; i < bytes / 4; i += n) ((uint32_t *)base)[i] = pat;
    } else {
        for (int64_t i = tid; i < bytes; i += n) ((uint8_t *)base)[i] = (uint8_t)(pat >> (8 * (i & 3)));
    }
}

/* `n` int32 counts become -1, spread over the grid's threads (NULL: skipped). */
__device__ inline void poison_counts(int32_t *p, int64_t n)
{
    if (!p) return;
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, m = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = tid; i < n; i += m) p[i] = -1;
}

/* ------------------------------------------------------------------------ kernel frame ---- */

/* Block-wide "am I the last block to finish": every block calls it once at its end (all
 * threads). Each block's writes are fenced at system scope before its arrival, so the last block
 * sees them all. Resets the counter for the next launch. */
__device__ inline bool last_block_arrive(uint32_t *counter)
{
    __shared__ int is_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned prev = atomic_add_release_sys(counter, 1u);
        is_last = (prev == gridDim.x - 1);
        if (is_last) {
            *counter = 0;
            __threadfence_system();
        }
    }
    __syncthreads();
    return is_last != 0;
}

struct no_arrival {
    __device__ bool operator()(int) const
    {
        return true;
    }
};
struct open_gate {
    __device__ bool operator()() const
    {
        return true;
    }
};

/* The opening of a collective kernel (all threads): thread r < R waits until peer r's word
 * flag_of(r) reaches `target`, then runs arrived(r) (false fails the block). Returns the block's
 * verdict, a shared word (nonzero: every wait succeeded) that stays in shared memory rather than
 * a register through the kernel (one word per call site: each lambda is its own instantiation).
 * Shared memory the caller set up before is visible after it. A gate (thread 0) that says false
 * skips the waits and fails the block. */
template <typename FlagOf, typename Arrived = no_arrival, typename Gate = open_gate>
__device__ __forceinline__ const int &wait_peers(const epx_cuda_common_t *c, FlagOf flag_of, uint64_t target,
                                                 uint64_t epoch, int what, Arrived arrived = Arrived(),
                                                 Gate gate = Gate(), int expert = -1)
{
    constexpr bool gated = !std::is_same<Gate, open_gate>::value;
    __shared__ int ok;
    if (threadIdx.x == 0) ok = gate();
    __syncthreads();
    if (threadIdx.x < c->nranks && (!gated || ok) &&
        !(wait_flag_geq(c, flag_of(threadIdx.x), target, epoch, threadIdx.x, what, expert) &&
          arrived(threadIdx.x)))
        ok = 0;
    __syncthreads();
    return ok;
}

/* Thread r < R stores `value` into peer r's word flag_of(r) with system-scope release. */
template <typename FlagOf>
__device__ __forceinline__ void release_peers(const epx_cuda_common_t *c, FlagOf flag_of, uint64_t value)
{
    if (threadIdx.x < c->nranks) st_release_sys(flag_of(threadIdx.x), value);
}

/* A sender's end (last block): unless this rank already failed `epoch`, thread r < R runs
 * publish(r), which hands peer r what this kernel wrote for it. */
template <typename Publish>
__device__ __forceinline__ void publish_peers(const epx_cuda_common_t *c, uint64_t epoch, Publish publish)
{
    if (!epoch_failed(c, epoch) && threadIdx.x < c->nranks) publish(threadIdx.x);
}

/* Thread 0 closes collective `epoch`: the operation's own last-epoch word(s), then the ctrl's
 * epoch that the next kernel of this rank reads, fenced at system scope. */
__device__ __forceinline__ void close_epoch(epx_cuda_ctrl_t *own, uint64_t *op_last, uint64_t epoch,
                                            uint64_t *also_last = nullptr)
{
    if (threadIdx.x == 0) {
        *op_last = epoch;
        if (also_last) *also_last = epoch;
        own->epoch = epoch;
        __threadfence_system();
    }
}

/* A failed collective's end (last block, all threads): the HT/routing-map dispatch and combine
 * areas go back to every peer at `epoch`, and after a mismatch also both LL slots' dispatch and
 * combine areas, so a peer whose call of this epoch was of another kind does not wait for a
 * release we would never make. Between calls the HT areas hold nothing of ours that a peer still
 * needs; an LL slot may (a receive hook not run yet), so its release waits for a mismatch, where
 * the ranks' calls are out of step anyway. */
__device__ __forceinline__ void release_if_failed(const epx_cuda_common_t *c, uint64_t epoch)
{
    __shared__ int failed;
    __syncthreads();
    if (threadIdx.x == 0) {
        failed = epoch_failed(c, epoch);
        if (failed && c->lay.ll && ld_volatile_i32(&c->host->err.code) == EPX_ERR_MISMATCH &&
            ld_volatile_u64(&c->host->err.epoch) == epoch)
            failed = 2;
    }
    __syncthreads();
    if (failed && (int)threadIdx.x < c->nranks) {
        /* Never below what a later call released (an LL receive hook may run late): a maximum. */
        epx_cuda_ctrl_t *peer = peer_ctrl(c, threadIdx.x);
        __threadfence_system();
        atomicMax_system((unsigned long long *)&peer->disp_ack[c->rank], (unsigned long long)epoch);
        atomicMax_system((unsigned long long *)&peer->comb_ack[c->rank], (unsigned long long)epoch);
        if (failed == 2) {
            epx_cuda_ll_ctrl_t *lp = (epx_cuda_ll_ctrl_t *)(c->peers[threadIdx.x] + c->lay.ll);
            for (int s = 0; s < 2; s++) {
                atomicMax_system((unsigned long long *)&lp->disp_ack[s][c->rank], (unsigned long long)epoch);
                atomicMax_system((unsigned long long *)&lp->comb_ack[s][c->rank], (unsigned long long)epoch);
            }
        }
    }
}

/* A dispatch receiver's end (last block, after its own writes): every source may reuse its slice
 * of our area, and the collective closes. */
__device__ __forceinline__ void finish_dispatch_recv(const epx_cuda_common_t *c, uint64_t epoch,
                                                     uint64_t *also_last = nullptr)
{
    epx_cuda_ctrl_t *own = peer_ctrl(c, c->rank);
    release_if_failed(c, epoch);
    release_peers(
        c, [&](int r) { return &peer_ctrl(c, r)->disp_ack[c->rank]; }, epoch);
    close_epoch(own, &own->disp_last, epoch, also_last);
}

/* A dispatch receiver's verdict on its row count, before it writes any output (all threads; `ok`
 * and `fits` the same in every thread of the block). Block 0's threads r < R tell peer r that we
 * accept (accept word), or, when our waits succeeded but the outputs are too small (!fits), that
 * we refuse: our fail word for `epoch`, which makes the peer's waits on us return
 * EPX_ERR_REMOTE. With `wait` (a receiver whose outputs must hold every row), a block that
 * accepted then waits until every peer accepted, so no rank writes outputs of a call that some
 * rank refuses; one flag round, only where the host waits for N_r anyway. Every dispatch that a
 * waiting peer's call can meet at its epoch posts: a refusal or a bad call never leaves a peer
 * waiting. Returns the block's verdict: ok, and fits, and every peer accepted. */
__device__ __forceinline__ bool accept_counts(const epx_cuda_common_t *c, uint64_t epoch, bool ok, bool fits,
                                              bool wait)
{
    epx_cuda_ctrl_t *own = peer_ctrl(c, c->rank);
    if (blockIdx.x == 0 && (int)threadIdx.x < c->nranks) {
        epx_cuda_ctrl_t *peer = peer_ctrl(c, threadIdx.x);
        const bool refuse = ok && !fits && (int)threadIdx.x != c->rank;
        st_release_sys(refuse ? &peer->fail[c->rank] : &peer->accept[c->rank], epoch);
    }
    if (!ok || !fits) return false;
    if (!wait) return true;
    const int &agreed = wait_peers(
        c, [&](int r) { return &own->accept[r]; }, epoch, epoch, EPX_CUDA_WAIT_ACCEPT);
    return agreed != 0;
}

/* -------------------------------------------------------------------------- launchers ---- */

/* Enqueues kernel<<<grid, block, smem>>>(args) on `stream`; a cudaError_t value (0 = success). */
template <typename Args>
static inline int launch_kernel(void (*kernel)(Args), const Args &args, int grid, int block, size_t smem,
                                void *stream)
{
    kernel<<<grid, block, smem, (cudaStream_t)stream>>>(args);
    return (int)cudaGetLastError();
}

/* Defines the contract's launcher epx_cuda_launch_<name>(const Args *, void *stream): <name>_kernel
 * over the args' grid of kBlockThreads-thread blocks. */
#define EPX_DEFINE_LAUNCHER(name, Args)                                                           \
    extern "C" int epx_cuda_launch_##name(const Args *args, void *stream)                         \
    {                                                                                             \
        return launch_kernel(name##_kernel, *args, args->c.num_blocks, kBlockThreads, 0, stream); \
    }

/* The two halves of an operation, in stream order over the args' grid: `second` gets `smem` bytes
 * of dynamic shared memory (opted in past the 48 KB that need none). */
template <typename Args>
static inline int launch_pair(void (*first)(Args), void (*second)(Args), const Args *args, size_t smem,
                              void *stream)
{
    cudaError_t err = (cudaError_t)launch_kernel(first, *args, args->c.num_blocks, kBlockThreads, 0, stream);
    if (err != cudaSuccess) return (int)err;
    if (smem > 48 * 1024) {
        err = cudaFuncSetAttribute(second, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (err != cudaSuccess) return (int)err;
    }
    return launch_kernel(second, *args, args->c.num_blocks, kBlockThreads, smem, stream);
}

#endif /* EPX_KERNELS_COMMON_CUH */
