/*
 * The GIN probe's host setup and teardown, in docs/network.md's order: environment (each rank its own
 * emulated node), CUDA, the unique id over the shared page, ncclCommInitRank, whether NCCL opened the
 * plugin, ncclMemAlloc + ncclCommWindowRegister, ncclDevCommCreate with GIN, the net.h handle; then
 * ncclDevCommDestroy, window deregistration, ncclMemFree, a barrier, finalize + destroy or abort.
 * Run on one H200 (docs/benchmarks.md).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "probe.h"

#define CUDA_TRY(p, call)                                                                        \
    do {                                                                                         \
        cudaError_t e_ = (call);                                                                 \
        if (e_ != cudaSuccess) return probe_fail(p, 1, "%s: %s", #call, cudaGetErrorString(e_)); \
    } while (0)
#define NCCL_TRY(p, s, call)                                                      \
    do {                                                                          \
        ncclResult_t r_ = (call);                                                 \
        if (r_ != ncclSuccess)                                                    \
            return probe_fail(p, 1, "%s: %s (%s)", #call, ncclGetErrorString(r_), \
                              ncclGetLastError((s)->comm));                       \
    } while (0)

static int stage_env(probe_t *p, rank_state_t *s)
{
    const probe_opts_t *o = s->o;
    probe_begin(p, PROBE_STAGE_ENV,
                "NCCL_HOSTID, NCCL_NET_PLUGIN, NCCL_GIN_TYPE, NCCL_SOCKET_IFNAME, NCCL_NVLS_ENABLE");
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
    return probe_ok(
        p, "NCCL_HOSTID=%s NCCL_NET_PLUGIN=%s NCCL_GIN_TYPE=%s NCCL_SOCKET_IFNAME=%s NCCL_NVLS_ENABLE=%s",
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
        return probe_fail(p, 1,
                          "libnccl is %d but the probe was compiled against NCCL %d headers: the device "
                          "communicator's layout differs between versions",
                          version, NCCL_VERSION_CODE);
    CUDA_TRY(p, cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
    CUDA_TRY(p, cudaHostAlloc((void **)&s->abort_host, sizeof(int32_t), cudaHostAllocMapped));
    CUDA_TRY(p, cudaHostAlloc((void **)&s->res_host, sizeof(kernel_result_t), cudaHostAllocMapped));
    CUDA_TRY(p, cudaHostGetDevicePointer((void **)&s->abort_dev, s->abort_host, 0));
    CUDA_TRY(p, cudaHostGetDevicePointer((void **)&s->res_dev, s->res_host, 0));
    *s->abort_host = 0;
    CUDA_TRY(p, cudaMallocHost((void **)&s->h_src, WINDOW_BYTES));
    CUDA_TRY(p, cudaMallocHost((void **)&s->h_expect, WINDOW_BYTES));
    CUDA_TRY(p, cudaMallocHost((void **)&s->h_got, WINDOW_BYTES));
    return probe_ok(p, "device 0 %s (sm_%d%d), libnccl %d, headers %d", prop.name, prop.major, prop.minor,
                    version, NCCL_VERSION_CODE);
}

static int stage_comm(probe_t *p, rank_state_t *s)
{
    ncclUniqueId id;
    char why[256];
    probe_begin(p, PROBE_STAGE_UNIQUE_ID,
                s->rank == 0 ? "ncclGetUniqueId, published on the shared page"
                             : "waiting for rank 0's unique id");
    if (s->rank == 0) {
        NCCL_TRY(p, s, ncclGetUniqueId(&id));
        probe_publish_id(p, &id, sizeof(id));
    } else if (!probe_wait_id(p, &id, sizeof(id), (s->o->stage_timeout_s - 2) * 1000, why, sizeof(why))) {
        return probe_fail(p, 1, "%s", why);
    }
    probe_ok(p, "%zu bytes", sizeof(id));
    probe_begin(p, PROBE_STAGE_COMM_INIT, "ncclCommInitRank");
    ncclComm_t comm = NULL; /* kept only once whole: a failed init leaves nothing to tear down */
    NCCL_TRY(p, s, ncclCommInitRank(&comm, s->nranks, id, s->rank));
    s->comm = comm;
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
        probe_record(p, PROBE_STAGE_PLUGIN, PROBE_SKIPPED,
                     "no NCCL_NET_PLUGIN: NCCL has only its built-in transports");
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
        probe_ok(p,
                 "%s is mapped: NCCL opened it (its GIN table was taken if NCCL's INFO log says 'Loaded gin "
                 "plugin "
                 "EPX_GIN_TEST' and 'Assigned GIN plugin')",
                 found);
    } else {
        probe_fail(p, 0,
                   "%s is not mapped after ncclCommInitRank: NCCL did not open it (NCCL's INFO lines "
                   "'NET/Plugin' say why)",
                   name);
        s->failed = 1;
    }
}

static int stage_memory(probe_t *p, rank_state_t *s)
{
    probe_begin(p, PROBE_STAGE_MEM_ALLOC, "ncclMemAlloc of two windows");
    for (; s->nbuf < 2; s->nbuf++) NCCL_TRY(p, s, ncclMemAlloc(&s->buf[s->nbuf], WINDOW_BYTES));
    probe_ok(p, "2 x %llu bytes at %p, %p", WINDOW_BYTES, s->buf[0], s->buf[1]);
    probe_begin(p, PROBE_STAGE_WINDOWS,
                "ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC) of both (collective)");
    for (; s->nwin < 2; s->nwin++)
        NCCL_TRY(p, s,
                 ncclCommWindowRegister(s->comm, s->buf[s->nwin], WINDOW_BYTES, &s->win[s->nwin],
                                        NCCL_WIN_COLL_SYMMETRIC));
    return probe_ok(p, "region 0 (source) window %p, region 1 (destination) window %p", (void *)s->win[0],
                    (void *)s->win[1]);
}

static int stage_devcomm(probe_t *p, rank_state_t *s)
{
    probe_begin(p, PROBE_STAGE_DEVCOMM,
                "ncclDevCommCreate with GIN: contexts, signals, counters, ginForceEnable");
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
    return probe_ok(
        p, "rank %d of %d, %d GIN contexts (backend types %s; %d is the proxy), %d signals, %d counters",
        d.rank, d.nRanks, (int)d.ginContextCount, types, (int)NCCL_NET_DEVICE_GIN_PROXY, d.ginSignalCount,
        d.ginCounterCount);
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
    /* NCCL's window and device-communicator copies run on its own streams; the probe's stream does not wait.
     */
    CUDA_TRY(p, cudaDeviceSynchronize());
    memset(&s->net, 0, sizeof(s->net));
    s->net.transport = EPX_NET_TRANSPORT_GIN;
    s->net.rank = s->rank;
    s->net.nranks = s->nranks;
    s->net.ncontexts = ncontexts;
    s->net.nsignals = NSIGNALS;
    s->net.impl = s->g_dev;
    s->net.abort_word = s->abort_dev;
    return probe_ok(
        p, "%u contexts, %d signals, 2 regions of %llu bytes; puts go to rank %d, signals come from rank %d",
        ncontexts, NSIGNALS, WINDOW_BYTES, s->peer, s->from);
}

int probe_setup(probe_t *p, rank_state_t *s)
{
    if (!stage_env(p, s) || !stage_cuda(p, s) || !stage_comm(p, s)) return 0;
    stage_plugin(p, s);
    if (s->o->devcomm_first) return stage_devcomm(p, s) && stage_memory(p, s) && stage_handle(p, s);
    return stage_memory(p, s) && stage_devcomm(p, s) && stage_handle(p, s);
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
void probe_teardown(probe_t *p, rank_state_t *s)
{
    char why[256];
    if (s->kernel_stuck) {
        for (int st = PROBE_STAGE_DEVCOMM_DESTROY; st <= PROBE_STAGE_COMM_DESTROY; st++)
            probe_record(p, (probe_stage_t)st, PROBE_SKIPPED,
                         "a kernel still runs: the process exits without teardown");
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
        for (int i = s->nwin - 1; i >= 0 && r == ncclSuccess; i--)
            r = ncclCommWindowDeregister(s->comm, s->win[i]);
        teardown_step(p, s, "ncclCommWindowDeregister", r);
    } else {
        probe_record(p, PROBE_STAGE_WINDOWS_DEREG, PROBE_SKIPPED, "no window registered");
    }
    if (s->nbuf > 0 || s->g_dev || s->posted) {
        probe_begin(p, PROBE_STAGE_MEM_FREE,
                    "ncclMemFree of each window's memory, the handle's device copy, posted[]");
        ncclResult_t r = ncclSuccess;
        for (int i = s->nbuf - 1; i >= 0 && r == ncclSuccess; i--) r = ncclMemFree(s->buf[i]);
        const cudaError_t e1 = cudaFree(s->g_dev), e2 = cudaFree(s->posted);
        if (r == ncclSuccess && (e1 != cudaSuccess || e2 != cudaSuccess)) {
            s->failed = 1;
            probe_fail(p, 0, "cudaFree of the handle: %s", cudaGetErrorString(e1 != cudaSuccess ? e1 : e2));
        } else {
            teardown_step(p, s, "ncclMemFree", r);
        }
    } else {
        probe_record(p, PROBE_STAGE_MEM_FREE, PROBE_SKIPPED, "nothing allocated");
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
        probe_record(p, PROBE_STAGE_COMM_FINALIZE, PROBE_SKIPPED,
                     "a peer is gone or the barrier failed: force-close");
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
