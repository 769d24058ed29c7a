/*
 * Ranks that make different collective calls under one sequence number (issue 11, defect 10):
 * for every pair of kinds (HT, LL, routing-map dispatch and combine), rank 0 makes one and the
 * others the other, at R = 2 and 3. Every rank must fail at once (far below the 20 s timeout)
 * with EPX_ERR_MISMATCH naming both calls, and the next call, alike on every rank, succeed at once.
 * Then LL combines that name different live dispatches (ERR_MISMATCH at once on every rank, their
 * slots' areas never meet), a stale handle on one rank (it fails by itself, its peers with
 * ERR_REMOTE at once), a hook that outlives a failed call (it still runs, its peers kept what it reads)
 * and a hook dropped by a later call on its slot (it fails naming that call).
 */
#include <unistd.h>

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

/* LL combines of different dispatches, a stale handle on one rank, a hook ended by a failure. */
static int ll_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    (void)ctx;
    static calls_t c;
    if (calls_open(&c, rank, nranks, id)) return 1;
    epx_ll_handle_t A, B, C;
    EXPECT_OK(calls_ll_dispatch(&c, &A)); /* slot 0 */
    EXPECT_OK(calls_ll_dispatch(&c, &B)); /* slot 1 */
    /* Rank 0 combines B, the others A: different slots, so no area is shared. */
    c.ll = rank == 0 ? B : A;
    double t0 = epx_test_now_s();
    EXPECT_RES(calls_ll_combine(&c), EPX_ERR_MISMATCH);
    EXPECT_TRUE(epx_test_now_s() - t0 < LIMIT_S);
    EXPECT_MSG_HAS("combines the LL dispatch of call");
    c.ll = B;
    EXPECT_OK(calls_ll_combine(&c));
    /* C reuses A's slot: A is stale. Rank 1 alone passes A; the others combine B. */
    EXPECT_OK(calls_ll_dispatch(&c, &C));
    c.ll = rank == 1 ? A : B;
    t0 = epx_test_now_s();
    if (rank == 1) {
        EXPECT_RES(calls_ll_combine(&c), EPX_ERR_INVALID_ARG);
        EXPECT_MSG_HAS("stale ll handle");
    } else {
        EXPECT_RES(calls_ll_combine(&c), EPX_ERR_REMOTE);
        EXPECT_MSG_HAS("peer 1 failed call");
    }
    EXPECT_TRUE(epx_test_now_s() - t0 < LIMIT_S);
    /* A dispatch hook pending when a call fails (rank 0 refuses its HT dispatch: T past the buffer) still
     * runs on every rank: the peers kept what it reads. Its combine works. */
    epx_hook_t hook;
    EXPECT_OK(calls_ll_dispatch_hooked(&c, &c.ll, &hook));
    EXPECT_TRUE(calls_ht_refused_by_rank0(&c) != EPX_SUCCESS);
    EXPECT_OK(epx_hook_run(&hook, NULL));
    EXPECT_OK(calls_ll_combine(&c));
    /* A hook dropped because the next LL dispatch on its slot came first: running it names that call. */
    epx_hook_t first;
    EXPECT_OK(calls_ll_dispatch_hooked(&c, NULL, &first)); /* slot s, hook pending */
    EXPECT_OK(calls_ll_dispatch(&c, &c.ll)); /* slot 1 - s */
    EXPECT_OK(calls_ll_dispatch(&c, &c.ll)); /* slot s again: drops the pending hook */
    EXPECT_RES(epx_hook_run(&first, NULL), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("no longer runs");
    EXPECT_MSG_HAS("took its slot");
    EXPECT_OK(calls_ll_combine(&c));
    /* Ranks that disagree on use_fp8 fail the dispatch with ERR_MISMATCH, and the next one works. */
    static float scales[CL * (CH / 128) * CR_MAX * CT];
    epx_ll_dispatch_args_t f = EPX_LL_DISPATCH_ARGS_INIT;
    f.x = epx_tensor_2d(c.x, EPX_DTYPE_BF16, CT, CH);
    f.topk_idx = epx_tensor_2d(c.topk, EPX_DTYPE_INT32, CT, CK);
    f.use_fp8 = rank == 0;
    epx_ll_dispatch_outputs_t fo = EPX_LL_DISPATCH_OUTPUTS_INIT;
    fo.recv_x = epx_tensor_3d(c.ll_recv, rank == 0 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16, CL, (int64_t)nranks * CT, CH);
    if (rank == 0) fo.recv_scales = epx_tensor_3d(scales, EPX_DTYPE_FP32, CL, CH / 128, (int64_t)nranks * CT);
    fo.recv_count = epx_tensor_1d(c.ll_count, EPX_DTYPE_INT32, CL);
    EXPECT_RES(epx_ll_dispatch(c.buf, &f, &fo), EPX_ERR_MISMATCH);
    EXPECT_MSG_HAS("passes use_fp8");
    EXPECT_OK(calls_ll_dispatch(&c, &c.ll));
    EXPECT_OK(calls_ll_combine(&c));
    return calls_close(&c);
}

/* A hook held across a failed call while the peers move on: rank 1 runs its dispatch hook late, after
 * its peers made the next dispatch on the hook's slot. They must wait for it (its hold) instead of
 * overwriting what it reads: its rows must be those of its own dispatch. */
static int hold_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    (void)ctx;
    static calls_t c;
    static uint16_t want[sizeof(c.ll_recv) / sizeof(uint16_t)];
    if (calls_open(&c, rank, nranks, id)) return 1;
    epx_ll_handle_t h;
    EXPECT_OK(calls_ll_dispatch(&c, &h)); /* slot 0: the reference rows of x */
    memcpy(want, c.ll_recv, sizeof(want));
    const int32_t want_count = c.ll_count[0];
    EXPECT_OK(calls_ll_dispatch(&c, &h)); /* slot 1 */
    epx_hook_t hook;
    EXPECT_OK(calls_ll_dispatch_hooked(&c, NULL, &hook)); /* A: slot 0, hook pending */
    memset(c.ll_recv, 0, sizeof(c.ll_recv));
    EXPECT_TRUE(calls_ht_refused_by_rank0(&c) != EPX_SUCCESS);
    static uint16_t mine[sizeof(c.ll_recv) / sizeof(uint16_t)];
    if (rank != 1) {
        EXPECT_OK(epx_hook_run(&hook, NULL));
        memcpy(mine, c.ll_recv, sizeof(mine));
    }
    EXPECT_OK(calls_ll_dispatch(&c, &h)); /* B: slot 1 */
    if (rank == 1) {
        usleep(300 * 1000); /* the peers reach C's slot-0 publication meanwhile */
        memset(c.ll_recv, 0, sizeof(c.ll_recv)); /* the hook writes A's rows here (its dispatch's outputs) */
        EXPECT_OK(epx_hook_run(&hook, NULL));
        memcpy(mine, c.ll_recv, sizeof(mine));
    }
    for (int i = 0; i < CT * CH; i++) c.x[i] ^= 0x0101; /* C moves other rows through slot 0 */
    EXPECT_OK(calls_ll_dispatch(&c, &h));
    EXPECT_TRUE(want_count == c.ll_count[0]);
    for (int j = 0; j < CL; j++)
        for (int64_t r = 0; r < (int64_t)nranks * CT; r++) {
            const size_t at = ((size_t)j * (size_t)(nranks * CT) + (size_t)r) * CH;
            if (r < 2 && memcmp(mine + at, want + at, CH * 2) != 0) {
                fprintf(stderr, "rank %d: hook rows of expert %d row %lld are not its dispatch's\n", rank, j,
                        (long long)r);
                return 1;
            }
        }
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
    for (int R = 2; R <= 3; R++, cases++)
        if (epx_test_run_ranks(R, ll_body, NULL, 60)) {
            fprintf(stderr, "mismatch: R=%d, LL combines of different dispatches: FAILED\n", R);
            failed = 1;
        }
    for (int R = 2; R <= 3; R++, cases++)
        if (epx_test_run_ranks(R, hold_body, NULL, 60)) {
            fprintf(stderr, "mismatch: R=%d, a hook held across a failed call: FAILED\n", R);
            failed = 1;
        }
    printf("mismatch: %d cases %s\n", cases, failed ? "FAILED" : "ok");
    return failed;
}
