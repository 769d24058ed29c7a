/*
 * Memory ordering and bounded waits for the cuda backend's kernels. Every cross-rank flag goes
 * through these helpers; every spin has a %globaltimer deadline, polls the abort flag and the
 * peer's failure word, and on expiry fills the buffer's error record.
 */
#ifndef EPX_KERNELS_SYNC_CUH
#define EPX_KERNELS_SYNC_CUH

#include <stdint.h>

#include "kernels/contract.h"

#define EPX_RES_TIMEOUT 4 /* EPX_ERR_TIMEOUT */
#define EPX_RES_REMOTE 10 /* EPX_ERR_REMOTE */
#define EPX_RES_INVALID 1 /* EPX_ERR_INVALID_ARG */

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

__device__ __forceinline__ void fence_acq_rel_sys(void) { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ uint64_t globaltimer_ns(void)
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

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

__device__ __forceinline__ epx_cuda_ctrl_t *ctrl_of(uint8_t *region) { return (epx_cuda_ctrl_t *)region; }

/* Records the first failure of `epoch` (the device-local claim word picks one writer), then
 * publishes it to the host with the code written last. */
__device__ inline void record_error(const epx_cuda_common_t *c, uint64_t epoch, int code, int peer, int what,
                                    uint64_t seen, uint64_t expected, int expert = -1)
{
    epx_cuda_ctrl_t *own = ctrl_of(c->peers[c->rank]);
    unsigned long long *claim = (unsigned long long *)&own->err_epoch;
    unsigned long long old = atomicAdd(claim, 0ull);
    while (old < epoch) {
        unsigned long long prev = atomicCAS(claim, old, (unsigned long long)epoch);
        if (prev == old) {
            epx_cuda_err_record_t *rec = &c->host->err;
            volatile epx_cuda_err_record_t *vrec = rec;
            /* A record of an earlier epoch may be there: hide it while the fields change, so the
             * host never pairs its code with our fields. */
            vrec->code = 0;
            __threadfence_system();
            vrec->rank = c->rank;
            vrec->peer = peer;
            vrec->channel = (int32_t)blockIdx.x;
            vrec->what = what;
            vrec->epoch = epoch;
            vrec->seen = seen;
            vrec->expected = expected;
            vrec->expert = expert;
            __threadfence_system();
            vrec->code = code;
            __threadfence_system();
            return;
        }
        old = prev;
    }
}

/* True when some block of this rank already failed `epoch`: give up without waiting. */
__device__ __forceinline__ bool epoch_failed(const epx_cuda_common_t *c, uint64_t epoch)
{
    return ld_volatile_u64(&ctrl_of(c->peers[c->rank])->err_epoch) >= epoch;
}

/* Spins until *flag >= target. Gives up on the deadline (EPX_ERR_TIMEOUT), on the peer's
 * failure word reaching `epoch` (EPX_ERR_REMOTE), on the abort flag, or when another block of
 * this rank already failed the epoch. Returns true when the flag arrived. */
__device__ inline bool wait_flag_geq(const epx_cuda_common_t *c, const uint64_t *flag, uint64_t target,
                                     uint64_t epoch, int peer, int what, int expert = -1)
{
    uint64_t v = ld_acquire_sys(flag);
    if (v >= target) return true;
    const uint64_t start = globaltimer_ns();
    const uint64_t *fail = &ctrl_of(c->peers[c->rank])->fail[peer];
    for (uint32_t it = 1;; it++) {
        v = ld_acquire_sys(flag);
        if (v >= target) return true;
        if ((it & 63u) == 0) {
            if (ld_volatile_u64(fail) >= epoch) {
                record_error(c, epoch, EPX_RES_REMOTE, peer, what, v, target, expert);
                return false;
            }
            if (epoch_failed(c, epoch) || ld_volatile_i32(&c->host->abort_flag)) return false;
            if (globaltimer_ns() - start > c->timeout_ns) {
                record_error(c, epoch, EPX_RES_TIMEOUT, peer, what, v, target, expert);
                return false;
            }
        }
    }
}

/* Block-wide "am I the last block to finish": every block calls it once at its end (all
 * threads). Each block's writes are fenced at system scope before its arrival, so the last block
 * sees them all. Resets the counter for the next launch. */
__device__ inline bool last_block_arrive(uint32_t *counter)
{
    __shared__ int is_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        unsigned prev = atomicAdd(counter, 1u);
        is_last = (prev == gridDim.x - 1);
        if (is_last) {
            *counter = 0;
            __threadfence_system();
        }
    }
    __syncthreads();
    return is_last != 0;
}

#endif /* EPX_KERNELS_SYNC_CUH */
