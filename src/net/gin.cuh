/*
 * The GIN transport of net.h, device side: every net.h operation on NCCL's GPU-Initiated Networking
 * through NCCL's public device API only (ncclGin put / signal / readSignal / readCounter, windows,
 * the world team), never a backend's internal memory, so the same code runs on the GPU-direct
 * backend (GDAKI) and the CPU-assisted one (proxy). Run on one H200 through the proxy path and the
 * test GIN plugin (tests/gin_probe, gpu.gin_host); the GDAKI path needs ConnectX NICs and has not run. net.h includes this file only when EPX_NET_HAVE_GIN is defined in a CUDA
 * compile with NCCL's headers (2.28); every other translation unit never sees NCCL.
 *
 * Host setup (a later step; see docs/network.md for the whole sequence):
 *  1. ncclCommInitRank over all ranks of the communicator (unique id through epx's bootstrap), or the
 *     caller's ncclComm_t. net.h ranks are the communicator's world ranks.
 *  2. Each region: allocated with ncclMemAlloc (same size on every rank), registered in the same order
 *     on every rank with ncclCommWindowRegister(comm, base, bytes, &win, NCCL_WIN_COLL_SYMMETRIC); the
 *     registration index is the region number net.h uses.
 *  3. ncclDevCommCreate with ginContextCount = contexts wanted (a hint: the transport uses what NCCL
 *     returns), ginSignalCount >= signal_base + nsignals, ginCounterCount >= counter_base + contexts.
 *  4. An epx_net_gin_t filled from the result (below), copied to device memory with `posted` zeroed;
 *     the handle: transport GIN, rank/nranks from the comm, ncontexts = devComm.ginContextCount,
 *     nsignals, impl = the device copy, abort_word = a device-visible word.
 *  NCCL_GIN_TYPE picks the backend at ncclDevCommCreate: 3 GDAKI (GPU-direct, mlx5), 2 proxy
 *  (CPU-assisted: kernels write descriptors, an NCCL host thread posts them). This code is the same
 *  for both. Teardown: kernels done or aborted (bounded), ncclDevCommDestroy, ncclCommWindowDeregister
 *  of each region, ncclMemFree, then ncclCommFinalize + ncclCommDestroy (ncclCommAbort if a peer is
 *  gone).
 *
 * How net.h's rules map onto GIN (NCCL 2.28 nccl_device/gin.h):
 *  - Context c is the ncclGin of context index c; net.h contexts never outnumber the device
 *    communicator's (checked on every call), so no two net.h contexts alias one GIN context.
 *  - put: ncclGin::put on the world team, local action CounterInc on context c's counter (flush).
 *  - put with signal, STRONG and WEAK alike: ncclGin::put with remote action SignalAdd. GIN makes
 *    that signal visible only after this put and every earlier put of the context *to the same peer*
 *    have settled. WEAK (own put only) is weaker, so it is met. STRONG is met as net.h states it: a
 *    strong signal covers the earlier puts of its context to its own peer (net.h's rule was narrowed
 *    to that because GIN's public API offers no way to order a signal behind puts to other peers:
 *    flush is local completion, and no call completes a put remotely).
 *  - signal add: ncclGin::signal with SignalAdd, posted on the same per-peer queue (proxy) or queue
 *    pair (GDAKI) as the context's puts to that peer, so it is ordered behind them the same way.
 *  - signal read: GIN signals live per context (each context has its own table), while net.h names a
 *    signal by id alone. The read is the sum over the contexts of readSignal(id, acquire). Each term
 *    only grows, so a sum that reaches a target counts only adds this thread has observed with
 *    acquire: the bytes they cover are visible. Waits are net.h's generic loop over this read.
 *  - flush: NCCL's ncclGin::flush spins without a deadline, so it is not used. Instead every put
 *    counts itself in `posted[c]` (a device atomic) before posting and carries CounterInc, which
 *    GIN raises when the put's source has been read; flush waits until the counter reaches the
 *    posted count it read (rolling 56-bit compare, GIN's counter width), bounded by the deadline and
 *    the abort word. Puts counted but not yet posted by other threads make it wait longer, never
 *    return early.
 *  - NCCL 2.30.5+ deprecates SignalAdd for StrongSignalAdd / WeakSignalAdd (SignalAdd's strength then
 *    follows ginStrongSignalsRequired, default true): on those headers STRONG maps to the strong
 *    action, WEAK to the weak one, and setup keeps ginStrongSignalsRequired true.
 *  - Not mappable, documented rather than hidden: posting can block inside NCCL while the peer's
 *    queue is full (proxy descriptor credits, GDAKI send-queue slots); net.h's post has no deadline.
 *    A kernel keeps its in-flight operations per (context, peer) below the queue depth (flush with a
 *    deadline before it), or a stalled proxy thread hangs the poster where no abort word reaches.
 */
/* net.h first, outside the guard: it includes this file once its types and the abort-word helper
 * exist, and its operations call the functions below. */
#include "net/net.h"

#ifndef EPX_NET_GIN_CUH
#define EPX_NET_GIN_CUH

#if defined(EPX_NET_HAVE_GIN) && defined(__CUDACC__)

#include <nccl.h>
#include <nccl_device.h>

#define EPX_NET_GIN_MAX_REGIONS  16
#define EPX_NET_GIN_COUNTER_BITS 56 /* GIN counters carry 56 bits (nccl_device/gin.h) */

/* What a GIN handle's `impl` points to, in device memory. Read-only on the device except `posted`. */
typedef struct epx_net_gin {
    ncclDevComm comm;      /* as ncclDevCommCreate returned it */
    uint32_t nregions;     /* registered regions, 0..EPX_NET_GIN_MAX_REGIONS */
    uint32_t signal_base;  /* net.h signal s is GIN signal signal_base + s */
    uint32_t counter_base; /* context c's source-read counter is GIN counter counter_base + c */
    uint32_t pad;
    ncclWindow_t windows[EPX_NET_GIN_MAX_REGIONS];  /* symmetric windows, by registration index */
    uint64_t region_bytes[EPX_NET_GIN_MAX_REGIONS]; /* equal on every rank (symmetric registration) */
    unsigned long long *posted; /* [ncontexts], zeroed at setup: puts counted per context */
} epx_net_gin_t;

/* The handle's shape fits its device communicator (a setup error otherwise, reported on every call). */
__device__ static inline int epx_net_gin_shape_ok(const epx_net_t *net, const epx_net_gin_t *g)
{
    return g && net->ncontexts >= 1 && net->ncontexts <= (uint32_t)g->comm.ginContextCount &&
           net->nranks == g->comm.nRanks && g->nregions <= EPX_NET_GIN_MAX_REGIONS &&
           (uint64_t)g->signal_base + net->nsignals <= (uint64_t)g->comm.ginSignalCount &&
           (uint64_t)g->counter_base + net->ncontexts <= (uint64_t)g->comm.ginCounterCount;
}

/* The handle fits its device communicator, then net.h's checks of the operation. */
__device__ static inline epx_net_status_t epx_net_gin_check(const epx_net_t *net, const epx_net_gin_t *g,
                                                            const epx_net_op_t *op)
{
    if (!epx_net_gin_shape_ok(net, g)) return EPX_NET_INVALID;
    return epx_net_check_op(net, op, g->nregions, g->region_bytes);
}

/* Every operation is issued by the calling thread alone (ncclCoopThread). NCCL's default release
 * arguments apply: a system-scope release before posting, so the put reads what the calling thread
 * wrote; bytes written by other threads must be made visible to it first (a barrier). */
__device__ static inline epx_net_status_t epx_net_gin_post(const epx_net_t *net, const epx_net_op_t *op)
{
    const epx_net_gin_t *g = (const epx_net_gin_t *)net->impl;
    const epx_net_status_t s = epx_net_gin_check(net, g, op);
    if (s != EPX_NET_OK) return s;
    ncclGin gin(g->comm, (int)op->ctx);
    const ncclTeam world = ncclTeamWorld(g->comm);
    const ncclGin_SignalAdd add = {(ncclGinSignal_t)(g->signal_base + op->signal), op->signal_add};
    const ncclGin_CounterInc sourced = {(ncclGinCounter_t)(g->counter_base + op->ctx)};
    if (op->kind != EPX_NET_OP_SIGNAL) atomicAdd(&g->posted[op->ctx], 1ull); /* before the put: see flush */
    switch (op->kind) {
    case EPX_NET_OP_PUT:
        gin.put(world, op->peer, g->windows[op->dst_region], op->dst_offset, g->windows[op->src_region],
                op->src_offset, op->bytes, ncclGin_None{}, sourced);
        break;
    case EPX_NET_OP_PUT_SIGNAL: /* STRONG and WEAK: GIN's one signal covers both (see the top) */
        gin.put(world, op->peer, g->windows[op->dst_region], op->dst_offset, g->windows[op->src_region],
                op->src_offset, op->bytes, add, sourced);
        break;
    default: gin.signal(world, op->peer, add); break;
    }
    return EPX_NET_OK;
}

/* Our signal `signal`: the sum of its value in every context's table, each read with acquire. */
__device__ static inline epx_net_status_t epx_net_gin_signal_read(const epx_net_t *net, uint32_t signal,
                                                                  uint64_t *value_out)
{
    const epx_net_gin_t *g = (const epx_net_gin_t *)net->impl;
    if (!epx_net_gin_shape_ok(net, g) || signal >= net->nsignals) return EPX_NET_INVALID;
    uint64_t sum = 0;
    for (uint32_t c = 0; c < net->ncontexts; c++) {
        ncclGin gin(g->comm, (int)c);
        sum += gin.readSignal((ncclGinSignal_t)(g->signal_base + signal), 64, cuda::memory_order_acquire);
    }
    *value_out = sum;
    return EPX_NET_OK;
}

/* `done` has reached `target` in GIN's rolling compare over `bits` bits. */
__device__ static inline int epx_net_gin_reached(uint64_t done, uint64_t target, int bits)
{
    const uint64_t mask = ~0ull >> (64 - bits);
    return ((done - target) & mask) <= (mask >> 1);
}

/* Local completion of every put counted on `ctx` before this call, bounded like a wait. */
__device__ static inline epx_net_status_t epx_net_gin_flush(const epx_net_t *net, uint32_t ctx,
                                                            uint64_t deadline_ns)
{
    const epx_net_gin_t *g = (const epx_net_gin_t *)net->impl;
    if (!epx_net_gin_shape_ok(net, g) || ctx >= net->ncontexts) return EPX_NET_INVALID;
    ncclGin gin(g->comm, (int)ctx);
    const ncclGinCounter_t counter = (ncclGinCounter_t)(g->counter_base + ctx);
    const uint64_t target = cuda::atomic_ref<unsigned long long, cuda::thread_scope_device>(g->posted[ctx])
                                .load(cuda::memory_order_relaxed);
    for (;;) {
        const uint64_t done = gin.readCounter(counter, EPX_NET_GIN_COUNTER_BITS, cuda::memory_order_acquire);
        if (epx_net_gin_reached(done, target, EPX_NET_GIN_COUNTER_BITS)) return EPX_NET_OK;
        if (epx_net_aborted(net)) return EPX_NET_ABORTED;
        if (epx_net_now_ns() > deadline_ns) return EPX_NET_TIMEOUT;
    }
}

#endif /* EPX_NET_HAVE_GIN && __CUDACC__ */

#endif
