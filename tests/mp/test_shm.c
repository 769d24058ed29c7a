/*
 * The host backend's shared memory leaves nothing behind and cannot be squatted: a rank killed
 * at each step of epx_buffer_create (EPX_TEST_FAULT_SHM) makes its peers fail without leaking a
 * descriptor, and no file appears in EPX_SHM_DIR, before or after; files planted there with the
 * names older versions used do not stop creation. A rank whose own preparation fails (EPX_TEST_FAULT_SHM
 * "<rank>:0:fail") still takes part in the agreement: every rank fails at once, the comm stays in step,
 * and the next creation succeeds.
 */
#include <dirent.h>
#include <signal.h>
#include <sys/inotify.h>
#include <unistd.h>

#include "epx_test.h"

#define NRANKS 3

static int count_fds(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    while (readdir(d)) n++;
    closedir(d);
    return n;
}

/* Creates a buffer; with a fault set it must fail on every surviving rank, descriptors intact. */
static int create_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx, void *result)
{
    const int faulty = *(const int *)ctx;
    epx_comm_t comm;
    epx_buffer_t buf = NULL;
    EXPECT_OK(epx_test_host_comm(id, rank, nranks, 20000, &comm));
    const epx_buffer_config_t cfg = epx_test_buffer_config(8, 256, 2, 6, 0);
    const int fds_before = count_fds();
    const double t0 = epx_test_now_s();
    epx_result_t res = epx_buffer_create(comm, &cfg, &buf);
    if (!faulty) {
        EXPECT_RES(res, EPX_SUCCESS);
        EXPECT_OK(epx_buffer_destroy(buf));
    } else {
        EXPECT_TRUE(res != EPX_SUCCESS);
        EXPECT_TRUE(epx_test_now_s() - t0 < 5.0);
        EXPECT_EQ_INT(count_fds(), fds_before);
        return 0; /* the comm's bootstrap lost a rank: leave without a collective destroy */
    }
    EXPECT_EQ_INT(count_fds(), fds_before);
    EXPECT_OK(epx_comm_destroy(comm));
    return 0;
}

/* Rank `*ctx` fails the descriptor exchange's preparation: every rank's creation fails well inside the
 * comm's 20 s timeout (the failing rank with its own error, the others naming it), no descriptor leaks,
 * and the comm's collectives are still in step: a second creation without the fault succeeds. */
static int fail_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx, void *result)
{
    const int failing = *(const int *)ctx;
    (void)result;
    epx_comm_t comm;
    epx_buffer_t buf = NULL;
    EXPECT_OK(epx_test_host_comm(id, rank, nranks, 20000, &comm));
    const epx_buffer_config_t cfg = epx_test_buffer_config(8, 256, 2, 6, 0);
    const int fds_before = count_fds();
    char spec[32];
    snprintf(spec, sizeof(spec), "%d:0:fail", failing);
    setenv("EPX_TEST_FAULT_SHM", spec, 1);
    const double t0 = epx_test_now_s();
    epx_result_t res = epx_buffer_create(comm, &cfg, &buf);
    const double took = epx_test_now_s() - t0;
    unsetenv("EPX_TEST_FAULT_SHM");
    if (rank == failing) {
        EXPECT_RES(res, EPX_ERR_SYSTEM);
        EXPECT_MSG_HAS("failed by EPX_TEST_FAULT_SHM");
    } else {
        char needle[64];
        snprintf(needle, sizeof(needle), "peer %d failed to prepare the descriptor exchange", failing);
        EXPECT_RES(res, EPX_ERR_REMOTE);
        EXPECT_MSG_HAS(needle);
    }
    EXPECT_TRUE(buf == NULL);
    EXPECT_TRUE(took < 5.0);
    EXPECT_EQ_INT(count_fds(), fds_before);
    EXPECT_OK(epx_buffer_create(comm, &cfg, &buf));
    EXPECT_OK(epx_buffer_destroy(buf));
    EXPECT_EQ_INT(count_fds(), fds_before);
    EXPECT_OK(epx_comm_destroy(comm));
    return 0;
}

static int run_fail_case(int failing)
{
    unsetenv("EPX_TEST_FAULT_SHM");
    epx_harness_opts_t opts = {"shm-fail", NRANKS, fail_body, (void *)&failing, 0, 60.0, NULL};
    epx_harness_report_t rep;
    const int rc = epx_harness_run(&opts, &rep);
    int ok = rc == 0;
    for (int r = 0; r < NRANKS && rc >= 0; r++) ok &= rep.outcome[r] == EPX_HARNESS_RANK_OK;
    if (rc >= 0) epx_harness_report_free(&rep);
    if (!ok) fprintf(stderr, "shm: rank %d failing its preparation did not end as expected\n", failing);
    EXPECT_TRUE(ok);
    return 0;
}

/* Files in dir other than those whose name starts with "planted". */
static int foreign_files(const char *dir)
{
    int n = 0;
    DIR *d = opendir(dir);
    if (!d) return -1;
    for (struct dirent *e; (e = readdir(d));)
        n += e->d_name[0] != '.' && strncmp(e->d_name, "planted", 7) != 0;
    closedir(d);
    return n;
}

static int run_case(const char *dir, int kill_rank, int step)
{
    char spec[32] = "none";
    if (kill_rank >= 0) snprintf(spec, sizeof(spec), "%d:%d", kill_rank, step);
    if (kill_rank >= 0)
        setenv("EPX_TEST_FAULT_SHM", spec, 1);
    else
        unsetenv("EPX_TEST_FAULT_SHM");
    int watch = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    EXPECT_TRUE(watch >= 0 && inotify_add_watch(watch, dir, IN_CREATE) >= 0);
    const int faulty = kill_rank >= 0;
    epx_harness_opts_t opts = {"shm", NRANKS, create_body, (void *)&faulty, 0, 60.0, NULL};
    epx_harness_report_t rep;
    const int rc = epx_harness_run(&opts, &rep);
    int as_expected = rc >= 0;
    for (int r = 0; r < NRANKS && rc >= 0; r++)
        as_expected &= r == kill_rank ? rep.outcome[r] == EPX_HARNESS_RANK_CRASHED && rep.detail[r] == SIGKILL
                                      : rep.outcome[r] == EPX_HARNESS_RANK_OK;
    if (rc >= 0) epx_harness_report_free(&rep);
    if (!as_expected) fprintf(stderr, "shm: case %s did not end as expected\n", spec);
    char events[4096];
    const ssize_t created = read(watch, events, sizeof(events));
    close(watch);
    if (created > 0) fprintf(stderr, "shm: case %s created files in %s\n", spec, dir);
    EXPECT_TRUE(as_expected);
    EXPECT_TRUE(created <= 0);
    EXPECT_EQ_INT(foreign_files(dir), 0);
    return 0;
}

int main(void)
{
    char dir[] = "/tmp/epx-shm-test-XXXXXX";
    EXPECT_TRUE(mkdtemp(dir) != NULL);
    setenv("EPX_SHM_DIR", dir, 1);
    /* Names older versions would have used, planted first: they must not matter. */
    for (int r = 0; r < NRANKS; r++) {
        char path[256];
        snprintf(path, sizeof(path), "%s/planted-epx-0000000000000000-%d", dir, r);
        FILE *f = fopen(path, "w");
        EXPECT_TRUE(f != NULL);
        fclose(f);
    }
    int rc = run_case(dir, -1, 0);
    for (int step = 1; step <= 3 && !rc; step++)
        for (int kill_rank = 0; kill_rank < NRANKS && !rc; kill_rank += NRANKS - 1)
            rc = run_case(dir, kill_rank, step);
    for (int failing = 0; failing < NRANKS && !rc; failing += NRANKS - 1) rc = run_fail_case(failing);
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    if (system(cmd) != 0) fprintf(stderr, "shm: cannot remove %s\n", dir);
    if (rc) return 1;
    printf("shm: ok\n");
    return 0;
}
