/*
 * The rank-forking harness shared by the multi-process tests, the GPU tests and the benchmark
 * tools: fork R rank processes on one fresh unique id, give each a slot of a shared result block,
 * wait for them under a deadline and say which ranks failed, crashed or hung. This header is its manual.
 */
#ifndef EPX_HARNESS_H
#define EPX_HARNESS_H

#include <stddef.h>

#include "epx/epx.h"

#define EPX_HARNESS_MAX_RANKS 256
/* CTest's skip code: what a test returns when the machine lacks what it needs (a GPU). */
#define EPX_HARNESS_SKIP 77

/* A rank's body, run in its own forked process.
 *   rank, nranks  [in] this process's rank and the run's size
 *   id            [in] the run's unique id (one per run, shared by all ranks)
 *   ctx           [in] the caller's context (the rank's copy-on-write copy of the parent's memory)
 *   result        [out] this rank's slot of the result block: result_bytes, zeroed, visible to the
 *                 parent after the run; NULL when result_bytes is 0
 * Returns 0 on success; anything else fails the run (the exit status is the value's low byte, or 1). */
typedef int (*epx_harness_rank_fn)(int rank, int nranks, const epx_unique_id_t *id, void *ctx, void *result);

/* Optional parent-side watcher, called about every millisecond while ranks run, and once more
 * after the last one ended (that call's return value is ignored). results: the whole block (nranks slots,
 * ranks write it concurrently); nfailed: ranks that have already ended badly (a tool raises its abort flag on
 * it). Returns > 0 when it saw progress (the deadline then counts again from now: a stall limit rather than a
 * total), 0 when not, < 0 to stop the run (every rank is killed and the run fails). */
typedef int (*epx_harness_watch_fn)(void *ctx, void *results, int nfailed);

typedef struct epx_harness_opts {
    const char *name;           /* prefix of the harness's messages ("ht ipc"); NULL: "ranks" */
    int nranks;                 /* 1 .. EPX_HARNESS_MAX_RANKS */
    epx_harness_rank_fn fn;     /* the body of every rank */
    void *ctx;                  /* passed to fn and watch */
    size_t result_bytes;        /* size of each rank's result slot; 0: none */
    double timeout_s;           /* the run's deadline; <= 0: 300 s. Never unbounded. */
    epx_harness_watch_fn watch; /* NULL: none */
} epx_harness_opts_t;

typedef enum epx_harness_outcome {
    EPX_HARNESS_RANK_OK = 0,      /* returned 0 */
    EPX_HARNESS_RANK_FAILED,      /* returned non-zero: detail is the exit status */
    EPX_HARNESS_RANK_CRASHED,     /* ended by a signal: detail is the signal */
    EPX_HARNESS_RANK_TIMED_OUT,   /* still running at the deadline (or a watcher stop): killed */
    EPX_HARNESS_RANK_NOT_STARTED, /* fork failed before it */
} epx_harness_outcome_t;

/* What a run left: per-rank outcomes and the result block, which stays mapped until
 * epx_harness_report_free. */
typedef struct epx_harness_report {
    int nranks;
    size_t result_bytes;
    void *results; /* nranks * result_bytes; NULL when result_bytes is 0 */
    epx_harness_outcome_t outcome[EPX_HARNESS_MAX_RANKS];
    int detail[EPX_HARNESS_MAX_RANKS];
} epx_harness_report_t;

/* Forks opts->nranks processes running opts->fn on a fresh unique id and waits for all of them,
 * at most timeout_s (see watch); at the deadline every rank still running gets SIGKILL and is
 * reaped (bounded too). Each rank that did not return 0 is printed to stderr with how it ended.
 * Flushes stdout and stderr before forking. Must be called from a process that has not
 * initialised CUDA (use epx_harness_gpu_count to probe).
 *   report [out] optional; when NULL the result block is freed before returning. Written even
 *          when the run fails, so the caller can tell which ranks ended how; free it with
 *          epx_harness_report_free.
 * Returns 0 when every rank returned 0, 1 when a rank failed, crashed or timed out, -1 when the
 * run could not start (bad options, no unique id, no memory, fork failed). */
int epx_harness_run(const epx_harness_opts_t *opts, epx_harness_report_t *report);

/* Rank `rank`'s result slot of a finished run (NULL without result block or out of range). */
void *epx_harness_result(const epx_harness_report_t *report, int rank);

/* Unmaps the result block; the report may be reused. */
void epx_harness_report_free(epx_harness_report_t *report);

/* Shorthand for a run without result block or watcher: 0 when every rank returned 0, else 1. */
int epx_harness_run_simple(const char *name, int nranks, epx_harness_rank_fn fn, void *ctx, double timeout_s);

/* Number of usable GPUs, asked in a forked child (cudaGetDeviceCount) so that the caller's
 * process never initialises CUDA before it forks ranks. 0 in builds without CUDA, on any error,
 * or when the child does not answer within 60 s. */
int epx_harness_gpu_count(void);

/* The device of `rank` when ngpu GPUs are shared round-robin: rank % ngpu (0 when ngpu < 1). */
int epx_harness_rank_device(int rank, int ngpu);

/* Parses a rank-count list such as "2,4,8" into counts[0 .. max_counts). Entries outside
 * [1, max_ranks] are skipped with a note on stdout. Returns how many counts it kept, or -1 (after
 * a message on stderr) for an entry that is not a number or more entries than max_counts. */
int epx_harness_parse_ranks(const char *list, int max_ranks, int *counts, int max_counts);

/* Runs body(nranks, ctx) for each count of the list in environment variable `env` (or `dflt` when
 * env is NULL or unset), printing "<name>: R ranks" before each and stopping at the first body
 * that returns non-zero. Returns 0 when every body passed ("<name>: all passed" is printed), 1
 * after a failure or for a list that is malformed or keeps no count. */
int epx_harness_each_nranks(const char *name, const char *env, const char *dflt, int max_ranks,
                            int (*body)(int nranks, void *ctx), void *ctx);

#endif
