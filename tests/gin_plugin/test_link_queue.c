/*
 * The link test's cases for the queue core over the link (the plugin's path without CUDA): a CPU mover
 * whose puts land in the peer's shared memory and whose adds the owner applies from its mailbox, and
 * the plugin's close sequence (teardown.c). The failure classes of a CPU-assisted network path: the
 * first operation lands as posted; teardown right after a burst completes; teardown with a dead peer
 * or an operation still queued ends within its deadline naming rank, peer and operation; an injected
 * failure is an error naming them, never a hang.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "epx_test.h"
#include "test_link_cases.h"

#define CONTEXT 5
#define BURST   48

/* One rank: its link, mover, queue context, and a thread that serves its inbox as NCCL's GIN progress
 * thread does between polls. */
typedef struct qrank {
    link_t l;
    lt_mover_t m;
    ginq_t *q;
    pthread_t server;
    int serving, stop;
} qrank_t;

static void *serve_loop(void *arg)
{
    qrank_t *r = arg;
    char err[256];
    while (!__atomic_load_n(&r->stop, __ATOMIC_ACQUIRE)) {
        r->m.server.serve(&r->m, err, sizeof(err));
        usleep(50);
    }
    return NULL;
}

static int qrank_open(qrank_t *r, lt_shared_t *sh, int rank, const char *faults, uint64_t seed, int serve)
{
    ginq_config_t cfg = {.rank = rank, .nranks = sh->nranks, .context = CONTEXT, .capacity = 256};
    char err[256] = "";
    EXPECT_EQ_INT(lt_join(sh, rank, 10000, 256, 0, &r->l, NULL, 0), 0);
    EXPECT_EQ_INT(lt_mover_init(&r->m, &r->l, seed), 0);
    EXPECT_EQ_INT(ginq_faults_parse(faults, &cfg.faults, err, sizeof(err)), GINQ_OK);
    if (ginq_create(&cfg, &r->m.iface, err, sizeof(err), &r->q) != GINQ_OK) {
        fprintf(stderr, "rank %d: %s\n", rank, err);
        return 1;
    }
    if (serve) EXPECT_EQ_INT(pthread_create(&r->server, NULL, serve_loop, r), 0);
    r->serving = serve;
    return 0;
}

static void qrank_close(qrank_t *r)
{
    if (r->serving) {
        __atomic_store_n(&r->stop, 1, __ATOMIC_RELEASE);
        pthread_join(r->server, NULL);
    }
    ginq_destroy(r->q);
    lt_mover_fini(&r->m);
    link_close(&r->l);
}

static ginq_desc_t put_signal(qrank_t *r, int peer, uint64_t off, size_t bytes, int word, uint64_t value)
{
    return (ginq_desc_t){.peer = peer,
                         .src = &r->m.src_region.core,
                         .src_off = off,
                         .dst = &r->m.dst_region.core,
                         .dst_off = off,
                         .bytes = bytes,
                         .signal_op = value ? GINQ_SIGNAL_ADD : GINQ_SIGNAL_INC,
                         .signal = &r->m.sig_region.core,
                         .signal_off = 8 * (uint64_t)word,
                         .signal_value = value};
}

/* Drives progress until `req` is reported; its result, with the failure's message in msg. */
static ginq_result_t wait_req(qrank_t *r, ginq_req_t *req, char *msg, size_t len)
{
    int done = 0;
    double end = epx_test_now_s() + 20.0;
    ginq_result_t res = GINQ_OK;
    while (!done && epx_test_now_s() < end) {
        ginq_progress(r->q);
        res = ginq_test(r->q, req, &done, msg, len);
    }
    return done ? res : GINQ_ETIMEDOUT;
}

/* The seeded bytes of `rank` at [off, off + bytes) landed in this rank's data region. */
static int landed(qrank_t *r, int rank, uint64_t seed, uint64_t off, size_t bytes)
{
    for (size_t i = 0; i < bytes; i++)
        if (r->m.data[r->m.rank][off + i] != lt_src_byte(rank, seed, off + i)) return 0;
    return 1;
}

/* The first operation: each rank sends a put with a signal to the next; what the receiver sees when the
 * signal reaches the value posted is the source as posted. Then a burst to every rank (itself too) and
 * teardown at once: it drains and returns OK within its deadline, every request done, every signal
 * exact and every byte landed. */
int lt_case_burst(lt_shared_t *sh, int rank, int nranks, uint64_t seed)
{
    qrank_t *r = calloc(1, sizeof(*r));
    char msg[256] = "";
    EXPECT_TRUE(r && qrank_open(r, sh, rank, NULL, seed, 1) == 0);
    const int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
    ginq_desc_t d = put_signal(r, next, 256 * (uint64_t)rank, 256, 0, 1000 + (uint64_t)rank);
    ginq_req_t *first, *reqs[BURST * LT_MAX_RANKS];
    EXPECT_EQ_INT(ginq_post(r->q, &d, &first), GINQ_OK);
    EXPECT_EQ_INT(wait_req(r, first, msg, sizeof(msg)), GINQ_OK);
    double end = epx_test_now_s() + 20.0;
    while (lt_sig(&r->m, 0) == 0) EXPECT_TRUE(epx_test_now_s() < end);
    EXPECT_TRUE(lt_sig(&r->m, 0) == 1000 + (uint64_t)prev);
    EXPECT_TRUE(landed(r, prev, seed, 256 * (uint64_t)prev, 256));

    int n = 0;
    for (int k = 0; k < BURST; k++) {
        for (int p = 0; p < nranks; p++) {
            d = put_signal(r, p, 2048 + 8 * (uint64_t)(rank * BURST + k), 8, 1 + rank, 0);
            EXPECT_EQ_INT(ginq_post(r->q, &d, &reqs[n++]), GINQ_OK);
        }
        ginq_progress(r->q);
    }
    const uint64_t deadline = 10000;
    double t0 = epx_test_now_s();
    ginq_result_t res = gin_teardown(r->q, &r->l, &r->m.server, rank, CONTEXT, deadline, msg, sizeof(msg));
    uint64_t waited = (uint64_t)((epx_test_now_s() - t0) * 1000);
    if (res != GINQ_OK) fprintf(stderr, "rank %d: teardown: %s\n", rank, msg);
    EXPECT_EQ_INT(res, GINQ_OK);
    EXPECT_TRUE(waited < deadline);
    for (int i = 0; i < n; i++) {
        int done = 0;
        EXPECT_EQ_INT(ginq_test(r->q, reqs[i], &done, msg, sizeof(msg)), GINQ_OK);
        EXPECT_EQ_INT(done, 1);
    }
    /* Every peer closed after its operations completed, so everything sent here has landed. */
    for (int s = 0; s < nranks; s++) {
        EXPECT_TRUE(lt_sig(&r->m, 1 + s) == BURST);
        EXPECT_TRUE(landed(r, s, seed, 2048 + 8 * (uint64_t)(s * BURST), 8 * BURST));
    }
    qrank_close(r);
    free(r);
    return 0;
}

/* The last rank is killed with a put-signal from every survivor in flight to it: each survivor's
 * teardown ends within its deadline with the failure naming rank, operation and the dead peer. */
int lt_case_dead_teardown(lt_shared_t *sh, int rank, int nranks, uint64_t seed)
{
    const int victim = nranks - 1;
    qrank_t *r = calloc(1, sizeof(*r));
    char msg[256] = "", want[128];
    EXPECT_TRUE(r && qrank_open(r, sh, rank, NULL, seed, rank != victim) == 0);
    if (rank == victim) {
        for (int s = 0; s < victim; s++) EXPECT_EQ_INT(lt_wait_marker(sh, s, 1), 0);
        raise(SIGKILL);
        return 1;
    }
    ginq_req_t *to_victim, *to_peer;
    ginq_desc_t d = put_signal(r, victim, 0, 64, 0, 1);
    EXPECT_EQ_INT(ginq_post(r->q, &d, &to_victim), GINQ_OK);
    d = put_signal(r, (rank + 1) % victim, 64, 64, 1, 1);
    EXPECT_EQ_INT(ginq_post(r->q, &d, &to_peer), GINQ_OK);
    for (int i = 0; i < 10; i++) ginq_progress(r->q);
    __atomic_store_n(&sh->marker[rank], 1, __ATOMIC_RELEASE);
    const uint64_t deadline = 5000;
    double t0 = epx_test_now_s();
    ginq_result_t res = gin_teardown(r->q, &r->l, &r->m.server, rank, CONTEXT, deadline, msg, sizeof(msg));
    uint64_t waited = (uint64_t)((epx_test_now_s() - t0) * 1000);
    EXPECT_TRUE(res == GINQ_EFAILED || res == GINQ_ETIMEDOUT);
    EXPECT_TRUE(waited <= deadline + 3000);
    snprintf(want, sizeof(want),
             "rank %d: put-signal #1 to peer %d on context %d failed: peer %d (pid %d) is gone", rank, victim,
             CONTEXT, victim, (int)sh->pid[victim]);
    int done = 0;
    EXPECT_EQ_INT(ginq_test(r->q, to_victim, &done, msg, sizeof(msg)), GINQ_EFAILED);
    EXPECT_TRUE(done && strstr(msg, want));
    ginq_test(r->q, to_peer, &done, msg, sizeof(msg));
    EXPECT_EQ_INT(done, 1);
    EXPECT_EQ_INT(lt_barrier(sh, 0, victim), 0);
    qrank_close(r);
    free(r);
    return 0;
}

/* Operations held by a delay fault far past the deadline: teardown ends at its deadline with them
 * abandoned, the message naming rank, peer, operation and where it was stuck; the peer's signal word
 * never moves. */
int lt_case_queued_teardown(lt_shared_t *sh, int rank, int nranks, uint64_t seed)
{
    qrank_t *r = calloc(1, sizeof(*r));
    char msg[256] = "", want[160];
    EXPECT_TRUE(r && qrank_open(r, sh, rank, "delay_us=60000000", seed, 1) == 0);
    const int peer = 1 - rank;
    ginq_req_t *req;
    ginq_desc_t d = put_signal(r, peer, 0, 64, 0, 1);
    EXPECT_EQ_INT(ginq_post(r->q, &d, &req), GINQ_OK);
    const uint64_t deadline = 1000;
    double t0 = epx_test_now_s();
    ginq_result_t res = gin_teardown(r->q, &r->l, &r->m.server, rank, CONTEXT, deadline, msg, sizeof(msg));
    uint64_t waited = (uint64_t)((epx_test_now_s() - t0) * 1000);
    EXPECT_EQ_INT(res, GINQ_ETIMEDOUT);
    snprintf(want, sizeof(want), "rank %d: context %d closed with 1 operations abandoned after the 1000 ms",
             rank, CONTEXT);
    EXPECT_TRUE(strstr(msg, want) != NULL || (fprintf(stderr, "'%s' lacks '%s'\n", msg, want), 0));
    if (waited + 5 < deadline || waited > deadline + 3000) {
        fprintf(stderr, "rank %d: teardown took %llu ms, deadline %llu\n", rank, (unsigned long long)waited,
                (unsigned long long)deadline);
        return 1;
    }
    int done = 0;
    EXPECT_EQ_INT(ginq_test(r->q, req, &done, msg, sizeof(msg)), GINQ_EFAILED);
    snprintf(want, sizeof(want), "rank %d: put-signal #1 to peer %d on context %d abandoned at close", rank,
             peer, CONTEXT);
    EXPECT_TRUE(done && strstr(msg, want) && strstr(msg, "still held by the delay fault"));
    EXPECT_EQ_INT(lt_barrier(sh, 0, nranks), 0);
    EXPECT_TRUE(lt_sig(&r->m, 0) == 0);
    qrank_close(r);
    free(r);
    return 0;
}

/* Rank 0's first operation fails (fail_nth=1): its request and its teardown report it naming rank,
 * peer and operation; nothing lands at rank 1, whose teardown is clean. */
int lt_case_failed_put(lt_shared_t *sh, int rank, int nranks, uint64_t seed)
{
    qrank_t *r = calloc(1, sizeof(*r));
    char msg[256] = "";
    const char *want = "rank 0: put-signal #1 to peer 1 on context 5 failed: injected fault (fail_nth=1)";
    EXPECT_TRUE(r && qrank_open(r, sh, rank, rank == 0 ? "fail_nth=1" : NULL, seed, 1) == 0);
    const uint64_t deadline = 3000;
    double t0 = epx_test_now_s();
    if (rank == 0) {
        ginq_req_t *req;
        ginq_desc_t d = put_signal(r, 1, 0, 64, 0, 1);
        EXPECT_EQ_INT(ginq_post(r->q, &d, &req), GINQ_OK);
        EXPECT_EQ_INT(wait_req(r, req, msg, sizeof(msg)), GINQ_EFAILED);
        EXPECT_TRUE(strstr(msg, want) != NULL);
        EXPECT_EQ_INT(ginq_post(r->q, &d, &req), GINQ_EFAILED); /* a context in error refuses posts */
    }
    ginq_result_t res = gin_teardown(r->q, &r->l, &r->m.server, rank, CONTEXT, deadline, msg, sizeof(msg));
    EXPECT_EQ_INT(res, rank == 0 ? GINQ_EFAILED : GINQ_OK);
    if (rank == 0) EXPECT_TRUE(strstr(msg, want) != NULL);
    EXPECT_TRUE(epx_test_now_s() - t0 < (deadline + 3000) / 1000.0);
    if (rank == 1) {
        EXPECT_TRUE(lt_sig(&r->m, 0) == 0);
        EXPECT_TRUE(!landed(r, 0, seed, 0, 64));
    }
    qrank_close(r);
    free(r);
    (void)nranks;
    return 0;
}
