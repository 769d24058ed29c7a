/*
 * cuda backend: device selection, the ipc transport (one region per rank and buffer, laid out by
 * mode, exported and mapped by every peer: src/cuda/ipc.c), the error poller, the handle
 * pool and the function table. Operations are in ht.c, ll.c and rm.c, on the runner of op.c.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/network.h"
#include "cuda/cuda.h"

int epx_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

epx_result_t epx_cuda_check(int err, const char *what, int rank)
{
    if (err == cudaSuccess) return EPX_SUCCESS;
    (void)cudaGetLastError();
    epx_result_t res = err == cudaErrorMemoryAllocation ? EPX_ERR_OUT_OF_MEMORY : EPX_ERR_CUDA;
    return epx_error(res, "rank %d: %s failed: %s (%s)", rank, what, cudaGetErrorName((cudaError_t)err),
                     cudaGetErrorString((cudaError_t)err));
}

static epx_result_t cuda_comm_init(epx_comm_t comm)
{
    int dev = comm->peers[comm->rank].cuda_device;
    if (dev < 0) EPX_CHECK(epx_cuda_check(cudaGetDevice(&dev), "cudaGetDevice", comm->rank));
    int count = epx_cuda_device_count();
    if (dev >= count)
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d: cuda_device %d is out of range [0, %d)", comm->rank, dev,
                         count);
    EPX_CHECK(epx_cuda_check(cudaSetDevice(dev), "cudaSetDevice", comm->rank));
    comm->cuda_device = dev;
    return EPX_SUCCESS;
}

void epx_cuda_fill_common(cuda_buffer_t *cb, epx_cuda_common_t *c)
{
    epx_buffer_t b = cb->buffer;
    memset(c, 0, sizeof(*c));
    for (int r = 0; r < b->comm->nranks; r++) c->peers[r] = cb->peers[r];
    c->lay = cb->lay;
    c->host = cb->host_dev;
    c->rank = b->comm->rank;
    c->nranks = b->comm->nranks;
    c->num_local_experts = b->num_local_experts;
    c->num_topk = b->config.num_topk;
    c->hidden = b->config.hidden;
    c->max_tokens = b->config.max_tokens;
    c->timeout_ns = (uint64_t)b->comm->timeout_ms * 1000000ull;
    c->num_blocks = cb->num_blocks;
    c->num_threads = 512;
}

static uint64_t align_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) / a * a;
}

/* Places areas of the given sizes one after another from `off`, each at a 256-byte boundary;
 * returns the end. */
static uint64_t place_areas(uint64_t off, uint64_t *const at[], const uint64_t bytes[], int n)
{
    for (int i = 0; i < n; i++) {
        *at[i] = off;
        off = align_up(off + bytes[i], 256);
    }
    return off;
}

/* Every rank computes the same offsets from the (agreed) buffer config. Each mode reserves the
 * areas its kernels use; an area two modes use comes with either. Unreserved offsets stay 0. */
static void compute_layout(epx_buffer_t b, epx_cuda_layout_t *lay)
{
    const uint64_t R = (uint64_t)b->comm->nranks, T = (uint64_t)b->config.max_tokens;
    const uint64_t H = (uint64_t)b->config.hidden, K = (uint64_t)b->config.num_topk;
    const uint32_t dt = b->config.dispatch_dtypes, modes = b->config.modes;
    uint64_t elem = 1;
    if (dt & EPX_DTYPE_BIT(EPX_DTYPE_BF16)) elem = 2;
    if (dt & EPX_DTYPE_BIT(EPX_DTYPE_FP32)) elem = 4;
    const uint64_t scales = (dt & EPX_DTYPE_BIT(EPX_DTYPE_FP8_E4M3)) ? H / 128 : 0;
    memset(lay, 0, sizeof(*lay));
    lay->x_stride = align_up(H * elem, 16);
    uint64_t off = align_up(sizeof(epx_cuda_ctrl_t), 4096);
    /* R * T_max dispatch rows: x, scales, remapped ids, weights, source token. */
    const uint64_t RT = R * T;
    const uint64_t rows[5] = {RT * lay->x_stride, RT * scales * 4, RT * K * 4, RT * K * 4, RT * 4};
    if (modes & (EPX_MODE_HT | EPX_MODE_PERMUTE)) {
        /* Dispatch rows and combine input: HT, and the routing map (src/cuda/rm.c). */
        uint64_t *const at[] = {&lay->disp_x, &lay->disp_scales, &lay->disp_idx,
                                &lay->disp_w, &lay->disp_src,    &lay->comb_x};
        const uint64_t bytes[] = {rows[0], rows[1], rows[2], rows[3], rows[4], RT * H * 2};
        off = place_areas(off, at, bytes, 6);
    }
    if (modes & EPX_MODE_HT) {
        /* HT only: combine weights, expert counts, and view mode's final layout (src/cuda/ht.c). */
        uint64_t *const at[] = {&lay->comb_w, &lay->expert_scratch, &lay->view_x,  &lay->view_scales,
                                &lay->view_idx, &lay->view_w, &lay->view_src};
        const uint64_t bytes[] = {
            RT * K * 4, (uint64_t)b->num_local_experts * 4, rows[0], rows[1], rows[2], rows[3], rows[4]};
        off = place_areas(off, at, bytes, 7);
        /* The other view areas repeat area 0's five arrays. */
        lay->view_stride = off - lay->view_x;
        off += (uint64_t)(b->config.num_view_areas - 1) * lay->view_stride;
    }
    if (modes & EPX_MODE_LL) { /* src/cuda/ll.c */
        lay->ll = off;
        off = align_up(off + epx_cuda_ll_bytes(b), 256);
    }
    off = epx_cuda_rm_layout(b, lay, off); /* with EPX_MODE_PERMUTE */
    lay->total = off;
}

static const char *call_kind_name(uint32_t sig)
{
    static const char *names[] = {"?",          "an HT dispatch",      "an HT combine", "a routing-map dispatch",
                                  "a routing-map combine", "an LL dispatch", "an LL combine"};
    const uint32_t kind = sig & 15;
    return kind < sizeof(names) / sizeof(names[0]) ? names[kind] : names[0];
}

/* The first field in which this rank's call (`mine`) and rank `peer`'s (`theirs`) differ, from
 * their call words (contract.h), as a message naming both. */
static void describe_mismatch(char *msg, size_t cap, int me, int peer, uint32_t theirs, uint32_t mine,
                              uint64_t epoch)
{
    const int n = snprintf(msg, cap, "rank %d: collective epoch %llu: ", me, (unsigned long long)epoch);
    char *p = msg + (n > 0 ? n : 0);
    const size_t left = cap - (size_t)(n > 0 ? n : 0);
    const uint32_t diff = theirs ^ mine;
    const char *field = NULL;
    if (diff & 15) {
        snprintf(p, left, "this rank makes %s but rank %d makes %s (the ranks' calls are out of step)",
                 call_kind_name(mine), peer, call_kind_name(theirs));
        return;
    }
    if (diff & 0xf0) {
        snprintf(p, left, "ranks disagree on the dtype of %s: this rank passes %s, rank %d passes %s",
                 call_kind_name(mine), epx_dtype_str((epx_dtype_t)(mine >> 4 & 15)), peer,
                 epx_dtype_str((epx_dtype_t)(theirs >> 4 & 15)));
        return;
    }
    if (!(diff & 0xff00u)) {
        snprintf(p, left, "the handles of %s come from different dispatches (low byte of the call number: %u "
                 "here, %u on rank %d)", call_kind_name(mine), mine >> 16 & 0xff, theirs >> 16 & 0xff, peer);
        return;
    }
    if (diff & EPX_CUDA_SIG_CACHED) field = "args.cached_handle";
    else if (diff & EPX_CUDA_SIG_VIEW) field = (mine & 15) == EPX_CUDA_CALL_HT_COMBINE ? "args.x_in_buffer"
                                                                                       : "args.recv_in_buffer";
    else if (diff & EPX_CUDA_SIG_PERMUTE) field = "args.permute";
    else field = "the presence of args.probs";
    const uint32_t bit = diff & 0xff00u & (0u - (diff & 0xff00u)); /* the lowest differing flag */
    snprintf(p, left, "ranks disagree on %s of %s: this rank %s, rank %d %s", field, call_kind_name(mine),
             (mine & bit) ? "sets it" : "does not", peer, (theirs & bit) ? "sets it" : "does not");
}

/* Reports a device error record of an epoch not reported yet to the comm (async error). */
epx_result_t epx_cuda_report_record(cuda_buffer_t *cb, uint64_t min_epoch, int set_thread_error)
{
    volatile epx_cuda_host_block_t *hb = cb->host;
    epx_comm_t comm = cb->buffer->comm;
    int code = hb->err.code;
    uint64_t epoch = hb->err.epoch;
    if (code == 0 || epoch < min_epoch) return EPX_SUCCESS;
    static const char *what_names[] = {"?", "release of its dispatch area", "dispatch rows", "release of its combine area",
                                       "combine rows", "expert id", "capacity", "call",
                                       "acceptance of its row count (its outputs are too small)", "routing map"};
    const int nwhat = (int)(sizeof(what_names) / sizeof(what_names[0]));
    int what = hb->err.what >= 0 && hb->err.what < nwhat ? hb->err.what : 0;
    char msg[512];
    const int64_t where = (int64_t)hb->err.expected - 1;
    if (code == EPX_ERR_INVALID_ARG && what == EPX_CUDA_WAIT_BAD_EXPERT)
        snprintf(msg, sizeof(msg), "rank %d: topk_idx[%lld][%lld] = %lld is out of range [-1, %d) or repeated in "
                 "its row; this rank's outputs of collective epoch %llu are poisoned (counts -1, rows NaN)",
                 hb->err.rank, (long long)(where / EPX_MAX_TOPK), (long long)(where % EPX_MAX_TOPK),
                 (long long)hb->err.seen, cb->buffer->config.num_experts, (unsigned long long)epoch);
    else if (code == EPX_ERR_INVALID_ARG && what == EPX_CUDA_WAIT_BAD_MAP)
        snprintf(msg, sizeof(msg), "rank %d: routing_map[%lld] has more than K = %d true entries (column %lld is "
                 "past them); this rank's outputs of collective epoch %llu are poisoned (counts -1, rows NaN)",
                 hb->err.rank, (long long)where, cb->buffer->config.num_topk, (long long)hb->err.seen,
                 (unsigned long long)epoch);
    else if (code == EPX_ERR_MISMATCH)
        describe_mismatch(msg, sizeof(msg), hb->err.rank, hb->err.peer, (uint32_t)hb->err.seen,
                          (uint32_t)hb->err.expected, epoch);
    else if (code == EPX_ERR_REMOTE && hb->err.peer >= 0 && hb->err.peer < comm->nranks &&
             (atomic_load(&cb->dead_mask) >> hb->err.peer & 1))
        snprintf(msg, sizeof(msg), "rank %d: peer %d (pid %d) exited; collective epoch %llu failed while this rank "
                 "waited for its %s (channel %d)", hb->err.rank, hb->err.peer, (int)cb->procs.pid[hb->err.peer],
                 (unsigned long long)epoch, what_names[what], hb->err.channel);
    else if (code == EPX_ERR_REMOTE)
        snprintf(msg, sizeof(msg), "rank %d: peer %d failed collective epoch %llu while this rank waited for its %s "
                 "(channel %d)", hb->err.rank, hb->err.peer, (unsigned long long)epoch, what_names[what],
                 hb->err.channel);
    else
        snprintf(msg, sizeof(msg), "rank %d: peer %d did not publish %s within %lld ms (channel %d, epoch %llu, "
                 "seen %llu, expected %llu)", hb->err.rank, hb->err.peer, what_names[what],
                 (long long)comm->timeout_ms, hb->err.channel, (unsigned long long)epoch,
                 (unsigned long long)hb->err.seen, (unsigned long long)hb->err.expected);
    if (hb->err.expert >= 0) {
        size_t used = strlen(msg);
        snprintf(msg + used, sizeof(msg) - used, " serving expert %d", hb->err.expert);
    }
    pthread_mutex_lock(&cb->lock);
    int fresh = epoch > cb->reported_epoch;
    if (fresh) cb->reported_epoch = epoch;
    pthread_mutex_unlock(&cb->lock);
    if (fresh) epx_comm_set_async_error(comm, (epx_result_t)code, msg);
    if (set_thread_error) return epx_error((epx_result_t)code, "%s", msg);
    return (epx_result_t)code;
}

/* The process's live buffers, for epx_get_async_error (cuda_poll_async): a caller who synchronised
 * must see a device record at once, not at the poller's next turn. */
static pthread_mutex_t live_lock_g = PTHREAD_MUTEX_INITIALIZER;
static cuda_buffer_t *live_g;

static void live_add(cuda_buffer_t *cb)
{
    pthread_mutex_lock(&live_lock_g);
    cb->next_live = live_g;
    live_g = cb;
    pthread_mutex_unlock(&live_lock_g);
}

static void live_remove(cuda_buffer_t *cb)
{
    pthread_mutex_lock(&live_lock_g);
    for (cuda_buffer_t **p = &live_g; *p; p = &(*p)->next_live)
        if (*p == cb) {
            *p = cb->next_live;
            break;
        }
    pthread_mutex_unlock(&live_lock_g);
}

static void cuda_poll_async(epx_comm_t comm)
{
    pthread_mutex_lock(&live_lock_g);
    for (cuda_buffer_t *cb = live_g; cb; cb = cb->next_live) {
        if (cb->buffer->comm != comm) continue;
        (void)epx_cuda_report_record(cb, cb->reported_epoch + 1, 0);
        char msg[256];
        if (epx_cuda_bad_topk(cb, msg, sizeof(msg), 0)) epx_comm_set_async_error(comm, EPX_ERR_INVALID_ARG, msg);
    }
    pthread_mutex_unlock(&live_lock_g);
}

/* SMs per rank for kernels that wait on each other; with `cap` 0, the most that keeps every
 * sharing rank's blocks co-resident. */
static epx_result_t default_num_sms(epx_buffer_t b, int *out, int cap)
{
    epx_comm_t comm = b->comm;
    int sms = 0;
    EPX_CHECK(epx_cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, comm->cuda_device),
                             "cudaDeviceGetAttribute", comm->rank));
    int sharing = 0;
    for (int r = 0; r < comm->nranks; r++)
        if (comm->peers[r].host_hash == comm->peers[comm->rank].host_hash &&
            !memcmp(comm->peers[r].cuda_uuid, comm->peers[comm->rank].cuda_uuid, 16))
            sharing++;
    if (sharing < 1) sharing = 1;
    /* Kernels of ranks that wait on each other must be co-resident: split the SMs (8 ranks on a
     * 132-SM H200 get 16 each); ranks with a GPU each take 24. */
    int n = sms / sharing;
    if (cap > 0) {
        /* An explicit num_sms above the share would let waiting blocks of one rank keep another
         * rank's blocks off the GPU until the timeout. */
        if (cap > n && n >= 1)
            EPX_INFO(EPX_SUBSYS_IPC, "rank %d: num_sms %d lowered to %d (%d SMs shared by %d ranks)",
                     comm->rank, cap, n, sms, sharing);
        else
            n = cap;
    } else if (n > 24) {
        n = 24;
    }
    if (n < 1) n = 1;
    *out = n;
    return EPX_SUCCESS;
}

static epx_result_t cuda_buffer_create(epx_buffer_t buffer)
{
    epx_comm_t comm = buffer->comm;
    const int R = comm->nranks, me = comm->rank;
    epx_result_t res = EPX_SUCCESS;
    if (R > EPX_CUDA_MAX_RANKS)
        return epx_error(EPX_ERR_UNSUPPORTED, "rank %d: the cuda backend supports at most %d ranks, not %d", me,
                         EPX_CUDA_MAX_RANKS, R);
    /* Across nodes only LL runs: its kernels reach every rank through the network transport
     * (src/kernels/ll_net.cu); HT and the routing map have no kernels across nodes yet. */
    const int across = comm->num_nodes > 1;
    if (across && buffer->config.modes != EPX_MODE_LL) {
        char why[192];
        return epx_error(
            EPX_ERR_UNSUPPORTED,
            "rank %d: the ranks span %d nodes (node 0 '%s', node 1 '%s', %d ranks each); the cuda "
            "backend runs only EPX_MODE_LL across nodes (HT and routing-map kernels across nodes do not "
            "exist yet); GIN: %s",
            me, comm->num_nodes, comm->peers[0].node_id, comm->peers[comm->ranks_per_node].node_id,
            comm->ranks_per_node, epx_net_gin_unavailable(why, sizeof(why)));
    }
    /* Fabric handles reach every GPU of a multi-node NVLink domain; other exports only this host's. */
    for (int r = 0; r < R && !across && !epx_cuda_ipc_asks_fabric(); r++)
        if (comm->peers[r].host_hash != comm->peers[me].host_hash)
            return epx_error(EPX_ERR_UNSUPPORTED, "rank %d: rank %d is on host %s, not %s; the cuda backend needs "
                             "every rank in one nvlink domain on one machine", me, r, comm->peers[r].hostname,
                             comm->peers[me].hostname);
    EPX_CHECK(epx_cuda_check(cudaSetDevice(comm->cuda_device), "cudaSetDevice", me));
    cuda_buffer_t *cb = calloc(1, sizeof(*cb));
    if (!cb) return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: cuda buffer state", me);
    cb->buffer = buffer;
    cb->device = comm->cuda_device;
    pthread_mutex_init(&cb->lock, NULL);
    atomic_init(&cb->poller_stop, 0);
    compute_layout(buffer, &cb->lay);

    /* Record the GPU uuid so ranks can tell who shares a GPU (num_sms default). */
    struct cudaDeviceProp prop;
    EPX_CHECK_GOTO(epx_cuda_check(cudaGetDeviceProperties(&prop, cb->device), "cudaGetDeviceProperties", me), res,
                   err_free_state);
    memcpy(comm->peers[me].cuda_uuid, prop.uuid.bytes, 16);
    {
        char(*uuids)[16] = calloc((size_t)R, 16);
        if (!uuids) {
            res = epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: uuid table", me);
            goto err_free_state;
        }
        res = epx_comm_allgather(comm, prop.uuid.bytes, uuids, 16);
        if (res == EPX_SUCCESS)
            for (int r = 0; r < R; r++) memcpy(comm->peers[r].cuda_uuid, uuids[r], 16);
        free(uuids);
        if (res != EPX_SUCCESS) goto err_free_state;
    }
    int num_sms = 0;
    const int asked = buffer->config.num_sms > 0 ? buffer->config.num_sms : 0;
    EPX_CHECK_GOTO(default_num_sms(buffer, &num_sms, asked), res, err_free_state);
    cb->num_blocks = num_sms;

    if (across) { /* nothing of the region is shared: the transport carries what peers see */
        cb->ipc_fd = -1;
        cb->ipc_kind = EPX_CUDA_IPC_LEGACY;
        EPX_CHECK_GOTO(epx_comm_agree(comm,
                                      epx_cuda_check(cudaMalloc((void **)&cb->region, cb->lay.total),
                                                     "cudaMalloc(region)", me),
                                      "allocate its region"),
                       res, err_free_region);
    } else {
        EPX_CHECK_GOTO(epx_cuda_ipc_alloc(cb), res, err_free_region);
    }
    EPX_CHECK_GOTO(epx_cuda_check(cudaMemset(cb->region, 0, cb->lay.total), "cudaMemset(region)", me), res,
                   err_free_region);
    /* The block, then the per-expert counts of a default-mode dispatch (EPX_CUDA_HOST_COUNTS). */
    const size_t host_bytes = sizeof(*cb->host) + (size_t)buffer->num_local_experts * sizeof(int32_t);
    EPX_CHECK_GOTO(epx_cuda_check(cudaHostAlloc((void **)&cb->host, host_bytes, cudaHostAllocMapped),
                                  "cudaHostAlloc(mapped block)", me), res, err_free_region);
    memset(cb->host, 0, host_bytes);
    EPX_CHECK_GOTO(epx_cuda_check(cudaHostGetDevicePointer((void **)&cb->host_dev, cb->host, 0),
                                  "cudaHostGetDevicePointer", me), res, err_free_host);
    cudaEvent_t ev;
    EPX_CHECK_GOTO(epx_cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate", me),
                   res, err_free_host);
    cb->event = ev;
    cudaStream_t st;
    EPX_CHECK_GOTO(epx_cuda_check(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate", me),
                   res, err_destroy_event);
    cb->internal_stream = st;
    EPX_CHECK_GOTO(epx_cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize", me), res, err_destroy_stream);

    /* Every peer's region mapped here (the sizes were agreed with the kind of export); across nodes
     * only our own. */
    if (across)
        cb->peers[me] = cb->region;
    else
        EPX_CHECK_GOTO(epx_cuda_ipc_map_peers(cb), res, err_destroy_stream);
    /* Nobody writes into a peer's region before every rank has mapped every region. */
    EPX_CHECK_GOTO(epx_comm_barrier(comm), res, err_close_peers);

    /* LL state first (across nodes it opens the transport, which the watcher then polls). */
    if (buffer->config.modes & EPX_MODE_LL) EPX_CHECK_GOTO(epx_cuda_ll_init(cb), res, err_close_peers);
    res = epx_cuda_watch_start(cb);
    if (res != EPX_SUCCESS) {
        epx_cuda_ll_fini(cb);
        goto err_close_peers;
    }
    buffer->backend_state = cb;
    live_add(cb);
    EPX_INFO(EPX_SUBSYS_IPC, "rank %d: cuda buffer of %llu bytes, %d blocks per kernel", me,
             (unsigned long long)cb->lay.total, cb->num_blocks);
    return EPX_SUCCESS;

err_close_peers:
    epx_cuda_ipc_unmap_peers(cb);
err_destroy_stream:
    (void)cudaStreamDestroy((cudaStream_t)cb->internal_stream);
err_destroy_event:
    (void)cudaEventDestroy((cudaEvent_t)cb->event);
err_free_host:
    (void)cudaFreeHost(cb->host);
err_free_region:
    epx_cuda_ipc_free(cb);
err_free_state:
    pthread_mutex_destroy(&cb->lock);
    free(cb);
    return res;
}

/* ---- handle pool: device slabs of HT and routing-map handles, one free list per kind ---- */

static int pool_of(epx_handle_kind_t kind)
{
    return kind == EPX_HANDLE_RM;
}

typedef struct slab_cursor {
    uint8_t *base; /* NULL: only measure */
    uint64_t off;
} slab_cursor_t;

static void *carve(slab_cursor_t *c, uint64_t bytes)
{
    void *p = c->base ? c->base + c->off : NULL;
    c->off += align_up(bytes, 256);
    return p;
}

/* Places the arrays of a `kind` slab at `base` into h->dev, each at a 256-byte boundary; returns
 * the slab's bytes. */
static uint64_t slab_layout(epx_buffer_t b, epx_handle_kind_t kind, uint8_t *base, cuda_handle_t *h)
{
    const uint64_t R = (uint64_t)b->comm->nranks, T = (uint64_t)b->config.max_tokens;
    const uint64_t K = (uint64_t)b->config.num_topk;
    slab_cursor_t c = {base, 0};
    if (kind == EPX_HANDLE_RM) {
        epx_cuda_rm_handle_dev_t *d = &h->dev.rm;
        d->send_row = carve(&c, T * R * 4);
        d->src_sel = carve(&c, T * K * 4);
        d->src_within = carve(&c, T * K * 4);
        d->src_prob = carve(&c, T * K * 4);
        d->recv_src = carve(&c, R * T * 4);
        d->perm_row = carve(&c, R * T * K * 4);
        d->recv_prefix = carve(&c, (R + 1) * 4);
        d->local_row = carve(&c, T * 4);
        d->meta = carve(&c, 2 * 4);
        d->bad = carve(&c, 2 * 8);
    } else {
        epx_cuda_handle_dev_t *d = &h->dev.ht;
        d->send_row = carve(&c, T * R * 4);
        d->send_count = carve(&c, R * 4);
        d->recv_src = carve(&c, R * T * 4);
        d->recv_prefix = carve(&c, (R + 1) * 4);
        d->rows_valid = carve(&c, 4);
        d->bad = carve(&c, 2 * 8);
    }
    return c.off;
}

/* A new handle of `kind` with its device slab. */
static epx_result_t handle_new(cuda_buffer_t *cb, epx_handle_kind_t kind, cuda_handle_t **out)
{
    epx_buffer_t b = cb->buffer;
    const int rm = kind == EPX_HANDLE_RM;
    cuda_handle_t *h = calloc(1, sizeof(*h));
    if (!h) return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: %shandle state", b->comm->rank, rm ? "routing-map " : "");
    /* A static or bounded dispatch may be captured into a graph: cudaMalloc is refused (and the
     * capture invalidated) in the capturing thread unless its capture mode is relaxed. The slab
     * lives with the handle, outside the graph. */
    enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    epx_result_t res = epx_cuda_check(cudaMalloc(&h->slab, slab_layout(b, kind, NULL, h)),
                                      rm ? "cudaMalloc(routing-map handle)" : "cudaMalloc(handle)", b->comm->rank);
    if (res == EPX_SUCCESS) {
        h->kind = kind;
        (void)slab_layout(b, kind, h->slab, h);
        /* The bad word starts clear (the receive kernel clears it after each use); on the
         * internal stream, which no capture or blocking stream waits on. */
        void *bad = rm ? (void *)h->dev.rm.bad : (void *)h->dev.ht.bad;
        res = epx_cuda_check(cudaMemsetAsync(bad, 0, 16, (cudaStream_t)cb->internal_stream),
                             "cudaMemsetAsync(handle)", b->comm->rank);
        if (res == EPX_SUCCESS)
            res = epx_cuda_check(cudaStreamSynchronize((cudaStream_t)cb->internal_stream),
                                 "cudaStreamSynchronize(handle)", b->comm->rank);
        if (res != EPX_SUCCESS) (void)cudaFree(h->slab);
    }
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    if (res != EPX_SUCCESS) {
        free(h);
        return res;
    }
    *out = h;
    return EPX_SUCCESS;
}

/* Most retired handles before a free waits for the buffer's last operation. */
#define MAX_RETIRED 8

/* Retired handles rejoin the pool once the buffer's last operation completed (kernels that read a
 * retired slab were queued before it; work on several streams is ordered by the caller, as for any
 * buffer memory). `wait`: waits for it (bounded by device deadlines), else only looks. */
static void recycle_retired(cuda_buffer_t *cb, int wait)
{
    enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    (void)cudaThreadExchangeStreamCaptureMode(&mode); /* legal while the caller captures */
    cudaEvent_t last = (cudaEvent_t)cb->event;
    const cudaError_t e = wait ? cudaEventSynchronize(last) : cudaEventQuery(last);
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    if (e != cudaSuccess) {
        if (e != cudaErrorNotReady) (void)cudaGetLastError();
        if (!wait) return;
    }
    pthread_mutex_lock(&cb->lock);
    for (int p = 0; p < 2; p++)
        while (cb->retired[p]) {
            cuda_handle_t *h = cb->retired[p];
            cb->retired[p] = h->next_free;
            h->next_free = cb->free_handles[p];
            cb->free_handles[p] = h;
        }
    cb->num_retired = 0;
    pthread_mutex_unlock(&cb->lock);
}

epx_result_t epx_cuda_handle_get(cuda_buffer_t *cb, epx_handle_kind_t kind, int capturing, cuda_handle_t **out)
{
    cuda_handle_t **pool = &cb->free_handles[pool_of(kind)];
    if (!*pool && cb->num_retired) recycle_retired(cb, 0);
    pthread_mutex_lock(&cb->lock);
    cuda_handle_t *h = *pool;
    if (h) *pool = h->next_free;
    const int empty = *pool == NULL;
    pthread_mutex_unlock(&cb->lock);
    if (!h) EPX_CHECK(handle_new(cb, kind, &h));
    /* Outside capture, keep one spare in the pool, so that a captured dispatch while earlier
     * handles are alive (a warm-up's, typically) takes it instead of allocating inside a capture
     * that forbids it (strict capture modes of other threads). No spare is no error. */
    cuda_handle_t *spare;
    if (empty && !capturing && handle_new(cb, kind, &spare) == EPX_SUCCESS) {
        pthread_mutex_lock(&cb->lock);
        spare->next_free = *pool;
        *pool = spare;
        pthread_mutex_unlock(&cb->lock);
    }
    epx_error_clear();
    h->next_free = NULL;
    *out = h;
    return EPX_SUCCESS;
}

static void cuda_handle_free(epx_handle_t handle)
{
    cuda_handle_t *h = handle->backend_state;
    cuda_buffer_t *cb = handle->buffer->backend_state;
    if (!h || !cb) return;
    /* Kernels may still read the slab: no host wait here (a freed handle must not stall the
     * caller's pipeline); it is retired and reused once the buffer's last operation completed. */
    pthread_mutex_lock(&cb->lock);
    h->next_free = cb->retired[pool_of(h->kind)];
    cb->retired[pool_of(h->kind)] = h;
    const int many = ++cb->num_retired > MAX_RETIRED;
    pthread_mutex_unlock(&cb->lock);
    if (many) recycle_retired(cb, 1);
    handle->backend_state = NULL;
}

static void handle_pool_fini(cuda_buffer_t *cb)
{
    recycle_retired(cb, 1);
    for (int p = 0; p < 2; p++)
        while (cb->free_handles[p]) {
            cuda_handle_t *h = cb->free_handles[p];
            cb->free_handles[p] = h->next_free;
            (void)cudaFree(h->slab);
            free(h);
        }
}

/* Waits (bounded by the comm's timeout) for the work queued so far on the internal stream. */
static void internal_stream_wait(cuda_buffer_t *cb)
{
    cudaEvent_t done;
    if (cudaEventCreateWithFlags(&done, cudaEventDisableTiming) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    if (cudaEventRecord(done, (cudaStream_t)cb->internal_stream) == cudaSuccess) {
        const uint64_t deadline = epx_deadline_after_ms(cb->buffer->comm->timeout_ms);
        while (cudaEventQuery(done) == cudaErrorNotReady && epx_time_ns() < deadline) {
            struct timespec ts = {0, 50000};
            nanosleep(&ts, NULL);
        }
    }
    (void)cudaGetLastError();
    (void)cudaEventDestroy(done);
}

/* Tells every peer that this rank is gone: its fail word for us becomes the largest epoch, so each
 * of its waits on us, now or later, ends with EPX_ERR_REMOTE. Copies on the internal stream (copy
 * engines: no SM is needed while our own kernels may still hold them), bounded by the timeout. A
 * peer that told us it is gone (its word in our ctrl) may have freed its region: skipped. */
static void tell_peers_gone(cuda_buffer_t *cb)
{
    epx_comm_t comm = cb->buffer->comm;
    volatile epx_cuda_host_block_t *hb = cb->host;
    uint64_t told[EPX_CUDA_MAX_RANKS];
    memset(told, 0, sizeof(told));
    hb->gone = ~0ull;
    cudaStream_t st = (cudaStream_t)cb->internal_stream;
    if (cudaMemcpyAsync(told, ((epx_cuda_ctrl_t *)cb->region)->fail, sizeof(uint64_t) * (size_t)comm->nranks,
                        cudaMemcpyDeviceToHost, st) != cudaSuccess)
        (void)cudaGetLastError();
    internal_stream_wait(cb);
    for (int r = 0; r < comm->nranks; r++) {
        if (r == comm->rank || told[r] == ~0ull || !cb->peers[r]) continue; /* across nodes: none mapped */
        uint64_t *word = &((epx_cuda_ctrl_t *)cb->peers[r])->fail[comm->rank];
        if (cudaMemcpyAsync(word, (const void *)&cb->host->gone, sizeof(*word), cudaMemcpyDefault, st) !=
            cudaSuccess)
            (void)cudaGetLastError();
    }
    internal_stream_wait(cb);
}

static void cuda_buffer_destroy(epx_buffer_t buffer)
{
    cuda_buffer_t *cb = buffer->backend_state;
    if (!cb) return;
    live_remove(cb);
    (void)cudaSetDevice(cb->device);
    /* Every device wait polls the abort flag, so this synchronisation cannot hang on a peer; the
     * peers' waits on us end through their fail words. */
    ((volatile epx_cuda_host_block_t *)cb->host)->abort_flag = 1;
    tell_peers_gone(cb);
    (void)cudaDeviceSynchronize();
    epx_cuda_watch_stop(cb);
    epx_cuda_ll_fini(cb);
    handle_pool_fini(cb);
    epx_cuda_ipc_unmap_peers(cb);
    (void)cudaStreamDestroy((cudaStream_t)cb->internal_stream);
    (void)cudaEventDestroy((cudaEvent_t)cb->event);
    (void)cudaFreeHost(cb->host);
    epx_cuda_ipc_free(cb);
    pthread_mutex_destroy(&cb->lock);
    free(cb);
    buffer->backend_state = NULL;
}

/* The API layer refused a collective call: tell the peers without breaking a capture of the
 * call's stream (see epx_cuda_tell_peers). */
static void cuda_fail_collective(epx_buffer_t buffer, uint64_t seq, epx_result_t res, void *stream)
{
    cuda_buffer_t *cb = buffer->backend_state;
    if (cb) epx_cuda_tell_peers(cb, seq, res, epx_cuda_stream_capturing(stream, 1));
}

static epx_result_t cuda_query_overflow(epx_buffer_t buffer, int *overflowed_out)
{
    cuda_buffer_t *cb = buffer->backend_state;
    EPX_CHECK(epx_cuda_wait_event(cb, "epx_buffer_query_overflow"));
    volatile epx_cuda_host_block_t *hb = cb->host;
    *overflowed_out = hb->overflow != 0;
    hb->overflow = 0;
    return EPX_SUCCESS;
}

const epx_backend_ops_t epx_cuda_backend_ops = {
    .name = "cuda",
    .comm_init = cuda_comm_init,
    .buffer_create = cuda_buffer_create,
    .buffer_destroy = cuda_buffer_destroy,
    .handle_free = cuda_handle_free,
    .fail_collective = cuda_fail_collective,
    .poll_async = cuda_poll_async,
    .layout = epx_cuda_layout,
    .ht_dispatch = epx_cuda_ht_dispatch,
    .ht_combine = epx_cuda_ht_combine,
    .rm_dispatch = epx_cuda_rm_dispatch,
    .rm_combine = epx_cuda_rm_combine,
    .query_overflow = cuda_query_overflow,
    .ll_dispatch = epx_cuda_ll_dispatch,
    .ll_combine = epx_cuda_ll_combine,
    .ll_get_combine_buffer = epx_cuda_ll_get_combine_buffer,
    .hook_run = epx_cuda_hook_run,
    .ht_get_combine_input = epx_cuda_ht_get_combine_input,
};
