/*
 * The device half of the GIN host setup (src/net/gin_dev.cu, the one host file that sees NCCL's device
 * types): the device communicator and the handle's state in device memory. Called by src/net/gin_host.c
 * only; plain C, no NCCL types (an ncclComm_t or ncclWindow_t travels as void *). Results are NCCL's or
 * CUDA's own codes; the caller turns them into epx errors.
 */
#ifndef EPX_NET_GIN_DEV_H
#define EPX_NET_GIN_DEV_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct epx_gin_dev epx_gin_dev_t;

/* What the device communicator holds, as NCCL made it. */
typedef struct epx_gin_dev_counts {
    int32_t rank, nranks;
    int32_t contexts, signals, counters;
    int32_t gin_type; /* backend of context 0 (NCCL_NET_DEVICE_GIN_*), -1 without contexts */
} epx_gin_dev_counts_t;

/* Allocates the state (*out; NULL and ncclSystemError when out of host memory) and starts
 * ncclDevCommCreate with GIN forced, `contexts` (a hint), `signals` and `counters`. On a non-blocking
 * communicator NCCL may answer ncclInProgress: the device communicator is complete once the
 * communicator's asynchronous state leaves ncclInProgress. Returns the ncclResult_t. */
int epx_gin_dev_create(void *nccl_comm, int contexts, int signals, int counters, epx_gin_dev_t **out);
/* The complete device communicator's counts. */
void epx_gin_dev_get_counts(const epx_gin_dev_t *d, epx_gin_dev_counts_t *counts_out);
/* Copies the handle's state (device communicator, `nregions` windows of region_bytes each, signal and
 * counter base 0, posted[ncontexts] zeroed) to device memory and waits for the device (NCCL's own copies
 * run on its streams) at most timeout_ms. [out] impl_out: the device copy for epx_net_t.impl. Returns the
 * cudaError_t (cudaErrorTimeout past the deadline). */
int epx_gin_dev_publish(epx_gin_dev_t *d, uint32_t ncontexts, int nregions, void *const *windows,
                        const uint64_t *region_bytes, int64_t timeout_ms, void **impl_out);
/* Starts ncclDevCommDestroy when the device communicator was created (ncclSuccess otherwise); may
 * answer ncclInProgress like create. Returns the ncclResult_t. */
int epx_gin_dev_destroy(void *nccl_comm, epx_gin_dev_t *d);
/* Frees the device copies and the state (after destroy, or after the communicator's abort). */
void epx_gin_dev_free(epx_gin_dev_t *d);

#ifdef __cplusplus
}
#endif

#endif
