/*
 * epx-bench memory, tensors and timing on the rank's device (CUDA memory, events and stream) or,
 * on the host backend, plain memory and CLOCK_MONOTONIC. The only file that calls CUDA itself.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef EPX_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "core/internal.h"
#include "tool.h"

#ifdef EPX_HAVE_CUDA
/* Copies are ordered on the rank's (non-blocking) stream and waited for, so that later work on
 * that stream sees them. */
static int cuda_copy(bench_rank_t *b, void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind)
{
    cudaStream_t s = (cudaStream_t)b->stream;
    if (cudaMemcpyAsync(dst, src, bytes, kind, s) == cudaSuccess && cudaStreamSynchronize(s) == cudaSuccess)
        return 0;
    fprintf(stderr, "rank %d: copy of %zu bytes failed\n", b->rank, bytes);
    return -1;
}
#endif

void *mem_alloc(bench_rank_t *b, size_t bytes)
{
    if (bytes == 0) bytes = 1;
#ifdef EPX_HAVE_CUDA
    if (b->gpu) {
        void *p = NULL;
        if (cudaMalloc(&p, bytes) != cudaSuccess) {
            fprintf(stderr, "rank %d: cudaMalloc of %zu bytes failed\n", b->rank, bytes);
            return NULL;
        }
        return p;
    }
#endif
    void *p = calloc(1, bytes);
    if (!p) fprintf(stderr, "rank %d: out of memory allocating %zu bytes\n", b->rank, bytes);
    return p;
}

void mem_free(bench_rank_t *b, void *p)
{
#ifdef EPX_HAVE_CUDA
    if (b->gpu) {
        if (p) cudaFree(p);
        return;
    }
#endif
    free(p);
}

int mem_put(bench_rank_t *b, void *dst, const void *src, size_t bytes)
{
    if (bytes == 0) return 0;
    if (!dst) {
        fprintf(stderr, "rank %d: no memory to write %zu bytes to\n", b->rank, bytes);
        return -1;
    }
#ifdef EPX_HAVE_CUDA
    if (b->gpu) return cuda_copy(b, dst, src, bytes, cudaMemcpyHostToDevice);
#endif
    memcpy(dst, src, bytes);
    return 0;
}

int stream_sync(bench_rank_t *b)
{
#ifdef EPX_HAVE_CUDA
    if (b->gpu && cudaStreamSynchronize((cudaStream_t)b->stream) != cudaSuccess) {
        fprintf(stderr, "rank %d: waiting for the stream failed\n", b->rank);
        return -1;
    }
#endif
    (void)b;
    return 0;
}

int mem_zero(bench_rank_t *b, void *dst, size_t bytes)
{
    if (bytes == 0) return 0;
    if (!dst) {
        fprintf(stderr, "rank %d: no memory to write %zu bytes to\n", b->rank, bytes);
        return -1;
    }
#ifdef EPX_HAVE_CUDA
    if (b->gpu) {
        cudaStream_t s = (cudaStream_t)b->stream;
        if (cudaMemsetAsync(dst, 0, bytes, s) == cudaSuccess && cudaStreamSynchronize(s) == cudaSuccess)
            return 0;
        fprintf(stderr, "rank %d: clearing %zu bytes failed\n", b->rank, bytes);
        return -1;
    }
#endif
    memset(dst, 0, bytes);
    return 0;
}

const void *mem_view(bench_rank_t *b, const void *src, size_t bytes)
{
#ifdef EPX_HAVE_CUDA
    if (b->gpu) {
        void *p = malloc(bytes ? bytes : 1);
        if (p && bytes && cuda_copy(b, p, src, bytes, cudaMemcpyDeviceToHost)) {
            free(p);
            p = NULL;
        }
        if (!p) fprintf(stderr, "rank %d: cannot read back %zu bytes from the device\n", b->rank, bytes);
        return p;
    }
#endif
    return src;
}

void mem_view_release(bench_rank_t *b, const void *view)
{
    if (b->gpu) free((void *)view);
}

int mem_copy_async(bench_rank_t *b, void *dst, const void *src, size_t bytes)
{
#ifdef EPX_HAVE_CUDA
    if (b->gpu)
        return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, (cudaStream_t)b->stream) ==
                       cudaSuccess
                   ? 0
                   : -1;
#endif
    memcpy(dst, src, bytes);
    return 0;
}

void *dev_take(bench_rank_t *b, bench_mem_t *m, size_t bytes)
{
    for (int i = 0; i < 20 && !m->failed; i++)
        if (!m->dev[i]) {
            m->failed = (m->dev[i] = mem_alloc(b, bytes)) == NULL;
            return m->dev[i];
        }
    m->failed = 1;
    return NULL;
}

void *host_take(bench_mem_t *m, size_t bytes)
{
    for (int i = 0; i < 8 && !m->failed; i++)
        if (!m->host[i]) {
            m->failed = (m->host[i] = calloc(1, bytes ? bytes : 1)) == NULL;
            return m->host[i];
        }
    m->failed = 1;
    return NULL;
}

void mem_release_all(bench_rank_t *b, bench_mem_t *m)
{
    for (int i = 19; i >= 0; i--) mem_free(b, m->dev[i]);
    for (int i = 7; i >= 0; i--) free(m->host[i]);
    memset(m, 0, sizeof(*m));
}

epx_tensor_t tensor(bench_rank_t *b, void *data, epx_dtype_t dtype, int ndim, int64_t d0, int64_t d1,
                    int64_t d2)
{
    epx_tensor_t t = ndim == 1   ? epx_tensor_1d(data, dtype, d0)
                     : ndim == 2 ? epx_tensor_2d(data, dtype, d0, d1)
                                 : epx_tensor_3d(data, dtype, d0, d1, d2);
    if (b->gpu) {
        t.device_type = EPX_DEVICE_CUDA;
        t.device_id = b->device;
    }
    return t;
}

/* Selects the rank's GPU, makes its stream (non-blocking, as the library's own streams) and the
 * events of the samples. Nothing to do on the host backend. */
int device_open(bench_rank_t *b)
{
#ifdef EPX_HAVE_CUDA
    if (!b->gpu) return 0;
    cudaStream_t stream;
    cudaEvent_t start, stop;
    if (cudaSetDevice(b->device) != cudaSuccess ||
        cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
        fprintf(stderr, "rank %d: cannot use cuda device %d\n", b->rank, b->device);
        return -1;
    }
    b->stream = stream;
    if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess) {
        fprintf(stderr, "rank %d: cannot create cuda events\n", b->rank);
        return -1;
    }
    b->ev_start = start;
    b->ev_stop = stop;
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, b->device);
    b->res->device_sms = sms;
#endif
    return 0;
}

void device_close(bench_rank_t *b)
{
#ifdef EPX_HAVE_CUDA
    if (b->ev_stop) cudaEventDestroy((cudaEvent_t)b->ev_stop);
    if (b->ev_start) cudaEventDestroy((cudaEvent_t)b->ev_start);
    if (b->stream) cudaStreamDestroy((cudaStream_t)b->stream);
#endif
    b->ev_start = b->ev_stop = b->stream = NULL;
}

/* epx_comm_barrier: the communicator's own bootstrap barrier, the one every rank passes before
 * each timed call. */
int timed_begin(bench_rank_t *b)
{
    epx_result_t res = epx_comm_barrier(b->comm);
    if (res != EPX_SUCCESS) {
        fprintf(stderr, "rank %d: barrier failed: %s (%s)\n", b->rank, epx_result_name(res),
                epx_last_error_message());
        return -1;
    }
#ifdef EPX_HAVE_CUDA
    if (b->gpu) {
        cudaEventRecord((cudaEvent_t)b->ev_start, (cudaStream_t)b->stream);
        return 0;
    }
#endif
    b->t0 = epx_time_ns();
    return 0;
}

int timed_end(bench_rank_t *b, double *us)
{
#ifdef EPX_HAVE_CUDA
    if (b->gpu) {
        float ms = 0.0f;
        cudaEventRecord((cudaEvent_t)b->ev_stop, (cudaStream_t)b->stream);
        if (cudaEventSynchronize((cudaEvent_t)b->ev_stop) != cudaSuccess) {
            fprintf(stderr, "rank %d: waiting for a timed call failed\n", b->rank);
            return -1;
        }
        cudaEventElapsedTime(&ms, (cudaEvent_t)b->ev_start, (cudaEvent_t)b->ev_stop);
        *us = ms * 1000.0;
        return 0;
    }
#endif
    *us = (double)(epx_time_ns() - b->t0) / 1000.0;
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return v[n / 2];
}
