/*
 * The GIN probe's shared declarations: options, one rank's state (communicator, windows, device
 * communicator, the net.h handle), the host setup and teardown stages (setup.cu) that the rounds and the
 * soak (probe.cu) run between. CUDA translation units with NCCL 2.28 headers and EPX_NET_HAVE_GIN only.
 */
#ifndef EPX_GIN_PROBE_PROBE_H
#define EPX_GIN_PROBE_PROBE_H

#ifndef EPX_NET_HAVE_GIN
#error "the GIN probe needs -DEPX_NET_HAVE_GIN and NCCL's headers"
#endif

#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include "harness.h"
#include "net/net.h"

#ifndef EPX_NET_GIN_DEVICE
#error "net.h did not take in the GIN transport"
#endif

#define WINDOW_BYTES  (8ull << 20) /* each of the two windows: region 0 source, region 1 destination */
#define NSIGNALS      3            /* one per signal mode: its cumulative count is the wait target */
#define CONTEXT_HINT  2
#define COUNTERS      4    /* NCCL 2.28's most contexts: one source-read counter each */
#define HOST_GRACE_MS 5000 /* past the kernel's own deadline before the host sets the abort word */

typedef struct probe_opts {
    int nranks, iterations, stage_timeout_s, kernel_timeout_ms, devcomm_first, no_plugin;
    const char *plugin;
} probe_opts_t;

/* What one round's kernel did, written to mapped host memory at its end. */
typedef struct kernel_result {
    int32_t post_status, wait_status, flush_status;
    uint32_t ops_posted;
    unsigned long long signal_before, signal_seen, elapsed_ns; /* our signal at the start and the end */
    volatile uint32_t done;
} kernel_result_t;

typedef struct rank_state {
    const probe_opts_t *o;
    int rank, nranks, peer, from; /* puts go to peer (rank + 1), signals come from `from` (rank - 1) */
    int failed, kernel_stuck;
    cudaStream_t stream;
    int32_t *abort_host, *abort_dev;
    kernel_result_t *res_host, *res_dev;
    unsigned char *h_src, *h_expect, *h_got; /* pinned, WINDOW_BYTES each */
    ncclComm_t comm;
    void *buf[2];
    ncclWindow_t win[2];
    int nbuf, nwin, have_dev;
    ncclDevComm dev;
    epx_net_gin_t *g_dev;
    unsigned long long *posted;
    epx_net_t net;
    uint64_t expected_signal[NSIGNALS];
} rank_state_t;

/* Environment, CUDA, unique id, communicator, plugin check, windows and device communicator (in the order
 * the options ask), the net.h handle: each its own stage. 1 when every fatal stage passed. */
int probe_setup(probe_t *p, rank_state_t *s);
/* docs/network.md's teardown order, each step its own stage, bounded by the watchdog. */
void probe_teardown(probe_t *p, rank_state_t *s);

#endif
