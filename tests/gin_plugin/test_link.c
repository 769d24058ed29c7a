/*
 * Multi-process CPU tests of the test GIN plugin's link (link.h) and close sequence (teardown.h): 2..4
 * forked ranks connect, run collective exchanges carrying memfds, signal adds through the mailboxes
 * (exact sums, order per ring, refusals, a full ring), and the queue core over a CPU mover on the
 * link; peers that never arrive, are killed mid-exchange or with adds in flight, or exited unreaped,
 * are named within the deadline, and teardown is bounded with a dead peer or operations still queued.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "epx_test.h"
#include "test_link_cases.h"

#define SLACK_MS 3000 /* a loaded 2-core machine: never check an upper bound tighter than deadline + this */
#define ADDS     1500 /* per (sender, receiver) in the mailbox case */

typedef struct lt_case {
    const char *name;
    int nranks;
    int (*fn)(lt_shared_t *sh, int rank, int nranks, uint64_t seed);
    int victim; /* a rank that ends by SIGKILL; -1: none */
} lt_case_t;

static int has(const char *text, const char *needle)
{
    if (strstr(text, needle)) return 1;
    fprintf(stderr, "pid %d: message '%s' lacks '%s'\n", (int)getpid(), text, needle);
    return 0;
}

static uint64_t elapsed_ms(double t0)
{
    return (uint64_t)((epx_test_now_s() - t0) * 1000.0);
}

static int exchange_simple(link_t *l, uint64_t serial, uint64_t word, char *err, size_t err_len)
{
    link_msg_t mine = {.serial = serial}, all[LT_MAX_RANKS];
    int fds[LT_MAX_RANKS];
    mine.words[0] = word;
    return link_exchange(l, &mine, -1, all, fds, err, err_len);
}

/* ---- connect and exchanges ---------------------------------------------------------------------- */

/* Handles, mailboxes, then rounds of exchanges, every fourth carrying a memfd whose bytes the peers
 * read back; fast ranks run ahead into the next round, whose messages the slow ones stash. */
static int case_connect(lt_shared_t *sh, int rank, int nranks, uint64_t seed)
{
    enum { ROUNDS = 24, BYTES = 300 };
    link_t l;
    EXPECT_EQ_INT(lt_join(sh, rank, 10000, 5, 0, &l, NULL, 0), 0);
    EXPECT_EQ_INT(l.rank, rank);
    EXPECT_EQ_INT(l.nranks, nranks);
    EXPECT_TRUE(l.inbox && l.inbox->slots == 8); /* 5 rounded up to a power of two */
    EXPECT_EQ_INT(l.inbox_name[0], 0);           /* every peer mapped it: the name is gone */
    for (int r = 0; r < nranks; r++) {
        EXPECT_EQ_INT(l.peers[r].pid, sh->pid[r]);
        EXPECT_TRUE(l.peers[r].mbox && l.peers[r].mbox->nranks == nranks);
        EXPECT_EQ_INT(l.peers[r].mbox->owner_pid, sh->pid[r]);
        EXPECT_TRUE(link_peer_alive(&l, r));
    }
    int stashed = 0;
    for (int round = 0; round < ROUNDS; round++) {
        link_msg_t mine = {.serial = 1 + (uint64_t)round, .kind = round}, all[LT_MAX_RANKS];
        int fds[LT_MAX_RANKS], fd = -1;
        mine.words[0] = seed ^ ((uint64_t)rank << 32 | (uint64_t)round);
        uint8_t bytes[BYTES];
        if (round % 4 == 0) {
            for (int i = 0; i < BYTES; i++) bytes[i] = lt_src_byte(rank, seed + (uint64_t)round, (uint64_t)i);
            fd = memfd_create("epx-gin-link-test-round", MFD_CLOEXEC);
            EXPECT_TRUE(fd >= 0 && pwrite(fd, bytes, BYTES, 0) == BYTES);
        }
        if (rank == round % nranks) usleep(2000); /* someone is always late */
        char err[256] = "";
        int rc = link_exchange(&l, &mine, fd, all, fds, err, sizeof(err));
        if (rc) fprintf(stderr, "rank %d round %d: %s\n", rank, round, err);
        EXPECT_EQ_INT(rc, 0);
        if (fd >= 0) close(fd);
        stashed += l.stash != NULL;
        for (int r = 0; r < nranks; r++) {
            EXPECT_EQ_INT(all[r].rank, r);
            EXPECT_EQ_INT(all[r].kind, round);
            EXPECT_TRUE(all[r].serial == 1 + (uint64_t)round);
            EXPECT_TRUE(all[r].words[0] == (seed ^ ((uint64_t)r << 32 | (uint64_t)round)));
            if (r == rank || round % 4) {
                EXPECT_EQ_INT(fds[r], -1);
                continue;
            }
            uint8_t got[BYTES];
            EXPECT_TRUE(fds[r] >= 0 && pread(fds[r], got, BYTES, 0) == BYTES);
            close(fds[r]);
            for (int i = 0; i < BYTES; i++)
                EXPECT_EQ_INT(got[i], lt_src_byte(r, seed + (uint64_t)round, (uint64_t)i));
        }
    }
    if (rank == 0)
        printf("  connect: %d of %d rounds ended with a later round's message stashed\n", stashed, ROUNDS);
    link_close(&l);
    EXPECT_EQ_INT(l.sock, -1);
    return 0;
}

/* ---- the mailbox -------------------------------------------------------------------------------- */

static uint64_t add_value(int sender, uint64_t ticket)
{
    return 1 + ((uint64_t)sender * 7919 + ticket * 104729) % 1000;
}

typedef struct mbox_run {
    link_t *l;
    int rank, nranks, bad;
    uint64_t sums[LT_NSIG], full_seen;
} mbox_run_t;

/* The receiving side: takes every sender's adds in ticket order, checks each slot's payload is the one
 * its ticket carries, applies and publishes. */
static void *mbox_receiver(void *arg)
{
    mbox_run_t *run = arg;
    uint64_t next[LT_MAX_RANKS] = {0};
    double end = epx_test_now_s() + 20.0;
    for (int done = 0, moved = 1; done < run->nranks && !run->bad;) {
        if (!moved) sched_yield(); /* many ranks' threads share few cores */
        done = moved = 0;
        for (int s = 0; s < run->nranks; s++) {
            link_slot_t slot;
            uint64_t t;
            int took;
            while ((took = link_add_take(run->l, s, &slot, &t)) == 1) {
                if (t != next[s] || slot.value != add_value(s, t) || slot.offset != 8 * (t % LT_NSIG) ||
                    slot.region != (uint64_t)s) {
                    fprintf(stderr,
                            "rank %d: sender %d ticket %llu (expected %llu) carries value %llu offset %llu\n",
                            run->rank, s, (unsigned long long)t, (unsigned long long)next[s],
                            (unsigned long long)slot.value, (unsigned long long)slot.offset);
                    run->bad = 1;
                }
                run->sums[t % LT_NSIG] += slot.value;
                moved = 1;
                next[s] = t + 1;
                link_add_applied(run->l, s, t);
            }
            if (took) run->bad = 1; /* nothing was refused: no ring may be in error */
            done += next[s] == ADDS;
        }
        if (epx_test_now_s() > end) {
            fprintf(stderr, "rank %d: the adds did not all arrive within 20 s\n", run->rank);
            run->bad = 1;
        }
    }
    return NULL;
}

/* The sending side: ADDS adds to every rank (itself too), interleaved; polls them in ticket order and
 * checks `applied` never goes back and covers every ticket polled done. */
static void *mbox_sender(void *arg)
{
    mbox_run_t *run = arg;
    uint64_t posted[LT_MAX_RANKS] = {0}, acked[LT_MAX_RANKS] = {0}, last_applied[LT_MAX_RANKS] = {0};
    double end = epx_test_now_s() + 20.0;
    for (int done = 0, moved = 1; done < run->nranks && !run->bad;) {
        if (!moved) sched_yield();
        done = moved = 0;
        for (int p = 0; p < run->nranks; p++) {
            char err[256];
            uint64_t t;
            if (posted[p] < ADDS) {
                int rc = link_add_post(run->l, p, (uint64_t)run->rank, 8 * (posted[p] % LT_NSIG),
                                       add_value(run->rank, posted[p]), &t, err, sizeof(err));
                if (!rc && t != posted[p]) run->bad = 1;
                if (!rc)
                    posted[p]++;
                else if (strstr(err, "full"))
                    run->full_seen++;
                else
                    run->bad = 1;
            }
            while (acked[p] < posted[p]) {
                int rc = link_add_poll(run->l, p, acked[p], err, sizeof(err));
                if (rc < 0) {
                    fprintf(stderr, "rank %d: add %llu to %d: %s\n", run->rank, (unsigned long long)acked[p],
                            p, err);
                    run->bad = 1;
                }
                if (rc != 1) break;
                acked[p]++;
                moved = 1;
            }
            uint64_t applied =
                __atomic_load_n(&link_ring(run->l->peers[p].mbox, run->rank)->applied, __ATOMIC_ACQUIRE);
            if (applied < last_applied[p] || applied < acked[p] || applied > posted[p]) run->bad = 1;
            last_applied[p] = applied;
            done += acked[p] == ADDS;
        }
        if (epx_test_now_s() > end) {
            fprintf(stderr, "rank %d: the adds were not all applied within 20 s\n", run->rank);
            run->bad = 1;
        }
    }
    return NULL;
}

/* Every rank adds to every rank's words from a sender thread while a receiver thread applies; rings of
 * 8 slots wrap many times. The sums are exact, every slot carries its own ticket's payload. */
static int case_mailbox(lt_shared_t *sh, int rank, int nranks, uint64_t seed)
{
    link_t l;
    EXPECT_EQ_INT(lt_join(sh, rank, 10000, 8, 0, &l, NULL, 0), 0);
    mbox_run_t run = {.l = &l, .rank = rank, .nranks = nranks};
    pthread_t tx, rx;
    EXPECT_EQ_INT(pthread_create(&rx, NULL, mbox_receiver, &run), 0);
    EXPECT_EQ_INT(pthread_create(&tx, NULL, mbox_sender, &run), 0);
    pthread_join(tx, NULL);
    pthread_join(rx, NULL);
    EXPECT_EQ_INT(run.bad, 0);
    for (int w = 0; w < LT_NSIG; w++) {
        uint64_t expect = 0;
        for (int s = 0; s < nranks; s++)
            for (uint64_t t = (uint64_t)w; t < ADDS; t += LT_NSIG) expect += add_value(s, t);
        EXPECT_TRUE(run.sums[w] == expect);
    }
    if (rank == 0)
        printf("  mailbox: rank 0 found a ring full %llu times\n", (unsigned long long)run.full_seen);
    /* Close as the plugin does: nobody leaves before every peer has said it posts nothing more. */
    link_mark_sender_done(&l);
    double end = epx_test_now_s() + 20.0;
    while (!link_peers_done(&l)) EXPECT_TRUE(epx_test_now_s() < end);
    link_close(&l);
    (void)seed;
    return 0;
}

/* Rank 1's add to an unknown region is refused with the owner's reason, and so is its next add, which
 * is never applied; rank 2's adds land. Then a ring holds 8 adds not applied, the 9th is refused as
 * full until the owner serves. */
static int case_refused(lt_shared_t *sh, int rank, int nranks, uint64_t seed)
{
    link_t l;
    lt_mover_t *m = calloc(1, sizeof(*m));
    char err[256] = "";
    uint64_t t0, t1, t;
    EXPECT_TRUE(m != NULL);
    EXPECT_EQ_INT(lt_join(sh, rank, 10000, 8, 0, &l, NULL, 0), 0);
    EXPECT_EQ_INT(lt_mover_init(m, &l, seed), 0);
    if (rank == 1) {
        EXPECT_EQ_INT(link_add_post(&l, 0, 99, 0, 5, &t0, err, sizeof(err)), 0);
        EXPECT_EQ_INT(link_add_post(&l, 0, LT_SIG_REGION, 8, 6, &t1, err, sizeof(err)), 0);
    } else if (rank == 2) {
        EXPECT_EQ_INT(link_add_post(&l, 0, LT_SIG_REGION, 8, 7, &t0, err, sizeof(err)), 0);
    }
    EXPECT_EQ_INT(lt_barrier(sh, 0, nranks), 0);
    if (rank == 0) {
        while (!m->server.idle(m)) EXPECT_EQ_INT(m->server.serve(m, err, sizeof(err)), 0);
        EXPECT_TRUE(m->refused == 1 && m->served == 1);
        EXPECT_TRUE(lt_sig(m, 1) == 7); /* rank 1's second add was published, never applied */
    }
    EXPECT_EQ_INT(lt_barrier(sh, 1, nranks), 0);
    if (rank == 1) {
        EXPECT_EQ_INT(link_add_poll(&l, 0, t0, err, sizeof(err)), -1);
        EXPECT_TRUE(has(err, "peer 0 refused") && has(err, "rank 0: no signal region #99"));
        EXPECT_EQ_INT(link_add_poll(&l, 0, t1, err, sizeof(err)), -1);
        EXPECT_TRUE(has(err, "peer 0 refused"));
    } else if (rank == 2) {
        EXPECT_EQ_INT(link_add_poll(&l, 0, t0, err, sizeof(err)), 1);
        for (int i = 0; i < 8; i++)
            EXPECT_EQ_INT(link_add_post(&l, 0, LT_SIG_REGION, 16, 1, &t, err, sizeof(err)), 0);
        EXPECT_EQ_INT(link_add_post(&l, 0, LT_SIG_REGION, 16, 1, &t, err, sizeof(err)), -1);
        EXPECT_TRUE(has(err, "mailbox of peer 0 full"));
        EXPECT_EQ_INT(link_add_poll(&l, 0, t, err, sizeof(err)), 0);
    }
    EXPECT_EQ_INT(lt_barrier(sh, 2, nranks), 0);
    if (rank == 0) {
        while (!m->server.idle(m)) EXPECT_EQ_INT(m->server.serve(m, err, sizeof(err)), 0);
        EXPECT_TRUE(lt_sig(m, 2) == 8);
    }
    EXPECT_EQ_INT(lt_barrier(sh, 3, nranks), 0);
    if (rank == 2) {
        EXPECT_EQ_INT(link_add_poll(&l, 0, t, err, sizeof(err)), 1);
        EXPECT_EQ_INT(link_add_post(&l, 0, LT_SIG_REGION, 16, 1, &t, err, sizeof(err)), 0);
    }
    link_mark_sender_done(&l);
    if (rank == 0) {
        double end = epx_test_now_s() + 20.0;
        while (!(link_peers_done(&l) && m->server.idle(m))) {
            EXPECT_EQ_INT(m->server.serve(m, err, sizeof(err)), 0);
            EXPECT_TRUE(epx_test_now_s() < end);
        }
        EXPECT_TRUE(lt_sig(m, 2) == 9);
    }
    EXPECT_EQ_INT(lt_barrier(sh, 4, nranks), 0);
    lt_mover_fini(m);
    link_close(&l);
    free(m);
    return 0;
}

/* ---- peers that never arrive, die, or exit unreaped ----------------------------------------------- */

/* The last rank publishes its handle but never connects: every other rank's connect fails at the
 * deadline naming it. */
static int case_absent(lt_shared_t *sh, int rank, int nranks, uint64_t seed)
{
    const uint64_t deadline = 1000;
    link_t l;
    char err[256] = "", want[64];
    if (rank == nranks - 1) {
        EXPECT_EQ_INT(lt_join(sh, rank, deadline, 8, 1, &l, NULL, 0), 0);
        return lt_wait_marker(sh, 0, 1); /* stay until rank 0 is done, so that the process exists */
    }
    double t0 = epx_test_now_s();
    EXPECT_EQ_INT(lt_join(sh, rank, deadline, 8, 0, &l, err, sizeof(err)), 2);
    uint64_t waited = elapsed_ms(t0);
    snprintf(want, sizeof(want), "rank %d (pid %d) did not answer within 1000 ms", nranks - 1,
             (int)sh->pid[nranks - 1]);
    EXPECT_TRUE(has(err, want));
    if (waited + 5 < deadline || waited > deadline + SLACK_MS) {
        fprintf(stderr, "rank %d: connect gave up after %llu ms, deadline %llu\n", rank,
                (unsigned long long)waited, (unsigned long long)deadline);
        return 1;
    }
    EXPECT_EQ_INT(lt_barrier(sh, 0, nranks - 1), 0);
    if (rank == 0) __atomic_store_n(&sh->marker[0], 1, __ATOMIC_RELEASE);
    (void)seed;
    return 0;
}

static void *kill_self_later(void *arg)
{
    usleep((useconds_t)(uintptr_t)arg);
    raise(SIGKILL);
    return NULL;
}

/* The last rank is killed while it waits in an exchange that rank 0 joins late: every survivor's
 * exchange (that one, or the next when it completed with the victim's message already in) fails naming
 * the dead rank, long before the 15 s deadline. */
static int case_killed_exchange(lt_shared_t *sh, int rank, int nranks, uint64_t seed)
{
    const uint64_t deadline = 15000;
    const int victim = nranks - 1;
    link_t l;
    char err[256] = "", want[64];
    EXPECT_EQ_INT(lt_join(sh, rank, deadline, 8, 0, &l, NULL, 0), 0);
    if (rank == victim) {
        pthread_t t;
        EXPECT_EQ_INT(pthread_create(&t, NULL, kill_self_later, (void *)(uintptr_t)100000), 0);
        exchange_simple(&l, 7, 7, err, sizeof(err));
        usleep(20000000); /* not reached: killed first */
        return 1;
    }
    if (rank == 0) usleep(400000);
    double t0 = epx_test_now_s();
    int rc = exchange_simple(&l, 7, 7, err, sizeof(err));
    if (rc == 0) rc = exchange_simple(&l, 8, 8, err, sizeof(err));
    uint64_t waited = elapsed_ms(t0);
    EXPECT_TRUE(rc != 0);
    snprintf(want, sizeof(want), "rank %d (pid %d) is gone", victim, (int)sh->pid[victim]);
    EXPECT_TRUE(has(err, want));
    EXPECT_TRUE(waited < deadline);
    EXPECT_EQ_INT(lt_barrier(sh, 0, nranks - 1), 0); /* no survivor leaves while another still looks */
    link_close(&l);
    (void)seed;
    return 0;
}

/* Adds in flight to a rank that is then killed: every sender's poll reports the peer gone. */
static int case_killed_adds(lt_shared_t *sh, int rank, int nranks, uint64_t seed)
{
    const int victim = nranks - 1;
    link_t l;
    char err[256] = "", want[64];
    uint64_t t = 0;
    EXPECT_EQ_INT(lt_join(sh, rank, 15000, 8, 0, &l, NULL, 0), 0);
    if (rank == victim) {
        for (int r = 0; r < nranks - 1; r++) EXPECT_EQ_INT(lt_wait_marker(sh, r, 1), 0);
        raise(SIGKILL);
        return 1;
    }
    for (int i = 0; i < 4; i++)
        EXPECT_EQ_INT(link_add_post(&l, victim, LT_SIG_REGION, 0, 1, &t, err, sizeof(err)), 0);
    EXPECT_EQ_INT(link_add_poll(&l, victim, t, err, sizeof(err)), 0);
    __atomic_store_n(&sh->marker[rank], 1, __ATOMIC_RELEASE);
    double t0 = epx_test_now_s();
    int rc;
    while ((rc = link_add_poll(&l, victim, t, err, sizeof(err))) == 0) {
        EXPECT_TRUE(epx_test_now_s() - t0 < 15.0);
        usleep(100);
    }
    EXPECT_EQ_INT(rc, -1);
    snprintf(want, sizeof(want), "peer %d (pid %d) is gone", victim, (int)sh->pid[victim]);
    EXPECT_TRUE(has(err, want));
    EXPECT_EQ_INT(lt_barrier(sh, 0, nranks - 1), 0);
    link_close(&l);
    (void)seed;
    return 0;
}

/* Link rank 1 is a child of rank 0's process that exits and is left unreaped (a zombie, which kill()
 * still reaches): rank 0's next exchange names it gone at once instead of waiting out 15 s. */
static int case_zombie(lt_shared_t *sh, int rank, int nranks, uint64_t seed)
{
    link_t l;
    char err[256] = "", want[64];
    sh->nranks = 2;
    pid_t child = fork();
    EXPECT_TRUE(child >= 0);
    if (child == 0) {
        int rc = lt_join(sh, 1, 15000, 8, 0, &l, NULL, 0) || lt_wait_marker(sh, 0, 1);
        link_close(&l);
        _exit(rc);
    }
    int rc = lt_join(sh, 0, 15000, 8, 0, &l, NULL, 0);
    __atomic_store_n(&sh->marker[0], 1, __ATOMIC_RELEASE);
    int status = 0;
    double t0 = epx_test_now_s();
    if (rc == 0) {
        /* Wait until it has exited, leaving it waitable (WNOWAIT): a zombie nobody reaped. */
        siginfo_t info;
        memset(&info, 0, sizeof(info));
        while (waitid(P_PID, (id_t)child, &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid != child &&
               epx_test_now_s() - t0 < 10.0)
            usleep(1000);
        rc = info.si_pid != child || link_peer_alive(&l, 1);
        if (rc) fprintf(stderr, "rank 0: link rank 1 (pid %d) did not exit, or is seen alive\n", (int)child);
    }
    if (rc == 0) {
        rc = exchange_simple(&l, 9, 9, err, sizeof(err)) == 0;
        snprintf(want, sizeof(want), "rank 1 (pid %d) is gone", (int)child);
        rc |= !has(err, want) || elapsed_ms(t0) >= 15000;
    }
    waitpid(child, &status, 0);
    EXPECT_EQ_INT(rc, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    link_close(&l);
    (void)rank, (void)nranks, (void)seed;
    return 0;
}

static const lt_case_t cases[] = {
    {"connect", 2, case_connect, -1},
    {"connect", 3, case_connect, -1},
    {"connect", 4, case_connect, -1},
    {"mailbox", 2, case_mailbox, -1},
    {"mailbox", 4, case_mailbox, -1},
    {"refused", 3, case_refused, -1},
    {"absent", 2, case_absent, -1},
    {"absent", 4, case_absent, -1},
    {"killed_exchange", 3, case_killed_exchange, 2},
    {"killed_exchange", 4, case_killed_exchange, 3},
    {"killed_adds", 3, case_killed_adds, 2},
    {"zombie", 1, case_zombie, -1},
    {"first_op_burst_teardown", 2, lt_case_burst, -1},
    {"first_op_burst_teardown", 4, lt_case_burst, -1},
    {"teardown_dead_peer", 3, lt_case_dead_teardown, 2},
    {"teardown_queued", 2, lt_case_queued_teardown, -1},
    {"failed_put", 2, lt_case_failed_put, -1},
};

static lt_shared_t *shared;
static uint64_t case_seed;

static int rank_main(int rank, int nranks, const epx_unique_id_t *id, void *ctx, void *result)
{
    const lt_case_t *c = ctx;
    (void)id, (void)result;
    int rc = c->fn(shared, rank, nranks, case_seed);
    if (rc)
        fprintf(stderr, "%s (%d ranks, seed %llu): rank %d failed\n", c->name, nranks,
                (unsigned long long)case_seed, rank);
    return rc;
}

int main(void)
{
    uint64_t seed = epx_test_seed();
    shared = mmap(NULL, sizeof(*shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shared == MAP_FAILED) return 1;
    int failed = 0;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const lt_case_t *c = &cases[i];
        memset(shared, 0, sizeof(*shared));
        shared->nranks = c->nranks;
        case_seed = seed + i;
        double t0 = epx_test_now_s();
        epx_harness_opts_t opts = {
            .name = c->name, .nranks = c->nranks, .fn = rank_main, .ctx = (void *)c, .timeout_s = 60};
        epx_harness_report_t rep;
        int rc = epx_harness_run(&opts, &rep);
        int ok = rc >= 0;
        for (int r = 0; r < c->nranks && ok; r++) {
            if (r == c->victim)
                ok = rep.outcome[r] == EPX_HARNESS_RANK_CRASHED && rep.detail[r] == SIGKILL;
            else
                ok = rep.outcome[r] == EPX_HARNESS_RANK_OK;
        }
        if (rc >= 0) epx_harness_report_free(&rep);
        printf("%s (%d ranks): %s in %.2f s\n", c->name, c->nranks, ok ? "ok" : "FAILED",
               epx_test_now_s() - t0);
        fflush(stdout);
        failed += !ok;
    }
    munmap(shared, sizeof(*shared));
    printf("%s\n", failed ? "gin link: FAILED" : "gin link: all passed");
    return failed ? 1 : 0;
}
