/*
 * The `loop` test transport of net.h, device side (its state and modes: src/net/loop.h). Every operation
 * is issued by the calling thread alone, like GIN's: a put reads what that thread may read (bytes other
 * threads wrote must be made visible to it first, a barrier), and a copy of a queued put may be done by
 * another thread of the rank later, reading the source through L2. Included by net.h in CUDA compiles.
 */
#include "net/net.h"

#ifndef EPX_NET_LOOP_CUH
#define EPX_NET_LOOP_CUH

#if defined(__CUDACC__)

#include "net/loop.h"

__device__ static inline unsigned long long epx_net_loop_ld_acquire(const unsigned long long *p)
{
    unsigned long long v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ static inline void epx_net_loop_st_release(unsigned long long *p, unsigned long long v)
{
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* The handle fits the transport's limits, then net.h's checks of the operation. */
__device__ static inline epx_net_status_t epx_net_loop_check(const epx_net_t *net, const epx_net_loop_t *l,
                                                             const epx_net_op_t *op)
{
    if (!l || net->nranks > EPX_NET_LOOP_MAX_RANKS || net->ncontexts > EPX_NET_LOOP_MAX_CONTEXTS)
        return EPX_NET_INVALID;
    return epx_net_check_op(net, op, l->nregions, l->region_bytes);
}

/* Copies `n` bytes through L2 (the source may have been written by another thread of the rank, the
 * destination is read by another process); `reverse`: the last 16-byte word first. */
__device__ static inline void epx_net_loop_copy(uint8_t *dst, const uint8_t *src, uint64_t n, int reverse)
{
    if (((uintptr_t)dst & 15) == 0 && ((uintptr_t)src & 15) == 0) {
        const uint64_t n16 = n >> 4;
        for (uint64_t i = 0; i < n16; i++) {
            const uint64_t k = reverse ? n16 - 1 - i : i;
            __stcg((int4 *)dst + k, __ldcg((const int4 *)src + k));
        }
        for (uint64_t i = n16 << 4; i < n; i++) __stcg(dst + i, __ldcg(src + i));
    } else {
        for (uint64_t i = 0; i < n; i++) {
            const uint64_t k = reverse ? n - 1 - i : i;
            __stcg(dst + k, __ldcg(src + k));
        }
    }
}

/* Adds `add` to `peer`'s signal after every byte this thread has copied or seen delivered. */
__device__ static inline void epx_net_loop_signal(const epx_net_loop_t *l, int peer, uint32_t signal,
                                                  uint64_t add)
{
    __threadfence_system();
    atomicAdd_system(l->signals[peer] + signal, (unsigned long long)add);
}

/* Lands a queued operation whose slot this thread claimed (phase 2 for `ticket`), then frees the slot. */
__device__ static inline void epx_net_loop_land(const epx_net_t *net, const epx_net_loop_t *l,
                                                epx_net_loop_entry_t *e, unsigned long long ticket)
{
    if (e->kind != EPX_NET_LOOP_SIGNAL) epx_net_loop_copy(e->dst, e->src, e->bytes, 1);
    if (e->kind != EPX_NET_LOOP_PUT) {
        epx_net_loop_signal(l, e->peer, e->signal, e->add);
        const uint32_t ctx = (uint32_t)((e - l->queue) / EPX_NET_LOOP_QUEUE);
        atomicAdd(l->tail + net->ncontexts + ctx, ~0ull); /* one weak operation fewer queued */
    }
    __threadfence_system();
    epx_net_loop_st_release(&e->state, 4ull * (ticket + EPX_NET_LOOP_QUEUE));
}

/* Kinds a delivery lands: bit k for EPX_NET_LOOP_* k. */
enum { EPX_NET_LOOP_PUTS = 3, EPX_NET_LOOP_WEAK = 6, EPX_NET_LOOP_ALL = 7 };

/* Lands the queued operations of `ctx` of the kinds in `kinds` (to `peer` only, or every peer when
 * peer < 0), newest first. With `wait`, also waits for those another thread is landing: EPX_NET_TIMEOUT
 * past `deadline_ns`, EPX_NET_ABORTED when the abort word is set meanwhile. An operation queued
 * concurrently (not before this call) may or may not land. */
__device__ static inline epx_net_status_t epx_net_loop_deliver(const epx_net_t *net, const epx_net_loop_t *l,
                                                               uint32_t ctx, int peer, int kinds, int wait,
                                                               uint64_t deadline_ns)
{
    const unsigned long long tail = epx_net_loop_ld_acquire(l->tail + ctx);
    const unsigned long long n = tail < EPX_NET_LOOP_QUEUE ? tail : EPX_NET_LOOP_QUEUE;
    epx_net_loop_entry_t *q = l->queue + (uint64_t)ctx * EPX_NET_LOOP_QUEUE;
    for (unsigned long long i = 0; i < n; i++) {
        epx_net_loop_entry_t *e = q + (tail - 1 - i) % EPX_NET_LOOP_QUEUE;
        for (;;) {
            const unsigned long long s = epx_net_loop_ld_acquire(&e->state);
            const unsigned long long phase = s & 3, ticket = s >> 2;
            if (phase == 0 || (peer >= 0 && e->peer != peer) || !((kinds >> e->kind) & 1)) break;
            if (phase == 1 && atomicCAS(&e->state, s, 4ull * ticket + 2) == s) {
                epx_net_loop_land(net, l, e, ticket);
                break;
            }
            if (phase == 2) { /* another thread lands it: with `wait`, it must land before we go on */
                if (!wait) break;
                if (epx_net_aborted(net)) return EPX_NET_ABORTED;
                if (epx_net_now_ns() > deadline_ns) return EPX_NET_TIMEOUT;
            }
        }
    }
    return EPX_NET_OK;
}

/* Queues an operation (strict mode). Its slot may still hold the operation of ticket - QUEUE: that one
 * lands first. */
__device__ static inline epx_net_status_t epx_net_loop_enqueue(const epx_net_t *net, const epx_net_loop_t *l,
                                                               const epx_net_op_t *op, uint32_t kind,
                                                               uint8_t *dst, const uint8_t *src)
{
    const unsigned long long ticket = atomicAdd(l->tail + op->ctx, 1ull);
    epx_net_loop_entry_t *e = l->queue + (uint64_t)op->ctx * EPX_NET_LOOP_QUEUE + ticket % EPX_NET_LOOP_QUEUE;
    const uint64_t deadline = epx_net_now_ns() + EPX_NET_LOOP_POST_WAIT_NS;
    for (;;) {
        const unsigned long long s = epx_net_loop_ld_acquire(&e->state);
        if (s == 4ull * ticket) break;
        if ((s & 3) == 1 && atomicCAS(&e->state, s, (s & ~3ull) + 2) == s) {
            epx_net_loop_land(net, l, e, s >> 2);
            continue;
        }
        if (epx_net_aborted(net)) return EPX_NET_ABORTED;
        if (epx_net_now_ns() > deadline) return EPX_NET_TIMEOUT;
    }
    e->peer = op->peer;
    e->kind = kind;
    e->bytes = op->bytes;
    e->dst = dst;
    e->src = src;
    e->signal = op->signal;
    e->add = op->signal_add;
    if (kind != EPX_NET_LOOP_PUT) atomicAdd(l->tail + net->ncontexts + op->ctx, 1ull);
    __threadfence();
    epx_net_loop_st_release(&e->state, 4ull * ticket + 1);
    return EPX_NET_OK;
}

__device__ static inline epx_net_status_t epx_net_loop_post(const epx_net_t *net, const epx_net_op_t *op)
{
    const epx_net_loop_t *l = (const epx_net_loop_t *)net->impl;
    const epx_net_status_t s = epx_net_loop_check(net, l, op);
    if (s != EPX_NET_OK) return s;
    const int strong = op->kind != EPX_NET_OP_PUT && op->signal_mode == EPX_NET_SIGNAL_STRONG;
    uint8_t *dst = nullptr;
    const uint8_t *src = nullptr;
    if (op->kind != EPX_NET_OP_SIGNAL) {
        dst = l->base[op->peer][op->dst_region] + op->dst_offset;
        src = l->base[net->rank][op->src_region] + op->src_offset;
    }
    if (l->strict && !strong) /* a plain put, or a weak signal with or without its put: queued */
        return epx_net_loop_enqueue(net, l, op,
                                    op->kind == EPX_NET_OP_PUT          ? EPX_NET_LOOP_PUT
                                    : op->kind == EPX_NET_OP_PUT_SIGNAL ? EPX_NET_LOOP_PUT_SIGNAL
                                                                        : EPX_NET_LOOP_SIGNAL,
                                    dst, src);
    if (l->strict) { /* a strong signal: the context's queued puts to its peer land first */
        const epx_net_status_t d = epx_net_loop_deliver(net, l, op->ctx, op->peer, EPX_NET_LOOP_PUTS, 1,
                                                        epx_net_now_ns() + EPX_NET_LOOP_POST_WAIT_NS);
        if (d != EPX_NET_OK) return d;
    }
    if (op->kind != EPX_NET_OP_SIGNAL) epx_net_loop_copy(dst, src, op->bytes, (int)l->strict);
    if (op->kind != EPX_NET_OP_PUT) epx_net_loop_signal(l, op->peer, op->signal, op->signal_add);
    return EPX_NET_OK;
}

/* Strict mode, from a wait's poll: the rank's queued weak operations of every context land (those another
 * thread is landing are left to it). */
__device__ static inline void epx_net_loop_poll(const epx_net_t *net)
{
    const epx_net_loop_t *l = (const epx_net_loop_t *)net->impl;
    if (!l || !l->strict || net->ncontexts > EPX_NET_LOOP_MAX_CONTEXTS) return;
    for (uint32_t c = 0; c < net->ncontexts; c++)
        if (*(volatile unsigned long long *)(l->tail + net->ncontexts + c) != 0)
            epx_net_loop_deliver(net, l, c, -1, EPX_NET_LOOP_WEAK, 0, 0);
}

__device__ static inline epx_net_status_t epx_net_loop_signal_read(const epx_net_t *net, uint32_t signal,
                                                                   uint64_t *value_out)
{
    const epx_net_loop_t *l = (const epx_net_loop_t *)net->impl;
    if (!l || net->rank < 0 || net->rank >= EPX_NET_LOOP_MAX_RANKS || signal >= net->nsignals)
        return EPX_NET_INVALID;
    *value_out = epx_net_loop_ld_acquire(l->signals[net->rank] + signal);
    return EPX_NET_OK;
}

/* Normal mode: every put was copied when posted. Strict mode: the context's queued operations land now. */
__device__ static inline epx_net_status_t epx_net_loop_flush(const epx_net_t *net, uint32_t ctx,
                                                             uint64_t deadline_ns)
{
    const epx_net_loop_t *l = (const epx_net_loop_t *)net->impl;
    if (!l || ctx >= net->ncontexts || net->ncontexts > EPX_NET_LOOP_MAX_CONTEXTS) return EPX_NET_INVALID;
    return l->strict ? epx_net_loop_deliver(net, l, ctx, -1, EPX_NET_LOOP_ALL, 1, deadline_ns) : EPX_NET_OK;
}

#endif /* __CUDACC__ */

#endif
