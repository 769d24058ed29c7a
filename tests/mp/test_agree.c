/*
 * Every collective call succeeds on all ranks or fails on all (issue 11, defect 6), and a peer's
 * destroy is noticed at once (defect 7), on the host backend:
 * - one rank's outputs are too small for what arrives (HT dispatch at R = 2, 3, 6, 7; cached
 *   static HT dispatch, refused before the exchange; routing-map dispatch with and without
 *   permute): that rank fails with
 *   EPX_ERR_INVALID_ARG, every peer with EPX_ERR_REMOTE naming it, no rank writes an output or
 *   gets a handle, and the next calls work everywhere;
 * - a rank destroys its buffer while (or before) its peers enter a dispatch: they fail with
 *   EPX_ERR_REMOTE saying so, long before the 20 s timeout; then it destroys its comm and the
 *   peers' next buffer creation fails as fast.
 */
#include <unistd.h>

#include "test_calls_io.h"

#define LIMIT_S 1.5
#define POISON  0xabab

enum { CASE_HT, CASE_HT_CACHED_STATIC, CASE_RM, CASE_RM_PERMUTE };
static const char *const case_names[] = {"ht dispatch", "cached static ht dispatch", "rm dispatch",
                                         "rm dispatch with permute"};

/* The failing rank's result, or the peers' naming it. */
static int expect_agreed_failure(epx_result_t res, int rank, int small_rank)
{
    if (rank == small_rank) {
        EXPECT_RES(res, EPX_ERR_INVALID_ARG);
        return 0;
    }
    char peer[32];
    snprintf(peer, sizeof(peer), "peer %d", small_rank);
    EXPECT_RES(res, EPX_ERR_REMOTE);
    EXPECT_MSG_HAS(peer);
    EXPECT_MSG_HAS("INVALID_ARG");
    return 0;
}

static int rows_untouched(const calls_t *c)
{
    for (size_t i = 0; i < sizeof(c->recv) / sizeof(c->recv[0]); i++)
        if (c->recv[i] != POISON) {
            fprintf(stderr, "rank %d: output element %zu written by a failed call\n", c->rank, i);
            return 0;
        }
    return 1;
}

/* One call of case `which` where the last rank's outputs hold one row less than it receives. */
static int small_output_call(calls_t *c, int which)
{
    const int R = c->nranks, small = R - 1, me = c->rank;
    const int64_t cap = (int64_t)R * CT;
    epx_result_t res;
    epx_handle_t static_handle = NULL;
    memset(c->recv, 0xab, sizeof(c->recv));
    if (which == CASE_HT) {
        epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
        a.x = epx_tensor_2d(c->x, EPX_DTYPE_BF16, CT, CH);
        a.topk_idx = epx_tensor_2d(c->topk, EPX_DTYPE_INT32, CT, CK);
        epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
        o.recv_x = epx_tensor_2d(c->recv, EPX_DTYPE_BF16, me == small ? c->ht_rows - 1 : cap, CH);
        res = epx_ht_dispatch(c->buf, &a, &o);
        EXPECT_TRUE(o.handle == NULL);
    } else if (which == CASE_HT_CACHED_STATIC) {
        /* A static handle (bound cap), then its cached dispatch, where the last rank's recv_x holds
         * one row less than the bound: that rank refuses before the exchange and its peers hear it. */
        uint16_t *rows = malloc((size_t)cap * CH * sizeof(uint16_t));
        EXPECT_TRUE(rows != NULL);
        epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
        a.x = epx_tensor_2d(c->x, EPX_DTYPE_BF16, CT, CH);
        a.topk_idx = epx_tensor_2d(c->topk, EPX_DTYPE_INT32, CT, CK);
        a.num_worst_tokens = cap;
        epx_ht_dispatch_outputs_t so = EPX_HT_DISPATCH_OUTPUTS_INIT;
        so.recv_x = epx_tensor_2d(rows, EPX_DTYPE_BF16, cap, CH);
        EXPECT_OK(epx_ht_dispatch(c->buf, &a, &so));
        free(rows);
        static_handle = so.handle;
        a.cached_handle = so.handle;
        a.num_worst_tokens = 0; /* the handle's bound */
        memset(&a.topk_idx, 0, sizeof(a.topk_idx));
        epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
        o.recv_x = epx_tensor_2d(c->recv, EPX_DTYPE_BF16, me == small ? cap - 1 : cap, CH);
        res = epx_ht_dispatch(c->buf, &a, &o);
    } else {
        epx_rm_dispatch_args_t a = EPX_RM_DISPATCH_ARGS_INIT;
        a.hidden = epx_tensor_2d(c->x, EPX_DTYPE_BF16, CT, CH);
        a.routing_map = epx_tensor_2d(c->map, EPX_DTYPE_BOOL, CT, (int64_t)CL * R);
        a.permute = which == CASE_RM_PERMUTE;
        epx_rm_dispatch_outputs_t o = EPX_RM_DISPATCH_OUTPUTS_INIT;
        /* Each received token selects one or two of our experts: with permute, fewer rows than
         * received tokens never fit, without, N_r - 1 rows do not. */
        const int64_t need = a.permute ? c->ht_rows : c->rm_rows;
        int32_t per_expert[CL];
        if (a.permute) o.tokens_per_expert = epx_tensor_1d(per_expert, EPX_DTYPE_INT32, CL);
        o.tokens = epx_tensor_2d(c->recv, EPX_DTYPE_BF16, me == small ? need - 1 : cap, CH);
        res = epx_rm_dispatch(c->buf, &a, &o);
        EXPECT_TRUE(o.handle == NULL);
    }
    if (expect_agreed_failure(res, me, small)) return 1;
    EXPECT_TRUE(rows_untouched(c));
    EXPECT_OK(epx_handle_destroy(static_handle));
    return 0;
}

static int agree_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    const int which = *(const int *)ctx;
    static calls_t c;
    if (calls_open(&c, rank, nranks, id)) return 1;
    EXPECT_TRUE(c.ht_rows >= 2 && c.rm_rows >= 2);
    if (small_output_call(&c, which)) return 1;
    /* The ranks are in step: every kind of call still works. */
    for (int kind = 0; kind < CALL_KINDS; kind++) EXPECT_OK(calls_make(&c, kind));
    EXPECT_OK(epx_buffer_query_overflow(c.buf));
    return calls_close(&c);
}

/* ------------------------------------------------------------------------- destroy ---- */

/* `late`: the peers enter their dispatch after the destroy, else before it. */
static int destroy_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    const int late = *(const int *)ctx, gone = nranks - 1;
    static calls_t c;
    if (calls_open(&c, rank, nranks, id)) return 1;
    if (rank == gone) {
        if (!late) usleep(200000); /* the peers are waiting for our publication by now */
        calls_release(&c);
        EXPECT_OK(epx_buffer_destroy(c.buf));
        usleep(400000);
        EXPECT_OK(epx_comm_destroy(c.comm));
        return 0;
    }
    if (late) usleep(200000);
    double t0 = epx_test_now_s();
    EXPECT_RES(calls_make(&c, CALL_HT_DISPATCH), EPX_ERR_REMOTE);
    double waited = epx_test_now_s() - t0;
    char what[64];
    snprintf(what, sizeof(what), "peer %d destroyed its buffer", gone);
    EXPECT_MSG_HAS(what);
    EXPECT_TRUE(waited < LIMIT_S);
    calls_release(&c);
    EXPECT_OK(epx_buffer_destroy(c.buf));

    /* The peer's comm goes too: a collective on ours fails as soon as it is gone. */
    const epx_buffer_config_t cfg = calls_config(nranks);
    epx_buffer_t buf;
    t0 = epx_test_now_s();
    epx_result_t res = epx_buffer_create(c.comm, &cfg, &buf);
    waited = epx_test_now_s() - t0;
    if (res == EPX_SUCCESS || waited > LIMIT_S) {
        fprintf(stderr, "rank %d: buffer creation without peer %d returned %s after %.3f s (%s)\n", rank,
                gone, epx_result_name(res), waited, epx_last_error_message());
        return 1;
    }
    EXPECT_MSG_HAS("closed");
    EXPECT_OK(epx_comm_destroy(c.comm));
    return 0;
}

int main(void)
{
    int failed = 0;
    const int ht_ranks[] = {2, 3, 6, 7};
    for (int i = 0; i < 4; i++) {
        int which = CASE_HT;
        if (epx_test_run_ranks(ht_ranks[i], agree_body, &which, 60)) {
            fprintf(stderr, "agree: %s at R=%d: FAILED\n", case_names[which], ht_ranks[i]);
            failed = 1;
        }
    }
    for (int which = CASE_HT_CACHED_STATIC; which <= CASE_RM_PERMUTE; which++)
        for (int R = 2; R <= 3; R++)
            if (epx_test_run_ranks(R, agree_body, &which, 60)) {
                fprintf(stderr, "agree: %s at R=%d: FAILED\n", case_names[which], R);
                failed = 1;
            }
    for (int late = 0; late <= 1; late++)
        for (int R = 2; R <= 3; R++)
            if (epx_test_run_ranks(R, destroy_body, &late, 60)) {
                fprintf(stderr, "agree: destroy %s the peers' dispatch at R=%d: FAILED\n",
                        late ? "before" : "during", R);
                failed = 1;
            }
    printf("agree: %s\n", failed ? "FAILED" : "ok");
    return failed;
}
