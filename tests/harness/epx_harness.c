/*
 * The rank-forking harness (see epx_harness.h): fork, shared result block, deadline with kill and
 * bounded reaping, the GPU probe in a child and rank-count lists.
 */
#include "epx_harness.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifdef EPX_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#define DEFAULT_TIMEOUT_S 300.0
/* After SIGKILL a rank still has to leave the kernel (a GPU context can take seconds). */
#define REAP_LIMIT_S 30.0

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Waits for one child until `deadline` (now_s() time): 1 reaped (status set), 0 still running,
 * -1 not waitable (already reaped elsewhere, or SIGCHLD ignored). */
static int wait_until(pid_t pid, int *status, double deadline)
{
    for (;;) {
        pid_t got = waitpid(pid, status, WNOHANG);
        if (got == pid) return 1;
        if (got < 0 && errno != EINTR) return -1;
        if (now_s() >= deadline) return 0;
        usleep(1000);
    }
}

static void record(epx_harness_report_t *rep, int rank, int status)
{
    if (WIFEXITED(status)) {
        rep->outcome[rank] = WEXITSTATUS(status) == 0 ? EPX_HARNESS_RANK_OK : EPX_HARNESS_RANK_FAILED;
        rep->detail[rank] = WEXITSTATUS(status);
    } else {
        rep->outcome[rank] = EPX_HARNESS_RANK_CRASHED;
        rep->detail[rank] = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    }
}

static void print_outcomes(const char *name, const epx_harness_report_t *rep)
{
    for (int r = 0; r < rep->nranks; r++) {
        const int d = rep->detail[r];
        switch (rep->outcome[r]) {
        case EPX_HARNESS_RANK_OK: break;
        case EPX_HARNESS_RANK_FAILED: fprintf(stderr, "%s: rank %d failed (exit %d)\n", name, r, d); break;
        case EPX_HARNESS_RANK_CRASHED:
            fprintf(stderr, "%s: rank %d crashed (signal %d, %s)\n", name, r, d, strsignal(d));
            break;
        case EPX_HARNESS_RANK_TIMED_OUT:
            fprintf(stderr, "%s: rank %d was still running when the run stopped: killed\n", name, r);
            break;
        case EPX_HARNESS_RANK_NOT_STARTED: fprintf(stderr, "%s: rank %d was not started\n", name, r); break;
        }
    }
    fflush(stderr);
}

void *epx_harness_result(const epx_harness_report_t *report, int rank)
{
    if (!report || !report->results || rank < 0 || rank >= report->nranks) return NULL;
    return (char *)report->results + (size_t)rank * report->result_bytes;
}

void epx_harness_report_free(epx_harness_report_t *report)
{
    if (report && report->results) munmap(report->results, (size_t)report->nranks * report->result_bytes);
    if (report) report->results = NULL;
}

/* Kills the ranks still running and reaps them, each within REAP_LIMIT_S. */
static void kill_and_reap(const char *name, epx_harness_report_t *rep, const pid_t *pids, int started,
                          const char *running)
{
    for (int r = 0; r < started; r++)
        if (running[r]) kill(pids[r], SIGKILL);
    const double deadline = now_s() + REAP_LIMIT_S;
    for (int r = 0; r < started; r++) {
        if (!running[r]) continue;
        int status;
        rep->outcome[r] = EPX_HARNESS_RANK_TIMED_OUT;
        rep->detail[r] = SIGKILL;
        if (wait_until(pids[r], &status, deadline) == 0)
            fprintf(stderr, "%s: rank %d (pid %d) did not leave after SIGKILL\n", name, r, (int)pids[r]);
    }
}

int epx_harness_run(const epx_harness_opts_t *opts, epx_harness_report_t *report)
{
    epx_harness_report_t local;
    epx_harness_report_t *rep = report ? report : &local;
    memset(rep, 0, sizeof(*rep));
    const char *name = opts && opts->name ? opts->name : "ranks";
    if (!opts || !opts->fn || opts->nranks < 1 || opts->nranks > EPX_HARNESS_MAX_RANKS) {
        fprintf(stderr, "%s: bad harness options (nranks %d, at most %d)\n", name, opts ? opts->nranks : 0,
                EPX_HARNESS_MAX_RANKS);
        return -1;
    }
    const int n = opts->nranks;
    const double timeout = opts->timeout_s > 0 ? opts->timeout_s : DEFAULT_TIMEOUT_S;
    rep->nranks = n;
    rep->result_bytes = opts->result_bytes;
    if (opts->result_bytes) {
        /* Anonymous shared pages start zeroed and stay shared across fork. */
        void *m = mmap(NULL, (size_t)n * opts->result_bytes, PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) {
            fprintf(stderr, "%s: mmap of %zu result bytes: %s\n", name, (size_t)n * opts->result_bytes,
                    strerror(errno));
            return -1;
        }
        rep->results = m;
    }
    epx_unique_id_t id;
    if (epx_get_unique_id(&id) != EPX_SUCCESS) {
        fprintf(stderr, "%s: epx_get_unique_id: %s\n", name, epx_last_error_message());
        goto err_unmap;
    }

    pid_t pids[EPX_HARNESS_MAX_RANKS];
    char running[EPX_HARNESS_MAX_RANKS] = {0};
    int started = 0;
    fflush(stdout);
    fflush(stderr);
    for (; started < n; started++) {
        pid_t pid = fork();
        if (pid < 0) {
            fprintf(stderr, "%s: fork of rank %d: %s\n", name, started, strerror(errno));
            break;
        }
        if (pid == 0) {
            int rc = opts->fn(started, n, &id, opts->ctx, epx_harness_result(rep, started));
            fflush(stdout);
            fflush(stderr);
            _exit(rc == 0 ? 0 : (rc & 0xff) ? (rc & 0xff) : 1);
        }
        pids[started] = pid;
        running[started] = 1;
    }
    for (int r = started; r < n; r++) rep->outcome[r] = EPX_HARNESS_RANK_NOT_STARTED;

    int left = started, nfailed = 0, stop = started < n;
    double deadline = now_s() + timeout;
    while (left > 0 && !stop) {
        for (int r = 0; r < started; r++) {
            int status;
            if (!running[r]) continue;
            const int w = wait_until(pids[r], &status, 0.0);
            if (w == 0) continue;
            if (w > 0) {
                record(rep, r, status);
            } else { /* someone else reaped it: its end is unknown */
                rep->outcome[r] = EPX_HARNESS_RANK_FAILED;
                rep->detail[r] = -1;
            }
            running[r] = 0;
            left--;
            nfailed += rep->outcome[r] != EPX_HARNESS_RANK_OK;
        }
        if (opts->watch && left > 0) {
            const int w = opts->watch(opts->ctx, rep->results, nfailed);
            if (w > 0) deadline = now_s() + timeout;
            if (w < 0) {
                fprintf(stderr, "%s: stopped by its watcher; killing the ranks\n", name);
                stop = 1;
            }
        }
        if (left > 0 && !stop && now_s() > deadline) {
            fprintf(stderr, "%s: %g s deadline passed; killing the ranks\n", name, timeout);
            stop = 1;
        }
        if (left > 0 && !stop) usleep(1000);
    }
    if (left > 0)
        kill_and_reap(name, rep, pids, started, running);
    else if (opts->watch && !stop) /* the last results, after every rank has written them */
        opts->watch(opts->ctx, rep->results, nfailed);
    print_outcomes(name, rep);
    if (started < n) goto err_unmap;
    int rc = 0;
    for (int r = 0; r < n; r++) rc |= rep->outcome[r] != EPX_HARNESS_RANK_OK;
    if (!report) epx_harness_report_free(rep);
    return rc;

err_unmap:
    if (!report) epx_harness_report_free(rep);
    return -1;
}

int epx_harness_run_simple(const char *name, int nranks, epx_harness_rank_fn fn, void *ctx, double timeout_s)
{
    epx_harness_opts_t opts = {name, nranks, fn, ctx, 0, timeout_s, NULL};
    return epx_harness_run(&opts, NULL) == 0 ? 0 : 1;
}

int epx_harness_gpu_count(void)
{
#ifdef EPX_HAVE_CUDA
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) return 0;
    if (pid == 0) {
        int count = 0;
        if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
        _exit(count < 0 ? 0 : count > 100 ? 100 : count);
    }
    int status = 0;
    const int w = wait_until(pid, &status, now_s() + 60.0);
    if (w == 0) {
        kill(pid, SIGKILL);
        wait_until(pid, &status, now_s() + REAP_LIMIT_S);
        return 0;
    }
    return w > 0 && WIFEXITED(status) ? WEXITSTATUS(status) : 0;
#else
    return 0;
#endif
}

int epx_harness_rank_device(int rank, int ngpu)
{
    return ngpu > 0 ? rank % ngpu : 0;
}

int epx_harness_parse_ranks(const char *list, int max_ranks, int *counts, int max_counts)
{
    int kept = 0;
    for (const char *p = list ? list : ""; *p;) {
        while (*p == ' ' || *p == ',') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        const long v = strtol(p, &end, 10);
        while (*end == ' ') end++;
        if (end == p || errno || (*end && *end != ',')) {
            fprintf(stderr, "rank list '%s': '%.*s' is not a number\n", list, (int)strcspn(p, ","), p);
            return -1;
        }
        p = end;
        if (v < 1 || v > max_ranks) {
            printf("rank list '%s': skipping %ld (1 to %d ranks)\n", list, v, max_ranks);
            continue;
        }
        if (kept == max_counts) {
            fprintf(stderr, "rank list '%s': more than %d entries\n", list, max_counts);
            return -1;
        }
        counts[kept++] = (int)v;
    }
    return kept;
}

int epx_harness_each_nranks(const char *name, const char *env, const char *dflt, int max_ranks,
                            int (*body)(int nranks, void *ctx), void *ctx)
{
    const char *list = env ? getenv(env) : NULL;
    if (!list) list = dflt;
    int counts[64];
    const int n = epx_harness_parse_ranks(list, max_ranks, counts, 64);
    if (n <= 0) {
        fprintf(stderr, "%s: no rank count to run in '%s'%s%s\n", name, list ? list : "", env ? " from " : "",
                env ? env : "");
        return 1;
    }
    for (int i = 0; i < n; i++) {
        printf("%s: %d ranks\n", name, counts[i]);
        fflush(stdout);
        if (body(counts[i], ctx) != 0) {
            fprintf(stderr, "%s: %d ranks failed\n", name, counts[i]);
            return 1;
        }
    }
    printf("%s: all passed\n", name);
    return 0;
}
