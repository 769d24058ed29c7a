/*
 * The fault-injection suite: a driver (fault_main.c) forks R ranks per trial, kills one of them at a
 * random point of init, buffer creation or an operation loop (fault_modes.c) and classifies how the
 * survivors end; fault_boot.c attacks the bootstrap of a real job. The ranks and the driver share one
 * record per rank, written by the rank and read by the driver after the rank ended.
 */
#ifndef EPX_FAULT_H
#define EPX_FAULT_H

#include <stdint.h>

#include "epx/epx.h"

#define FAULT_MAX_RANKS 8
#define FAULT_T_MAX     16 /* tokens per rank and call, at most (>= FAULT_MAX_RANKS: routing covers all) */
#define FAULT_HIDDEN    128
#define FAULT_TOPK      3
#define FAULT_LOCAL     2 /* experts per rank */
#define FAULT_PAD       4 /* the permute pad multiple of the odd permute calls */

/* Operation loops a trial may run until a call fails. */
typedef enum fault_mode {
    FAULT_MODE_HT = 0,     /* HT dispatch, combine, cached dispatch, combine */
    FAULT_MODE_HT_STATIC,  /* static-shape HT dispatch (num_worst_tokens), combine */
    FAULT_MODE_LL,         /* LL dispatch, combine */
    FAULT_MODE_LL_HOOK,    /* LL dispatch and combine with return_recv_hook, each hook run */
    FAULT_MODE_RM,         /* routing-map dispatch without permute, combine */
    FAULT_MODE_RM_PERMUTE, /* routing-map dispatch with permute (pad 1 and 4), combine with unpermute */
    FAULT_MODE_BOOT,       /* init, barrier, destroy: the job of a bootstrap attack */
    FAULT_MODE_COUNT
} fault_mode_t;

/* Where the victim dies. */
typedef enum fault_kill {
    FAULT_KILL_NONE = 0,  /* nobody: the bootstrap attacks' jobs */
    FAULT_KILL_INIT,      /* SIGKILL from the driver a random time after it entered epx_comm_init */
    FAULT_KILL_CREATE,    /* ... after it entered epx_buffer_create */
    FAULT_KILL_SHM_POINT, /* inside epx_buffer_create at an EPX_TEST_FAULT_SHM step (host backend) */
    FAULT_KILL_LOOP,      /* SIGKILL a random time after every rank started its loop */
    FAULT_KILL_COUNT
} fault_kill_t;

typedef enum fault_phase {
    FAULT_PHASE_START = 0,
    FAULT_PHASE_INIT,
    FAULT_PHASE_CREATE,
    FAULT_PHASE_LOOP,
    FAULT_PHASE_CLEANUP,
    FAULT_PHASE_DONE,
} fault_phase_t;

/* What every rank of a trial knows before it starts (the driver's copy, inherited by fork). */
typedef struct fault_plan {
    int R;
    fault_mode_t mode;
    fault_kill_t kill;
    int victim;
    int shm_step;  /* FAULT_KILL_SHM_POINT: 1..3 */
    int delay_us;  /* FAULT_KILL_INIT/CREATE/LOOP: after the phase began */
    uint64_t seed; /* inputs and routing */
    epx_backend_t backend;
    int ngpu;                               /* cuda: GPUs shared round-robin */
    int timeout_ms;                         /* the communicators' EPX_TIMEOUT_MS */
    int per_node;                           /* ranks per emulated node (node id "fault-node<rank / per_node>");
                                               0: one node, the default identity */
    int boot_procs;                         /* FAULT_MODE_BOOT: processes (R, or R + 1 with a duplicate) */
    int boot_rank[FAULT_MAX_RANKS + 1];     /* FAULT_MODE_BOOT: the rank each process claims */
    int boot_delay_ms[FAULT_MAX_RANKS + 1]; /* FAULT_MODE_BOOT: before the init */
} fault_plan_t;

/* One rank's account of its run; calls are numbered in order (init 0, create 1, then the loop's). */
typedef struct fault_rec {
    volatile int32_t phase;   /* fault_phase_t */
    volatile int32_t entered; /* the call it is in or last entered */
    int32_t last_recv_needs;  /* of the last successful call that received data: the number of the call in
                                 which the peers sent it (-1: none) */
    int32_t ok_calls;
    int32_t err_call;              /* -1: no call failed */
    int32_t err_res;               /* epx_result_t of the failed call */
    int32_t bad_data;              /* successful calls whose outputs were wrong */
    int32_t fds_before, fds_after; /* open descriptors at start and after teardown (-1: not reached) */
    double t_entered;              /* CLOCK_MONOTONIC seconds when the last call began */
    double t_err;                  /* ... when the failed call returned */
    double t_init;                 /* FAULT_MODE_BOOT: seconds the init took */
    char err_what[48];             /* the failed call */
    char err_msg[200];             /* its message, or the first wrong output */
} fault_rec_t;

/* The body of rank `rank` (fault_modes.c): init, create, loop until a call fails, teardown. Returns
 * the process's exit status: 0 when it ended as a rank of a fault trial should (every call either
 * succeeded with right outputs or failed once, after which it tore down). */
int fault_rank_main(const fault_plan_t *plan, int rank, const epx_unique_id_t *id, fault_rec_t *rec);

/* Open descriptors of the calling process (-1 when /proc is unreadable). live_only: leaves out
 * sockets that neither listen nor have a peer (a rendezvous socket rank 0 shut down, which the library
 * closes at its next epx_get_unique_id by design). */
int fault_count_fds(int live_only);
/* CLOCK_MONOTONIC in seconds. */
double fault_now(void);

/* The bootstrap attacks (fault_boot.c). */
typedef enum fault_attack {
    FAULT_ATTACK_IDLE = 0,       /* a few connections that never say anything */
    FAULT_ATTACK_PARTIAL,        /* half a hello */
    FAULT_ATTACK_OVERSIZED,      /* a hello with 1000 bytes more */
    FAULT_ATTACK_SECRET,         /* a hello with a wrong secret */
    FAULT_ATTACK_DUPLICATE,      /* a second process claims rank 1 before the real one: the job fails fast */
    FAULT_ATTACK_LATE_DUPLICATE, /* ... after the job formed: the job succeeds, the latecomer fails */
    FAULT_ATTACK_MANY,           /* more idle connections than rank 0 holds at once */
    FAULT_ATTACK_COUNT
} fault_attack_t;
const char *fault_attack_name(fault_attack_t attack);

/* How a run of ranks ended (fault_main.c's runner). */
typedef struct fault_run {
    int hung[FAULT_MAX_RANKS];   /* still running at the watchdog: killed */
    int status[FAULT_MAX_RANKS]; /* waitpid status */
    double t_death;              /* when the victim was killed or seen dead; 0: never */
    int victim_killed;           /* the victim ended by SIGKILL */
    int point_missed;            /* FAULT_KILL_SHM_POINT: the victim got past creation alive */
} fault_run_t;

/* Forks plan->R ranks (plan->boot_procs processes for FAULT_MODE_BOOT) on a fresh unique id (or *id when
 * non-NULL), kills the victim as planned and waits for every rank under a watchdog. recs: plan->R shared
 * records. Returns 0, or -1 when the run could not start. */
int fault_run_ranks(const fault_plan_t *plan, const epx_unique_id_t *id, fault_rec_t *recs, fault_run_t *run);

/* One bootstrap attack trial of a job of R ranks: 0 when the job ended as expected and every attacker was
 * refused within its bound; describes what went wrong in why[why_len] otherwise. *hung: the job had to be
 * killed. */
int fault_boot_trial(fault_attack_t attack, int R, int timeout_ms, fault_rec_t *recs, char *why,
                     size_t why_len, int *hung);

#endif
