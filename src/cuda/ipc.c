/*
 * The ipc transport's memory: each rank's registered region and its mappings of its peers' regions.
 *
 * Kinds (EPX_CUDA_IPC; docs/architecture.md, "The ipc transport"):
 *  - fd (the default where every rank's device supports it): the region is CUDA virtual memory
 *    (cuMemCreate) exported as a POSIX file descriptor, handed to the node's other processes over a
 *    Unix socket (src/core/share.c) and mapped there (cuMemImportFromShareableHandle, cuMemMap). No
 *    legacy IPC handle.
 *  - fabric: the same memory exported as a fabric handle (multi-node NVLink systems, where the
 *    driver offers it), exchanged through the bootstrap, so one NVLink domain can span hosts. Behind
 *    the device's capability; asked for by EPX_CUDA_IPC=fabric only.
 *  - legacy: cudaMalloc and cudaIpcGetMemHandle / cudaIpcOpenMemHandle.
 * EPX_CUDA_IPC=auto (or unset) takes fd when every rank can (its device exports POSIX descriptors, and
 * all ranks share one pid and one network namespace, which the socket exchange needs), else legacy;
 * when the fd path fails on some rank (every step is agreed, so on all of them) it falls back to legacy
 * with a warning. A named kind that some rank cannot use fails the creation on every rank with
 * EPX_ERR_UNSUPPORTED. Every rank maps its peers' regions with the same size (the largest
 * granularity of all ranks').
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda/cuda.h"


/* Fabric handles exist from CUDA 12.3 on. */
#if CUDA_VERSION >= 12030
#define EPX_HAVE_FABRIC 1
#else
#define EPX_HAVE_FABRIC 0
#endif

/* The driver calls used here, found through the runtime (cudaGetDriverEntryPointByVersion): the library
 * keeps no link to libcuda, so it loads where no driver is installed (the CPU backend still works). */
#define EPX_DRIVER_CALLS(X)                                                                                 \
    X(cuGetErrorName) X(cuGetErrorString) X(cuDeviceGet) X(cuDeviceGetAttribute)                           \
    X(cuMemGetAllocationGranularity) X(cuMemCreate) X(cuMemRelease) X(cuMemExportToShareableHandle)        \
    X(cuMemImportFromShareableHandle) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap) \
    X(cuMemSetAccess)

static struct {
#define EPX_DRIVER_FIELD_(f) __typeof__(&f) p_##f;
    EPX_DRIVER_CALLS(EPX_DRIVER_FIELD_)
#undef EPX_DRIVER_FIELD_
    const char *missing; /* the first call the driver did not give, NULL when all are there */
} drv;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

/* The runtime's lookup of a driver call: by version where the toolkit has it (12.5 on), else the older
 * call (the toolkit's own driver version). */
static cudaError_t get_entry_point(const char *name, void **fn, enum cudaDriverEntryPointQueryResult *q)
{
#if CUDART_VERSION >= 12050
    return cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, q);
#else
    return cudaGetDriverEntryPoint(name, fn, cudaEnableDefault, q);
#endif
}

static void drv_load(void)
{
#define EPX_DRIVER_LOAD_(f)                                                                                 \
    if (!drv.missing) {                                                                                     \
        void *fn = NULL;                                                                                    \
        enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;                       \
        if (get_entry_point(#f, &fn, &q) != cudaSuccess ||                                                 \
            q != cudaDriverEntryPointSuccess || !fn) {                                                      \
            (void)cudaGetLastError();                                                                       \
            drv.missing = #f;                                                                               \
        } else {                                                                                            \
            drv.p_##f = (__typeof__(&f))fn;                                                                 \
        }                                                                                                   \
    }
    EPX_DRIVER_CALLS(EPX_DRIVER_LOAD_)
#undef EPX_DRIVER_LOAD_
}

/* Whether every driver call is there (loaded once). */
static int drv_ready(void)
{
    pthread_once(&drv_once, drv_load);
    return drv.missing == NULL;
}

static epx_result_t drv_check(CUresult r, const char *what, int rank)
{
    if (r == CUDA_SUCCESS) return EPX_SUCCESS;
    const char *name = NULL, *text = NULL;
    if (drv.p_cuGetErrorName) (void)drv.p_cuGetErrorName(r, &name);
    if (drv.p_cuGetErrorString) (void)drv.p_cuGetErrorString(r, &text);
    return epx_error(r == CUDA_ERROR_OUT_OF_MEMORY ? EPX_ERR_OUT_OF_MEMORY
                     : r == CUDA_ERROR_NOT_SUPPORTED ? EPX_ERR_UNSUPPORTED
                                                     : EPX_ERR_CUDA,
                     "rank %d: %s failed: %s (%s)", rank, what, name ? name : "?", text ? text : "?");
}

/* The kind EPX_CUDA_IPC names (EPX_CUDA_IPC_AUTO when unset or "auto"), or -1 for anything else. */
static int asked_kind(void)
{
    const epx_params_t *p = NULL;
    if (epx_params_get(&p) != EPX_SUCCESS) return -1;
    const char *v = p->cuda_ipc;
    if (!*v || !strcasecmp(v, "auto")) return EPX_CUDA_IPC_AUTO;
    if (!strcasecmp(v, "fd")) return EPX_CUDA_IPC_FD;
    if (!strcasecmp(v, "fabric")) return EPX_CUDA_IPC_FABRIC;
    if (!strcasecmp(v, "legacy")) return EPX_CUDA_IPC_LEGACY;
    return -1;
}

int epx_cuda_ipc_asks_fabric(void)
{
    return asked_kind() == EPX_CUDA_IPC_FABRIC;
}

/* EPX_CUDA_IPC_CAN_FD | EPX_CUDA_IPC_CAN_FABRIC for our device. */
static int capabilities(int device)
{
    if (!drv_ready()) return 0;
    CUdevice dev;
    if (drv.p_cuDeviceGet(&dev, device) != CUDA_SUCCESS) return 0;
    int vmm = 0, fd = 0, fabric = 0;
    if (drv.p_cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev) != CUDA_SUCCESS)
        vmm = 0;
    if (drv.p_cuDeviceGetAttribute(&fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev) !=
        CUDA_SUCCESS)
        fd = 0;
#if EPX_HAVE_FABRIC
    if (drv.p_cuDeviceGetAttribute(&fabric, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, dev) != CUDA_SUCCESS)
        fabric = 0;
#endif
    return vmm ? (fd ? EPX_CUDA_IPC_CAN_FD : 0) | (fabric ? EPX_CUDA_IPC_CAN_FABRIC : 0) : 0;
}

/* ---- virtual memory ---------------------------------------------------------------------------- */

static CUmemAllocationHandleType handle_type(int kind)
{
#if EPX_HAVE_FABRIC
    if (kind == EPX_CUDA_IPC_FABRIC) return CU_MEM_HANDLE_TYPE_FABRIC;
#endif
    (void)kind;
    return CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
}

/* Reserves an address range, maps allocation `h` there and gives our device read-write access. */
static epx_result_t vmm_map(const cuda_buffer_t *cb, CUmemGenericAllocationHandle h, uint8_t **va_out)
{
    const int me = cb->buffer->comm->rank;
    CUdeviceptr va = 0;
    EPX_CHECK(drv_check(drv.p_cuMemAddressReserve(&va, cb->ipc_bytes, 0, 0, 0), "cuMemAddressReserve", me));
    epx_result_t res = drv_check(drv.p_cuMemMap(va, cb->ipc_bytes, 0, h, 0), "cuMemMap", me);
    if (res != EPX_SUCCESS) {
        (void)drv.p_cuMemAddressFree(va, cb->ipc_bytes);
        return res;
    }
    CUmemAccessDesc access;
    memset(&access, 0, sizeof(access));
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = cb->device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    res = drv_check(drv.p_cuMemSetAccess(va, cb->ipc_bytes, &access, 1), "cuMemSetAccess", me);
    if (res != EPX_SUCCESS) {
        (void)drv.p_cuMemUnmap(va, cb->ipc_bytes);
        (void)drv.p_cuMemAddressFree(va, cb->ipc_bytes);
        return res;
    }
    *va_out = (uint8_t *)(uintptr_t)va;
    return EPX_SUCCESS;
}

static void vmm_unmap(const cuda_buffer_t *cb, uint8_t *va)
{
    (void)drv.p_cuMemUnmap((CUdeviceptr)(uintptr_t)va, cb->ipc_bytes);
    (void)drv.p_cuMemAddressFree((CUdeviceptr)(uintptr_t)va, cb->ipc_bytes);
}

/* The properties of an exportable region of `kind` on our device. */
static void allocation_prop(const cuda_buffer_t *cb, int kind, CUmemAllocationProp *prop)
{
    memset(prop, 0, sizeof(*prop));
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = cb->device;
    prop->requestedHandleTypes = handle_type(kind);
}

/* Our device's recommended granularity for regions exported as `kind` (0: unknown). */
static uint64_t granularity(const cuda_buffer_t *cb, int kind)
{
    CUmemAllocationProp prop;
    allocation_prop(cb, kind, &prop);
    size_t gran = 0;
    if (drv.p_cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) != CUDA_SUCCESS)
        gran = 0;
    return gran;
}

/* Our region as virtual memory of `kind`, cb->ipc_bytes (agreed by every rank) long. */
static epx_result_t vmm_alloc(cuda_buffer_t *cb, int kind)
{
    const int me = cb->buffer->comm->rank;
    CUmemAllocationProp prop;
    allocation_prop(cb, kind, &prop);
    CUmemGenericAllocationHandle h;
    EPX_CHECK(drv_check(drv.p_cuMemCreate(&h, cb->ipc_bytes, &prop, 0), "cuMemCreate(region)", me));
    epx_result_t res;
    if (kind == EPX_CUDA_IPC_FABRIC) {
#if EPX_HAVE_FABRIC
        CUmemFabricHandle fh;
        res = drv_check(drv.p_cuMemExportToShareableHandle(&fh, h, CU_MEM_HANDLE_TYPE_FABRIC, 0),
                        "cuMemExportToShareableHandle(fabric)", me);
        if (res == EPX_SUCCESS) memcpy(cb->ipc_fabric, &fh, sizeof(cb->ipc_fabric));
#else
        res = epx_error(EPX_ERR_UNSUPPORTED, "rank %d: this build's CUDA toolkit has no fabric handles", me);
#endif
    } else {
        int fd = -1;
        res = drv_check(drv.p_cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                        "cuMemExportToShareableHandle(fd)", me);
        cb->ipc_fd = res == EPX_SUCCESS ? fd : -1;
    }
    if (res == EPX_SUCCESS) res = vmm_map(cb, h, &cb->region);
    /* The mapping (and the export) keep the memory; it goes with the last of them. */
    (void)drv.p_cuMemRelease(h);
    if (res != EPX_SUCCESS && cb->ipc_fd >= 0) {
        close(cb->ipc_fd);
        cb->ipc_fd = -1;
    }
    return res;
}

/* Imports and maps peer r's region from its exported handle (fd: ours to close). */
static epx_result_t vmm_import(cuda_buffer_t *cb, int r, int kind, void *shared)
{
    const int me = cb->buffer->comm->rank;
    CUmemGenericAllocationHandle h;
    char what[64];
    snprintf(what, sizeof(what), "cuMemImportFromShareableHandle(%s of rank %d)", epx_cuda_ipc_kind_name(kind), r);
    EPX_CHECK(drv_check(drv.p_cuMemImportFromShareableHandle(&h, shared, handle_type(kind)), what, me));
    epx_result_t res = vmm_map(cb, h, &cb->peers[r]);
    (void)drv.p_cuMemRelease(h);
    if (res == EPX_SUCCESS) cb->peer_opened[r] = 1;
    return res;
}

/* Every peer's region through the fd exchange (fd) or the bootstrap (fabric). Every rank takes the same
 * collective steps whatever fails locally (a table it cannot allocate included). *settled: 1 when the
 * outcome is every rank's (the last agreement completed), so that a fallback is a step all ranks take;
 * 0 after a collective failed (a peer dead or stalled). */
static epx_result_t vmm_map_peers(cuda_buffer_t *cb, int kind, int *settled)
{
    epx_comm_t comm = cb->buffer->comm;
    const int R = comm->nranks, me = comm->rank;
    epx_result_t res = EPX_SUCCESS;
    *settled = 0;
    if (kind == EPX_CUDA_IPC_FABRIC) {
        uint8_t(*all)[64] = calloc((size_t)R, 64);
        res = epx_comm_agree_settled(
            comm, all ? EPX_SUCCESS : epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: fabric handle table", me),
            "allocate its fabric handle table", settled);
        if (res == EPX_SUCCESS) {
            *settled = 0; /* a failed allgather is a collective failure */
            res = epx_comm_allgather(comm, cb->ipc_fabric, all, 64);
        }
        if (res == EPX_SUCCESS) {
            epx_result_t imported = EPX_SUCCESS;
            for (int r = 0; r < R && imported == EPX_SUCCESS; r++)
                if (r != me) imported = vmm_import(cb, r, kind, all[r]);
            res = epx_comm_agree_settled(comm, imported, "map its peers' regions (fabric handles)", settled);
        }
        free(all);
        return res;
    }
    int *fds = malloc((size_t)R * sizeof(int));
    epx_peers_t procs;
    memset(&procs, 0, sizeof(procs));
    epx_result_t ready = fds ? epx_peers_open(&procs, comm)
                             : epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: descriptor table", me);
    /* A rank that is not ready still joins the exchange's first agreement (and receives nothing). */
    res = epx_share_fds(comm, &procs, cb->ipc_fd, fds, ready);
    epx_peers_close(&procs);
    /* Fault injection of the tests: EPX_TEST_FAULT_IPC=<rank> fails that rank's imports (auto then falls
     * back to legacy handles on every rank). */
    const char *fault = getenv("EPX_TEST_FAULT_IPC");
    char *end = NULL;
    const long faulty = fault && *fault ? strtol(fault, &end, 10) : -1;
    if (res == EPX_SUCCESS && end && !*end && faulty == me)
        res = epx_error(EPX_ERR_CUDA, "rank %d: imports failed by EPX_TEST_FAULT_IPC", me);
    for (int r = 0; r < R && res == EPX_SUCCESS; r++)
        if (r != me) res = vmm_import(cb, r, kind, (void *)(uintptr_t)fds[r]);
    for (int r = 0; fds && r < R; r++)
        if (fds[r] >= 0) close(fds[r]);
    free(fds);
    close(cb->ipc_fd); /* every peer holds its own copy now (or the creation fails) */
    cb->ipc_fd = -1;
    return epx_comm_agree_settled(comm, res, "map its peers' regions (file descriptors)", settled);
}

/* ---- legacy IPC ---------------------------------------------------------------------------------- */

static epx_result_t legacy_alloc(cuda_buffer_t *cb)
{
    cb->ipc_bytes = cb->lay.total;
    return epx_cuda_check(cudaMalloc((void **)&cb->region, cb->lay.total), "cudaMalloc(region)",
                          cb->buffer->comm->rank);
}

static epx_result_t legacy_map_peers(cuda_buffer_t *cb)
{
    epx_comm_t comm = cb->buffer->comm;
    const int R = comm->nranks, me = comm->rank;
    cudaIpcMemHandle_t mine, *all = calloc((size_t)R, sizeof(cudaIpcMemHandle_t));
    memset(&mine, 0, sizeof(mine));
    epx_result_t res = all ? epx_cuda_check(cudaIpcGetMemHandle(&mine, cb->region), "cudaIpcGetMemHandle", me)
                           : epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: ipc handle table", me);
    res = epx_comm_agree(comm, res, "export its region");
    if (res == EPX_SUCCESS) res = epx_comm_allgather(comm, &mine, all, sizeof(mine));
    for (int r = 0; r < R && res == EPX_SUCCESS; r++) {
        if (r == me) continue;
        void *p = NULL;
        res = epx_cuda_check(cudaIpcOpenMemHandle(&p, all[r], cudaIpcMemLazyEnablePeerAccess),
                             "cudaIpcOpenMemHandle", me);
        if (res == EPX_SUCCESS) {
            cb->peers[r] = p;
            cb->peer_opened[r] = 1;
        }
    }
    free(all);
    return epx_comm_agree(comm, res, "map its peers' regions (legacy handles)");
}

/* ---- the entry points --------------------------------------------------------------------------- */

epx_result_t epx_cuda_ipc_alloc(cuda_buffer_t *cb)
{
    epx_comm_t comm = cb->buffer->comm;
    const int R = comm->nranks, me = comm->rank;
    cb->ipc_fd = -1;
    const int asked = asked_kind();
    if (asked < 0)
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d: EPX_CUDA_IPC='%s' is none of auto, fd, fabric, legacy", me,
                         getenv("EPX_CUDA_IPC") ? getenv("EPX_CUDA_IPC") : "");
    /* Every rank's capabilities, region size, granularity and namespaces, so that all choose the same
     * kind and size (src/cuda/ipc_plan.h). */
    epx_cuda_ipc_rec_t mine = {capabilities(cb->device), asked, cb->lay.total, 0, 0, epx_namespace_id("pid"),
                               epx_namespace_id("net")};
    if (mine.can & EPX_CUDA_IPC_CAN_FD) mine.gran = granularity(cb, EPX_CUDA_IPC_FD);
    if (mine.can & EPX_CUDA_IPC_CAN_FABRIC) mine.gran_fabric = granularity(cb, EPX_CUDA_IPC_FABRIC);
    epx_cuda_ipc_rec_t *all = calloc((size_t)R, sizeof(*all));
    /* A rank short of memory still takes part, so that its peers learn of it at once. */
    epx_result_t res = epx_comm_agree(
        comm, all ? EPX_SUCCESS : epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: ipc capability table", me),
        "allocate its ipc capability table");
    if (res == EPX_SUCCESS) res = epx_comm_allgather(comm, &mine, all, sizeof(*all));
    int kind = EPX_CUDA_IPC_LEGACY;
    uint64_t bytes = cb->lay.total;
    if (res == EPX_SUCCESS) res = epx_cuda_ipc_plan(me, R, all, drv.missing, &kind, &bytes);
    free(all);
    if (res != EPX_SUCCESS) return res;
    if (kind != EPX_CUDA_IPC_LEGACY) {
        cb->ipc_bytes = bytes;
        cb->ipc_kind = kind;
        int settled = 0;
        res = epx_comm_agree_settled(comm, vmm_alloc(cb, kind), "create its region as virtual memory", &settled);
        if (res == EPX_SUCCESS) return EPX_SUCCESS;
        epx_cuda_ipc_free(cb);
        cb->ipc_kind = 0;
        /* Legacy handles instead only when every rank saw the same failure (a dead or stalled peer is
         * reported as it is, not covered by a second attempt). */
        if (asked != EPX_CUDA_IPC_AUTO || !settled) return res;
        EPX_WARN(EPX_SUBSYS_IPC, "rank %d: the region as virtual memory failed (%s); legacy CUDA IPC instead", me,
                 epx_last_error_message());
    }
    cb->ipc_kind = EPX_CUDA_IPC_LEGACY;
    return epx_comm_agree(comm, legacy_alloc(cb), "allocate its region");
}

epx_result_t epx_cuda_ipc_map_peers(cuda_buffer_t *cb)
{
    epx_comm_t comm = cb->buffer->comm;
    const int me = comm->rank;
    cb->peers[me] = cb->region;
    int settled = 0;
    epx_result_t res = cb->ipc_kind == EPX_CUDA_IPC_LEGACY ? legacy_map_peers(cb)
                                                           : vmm_map_peers(cb, cb->ipc_kind, &settled);
    if (res != EPX_SUCCESS && settled && cb->ipc_kind != EPX_CUDA_IPC_LEGACY && asked_kind() == EPX_CUDA_IPC_AUTO) {
        /* Every rank saw the failure (the step is agreed): all start over with legacy handles. */
        EPX_WARN(EPX_SUBSYS_IPC, "rank %d: mapping the peers' virtual-memory regions failed (%s); legacy CUDA "
                 "IPC instead", me, epx_last_error_message());
        epx_cuda_ipc_unmap_peers(cb);
        epx_cuda_ipc_free(cb);
        cb->ipc_kind = EPX_CUDA_IPC_LEGACY;
        res = epx_comm_agree(comm, legacy_alloc(cb), "allocate its region");
        if (res == EPX_SUCCESS) {
            cb->peers[me] = cb->region;
            res = epx_cuda_check(cudaMemset(cb->region, 0, cb->lay.total), "cudaMemset(region)", me);
            if (res == EPX_SUCCESS) res = epx_cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize", me);
            res = epx_comm_agree(comm, res, "clear its region");
        }
        if (res == EPX_SUCCESS) res = legacy_map_peers(cb);
    }
    if (res != EPX_SUCCESS) {
        epx_cuda_ipc_unmap_peers(cb);
        return res;
    }
    EPX_INFO(EPX_SUBSYS_IPC, "rank %d: mapped %d peer regions of %llu bytes (%s)", me, comm->nranks - 1,
             (unsigned long long)cb->ipc_bytes, epx_cuda_ipc_kind_name(cb->ipc_kind));
    return EPX_SUCCESS;
}

void epx_cuda_ipc_unmap_peers(cuda_buffer_t *cb)
{
    for (int r = 0; r < cb->buffer->comm->nranks; r++) {
        if (!cb->peer_opened[r]) continue;
        if (cb->ipc_kind == EPX_CUDA_IPC_LEGACY)
            (void)cudaIpcCloseMemHandle(cb->peers[r]);
        else
            vmm_unmap(cb, cb->peers[r]);
        cb->peer_opened[r] = 0;
        cb->peers[r] = NULL;
    }
}

void epx_cuda_ipc_free(cuda_buffer_t *cb)
{
    if (cb->ipc_fd >= 0) close(cb->ipc_fd);
    cb->ipc_fd = -1;
    if (!cb->region) return;
    if (cb->ipc_kind == EPX_CUDA_IPC_LEGACY)
        (void)cudaFree(cb->region);
    else
        vmm_unmap(cb, cb->region);
    cb->region = NULL;
}
