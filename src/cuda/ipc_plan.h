/*
 * The ipc transport's plan (src/cuda/ipc.c): from every rank's record, the kind of export all ranks
 * take and the size each region mapping has. Pure and free of CUDA, so that every rank computes the
 * same plan from the same allgathered records, and the unit tests check it without a GPU.
 */
#ifndef EPX_CUDA_IPC_PLAN_H
#define EPX_CUDA_IPC_PLAN_H

#include <stdint.h>

#include "core/internal.h"

/* Kinds of export (EPX_CUDA_IPC's values; 0 in `asked` = auto). */
enum { EPX_CUDA_IPC_AUTO = 0, EPX_CUDA_IPC_LEGACY = 1, EPX_CUDA_IPC_FD = 2, EPX_CUDA_IPC_FABRIC = 3 };
/* Capability bits of a rank's device (virtual memory exported as fd or fabric handles). */
enum { EPX_CUDA_IPC_CAN_FD = 1, EPX_CUDA_IPC_CAN_FABRIC = 2 };

/* What each rank tells the others before choosing. gran, gran_fabric: its device's recommended
 * granularity for regions exported as fd and as fabric handles (0: unknown); pid_ns and net_ns: its
 * namespaces' identities (the fd exchange's abstract sockets and SO_PEERCRED pids need one of each for
 * all ranks). */
typedef struct epx_cuda_ipc_rec {
    int32_t can, asked;
    uint64_t total, gran, gran_fabric, pid_ns, net_ns;
} epx_cuda_ipc_rec_t;

static inline const char *epx_cuda_ipc_kind_name(int kind)
{
    switch (kind) {
    case EPX_CUDA_IPC_LEGACY: return "legacy";
    case EPX_CUDA_IPC_FD: return "fd";
    case EPX_CUDA_IPC_FABRIC: return "fabric";
    }
    return "auto";
}

/* Rank `me`'s plan from all[R] (all[me] is its own record): the kind (auto: fd where every rank can and
 * all share their namespaces, else legacy) and the mapped bytes (the region size rounded up to the
 * largest granularity of all ranks for the chosen kind's handles, 2 MiB when none is known; the legacy
 * kind maps the size itself).
 * EPX_ERR_MISMATCH when the ranks disagree on the region size or on EPX_CUDA_IPC, EPX_ERR_UNSUPPORTED
 * when a named kind is one some rank cannot use (`missing`: a driver call this rank lacks, or NULL). */
static inline epx_result_t epx_cuda_ipc_plan(int me, int R, const epx_cuda_ipc_rec_t *all, const char *missing,
                                             int *kind_out, uint64_t *bytes_out)
{
    const epx_cuda_ipc_rec_t *mine = &all[me];
    int can = EPX_CUDA_IPC_CAN_FD | EPX_CUDA_IPC_CAN_FABRIC, lacks_fd = -1, lacks_fabric = -1;
    uint64_t gran = 0, gran_fabric = 0;
    for (int r = 0; r < R; r++) {
        int c = all[r].can;
        if (all[r].pid_ns != mine->pid_ns || all[r].net_ns != mine->net_ns) c &= ~EPX_CUDA_IPC_CAN_FD;
        if (all[r].total != mine->total)
            return epx_error(EPX_ERR_MISMATCH, "rank %d: rank %d's region is %llu bytes, ours %llu", me, r,
                             (unsigned long long)all[r].total, (unsigned long long)mine->total);
        if (all[r].asked != mine->asked)
            return epx_error(EPX_ERR_MISMATCH, "rank %d: EPX_CUDA_IPC differs between the ranks (rank %d: %s, ours: %s)",
                             me, r, epx_cuda_ipc_kind_name(all[r].asked), epx_cuda_ipc_kind_name(mine->asked));
        /* Granularities are powers of two: the largest is a multiple of every other. */
        if (all[r].gran > gran) gran = all[r].gran;
        if (all[r].gran_fabric > gran_fabric) gran_fabric = all[r].gran_fabric;
        if (lacks_fd < 0 && !(c & EPX_CUDA_IPC_CAN_FD)) lacks_fd = r;
        if (lacks_fabric < 0 && !(c & EPX_CUDA_IPC_CAN_FABRIC)) lacks_fabric = r;
        can &= c;
    }
    const int asked = mine->asked;
    const int kind = asked == EPX_CUDA_IPC_AUTO ? (can & EPX_CUDA_IPC_CAN_FD ? EPX_CUDA_IPC_FD : EPX_CUDA_IPC_LEGACY)
                                                : asked;
    if ((kind == EPX_CUDA_IPC_FD && !(can & EPX_CUDA_IPC_CAN_FD)) ||
        (kind == EPX_CUDA_IPC_FABRIC && !(can & EPX_CUDA_IPC_CAN_FABRIC)))
        return epx_error(EPX_ERR_UNSUPPORTED,
                         "rank %d: EPX_CUDA_IPC=%s, but rank %d cannot use it (a device without virtual memory "
                         "exported as %s handles%s%s%s); use EPX_CUDA_IPC=auto or legacy",
                         me, epx_cuda_ipc_kind_name(kind), kind == EPX_CUDA_IPC_FABRIC ? lacks_fabric : lacks_fd,
                         kind == EPX_CUDA_IPC_FABRIC ? "fabric" : "POSIX file descriptor",
                         kind == EPX_CUDA_IPC_FD ? ", or ranks in different pid or network namespaces" : "",
                         missing ? "; this rank's driver lacks " : "", missing ? missing : "");
    if (kind == EPX_CUDA_IPC_LEGACY) {
        *bytes_out = mine->total;
    } else {
        if (kind == EPX_CUDA_IPC_FABRIC) gran = gran_fabric;
        if (!gran) gran = 2u << 20;
        *bytes_out = (mine->total + gran - 1) / gran * gran;
    }
    *kind_out = kind;
    return EPX_SUCCESS;
}

#endif
