/*
 * Bad arguments on the host backend, one case per kind of mistake: each checks the exact result,
 * that the message names the culprit, and that no output byte or [out] field changed. The
 * 2-rank cases check cross-rank config mismatch and that a rank failing its checks in a
 * collective call makes its peer return EPX_ERR_REMOTE well before the timeout.
 */
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "epx_test.h"

#define TMAX            8
#define HID             128
#define TOPK            2
#define NEXP            4
#define T_USED          6
#define OUT_BYTES       (1u << 20)
#define SENTINEL        0xa5
#define SENTINEL_HANDLE ((epx_handle_t)(uintptr_t)0x5a5a5a50)
#define SENTINEL_COUNT  (-77)
#define SENTINEL_BUFFER ((epx_buffer_t)(uintptr_t)0x77)

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

/* ------------------------------------------------------------------------- one call ---- */

typedef enum op {
    HT_DISPATCH,
    HT_COMBINE,
    LAYOUT,
    LL_DISPATCH,
    LL_COMBINE,
    RM_DISPATCH,
    RM_COMBINE,
    HOOK_RUN,
    HANDLE_INFO,
    BUFFER_CREATE,
    BUFFER_DESTROY,
} op_t;

/* Valid arguments of every call at once; a case spoils the ones of its call. The [out] fields
 * hold sentinels that a failed call must leave alone. */
typedef struct call {
    epx_comm_t comm;
    epx_buffer_t buffer;     /* the buffer the call goes to: f->buf unless a case changes it */
    epx_handle_t handle;     /* a live HT handle of f->buf for cases that need one, else NULL */
    int64_t handle_rows;     /* its N_r */
    int null_args, null_out; /* pass NULL for the args / outputs struct */
    epx_ht_dispatch_args_t ht;
    epx_ht_dispatch_outputs_t ht_out;
    epx_ht_combine_args_t htc;
    epx_ht_combine_outputs_t htc_out;
    epx_tensor_t topk;
    epx_layout_outputs_t layout_out;
    epx_ll_dispatch_args_t ll;
    epx_ll_dispatch_outputs_t ll_out;
    epx_ll_combine_args_t llc;
    epx_ll_combine_outputs_t llc_out;
    epx_rm_dispatch_args_t rm;
    epx_rm_dispatch_outputs_t rm_out;
    epx_rm_combine_args_t rmc;
    epx_rm_combine_outputs_t rmc_out;
    epx_buffer_config_t config;
    epx_buffer_t created;
    epx_hook_t hook; /* HOOK_RUN passes it when its buffer is set, else NULL */
} call_t;

static void call_setup(fixture_t *f, call_t *c, epx_handle_t handle, int64_t handle_rows)
{
    memset(c, 0, sizeof(*c));
    const int64_t R = f->R, L = f->L, cap = R * TMAX, rows = R * TMAX;
    const int64_t rm_cap = R * TMAX * TOPK + L * 127; /* enough with or without permute */
    c->comm = f->comm;
    c->buffer = f->buf;
    c->handle = handle;
    c->handle_rows = handle_rows;

    c->ht = (epx_ht_dispatch_args_t)EPX_HT_DISPATCH_ARGS_INIT;
    c->ht.x = epx_tensor_2d(f->x, EPX_DTYPE_BF16, T_USED, HID);
    c->ht.topk_idx = epx_tensor_2d(f->topk, EPX_DTYPE_INT32, T_USED, TOPK);
    c->ht.topk_weights = epx_tensor_2d(f->weights, EPX_DTYPE_FP32, T_USED, TOPK);
    c->ht_out = (epx_ht_dispatch_outputs_t)EPX_HT_DISPATCH_OUTPUTS_INIT;
    c->ht_out.recv_x = epx_tensor_2d(out_take(f, (size_t)cap * HID * 2), EPX_DTYPE_BF16, cap, HID);
    c->ht_out.recv_topk_idx = epx_tensor_2d(out_take(f, (size_t)cap * TOPK * 4), EPX_DTYPE_INT32, cap, TOPK);
    c->ht_out.recv_topk_weights =
        epx_tensor_2d(out_take(f, (size_t)cap * TOPK * 4), EPX_DTYPE_FP32, cap, TOPK);
    c->ht_out.num_recv_tokens_per_expert = epx_tensor_1d(out_take(f, (size_t)L * 4), EPX_DTYPE_INT32, L);
    c->ht_out.rank_prefix_matrix = epx_tensor_2d(out_take(f, (size_t)(R * R) * 4), EPX_DTYPE_INT32, R, R);
    c->ht_out.num_recv_tokens_host = SENTINEL_COUNT;
    c->ht_out.handle = SENTINEL_HANDLE;

    c->htc = (epx_ht_combine_args_t)EPX_HT_COMBINE_ARGS_INIT;
    c->htc.handle = handle;
    c->htc.x = epx_tensor_2d(f->x, EPX_DTYPE_BF16, R * TMAX, HID);
    c->htc_out = (epx_ht_combine_outputs_t)EPX_HT_COMBINE_OUTPUTS_INIT;
    c->htc_out.combined_x = epx_tensor_2d(out_take(f, (size_t)T_USED * HID * 2), EPX_DTYPE_BF16, T_USED, HID);

    c->topk = epx_tensor_2d(f->topk, EPX_DTYPE_INT32, T_USED, TOPK);
    c->layout_out = (epx_layout_outputs_t)EPX_LAYOUT_OUTPUTS_INIT;
    c->layout_out.num_tokens_per_rank = epx_tensor_1d(out_take(f, (size_t)R * 4), EPX_DTYPE_INT32, R);
    c->layout_out.num_tokens_per_expert = epx_tensor_1d(out_take(f, NEXP * 4), EPX_DTYPE_INT32, NEXP);
    c->layout_out.is_token_in_rank =
        epx_tensor_2d(out_take(f, (size_t)(T_USED * R)), EPX_DTYPE_BOOL, T_USED, R);

    c->ll = (epx_ll_dispatch_args_t)EPX_LL_DISPATCH_ARGS_INIT;
    c->ll.x = epx_tensor_2d(f->x, EPX_DTYPE_BF16, T_USED, HID);
    c->ll.topk_idx = epx_tensor_2d(f->topk, EPX_DTYPE_INT32, T_USED, TOPK);
    c->ll_out = (epx_ll_dispatch_outputs_t)EPX_LL_DISPATCH_OUTPUTS_INIT;
    c->ll_out.recv_x = epx_tensor_3d(out_take(f, (size_t)(L * rows * HID) * 2), EPX_DTYPE_BF16, L, rows, HID);
    c->ll_out.recv_count = epx_tensor_1d(out_take(f, (size_t)L * 4), EPX_DTYPE_INT32, L);
    c->ll_out.handle.seq = 12345;
    c->ll_out.handle.slot = 7;
    c->llc = (epx_ll_combine_args_t)EPX_LL_COMBINE_ARGS_INIT;
    c->llc_out = (epx_ll_combine_outputs_t)EPX_LL_COMBINE_OUTPUTS_INIT;

    c->rm = (epx_rm_dispatch_args_t)EPX_RM_DISPATCH_ARGS_INIT;
    c->rm.hidden = epx_tensor_2d(f->x, EPX_DTYPE_BF16, T_USED, HID);
    c->rm.routing_map = epx_tensor_2d(f->rmap, EPX_DTYPE_BOOL, T_USED, NEXP);
    c->rm_out = (epx_rm_dispatch_outputs_t)EPX_RM_DISPATCH_OUTPUTS_INIT;
    c->rm_out.tokens = epx_tensor_2d(out_take(f, (size_t)rm_cap * HID * 2), EPX_DTYPE_BF16, rm_cap, HID);
    c->rm_out.tokens_per_expert = epx_tensor_1d(out_take(f, (size_t)L * 4), EPX_DTYPE_INT32, L);
    c->rm_out.num_tokens_host = SENTINEL_COUNT;
    c->rm_out.handle = SENTINEL_HANDLE;
    c->rmc = (epx_rm_combine_args_t)EPX_RM_COMBINE_ARGS_INIT;
    c->rmc.handle = handle;
    c->rmc.x = epx_tensor_2d(f->x, EPX_DTYPE_BF16, TMAX, HID);
    c->rmc_out = (epx_rm_combine_outputs_t)EPX_RM_COMBINE_OUTPUTS_INIT;
    c->rmc_out.combined = epx_tensor_2d(out_take(f, (size_t)T_USED * HID * 2), EPX_DTYPE_BF16, T_USED, HID);

    c->config = (epx_buffer_config_t)EPX_BUFFER_CONFIG_INIT;
    c->config.max_tokens = TMAX;
    c->config.hidden = HID;
    c->config.num_topk = TOPK;
    c->config.num_experts = NEXP;
    c->created = SENTINEL_BUFFER;
}

static epx_result_t call_run(op_t op, call_t *c)
{
    const int na = c->null_args, no = c->null_out;
    switch (op) {
    case HT_DISPATCH: return epx_ht_dispatch(c->buffer, na ? NULL : &c->ht, no ? NULL : &c->ht_out);
    case HT_COMBINE: return epx_ht_combine(c->buffer, &c->htc, &c->htc_out);
    case LAYOUT:
        return epx_get_dispatch_layout(c->buffer, na ? NULL : &c->topk, no ? NULL : &c->layout_out, NULL);
    case LL_DISPATCH: return epx_ll_dispatch(c->buffer, &c->ll, &c->ll_out);
    case LL_COMBINE: return epx_ll_combine(c->buffer, &c->llc, &c->llc_out);
    case RM_DISPATCH: return epx_rm_dispatch(c->buffer, &c->rm, &c->rm_out);
    case RM_COMBINE: return epx_rm_combine(c->buffer, &c->rmc, &c->rmc_out);
    case HOOK_RUN: return epx_hook_run(c->hook.buffer ? &c->hook : NULL, NULL);
    case HANDLE_INFO: return epx_handle_get_info(NULL, NULL);
    case BUFFER_CREATE: return epx_buffer_create(c->comm, &c->config, &c->created);
    case BUFFER_DESTROY: return epx_buffer_destroy(c->buffer);
    }
    return EPX_ERR_INTERNAL;
}

/* Every [out] field still holds its sentinel. */
static int out_fields_untouched(const call_t *c)
{
    EXPECT_TRUE(c->ht_out.handle == SENTINEL_HANDLE && c->ht_out.num_recv_tokens_host == SENTINEL_COUNT);
    EXPECT_TRUE(c->ll_out.handle.seq == 12345 && c->ll_out.handle.slot == 7);
    EXPECT_TRUE(c->rm_out.handle == SENTINEL_HANDLE && c->rm_out.num_tokens_host == SENTINEL_COUNT);
    EXPECT_TRUE(c->created == SENTINEL_BUFFER);
    return 0;
}

/* A successful HT dispatch on f->buf; its handle and N_r. */
static int ht_dispatch_ok(fixture_t *f, epx_handle_t *h_out, int64_t *rows_out)
{
    call_t c;
    call_setup(f, &c, NULL, 0);
    EXPECT_OK(epx_ht_dispatch(f->buf, &c.ht, &c.ht_out));
    EXPECT_TRUE(c.ht_out.handle != SENTINEL_HANDLE && c.ht_out.handle != NULL);
    EXPECT_TRUE(c.ht_out.num_recv_tokens_host >= 0);
    epx_handle_info_t info;
    EXPECT_OK(epx_handle_get_info(c.ht_out.handle, &info));
    EXPECT_TRUE(info.num_recv_tokens > 0);
    *h_out = c.ht_out.handle;
    *rows_out = info.num_recv_tokens;
    return 0;
}

/* ---------------------------------------------------------------------- the spoilers ---- */

typedef enum spoil {
    VALID, /* the arguments as call_setup made them */
    TOPK_ABOVE_RANGE,
    TOPK_BELOW_RANGE,
    TOPK_TWICE,
    TOPK_NONE_TWICE,
    TOKENS_ABOVE_MAX,
    X_HIDDEN_DOUBLE,
    TOPK_K_SHORT,
    ROUTING_MAP_WIDE,
    LAYOUT_EXPERTS_LONG,
    PREFIX_MATRIX_SHORT,
    X_INT32,
    TOPK_FP32,
    RECV_X_FP32,
    FP32_ON_BF16_BUFFER,
    FP8_WITHOUT_SCALES,
    TOPK_FLAT,
    TOPK_TOKENS_SHORT,
    LL_RECV_ROWS_SHORT,
    X_NULL,
    RECV_X_NULL,
    ARGS_NULL,
    OUTPUTS_NULL,
    EVERYTHING_NULL,
    BUFFER_NULL,
    X_MISALIGNED,
    TOPK_MISALIGNED,
    RECV_X_BELOW_WORST,
    LAYOUT_IN_RANK_SHORT,
    COMBINED_SHORT,
    COMBINE_X_SHORT,
    X_STRIDED,
    RECV_X_COLUMN_MAJOR,
    X_ROW_MAJOR_STRIDES,
    X_ON_CUDA,
    ON_HT_BUFFER,
    ON_LLRM_BUFFER,
    CACHED_HANDLE_OF_BUF,
    LL_UE8M0_ALONE,
    LL_ROUND_SCALE_H128,
    LL_ROUND_SCALE_ALONE,
    LL_HANDLE_BAD_SLOT,
    PAD_ZERO,
    PAD_129,
    DISPATCHED_ABOVE_CAPACITY,
    PERMUTED_ABOVE_CAPACITY,
    TOKENS_BELOW_BOUND,
    CONFIG_SIZE_ZERO,
    ARGS_SIZE_4,
    OUTPUTS_WITHOUT_HANDLE,
    RECV_X_EMPTY_NO_DATA,
    HOOK_ON_HT_BUFFER,
    CONFIG_TOO_LARGE,
    ALIGNMENT_NEGATIVE,
    RMAP_OVER_K,
} spoil_t;

/* Spoils the arguments of a call (or the fixture's inputs they point to). */
static void spoil(fixture_t *f, call_t *c, spoil_t what)
{
    const int64_t cap_plain = (int64_t)f->R * TMAX;
    const int64_t cap_perm = cap_plain * (TOPK < f->L ? TOPK : f->L) + (int64_t)f->L * 127;
    epx_tensor_t *const x = &c->ht.x, *const topk = &c->ht.topk_idx, *const recv_x = &c->ht_out.recv_x;
    switch (what) {
    case VALID: break;
    case TOPK_ABOVE_RANGE: f->topk[3 * TOPK + 1] = NEXP; break;
    case TOPK_BELOW_RANGE: f->topk[3 * TOPK + 1] = -2; break;
    case TOPK_TWICE: f->topk[2 * TOPK + 0] = f->topk[2 * TOPK + 1] = 1; break;
    case TOPK_NONE_TWICE: f->topk[2 * TOPK + 0] = f->topk[2 * TOPK + 1] = -1; break;
    case TOKENS_ABOVE_MAX: x->shape[0] = topk->shape[0] = c->ht.topk_weights.shape[0] = TMAX + 1; break;
    case X_HIDDEN_DOUBLE: x->shape[1] = c->ll.x.shape[1] = 2 * HID; break;
    case TOPK_K_SHORT: topk->shape[1] = TOPK - 1; break;
    case ROUTING_MAP_WIDE: c->rm.routing_map.shape[1] = 2 * NEXP; break;
    case LAYOUT_EXPERTS_LONG: c->layout_out.num_tokens_per_expert.shape[0] = NEXP + 1; break;
    case PREFIX_MATRIX_SHORT:
        c->ht_out.rank_prefix_matrix.shape[1] = c->ht_out.rank_prefix_matrix.shape[0] - 1;
        break;
    case X_INT32:
        x->dtype = EPX_DTYPE_INT32;
        x->shape[1] = HID / 2;
        break;
    case TOPK_FP32: topk->dtype = EPX_DTYPE_FP32; break;
    case RECV_X_FP32: recv_x->dtype = EPX_DTYPE_FP32; break;
    case FP32_ON_BF16_BUFFER: /* fp32 is a dispatch dtype, but not one buf_ht was created for */
        c->buffer = f->buf_ht;
        x->dtype = recv_x->dtype = EPX_DTYPE_FP32;
        break;
    case FP8_WITHOUT_SCALES: x->dtype = EPX_DTYPE_FP8_E4M3; break;
    case TOPK_FLAT: *topk = epx_tensor_1d(f->topk, EPX_DTYPE_INT32, T_USED * TOPK); break;
    case TOPK_TOKENS_SHORT: topk->shape[0] = T_USED - 1; break; /* x and topk_idx disagree on T */
    case LL_RECV_ROWS_SHORT: c->ll_out.recv_x.shape[1] -= 1; break;
    case X_NULL: x->data = NULL; break;
    case RECV_X_NULL: recv_x->data = NULL; break;
    case RECV_X_EMPTY_NO_DATA: *recv_x = epx_tensor_2d(NULL, EPX_DTYPE_BF16, 0, HID); break;
    case HOOK_ON_HT_BUFFER:
        c->hook.buffer = f->buf_ht;
        c->hook.slot = 0;
        c->hook.kind = 1;
        break;
    case CONFIG_TOO_LARGE:
        c->config.max_tokens = 1 << 30;
        c->config.hidden = 1 << 30;
        break;
    case ALIGNMENT_NEGATIVE: c->ht.expert_alignment = -1; break;
    case RMAP_OVER_K: f->rmap[2 * NEXP + 0] = 1; break; /* row 2 had columns 2 and 3 */
    case ARGS_NULL: c->null_args = 1; break;
    case OUTPUTS_NULL: c->null_out = 1; break;
    case EVERYTHING_NULL: c->null_args = c->null_out = 1; break;
    case BUFFER_NULL: c->buffer = NULL; break;
    case X_MISALIGNED: x->data = f->x + 1; break; /* element-aligned, not 16-byte aligned */
    case TOPK_MISALIGNED: topk->data = (char *)f->topk + 1; break;
    case RECV_X_BELOW_WORST:
        c->ht.num_worst_tokens = cap_plain;
        recv_x->shape[0] = cap_plain - 1;
        break;
    case LAYOUT_IN_RANK_SHORT: c->layout_out.is_token_in_rank.shape[0] = T_USED - 1; break;
    /* Combine outputs need the handle's T rows; x needs its N_r rows. */
    case COMBINED_SHORT: c->htc_out.combined_x.shape[0] = T_USED - 1; break;
    case COMBINE_X_SHORT: c->htc.x.shape[0] = c->handle_rows - 1; break;
    case X_STRIDED: /* every other row of a wider tensor */
        x->strides[0] = 2 * HID;
        x->strides[1] = 1;
        break;
    case RECV_X_COLUMN_MAJOR:
        recv_x->strides[0] = 1;
        recv_x->strides[1] = recv_x->shape[0];
        break;
    case X_ROW_MAJOR_STRIDES:
        x->strides[0] = HID;
        x->strides[1] = 1;
        break;
    case X_ON_CUDA: x->device_type = EPX_DEVICE_CUDA; break;
    case ON_HT_BUFFER: c->buffer = f->buf_ht; break;
    case ON_LLRM_BUFFER: c->buffer = f->buf_llrm; break;
    case CACHED_HANDLE_OF_BUF:
        c->buffer = f->buf_ht;
        c->ht.cached_handle = c->handle;
        break;
    case LL_UE8M0_ALONE:
    case LL_ROUND_SCALE_H128:
        c->ll.use_fp8 = c->ll.use_ue8m0 = 1;
        c->ll_out.recv_x.dtype = EPX_DTYPE_FP8_E4M3;
        c->ll.round_scale = what == LL_ROUND_SCALE_H128; /* then only H % 512 is wrong: H = 128 */
        break;
    case LL_ROUND_SCALE_ALONE: c->ll.round_scale = 1; break;
    case LL_HANDLE_BAD_SLOT:
        c->llc.handle.seq = 1;
        c->llc.handle.slot = 2;
        c->llc.handle.num_tokens = T_USED;
        break;
    case PAD_ZERO:
    case PAD_129:
        c->rm.permute = 1;
        c->rm.pad_multiple = what == PAD_ZERO ? 0 : 129;
        break;
    case DISPATCHED_ABOVE_CAPACITY: c->rm.num_dispatched_tokens = cap_plain + 1; break;
    case PERMUTED_ABOVE_CAPACITY:
        c->rm.permute = 1;
        c->rm.num_permuted_tokens = c->rm_out.tokens.shape[0] = cap_perm + 1;
        break;
    case TOKENS_BELOW_BOUND: /* a valid bound, but outputs smaller than it */
        c->rm.num_dispatched_tokens = 4;
        c->rm_out.tokens.shape[0] = 3;
        break;
    case CONFIG_SIZE_ZERO: c->config.size = 0; break;
    case ARGS_SIZE_4: c->ht.size = 4; break;
    case OUTPUTS_WITHOUT_HANDLE: /* no room for the handle */
        c->ht_out.size = offsetof(epx_ht_dispatch_outputs_t, handle);
        break;
    }
}

/* ------------------------------------------------------------------------ the cases ---- */

typedef struct bad_case {
    const char *name;
    op_t op;
    spoil_t spoil;
    epx_result_t expected;
    const char *needle, *needle2; /* the message contains both (NULL: nothing asked) */
    int with_handle;              /* needs a live HT handle of f->buf */
} bad_case_t;

#define INVALID EPX_ERR_INVALID_ARG
static const bad_case_t cases[] = {
    {"expert above range", HT_DISPATCH, TOPK_ABOVE_RANGE, INVALID, "topk_idx[3][1] = 4 is out of range"},
    {"expert below range", HT_DISPATCH, TOPK_BELOW_RANGE, INVALID, "topk_idx[3][1] = -2"},
    {"layout expert below range", LAYOUT, TOPK_BELOW_RANGE, INVALID, "topk_idx[3][1]"},
    {"ll expert below range", LL_DISPATCH, TOPK_BELOW_RANGE, INVALID, "topk_idx[3][1]"},
    {"duplicate expert", HT_DISPATCH, TOPK_TWICE, INVALID, "topk_idx[2] selects expert 1 twice"},
    {"'no expert' may repeat", HT_DISPATCH, TOPK_NONE_TWICE, EPX_SUCCESS},
    {"tokens above max", HT_DISPATCH, TOKENS_ABOVE_MAX, INVALID,
     "x has 9 tokens, more than the buffer's max_tokens = 8"},
    {"hidden differs", HT_DISPATCH, X_HIDDEN_DOUBLE, INVALID, "x.shape[1] = 256, expected H = 128"},
    {"ll hidden differs", LL_DISPATCH, X_HIDDEN_DOUBLE, INVALID, "x.shape[1] = 256"},
    {"topk differs", HT_DISPATCH, TOPK_K_SHORT, INVALID, "topk_idx.shape[1] = 1, expected K = 2"},
    {"experts differ", RM_DISPATCH, ROUTING_MAP_WIDE, INVALID, "routing_map.shape[1] = 8, expected E = 4"},
    {"rank prefix matrix too narrow", HT_DISPATCH, PREFIX_MATRIX_SHORT, INVALID,
     "outputs.rank_prefix_matrix.shape[1]"},
    {"layout experts differ", LAYOUT, LAYOUT_EXPERTS_LONG, INVALID,
     "outputs.num_tokens_per_expert.shape[0] = 5, expected E = 4"},
    {"x dtype", HT_DISPATCH, X_INT32, INVALID, "x has dtype int32"},
    {"topk dtype", HT_DISPATCH, TOPK_FP32, INVALID, "topk_idx has dtype fp32"},
    {"recv_x dtype", HT_DISPATCH, RECV_X_FP32, INVALID, "outputs.recv_x has dtype fp32"},
    {"dtype not in the buffer", HT_DISPATCH, FP32_ON_BF16_BUFFER, INVALID, "dispatch_dtypes"},
    {"fp8 without scales", HT_DISPATCH, FP8_WITHOUT_SCALES, INVALID, "x_scales.data is NULL"},
    {"topk 1-d", HT_DISPATCH, TOPK_FLAT, INVALID, "topk_idx has 1 dimensions; expected 2"},
    {"topk tokens differ", HT_DISPATCH, TOPK_TOKENS_SHORT, INVALID, "topk_idx.shape[0] = 5, expected T = 6"},
    {"ll recv rows short", LL_DISPATCH, LL_RECV_ROWS_SHORT, INVALID, "outputs.recv_x.shape[1]"},
    {"x NULL", HT_DISPATCH, X_NULL, INVALID, "x.data is NULL"},
    {"recv_x NULL", HT_DISPATCH, RECV_X_NULL, INVALID, "outputs.recv_x.data is NULL"},
    {"args NULL", HT_DISPATCH, ARGS_NULL, INVALID, "args is NULL"},
    {"outputs NULL", HT_DISPATCH, OUTPUTS_NULL, INVALID, "outputs is NULL"},
    {"buffer NULL", HT_DISPATCH, BUFFER_NULL, INVALID, "buffer is NULL"},
    {"layout topk NULL", LAYOUT, EVERYTHING_NULL, INVALID, "topk_idx is NULL"},
    {"hook NULL", HOOK_RUN, VALID, INVALID, "hook is NULL"},
    {"handle NULL", HANDLE_INFO, VALID, INVALID, "handle is NULL"},
    {"x misaligned", HT_DISPATCH, X_MISALIGNED, INVALID, "x.data", "not aligned to 16 bytes"},
    {"topk misaligned", HT_DISPATCH, TOPK_MISALIGNED, INVALID, "topk_idx.data",
     "not aligned to its 4-byte elements"},
    {"recv_x below num_worst_tokens", HT_DISPATCH, RECV_X_BELOW_WORST, INVALID,
     "outputs.recv_x.shape[0] = 7 rows", "num_worst_tokens = 8"},
    {"layout in_rank short", LAYOUT, LAYOUT_IN_RANK_SHORT, INVALID, "outputs.is_token_in_rank.shape[0] = 5"},
    {"combined short", HT_COMBINE, COMBINED_SHORT, INVALID, "outputs.combined_x.shape[0] = 5", "T = 6", 1},
    {"combine x short", HT_COMBINE, COMBINE_X_SHORT, INVALID, "x.shape[0]", "N_r", 1},
    {"x strided", HT_DISPATCH, X_STRIDED, INVALID, "x is not contiguous: strides[0] = 256"},
    {"recv_x column-major", HT_DISPATCH, RECV_X_COLUMN_MAJOR, INVALID, "outputs.recv_x is not contiguous"},
    {"explicit row-major strides", HT_DISPATCH, X_ROW_MAJOR_STRIDES, EPX_SUCCESS},
    {"x on cuda", HT_DISPATCH, X_ON_CUDA, INVALID, "x has device_type 1", "host backend"},
    {"ll without EPX_MODE_LL", LL_DISPATCH, ON_HT_BUFFER, INVALID,
     "epx_ll_dispatch needs a buffer created with EPX_MODE_LL"},
    {"rm without EPX_MODE_PERMUTE", RM_DISPATCH, ON_HT_BUFFER, INVALID,
     "epx_rm_dispatch needs a buffer created with EPX_MODE_PERMUTE"},
    {"ht without EPX_MODE_HT", HT_DISPATCH, ON_LLRM_BUFFER, INVALID,
     "epx_ht_dispatch needs a buffer created with EPX_MODE_HT"},
    {"layout without EPX_MODE_HT", LAYOUT, ON_LLRM_BUFFER, INVALID, "EPX_MODE_HT"},
    {"combine on another buffer", HT_COMBINE, ON_HT_BUFFER, INVALID, "args.handle belongs to another buffer",
     NULL, 1},
    {"cached handle of another buffer", HT_DISPATCH, CACHED_HANDLE_OF_BUF, INVALID,
     "args.cached_handle belongs to another buffer", NULL, 1},
    {"rm combine of an HT handle", RM_COMBINE, VALID, INVALID, "args.handle is a HT handle", NULL, 1},
    {"buffer with a live handle", BUFFER_DESTROY, VALID, INVALID, "1 live handles", NULL, 1},
    {"ll ue8m0 without round_scale", LL_DISPATCH, LL_UE8M0_ALONE, INVALID,
     "use_ue8m0 needs args.round_scale"},
    {"ll round_scale at H 128", LL_DISPATCH, LL_ROUND_SCALE_H128, INVALID, "hidden % 512 == 0; hidden = 128"},
    {"ll round_scale without fp8", LL_DISPATCH, LL_ROUND_SCALE_ALONE, INVALID,
     "round_scale needs args.use_fp8"},
    {"ll handle slot", LL_COMBINE, LL_HANDLE_BAD_SLOT, INVALID, "args.handle.slot = 2"},
    {"pad_multiple 0", RM_DISPATCH, PAD_ZERO, INVALID, "args.pad_multiple = 0 is out of range [1, 128]"},
    {"pad_multiple 129", RM_DISPATCH, PAD_129, INVALID, "args.pad_multiple = 129"},
    {"dispatched bound above capacity", RM_DISPATCH, DISPATCHED_ABOVE_CAPACITY, INVALID,
     "args.num_dispatched_tokens = 9"},
    {"permuted bound above capacity", RM_DISPATCH, PERMUTED_ABOVE_CAPACITY, INVALID,
     "args.num_permuted_tokens"},
    {"tokens below the bound", RM_DISPATCH, TOKENS_BELOW_BOUND, INVALID,
     "num_dispatched_tokens = 4 rows are needed"},
    {"config size 0", BUFFER_CREATE, CONFIG_SIZE_ZERO, INVALID, "config->size = 0"},
    {"args size 4", HT_DISPATCH, ARGS_SIZE_4, INVALID, "args->size = 4"},
    {"outputs without room for the handle", HT_DISPATCH, OUTPUTS_WITHOUT_HANDLE, INVALID, "outputs.handle"},
    /* An empty tensor may come without data; a required one still holds no row. */
    {"recv_x empty without data", HT_DISPATCH, RECV_X_EMPTY_NO_DATA, INVALID, "recv_x has room for 0 rows"},
    {"hook on a buffer without LL", HOOK_RUN, HOOK_ON_HT_BUFFER, INVALID,
     "epx_hook_run needs a buffer created with EPX_MODE_LL"},
    {"config past any layout", BUFFER_CREATE, CONFIG_TOO_LARGE, INVALID, "bytes of buffer per rank",
     "hidden = 1073741824"},
    {"expert_alignment negative", HT_DISPATCH, ALIGNMENT_NEGATIVE, INVALID,
     "args.expert_alignment = -1 must be >= 0"},
    {"routing map above K", RM_DISPATCH, RMAP_OVER_K, INVALID, "routing_map[2] selects 3 experts",
     "column 3 is past them"},
};
#define NUM_CASES ((int)(sizeof(cases) / sizeof(cases[0])))

/* Runs one case on fresh inputs and outputs. With `spoiled`, the case's arguments are spoiled and its
 * result and message expected; without (a peer spoiled them), EPX_ERR_REMOTE. A failed call must
 * return at once, leave every [out] field and (when it failed its own checks) every output byte. */
static int run_case(fixture_t *f, const bad_case_t *bc, int spoiled)
{
    epx_handle_t handle = NULL;
    int64_t rows = 0;
    fill_inputs(f);
    out_reset(f);
    if (bc->with_handle) {
        EXPECT_TRUE(ht_dispatch_ok(f, &handle, &rows) == 0);
        out_reset(f);
    }
    call_t c;
    call_setup(f, &c, handle, rows);
    if (spoiled) spoil(f, &c, bc->spoil);
    const double t0 = epx_test_now_s();
    EXPECT_RES(call_run(bc->op, &c), spoiled ? bc->expected : EPX_ERR_REMOTE);
    EXPECT_TRUE(epx_test_now_s() - t0 < 5.0);
    if (bc->expected == EPX_SUCCESS) {
        EXPECT_OK(epx_handle_destroy(c.ht_out.handle));
        return 0;
    }
    if (spoiled && bc->needle) EXPECT_MSG_HAS(bc->needle);
    if (spoiled && bc->needle2) EXPECT_MSG_HAS(bc->needle2);
    if (spoiled) EXPECT_TRUE(out_untouched(f));
    EXPECT_TRUE(out_fields_untouched(&c) == 0);
    if (handle) EXPECT_OK(epx_handle_destroy(handle));
    return 0;
}

static const bad_case_t *case_named(const char *name)
{
    for (int i = 0; i < NUM_CASES; i++)
        if (!strcmp(cases[i].name, name)) return &cases[i];
    abort(); /* the test's own typo */
}

/* ------------------------------------------------------------------------- fixtures ---- */

static epx_result_t make_buffer(epx_comm_t comm, uint32_t modes, uint32_t dtypes, int64_t max_tokens,
                                epx_buffer_t *out)
{
    epx_buffer_config_t cfg = epx_test_buffer_config(max_tokens, HID, TOPK, NEXP, modes);
    cfg.dispatch_dtypes = dtypes;
    return epx_buffer_create(comm, &cfg, out);
}

/* aligned_alloc wants a size that is a multiple of the alignment. */
static void *alloc64(size_t bytes)
{
    return aligned_alloc(64, (bytes + 63) & ~(size_t)63);
}

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
    EXPECT_OK(epx_test_host_comm(id, rank, nranks, 20000, &f->comm));
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

/* A full round trip succeeds: the buffer still works after the failures. */
static int still_usable(fixture_t *f)
{
    epx_handle_t h;
    int64_t rows;
    fill_inputs(f);
    out_reset(f);
    EXPECT_TRUE(ht_dispatch_ok(f, &h, &rows) == 0);
    call_t c;
    call_setup(f, &c, h, rows);
    EXPECT_OK(epx_ht_combine(f->buf, &c.htc, &c.htc_out));
    EXPECT_OK(epx_handle_destroy(h));
    return 0;
}

static int one_rank_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    fixture_t f;
    if (fixture_open(&f, rank, nranks, id)) return 1;
    int failed = 0;
    for (int i = 0; i <= NUM_CASES; i++) {
        const int rc = i < NUM_CASES ? run_case(&f, &cases[i], 1) : still_usable(&f);
        printf("case %-36s %s\n", i < NUM_CASES ? cases[i].name : "still usable", rc ? "FAILED" : "ok");
        fflush(stdout);
        failed |= rc;
    }
    if (fixture_close(&f)) return 1;
    return failed;
}

/* -------------------------------------------------------------------- 2-rank cases ---- */

/* Ranks disagree on max_tokens: both get EPX_ERR_MISMATCH naming it. A rank whose own config
 * is bad makes the other return EPX_ERR_REMOTE at once. */
static int config_mismatch_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    epx_comm_t comm;
    EXPECT_OK(epx_test_host_comm(id, rank, nranks, 20000, &comm));
    epx_buffer_t b = SENTINEL_BUFFER;
    EXPECT_RES(make_buffer(comm, 0, 0, rank == 0 ? TMAX : 2 * TMAX, &b), EPX_ERR_MISMATCH);
    EXPECT_MSG_HAS("max_tokens differs: rank 0 has 8, rank 1 has 16");
    EXPECT_TRUE(b == SENTINEL_BUFFER);

    double t0 = epx_test_now_s();
    if (rank == 1) {
        EXPECT_RES(make_buffer(comm, 0, 0, 0, &b), EPX_ERR_INVALID_ARG);
        EXPECT_MSG_HAS("config.max_tokens = 0");
    } else {
        EXPECT_RES(make_buffer(comm, 0, 0, TMAX, &b), EPX_ERR_REMOTE);
        EXPECT_MSG_HAS("rank 1");
    }
    EXPECT_TRUE(epx_test_now_s() - t0 < 5.0);
    EXPECT_TRUE(b == SENTINEL_BUFFER);
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
    static const char *const spoiled[] = {"expert above range", "ll hidden differs", "pad_multiple 0"};
    fixture_t f;
    if (fixture_open(&f, rank, nranks, id)) return 1;
    for (int i = 0; i < 3; i++)
        if (run_case(&f, case_named(spoiled[i]), rank == 1)) return 1;
    if (still_usable(&f)) return 1;
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
