/*
 * What the build found of the network engine (NCCL's GPU-initiated networking, found by
 * cmake/EpxNccl.cmake) and what to install when it is missing.
 */
#ifndef EPX_CORE_NETWORK_H
#define EPX_CORE_NETWORK_H

#include <stddef.h>

#include "epx/epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Fills the NCCL and network fields of a build info (nccl, nccl_version_code, nccl_version,
 * network); leaves the others as they are. */
void epx_net_build_info(epx_build_info_t *info);

/* Why this build cannot reach ranks of other nodes, for an error message: what to install when
 * the library was built without NCCL, else that the GIN transport is not built yet. Writes at
 * most n bytes (NUL-terminated when n > 0) and returns why. */
const char *epx_net_gin_unavailable(char *why, size_t n);

/* A kernel's net.h status as an epx error naming `what`, for a transport that found every peer alive
 * (each transport reports a peer gone itself): EPX_SUCCESS for EPX_NET_OK, EPX_ERR_TIMEOUT for
 * EPX_NET_TIMEOUT (naming timeout_ms) and EPX_NET_ABORTED, EPX_ERR_INVALID_ARG for EPX_NET_INVALID,
 * EPX_ERR_INTERNAL for the rest. */
epx_result_t epx_net_status_error(int rank, int status, const char *what, int64_t timeout_ms);

/* The shape a transport's open is asked for, checked alike for every transport: nregions in
 * [1, max_regions], each of its region_bytes > 0, contexts in [1, max_contexts], nsignals >= 1.
 * EPX_ERR_INVALID_ARG naming `call` and the first bad one. */
epx_result_t epx_net_check_shape(int rank, const char *call, int nregions, const uint64_t *region_bytes,
                                 int max_regions, int contexts, int max_contexts, int nsignals);

#ifdef __cplusplus
}
#endif

#endif
