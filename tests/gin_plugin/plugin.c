/*
 * The export of the test GIN plugin: ncclGinPlugin_v11, a GIN implementation of the proxy type over the
 * queue core (queue.h) and the CUDA mover (mover_cuda.h), and ncclNetPlugin_v11, the net table NCCL
 * 2.28 requires in the same library before it takes the GIN table. The net table initialises and
 * reports one host device but refuses connections: this library carries GIN traffic only.
 * A test instrument for one machine, never linked into libepx.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gin_v11.h"
#include "link.h"
#include "mover_cuda.h"
#include "queue.h"
#include "teardown.h"

#define PLUGIN_NAME      "EPX_GIN_TEST"
#define EXPORT           __attribute__((visibility("default")))
#define DEADLINE_ENV     "EPX_GIN_TEST_TIMEOUT_MS"
#define DEFAULT_DEADLINE 30000

static gin11_logger_t logger;
static int contexts_failed; /* contexts of this process in error, for queryLastError */
static int next_context;

static void say(int level, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void say(int level, int line, const char *fmt, ...)
{
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    if (logger)
        logger(level, GIN11_SUBSYS_NET | GIN11_SUBSYS_INIT, __FILE__, line, "%s: %s", PLUGIN_NAME, text);
    else if (level == GIN11_LOG_WARN)
        fprintf(stderr, "%s: %s\n", PLUGIN_NAME, text);
}
#define WARN(...) say(GIN11_LOG_WARN, __LINE__, __VA_ARGS__)
#define INFO(...) say(GIN11_LOG_INFO, __LINE__, __VA_ARGS__)

typedef struct plugin_ctx {
    uint64_t comm_id;
    ginq_faults_t faults;
    uint64_t deadline_ms;
} plugin_ctx_t;

typedef struct listen_comm {
    int sock; /* -1 once connect took it */
    uint64_t serial;
} listen_comm_t;

typedef struct coll_comm {
    plugin_ctx_t *ctx;
    link_t link;
    cuda_mover_t *mover;
    ginq_t *q;
    int rank, nranks, context, reported;
} coll_comm_t;

static uint64_t deadline_from_env(void)
{
    const char *s = getenv(DEADLINE_ENV);
    if (!s || !s[0]) return DEFAULT_DEADLINE;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end || v == 0) {
        WARN("%s='%s' is not a positive number of milliseconds; using %d", DEADLINE_ENV, s, DEFAULT_DEADLINE);
        return DEFAULT_DEADLINE;
    }
    return v;
}

/* ---- GIN: setup --------------------------------------------------------------------------------- */

static gin11_result_t gin_init(void **ctx, uint64_t comm_id, gin11_logger_t log)
{
    if (log) logger = log;
    if (!ctx) return GIN11_INVALID_ARGUMENT;
    plugin_ctx_t *c = calloc(1, sizeof(*c));
    if (!c) return GIN11_SYSTEM_ERROR;
    char err[256] = "";
    if (ginq_faults_parse(getenv(GINQ_FAULTS_ENV), &c->faults, err, sizeof(err)) != GINQ_OK) {
        WARN("%s: %s", GINQ_FAULTS_ENV, err);
        free(c);
        return GIN11_INVALID_ARGUMENT;
    }
    c->comm_id = comm_id;
    c->deadline_ms = deadline_from_env();
    INFO("GIN plugin (proxy type, CUDA IPC between processes of one machine) initialised in pid %d: faults "
         "delay_us=%llu delay_nth=%llu reorder=%d fail_nth=%llu seed=%llu, deadline %llu ms",
         (int)getpid(), (unsigned long long)c->faults.delay_us, (unsigned long long)c->faults.delay_nth,
         c->faults.reorder, (unsigned long long)c->faults.fail_nth, (unsigned long long)c->faults.seed,
         (unsigned long long)c->deadline_ms);
    *ctx = c;
    return GIN11_OK;
}

static gin11_result_t gin_devices(int *ndev)
{
    if (!ndev) return GIN11_INVALID_ARGUMENT;
    *ndev = 1;
    return GIN11_OK;
}

static void fill_properties(gin11_properties_t *p, int device_type)
{
    memset(p, 0, sizeof(*p));
    p->name = (char *)PLUGIN_NAME;
    p->pci_path = NULL;
    p->guid = 0x65707867696e7431ull;
    p->ptr_support = device_type == GIN11_DEVICE_GIN_PROXY ? GIN11_PTR_HOST | GIN11_PTR_CUDA : GIN11_PTR_HOST;
    p->speed_mbps = 100000;
    p->max_comms = 65536;
    p->max_recvs = 1; /* NCCL's proxy queue per peer: GIN11_MAX_REQUESTS x this */
    p->net_device_type = device_type;
    p->vprops.ndevs = 1;
    p->max_p2p_bytes = 1ull << 30;
    p->max_coll_bytes = 1ull << 30;
    p->max_multi_request_size = 1;
}

static gin11_result_t gin_get_properties(int dev, gin11_properties_t *props)
{
    if (dev != 0 || !props) return GIN11_INVALID_ARGUMENT;
    fill_properties(props, GIN11_DEVICE_GIN_PROXY);
    return GIN11_OK;
}

static gin11_result_t gin_listen(void *ctx, int dev, void *handle, void **listen_comm)
{
    if (!ctx || dev != 0 || !handle || !listen_comm) return GIN11_INVALID_ARGUMENT;
    _Static_assert(sizeof(link_handle_t) <= GIN11_HANDLE_MAXSIZE, "the listen handle must fit NCCL's");
    listen_comm_t *l = calloc(1, sizeof(*l));
    if (!l) return GIN11_SYSTEM_ERROR;
    char err[256];
    link_handle_t h;
    if (link_listen(&h, &l->sock, err, sizeof(err))) {
        WARN("%s", err);
        free(l);
        return GIN11_SYSTEM_ERROR;
    }
    l->serial = h.serial;
    memset(handle, 0, GIN11_HANDLE_MAXSIZE);
    memcpy(handle, &h, sizeof(h));
    *listen_comm = l;
    return GIN11_OK;
}

static void free_coll(coll_comm_t *c)
{
    ginq_destroy(c->q);
    cuda_mover_destroy(c->mover);
    link_close(&c->link);
    free(c);
}

static gin11_result_t gin_connect(void *ctx, void *handles[], int nranks, int rank, void *listen_comm,
                                  void **coll_comm)
{
    listen_comm_t *l = listen_comm;
    if (!ctx || !handles || nranks < 1 || rank < 0 || rank >= nranks || !l || l->sock < 0 || !coll_comm)
        return GIN11_INVALID_ARGUMENT;
    plugin_ctx_t *pc = ctx;
    coll_comm_t *c = calloc(1, sizeof(*c));
    if (!c) return GIN11_SYSTEM_ERROR;
    c->link.sock = -1;
    c->ctx = pc;
    c->rank = rank;
    c->nranks = nranks;
    c->context = __atomic_fetch_add(&next_context, 1, __ATOMIC_RELAXED);
    /* NCCL keeps at most GIN11_MAX_REQUESTS x max_recvs operations in flight per peer. */
    int capacity = nranks * GIN11_MAX_REQUESTS;
    ginq_config_t cfg = {
        .rank = rank, .nranks = nranks, .context = c->context, .capacity = capacity, .faults = pc->faults};
    ginq_mover_t iface;
    char err[256] = "";
    int sock = l->sock;
    l->sock = -1; /* the link owns it now, whatever happens */
    if (link_connect(&c->link, sock, l->serial, handles, nranks, rank, (uint64_t)capacity, pc->deadline_ms,
                     err, sizeof(err)) ||
        cuda_mover_create(&c->link, capacity, &c->mover, err, sizeof(err)))
        goto fail;
    cuda_mover_interface(c->mover, &iface);
    if (ginq_create(&cfg, &iface, err, sizeof(err), &c->q) != GINQ_OK) goto fail;
    INFO("rank %d of %d connected (context %d, %d requests, pid %d)", rank, nranks, c->context, capacity,
         (int)getpid());
    *coll_comm = c;
    return GIN11_OK;
fail:
    WARN("rank %d of %d: connect failed: %s", rank, nranks, err);
    free_coll(c);
    return GIN11_SYSTEM_ERROR;
}

static gin11_result_t gin_create_context(void *coll_comm, int nsignals, int ncounters, void **gin_ctx,
                                         gin11_device_handle_t **dev_handle)
{
    WARN("createContext called, but this is a proxy-type plugin: NCCL builds the proxy context itself");
    return GIN11_INVALID_USAGE;
}

static gin11_result_t gin_destroy_context(void *gin_ctx)
{
    if (!gin_ctx) return GIN11_OK;
    WARN("destroyContext called with a context this plugin never created");
    return GIN11_INVALID_USAGE;
}

/* ---- GIN: memory -------------------------------------------------------------------------------- */

static gin11_result_t gin_reg_mr_sym(void *coll_comm, void *data, size_t size, int type, uint64_t mr_flags,
                                     void **mhandle, void **gin_handle)
{
    coll_comm_t *c = coll_comm;
    if (!c || !data || size == 0 || !mhandle || !gin_handle) return GIN11_INVALID_ARGUMENT;
    if (type != GIN11_PTR_HOST && type != GIN11_PTR_CUDA) {
        WARN("rank %d: regMrSym of %p: memory type %d is neither host (1) nor cuda (2)", c->rank, data, type);
        return GIN11_INVALID_ARGUMENT;
    }
    /* Strong ordering (GIN11_MR_FLAG_FORCE_SO) is what the core gives every signal: nothing to set. */
    cuda_region_t *r = NULL;
    char err[256] = "";
    if (cuda_mover_register(c->mover, data, size, type, &r, err, sizeof(err))) {
        WARN("rank %d: regMrSym of %p (%zu bytes, type %d): %s", c->rank, data, size, type, err);
        return GIN11_SYSTEM_ERROR;
    }
    /* One handle for both roles: NCCL's proxy passes the mhandle of its inline buffer and the GIN
     * handles of windows and signals to iput alike. */
    *mhandle = *gin_handle = cuda_region_core(r);
    return GIN11_OK;
}

static gin11_result_t gin_reg_mr_sym_dmabuf(void *coll_comm, void *data, size_t size, int type,
                                            uint64_t offset, int fd, uint64_t mr_flags, void **mhandle,
                                            void **gin_handle)
{
    WARN("regMrSymDmaBuf: this plugin does not advertise DMA-BUF (ptrSupport lacks it); use regMrSym");
    return GIN11_INVALID_USAGE;
}

static gin11_result_t gin_dereg_mr_sym(void *coll_comm, void *mhandle)
{
    coll_comm_t *c = coll_comm;
    if (!c || !mhandle) return GIN11_INVALID_ARGUMENT;
    cuda_mover_deregister(c->mover, ((ginq_region_t *)mhandle)->mover_data);
    return GIN11_OK;
}

/* ---- GIN: data path (NCCL's GIN progress thread) ------------------------------------------------ */

/* The request of a put of no bytes without a signal: nothing to move, complete at once. */
static char empty_request;

static gin11_result_t post(coll_comm_t *c, const ginq_desc_t *d, void **request)
{
    if (d->bytes == 0 && d->signal_op == GINQ_SIGNAL_NONE) {
        *request = &empty_request;
        return GIN11_OK;
    }
    ginq_req_t *req = NULL;
    ginq_result_t res = ginq_post(c->q, d, &req);
    if (res == GINQ_OK) {
        *request = req;
        return GIN11_OK;
    }
    char msg[256];
    ginq_message(c->q, msg, sizeof(msg));
    WARN("%s", msg);
    return res == GINQ_EINVAL    ? GIN11_INVALID_ARGUMENT
           : res == GINQ_EFAILED ? GIN11_REMOTE_ERROR
                                 : GIN11_INTERNAL_ERROR;
}

static gin11_result_t gin_iput(void *coll_comm, uint64_t src_off, void *src_mhandle, size_t size,
                               uint64_t dst_off, void *dst_mhandle, uint32_t rank, void **request)
{
    coll_comm_t *c = coll_comm;
    if (!c || !request || (size > 0 && (!src_mhandle || !dst_mhandle))) return GIN11_INVALID_ARGUMENT;
    ginq_desc_t d = {.peer = (int)rank,
                     .src = src_mhandle,
                     .src_off = src_off,
                     .dst = dst_mhandle,
                     .dst_off = dst_off,
                     .bytes = size};
    return post(c, &d, request);
}

static gin11_result_t gin_iput_signal(void *coll_comm, uint64_t src_off, void *src_mhandle, size_t size,
                                      uint64_t dst_off, void *dst_mhandle, uint32_t rank, uint64_t signal_off,
                                      void *signal_mhandle, uint64_t signal_value, uint32_t signal_op,
                                      void **request)
{
    coll_comm_t *c = coll_comm;
    if (!c || !request || !signal_mhandle || (size > 0 && (!src_mhandle || !dst_mhandle)))
        return GIN11_INVALID_ARGUMENT;
    if (signal_op != GIN11_SIGNAL_OP_INC && signal_op != GIN11_SIGNAL_OP_ADD) {
        WARN("rank %d: iputSignal to peer %u: unknown signal op %u", c->rank, rank, signal_op);
        return GIN11_INVALID_ARGUMENT;
    }
    ginq_desc_t d = {.peer = (int)rank,
                     .src = src_mhandle,
                     .src_off = src_off,
                     .dst = dst_mhandle,
                     .dst_off = dst_off,
                     .bytes = size,
                     .signal_op = (ginq_signal_op_t)signal_op,
                     .signal = signal_mhandle,
                     .signal_off = signal_off,
                     .signal_value = signal_value,
                     .signal_weak = 0};
    return post(c, &d, request);
}

static gin11_result_t gin_test(void *coll_comm, void *request, int *done)
{
    coll_comm_t *c = coll_comm;
    if (!c || !request || !done) return GIN11_INVALID_ARGUMENT;
    if (request == &empty_request) {
        *done = 1;
        return GIN11_OK;
    }
    char msg[256] = "";
    ginq_result_t res = ginq_test(c->q, request, done, msg, sizeof(msg));
    if (res == GINQ_OK) return GIN11_OK;
    if (res == GINQ_EFAILED) {
        WARN("%s", msg);
        return GIN11_REMOTE_ERROR;
    }
    ginq_message(c->q, msg, sizeof(msg));
    WARN("%s", msg);
    return GIN11_INVALID_ARGUMENT;
}

static gin11_result_t gin_progress(void *coll_comm)
{
    coll_comm_t *c = coll_comm;
    if (!c) return GIN11_INVALID_ARGUMENT;
    char err[256] = "";
    if (cuda_mover_serve(c->mover, err, sizeof(err))) WARN("rank %d: %s", c->rank, err);
    if (ginq_progress(c->q) == GINQ_OK) return GIN11_OK;
    if (!c->reported) {
        c->reported = 1;
        __atomic_fetch_add(&contexts_failed, 1, __ATOMIC_RELAXED);
        ginq_failed(c->q, err, sizeof(err));
        WARN("context %d failed: %s", c->context, err);
    }
    return GIN11_REMOTE_ERROR;
}

static gin11_result_t gin_query_last_error(void *gin_ctx, bool *has_error)
{
    if (!has_error) return GIN11_INVALID_ARGUMENT;
    *has_error = __atomic_load_n(&contexts_failed, __ATOMIC_RELAXED) > 0;
    return GIN11_OK;
}

/* ---- GIN: teardown ------------------------------------------------------------------------------ */

static int serve_adds(void *mover, char *err, size_t err_len)
{
    return cuda_mover_serve(mover, err, err_len);
}

static int serve_idle(void *mover)
{
    return cuda_mover_serve_idle(mover);
}

static void warn_text(const char *msg)
{
    WARN("%s", msg);
}

/* The close sequence (teardown.h) within the deadline, then the context is freed. */
static gin11_result_t gin_close_coll(void *coll_comm)
{
    coll_comm_t *c = coll_comm;
    if (!c) return GIN11_INVALID_ARGUMENT;
    char err[256] = "";
    gin_server_t srv = {c->mover, serve_adds, serve_idle, warn_text};
    ginq_result_t res =
        gin_teardown(c->q, &c->link, &srv, c->rank, c->context, c->ctx->deadline_ms, err, sizeof(err));
    gin11_result_t rc = GIN11_OK;
    if (res != GINQ_OK) {
        WARN("rank %d: close of context %d: %s", c->rank, c->context, err);
        rc = res == GINQ_ETIMEDOUT ? GIN11_INTERNAL_ERROR : GIN11_REMOTE_ERROR;
    }
    free_coll(c);
    return rc;
}

static gin11_result_t gin_close_listen(void *listen_comm)
{
    listen_comm_t *l = listen_comm;
    if (!l) return GIN11_OK;
    if (l->sock >= 0) close(l->sock);
    free(l);
    return GIN11_OK;
}

static gin11_result_t gin_finalize(void *ctx)
{
    free(ctx);
    return GIN11_OK;
}

EXPORT gin11_gin_t ncclGinPlugin_v11 = {
    .name = PLUGIN_NAME,
    .init = gin_init,
    .devices = gin_devices,
    .get_properties = gin_get_properties,
    .listen = gin_listen,
    .connect = gin_connect,
    .create_context = gin_create_context,
    .reg_mr_sym = gin_reg_mr_sym,
    .reg_mr_sym_dmabuf = gin_reg_mr_sym_dmabuf,
    .dereg_mr_sym = gin_dereg_mr_sym,
    .destroy_context = gin_destroy_context,
    .close_coll = gin_close_coll,
    .close_listen = gin_close_listen,
    .iput = gin_iput,
    .iput_signal = gin_iput_signal,
    .test = gin_test,
    .progress = gin_progress,
    .query_last_error = gin_query_last_error,
    .finalize = gin_finalize,
};

/* ---- the net table NCCL 2.28 requires beside it ------------------------------------------------- */

static gin11_result_t net_refuse(const char *call)
{
    WARN("net %s: this plugin carries GIN only; ordinary NCCL traffic (collectives, send/recv) between "
         "emulated nodes is not supported with it",
         call);
    return GIN11_INVALID_USAGE;
}

static gin11_result_t net_init(void **ctx, uint64_t comm_id, gin11_net_config_t *config, gin11_logger_t log,
                               gin11_profiler_cb_t prof)
{
    if (log) logger = log;
    if (ctx) *ctx = NULL;
    INFO("net table initialised (one host device; it refuses connections: GIN only)");
    return GIN11_OK;
}

static gin11_result_t net_get_properties(int dev, gin11_properties_t *props)
{
    if (dev != 0 || !props) return GIN11_INVALID_ARGUMENT;
    fill_properties(props, GIN11_DEVICE_HOST);
    return GIN11_OK;
}

static gin11_result_t net_listen(void *ctx, int dev, void *handle, void **listen_comm)
{
    return net_refuse("listen");
}
static gin11_result_t net_connect(void *ctx, int dev, void *handle, void **send_comm,
                                  gin11_device_handle_t **dc)
{
    return net_refuse("connect");
}
static gin11_result_t net_accept(void *listen_comm, void **recv_comm, gin11_device_handle_t **dc)
{
    return net_refuse("accept");
}
static gin11_result_t net_reg_mr(void *comm, void *data, size_t size, int type, void **mhandle)
{
    return net_refuse("regMr");
}
static gin11_result_t net_reg_mr_dmabuf(void *comm, void *data, size_t size, int type, uint64_t offset,
                                        int fd, void **mhandle)
{
    return net_refuse("regMrDmaBuf");
}
static gin11_result_t net_dereg_mr(void *comm, void *mhandle)
{
    return mhandle ? net_refuse("deregMr") : GIN11_OK;
}
static gin11_result_t net_isend(void *send_comm, void *data, size_t size, int tag, void *mh, void *ph,
                                void **req)
{
    return net_refuse("isend");
}
static gin11_result_t net_irecv(void *recv_comm, int n, void **data, size_t *sizes, int *tags, void **mhs,
                                void **phs, void **req)
{
    return net_refuse("irecv");
}
static gin11_result_t net_iflush(void *recv_comm, int n, void **data, int *sizes, void **mhs, void **req)
{
    return net_refuse("iflush");
}
static gin11_result_t net_test(void *request, int *done, int *sizes)
{
    return net_refuse("test");
}
static gin11_result_t net_close(void *comm)
{
    return comm ? net_refuse("close") : GIN11_OK;
}
static gin11_result_t net_get_device_mr(void *comm, void *mhandle, void **dptr)
{
    return net_refuse("getDeviceMr");
}
static gin11_result_t net_irecv_consumed(void *recv_comm, int n, void *request)
{
    return net_refuse("irecvConsumed");
}
static gin11_result_t net_make_vdevice(int *d, gin11_vdevice_props_t *props)
{
    if (!d || !props || props->ndevs != 1 || props->devs[0] != 0)
        return net_refuse("makeVDevice (merging devices)");
    *d = 0;
    return GIN11_OK;
}
static gin11_result_t net_finalize(void *ctx)
{
    return GIN11_OK;
}
static gin11_result_t net_set_net_attr(void *ctx, gin11_net_attr_t *attr)
{
    return GIN11_OK; /* a tuning hint: nothing to tune */
}

EXPORT gin11_net_t ncclNetPlugin_v11 = {
    .name = PLUGIN_NAME,
    .init = net_init,
    .devices = gin_devices,
    .get_properties = net_get_properties,
    .listen = net_listen,
    .connect = net_connect,
    .accept = net_accept,
    .reg_mr = net_reg_mr,
    .reg_mr_dmabuf = net_reg_mr_dmabuf,
    .dereg_mr = net_dereg_mr,
    .isend = net_isend,
    .irecv = net_irecv,
    .iflush = net_iflush,
    .test = net_test,
    .close_send = net_close,
    .close_recv = net_close,
    .close_listen = net_close,
    .get_device_mr = net_get_device_mr,
    .irecv_consumed = net_irecv_consumed,
    .make_vdevice = net_make_vdevice,
    .finalize = net_finalize,
    .set_net_attr = net_set_net_attr,
};
