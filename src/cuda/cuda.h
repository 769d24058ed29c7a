/*
 * Host-side internals of the cuda backend: per-buffer state (registered region, peer mappings,
 * host-mapped block, epochs), per-handle state and the operation runner. Internal to libepx (not
 * exported); the benchmark hooks in src/bench call some of it through the static library.
 */
#ifndef EPX_CUDA_CUDA_H
#define EPX_CUDA_CUDA_H

#include <pthread.h>

#include "core/internal.h"
#include "cuda/ipc_plan.h"
#include "kernels/contract.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Per-handle device state: one slab of the buffer's handle pool, carved for the handle's kind. */
typedef struct cuda_handle {
    epx_handle_kind_t kind; /* EPX_HANDLE_HT or EPX_HANDLE_RM: the member of dev, the free list */
    int32_t no_host_wait;   /* dispatched without a host wait (HT static mode, routing map with a
                               bound): its combine reports device errors through the poller too */
    int32_t has_probs;      /* routing map: probs were given at dispatch */
    uint64_t seq;           /* the dispatch call that made it (its low byte is in combine's call word) */
    union {
        epx_cuda_handle_dev_t ht;
        epx_cuda_rm_handle_dev_t rm;
    } dev;
    void *slab;
    struct cuda_handle *next_free;
} cuda_handle_t;

typedef struct cuda_buffer {
    epx_buffer_t buffer;
    int32_t device;
    uint8_t *region;                       /* ours, exported (src/cuda/ipc.c) */
    uint8_t *peers[EPX_CUDA_MAX_RANKS];    /* mapped regions (peers[rank] == region) */
    int32_t peer_opened[EPX_CUDA_MAX_RANKS];
    int32_t ipc_kind;                      /* EPX_CUDA_IPC_*: how the regions are exported and mapped */
    int32_t ipc_fd;                        /* our exported descriptor until the peers have it, else -1 */
    uint64_t ipc_bytes;                    /* bytes of each region mapping (the allocation's size) */
    uint8_t ipc_fabric[64];                /* our fabric handle (EPX_CUDA_IPC_FABRIC) */
    epx_cuda_layout_t lay;
    epx_cuda_host_block_t *host;           /* host view of the mapped block */
    epx_cuda_host_block_t *host_dev;       /* its device pointer */
    int32_t num_blocks;
    uint64_t epoch;                        /* collectives launched (device epochs follow) */
    void *event;                           /* cudaEvent_t after the last operation */
    void *internal_stream;                 /* cudaStream_t for the failure path */
    pthread_mutex_t lock;                  /* handle pool, reported_epoch */
    cuda_handle_t *free_handles[2];        /* handle pool: HT slabs, routing-map slabs */
    cuda_handle_t *retired[2];             /* freed handles whose slabs kernels may still read */
    int32_t num_retired;
    uint64_t reported_epoch;               /* last device error reported to the comm */
    pthread_t poller;                      /* the watcher (src/cuda/watch.c) */
    int32_t poller_running;
    atomic_int poller_stop;
    epx_peers_t procs;                     /* the peers' processes, watched by the poller */
    void *watch_stream;                    /* cudaStream_t of the poller's fail-word copies */
    _Atomic uint64_t dead_mask;            /* bit r: peer r's process exited */
    _Atomic uint64_t dead_at_ns;           /* when the poller first saw a peer gone (0: never) */
    void *ll;                              /* LL state (src/cuda/ll.c), NULL without EPX_MODE_LL */
    unsigned long long *ll_stamps;         /* the benchmark's LL timeline (device), NULL: off */
    struct cuda_buffer *next_live;         /* the process's live buffers (src/cuda/backend.c) */
} cuda_buffer_t;

/* The ipc transport's memory (src/cuda/ipc.c; its kinds and plan: src/cuda/ipc_plan.h). */
/* Chooses the kind (EPX_CUDA_IPC and every rank's device, agreed) and allocates our region (collective;
 * cb->lay.total bytes at least). */
epx_result_t epx_cuda_ipc_alloc(cuda_buffer_t *cb);
/* Maps every peer's region into cb->peers (collective, agreed); on failure nothing stays mapped. Under
 * EPX_CUDA_IPC=auto a failed virtual-memory mapping starts over with legacy handles (a new, cleared
 * cb->region). */
epx_result_t epx_cuda_ipc_map_peers(cuda_buffer_t *cb);
void epx_cuda_ipc_unmap_peers(cuda_buffer_t *cb);
/* Frees our region (and an export not yet handed out). */
void epx_cuda_ipc_free(cuda_buffer_t *cb);
/* Whether EPX_CUDA_IPC asks for fabric handles (a domain may then span hosts). */
int epx_cuda_ipc_asks_fabric(void);

/* Device, transport, error poller and handle pool (src/cuda/backend.c). */
/* Converts a cudaError_t into an epx error naming `what` (EPX_SUCCESS for cudaSuccess). */
epx_result_t epx_cuda_check(int err, const char *what, int rank);
/* Reports the device error record when its epoch is >= min_epoch (once to the comm's async
 * error); returns its code, also as the thread's error when set_thread_error. */
epx_result_t epx_cuda_report_record(cuda_buffer_t *cb, uint64_t min_epoch, int set_thread_error);
/* Fills the arguments every collective kernel shares. */
void epx_cuda_fill_common(cuda_buffer_t *cb, epx_cuda_common_t *c);
/* A handle slab of `kind` from the pool, or a new one (also while the caller captures); outside
 * capture (`capturing` 0) the pool is topped up to one spare. */
epx_result_t epx_cuda_handle_get(cuda_buffer_t *cb, epx_handle_kind_t kind, int capturing, cuda_handle_t **out);

/* Watcher thread (src/cuda/watch.c): device error records to the comm's async error, and peers
 * whose process exited (fail word ~0 in our own ctrl, EPX_ERR_REMOTE "peer N (pid P) exited"). */
epx_result_t epx_cuda_watch_start(cuda_buffer_t *cb);
void epx_cuda_watch_stop(cuda_buffer_t *cb);
/* The lowest peer whose process the watcher saw exit, or -1. */
int epx_cuda_dead_peer(cuda_buffer_t *cb);

/* Operation runner (src/cuda/op.c). An operation is one backend call on the caller's stream: its
 * collective kernel takes the next epoch; after its last launch the buffer's event is recorded
 * (not under capture, where the graph orders its replays). */
typedef struct epx_cuda_op {
    cuda_buffer_t *cb;
    uint64_t seq;   /* collective call number; 0: not collective (layout, hook), never refused */
    void *stream;
    int capturing;  /* `stream` is being captured */
    uint64_t mark;  /* epoch of the device error record before the call (0: none) */
    uint64_t epoch; /* host epoch taken by the call's collective kernel (0: not queued yet) */
} epx_cuda_op_t;

/* Starts an operation: capture state, error mark and device (a failure to set it is refused).
 * The mark: the device records an epoch only above every recorded one, so a record above it
 * belongs to the call or to work queued before it. The host's epoch would not do: graph replays
 * advance the device's epochs without the host, and a captured call the host's alone. */
epx_result_t epx_cuda_op_begin(epx_cuda_op_t *op, epx_buffer_t buffer, uint64_t seq, void *stream);
/* A failure before the call's collective kernel was queued: tells the peers (they return
 * EPX_ERR_REMOTE instead of waiting out the timeout), keeps the epochs in step, returns `res`. */
epx_result_t epx_cuda_op_refuse(const epx_cuda_op_t *op, epx_result_t res);
/* After a launch that returned `err` (a cudaError_t): a failure is refused while the call's
 * collective kernel is not queued; the first success takes the epoch. No event (a send half). */
epx_result_t epx_cuda_op_sent(epx_cuda_op_t *op, int err, const char *what);
/* The same for the call's last launch, then the event. */
epx_result_t epx_cuda_op_launched(epx_cuda_op_t *op, int err, const char *what);
/* Records the buffer's last-operation event on the stream (not under capture). */
epx_result_t epx_cuda_op_record(const epx_cuda_op_t *op);
/* Waits for the operation, then returns the device error recorded since the mark, if any. */
epx_result_t epx_cuda_op_wait(const epx_cuda_op_t *op, const char *what);
/* Waits (bounded by the comm's timeout) for the buffer's last operation. */
epx_result_t epx_cuda_wait_event(cuda_buffer_t *cb, const char *what);
/* Tells the peers that this rank fails collective call `seq` (launches the fail kernel after our
 * earlier work); legal while the caller's stream is being captured when `capturing` says so.
 * Sets no thread error, so the caller's message stays. */
void epx_cuda_tell_peers(cuda_buffer_t *cb, uint64_t seq, epx_result_t res, int capturing);
/* Whether `stream` is being captured into a CUDA graph; `if_unknown` when the query fails (a
 * stream that cannot be queried, e.g. the legacy stream during another stream's global capture). */
int epx_cuda_stream_capturing(void *stream, int if_unknown);
/* When the device found an invalid topk_idx entry (a standalone layout), formats "rank r:
 * topk_idx[t][k] = v is out of range ..." into msg, clears the record if `clear`, returns 1. */
int epx_cuda_bad_topk(cuda_buffer_t *cb, char *msg, size_t cap, int clear);

/* HT operations (src/cuda/ht.c). */
epx_result_t epx_cuda_layout(epx_buffer_t buffer, const epx_tensor_t *topk_idx, epx_layout_outputs_t *outputs,
                             void *stream);
epx_result_t epx_cuda_ht_dispatch(epx_buffer_t buffer, uint64_t seq, const epx_ht_dispatch_args_t *args,
                                  epx_ht_dispatch_outputs_t *outputs, epx_handle_t handle);
epx_result_t epx_cuda_ht_combine(epx_buffer_t buffer, uint64_t seq, const epx_ht_combine_args_t *args,
                                 epx_ht_combine_outputs_t *outputs);
/* [rows, H] bf16 view of our comb_x area (rows: the handle's N_r or num_worst_tokens). */
epx_result_t epx_cuda_ht_get_combine_input(epx_buffer_t buffer, epx_handle_t handle, epx_tensor_t *view_out);

/* LL operations (src/cuda/ll.c). */
/* Bytes of the LL areas of a buffer (0 without EPX_MODE_LL); compute_layout places them at lay.ll. */
uint64_t epx_cuda_ll_bytes(epx_buffer_t buffer);
epx_result_t epx_cuda_ll_init(cuda_buffer_t *cb);
void epx_cuda_ll_fini(cuda_buffer_t *cb);
/* Across nodes: ends every wait of the LL kernels on the network transport (a peer gone, teardown). */
void epx_cuda_ll_abort(cuda_buffer_t *cb);
/* Across nodes: the transport's own look at the peers (never blocks); EPX_ERR_REMOTE once one is gone (the
 * transport's waits then end). EPX_SUCCESS without a transport. */
epx_result_t epx_cuda_ll_poll(cuda_buffer_t *cb);
/* Called by epx_cuda_tell_peers before the epoch of the failed call is closed. */
void epx_cuda_ll_on_fail(cuda_buffer_t *cb, void *stream);
epx_result_t epx_cuda_ll_dispatch(epx_buffer_t buffer, uint64_t seq, const epx_ll_dispatch_args_t *args,
                                  epx_ll_dispatch_outputs_t *outputs);
epx_result_t epx_cuda_ll_combine(epx_buffer_t buffer, uint64_t seq, const epx_ll_combine_args_t *args,
                                 epx_ll_combine_outputs_t *outputs);
/* The arguments every LL kernel of `slot` shares (the buffer has LL state). */
void epx_cuda_ll_fill(cuda_buffer_t *cb, int slot, epx_cuda_ll_args_t *a);
/* The dispatch fields of an LL kernel's arguments (what the send half reads of `args`). */
void epx_cuda_ll_dispatch_args(const epx_ll_dispatch_args_t *args, epx_cuda_ll_args_t *a);
/* The handle must name the dispatch that still owns its slot, with its receive half launched. */
epx_result_t epx_cuda_ll_check_handle(cuda_buffer_t *cb, const epx_ll_handle_t *handle, const char *what);
/* Our zero-copy combine input of `slot` ([L][R*T_max][H] bf16). */
void *epx_cuda_ll_zc_ptr(cuda_buffer_t *cb, int slot);
epx_result_t epx_cuda_ll_get_combine_buffer(epx_buffer_t buffer, const epx_ll_handle_t *handle,
                                            epx_tensor_t *view_out);
epx_result_t epx_cuda_hook_run(const epx_hook_t *hook, void *stream);

/* Routing-map operations (src/cuda/rm.c). */
/* Appends the routing-map areas at `off` (buffers with EPX_MODE_PERMUTE); returns the new end. */
uint64_t epx_cuda_rm_layout(epx_buffer_t b, epx_cuda_layout_t *lay, uint64_t off);
epx_result_t epx_cuda_rm_dispatch(epx_buffer_t buffer, uint64_t seq, const epx_rm_dispatch_args_t *args,
                                  epx_rm_dispatch_outputs_t *outputs, epx_handle_t handle);
epx_result_t epx_cuda_rm_combine(epx_buffer_t buffer, uint64_t seq, const epx_rm_combine_args_t *args,
                                 epx_rm_combine_outputs_t *outputs);

#ifdef __cplusplus
}
#endif

#endif /* EPX_CUDA_CUDA_H */
