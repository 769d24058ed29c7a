/*
 * LL on a bf16-only buffer whose hidden size is not a multiple of 128 (host backend): the buffer is
 * created, bf16 dispatch and combine move exact data, and an fp8 call is refused per call with
 * EPX_ERR_INVALID_ARG naming hidden while the peer returns EPX_ERR_REMOTE long before the timeout;
 * both ranks go on afterwards.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "epx_test.h"

#define R_RANKS 2
#define HID     200 /* a multiple of 8, not of 128 */
#define TMAX    8
#define TOPK    2
#define NEXP    4

/* Token t of rank r, channel c: a bf16 value exact in any sum of two of them times 1 or 0.5. */
static uint16_t x_val(int r, int t, int c)
{
    return epx_f32_to_bf16((float)(1 + r * 64 + t * 8 + c % 8));
}

typedef struct ll_state {
    uint16_t x[TMAX * HID], recv_x[(NEXP / R_RANKS) * R_RANKS * TMAX * HID], out[TMAX * HID];
    uint8_t recv_fp8[(NEXP / R_RANKS) * R_RANKS * TMAX * HID];
    float scales[(NEXP / R_RANKS) * 2 * R_RANKS * TMAX], weights[TMAX * TOPK];
    int32_t topk[TMAX * TOPK], count[NEXP / R_RANKS], src_info[(NEXP / R_RANKS) * R_RANKS * TMAX];
} ll_state_t;

static epx_result_t dispatch(epx_buffer_t buf, ll_state_t *s, int fp8, epx_ll_handle_t *handle_out)
{
    const int64_t L = NEXP / R_RANKS, RT = (int64_t)R_RANKS * TMAX;
    epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
    a.x = epx_tensor_2d(s->x, EPX_DTYPE_BF16, TMAX, HID);
    a.topk_idx = epx_tensor_2d(s->topk, EPX_DTYPE_INT32, TMAX, TOPK);
    a.use_fp8 = fp8;
    epx_ll_dispatch_outputs_t o = EPX_LL_DISPATCH_OUTPUTS_INIT;
    o.recv_x = fp8 ? epx_tensor_3d(s->recv_fp8, EPX_DTYPE_FP8_E4M3, L, RT, HID)
                   : epx_tensor_3d(s->recv_x, EPX_DTYPE_BF16, L, RT, HID);
    if (fp8) o.recv_scales = epx_tensor_3d(s->scales, EPX_DTYPE_FP32, L, 1, RT);
    o.recv_count = epx_tensor_1d(s->count, EPX_DTYPE_INT32, L);
    o.src_info = epx_tensor_2d(s->src_info, EPX_DTYPE_INT32, L, RT);
    epx_result_t res = epx_ll_dispatch(buf, &a, &o);
    if (res == EPX_SUCCESS) *handle_out = o.handle;
    return res;
}

/* One bf16 round trip: every token selects both local experts of its own rank, so each expert
 * receives this rank's T_max tokens in order; combine (the rows sent back unchanged, weights 1 and
 * 0.5) gives x + 0.5 x, rounded once. */
static int round_trip(int rank, epx_buffer_t buf, ll_state_t *s)
{
    const int64_t L = NEXP / R_RANKS, RT = (int64_t)R_RANKS * TMAX;
    epx_ll_handle_t h;
    EXPECT_OK(dispatch(buf, s, 0, &h));
    for (int64_t j = 0; j < L; j++) {
        EXPECT_EQ_INT(s->count[j], TMAX);
        for (int64_t q = 0; q < TMAX; q++) {
            const int t = s->src_info[j * RT + q];
            EXPECT_EQ_INT(t, q);
            for (int c = 0; c < HID; c++) EXPECT_EQ_INT(s->recv_x[(j * RT + q) * HID + c], x_val(rank, t, c));
        }
    }
    epx_ll_combine_args_t ca = EPX_LL_COMBINE_ARGS_INIT;
    ca.y = epx_tensor_3d(s->recv_x, EPX_DTYPE_BF16, L, RT, HID);
    ca.topk_idx = epx_tensor_2d(s->topk, EPX_DTYPE_INT32, TMAX, TOPK);
    ca.topk_weights = epx_tensor_2d(s->weights, EPX_DTYPE_FP32, TMAX, TOPK);
    ca.handle = h;
    epx_ll_combine_outputs_t co = EPX_LL_COMBINE_OUTPUTS_INIT;
    co.combined_x = epx_tensor_2d(s->out, EPX_DTYPE_BF16, TMAX, HID);
    EXPECT_OK(epx_ll_combine(buf, &ca, &co));
    for (int t = 0; t < TMAX; t++)
        for (int c = 0; c < HID; c++) {
            const float v = epx_bf16_to_f32(x_val(rank, t, c));
            EXPECT_EQ_INT(s->out[t * HID + c], epx_f32_to_bf16(v + 0.5f * v));
        }
    return 0;
}

static int body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    (void)ctx;
    epx_comm_t comm;
    EXPECT_OK(epx_test_host_comm(id, rank, nranks, 20000, &comm));
    ll_state_t *s = calloc(1, sizeof(*s));
    EXPECT_TRUE(s != NULL);
    const int L = NEXP / R_RANKS;
    for (int t = 0; t < TMAX; t++) {
        for (int c = 0; c < HID; c++) s->x[t * HID + c] = x_val(rank, t, c);
        for (int k = 0; k < TOPK; k++) s->topk[t * TOPK + k] = rank * L + k;
        s->weights[t * TOPK] = 1.0f;
        s->weights[t * TOPK + 1] = 0.5f;
    }
    epx_buffer_config_t bc = epx_test_buffer_config(TMAX, HID, TOPK, NEXP, EPX_MODE_LL);
    bc.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_BF16);
    epx_buffer_t buf;
    EXPECT_OK(epx_buffer_create(comm, &bc, &buf));
    if (round_trip(rank, buf, s)) return 1;
    /* fp8 on rank 0 only: rank 0 is refused naming hidden, rank 1 hears of it. */
    epx_ll_handle_t h;
    const double t0 = epx_test_now_s();
    if (rank == 0) {
        EXPECT_RES(dispatch(buf, s, 1, &h), EPX_ERR_INVALID_ARG);
        EXPECT_MSG_HAS("hidden = 200");
    } else {
        EXPECT_RES(dispatch(buf, s, 0, &h), EPX_ERR_REMOTE);
    }
    EXPECT_TRUE(epx_test_now_s() - t0 < 10.0);
    if (round_trip(rank, buf, s)) return 1;
    EXPECT_OK(epx_comm_barrier(comm));
    EXPECT_OK(epx_buffer_destroy(buf));
    free(s);
    EXPECT_OK(epx_comm_destroy(comm));
    return 0;
}

int main(void)
{
    const int failed = epx_test_run_ranks(R_RANKS, body, NULL, 60);
    printf(failed ? "FAILED\n" : "ok\n");
    return failed;
}
