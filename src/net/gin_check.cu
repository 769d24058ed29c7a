/*
 * Compiles the GIN transport (src/net/gin.cuh) through net.h's operations in device code (built only
 * when CUDA and NCCL are found, with EPX_NET_HAVE_GIN; linked into nothing). Compiled, not run: the
 * kernel needs a device communicator with a GIN backend. It records each call's status, and the
 * handle it is given decides the transport, so a GIN handle takes every GIN path here.
 */
#ifndef EPX_NET_HAVE_GIN
#error "gin_check.cu needs -DEPX_NET_HAVE_GIN and NCCL's headers"
#endif

#include "net/net.h"

#ifndef EPX_NET_GIN_DEVICE
#error "net.h did not take in the GIN transport"
#endif

/* One thread posts on context 0 and 1, reads and waits on a signal, flushes both contexts. Region 0
 * is the source, region 1 the destination, on every rank. */
__global__ void epx_net_gin_check_kernel(epx_net_t net, int peer, uint64_t timeout_ns, int *status_out,
                                         uint64_t *signal_out)
{
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const uint64_t deadline = epx_net_now_ns() + timeout_ns;
    int s = epx_net_put(&net, 0, peer, 1, 0, 0, 0, 256);
    s |= epx_net_put_signal(&net, 0, peer, 1, 256, 0, 256, 256, 0, 1, EPX_NET_SIGNAL_STRONG) << 3;
    s |= epx_net_put_signal(&net, 1, peer, 1, 512, 0, 512, 256, 1, 1, EPX_NET_SIGNAL_WEAK) << 6;
    s |= epx_net_signal_add(&net, 1, peer, 2, 3, EPX_NET_SIGNAL_STRONG) << 9;
    s |= epx_net_signal_add(&net, 0, peer, 2, 4, EPX_NET_SIGNAL_WEAK) << 12;
    uint64_t v = 0;
    s |= epx_net_signal_read(&net, 2, &v) << 15;
    s |= epx_net_wait_signal(&net, 0, 1, deadline) << 18;
    s |= epx_net_flush(&net, 0, deadline) << 21;
    s |= epx_net_flush(&net, 1, deadline) << 24;
    s |= epx_net_aborted(&net) << 27;
    *status_out = s;
    *signal_out = v;
}
