/*
 * Compiles net.h's operations from device code (built only in cuda builds, linked into nothing): the
 * header must stay usable by kernels (the loop transport's device side included); the kernel records
 * what it got.
 */
#include "net/net.h"

__global__ void epx_net_device_check_kernel(epx_net_t net, int *status_out)
{
    int s = epx_net_put(&net, 0, 1, 1, 0, 0, 0, 16);
    s |= epx_net_put_signal(&net, 0, 1, 1, 0, 0, 0, 16, 0, 1, EPX_NET_SIGNAL_STRONG) << 4;
    s |= epx_net_signal_add(&net, 1, 1, 0, 1, EPX_NET_SIGNAL_WEAK) << 8;
    uint64_t v = 0;
    s |= epx_net_signal_read(&net, 0, &v) << 12;
    s |= epx_net_wait_signal(&net, 0, 1, epx_net_now_ns() + 1000000ull) << 16;
    s |= epx_net_flush(&net, 0, epx_net_now_ns() + 1000000ull) << 20;
    s |= epx_net_aborted(&net) << 24;
    *status_out = s;
}
