/*
 * The network engine as this build has it: the NCCL version the discovery found (EPX_HAVE_NCCL,
 * EPX_NCCL_MAJOR/MINOR/PATCH/VERSION_CODE from the build), whether the GIN host setup
 * (src/net/gin_host.c, EPX_HAVE_GIN_HOST: NCCL and the cuda backend) is built, the message a caller
 * gets when it asks for ranks on other nodes of a backend that cannot reach them, and the GIN host
 * calls' argument checks (and their refusal in a build without the host setup).
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "core/network.h"
#include "net/gin_host.h"

#define EPX_NET_STR2_(x) #x
#define EPX_NET_STR_(x)  EPX_NET_STR2_(x)

#ifdef EPX_HAVE_NCCL
#define EPX_NET_NCCL_VERSION \
    EPX_NET_STR_(EPX_NCCL_MAJOR) "." EPX_NET_STR_(EPX_NCCL_MINOR) "." EPX_NET_STR_(EPX_NCCL_PATCH)
#endif

void epx_net_build_info(epx_build_info_t *info)
{
#ifdef EPX_HAVE_NCCL
    info->nccl = 1;
    info->nccl_version_code = EPX_NCCL_VERSION_CODE;
    snprintf(info->nccl_version, sizeof(info->nccl_version), "%s", EPX_NET_NCCL_VERSION);
#else
    info->nccl = 0;
    info->nccl_version_code = 0;
    memset(info->nccl_version, 0, sizeof(info->nccl_version));
#endif
    /* The GIN host setup may be built (EPX_HAVE_GIN_HOST) and the LL kernels across nodes use it, but they
     * have not passed over GIN yet (docs/network.md) and HT and the routing map have no kernels across
     * nodes: `network` stays 0 until a transport carries every mode. */
    info->network = 0;
}

const char *epx_net_gin_unavailable(char *why, size_t n)
{
    if (n == 0) return why;
#if defined(EPX_HAVE_GIN_HOST)
    snprintf(why, n,
             "built with NCCL " EPX_NET_NCCL_VERSION
             " and its GIN host setup, which the LL kernels across nodes "
             "use (EPX_NET_TRANSPORT=gin); HT and routing-map kernels across nodes are not built yet");
#elif defined(EPX_HAVE_NCCL)
    snprintf(
        why, n,
        "built with NCCL " EPX_NET_NCCL_VERSION " but without the cuda backend, which the GIN host setup "
        "and the LL kernels across nodes need (HT and routing-map kernels across nodes are not built yet)");
#else
    snprintf(why, n,
             "built without NCCL: install NCCL >= 2.28 (pip install nvidia-nccl-cu13, or point "
             "EPX_NCCL_HOME at an NCCL install) and rebuild");
#endif
    return why;
}

epx_result_t epx_net_status_error(int rank, int status, const char *what, int64_t timeout_ms)
{
    switch ((epx_net_status_t)status) {
    case EPX_NET_OK: return EPX_SUCCESS;
    case EPX_NET_TIMEOUT:
        return epx_error(EPX_ERR_TIMEOUT, "rank %d: %s passed its deadline (%lld ms) with every peer alive",
                         rank, what, (long long)timeout_ms);
    case EPX_NET_ABORTED:
        return epx_error(EPX_ERR_TIMEOUT, "rank %d: %s ended by the abort word (set on this rank)", rank,
                         what);
    case EPX_NET_INVALID:
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d: %s: an argument out of the handle's range", rank,
                         what);
    default:
        return epx_error(EPX_ERR_INTERNAL, "rank %d: %s ended with %s", rank, what,
                         epx_net_status_name((epx_net_status_t)status));
    }
}

epx_result_t epx_net_check_shape(int rank, const char *call, int nregions, const uint64_t *region_bytes,
                                 int max_regions, int contexts, int max_contexts, int nsignals)
{
    if (nregions < 1 || nregions > max_regions)
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d: %s: nregions %d is outside [1, %d]", rank, call,
                         nregions, max_regions);
    for (int i = 0; i < nregions; i++)
        if (region_bytes[i] == 0)
            return epx_error(EPX_ERR_INVALID_ARG, "rank %d: %s: region_bytes[%d] is 0", rank, call, i);
    if (contexts < 1)
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d: %s: contexts %d is below 1", rank, call, contexts);
    if (contexts > max_contexts)
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d: %s: contexts %d is above %d", rank, call, contexts,
                         max_contexts);
    if (nsignals < 1)
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d: %s: nsignals %d is below 1", rank, call, nsignals);
    return EPX_SUCCESS;
}

epx_result_t epx_gin_check_args(epx_comm_t comm, const epx_gin_open_args_t *args, epx_gin_t **out)
{
    EPX_CHECK(epx_comm_check(comm, "epx_gin_open"));
    const int rank = comm->rank;
    if (!args) return epx_error(EPX_ERR_INVALID_ARG, "rank %d: epx_gin_open: args is NULL", rank);
    if (!out) return epx_error(EPX_ERR_INVALID_ARG, "rank %d: epx_gin_open: out is NULL", rank);
    /* NCCL decides how many contexts it gives: any wish of 1 or more is taken. */
    return epx_net_check_shape(rank, "epx_gin_open", args->nregions, args->region_bytes, EPX_GIN_MAX_REGIONS,
                               args->contexts, INT32_MAX, args->nsignals);
}

#ifndef EPX_HAVE_GIN_HOST
/* Without NCCL or the cuda backend there is no GIN host setup: the arguments are checked as in a build
 * that has it, then the call is refused with what the build lacks. */
epx_result_t epx_gin_open(epx_comm_t comm, const epx_gin_open_args_t *args, epx_gin_t **out)
{
    EPX_CHECK(epx_gin_check_args(comm, args, out));
    char why[256];
    return epx_error(EPX_ERR_UNSUPPORTED, "rank %d: epx_gin_open: %s", comm->rank,
                     epx_net_gin_unavailable(why, sizeof(why)));
}

/* No handle can exist in this build: only NULL reaches here. */
epx_result_t epx_gin_close(epx_gin_t *g)
{
    return g ? epx_error(EPX_ERR_INVALID_ARG, "epx_gin_close: %p is not a GIN handle of this build", (void *)g)
             : EPX_SUCCESS;
}
#endif
