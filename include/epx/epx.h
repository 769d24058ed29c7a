/*
 * epx: expert-parallel communication for Mixture-of-Experts models.
 *
 * This header is the whole public contract of libepx. The semantics of every operation are
 * those of REFERENCE.md (docs/reference.md in the tree); this file says how they are called.
 *
 * Conventions
 * - Every function returns an epx_result_t. On failure, epx_last_error_message() gives the
 *   detail for the calling thread, and nothing was written to any [out] argument or output
 *   tensor.
 * - Outputs are caller-provided tensors with a capacity (the first dimension of their shape);
 *   the library never allocates a caller's output.
 * - "Collective" means every rank of the communicator must make the call, in the same order
 *   as its other collective calls on the same buffer. A rank that fails its own argument
 *   checks in a collective call tells its peers, which return EPX_ERR_REMOTE instead of
 *   waiting for it; a rank that never arrives makes the others return EPX_ERR_TIMEOUT after
 *   EPX_TIMEOUT_MS.
 * - "stream" arguments are cudaStream_t values (NULL = the legacy default stream) for the cuda
 *   backend; the host backend runs synchronously and ignores them.
 * - Tensors must be contiguous (row-major), their data aligned to their element size. Tensors of
 *   token rows ([.., H]: x, hidden, recv_x, y, combined outputs, biases) start on a 16-byte
 *   boundary (the kernels move rows in 16-byte vectors); others are refused naming the tensor.
 *   Host-backend tensors live in host memory, cuda-backend tensors in device memory of the
 *   communicator's GPU.
 */
#ifndef EPX_EPX_H
#define EPX_EPX_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EPX_VERSION_MAJOR 0
#define EPX_VERSION_MINOR 1
#define EPX_VERSION_PATCH 0
#define EPX_VERSION_CODE (EPX_VERSION_MAJOR * 10000 + EPX_VERSION_MINOR * 100 + EPX_VERSION_PATCH)

/* Initializers of the config/args/outputs structs: size and version set, everything else zero
 * (designated in C so callers' -Wextra stays quiet; in C++, where designated initializers need
 * C++20 and a partial brace list trips -Wmissing-field-initializers, a value-initialized struct
 * from a lambda, C++11 on). EPX_CXX_INIT_'s second argument: more assignments to epx_init_. */
#ifdef __cplusplus
#define EPX_CXX_INIT_(type, ...)               \
    ([]() {                                    \
        type epx_init_ = type();               \
        epx_init_.size = sizeof(type);         \
        __VA_ARGS__                            \
        return epx_init_;                      \
    }())
#define EPX_STRUCT_INIT_(type) EPX_CXX_INIT_(type, epx_init_.version = EPX_VERSION_CODE;)
#else
#define EPX_STRUCT_INIT_(type) {.size = sizeof(type), .version = EPX_VERSION_CODE}
#endif

#if defined(_WIN32)
#define EPX_API
#elif defined(EPX_BUILDING_LIBRARY)
#define EPX_API __attribute__((visibility("default")))
#else
#define EPX_API
#endif

/* ------------------------------------------------------------------------------------------ */
/* Results                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* X(name, value, description): the one table that defines result codes and their strings. */
#define EPX_RESULT_MAP(X)                                                                       \
    X(SUCCESS, 0, "success")                                                                   \
    X(ERR_INVALID_ARG, 1, "invalid argument")                                                  \
    X(ERR_UNSUPPORTED, 2, "not supported by this build, backend or device")                    \
    X(ERR_OUT_OF_MEMORY, 3, "out of memory")                                                   \
    X(ERR_TIMEOUT, 4, "a wait exceeded its deadline (EPX_TIMEOUT_MS)")                         \
    X(ERR_SYSTEM, 5, "a system call failed")                                                   \
    X(ERR_CUDA, 6, "a CUDA call failed")                                                       \
    X(ERR_GRAPH_CAPTURE, 7, "not allowed while the stream is being captured")                  \
    X(ERR_OVERFLOW, 8, "rows past a caller-given upper bound were dropped")                    \
    X(ERR_MISMATCH, 9, "collective arguments differ across ranks")                             \
    X(ERR_REMOTE, 10, "a peer rank failed or left the operation")                              \
    X(ERR_BOOTSTRAP, 11, "bootstrap (rendezvous or callback) failed")                          \
    X(ERR_INTERNAL, 12, "internal error")                                                      \
    X(ERR_INVALID_USAGE, 13, "an object was used after its destroy or by two threads at once")

typedef enum epx_result {
#define EPX_RESULT_ENUM_(name, value, text) EPX_##name = value,
    EPX_RESULT_MAP(EPX_RESULT_ENUM_)
#undef EPX_RESULT_ENUM_
} epx_result_t;

/* A static description of a result ("invalid argument"); never NULL. */
EPX_API const char *epx_strerror(epx_result_t result);
/* The enum's name without prefix ("ERR_INVALID_ARG"); never NULL. */
EPX_API const char *epx_result_name(epx_result_t result);
/* Detail of the last failure on the calling thread ("" if none); valid until the next epx call
 * on this thread. */
EPX_API const char *epx_last_error_message(void);

/* "major.minor.patch" of the linked library. */
EPX_API const char *epx_version(void);
/* EPX_VERSION_CODE of the linked library. */
EPX_API int epx_version_code(void);

/* What the linked library was built with. NCCL (>= 2.28, with its GPU-initiated networking
 * device API) is the engine of the network transport between nodes; the build finds it when
 * present (CMake option EPX_NCCL, README "Build options"). */
typedef struct epx_build_info {
    size_t size;               /* [in] sizeof(epx_build_info_t) as the caller compiled it */
    int32_t cuda;              /* 1: the cuda backend was built */
    int32_t nccl;              /* 1: NCCL was found at build time */
    int32_t nccl_version_code; /* of the NCCL headers built against: major * 10000 + minor * 100 +
                                * patch (2.28.9 = 22809); 0 without NCCL */
    int32_t network;           /* 1: a network transport for every mode was built (never in this version:
                                * only LL has kernels across nodes, docs/network.md) */
    char nccl_version[16];     /* "2.28.9", "" without NCCL */
} epx_build_info_t;

#ifdef __cplusplus
#define EPX_BUILD_INFO_INIT EPX_CXX_INIT_(epx_build_info_t, )
#else
#define EPX_BUILD_INFO_INIT {.size = sizeof(epx_build_info_t)}
#endif

/* [in,out] info: size set by the caller (EPX_BUILD_INFO_INIT); min(size, sizeof) bytes are
 * written on success. Any thread, no communicator needed. EPX_ERR_INVALID_ARG for a NULL info or
 * a size smaller than the size field plus the cuda field. */
EPX_API epx_result_t epx_get_build_info(epx_build_info_t *info);

/* ------------------------------------------------------------------------------------------ */
/* Tensors                                                                                    */
/* ------------------------------------------------------------------------------------------ */

typedef enum epx_dtype {
    EPX_DTYPE_INVALID = 0,
    EPX_DTYPE_BF16 = 1,
    EPX_DTYPE_FP32 = 2,
    EPX_DTYPE_FP8_E4M3 = 3,
    EPX_DTYPE_INT32 = 4,
    EPX_DTYPE_INT64 = 5,
    EPX_DTYPE_BOOL = 6, /* one byte, 0 or 1 */
    EPX_DTYPE_UINT8 = 7,
    EPX_DTYPE_COUNT_
} epx_dtype_t;

/* Bytes per element of a dtype, 0 for EPX_DTYPE_INVALID or an unknown value. */
EPX_API size_t epx_dtype_size(epx_dtype_t dtype);
/* Lowercase name ("bf16", "fp8_e4m3"); "invalid" for an unknown value. */
EPX_API const char *epx_dtype_name(epx_dtype_t dtype);

typedef enum epx_device_type {
    EPX_DEVICE_HOST = 0,
    EPX_DEVICE_CUDA = 1,
} epx_device_type_t;

#define EPX_MAX_DIMS 4

/* A view of caller memory. strides are in elements; all zero means contiguous row-major, which
 * is the only layout accepted today. An absent optional tensor has data == NULL. */
typedef struct epx_tensor {
    void *data;
    epx_dtype_t dtype;
    int32_t ndim;
    int64_t shape[EPX_MAX_DIMS];
    int64_t strides[EPX_MAX_DIMS];
    epx_device_type_t device_type;
    int32_t device_id;
} epx_tensor_t;

/* Convenience constructors for contiguous host tensors (set device_type yourself for cuda). */
static inline epx_tensor_t epx_tensor_1d(void *data, epx_dtype_t dtype, int64_t d0)
{
    epx_tensor_t t = {data, dtype, 1, {d0, 0, 0, 0}, {0, 0, 0, 0}, EPX_DEVICE_HOST, 0};
    return t;
}
static inline epx_tensor_t epx_tensor_2d(void *data, epx_dtype_t dtype, int64_t d0, int64_t d1)
{
    epx_tensor_t t = {data, dtype, 2, {d0, d1, 0, 0}, {0, 0, 0, 0}, EPX_DEVICE_HOST, 0};
    return t;
}
static inline epx_tensor_t epx_tensor_3d(void *data, epx_dtype_t dtype, int64_t d0, int64_t d1, int64_t d2)
{
    epx_tensor_t t = {data, dtype, 3, {d0, d1, d2, 0}, {0, 0, 0, 0}, EPX_DEVICE_HOST, 0};
    return t;
}

/* ------------------------------------------------------------------------------------------ */
/* Communicator and bootstrap                                                                 */
/* ------------------------------------------------------------------------------------------ */

/* Threads and lifetimes (as NCCL's communicators): one thread at a time per communicator and per
 * buffer; a handle counts as part of its buffer. Different communicators and buffers, even of one
 * communicator, may be used from different threads at once. A call that enters a communicator or
 * buffer another thread is inside returns EPX_ERR_INVALID_USAGE at once and does nothing: a
 * collective call refused so is not numbered and no peer is told, so the misuse stays local (the
 * caller must still make the call on every rank to stay in step). epx_get_async_error and
 * epx_comm_get_topology may be called from any thread at any time. A communicator, buffer or
 * handle used after its destroy, including a second destroy, is refused with
 * EPX_ERR_INVALID_USAGE without touching freed memory, unless a new object of the same kind has
 * since been created at the same address, which the library cannot tell apart. */

typedef struct epx_comm *epx_comm_t;
typedef struct epx_buffer *epx_buffer_t;
typedef struct epx_handle *epx_handle_t;

#define EPX_UNIQUE_ID_BYTES 128
/* Opaque rendezvous token: created once, sent to every rank by the caller's own means. */
typedef struct epx_unique_id {
    char internal[EPX_UNIQUE_ID_BYTES];
} epx_unique_id_t;

/* Creates a unique id for a TCP rendezvous hosted by rank 0. The address is taken from
 * EPX_BOOTSTRAP_ADDR ("ip:port") when set, else the first non-loopback IPv4 address of
 * EPX_SOCKET_IFNAME (or of any interface; loopback when there is no other), with a free port.
 * When the process that creates the id is also rank 0 (or forks rank 0), the listening socket
 * is reused; otherwise rank 0 binds the address itself, and the port is free for any process to
 * take between the creator's exit and that bind (rank 0 then fails with EPX_ERR_SYSTEM naming
 * the address, and the other ranks with EPX_ERR_BOOTSTRAP: the process on the port cannot prove
 * it holds the id's secret, which never travels); where that matters, set EPX_BOOTSTRAP_ADDR to a
 * port reserved for the job. An id serves one job: two jobs started with one id may meet.
 * [out] id_out. Returns EPX_ERR_SYSTEM if no address can be bound, EPX_ERR_INVALID_ARG for a
 * malformed env value. Not collective. */
EPX_API epx_result_t epx_get_unique_id(epx_unique_id_t *id_out);

typedef enum epx_backend {
    EPX_BACKEND_AUTO = 0, /* cuda when a GPU is usable and the build has CUDA, else host */
    EPX_BACKEND_HOST = 1, /* CPU: ranks are processes of one machine, POSIX shared memory */
    EPX_BACKEND_CUDA = 2, /* GPU */
} epx_backend_t;

typedef struct epx_comm_config {
    size_t size;          /* sizeof(epx_comm_config_t) as the caller compiled it */
    uint32_t version;     /* EPX_VERSION_CODE the caller compiled against */
    epx_backend_t backend;
    int32_t cuda_device;  /* -1: the calling thread's current device */
    int32_t timeout_ms;   /* 0: EPX_TIMEOUT_MS (default 100000) */
    /* This rank's node: ranks with equal node ids form one node (see epx_node_topology_t). NULL or
     * "": the default. Precedence: EPX_NODE_ID when set and not empty, else this field, else the
     * host's identity (hostname and boot id). At most EPX_NODE_ID_MAX - 1 bytes; read only during
     * the init (the string need not outlive it) and only when `size` covers it. */
    const char *node_id;
} epx_comm_config_t;

#define EPX_NODE_ID_MAX 64

#ifdef __cplusplus
#define EPX_COMM_CONFIG_INIT                                                                   \
    EPX_CXX_INIT_(epx_comm_config_t, epx_init_.version = EPX_VERSION_CODE;                      \
                  epx_init_.backend = EPX_BACKEND_AUTO; epx_init_.cuda_device = -1;)
#else
#define EPX_COMM_CONFIG_INIT                                                                   \
    {.size = sizeof(epx_comm_config_t), .version = EPX_VERSION_CODE, .backend = EPX_BACKEND_AUTO, \
     .cuda_device = -1, .timeout_ms = 0, .node_id = NULL}
#endif

/* Creates the communicator of rank `rank` out of `nranks` through the TCP rendezvous of `id`.
 * Collective over all nranks processes. config may be NULL (defaults).
 * [out] comm_out. Errors: EPX_ERR_INVALID_ARG (rank out of range, bad config or env value,
 * nodes of unequal size or not of consecutive ranks: see epx_node_topology_t),
 * EPX_ERR_TIMEOUT (a rank did not arrive within the timeout), EPX_ERR_BOOTSTRAP,
 * EPX_ERR_MISMATCH (ranks disagree on nranks or backend), EPX_ERR_UNSUPPORTED (backend not
 * available, or host backend across machines). */
EPX_API epx_result_t epx_comm_init(const epx_unique_id_t *id, int rank, int nranks,
                                   const epx_comm_config_t *config, epx_comm_t *comm_out);

/* Caller-supplied collectives, to embed epx in MPI, torch.distributed or a custom launcher.
 * Both must be collective over the same ranks and return 0 on success, anything else on
 * failure; they should give up after a deadline of their own. allgather gathers `bytes` from
 * every rank into recv (rank i's block at offset i * bytes). */
typedef int (*epx_allgather_fn)(void *ctx, const void *send, void *recv, size_t bytes);
typedef int (*epx_barrier_fn)(void *ctx);

typedef struct epx_bootstrap_callbacks {
    epx_allgather_fn allgather;
    epx_barrier_fn barrier;
    void *ctx; /* passed back to both; must outlive the communicator */
} epx_bootstrap_callbacks_t;

/* Like epx_comm_init, with the caller's collectives instead of the TCP rendezvous.
 * Errors: as epx_comm_init; EPX_ERR_BOOTSTRAP when a callback returns non-zero. */
EPX_API epx_result_t epx_comm_init_callbacks(const epx_bootstrap_callbacks_t *callbacks, int rank,
                                             int nranks, const epx_comm_config_t *config,
                                             epx_comm_t *comm_out);

/* Frees the communicator. Every buffer made from it must be destroyed first
 * (EPX_ERR_INVALID_ARG otherwise, nothing freed). Not collective and never waits on a peer.
 * NULL is accepted. */
EPX_API epx_result_t epx_comm_destroy(epx_comm_t comm);

typedef struct epx_topology {
    int32_t rank;
    int32_t nranks;
    int32_t local_rank;              /* index among the ranks of this machine (see epx_node_topology_t) */
    int32_t local_nranks;            /* ranks on this machine */
    int32_t ranks_per_nvlink_domain; /* D: detected, capped by EPX_RANKS_PER_NVLINK_DOMAIN */
    int32_t num_nvlink_domains;      /* nranks / D */
    epx_backend_t backend;           /* the backend actually chosen */
    int32_t cuda_device;             /* -1 for the host backend */
} epx_topology_t;

/* [out] topo_out: the communicator's topology. Not collective. */
EPX_API epx_result_t epx_comm_get_topology(epx_comm_t comm, epx_topology_t *topo_out);

/* Nodes, as the library derives them at init from every rank's node id (never from the launcher):
 * ranks with one node id form a node, nodes are numbered by their lowest rank. A node holds
 * consecutive ranks and every node holds as many (the init fails with EPX_ERR_INVALID_ARG naming
 * the nodes otherwise), so rank r is local rank r % ranks_per_node of node r / ranks_per_node.
 * Ranks of one node reach each other through ipc (load/store over NVLink); ranks of different
 * nodes only through a network transport, even when they share a machine or a GPU. The NVLink
 * domain is the node, cut into blocks of EPX_RANKS_PER_NVLINK_DOMAIN ranks when that is smaller
 * (it must divide ranks_per_node); the cap shapes the layout's per-domain counts, not the paths. */
typedef struct epx_node_topology {
    size_t size;                     /* [in] sizeof(epx_node_topology_t) as the caller compiled it */
    int32_t node;                    /* this rank's node index, 0 .. num_nodes - 1 */
    int32_t num_nodes;
    int32_t ranks_per_node;
    int32_t local_rank;              /* index among the ranks of this node */
    int32_t ranks_per_nvlink_domain; /* D, as in epx_topology_t */
    int32_t num_nvlink_domains;
    char node_id[EPX_NODE_ID_MAX];   /* this rank's node id as exchanged, NUL-terminated */
} epx_node_topology_t;

#ifdef __cplusplus
#define EPX_NODE_TOPOLOGY_INIT EPX_CXX_INIT_(epx_node_topology_t, )
#else
#define EPX_NODE_TOPOLOGY_INIT {.size = sizeof(epx_node_topology_t)}
#endif

/* [in,out] topo: size set by the caller (EPX_NODE_TOPOLOGY_INIT); min(size, sizeof) bytes are
 * written on success. Not collective; any thread. EPX_ERR_INVALID_ARG for a NULL topo or a size
 * smaller than the size field plus the node field. */
EPX_API epx_result_t epx_comm_get_node_topology(epx_comm_t comm, epx_node_topology_t *topo);

/* How this rank reaches a peer. The host backend carries every path through its shared memory
 * (it stands in for both); the cuda backend reaches another node only in LL mode, through the network
 * interface (EPX_NET_TRANSPORT). */
typedef enum epx_path {
    EPX_PATH_SELF = 0,    /* the peer is this rank */
    EPX_PATH_IPC = 1,     /* same node: load/store (NVLink) */
    EPX_PATH_NETWORK = 2, /* another node: the network transport only */
} epx_path_t;

/* [in] peer: 0 .. nranks - 1. [out] path_out. Not collective; any thread. EPX_ERR_INVALID_ARG
 * for a peer out of range or a NULL path_out. */
EPX_API epx_result_t epx_comm_get_peer_path(epx_comm_t comm, int peer, epx_path_t *path_out);

/* Reports (and keeps) the first asynchronous failure seen by the communicator's buffers: a
 * device-side timeout (with rank, peer, channel and counters in the message), a peer that
 * failed, an overflow that has not been queried. EPX_SUCCESS when there is none. Not
 * collective; never blocks. */
EPX_API epx_result_t epx_get_async_error(epx_comm_t comm);

/* ------------------------------------------------------------------------------------------ */
/* Buffers                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* Modes a buffer is created for. */
#define EPX_MODE_HT 0x1u      /* high-throughput dispatch/combine and layout */
#define EPX_MODE_LL 0x2u      /* low-latency dispatch/combine */
#define EPX_MODE_PERMUTE 0x4u /* routing-map dispatch (with or without permute) and its combine */
#define EPX_MODE_ALL 0x7u

/* Bit for a dtype in epx_buffer_config_t.dispatch_dtypes. */
#define EPX_DTYPE_BIT(dtype) (1u << (unsigned)(dtype))

typedef struct epx_buffer_config {
    size_t size;
    uint32_t version;
    int64_t max_tokens;       /* T_max: most tokens any rank passes in one call (>= 1) */
    int64_t hidden;           /* H (>= 1; a multiple of 128 for fp8) */
    int32_t num_topk;         /* K (1..64) */
    int32_t num_experts;      /* E (a multiple of nranks) */
    uint32_t modes;           /* EPX_MODE_* bits; 0 means EPX_MODE_ALL */
    uint32_t dispatch_dtypes; /* EPX_DTYPE_BIT()s of x allowed in dispatch; 0 = bf16|fp32, and fp8
                                 when hidden % 128 == 0 (fp8 asked for explicitly needs that too) */
    int32_t max_pad_multiple; /* largest pad_multiple used with permute; 0 = 128 */
    int32_t num_sms;          /* GPU: SMs a kernel may take; 0 = tuned default for nranks */
    int32_t chunk_tokens;     /* reserved: checked (>= 0) and compared across ranks, currently ignored */
    /* Appended (read only when `size` covers it): view areas for HT view-mode dispatch outputs,
     * 0 or 1 = one, at most EPX_MAX_VIEW_AREAS. Each area holds one dispatch's outputs
     * (epx_ht_dispatch_args_t.view_area), so views of one area outlive dispatches into another. */
    int32_t num_view_areas;
} epx_buffer_config_t;

#define EPX_MAX_VIEW_AREAS 8

#define EPX_BUFFER_CONFIG_INIT EPX_STRUCT_INIT_(epx_buffer_config_t)

/* Creates a communication buffer able to serve every operation of `config->modes` up to the
 * given maximum shape. Collective: every rank must pass the same config (max_tokens, hidden,
 * num_topk, num_experts, modes, dtypes, max_pad_multiple, num_sms, chunk_tokens); otherwise
 * every rank returns EPX_ERR_MISMATCH naming the field. [out] buffer_out. Errors:
 * EPX_ERR_INVALID_ARG (bad field, E % nranks != 0, H % 128 for fp8), EPX_ERR_OUT_OF_MEMORY,
 * EPX_ERR_SYSTEM, EPX_ERR_TIMEOUT, EPX_ERR_MISMATCH. */
EPX_API epx_result_t epx_buffer_create(epx_comm_t comm, const epx_buffer_config_t *config,
                                       epx_buffer_t *buffer_out);

/* Frees the buffer and its peers' mappings. Handles made from it must be destroyed first
 * (EPX_ERR_INVALID_ARG otherwise). Not collective; never waits on a peer. NULL is accepted. */
EPX_API epx_result_t epx_buffer_destroy(epx_buffer_t buffer);

/* Returns EPX_ERR_OVERFLOW (and clears the flag) when a call with an upper bound on this
 * buffer dropped rows since the last query, else EPX_SUCCESS. For the cuda backend this
 * synchronises with the buffer's last operation. Not collective. */
EPX_API epx_result_t epx_buffer_query_overflow(epx_buffer_t buffer);

/* ------------------------------------------------------------------------------------------ */
/* Layout                                                                                     */
/* ------------------------------------------------------------------------------------------ */

typedef struct epx_layout_outputs {
    size_t size;
    uint32_t version;
    epx_tensor_t num_tokens_per_rank;   /* [out] [R] int32 */
    epx_tensor_t num_tokens_per_expert; /* [out] [E] int32 */
    epx_tensor_t is_token_in_rank;      /* [out] [T, R] bool */
    epx_tensor_t num_tokens_per_domain; /* [out] optional [R / D] int32 */
} epx_layout_outputs_t;

#define EPX_LAYOUT_OUTPUTS_INIT EPX_STRUCT_INIT_(epx_layout_outputs_t)

/* Counts derived from topk_idx [T, K] (int32 or int64, -1 = no expert). Not collective.
 * Ordered on `stream`. Errors: EPX_ERR_INVALID_ARG (shape, dtype, expert id out of range or
 * repeated within a token, T > T_max, outputs too small, buffer without EPX_MODE_HT). */
EPX_API epx_result_t epx_get_dispatch_layout(epx_buffer_t buffer, const epx_tensor_t *topk_idx,
                                             epx_layout_outputs_t *outputs, void *stream);

/* ------------------------------------------------------------------------------------------ */
/* High-throughput dispatch and combine                                                       */
/* ------------------------------------------------------------------------------------------ */

typedef struct epx_ht_dispatch_args {
    size_t size;
    uint32_t version;
    epx_tensor_t x;              /* [T, H] bf16, fp32 or fp8_e4m3 */
    epx_tensor_t x_scales;       /* [T, H/128] fp32; required for fp8, absent otherwise */
    epx_tensor_t topk_idx;       /* [T, K] int32/int64; ignored when cached_handle is set */
    epx_tensor_t topk_weights;   /* optional [T, K] fp32; ignored when cached_handle is set */
    epx_handle_t cached_handle;  /* non-NULL: cached dispatch with that handle's routing */
    int32_t expert_alignment;    /* round num_recv_tokens_per_expert up to this (>= 1) */
    int64_t num_worst_tokens;    /* > 0: static-shape mode, outputs have this many rows */
    void *stream;
    /* Since 0.1 (read only when `size` covers it): non-zero = view mode. recv_x, recv_x_scales,
     * recv_topk_idx and recv_topk_weights are not caller memory: pass them with data == NULL and
     * the library sets them to views of its own buffer (device memory on cuda; recv_topk_idx is
     * int32; recv_topk_weights only when topk_weights is given), so each row is written once,
     * straight into its final place. Every rank must pass the same value. */
    int32_t recv_in_buffer;
    /* Appended (read only when `size` covers it): with recv_in_buffer, the view area
     * (0 .. num_view_areas - 1) this rank's outputs go to. Each rank picks its own: ranks may
     * pass different values. */
    int32_t view_area;
} epx_ht_dispatch_args_t;

#define EPX_HT_DISPATCH_ARGS_INIT EPX_STRUCT_INIT_(epx_ht_dispatch_args_t)

typedef struct epx_ht_dispatch_outputs {
    size_t size;
    uint32_t version;
    epx_tensor_t recv_x;                     /* [out] [cap, H], dtype of x */
    epx_tensor_t recv_x_scales;              /* [out] [cap, H/128] fp32, fp8 only */
    epx_tensor_t recv_topk_idx;              /* [out] optional [cap, K] int32/int64 */
    epx_tensor_t recv_topk_weights;          /* [out] optional [cap, K] fp32 */
    epx_tensor_t num_recv_tokens_per_expert; /* [out] optional [L] int32 */
    epx_tensor_t num_recv_tokens;            /* [out] optional [1] int32: N_r, in device memory */
    int64_t num_recv_tokens_host;            /* [out] N_r; -1 in static mode on every backend
                                                (the num_recv_tokens tensor has it after a sync) */
    epx_handle_t handle;                     /* [out] new handle (not written for cached) */
    /* Appended (read only when `size` covers it): optional [R, R] int32, DeepEP's rank prefix
     * matrix: element [s, d] = tokens that ranks 0..s send to rank d, before any num_worst_tokens
     * bound; so column d's differences are every source's rows for rank d, and [R-1, d] is rank d's
     * N_r. Every rank learns it from the dispatch's own count exchange. Not written by a cached
     * dispatch. */
    epx_tensor_t rank_prefix_matrix; /* [out] optional [R, R] int32 */
    /* Appended (read only when `size` covers it): optional host memory of L int32. In the default
     * mode (no num_worst_tokens) a dispatch with top-k (not cached) writes there, before it returns,
     * the values it writes to num_recv_tokens_per_expert (aligned per expert), so that a caller who
     * needs them on the host reads no device memory. Not written in static mode (the host does not
     * wait) nor by a cached dispatch; NULL: not wanted. Not a tensor: its memory is the caller's,
     * on every backend. */
    int32_t *num_recv_tokens_per_expert_host;
} epx_ht_dispatch_outputs_t;

#define EPX_HT_DISPATCH_OUTPUTS_INIT EPX_STRUCT_INIT_(epx_ht_dispatch_outputs_t)

/* Sends each token of x to every rank holding one of its experts (docs/reference.md, HT dispatch).
 * Collective. Ordered on args->stream. The capacity of recv_x (shape[0]) must be >= N_r, or
 * >= num_worst_tokens in static mode; in the default mode the host waits for N_r, which is
 * refused during stream capture (EPX_ERR_GRAPH_CAPTURE naming num_worst_tokens). With
 * cached_handle only recv_x and recv_x_scales are written, and x must have the handle's T.
 * Errors: EPX_ERR_INVALID_ARG (shapes, dtypes, ids, T > T_max, null pointers, capacity below
 * N_r), EPX_ERR_MISMATCH (ranks disagree on the dtype), EPX_ERR_REMOTE, EPX_ERR_TIMEOUT.
 * In static mode, rows past num_worst_tokens are dropped and the buffer's overflow flag is set
 * (epx_buffer_query_overflow); the call itself succeeds.
 * View mode (args->recv_in_buffer): the output views stay valid until the next view-mode dispatch
 * into the same area (args->view_area) on this rank; on cuda, work that reads them must be ordered
 * before that dispatch on its stream. num_worst_tokens must then be <= R * max_tokens. */
EPX_API epx_result_t epx_ht_dispatch(epx_buffer_t buffer, const epx_ht_dispatch_args_t *args,
                                     epx_ht_dispatch_outputs_t *outputs);

typedef struct epx_ht_combine_args {
    size_t size;
    uint32_t version;
    epx_handle_t handle;       /* from epx_ht_dispatch */
    epx_tensor_t x;            /* [>= N_r, H] bf16: one row per received token */
    epx_tensor_t topk_weights; /* optional [>= N_r, K] fp32, combined like x */
    epx_tensor_t bias0;        /* optional [T, H] bf16 */
    epx_tensor_t bias1;        /* optional [T, H] bf16 */
    void *stream;
    /* Since 0.1 (read only when `size` covers it): non-zero = the rows are in the library's
     * buffer and source ranks read them straight from there (zero-copy):
     * 1 = the expert outputs were written into epx_ht_get_combine_input()'s view; `x` is ignored.
     * 2 = `x` is the recv_x view returned by the latest view-mode dispatch into its
     *     area, made with `handle` (cached or not), bf16, passed whole ([rows, H], contiguous).
     * Every rank must pass a non-zero value when one does; ranks may mix 1 and 2. */
    int32_t x_in_buffer;
} epx_ht_combine_args_t;

#define EPX_HT_COMBINE_ARGS_INIT EPX_STRUCT_INIT_(epx_ht_combine_args_t)

typedef struct epx_ht_combine_outputs {
    size_t size;
    uint32_t version;
    epx_tensor_t combined_x;            /* [out] [T, H] bf16 */
    epx_tensor_t combined_topk_weights; /* [out] optional [T, K] fp32 (needs args topk_weights) */
} epx_ht_combine_outputs_t;

#define EPX_HT_COMBINE_OUTPUTS_INIT EPX_STRUCT_INIT_(epx_ht_combine_outputs_t)

/* [out] view_out: the [N_r, H] bf16 rows in the library's buffer (device memory on cuda) that
 * the next epx_ht_combine of `handle` with x_in_buffer reads; N_r is the handle's row count
 * (num_worst_tokens in static mode). Write row i of the expert outputs to row i, then call the
 * combine (on cuda, order the writes before it on its stream). Valid until the next HT or
 * routing-map combine on this buffer; the combine that reads it returns (on its stream) only
 * after every peer finished reading it. Not collective; the host backend may wait (bounded)
 * until peers released the rows of the previous combine. Errors: EPX_ERR_INVALID_ARG. */
EPX_API epx_result_t epx_ht_get_combine_input(epx_buffer_t buffer, epx_handle_t handle,
                                              epx_tensor_t *view_out);

/* Reduces each token's rows back on its source rank: out[t] = sum over ranks that received t
 * (+ bias0[t] + bias1[t]), fp32 accumulation, one rounding to bf16. Collective. Errors:
 * EPX_ERR_INVALID_ARG (handle of another buffer, shapes), EPX_ERR_REMOTE, EPX_ERR_TIMEOUT. */
EPX_API epx_result_t epx_ht_combine(epx_buffer_t buffer, const epx_ht_combine_args_t *args,
                                    epx_ht_combine_outputs_t *outputs);

typedef struct epx_handle_info {
    int64_t num_tokens;      /* T this rank dispatched */
    int64_t num_recv_tokens; /* rows the handle covers: N_r (HT, routing map) or P (permute);
                              * with a bound (num_worst_tokens, num_dispatched_tokens,
                              * num_permuted_tokens) the bound, on every backend */
    int32_t num_ranks;
    int32_t num_local_experts;
} epx_handle_info_t;

/* [out] info_out. For the cuda backend's static modes this waits for the dispatch to finish
 * (bounded by EPX_TIMEOUT_MS). Not collective. */
EPX_API epx_result_t epx_handle_get_info(epx_handle_t handle, epx_handle_info_t *info_out);

/* Frees a handle (HT or routing-map). Not collective. NULL is accepted. */
EPX_API epx_result_t epx_handle_destroy(epx_handle_t handle);

/* ------------------------------------------------------------------------------------------ */
/* Low-latency dispatch and combine                                                           */
/* ------------------------------------------------------------------------------------------ */

/* Identifies one LL dispatch; passed by value to the matching combine. */
typedef struct epx_ll_handle {
    uint64_t seq;       /* collective sequence number of the dispatch */
    int32_t slot;       /* double-buffer slot (0 or 1) */
    int32_t num_tokens; /* T of the dispatch */
} epx_ll_handle_t;

/* The receive half of an operation called with return_recv_hook. */
typedef struct epx_hook {
    epx_buffer_t buffer;
    uint64_t seq;
    int32_t kind; /* internal */
    int32_t slot; /* internal */
} epx_hook_t;

typedef struct epx_ll_dispatch_args {
    size_t size;
    uint32_t version;
    epx_tensor_t x;                     /* [T, H] bf16 */
    epx_tensor_t topk_idx;              /* [T, K] int32/int64, -1 = no expert */
    epx_tensor_t cumulative_recv_stats; /* optional [L] int32: received tokens per local expert
                                           are added to it */
    int32_t use_fp8;                    /* cast to fp8 e4m3 with per-128-channel scales */
    int32_t round_scale;                /* scales rounded up to powers of two (fp8 only) */
    int32_t use_ue8m0;                  /* scales as exponent bytes, four per int32 (needs
                                           round_scale and H % 512 == 0) */
    int32_t return_recv_hook;           /* return after the sends; outputs filled by the hook */
    void *stream;
} epx_ll_dispatch_args_t;

#define EPX_LL_DISPATCH_ARGS_INIT EPX_STRUCT_INIT_(epx_ll_dispatch_args_t)

typedef struct epx_ll_dispatch_outputs {
    size_t size;
    uint32_t version;
    epx_tensor_t recv_x;       /* [out] [L, R*T_max, H] bf16, or fp8_e4m3 with use_fp8 */
    epx_tensor_t recv_scales;  /* [out] fp8: [L, H/128, R*T_max] fp32 (storage order; logical
                                  [L, R*T_max, H/128]); ue8m0: [L, H/512, R*T_max] int32 */
    epx_tensor_t recv_count;   /* [out] [L] int32 */
    epx_tensor_t src_info;     /* [out] optional [L, R*T_max] int32: source token index */
    epx_tensor_t layout_range; /* [out] optional [L, R] int64: (begin << 32) | count */
    epx_ll_handle_t handle;    /* [out] */
    epx_hook_t hook;           /* [out] with return_recv_hook */
} epx_ll_dispatch_outputs_t;

#define EPX_LL_DISPATCH_OUTPUTS_INIT EPX_STRUCT_INIT_(epx_ll_dispatch_outputs_t)

/* Sends each token once per selected expert; rank r receives, per local expert, rows packed
 * from 0 in (source rank, source token) order. Collective; no host synchronisation; may be
 * captured in a CUDA graph. Two LL operations may be in flight; the third reuses the first
 * one's slot. With return_recv_hook the output tensors must stay valid until the hook runs.
 * Errors: EPX_ERR_INVALID_ARG (buffer without EPX_MODE_LL, shapes, ids, flags), EPX_ERR_REMOTE,
 * EPX_ERR_TIMEOUT. A receive that fails on the device after the call returned writes -1 into
 * recv_count (combine: NaN rows) and reports through epx_get_async_error. */
EPX_API epx_result_t epx_ll_dispatch(epx_buffer_t buffer, const epx_ll_dispatch_args_t *args,
                                     epx_ll_dispatch_outputs_t *outputs);

typedef struct epx_ll_combine_args {
    size_t size;
    uint32_t version;
    epx_ll_handle_t handle;    /* from epx_ll_dispatch */
    epx_tensor_t y;            /* [L, R*T_max, H] bf16 in the dispatch's layout (ignored with
                                  zero_copy) */
    epx_tensor_t topk_idx;     /* [T, K] as passed to the dispatch */
    epx_tensor_t topk_weights; /* [T, K] fp32 */
    int32_t zero_copy;         /* y was written into epx_ll_get_combine_buffer()'s view */
    int32_t return_recv_hook;
    void *stream;
} epx_ll_combine_args_t;

#define EPX_LL_COMBINE_ARGS_INIT EPX_STRUCT_INIT_(epx_ll_combine_args_t)

typedef struct epx_ll_combine_outputs {
    size_t size;
    uint32_t version;
    epx_tensor_t combined_x; /* [out] [T, H] bf16 */
    epx_hook_t hook;         /* [out] with return_recv_hook */
} epx_ll_combine_outputs_t;

#define EPX_LL_COMBINE_OUTPUTS_INIT EPX_STRUCT_INIT_(epx_ll_combine_outputs_t)

/* out[t] = sum over k with topk_idx[t,k] >= 0 of topk_weights[t,k] * y(expert, t), in fp32,
 * one rounding to bf16. Collective. Errors: EPX_ERR_INVALID_ARG (stale handle: its slot was
 * reused by a later dispatch; T differs from the dispatch's), EPX_ERR_REMOTE, EPX_ERR_TIMEOUT. */
EPX_API epx_result_t epx_ll_combine(epx_buffer_t buffer, const epx_ll_combine_args_t *args,
                                    epx_ll_combine_outputs_t *outputs);

/* [out] view_out: the [L, R*T_max, H] bf16 region in the library's memory that the next
 * epx_ll_combine of `handle` with zero_copy reads. Valid until that combine returns. Not
 * collective; may wait (bounded) until peers have released the region. */
EPX_API epx_result_t epx_ll_get_combine_buffer(epx_buffer_t buffer, const epx_ll_handle_t *handle,
                                               epx_tensor_t *view_out);

/* Runs the receive half of an operation called with return_recv_hook. Ordered on `stream`.
 * A hook runs once (EPX_ERR_INVALID_ARG after that, or once its slot was reused). */
EPX_API epx_result_t epx_hook_run(const epx_hook_t *hook, void *stream);

/* ------------------------------------------------------------------------------------------ */
/* Routing-map dispatch (with or without permute) and its combine                             */
/* ------------------------------------------------------------------------------------------ */

typedef struct epx_rm_dispatch_args {
    size_t size;
    uint32_t version;
    epx_tensor_t hidden;                /* [T, H] bf16 or fp8_e4m3 */
    epx_tensor_t scaling_factor;        /* [T, H/128] fp32 for fp8, absent otherwise */
    epx_tensor_t routing_map;           /* [T, E] bool; at most K true per row */
    epx_tensor_t probs;                 /* optional [T, E] fp32 */
    int32_t permute;                    /* group rows by local expert */
    int32_t pad_multiple;               /* permute: pad each group to a multiple (>= 1) */
    int64_t num_dispatched_tokens;      /* upper bound on N_r without permute; -1 = none */
    int64_t num_permuted_tokens;        /* upper bound on P with permute; -1 = none */
    void *stream;
} epx_rm_dispatch_args_t;

#ifdef __cplusplus
#define EPX_RM_DISPATCH_ARGS_INIT                                                              \
    EPX_CXX_INIT_(epx_rm_dispatch_args_t, epx_init_.version = EPX_VERSION_CODE;                 \
                  epx_init_.pad_multiple = 1; epx_init_.num_dispatched_tokens = -1;               \
                  epx_init_.num_permuted_tokens = -1;)
#else
#define EPX_RM_DISPATCH_ARGS_INIT                                                              \
    {.size = sizeof(epx_rm_dispatch_args_t), .version = EPX_VERSION_CODE, .pad_multiple = 1,   \
     .num_dispatched_tokens = -1, .num_permuted_tokens = -1}
#endif

typedef struct epx_rm_dispatch_outputs {
    size_t size;
    uint32_t version;
    epx_tensor_t tokens;            /* [out] [cap, H], dtype of hidden */
    epx_tensor_t scaling_factor;    /* [out] [cap, H/128] fp32, fp8 only */
    epx_tensor_t probs;             /* [out] optional: [cap, L] fp32 without permute, [cap] with */
    epx_tensor_t tokens_per_expert; /* [out] permute: [L] int32, padded counts */
    epx_tensor_t num_tokens;        /* [out] optional [1] int32: N_r or P, in device memory */
    int64_t num_tokens_host;        /* [out] N_r or P (the bound's value when one is given) */
    epx_handle_t handle;            /* [out] */
    epx_tensor_t local_map;         /* [out] optional [>= R*T_max, L] bool: row i for the i-th received
                                       token (HT order, all N_r of them whatever the bound), column j
                                       true where it selected local expert j; rows from N_r on false.
                                       In device memory, written without a host wait (capturable) */
} epx_rm_dispatch_outputs_t;

#define EPX_RM_DISPATCH_OUTPUTS_INIT EPX_STRUCT_INIT_(epx_rm_dispatch_outputs_t)

/* Routing-map dispatch (docs/reference.md). Collective. The capacity of tokens must be >= the
 * bound when one is given, else >= the real count (the host waits for it, refused under capture
 * with EPX_ERR_GRAPH_CAPTURE naming num_dispatched_tokens or num_permuted_tokens). With a
 * bound, rows past it are dropped and the overflow flag set (epx_buffer_query_overflow); the
 * rows between the real count and the bound are zero. Ranks may pass different T. Errors:
 * EPX_ERR_INVALID_ARG, EPX_ERR_MISMATCH (dtype or permute flag differ), EPX_ERR_REMOTE,
 * EPX_ERR_TIMEOUT, EPX_ERR_GRAPH_CAPTURE. */
EPX_API epx_result_t epx_rm_dispatch(epx_buffer_t buffer, const epx_rm_dispatch_args_t *args,
                                     epx_rm_dispatch_outputs_t *outputs);

typedef struct epx_rm_combine_args {
    size_t size;
    uint32_t version;
    epx_handle_t handle; /* from epx_rm_dispatch */
    epx_tensor_t x;      /* [>= N_r or P, H] bf16, in the dispatch's output layout */
    int32_t weighted;    /* permute only: weight each row by its prob */
    void *stream;
} epx_rm_combine_args_t;

#define EPX_RM_COMBINE_ARGS_INIT EPX_STRUCT_INIT_(epx_rm_combine_args_t)

typedef struct epx_rm_combine_outputs {
    size_t size;
    uint32_t version;
    epx_tensor_t combined; /* [out] [T, H] bf16 */
} epx_rm_combine_outputs_t;

#define EPX_RM_COMBINE_OUTPUTS_INIT EPX_STRUCT_INIT_(epx_rm_combine_outputs_t)

/* Inverse of epx_rm_dispatch: without permute an unweighted sum over the receiving ranks; with
 * permute, combine-with-unpermute: out[t] = sum over (rank, selected local expert) of w * row,
 * w = prob if weighted else 1. fp32 accumulation, bf16 output. Collective. */
EPX_API epx_result_t epx_rm_combine(epx_buffer_t buffer, const epx_rm_combine_args_t *args,
                                    epx_rm_combine_outputs_t *outputs);

/* ------------------------------------------------------------------------------------------ */
/* Refusing a collective call                                                                 */
/* ------------------------------------------------------------------------------------------ */

/* The collective calls on a buffer, as epx_buffer_refuse_collective names them. */
typedef enum epx_collective {
    EPX_COLLECTIVE_HT_DISPATCH = 1, /* epx_ht_dispatch */
    EPX_COLLECTIVE_HT_COMBINE,      /* epx_ht_combine */
    EPX_COLLECTIVE_LL_DISPATCH,     /* epx_ll_dispatch */
    EPX_COLLECTIVE_LL_COMBINE,      /* epx_ll_combine */
    EPX_COLLECTIVE_RM_DISPATCH,     /* epx_rm_dispatch */
    EPX_COLLECTIVE_RM_COMBINE,      /* epx_rm_combine */
} epx_collective_t;

/* Stands for a collective call of `kind` that the caller refused before making it (a binding or
 * wrapper whose own checks of its inputs failed), so that the ranks stay in step: it takes this
 * rank's place in the buffer's sequence of collective calls exactly as that call refused by the
 * library's own checks would (an LL dispatch also takes its LL slot), and tells the peers, whose
 * matching call returns EPX_ERR_REMOTE instead of waiting. Every later call pairs with the peers'
 * next one. Collective in that sense: call it where the refused call would have been made, and
 * not in addition to that call.
 * [in] buffer: a live buffer; it need not have been created for the mode of `kind`.
 * [in] kind: the refused call.
 * [in] code: the result the refused call stands for; EPX_SUCCESS or a value outside epx_result_t
 *      counts as EPX_ERR_INVALID_ARG.
 * [in] reason: the detail epx_last_error_message() returns after this call (NULL: a generic one).
 * [in] stream: the refused call's stream as far as the caller knows it (NULL otherwise); telling
 *      the peers never breaks a capture on it.
 * Returns `code` (as adjusted above) after telling the peers. Without telling anyone:
 * EPX_ERR_INVALID_ARG for a NULL or unknown buffer or an unknown kind, EPX_ERR_INVALID_USAGE for a
 * destroyed buffer or one another thread is inside (one thread at a time per buffer, as for every
 * entry point). */
EPX_API epx_result_t epx_buffer_refuse_collective(epx_buffer_t buffer, epx_collective_t kind,
                                                  epx_result_t code, const char *reason, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* EPX_EPX_H */
