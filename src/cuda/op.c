/*
 * The cuda backend's operation runner: what every operation does around its kernels on the
 * caller's stream (capture check, device, launch checks, the last-operation event, the refusal
 * that tells the peers, and the host wait that reads the device error record afterwards).
 */
#include <cuda_runtime.h>
#include <sched.h>
#include <stdio.h>
#include <time.h>

#include "cuda/cuda.h"

int epx_cuda_stream_capturing(void *stream, int if_unknown)
{
    enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing((cudaStream_t)stream, &st) != cudaSuccess) {
        (void)cudaGetLastError();
        return if_unknown;
    }
    return st != cudaStreamCaptureStatusNone;
}

/* After a peer's process exited, the device's waits on it end within a few ms (the watcher's fail
 * word): a host wait gives the device this long past the watcher's notice, then gives up. */
#define DEAD_PEER_GRACE_MS 500

epx_result_t epx_cuda_wait_event(cuda_buffer_t *cb, const char *what)
{
    epx_comm_t comm = cb->buffer->comm;
    /* Device waits give up after the timeout; the slack covers launch and teardown of a kernel. */
    const uint64_t deadline = epx_deadline_after_ms(comm->timeout_ms + 10000);
    for (uint32_t it = 0;; it++) {
        cudaError_t err = cudaEventQuery((cudaEvent_t)cb->event);
        if (err == cudaSuccess) return EPX_SUCCESS;
        if (err != cudaErrorNotReady) return epx_cuda_check(err, what, comm->rank);
        const uint64_t now = epx_time_ns(), dead_at = atomic_load(&cb->dead_at_ns);
        if (dead_at != 0 && now > dead_at + DEAD_PEER_GRACE_MS * 1000000ull) {
            const int peer = epx_cuda_dead_peer(cb);
            return epx_error(EPX_ERR_REMOTE, "rank %d: %s: peer %d (pid %d) exited and the device did not "
                             "finish within %d ms of it", comm->rank, what, peer, (int)cb->procs.pid[peer],
                             DEAD_PEER_GRACE_MS);
        }
        if (now > deadline)
            return epx_error(EPX_ERR_TIMEOUT, "rank %d: %s: the device did not finish within %lld ms",
                             comm->rank, what, (long long)comm->timeout_ms + 10000);
        if (it < 20000) {
            sched_yield();
        } else {
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
        }
    }
}

void epx_cuda_tell_peers(cuda_buffer_t *cb, uint64_t seq, epx_result_t res, int capturing)
{
    (void)cudaSetDevice(cb->device);
    /* The fail kernel reads our epoch, so our earlier kernels must have finished. A device
     * synchronisation would invalidate the caller's capture: there, wait for the buffer's last
     * operation instead (captured ones have not run), in the mode that allows it. */
    enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    if (capturing) {
        (void)cudaThreadExchangeStreamCaptureMode(&mode);
        (void)cudaEventSynchronize((cudaEvent_t)cb->event);
    } else {
        (void)cudaDeviceSynchronize();
    }
    epx_cuda_common_t c;
    epx_cuda_fill_common(cb, &c);
    epx_cuda_ll_on_fail(cb, cb->internal_stream);
    if (epx_cuda_launch_fail(&c, cb->internal_stream) == cudaSuccess) {
        cb->epoch++;
        (void)cudaStreamSynchronize((cudaStream_t)cb->internal_stream);
    }
    if (capturing) (void)cudaThreadExchangeStreamCaptureMode(&mode);
    EPX_INFO(EPX_SUBSYS_HT, "rank %d: told peers that collective call %llu failed (%s)",
             cb->buffer->comm->rank, (unsigned long long)seq, epx_result_str(res));
}

epx_result_t epx_cuda_op_refuse(const epx_cuda_op_t *op, epx_result_t res)
{
    if (op->seq != 0) epx_cuda_tell_peers(op->cb, op->seq, res, op->capturing);
    return res;
}

epx_result_t epx_cuda_op_begin(epx_cuda_op_t *op, epx_buffer_t buffer, uint64_t seq, void *stream)
{
    cuda_buffer_t *cb = buffer->backend_state;
    const volatile epx_cuda_host_block_t *hb = cb->host;
    op->cb = cb;
    op->seq = seq;
    op->stream = stream;
    op->capturing = epx_cuda_stream_capturing(stream, 0);
    op->mark = hb->err.code != 0 ? hb->err.epoch : 0;
    op->epoch = 0;
    epx_result_t res = epx_cuda_check(cudaSetDevice(cb->device), "cudaSetDevice", buffer->comm->rank);
    return res == EPX_SUCCESS ? res : epx_cuda_op_refuse(op, res);
}

epx_result_t epx_cuda_op_record(const epx_cuda_op_t *op)
{
    if (op->capturing) return EPX_SUCCESS; /* the graph orders its own replays */
    return epx_cuda_check(cudaEventRecord((cudaEvent_t)op->cb->event, (cudaStream_t)op->stream),
                          "cudaEventRecord", op->cb->buffer->comm->rank);
}

epx_result_t epx_cuda_op_sent(epx_cuda_op_t *op, int err, const char *what)
{
    epx_result_t res = epx_cuda_check(err, what, op->cb->buffer->comm->rank);
    if (res != EPX_SUCCESS) return op->epoch == 0 ? epx_cuda_op_refuse(op, res) : res;
    if (op->seq != 0 && op->epoch == 0) op->epoch = ++op->cb->epoch;
    return EPX_SUCCESS;
}

epx_result_t epx_cuda_op_launched(epx_cuda_op_t *op, int err, const char *what)
{
    EPX_CHECK(epx_cuda_op_sent(op, err, what));
    return epx_cuda_op_record(op);
}

epx_result_t epx_cuda_op_wait(const epx_cuda_op_t *op, const char *what)
{
    cuda_buffer_t *cb = op->cb;
    EPX_CHECK(epx_cuda_wait_event(cb, what));
    const volatile epx_cuda_host_block_t *hb = cb->host;
    if (hb->err.code != 0 && hb->err.epoch > op->mark) return epx_cuda_report_record(cb, op->mark + 1, 1);
    return EPX_SUCCESS;
}

int epx_cuda_bad_topk(cuda_buffer_t *cb, char *msg, size_t cap, int clear)
{
    volatile epx_cuda_host_block_t *hb = cb->host;
    const int64_t where = hb->bad_where;
    if (!where) return 0;
    const int64_t w = where - 1;
    snprintf(msg, cap, "rank %d: topk_idx[%lld][%lld] = %lld is out of range [-1, %d) or repeated in its row",
             cb->buffer->comm->rank, (long long)(w / EPX_MAX_TOPK), (long long)(w % EPX_MAX_TOPK),
             (long long)hb->bad_value, cb->buffer->config.num_experts);
    if (clear) hb->bad_where = 0;
    return 1;
}
