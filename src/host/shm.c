/*
 * Host backend transport: one shared-memory region per rank and buffer (a memfd whose descriptor
 * every peer receives and maps), the publish/wait/done protocol on the area headers, and the small worker
 * pool that splits copies and reductions.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "host/host.h"

#define HOST_REGION_MAGIC 0x45505852454731ull /* "EPXREG1" */
#define HOST_PAGE         4096u
#define HOST_PID_CHECK_NS 50000000ull

static const char *const area_names[HOST_AREA_COUNT] = {"in",     "combine", "ll_in0",
                                                        "ll_in1", "ll_out0", "ll_out1"};

static size_t round_page(size_t v)
{
    return (v + HOST_PAGE - 1) / HOST_PAGE * HOST_PAGE;
}

/* ------------------------------------------------------------------------ area sizes ---- */

void host_area_sizes(const epx_buffer_config_t *cfg, int nranks, size_t sizes_out[HOST_AREA_COUNT])
{
    const size_t R = (size_t)nranks, Tm = (size_t)cfg->max_tokens, H = (size_t)cfg->hidden;
    const size_t K = (size_t)cfg->num_topk, E = (size_t)cfg->num_experts, L = E / R;
    const size_t xs = 4; /* largest dispatch element (fp32) */
    const size_t pad = cfg->max_pad_multiple > 1 ? (size_t)cfg->max_pad_multiple : 1;
    const uint32_t modes = cfg->modes ? cfg->modes : EPX_MODE_ALL;

    for (int a = 0; a < HOST_AREA_COUNT; a++) sizes_out[a] = 0;
    if (modes & (EPX_MODE_HT | EPX_MODE_PERMUTE)) {
        sizes_out[HOST_AREA_IN] =
            round_page(Tm * (H * xs + (H / 128 + 1) * 4 + K * 8 + K * 4 + E + E * 4) + 4096);
        size_t ht_rows = R * Tm * (H * 2 + K * 4);
        size_t permuted = 0;
        if (modes & EPX_MODE_PERMUTE) permuted = (R * Tm * (K < L ? K : L) + L * (pad - 1)) * (H * 2 + 4);
        sizes_out[HOST_AREA_COMBINE] =
            round_page((ht_rows > permuted ? ht_rows : permuted) + R * Tm * 16 + 4096);
    }
    if (modes & EPX_MODE_LL) {
        sizes_out[HOST_AREA_LL_IN0] = sizes_out[HOST_AREA_LL_IN1] =
            round_page(Tm * (H * 2 + K * 8 + 16) + 4096);
        sizes_out[HOST_AREA_LL_OUT0] = sizes_out[HOST_AREA_LL_OUT1] = round_page(L * R * Tm * H * 2 + 4096);
    }
}

/* ---------------------------------------------------------------------- worker pool ---- */

typedef struct host_pool {
    int nthreads; /* including the caller */
    pthread_t *threads;
    pthread_mutex_t lock;
    pthread_cond_t start_cv, done_cv;
    pthread_mutex_t call_lock; /* one parallel_for at a time per buffer */
    uint64_t generation;
    int stop;
    int busy; /* workers still inside the current job */
    host_range_fn fn;
    void *ctx;
    int64_t n, chunk;
    _Atomic int64_t next;
} host_pool_t;

static void pool_run_chunks(host_pool_t *pool)
{
    for (;;) {
        int64_t begin = atomic_fetch_add_explicit(&pool->next, pool->chunk, memory_order_relaxed);
        if (begin >= pool->n) return;
        int64_t end = begin + pool->chunk < pool->n ? begin + pool->chunk : pool->n;
        pool->fn(pool->ctx, begin, end);
    }
}

static void *pool_worker(void *arg)
{
    host_pool_t *pool = arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool->lock);
    for (;;) {
        while (!pool->stop && pool->generation == seen) pthread_cond_wait(&pool->start_cv, &pool->lock);
        if (pool->stop) break;
        seen = pool->generation;
        pthread_mutex_unlock(&pool->lock);
        pool_run_chunks(pool);
        pthread_mutex_lock(&pool->lock);
        if (--pool->busy == 0) pthread_cond_signal(&pool->done_cv);
    }
    pthread_mutex_unlock(&pool->lock);
    return NULL;
}

static void pool_destroy(host_pool_t *pool)
{
    if (!pool) return;
    pthread_mutex_lock(&pool->lock);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->start_cv);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 0; i < pool->nthreads - 1; i++) pthread_join(pool->threads[i], NULL);
    pthread_cond_destroy(&pool->done_cv);
    pthread_cond_destroy(&pool->start_cv);
    pthread_mutex_destroy(&pool->call_lock);
    pthread_mutex_destroy(&pool->lock);
    free(pool->threads);
    free(pool);
}

static epx_result_t pool_create(int nthreads, int rank, host_pool_t **pool_out)
{
    host_pool_t *pool = calloc(1, sizeof(*pool));
    if (!pool) return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: cannot allocate the worker pool", rank);
    pool->nthreads = 1;
    pthread_mutex_init(&pool->lock, NULL);
    pthread_mutex_init(&pool->call_lock, NULL);
    pthread_cond_init(&pool->start_cv, NULL);
    pthread_cond_init(&pool->done_cv, NULL);
    if (nthreads > 1) {
        pool->threads = calloc((size_t)nthreads - 1, sizeof(pthread_t));
        if (!pool->threads) {
            pool_destroy(pool);
            return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: cannot allocate the worker pool", rank);
        }
        for (int i = 0; i < nthreads - 1; i++) {
            int rc = pthread_create(&pool->threads[i], NULL, pool_worker, pool);
            if (rc != 0) {
                pool_destroy(pool);
                return epx_error(EPX_ERR_SYSTEM, "rank %d: pthread_create for worker %d of %d failed: %s",
                                 rank, i + 1, nthreads, strerror(rc));
            }
            pool->nthreads++;
        }
    }
    *pool_out = pool;
    return EPX_SUCCESS;
}

void host_parallel_for(host_buffer_t *hb, int64_t n, int64_t min_chunk, host_range_fn fn, void *ctx)
{
    host_pool_t *pool = hb->pool;
    if (n <= 0) return;
    if (min_chunk < 1) min_chunk = 1;
    if (!pool || pool->nthreads <= 1 || n <= min_chunk) {
        fn(ctx, 0, n);
        return;
    }
    pthread_mutex_lock(&pool->call_lock);
    /* A few chunks per thread balance uneven rows without much dispatch overhead. */
    int64_t chunk = (n + (int64_t)pool->nthreads * 4 - 1) / ((int64_t)pool->nthreads * 4);
    if (chunk < min_chunk) chunk = min_chunk;
    pthread_mutex_lock(&pool->lock);
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n = n;
    pool->chunk = chunk;
    atomic_store_explicit(&pool->next, 0, memory_order_relaxed);
    pool->busy = pool->nthreads - 1;
    pool->generation++;
    pthread_cond_broadcast(&pool->start_cv);
    pthread_mutex_unlock(&pool->lock);
    pool_run_chunks(pool);
    pthread_mutex_lock(&pool->lock);
    while (pool->busy > 0) pthread_cond_wait(&pool->done_cv, &pool->lock);
    pthread_mutex_unlock(&pool->lock);
    pthread_mutex_unlock(&pool->call_lock);
}

static int pool_threads(const epx_params_t *params, int local_nranks)
{
    if (params->host_threads > 0) return params->host_threads;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (cpus < 1) cpus = 1;
    long per_rank = cpus / (local_nranks > 0 ? local_nranks : 1);
    if (per_rank > 4) per_rank = 4;
    return per_rank < 1 ? 1 : (int)per_rank;
}

/* ------------------------------------------------------------------------- regions ---- */

/* Every rank reports its status; returns the first failure (ours, else a peer's). */
static void unmap_regions(host_buffer_t *hb)
{
    if (!hb->regions) return;
    for (int r = 0; r < hb->nranks; r++)
        if (hb->regions[r]) munmap(hb->regions[r], hb->region_bytes);
    free(hb->regions);
    hb->regions = NULL;
}

/* Creates and initialises our own region, anonymous memory shared by descriptor (*fd_out): no
 * name exists that a crash could leave behind or another user could take first. */
static epx_result_t create_own_region(host_buffer_t *hb, int *fd_out)
{
    int fd = memfd_create("epx-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return epx_error(EPX_ERR_SYSTEM, "rank %d: memfd_create failed: %s", hb->rank, strerror(errno));
    epx_result_t res = EPX_SUCCESS;
    if (ftruncate(fd, (off_t)hb->region_bytes) != 0) {
        res = epx_error(errno == EFBIG || errno == ENOSPC || errno == ENOMEM ? EPX_ERR_OUT_OF_MEMORY
                                                                            : EPX_ERR_SYSTEM,
                        "rank %d: cannot size our region to %zu bytes: %s", hb->rank, hb->region_bytes,
                        strerror(errno));
        goto err_close;
    }
    /* Peers map the size they see: it can no longer change under them. */
    (void)fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
    void *map = mmap(NULL, hb->region_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        res = epx_error(errno == ENOMEM ? EPX_ERR_OUT_OF_MEMORY : EPX_ERR_SYSTEM,
                        "rank %d: cannot map our region (%zu bytes): %s", hb->rank, hb->region_bytes,
                        strerror(errno));
        goto err_close;
    }
    host_region_hdr_t *hdr = map;
    hdr->rank = hb->rank;
    hdr->pid = (int32_t)getpid();
    atomic_store_explicit(&hdr->failed_seq, 0, memory_order_relaxed);
    __atomic_store_n(&hdr->magic, HOST_REGION_MAGIC, __ATOMIC_RELEASE);
    hb->regions[hb->rank] = map;
    *fd_out = fd;
    return EPX_SUCCESS;

err_close:
    close(fd);
    return res;
}

static epx_result_t map_peer_region(host_buffer_t *hb, int fd, int peer)
{
    struct stat st;
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != (uint64_t)hb->region_bytes)
        return epx_error(EPX_ERR_MISMATCH, "rank %d: peer %d's region has %lld bytes, expected %zu", hb->rank,
                         peer, (long long)st.st_size, hb->region_bytes);
    /* Peers' regions are only read: a stray write is a crash, not corruption. */
    void *map = mmap(NULL, hb->region_bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED)
        return epx_error(errno == ENOMEM ? EPX_ERR_OUT_OF_MEMORY : EPX_ERR_SYSTEM,
                         "rank %d: cannot map peer %d's region (%zu bytes): %s", hb->rank, peer,
                         hb->region_bytes, strerror(errno));
    hb->regions[peer] = map;
    const host_region_hdr_t *hdr = map;
    if (__atomic_load_n(&hdr->magic, __ATOMIC_ACQUIRE) != HOST_REGION_MAGIC || hdr->rank != peer)
        return epx_error(EPX_ERR_INTERNAL, "rank %d: peer %d's region is not its own (magic %llx, rank %d)",
                         hb->rank, peer, (unsigned long long)hdr->magic, hdr->rank);
    return EPX_SUCCESS;
}

/* Creates our region, hands its descriptor to every peer and maps theirs. */
static epx_result_t map_regions(host_buffer_t *hb)
{
    int own_fd = -1;
    /* One pid namespace first (from the peer information every rank has, so every rank returns here
     * alike): across two, the pid check below refuses every peer and only a timeout would say so. */
    epx_result_t res = epx_share_check_pid_ns(hb->buffer->comm);
    if (res != EPX_SUCCESS) return res;
    int *fds = malloc((size_t)hb->nranks * sizeof(int));
    for (int r = 0; fds && r < hb->nranks; r++) fds[r] = -1;
    /* A rank short of memory still takes part in the agreement, so that its peers learn of it at once. */
    res = epx_comm_agree(hb->buffer->comm,
                         fds ? create_own_region(hb, &own_fd)
                             : epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: cannot allocate descriptors", hb->rank),
                         "create its shared-memory region");
    if (res == EPX_SUCCESS) {
        epx_fault_point(hb->rank, 1);
        res = epx_share_fds(hb->buffer->comm, &hb->peers, own_fd, fds, EPX_SUCCESS);
    }
    epx_result_t mapped = res;
    for (int r = 0; r < hb->nranks && mapped == EPX_SUCCESS; r++)
        if (r != hb->rank) mapped = map_peer_region(hb, fds[r], r);
    epx_fault_point(hb->rank, 3);
    /* A rank that failed above has told its peers already; the rest agree on the mapping. */
    if (res == EPX_SUCCESS) res = epx_comm_agree(hb->buffer->comm, mapped, "map its peers' regions");
    for (int r = 0; fds && r < hb->nranks; r++)
        if (fds[r] >= 0) close(fds[r]);
    if (own_fd >= 0) close(own_fd);
    free(fds);
    return res;
}

epx_result_t host_shm_init(host_buffer_t *hb)
{
    epx_comm_t comm = hb->buffer->comm;
    const epx_params_t *params;
    EPX_CHECK(epx_params_get(&params));

    size_t offset = round_page(sizeof(host_region_hdr_t));
    host_area_sizes(&hb->buffer->config, hb->nranks, hb->area_bytes);
    for (int a = 0; a < HOST_AREA_COUNT; a++) {
        hb->area_offset[a] = offset;
        offset += hb->area_bytes[a];
    }
    hb->region_bytes = offset;

    hb->regions = calloc((size_t)hb->nranks, sizeof(uint8_t *));
    if (!hb->regions)
        return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: cannot allocate %d region pointers", hb->rank,
                         hb->nranks);
    epx_result_t res = map_regions(hb);
    if (res != EPX_SUCCESS) goto err_unmap;
    res = pool_create(pool_threads(params, comm->local_nranks), hb->rank, (host_pool_t **)&hb->pool);
    if (res != EPX_SUCCESS) goto err_unmap;
    EPX_INFO(EPX_SUBSYS_SHM, "rank %d: %d regions of %zu bytes mapped, %d worker threads", hb->rank,
             hb->nranks, hb->region_bytes, ((host_pool_t *)hb->pool)->nthreads);
    return EPX_SUCCESS;

err_unmap:
    unmap_regions(hb);
    return res;
}

void host_shm_fini(host_buffer_t *hb)
{
    pool_destroy(hb->pool);
    hb->pool = NULL;
    unmap_regions(hb);
}

/* -------------------------------------------------------------------- synchronisation ---- */

typedef struct wait_clock {
    uint64_t deadline;
    uint64_t next_pid_check;
    uint32_t iteration;
    int expired; /* the deadline passed: one more poll, then EPX_ERR_TIMEOUT */
} wait_clock_t;

static wait_clock_t wait_clock_start(const host_buffer_t *hb)
{
    uint64_t now = epx_time_ns();
    wait_clock_t c = {now + (uint64_t)hb->buffer->comm->timeout_ms * 1000000ull, now + HOST_PID_CHECK_NS, 0,
                      0};
    return c;
}

/* Whether `peer` failed call `seq` itself (its ring of failed calls); its status then. */
static int peer_failed_call(const host_buffer_t *hb, int peer, uint64_t seq, int32_t *status_out)
{
    const uint64_t f =
        atomic_load_explicit(&host_hdr(hb, peer)->failed_calls[seq % HOST_CALL_RING], memory_order_acquire);
    if (f >> 8 != seq) return 0;
    *status_out = (int32_t)(f & 0xff);
    return 1;
}

/* EPX_ERR_REMOTE when peer failed call `seq` (or a later one); else success. */
static epx_result_t check_failed(const host_buffer_t *hb, int peer, uint64_t seq, const char *doing)
{
    const host_region_hdr_t *hdr = host_hdr(hb, peer);
    uint64_t failed = atomic_load_explicit(&hdr->failed_seq, memory_order_acquire);
    if (failed != 0 && failed >= seq) {
        int32_t status = __atomic_load_n(&hdr->failed_status, __ATOMIC_RELAXED);
        /* Name the call we wait on when the peer failed that one (it may have failed later ones too). */
        if (peer_failed_call(hb, peer, seq, &status)) failed = seq;
        /* A peer that only passed a failure on (ERR_REMOTE): name the rank whose own failure it was,
         * when one has recorded it for this call. */
        int origin = -1;
        int32_t origin_status = 0;
        for (int q = 0; status == EPX_ERR_REMOTE && failed == seq && q < hb->nranks && origin < 0; q++)
            if (q != hb->rank && peer_failed_call(hb, q, seq, &origin_status) && origin_status != EPX_ERR_REMOTE)
                origin = q;
        if (origin >= 0 && origin != peer)
            return epx_error(EPX_ERR_REMOTE, "rank %d: peer %d failed call %llu (%s) while %s", hb->rank, origin,
                             (unsigned long long)failed, epx_result_str((epx_result_t)origin_status), doing);
        return epx_error(EPX_ERR_REMOTE, "rank %d: peer %d failed call %llu (%s) while %s", hb->rank, peer,
                         (unsigned long long)failed, epx_result_str((epx_result_t)status), doing);
    }
    return EPX_SUCCESS;
}

/* Whether `peer` destroyed its buffer. Loaded before the progress a wait looks for: what the peer
 * did before its destroy is then visible too, so only a peer that left without it is blamed. */
static int peer_destroyed(const host_buffer_t *hb, int peer)
{
    return atomic_load_explicit(&host_hdr(hb, peer)->destroyed, memory_order_acquire) != 0;
}

static epx_result_t destroyed_error(const host_buffer_t *hb, int peer, const char *doing)
{
    return epx_error(EPX_ERR_REMOTE, "rank %d: peer %d destroyed its buffer while %s", hb->rank, peer, doing);
}

/* EPX_ERR_MISMATCH when `peer` announced another kind of call `seq` than we did, or the same kind
 * working on something else (host_call_detail). */
static epx_result_t check_call(const host_buffer_t *hb, int peer, uint64_t seq)
{
    const size_t i = seq % HOST_CALL_RING;
    const uint64_t mine = atomic_load_explicit(&host_hdr(hb, hb->rank)->calls[i], memory_order_relaxed);
    const uint64_t theirs = atomic_load_explicit(&host_hdr(hb, peer)->calls[i], memory_order_acquire);
    if (seq == 0 || mine >> 8 != seq || theirs >> 8 != seq) return EPX_SUCCESS;
    if ((mine & 0xff) != (theirs & 0xff))
        return epx_error(EPX_ERR_MISMATCH, "rank %d: call %llu is %s here but %s on peer %d", hb->rank,
                         (unsigned long long)seq, epx_call_name((int)(mine & 0xff)),
                         epx_call_name((int)(theirs & 0xff)), peer);
    const uint64_t md = atomic_load_explicit(&host_hdr(hb, hb->rank)->call_details[i], memory_order_relaxed);
    const uint64_t td = atomic_load_explicit(&host_hdr(hb, peer)->call_details[i], memory_order_acquire);
    const uint64_t tag = seq & 0xffffffffu;
    if (md >> 32 != tag || td >> 32 != tag || (uint32_t)md == (uint32_t)td) return EPX_SUCCESS;
    return epx_error(EPX_ERR_MISMATCH,
                     "rank %d: call %llu (%s) combines the LL dispatch of call %u here but that of call %u on "
                     "peer %d (every rank combines the same dispatch)",
                     hb->rank, (unsigned long long)seq, epx_call_name((int)(mine & 0xff)), (unsigned)md,
                     (unsigned)td, peer);
}

void host_call_detail(host_buffer_t *hb, uint64_t seq, uint64_t detail)
{
    atomic_store_explicit(&host_hdr(hb, hb->rank)->call_details[seq % HOST_CALL_RING],
                          (seq & 0xffffffffu) << 32 | (detail & 0xffffffffu), memory_order_release);
}

void host_begin_call(host_buffer_t *hb, uint64_t seq, epx_call_kind_t kind)
{
    hb->call_seq = seq;
    atomic_store_explicit(&host_hdr(hb, hb->rank)->calls[seq % HOST_CALL_RING], seq << 8 | (uint64_t)kind,
                          memory_order_release);
}

void host_notify_destroy(host_buffer_t *hb)
{
    atomic_store_explicit(&host_hdr(hb, hb->rank)->destroyed, 1, memory_order_release);
}

/* Advances the clock; EPX_ERR_REMOTE if peer's process is gone, EPX_ERR_TIMEOUT (without a
 * message) past the deadline. The tick that finds the deadline passed returns EPX_SUCCESS once, so
 * that the caller polls again before it gives up: what arrived while we slept is not a timeout
 * (that would widen the race of a peer arriving at the deadline). */
static epx_result_t wait_tick(const host_buffer_t *hb, wait_clock_t *c, int peer, const char *doing)
{
    if (c->expired) return EPX_ERR_TIMEOUT;
    epx_backoff(c->iteration++);
    if ((c->iteration & 63) != 0) return EPX_SUCCESS;
    uint64_t now = epx_time_ns();
    if (now >= c->next_pid_check) {
        c->next_pid_check = now + HOST_PID_CHECK_NS;
        if (host_peer_exited(&hb->peers, peer)) {
            epx_result_t res = epx_error(EPX_ERR_REMOTE, "rank %d: peer %d (pid %d) exited while %s", hb->rank,
                                         peer, (int)hb->peers.pid[peer], doing);
            return epx_comm_set_async_error(hb->buffer->comm, res, NULL); /* kept: the comm has lost a rank */
        }
    }
    c->expired = now >= c->deadline;
    return EPX_SUCCESS;
}

epx_result_t host_area_acquire(host_buffer_t *hb, host_area_t area)
{
    uint64_t last = hb->last_pub_seq[area];
    if (last == 0) return EPX_SUCCESS;
    wait_clock_t clock = wait_clock_start(hb);
    char doing[96] = "";
    for (int p = 0; p < hb->nranks; p++) {
        if (p == hb->rank) continue;
        const host_region_hdr_t *hdr = host_hdr(hb, p);
        for (;;) {
            const int gone = peer_destroyed(hb, p);
            uint64_t done = atomic_load_explicit(&hdr->areas[area].done_seq, memory_order_acquire);
            if (done >= last) break;
            /* A peer that failed call `last` (or a later one) will not read it any more, unless a hook of
             * its own still holds it (it reads it when run, or lets it go when dropped). */
            uint64_t failed = atomic_load_explicit(&hdr->failed_seq, memory_order_acquire);
            if (failed >= last && atomic_load_explicit(&hdr->areas[area].held_seq, memory_order_acquire) != last)
                break;
            if (!doing[0]) /* formatted only when a peer is not done yet */
                snprintf(doing, sizeof(doing), "we waited for it to release area %s of call %llu",
                         area_names[area], (unsigned long long)last);
            if (gone) return destroyed_error(hb, p, doing);
            EPX_CHECK(check_call(hb, p, hb->call_seq));
            epx_result_t res = wait_tick(hb, &clock, p, doing);
            if (res == EPX_ERR_TIMEOUT)
                return epx_error(EPX_ERR_TIMEOUT,
                                 "rank %d: peer %d did not release area %s of call %llu within %lld ms "
                                 "(last done %llu)",
                                 hb->rank, p, area_names[area], (unsigned long long)last,
                                 (long long)hb->buffer->comm->timeout_ms, (unsigned long long)done);
            if (res != EPX_SUCCESS) return res;
        }
    }
    return EPX_SUCCESS;
}

void host_area_publish(host_buffer_t *hb, host_area_t area, uint64_t seq, epx_call_kind_t op, int32_t status,
                       const int64_t *words, int nwords)
{
    host_area_ctrl_t *ctrl = &host_hdr(hb, hb->rank)->areas[area];
    memset(&ctrl->pub, 0, sizeof(ctrl->pub));
    ctrl->pub.seq = seq;
    ctrl->pub.status = status;
    ctrl->pub.op = (int32_t)op;
    if (nwords > HOST_PUB_WORDS) nwords = HOST_PUB_WORDS;
    for (int i = 0; i < nwords; i++) ctrl->pub.words[i] = words[i];
    atomic_store_explicit(&ctrl->pub_seq, seq, memory_order_release);
    hb->last_pub_seq[area] = seq;
}

/* One poll of peer's publication: 1 when present (copied), 0 when not yet, -1 on failure. */
static int poll_pub(const host_buffer_t *hb, int peer, host_area_t area, uint64_t seq, host_pub_t *pub_out,
                    epx_result_t *res_out)
{
    const host_area_ctrl_t *ctrl = &host_hdr(hb, peer)->areas[area];
    /* failed_seq is read before the announcement and pub_seq: a peer announces and publishes call
     * n before it can fail call n (or n+1), so once we see the failure, what came before it is
     * visible too and wins below. The same holds for a destroy. */
    const int gone = peer_destroyed(hb, peer);
    uint64_t failed = atomic_load_explicit(&host_hdr(hb, peer)->failed_seq, memory_order_acquire);
    /* The call's kind first: a peer in another call may publish this very area (both dispatches
     * use IN) or never publish it. */
    *res_out = check_call(hb, peer, seq);
    if (*res_out != EPX_SUCCESS) return -1;
    uint64_t seen = atomic_load_explicit(&ctrl->pub_seq, memory_order_acquire);
    char doing[96];
    if (seen == seq) {
        host_pub_t pub;
        memcpy(&pub, &ctrl->pub, sizeof(pub));
        if (pub.status != EPX_SUCCESS) {
            *res_out = epx_error(EPX_ERR_REMOTE, "rank %d: peer %d failed call %llu (%s) in area %s",
                                 hb->rank, peer, (unsigned long long)seq,
                                 epx_result_str((epx_result_t)pub.status), area_names[area]);
            return -1;
        }
        if (pub_out) *pub_out = pub;
        return 1;
    }
    snprintf(doing, sizeof(doing), "we waited for area %s of call %llu", area_names[area],
             (unsigned long long)seq);
    if (failed != 0 && failed >= seq) {
        *res_out = check_failed(hb, peer, seq, doing);
        if (*res_out != EPX_SUCCESS) return -1;
    }
    if (gone) {
        *res_out = destroyed_error(hb, peer, doing);
        return -1;
    }
    if (seen > seq) {
        /* Only a peer that gave up on our call moves on without it. */
        *res_out = epx_error(
            EPX_ERR_REMOTE, "rank %d: peer %d moved on to call %llu in area %s while we wait for call %llu",
            hb->rank, peer, (unsigned long long)seen, area_names[area], (unsigned long long)seq);
        return -1;
    }
    return 0;
}

static epx_result_t pub_timeout(const host_buffer_t *hb, int peer, host_area_t area, uint64_t seq)
{
    uint64_t seen = atomic_load_explicit(&host_hdr(hb, peer)->areas[area].pub_seq, memory_order_acquire);
    return epx_error(EPX_ERR_TIMEOUT,
                     "rank %d: peer %d did not publish area %s for call %llu within %lld ms (last seen %llu)",
                     hb->rank, peer, area_names[area], (unsigned long long)seq,
                     (long long)hb->buffer->comm->timeout_ms, (unsigned long long)seen);
}

/* What a wait is for, as wait_tick reports it; formatted once, when the first poll came back empty
 * (a call whose peers are already there formats nothing). */
static void describe_wait(char *doing, size_t cap, host_area_t area, uint64_t seq)
{
    if (!doing[0])
        snprintf(doing, cap, "we waited for area %s of call %llu", area_names[area], (unsigned long long)seq);
}

epx_result_t host_area_wait(host_buffer_t *hb, int peer, host_area_t area, uint64_t seq, host_pub_t *pub_out)
{
    wait_clock_t clock = wait_clock_start(hb);
    char doing[96] = "";
    for (;;) {
        epx_result_t res = EPX_SUCCESS;
        int got = poll_pub(hb, peer, area, seq, pub_out, &res);
        if (got > 0) return EPX_SUCCESS;
        if (got < 0) return res;
        describe_wait(doing, sizeof(doing), area, seq);
        res = wait_tick(hb, &clock, peer, doing);
        if (res == EPX_ERR_TIMEOUT) return pub_timeout(hb, peer, area, seq);
        if (res != EPX_SUCCESS) return res;
    }
}

epx_result_t host_area_wait_all(host_buffer_t *hb, host_area_t area, uint64_t seq, host_pub_t *pubs_out)
{
    const int R = hb->nranks;
    wait_clock_t clock = wait_clock_start(hb);
    char doing[96] = "";
    /* Poll everyone in turn so a failed peer is noticed even while an earlier one is slow. */
    int first_missing = 0;
    for (;;) {
        int missing = -1;
        for (int p = first_missing; p < R; p++) {
            host_pub_t pub;
            epx_result_t res = EPX_SUCCESS;
            int got = poll_pub(hb, p, area, seq, &pub, &res);
            if (got < 0) return res;
            if (got > 0) {
                if (pubs_out) pubs_out[p] = pub;
                continue;
            }
            if (missing < 0) missing = p;
        }
        if (missing < 0) return EPX_SUCCESS;
        /* Ranks before the first missing one are copied; the rest are polled again. */
        first_missing = missing;
        describe_wait(doing, sizeof(doing), area, seq);
        epx_result_t res = wait_tick(hb, &clock, missing, doing);
        if (res == EPX_ERR_TIMEOUT) return pub_timeout(hb, missing, area, seq);
        if (res != EPX_SUCCESS) return res;
    }
}

void host_area_done(host_buffer_t *hb, host_area_t area, uint64_t seq)
{
    host_area_ctrl_t *ctrl = &host_hdr(hb, hb->rank)->areas[area];
    if (atomic_load_explicit(&ctrl->done_seq, memory_order_relaxed) < seq)
        atomic_store_explicit(&ctrl->done_seq, seq, memory_order_release);
    if (atomic_load_explicit(&ctrl->held_seq, memory_order_relaxed) <= seq)
        atomic_store_explicit(&ctrl->held_seq, 0, memory_order_release);
}

void host_area_hold(host_buffer_t *hb, host_area_t area, uint64_t seq)
{
    /* Stored before any later failure of ours is published (release), so a peer that sees the
     * failure sees the hold too. */
    atomic_store_explicit(&host_hdr(hb, hb->rank)->areas[area].held_seq, seq, memory_order_release);
}

epx_result_t host_fail(host_buffer_t *hb, uint64_t seq, epx_result_t res)
{
    host_region_hdr_t *hdr = host_hdr(hb, hb->rank);
    _Atomic uint64_t *ring = &hdr->failed_calls[seq % HOST_CALL_RING];
    if (atomic_load_explicit(ring, memory_order_relaxed) >> 8 != seq)
        atomic_store_explicit(ring, seq << 8 | ((uint64_t)res & 0xff), memory_order_release);
    if (atomic_load_explicit(&hdr->failed_seq, memory_order_relaxed) >= seq) return res;
    __atomic_store_n(&hdr->failed_status, (int32_t)res, __ATOMIC_RELAXED);
    atomic_store_explicit(&hdr->failed_seq, seq, memory_order_release);
    EPX_INFO(EPX_SUBSYS_SHM, "rank %d: call %llu failed (%s), peers told", hb->rank, (unsigned long long)seq,
             epx_result_str(res));
    return res;
}

epx_result_t host_end_call(host_buffer_t *hb, uint64_t seq, epx_result_t res)
{
    if (res != EPX_SUCCESS) {
        if (res == EPX_ERR_TIMEOUT) epx_comm_set_async_error(hb->buffer->comm, res, NULL);
        return host_fail(hb, seq, res);
    }
    for (int p = 0; p < hb->nranks; p++) {
        int32_t status;
        if (p == hb->rank || !peer_failed_call(hb, p, seq, &status)) continue;
        return host_fail(hb, seq,
                         epx_error(EPX_ERR_REMOTE,
                                   "rank %d: peer %d failed call %llu (%s) before this rank completed it (this "
                                   "rank came late, after the peer gave up); what this call wrote is not a result",
                                   hb->rank, p, (unsigned long long)seq, epx_result_str((epx_result_t)status)));
    }
    return EPX_SUCCESS;
}

epx_result_t host_verdict(host_buffer_t *hb, uint64_t seq, epx_result_t mine)
{
    if (mine != EPX_SUCCESS) return host_fail(hb, seq, mine);
    atomic_store_explicit(&host_hdr(hb, hb->rank)->verdict_seq, seq, memory_order_release);
    wait_clock_t clock = wait_clock_start(hb);
    char doing[96];
    snprintf(doing, sizeof(doing), "we waited for its verdict on call %llu", (unsigned long long)seq);
    for (int p = 0; p < hb->nranks; p++) {
        if (p == hb->rank) continue;
        const host_region_hdr_t *hdr = host_hdr(hb, p);
        for (;;) {
            /* Failures and the destroy are read before the verdict: a peer that passed it may fail
             * in this step (another peer failed) or in its next call, and its verdict, stored
             * first, is then visible and wins. */
            const int gone = peer_destroyed(hb, p);
            const uint64_t failed = atomic_load_explicit(&hdr->failed_seq, memory_order_acquire);
            if (atomic_load_explicit(&hdr->verdict_seq, memory_order_acquire) >= seq) break;
            epx_result_t res = check_call(hb, p, seq);
            if (res == EPX_SUCCESS && failed >= seq) res = check_failed(hb, p, seq, doing);
            if (res == EPX_SUCCESS && gone) res = destroyed_error(hb, p, doing);
            if (res == EPX_SUCCESS) {
                res = wait_tick(hb, &clock, p, doing);
                if (res == EPX_ERR_TIMEOUT)
                    res = epx_error(EPX_ERR_TIMEOUT,
                                    "rank %d: peer %d gave no verdict on call %llu within %lld ms", hb->rank,
                                    p, (unsigned long long)seq, (long long)hb->buffer->comm->timeout_ms);
            }
            if (res != EPX_SUCCESS) return host_fail(hb, seq, res);
        }
    }
    return EPX_SUCCESS;
}
