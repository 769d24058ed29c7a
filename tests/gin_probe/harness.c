/*
 * The GIN probe's process harness: one forked process per rank, a shared anonymous page for the unique
 * id, the barriers and each rank's stage outcomes, a SIGALRM watchdog per rank (no stage runs past the
 * stage timeout) and a parent that kills a rank the watchdog could not end, then prints the summary.
 */
#include "harness.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MSG_LEN        200
#define HANG_LEN       320
#define EXIT_HUNG      3  /* a rank's exit status when its watchdog fired */
#define PARENT_GRACE_S 15 /* past the stage timeout, the parent kills a rank that made no progress */
#define ID_BYTES       128

static const char *const stage_names[PROBE_STAGE_COUNT] = {
    "env",
    "cuda",
    "unique-id",
    "comm-init",
    "plugin-loaded",
    "mem-alloc",
    "window-register",
    "devcomm-create",
    "net-handle",
    "kernel",
    "data-check",
    "soak",
    "devcomm-destroy",
    "window-deregister",
    "mem-free",
    "teardown-barrier",
    "comm-finalize",
    "comm-destroy",
    "process-exit",
};
static const char *const outcome_names[] = {"-", "RUNNING", "ok", "FAILED", "skipped"};

typedef struct rank_slot {
    _Atomic int outcome[PROBE_STAGE_COUNT];
    char msg[PROBE_STAGE_COUNT][MSG_LEN];
    _Atomic int current; /* the running stage, -1 between stages */
    _Atomic uint64_t heartbeat_ns;
    char hang[2]
             [HANG_LEN]; /* the watchdog's line; written alternately so the handler never reads a torn one */
    _Atomic int hang_index;
    uint64_t sent_hash, received_hash, iterations;
    _Atomic int hashes_set;
} rank_slot_t;

typedef struct shared {
    _Atomic int abort; /* a rank failed fatally: the others stop at their next barrier or kernel wait */
    _Atomic int gone;  /* a rank's process ended abnormally */
    _Atomic int id_ready;
    unsigned char id[ID_BYTES];
    struct {
        _Atomic uint32_t arrived;
        _Atomic uint32_t generation;
    } barrier[PROBE_BARRIERS];
    rank_slot_t slot[PROBE_MAX_RANKS];
} shared_t;

struct probe {
    int rank, nranks, stage_timeout_s;
    shared_t *sh;
};

static probe_t *watched; /* this process's rank, for the watchdog */

uint64_t probe_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t probe_fnv(const void *data, size_t n, uint64_t h)
{
    const unsigned char *b = (const unsigned char *)data;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static void nap_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

static void write_all(const char *s, size_t n)
{
    while (n > 0) {
        ssize_t w = write(STDOUT_FILENO, s, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return;
        s += w;
        n -= (size_t)w;
    }
}

int probe_rank(const probe_t *p)
{
    return p->rank;
}
int probe_nranks(const probe_t *p)
{
    return p->nranks;
}

/* One line, one write: lines of several ranks never interleave. */
static void say_v(const probe_t *p, const char *fmt, va_list ap)
{
    char line[1024];
    int n = snprintf(line, sizeof(line), "gin-probe rank %d/%d: ", p->rank, p->nranks);
    n += vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
    if (n > (int)sizeof(line) - 2) n = (int)sizeof(line) - 2;
    line[n++] = '\n';
    write_all(line, (size_t)n);
}

void probe_say(const probe_t *p, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    say_v(p, fmt, ap);
    va_end(ap);
}

/* Prepares the watchdog's line for what runs now and re-arms it. */
static void arm(probe_t *p, const char *what)
{
    rank_slot_t *s = &p->sh->slot[p->rank];
    const int cur = atomic_load(&s->current);
    const int next = 1 - atomic_load(&s->hang_index);
    snprintf(s->hang[next], HANG_LEN,
             "gin-probe rank %d/%d: stage %s failed: no progress in %d s (watchdog) in: %s\n", p->rank,
             p->nranks, cur >= 0 ? stage_names[cur] : "(between stages)", p->stage_timeout_s, what);
    atomic_store(&s->hang_index, next);
    atomic_store(&s->heartbeat_ns, probe_now_ns());
    alarm((unsigned)p->stage_timeout_s);
}

static void on_alarm(int sig)
{
    (void)sig;
    probe_t *p = watched;
    if (!p) _exit(EXIT_HUNG);
    rank_slot_t *s = &p->sh->slot[p->rank];
    const char *line = s->hang[atomic_load(&s->hang_index)];
    const int cur = atomic_load(&s->current);
    if (cur >= 0) {
        /* The stage's summary message: the line without its prefix. */
        const char *why = strstr(line, "no progress");
        size_t n = why ? strlen(why) : 0;
        if (n >= MSG_LEN) n = MSG_LEN - 1;
        if (why) memcpy(s->msg[cur], why, n);
        s->msg[cur][n > 0 && s->msg[cur][n - 1] == '\n' ? n - 1 : n] = '\0';
        atomic_store(&s->outcome[cur], PROBE_FAILED);
    }
    atomic_store(&p->sh->abort, 1);
    write_all(line, strlen(line));
    _exit(EXIT_HUNG);
}

void probe_begin(probe_t *p, probe_stage_t stage, const char *what)
{
    rank_slot_t *s = &p->sh->slot[p->rank];
    atomic_store(&s->current, (int)stage);
    atomic_store(&s->outcome[stage], PROBE_RUNNING);
    snprintf(s->msg[stage], MSG_LEN, "running: %s", what);
    arm(p, what);
    probe_say(p, "stage %s begins: %s", stage_names[stage], what);
}

void probe_progress(probe_t *p, const char *what)
{
    arm(p, what);
}

static void finish(probe_t *p, probe_stage_t stage, probe_outcome_t outcome, const char *fmt, va_list ap)
{
    rank_slot_t *s = &p->sh->slot[p->rank];
    char text[MSG_LEN];
    vsnprintf(text, sizeof(text), fmt, ap);
    memcpy(s->msg[stage], text, sizeof(text));
    atomic_store(&s->outcome[stage], (int)outcome);
    probe_say(p, "stage %s %s: %s", stage_names[stage],
              outcome == PROBE_FAILED ? "failed" : outcome_names[outcome], text);
}

/* Ends the running stage with an outcome; the watchdog stays armed for what follows. */
static void end_current(probe_t *p, probe_outcome_t outcome, const char *fmt, va_list ap)
{
    rank_slot_t *s = &p->sh->slot[p->rank];
    const int cur = atomic_load(&s->current);
    if (cur < 0) return;
    finish(p, (probe_stage_t)cur, outcome, fmt, ap);
    char after[64];
    snprintf(after, sizeof(after), "after stage %s", stage_names[cur]);
    atomic_store(&s->current, -1);
    arm(p, after);
}

int probe_ok(probe_t *p, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    end_current(p, PROBE_OK, fmt, ap);
    va_end(ap);
    return 1;
}

int probe_fail(probe_t *p, int fatal, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    end_current(p, PROBE_FAILED, fmt, ap);
    va_end(ap);
    if (fatal) atomic_store(&p->sh->abort, 1);
    return 0;
}

void probe_skip(probe_t *p, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    end_current(p, PROBE_SKIPPED, fmt, ap);
    va_end(ap);
}

void probe_record(probe_t *p, probe_stage_t stage, probe_outcome_t outcome, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    finish(p, stage, outcome, fmt, ap);
    va_end(ap);
}

int probe_aborted(const probe_t *p)
{
    return atomic_load(&p->sh->abort) != 0;
}
int probe_peer_gone(const probe_t *p)
{
    return atomic_load(&p->sh->gone) != 0;
}

int probe_publish_id(probe_t *p, const void *id, size_t bytes)
{
    if (bytes > ID_BYTES) return 0;
    memcpy(p->sh->id, id, bytes);
    atomic_store_explicit(&p->sh->id_ready, 1, memory_order_release);
    return 1;
}

int probe_wait_id(probe_t *p, void *id_out, size_t bytes, int timeout_ms, char *why, size_t why_len)
{
    const uint64_t deadline = probe_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    while (!atomic_load_explicit(&p->sh->id_ready, memory_order_acquire)) {
        if (bytes > ID_BYTES) break;
        if (probe_aborted(p)) {
            snprintf(why, why_len, "another rank failed before rank 0 published the unique id");
            return 0;
        }
        if (probe_now_ns() > deadline) {
            snprintf(why, why_len, "rank 0 did not publish the unique id within %d ms", timeout_ms);
            return 0;
        }
        nap_us(1000);
    }
    if (bytes > ID_BYTES) {
        snprintf(why, why_len, "unique id of %zu bytes exceeds the shared page's %d", bytes, ID_BYTES);
        return 0;
    }
    memcpy(id_out, p->sh->id, bytes);
    return 1;
}

int probe_barrier(probe_t *p, int which, int timeout_ms, int honor_abort, char *why, size_t why_len)
{
    if (which < 0 || which >= PROBE_BARRIERS) {
        snprintf(why, why_len, "barrier %d does not exist", which);
        return 0;
    }
    _Atomic uint32_t *arrived = &p->sh->barrier[which].arrived;
    _Atomic uint32_t *generation = &p->sh->barrier[which].generation;
    const uint32_t gen = atomic_load_explicit(generation, memory_order_acquire);
    if (atomic_fetch_add(arrived, 1) + 1 == (uint32_t)p->nranks) {
        atomic_store(arrived, 0);
        atomic_fetch_add_explicit(generation, 1, memory_order_release);
        return 1;
    }
    const uint64_t deadline = probe_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    while (atomic_load_explicit(generation, memory_order_acquire) == gen) {
        if (honor_abort && probe_aborted(p)) {
            snprintf(why, why_len, "another rank failed (barrier %d left early)", which);
            return 0;
        }
        if (probe_peer_gone(p)) {
            snprintf(why, why_len, "a rank's process has ended (barrier %d cannot complete)", which);
            return 0;
        }
        if (probe_now_ns() > deadline) {
            snprintf(why, why_len, "barrier %d: %u of %d ranks arrived within %d ms", which,
                     atomic_load(arrived), p->nranks, timeout_ms);
            return 0;
        }
        nap_us(50);
    }
    return 1;
}

void probe_set_hashes(probe_t *p, uint64_t sent, uint64_t received, uint64_t iterations)
{
    rank_slot_t *s = &p->sh->slot[p->rank];
    s->sent_hash = sent;
    s->received_hash = received;
    s->iterations = iterations;
    atomic_store_explicit(&s->hashes_set, 1, memory_order_release);
}

/* ---- the parent ----------------------------------------------------------------------------------- */

static void parent_say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void parent_say(const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof(line) - 1, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof(line) - 2) n = (int)sizeof(line) - 2;
    line[n++] = '\n';
    write_all(line, (size_t)n);
}

/* The rank process: watchdog, parent-death signal, the rank's work, exit under the watchdog. */
static void child(shared_t *sh, int rank, const probe_run_opts_t *opts, probe_rank_fn fn, void *arg,
                  pid_t parent)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(EXIT_HUNG);
    static probe_t self;
    self.rank = rank;
    self.nranks = opts->nranks;
    self.stage_timeout_s = opts->stage_timeout_s;
    self.sh = sh;
    watched = &self;
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_alarm;
    sigaction(SIGALRM, &sa, NULL);
    atomic_store(&sh->slot[rank].current, -1);
    arm(&self, "start");
    const int rc = fn(&self, arg);
    arm(&self, "process exit (CUDA and NCCL library teardown)");
    exit(rc == 0 ? 0 : 1);
}

static void record_exit(shared_t *sh, int rank, int status)
{
    rank_slot_t *s = &sh->slot[rank];
    char what[96];
    int normal = WIFEXITED(status) && (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == 1);
    if (WIFEXITED(status))
        snprintf(what, sizeof(what), "exit status %d%s", WEXITSTATUS(status),
                 WEXITSTATUS(status) == EXIT_HUNG ? " (watchdog)" : "");
    else if (WIFSIGNALED(status))
        snprintf(what, sizeof(what), "killed by signal %d (%s)", WTERMSIG(status),
                 strsignal(WTERMSIG(status)));
    else
        snprintf(what, sizeof(what), "ended with wait status 0x%x", status);
    const int cur = atomic_load(&s->current);
    if (!normal && cur >= 0 && atomic_load(&s->outcome[cur]) == PROBE_RUNNING) {
        snprintf(s->msg[cur], MSG_LEN, "process ended during this stage: %s", what);
        atomic_store(&s->outcome[cur], PROBE_FAILED);
    }
    snprintf(s->msg[PROBE_STAGE_EXIT], MSG_LEN, "%s", what);
    atomic_store(&s->outcome[PROBE_STAGE_EXIT], normal ? PROBE_OK : PROBE_FAILED);
    if (!normal) {
        atomic_store(&sh->gone, 1);
        atomic_store(&sh->abort, 1);
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 1) atomic_store(&sh->abort, 1);
}

/* Waits for every rank; kills one that made no progress past the stage timeout plus a grace. */
static void watch(shared_t *sh, const pid_t *pids, int nranks, int stage_timeout_s)
{
    int alive = nranks, exited[PROBE_MAX_RANKS] = {0};
    const uint64_t limit_ns = (uint64_t)(stage_timeout_s + PARENT_GRACE_S) * 1000000000ull;
    while (alive > 0) {
        int status = 0;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid > 0) {
            for (int r = 0; r < nranks; r++) {
                if (pids[r] != pid) continue;
                record_exit(sh, r, status);
                exited[r] = 1;
                alive--;
            }
            continue;
        }
        if (pid < 0 && errno != EINTR) break;
        const uint64_t now = probe_now_ns();
        for (int r = 0; r < nranks; r++) {
            rank_slot_t *s = &sh->slot[r];
            const uint64_t beat = atomic_load(&s->heartbeat_ns); /* may be later than `now`: no wrap */
            if (exited[r] || beat >= now || now - beat <= limit_ns) continue;
            parent_say("gin-probe parent: rank %d made no progress in %d s and its watchdog did not end it: "
                       "killing pid %d",
                       r, stage_timeout_s + PARENT_GRACE_S, (int)pids[r]);
            kill(pids[r], SIGKILL);
            atomic_store(&s->heartbeat_ns, now); /* once */
        }
        nap_us(20000);
    }
}

/* The per-stage table, every failure, the soak's cross-rank hash check and the verdict. */
static int summarize(shared_t *sh, const probe_run_opts_t *opts)
{
    const int n = opts->nranks;
    char line[512];
    int len, failed = 0, proven = 1;
    parent_say("gin-probe summary: %s", opts->title);
    len = snprintf(line, sizeof(line), "  %-18s", "stage");
    for (int r = 0; r < n; r++) len += snprintf(line + len, sizeof(line) - (size_t)len, " rank%-4d", r);
    parent_say("%s", line);
    for (int st = 0; st < PROBE_STAGE_COUNT; st++) {
        len = snprintf(line, sizeof(line), "  %-18s", stage_names[st]);
        for (int r = 0; r < n; r++) {
            const int o = atomic_load(&sh->slot[r].outcome[st]);
            len += snprintf(line + len, sizeof(line) - (size_t)len, " %-8s", outcome_names[o]);
            if (o == PROBE_FAILED || o == PROBE_RUNNING) failed = 1;
            if (st == (int)opts->proof_stage && o != PROBE_OK) proven = 0;
            if (st == PROBE_STAGE_EXIT && o != PROBE_OK) failed = 1;
        }
        parent_say("%s", line);
    }
    int first_stage = -1, first_rank = -1;
    for (int st = 0; st < PROBE_STAGE_COUNT; st++) {
        for (int r = 0; r < n; r++) {
            const int o = atomic_load(&sh->slot[r].outcome[st]);
            if (o != PROBE_FAILED && o != PROBE_RUNNING) continue;
            parent_say("  failure: rank %d, stage %s: %s", r, stage_names[st], sh->slot[r].msg[st]);
            if (first_stage < 0) first_stage = st, first_rank = r;
        }
    }
    int hashes_ok = 1;
    for (int r = 0; r < n; r++) {
        const rank_slot_t *s = &sh->slot[r], *from = &sh->slot[(r + n - 1) % n];
        if (!atomic_load(&s->hashes_set) || !atomic_load(&from->hashes_set)) {
            hashes_ok = 0;
            continue;
        }
        const int match = s->received_hash == from->sent_hash && s->iterations == from->iterations;
        parent_say("  soak: rank %d received hash 0x%016llx over %llu iterations; rank %d sent 0x%016llx: %s",
                   r, (unsigned long long)s->received_hash, (unsigned long long)s->iterations,
                   (r + n - 1) % n, (unsigned long long)from->sent_hash, match ? "match" : "MISMATCH");
        if (!match) hashes_ok = 0;
    }
    if (!failed && proven && hashes_ok) {
        parent_say("gin-probe verdict: PASS (%d ranks): every stage ok, data bit-exact, soak hashes match "
                   "across ranks",
                   n);
        return 0;
    }
    if (first_stage >= 0)
        parent_say("gin-probe verdict: FAIL (%d ranks): first failure rank %d, stage %s: %s", n, first_rank,
                   stage_names[first_stage], sh->slot[first_rank].msg[first_stage]);
    else
        parent_say("gin-probe verdict: FAIL (%d ranks): %s", n,
                   !proven ? "the proving stage did not pass on every rank"
                           : "the soak hashes are missing or differ");
    return 1;
}

int probe_run(const probe_run_opts_t *opts, probe_rank_fn fn, void *arg)
{
    if (opts->nranks < 2 || opts->nranks > PROBE_MAX_RANKS) {
        fprintf(stderr, "gin-probe: %d ranks: need 2..%d\n", opts->nranks, PROBE_MAX_RANKS);
        return 2;
    }
    shared_t *sh =
        (shared_t *)mmap(NULL, sizeof(shared_t), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) {
        fprintf(stderr, "gin-probe: mmap of the shared page: %s\n", strerror(errno));
        return 2;
    }
    memset(sh, 0, sizeof(*sh));
    pid_t pids[PROBE_MAX_RANKS] = {0};
    const pid_t parent = getpid();
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < opts->nranks; r++) {
        atomic_store(&sh->slot[r].heartbeat_ns, probe_now_ns());
        atomic_store(&sh->slot[r].current, -1);
        pids[r] = fork();
        if (pids[r] == 0) child(sh, r, opts, fn, arg, parent);
        if (pids[r] < 0) {
            parent_say("gin-probe parent: fork of rank %d: %s", r, strerror(errno));
            atomic_store(&sh->abort, 1);
            atomic_store(&sh->gone, 1);
            for (int k = 0; k < r; k++) kill(pids[k], SIGKILL);
            for (int k = 0; k < r; k++) waitpid(pids[k], NULL, 0);
            munmap(sh, sizeof(*sh));
            return 2;
        }
    }
    watch(sh, pids, opts->nranks, opts->stage_timeout_s);
    const int rc = summarize(sh, opts);
    munmap(sh, sizeof(*sh));
    return rc;
}
