/*
 * The device half of the GIN host setup (src/net/gin_dev.h): ncclDevCommCreate / ncclDevCommDestroy and
 * the handle's state (src/net/gin.cuh's epx_net_gin_t) in device memory. Host code only, compiled with
 * NCCL's device headers because the device communicator is their type. Run by gpu.gin_host.
 */
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "net/gin.cuh"
#include "net/gin_dev.h"

#if !defined(EPX_NET_GIN_DEVICE)
#error "src/net/gin_dev.cu needs EPX_NET_HAVE_GIN and NCCL's device headers"
#endif

struct epx_gin_dev {
    ncclDevComm comm; /* NCCL writes it when the (possibly deferred) creation completes */
    int created;      /* ncclDevCommCreate was accepted: destroy owes a call */
    epx_net_gin_t *impl;
    unsigned long long *posted;
};

extern "C" int epx_gin_dev_create(void *nccl_comm, int contexts, int signals, int counters, epx_gin_dev_t **out)
{
    *out = (epx_gin_dev_t *)calloc(1, sizeof(epx_gin_dev_t));
    if (!*out) return (int)ncclSystemError;
    ncclDevCommRequirements reqs;
#ifdef NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
    reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
    memset(&reqs, 0, sizeof(reqs));
#endif
    reqs.ginForceEnable = true;
    reqs.ginContextCount = contexts;
    reqs.ginSignalCount = signals;
    reqs.ginCounterCount = counters;
    const ncclResult_t r = ncclDevCommCreate((ncclComm_t)nccl_comm, &reqs, &(*out)->comm);
    (*out)->created = r == ncclSuccess || r == ncclInProgress;
    return (int)r;
}

extern "C" void epx_gin_dev_get_counts(const epx_gin_dev_t *d, epx_gin_dev_counts_t *counts_out)
{
    const ncclDevComm &c = d->comm;
    counts_out->rank = c.rank;
    counts_out->nranks = c.nRanks;
    counts_out->contexts = c.ginContextCount;
    counts_out->signals = c.ginSignalCount;
    counts_out->counters = c.ginCounterCount;
    counts_out->gin_type = c.ginContextCount > 0 ? (int32_t)c.ginTypes[0] : -1;
}

/* cudaDeviceSynchronize on a helper thread, waited for here at most timeout_ms: past it the caller gets
 * cudaErrorTimeout and the helper is left to finish on its own (it holds only its shared verdict). */
static cudaError_t sync_device_bounded(int64_t timeout_ms)
{
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    auto verdict = std::make_shared<std::atomic<int>>(-1);
    try {
        std::thread([verdict, dev] {
            cudaError_t r = cudaSetDevice(dev);
            if (r == cudaSuccess) r = cudaDeviceSynchronize();
            verdict->store((int)r, std::memory_order_release);
        }).detach();
    } catch (...) {
        return cudaErrorMemoryAllocation;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
        const int v = verdict->load(std::memory_order_acquire);
        if (v >= 0) return (cudaError_t)v;
        if (std::chrono::steady_clock::now() > deadline) return cudaErrorTimeout;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
}

extern "C" int epx_gin_dev_publish(epx_gin_dev_t *d, uint32_t ncontexts, int nregions, void *const *windows,
                                   const uint64_t *region_bytes, int64_t timeout_ms, void **impl_out)
{
    if (nregions < 0 || nregions > EPX_NET_GIN_MAX_REGIONS || ncontexts == 0) return (int)cudaErrorInvalidValue;
    epx_net_gin_t g;
    memset(&g, 0, sizeof(g));
    g.comm = d->comm;
    g.nregions = (uint32_t)nregions;
    g.signal_base = 0; /* NCCL numbers the requested signals and counters from 0 */
    g.counter_base = 0;
    for (int i = 0; i < nregions; i++) {
        g.windows[i] = (ncclWindow_t)windows[i];
        g.region_bytes[i] = region_bytes[i];
    }
    cudaError_t e = cudaMalloc((void **)&d->posted, ncontexts * sizeof(unsigned long long));
    if (e == cudaSuccess) e = cudaMemset(d->posted, 0, ncontexts * sizeof(unsigned long long));
    g.posted = d->posted;
    if (e == cudaSuccess) e = cudaMalloc((void **)&d->impl, sizeof(g));
    if (e == cudaSuccess) e = cudaMemcpy(d->impl, &g, sizeof(g), cudaMemcpyHostToDevice);
    /* The windows' and the device communicator's device tables are written on NCCL's streams, which a
     * kernel launched on another stream does not wait for. No kernel of this handle runs yet. The wait is
     * bounded: a device that never finishes NCCL's copies gives cudaErrorTimeout. */
    if (e == cudaSuccess) e = sync_device_bounded(timeout_ms);
    if (e == cudaSuccess) *impl_out = d->impl;
    return (int)e;
}

extern "C" int epx_gin_dev_destroy(void *nccl_comm, epx_gin_dev_t *d)
{
    if (!d || !d->created) return (int)ncclSuccess;
    d->created = 0;
    return (int)ncclDevCommDestroy((ncclComm_t)nccl_comm, &d->comm);
}

extern "C" void epx_gin_dev_free(epx_gin_dev_t *d)
{
    if (!d) return;
    if (d->impl) cudaFree(d->impl);
    if (d->posted) cudaFree(d->posted);
    free(d);
}
