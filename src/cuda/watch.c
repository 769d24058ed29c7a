/*
 * The cuda buffer's watcher thread: every 2 ms it turns device error records into the comm's async
 * error (static mode and graphs synchronise with nobody) and looks at the peers' processes. A peer
 * that exited gets the largest fail word in our own ctrl, copied by a copy engine beside the
 * kernels that wait on it, so each of their waits on that peer ends at once with EPX_ERR_REMOTE.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <time.h>

#include "cuda/cuda.h"

/* Peer r's process exited: the comm's async error names it, and our fail word for r becomes ~0. */
static void peer_exited(cuda_buffer_t *cb, int r)
{
    epx_comm_t comm = cb->buffer->comm;
    if (atomic_load(&cb->dead_at_ns) == 0) atomic_store(&cb->dead_at_ns, epx_time_ns());
    atomic_fetch_or(&cb->dead_mask, 1ull << r);
    char msg[128];
    snprintf(msg, sizeof(msg), "rank %d: peer %d (pid %d) exited", comm->rank, r, (int)cb->procs.pid[r]);
    EPX_WARN(EPX_SUBSYS_IPC, "%s", msg);
    epx_comm_set_async_error(comm, EPX_ERR_REMOTE, msg);
    epx_cuda_ll_abort(cb); /* across nodes: the transport's waits end too */
    uint64_t *word = &((epx_cuda_ctrl_t *)cb->region)->fail[r];
    if (cudaMemcpyAsync(word, (const void *)&cb->host->dead, sizeof(*word), cudaMemcpyHostToDevice,
                        (cudaStream_t)cb->watch_stream) != cudaSuccess)
        (void)cudaGetLastError();
}

static void *watch_main(void *arg)
{
    cuda_buffer_t *cb = arg;
    const int me = cb->buffer->comm->rank, R = cb->buffer->comm->nranks;
    /* This thread's calls never join a capture of the caller's threads. */
    enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    (void)cudaSetDevice(cb->device);
    while (!atomic_load(&cb->poller_stop)) {
        struct timespec ts = {0, 2 * 1000 * 1000};
        nanosleep(&ts, NULL);
        (void)epx_cuda_report_record(cb, cb->reported_epoch + 1, 0);
        (void)epx_cuda_ll_poll(cb); /* across nodes: a peer gone ends the transport's waits */
        char msg[256];
        if (epx_cuda_bad_topk(cb, msg, sizeof(msg), 1))
            epx_comm_set_async_error(cb->buffer->comm, EPX_ERR_INVALID_ARG, msg);
        /* Only peers with a pidfd: without one, a pid that names no process of our pid namespace
         * would read as an exit (the device deadline still covers them). */
        const uint64_t dead = atomic_load(&cb->dead_mask);
        for (int r = 0; r < R; r++)
            if (r != me && cb->procs.pidfd[r] >= 0 && !(dead >> r & 1) && epx_peer_exited(&cb->procs, r))
                peer_exited(cb, r);
    }
    return NULL;
}

epx_result_t epx_cuda_watch_start(cuda_buffer_t *cb)
{
    epx_comm_t comm = cb->buffer->comm;
    cb->host->dead = ~0ull;
    atomic_init(&cb->dead_mask, 0);
    atomic_init(&cb->dead_at_ns, 0);
    EPX_CHECK(epx_peers_open(&cb->procs, comm));
    cudaStream_t st;
    epx_result_t res = epx_cuda_check(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking),
                                      "cudaStreamCreate(watch)", comm->rank);
    if (res != EPX_SUCCESS) goto err_close_peers;
    cb->watch_stream = st;
    if (pthread_create(&cb->poller, NULL, watch_main, cb) != 0) {
        res = epx_error(EPX_ERR_SYSTEM, "rank %d: could not start the cuda error poller", comm->rank);
        goto err_destroy_stream;
    }
    cb->poller_running = 1;
    return EPX_SUCCESS;

err_destroy_stream:
    (void)cudaStreamDestroy(st);
err_close_peers:
    epx_peers_close(&cb->procs);
    return res;
}

void epx_cuda_watch_stop(cuda_buffer_t *cb)
{
    if (!cb->poller_running) return;
    atomic_store(&cb->poller_stop, 1);
    pthread_join(cb->poller, NULL);
    cb->poller_running = 0;
    (void)cudaStreamDestroy((cudaStream_t)cb->watch_stream);
    epx_peers_close(&cb->procs);
}

int epx_cuda_dead_peer(cuda_buffer_t *cb)
{
    const uint64_t dead = atomic_load(&cb->dead_mask);
    return dead ? __builtin_ctzll(dead) : -1;
}
