/*
 * Internal declarations shared by every part of libepx: errors and logging, dtypes, parameters
 * (env), time, and the comm/buffer/handle objects with the backend function table. The backend
 * registry (core/backend.h) comes with it; the bootstrap (core/bootstrap.h) is core's own. Nothing
 * here is exported. Backends are reached only through their function table: the API layer calls
 * the operations, core the communicator's and a failed call's hooks.
 */
#ifndef EPX_CORE_INTERNAL_H
#define EPX_CORE_INTERNAL_H

#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/backend.h"
#include "core/limits.h"
#include "core/numeric.h"
#include "epx/epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- errors and logging ---- */

/* Records `res` with a formatted detail as the calling thread's last error, logs it at warn
 * level, and returns `res`. The first place that detects an error calls this; callers only
 * propagate. */
epx_result_t epx_error(epx_result_t res, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Clears the calling thread's last error (the API layer does it on entry). */
void epx_error_clear(void);
/* Copies the thread's last message into dst (for async error records). */
void epx_error_copy(char *dst, size_t cap);
/* Sets the thread's last message verbatim (no logging). */
void epx_error_set_message(const char *msg);
/* The thread's last message ("" when none). */
const char *epx_error_message(void);
/* A result's name without prefix ("ERR_TIMEOUT") and its description ("timed out ..."), from the
 * one table in epx.h; never NULL. */
const char *epx_result_str(epx_result_t result);
const char *epx_result_text(epx_result_t result);
/* Whether `code` is one of epx_result_t's failures (not EPX_SUCCESS, not a value outside the enum). */
bool epx_result_is_failure(int32_t code);

/* In order: EPX_DEBUG's names index them. */
typedef enum epx_log_level {
    EPX_LOG_NONE = 0,
    EPX_LOG_ERROR,
    EPX_LOG_WARN,
    EPX_LOG_INFO,
    EPX_LOG_TRACE,
} epx_log_level_t;

/* Subsystems for EPX_DEBUG_SUBSYS. */
#define EPX_SUBSYS_INIT 0x1u
#define EPX_SUBSYS_BOOTSTRAP 0x2u
#define EPX_SUBSYS_SHM 0x4u
#define EPX_SUBSYS_IPC 0x8u
#define EPX_SUBSYS_HT 0x10u
#define EPX_SUBSYS_LL 0x20u
#define EPX_SUBSYS_PERMUTE 0x40u
#define EPX_SUBSYS_API 0x80u
#define EPX_SUBSYS_ALL 0xffffffffu

extern int epx_log_level_g;          /* current level; set from EPX_DEBUG */
extern unsigned epx_log_subsys_g;    /* mask; set from EPX_DEBUG_SUBSYS */
extern int epx_log_rank_g;           /* rank prefix for messages, -1 before a comm exists */
void epx_log_write(epx_log_level_t level, unsigned subsys, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The level check happens before any formatting. */
#define EPX_LOG(level, subsys, ...)                                                            \
    do {                                                                                       \
        if ((int)(level) <= epx_log_level_g && ((subsys) & epx_log_subsys_g))                  \
            epx_log_write((level), (subsys), __VA_ARGS__);                                     \
    } while (0)
#define EPX_WARN(subsys, ...) EPX_LOG(EPX_LOG_WARN, subsys, __VA_ARGS__)
#define EPX_INFO(subsys, ...) EPX_LOG(EPX_LOG_INFO, subsys, __VA_ARGS__)
#define EPX_TRACE(subsys, ...) EPX_LOG(EPX_LOG_TRACE, subsys, __VA_ARGS__)

/* Propagate a failure from an internal call. */
#define EPX_CHECK(call)                                                                        \
    do {                                                                                       \
        epx_result_t epx_check_res_ = (call);                                                  \
        if (epx_check_res_ != EPX_SUCCESS) return epx_check_res_;                              \
    } while (0)
#define EPX_CHECK_GOTO(call, res, label)                                                       \
    do {                                                                                       \
        (res) = (call);                                                                        \
        if ((res) != EPX_SUCCESS) goto label;                                                  \
    } while (0)

/* -------------------------------------------------------------------------- dtypes ---- */

/* Bytes per element (0 for an unknown dtype) and lowercase name ("invalid" for an unknown one). */
size_t epx_dtype_bytes(epx_dtype_t dtype);
const char *epx_dtype_str(epx_dtype_t dtype);

/* ------------------------------------------------------------------- parameters (env) ---- */

/* Every environment variable of the library, parsed once (src/core/params.c holds the table
 * with names, types, defaults and help). */
typedef struct epx_params {
    int64_t timeout_ms;              /* EPX_TIMEOUT_MS, default 100000 */
    int32_t ranks_per_nvlink_domain; /* EPX_RANKS_PER_NVLINK_DOMAIN, 0 = no cap */
    int32_t host_threads;            /* EPX_HOST_THREADS, 0 = automatic */
    int32_t debug_level;             /* EPX_DEBUG */
    uint32_t debug_subsys;           /* EPX_DEBUG_SUBSYS */
    char bootstrap_addr[128];        /* EPX_BOOTSTRAP_ADDR "ip:port", "" = pick */
    char socket_ifname[64];          /* EPX_SOCKET_IFNAME, "" = any */
    char shm_dir[256];               /* EPX_SHM_DIR, default /dev/shm */
    char node_id[EPX_NODE_ID_MAX];   /* EPX_NODE_ID, "" = the config's or the host's identity */
    int32_t print_env;               /* EPX_PRINT_ENV */
    char cuda_ipc[16];               /* EPX_CUDA_IPC: auto, fd, fabric or legacy (src/cuda/ipc.c) */
    char net_transport[16];          /* EPX_NET_TRANSPORT: "" or loop (src/cuda/ll.c) */
    int32_t net_loop_strict;         /* EPX_NET_LOOP_STRICT */
} epx_params_t;

/* Parses the environment once per process (thread-safe) and returns the parameters, or
 * EPX_ERR_INVALID_ARG naming the variable whose value is malformed (checked again on every
 * call until it is fixed, so a test can set a bad value and see the error). */
epx_result_t epx_params_get(const epx_params_t **params_out);
/* Re-reads the environment (tests only). */
epx_result_t epx_params_reload(void);
/* Prints the table (name, value, default, help) to `out` (a FILE*). */
void epx_params_print(void *out);

/* ----------------------------------------------------------------------------- time ---- */

uint64_t epx_time_ns(void); /* CLOCK_MONOTONIC */
/* SipHash-2-4 of `len` bytes under a 128-bit key (a keyed PRF: the bootstrap's authentication). */
uint64_t epx_siphash24(const unsigned char key[16], const void *data, size_t len);
/* A deadline `timeout_ms` from now. */
static inline uint64_t epx_deadline_after_ms(int64_t timeout_ms)
{
    return epx_time_ns() + (uint64_t)timeout_ms * 1000000ull;
}
/* Sleeps progressively longer as `iteration` grows (spin, yield, then up to ~100 us), for
 * host-side polling loops among more processes than cores. */
void epx_backoff(uint32_t iteration);

/* -------------------------------------------------------------------------- objects ---- */

#define EPX_COMM_MAGIC 0x45505843u   /* "EPXC" */
#define EPX_BUFFER_MAGIC 0x45505842u /* "EPXB" */
#define EPX_HANDLE_MAGIC 0x45505848u /* "EPXH" */

/* Defined in core/bootstrap.h (only core reaches the bootstrap). */
typedef struct epx_bootstrap_ops epx_bootstrap_ops_t;

/* What each rank tells every other at init (fixed size, exchanged by allgather). */
typedef struct epx_peer_info {
    int32_t rank;
    int32_t pid;
    uint64_t host_hash;       /* of the hostname + boot id */
    uint64_t pid_ns;          /* epx_namespace_id("pid"), 0 when unreadable */
    char hostname[64];
    int32_t backend;          /* chosen backend */
    int32_t cuda_device;      /* ordinal, -1 for host */
    char cuda_uuid[16];       /* GPU uuid, zero for host */
    int32_t nranks;           /* as this rank was told */
    char node_id[EPX_NODE_ID_MAX]; /* EPX_NODE_ID, the config's, or the host's identity */
} epx_peer_info_t;

struct epx_comm {
    uint32_t magic;
    int32_t rank;
    int32_t nranks;
    int32_t local_rank;   /* among the ranks of this machine */
    int32_t local_nranks;
    int32_t node;         /* node index (nodes numbered by their lowest rank) */
    int32_t num_nodes;
    int32_t ranks_per_node;
    int32_t node_rank;    /* index among the ranks of this node */
    int32_t ranks_per_domain;
    int32_t num_domains;
    epx_backend_t backend;
    int32_t cuda_device;
    int64_t timeout_ms;
    const epx_bootstrap_ops_t *bootstrap;
    void *bootstrap_state;
    epx_peer_info_t *peers;     /* [nranks] */
    int32_t *agree_words;       /* [nranks] epx_comm_agree's status words, allocated with the comm so
                                 * that no rank stays out of an agreement for want of memory */
    const epx_backend_ops_t *ops;
    void *backend_comm_state;   /* backend's per-comm state (may be NULL) */
    atomic_int live_buffers;
    atomic_int busy;            /* 1 while a thread is inside an entry point on it (src/api) */
    /* First asynchronous error, reported by epx_get_async_error. */
    atomic_int async_result;
    char async_message[512];
};

/* EPX_ERR_INVALID_ARG naming `fn` unless `comm` is a live communicator. */
epx_result_t epx_comm_check(epx_comm_t comm, const char *fn);
/* Builds rank `rank`'s communicator (collective): the backend choice, the bootstrap (the TCP
 * rendezvous of `id`, or `callbacks` when not NULL), the peer exchange and topology, and the
 * backend's comm_init. The arguments and `config` (normalized) were checked by the caller. */
epx_result_t epx_comm_create(int rank, int nranks, const epx_unique_id_t *id,
                             const epx_bootstrap_callbacks_t *callbacks, const epx_comm_config_t *config,
                             epx_comm_t *comm_out);
/* Frees a live communicator that has no buffers left; never waits on a peer. */
void epx_comm_free(epx_comm_t comm);
/* Collectives over the comm's bootstrap (bounded). */
epx_result_t epx_comm_allgather(epx_comm_t comm, const void *send, void *recv, size_t bytes);
epx_result_t epx_comm_barrier(epx_comm_t comm);
/* The peer processes of a buffer, watched for exit (src/core/peers.c). */
typedef struct epx_peers {
    int nranks;
    int *pidfd;   /* [nranks] pidfd of each peer, -1 for ourselves or where pidfds are missing */
    int32_t *pid; /* [nranks] */
} epx_peers_t;
/* Opens a pidfd for every peer of `comm` (once per buffer); epx_peers_close closes them. */
epx_result_t epx_peers_open(epx_peers_t *peers, epx_comm_t comm);
void epx_peers_close(epx_peers_t *peers);
/* 1 when `peer`'s process has exited, reaped or not (a zombie counts as dead); else 0. */
int epx_peer_exited(const epx_peers_t *peers, int peer);
/* Buffer creation's shared steps (src/core/share.c). epx_comm_agree: every rank's outcome of a step
 * (collective): `mine` when it failed, EPX_ERR_REMOTE naming a peer that failed, else success.
 * epx_share_fds: hands our descriptor to every peer and receives theirs into fds[nranks] (collective,
 * agreed; SCM_RIGHTS over abstract Unix sockets; peers known by `peers`' pids, a dead one reported at
 * once, the whole bounded by the comm's timeout); received descriptors are in fds even on failure, -1
 * elsewhere. epx_fault_point: the fault tests' kill point (EPX_TEST_FAULT_SHM "<rank>:<step>"; step 0 is
 * the descriptor exchange's preparation); with "<rank>:<step>:fail" it returns 1 there instead. */
epx_result_t epx_comm_agree(epx_comm_t comm, epx_result_t mine, const char *step);
/* epx_comm_agree, and *settled = 1 when the agreement itself completed: every rank then holds the same
 * verdict, so a failure of the step can be followed by a step all ranks take together (a fallback);
 * 0 when the collective failed (a peer dead or stalled), after which no further collective is tried.
 * Limit: a peer that dies while rank 0 hands out the result can leave the ranks served before it
 * settled and the others not; the former's next step then fails by the timeout, never by a hang. */
epx_result_t epx_comm_agree_settled(epx_comm_t comm, epx_result_t mine, const char *step, int *settled);
/* `ready`: the caller's outcome so far; a failure joins the exchange's first agreement, so that the
 * peers learn of it at once instead of waiting for a rank that never comes (fds may then be NULL). */
epx_result_t epx_share_fds(epx_comm_t comm, const epx_peers_t *peers, int own_fd, int *fds, epx_result_t ready);
int epx_fault_point(int rank, int step);
/* The identity of this process's namespace of `kind` ("pid", "net"): device and inode of
 * /proc/self/ns/<kind>; 0 when unreadable. */
uint64_t epx_namespace_id(const char *kind);
/* Whether the comm's ranks' pid namespaces (peers[].pid_ns, 0 = unknown) allow passing file
 * descriptors checked by pid: EPX_SUCCESS, or EPX_ERR_UNSUPPORTED naming the first rank whose
 * namespace differs from this rank's. The same verdict on every rank; no communication. */
epx_result_t epx_share_check_pid_ns(epx_comm_t comm);
/* Records the first async error of the comm (later ones are dropped); returns `res`. */
epx_result_t epx_comm_set_async_error(epx_comm_t comm, epx_result_t res, const char *message);
/* The first async error (EPX_SUCCESS when none), its message made the thread's last one. */
epx_result_t epx_comm_get_async_error(epx_comm_t comm);

struct epx_buffer {
    uint32_t magic;
    epx_comm_t comm;
    epx_buffer_config_t config;   /* normalized: modes and dtypes filled, defaults applied */
    int32_t num_local_experts;    /* L = E / R */
    const epx_backend_ops_t *ops;
    void *backend_state;
    uint64_t seq;                 /* collective calls made on this buffer (same on all ranks) */
    uint64_t ll_dispatches;       /* LL dispatch calls so far, failed ones included (slot =
                                     (ll_dispatches - 1) % 2 for the current call) */
    atomic_int live_handles;
    atomic_int overflow;          /* set by a bounded call that dropped rows */
    atomic_int busy;              /* 1 while a thread is inside an entry point on it (src/api) */
    /* What each HT view area holds after the last view-mode dispatch into it (src/api/collective.c),
     * for a combine whose x is that dispatch's recv_x (x_in_buffer = 2); x NULL = nothing usable. */
    struct {
        const void *x;
        uint64_t handle_id;
        int64_t rows;
        epx_dtype_t dtype;
    } view_areas[EPX_MAX_VIEW_AREAS];
};

/* This rank failed collective call `seq` on `buffer` before its operation ran: tells the peers
 * through the backend (they return EPX_ERR_REMOTE instead of waiting) and returns `res`, the
 * thread keeping the message of the failure. `stream` is the call's stream as far as its
 * arguments could be read (NULL otherwise); telling the peers never breaks a capture on it. */
epx_result_t epx_buffer_fail_collective(epx_buffer_t buffer, uint64_t seq, epx_result_t res, void *stream);

typedef enum epx_handle_kind {
    EPX_HANDLE_HT = 1,
    EPX_HANDLE_RM = 2,
} epx_handle_kind_t;

struct epx_handle {
    uint32_t magic;
    epx_handle_kind_t kind;
    epx_buffer_t buffer;
    int64_t num_tokens;     /* T of the dispatch on this rank */
    int64_t num_recv;       /* N_r (HT, RM) or P (RM with permute); bound-capped for RM */
    int32_t permute;        /* RM only */
    int32_t is_static;      /* HT: dispatched with num_worst_tokens (num_recv is that bound) */
    epx_dtype_t x_dtype;    /* dtype dispatched */
    uint64_t id;            /* the buffer's sequence number of the dispatch that made it */
    void *backend_state;    /* freed by ops->handle_free */
};

/* The kind of a collective call, announced to the peers when the call starts (ops->begin_call), so
 * that ranks making different calls under one sequence number find out at once. 0 is none. */
typedef enum epx_call_kind {
    EPX_CALL_HT_DISPATCH = 1,
    EPX_CALL_HT_COMBINE,
    EPX_CALL_LL_DISPATCH,
    EPX_CALL_LL_COMBINE,
    EPX_CALL_RM_DISPATCH,
    EPX_CALL_RM_COMBINE,
    EPX_CALL_KIND_COUNT,
} epx_call_kind_t;
/* The entry point of a call kind ("epx_ht_dispatch"), "no call" for 0, "an unknown call" else. */
const char *epx_call_name(int kind);

/* The operations of a backend, one type each, so that a backend declares its implementations
 * without restating them (`epx_ht_dispatch_op_t host_ht_dispatch;`). `seq` is the collective
 * sequence number of the call (the same on every rank); ht_dispatch and rm_dispatch fill
 * `handle` (for a cached HT dispatch, args->cached_handle). */
typedef epx_result_t epx_layout_op_t(epx_buffer_t buffer, const epx_tensor_t *topk_idx,
                                     epx_layout_outputs_t *outputs, void *stream);
typedef epx_result_t epx_ht_dispatch_op_t(epx_buffer_t buffer, uint64_t seq,
                                          const epx_ht_dispatch_args_t *args,
                                          epx_ht_dispatch_outputs_t *outputs, epx_handle_t handle);
typedef epx_result_t epx_ht_combine_op_t(epx_buffer_t buffer, uint64_t seq, const epx_ht_combine_args_t *args,
                                         epx_ht_combine_outputs_t *outputs);
/* [N_r, H] bf16 view of this rank's HT combine input rows. */
typedef epx_result_t epx_ht_get_combine_input_op_t(epx_buffer_t buffer, epx_handle_t handle,
                                                   epx_tensor_t *view_out);
typedef epx_result_t epx_ll_dispatch_op_t(epx_buffer_t buffer, uint64_t seq,
                                          const epx_ll_dispatch_args_t *args,
                                          epx_ll_dispatch_outputs_t *outputs);
typedef epx_result_t epx_ll_combine_op_t(epx_buffer_t buffer, uint64_t seq, const epx_ll_combine_args_t *args,
                                         epx_ll_combine_outputs_t *outputs);
typedef epx_result_t epx_ll_get_combine_buffer_op_t(epx_buffer_t buffer, const epx_ll_handle_t *handle,
                                                    epx_tensor_t *view_out);
typedef epx_result_t epx_hook_run_op_t(const epx_hook_t *hook, void *stream);
typedef epx_result_t epx_rm_dispatch_op_t(epx_buffer_t buffer, uint64_t seq,
                                          const epx_rm_dispatch_args_t *args,
                                          epx_rm_dispatch_outputs_t *outputs, epx_handle_t handle);
typedef epx_result_t epx_rm_combine_op_t(epx_buffer_t buffer, uint64_t seq, const epx_rm_combine_args_t *args,
                                         epx_rm_combine_outputs_t *outputs);

/* The backend function table. The API layer has checked every argument against the buffer
 * (shapes, dtypes, pointers, capacities, flags) before calling, and for host-memory index
 * tensors also their values. Backends check what only they can (cross-rank agreement, device
 * tensors' values) and must leave all ranks able to make the next collective call after any
 * failure. An operation a backend lacks is NULL (the API answers EPX_ERR_UNSUPPORTED). */
struct epx_backend_ops {
    const char *name;
    epx_result_t (*comm_init)(epx_comm_t comm); /* may be NULL */
    void (*comm_destroy)(epx_comm_t comm);      /* may be NULL */
    epx_result_t (*buffer_create)(epx_buffer_t buffer);
    void (*buffer_destroy)(epx_buffer_t buffer);
    void (*handle_free)(epx_handle_t handle);
    /* This rank failed its checks for collective call `seq`: tell the peers (they return
     * EPX_ERR_REMOTE) and stay in step, legal while `stream` (the call's, may be NULL) is being
     * captured into a CUDA graph. */
    void (*fail_collective)(epx_buffer_t buffer, uint64_t seq, epx_result_t res, void *stream);
    /* Turns what the backend's buffers of `comm` recorded asynchronously (device error records)
     * into the comm's async error now, so a caller who synchronised sees it at once. Never
     * blocks. May be NULL. */
    void (*poll_async)(epx_comm_t comm);
    /* Collective call `seq` of `kind` starts on this rank (before its checks, so refused calls
     * too): tell the peers, whose waits for call `seq` then fail at once with EPX_ERR_MISMATCH
     * when they make another kind of call. May be NULL. */
    void (*begin_call)(epx_buffer_t buffer, uint64_t seq, epx_call_kind_t kind);
    /* This rank destroys `buffer` (called before buffer_destroy, never waits): a peer waiting on
     * it in any collective returns EPX_ERR_REMOTE at once, saying that this rank destroyed its
     * buffer. May be NULL. */
    void (*notify_destroy)(epx_buffer_t buffer);
    /* Collective call `seq` (or the receive half a hook of it ran) ended on this rank with `res`
     * from the backend: a failure is told to the peers; a success is checked against peers that
     * failed this very call meanwhile (a rank that came late may find everything they published
     * before they gave up), which turns it into EPX_ERR_REMOTE. Returns the call's result. May be
     * NULL. */
    epx_result_t (*end_call)(epx_buffer_t buffer, uint64_t seq, epx_result_t res);
    epx_layout_op_t *layout;
    epx_ht_dispatch_op_t *ht_dispatch;
    epx_ht_combine_op_t *ht_combine;
    epx_ll_dispatch_op_t *ll_dispatch;
    epx_ll_combine_op_t *ll_combine;
    epx_ll_get_combine_buffer_op_t *ll_get_combine_buffer;
    epx_hook_run_op_t *hook_run;
    epx_rm_dispatch_op_t *rm_dispatch;
    epx_rm_combine_op_t *rm_combine;
    /* Reads and clears the buffer's overflow flag (device-side flag for cuda). */
    epx_result_t (*query_overflow)(epx_buffer_t buffer, int *overflowed_out);
    epx_ht_get_combine_input_op_t *ht_get_combine_input;
};

#ifdef __cplusplus
}
#endif

#endif /* EPX_CORE_INTERNAL_H */
