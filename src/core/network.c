/*
 * The network engine as this build has it: the NCCL version the discovery found (EPX_HAVE_NCCL,
 * EPX_NCCL_MAJOR/MINOR/PATCH/VERSION_CODE from the build) and the message a caller gets when it
 * asks for ranks on other nodes of a backend that cannot reach them.
 */
#include <stdio.h>
#include <string.h>

#include "core/network.h"

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
    /* NCCL is found but nothing drives it yet: no GIN transport in this version. */
    info->network = 0;
}

const char *epx_net_gin_unavailable(char *why, size_t n)
{
    if (n == 0) return why;
#ifdef EPX_HAVE_NCCL
    snprintf(why, n,
             "built with NCCL " EPX_NET_NCCL_VERSION ", but the GIN network transport is not built yet");
#else
    snprintf(why, n,
             "built without NCCL: install NCCL >= 2.28 (pip install nvidia-nccl-cu13, or point "
             "EPX_NCCL_HOME at an NCCL install) and rebuild");
#endif
    return why;
}
