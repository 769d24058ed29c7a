/*
 * The network interface (src/net/net.h) on its host model (src/net/loop_model.c): the ordering rules
 * over many strict-mode seeds (strong signals cover earlier puts to their peer and no other, weak
 * ones cover their own put only, contexts and puts are unordered, flush is local only), bounded
 * waits, bad input, normal mode's order, and a threaded run with a separate progress thread
 * (ThreadSanitizer in the tsan build).
 */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "epx_test.h"
#include "net/loop_model.h"

#define SEEDS  400
#define CHUNK  64
#define CHUNKS 8
#define BUF    (CHUNK * (CHUNKS + 2))

/* Three ranks with one source and one destination region each (indices 0 and 1 on every rank). */
typedef struct fixture {
    epx_net_model_t *model;
    epx_net_t net[3];
    uint8_t src[3][BUF];
    uint8_t dst[3][BUF];
    int32_t abort_word;
} fixture_t;

enum { SRC = 0, DST = 1 };

static int setup(fixture_t *f, epx_net_model_mode_t mode, uint64_t seed, int progress_in_wait)
{
    memset(f, 0, sizeof(*f));
    epx_net_model_config_t cfg = {.nranks = 3,
                                  .ncontexts = 2,
                                  .nsignals = 4,
                                  .mode = mode,
                                  .seed = seed,
                                  .progress_in_wait = progress_in_wait,
                                  .abort_word = &f->abort_word};
    EXPECT_EQ_INT(epx_net_model_create(&cfg, &f->model), EPX_NET_OK);
    for (int r = 0; r < 3; r++) {
        uint32_t region = 99;
        EXPECT_EQ_INT(epx_net_model_register(f->model, r, f->src[r], BUF, &region), EPX_NET_OK);
        EXPECT_EQ_INT(region, SRC);
        EXPECT_EQ_INT(epx_net_model_register(f->model, r, f->dst[r], BUF, &region), EPX_NET_OK);
        EXPECT_EQ_INT(region, DST);
        EXPECT_EQ_INT(epx_net_model_handle(f->model, r, &f->net[r]), EPX_NET_OK);
    }
    return 0;
}

static uint8_t pattern(uint64_t seed, int sender, int chunk, int i)
{
    return (uint8_t)(seed * 31 + (uint64_t)sender * 101 + (uint64_t)chunk * 7 + (uint64_t)i + 1);
}

/* Fills chunk `chunk` of `sender`'s source with its pattern. */
static void fill(fixture_t *f, uint64_t seed, int sender, int chunk)
{
    for (int i = 0; i < CHUNK; i++) f->src[sender][chunk * CHUNK + i] = pattern(seed, sender, chunk, i);
}

/* Chunk `chunk` from `sender` has landed at `receiver`. */
static int landed(const fixture_t *f, uint64_t seed, int sender, int receiver, int chunk)
{
    for (int i = 0; i < CHUNK; i++)
        if (f->dst[receiver][chunk * CHUNK + i] != pattern(seed, sender, chunk, i)) return 0;
    return 1;
}

static epx_net_status_t put_chunk(fixture_t *f, int sender, uint32_t ctx, int peer, int chunk)
{
    return epx_net_put(&f->net[sender], ctx, peer, DST, (uint64_t)chunk * CHUNK, SRC, (uint64_t)chunk * CHUNK,
                       CHUNK);
}

static uint64_t deadline_ms(uint64_t ms)
{
    return epx_net_now_ns() + ms * 1000000ull;
}

/* (a) A waiter that sees a strong signal sees every earlier put of its context, whatever else is in
 * flight (another sender, the other context, weak signals). */
static int test_strong_covers_earlier_puts(void)
{
    for (uint64_t seed = 0; seed < SEEDS; seed++) {
        fixture_t f;
        if (setup(&f, EPX_NET_MODEL_STRICT, seed, 1)) return 1;
        for (int c = 0; c < CHUNKS + 1; c++) fill(&f, seed, 0, c);
        fill(&f, seed, 2, CHUNKS + 1);
        for (int c = 0; c < CHUNKS; c++) {
            EXPECT_EQ_INT(put_chunk(&f, 0, 0, 1, c), EPX_NET_OK);
            EXPECT_EQ_INT(epx_net_signal_add(&f.net[0], 1, 1, 2, 1, EPX_NET_SIGNAL_WEAK), EPX_NET_OK);
        }
        EXPECT_EQ_INT(put_chunk(&f, 2, 0, 1, CHUNKS + 1), EPX_NET_OK);
        /* Half the seeds signal with the last put, half with a bare signal after it. */
        if (seed % 2) {
            EXPECT_EQ_INT(epx_net_put_signal(&f.net[0], 0, 1, DST, CHUNKS * CHUNK, SRC, CHUNKS * CHUNK, CHUNK,
                                             0, 1, EPX_NET_SIGNAL_STRONG),
                          EPX_NET_OK);
        } else {
            EXPECT_EQ_INT(put_chunk(&f, 0, 0, 1, CHUNKS), EPX_NET_OK);
            EXPECT_EQ_INT(epx_net_signal_add(&f.net[0], 0, 1, 0, 1, EPX_NET_SIGNAL_STRONG), EPX_NET_OK);
        }
        EXPECT_EQ_INT(epx_net_wait_signal(&f.net[1], 0, 1, deadline_ms(10000)), EPX_NET_OK);
        for (int c = 0; c <= CHUNKS; c++) {
            if (!landed(&f, seed, 0, 1, c)) {
                fprintf(stderr, "seed %llu: chunk %d missing behind a strong signal\n",
                        (unsigned long long)seed, c);
                return 1;
            }
        }
        while (epx_net_model_progress(f.model, 1000)) {
        }
        EXPECT_TRUE(landed(&f, seed, 2, 1, CHUNKS + 1));
        uint64_t weak = 0;
        EXPECT_EQ_INT(epx_net_signal_read(&f.net[1], 2, &weak), EPX_NET_OK);
        EXPECT_EQ_INT(weak, CHUNKS);
        epx_net_model_destroy(f.model);
    }
    return 0;
}

/* (a2) A strong signal covers earlier puts of its context to its own peer only: the strict model must
 * show, for some seed, a put to another peer not yet landed when the signal is seen there. */
static int test_strong_other_peer_not_covered(void)
{
    int other_missing = 0;
    for (uint64_t seed = 0; seed < SEEDS; seed++) {
        fixture_t f;
        if (setup(&f, EPX_NET_MODEL_STRICT, seed, 1)) return 1;
        for (int c = 0; c <= CHUNKS; c++) fill(&f, seed, 0, c);
        for (int c = 0; c < CHUNKS; c++) EXPECT_EQ_INT(put_chunk(&f, 0, 0, 2, c), EPX_NET_OK);
        EXPECT_EQ_INT(put_chunk(&f, 0, 0, 1, 0), EPX_NET_OK);
        EXPECT_EQ_INT(epx_net_put_signal(&f.net[0], 0, 1, DST, CHUNKS * CHUNK, SRC, CHUNKS * CHUNK, CHUNK, 0,
                                         1, EPX_NET_SIGNAL_STRONG),
                      EPX_NET_OK);
        EXPECT_EQ_INT(epx_net_wait_signal(&f.net[1], 0, 1, deadline_ms(10000)), EPX_NET_OK);
        EXPECT_TRUE(landed(&f, seed, 0, 1, 0) && landed(&f, seed, 0, 1, CHUNKS)); /* its own peer's: always */
        for (int c = 0; c < CHUNKS; c++) other_missing += !landed(&f, seed, 0, 2, c);
        epx_net_model_destroy(f.model);
    }
    printf("strong signals: %d puts to another peer missing, over %d seeds\n", other_missing, SEEDS);
    EXPECT_TRUE(other_missing > 0);
    return 0;
}

/* (b) A weak signal covers its own put only: the strict model must show, for some seed, an earlier
 * put not yet landed when the signal is seen, and a weak signal trailing a later strong one. */
static int test_weak_covers_own_put_only(void)
{
    int missing_seen = 0, overtaken_seen = 0;
    for (uint64_t seed = 0; seed < SEEDS; seed++) {
        fixture_t f;
        if (setup(&f, EPX_NET_MODEL_STRICT, seed, 1)) return 1;
        for (int c = 0; c <= CHUNKS + 1; c++) fill(&f, seed, 0, c);
        for (int c = 0; c < CHUNKS; c++) EXPECT_EQ_INT(put_chunk(&f, 0, 0, 1, c), EPX_NET_OK);
        EXPECT_EQ_INT(epx_net_put_signal(&f.net[0], 0, 1, DST, CHUNKS * CHUNK, SRC, CHUNKS * CHUNK, CHUNK, 0,
                                         1, EPX_NET_SIGNAL_WEAK),
                      EPX_NET_OK);
        EXPECT_EQ_INT(epx_net_put_signal(&f.net[0], 0, 1, DST, (CHUNKS + 1) * CHUNK, SRC,
                                         (CHUNKS + 1) * CHUNK, CHUNK, 1, 1, EPX_NET_SIGNAL_STRONG),
                      EPX_NET_OK);
        EXPECT_EQ_INT(epx_net_wait_signal(&f.net[1], 0, 1, deadline_ms(10000)), EPX_NET_OK);
        EXPECT_TRUE(landed(&f, seed, 0, 1, CHUNKS)); /* its own put, always */
        for (int c = 0; c < CHUNKS; c++) missing_seen += !landed(&f, seed, 0, 1, c);
        /* The weak signal may also trail the later strong one. */
        fixture_t g;
        if (setup(&g, EPX_NET_MODEL_STRICT, seed, 1)) return 1;
        fill(&g, seed, 0, 0);
        fill(&g, seed, 0, 1);
        EXPECT_EQ_INT(epx_net_put_signal(&g.net[0], 0, 1, DST, 0, SRC, 0, CHUNK, 0, 1, EPX_NET_SIGNAL_WEAK),
                      EPX_NET_OK);
        EXPECT_EQ_INT(
            epx_net_put_signal(&g.net[0], 0, 1, DST, CHUNK, SRC, CHUNK, CHUNK, 1, 1, EPX_NET_SIGNAL_STRONG),
            EPX_NET_OK);
        EXPECT_EQ_INT(epx_net_wait_signal(&g.net[1], 1, 1, deadline_ms(10000)), EPX_NET_OK);
        EXPECT_TRUE(landed(&g, seed, 0, 1, 0) && landed(&g, seed, 0, 1, 1)); /* the strong one covers both */
        uint64_t weak = 9;
        EXPECT_EQ_INT(epx_net_signal_read(&g.net[1], 0, &weak), EPX_NET_OK);
        overtaken_seen += weak == 0;
        epx_net_model_destroy(f.model);
        epx_net_model_destroy(g.model);
    }
    printf("weak signals: %d earlier puts missing, %d signals overtaken, over %d seeds\n", missing_seen,
           overtaken_seen, SEEDS);
    EXPECT_TRUE(missing_seen > 0);
    EXPECT_TRUE(overtaken_seen > 0);
    return 0;
}

/* (c) A strong signal on one context says nothing of another context's puts; puts of one context to
 * one place may land in either order. */
static int test_contexts_and_puts_unordered(void)
{
    int other_ctx_missing = 0, later_first = 0, earlier_first = 0;
    for (uint64_t seed = 0; seed < SEEDS; seed++) {
        fixture_t f;
        if (setup(&f, EPX_NET_MODEL_STRICT, seed, 1)) return 1;
        fill(&f, seed, 0, 0);
        fill(&f, seed, 0, 1);
        EXPECT_EQ_INT(put_chunk(&f, 0, 1, 1, 0), EPX_NET_OK);
        EXPECT_EQ_INT(
            epx_net_put_signal(&f.net[0], 0, 1, DST, CHUNK, SRC, CHUNK, CHUNK, 0, 1, EPX_NET_SIGNAL_STRONG),
            EPX_NET_OK);
        EXPECT_EQ_INT(epx_net_wait_signal(&f.net[1], 0, 1, deadline_ms(10000)), EPX_NET_OK);
        EXPECT_TRUE(landed(&f, seed, 0, 1, 1));
        other_ctx_missing += !landed(&f, seed, 0, 1, 0);
        epx_net_model_destroy(f.model);

        /* Two puts to the same bytes: the one that lands last stays. */
        if (setup(&f, EPX_NET_MODEL_STRICT, seed, 0)) return 1;
        memset(f.src[0], 0xaa, CHUNK);
        memset(f.src[0] + CHUNK, 0xbb, CHUNK);
        EXPECT_EQ_INT(epx_net_put(&f.net[0], 0, 1, DST, 0, SRC, 0, CHUNK), EPX_NET_OK);
        EXPECT_EQ_INT(epx_net_put(&f.net[0], 0, 1, DST, 0, SRC, CHUNK, CHUNK), EPX_NET_OK);
        while (epx_net_model_progress(f.model, 1000)) {
        }
        EXPECT_TRUE(f.dst[1][0] == 0xaa || f.dst[1][0] == 0xbb);
        EXPECT_TRUE(f.dst[1][0] == f.dst[1][CHUNK - 1]);
        later_first += f.dst[1][0] == 0xaa;
        earlier_first += f.dst[1][0] == 0xbb;
        epx_net_model_destroy(f.model);
    }
    printf("contexts: %d puts of the other context missing; same bytes: %d later-first, %d in order\n",
           other_ctx_missing, later_first, earlier_first);
    EXPECT_TRUE(other_ctx_missing > 0);
    EXPECT_TRUE(later_first > 0 && earlier_first > 0);
    return 0;
}

typedef struct abort_later {
    int32_t *word;
    unsigned delay_us;
} abort_later_t;

static void *set_abort_later(void *arg)
{
    abort_later_t *a = arg;
    usleep(a->delay_us);
    __atomic_store_n(a->word, 1, __ATOMIC_RELEASE);
    return NULL;
}

/* (d) Waits end at their deadline with TIMEOUT and on the abort word with ABORTED, within bounds; a
 * signal already at its target wins over both. */
static int test_wait_bounds(void)
{
    fixture_t f;
    if (setup(&f, EPX_NET_MODEL_STRICT, 1, 1)) return 1;
    uint64_t t0 = epx_net_now_ns();
    EXPECT_EQ_INT(epx_net_wait_signal(&f.net[1], 0, 1, t0 + 50000000ull), EPX_NET_TIMEOUT);
    uint64_t waited = epx_net_now_ns() - t0;
    EXPECT_TRUE(waited >= 50000000ull && waited < 2000000000ull);

    abort_later_t a = {&f.abort_word, 30000};
    pthread_t th;
    EXPECT_TRUE(pthread_create(&th, NULL, set_abort_later, &a) == 0);
    t0 = epx_net_now_ns();
    epx_net_status_t s = epx_net_wait_signal(&f.net[1], 0, 1, t0 + 20000000000ull);
    waited = epx_net_now_ns() - t0;
    pthread_join(th, NULL);
    EXPECT_EQ_INT(s, EPX_NET_ABORTED);
    EXPECT_TRUE(waited >= 25000000ull && waited < 5000000000ull);
    EXPECT_EQ_INT(epx_net_flush(&f.net[0], 0, deadline_ms(1000)), EPX_NET_ABORTED);

    /* Reached: OK even with the abort word set and the deadline gone. */
    EXPECT_EQ_INT(epx_net_signal_add(&f.net[0], 0, 1, 3, 5, EPX_NET_SIGNAL_WEAK), EPX_NET_OK);
    EXPECT_EQ_INT(epx_net_model_progress(f.model, 10), 1);
    EXPECT_EQ_INT(epx_net_wait_signal(&f.net[1], 3, 5, 0), EPX_NET_OK);
    EXPECT_EQ_INT(epx_net_wait_signal(&f.net[1], 3, 6, 0), EPX_NET_ABORTED);
    f.abort_word = 0;
    EXPECT_EQ_INT(epx_net_wait_signal(&f.net[1], 3, 6, 0), EPX_NET_TIMEOUT);
    epx_net_model_destroy(f.model);
    return 0;
}

/* (e) Flush is local completion: after it the source may change without changing what lands; without
 * it a late source read can pick up the change; flush itself delivers nothing. */
static int test_flush_is_local(void)
{
    int late_read_seen = 0;
    for (uint64_t seed = 0; seed < SEEDS; seed++) {
        for (int flush = 0; flush < 2; flush++) {
            fixture_t f;
            if (setup(&f, EPX_NET_MODEL_STRICT, seed, 0)) return 1;
            for (int c = 0; c < 4; c++) fill(&f, seed, 0, c);
            for (int c = 0; c < 4; c++) EXPECT_EQ_INT(put_chunk(&f, 0, 0, 1, c), EPX_NET_OK);
            epx_net_model_progress(f.model, seed % 5); /* some steps may already have run */
            if (flush) {
                const uint8_t before = f.dst[1][0];
                EXPECT_EQ_INT(epx_net_flush(&f.net[0], 0, deadline_ms(1000)), EPX_NET_OK);
                EXPECT_TRUE(f.dst[1][0] == before); /* nothing landed by the flush */
            }
            memset(f.src[0], 0, 4 * CHUNK); /* reuse the source */
            while (epx_net_model_progress(f.model, 1000)) {
            }
            EXPECT_EQ_INT(epx_net_model_pending(f.model), 0);
            for (int c = 0; c < 4; c++) {
                if (flush && !landed(&f, seed, 0, 1, c)) {
                    fprintf(stderr, "seed %llu: chunk %d changed after flush\n", (unsigned long long)seed, c);
                    return 1;
                }
                late_read_seen += !flush && !landed(&f, seed, 0, 1, c);
            }
            epx_net_model_destroy(f.model);
        }
    }
    printf("flush: %d late source reads without flush\n", late_read_seen);
    EXPECT_TRUE(late_read_seen > 0);
    return 0;
}

/* (f) Normal mode: one step completes the oldest operation of a queue, so puts and weak signals land
 * in post order. */
static int test_normal_in_order(void)
{
    fixture_t f;
    if (setup(&f, EPX_NET_MODEL_NORMAL, 0, 0)) return 1;
    for (int c = 0; c < CHUNKS; c++) f.src[0][c * CHUNK] = (uint8_t)(c + 1);
    for (int c = 0; c < CHUNKS; c++)
        EXPECT_EQ_INT(epx_net_put_signal(&f.net[0], 0, 1, DST, 0, SRC, (uint64_t)c * CHUNK, 1, 0, 1,
                                         EPX_NET_SIGNAL_WEAK),
                      EPX_NET_OK);
    EXPECT_EQ_INT(epx_net_model_pending(f.model), CHUNKS);
    for (int c = 0; c < CHUNKS; c++) {
        EXPECT_EQ_INT(epx_net_model_progress(f.model, 1), 1);
        uint64_t v = 0;
        EXPECT_EQ_INT(epx_net_signal_read(&f.net[1], 0, &v), EPX_NET_OK);
        EXPECT_EQ_INT(v, c + 1);
        EXPECT_EQ_INT(f.dst[1][0], c + 1);
    }
    EXPECT_EQ_INT(epx_net_model_progress(f.model, 1), 0);
    epx_net_model_destroy(f.model);
    return 0;
}

/* Bad input: INVALID naming the thing, nothing queued; a transport absent on this side. */
static int test_bad_input(void)
{
    fixture_t f;
    if (setup(&f, EPX_NET_MODEL_STRICT, 0, 0)) return 1;
    EXPECT_EQ_INT(epx_net_put(&f.net[0], 2, 1, DST, 0, SRC, 0, 8), EPX_NET_INVALID);
    EXPECT_TRUE(strstr(epx_net_model_message(), "context 2"));
    EXPECT_EQ_INT(epx_net_put(&f.net[0], 0, 3, DST, 0, SRC, 0, 8), EPX_NET_INVALID);
    EXPECT_TRUE(strstr(epx_net_model_message(), "peer 3"));
    EXPECT_EQ_INT(epx_net_put(&f.net[0], 0, 1, DST, BUF - 4, SRC, 0, 8), EPX_NET_INVALID);
    EXPECT_TRUE(strstr(epx_net_model_message(), "destination region 1"));
    EXPECT_EQ_INT(epx_net_put(&f.net[0], 0, 1, DST, 0, 7, 0, 8), EPX_NET_INVALID);
    EXPECT_TRUE(strstr(epx_net_model_message(), "source region 7"));
    EXPECT_EQ_INT(epx_net_put(&f.net[0], 0, 1, DST, UINT64_MAX, SRC, 0, 8), EPX_NET_INVALID);
    EXPECT_EQ_INT(epx_net_signal_add(&f.net[0], 0, 1, 4, 1, EPX_NET_SIGNAL_STRONG), EPX_NET_INVALID);
    EXPECT_TRUE(strstr(epx_net_model_message(), "signal 4"));
    EXPECT_EQ_INT(epx_net_signal_add(&f.net[0], 0, 1, 0, 1, (epx_net_signal_mode_t)7), EPX_NET_INVALID);
    EXPECT_TRUE(strstr(epx_net_model_message(), "signal mode 7"));
    EXPECT_EQ_INT(epx_net_flush(&f.net[0], 5, deadline_ms(1000)), EPX_NET_INVALID);
    uint64_t v = 42;
    EXPECT_EQ_INT(epx_net_signal_read(&f.net[1], 9, &v), EPX_NET_INVALID);
    EXPECT_EQ_INT(v, 42);
    EXPECT_EQ_INT(epx_net_model_pending(f.model), 0);
    epx_net_model_config_t bad = {.nranks = 0, .ncontexts = 1, .nsignals = 1};
    epx_net_model_t *m = NULL;
    EXPECT_EQ_INT(epx_net_model_create(&bad, &m), EPX_NET_INVALID);
    EXPECT_TRUE(strstr(epx_net_model_message(), "nranks 0") && m == NULL);
    epx_net_t none = f.net[0];
    none.transport = EPX_NET_TRANSPORT_GIN;
    EXPECT_EQ_INT(epx_net_put(&none, 0, 1, DST, 0, SRC, 0, 8), EPX_NET_UNSUPPORTED);
    EXPECT_EQ_INT(epx_net_wait_signal(&none, 0, 1, deadline_ms(1000)), EPX_NET_UNSUPPORTED);
    epx_net_model_destroy(f.model);
    return 0;
}

/* Threaded: a sender, a receiver and a progress thread, strict mode. */
#define ROUNDS 200
#define SLOT   16
typedef struct threaded {
    epx_net_model_t *model;
    epx_net_t sender, receiver;
    uint8_t src[ROUNDS * 4 * SLOT];
    uint8_t dst[ROUNDS * 4 * SLOT];
    int stop;
    int failed;
} threaded_t;

static void *progress_main(void *arg)
{
    threaded_t *t = arg;
    while (!__atomic_load_n(&t->stop, __ATOMIC_ACQUIRE))
        if (!epx_net_model_progress(t->model, 64)) sched_yield();
    return NULL;
}

static void *sender_main(void *arg)
{
    threaded_t *t = arg;
    for (int r = 0; r < ROUNDS && !t->failed; r++) {
        for (int k = 0; k < 4 * SLOT; k++) t->src[r * 4 * SLOT + k] = (uint8_t)(r * 3 + k + 1);
        for (int k = 0; k < 4; k++) {
            const uint64_t off = (uint64_t)(r * 4 + k) * SLOT;
            if (epx_net_put(&t->sender, (uint32_t)(r % 2), 1, 1, off, 0, off, SLOT) != EPX_NET_OK)
                t->failed = 1;
        }
        if (epx_net_signal_add(&t->sender, (uint32_t)(r % 2), 1, (uint32_t)(r % 2), 1, EPX_NET_SIGNAL_STRONG))
            t->failed = 1;
    }
    return NULL;
}

static int test_threaded(void)
{
    static threaded_t t;
    memset(&t, 0, sizeof(t));
    epx_net_model_config_t cfg = {
        .nranks = 2, .ncontexts = 2, .nsignals = 2, .mode = EPX_NET_MODEL_STRICT, .seed = 7};
    EXPECT_EQ_INT(epx_net_model_create(&cfg, &t.model), EPX_NET_OK);
    uint32_t region;
    for (int r = 0; r < 2; r++) {
        EXPECT_EQ_INT(epx_net_model_register(t.model, r, t.src, sizeof(t.src), &region), EPX_NET_OK);
        EXPECT_EQ_INT(epx_net_model_register(t.model, r, t.dst, sizeof(t.dst), &region), EPX_NET_OK);
    }
    EXPECT_EQ_INT(epx_net_model_handle(t.model, 0, &t.sender), EPX_NET_OK);
    EXPECT_EQ_INT(epx_net_model_handle(t.model, 1, &t.receiver), EPX_NET_OK);
    pthread_t progress, sender;
    EXPECT_TRUE(pthread_create(&progress, NULL, progress_main, &t) == 0);
    EXPECT_TRUE(pthread_create(&sender, NULL, sender_main, &t) == 0);
    int bad = 0;
    /* Round r is the (r / 2 + 1)-th strong signal of context r % 2. */
    for (int r = 0; r < ROUNDS && !bad; r++) {
        epx_net_status_t s =
            epx_net_wait_signal(&t.receiver, (uint32_t)(r % 2), (uint64_t)(r / 2 + 1), deadline_ms(20000));
        if (s != EPX_NET_OK) {
            fprintf(stderr, "round %d: wait returned %s\n", r, epx_net_status_name(s));
            bad = 1;
        }
        for (int k = 0; k < 4 * SLOT && !bad; k++)
            if (t.dst[r * 4 * SLOT + k] != (uint8_t)(r * 3 + k + 1)) {
                fprintf(stderr, "round %d: byte %d missing behind its strong signal\n", r, k);
                bad = 1;
            }
    }
    pthread_join(sender, NULL);
    __atomic_store_n(&t.stop, 1, __ATOMIC_RELEASE);
    pthread_join(progress, NULL);
    epx_net_model_destroy(t.model);
    EXPECT_TRUE(!bad && !t.failed);
    return 0;
}

/* net.h's operation check, which the device transports (loop, GIN) share: every field out of range is
 * refused, a signal's byte fields and a put's signal fields are not looked at. */
static int test_check_op(void)
{
    epx_net_t net;
    memset(&net, 0, sizeof(net));
    net.nranks = 3;
    net.ncontexts = 2;
    net.nsignals = 4;
    const uint64_t bytes[2] = {BUF, BUF};
    const epx_net_op_t ok = {EPX_NET_OP_PUT_SIGNAL, 1, 2, EPX_NET_SIGNAL_WEAK, 0, 1, 0, BUF - 8, 8, 3, 0, 1};
    /* Each case: `ok` with one field changed, and the answer. */
    struct {
        epx_net_op_t op;
        epx_net_status_t want;
    } cases[12];
    for (int i = 0; i < 12; i++) {
        cases[i].op = ok;
        cases[i].want = EPX_NET_INVALID;
    }
    cases[0].want = EPX_NET_OK;
    cases[1].op.kind = 0;
    cases[2].op.ctx = 2;
    cases[3].op.peer = 3;
    cases[4].op.peer = -1;
    cases[5].op.dst_offset = BUF - 4;
    cases[6].op.dst_offset = UINT64_MAX;
    cases[7].op.src_region = 2;
    cases[8].op.signal = 4;
    cases[9].op.signal_mode = 7;
    cases[10].op.kind = EPX_NET_OP_SIGNAL; /* its byte fields are not looked at */
    cases[10].op.src_region = 9;
    cases[10].want = EPX_NET_OK;
    cases[11].op.kind = EPX_NET_OP_PUT; /* nor a put's signal fields */
    cases[11].op.signal = 99;
    cases[11].want = EPX_NET_OK;
    for (int i = 0; i < 12; i++) {
        const epx_net_status_t got = epx_net_check_op(&net, &cases[i].op, 2, bytes);
        if (got != cases[i].want) {
            fprintf(stderr, "check case %d: %s, want %s\n", i, epx_net_status_name(got),
                    epx_net_status_name(cases[i].want));
            return 1;
        }
    }
    return 0;
}

int main(void)
{
    if (test_strong_covers_earlier_puts() || test_strong_other_peer_not_covered() ||
        test_weak_covers_own_put_only() || test_contexts_and_puts_unordered() || test_wait_bounds() ||
        test_flush_is_local() || test_normal_in_order() || test_bad_input() || test_check_op() ||
        test_threaded())
        return 1;
    printf("ok\n");
    return 0;
}
