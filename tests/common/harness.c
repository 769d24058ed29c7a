/* Fork-based multi-rank launcher and seed selection for the tests. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "epx_test.h"

uint64_t epx_test_seed(void)
{
    const char *env = getenv("EPX_TEST_SEED");
    uint64_t seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);
    printf("seed %llu (EPX_TEST_SEED to replay)\n", (unsigned long long)seed);
    fflush(stdout);
    return seed;
}

int epx_test_run_ranks(int nranks, epx_test_rank_fn fn, void *ctx, int timeout_s)
{
    epx_unique_id_t id;
    if (epx_get_unique_id(&id) != EPX_SUCCESS) {
        fprintf(stderr, "epx_get_unique_id failed: %s\n", epx_last_error_message());
        return 1;
    }
    pid_t pids[256];
    if (nranks > 256) return 1;
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < nranks; r++) {
        pid_t pid = fork();
        if (pid < 0) {
            perror("fork");
            for (int i = 0; i < r; i++) kill(pids[i], SIGKILL);
            return 1;
        }
        if (pid == 0) {
            int rc = fn(r, nranks, &id, ctx);
            fflush(stdout);
            fflush(stderr);
            _exit(rc == 0 ? 0 : 1);
        }
        pids[r] = pid;
    }
    int failed = 0, remaining = nranks;
    int status_of[256];
    for (int r = 0; r < nranks; r++) status_of[r] = -1;
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    while (remaining > 0) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid > 0) {
            for (int r = 0; r < nranks; r++)
                if (pids[r] == pid) {
                    status_of[r] = status;
                    remaining--;
                    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
                        fprintf(stderr, "rank %d failed (%s %d)\n", r,
                                WIFEXITED(status) ? "exit" : "signal",
                                WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
                        failed = 1;
                    }
                }
            continue;
        }
        if (pid < 0 && errno != EINTR) break;
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec - start.tv_sec > timeout_s) {
            fprintf(stderr, "ranks did not finish within %d s; killing them\n", timeout_s);
            for (int r = 0; r < nranks; r++)
                if (status_of[r] < 0) kill(pids[r], SIGKILL);
            while (waitpid(-1, NULL, 0) > 0) {
            }
            return 1;
        }
        usleep(2000);
    }
    return failed;
}
