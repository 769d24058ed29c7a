/*
 * The GIN transport's host side (src/net/gin_host.h): an NCCL communicator made from the epx
 * communicator's bootstrap (or the caller's), symmetric windows, the device communicator with GIN and the
 * net.h handle; then the bounded teardown in src/net/gin.cuh's order. The communicator is non-blocking, so
 * every NCCL call that waits for peers is polled here against a deadline and abandoned (ncclCommAbort)
 * past it. The steps a rank takes alone (CUDA, memory, the unique id) end in an agreement over the
 * bootstrap, so no rank enters a collective NCCL step that another has given up on. It ran on one
 * H200 through NCCL 2.28.9's proxy (CPU-assisted) path and the test GIN plugin (gpu.gin_host, 2 and 4 ranks).
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "core/network.h"
#include "cuda/cuda.h"
#include "net/gin_dev.h"
#include "net/gin_host.h"

struct epx_gin {
    epx_comm_t comm;
    int rank, nranks;
    ncclComm_t nccl;
    int own_comm; /* epx made `nccl` and ends it */
    int64_t timeout_ms;
    int nregions, nmem, nwin;
    void *mem[EPX_GIN_MAX_REGIONS];
    ncclWindow_t win[EPX_GIN_MAX_REGIONS];
    uint64_t bytes[EPX_GIN_MAX_REGIONS];
    epx_gin_dev_t *dev;
    void *impl; /* the device copy of the handle's state */
    uint32_t ncontexts, nsignals;
    int32_t *abort_host; /* mapped: abort_dev is its device address */
    int32_t *abort_dev;
    epx_peers_t peers;
};

/* The agreement of the local steps: each rank's verdict and what every rank must share. */
typedef struct gin_agree {
    int32_t result;
    int32_t nregions, contexts, nsignals;
    uint64_t region_bytes[EPX_GIN_MAX_REGIONS];
    ncclUniqueId id; /* rank 0's counts */
} gin_agree_t;

static epx_result_t from_nccl(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess: return EPX_SUCCESS;
    case ncclUnhandledCudaError: return EPX_ERR_CUDA;
    case ncclSystemError: return EPX_ERR_SYSTEM;
    case ncclInvalidArgument: return EPX_ERR_INVALID_ARG;
    /* NCCL's answer for what this build or machine cannot do (no GIN backend, no symmetric memory). */
    case ncclInvalidUsage: return EPX_ERR_UNSUPPORTED;
    case ncclRemoteError: return EPX_ERR_REMOTE;
    case ncclInProgress: return EPX_ERR_TIMEOUT;
    default: return EPX_ERR_INTERNAL;
    }
}

static epx_result_t nccl_fail(const epx_gin_t *g, ncclResult_t r, const char *call)
{
    const char *last = ncclGetLastError(g->nccl);
    return epx_error(from_nccl(r), "rank %d: %s failed: %s (NCCL: %s)", g->rank, call, ncclGetErrorString(r),
                     last && last[0] ? last : "no message");
}

/* A peer process on this machine that has exited (-1: none). Pids of other machines mean nothing here. */
static int dead_peer(const epx_gin_t *g)
{
    const uint64_t host = g->comm->peers[g->rank].host_hash;
    for (int r = 0; r < g->nranks; r++)
        if (r != g->rank && g->comm->peers[r].host_hash == host && epx_peer_exited(&g->peers, r)) return r;
    return -1;
}

/* Why the peers cannot be reached any more, or 0: a peer gone or NCCL's asynchronous error. */
static int peer_trouble(const epx_gin_t *g, char *why, size_t n)
{
    const int dead = dead_peer(g);
    if (dead >= 0) {
        snprintf(why, n, "rank %d (pid %d) has exited", dead, (int)g->comm->peers[dead].pid);
        return 1;
    }
    ncclResult_t state = ncclSuccess;
    if (g->nccl && ncclCommGetAsyncError(g->nccl, &state) == ncclSuccess && state != ncclSuccess &&
        state != ncclInProgress) {
        const char *last = ncclGetLastError(g->nccl);
        snprintf(why, n, "NCCL reports an asynchronous error: %s (%s)", ncclGetErrorString(state),
                 last && last[0] ? last : "no message");
        return 1;
    }
    return 0;
}

/* `r` is what `call` answered on the non-blocking communicator: polls its asynchronous state until it
 * leaves ncclInProgress, a peer is gone, or `deadline` passes. */
static epx_result_t nccl_settle(epx_gin_t *g, ncclResult_t r, const char *call, uint64_t deadline)
{
    if (r != ncclSuccess && r != ncclInProgress) return nccl_fail(g, r, call);
    for (uint32_t i = 0;; i++) {
        ncclResult_t state = ncclInProgress;
        const ncclResult_t q = ncclCommGetAsyncError(g->nccl, &state);
        if (q != ncclSuccess) return nccl_fail(g, q, "ncclCommGetAsyncError");
        if (state == ncclSuccess) return EPX_SUCCESS;
        if (state != ncclInProgress) return nccl_fail(g, state, call);
        const int dead = (i & 63) == 0 ? dead_peer(g) : -1;
        if (dead >= 0)
            return epx_error(EPX_ERR_REMOTE, "rank %d: %s: rank %d (pid %d) exited while it was in progress",
                             g->rank, call, dead, (int)g->comm->peers[dead].pid);
        if (epx_time_ns() > deadline)
            return epx_error(EPX_ERR_TIMEOUT, "rank %d: %s did not complete within %lld ms (NCCL: %s)", g->rank,
                             call, (long long)g->timeout_ms, ncclGetLastError(g->nccl));
        epx_backoff(i);
    }
}

static uint64_t step_deadline(const epx_gin_t *g)
{
    return epx_deadline_after_ms(g->timeout_ms);
}

/* Every rank's verdict on its local steps: the first failure elsewhere becomes EPX_ERR_REMOTE here (a local
 * failure keeps its own code and message). With `shape`, also the arguments every rank must share. */
static epx_result_t agree(epx_gin_t *g, epx_result_t local, const char *step, gin_agree_t *mine,
                          const epx_gin_open_args_t *shape)
{
    char message[1024];
    epx_error_copy(message, sizeof(message));
    gin_agree_t *all = calloc((size_t)g->nranks, sizeof(*all));
    if (!all) return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: %d gin agreements", g->rank, g->nranks);
    mine->result = (int32_t)local;
    epx_result_t res = epx_comm_allgather(g->comm, mine, all, sizeof(*mine));
    if (res == EPX_SUCCESS && local != EPX_SUCCESS) {
        epx_error_set_message(message);
        res = local;
    }
    for (int r = 0; r < g->nranks && res == EPX_SUCCESS; r++) {
        const gin_agree_t *a = &all[r];
        if (a->result != EPX_SUCCESS) {
            res = epx_error(EPX_ERR_REMOTE, "rank %d: rank %d failed %s (%s)", g->rank, r, step,
                            epx_result_str((epx_result_t)a->result));
        } else if (shape && (a->nregions != all[0].nregions || a->contexts != all[0].contexts ||
                             a->nsignals != all[0].nsignals)) {
            res = epx_error(EPX_ERR_MISMATCH,
                            "rank %d: epx_gin_open: rank %d has %d regions, %d contexts, %d signals; rank 0 has "
                            "%d, %d, %d",
                            g->rank, r, a->nregions, a->contexts, a->nsignals, all[0].nregions, all[0].contexts,
                            all[0].nsignals);
        } else if (shape) {
            for (int i = 0; i < a->nregions && res == EPX_SUCCESS; i++)
                if (a->region_bytes[i] != all[0].region_bytes[i])
                    res = epx_error(EPX_ERR_MISMATCH,
                                    "rank %d: epx_gin_open: region %d is %llu bytes on rank %d, %llu on rank 0 "
                                    "(symmetric windows are equal everywhere)",
                                    g->rank, i, (unsigned long long)a->region_bytes[i], r,
                                    (unsigned long long)all[0].region_bytes[i]);
        }
    }
    if (res == EPX_SUCCESS && shape) mine->id = all[0].id;
    free(all);
    return res;
}

/* What a rank does alone before NCCL forms the communicator: its device, the peers' pidfds, the abort
 * word, the library's version, and rank 0's unique id (or the caller's communicator's shape). */
static epx_result_t open_local(epx_gin_t *g, const epx_gin_open_args_t *args, gin_agree_t *mine)
{
    EPX_CHECK(epx_cuda_check(cudaSetDevice(g->comm->cuda_device), "cudaSetDevice", g->rank));
    EPX_CHECK(epx_peers_open(&g->peers, g->comm));
    EPX_CHECK(epx_cuda_check(cudaHostAlloc((void **)&g->abort_host, sizeof(int32_t), cudaHostAllocMapped),
                             "cudaHostAlloc(abort word)", g->rank));
    *g->abort_host = 0;
    EPX_CHECK(epx_cuda_check(cudaHostGetDevicePointer((void **)&g->abort_dev, g->abort_host, 0),
                             "cudaHostGetDevicePointer(abort word)", g->rank));
    int version = 0;
    ncclResult_t r = ncclGetVersion(&version);
    if (r != ncclSuccess) return nccl_fail(g, r, "ncclGetVersion");
    /* The device communicator's layout is the headers': another major.minor would misread it. */
    if (version / 100 != NCCL_VERSION_CODE / 100)
        return epx_error(EPX_ERR_UNSUPPORTED,
                         "rank %d: the loaded libnccl is version %d, but epx was built against NCCL %d headers "
                         "(the device communicator's layout differs between versions)",
                         g->rank, version, NCCL_VERSION_CODE);
    if (!g->own_comm) {
        int count = -1, rank = -1;
        r = ncclCommCount(g->nccl, &count);
        if (r == ncclSuccess) r = ncclCommUserRank(g->nccl, &rank);
        if (r != ncclSuccess) return nccl_fail(g, r, "ncclCommCount / ncclCommUserRank of the caller's comm");
        if (count != g->nranks || rank != g->rank)
            return epx_error(EPX_ERR_INVALID_ARG,
                             "rank %d: the caller's NCCL communicator is rank %d of %d, the epx comm rank %d of %d",
                             g->rank, rank, count, g->rank, g->nranks);
    } else if (g->rank == 0) {
        r = ncclGetUniqueId(&mine->id);
        if (r != ncclSuccess) return nccl_fail(g, r, "ncclGetUniqueId");
    }
    mine->nregions = args->nregions;
    mine->contexts = args->contexts;
    mine->nsignals = args->nsignals;
    memcpy(mine->region_bytes, args->region_bytes, sizeof(mine->region_bytes));
    return EPX_SUCCESS;
}

static epx_result_t open_comm(epx_gin_t *g, const ncclUniqueId *id)
{
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0; /* every step is polled against a deadline below */
    ncclComm_t comm = NULL;
    const ncclResult_t r = ncclCommInitRankConfig(&comm, g->nranks, *id, g->rank, &config);
    g->nccl = comm; /* non-blocking: a communicator to poll, and to abort on failure, exists already */
    if (!comm) return nccl_fail(g, r, "ncclCommInitRankConfig");
    return nccl_settle(g, r, "ncclCommInitRankConfig", step_deadline(g));
}

/* ncclMemAlloc of every region: local, so its verdict is agreed before the collective registration. */
static epx_result_t open_memory(epx_gin_t *g)
{
    for (; g->nmem < g->nregions; g->nmem++) {
        const ncclResult_t r = ncclMemAlloc(&g->mem[g->nmem], (size_t)g->bytes[g->nmem]);
        if (r != ncclSuccess) {
            g->mem[g->nmem] = NULL;
            const epx_result_t res = nccl_fail(g, r, "ncclMemAlloc");
            return epx_error(res == EPX_ERR_CUDA ? EPX_ERR_OUT_OF_MEMORY : res,
                             "rank %d: ncclMemAlloc of region %d (%llu bytes) failed: %s", g->rank, g->nmem,
                             (unsigned long long)g->bytes[g->nmem], epx_error_message());
        }
    }
    return EPX_SUCCESS;
}

static epx_result_t open_windows(epx_gin_t *g)
{
    for (; g->nwin < g->nregions; g->nwin++) {
        const ncclResult_t r = ncclCommWindowRegister(g->nccl, g->mem[g->nwin], (size_t)g->bytes[g->nwin],
                                                      &g->win[g->nwin], NCCL_WIN_COLL_SYMMETRIC);
        const epx_result_t res = nccl_settle(g, r, "ncclCommWindowRegister", step_deadline(g));
        if (res != EPX_SUCCESS) {
            /* Registered or not, the communicator's abort (the only way on from here) releases it. */
            return res;
        }
    }
    return EPX_SUCCESS;
}

/* The device communicator: GIN contexts, the signals, one source-read counter per context (gin.cuh). */
static epx_result_t open_devcomm(epx_gin_t *g, const epx_gin_open_args_t *args)
{
    const ncclResult_t r = epx_gin_dev_create(g->nccl, args->contexts, args->nsignals, args->contexts, &g->dev);
    if (!g->dev) return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: device communicator state", g->rank);
    EPX_CHECK(nccl_settle(g, r, "ncclDevCommCreate (GIN)", step_deadline(g)));
    epx_gin_dev_counts_t c;
    epx_gin_dev_get_counts(g->dev, &c);
    if (c.rank != g->rank || c.nranks != g->nranks)
        return epx_error(EPX_ERR_INTERNAL, "rank %d: the device communicator says rank %d of %d, not %d of %d",
                         g->rank, c.rank, c.nranks, g->rank, g->nranks);
    if (c.contexts < 1 || c.signals < args->nsignals || c.counters < 1)
        return epx_error(EPX_ERR_UNSUPPORTED,
                         "rank %d: ncclDevCommCreate gave %d GIN contexts, %d signals, %d counters (asked %d, %d, "
                         "%d): NCCL has no usable GIN backend here",
                         g->rank, c.contexts, c.signals, c.counters, args->contexts, args->nsignals, args->contexts);
    /* Contexts past the counters (or past the wish) stay unused: each context counts its puts' sources. */
    int n = args->contexts < c.contexts ? args->contexts : c.contexts;
    if (c.counters < n) n = c.counters;
    g->ncontexts = (uint32_t)n;
    g->nsignals = (uint32_t)args->nsignals;
    void *windows[EPX_GIN_MAX_REGIONS];
    for (int i = 0; i < g->nregions; i++) windows[i] = (void *)g->win[i];
    const int published = epx_gin_dev_publish(g->dev, g->ncontexts, g->nregions, windows, g->bytes, g->timeout_ms,
                                              &g->impl);
    if (published == (int)cudaErrorTimeout)
        return epx_error(EPX_ERR_TIMEOUT, "rank %d: the device did not finish NCCL's copies of the GIN tables within "
                         "%lld ms", g->rank, (long long)g->timeout_ms);
    EPX_CHECK(epx_cuda_check(published, "the GIN handle's device copy", g->rank));
    EPX_INFO(EPX_SUBSYS_INIT,
             "rank %d: GIN device communicator: %d contexts (%u used), %d signals, %d counters, backend type %d, "
             "%d regions",
             g->rank, c.contexts, g->ncontexts, c.signals, c.counters, c.gin_type, g->nregions);
    return EPX_SUCCESS;
}

/* The teardown when peers cannot take part: abort (our communicator only), then the memory, which the
 * communicator's windows no longer hold. A caller's communicator keeps its windows and their memory. */
static void close_abort(epx_gin_t *g)
{
    if (g->own_comm && g->nccl) {
        const ncclResult_t r = ncclCommAbort(g->nccl);
        if (r != ncclSuccess)
            EPX_WARN(EPX_SUBSYS_INIT, "rank %d: ncclCommAbort: %s", g->rank, ncclGetErrorString(r));
        g->nccl = NULL;
    }
    if (g->own_comm || g->nwin == 0)
        for (; g->nmem > 0; g->nmem--) ncclMemFree(g->mem[g->nmem - 1]);
    else if (g->nmem > 0)
        EPX_WARN(EPX_SUBSYS_INIT, "rank %d: %d GIN regions stay registered on the caller's NCCL communicator",
                 g->rank, g->nwin);
    epx_gin_dev_free(g->dev);
    g->dev = NULL;
}

static void gin_free(epx_gin_t *g)
{
    if (g->abort_host) cudaFreeHost(g->abort_host);
    epx_peers_close(&g->peers);
    free(g);
}

epx_result_t epx_gin_open(epx_comm_t comm, const epx_gin_open_args_t *args, epx_gin_t **out)
{
    EPX_CHECK(epx_gin_check_args(comm, args, out));
    if (comm->backend != EPX_BACKEND_CUDA)
        return epx_error(EPX_ERR_UNSUPPORTED,
                         "rank %d: the GIN transport needs a communicator of the cuda backend, not the %s backend",
                         comm->rank, epx_backend_name(comm->backend));
    epx_gin_t *g = calloc(1, sizeof(*g));
    if (!g) return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: gin state", comm->rank);
    g->comm = comm;
    g->rank = comm->rank;
    g->nranks = comm->nranks;
    g->nccl = (ncclComm_t)args->nccl_comm;
    g->own_comm = args->nccl_comm == NULL;
    g->timeout_ms = args->timeout_ms > 0 ? args->timeout_ms : comm->timeout_ms;
    g->nregions = args->nregions;
    memcpy(g->bytes, args->region_bytes, sizeof(g->bytes));

    gin_agree_t mine;
    memset(&mine, 0, sizeof(mine));
    epx_result_t res = agree(g, open_local(g, args, &mine), "its local GIN setup", &mine, args);
    if (res != EPX_SUCCESS) goto fail;
    if (g->own_comm) {
        res = open_comm(g, &mine.id);
        if (res != EPX_SUCCESS) goto fail;
    }
    res = agree(g, open_memory(g), "ncclMemAlloc of its GIN regions", &mine, NULL);
    if (res != EPX_SUCCESS) goto fail;
    res = open_windows(g);
    if (res == EPX_SUCCESS) res = open_devcomm(g, args);
    if (res != EPX_SUCCESS) goto fail;
    EPX_INFO(EPX_SUBSYS_INIT, "rank %d of %d: GIN transport open (%s NCCL communicator, timeout %lld ms)", g->rank,
             g->nranks, g->own_comm ? "its own" : "the caller's", (long long)g->timeout_ms);
    *out = g;
    return EPX_SUCCESS;

fail: {
    /* Peers may stand anywhere in the collective steps: only the abort is safe. The message stays the
     * failure's. */
    char message[1024];
    epx_error_copy(message, sizeof(message));
    close_abort(g);
    gin_free(g);
    epx_error_set_message(message);
    return res;
}
}

epx_net_t epx_gin_net(const epx_gin_t *g)
{
    epx_net_t net;
    memset(&net, 0, sizeof(net));
    net.transport = EPX_NET_TRANSPORT_GIN;
    net.rank = g->rank;
    net.nranks = g->nranks;
    net.ncontexts = g->ncontexts;
    net.nsignals = g->nsignals;
    net.impl = g->impl;
    net.abort_word = g->abort_dev;
    return net;
}

void *epx_gin_region(const epx_gin_t *g, int region)
{
    return region >= 0 && region < g->nmem ? g->mem[region] : NULL;
}

void epx_gin_abort(epx_gin_t *g)
{
    __atomic_store_n(g->abort_host, 1, __ATOMIC_RELEASE);
}

epx_result_t epx_gin_poll(epx_gin_t *g)
{
    char why[512];
    if (!peer_trouble(g, why, sizeof(why))) return EPX_SUCCESS;
    epx_gin_abort(g);
    return epx_error(EPX_ERR_REMOTE, "rank %d: the GIN transport cannot reach its peers: %s", g->rank, why);
}

epx_result_t epx_gin_wait_result(epx_gin_t *g, epx_net_status_t status, const char *what)
{
    if (status == EPX_NET_OK) return EPX_SUCCESS;
    char why[512];
    if (peer_trouble(g, why, sizeof(why)))
        return epx_error(EPX_ERR_REMOTE, "rank %d: %s ended with %s: %s", g->rank, what, epx_net_status_name(status),
                         why);
    return epx_net_status_error(g->rank, status, what, g->timeout_ms);
}

/* One collective teardown step on a live communicator; the first failure is kept in *res. */
static int close_step(epx_gin_t *g, ncclResult_t r, const char *call, uint64_t deadline, epx_result_t *res)
{
    const epx_result_t s = nccl_settle(g, r, call, deadline);
    if (s != EPX_SUCCESS && *res == EPX_SUCCESS) *res = s;
    return s == EPX_SUCCESS;
}

epx_result_t epx_gin_close(epx_gin_t *g)
{
    if (!g) return EPX_SUCCESS;
    epx_gin_abort(g);
    const uint64_t deadline = step_deadline(g);
    epx_result_t res = EPX_SUCCESS;
    char why[512];
    int healthy = !peer_trouble(g, why, sizeof(why));
    if (!healthy) res = epx_error(EPX_ERR_REMOTE, "rank %d: epx_gin_close: %s: aborting", g->rank, why);
    /* Every rank's kernels have ended before any window goes; a peer that never comes fails it. */
    if (healthy && (res = epx_comm_barrier(g->comm)) != EPX_SUCCESS) healthy = 0;
    if (healthy) healthy = close_step(g, epx_gin_dev_destroy(g->nccl, g->dev), "ncclDevCommDestroy", deadline, &res);
    while (healthy && g->nwin > 0) {
        healthy = close_step(g, ncclCommWindowDeregister(g->nccl, g->win[g->nwin - 1]), "ncclCommWindowDeregister",
                             deadline, &res);
        if (healthy) g->nwin--;
    }
    if (healthy) {
        for (; g->nmem > 0; g->nmem--) ncclMemFree(g->mem[g->nmem - 1]);
        epx_gin_dev_free(g->dev);
        g->dev = NULL;
    }
    if (healthy && g->own_comm) {
        healthy = close_step(g, ncclCommFinalize(g->nccl), "ncclCommFinalize", deadline, &res);
        if (healthy) {
            const ncclResult_t r = ncclCommDestroy(g->nccl);
            if (r != ncclSuccess && res == EPX_SUCCESS) res = nccl_fail(g, r, "ncclCommDestroy");
            g->nccl = NULL;
        }
    }
    if (!healthy) {
        char message[1024];
        epx_error_copy(message, sizeof(message));
        close_abort(g);
        epx_error_set_message(message);
    }
    gin_free(g);
    return res;
}
