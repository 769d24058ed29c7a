/*
 * The test GIN plugin's own declaration of the plugin ABI NCCL 2.28 loads from a net plugin library
 * (NCCL_NET_PLUGIN): the v11 GIN table (symbol ncclGinPlugin_v11) and the v11 net table (symbol
 * ncclNetPlugin_v11), which NCCL 2.28 requires in the same library before it looks at the GIN table.
 * Written from the layout NCCL documents in src/include/plugin/net/net_v11.h and
 * nccl_device/net_device.h; names are the plugin's own, layouts and values must match NCCL's.
 */
#ifndef EPX_GIN_PLUGIN_GIN_V11_H
#define EPX_GIN_PLUGIN_GIN_V11_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ncclResult_t: NCCL reads the returned int. */
typedef enum gin11_result {
    GIN11_OK = 0,
    GIN11_CUDA_ERROR = 1,
    GIN11_SYSTEM_ERROR = 2,
    GIN11_INTERNAL_ERROR = 3,
    GIN11_INVALID_ARGUMENT = 4,
    GIN11_INVALID_USAGE = 5,
    GIN11_REMOTE_ERROR = 6,
} gin11_result_t;

/* The logger NCCL passes to init (level, subsystem flags, file, line, printf format). */
enum { GIN11_LOG_WARN = 2, GIN11_LOG_INFO = 3, GIN11_LOG_TRACE = 5 };
enum { GIN11_SUBSYS_INIT = 0x1, GIN11_SUBSYS_NET = 0x10 };
typedef void (*gin11_logger_t)(int level, unsigned long flags, const char *file, int line, const char *fmt, ...);

#define GIN11_HANDLE_MAXSIZE 128 /* listen's handle, all-gathered by NCCL */
#define GIN11_PTR_HOST       0x1
#define GIN11_PTR_CUDA       0x2
#define GIN11_PTR_DMABUF     0x4
#define GIN11_MAX_REQUESTS   32  /* per comm object: NCCL sizes its proxy queue per peer as this x maxRecvs */
#define GIN11_MR_FLAG_FORCE_SO 0x1 /* regMrSym: force strong ordering (NCCL's signal buffer) */
#define GIN11_SIGNAL_OP_INC  0x1
#define GIN11_SIGNAL_OP_ADD  0x2

/* netDeviceType values */
enum { GIN11_DEVICE_HOST = 0, GIN11_DEVICE_UNPACK = 1, GIN11_DEVICE_GIN_PROXY = 2, GIN11_DEVICE_GIN_GDAKI = 3 };

#define GIN11_MAX_DEVS_PER_NIC 4

typedef struct gin11_vdevice_props {
    int ndevs;
    int devs[GIN11_MAX_DEVS_PER_NIC];
} gin11_vdevice_props_t;

typedef struct gin11_properties {
    char *name;
    char *pci_path;
    uint64_t guid;
    int ptr_support; /* GIN11_PTR_* bits */
    int reg_is_global;
    int force_flush;
    int speed_mbps;
    int port;
    float latency;
    int max_comms;
    int max_recvs;
    int net_device_type; /* an enum in NCCL: int-sized */
    int net_device_version;
    gin11_vdevice_props_t vprops;
    size_t max_p2p_bytes;
    size_t max_coll_bytes;
    int max_multi_request_size;
} gin11_properties_t;

/* What createContext / the net connect calls hand out for device offload (unused by a proxy plugin). */
typedef struct gin11_device_handle {
    int net_device_type;
    int net_device_version;
    void *handle;
    size_t size;
    int needs_proxy_progress;
} gin11_device_handle_t;

typedef struct gin11_gin {
    const char *name;
    gin11_result_t (*init)(void **ctx, uint64_t comm_id, gin11_logger_t log);
    gin11_result_t (*devices)(int *ndev);
    gin11_result_t (*get_properties)(int dev, gin11_properties_t *props);
    gin11_result_t (*listen)(void *ctx, int dev, void *handle, void **listen_comm);
    gin11_result_t (*connect)(void *ctx, void *handles[], int nranks, int rank, void *listen_comm,
                              void **coll_comm);
    gin11_result_t (*create_context)(void *coll_comm, int nsignals, int ncounters, void **gin_ctx,
                                     gin11_device_handle_t **dev_handle);
    gin11_result_t (*reg_mr_sym)(void *coll_comm, void *data, size_t size, int type, uint64_t mr_flags,
                                 void **mhandle, void **gin_handle);
    gin11_result_t (*reg_mr_sym_dmabuf)(void *coll_comm, void *data, size_t size, int type, uint64_t offset,
                                        int fd, uint64_t mr_flags, void **mhandle, void **gin_handle);
    gin11_result_t (*dereg_mr_sym)(void *coll_comm, void *mhandle);
    gin11_result_t (*destroy_context)(void *gin_ctx);
    gin11_result_t (*close_coll)(void *coll_comm);
    gin11_result_t (*close_listen)(void *listen_comm);
    gin11_result_t (*iput)(void *coll_comm, uint64_t src_off, void *src_mhandle, size_t size, uint64_t dst_off,
                           void *dst_mhandle, uint32_t rank, void **request);
    gin11_result_t (*iput_signal)(void *coll_comm, uint64_t src_off, void *src_mhandle, size_t size,
                                  uint64_t dst_off, void *dst_mhandle, uint32_t rank, uint64_t signal_off,
                                  void *signal_mhandle, uint64_t signal_value, uint32_t signal_op,
                                  void **request);
    gin11_result_t (*test)(void *coll_comm, void *request, int *done);
    gin11_result_t (*progress)(void *coll_comm);
    gin11_result_t (*query_last_error)(void *gin_ctx, bool *has_error);
    gin11_result_t (*finalize)(void *ctx);
} gin11_gin_t;

/* The v11 net table, in NCCL's order. The plugin fills every entry (see plugin.c for what each does). */
typedef struct gin11_net_config {
    int traffic_class;
} gin11_net_config_t;

typedef struct gin11_net_attr {
    int32_t send_attr[4];
    int32_t recv_attr[4];
    uint32_t op, algo, proto;
} gin11_net_attr_t;

typedef gin11_result_t (*gin11_profiler_cb_t)(void **event, int type, void *parent, int64_t plugin_id,
                                              void *ext);

typedef struct gin11_net {
    const char *name;
    gin11_result_t (*init)(void **ctx, uint64_t comm_id, gin11_net_config_t *config, gin11_logger_t log,
                           gin11_profiler_cb_t prof);
    gin11_result_t (*devices)(int *ndev);
    gin11_result_t (*get_properties)(int dev, gin11_properties_t *props);
    gin11_result_t (*listen)(void *ctx, int dev, void *handle, void **listen_comm);
    gin11_result_t (*connect)(void *ctx, int dev, void *handle, void **send_comm,
                              gin11_device_handle_t **send_dev_comm);
    gin11_result_t (*accept)(void *listen_comm, void **recv_comm, gin11_device_handle_t **recv_dev_comm);
    gin11_result_t (*reg_mr)(void *comm, void *data, size_t size, int type, void **mhandle);
    gin11_result_t (*reg_mr_dmabuf)(void *comm, void *data, size_t size, int type, uint64_t offset, int fd,
                                    void **mhandle);
    gin11_result_t (*dereg_mr)(void *comm, void *mhandle);
    gin11_result_t (*isend)(void *send_comm, void *data, size_t size, int tag, void *mhandle, void *phandle,
                            void **request);
    gin11_result_t (*irecv)(void *recv_comm, int n, void **data, size_t *sizes, int *tags, void **mhandles,
                            void **phandles, void **request);
    gin11_result_t (*iflush)(void *recv_comm, int n, void **data, int *sizes, void **mhandles, void **request);
    gin11_result_t (*test)(void *request, int *done, int *sizes);
    gin11_result_t (*close_send)(void *send_comm);
    gin11_result_t (*close_recv)(void *recv_comm);
    gin11_result_t (*close_listen)(void *listen_comm);
    gin11_result_t (*get_device_mr)(void *comm, void *mhandle, void **dptr_mhandle);
    gin11_result_t (*irecv_consumed)(void *recv_comm, int n, void *request);
    gin11_result_t (*make_vdevice)(int *d, gin11_vdevice_props_t *props);
    gin11_result_t (*finalize)(void *ctx);
    gin11_result_t (*set_net_attr)(void *ctx, gin11_net_attr_t *attr);
} gin11_net_t;

#endif
