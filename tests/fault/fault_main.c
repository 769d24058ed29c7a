/*
 * The fault-injection driver: N trials, each R forked ranks (2 .. max) of one operation mode with a
 * victim killed at a random point (init, buffer creation by delay or at an EPX_TEST_FAULT_SHM step,
 * the operation loop), plus the bootstrap attacks of fault_boot.c. Classifies every survivor,
 * prints the table and fails when a target is missed: 0 wrong successes, 0 hangs, 0 leftovers,
 * every survivor's error within EPX_TIMEOUT_MS + slack of the death. docs/fault.md is its manual.
 */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "epx_test.h"
#include "fault.h"
#include "reference.h"

/* A trial whose victim was not killed within this long after it started is stuck before the kill. */
#define SETUP_CAP_S 30.0
/* After the death, teardown gets this long on top of the timeout before the watchdog calls a hang. */
#define HANG_GRACE_S 2.0
/* Errors a survivor may report for a dead peer. */
#define EXPECTED_ERROR(res) \
    ((res) == EPX_ERR_REMOTE || (res) == EPX_ERR_TIMEOUT || (res) == EPX_ERR_BOOTSTRAP)

typedef struct opts {
    int trials, max_ranks, timeout_ms, slack_ms, only, verbose;
    uint64_t seed;
    epx_backend_t backend;
} opts_t;

static const char *mode_names[FAULT_MODE_COUNT] = {"ht", "ht-static",  "ll",  "ll-hook",
                                                   "rm", "rm-permute", "boot"};
static const char *kill_names[FAULT_KILL_COUNT] = {"attack", "init", "create", "shm point", "loop"};

/* ------------------------------------------------------------------------ runner ---- */

int fault_run_ranks(const fault_plan_t *plan, const epx_unique_id_t *id_in, fault_rec_t *recs,
                    fault_run_t *run)
{
    const int n = plan->mode == FAULT_MODE_BOOT ? plan->boot_procs : plan->R;
    memset(recs, 0, sizeof(*recs) * (size_t)n);
    memset(run, 0, sizeof(*run));
    epx_unique_id_t id;
    if (id_in)
        id = *id_in;
    else if (epx_get_unique_id(&id) != EPX_SUCCESS) {
        fprintf(stderr, "fault: epx_get_unique_id: %s\n", epx_last_error_message());
        return -1;
    }
    pid_t pids[FAULT_MAX_RANKS + 1];
    int running[FAULT_MAX_RANKS + 1] = {0}, left = 0;
    fflush(NULL);
    for (int r = 0; r < n; r++) {
        pids[r] = fork();
        if (pids[r] == 0) _exit(fault_rank_main(plan, r, &id, &recs[r]));
        if (pids[r] < 0) {
            fprintf(stderr, "fault: fork: %s\n", strerror(errno));
            for (int q = 0; q < r; q++) kill(pids[q], SIGKILL);
            for (int q = 0; q < r; q++) waitpid(pids[q], NULL, 0);
            return -1;
        }
        running[r] = 1;
        left++;
    }
    const int v = plan->victim;
    const double start = fault_now();
    double kill_at = 0.0;
    while (left > 0) {
        const double now = fault_now();
        for (int r = 0; r < n; r++) {
            if (!running[r] || waitpid(pids[r], &run->status[r], WNOHANG) != pids[r]) continue;
            running[r] = 0;
            left--;
            if (r == v && plan->kill != FAULT_KILL_NONE && run->t_death == 0.0) run->t_death = now;
        }
        if (plan->kill != FAULT_KILL_NONE && running[v] && run->t_death == 0.0) {
            int all_looping = 1;
            for (int r = 0; r < n; r++) all_looping &= !running[r] || recs[r].phase >= FAULT_PHASE_LOOP;
            const int phase = recs[v].phase;
            const int armed = (plan->kill == FAULT_KILL_INIT && phase >= FAULT_PHASE_INIT) ||
                              (plan->kill == FAULT_KILL_CREATE && phase >= FAULT_PHASE_CREATE) ||
                              (plan->kill == FAULT_KILL_LOOP && all_looping);
            if (armed && kill_at == 0.0) kill_at = now + plan->delay_us * 1e-6;
            if (plan->kill == FAULT_KILL_SHM_POINT && phase >= FAULT_PHASE_LOOP) {
                run->point_missed = 1;
                kill_at = now;
            }
            if (kill_at != 0.0 && now >= kill_at) {
                run->t_death = fault_now();
                kill(pids[v], SIGKILL);
            }
        }
        double deadline = start + SETUP_CAP_S;
        if (run->t_death != 0.0) deadline = run->t_death + plan->timeout_ms * 1e-3 + HANG_GRACE_S;
        if (plan->kill == FAULT_KILL_NONE) deadline = start + plan->timeout_ms * 1e-3 + HANG_GRACE_S;
        if (left > 0 && now > deadline) {
            for (int r = 0; r < n; r++)
                if (running[r]) {
                    run->hung[r] = 1;
                    kill(pids[r], SIGKILL);
                    waitpid(pids[r], &run->status[r], 0);
                    running[r] = 0;
                    left--;
                }
        }
        if (left > 0) usleep(200);
    }
    run->victim_killed = plan->kill != FAULT_KILL_NONE && !run->hung[v] && WIFSIGNALED(run->status[v]) &&
                         WTERMSIG(run->status[v]) == SIGKILL;
    return 0;
}

/* ------------------------------------------------------------------------ tally ---- */

enum { P_WRONG, P_HANG, P_LATE, P_UNEXPECTED, P_LEFTOVER, P_COUNT };
static const char *problem_names[P_COUNT] = {"wrong success", "hang", "late", "unexpected", "leftover"};

typedef struct tally {
    int trials, expected, problems[P_COUNT];
    double worst_ms;
} tally_t;

typedef struct outcome {
    int problem[P_COUNT];
    double worst_ms;
    char why[400];
} outcome_t;

static void flag(outcome_t *o, int problem, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void flag(outcome_t *o, int problem, const char *fmt, ...)
{
    size_t used = strlen(o->why);
    if (!o->problem[problem] && used + 4 < sizeof(o->why)) {
        va_list ap;
        va_start(ap, fmt);
        snprintf(o->why + used, sizeof(o->why) - used, "%s", used ? "; " : "");
        used = strlen(o->why);
        vsnprintf(o->why + used, sizeof(o->why) - used, fmt, ap);
        va_end(ap);
    }
    o->problem[problem] = 1;
}

static void add(tally_t *t, const outcome_t *o)
{
    int any = 0;
    t->trials++;
    for (int p = 0; p < P_COUNT; p++) {
        t->problems[p] += o->problem[p];
        any |= o->problem[p];
    }
    t->expected += !any;
    if (o->worst_ms > t->worst_ms) t->worst_ms = o->worst_ms;
}

static int result_counts[EPX_ERR_INVALID_USAGE + 1];

/* How every survivor of a kill trial ended. */
static void classify(const opts_t *op, const fault_plan_t *plan, const fault_rec_t *recs,
                     const fault_run_t *run, outcome_t *o)
{
    const int v = plan->victim;
    const fault_rec_t *vr = &recs[v];
    if (run->point_missed)
        flag(o, P_UNEXPECTED, "victim passed EPX_TEST_FAULT_SHM step %d alive", plan->shm_step);
    if (!run->victim_killed && !run->hung[v])
        flag(o, P_UNEXPECTED, "victim ended with status 0x%x before the kill (%s: %s)", run->status[v],
             vr->err_what, vr->err_msg);
    const double bound_ms = op->timeout_ms + op->slack_ms;
    /* A victim killed by the driver died at t_death. One that killed itself at a shm point is seen
     * dead only when reaped, which lags under load: it died somewhere after it entered the buffer
     * creation, so a survivor's error from then on is not early. */
    const double earliest_death = plan->kill == FAULT_KILL_SHM_POINT && vr->phase == FAULT_PHASE_CREATE &&
                                          vr->t_entered > 0.0 && vr->t_entered < run->t_death
                                      ? vr->t_entered
                                      : run->t_death;
    for (int r = 0; r < plan->R; r++) {
        if (r == v) continue;
        const fault_rec_t *rr = &recs[r];
        if (run->hung[r]) {
            flag(o, P_HANG, "rank %d still running %.1f s after the death (phase %d, call %d)", r,
                 op->timeout_ms * 1e-3 + HANG_GRACE_S, rr->phase, rr->entered);
            continue;
        }
        if (rr->bad_data) flag(o, P_WRONG, "rank %d: wrong output: %s", r, rr->err_msg);
        if (rr->last_recv_needs > vr->entered)
            flag(o, P_WRONG,
                 "rank %d: call %d succeeded, needing data of call %d the victim never entered (it died in "
                 "%d)",
                 r, rr->entered, rr->last_recv_needs, vr->entered);
        const int status = run->status[r];
        if (rr->err_call < 0) {
            if (!rr->bad_data)
                flag(o, P_UNEXPECTED, "rank %d ended without an error (status 0x%x, phase %d)", r, status,
                     rr->phase);
            continue;
        }
        if (rr->err_res >= 0 && rr->err_res <= EPX_ERR_INVALID_USAGE) result_counts[rr->err_res]++;
        /* A call that began after the death has its own timeout: it counts from its start. */
        const double since = rr->t_entered > run->t_death ? rr->t_entered : run->t_death;
        const double ms = (rr->t_err - since) * 1e3;
        if (!EXPECTED_ERROR(rr->err_res))
            flag(o, P_UNEXPECTED, "rank %d: %s returned %s: %s", r, rr->err_what,
                 epx_result_name((epx_result_t)rr->err_res), rr->err_msg);
        else if (run->t_death == 0.0 || rr->t_err < earliest_death - 0.02)
            flag(o, P_UNEXPECTED, "rank %d: %s failed %.1f ms before the death: %s", r, rr->err_what,
                 (earliest_death - rr->t_err) * 1e3, rr->err_msg);
        if (ms > o->worst_ms) o->worst_ms = ms;
        if (ms > bound_ms)
            flag(o, P_LATE, "rank %d: %s returned %s %.1f ms after the death or its start (bound %.0f ms)", r,
                 rr->err_what, epx_result_name((epx_result_t)rr->err_res), ms, bound_ms);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
            flag(o, P_UNEXPECTED, "rank %d ended with status 0x%x after %s", r, status, rr->err_what);
        if (rr->fds_before >= 0 && rr->fds_after > rr->fds_before)
            flag(o, P_LEFTOVER, "rank %d: %d descriptors open after teardown, %d before init", r,
                 rr->fds_after, rr->fds_before);
    }
}

/* ------------------------------------------------------------------- leftovers ---- */

/* Rank 0 was the victim and died before its rendezvous ended (it alone stops the id's socket). */
static int rank0_died_in_rendezvous(const fault_plan_t *plan, const fault_rec_t *recs)
{
    return plan->mode != FAULT_MODE_BOOT && plan->victim == 0 && recs[0].phase <= FAULT_PHASE_INIT;
}

/* /dev/shm is shared with whatever else runs on the machine (tests beside this one under ctest
 * --parallel make and remove "epx-..." entries of their own), so entries are followed by name: one
 * that appeared during a trial is a leftover only when it is still there at the end of the run, after
 * SHM_GRACE_S more; entries that come and go, or that vanish, are someone else's. */
#define SHM_NAMES_MAX 128
#define SHM_GRACE_S   2.0

typedef struct shm_names {
    int count;
    char name[SHM_NAMES_MAX][256];
    int trial[SHM_NAMES_MAX]; /* suspects: the trial the entry appeared in */
} shm_names_t;

/* The entries of /dev/shm whose name holds "epx". */
static void shm_list(shm_names_t *out)
{
    out->count = 0;
    DIR *d = opendir("/dev/shm");
    if (!d) return;
    for (struct dirent *e; out->count < SHM_NAMES_MAX && (e = readdir(d));)
        if (strstr(e->d_name, "epx"))
            snprintf(out->name[out->count++], sizeof(out->name[0]), "%s", e->d_name);
    closedir(d);
}

static int shm_has(const shm_names_t *set, const char *name)
{
    for (int i = 0; i < set->count; i++)
        if (strcmp(set->name[i], name) == 0) return 1;
    return 0;
}

/* Adds the entries of `after` that are not in `before` to `suspects`. */
static void shm_note_new(const shm_names_t *before, const shm_names_t *after, int trial,
                         shm_names_t *suspects)
{
    for (int i = 0; i < after->count && suspects->count < SHM_NAMES_MAX; i++)
        if (!shm_has(before, after->name[i]) && !shm_has(suspects, after->name[i])) {
            snprintf(suspects->name[suspects->count], sizeof(suspects->name[0]), "%s", after->name[i]);
            suspects->trial[suspects->count++] = trial;
        }
}

/* Flags the suspects still present once SHM_GRACE_S has passed (or none is left). */
static void shm_check_leftovers(const shm_names_t *suspects, outcome_t *o)
{
    static shm_names_t now;
    const double give_up = fault_now() + SHM_GRACE_S;
    int left = 0, first = -1;
    for (;;) {
        shm_list(&now);
        left = 0;
        for (int i = 0; i < suspects->count; i++)
            if (shm_has(&now, suspects->name[i])) {
                if (!left) first = i;
                left++;
            }
        if (!left || fault_now() > give_up) break;
        usleep(50000);
    }
    if (left)
        flag(o, P_LEFTOVER,
             "%d /dev/shm entries made during the trials are still there (/dev/shm/%s, trial %d)", left,
             suspects->name[first], suspects->trial[first]);
}

static int children_left(void)
{
    int status;
    const pid_t got = waitpid(-1, &status, WNOHANG);
    return !(got < 0 && errno == ECHILD);
}

/* ------------------------------------------------------------------------ trials ---- */

static fault_plan_t make_plan(const opts_t *op, int trial)
{
    uint64_t st = ref_hash(op->seed, 0xfa17, (uint64_t)trial, 0, 0);
    fault_plan_t p;
    memset(&p, 0, sizeof(p));
    p.R = 2 + (int)(epx_test_rand(&st) % (uint64_t)(op->max_ranks - 1));
    p.mode = (fault_mode_t)(epx_test_rand(&st) % FAULT_MODE_BOOT);
    p.victim = (int)(epx_test_rand(&st) % (uint64_t)p.R);
    const int where = (int)(epx_test_rand(&st) % 20);
    p.kill = where < 3    ? FAULT_KILL_INIT
             : where < 6  ? FAULT_KILL_CREATE
             : where < 10 ? FAULT_KILL_SHM_POINT
                          : FAULT_KILL_LOOP;
    p.shm_step = 1 + (int)(epx_test_rand(&st) % 3);
    /* Up to about the length of the phase on a loaded 2-core machine; GPU phases take longer. */
    const int scale = op->backend == EPX_BACKEND_CUDA ? 10 : 1;
    p.delay_us = (int)(epx_test_rand(&st) % (uint64_t)(p.kill == FAULT_KILL_LOOP   ? 60000
                                                       : p.kill == FAULT_KILL_INIT ? 1000
                                                                                   : 3000)) *
                 scale;
    if (op->backend == EPX_BACKEND_CUDA && p.kill == FAULT_KILL_SHM_POINT) p.kill = FAULT_KILL_CREATE;
    p.seed = epx_test_rand(&st);
    p.backend = op->backend;
    p.ngpu = 1;
    p.timeout_ms = op->timeout_ms;
    /* Host backend: a node split with equal nodes (a divisor of R; R itself is one node), so that the
     * victim and the survivors also sit on different emulated nodes. The cuda backend refuses buffers
     * across nodes: one node. Drawn last, so earlier draws replay as before. */
    const uint64_t draw = epx_test_rand(&st);
    if (op->backend == EPX_BACKEND_HOST) {
        int divisors[FAULT_MAX_RANKS], n = 0;
        for (int d = 1; d <= p.R; d++)
            if (p.R % d == 0) divisors[n++] = d;
        const int per = divisors[draw % (uint64_t)n];
        p.per_node = per < p.R ? per : 0;
    }
    return p;
}

static int usage(void)
{
    fprintf(stderr,
            "usage: fault_kill [--trials N] [--seed S] [--backend host|cuda] [--max-ranks R]\n"
            "                  [--timeout-ms MS] [--slack-ms MS] [--only TRIAL] [--verbose]\n"
            "environment: EPX_FAULT_TRIALS, EPX_FAULT_SEED, EPX_FAULT_BACKEND, EPX_FAULT_MAX_RANKS\n");
    return 2;
}

static int parse(int argc, char **argv, opts_t *op)
{
    const char *env;
    op->trials = (env = getenv("EPX_FAULT_TRIALS")) ? atoi(env) : 200;
    op->seed = (env = getenv("EPX_FAULT_SEED")) ? strtoull(env, NULL, 0) : 1;
    op->max_ranks = (env = getenv("EPX_FAULT_MAX_RANKS")) ? atoi(env) : 6;
    env = getenv("EPX_FAULT_BACKEND");
    op->backend = env && strcmp(env, "cuda") == 0 ? EPX_BACKEND_CUDA : EPX_BACKEND_HOST;
    op->timeout_ms = 2000;
    op->slack_ms = 100;
    op->only = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--verbose") == 0) {
            op->verbose = 1;
            continue;
        }
        if (!val) return usage();
        i++;
        if (strcmp(a, "--trials") == 0)
            op->trials = atoi(val);
        else if (strcmp(a, "--seed") == 0)
            op->seed = strtoull(val, NULL, 0);
        else if (strcmp(a, "--max-ranks") == 0)
            op->max_ranks = atoi(val);
        else if (strcmp(a, "--timeout-ms") == 0)
            op->timeout_ms = atoi(val);
        else if (strcmp(a, "--slack-ms") == 0)
            op->slack_ms = atoi(val);
        else if (strcmp(a, "--only") == 0)
            op->only = atoi(val);
        else if (strcmp(a, "--backend") == 0 && (strcmp(val, "host") == 0 || strcmp(val, "cuda") == 0))
            op->backend = strcmp(val, "cuda") == 0 ? EPX_BACKEND_CUDA : EPX_BACKEND_HOST;
        else
            return usage();
    }
    if (op->trials < 1 || op->max_ranks < 2 || op->max_ranks > FAULT_MAX_RANKS || op->timeout_ms < 100 ||
        op->slack_ms < 0) {
        fprintf(stderr, "fault: trials >= 1, max ranks 2..%d, timeout >= 100 ms, slack >= 0\n",
                FAULT_MAX_RANKS);
        return 2;
    }
    return 0;
}

static void print_row(const char *name, const tally_t *t)
{
    if (!t->trials) return;
    printf("%-22s %7d %9d %7d %6d %6d %11d %10d %10.1f\n", name, t->trials, t->expected, t->problems[P_WRONG],
           t->problems[P_HANG], t->problems[P_LATE], t->problems[P_UNEXPECTED], t->problems[P_LEFTOVER],
           t->worst_ms);
}

int main(int argc, char **argv)
{
    opts_t op;
    memset(&op, 0, sizeof(op));
    int rc = parse(argc, argv, &op);
    if (rc) return rc;
    signal(SIGPIPE, SIG_IGN);
    char timeout[16];
    snprintf(timeout, sizeof(timeout), "%d", op.timeout_ms);
    if (epx_test_set_env("EPX_TIMEOUT_MS", timeout) ||
        epx_test_set_env("EPX_DEBUG", op.verbose ? "warn" : "none"))
        return 1;
    const int cuda = op.backend == EPX_BACKEND_CUDA;
    if (cuda && epx_harness_gpu_count() < 1) {
        printf("fault: no GPU, skipped\n");
        return EPX_TEST_SKIP;
    }
    printf(
        "fault: %d trials, seed %llu (--seed or EPX_FAULT_SEED to replay, --only TRIAL for one), backend %s, "
        "2..%d ranks, EPX_TIMEOUT_MS %d, bound %d ms after the death\n",
        op.trials, (unsigned long long)op.seed, cuda ? "cuda" : "host", op.max_ranks, op.timeout_ms,
        op.timeout_ms + op.slack_ms);
    fault_rec_t *recs = mmap(NULL, sizeof(fault_rec_t) * (FAULT_MAX_RANKS + 1), PROT_READ | PROT_WRITE,
                             MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (recs == MAP_FAILED) return 1;
    const int fds_start = fault_count_fds(1);
    static shm_names_t shm_before, shm_after, shm_suspects;
    /* The bootstrap attacks come first (host only: the rendezvous is the same for every backend). */
    const int attacks = cuda ? 0 : FAULT_ATTACK_COUNT;
    tally_t total = {0}, by_mode[FAULT_MODE_COUNT] = {{0}}, by_kill[FAULT_KILL_COUNT + 3] = {{0}};
    tally_t by_phase[FAULT_PHASE_DONE + 1] = {{0}}; /* the victim's phase when it died */
    tally_t by_split[2] = {{0}};                     /* one node, or the ranks split into nodes */
    const double t0 = fault_now();
    int held = 0, held_live = 0; /* trials that left the id's socket; those still open */
    for (int trial = 0; trial < op.trials; trial++) {
        if (op.only >= 0 && trial != op.only) continue;
        outcome_t o;
        memset(&o, 0, sizeof(o));
        const int fds_before = fault_count_fds(1);
        shm_list(&shm_before);
        fault_plan_t plan;
        memset(&plan, 0, sizeof(plan));
        char desc[160];
        if (trial < attacks) {
            const fault_attack_t a = (fault_attack_t)trial;
            plan.mode = FAULT_MODE_BOOT;
            plan.R = 2 + trial % 3;
            int hung = 0;
            char why[300] = "";
            if (fault_boot_trial(a, plan.R, op.timeout_ms, recs, why, sizeof(why), &hung))
                flag(&o, hung ? P_HANG : P_UNEXPECTED, "%s", why);
            snprintf(desc, sizeof(desc), "attack %s, %d ranks", fault_attack_name(a), plan.R);
        } else {
            plan = make_plan(&op, trial);
            fault_run_t run;
            if (fault_run_ranks(&plan, NULL, recs, &run)) return 1;
            classify(&op, &plan, recs, &run, &o);
            snprintf(desc, sizeof(desc), "%s, %d ranks in %d node(s), victim %d, %s %s%d, died in call %d (phase %d)",
                     mode_names[plan.mode], plan.R, plan.per_node ? plan.R / plan.per_node : 1, plan.victim,
                     kill_names[plan.kill],
                     plan.kill == FAULT_KILL_SHM_POINT ? "step " : "+",
                     plan.kill == FAULT_KILL_SHM_POINT ? plan.shm_step : plan.delay_us / 1000,
                     recs[plan.victim].entered, recs[plan.victim].phase);
        }
        /* The driver's live descriptors change by the id's socket this trial left (only when rank 0
         * died inside its rendezvous) minus the sockets of earlier such trials that the library's
         * age sweep closed meanwhile; anything else is a leftover. */
        const int fds_after = fault_count_fds(1), change = fds_after - fds_before;
        const int may_hold = rank0_died_in_rendezvous(&plan, recs);
        if (change <= may_hold && held_live + change >= 0) {
            held_live += change;
            held += may_hold && change > 0;
        } else {
            flag(&o, P_LEFTOVER, "the driver holds %d descriptors, %d before", fds_after, fds_before);
        }
        shm_list(&shm_after);
        shm_note_new(&shm_before, &shm_after, trial, &shm_suspects);
        if (children_left()) flag(&o, P_LEFTOVER, "a child process is left");
        add(&total, &o);
        add(&by_mode[plan.mode], &o);
        add(&by_kill[plan.kill == FAULT_KILL_SHM_POINT ? FAULT_KILL_COUNT + plan.shm_step - 1
                                                       : (int)plan.kill],
            &o);
        if (plan.mode != FAULT_MODE_BOOT) add(&by_phase[recs[plan.victim].phase], &o);
        if (plan.mode != FAULT_MODE_BOOT) add(&by_split[plan.per_node > 0], &o);
        int any = 0;
        for (int p = 0; p < P_COUNT; p++) any |= o.problem[p];
        if (any || op.verbose)
            printf("trial %d: %s: %s%s%s\n", trial, desc, any ? "" : "ok", any ? "FAILED: " : "", o.why);
        fflush(stdout);
    }
    const double took = fault_now() - t0;
    outcome_t o;
    memset(&o, 0, sizeof(o));
    int fds_end = fault_count_fds(1), fds_expected = fds_start;
    if (held_live > 0) {
        /* A rank 0 that died inside its rendezvous leaves the driver's copy of the id's socket
         * listening; the library closes such copies once older than EPX_TIMEOUT_MS + 1 s, at its
         * next visit to them (here: a new id, whose own socket is the one left). */
        usleep((useconds_t)(op.timeout_ms + 1200) * 1000u);
        epx_unique_id_t id;
        if (epx_get_unique_id(&id) == EPX_SUCCESS) fds_expected++;
        fds_end = fault_count_fds(1);
        printf("%d trial(s) left the id's socket with the driver while rank 0 died in its rendezvous; "
               "after the age sweep the driver holds %d descriptors (%d expected)\n",
               held, fds_end, fds_expected);
    }
    if (fds_end != fds_expected) flag(&o, P_LEFTOVER, "driver descriptors %d -> %d", fds_start, fds_end);
    shm_check_leftovers(&shm_suspects, &o);
    if (children_left()) flag(&o, P_LEFTOVER, "child processes are left");
    if (o.problem[P_LEFTOVER]) {
        printf("after all trials: %s\n", o.why);
        total.problems[P_LEFTOVER]++;
    }

    printf("\n%-22s %7s %9s %7s %6s %6s %11s %10s %10s\n", "class", "trials", "expected", "wrong", "hangs",
           "late", "unexpected", "leftovers", "worst ms");
    for (int m = 0; m < FAULT_MODE_COUNT; m++) {
        char name[32];
        snprintf(name, sizeof(name), "mode %s", mode_names[m]);
        print_row(name, &by_mode[m]);
    }
    for (int k = 0; k < FAULT_KILL_COUNT + 3; k++) {
        char name[32];
        if (k < FAULT_KILL_COUNT)
            snprintf(name, sizeof(name), "kill in %s", kill_names[k]);
        else
            snprintf(name, sizeof(name), "kill at shm step %d", k - FAULT_KILL_COUNT + 1);
        if (k != FAULT_KILL_SHM_POINT) print_row(name, &by_kill[k]);
    }
    static const char *phase_names[] = {"start", "init", "create", "loop", "teardown", "done"};
    for (int ph = 0; ph <= FAULT_PHASE_DONE; ph++) {
        char name[32];
        snprintf(name, sizeof(name), "victim died in %s", phase_names[ph]);
        print_row(name, &by_phase[ph]);
    }
    print_row("one node", &by_split[0]);
    print_row("split into nodes", &by_split[1]);
    print_row("total", &total);
    printf("survivor errors:");
    for (int r = 0; r <= EPX_ERR_INVALID_USAGE; r++)
        if (result_counts[r]) printf(" %s %d", epx_result_name((epx_result_t)r), result_counts[r]);
    printf("\nworst detection latency %.1f ms (bound %d ms); %.1f s for %d trials\n", total.worst_ms,
           op.timeout_ms + op.slack_ms, took, total.trials);
    munmap(recs, sizeof(fault_rec_t) * (FAULT_MAX_RANKS + 1));
    int missed = 0;
    for (int p = 0; p < P_COUNT; p++)
        if (total.problems[p]) {
            printf("target missed: %d trials with %s\n", total.problems[p], problem_names[p]);
            missed = 1;
        }
    printf("fault: %s\n", missed ? "FAILED" : "ok");
    return missed;
}
