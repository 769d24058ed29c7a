/*
 * Ranks that make different collective calls under one sequence number (issue 11, defect 10):
 * for every pair of kinds (HT, LL, routing-map dispatch and combine), rank 0 makes one and the
 * others the other, at R = 2 and 3. Every rank must fail at once (far below the 20 s timeout)
 * with EPX_ERR_MISMATCH naming both calls, and the next call, alike on every rank, succeed at once.
 */
#include "test_calls_io.h"

#define LIMIT_S 2.0

typedef struct pair {
    int first, second; /* rank 0's kind, the other ranks' */
} pair_t;

static int body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    const pair_t *pair = ctx;
    static calls_t c;
    if (calls_open(&c, rank, nranks, id)) return 1;

    const int mine = rank == 0 ? pair->first : pair->second;
    const int other = rank == 0 ? pair->second : pair->first;
    const double t0 = epx_test_now_s();
    EXPECT_RES(calls_make(&c, mine), EPX_ERR_MISMATCH);
    const double waited = epx_test_now_s() - t0;
    if (waited > LIMIT_S) {
        fprintf(stderr, "rank %d: %s against %s failed after %.3f s\n", rank, calls_names[mine],
                calls_names[other], waited);
        return 1;
    }
    /* "call N is <ours> here but <theirs> on peer P" */
    char here[64], there[64];
    snprintf(here, sizeof(here), "is %s here", calls_names[mine]);
    snprintf(there, sizeof(there), "but %s on peer", calls_names[other]);
    EXPECT_MSG_HAS(here);
    EXPECT_MSG_HAS(there);
    /* The ranks stay in step: the next call, the same on every rank, succeeds at once (a rank whose
     * side of the mismatch left an area unreleased made it wait out the timeout and fail). */
    const double t1 = epx_test_now_s();
    EXPECT_OK(calls_make(&c, CALL_HT_DISPATCH));
    EXPECT_TRUE(epx_test_now_s() - t1 < LIMIT_S);
    return calls_close(&c);
}

int main(void)
{
    int failed = 0, cases = 0;
    for (int R = 2; R <= 3; R++)
        for (int a = 0; a < CALL_KINDS; a++)
            for (int b = a + 1; b < CALL_KINDS; b++) {
                pair_t pair = {a, b};
                if (epx_test_run_ranks(R, body, &pair, 60)) {
                    fprintf(stderr, "mismatch: R=%d, rank 0 %s, the others %s: FAILED\n", R, calls_names[a],
                            calls_names[b]);
                    failed = 1;
                }
                cases++;
            }
    printf("mismatch: %d cases %s\n", cases, failed ? "FAILED" : "ok");
    return failed;
}
