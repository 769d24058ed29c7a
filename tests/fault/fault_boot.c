/*
 * Bootstrap attacks as fault trials: connections to rank 0's rendezvous opened before a real job
 * starts (idle ones, half a hello, an oversized hello, a wrong secret, more idle connections than
 * rank 0 holds at once), or a second process claiming a rank. The job must succeed within its bound
 * (fail fast for the duplicate rank) and every attacker be dropped without receiving a byte.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "boot_io.h"
#include "core/bootstrap.h"
#include "fault.h"

#define MAX_ATTACKERS (EPX_BOOT_PENDING_MAX + 40)
/* A job's init under attack ends within this (rank start-up on a loaded 2-core machine included). */
#define JOB_BOUND_S        2.0
#define DUPLICATE_DELAY_MS 300

static const char *attack_names[FAULT_ATTACK_COUNT] = {
    "idle",           "partial hello",  "oversized hello", "wrong secret",
    "duplicate rank", "late duplicate", "many connections"};

const char *fault_attack_name(fault_attack_t attack)
{
    return attack < FAULT_ATTACK_COUNT ? attack_names[attack] : "?";
}

/* Sends the attack's bytes on fd; 0 on success. */
static int send_attack(fault_attack_t attack, const epx_unique_id_t *id, int nranks, int fd)
{
    unsigned char bytes[sizeof(epx_boot_hello_t) + 1000];
    epx_boot_hello_t h = boot_hello(id, nranks - 1, nranks);
    size_t n = 0;
    switch (attack) {
    case FAULT_ATTACK_PARTIAL: n = sizeof(h) / 2; break;
    case FAULT_ATTACK_OVERSIZED: n = sizeof(bytes); break;
    case FAULT_ATTACK_SECRET:
        h.tag[3] ^= 0x10;
        n = sizeof(h);
        break;
    default: return 0;
    }
    memset(bytes, 0x5a, sizeof(bytes));
    memcpy(bytes, &h, sizeof(h));
    return send(fd, bytes, n, MSG_NOSIGNAL) == (ssize_t)n ? 0 : 1;
}

/* Waits until the peer closes fd: 0 when it did within limit_s without sending a byte. */
static int dropped_within(int fd, double limit_s)
{
    const double end = fault_now() + limit_s;
    for (;;) {
        const double left = end - fault_now();
        struct pollfd p = {fd, POLLIN, 0};
        if (left <= 0 || poll(&p, 1, (int)(left * 1000) + 1) <= 0) {
            if (fault_now() >= end) return 1;
            continue;
        }
        char byte;
        const ssize_t n = recv(fd, &byte, 1, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno == ECONNRESET)) return 0;
        if (n > 0) return 2;
    }
}

int fault_boot_trial(fault_attack_t attack, int R, int timeout_ms, fault_rec_t *recs, char *why,
                     size_t why_len, int *hung)
{
    static int fds[MAX_ATTACKERS];
    *hung = 0;
    fault_plan_t plan;
    memset(&plan, 0, sizeof(plan));
    plan.R = R;
    plan.mode = FAULT_MODE_BOOT;
    plan.kill = FAULT_KILL_NONE;
    plan.backend = EPX_BACKEND_HOST;
    plan.timeout_ms = timeout_ms;
    plan.boot_procs = R;
    for (int r = 0; r < R; r++) plan.boot_rank[r] = r;
    const int duplicate = attack == FAULT_ATTACK_DUPLICATE || attack == FAULT_ATTACK_LATE_DUPLICATE;
    if (duplicate) {
        /* Process R claims rank 1 too: before rank 0 starts its rendezvous (both claims wait in its
         * backlog), or once the job has formed. */
        plan.boot_procs = R + 1;
        plan.boot_rank[R] = 1;
        /* Within a third of the timeout, so that the ranks waiting for rank 0 do not time out first. */
        plan.boot_delay_ms[attack == FAULT_ATTACK_DUPLICATE ? 0 : R] =
            timeout_ms / 3 < DUPLICATE_DELAY_MS ? timeout_ms / 3 : DUPLICATE_DELAY_MS;
    }
    epx_unique_id_t id;
    if (epx_get_unique_id(&id) != EPX_SUCCESS) {
        snprintf(why, why_len, "epx_get_unique_id: %s", epx_last_error_message());
        return 1;
    }
    const int nattack = attack == FAULT_ATTACK_MANY   ? MAX_ATTACKERS
                        : attack == FAULT_ATTACK_IDLE ? 4
                        : duplicate                   ? 0
                                                      : 1;
    int rc = 0;
    const double t_attack = fault_now();
    for (int i = 0; i < nattack; i++) {
        fds[i] = boot_connect(&id);
        if (fds[i] < 0 || send_attack(attack, &id, R, fds[i])) {
            snprintf(why, why_len, "attacker %d could not connect or send: %s", i, strerror(errno));
            for (int j = 0; j <= i; j++)
                if (fds[j] >= 0) close(fds[j]);
            return 1;
        }
    }
    fault_run_t run;
    if (fault_run_ranks(&plan, &id, recs, &run)) {
        snprintf(why, why_len, "the job could not start");
        rc = 1;
    }
    for (int p = 0; p < plan.boot_procs && !rc; p++) {
        const fault_rec_t *rec = &recs[p];
        const char *got = rec->err_call >= 0 ? epx_result_name((epx_result_t)rec->err_res) : "SUCCESS";
        /* A duplicate within the rendezvous makes it fail for all, fast. A latecomer finds nobody
         * listening and tries until its timeout, as for a rank 0 that has not started yet. */
        const int late = attack == FAULT_ATTACK_LATE_DUPLICATE && p == R;
        const int must_fail = attack == FAULT_ATTACK_DUPLICATE || late;
        const epx_result_t want = late ? EPX_ERR_TIMEOUT : EPX_ERR_BOOTSTRAP;
        const double bound = late ? timeout_ms * 1e-3 + 0.5 : JOB_BOUND_S;
        if (run.hung[p]) {
            *hung = 1;
            snprintf(why, why_len, "process %d (rank %d) still in the job after %.1f s", p, plan.boot_rank[p],
                     timeout_ms * 1e-3 + 2.0);
        } else if (!WIFEXITED(run.status[p]) || WEXITSTATUS(run.status[p]) != 0) {
            snprintf(why, why_len, "process %d (rank %d) ended with status 0x%x after init %s: %s", p,
                     plan.boot_rank[p], run.status[p], got, rec->err_msg);
        } else if (must_fail ? rec->err_res != (int)want || rec->err_call != 0 : rec->err_call >= 0) {
            snprintf(why, why_len, "process %d (rank %d): %s returned %s, expected %s: %s", p,
                     plan.boot_rank[p], rec->err_call >= 0 ? rec->err_what : "epx_comm_init", got,
                     must_fail ? epx_result_name(want) : "SUCCESS", rec->err_msg);
        } else if (rec->t_init > bound) {
            snprintf(why, why_len, "process %d: init took %.3f s, bound %.1f s", p, rec->t_init, bound);
        } else {
            continue;
        }
        rc = 1;
    }
    /* Every attacker is dropped without a byte: at once once the job is over; a partial hello after
     * EPX_BOOT_HELLO_MS from its connection at the latest. */
    for (int i = 0; i < nattack; i++) {
        const double limit =
            attack == FAULT_ATTACK_PARTIAL ? t_attack + EPX_BOOT_HELLO_MS * 1e-3 + 0.5 - fault_now() : 1.0;
        const int d = dropped_within(fds[i], limit > 0.05 ? limit : 0.05);
        if (d && !rc) {
            snprintf(why, why_len, "attacker %d %s", i,
                     d == 2 ? "received a byte" : "was not dropped in time");
            rc = 1;
        }
        close(fds[i]);
    }
    return rc;
}
