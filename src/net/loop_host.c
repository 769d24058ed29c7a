/*
 * The `loop` test transport's host side (src/net/loop_host.h): regions and signal words exported through
 * legacy CUDA IPC handles and mapped by every other rank into the transport's device state. The steps a
 * rank takes alone end in an agreement over the bootstrap, so every rank reaches the same verdict.
 */
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/network.h"
#include "cuda/cuda.h"
#include "net/loop_host.h"

#define LOOP_MEMS (EPX_NET_LOOP_MAX_REGIONS + 1) /* the regions, then the signal words */

struct epx_loop {
    epx_comm_t comm;
    int rank, nranks;
    int64_t timeout_ms;
    int nregions, nmem;
    uint64_t bytes[LOOP_MEMS];
    void *mem[LOOP_MEMS];                            /* ours */
    void *mapped[EPX_NET_LOOP_MAX_RANKS][LOOP_MEMS]; /* peers', opened through IPC (NULL: not opened) */
    uint32_t ncontexts, nsignals;
    int strict;
    unsigned long long *tail;
    epx_net_loop_entry_t *queue;
    epx_net_loop_t *dev;
    int32_t *abort_host, *abort_dev;
    epx_peers_t peers;
};

/* What each rank tells the others: its shape and its exports. */
typedef struct loop_rec {
    int32_t nregions, contexts, nsignals, strict;
    uint64_t bytes[EPX_NET_LOOP_MAX_REGIONS];
    cudaIpcMemHandle_t handle[LOOP_MEMS];
    uint64_t ptr[LOOP_MEMS]; /* for a peer of the same process */
} loop_rec_t;

static epx_result_t check_args(epx_comm_t comm, const epx_loop_open_args_t *args, epx_loop_t **out)
{
    EPX_CHECK(epx_comm_check(comm, "epx_loop_open"));
    const int me = comm->rank;
    if (!args) return epx_error(EPX_ERR_INVALID_ARG, "rank %d: epx_loop_open: args is NULL", me);
    if (!out) return epx_error(EPX_ERR_INVALID_ARG, "rank %d: epx_loop_open: out is NULL", me);
    EPX_CHECK(epx_net_check_shape(me, "epx_loop_open", args->nregions, args->region_bytes,
                                  EPX_NET_LOOP_MAX_REGIONS, args->contexts, EPX_NET_LOOP_MAX_CONTEXTS,
                                  args->nsignals));
    if (comm->backend != EPX_BACKEND_CUDA)
        return epx_error(
            EPX_ERR_UNSUPPORTED,
            "rank %d: the loop transport needs a communicator of the cuda backend, not the %s backend", me,
            epx_backend_name(comm->backend));
    if (comm->nranks > EPX_NET_LOOP_MAX_RANKS)
        return epx_error(EPX_ERR_UNSUPPORTED, "rank %d: the loop transport takes at most %d ranks, not %d",
                         me, EPX_NET_LOOP_MAX_RANKS, comm->nranks);
    for (int r = 0; r < comm->nranks; r++)
        if (comm->peers[r].host_hash != comm->peers[me].host_hash)
            return epx_error(
                EPX_ERR_UNSUPPORTED,
                "rank %d: rank %d is on host %s, not %s: the loop transport joins processes of one "
                "machine only (a test instrument; between machines use the GIN transport)",
                me, r, comm->peers[r].hostname, comm->peers[me].hostname);
    return EPX_SUCCESS;
}

/* What a rank does alone: device, peers' pidfds, abort word, memory zeroed, exports, strict queues. */
static epx_result_t open_local(epx_loop_t *l, loop_rec_t *rec)
{
    const int me = l->rank;
    EPX_CHECK(epx_cuda_check(cudaSetDevice(l->comm->cuda_device), "cudaSetDevice", me));
    EPX_CHECK(epx_peers_open(&l->peers, l->comm));
    EPX_CHECK(epx_cuda_check(cudaHostAlloc((void **)&l->abort_host, sizeof(int32_t), cudaHostAllocMapped),
                             "cudaHostAlloc(abort word)", me));
    *l->abort_host = 0;
    EPX_CHECK(epx_cuda_check(cudaHostGetDevicePointer((void **)&l->abort_dev, l->abort_host, 0),
                             "cudaHostGetDevicePointer(abort word)", me));
    for (; l->nmem < l->nregions + 1; l->nmem++) {
        const int i = l->nmem;
        cudaError_t e = cudaMalloc(&l->mem[i], (size_t)l->bytes[i]);
        if (e != cudaSuccess) {
            l->mem[i] = NULL;
            return epx_error(e == cudaErrorMemoryAllocation ? EPX_ERR_OUT_OF_MEMORY : EPX_ERR_CUDA,
                             "rank %d: cudaMalloc of loop %s %d (%llu bytes): %s", me,
                             i < l->nregions ? "region" : "signal words", i, (unsigned long long)l->bytes[i],
                             cudaGetErrorString(e));
        }
        EPX_CHECK(
            epx_cuda_check(cudaMemset(l->mem[i], 0, (size_t)l->bytes[i]), "cudaMemset(loop region)", me));
        EPX_CHECK(epx_cuda_check(cudaIpcGetMemHandle(&rec->handle[i], l->mem[i]), "cudaIpcGetMemHandle", me));
        rec->ptr[i] = (uint64_t)(uintptr_t)l->mem[i];
    }
    EPX_CHECK(
        epx_cuda_check(cudaMalloc((void **)&l->dev, sizeof(epx_net_loop_t)), "cudaMalloc(loop state)", me));
    if (l->strict) {
        const size_t n = (size_t)l->ncontexts * EPX_NET_LOOP_QUEUE;
        const size_t words = 2 * (size_t)l->ncontexts * sizeof(*l->tail); /* tails, weak operations queued */
        EPX_CHECK(epx_cuda_check(cudaMalloc((void **)&l->tail, words), "cudaMalloc(loop queue tails)", me));
        EPX_CHECK(epx_cuda_check(cudaMemset(l->tail, 0, words), "cudaMemset", me));
        EPX_CHECK(epx_cuda_check(cudaMalloc((void **)&l->queue, n * sizeof(*l->queue)),
                                 "cudaMalloc(loop queues)", me));
        epx_net_loop_entry_t *init = calloc(n, sizeof(*init));
        if (!init) return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: loop queue image", me);
        for (size_t k = 0; k < n; k++)
            init[k].state = 4ull * (k % EPX_NET_LOOP_QUEUE); /* free for ticket k */
        const cudaError_t e = cudaMemcpy(l->queue, init, n * sizeof(*init), cudaMemcpyHostToDevice);
        free(init);
        EPX_CHECK(epx_cuda_check(e, "cudaMemcpy(loop queues)", me));
    }
    return EPX_SUCCESS;
}

/* Maps every peer's exports (a peer of this process: its pointers as they are). */
static epx_result_t open_map(epx_loop_t *l, const loop_rec_t *all)
{
    const int me = l->rank;
    for (int r = 0; r < l->nranks; r++) {
        if (r == me || l->comm->peers[r].pid == l->comm->peers[me].pid) continue; /* ours: as they are */
        for (int i = 0; i < l->nregions + 1; i++) {
            void *p = NULL;
            const cudaError_t e = cudaIpcOpenMemHandle(&p, all[r].handle[i], cudaIpcMemLazyEnablePeerAccess);
            if (e != cudaSuccess)
                return epx_error(EPX_ERR_CUDA, "rank %d: cudaIpcOpenMemHandle of rank %d's loop %s %d: %s",
                                 me, r, i < l->nregions ? "region" : "signal words", i,
                                 cudaGetErrorString(e));
            l->mapped[r][i] = p;
        }
    }
    epx_net_loop_t st;
    memset(&st, 0, sizeof(st));
    st.nregions = (uint32_t)l->nregions;
    st.strict = (uint32_t)l->strict;
    for (int i = 0; i < l->nregions; i++) st.region_bytes[i] = l->bytes[i];
    for (int r = 0; r < l->nranks; r++) {
        for (int i = 0; i < l->nregions + 1; i++) {
            uint8_t *p = r == me           ? l->mem[i]
                         : l->mapped[r][i] ? l->mapped[r][i]
                                           : (uint8_t *)(uintptr_t)all[r].ptr[i];
            if (i < l->nregions)
                st.base[r][i] = p;
            else
                st.signals[r] = (unsigned long long *)p;
        }
    }
    st.tail = l->tail;
    st.queue = l->queue;
    return epx_cuda_check(cudaMemcpy(l->dev, &st, sizeof(st), cudaMemcpyHostToDevice),
                          "cudaMemcpy(loop state)", me);
}

static void loop_free(epx_loop_t *l)
{
    for (int r = 0; r < l->nranks; r++)
        for (int i = 0; i < LOOP_MEMS; i++)
            if (l->mapped[r][i]) cudaIpcCloseMemHandle(l->mapped[r][i]);
    for (int i = 0; i < l->nmem; i++) cudaFree(l->mem[i]);
    cudaFree(l->dev);
    cudaFree(l->tail);
    cudaFree(l->queue);
    if (l->abort_host) cudaFreeHost(l->abort_host);
    epx_peers_close(&l->peers);
    free(l);
}

epx_result_t epx_loop_open(epx_comm_t comm, const epx_loop_open_args_t *args, epx_loop_t **out)
{
    EPX_CHECK(check_args(comm, args, out));
    epx_loop_t *l = calloc(1, sizeof(*l));
    loop_rec_t *all = calloc((size_t)comm->nranks, sizeof(*all));
    if (!l || !all) {
        free(l);
        free(all);
        return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: loop transport state", comm->rank);
    }
    l->comm = comm;
    l->rank = comm->rank;
    l->nranks = comm->nranks;
    l->timeout_ms = args->timeout_ms > 0 ? args->timeout_ms : comm->timeout_ms;
    l->nregions = args->nregions;
    for (int i = 0; i < args->nregions; i++) l->bytes[i] = args->region_bytes[i];
    l->bytes[args->nregions] = (uint64_t)args->nsignals * sizeof(unsigned long long);
    l->ncontexts = (uint32_t)args->contexts;
    l->nsignals = (uint32_t)args->nsignals;
    l->strict = args->strict != 0;

    loop_rec_t mine;
    memset(&mine, 0, sizeof(mine));
    mine.nregions = args->nregions;
    mine.contexts = args->contexts;
    mine.nsignals = args->nsignals;
    mine.strict = l->strict;
    memcpy(mine.bytes, args->region_bytes, sizeof(mine.bytes));
    epx_result_t res = epx_comm_agree(comm, open_local(l, &mine), "its loop transport setup");
    if (res == EPX_SUCCESS) res = epx_comm_allgather(comm, &mine, all, sizeof(mine));
    for (int r = 0; r < l->nranks && res == EPX_SUCCESS; r++) {
        const loop_rec_t *a = &all[r];
        if (a->nregions != mine.nregions || a->contexts != mine.contexts || a->nsignals != mine.nsignals ||
            a->strict != mine.strict || memcmp(a->bytes, mine.bytes, sizeof(mine.bytes)) != 0)
            res = epx_error(
                EPX_ERR_MISMATCH,
                "rank %d: epx_loop_open: rank %d asks for %d regions, %d contexts, %d signals, strict %d "
                "(or other region sizes); this rank %d, %d, %d, %d",
                l->rank, r, a->nregions, a->contexts, a->nsignals, a->strict, mine.nregions, mine.contexts,
                mine.nsignals, mine.strict);
    }
    if (res == EPX_SUCCESS)
        res = epx_comm_agree(comm, open_map(l, all), "mapping the loop transport's peers");
    free(all);
    if (res != EPX_SUCCESS) {
        char message[1024];
        epx_error_copy(message, sizeof(message));
        loop_free(l);
        epx_error_set_message(message);
        return res;
    }
    EPX_INFO(EPX_SUBSYS_INIT,
             "rank %d of %d: loop transport open (%s mode, %u contexts, %u signals, %d regions)", l->rank,
             l->nranks, l->strict ? "strict" : "normal", l->ncontexts, l->nsignals, l->nregions);
    *out = l;
    return EPX_SUCCESS;
}

epx_net_t epx_loop_net(const epx_loop_t *l)
{
    epx_net_t net;
    memset(&net, 0, sizeof(net));
    net.transport = EPX_NET_TRANSPORT_LOOP;
    net.rank = l->rank;
    net.nranks = l->nranks;
    net.ncontexts = l->ncontexts;
    net.nsignals = l->nsignals;
    net.impl = l->dev;
    net.abort_word = l->abort_dev;
    return net;
}

void *epx_loop_region(const epx_loop_t *l, int region)
{
    return region >= 0 && region < l->nregions ? l->mem[region] : NULL;
}

void epx_loop_abort(epx_loop_t *l)
{
    __atomic_store_n(l->abort_host, 1, __ATOMIC_RELEASE);
}

static int dead_peer(const epx_loop_t *l)
{
    for (int r = 0; r < l->nranks; r++)
        if (r != l->rank && epx_peer_exited(&l->peers, r)) return r;
    return -1;
}

epx_result_t epx_loop_poll(epx_loop_t *l)
{
    const int dead = dead_peer(l);
    if (dead < 0) return EPX_SUCCESS;
    epx_loop_abort(l);
    return epx_error(EPX_ERR_REMOTE,
                     "rank %d: the loop transport cannot reach its peers: rank %d (pid %d) has exited",
                     l->rank, dead, (int)l->comm->peers[dead].pid);
}

epx_result_t epx_loop_wait_result(epx_loop_t *l, epx_net_status_t status, const char *what)
{
    if (status == EPX_NET_OK) return EPX_SUCCESS;
    const int dead = dead_peer(l);
    if (dead >= 0)
        return epx_error(EPX_ERR_REMOTE, "rank %d: %s ended with %s: rank %d (pid %d) has exited", l->rank,
                         what, epx_net_status_name(status), dead, (int)l->comm->peers[dead].pid);
    return epx_net_status_error(l->rank, status, what, l->timeout_ms);
}

epx_result_t epx_loop_close(epx_loop_t *l)
{
    if (!l) return EPX_SUCCESS;
    epx_loop_abort(l);
    epx_result_t res = EPX_SUCCESS;
    const int dead = dead_peer(l);
    if (dead >= 0)
        res = epx_error(EPX_ERR_REMOTE,
                        "rank %d: epx_loop_close: rank %d (pid %d) has exited: unmapping at once", l->rank,
                        dead, (int)l->comm->peers[dead].pid);
    else
        res = epx_comm_barrier(l->comm); /* no rank unmaps or frees what another still writes */
    char message[1024];
    epx_error_copy(message, sizeof(message));
    loop_free(l);
    if (res != EPX_SUCCESS) epx_error_set_message(message);
    return res;
}
