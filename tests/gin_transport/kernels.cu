/*
 * The network transport test's kernels, every operation through net.h over the handle the transport's
 * open made (GIN: src/net/gin.cuh, loop: src/net/loop.cuh): a ring round (one thread posts, waits,
 * flushes), the soak (one block: all threads write and check the bytes, thread 0 alone talks to the
 * network), the protocols wrong on purpose (weak cover, strong other peer), and the dead-peer wait.
 */
#include <cuda_runtime.h>

#include "gin_test.h"

#define SOAK_THREADS 256

__global__ void gin_ring_kernel(epx_net_t net, gin_ring_args_t a, gin_kernel_result_t *result)
{
    const uint64_t start = epx_net_now_ns();
    const uint64_t deadline = start + a.timeout_ns;
    const uint64_t chunk = (a.bytes + a.chunks - 1) / a.chunks;
    epx_net_status_t post = EPX_NET_OK;
    for (uint64_t off = 0; post == EPX_NET_OK && off < a.bytes; off += chunk) {
        const uint64_t len = a.bytes - off < chunk ? a.bytes - off : chunk;
        const uint64_t dst = a.dst_offset + off, src = a.src_offset + off;
        if (a.mode == GIN_MODE_WEAK)
            post = epx_net_put_signal(&net, a.ctx, a.peer, GIN_DST, dst, GIN_SRC, src, len, GIN_SIG_RING, 1,
                                      EPX_NET_SIGNAL_WEAK);
        else if (a.mode == GIN_MODE_STRONG && off + len == a.bytes)
            post = epx_net_put_signal(&net, a.ctx, a.peer, GIN_DST, dst, GIN_SRC, src, len, GIN_SIG_RING, 1,
                                      EPX_NET_SIGNAL_STRONG);
        else
            post = epx_net_put(&net, a.ctx, a.peer, GIN_DST, dst, GIN_SRC, src, len);
    }
    if (post == EPX_NET_OK && a.mode == GIN_MODE_SIGNAL)
        post = epx_net_signal_add(&net, a.ctx, a.peer, GIN_SIG_RING, 1, EPX_NET_SIGNAL_STRONG);
    const epx_net_status_t wait =
        post == EPX_NET_OK ? epx_net_wait_signal(&net, GIN_SIG_RING, a.signal_target, deadline) : EPX_NET_ABORTED;
    uint64_t seen = 0;
    epx_net_signal_read(&net, GIN_SIG_RING, &seen);
    result->post_status = post;
    result->wait_status = wait;
    result->flush_status = epx_net_flush(&net, a.ctx, deadline);
    result->signal_seen = seen;
    result->elapsed_ns = epx_net_now_ns() - start;
    __threadfence_system();
    result->done = 1;
}

/* Bytes the network wrote: read past L1, which may still hold the slot's previous content. */
__device__ static inline unsigned char load_landed(const unsigned char *p)
{
    return __ldcv(p);
}

/* Iteration i: wait until the slot may be reused (its last put read its source: flush; the right rank
 * consumed it: acknowledgement), write the pattern, put it with a signal (strong and weak in pairs,
 * contexts in turn), wait for the left rank's, check and hash it, acknowledge. Thread 0 alone calls net.h;
 * the barriers carry the other threads' bytes to it and its verdicts to them.
 * The data signal is the slot's own (GIN_SIG_SOAK / GIN_SIG_SOAK1), waited for at i / 2 + 1: the left rank
 * may already have posted iteration i + 1 (other slot, other context) while we wait for i, and nothing
 * orders the two (contexts are independent; a weak signal covers only its own put), so a count shared by
 * both slots could reach i + 1 through i + 1's signal with i's bytes not landed. Per slot the count is
 * exact: the slot's next put (i + 2) waits for our acknowledgement of i. */
__global__ void __launch_bounds__(SOAK_THREADS) gin_soak_kernel(epx_net_t net, gin_soak_args_t a,
                                                                 gin_kernel_result_t *result)
{
    __shared__ unsigned long long sent, recv, bad;
    __shared__ int post, wait, flush, stop;
    const int tid = threadIdx.x;
    const uint64_t start = epx_net_now_ns();
    if (tid == 0) {
        sent = recv = bad = 0;
        post = wait = flush = EPX_NET_OK;
        stop = 0;
    }
    __syncthreads();
    uint64_t i = 0;
    for (; i < a.iterations; i++) {
        const uint64_t n = gin_soak_bytes(a.seed, i), off = gin_soak_offset(a.seed, i);
        const uint32_t ctx = (uint32_t)(i % net.ncontexts);
        const uint32_t sig = (i & 1) ? GIN_SIG_SOAK1 : GIN_SIG_SOAK;
        __syncthreads(); /* every thread has read the last iteration's `stop` before thread 0 writes it again
                          */
        if (tid == 0 && i >= 2) {
            flush = epx_net_flush(&net, (uint32_t)((i - 2) % net.ncontexts), epx_net_now_ns() + a.timeout_ns);
            if (flush == EPX_NET_OK)
                wait = epx_net_wait_signal(&net, GIN_SIG_ACK, i - 1, epx_net_now_ns() + a.timeout_ns);
            stop = flush != EPX_NET_OK || wait != EPX_NET_OK;
        }
        __syncthreads();
        if (stop) break;
        unsigned long long h = 0;
        for (uint64_t k = tid; k < n; k += SOAK_THREADS) {
            const unsigned char b = gin_pattern_byte(a.seed, net.rank, i, k);
            a.src[off + k] = b;
            h += gin_byte_hash(i, k, b);
        }
        atomicAdd(&sent, h);
        __threadfence_system();
        __syncthreads();
        if (tid == 0) {
            post = epx_net_put_signal(&net, ctx, a.right, GIN_DST, off, GIN_SRC, off, n, sig, 1,
                                      (i & 2) ? EPX_NET_SIGNAL_WEAK : EPX_NET_SIGNAL_STRONG);
            if (post == EPX_NET_OK)
                wait = epx_net_wait_signal(&net, sig, i / 2 + 1, epx_net_now_ns() + a.timeout_ns);
            stop = post != EPX_NET_OK || wait != EPX_NET_OK;
        }
        __syncthreads();
        if (stop) break;
        unsigned long long hr = 0, nb = 0;
        for (uint64_t k = tid; k < n; k += SOAK_THREADS) {
            const unsigned char b = load_landed(a.dst + off + k);
            hr += gin_byte_hash(i, k, b);
            nb += b != gin_pattern_byte(a.seed, a.left, i, k);
        }
        atomicAdd(&recv, hr);
        atomicAdd(&bad, nb);
        __syncthreads();
        if (tid == 0) {
            post = epx_net_signal_add(&net, ctx, a.left, GIN_SIG_ACK, 1, EPX_NET_SIGNAL_STRONG);
            stop = post != EPX_NET_OK;
        }
        __syncthreads();
        if (stop) break;
    }
    if (tid != 0) return;
    for (uint32_t c = 0; c < net.ncontexts && flush == EPX_NET_OK; c++)
        flush = epx_net_flush(&net, c, epx_net_now_ns() + a.timeout_ns);
    uint64_t seen = 0, seen1 = 0;
    epx_net_signal_read(&net, GIN_SIG_SOAK, &seen);
    epx_net_signal_read(&net, GIN_SIG_SOAK1, &seen1);
    seen += seen1; /* both slots: the soak puts received */
    result->post_status = post;
    result->wait_status = wait;
    result->flush_status = flush;
    result->signal_seen = seen;
    result->iterations = i;
    result->failed_at = i;
    result->sent_hash = sent;
    result->recv_hash = recv;
    result->mismatches = bad;
    result->elapsed_ns = epx_net_now_ns() - start;
    __threadfence_system();
    result->done = 1;
}

/* One thread. Weak cover: a plain put of GIN_WRONG_BYTES to the right, a WEAK signal to it that covers
 * nothing, the wait for the left's, the count of the left's bytes not there yet, an acknowledgement to the
 * left, the wait for the right's, then the flush (the put lands by then in every mode). Strong other peer:
 * the same put, then a STRONG signal to the left, which covers only puts to the left; a rank that sees its
 * right's relays it to the right's right, which counts the bytes of its left (the put the strong signal was
 * read as covering), acknowledges, and the sender flushes after its right's acknowledgement. */
__global__ void gin_wrong_kernel(epx_net_t net, gin_wrong_args_t a, gin_kernel_result_t *result)
{
    const uint64_t start = epx_net_now_ns(), deadline = start + a.timeout_ns;
    const bool weak = a.kind == GIN_WRONG_WEAK_COVER;
    const uint32_t sig = weak ? GIN_SIG_WRONG : GIN_SIG_STRONG2,
                   ack = weak ? GIN_SIG_WRONG_ACK : GIN_SIG_ACK2;
    epx_net_status_t post = epx_net_put(&net, 0, a.right, GIN_DST, 0, GIN_SRC, 0, GIN_WRONG_BYTES);
    if (post == EPX_NET_OK)
        post = epx_net_signal_add(&net, 0, weak ? a.right : a.left, sig, 1,
                                  weak ? EPX_NET_SIGNAL_WEAK : EPX_NET_SIGNAL_STRONG);
    epx_net_status_t wait =
        post == EPX_NET_OK ? epx_net_wait_signal(&net, sig, 1, deadline) : EPX_NET_ABORTED;
    if (!weak && wait == EPX_NET_OK) { /* the right's strong signal: relay it to the right's right */
        post = epx_net_signal_add(&net, 0, a.right2, GIN_SIG_RELAY, 1, EPX_NET_SIGNAL_WEAK);
        wait = post == EPX_NET_OK ? epx_net_wait_signal(&net, GIN_SIG_RELAY, 1, deadline) : EPX_NET_ABORTED;
    }
    uint64_t stale = 0;
    if (wait == EPX_NET_OK) {
        for (uint64_t k = 0; k < GIN_WRONG_BYTES; k++)
            stale += load_landed(a.dst + k) != gin_pattern_byte(a.seed, a.left, a.round, k);
        post = epx_net_signal_add(&net, 0, a.left, ack, 1, EPX_NET_SIGNAL_WEAK);
        if (post == EPX_NET_OK) wait = epx_net_wait_signal(&net, ack, 1, deadline);
    }
    result->post_status = post;
    result->wait_status = wait;
    result->flush_status = epx_net_flush(&net, 0, deadline);
    result->mismatches = stale;
    result->elapsed_ns = epx_net_now_ns() - start;
    __threadfence_system();
    result->done = 1;
}

__global__ void gin_wait_kernel(epx_net_t net, uint64_t timeout_ns, gin_kernel_result_t *result)
{
    const uint64_t start = epx_net_now_ns();
    result->wait_status = epx_net_wait_signal(&net, GIN_SIG_NEVER, 1, start + timeout_ns);
    uint64_t seen = 0;
    epx_net_signal_read(&net, GIN_SIG_NEVER, &seen);
    result->signal_seen = seen;
    result->elapsed_ns = epx_net_now_ns() - start;
    __threadfence_system();
    result->done = 1;
}

extern "C" int gin_launch_ring(const epx_net_t *net, void *stream, const gin_ring_args_t *args,
                               gin_kernel_result_t *result)
{
    gin_ring_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(*net, *args, result);
    return (int)cudaGetLastError();
}

extern "C" int gin_launch_soak(const epx_net_t *net, void *stream, const gin_soak_args_t *args,
                               gin_kernel_result_t *result)
{
    gin_soak_kernel<<<1, SOAK_THREADS, 0, (cudaStream_t)stream>>>(*net, *args, result);
    return (int)cudaGetLastError();
}

extern "C" int gin_launch_wrong(const epx_net_t *net, void *stream, const gin_wrong_args_t *args,
                                gin_kernel_result_t *result)
{
    gin_wrong_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(*net, *args, result);
    return (int)cudaGetLastError();
}

extern "C" int gin_launch_wait(const epx_net_t *net, void *stream, uint64_t timeout_ns, gin_kernel_result_t *result)
{
    gin_wait_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(*net, timeout_ns, result);
    return (int)cudaGetLastError();
}
