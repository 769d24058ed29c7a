/*
 * The test GIN plugin's CUDA mover (mover_cuda.h): region export / import, puts as peer copies on a
 * plugin stream, and signal adds applied by the owner of the signal word from its mailbox.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "mover_cuda.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gin_v11.h"

enum { MAP_NONE = 0, MAP_LEGACY = 1, MAP_VMM = 2 };
#define SERVE_BATCH 64

struct cuda_region {
    ginq_region_t core; /* core.mover_data == this */
    uint64_t serial;
    int type, kind;
    char *local;
    char **peer;        /* nranks: the peer's region mapped here, NULL when unmapped; [rank] = local */
    size_t *peer_size;  /* nranks */
    void **legacy_base; /* nranks: what cudaIpcOpenMemHandle gave */
    CUdeviceptr *vmm_va;
    size_t *vmm_len;
    CUmemGenericAllocationHandle *vmm_handle;
    struct cuda_region *next;
};

typedef struct xfer {
    int used, is_signal, peer;
    uint64_t ticket;
    cudaEvent_t event;
} xfer_t;

typedef struct serve_req {
    int sender;
    uint64_t ticket;
    uint64_t *word; /* NULL: refused, publish only */
    uint64_t value;
    int word_index;
} serve_req_t;

struct cuda_mover {
    link_t *link;
    int rank, nranks, device, nxfers;
    cudaStream_t stream;
    xfer_t *xfers;
    pthread_mutex_t mutex; /* regions and serve state */
    cuda_region_t *regions;
    uint64_t next_serial;
    /* serve: 0 idle, 1 reading the words, 2 writing them back */
    int phase, nreq, nwords;
    serve_req_t req[SERVE_BATCH];
    uint64_t *words[SERVE_BATCH];
    uint64_t *staging; /* pinned, SERVE_BATCH words */
    cudaEvent_t serve_event;
    char broken[160]; /* set once applying failed: every later add is refused with this reason */
};

static int cuda_fail(cudaError_t e, const char *what, char *err, size_t len)
{
    if (e == cudaSuccess) return 0;
    snprintf(err, len, "%s: %s", what, cudaGetErrorString(e));
    return -1;
}

static int cu_fail(CUresult e, const char *what, char *err, size_t len)
{
    if (e == CUDA_SUCCESS) return 0;
    const char *s = NULL;
    cuGetErrorString(e, &s);
    snprintf(err, len, "%s: %s", what, s ? s : "unknown driver error");
    return -1;
}

/* ---- lifetime ----------------------------------------------------------------------------------- */

int cuda_mover_create(link_t *link, int capacity, cuda_mover_t **out, char *err, size_t err_len)
{
    cuda_mover_t *m = calloc(1, sizeof(*m));
    if (!m) goto oom;
    m->link = link;
    m->rank = link->rank;
    m->nranks = link->nranks;
    m->nxfers = 2 * capacity; /* a put and a signal per request at most */
    m->xfers = calloc((size_t)m->nxfers, sizeof(*m->xfers));
    if (!m->xfers || pthread_mutex_init(&m->mutex, NULL)) goto oom;
    if (cuda_fail(cudaGetDevice(&m->device), "cudaGetDevice", err, err_len) ||
        cuda_fail(cudaStreamCreateWithFlags(&m->stream, cudaStreamNonBlocking), "cudaStreamCreate", err,
                  err_len) ||
        cuda_fail(cudaEventCreateWithFlags(&m->serve_event, cudaEventDisableTiming), "cudaEventCreate", err,
                  err_len) ||
        cuda_fail(cudaHostAlloc((void **)&m->staging, SERVE_BATCH * sizeof(uint64_t), cudaHostAllocDefault),
                  "cudaHostAlloc (signal staging)", err, err_len)) {
        cuda_mover_destroy(m);
        return -1;
    }
    *out = m;
    return 0;
oom:
    if (m) {
        free(m->xfers);
        free(m);
    }
    snprintf(err, err_len, "cuda mover: out of memory");
    return -1;
}

void cuda_mover_destroy(cuda_mover_t *m)
{
    if (!m) return;
    cudaSetDevice(m->device);
    /* Wait for this mover's own copies, at most 2 s: past that, leak the stream and its buffers
     * rather than block (a copy may still target them). */
    int quiet = !m->stream;
    for (uint64_t end = link_now_ms() + 2000; !quiet && link_now_ms() < end; usleep(100))
        quiet = cudaStreamQuery(m->stream) != cudaErrorNotReady;
    if (!quiet) {
        fprintf(stderr, "EPX_GIN_TEST: rank %d: copies still running 2 s into teardown; leaking the mover\n",
                m->rank);
        return;
    }
    while (m->regions) cuda_mover_deregister(m, m->regions);
    for (int i = 0; i < m->nxfers; i++)
        if (m->xfers[i].event) cudaEventDestroy(m->xfers[i].event);
    if (m->serve_event) cudaEventDestroy(m->serve_event);
    if (m->staging) cudaFreeHost(m->staging);
    if (m->stream) cudaStreamDestroy(m->stream);
    pthread_mutex_destroy(&m->mutex);
    free(m->xfers);
    free(m);
}

/* ---- registration ------------------------------------------------------------------------------- */

ginq_region_t *cuda_region_core(cuda_region_t *r)
{
    return &r->core;
}

/* How this rank's region can be opened by its peers: the message to send and, for VMM, an fd. */
static int export_region(cuda_region_t *r, link_msg_t *msg, int *fd, char *err, size_t len)
{
    *fd = -1;
    msg->kind = MAP_NONE;
    if (r->type != GIN11_PTR_CUDA) return 0; /* host memory: a local source only */
    CUdeviceptr base = 0;
    size_t alloc_len = 0;
    if (cu_fail(cuMemGetAddressRange(&base, &alloc_len, (CUdeviceptr)r->local), "cuMemGetAddressRange", err,
                len))
        return -1;
    if ((CUdeviceptr)r->local + r->core.size > base + alloc_len) {
        snprintf(err, len, "region %p + %zu spans more than one allocation (%p + %zu)", (void *)r->local,
                 r->core.size, (void *)base, alloc_len);
        return -1;
    }
    msg->words[0] = alloc_len;
    msg->words[1] = (uint64_t)((CUdeviceptr)r->local - base);
    unsigned long long allowed = 0;
    int legacy = 0;
    if (cuPointerGetAttribute(&allowed, CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, (CUdeviceptr)r->local) ==
            CUDA_SUCCESS &&
        (allowed & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
        CUmemGenericAllocationHandle h;
        if (cu_fail(cuMemRetainAllocationHandle(&h, r->local), "cuMemRetainAllocationHandle", err, len))
            return -1;
        CUresult e = cuMemExportToShareableHandle(fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        cuMemRelease(h);
        if (cu_fail(e, "cuMemExportToShareableHandle (POSIX fd)", err, len)) return -1;
        msg->kind = MAP_VMM;
    } else if (cuPointerGetAttribute(&legacy, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                                     (CUdeviceptr)r->local) == CUDA_SUCCESS &&
               legacy) {
        cudaIpcMemHandle_t h;
        if (cuda_fail(cudaIpcGetMemHandle(&h, (void *)base), "cudaIpcGetMemHandle", err, len)) return -1;
        memcpy(msg->blob, &h, sizeof(h));
        msg->kind = MAP_LEGACY;
    }
    /* Neither (e.g. VMM memory allocated without a shareable handle type, like NCCL's signal buffer):
     * peers cannot map it; it can still be a signal target (the owner applies adds) or a local source. */
    return 0;
}

static int import_region(cuda_mover_t *m, cuda_region_t *r, int peer, const link_msg_t *msg, int fd,
                         char *err, size_t len)
{
    r->peer_size[peer] = msg->words[2];
    if (msg->kind == MAP_LEGACY) {
        cudaIpcMemHandle_t h;
        memcpy(&h, msg->blob, sizeof(h));
        if (cuda_fail(cudaIpcOpenMemHandle(&r->legacy_base[peer], h, cudaIpcMemLazyEnablePeerAccess),
                      "cudaIpcOpenMemHandle", err, len))
            return -1;
        r->peer[peer] = (char *)r->legacy_base[peer] + msg->words[1];
    } else if (msg->kind == MAP_VMM) {
        if (fd < 0) {
            snprintf(err, len, "rank %d exported a VMM region without passing its fd", peer);
            return -1;
        }
        size_t map_len = msg->words[0];
        CUmemAccessDesc access = {{CU_MEM_LOCATION_TYPE_DEVICE, m->device},
                                  CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        if (cu_fail(cuMemImportFromShareableHandle(&r->vmm_handle[peer], (void *)(uintptr_t)fd,
                                                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                    "cuMemImportFromShareableHandle", err, len))
            return -1;
        if (cu_fail(cuMemAddressReserve(&r->vmm_va[peer], map_len, 0, 0, 0), "cuMemAddressReserve", err,
                    len)) {
            cuMemRelease(r->vmm_handle[peer]);
            r->vmm_handle[peer] = 0;
            return -1;
        }
        r->vmm_len[peer] = map_len;
        if (cu_fail(cuMemMap(r->vmm_va[peer], map_len, 0, r->vmm_handle[peer], 0), "cuMemMap", err, len))
            return -1;                                           /* deregister undoes what was done */
        r->peer[peer] = (char *)r->vmm_va[peer] + msg->words[1]; /* mapped: deregister unmaps it */
        if (cu_fail(cuMemSetAccess(r->vmm_va[peer], map_len, &access, 1), "cuMemSetAccess", err, len))
            return -1;
    }
    return 0;
}

int cuda_mover_register(cuda_mover_t *m, void *data, size_t size, int type, cuda_region_t **out, char *err,
                        size_t err_len)
{
    int nr = m->nranks, rc = -1, fd = -1;
    cuda_region_t *r = calloc(1, sizeof(*r));
    link_msg_t *all = calloc((size_t)nr, sizeof(*all));
    int *fds = calloc((size_t)nr, sizeof(*fds));
    if (!r || !all || !fds) {
        snprintf(err, err_len, "register: out of memory");
        goto out;
    }
    r->peer = calloc((size_t)nr, sizeof(*r->peer));
    r->peer_size = calloc((size_t)nr, sizeof(*r->peer_size));
    r->legacy_base = calloc((size_t)nr, sizeof(*r->legacy_base));
    r->vmm_va = calloc((size_t)nr, sizeof(*r->vmm_va));
    r->vmm_len = calloc((size_t)nr, sizeof(*r->vmm_len));
    r->vmm_handle = calloc((size_t)nr, sizeof(*r->vmm_handle));
    if (!r->peer || !r->peer_size || !r->legacy_base || !r->vmm_va || !r->vmm_len || !r->vmm_handle) {
        snprintf(err, err_len, "register: out of memory");
        goto out;
    }
    cudaSetDevice(m->device);
    pthread_mutex_lock(&m->mutex);
    r->serial = ++m->next_serial; /* regMrSym is collective: the same serial on every rank */
    pthread_mutex_unlock(&m->mutex);
    r->type = type;
    r->local = data;
    r->core.size = size;
    r->core.mover_data = r;
    link_msg_t mine = {.serial = r->serial};
    mine.words[2] = size;
    if (export_region(r, &mine, &fd, err, err_len)) goto out;
    r->kind = mine.kind;
    if (link_exchange(m->link, &mine, fd, all, fds, err, err_len)) goto out;
    r->peer[m->rank] = data;
    r->peer_size[m->rank] = size;
    for (int p = 0; p < nr; p++) {
        if (p == m->rank) continue;
        int bad = import_region(m, r, p, &all[p], fds[p], err, err_len);
        if (fds[p] >= 0) close(fds[p]), fds[p] = -1;
        if (bad) {
            for (int q = p + 1; q < nr; q++)
                if (fds[q] >= 0) close(fds[q]), fds[q] = -1;
            goto out;
        }
    }
    pthread_mutex_lock(&m->mutex);
    r->next = m->regions;
    m->regions = r;
    pthread_mutex_unlock(&m->mutex);
    *out = r;
    r = NULL;
    rc = 0;
out:
    if (fd >= 0) close(fd);
    if (r && r->peer) {
        pthread_mutex_lock(&m->mutex);
        r->next = m->regions; /* deregister unlinks and frees it */
        m->regions = r;
        pthread_mutex_unlock(&m->mutex);
        cuda_mover_deregister(m, r);
    } else {
        free(r);
    }
    free(all);
    free(fds);
    return rc;
}

void cuda_mover_deregister(cuda_mover_t *m, cuda_region_t *r)
{
    if (!r) return;
    cudaSetDevice(m->device);
    pthread_mutex_lock(&m->mutex);
    for (cuda_region_t **p = &m->regions; *p; p = &(*p)->next) {
        if (*p == r) {
            *p = r->next;
            break;
        }
    }
    pthread_mutex_unlock(&m->mutex);
    for (int p = 0; p < m->nranks; p++) {
        if (p == m->rank) continue;
        if (r->legacy_base && r->legacy_base[p]) cudaIpcCloseMemHandle(r->legacy_base[p]);
        if (r->vmm_va && r->vmm_va[p]) {
            if (r->peer[p]) cuMemUnmap(r->vmm_va[p], r->vmm_len[p]);
            cuMemAddressFree(r->vmm_va[p], r->vmm_len[p]);
        }
        if (r->vmm_handle && r->vmm_handle[p]) cuMemRelease(r->vmm_handle[p]);
    }
    free(r->peer);
    free(r->peer_size);
    free(r->legacy_base);
    free(r->vmm_va);
    free(r->vmm_len);
    free(r->vmm_handle);
    free(r);
}

/* ---- the mover ---------------------------------------------------------------------------------- */

static int take_xfer(cuda_mover_t *m, int is_signal, int peer, uint64_t *token, char *msg, size_t len)
{
    for (int i = 0; i < m->nxfers; i++) {
        xfer_t *x = &m->xfers[i];
        if (x->used) continue;
        if (!x->event && cuda_fail(cudaEventCreateWithFlags(&x->event, cudaEventDisableTiming),
                                   "cudaEventCreate", msg, len))
            return -1;
        x->used = 1;
        x->is_signal = is_signal;
        x->peer = peer;
        *token = (uint64_t)i;
        return 0;
    }
    snprintf(msg, len, "cuda mover: all %d transfer slots in use", m->nxfers);
    return -1;
}

static int start_put(void *state, const ginq_op_t *op, uint64_t *token, char *msg, size_t len)
{
    cuda_mover_t *m = state;
    const ginq_desc_t *d = &op->desc;
    cuda_region_t *src = d->src->mover_data, *dst = d->dst->mover_data;
    if (!dst->peer[d->peer]) {
        snprintf(msg, len,
                 "destination region #%" PRIu64 " is not mapped for peer %d (its memory allows no export)",
                 dst->serial, d->peer);
        return -1;
    }
    if (d->dst_off + d->bytes > dst->peer_size[d->peer]) {
        snprintf(msg, len,
                 "destination range %" PRIu64 "+%zu outside peer %d's region #%" PRIu64 " (%zu bytes)",
                 d->dst_off, d->bytes, d->peer, dst->serial, dst->peer_size[d->peer]);
        return -1;
    }
    if (take_xfer(m, 0, d->peer, token, msg, len)) return -1;
    xfer_t *x = &m->xfers[*token];
    cudaSetDevice(m->device);
    if (cuda_fail(cudaMemcpyAsync(dst->peer[d->peer] + d->dst_off, src->local + d->src_off, d->bytes,
                                  cudaMemcpyDefault, m->stream),
                  "put: cudaMemcpyAsync", msg, len) ||
        cuda_fail(cudaEventRecord(x->event, m->stream), "put: cudaEventRecord", msg, len)) {
        x->used = 0;
        return -1;
    }
    return 0;
}

static int start_signal(void *state, const ginq_op_t *op, uint64_t *token, char *msg, size_t len)
{
    cuda_mover_t *m = state;
    const ginq_desc_t *d = &op->desc;
    const cuda_region_t *sig = d->signal->mover_data;
    uint64_t ticket;
    if (take_xfer(m, 1, d->peer, token, msg, len)) return -1;
    if (link_add_post(m->link, d->peer, sig->serial, d->signal_off, op->signal_add, &ticket, msg, len)) {
        m->xfers[*token].used = 0;
        return -1;
    }
    m->xfers[*token].ticket = ticket;
    return 0;
}

static int poll_xfer(void *state, uint64_t token, char *msg, size_t len)
{
    cuda_mover_t *m = state;
    xfer_t *x = &m->xfers[token];
    if (!x->is_signal) {
        cudaError_t e = cudaEventQuery(x->event);
        if (e == cudaErrorNotReady) return 0;
        return cuda_fail(e, "put", msg, len) ? -1 : 1;
    }
    return link_add_poll(m->link, x->peer, x->ticket, msg, len);
}

static void release_xfer(void *state, uint64_t token, int abandoned)
{
    cuda_mover_t *m = state;
    /* An abandoned copy may still run; its event stays with the slot and is re-recorded on reuse. */
    m->xfers[token].used = 0;
}

void cuda_mover_interface(cuda_mover_t *m, ginq_mover_t *out)
{
    *out = (ginq_mover_t){m, start_put, start_signal, poll_xfer, release_xfer};
}

/* ---- serving the adds posted to this rank ------------------------------------------------------- */

static cuda_region_t *find_region(cuda_mover_t *m, uint64_t serial)
{
    for (cuda_region_t *r = m->regions; r; r = r->next)
        if (r->serial == serial) return r;
    return NULL;
}

/* Takes what senders have published, in ticket order per sender. */
static void gather(cuda_mover_t *m)
{
    m->nreq = m->nwords = 0;
    for (int s = 0; s < m->nranks && m->nreq < SERVE_BATCH; s++) {
        while (m->nreq < SERVE_BATCH) {
            link_slot_t slot;
            uint64_t t;
            int took = link_add_take(m->link, s, &slot, &t);
            if (!took) break;
            serve_req_t *q = &m->req[m->nreq++];
            *q = (serve_req_t){.sender = s, .ticket = t, .value = slot.value, .word_index = -1};
            if (took == 2) continue; /* after a refused add of this sender: published, never applied */
            cuda_region_t *r = find_region(m, slot.region);
            char why[160];
            if (m->broken[0]) {
                link_add_refuse(m->link, s, t, m->broken);
                continue;
            }
            if (!r || r->type != GIN11_PTR_CUDA || slot.offset % 8 || slot.offset + 8 > r->core.size) {
                snprintf(why, sizeof(why),
                         "rank %d: no device region #%" PRIu64 " holds a signal word at offset %" PRIu64,
                         m->rank, slot.region, slot.offset);
                link_add_refuse(m->link, s, t, why);
                continue;
            }
            q->word = (uint64_t *)(r->local + slot.offset);
            for (int w = 0; w < m->nwords && q->word_index < 0; w++)
                if (m->words[w] == q->word) q->word_index = w;
            if (q->word_index < 0) {
                q->word_index = m->nwords;
                m->words[m->nwords++] = q->word;
            }
        }
    }
}

static void publish(cuda_mover_t *m)
{
    /* Requests of one sender were taken in ticket order: the last one publishes them all. */
    for (int i = 0; i < m->nreq; i++) link_add_applied(m->link, m->req[i].sender, m->req[i].ticket);
    m->nreq = m->nwords = 0;
    m->phase = 0;
}

int cuda_mover_serve(cuda_mover_t *m, char *err, size_t err_len)
{
    int rc = 0;
    pthread_mutex_lock(&m->mutex);
    cudaSetDevice(m->device);
    if (m->phase == 0) {
        gather(m);
        if (m->nwords == 0) {
            if (m->nreq) publish(m);
            goto out;
        }
        for (int w = 0; w < m->nwords && !rc; w++)
            rc = cuda_fail(cudaMemcpyAsync(&m->staging[w], m->words[w], sizeof(uint64_t),
                                           cudaMemcpyDeviceToHost, m->stream),
                           "signal add: read", err, err_len);
        if (!rc)
            rc = cuda_fail(cudaEventRecord(m->serve_event, m->stream), "signal add: record", err, err_len);
        m->phase = 1;
        goto out;
    }
    cudaError_t e = cudaEventQuery(m->serve_event);
    if (e == cudaErrorNotReady) goto out;
    if ((rc = cuda_fail(e, "signal add", err, err_len))) goto out;
    if (m->phase == 1) {
        for (int i = 0; i < m->nreq; i++)
            if (m->req[i].word) m->staging[m->req[i].word_index] += m->req[i].value;
        for (int w = 0; w < m->nwords && !rc; w++)
            rc = cuda_fail(cudaMemcpyAsync(m->words[w], &m->staging[w], sizeof(uint64_t),
                                           cudaMemcpyHostToDevice, m->stream),
                           "signal add: write", err, err_len);
        if (!rc)
            rc = cuda_fail(cudaEventRecord(m->serve_event, m->stream), "signal add: record", err, err_len);
        m->phase = 2;
    } else {
        publish(m);
    }
out:
    if (rc && !m->broken[0]) {
        /* The adds of this batch never landed: refuse them, and everything after, with the reason. */
        snprintf(m->broken, sizeof(m->broken), "rank %d could not apply signal adds: %.100s", m->rank, err);
        for (int i = 0; i < m->nreq; i++)
            link_add_refuse(m->link, m->req[i].sender, m->req[i].ticket, m->broken);
        publish(m);
    }
    pthread_mutex_unlock(&m->mutex);
    return rc;
}

int cuda_mover_serve_idle(cuda_mover_t *m)
{
    pthread_mutex_lock(&m->mutex);
    int idle = m->phase == 0 && link_inbox_idle(m->link);
    pthread_mutex_unlock(&m->mutex);
    return idle;
}

void cuda_mover_mark_sender_done(cuda_mover_t *m)
{
    link_mark_sender_done(m->link);
}

int cuda_mover_peers_done(cuda_mover_t *m)
{
    return link_peers_done(m->link);
}
