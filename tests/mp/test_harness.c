/*
 * The rank-forking harness itself (tests/harness): result slots reach the parent; a rank that
 * fails, dies by a signal or outlives the deadline is reported as such; a watcher's progress
 * restarts the deadline and its stop ends the run; rank-count lists parse and stop at a failure.
 */
#include <signal.h>
#include <stdatomic.h>
#include <unistd.h>

#include "epx_test.h"

typedef struct slot {
    _Atomic int value;
} slot_t;

/* Rank 0 passes, 1 fails with 3, 2 dies by SIGKILL, 3 outlives the deadline; each first fills its slot. */
static int mixed_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx, void *result)
{
    atomic_store(&((slot_t *)result)->value, rank * 10 + nranks);
    if (rank == 1) return 3;
    if (rank == 2) raise(SIGKILL);
    if (rank == 3) sleep(60);
    return 0;
}

static int test_outcomes(void)
{
    epx_harness_opts_t opts = {"outcomes", 4, mixed_body, NULL, sizeof(slot_t), 1.0, NULL};
    epx_harness_report_t rep;
    const double t0 = epx_test_now_s();
    EXPECT_EQ_INT(epx_harness_run(&opts, &rep), 1);
    EXPECT_TRUE(epx_test_now_s() - t0 < 30.0);
    static const epx_harness_outcome_t expected[4] = {EPX_HARNESS_RANK_OK, EPX_HARNESS_RANK_FAILED,
                                                      EPX_HARNESS_RANK_CRASHED, EPX_HARNESS_RANK_TIMED_OUT};
    for (int r = 0; r < 4; r++) {
        EXPECT_EQ_INT(rep.outcome[r], expected[r]);
        EXPECT_EQ_INT(atomic_load(&((slot_t *)epx_harness_result(&rep, r))->value), r * 10 + 4);
    }
    EXPECT_EQ_INT(rep.detail[1], 3);
    EXPECT_EQ_INT(rep.detail[2], SIGKILL);
    EXPECT_TRUE(epx_harness_result(&rep, 4) == NULL);
    epx_harness_report_free(&rep);
    EXPECT_TRUE(rep.results == NULL);
    return 0;
}

/* Counts up for about 1.5 s, longer than the 0.5 s deadline, which progress keeps restarting. */
static int counting_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx, void *result)
{
    for (int i = 1; i <= 30; i++) {
        usleep(50000);
        atomic_store(&((slot_t *)result)->value, i);
    }
    return 0;
}

typedef struct watcher {
    int last, calls, stop_at; /* stop_at > 0: stop the run once the count reaches it */
} watcher_t;

static int watch(void *ctx, void *results, int nfailed)
{
    watcher_t *w = ctx;
    const int now = atomic_load(&((slot_t *)results)->value);
    w->calls++;
    if (w->stop_at > 0 && now >= w->stop_at) return -1;
    const int progressed = now != w->last;
    w->last = now;
    return progressed;
}

static int test_watcher(void)
{
    watcher_t w = {0, 0, 0};
    epx_harness_opts_t opts = {"watched", 1, counting_body, &w, sizeof(slot_t), 0.5, watch};
    EXPECT_EQ_INT(epx_harness_run(&opts, NULL), 0);
    EXPECT_TRUE(w.calls > 10 && w.last >= 20);
    /* Without the watcher the same body outlives the deadline. */
    opts.watch = NULL;
    epx_harness_report_t rep;
    EXPECT_EQ_INT(epx_harness_run(&opts, &rep), 1);
    EXPECT_EQ_INT(rep.outcome[0], EPX_HARNESS_RANK_TIMED_OUT);
    epx_harness_report_free(&rep);
    /* A watcher's stop kills the ranks. */
    watcher_t stopper = {0, 0, 3};
    opts.ctx = &stopper;
    opts.watch = watch;
    opts.timeout_s = 30.0;
    EXPECT_EQ_INT(epx_harness_run(&opts, &rep), 1);
    EXPECT_EQ_INT(rep.outcome[0], EPX_HARNESS_RANK_TIMED_OUT);
    EXPECT_TRUE(stopper.last < 30);
    epx_harness_report_free(&rep);
    return 0;
}

static int seen[8], nseen;

static int record_body(int nranks, void *ctx)
{
    seen[nseen++] = nranks;
    return nranks == *(const int *)ctx;
}

static int test_rank_lists(void)
{
    int counts[8];
    EXPECT_EQ_INT(epx_harness_parse_ranks("2, 4,,100,8", 16, counts, 8), 3);
    EXPECT_TRUE(counts[0] == 2 && counts[1] == 4 && counts[2] == 8);
    EXPECT_EQ_INT(epx_harness_parse_ranks("2,x", 16, counts, 8), -1);
    EXPECT_EQ_INT(epx_harness_parse_ranks("1,2,3", 16, counts, 2), -1);
    int fail_at = 0;
    unsetenv("EPX_HARNESS_TEST_RANKS");
    EXPECT_EQ_INT(epx_harness_each_nranks("list", "EPX_HARNESS_TEST_RANKS", "1,3", 16, record_body, &fail_at),
                  0);
    EXPECT_TRUE(nseen == 2 && seen[0] == 1 && seen[1] == 3);
    nseen = 0;
    fail_at = 5;
    setenv("EPX_HARNESS_TEST_RANKS", "2,5,7", 1);
    EXPECT_EQ_INT(epx_harness_each_nranks("list", "EPX_HARNESS_TEST_RANKS", "1", 16, record_body, &fail_at),
                  1);
    EXPECT_TRUE(nseen == 2 && seen[1] == 5);
    setenv("EPX_HARNESS_TEST_RANKS", "99", 1);
    EXPECT_EQ_INT(epx_harness_each_nranks("list", "EPX_HARNESS_TEST_RANKS", "1", 16, record_body, &fail_at),
                  1);
    EXPECT_EQ_INT(epx_harness_rank_device(5, 2), 1);
    EXPECT_EQ_INT(epx_harness_rank_device(3, 0), 0);
    return 0;
}

int main(void)
{
    /* The probe never fails: no GPU here, or some. */
    EXPECT_TRUE(epx_harness_gpu_count() >= 0);
    int (*const cases[])(void) = {test_outcomes, test_watcher, test_rank_lists};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        if (cases[i]()) return 1;
    printf("harness: ok\n");
    return 0;
}
