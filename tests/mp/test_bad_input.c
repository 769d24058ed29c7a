/*
 * Bad arguments on the host backend, one case per kind of mistake: each checks the exact result,
 * that the message names the culprit, and that no output byte or [out] field changed. The
 * 2-rank cases check cross-rank config mismatch and that a rank failing its checks in a
 * collective call makes its peer return EPX_ERR_REMOTE well before the timeout.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/internal.h"
#include "epx_test.h"

#define TMAX 8
#define HID 128
#define TOPK 2
#define NEXP 4
#define T_USED 6
#define OUT_BYTES (1u << 20)
#define SENTINEL 0xa5
#define SENTINEL_HANDLE ((epx_handle_t)(uintptr_t)0x5a5a5a50)
#define SENTINEL_COUNT (-77)

typedef struct fixture {
    int rank, R, L;
    epx_comm_t comm;
    epx_buffer_t buf;      /* every mode, default dtypes */
    epx_buffer_t buf_ht;   /* EPX_MODE_HT and bf16 only */
    epx_buffer_t buf_llrm; /* EPX_MODE_LL | EPX_MODE_PERMUTE */
    /* Inputs, with room for T_MAX+1 rows of twice the hidden size and misaligned views. */
    uint16_t *x;
    int32_t *topk;
    float *weights;
    uint8_t *rmap;
    /* Every output is carved from here; it holds SENTINEL bytes before each call. */
    uint8_t *out;
    size_t out_used;
} fixture_t;

static void *out_take(fixture_t *f, size_t bytes)
{
    void *p = f->out + f->out_used;
    f->out_used += (bytes + 63) & ~(size_t)63;
    if (f->out_used > OUT_BYTES) abort(); /* the test's own sizing bug */
    return p;
}

static void out_reset(fixture_t *f)
{
    memset(f->out, SENTINEL, OUT_BYTES);
    f->out_used = 0;
}

static int out_untouched(const fixture_t *f)
{
    for (size_t i = 0; i < OUT_BYTES; i++)
        if (f->out[i] != SENTINEL) {
            fprintf(stderr, "output byte %zu was written (0x%02x)\n", i, f->out[i]);
            return 0;
        }
    return 1;
}

/* A failed call: exact code, a message naming the culprit, and no output written. */
#define EXPECT_FAIL(f, call, code, needle)                                                                   \
    do {                                                                                                     \
        EXPECT_RES(call, code);                                                                              \
        EXPECT_MSG_HAS(needle);                                                                              \
        EXPECT_TRUE(out_untouched(f));                                                                       \
    } while (0)

/* Valid routing: token t selects experts t % E and (t + 1) % E. */
static void fill_inputs(fixture_t *f)
{
    int E = NEXP;
    for (int i = 0; i < (TMAX + 2) * 2 * HID; i++) f->x[i] = epx_f32_to_bf16((float)(i % 13) * 0.25f);
    for (int t = 0; t < TMAX + 1; t++) {
        for (int k = 0; k < TOPK; k++) {
            f->topk[t * TOPK + k] = (t + k) % E;
            f->weights[t * TOPK + k] = 0.5f;
        }
        for (int e = 0; e < 2 * NEXP; e++) f->rmap[t * 2 * NEXP + e] = 0;
        for (int k = 0; k < TOPK; k++) f->rmap[t * NEXP + (t + k) % E] = 1;
    }
}

/* ---------------------------------------------------------------- argument builders ---- */

static void ht_setup(fixture_t *f, epx_ht_dispatch_args_t *a, epx_ht_dispatch_outputs_t *o)
{
    memset(a, 0, sizeof(*a));
    memset(o, 0, sizeof(*o));
    a->size = sizeof(*a);
    a->version = EPX_VERSION_CODE;
    o->size = sizeof(*o);
    o->version = EPX_VERSION_CODE;
    int64_t cap = (int64_t)f->R * TMAX;
    a->x = epx_tensor_2d(f->x, EPX_DTYPE_BF16, T_USED, HID);
    a->topk_idx = epx_tensor_2d(f->topk, EPX_DTYPE_INT32, T_USED, TOPK);
    a->topk_weights = epx_tensor_2d(f->weights, EPX_DTYPE_FP32, T_USED, TOPK);
    o->recv_x = epx_tensor_2d(out_take(f, (size_t)cap * HID * 2), EPX_DTYPE_BF16, cap, HID);
    o->recv_topk_idx = epx_tensor_2d(out_take(f, (size_t)cap * TOPK * 4), EPX_DTYPE_INT32, cap, TOPK);
    o->recv_topk_weights = epx_tensor_2d(out_take(f, (size_t)cap * TOPK * 4), EPX_DTYPE_FP32, cap, TOPK);
    o->num_recv_tokens_per_expert = epx_tensor_1d(out_take(f, (size_t)f->L * 4), EPX_DTYPE_INT32, f->L);
    o->num_recv_tokens_host = SENTINEL_COUNT;
    o->handle = SENTINEL_HANDLE;
}

static void ht_combine_setup(fixture_t *f, epx_handle_t h, epx_ht_combine_args_t *a,
                             epx_ht_combine_outputs_t *o)
{
    memset(a, 0, sizeof(*a));
    memset(o, 0, sizeof(*o));
    a->size = sizeof(*a);
    a->version = EPX_VERSION_CODE;
    o->size = sizeof(*o);
    o->version = EPX_VERSION_CODE;
    a->handle = h;
    a->x = epx_tensor_2d(f->x, EPX_DTYPE_BF16, (int64_t)f->R * TMAX, HID);
    o->combined_x = epx_tensor_2d(out_take(f, (size_t)T_USED * HID * 2), EPX_DTYPE_BF16, T_USED, HID);
}

static void layout_setup(fixture_t *f, epx_tensor_t *topk, epx_layout_outputs_t *o)
{
    memset(o, 0, sizeof(*o));
    o->size = sizeof(*o);
    o->version = EPX_VERSION_CODE;
    *topk = epx_tensor_2d(f->topk, EPX_DTYPE_INT32, T_USED, TOPK);
    o->num_tokens_per_rank = epx_tensor_1d(out_take(f, (size_t)f->R * 4), EPX_DTYPE_INT32, f->R);
    o->num_tokens_per_expert = epx_tensor_1d(out_take(f, NEXP * 4), EPX_DTYPE_INT32, NEXP);
    o->is_token_in_rank = epx_tensor_2d(out_take(f, (size_t)T_USED * f->R), EPX_DTYPE_BOOL, T_USED, f->R);
}

static void ll_setup(fixture_t *f, epx_ll_dispatch_args_t *a, epx_ll_dispatch_outputs_t *o)
{
    memset(a, 0, sizeof(*a));
    memset(o, 0, sizeof(*o));
    a->size = sizeof(*a);
    a->version = EPX_VERSION_CODE;
    o->size = sizeof(*o);
    o->version = EPX_VERSION_CODE;
    int64_t rows = (int64_t)f->R * TMAX;
    a->x = epx_tensor_2d(f->x, EPX_DTYPE_BF16, T_USED, HID);
    a->topk_idx = epx_tensor_2d(f->topk, EPX_DTYPE_INT32, T_USED, TOPK);
    o->recv_x = epx_tensor_3d(out_take(f, (size_t)f->L * rows * HID * 2), EPX_DTYPE_BF16, f->L, rows, HID);
    o->recv_count = epx_tensor_1d(out_take(f, (size_t)f->L * 4), EPX_DTYPE_INT32, f->L);
    o->handle.seq = 12345;
    o->handle.slot = 7;
}

static void rm_setup(fixture_t *f, epx_rm_dispatch_args_t *a, epx_rm_dispatch_outputs_t *o)
{
    memset(a, 0, sizeof(*a));
    memset(o, 0, sizeof(*o));
    a->size = sizeof(*a);
    a->version = EPX_VERSION_CODE;
    a->pad_multiple = 1;
    a->num_dispatched_tokens = -1;
    a->num_permuted_tokens = -1;
    o->size = sizeof(*o);
    o->version = EPX_VERSION_CODE;
    int64_t cap = (int64_t)f->R * TMAX * TOPK + (int64_t)f->L * 127; /* enough with or without permute */
    a->hidden = epx_tensor_2d(f->x, EPX_DTYPE_BF16, T_USED, HID);
    a->routing_map = epx_tensor_2d(f->rmap, EPX_DTYPE_BOOL, T_USED, NEXP);
    o->tokens = epx_tensor_2d(out_take(f, (size_t)cap * HID * 2), EPX_DTYPE_BF16, cap, HID);
    o->tokens_per_expert = epx_tensor_1d(out_take(f, (size_t)f->L * 4), EPX_DTYPE_INT32, f->L);
    o->num_tokens_host = SENTINEL_COUNT;
    o->handle = SENTINEL_HANDLE;
}

static int ht_outputs_untouched(const epx_ht_dispatch_outputs_t *o)
{
    return o->handle == SENTINEL_HANDLE && o->num_recv_tokens_host == SENTINEL_COUNT;
}

/* A successful HT dispatch on `buffer`; its handle in *h_out. */
static int ht_dispatch_ok(fixture_t *f, epx_buffer_t buffer, epx_handle_t *h_out)
{
    epx_ht_dispatch_args_t a;
    epx_ht_dispatch_outputs_t o;
    ht_setup(f, &a, &o);
    EXPECT_OK(epx_ht_dispatch(buffer, &a, &o));
    EXPECT_TRUE(o.handle != SENTINEL_HANDLE && o.handle != NULL);
    EXPECT_TRUE(o.num_recv_tokens_host >= 0);
    *h_out = o.handle;
    return 0;
}

/* -------------------------------------------------------------------- 1-rank cases ---- */

static int case_expert_out_of_range(fixture_t *f)
{
    epx_ht_dispatch_args_t a;
    epx_ht_dispatch_outputs_t o;
    ht_setup(f, &a, &o);
    f->topk[3 * TOPK + 1] = NEXP;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG,
                "topk_idx[3][1] = 4 is out of range");
    EXPECT_TRUE(ht_outputs_untouched(&o));
    f->topk[3 * TOPK + 1] = -2;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "topk_idx[3][1] = -2");
    epx_tensor_t topk;
    epx_layout_outputs_t lo;
    layout_setup(f, &topk, &lo);
    EXPECT_FAIL(f, epx_get_dispatch_layout(f->buf, &topk, &lo, NULL), EPX_ERR_INVALID_ARG, "topk_idx[3][1]");
    epx_ll_dispatch_args_t la;
    epx_ll_dispatch_outputs_t llo;
    ll_setup(f, &la, &llo);
    EXPECT_FAIL(f, epx_ll_dispatch(f->buf, &la, &llo), EPX_ERR_INVALID_ARG, "topk_idx[3][1]");
    EXPECT_TRUE(llo.handle.seq == 12345 && llo.handle.slot == 7);
    return 0;
}

static int case_duplicate_expert(fixture_t *f)
{
    epx_ht_dispatch_args_t a;
    epx_ht_dispatch_outputs_t o;
    ht_setup(f, &a, &o);
    f->topk[2 * TOPK + 0] = 1;
    f->topk[2 * TOPK + 1] = 1;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG,
                "topk_idx[2] selects expert 1 twice");
    EXPECT_TRUE(ht_outputs_untouched(&o));
    /* "No expert" may repeat. */
    f->topk[2 * TOPK + 0] = -1;
    f->topk[2 * TOPK + 1] = -1;
    EXPECT_OK(epx_ht_dispatch(f->buf, &a, &o));
    EXPECT_OK(epx_handle_destroy(o.handle));
    return 0;
}

static int case_tokens_above_max(fixture_t *f)
{
    epx_ht_dispatch_args_t a;
    epx_ht_dispatch_outputs_t o;
    ht_setup(f, &a, &o);
    a.x.shape[0] = TMAX + 1;
    a.topk_idx.shape[0] = TMAX + 1;
    a.topk_weights.shape[0] = TMAX + 1;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG,
                "x has 9 tokens, more than the buffer's max_tokens = 8");
    EXPECT_TRUE(ht_outputs_untouched(&o));
    return 0;
}

static int case_hidden_differs(fixture_t *f)
{
    epx_ht_dispatch_args_t a;
    epx_ht_dispatch_outputs_t o;
    ht_setup(f, &a, &o);
    a.x.shape[1] = 2 * HID;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG,
                "x.shape[1] = 256, expected H = 128");
    EXPECT_TRUE(ht_outputs_untouched(&o));
    return 0;
}

static int case_topk_differs(fixture_t *f)
{
    epx_ht_dispatch_args_t a;
    epx_ht_dispatch_outputs_t o;
    ht_setup(f, &a, &o);
    a.topk_idx.shape[1] = TOPK - 1;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG,
                "topk_idx.shape[1] = 1, expected K = 2");
    EXPECT_TRUE(ht_outputs_untouched(&o));
    return 0;
}

static int case_experts_differ(fixture_t *f)
{
    epx_rm_dispatch_args_t a;
    epx_rm_dispatch_outputs_t o;
    rm_setup(f, &a, &o);
    a.routing_map.shape[1] = 2 * NEXP;
    EXPECT_FAIL(f, epx_rm_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG,
                "routing_map.shape[1] = 8, expected E = 4");
    EXPECT_TRUE(o.handle == SENTINEL_HANDLE && o.num_tokens_host == SENTINEL_COUNT);
    epx_tensor_t topk;
    epx_layout_outputs_t lo;
    layout_setup(f, &topk, &lo);
    lo.num_tokens_per_expert.shape[0] = NEXP + 1;
    EXPECT_FAIL(f, epx_get_dispatch_layout(f->buf, &topk, &lo, NULL), EPX_ERR_INVALID_ARG,
                "outputs.num_tokens_per_expert.shape[0] = 5, expected E = 4");
    return 0;
}

static int case_wrong_dtype(fixture_t *f)
{
    epx_ht_dispatch_args_t a;
    epx_ht_dispatch_outputs_t o;
    ht_setup(f, &a, &o);
    a.x.dtype = EPX_DTYPE_INT32;
    a.x.shape[1] = HID / 2;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "x has dtype int32");
    ht_setup(f, &a, &o);
    a.topk_idx.dtype = EPX_DTYPE_FP32;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "topk_idx has dtype fp32");
    ht_setup(f, &a, &o);
    o.recv_x.dtype = EPX_DTYPE_FP32;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "outputs.recv_x has dtype fp32");
    /* fp32 is a dispatch dtype, but not one buf_ht was created for. */
    ht_setup(f, &a, &o);
    a.x.dtype = EPX_DTYPE_FP32;
    o.recv_x.dtype = EPX_DTYPE_FP32;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf_ht, &a, &o), EPX_ERR_INVALID_ARG, "dispatch_dtypes");
    /* fp8 needs its scales. */
    ht_setup(f, &a, &o);
    a.x.dtype = EPX_DTYPE_FP8_E4M3;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "x_scales.data is NULL");
    EXPECT_TRUE(ht_outputs_untouched(&o));
    return 0;
}

static int case_wrong_shape(fixture_t *f)
{
    epx_ht_dispatch_args_t a;
    epx_ht_dispatch_outputs_t o;
    ht_setup(f, &a, &o);
    a.topk_idx = epx_tensor_1d(f->topk, EPX_DTYPE_INT32, T_USED * TOPK);
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG,
                "topk_idx has 1 dimensions; expected 2");
    ht_setup(f, &a, &o);
    a.topk_idx.shape[0] = T_USED - 1; /* x and topk_idx disagree on T */
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG,
                "topk_idx.shape[0] = 5, expected T = 6");
    epx_ll_dispatch_args_t la;
    epx_ll_dispatch_outputs_t lo;
    ll_setup(f, &la, &lo);
    lo.recv_x.shape[1] -= 1;
    EXPECT_FAIL(f, epx_ll_dispatch(f->buf, &la, &lo), EPX_ERR_INVALID_ARG, "outputs.recv_x.shape[1]");
    EXPECT_TRUE(ht_outputs_untouched(&o));
    return 0;
}

static int case_null_pointer(fixture_t *f)
{
    epx_ht_dispatch_args_t a;
    epx_ht_dispatch_outputs_t o;
    ht_setup(f, &a, &o);
    a.x.data = NULL;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "x.data is NULL");
    ht_setup(f, &a, &o);
    o.recv_x.data = NULL;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "outputs.recv_x.data is NULL");
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, NULL, &o), EPX_ERR_INVALID_ARG, "args is NULL");
    ht_setup(f, &a, &o);
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, NULL), EPX_ERR_INVALID_ARG, "outputs is NULL");
    EXPECT_FAIL(f, epx_ht_dispatch(NULL, &a, &o), EPX_ERR_INVALID_ARG, "buffer is NULL");
    EXPECT_FAIL(f, epx_get_dispatch_layout(f->buf, NULL, NULL, NULL), EPX_ERR_INVALID_ARG,
                "topk_idx is NULL");
    EXPECT_FAIL(f, epx_hook_run(NULL, NULL), EPX_ERR_INVALID_ARG, "hook is NULL");
    EXPECT_FAIL(f, epx_handle_get_info(NULL, NULL), EPX_ERR_INVALID_ARG, "handle is NULL");
    EXPECT_TRUE(ht_outputs_untouched(&o));
    return 0;
}

static int case_misaligned_pointer(fixture_t *f)
{
    epx_ht_dispatch_args_t a;
    epx_ht_dispatch_outputs_t o;
    ht_setup(f, &a, &o);
    a.x.data = f->x + 1; /* element-aligned, not 16-byte aligned */
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "x.data");
    EXPECT_MSG_HAS("not aligned to 16 bytes");
    ht_setup(f, &a, &o);
    a.topk_idx.data = (char *)f->topk + 1;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "topk_idx.data");
    EXPECT_MSG_HAS("not aligned to its 4-byte elements");
    EXPECT_TRUE(ht_outputs_untouched(&o));
    return 0;
}

static int case_output_too_small(fixture_t *f)
{
    epx_ht_dispatch_args_t a;
    epx_ht_dispatch_outputs_t o;
    ht_setup(f, &a, &o);
    a.num_worst_tokens = (int64_t)f->R * TMAX;
    o.recv_x.shape[0] = a.num_worst_tokens - 1;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "outputs.recv_x.shape[0] = 7 rows");
    EXPECT_MSG_HAS("num_worst_tokens = 8");
    EXPECT_TRUE(ht_outputs_untouched(&o));
    epx_tensor_t topk;
    epx_layout_outputs_t lo;
    layout_setup(f, &topk, &lo);
    lo.is_token_in_rank.shape[0] = T_USED - 1;
    EXPECT_FAIL(f, epx_get_dispatch_layout(f->buf, &topk, &lo, NULL), EPX_ERR_INVALID_ARG,
                "outputs.is_token_in_rank.shape[0] = 5");
    /* Combine outputs need the handle's T rows; x needs its N_r rows. */
    epx_handle_t h;
    EXPECT_TRUE(ht_dispatch_ok(f, f->buf, &h) == 0);
    out_reset(f);
    epx_ht_combine_args_t ca;
    epx_ht_combine_outputs_t co;
    ht_combine_setup(f, h, &ca, &co);
    co.combined_x.shape[0] = T_USED - 1;
    EXPECT_FAIL(f, epx_ht_combine(f->buf, &ca, &co), EPX_ERR_INVALID_ARG, "outputs.combined_x.shape[0] = 5");
    EXPECT_MSG_HAS("T = 6");
    ht_combine_setup(f, h, &ca, &co);
    epx_handle_info_t info;
    EXPECT_OK(epx_handle_get_info(h, &info));
    EXPECT_TRUE(info.num_recv_tokens > 0);
    ca.x.shape[0] = info.num_recv_tokens - 1;
    EXPECT_FAIL(f, epx_ht_combine(f->buf, &ca, &co), EPX_ERR_INVALID_ARG, "x.shape[0]");
    EXPECT_MSG_HAS("N_r");
    EXPECT_OK(epx_handle_destroy(h));
    return 0;
}

static int case_non_contiguous(fixture_t *f)
{
    epx_ht_dispatch_args_t a;
    epx_ht_dispatch_outputs_t o;
    ht_setup(f, &a, &o);
    a.x.strides[0] = 2 * HID; /* every other row of a wider tensor */
    a.x.strides[1] = 1;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG,
                "x is not contiguous: strides[0] = 256");
    ht_setup(f, &a, &o);
    o.recv_x.strides[0] = 1; /* column-major */
    o.recv_x.strides[1] = o.recv_x.shape[0];
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "outputs.recv_x is not contiguous");
    /* Explicit row-major strides are accepted. */
    ht_setup(f, &a, &o);
    a.x.strides[0] = HID;
    a.x.strides[1] = 1;
    EXPECT_OK(epx_ht_dispatch(f->buf, &a, &o));
    EXPECT_OK(epx_handle_destroy(o.handle));
    return 0;
}

static int case_wrong_device(fixture_t *f)
{
    epx_ht_dispatch_args_t a;
    epx_ht_dispatch_outputs_t o;
    ht_setup(f, &a, &o);
    a.x.device_type = EPX_DEVICE_CUDA;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "x has device_type 1");
    EXPECT_MSG_HAS("host backend");
    EXPECT_TRUE(ht_outputs_untouched(&o));
    return 0;
}

static int case_mode_missing(fixture_t *f)
{
    epx_ll_dispatch_args_t la;
    epx_ll_dispatch_outputs_t lo;
    ll_setup(f, &la, &lo);
    EXPECT_FAIL(f, epx_ll_dispatch(f->buf_ht, &la, &lo), EPX_ERR_INVALID_ARG,
                "epx_ll_dispatch needs a buffer created with EPX_MODE_LL");
    EXPECT_TRUE(lo.handle.seq == 12345 && lo.handle.slot == 7);
    epx_rm_dispatch_args_t ra;
    epx_rm_dispatch_outputs_t ro;
    rm_setup(f, &ra, &ro);
    EXPECT_FAIL(f, epx_rm_dispatch(f->buf_ht, &ra, &ro), EPX_ERR_INVALID_ARG,
                "epx_rm_dispatch needs a buffer created with EPX_MODE_PERMUTE");
    EXPECT_TRUE(ro.handle == SENTINEL_HANDLE);
    epx_ht_dispatch_args_t ha;
    epx_ht_dispatch_outputs_t ho;
    ht_setup(f, &ha, &ho);
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf_llrm, &ha, &ho), EPX_ERR_INVALID_ARG,
                "epx_ht_dispatch needs a buffer created with EPX_MODE_HT");
    EXPECT_TRUE(ht_outputs_untouched(&ho));
    epx_tensor_t topk;
    epx_layout_outputs_t lyo;
    layout_setup(f, &topk, &lyo);
    EXPECT_FAIL(f, epx_get_dispatch_layout(f->buf_llrm, &topk, &lyo, NULL), EPX_ERR_INVALID_ARG,
                "EPX_MODE_HT");
    return 0;
}

static int case_handle_of_other_buffer(fixture_t *f)
{
    epx_handle_t h;
    EXPECT_TRUE(ht_dispatch_ok(f, f->buf, &h) == 0);
    out_reset(f);
    epx_ht_combine_args_t ca;
    epx_ht_combine_outputs_t co;
    ht_combine_setup(f, h, &ca, &co);
    EXPECT_FAIL(f, epx_ht_combine(f->buf_ht, &ca, &co), EPX_ERR_INVALID_ARG,
                "args.handle belongs to another buffer");
    epx_ht_dispatch_args_t a;
    epx_ht_dispatch_outputs_t o;
    ht_setup(f, &a, &o);
    a.cached_handle = h;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf_ht, &a, &o), EPX_ERR_INVALID_ARG,
                "args.cached_handle belongs to another buffer");
    /* A handle of the other kind is refused too. */
    out_reset(f);
    epx_rm_combine_args_t ra;
    epx_rm_combine_outputs_t ro;
    memset(&ra, 0, sizeof(ra));
    memset(&ro, 0, sizeof(ro));
    ra.size = sizeof(ra);
    ra.version = EPX_VERSION_CODE;
    ro.size = sizeof(ro);
    ro.version = EPX_VERSION_CODE;
    ra.handle = h;
    ra.x = epx_tensor_2d(f->x, EPX_DTYPE_BF16, TMAX, HID);
    ro.combined = epx_tensor_2d(out_take(f, (size_t)T_USED * HID * 2), EPX_DTYPE_BF16, T_USED, HID);
    EXPECT_FAIL(f, epx_rm_combine(f->buf, &ra, &ro), EPX_ERR_INVALID_ARG, "args.handle is a HT handle");
    /* A buffer with a live handle cannot go away. */
    EXPECT_RES(epx_buffer_destroy(f->buf), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("1 live handles");
    EXPECT_OK(epx_handle_destroy(h));
    return 0;
}

static int case_ll_flags(fixture_t *f)
{
    epx_ll_dispatch_args_t a;
    epx_ll_dispatch_outputs_t o;
    ll_setup(f, &a, &o);
    a.use_fp8 = 1;
    a.use_ue8m0 = 1;
    o.recv_x.dtype = EPX_DTYPE_FP8_E4M3;
    EXPECT_FAIL(f, epx_ll_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "use_ue8m0 needs args.round_scale");
    a.round_scale = 1; /* now only H % 512 is wrong: H = 128 */
    EXPECT_FAIL(f, epx_ll_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "hidden % 512 == 0; hidden = 128");
    ll_setup(f, &a, &o);
    a.round_scale = 1;
    EXPECT_FAIL(f, epx_ll_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "round_scale needs args.use_fp8");
    /* An LL combine handle with an impossible slot. */
    epx_ll_combine_args_t ca;
    epx_ll_combine_outputs_t co;
    memset(&ca, 0, sizeof(ca));
    memset(&co, 0, sizeof(co));
    ca.size = sizeof(ca);
    ca.version = EPX_VERSION_CODE;
    co.size = sizeof(co);
    co.version = EPX_VERSION_CODE;
    ca.handle.seq = 1;
    ca.handle.slot = 2;
    ca.handle.num_tokens = T_USED;
    EXPECT_FAIL(f, epx_ll_combine(f->buf, &ca, &co), EPX_ERR_INVALID_ARG, "args.handle.slot = 2");
    EXPECT_TRUE(o.handle.seq == 12345 && o.handle.slot == 7);
    return 0;
}

static int case_bad_pad_multiple(fixture_t *f)
{
    epx_rm_dispatch_args_t a;
    epx_rm_dispatch_outputs_t o;
    rm_setup(f, &a, &o);
    a.permute = 1;
    a.pad_multiple = 0;
    EXPECT_FAIL(f, epx_rm_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG,
                "args.pad_multiple = 0 is out of range [1, 128]");
    a.pad_multiple = 129;
    EXPECT_FAIL(f, epx_rm_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "args.pad_multiple = 129");
    EXPECT_TRUE(o.handle == SENTINEL_HANDLE && o.num_tokens_host == SENTINEL_COUNT);
    return 0;
}

static int case_bound_above_capacity(fixture_t *f)
{
    epx_rm_dispatch_args_t a;
    epx_rm_dispatch_outputs_t o;
    int64_t cap_plain = (int64_t)f->R * TMAX;
    int64_t cap_perm = cap_plain * (TOPK < f->L ? TOPK : f->L) + (int64_t)f->L * 127;
    rm_setup(f, &a, &o);
    a.num_dispatched_tokens = cap_plain + 1;
    EXPECT_FAIL(f, epx_rm_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "args.num_dispatched_tokens = 9");
    rm_setup(f, &a, &o);
    a.permute = 1;
    a.num_permuted_tokens = cap_perm + 1;
    o.tokens.shape[0] = cap_perm + 1;
    EXPECT_FAIL(f, epx_rm_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "args.num_permuted_tokens");
    /* A valid bound, but outputs smaller than it. */
    rm_setup(f, &a, &o);
    a.num_dispatched_tokens = 4;
    o.tokens.shape[0] = 3;
    EXPECT_FAIL(f, epx_rm_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG,
                "num_dispatched_tokens = 4 rows are needed");
    EXPECT_TRUE(o.handle == SENTINEL_HANDLE && o.num_tokens_host == SENTINEL_COUNT);
    return 0;
}

static int case_malformed_struct_size(fixture_t *f)
{
    epx_buffer_config_t cfg = {.size = 0,
                               .version = EPX_VERSION_CODE,
                               .max_tokens = TMAX,
                               .hidden = HID,
                               .num_topk = TOPK,
                               .num_experts = NEXP};
    epx_buffer_t b = (epx_buffer_t)(uintptr_t)0x77;
    EXPECT_RES(epx_buffer_create(f->comm, &cfg, &b), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("config->size = 0");
    EXPECT_TRUE(b == (epx_buffer_t)(uintptr_t)0x77);
    epx_ht_dispatch_args_t a;
    epx_ht_dispatch_outputs_t o;
    ht_setup(f, &a, &o);
    a.size = 4;
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "args->size = 4");
    ht_setup(f, &a, &o);
    o.size = offsetof(epx_ht_dispatch_outputs_t, handle); /* no room for the handle */
    EXPECT_FAIL(f, epx_ht_dispatch(f->buf, &a, &o), EPX_ERR_INVALID_ARG, "outputs.handle");
    EXPECT_TRUE(ht_outputs_untouched(&o));
    return 0;
}

/* After every failure above, the buffer still works: a full round trip succeeds. */
static int case_still_usable(fixture_t *f)
{
    epx_handle_t h;
    EXPECT_TRUE(ht_dispatch_ok(f, f->buf, &h) == 0);
    epx_ht_combine_args_t ca;
    epx_ht_combine_outputs_t co;
    ht_combine_setup(f, h, &ca, &co);
    EXPECT_OK(epx_ht_combine(f->buf, &ca, &co));
    EXPECT_OK(epx_handle_destroy(h));
    return 0;
}

typedef struct named_case {
    const char *name;
    int (*fn)(fixture_t *f);
} named_case_t;

static const named_case_t one_rank_cases[] = {
    {"expert_out_of_range", case_expert_out_of_range},
    {"duplicate_expert", case_duplicate_expert},
    {"tokens_above_max", case_tokens_above_max},
    {"hidden_differs", case_hidden_differs},
    {"topk_differs", case_topk_differs},
    {"experts_differ", case_experts_differ},
    {"wrong_dtype", case_wrong_dtype},
    {"wrong_shape", case_wrong_shape},
    {"null_pointer", case_null_pointer},
    {"misaligned_pointer", case_misaligned_pointer},
    {"output_too_small", case_output_too_small},
    {"non_contiguous", case_non_contiguous},
    {"wrong_device", case_wrong_device},
    {"mode_missing", case_mode_missing},
    {"handle_of_other_buffer", case_handle_of_other_buffer},
    {"ll_flags", case_ll_flags},
    {"bad_pad_multiple", case_bad_pad_multiple},
    {"bound_above_capacity", case_bound_above_capacity},
    {"malformed_struct_size", case_malformed_struct_size},
    {"still_usable", case_still_usable},
};

/* ------------------------------------------------------------------------- fixtures ---- */

static epx_result_t make_buffer(epx_comm_t comm, uint32_t modes, uint32_t dtypes, int64_t max_tokens,
                                epx_buffer_t *out)
{
    epx_buffer_config_t cfg = {.size = sizeof(cfg),
                               .version = EPX_VERSION_CODE,
                               .max_tokens = max_tokens,
                               .hidden = HID,
                               .num_topk = TOPK,
                               .num_experts = NEXP,
                               .modes = modes,
                               .dispatch_dtypes = dtypes};
    return epx_buffer_create(comm, &cfg, out);
}

static epx_result_t make_comm(int rank, int nranks, const epx_unique_id_t *id, epx_comm_t *comm)
{
    epx_comm_config_t cc = {.size = sizeof(cc),
                            .version = EPX_VERSION_CODE,
                            .backend = EPX_BACKEND_HOST,
                            .cuda_device = -1,
                            .timeout_ms = 20000};
    return epx_comm_init(id, rank, nranks, &cc, comm);
}

/* aligned_alloc wants a size that is a multiple of the alignment. */
static void *alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) & ~(size_t)63); }

static int fixture_open(fixture_t *f, int rank, int nranks, const epx_unique_id_t *id)
{
    memset(f, 0, sizeof(*f));
    f->rank = rank;
    f->R = nranks;
    f->L = NEXP / nranks;
    f->x = alloc64((TMAX + 2) * 2 * HID * sizeof(uint16_t));
    f->topk = alloc64((TMAX + 2) * TOPK * sizeof(int32_t) + 64);
    f->weights = alloc64((TMAX + 2) * TOPK * sizeof(float) + 64);
    f->rmap = alloc64((TMAX + 2) * 2 * NEXP);
    f->out = alloc64(OUT_BYTES);
    EXPECT_TRUE(f->x && f->topk && f->weights && f->rmap && f->out);
    EXPECT_OK(make_comm(rank, nranks, id, &f->comm));
    EXPECT_OK(make_buffer(f->comm, 0, 0, TMAX, &f->buf));
    EXPECT_OK(make_buffer(f->comm, EPX_MODE_HT, EPX_DTYPE_BIT(EPX_DTYPE_BF16), TMAX, &f->buf_ht));
    EXPECT_OK(make_buffer(f->comm, EPX_MODE_LL | EPX_MODE_PERMUTE, 0, TMAX, &f->buf_llrm));
    return 0;
}

static int fixture_close(fixture_t *f)
{
    EXPECT_OK(epx_buffer_destroy(f->buf_llrm));
    EXPECT_OK(epx_buffer_destroy(f->buf_ht));
    EXPECT_OK(epx_buffer_destroy(f->buf));
    EXPECT_OK(epx_comm_destroy(f->comm));
    free(f->out);
    free(f->rmap);
    free(f->weights);
    free(f->topk);
    free(f->x);
    return 0;
}

static int one_rank_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    fixture_t f;
    if (fixture_open(&f, rank, nranks, id)) return 1;
    int failed = 0;
    for (size_t i = 0; i < sizeof(one_rank_cases) / sizeof(one_rank_cases[0]); i++) {
        fill_inputs(&f);
        out_reset(&f);
        int rc = one_rank_cases[i].fn(&f);
        printf("case %-24s %s\n", one_rank_cases[i].name, rc ? "FAILED" : "ok");
        fflush(stdout);
        failed |= rc;
    }
    if (fixture_close(&f)) return 1;
    return failed;
}

/* -------------------------------------------------------------------- 2-rank cases ---- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Ranks disagree on max_tokens: both get EPX_ERR_MISMATCH naming it. A rank whose own config
 * is bad makes the other return EPX_ERR_REMOTE at once. */
static int config_mismatch_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    epx_comm_t comm;
    EXPECT_OK(make_comm(rank, nranks, id, &comm));
    epx_buffer_t b = (epx_buffer_t)(uintptr_t)0x77;
    EXPECT_RES(make_buffer(comm, 0, 0, rank == 0 ? TMAX : 2 * TMAX, &b), EPX_ERR_MISMATCH);
    EXPECT_MSG_HAS("max_tokens differs: rank 0 has 8, rank 1 has 16");
    EXPECT_TRUE(b == (epx_buffer_t)(uintptr_t)0x77);

    double t0 = now_s();
    if (rank == 1) {
        EXPECT_RES(make_buffer(comm, 0, 0, 0, &b), EPX_ERR_INVALID_ARG);
        EXPECT_MSG_HAS("config.max_tokens = 0");
    } else {
        EXPECT_RES(make_buffer(comm, 0, 0, TMAX, &b), EPX_ERR_REMOTE);
        EXPECT_MSG_HAS("rank 1");
    }
    EXPECT_TRUE(now_s() - t0 < 5.0);
    EXPECT_TRUE(b == (epx_buffer_t)(uintptr_t)0x77);
    /* Still in step: a matching create works. */
    EXPECT_OK(make_buffer(comm, 0, 0, TMAX, &b));
    EXPECT_OK(epx_buffer_destroy(b));
    EXPECT_OK(epx_comm_destroy(comm));
    printf("rank %d: config mismatch cases ok\n", rank);
    return 0;
}

/* Rank 1 fails its checks in HT, LL and RM dispatch; rank 0, with good arguments, must get
 * EPX_ERR_REMOTE long before the 20 s timeout, and both must be able to go on. */
static int remote_failure_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    fixture_t f;
    if (fixture_open(&f, rank, nranks, id)) return 1;
    fill_inputs(&f);
    const int bad = rank == 1;

    out_reset(&f);
    epx_ht_dispatch_args_t a;
    epx_ht_dispatch_outputs_t o;
    ht_setup(&f, &a, &o);
    if (bad) f.topk[1] = NEXP;
    double t0 = now_s();
    epx_result_t res = epx_ht_dispatch(f.buf, &a, &o);
    double took = now_s() - t0;
    EXPECT_EQ_INT(res, bad ? EPX_ERR_INVALID_ARG : EPX_ERR_REMOTE);
    EXPECT_TRUE(took < 5.0);
    if (bad) EXPECT_MSG_HAS("topk_idx[0][1] = 4");
    EXPECT_TRUE(ht_outputs_untouched(&o));
    if (bad) EXPECT_TRUE(out_untouched(&f));
    fill_inputs(&f);

    out_reset(&f);
    epx_ll_dispatch_args_t la;
    epx_ll_dispatch_outputs_t lo;
    ll_setup(&f, &la, &lo);
    if (bad) la.x.shape[1] = HID * 2;
    t0 = now_s();
    res = epx_ll_dispatch(f.buf, &la, &lo);
    took = now_s() - t0;
    EXPECT_EQ_INT(res, bad ? EPX_ERR_INVALID_ARG : EPX_ERR_REMOTE);
    EXPECT_TRUE(took < 5.0);
    if (bad) EXPECT_MSG_HAS("x.shape[1] = 256");
    if (bad) EXPECT_TRUE(out_untouched(&f));

    out_reset(&f);
    epx_rm_dispatch_args_t ra;
    epx_rm_dispatch_outputs_t ro;
    rm_setup(&f, &ra, &ro);
    ra.permute = 1;
    if (bad) ra.pad_multiple = 0;
    t0 = now_s();
    res = epx_rm_dispatch(f.buf, &ra, &ro);
    took = now_s() - t0;
    EXPECT_EQ_INT(res, bad ? EPX_ERR_INVALID_ARG : EPX_ERR_REMOTE);
    EXPECT_TRUE(took < 5.0);
    EXPECT_TRUE(ro.handle == SENTINEL_HANDLE && ro.num_tokens_host == SENTINEL_COUNT);
    if (bad) EXPECT_TRUE(out_untouched(&f));

    /* Both ranks go on with a good round trip. */
    out_reset(&f);
    if (case_still_usable(&f)) return 1;
    if (fixture_close(&f)) return 1;
    printf("rank %d: remote failure cases ok\n", rank);
    return 0;
}

int main(void)
{
    /* Peers must learn of a failure from the failing rank, not from this deadline. */
    setenv("EPX_TIMEOUT_MS", "20000", 1);
    int failed = 0;
    failed |= epx_test_run_ranks(1, one_rank_body, NULL, 120);
    failed |= epx_test_run_ranks(2, config_mismatch_body, NULL, 60);
    failed |= epx_test_run_ranks(2, remote_failure_body, NULL, 60);
    printf(failed ? "FAILED\n" : "ok\n");
    return failed;
}
