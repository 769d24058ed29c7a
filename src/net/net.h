/*
 * epx's network interface as kernels use it: put, put with signal, signal add, read and wait for a
 * signal, flush, on numbered contexts. Transport-independent: a handle names its transport and every
 * operation dispatches on it. Plain C, read by device code (.cu), host C code and the tests; the
 * host model of these rules (src/net/loop_model.c) is the semantic reference every transport
 * (the cuda `loop` test transport, the GIN transport) must match.
 *
 * Ordering rules (NCCL GIN's; a kernel that relies on anything more is wrong on a NIC):
 *  - Contexts are independent: nothing on one context is ordered with anything on another.
 *  - Puts on one context may land in any order, at one peer or at several.
 *  - A STRONG signal becomes visible at its peer only after every put posted earlier on its context
 *    to that same peer (its own put included) has landed. Puts of the context to other peers are
 *    not covered: GIN orders a signal only behind its context's puts to the signal's peer, and its
 *    public API has no call that completes a put at a peer (flush is local).
 *  - A WEAK signal covers only its own put: earlier puts of its context may still be in flight
 *    when it is seen, and it may be seen after later operations of its context.
 *  - A signal is an atomic add to a 64-bit counter at the peer; adds of one signal id never lose
 *    each other, in whatever order they land.
 *  - Flush returns when every put posted earlier on the context has read its source bytes (local
 *    completion: the source may be reused). It says nothing about delivery at the peer.
 *  - A waiter that sees a signal reach its target (acquire) sees the bytes the signal covers.
 * Every wait is bounded: it ends with EPX_NET_TIMEOUT at its deadline or EPX_NET_ABORTED when the
 * handle's abort word is non-zero, whichever it notices first, never later than one poll after.
 */
#ifndef EPX_NET_NET_H
#define EPX_NET_NET_H

#include <stddef.h>
#include <stdint.h>
#if !defined(__CUDA_ARCH__)
#include <time.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__CUDACC__)
#define EPX_NET_FN __host__ __device__ static inline
#else
#define EPX_NET_FN static inline
#endif

typedef enum epx_net_status {
    EPX_NET_OK = 0,
    EPX_NET_TIMEOUT = 1,     /* a wait passed its deadline */
    EPX_NET_ABORTED = 2,     /* a wait saw the abort word set */
    EPX_NET_INVALID = 3,     /* an argument out of range (context, peer, region, offset, signal) */
    EPX_NET_UNSUPPORTED = 4, /* the handle's transport is not available on this side (host/device) */
    EPX_NET_NO_MEMORY = 5,
} epx_net_status_t;

typedef enum epx_net_transport {
    EPX_NET_TRANSPORT_NONE = 0,
    EPX_NET_TRANSPORT_MODEL = 1, /* the host model (src/net/loop_model.c): tests only */
    EPX_NET_TRANSPORT_LOOP =
        2, /* cuda IPC between emulated nodes, device side: tests only (src/net/loop.cuh) */
    EPX_NET_TRANSPORT_GIN = 3, /* NCCL GIN, device side (src/net/gin.cuh, with EPX_NET_HAVE_GIN) */
} epx_net_transport_t;

typedef enum epx_net_signal_mode {
    EPX_NET_SIGNAL_STRONG = 0, /* covers every earlier put of its context to its peer */
    EPX_NET_SIGNAL_WEAK = 1,   /* covers only its own put */
} epx_net_signal_mode_t;

typedef enum epx_net_op_kind {
    EPX_NET_OP_PUT = 1,
    EPX_NET_OP_PUT_SIGNAL = 2,
    EPX_NET_OP_SIGNAL = 3, /* a signal add carrying no bytes */
} epx_net_op_kind_t;

/* One posted operation, as a transport receives it (and as a CPU-assisted queue would carry it).
 * Regions are registration indices: src_region on the poster, dst_region on `peer`. */
typedef struct epx_net_op {
    uint32_t kind; /* epx_net_op_kind_t */
    uint32_t ctx;
    int32_t peer;
    uint32_t signal_mode; /* epx_net_signal_mode_t; PUT_SIGNAL and SIGNAL only */
    uint32_t src_region;
    uint32_t dst_region;
    uint64_t src_offset;
    uint64_t dst_offset;
    uint64_t bytes;
    uint32_t signal; /* signal id at `peer`; PUT_SIGNAL and SIGNAL only */
    uint32_t pad;
    uint64_t signal_add;
} epx_net_op_t;

/* A rank's handle on a transport. Device code receives it by value in a kernel's argument struct.
 * `abort_word` (may be NULL) ends every wait of this handle when non-zero. */
typedef struct epx_net {
    uint32_t transport; /* epx_net_transport_t */
    int32_t rank;
    int32_t nranks;
    uint32_t ncontexts;
    uint32_t nsignals;
    uint32_t pad;
    void *impl; /* the transport's state */
    const int32_t *abort_word;
} epx_net_t;

/* ---- transport entry points (each behind its transport's case below) ---------------------------- */
#if !defined(__CUDA_ARCH__)
/* Host model (src/net/loop_model.c). */
epx_net_status_t epx_net_model_post(void *impl, int rank, const epx_net_op_t *op);
epx_net_status_t epx_net_model_signal_read(void *impl, int rank, uint32_t signal, uint64_t *value_out);
epx_net_status_t epx_net_model_flush(void *impl, int rank, uint32_t ctx);
void epx_net_model_poll(void *impl);
#endif

/* ---- clock and abort word ------------------------------------------------------------------------ */

/* Nanoseconds of a monotonic clock: the deadlines' time base (globaltimer on the device). */
EPX_NET_FN uint64_t epx_net_now_ns(void)
{
#if defined(__CUDA_ARCH__)
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
#endif
}

EPX_NET_FN int epx_net_aborted(const epx_net_t *net)
{
    if (!net->abort_word) return 0;
#if defined(__CUDA_ARCH__)
    int32_t v;
    asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(net->abort_word) : "memory");
    return v != 0;
#else
    return __atomic_load_n(net->abort_word, __ATOMIC_ACQUIRE) != 0;
#endif
}

/* The checks every transport makes of an operation, in the host model's order: kind, context, peer,
 * both byte ranges against the regions (`nregions` of `region_bytes` each, equal on every rank), signal
 * and its mode. EPX_NET_INVALID for the first that fails. */
EPX_NET_FN epx_net_status_t epx_net_check_op(const epx_net_t *net, const epx_net_op_t *op, uint32_t nregions,
                                             const uint64_t *region_bytes)
{
    if (op->kind < EPX_NET_OP_PUT || op->kind > EPX_NET_OP_SIGNAL) return EPX_NET_INVALID;
    if (op->ctx >= net->ncontexts) return EPX_NET_INVALID;
    if (op->peer < 0 || op->peer >= net->nranks) return EPX_NET_INVALID;
    if (op->kind != EPX_NET_OP_SIGNAL) {
        const uint32_t region[2] = {op->src_region, op->dst_region};
        const uint64_t offset[2] = {op->src_offset, op->dst_offset};
        for (int i = 0; i < 2; i++)
            if (region[i] >= nregions || offset[i] > region_bytes[region[i]] ||
                op->bytes > region_bytes[region[i]] - offset[i])
                return EPX_NET_INVALID;
    }
    if (op->kind != EPX_NET_OP_PUT &&
        (op->signal >= net->nsignals ||
         (op->signal_mode != EPX_NET_SIGNAL_STRONG && op->signal_mode != EPX_NET_SIGNAL_WEAK)))
        return EPX_NET_INVALID;
    return EPX_NET_OK;
}

/* The device transports. GIN's device side needs NCCL's C++ device headers: only CUDA compiles that define
 * EPX_NET_HAVE_GIN (and have NCCL 2.28+) see it; everywhere else GIN answers EPX_NET_UNSUPPORTED. The
 * loop test transport's needs nothing but CUDA: every CUDA compile sees it. */
#if defined(EPX_NET_HAVE_GIN) && defined(__CUDACC__)
#define EPX_NET_GIN_DEVICE 1
#endif
#if defined(__CUDACC__)
#ifdef __cplusplus
}
#endif
#include "net/loop.cuh"
#if defined(EPX_NET_GIN_DEVICE)
#include "net/gin.cuh"
#endif
#ifdef __cplusplus
extern "C" {
#endif
#endif

/* ---- operations ------------------------------------------------------------------------------- */

/* Hands one operation to the handle's transport. Returns EPX_NET_INVALID (nothing posted) for a
 * context, peer, region, range or signal out of range, EPX_NET_UNSUPPORTED for a transport absent
 * on this side. */
EPX_NET_FN epx_net_status_t epx_net_post(const epx_net_t *net, const epx_net_op_t *op)
{
    switch (net->transport) {
#if !defined(__CUDA_ARCH__)
    case EPX_NET_TRANSPORT_MODEL: return epx_net_model_post(net->impl, net->rank, op);
#endif
#if defined(__CUDA_ARCH__)
    case EPX_NET_TRANSPORT_LOOP: return epx_net_loop_post(net, op);
#endif
#if defined(__CUDA_ARCH__) && defined(EPX_NET_GIN_DEVICE)
    case EPX_NET_TRANSPORT_GIN: return epx_net_gin_post(net, op);
#endif
    default: return EPX_NET_UNSUPPORTED;
    }
}

/* Puts `bytes` from our region `src_region` at `src_offset` to `peer`'s region `dst_region` at
 * `dst_offset`, on context `ctx`. Lands some time later, unordered with other puts of the context. */
EPX_NET_FN epx_net_status_t epx_net_put(const epx_net_t *net, uint32_t ctx, int peer, uint32_t dst_region,
                                        uint64_t dst_offset, uint32_t src_region, uint64_t src_offset,
                                        uint64_t bytes)
{
    epx_net_op_t op = {EPX_NET_OP_PUT, ctx,        peer,  0, src_region, dst_region,
                       src_offset,     dst_offset, bytes, 0, 0,          0};
    return epx_net_post(net, &op);
}

/* A put followed by adding `add` to signal `signal` at `peer`: WEAK covers this put only, STRONG also
 * every earlier put of `ctx` to `peer`. */
EPX_NET_FN epx_net_status_t epx_net_put_signal(const epx_net_t *net, uint32_t ctx, int peer,
                                               uint32_t dst_region, uint64_t dst_offset, uint32_t src_region,
                                               uint64_t src_offset, uint64_t bytes, uint32_t signal,
                                               uint64_t add, epx_net_signal_mode_t mode)
{
    epx_net_op_t op = {EPX_NET_OP_PUT_SIGNAL,
                       ctx,
                       peer,
                       (uint32_t)mode,
                       src_region,
                       dst_region,
                       src_offset,
                       dst_offset,
                       bytes,
                       signal,
                       0,
                       add};
    return epx_net_post(net, &op);
}

/* Adds `add` to signal `signal` at `peer` without bytes: STRONG covers every earlier put of `ctx` to
 * `peer`, WEAK covers nothing. */
EPX_NET_FN epx_net_status_t epx_net_signal_add(const epx_net_t *net, uint32_t ctx, int peer, uint32_t signal,
                                               uint64_t add, epx_net_signal_mode_t mode)
{
    epx_net_op_t op = {EPX_NET_OP_SIGNAL, ctx, peer, (uint32_t)mode, 0, 0, 0, 0, 0, signal, 0, add};
    return epx_net_post(net, &op);
}

/* Reads our signal `signal` (acquire). [out] value_out, written on EPX_NET_OK only. */
EPX_NET_FN epx_net_status_t epx_net_signal_read(const epx_net_t *net, uint32_t signal, uint64_t *value_out)
{
    switch (net->transport) {
#if !defined(__CUDA_ARCH__)
    case EPX_NET_TRANSPORT_MODEL: return epx_net_model_signal_read(net->impl, net->rank, signal, value_out);
#endif
#if defined(__CUDA_ARCH__)
    case EPX_NET_TRANSPORT_LOOP: return epx_net_loop_signal_read(net, signal, value_out);
#endif
#if defined(__CUDA_ARCH__) && defined(EPX_NET_GIN_DEVICE)
    case EPX_NET_TRANSPORT_GIN: return epx_net_gin_signal_read(net, signal, value_out);
#endif
    default: return EPX_NET_UNSUPPORTED;
    }
}

/* Lets a transport that needs it move (the model when it progresses inside waits, the strict loop's queued
 * weak operations); nothing else. */
EPX_NET_FN void epx_net_poll(const epx_net_t *net)
{
#if !defined(__CUDA_ARCH__)
    if (net->transport == EPX_NET_TRANSPORT_MODEL) epx_net_model_poll(net->impl);
#else
    if (net->transport == EPX_NET_TRANSPORT_LOOP) epx_net_loop_poll(net);
#endif
}

/* Waits until our signal `signal` is at least `target`. Returns EPX_NET_OK once it is (checked first
 * on every poll), EPX_NET_ABORTED when the abort word is set, EPX_NET_TIMEOUT once epx_net_now_ns()
 * passes `deadline_ns`; a read's own error as it is. */
EPX_NET_FN epx_net_status_t epx_net_wait_signal(const epx_net_t *net, uint32_t signal, uint64_t target,
                                                uint64_t deadline_ns)
{
    for (;;) {
        uint64_t v = 0;
        epx_net_status_t s = epx_net_signal_read(net, signal, &v);
        if (s != EPX_NET_OK) return s;
        if (v >= target) return EPX_NET_OK;
        if (epx_net_aborted(net)) return EPX_NET_ABORTED;
        if (epx_net_now_ns() > deadline_ns) return EPX_NET_TIMEOUT;
        epx_net_poll(net);
    }
}

/* Local completion of every put posted earlier on `ctx`: their sources may be reused on return.
 * Delivery at the peers is not implied. Bounded like a wait. */
EPX_NET_FN epx_net_status_t epx_net_flush(const epx_net_t *net, uint32_t ctx, uint64_t deadline_ns)
{
    (void)deadline_ns; /* the model reads sources at once; a NIC or the strict loop waits until deadline_ns */
    if (epx_net_aborted(net)) return EPX_NET_ABORTED;
    switch (net->transport) {
#if !defined(__CUDA_ARCH__)
    case EPX_NET_TRANSPORT_MODEL: return epx_net_model_flush(net->impl, net->rank, ctx);
#endif
#if defined(__CUDA_ARCH__)
    case EPX_NET_TRANSPORT_LOOP: return epx_net_loop_flush(net, ctx, deadline_ns);
#endif
#if defined(__CUDA_ARCH__) && defined(EPX_NET_GIN_DEVICE)
    case EPX_NET_TRANSPORT_GIN: return epx_net_gin_flush(net, ctx, deadline_ns);
#endif
    default: return EPX_NET_UNSUPPORTED;
    }
}

EPX_NET_FN const char *epx_net_status_name(epx_net_status_t s)
{
    switch (s) {
    case EPX_NET_OK: return "EPX_NET_OK";
    case EPX_NET_TIMEOUT: return "EPX_NET_TIMEOUT";
    case EPX_NET_ABORTED: return "EPX_NET_ABORTED";
    case EPX_NET_INVALID: return "EPX_NET_INVALID";
    case EPX_NET_UNSUPPORTED: return "EPX_NET_UNSUPPORTED";
    case EPX_NET_NO_MEMORY: return "EPX_NET_NO_MEMORY";
    }
    return "EPX_NET_UNKNOWN";
}

#ifdef __cplusplus
}
#endif

#endif
