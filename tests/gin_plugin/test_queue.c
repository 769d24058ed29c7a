/*
 * CPU tests of the test GIN plugin's queue core (tests/gin_plugin/queue.h) over a memcpy / __atomic
 * mover that can land transfers late, stall a peer or fail one: ordering over many reorder seeds,
 * weak signals, delay, fail_nth and its messages, teardown bounded by its deadline, posting and
 * progress on separate threads (ThreadSanitizer in the tsan build), and bad input.
 */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epx_test.h"
#include "fixture.h"

#define SEEDS 300

/* Runs progress until nothing is outstanding, for at most 5 s. */
static int drain(ginq_t *q)
{
    double end = epx_test_now_s() + 5.0;
    while (ginq_outstanding(q) > 0) {
        EXPECT_EQ_INT(ginq_progress(q), GINQ_OK);
        EXPECT_TRUE(epx_test_now_s() < end);
    }
    return 0;
}

/* Posts d[0..n) in order (request i to reqs[i]), then `rounds` progress calls; each must succeed. */
static int post_progress(ginq_t *q, const ginq_desc_t *d, int n, ginq_req_t **reqs, int rounds)
{
    for (int i = 0; i < n; i++) EXPECT_EQ_INT(ginq_post(q, &d[i], &reqs[i]), GINQ_OK);
    for (int i = 0; i < rounds; i++) EXPECT_EQ_INT(ginq_progress(q), GINQ_OK);
    return 0;
}

/* A fixture of `seed` (not lazy) and a queue on it (queue_new's arguments); NULL when either failed. */
static ginq_t *fixture_queue(fixture_t **f, uint64_t seed, int context, int capacity, const char *faults)
{
    *f = fixture_new(seed, 0);
    return *f ? queue_new(*f, context, capacity, faults) : NULL;
}

static int expect_has(const char *text, const char *needle)
{
    if (strstr(text, needle)) return 0;
    fprintf(stderr, "message '%s' lacks '%s'\n", text, needle);
    return 1;
}

/* The end of a test whose queue has nothing left to do: a clean close, then the queue and the fixture
 * freed. */
static int close_clean(fixture_t *f, ginq_t *q)
{
    EXPECT_EQ_INT(ginq_close(q, 100), GINQ_OK);
    ginq_destroy(q);
    free(f);
    return 0;
}

/* ---- ordering ------------------------------------------------------------------------------------ */

/* One seed: random puts, put-signals (strong or weak) and signals posted between progress passes;
 * checks every strong signal landed after every earlier put, every weak one after its own, and the
 * bytes and signal words. Counts puts the core issued out of post order, puts that landed out of
 * it, and weak signals that overtook an earlier put. */
static int ordering_case(uint64_t seed, int reorder, int *issue_inversions, int *inversions, int *weak_early)
{
    enum { NOPS = 48 };
    fixture_t *f = fixture_new(seed, reorder);
    char faults[64];
    snprintf(faults, sizeof(faults), "reorder=%d,seed=%llu", reorder, (unsigned long long)seed);
    ginq_t *q = f ? queue_new(f, 1, NOPS, faults) : NULL;
    EXPECT_TRUE(q != NULL);
    uint64_t rng = seed ^ 0x5eed;
    uint64_t expect_sig[NR][NSIG] = {{0}};
    int peer_of[NOPS + 1] = {0}, has_put[NOPS + 1] = {0}, weak[NOPS + 1] = {0};
    ginq_req_t *reqs[NOPS];
    for (int i = 0; i < NOPS; i++) {
        int kind = (int)(epx_test_rand(&rng) % 4), peer = 1 + (int)(epx_test_rand(&rng) % 2);
        ginq_desc_t d = put_desc(f, peer, i);
        if (kind == 3) d.bytes = 0;
        if (kind >= 2) {
            int id = (int)(epx_test_rand(&rng) % NSIG), is_weak = kind == 2 && (epx_test_rand(&rng) & 1);
            uint64_t value = 1 + epx_test_rand(&rng) % 5;
            add_signal(f, &d, id, value == 1 ? GINQ_SIGNAL_INC : GINQ_SIGNAL_ADD, value, is_weak);
            expect_sig[peer][id] += value;
            weak[i + 1] = is_weak;
        }
        peer_of[i + 1] = peer;
        has_put[i + 1] = d.bytes > 0;
        EXPECT_EQ_INT(ginq_post(q, &d, &reqs[i]), GINQ_OK);
        if (epx_test_rand(&rng) % 3 == 0) EXPECT_EQ_INT(ginq_progress(q), GINQ_OK);
    }
    if (drain(q)) return 1;
    int put_at[NOPS + 1], last_put = 0;
    for (int o = 0; o <= NOPS; o++) put_at[o] = -1;
    for (int i = 0; i < f->mover.nlog; i++) {
        const event_t *e = &f->mover.log[i];
        if (!e->is_signal) {
            put_at[e->ordinal] = i;
            *inversions += e->ordinal < (uint64_t)last_put;
            last_put = (int)e->ordinal;
            continue;
        }
        int s = (int)e->ordinal;
        if (has_put[s] && (put_at[s] < 0 || put_at[s] > i)) {
            fprintf(stderr, "seed %llu: signal #%d landed before its own put\n", (unsigned long long)seed, s);
            return 1;
        }
        for (int o = 1; o < s; o++) {
            if (!has_put[o] || put_at[o] >= 0) continue;
            if (!weak[s]) {
                fprintf(stderr, "seed %llu: strong signal #%d landed before put #%d\n",
                        (unsigned long long)seed, s, o);
                return 1;
            }
            (*weak_early)++;
            break;
        }
    }
    for (int i = 1; i < f->mover.nissued; i++)
        *issue_inversions += f->mover.put_issued[i] < f->mover.put_issued[i - 1];
    if (!reorder && (*inversions || *issue_inversions)) {
        fprintf(stderr, "seed %llu: puts issued or landed out of post order without reorder\n",
                (unsigned long long)seed);
        return 1;
    }
    for (int o = 1; o <= NOPS; o++)
        if (has_put[o]) EXPECT_TRUE(chunk_landed(f, peer_of[o], o - 1));
    for (int r = 0; r < NR; r++)
        for (int s = 0; s < NSIG; s++) EXPECT_EQ_INT(f->sig[r][s], expect_sig[r][s]);
    for (int i = 0; i < NOPS; i++) {
        int done = 0;
        EXPECT_EQ_INT(ginq_test(q, reqs[i], &done, NULL, 0), GINQ_OK);
        EXPECT_EQ_INT(done, 1);
    }
    EXPECT_EQ_INT(f->mover.released, f->mover.nlog);
    return close_clean(f, q);
}

static int test_ordering(void)
{
    uint64_t base = epx_test_seed();
    int issue_inversions = 0, inversions = 0, weak_early = 0, in_order[2] = {0, 0}, unused = 0;
    for (uint64_t s = 0; s < SEEDS; s++) {
        if (ordering_case(base + s, 1, &issue_inversions, &inversions, &weak_early)) {
            fprintf(stderr, "ordering failed with reorder, seed %llu\n", (unsigned long long)(base + s));
            return 1;
        }
    }
    for (uint64_t s = 0; s < 20; s++)
        EXPECT_EQ_INT(ordering_case(base + s, 0, &in_order[0], &in_order[1], &unused), 0);
    /* Reorder must really reorder, or the checks above prove nothing. */
    EXPECT_TRUE(issue_inversions > 0);
    EXPECT_TRUE(inversions > 0);
    EXPECT_TRUE(weak_early > 0);
    printf(
        "ordering: %d seeds, puts out of post order: %d issued, %d landed; %d weak signals ahead of earlier "
        "puts\n",
        SEEDS, issue_inversions, inversions, weak_early);
    return 0;
}

/* A stalled put: a later weak put-signal lands without it, a later strong signal waits for it. */
static int test_weak_signal(void)
{
    fixture_t *f;
    ginq_t *q = fixture_queue(&f, 1, 0, 8, "");
    EXPECT_TRUE(q != NULL);
    ginq_req_t *reqs[3];
    ginq_desc_t d[3] = {put_desc(f, 1, 0), put_desc(f, 1, 1), {.peer = 1}};
    add_signal(f, &d[1], 0, GINQ_SIGNAL_INC, 0, 1);
    add_signal(f, &d[2], 1, GINQ_SIGNAL_ADD, 7, 0);
    f->mover.stall_ordinal = 1;
    if (post_progress(q, d, 3, reqs, 20)) return 1;
    EXPECT_EQ_INT(__atomic_load_n(&f->sig[1][0], __ATOMIC_ACQUIRE), 1);
    EXPECT_TRUE(chunk_landed(f, 1, 1));
    EXPECT_TRUE(!chunk_landed(f, 1, 0));
    EXPECT_EQ_INT(__atomic_load_n(&f->sig[1][1], __ATOMIC_ACQUIRE), 0);
    int done = -1;
    EXPECT_EQ_INT(ginq_test(q, reqs[1], &done, NULL, 0), GINQ_OK);
    EXPECT_EQ_INT(done, 1);
    EXPECT_EQ_INT(ginq_test(q, reqs[2], &done, NULL, 0), GINQ_OK);
    EXPECT_EQ_INT(done, 0);
    f->mover.stall_ordinal = 0;
    if (drain(q)) return 1;
    EXPECT_TRUE(chunk_landed(f, 1, 0));
    EXPECT_EQ_INT(f->sig[1][1], 7);
    return close_clean(f, q);
}

/* ---- faults -------------------------------------------------------------------------------------- */

static int test_delay(void)
{
    fixture_t *f;
    ginq_t *q = fixture_queue(&f, 2, 0, 8, "delay_us=30000");
    EXPECT_TRUE(q != NULL);
    ginq_req_t *req;
    ginq_desc_t d = put_desc(f, 2, 3);
    double t0 = epx_test_now_s();
    if (post_progress(q, &d, 1, &req, 5)) return 1;
    if (epx_test_now_s() - t0 < 0.025) EXPECT_TRUE(!chunk_landed(f, 2, 3));
    if (drain(q)) return 1;
    double waited = epx_test_now_s() - t0;
    EXPECT_TRUE(waited >= 0.030 && waited < 2.0);
    EXPECT_TRUE(chunk_landed(f, 2, 3));
    int done = 0;
    EXPECT_EQ_INT(ginq_test(q, req, &done, NULL, 0), GINQ_OK);
    EXPECT_EQ_INT(ginq_close(q, 100), GINQ_OK);
    ginq_destroy(q);

    /* delay_nth holds only that operation: the first lands at once, the second waits. */
    q = queue_new(f, 0, 8, "delay_us=10000000,delay_nth=2");
    EXPECT_TRUE(q != NULL);
    ginq_req_t *reqs[2];
    const ginq_desc_t d2[2] = {put_desc(f, 1, 4), put_desc(f, 1, 5)};
    if (post_progress(q, d2, 2, reqs, 5)) return 1;
    EXPECT_TRUE(chunk_landed(f, 1, 4));
    EXPECT_TRUE(!chunk_landed(f, 1, 5));
    EXPECT_EQ_INT(ginq_outstanding(q), 1);
    t0 = epx_test_now_s();
    EXPECT_EQ_INT(ginq_close(q, 50), GINQ_ETIMEDOUT);
    EXPECT_TRUE(epx_test_now_s() - t0 < 1.0);
    char msg[256];
    EXPECT_EQ_INT(ginq_test(q, reqs[1], &done, msg, sizeof(msg)), GINQ_EFAILED);
    if (expect_has(msg, "put #2 to peer 1 on context 0 abandoned at close") ||
        expect_has(msg, "held by the delay fault"))
        return 1;
    ginq_destroy(q);
    free(f);
    return 0;
}

static int test_fail_nth(void)
{
    fixture_t *f;
    ginq_t *q = fixture_queue(&f, 3, 2, 16, "fail_nth=3");
    EXPECT_TRUE(q != NULL);
    ginq_req_t *reqs[6];
    ginq_desc_t d[6] = {[5] = {.peer = 1}};
    for (int i = 0; i < 5; i++) d[i] = put_desc(f, 1, i);
    add_signal(f, &d[5], 2, GINQ_SIGNAL_INC, 0, 0);
    /* Two puts land; then puts 3 to 5 and a signal, the first of them failing. */
    if (post_progress(q, d, 2, reqs, 0) || drain(q) || post_progress(q, d + 2, 4, reqs + 2, 0)) return 1;
    EXPECT_EQ_INT(ginq_progress(q), GINQ_EFAILED);
    EXPECT_EQ_INT(ginq_outstanding(q), 0);
    EXPECT_EQ_INT(f->sig[1][2], 0); /* the signal covering the failed put is never applied */
    char msg[256];
    int done = 0;
    for (int i = 0; i < 2; i++) EXPECT_EQ_INT(ginq_test(q, reqs[i], &done, msg, sizeof(msg)), GINQ_OK);
    EXPECT_EQ_INT(ginq_test(q, reqs[2], &done, msg, sizeof(msg)), GINQ_EFAILED);
    EXPECT_EQ_INT(done, 1);
    if (expect_has(msg, "rank 0: put #3 to peer 1 on context 2 failed: injected fault (fail_nth=3)"))
        return 1;
    EXPECT_EQ_INT(ginq_test(q, reqs[5], &done, msg, sizeof(msg)), GINQ_EFAILED);
    if (expect_has(msg, "rank 0: signal #6 to peer 1 on context 2 abandoned: the context failed at put #3"))
        return 1;
    for (int i = 3; i < 5; i++) EXPECT_EQ_INT(ginq_test(q, reqs[i], &done, NULL, 0), GINQ_EFAILED);
    EXPECT_EQ_INT(ginq_failed(q, msg, sizeof(msg)), 1);
    if (expect_has(msg, "put #3 to peer 1 on context 2 failed")) return 1;
    const ginq_desc_t after = put_desc(f, 1, 9);
    ginq_req_t *late = NULL;
    EXPECT_EQ_INT(ginq_post(q, &after, &late), GINQ_EFAILED);
    EXPECT_TRUE(late == NULL);
    ginq_message(q, msg, sizeof(msg));
    if (expect_has(msg, "the context is in error")) return 1;
    EXPECT_EQ_INT(ginq_close(q, 1000), GINQ_EFAILED);
    ginq_destroy(q);

    /* A transfer the mover fails names the peer and the mover's reason. */
    f->mover.fail_peer = 2;
    q = queue_new(f, 1, 4, "");
    EXPECT_TRUE(q != NULL);
    ginq_desc_t dp = put_desc(f, 2, 0);
    EXPECT_EQ_INT(ginq_post(q, &dp, &reqs[0]), GINQ_OK);
    EXPECT_EQ_INT(ginq_progress(q), GINQ_EFAILED);
    EXPECT_EQ_INT(ginq_test(q, reqs[0], &done, msg, sizeof(msg)), GINQ_EFAILED);
    if (expect_has(msg, "rank 0: put #1 to peer 2 on context 1 failed: peer 2 unreachable")) return 1;
    ginq_destroy(q);
    free(f);
    return 0;
}

static int test_fault_spec(void)
{
    ginq_faults_t faults = {.seed = 99};
    char err[256] = "";
    EXPECT_EQ_INT(
        ginq_faults_parse("delay_us=200,reorder=1,fail_nth=17,seed=3,delay_nth=4", &faults, err, sizeof(err)),
        GINQ_OK);
    EXPECT_EQ_INT(faults.delay_us, 200);
    EXPECT_EQ_INT(faults.reorder, 1);
    EXPECT_EQ_INT(faults.fail_nth, 17);
    EXPECT_EQ_INT(faults.seed, 3);
    EXPECT_EQ_INT(faults.delay_nth, 4);
    EXPECT_EQ_INT(ginq_faults_parse(NULL, &faults, err, sizeof(err)), GINQ_OK);
    EXPECT_EQ_INT(faults.fail_nth, 0);
    const char *bad[] = {"delay_us=abc", "bogus=1", "reorder=2", "fail_nth",
                         "delay_us=-5",  "seed=1x", "seed="};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        faults.seed = 42;
        EXPECT_EQ_INT(ginq_faults_parse(bad[i], &faults, err, sizeof(err)), GINQ_EINVAL);
        EXPECT_EQ_INT(faults.seed, 42);
        if (expect_has(err, bad[i])) return 1;
    }
    /* The spec as the plugin reads it, from the environment. */
    EXPECT_EQ_INT(setenv(GINQ_FAULTS_ENV, "fail_nth=5", 1), 0);
    EXPECT_EQ_INT(ginq_faults_parse(getenv(GINQ_FAULTS_ENV), &faults, err, sizeof(err)), GINQ_OK);
    EXPECT_EQ_INT(faults.fail_nth, 5);
    unsetenv(GINQ_FAULTS_ENV);
    return 0;
}

/* ---- teardown ------------------------------------------------------------------------------------ */

static int test_teardown(void)
{
    fixture_t *f = fixture_new(4, 1);
    EXPECT_TRUE(f != NULL);
    /* Idle, and with operations that can drain: close returns at once, everything done. */
    ginq_t *q = queue_new(f, 0, 16, "");
    EXPECT_TRUE(q != NULL);
    double t0 = epx_test_now_s();
    EXPECT_EQ_INT(ginq_close(q, 2000), GINQ_OK);
    EXPECT_TRUE(epx_test_now_s() - t0 < 0.5);
    ginq_destroy(q);
    q = queue_new(f, 0, 16, "");
    EXPECT_TRUE(q != NULL);
    ginq_req_t *reqs[8];
    for (int i = 0; i < 8; i++) {
        ginq_desc_t d = put_desc(f, 1 + i % 2, i);
        if (i == 7) add_signal(f, &d, 0, GINQ_SIGNAL_INC, 0, 0);
        EXPECT_EQ_INT(ginq_post(q, &d, &reqs[i]), GINQ_OK);
    }
    EXPECT_EQ_INT(ginq_close(q, 2000), GINQ_OK);
    int done = 0;
    for (int i = 0; i < 8; i++) EXPECT_EQ_INT(ginq_test(q, reqs[i], &done, NULL, 0), GINQ_OK);
    EXPECT_EQ_INT(f->sig[2][0], 1);
    char msg[256];
    ginq_desc_t d = put_desc(f, 1, 20);
    ginq_req_t *late = NULL;
    EXPECT_EQ_INT(ginq_post(q, &d, &late), GINQ_ECLOSED);
    EXPECT_TRUE(late == NULL);
    ginq_message(q, msg, sizeof(msg));
    if (expect_has(msg, "closing")) return 1;
    ginq_destroy(q);

    /* A dead peer: its transfers never land; close gives up at its deadline, naming them. */
    f->mover.stall_peer = 2;
    int abandoned_before = f->mover.abandoned;
    q = queue_new(f, 3, 16, "");
    EXPECT_TRUE(q != NULL);
    for (int i = 0; i < 4; i++) {
        ginq_desc_t dd = put_desc(f, 1 + i % 2, 30 + i);
        if (i == 3) add_signal(f, &dd, 1, GINQ_SIGNAL_INC, 0, 0);
        EXPECT_EQ_INT(ginq_post(q, &dd, &reqs[i]), GINQ_OK);
    }
    ginq_desc_t sig = {.peer = 1};
    add_signal(f, &sig, 2, GINQ_SIGNAL_ADD, 3, 0);
    EXPECT_EQ_INT(ginq_post(q, &sig, &reqs[4]), GINQ_OK);
    t0 = epx_test_now_s();
    EXPECT_EQ_INT(ginq_close(q, 100), GINQ_ETIMEDOUT);
    double took = epx_test_now_s() - t0;
    EXPECT_TRUE(took >= 0.1 && took < 1.0);
    ginq_message(q, msg, sizeof(msg));
    if (expect_has(msg, "context 3 closed with 3 operations abandoned after the 100 ms deadline")) return 1;
    EXPECT_EQ_INT(f->mover.abandoned - abandoned_before, 2); /* the two puts to peer 2 were in flight */
    EXPECT_EQ_INT(ginq_test(q, reqs[0], &done, NULL, 0), GINQ_OK);
    EXPECT_EQ_INT(ginq_test(q, reqs[2], &done, NULL, 0), GINQ_OK);
    EXPECT_EQ_INT(ginq_test(q, reqs[1], &done, msg, sizeof(msg)), GINQ_EFAILED);
    if (expect_has(msg, "rank 0: put #2 to peer 2 on context 3 abandoned at close") ||
        expect_has(msg, "in flight"))
        return 1;
    EXPECT_EQ_INT(ginq_test(q, reqs[4], &done, msg, sizeof(msg)), GINQ_EFAILED);
    if (expect_has(msg, "signal #5 to peer 1") || expect_has(msg, "waiting for earlier puts")) return 1;
    EXPECT_EQ_INT(f->sig[1][2], 0);
    EXPECT_EQ_INT(ginq_failed(q, NULL, 0), 1);
    ginq_destroy(q);

    /* destroy without close while a transfer is in flight: it is given back to the mover. */
    abandoned_before = f->mover.abandoned;
    q = queue_new(f, 0, 4, "");
    EXPECT_TRUE(q != NULL);
    ginq_desc_t dd = put_desc(f, 2, 40);
    EXPECT_EQ_INT(ginq_post(q, &dd, &reqs[0]), GINQ_OK);
    EXPECT_EQ_INT(ginq_progress(q), GINQ_OK);
    ginq_destroy(q);
    EXPECT_EQ_INT(f->mover.abandoned - abandoned_before, 1);
    free(f);
    return 0;
}

/* ---- threads ------------------------------------------------------------------------------------- */

enum { ROUNDS = 120, PUTS_PER_ROUND = 4, HELD = 32 };

typedef struct threaded {
    fixture_t *f;
    ginq_t *q;
    int stop;
    int failed;
} threaded_t;

/* Posts ROUNDS rounds of puts to peer 1, each closed by a strong signal add; tests its requests when
 * the queue is full and at the end, driving progress itself now and then as NCCL's thread does. */
static void *poster(void *arg)
{
    threaded_t *t = arg;
    ginq_req_t *held[HELD];
    int nheld = 0;
    double end = epx_test_now_s() + 20.0;
    for (int k = 0; k < ROUNDS * (PUTS_PER_ROUND + 1) && !t->failed; k++) {
        int round = k / (PUTS_PER_ROUND + 1), part = k % (PUTS_PER_ROUND + 1);
        ginq_desc_t d = put_desc(t->f, 1, round * PUTS_PER_ROUND + (part < PUTS_PER_ROUND ? part : 0));
        if (part == PUTS_PER_ROUND) {
            d.bytes = 0;
            add_signal(t->f, &d, 0, GINQ_SIGNAL_INC, 0, 0);
        }
        for (;;) {
            ginq_result_t res = nheld < HELD ? ginq_post(t->q, &d, &held[nheld]) : GINQ_EFULL;
            if (res == GINQ_OK) {
                nheld++;
                break;
            }
            if (res != GINQ_EFULL || epx_test_now_s() > end) {
                fprintf(stderr, "poster: post returned %s\n", ginq_result_name(res));
                __atomic_store_n(&t->failed, 1, __ATOMIC_RELAXED);
                return NULL;
            }
            if (k % 7 == 0) ginq_progress(t->q);
            for (int i = 0; i < nheld;) {
                int done = 0;
                if (ginq_test(t->q, held[i], &done, NULL, 0) != GINQ_OK)
                    __atomic_store_n(&t->failed, 1, __ATOMIC_RELAXED);
                if (done)
                    held[i] = held[--nheld];
                else
                    i++;
            }
            sched_yield();
        }
    }
    while (nheld > 0 && epx_test_now_s() < end) {
        int done = 0;
        if (ginq_test(t->q, held[nheld - 1], &done, NULL, 0) != GINQ_OK)
            __atomic_store_n(&t->failed, 1, __ATOMIC_RELAXED);
        if (done)
            nheld--;
        else
            sched_yield();
    }
    if (nheld) __atomic_store_n(&t->failed, 1, __ATOMIC_RELAXED);
    return NULL;
}

static void *progresser(void *arg)
{
    threaded_t *t = arg;
    while (!__atomic_load_n(&t->stop, __ATOMIC_ACQUIRE))
        if (ginq_progress(t->q) != GINQ_OK) __atomic_store_n(&t->failed, 1, __ATOMIC_RELAXED);
    return NULL;
}

/* The main thread reads the signal like a kernel would: when it reaches k, rounds 1..k have landed. */
static int test_threads(void)
{
    threaded_t t = {.f = fixture_new(5, 1)};
    EXPECT_TRUE(t.f != NULL);
    t.q = queue_new(t.f, 0, HELD, "reorder=1,seed=5");
    EXPECT_TRUE(t.q != NULL);
    pthread_t post_thread, progress_thread;
    EXPECT_EQ_INT(pthread_create(&progress_thread, NULL, progresser, &t), 0);
    EXPECT_EQ_INT(pthread_create(&post_thread, NULL, poster, &t), 0);
    int rc = 0;
    double end = epx_test_now_s() + 20.0;
    for (int k = 1; k <= ROUNDS && !rc; k++) {
        while (__atomic_load_n(&t.f->sig[1][0], __ATOMIC_ACQUIRE) < (uint64_t)k && !rc) {
            if (epx_test_now_s() > end || __atomic_load_n(&t.failed, __ATOMIC_RELAXED)) rc = 1;
            sched_yield();
        }
        for (int c = 0; c < PUTS_PER_ROUND && !rc; c++)
            if (!chunk_landed(t.f, 1, (k - 1) * PUTS_PER_ROUND + c)) {
                fprintf(stderr, "threads: signal reached %d before round %d's chunk %d landed\n", k, k, c);
                rc = 1;
            }
    }
    pthread_join(post_thread, NULL);
    __atomic_store_n(&t.stop, 1, __ATOMIC_RELEASE);
    pthread_join(progress_thread, NULL);
    EXPECT_EQ_INT(rc, 0);
    EXPECT_EQ_INT(t.failed, 0);
    EXPECT_EQ_INT(t.f->sig[1][0], ROUNDS);
    EXPECT_EQ_INT(ginq_close(t.q, 1000), GINQ_OK);
    ginq_destroy(t.q);
    free(t.f);
    return 0;
}

/* ---- bad input ----------------------------------------------------------------------------------- */

static int test_bad_input(void)
{
    fixture_t *f = fixture_new(6, 0);
    EXPECT_TRUE(f != NULL);
    char err[256];
    ginq_t *q = (ginq_t *)f; /* a sentinel: must stay untouched */
    ginq_config_t cfg = {.rank = 3, .nranks = NR, .capacity = 4};
    EXPECT_EQ_INT(ginq_create(&cfg, &f->iface, err, sizeof(err), &q), GINQ_EINVAL);
    EXPECT_TRUE(q == (ginq_t *)f);
    if (expect_has(err, "rank out of range")) return 1;
    cfg.rank = 0;
    cfg.capacity = 0;
    EXPECT_EQ_INT(ginq_create(&cfg, &f->iface, err, sizeof(err), &q), GINQ_EINVAL);
    if (expect_has(err, "capacity")) return 1;
    cfg.capacity = 2;
    ginq_mover_t no_poll = f->iface;
    no_poll.poll = NULL;
    EXPECT_EQ_INT(ginq_create(&cfg, &no_poll, err, sizeof(err), &q), GINQ_EINVAL);
    if (expect_has(err, "mover lacks")) return 1;
    EXPECT_EQ_INT(ginq_create(&cfg, &f->iface, err, sizeof(err), &q), GINQ_OK);

    ginq_req_t *sentinel = (ginq_req_t *)f, *req = sentinel;
    struct {
        ginq_desc_t d;
        const char *why;
    } bad[] = {
        {put_desc(f, 5, 0), "peer out of range"},
        {put_desc(f, -1, 0), "peer out of range"},
        {put_desc(f, 1, CHUNKS), "destination range outside"},
        {{.peer = 1}, "empty operation"},
        {{.peer = 1, .signal_op = (ginq_signal_op_t)7}, "unknown signal op"},
    };
    bad[2].d.src_off = 0;
    ginq_desc_t overflow = put_desc(f, 1, 0);
    overflow.src_off = UINT64_MAX - 4;
    ginq_desc_t unaligned = {.peer = 1};
    add_signal(f, &unaligned, 0, GINQ_SIGNAL_INC, 0, 0);
    unaligned.signal_off = 4;
    ginq_desc_t past = {.peer = 1};
    add_signal(f, &past, NSIG, GINQ_SIGNAL_INC, 0, 0);
    char msg[256];
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        EXPECT_EQ_INT(ginq_post(q, &bad[i].d, &req), GINQ_EINVAL);
        ginq_message(q, msg, sizeof(msg));
        if (expect_has(msg, bad[i].why) || expect_has(msg, "rank 0: post on context 0 rejected")) return 1;
    }
    EXPECT_EQ_INT(ginq_post(q, &overflow, &req), GINQ_EINVAL);
    ginq_message(q, msg, sizeof(msg));
    if (expect_has(msg, "source range outside")) return 1;
    EXPECT_EQ_INT(ginq_post(q, &unaligned, &req), GINQ_EINVAL);
    ginq_message(q, msg, sizeof(msg));
    if (expect_has(msg, "not 8-byte aligned")) return 1;
    EXPECT_EQ_INT(ginq_post(q, &past, &req), GINQ_EINVAL);
    ginq_message(q, msg, sizeof(msg));
    if (expect_has(msg, "signal word outside")) return 1;
    EXPECT_EQ_INT(ginq_post(q, NULL, &req), GINQ_EINVAL);
    EXPECT_TRUE(req == sentinel);
    EXPECT_EQ_INT(ginq_outstanding(q), 0);

    /* Capacity: a third request while two are held is refused until one is tested. */
    ginq_req_t *reqs[2];
    ginq_desc_t d = put_desc(f, 1, 0);
    EXPECT_EQ_INT(ginq_post(q, &d, &reqs[0]), GINQ_OK);
    EXPECT_EQ_INT(ginq_post(q, &d, &reqs[1]), GINQ_OK);
    EXPECT_EQ_INT(ginq_post(q, &d, &req), GINQ_EFULL);
    ginq_message(q, msg, sizeof(msg));
    if (expect_has(msg, "2 requests held (capacity)")) return 1;
    if (drain(q)) return 1;
    int done = 0;
    EXPECT_EQ_INT(ginq_test(q, reqs[0], &done, NULL, 0), GINQ_OK);
    EXPECT_EQ_INT(ginq_test(q, reqs[0], &done, NULL, 0), GINQ_EINVAL); /* already reported */
    EXPECT_EQ_INT(ginq_test(q, (ginq_req_t *)f, &done, NULL, 0), GINQ_EINVAL);
    ginq_message(q, msg, sizeof(msg));
    if (expect_has(msg, "is not outstanding")) return 1;
    EXPECT_EQ_INT(ginq_post(q, &d, &req), GINQ_OK);
    return close_clean(f, q);
}

int main(void)
{
    if (test_fault_spec() || test_bad_input() || test_weak_signal() || test_ordering() || test_delay() ||
        test_fail_nth() || test_teardown() || test_threads())
        return 1;
    printf("ok\n");
    return 0;
}
