/*
 * A rank of a fault trial: init, buffer creation, then one operation loop that runs until a call
 * fails, every output of a successful call checked. Inputs are small integers that encode (source
 * rank, token, call) in channels 0-2, so a row that was not sent in this very call shows; rank r
 * answers each received row with the row times r + 1, so each combined row names the ranks (or
 * experts) that contributed. Token t of rank s always selects an expert of rank (s + t) % R and every
 * rank sends at least R tokens: each receiving call needs data from every peer.
 */
#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core/internal.h"
#include "fault.h"
#include "reference.h"

#ifdef EPX_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#define H  FAULT_HIDDEN
#define K  FAULT_TOPK
#define TM FAULT_T_MAX
#define L  FAULT_LOCAL
/* The loop's own cap, far past any watchdog: a rank never runs unbounded. */
#define LOOP_CAP_S 120.0
/* A call that receives what the peers sent in the same call. */
#define NEEDS_SELF (-2)

int fault_count_fds(int live_only)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.' || atoi(e->d_name) == dirfd(d)) continue;
        int fd = atoi(e->d_name), listening = 0;
        socklen_t len = sizeof(listening);
        struct sockaddr_storage peer;
        socklen_t plen = sizeof(peer);
        if (live_only && getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) == 0 && !listening &&
            getpeername(fd, (struct sockaddr *)&peer, &plen) != 0 && errno == ENOTCONN)
            continue;
        n++;
    }
    closedir(d);
    return n;
}

double fault_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Caller memory the library reads or writes: device memory with a host mirror on cuda, else one
 * host block. */
typedef struct mem {
    void *h, *d;
    size_t bytes;
} mem_t;

typedef struct rank_state {
    const fault_plan_t *plan;
    fault_rec_t *rec;
    int rank, R, E, cuda, device, seq;
    double start;
    const epx_unique_id_t *id;
    epx_comm_t comm;
    epx_buffer_t buf;
    epx_handle_t handle; /* outstanding HT or routing-map handle */
    mem_t x, topk, w, map, recv, y, out, count, src, tpe;
} rank_state_t;

/* ------------------------------------------------------------------------ inputs ---- */

static uint64_t hash(const rank_state_t *st, uint64_t a, uint64_t b, uint64_t c, uint64_t d)
{
    return ref_hash(st->plan->seed, a, b, c, d);
}

static int num_tokens(const rank_state_t *st, int s, uint64_t rtag)
{
    return st->R + (int)(hash(st, 1, (uint64_t)s, rtag, 0) % (uint64_t)(TM - st->R + 1));
}

/* Token t of rank s: K distinct experts or -1, slot 0 always on rank (s + t) % R. */
static void route(const rank_state_t *st, int s, int t, uint64_t rtag, int64_t *row)
{
    row[0] = (int64_t)((s + t) % st->R) * L + (int64_t)(hash(st, 2, (uint64_t)s, (uint64_t)t, rtag) % L);
    for (int k = 1; k < K; k++) {
        uint64_t h = hash(st, 3 + (uint64_t)k, (uint64_t)s, (uint64_t)t, rtag);
        int64_t e = h % 4 == 0 ? -1 : (int64_t)((h >> 8) % (uint64_t)st->E);
        for (int j = 0; j < k; j++)
            if (row[j] == e) e = -1;
        row[k] = e;
    }
}

static int selects(const rank_state_t *st, int s, int t, uint64_t rtag, int64_t e)
{
    int64_t row[K];
    route(st, s, t, rtag, row);
    for (int k = 0; k < K; k++)
        if (row[k] == e) return 1;
    return 0;
}

static int reaches(const rank_state_t *st, int s, int t, uint64_t rtag, int r)
{
    int64_t row[K];
    route(st, s, t, rtag, row);
    for (int k = 0; k < K; k++)
        if (row[k] >= 0 && row[k] / L == r) return 1;
    return 0;
}

/* Sum of r + 1 over the ranks token (s, t) reaches (per_expert 0), or over its experts' ranks. */
static float factor(const rank_state_t *st, int s, int t, uint64_t rtag, int per_expert)
{
    int64_t row[K];
    route(st, s, t, rtag, row);
    float f = 0.0f;
    if (per_expert) {
        for (int k = 0; k < K; k++)
            if (row[k] >= 0) f += (float)(row[k] / L + 1);
        return f;
    }
    for (int r = 0; r < st->R; r++)
        if (reaches(st, s, t, rtag, r)) f += (float)(r + 1);
    return f;
}

/* Channel c of token (s, t) in the dispatch of xtag: exact in bf16, also times 21 (1 + ... + 6). */
static float xval(const rank_state_t *st, int s, int t, uint64_t xtag, int c)
{
    if (c == 0) return (float)(s + 1);
    if (c == 1) return (float)(t + 1);
    if (c == 2) return (float)(xtag % 8 + 1);
    return (float)((int)(hash(st, 9, (uint64_t)(s * 64 + t), xtag, (uint64_t)c) % 7) - 3);
}

/* ------------------------------------------------------------------------ memory ---- */

static int mem_alloc(rank_state_t *st, mem_t *m, size_t bytes)
{
    m->bytes = bytes;
    m->h = calloc(1, bytes);
    m->d = m->h;
#ifdef EPX_HAVE_CUDA
    if (st->cuda && (cudaMalloc(&m->d, bytes) != cudaSuccess || cudaMemset(m->d, 0, bytes) != cudaSuccess))
        m->d = NULL;
#endif
    return m->h && m->d ? 0 : 1;
}

static void mem_free(rank_state_t *st, mem_t *m)
{
#ifdef EPX_HAVE_CUDA
    if (st->cuda && m->d) cudaFree(m->d);
#endif
    free(m->h);
    m->h = m->d = NULL;
}

enum { MEM_DOWN = 0, MEM_UP = 1 };

/* The host copy to the device (MEM_UP) or back (MEM_DOWN); on the host backend both are one copy. */
static void mem_sync(const rank_state_t *st, const mem_t *m, int up)
{
#ifdef EPX_HAVE_CUDA
    if (st->cuda)
        cudaMemcpy(up ? m->d : m->h, up ? m->h : m->d, m->bytes,
                   up ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost);
#endif
    (void)st;
    (void)m;
    (void)up;
}

static epx_tensor_t tensor(const rank_state_t *st, const mem_t *m, epx_dtype_t dtype, int ndim, int64_t d0,
                           int64_t d1, int64_t d2)
{
    epx_tensor_t t = epx_tensor_3d(m->d, dtype, d0, d1, d2);
    t.ndim = ndim;
    for (int i = ndim; i < EPX_MAX_DIMS; i++) t.shape[i] = 0;
    if (st->cuda) {
        t.device_type = EPX_DEVICE_CUDA;
        t.device_id = st->device;
    }
    return t;
}

/* ------------------------------------------------------------------------- calls ---- */

static int call_begin(rank_state_t *st)
{
    st->rec->t_entered = fault_now();
    st->rec->entered = st->seq;
    return st->seq++;
}

/* Ends call k: on cuda a success counts only once the device finished without an async error.
 * Returns 0 after a success, 1 after recording the failure. */
static int call_end(rank_state_t *st, int k, int needs, epx_result_t res, const char *what)
{
#ifdef EPX_HAVE_CUDA
    if (st->cuda && res == EPX_SUCCESS && st->comm) {
        cudaError_t e = cudaDeviceSynchronize();
        res = epx_get_async_error(st->comm);
        if (res == EPX_SUCCESS && e != cudaSuccess) res = EPX_ERR_CUDA;
    }
#endif
    fault_rec_t *rec = st->rec;
    if (res != EPX_SUCCESS) {
        rec->t_err = fault_now();
        rec->err_call = k;
        rec->err_res = res;
        snprintf(rec->err_what, sizeof(rec->err_what), "%s", what);
        snprintf(rec->err_msg, sizeof(rec->err_msg), "%s", epx_last_error_message());
        return 1;
    }
    rec->ok_calls++;
    if (needs != -1) rec->last_recv_needs = needs == NEEDS_SELF ? k : needs;
    return 0;
}

/* Runs one dispatch as call number k_, keeping the handle it made (*handle_ = out_.handle) even
 * when the device fails the call after it returned (static mode on cuda): teardown frees it. */
#define RUN_DISPATCH(st, what, expr, out_, handle_, k_)                            \
    do {                                                                           \
        k_ = call_begin(st);                                                       \
        const epx_result_t run_res_ = (expr);                                      \
        if (run_res_ == EPX_SUCCESS) *(handle_) = (out_).handle;                   \
        if (call_end(st, k_, NEEDS_SELF, run_res_, what)) return FAULT_LOOP_ENDED; \
    } while (0)

/* Runs one epx call as call number k_ (set to its number). */
#define RUN(st, needs, what, expr, k_)                                      \
    do {                                                                    \
        k_ = call_begin(st);                                                \
        if (call_end(st, k_, needs, (expr), what)) return FAULT_LOOP_ENDED; \
    } while (0)

enum { FAULT_LOOP_ENDED = 0, FAULT_LOOP_BAD_DATA = 3, FAULT_LOOP_SETUP = 4, FAULT_LOOP_CAP = 5 };

static int bad(rank_state_t *st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int bad(rank_state_t *st, const char *fmt, ...)
{
    if (st->rec->bad_data++ == 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(st->rec->err_msg, sizeof(st->rec->err_msg), fmt, ap);
        va_end(ap);
    }
    return FAULT_LOOP_BAD_DATA;
}

/* ------------------------------------------------------------------------ checks ---- */

/* Row i of `rows` holds token (s, t) of xtag (s < 0: zeros). */
static int row_is(const rank_state_t *st, const uint16_t *rows, int64_t i, int s, int t, uint64_t xtag)
{
    for (int c = 0; c < H; c++) {
        uint16_t want = s < 0 ? 0 : ref_f32_to_bf16(xval(st, s, t, xtag, c));
        if (rows[i * H + c] != want) return 0;
    }
    return 1;
}

/* The rows this rank receives in HT order (expert e >= 0: only tokens selecting e); fills src/tok
 * when given. Returns their count. */
static int64_t expected_rows(const rank_state_t *st, uint64_t rtag, int64_t e, int *src, int *tok)
{
    int64_t n = 0;
    for (int s = 0; s < st->R; s++)
        for (int t = 0; t < num_tokens(st, s, rtag); t++) {
            if (e >= 0 ? !selects(st, s, t, rtag, e) : !reaches(st, s, t, rtag, st->rank)) continue;
            if (src) src[n] = s;
            if (tok) tok[n] = t;
            n++;
        }
    return n;
}

/* Rows [first, first + n) of recv are the expected ones of expert e (-1: of this rank), padded with
 * zero rows up to `rows`; returns 0 or the result of bad(). */
static int check_rows(rank_state_t *st, const char *what, const uint16_t *recv, int64_t first, int64_t rows,
                      uint64_t rtag, uint64_t xtag, int64_t e)
{
    static int src[FAULT_MAX_RANKS * TM], tok[FAULT_MAX_RANKS * TM];
    const int64_t n = expected_rows(st, rtag, e, src, tok);
    if (rows < n)
        return bad(st, "%s: %lld rows, expected %lld (expert %lld)", what, (long long)rows, (long long)n,
                   (long long)e);
    for (int64_t i = 0; i < rows; i++)
        if (!row_is(st, recv, first + i, i < n ? src[i] : -1, i < n ? tok[i] : 0, xtag))
            return bad(st, "%s: row %lld (expert %lld) is not token %d of rank %d from call tag %llu", what,
                       (long long)(first + i), (long long)e, i < n ? tok[i] : -1, i < n ? src[i] : -1,
                       (unsigned long long)xtag);
    return 0;
}

/* out [T, H] is this rank's x of xtag times the contributors' factor. */
static int check_combined(rank_state_t *st, const char *what, uint64_t rtag, uint64_t xtag, int per_expert)
{
    mem_sync(st, &st->out, MEM_DOWN);
    const uint16_t *out = st->out.h;
    for (int t = 0; t < num_tokens(st, st->rank, rtag); t++) {
        const float f = factor(st, st->rank, t, rtag, per_expert);
        for (int c = 0; c < H; c++)
            if (out[t * H + c] != ref_f32_to_bf16(xval(st, st->rank, t, xtag, c) * f))
                return bad(st, "%s: token %d channel %d is 0x%04x, expected 0x%04x", what, t, c,
                           out[t * H + c], ref_f32_to_bf16(xval(st, st->rank, t, xtag, c) * f));
    }
    return 0;
}

/* x and topk (and routing map, weights 1) of this rank for a call. */
static int fill_inputs(rank_state_t *st, uint64_t rtag, uint64_t xtag)
{
    const int T = num_tokens(st, st->rank, rtag);
    uint16_t *x = st->x.h;
    int64_t *topk = st->topk.h;
    uint8_t *map = st->map.h;
    float *w = st->w.h;
    memset(map, 0, st->map.bytes);
    for (int t = 0; t < T; t++) {
        for (int c = 0; c < H; c++) x[t * H + c] = ref_f32_to_bf16(xval(st, st->rank, t, xtag, c));
        route(st, st->rank, t, rtag, &topk[t * K]);
        for (int k = 0; k < K; k++) {
            w[t * K + k] = 1.0f;
            if (topk[t * K + k] >= 0) map[t * st->E + topk[t * K + k]] = 1;
        }
    }
    mem_sync(st, &st->x, MEM_UP);
    mem_sync(st, &st->topk, MEM_UP);
    mem_sync(st, &st->w, MEM_UP);
    mem_sync(st, &st->map, MEM_UP);
    return T;
}

/* y = the first `rows` received rows times rank + 1, zeros after. */
static void make_y(rank_state_t *st, int64_t rows)
{
    mem_sync(st, &st->recv, MEM_DOWN);
    const uint16_t *recv = st->recv.h;
    uint16_t *y = st->y.h;
    memset(y, 0, st->y.bytes);
    for (int64_t i = 0; i < rows * H; i++)
        y[i] = ref_f32_to_bf16(ref_bf16_to_f32(recv[i]) * (float)(st->rank + 1));
    mem_sync(st, &st->y, MEM_UP);
}

/* ------------------------------------------------------------------------- loops ---- */

/* One HT dispatch of xtag (cached on st->handle when `cached`) and its combine. */
static int ht_round(rank_state_t *st, uint64_t rtag, uint64_t xtag, int cached, int is_static)
{
    const int T = fill_inputs(st, rtag, xtag);
    const int64_t cap = (int64_t)st->R * TM;
    int k;
    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    a.x = tensor(st, &st->x, EPX_DTYPE_BF16, 2, T, H, 0);
    a.topk_idx = tensor(st, &st->topk, EPX_DTYPE_INT64, 2, T, K, 0);
    a.expert_alignment = 1;
    a.num_worst_tokens = is_static ? cap : 0;
    a.cached_handle = cached ? st->handle : NULL;
    epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
    o.recv_x = tensor(st, &st->recv, EPX_DTYPE_BF16, 2, cap, H, 0);
    epx_handle_t unused = NULL;
    RUN_DISPATCH(st, cached ? "epx_ht_dispatch (cached)" : "epx_ht_dispatch",
                 epx_ht_dispatch(st->buf, &a, &o), o, cached ? &unused : &st->handle, k);
    const int64_t n = expected_rows(st, rtag, -1, NULL, NULL);
    if (!is_static && !cached && o.num_recv_tokens_host != n)
        return bad(st, "ht dispatch: N_r %lld, expected %lld", (long long)o.num_recv_tokens_host,
                   (long long)n);
    mem_sync(st, &st->recv, MEM_DOWN);
    int rc = check_rows(st, "ht dispatch", st->recv.h, 0, n, rtag, xtag, -1);
    if (rc) return rc;
    make_y(st, n);
    epx_ht_combine_args_t ca = EPX_HT_COMBINE_ARGS_INIT;
    ca.handle = st->handle;
    ca.x = tensor(st, &st->y, EPX_DTYPE_BF16, 2, is_static ? cap : n, H, 0);
    epx_ht_combine_outputs_t co = EPX_HT_COMBINE_OUTPUTS_INIT;
    co.combined_x = tensor(st, &st->out, EPX_DTYPE_BF16, 2, T, H, 0);
    RUN(st, NEEDS_SELF, "epx_ht_combine", epx_ht_combine(st->buf, &ca, &co), k);
    return check_combined(st, "ht combine", rtag, xtag, 0) ? FAULT_LOOP_BAD_DATA : -1;
}

static int ht_loop(rank_state_t *st, int is_static)
{
    for (uint64_t it = 0; fault_now() < st->start + LOOP_CAP_S; it++) {
        int rc = ht_round(st, it, 2 * it, 0, is_static);
        if (rc < 0 && !is_static) rc = ht_round(st, it, 2 * it + 1, 1, 0);
        if (rc >= 0) return rc;
        epx_handle_destroy(st->handle);
        st->handle = NULL;
    }
    return FAULT_LOOP_CAP;
}

/* LL: dispatch, check, combine, check; with hooks each half is its own call. */
static int ll_loop(rank_state_t *st, int hooks)
{
    const int64_t RT = (int64_t)st->R * TM;
    for (uint64_t it = 0; fault_now() < st->start + LOOP_CAP_S; it++) {
        const int T = fill_inputs(st, it, it);
        int k, sent;
        epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
        a.x = tensor(st, &st->x, EPX_DTYPE_BF16, 2, T, H, 0);
        a.topk_idx = tensor(st, &st->topk, EPX_DTYPE_INT64, 2, T, K, 0);
        a.return_recv_hook = hooks;
        epx_ll_dispatch_outputs_t o = EPX_LL_DISPATCH_OUTPUTS_INIT;
        o.recv_x = tensor(st, &st->recv, EPX_DTYPE_BF16, 3, L, RT, H);
        o.recv_count = tensor(st, &st->count, EPX_DTYPE_INT32, 1, L, 0, 0);
        o.src_info = tensor(st, &st->src, EPX_DTYPE_INT32, 2, L, RT, 0);
        if (hooks) {
            RUN(st, -1, "epx_ll_dispatch (send half)", epx_ll_dispatch(st->buf, &a, &o), sent);
            RUN(st, sent, "epx_hook_run (ll dispatch)", epx_hook_run(&o.hook, NULL), k);
        } else {
            RUN(st, NEEDS_SELF, "epx_ll_dispatch", epx_ll_dispatch(st->buf, &a, &o), k);
        }
        mem_sync(st, &st->recv, MEM_DOWN);
        mem_sync(st, &st->count, MEM_DOWN);
        mem_sync(st, &st->src, MEM_DOWN);
        const int32_t *count = st->count.h, *src = st->src.h;
        for (int j = 0; j < L; j++) {
            const int64_t e = (int64_t)st->rank * L + j;
            static int tok[FAULT_MAX_RANKS * TM];
            const int64_t n = expected_rows(st, it, e, NULL, tok);
            if (count[j] != n)
                return bad(st, "ll dispatch: count[%d] %d, expected %lld", j, count[j], (long long)n);
            for (int64_t i = 0; i < n; i++)
                if (src[j * RT + i] != tok[i])
                    return bad(st, "ll dispatch: src_info[%d][%lld] %d, expected %d", j, (long long)i,
                               src[j * RT + i], tok[i]);
            int rc = check_rows(st, "ll dispatch", st->recv.h, j * RT, n, it, it, e);
            if (rc) return rc;
        }
        make_y(st, L * RT);
        epx_ll_combine_args_t ca = EPX_LL_COMBINE_ARGS_INIT;
        ca.handle = o.handle;
        ca.y = tensor(st, &st->y, EPX_DTYPE_BF16, 3, L, RT, H);
        ca.topk_idx = a.topk_idx;
        ca.topk_weights = tensor(st, &st->w, EPX_DTYPE_FP32, 2, T, K, 0);
        ca.return_recv_hook = hooks;
        epx_ll_combine_outputs_t co = EPX_LL_COMBINE_OUTPUTS_INIT;
        co.combined_x = tensor(st, &st->out, EPX_DTYPE_BF16, 2, T, H, 0);
        if (hooks) {
            RUN(st, -1, "epx_ll_combine (send half)", epx_ll_combine(st->buf, &ca, &co), sent);
            RUN(st, sent, "epx_hook_run (ll combine)", epx_hook_run(&co.hook, NULL), k);
        } else {
            RUN(st, NEEDS_SELF, "epx_ll_combine", epx_ll_combine(st->buf, &ca, &co), k);
        }
        if (check_combined(st, "ll combine", it, it, 1)) return FAULT_LOOP_BAD_DATA;
    }
    return FAULT_LOOP_CAP;
}

/* Routing map: dispatch (permute with pad 1 and FAULT_PAD in turn), check, combine, check. */
static int rm_loop(rank_state_t *st, int permute)
{
    for (uint64_t it = 0; fault_now() < st->start + LOOP_CAP_S; it++) {
        const int T = fill_inputs(st, it, it), pad = permute && it % 2 ? FAULT_PAD : 1;
        const int64_t cap = st->recv.bytes / (H * sizeof(uint16_t));
        int k;
        epx_rm_dispatch_args_t a = EPX_RM_DISPATCH_ARGS_INIT;
        a.hidden = tensor(st, &st->x, EPX_DTYPE_BF16, 2, T, H, 0);
        a.routing_map = tensor(st, &st->map, EPX_DTYPE_BOOL, 2, T, st->E, 0);
        a.permute = permute;
        a.pad_multiple = pad;
        epx_rm_dispatch_outputs_t o = EPX_RM_DISPATCH_OUTPUTS_INIT;
        o.tokens = tensor(st, &st->recv, EPX_DTYPE_BF16, 2, cap, H, 0);
        if (permute) o.tokens_per_expert = tensor(st, &st->tpe, EPX_DTYPE_INT32, 1, L, 0, 0);
        RUN_DISPATCH(st, permute ? "epx_rm_dispatch (permute)" : "epx_rm_dispatch",
                     epx_rm_dispatch(st->buf, &a, &o), o, &st->handle, k);
        mem_sync(st, &st->recv, MEM_DOWN);
        mem_sync(st, &st->tpe, MEM_DOWN);
        int64_t rows = 0;
        for (int j = 0; j < (permute ? L : 1); j++) {
            const int64_t e = permute ? (int64_t)st->rank * L + j : -1;
            const int64_t n = expected_rows(st, it, e, NULL, NULL), padded = (n + pad - 1) / pad * pad;
            if (permute && ((const int32_t *)st->tpe.h)[j] != padded)
                return bad(st, "rm dispatch: tokens_per_expert[%d] %d, expected %lld", j,
                           ((const int32_t *)st->tpe.h)[j], (long long)padded);
            int rc = check_rows(st, "rm dispatch", st->recv.h, rows, padded, it, it, e);
            if (rc) return rc;
            rows += padded;
        }
        if (o.num_tokens_host != rows)
            return bad(st, "rm dispatch: %lld rows, expected %lld", (long long)o.num_tokens_host,
                       (long long)rows);
        make_y(st, rows);
        epx_rm_combine_args_t ca = EPX_RM_COMBINE_ARGS_INIT;
        ca.handle = o.handle;
        ca.x = tensor(st, &st->y, EPX_DTYPE_BF16, 2, rows, H, 0);
        epx_rm_combine_outputs_t co = EPX_RM_COMBINE_OUTPUTS_INIT;
        co.combined = tensor(st, &st->out, EPX_DTYPE_BF16, 2, T, H, 0);
        RUN(st, NEEDS_SELF, "epx_rm_combine", epx_rm_combine(st->buf, &ca, &co), k);
        if (check_combined(st, "rm combine", it, it, permute)) return FAULT_LOOP_BAD_DATA;
        epx_handle_destroy(st->handle);
        st->handle = NULL;
    }
    return FAULT_LOOP_CAP;
}

/* ---------------------------------------------------------------------- the rank ---- */

static int alloc_all(rank_state_t *st)
{
    const size_t RT = (size_t)st->R * TM;
    const size_t rows = RT * K + L * FAULT_PAD > L * RT ? RT * K + L * FAULT_PAD : L * RT;
    return mem_alloc(st, &st->x, TM * H * 2) | mem_alloc(st, &st->topk, TM * K * 8) |
           mem_alloc(st, &st->w, TM * K * 4) | mem_alloc(st, &st->map, TM * (size_t)st->E) |
           mem_alloc(st, &st->recv, rows * H * 2) | mem_alloc(st, &st->y, rows * H * 2) |
           mem_alloc(st, &st->out, TM * H * 2) | mem_alloc(st, &st->count, L * 4) |
           mem_alloc(st, &st->src, L * RT * 4) | mem_alloc(st, &st->tpe, L * 4);
}

static void free_all(rank_state_t *st)
{
    mem_t *all[] = {&st->x, &st->topk, &st->w,     &st->map, &st->recv,
                    &st->y, &st->out,  &st->count, &st->src, &st->tpe};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) mem_free(st, all[i]);
}

/* The job of a bootstrap attack: init as plan->boot_rank[rank], barrier, destroy. Returns 0 after a
 * failed init too: fault_boot.c judges the results. */
static int boot_rank_main(rank_state_t *st)
{
    const fault_plan_t *plan = st->plan;
    epx_comm_config_t cc = EPX_COMM_CONFIG_INIT;
    cc.backend = EPX_BACKEND_HOST;
    usleep((useconds_t)plan->boot_delay_ms[st->rank] * 1000);
    const double t0 = fault_now();
    int k = call_begin(st);
    epx_result_t res = epx_comm_init(st->id, plan->boot_rank[st->rank], plan->R, &cc, &st->comm);
    st->rec->t_init = fault_now() - t0;
    if (call_end(st, k, NEEDS_SELF, res, "epx_comm_init")) return 0;
    k = call_begin(st);
    const int failed = call_end(st, k, NEEDS_SELF, epx_comm_barrier(st->comm), "epx_comm_barrier");
    return epx_comm_destroy(st->comm) != EPX_SUCCESS || failed;
}

int fault_rank_main(const fault_plan_t *plan, int rank, const epx_unique_id_t *id, fault_rec_t *rec)
{
    rank_state_t st;
    memset(&st, 0, sizeof(st));
    st.plan = plan;
    st.rec = rec;
    st.rank = rank;
    st.R = plan->R;
    st.E = plan->R * L;
    st.id = id;
    st.start = fault_now();
    st.cuda = plan->backend == EPX_BACKEND_CUDA;
    rec->err_call = -1;
    rec->last_recv_needs = -1;
    rec->fds_after = -1;
    /* CUDA keeps descriptors of its own after teardown: only the host backend's are counted. */
    rec->fds_before = st.cuda ? -1 : fault_count_fds(0);
    if (plan->mode == FAULT_MODE_BOOT) return boot_rank_main(&st);
    if (plan->kill == FAULT_KILL_SHM_POINT) {
        char spec[32];
        snprintf(spec, sizeof(spec), "%d:%d", plan->victim, plan->shm_step);
        setenv("EPX_TEST_FAULT_SHM", spec, 1);
    }
#ifdef EPX_HAVE_CUDA
    if (st.cuda) {
        st.device = plan->ngpu > 0 ? rank % plan->ngpu : 0;
        if (cudaSetDevice(st.device) != cudaSuccess) return FAULT_LOOP_SETUP;
    }
#endif
    if (alloc_all(&st)) return FAULT_LOOP_SETUP;

    int rc = FAULT_LOOP_ENDED, k;
    epx_comm_config_t cc = EPX_COMM_CONFIG_INIT;
    cc.backend = plan->backend;
    cc.cuda_device = st.cuda ? st.device : -1;
    cc.timeout_ms = plan->timeout_ms;
    char node[32];
    if (plan->per_node > 0) {
        snprintf(node, sizeof(node), "fault-node%d", rank / plan->per_node);
        cc.node_id = node;
    }
    rec->phase = FAULT_PHASE_INIT;
    k = call_begin(&st);
    if (call_end(&st, k, NEEDS_SELF, epx_comm_init(id, rank, plan->R, &cc, &st.comm), "epx_comm_init")) {
        st.comm = NULL;
        goto teardown;
    }
    if (plan->per_node > 0) {
        /* The split took: this rank's node as the library reports it (a local query, no peer). */
        epx_node_topology_t nt = EPX_NODE_TOPOLOGY_INIT;
        if (epx_comm_get_node_topology(st.comm, &nt) != EPX_SUCCESS || nt.node != rank / plan->per_node ||
            nt.num_nodes != plan->R / plan->per_node) {
            rc = FAULT_LOOP_SETUP;
            goto teardown;
        }
    }
    rec->phase = FAULT_PHASE_CREATE;
    epx_buffer_config_t bc = EPX_BUFFER_CONFIG_INIT;
    bc.max_tokens = TM;
    bc.hidden = H;
    bc.num_topk = K;
    bc.num_experts = st.E;
    bc.modes = EPX_MODE_ALL;
    bc.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_BF16);
    bc.max_pad_multiple = FAULT_PAD;
    k = call_begin(&st);
    if (call_end(&st, k, NEEDS_SELF, epx_buffer_create(st.comm, &bc, &st.buf), "epx_buffer_create")) {
        st.buf = NULL;
        goto teardown;
    }
    rec->phase = FAULT_PHASE_LOOP;
    switch (plan->mode) {
    case FAULT_MODE_HT: rc = ht_loop(&st, 0); break;
    case FAULT_MODE_HT_STATIC: rc = ht_loop(&st, 1); break;
    case FAULT_MODE_LL: rc = ll_loop(&st, 0); break;
    case FAULT_MODE_LL_HOOK: rc = ll_loop(&st, 1); break;
    case FAULT_MODE_RM: rc = rm_loop(&st, 0); break;
    case FAULT_MODE_RM_PERMUTE: rc = rm_loop(&st, 1); break;
    default: rc = FAULT_LOOP_SETUP; break;
    }

teardown:
    /* A rank whose peer died leaves without waiting on it: nothing here is collective. */
    rec->phase = FAULT_PHASE_CLEANUP;
    if (st.handle && epx_handle_destroy(st.handle) != EPX_SUCCESS && !rc) rc = 6;
    if (st.buf && epx_buffer_destroy(st.buf) != EPX_SUCCESS && !rc) rc = 6;
    if (st.comm && epx_comm_destroy(st.comm) != EPX_SUCCESS && !rc) rc = 6;
    free_all(&st);
    if (!st.cuda) rec->fds_after = fault_count_fds(0);
    rec->phase = FAULT_PHASE_DONE;
    return rc;
}
