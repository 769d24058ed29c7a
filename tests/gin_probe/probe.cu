/*
 * The GIN probe: can NCCL load epx's test GIN plugin and run GIN put / signal kernels through its proxy
 * (CPU-assisted) path? One process per rank on one GPU, each its own emulated node (NCCL_HOSTID), the
 * kernels calling epx's net.h GIN transport (src/net/gin.cuh); NCCL's public host and device API only.
 * Every stage prints one line (harness.c); the parent prints the per-stage summary and the verdict.
 * A test instrument, not part of libepx, and not a CTest test: it needs a GPU and the plugin.
 * Compiled, not yet run: it was written where there is no GPU.
 */
#ifndef EPX_NET_HAVE_GIN
#error "probe.cu needs -DEPX_NET_HAVE_GIN and NCCL's headers"
#endif

#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <algorithm>
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <vector>

#include "harness.h"
#include "net/net.h"

#ifndef EPX_NET_GIN_DEVICE
#error "net.h did not take in the GIN transport"
#endif

#define WINDOW_BYTES  (8ull << 20) /* each of the two windows: region 0 source, region 1 destination */
#define GUARD_BYTES   4096ull      /* bytes past a put's end that must stay untouched */
#define NSIGNALS      3            /* one per mode: its cumulative count is the wait target */
#define CONTEXT_HINT  2
#define COUNTERS      4 /* NCCL 2.28's most contexts: one source-read counter each */
#define SOAK_BYTES    65536ull
#define HOST_GRACE_MS 5000 /* past the kernel's own deadline before the host sets the abort word */

enum probe_mode { MODE_STRONG = 0, MODE_WEAK = 1, MODE_SIGNAL = 2 };
static const char *const mode_names[] = {"strong put-signal", "weak put-signal", "puts + strong signal"};

typedef struct probe_opts {
    int nranks, iterations, stage_timeout_s, kernel_timeout_ms, devcomm_first, no_plugin;
    const char *plugin;
} probe_opts_t;

/* What one round's kernel did, written to mapped host memory at its end. */
typedef struct kernel_result {
    int32_t post_status, wait_status, flush_status;
    uint32_t ops_posted;
    unsigned long long signal_seen, elapsed_ns;
    volatile uint32_t done;
} kernel_result_t;

typedef struct kernel_args {
    epx_net_t net;
    int32_t peer;
    uint32_t ctx, mode, chunks, signal;
    uint64_t bytes, src_offset, dst_offset, signal_target, timeout_ns;
    kernel_result_t *result;
} kernel_args_t;

/* One thread: posts the round's pattern to the next rank in chunks with the mode's signals, waits for its
 * own incoming signal with a deadline, flushes its context. Every status goes to the host. */
__global__ void probe_kernel(kernel_args_t a)
{
    const uint64_t start = epx_net_now_ns();
    const uint64_t deadline = start + a.timeout_ns;
    const uint64_t chunk = (a.bytes + a.chunks - 1) / a.chunks;
    epx_net_status_t post = EPX_NET_OK;
    uint32_t ops = 0;
    for (uint64_t off = 0; post == EPX_NET_OK && off < a.bytes; off += chunk, ops++) {
        const uint64_t len = a.bytes - off < chunk ? a.bytes - off : chunk;
        const uint64_t dst = a.dst_offset + off, src = a.src_offset + off;
        if (a.mode == MODE_WEAK)
            post = epx_net_put_signal(&a.net, a.ctx, a.peer, 1, dst, 0, src, len, a.signal, 1, EPX_NET_SIGNAL_WEAK);
        else if (a.mode == MODE_STRONG && off + len == a.bytes)
            post = epx_net_put_signal(&a.net, a.ctx, a.peer, 1, dst, 0, src, len, a.signal, 1, EPX_NET_SIGNAL_STRONG);
        else
            post = epx_net_put(&a.net, a.ctx, a.peer, 1, dst, 0, src, len);
    }
    if (post == EPX_NET_OK && a.mode == MODE_SIGNAL) {
        post = epx_net_signal_add(&a.net, a.ctx, a.peer, a.signal, 1, EPX_NET_SIGNAL_STRONG);
        ops++;
    }
    const epx_net_status_t wait =
        post == EPX_NET_OK ? epx_net_wait_signal(&a.net, a.signal, a.signal_target, deadline) : EPX_NET_ABORTED;
    uint64_t seen = 0;
    epx_net_signal_read(&a.net, a.signal, &seen);
    const epx_net_status_t flush = epx_net_flush(&a.net, a.ctx, deadline);
    a.result->post_status = post;
    a.result->wait_status = wait;
    a.result->flush_status = flush;
    a.result->ops_posted = ops;
    a.result->signal_seen = seen;
    a.result->elapsed_ns = epx_net_now_ns() - start;
    __threadfence_system();
    a.result->done = 1;
}

/* ---- one rank ------------------------------------------------------------------------------------- */

typedef struct rank_state {
    const probe_opts_t *o;
    int rank, nranks, peer, from, failed, kernel_stuck;
    cudaStream_t stream;
    int32_t *abort_host, *abort_dev;
    kernel_result_t *res_host, *res_dev;
    unsigned char *h_src, *h_expect, *h_got; /* pinned, WINDOW_BYTES each */
    ncclComm_t comm;
    void *buf[2];
    ncclWindow_t win[2];
    int nbuf, nwin, have_dev;
    ncclDevComm dev;
    epx_net_gin_t *g_dev;
    unsigned long long *posted;
    epx_net_t net;
    uint64_t expected_signal[NSIGNALS];
} rank_state_t;

typedef struct round_spec {
    int mode;
    uint64_t bytes, src_offset, dst_offset;
    uint32_t chunks;
} round_spec_t;

enum round_result { ROUND_OK = 0, ROUND_KERNEL, ROUND_DATA, ROUND_SETUP, ROUND_STOPPED };

static void nap_us(long us)
{
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

#define CUDA_TRY(p, call)                                                                                      \
    do {                                                                                                       \
        cudaError_t e_ = (call);                                                                               \
        if (e_ != cudaSuccess) return probe_fail(p, 1, "%s: %s", #call, cudaGetErrorString(e_));              \
    } while (0)
#define NCCL_TRY(p, s, call)                                                                                   \
    do {                                                                                                       \
        ncclResult_t r_ = (call);                                                                              \
        if (r_ != ncclSuccess)                                                                                 \
            return probe_fail(p, 1, "%s: %s (%s)", #call, ncclGetErrorString(r_), ncclGetLastError((s)->comm)); \
    } while (0)

static uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* The bytes `sender` puts in round `round`: recomputable by the receiver. */
static void pattern_fill(unsigned char *dst, uint64_t n, int sender, uint64_t round)
{
    const uint64_t seed = mix64(((uint64_t)sender << 48) ^ (round << 8) ^ 0x65707867ull);
    for (uint64_t i = 0; i < n; i += 8) {
        const uint64_t w = mix64(seed + i / 8);
        memcpy(dst + i, &w, n - i < 8 ? n - i : 8);
    }
}

static unsigned char guard_byte(uint64_t i, uint64_t round) { return (unsigned char)(0x5a ^ (i * 131) ^ round); }

static int stage_env(probe_t *p, rank_state_t *s)
{
    const probe_opts_t *o = s->o;
    probe_begin(p, PROBE_STAGE_ENV, "NCCL_HOSTID, NCCL_NET_PLUGIN, NCCL_GIN_TYPE, NCCL_SOCKET_IFNAME, NCCL_NVLS_ENABLE");
    char host[64];
    snprintf(host, sizeof(host), "epx-gin-probe-node-%d", s->rank);
    setenv("NCCL_HOSTID", host, 1);
    if (o->no_plugin) {
        unsetenv("NCCL_NET_PLUGIN");
    } else if (o->plugin) {
        if (strchr(o->plugin, '/') && access(o->plugin, R_OK) != 0)
            return probe_fail(p, 1, "plugin %s: %s", o->plugin, strerror(errno));
        setenv("NCCL_NET_PLUGIN", o->plugin, 1);
    }
    setenv("NCCL_GIN_TYPE", "2", 0); /* the proxy backend, unless the caller chose */
    setenv("NCCL_SOCKET_IFNAME", "lo", 0);
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    const char *plugin = getenv("NCCL_NET_PLUGIN");
    return probe_ok(p, "NCCL_HOSTID=%s NCCL_NET_PLUGIN=%s NCCL_GIN_TYPE=%s NCCL_SOCKET_IFNAME=%s NCCL_NVLS_ENABLE=%s",
                    host, plugin ? plugin : "(unset)", getenv("NCCL_GIN_TYPE"), getenv("NCCL_SOCKET_IFNAME"),
                    getenv("NCCL_NVLS_ENABLE"));
}

static int stage_cuda(probe_t *p, rank_state_t *s)
{
    probe_begin(p, PROBE_STAGE_CUDA, "cudaSetDevice(0), stream, mapped result and abort words, NCCL version");
    CUDA_TRY(p, cudaSetDevice(0));
    CUDA_TRY(p, cudaFree(0));
    cudaDeviceProp prop;
    CUDA_TRY(p, cudaGetDeviceProperties(&prop, 0));
    int version = 0;
    NCCL_TRY(p, s, ncclGetVersion(&version));
    if (version / 100 != NCCL_VERSION_CODE / 100)
        return probe_fail(p, 1, "libnccl is %d but the probe was compiled against NCCL %d headers: the device "
                                "communicator's layout differs between versions", version, NCCL_VERSION_CODE);
    CUDA_TRY(p, cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
    CUDA_TRY(p, cudaHostAlloc((void **)&s->abort_host, sizeof(int32_t), cudaHostAllocMapped));
    CUDA_TRY(p, cudaHostAlloc((void **)&s->res_host, sizeof(kernel_result_t), cudaHostAllocMapped));
    CUDA_TRY(p, cudaHostGetDevicePointer((void **)&s->abort_dev, s->abort_host, 0));
    CUDA_TRY(p, cudaHostGetDevicePointer((void **)&s->res_dev, s->res_host, 0));
    *s->abort_host = 0;
    CUDA_TRY(p, cudaMallocHost((void **)&s->h_src, WINDOW_BYTES));
    CUDA_TRY(p, cudaMallocHost((void **)&s->h_expect, WINDOW_BYTES));
    CUDA_TRY(p, cudaMallocHost((void **)&s->h_got, WINDOW_BYTES));
    return probe_ok(p, "device 0 %s (sm_%d%d), libnccl %d, headers %d", prop.name, prop.major, prop.minor, version,
                    NCCL_VERSION_CODE);
}

static int stage_comm(probe_t *p, rank_state_t *s)
{
    ncclUniqueId id;
    char why[256];
    probe_begin(p, PROBE_STAGE_UNIQUE_ID, s->rank == 0 ? "ncclGetUniqueId, published on the shared page"
                                                      : "waiting for rank 0's unique id");
    if (s->rank == 0) {
        NCCL_TRY(p, s, ncclGetUniqueId(&id));
        probe_publish_id(p, &id, sizeof(id));
    } else if (!probe_wait_id(p, &id, sizeof(id), (s->o->stage_timeout_s - 2) * 1000, why, sizeof(why))) {
        return probe_fail(p, 1, "%s", why);
    }
    probe_ok(p, "%zu bytes", sizeof(id));
    probe_begin(p, PROBE_STAGE_COMM_INIT, "ncclCommInitRank");
    NCCL_TRY(p, s, ncclCommInitRank(&s->comm, s->nranks, id, s->rank));
    int rank = -1, count = -1;
    NCCL_TRY(p, s, ncclCommUserRank(s->comm, &rank));
    NCCL_TRY(p, s, ncclCommCount(s->comm, &count));
    if (rank != s->rank || count != s->nranks)
        return probe_fail(p, 1, "the communicator says rank %d of %d", rank, count);
    return probe_ok(p, "rank %d of %d, each rank its own emulated node", rank, count);
}

/* Whether NCCL opened the plugin library: it is mapped in this process. Not fatal: the stages after it say
 * what NCCL did without it. */
static void stage_plugin(probe_t *p, rank_state_t *s)
{
    const char *plugin = getenv("NCCL_NET_PLUGIN");
    if (!plugin || !plugin[0]) {
        probe_record(p, PROBE_STAGE_PLUGIN, PROBE_SKIPPED, "no NCCL_NET_PLUGIN: NCCL has only its built-in transports");
        return;
    }
    probe_begin(p, PROBE_STAGE_PLUGIN, "looking for the plugin library in /proc/self/maps");
    char name[512];
    const char *slash = strrchr(plugin, '/');
    const size_t len = strlen(plugin);
    if (slash)
        snprintf(name, sizeof(name), "%s", slash + 1);
    else if (len > 3 && strcmp(plugin + len - 3, ".so") == 0)
        snprintf(name, sizeof(name), "%s", plugin);
    else
        snprintf(name, sizeof(name), "libnccl-net-%s.so", plugin);
    FILE *maps = fopen("/proc/self/maps", "r");
    char line[1024], found[1024] = "";
    while (maps && !found[0] && fgets(line, sizeof(line), maps)) {
        char *path = strchr(line, '/');
        const char *base = path ? strrchr(path, '/') + 1 : NULL;
        if (base && strncmp(base, name, strlen(name)) == 0) {
            path[strcspn(path, "\n")] = '\0';
            snprintf(found, sizeof(found), "%s", path);
        }
    }
    if (maps) fclose(maps);
    if (found[0]) {
        probe_ok(p, "%s is mapped: NCCL opened it (its GIN table was taken if NCCL's INFO log says 'Loaded gin plugin "
                    "EPX_GIN_TEST' and 'Assigned GIN plugin')", found);
    } else {
        probe_fail(p, 0, "%s is not mapped after ncclCommInitRank: NCCL did not open it (NCCL's INFO lines "
                         "'NET/Plugin' say why)", name);
        s->failed = 1;
    }
}

static int stage_memory(probe_t *p, rank_state_t *s)
{
    probe_begin(p, PROBE_STAGE_MEM_ALLOC, "ncclMemAlloc of two windows");
    for (; s->nbuf < 2; s->nbuf++) NCCL_TRY(p, s, ncclMemAlloc(&s->buf[s->nbuf], WINDOW_BYTES));
    probe_ok(p, "2 x %llu bytes at %p, %p", WINDOW_BYTES, s->buf[0], s->buf[1]);
    probe_begin(p, PROBE_STAGE_WINDOWS, "ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC) of both (collective)");
    for (; s->nwin < 2; s->nwin++)
        NCCL_TRY(p, s, ncclCommWindowRegister(s->comm, s->buf[s->nwin], WINDOW_BYTES, &s->win[s->nwin],
                                              NCCL_WIN_COLL_SYMMETRIC));
    return probe_ok(p, "region 0 (source) window %p, region 1 (destination) window %p", (void *)s->win[0],
                    (void *)s->win[1]);
}

static int stage_devcomm(probe_t *p, rank_state_t *s)
{
    probe_begin(p, PROBE_STAGE_DEVCOMM, "ncclDevCommCreate with GIN: contexts, signals, counters, ginForceEnable");
    ncclDevCommRequirements reqs;
    memset(&reqs, 0, sizeof(reqs));
    reqs.ginForceEnable = true;
    reqs.ginContextCount = CONTEXT_HINT;
    reqs.ginSignalCount = NSIGNALS;
    reqs.ginCounterCount = COUNTERS;
    NCCL_TRY(p, s, ncclDevCommCreate(s->comm, &reqs, &s->dev));
    s->have_dev = 1;
    const ncclDevComm &d = s->dev;
    if (d.ginContextCount < 1) return probe_fail(p, 1, "the device communicator has no GIN context");
    if (d.ginSignalCount < NSIGNALS || d.ginCounterCount < (int)d.ginContextCount)
        return probe_fail(p, 1, "%d signals, %d counters for %d contexts: fewer than asked", d.ginSignalCount,
                          d.ginCounterCount, (int)d.ginContextCount);
    char types[64] = "";
    for (int c = 0, n = 0; c < d.ginContextCount && c < 4; c++)
        n += snprintf(types + n, sizeof(types) - (size_t)n, "%s%d", c ? "," : "", (int)d.ginTypes[c]);
    return probe_ok(p, "rank %d of %d, %d GIN contexts (backend types %s; %d is the proxy), %d signals, %d counters",
                    d.rank, d.nRanks, (int)d.ginContextCount, types, (int)NCCL_NET_DEVICE_GIN_PROXY,
                    d.ginSignalCount, d.ginCounterCount);
}

/* The net.h handle over the device communicator (docs/network.md, host setup step 5). */
static int stage_handle(probe_t *p, rank_state_t *s)
{
    probe_begin(p, PROBE_STAGE_HANDLE, "epx_net_gin_t to device memory, posted[] zeroed, epx_net_t");
    epx_net_gin_t g;
    memset(&g, 0, sizeof(g));
    g.comm = s->dev;
    g.nregions = 2;
    g.signal_base = 0;
    g.counter_base = 0;
    for (int i = 0; i < 2; i++) {
        g.windows[i] = s->win[i];
        g.region_bytes[i] = WINDOW_BYTES;
    }
    const uint32_t ncontexts = s->dev.ginContextCount;
    CUDA_TRY(p, cudaMalloc((void **)&s->posted, ncontexts * sizeof(unsigned long long)));
    CUDA_TRY(p, cudaMemset(s->posted, 0, ncontexts * sizeof(unsigned long long)));
    g.posted = s->posted;
    CUDA_TRY(p, cudaMalloc((void **)&s->g_dev, sizeof(g)));
    CUDA_TRY(p, cudaMemcpy(s->g_dev, &g, sizeof(g), cudaMemcpyHostToDevice));
    memset(&s->net, 0, sizeof(s->net));
    s->net.transport = EPX_NET_TRANSPORT_GIN;
    s->net.rank = s->rank;
    s->net.nranks = s->nranks;
    s->net.ncontexts = ncontexts;
    s->net.nsignals = NSIGNALS;
    s->net.impl = s->g_dev;
    s->net.abort_word = s->abort_dev;
    return probe_ok(p, "%u contexts, %d signals, 2 regions of %llu bytes; puts go to rank %d, signals come from rank %d",
                    ncontexts, NSIGNALS, WINDOW_BYTES, s->peer, s->from);
}

/* Waits for the round's kernel, bounded: past its deadline plus a grace (or when another rank failed) the
 * abort word is set, which ends every net.h wait; a kernel that still runs 5 s later is stuck in a post. */
static int wait_kernel(const probe_t *p, rank_state_t *s, char *why, size_t why_len)
{
    uint64_t deadline = probe_now_ns() + (uint64_t)(s->o->kernel_timeout_ms + HOST_GRACE_MS) * 1000000ull;
    int aborted = 0;
    for (;;) {
        const cudaError_t e = cudaStreamQuery(s->stream);
        if (e == cudaSuccess) return 1;
        if (e != cudaErrorNotReady) {
            snprintf(why, why_len, "the kernel failed: %s", cudaGetErrorString(e));
            return 0;
        }
        const uint64_t now = probe_now_ns();
        if (!aborted && (now > deadline || probe_aborted(p))) {
            __atomic_store_n(s->abort_host, 1, __ATOMIC_RELEASE);
            aborted = 1;
            deadline = now + (uint64_t)HOST_GRACE_MS * 1000000ull;
        } else if (aborted && now > deadline) {
            s->kernel_stuck = 1;
            snprintf(why, why_len, "the kernel still runs %d ms after the abort word was set: a post is blocked "
                                   "inside NCCL (no descriptor credits: the proxy thread does not drain)",
                     HOST_GRACE_MS);
            return 0;
        }
        nap_us(20);
    }
}

/* Why a round's kernel did not return EPX_NET_OK everywhere, with NCCL's asynchronous error if any. */
static void describe_kernel(const rank_state_t *s, const kernel_args_t *a, char *why, size_t why_len)
{
    const kernel_result_t *r = s->res_host;
    int n;
    if (r->post_status != EPX_NET_OK)
        n = snprintf(why, why_len, "operation %u of the round returned %s", r->ops_posted,
                     epx_net_status_name((epx_net_status_t)r->post_status));
    else if (r->wait_status != EPX_NET_OK)
        n = snprintf(why, why_len, "waiting for signal %u from rank %d: %s after %.1f ms, read %llu, target %llu",
                     a->signal, s->from, epx_net_status_name((epx_net_status_t)r->wait_status),
                     r->elapsed_ns / 1e6, r->signal_seen, (unsigned long long)a->signal_target);
    else
        n = snprintf(why, why_len, "flush of context %u: %s (the puts' source reads were not reported)", a->ctx,
                     epx_net_status_name((epx_net_status_t)r->flush_status));
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(s->comm, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress &&
        n > 0 && (size_t)n < why_len)
        snprintf(why + n, why_len - (size_t)n, "; NCCL async error: %s (%s)", ncclGetErrorString(async),
                 ncclGetLastError(s->comm));
}

/* One round: this rank's pattern to the next rank on context ctx; the previous rank's bytes checked here
 * bit-exactly, and the guard bytes past them unchanged. */
static int run_round(probe_t *p, rank_state_t *s, const round_spec_t *rs, uint64_t round, uint32_t ctx,
                     uint64_t *sent_hash, uint64_t *got_hash, double *host_us, char *why, size_t why_len)
{
    const uint64_t n = rs->bytes, dst = rs->dst_offset;
    const uint64_t span = std::min(WINDOW_BYTES, dst + n + GUARD_BYTES);
    cudaError_t e;
    pattern_fill(s->h_src, n, s->rank, round);
    pattern_fill(s->h_expect, n, s->from, round);
    *sent_hash = probe_fnv(s->h_src, n, PROBE_FNV_SEED);
    for (uint64_t i = 0; i < span; i++) /* every byte the put must write starts as its complement */
        s->h_got[i] = i >= dst && i < dst + n ? (unsigned char)~s->h_expect[i - dst] : guard_byte(i, round);
    if ((e = cudaMemcpyAsync((char *)s->buf[0] + rs->src_offset, s->h_src, n, cudaMemcpyHostToDevice, s->stream)) !=
            cudaSuccess ||
        (e = cudaMemcpyAsync(s->buf[1], s->h_got, span, cudaMemcpyHostToDevice, s->stream)) != cudaSuccess ||
        (e = cudaStreamSynchronize(s->stream)) != cudaSuccess) {
        snprintf(why, why_len, "staging the round: %s", cudaGetErrorString(e));
        return ROUND_SETUP;
    }
    const uint64_t chunk = (n + rs->chunks - 1) / rs->chunks;
    s->expected_signal[rs->mode] += rs->mode == MODE_WEAK ? (n + chunk - 1) / chunk : 1; /* adds per round */
    memset((void *)s->res_host, 0, sizeof(*s->res_host));
    /* Every rank's destination is poisoned before any rank puts into it. */
    if (!probe_barrier(p, PROBE_BARRIER_ROUNDS, (s->o->stage_timeout_s - 2) * 1000, 1, why, why_len)) return ROUND_STOPPED;
    kernel_args_t a;
    memset(&a, 0, sizeof(a));
    a.net = s->net;
    a.peer = s->peer;
    a.ctx = ctx;
    a.mode = (uint32_t)rs->mode;
    a.chunks = rs->chunks;
    a.signal = (uint32_t)rs->mode;
    a.bytes = n;
    a.src_offset = rs->src_offset;
    a.dst_offset = dst;
    a.signal_target = s->expected_signal[rs->mode];
    a.timeout_ns = (uint64_t)s->o->kernel_timeout_ms * 1000000ull;
    a.result = s->res_dev;
    const uint64_t t0 = probe_now_ns();
    probe_kernel<<<1, 1, 0, s->stream>>>(a);
    if ((e = cudaGetLastError()) != cudaSuccess) {
        snprintf(why, why_len, "kernel launch: %s", cudaGetErrorString(e));
        return ROUND_KERNEL;
    }
    if (!wait_kernel(p, s, why, why_len)) return ROUND_KERNEL;
    *host_us = (double)(probe_now_ns() - t0) / 1e3;
    const kernel_result_t *r = s->res_host;
    if (!r->done) {
        snprintf(why, why_len, "the kernel ended without writing its result");
        return ROUND_KERNEL;
    }
    if (r->post_status != EPX_NET_OK || r->wait_status != EPX_NET_OK || r->flush_status != EPX_NET_OK) {
        describe_kernel(s, &a, why, why_len);
        return ROUND_KERNEL;
    }
    if ((e = cudaMemcpyAsync(s->h_got, s->buf[1], span, cudaMemcpyDeviceToHost, s->stream)) != cudaSuccess ||
        (e = cudaStreamSynchronize(s->stream)) != cudaSuccess) {
        snprintf(why, why_len, "reading the destination back: %s", cudaGetErrorString(e));
        return ROUND_SETUP;
    }
    uint64_t bad = 0, first = 0, guard_bad = 0, guard_first = 0;
    for (uint64_t i = 0; i < span; i++) {
        const int inside = i >= dst && i < dst + n;
        if (s->h_got[i] == (inside ? s->h_expect[i - dst] : guard_byte(i, round))) continue;
        if (inside && bad++ == 0) first = i;
        if (!inside && guard_bad++ == 0) guard_first = i;
    }
    *got_hash = probe_fnv(s->h_got + dst, n, PROBE_FNV_SEED);
    if (bad || guard_bad) {
        snprintf(why, why_len,
                 "%llu of %llu bytes from rank %d differ (first at offset %llu: got 0x%02x, expected 0x%02x); %llu bytes "
                 "outside the put changed (first at offset %llu)",
                 (unsigned long long)bad, (unsigned long long)n, s->from, (unsigned long long)(first - dst),
                 bad ? s->h_got[first] : 0, bad ? s->h_expect[first - dst] : 0, (unsigned long long)guard_bad,
                 (unsigned long long)guard_first);
        return ROUND_DATA;
    }
    return ROUND_OK;
}

/* Strong and weak put-signals and puts followed by a bare strong signal, 4 bytes to 4 MiB, with and without
 * offsets, over the contexts in turn. */
static const round_spec_t rounds[] = {
    {MODE_STRONG, 4, 0, 0, 1},     {MODE_STRONG, 4096, 0, 0, 4}, {MODE_STRONG, 65540, 8, 4100, 4},
    {MODE_STRONG, 4ull << 20, 0, 0, 4}, {MODE_WEAK, 4, 0, 0, 1},  {MODE_WEAK, 4096, 0, 0, 4},
    {MODE_WEAK, 65540, 8, 4100, 4}, {MODE_WEAK, 4ull << 20, 0, 0, 4}, {MODE_SIGNAL, 4096, 0, 0, 4},
    {MODE_SIGNAL, 65540, 8, 4100, 4},
};
#define NROUNDS ((int)(sizeof(rounds) / sizeof(rounds[0])))

static int stage_rounds(probe_t *p, rank_state_t *s)
{
    char what[160], why[512];
    probe_begin(p, PROBE_STAGE_KERNEL, "put/signal rounds: 3 signal modes, 4 bytes to 4 MiB, contexts in turn");
    for (int i = 0; i < NROUNDS; i++) {
        const round_spec_t *rs = &rounds[i];
        const uint32_t ctx = (uint32_t)i % s->net.ncontexts;
        snprintf(what, sizeof(what), "round %d: %s, %llu bytes, context %u", i, mode_names[rs->mode],
                 (unsigned long long)rs->bytes, ctx);
        probe_progress(p, what);
        uint64_t sent = 0, got = 0;
        double us = 0;
        const int rc = run_round(p, s, rs, (uint64_t)i, ctx, &sent, &got, &us, why, sizeof(why));
        if (rc == ROUND_STOPPED) {
            probe_skip(p, "%s: %s", what, why);
            probe_record(p, PROBE_STAGE_DATA, PROBE_SKIPPED, "stopped at round %d", i);
            return 0;
        }
        if (rc == ROUND_DATA) {
            probe_ok(p, "kernels of rounds 0..%d returned EPX_NET_OK", i);
            probe_begin(p, PROBE_STAGE_DATA, "the failed round's check");
            return probe_fail(p, 1, "%s: %s", what, why);
        }
        if (rc != ROUND_OK) {
            probe_fail(p, 1, "%s: %s", what, why);
            probe_record(p, PROBE_STAGE_DATA, i ? PROBE_SKIPPED : PROBE_NOT_REACHED,
                         "rounds 0..%d were bit-exact before the failure", i - 1);
            return 0;
        }
        probe_say(p, "round %d ok: %s, %llu bytes, offsets %llu -> %llu, context %u: signal %u reached %llu, %.1f us in "
                     "the kernel, %.1f us on the host; rank %d's bytes bit-exact",
                  i, mode_names[rs->mode], (unsigned long long)rs->bytes, (unsigned long long)rs->src_offset,
                  (unsigned long long)rs->dst_offset, ctx, (unsigned)rs->mode, s->res_host->signal_seen,
                  s->res_host->elapsed_ns / 1e3, us, s->from);
    }
    probe_ok(p, "%d rounds: every post, signal wait and flush returned EPX_NET_OK", NROUNDS);
    probe_record(p, PROBE_STAGE_DATA, PROBE_OK, "%d rounds bit-exact from rank %d, bytes past each put untouched",
                 NROUNDS, s->from);
    return 1;
}

/* Many small rounds: strong and weak in turn over every context, odd sizes and offsets, each checked and
 * hashed; the parent compares each rank's received hash with what its sender hashed. */
static int stage_soak(probe_t *p, rank_state_t *s)
{
    const int iters = s->o->iterations;
    if (iters == 0) {
        probe_record(p, PROBE_STAGE_SOAK, PROBE_SKIPPED, "0 iterations asked");
        probe_set_hashes(p, PROBE_FNV_SEED, PROBE_FNV_SEED, 0);
        return 1;
    }
    char what[160], why[512];
    snprintf(what, sizeof(what), "%d iterations of ~64 KiB, strong and weak in turn, every context, hashed", iters);
    probe_begin(p, PROBE_STAGE_SOAK, what);
    std::vector<double> host_us((size_t)iters);
    uint64_t sent_total = PROBE_FNV_SEED, got_total = PROBE_FNV_SEED;
    for (int it = 0; it < iters; it++) {
        const round_spec_t rs = {it % 2 ? MODE_WEAK : MODE_STRONG, SOAK_BYTES + (uint64_t)(it % 13),
                                 (uint64_t)(it * 264) % 4096, (uint64_t)(it * 520) % 8192, 2};
        const uint32_t ctx = (uint32_t)(it / 2) % s->net.ncontexts;
        snprintf(what, sizeof(what), "soak iteration %d: %s, %llu bytes, context %u", it, mode_names[rs.mode],
                 (unsigned long long)rs.bytes, ctx);
        probe_progress(p, what);
        uint64_t sent = 0, got = 0;
        const int rc = run_round(p, s, &rs, 1000000ull + (uint64_t)it, ctx, &sent, &got, &host_us[(size_t)it], why,
                                 sizeof(why));
        if (rc == ROUND_STOPPED) {
            probe_skip(p, "%s: %s", what, why);
            return 0;
        }
        if (rc != ROUND_OK) return probe_fail(p, 1, "%s: %s", what, why);
        sent_total = probe_fnv(&sent, sizeof(sent), sent_total);
        got_total = probe_fnv(&got, sizeof(got), got_total);
        if ((it + 1) % 250 == 0) probe_say(p, "soak: %d of %d iterations bit-exact", it + 1, iters);
    }
    probe_set_hashes(p, sent_total, got_total, (uint64_t)iters);
    std::sort(host_us.begin(), host_us.end());
    return probe_ok(p, "%d iterations bit-exact; sent hash 0x%016llx, received 0x%016llx; round on the host min %.1f "
                       "us, median %.1f us, max %.1f us",
                    iters, (unsigned long long)sent_total, (unsigned long long)got_total, host_us.front(),
                    host_us[host_us.size() / 2], host_us.back());
}

/* One teardown call in its own stage; a failure is recorded and teardown goes on. */
static int teardown_step(probe_t *p, rank_state_t *s, const char *what, ncclResult_t r)
{
    if (r == ncclSuccess) return probe_ok(p, "%s", what);
    s->failed = 1;
    return probe_fail(p, 0, "%s: %s (%s)", what, ncclGetErrorString(r), ncclGetLastError(s->comm));
}

/* docs/network.md's order: kernels are done (every round waited for its own, bounded); the device
 * communicator; the windows, then their memory and the handle; a barrier over the shared page, never over
 * the network; finalize and destroy, or abort when a peer is gone or the barrier timed out. */
static void teardown(probe_t *p, rank_state_t *s)
{
    char why[256];
    if (s->kernel_stuck) {
        for (int st = PROBE_STAGE_DEVCOMM_DESTROY; st <= PROBE_STAGE_COMM_DESTROY; st++)
            probe_record(p, (probe_stage_t)st, PROBE_SKIPPED, "a kernel still runs: the process exits without teardown");
        s->failed = 1;
        return;
    }
    ncclResult_t async = ncclSuccess;
    if (s->comm && ncclCommGetAsyncError(s->comm, &async) == ncclSuccess && async != ncclSuccess)
        probe_say(p, "NCCL reports an asynchronous error before teardown: %s (%s)", ncclGetErrorString(async),
                  ncclGetLastError(s->comm));
    if (s->have_dev) {
        probe_begin(p, PROBE_STAGE_DEVCOMM_DESTROY, "ncclDevCommDestroy");
        teardown_step(p, s, "ncclDevCommDestroy", ncclDevCommDestroy(s->comm, &s->dev));
    } else {
        probe_record(p, PROBE_STAGE_DEVCOMM_DESTROY, PROBE_SKIPPED, "no device communicator");
    }
    if (s->nwin > 0) {
        probe_begin(p, PROBE_STAGE_WINDOWS_DEREG, "ncclCommWindowDeregister of each window");
        ncclResult_t r = ncclSuccess;
        for (int i = s->nwin - 1; i >= 0 && r == ncclSuccess; i--) r = ncclCommWindowDeregister(s->comm, s->win[i]);
        teardown_step(p, s, "ncclCommWindowDeregister", r);
    } else {
        probe_record(p, PROBE_STAGE_WINDOWS_DEREG, PROBE_SKIPPED, "no window registered");
    }
    probe_begin(p, PROBE_STAGE_MEM_FREE, "ncclMemFree of each window's memory, the handle's device copy, posted[]");
    ncclResult_t r = ncclSuccess;
    for (int i = s->nbuf - 1; i >= 0 && r == ncclSuccess; i--) r = ncclMemFree(s->buf[i]);
    const cudaError_t e1 = cudaFree(s->g_dev), e2 = cudaFree(s->posted);
    if (r == ncclSuccess && (e1 != cudaSuccess || e2 != cudaSuccess)) {
        s->failed = 1;
        probe_fail(p, 0, "cudaFree of the handle: %s", cudaGetErrorString(e1 != cudaSuccess ? e1 : e2));
    } else {
        teardown_step(p, s, "ncclMemFree", r);
    }
    probe_begin(p, PROBE_STAGE_BARRIER, "barrier over the shared page (not the network), bounded");
    const int together =
        probe_barrier(p, PROBE_BARRIER_TEARDOWN, (s->o->stage_timeout_s - 2) * 1000, 0, why, sizeof(why));
    if (together) {
        probe_ok(p, "every rank reached teardown");
    } else {
        s->failed = 1;
        probe_fail(p, 0, "%s", why);
    }
    if (!s->comm) {
        probe_record(p, PROBE_STAGE_COMM_FINALIZE, PROBE_SKIPPED, "no communicator");
        probe_record(p, PROBE_STAGE_COMM_DESTROY, PROBE_SKIPPED, "no communicator");
    } else if (together && !probe_peer_gone(p)) {
        probe_begin(p, PROBE_STAGE_COMM_FINALIZE, "ncclCommFinalize");
        if (teardown_step(p, s, "ncclCommFinalize", ncclCommFinalize(s->comm))) {
            probe_begin(p, PROBE_STAGE_COMM_DESTROY, "ncclCommDestroy");
            teardown_step(p, s, "ncclCommDestroy", ncclCommDestroy(s->comm));
        } else {
            probe_begin(p, PROBE_STAGE_COMM_DESTROY, "ncclCommAbort after the failed finalize");
            teardown_step(p, s, "ncclCommAbort", ncclCommAbort(s->comm));
        }
    } else {
        probe_record(p, PROBE_STAGE_COMM_FINALIZE, PROBE_SKIPPED, "a peer is gone or the barrier failed: force-close");
        probe_begin(p, PROBE_STAGE_COMM_DESTROY, "ncclCommAbort");
        teardown_step(p, s, "ncclCommAbort", ncclCommAbort(s->comm));
    }
    cudaFreeHost(s->h_src);
    cudaFreeHost(s->h_expect);
    cudaFreeHost(s->h_got);
    cudaFreeHost(s->abort_host);
    cudaFreeHost(s->res_host);
    if (s->stream) cudaStreamDestroy(s->stream);
}

static int rank_main(probe_t *p, void *arg)
{
    static rank_state_t state;
    rank_state_t *s = &state;
    s->o = (const probe_opts_t *)arg;
    s->rank = probe_rank(p);
    s->nranks = probe_nranks(p);
    s->peer = (s->rank + 1) % s->nranks;
    s->from = (s->rank + s->nranks - 1) % s->nranks;
    int ok = stage_env(p, s) && stage_cuda(p, s) && stage_comm(p, s);
    if (ok) stage_plugin(p, s);
    if (ok)
        ok = s->o->devcomm_first ? stage_devcomm(p, s) && stage_memory(p, s) : stage_memory(p, s) && stage_devcomm(p, s);
    ok = ok && stage_handle(p, s) && stage_rounds(p, s) && stage_soak(p, s);
    if (!ok) s->failed = 1;
    teardown(p, s);
    return s->failed;
}

static void usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [-n RANKS] [-p PLUGIN | -P] [-i ITERATIONS] [-t STAGE_S] [-k KERNEL_MS] [-d]\n"
            "  -n  ranks, one process and one emulated node each (default 2, 2..%d)\n"
            "  -p  NCCL_NET_PLUGIN for every rank: a path to libnccl-net-epxtest.so or a name\n"
            "      (default: NCCL_NET_PLUGIN as the environment has it)\n"
            "  -P  unset NCCL_NET_PLUGIN (NCCL's own failure without a GIN backend)\n"
            "  -i  soak iterations (default 1000, 0 skips the soak)\n"
            "  -t  watchdog: seconds any stage of a rank may take (default 60)\n"
            "  -k  a kernel's signal wait and flush deadline in ms (default 10000)\n"
            "  -d  create the device communicator before registering the windows\n",
            argv0, PROBE_MAX_RANKS);
}

static int parse_int(const char *s, int lo, int hi, const char *what, int *out)
{
    char *end = NULL;
    const long v = strtol(s, &end, 10);
    if (!s[0] || *end || v < lo || v > hi) {
        fprintf(stderr, "gin-probe: %s '%s' is not a number in %d..%d\n", what, s, lo, hi);
        return 0;
    }
    *out = (int)v;
    return 1;
}

int main(int argc, char **argv)
{
    probe_opts_t o = {2, 1000, 60, 10000, 0, 0, NULL};
    int c;
    while ((c = getopt(argc, argv, "n:p:Pi:t:k:dh")) != -1) {
        int good = 1;
        switch (c) {
        case 'n': good = parse_int(optarg, 2, PROBE_MAX_RANKS, "-n", &o.nranks); break;
        case 'p': o.plugin = optarg; break;
        case 'P': o.no_plugin = 1; break;
        case 'i': good = parse_int(optarg, 0, 1000000, "-i", &o.iterations); break;
        case 't': good = parse_int(optarg, 10, 3600, "-t", &o.stage_timeout_s); break;
        case 'k': good = parse_int(optarg, 100, 600000, "-k", &o.kernel_timeout_ms); break;
        case 'd': o.devcomm_first = 1; break;
        default: usage(argv[0]); return c == 'h' ? 0 : 2;
        }
        if (!good) return 2;
    }
    if (optind != argc || (o.plugin && o.no_plugin)) {
        usage(argv[0]);
        return 2;
    }
    /* A round may take the kernel's deadline, the host's grace and the abort's grace, under the watchdog. */
    const int round_s = (o.kernel_timeout_ms + 2 * HOST_GRACE_MS) / 1000 + 5;
    if (o.stage_timeout_s < round_s) {
        fprintf(stderr, "gin-probe: -t %d is shorter than one bounded round (%d s with -k %d)\n", o.stage_timeout_s,
                round_s, o.kernel_timeout_ms);
        return 2;
    }
    const char *plugin = o.no_plugin ? "none (NCCL_NET_PLUGIN unset)"
                                     : o.plugin ? o.plugin
                                                : getenv("NCCL_NET_PLUGIN") ? getenv("NCCL_NET_PLUGIN") : "(unset)";
    char title[768];
    snprintf(title, sizeof(title), "%d ranks, plugin %s, %s first, %d soak iterations, NCCL headers %d", o.nranks,
             plugin, o.devcomm_first ? "device communicator" : "windows", o.iterations, NCCL_VERSION_CODE);
    printf("gin-probe: %s; watchdog %d s per stage, kernel deadline %d ms\n", title, o.stage_timeout_s,
           o.kernel_timeout_ms);
    const probe_run_opts_t run = {o.nranks, o.stage_timeout_s, title, PROBE_STAGE_DATA};
    return probe_run(&run, rank_main, &o);
}
