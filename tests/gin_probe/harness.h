/*
 * The GIN probe's process harness (plain C, no CUDA, no NCCL): forks one process per rank, gives them a
 * shared page (unique id, barriers, per-stage outcomes), bounds every stage with a watchdog, and prints
 * the per-stage summary and verdict in the parent. probe.cu supplies what each rank does.
 */
#ifndef EPX_GIN_PROBE_HARNESS_H
#define EPX_GIN_PROBE_HARNESS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PROBE_MAX_RANKS 16

/* In the order a rank passes them; the summary lists them so. */
typedef enum probe_stage {
    PROBE_STAGE_ENV = 0,
    PROBE_STAGE_CUDA,
    PROBE_STAGE_UNIQUE_ID,
    PROBE_STAGE_COMM_INIT,
    PROBE_STAGE_PLUGIN,
    PROBE_STAGE_MEM_ALLOC,
    PROBE_STAGE_WINDOWS,
    PROBE_STAGE_DEVCOMM,
    PROBE_STAGE_HANDLE,
    PROBE_STAGE_KERNEL,
    PROBE_STAGE_DATA,
    PROBE_STAGE_SOAK,
    PROBE_STAGE_DEVCOMM_DESTROY,
    PROBE_STAGE_WINDOWS_DEREG,
    PROBE_STAGE_MEM_FREE,
    PROBE_STAGE_BARRIER,
    PROBE_STAGE_COMM_FINALIZE,
    PROBE_STAGE_COMM_DESTROY,
    PROBE_STAGE_EXIT, /* recorded by the parent from the exit status */
    PROBE_STAGE_COUNT
} probe_stage_t;

typedef enum probe_outcome {
    PROBE_NOT_REACHED = 0,
    PROBE_RUNNING = 1,
    PROBE_OK = 2,
    PROBE_FAILED = 3,
    PROBE_SKIPPED = 4,
} probe_outcome_t;

enum { PROBE_BARRIER_ROUNDS = 0, PROBE_BARRIER_TEARDOWN = 1, PROBE_BARRIERS = 2 };

typedef struct probe probe_t; /* one rank's view of the run */
typedef int (*probe_rank_fn)(probe_t *p, void *arg);

typedef struct probe_run_opts {
    int nranks;
    int stage_timeout_s; /* the watchdog: no stage of a rank may run longer */
    const char *title;   /* the summary's heading */
    /* The stage whose success proves the path end to end; PASS needs it and the soak's hashes. */
    probe_stage_t proof_stage;
} probe_run_opts_t;

/* Forks nranks processes running fn(p, arg), watches them, prints the summary and the verdict. Returns
 * the program's exit status: 0 when every rank passed every stage it ran and the hashes agree. */
int probe_run(const probe_run_opts_t *opts, probe_rank_fn fn, void *arg);

int probe_rank(const probe_t *p);
int probe_nranks(const probe_t *p);
void probe_say(const probe_t *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Starts a stage: it is "running", the watchdog is armed for the stage timeout. */
void probe_begin(probe_t *p, probe_stage_t stage, const char *what);
/* Re-arms the watchdog inside a long stage (one round of many). */
void probe_progress(probe_t *p, const char *what);
/* End the running stage; the watchdog stays armed for what follows. probe_fail with fatal set also tells
 * every rank to stop (barriers and kernel waits of the others end early). Both return what a stage function
 * returns: 1 ok, 0 failed. */
int probe_ok(probe_t *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int probe_fail(probe_t *p, int fatal, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Ends the running stage as skipped: it stopped because another rank failed. */
void probe_skip(probe_t *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Records a stage's outcome without making it the running one (no watchdog change). */
void probe_record(probe_t *p, probe_stage_t stage, probe_outcome_t outcome, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Another rank failed fatally, or the parent saw a rank die. */
int probe_aborted(const probe_t *p);
/* A rank's process has ended abnormally (the parent saw it). */
int probe_peer_gone(const probe_t *p);

/* Rank 0 publishes the unique id (<= 128 bytes); the others wait for it, bounded. 1 ok, 0 failed (why). */
int probe_publish_id(probe_t *p, const void *id, size_t bytes);
int probe_wait_id(probe_t *p, void *id_out, size_t bytes, int timeout_ms, char *why, size_t why_len);

/* A barrier over the shared page (never over the network under test). honor_abort ends it early when
 * another rank failed. 1 ok, 0 timed out or aborted (why). Each barrier index is used by every rank in
 * the same sequence. */
int probe_barrier(probe_t *p, int which, int timeout_ms, int honor_abort, char *why, size_t why_len);

/* The soak's hashes: what this rank sent and received, for the parent's cross-rank check. */
void probe_set_hashes(probe_t *p, uint64_t sent, uint64_t received, uint64_t iterations);

/* FNV-1a, 64 bits. */
uint64_t probe_fnv(const void *data, size_t n, uint64_t h);
#define PROBE_FNV_SEED 0xcbf29ce484222325ull

uint64_t probe_now_ns(void);

#ifdef __cplusplus
}
#endif

#endif
