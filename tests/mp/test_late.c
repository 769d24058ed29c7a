/*
 * A rank that comes late, past its peers' deadline (alive, no signal): the peers fail the call with
 * EPX_ERR_TIMEOUT; the late rank, which finds everything they published before they gave up, must
 * not complete the call: it returns EPX_ERR_REMOTE saying a peer failed this very call. One late call
 * per kind (HT, LL, routing-map dispatch and combine), at R = 2 and 3, with a 600 ms timeout. The
 * timeout is also kept as the comm's async error.
 */
#include <unistd.h>

#include "test_calls_io.h"

#define TIMEOUT_MS 600
#define LATE_MS    1500

static int body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    const int kind = *(const int *)ctx;
    static calls_t c;
    calls_init(&c, rank, nranks);
    EXPECT_OK(epx_test_host_comm(id, rank, nranks, TIMEOUT_MS, &c.comm));
    const epx_buffer_config_t cfg = calls_config(nranks);
    EXPECT_OK(epx_buffer_create(c.comm, &cfg, &c.buf));
    EXPECT_OK(calls_prepare(&c));
    const int late = rank == nranks - 1;
    if (late) usleep(LATE_MS * 1000);
    const epx_result_t res = calls_make(&c, kind);
    if (late) {
        EXPECT_RES(res, EPX_ERR_REMOTE);
        EXPECT_MSG_HAS("failed call"); /* in the verdict step, or at the end of a call without one */
    } else {
        EXPECT_RES(res, EPX_ERR_TIMEOUT);
        EXPECT_RES(epx_get_async_error(c.comm), EPX_ERR_TIMEOUT);
    }
    calls_release(&c);
    EXPECT_OK(epx_buffer_destroy(c.buf));
    EXPECT_OK(epx_comm_destroy(c.comm));
    return 0;
}

int main(void)
{
    int failed = 0, cases = 0;
    for (int R = 2; R <= 3; R++)
        for (int kind = 0; kind < CALL_KINDS; kind++) {
            if (epx_test_run_ranks(R, body, &kind, 60)) {
                fprintf(stderr, "late: R=%d, late %s: FAILED\n", R, calls_names[kind]);
                failed = 1;
            }
            cases++;
        }
    printf("late: %d cases %s\n", cases, failed ? "FAILED" : "ok");
    return failed;
}
