/*
 * What the agreement and mismatch tests share: small valid calls of every collective kind on one
 * rank (HT, LL and routing-map dispatch and combine) over a host buffer with every mode, so that
 * a test can make any kind of call at any point.
 */
#ifndef EPX_TEST_CALLS_IO_H
#define EPX_TEST_CALLS_IO_H

#include <string.h>

#include "core/numeric.h"
#include "epx_test.h"

#define CT     4   /* T = T_max */
#define CH     128 /* H */
#define CK     2   /* K */
#define CL     2   /* local experts per rank */
#define CR_MAX 8

typedef struct calls {
    int rank, nranks;
    epx_comm_t comm;
    epx_buffer_t buf;
    _Alignas(16) uint16_t x[CT * CH];
    int32_t topk[CT * CK];
    float weights[CT * CK];
    uint8_t map[CT * CL * CR_MAX];
    _Alignas(16) uint16_t recv[CR_MAX * CT * CH];         /* HT and RM rows, and combine inputs */
    _Alignas(16) uint16_t ll_recv[CL * CR_MAX * CT * CH]; /* LL rows and combine input */
    int32_t ll_count[CL];
    _Alignas(16) uint16_t out[CT * CH];
    epx_handle_t ht, rm;
    int64_t ht_rows, rm_rows;
    epx_ll_handle_t ll;
} calls_t;

/* Routing: token t of rank r selects expert 0 of rank (r + t) % R and expert 1 of rank
 * (r + t + 1) % R, so every rank receives tokens from several sources; the routing map says the
 * same. */
static inline void calls_init(calls_t *c, int rank, int nranks)
{
    memset(c, 0, sizeof(*c));
    c->rank = rank;
    c->nranks = nranks;
    const int E = CL * nranks;
    for (int t = 0; t < CT; t++) {
        for (int h = 0; h < CH; h++) c->x[t * CH + h] = epx_f32_to_bf16((float)(rank + t + h % 7));
        for (int k = 0; k < CK; k++) {
            const int e = ((rank + t + k) % nranks) * CL + k;
            c->topk[t * CK + k] = e;
            c->weights[t * CK + k] = 0.5f;
            c->map[t * E + e] = 1;
        }
    }
}

static inline epx_buffer_config_t calls_config(int nranks)
{
    return epx_test_buffer_config(CT, CH, CK, CL * nranks, EPX_MODE_ALL);
}

static inline epx_result_t calls_ht_dispatch(calls_t *c, epx_ht_dispatch_outputs_t *o)
{
    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    a.x = epx_tensor_2d(c->x, EPX_DTYPE_BF16, CT, CH);
    a.topk_idx = epx_tensor_2d(c->topk, EPX_DTYPE_INT32, CT, CK);
    *o = (epx_ht_dispatch_outputs_t)EPX_HT_DISPATCH_OUTPUTS_INIT;
    o->recv_x = epx_tensor_2d(c->recv, EPX_DTYPE_BF16, (int64_t)c->nranks * CT, CH);
    return epx_ht_dispatch(c->buf, &a, o);
}

/* calls_<fam>_combine(c): the HT or routing-map combine of the c-><fam>_rows rows that c-><fam>
 * received into c->recv, written to c->out (its output field `out_field`). */
#define CALLS_COMBINE(fam, FAM, out_field)                                  \
    static inline epx_result_t calls_##fam##_combine(calls_t *c)            \
    {                                                                       \
        epx_##fam##_combine_args_t a = EPX_##FAM##_COMBINE_ARGS_INIT;       \
        a.handle = c->fam;                                                  \
        a.x = epx_tensor_2d(c->recv, EPX_DTYPE_BF16, c->fam##_rows, CH);    \
        epx_##fam##_combine_outputs_t o = EPX_##FAM##_COMBINE_OUTPUTS_INIT; \
        o.out_field = epx_tensor_2d(c->out, EPX_DTYPE_BF16, CT, CH);        \
        return epx_##fam##_combine(c->buf, &a, &o);                         \
    }

CALLS_COMBINE(ht, HT, combined_x)

/* An LL dispatch into c->ll_recv / c->ll_count; with hook_out, its receive half is left to the hook. */
static inline epx_result_t calls_ll_dispatch_hooked(calls_t *c, epx_ll_handle_t *handle_out, epx_hook_t *hook_out)
{
    epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
    a.x = epx_tensor_2d(c->x, EPX_DTYPE_BF16, CT, CH);
    a.topk_idx = epx_tensor_2d(c->topk, EPX_DTYPE_INT32, CT, CK);
    a.return_recv_hook = hook_out != NULL;
    epx_ll_dispatch_outputs_t o = EPX_LL_DISPATCH_OUTPUTS_INIT;
    o.recv_x = epx_tensor_3d(c->ll_recv, EPX_DTYPE_BF16, CL, (int64_t)c->nranks * CT, CH);
    o.recv_count = epx_tensor_1d(c->ll_count, EPX_DTYPE_INT32, CL);
    epx_result_t res = epx_ll_dispatch(c->buf, &a, &o);
    if (res == EPX_SUCCESS && handle_out) *handle_out = o.handle;
    if (res == EPX_SUCCESS && hook_out) *hook_out = o.hook;
    return res;
}

static inline epx_result_t calls_ll_dispatch(calls_t *c, epx_ll_handle_t *handle_out)
{
    return calls_ll_dispatch_hooked(c, handle_out, NULL);
}

/* An HT dispatch every rank fails: rank 0 passes T past the buffer (refused by its checks, before any
 * of x is read), the others then fail with ERR_REMOTE. */
static inline epx_result_t calls_ht_refused_by_rank0(calls_t *c)
{
    const int64_t T = c->rank == 0 ? CT + 1 : CT;
    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    a.x = epx_tensor_2d(c->x, EPX_DTYPE_BF16, T, CH);
    a.topk_idx = epx_tensor_2d(c->topk, EPX_DTYPE_INT32, T, CK);
    epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
    o.recv_x = epx_tensor_2d(c->recv, EPX_DTYPE_BF16, (int64_t)c->nranks * CT, CH);
    return epx_ht_dispatch(c->buf, &a, &o);
}

static inline epx_result_t calls_ll_combine(calls_t *c)
{
    epx_ll_combine_args_t a = EPX_LL_COMBINE_ARGS_INIT;
    a.handle = c->ll;
    a.y = epx_tensor_3d(c->ll_recv, EPX_DTYPE_BF16, CL, (int64_t)c->nranks * CT, CH);
    a.topk_idx = epx_tensor_2d(c->topk, EPX_DTYPE_INT32, CT, CK);
    a.topk_weights = epx_tensor_2d(c->weights, EPX_DTYPE_FP32, CT, CK);
    epx_ll_combine_outputs_t o = EPX_LL_COMBINE_OUTPUTS_INIT;
    o.combined_x = epx_tensor_2d(c->out, EPX_DTYPE_BF16, CT, CH);
    return epx_ll_combine(c->buf, &a, &o);
}

static inline epx_result_t calls_rm_dispatch(calls_t *c, epx_rm_dispatch_outputs_t *o)
{
    epx_rm_dispatch_args_t a = EPX_RM_DISPATCH_ARGS_INIT;
    a.hidden = epx_tensor_2d(c->x, EPX_DTYPE_BF16, CT, CH);
    a.routing_map = epx_tensor_2d(c->map, EPX_DTYPE_BOOL, CT, (int64_t)CL * c->nranks);
    *o = (epx_rm_dispatch_outputs_t)EPX_RM_DISPATCH_OUTPUTS_INIT;
    o->tokens = epx_tensor_2d(c->recv, EPX_DTYPE_BF16, (int64_t)c->nranks * CT, CH);
    return epx_rm_dispatch(c->buf, &a, o);
}

CALLS_COMBINE(rm, RM, combined)

/* One dispatch of each family, so that every combine has a handle. */
static inline epx_result_t calls_prepare(calls_t *c)
{
    epx_ht_dispatch_outputs_t ho;
    epx_rm_dispatch_outputs_t ro;
    epx_result_t res = calls_ht_dispatch(c, &ho);
    if (res != EPX_SUCCESS) return res;
    c->ht = ho.handle;
    c->ht_rows = ho.num_recv_tokens_host;
    if ((res = calls_ll_dispatch(c, &c->ll)) != EPX_SUCCESS) return res;
    if ((res = calls_rm_dispatch(c, &ro)) != EPX_SUCCESS) return res;
    c->rm = ro.handle;
    c->rm_rows = ro.num_tokens_host;
    return EPX_SUCCESS;
}

/* The call kinds in the order of their names below. */
enum {
    CALL_HT_DISPATCH,
    CALL_HT_COMBINE,
    CALL_LL_DISPATCH,
    CALL_LL_COMBINE,
    CALL_RM_DISPATCH,
    CALL_RM_COMBINE,
    CALL_KINDS
};
static const char *const calls_names[CALL_KINDS] = {"epx_ht_dispatch", "epx_ht_combine",  "epx_ll_dispatch",
                                                    "epx_ll_combine",  "epx_rm_dispatch", "epx_rm_combine"};

/* Makes one call of `kind`; a dispatch's new handle is destroyed when it succeeds. */
static inline epx_result_t calls_make(calls_t *c, int kind)
{
    epx_ht_dispatch_outputs_t ho;
    epx_rm_dispatch_outputs_t ro;
    epx_result_t res;
    switch (kind) {
    case CALL_HT_DISPATCH:
        res = calls_ht_dispatch(c, &ho);
        if (res == EPX_SUCCESS) epx_handle_destroy(ho.handle);
        return res;
    case CALL_HT_COMBINE: return calls_ht_combine(c);
    case CALL_LL_DISPATCH: return calls_ll_dispatch(c, NULL);
    case CALL_LL_COMBINE: return calls_ll_combine(c);
    case CALL_RM_DISPATCH:
        res = calls_rm_dispatch(c, &ro);
        if (res == EPX_SUCCESS) epx_handle_destroy(ro.handle);
        return res;
    default: return calls_rm_combine(c);
    }
}

static inline void calls_release(calls_t *c)
{
    epx_handle_destroy(c->ht);
    epx_handle_destroy(c->rm);
    c->ht = c->rm = NULL;
}

/* A host communicator with a 20 s timeout, a buffer of calls_config over it, c's inputs and one
 * dispatch of each family; 0 on success. */
static inline int calls_open(calls_t *c, int rank, int nranks, const epx_unique_id_t *id)
{
    calls_init(c, rank, nranks);
    EXPECT_OK(epx_test_host_comm(id, rank, nranks, 20000, &c->comm));
    const epx_buffer_config_t cfg = calls_config(nranks);
    EXPECT_OK(epx_buffer_create(c->comm, &cfg, &c->buf));
    EXPECT_OK(calls_prepare(c));
    return 0;
}

/* Undoes calls_open; 0 on success. */
static inline int calls_close(calls_t *c)
{
    calls_release(c);
    EXPECT_OK(epx_buffer_destroy(c->buf));
    EXPECT_OK(epx_comm_destroy(c->comm));
    return 0;
}

#endif
