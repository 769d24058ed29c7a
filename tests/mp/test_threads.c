/*
 * The thread contract (issue 11, defect 9): one thread at a time per communicator and per buffer.
 * A second thread entering the same object gets EPX_ERR_INVALID_USAGE at once, consumes no
 * sequence number and tells no peer; the object stays usable. Run under TSan as well.
 */
#include <pthread.h>
#include <unistd.h>

#include "test_misuse_io.h"

typedef struct worker {
    epx_comm_t comm;
    epx_buffer_t buffer;
    int nranks;
    io_t io;
    int iterations;
    long refusals; /* EPX_ERR_INVALID_USAGE seen */
    int failures;  /* any other failure */
    epx_result_t res;
    pthread_barrier_t *start; /* both workers of a pair begin together */
} worker_t;

static epx_result_t dispatch(worker_t *w, epx_handle_t *h_out, int64_t *rows_out)
{
    return io_dispatch(w->buffer, &w->io, w->nranks, NULL, h_out, rows_out);
}

static epx_result_t combine(worker_t *w, epx_handle_t h, int64_t rows)
{
    return io_combine(w->buffer, &w->io, h, rows);
}

/* Repeats `call` while another thread holds the object; counts the refusals. */
#define RETRY(w, call)                                                          \
    ({                                                                          \
        epx_result_t retry_res_;                                                \
        while ((retry_res_ = (call)) == EPX_ERR_INVALID_USAGE) (w)->refusals++; \
        retry_res_;                                                             \
    })

/* Round trips on a buffer another thread uses too (one rank: any order is a valid order). */
static void *hammer_buffer(void *arg)
{
    worker_t *w = arg;
    if (w->start) pthread_barrier_wait(w->start);
    for (int i = 0; i < w->iterations; i++) {
        epx_handle_t h;
        int64_t rows = 0;
        epx_handle_info_t info;
        if (RETRY(w, dispatch(w, &h, &rows)) != EPX_SUCCESS || RETRY(w, combine(w, h, rows)) != EPX_SUCCESS ||
            RETRY(w, epx_handle_get_info(h, &info)) != EPX_SUCCESS ||
            RETRY(w, epx_handle_destroy(h)) != EPX_SUCCESS ||
            RETRY(w, epx_buffer_query_overflow(w->buffer)) != EPX_SUCCESS)
            w->failures++;
    }
    return NULL;
}

/* Buffers created and destroyed on a communicator another thread uses too. */
static void *hammer_comm(void *arg)
{
    worker_t *w = arg;
    epx_buffer_config_t cfg = epx_test_buffer_config(TMAX, HID, 1, 2 * w->nranks, EPX_MODE_HT);
    if (w->start) pthread_barrier_wait(w->start);
    for (int i = 0; i < w->iterations; i++) {
        epx_buffer_t b;
        epx_topology_t topo;
        if (RETRY(w, epx_buffer_create(w->comm, &cfg, &b)) != EPX_SUCCESS ||
            epx_buffer_destroy(b) != EPX_SUCCESS || epx_comm_get_topology(w->comm, &topo) != EPX_SUCCESS ||
            epx_get_async_error(w->comm) != EPX_SUCCESS)
            w->failures++;
    }
    return NULL;
}

/* Runs both workers from a common start. The workers overlap only when the scheduler runs them
 * together (a loaded machine may not), so callers repeat pairs until a refusal is seen or
 * PAIR_DEADLINE_S has passed. */
#define PAIR_DEADLINE_S 30.0

static int run_pair(void *(*fn)(void *), worker_t *w)
{
    pthread_t t[2];
    pthread_barrier_t start;
    EXPECT_TRUE(pthread_barrier_init(&start, NULL, 2) == 0);
    for (int i = 0; i < 2; i++) w[i].start = &start;
    for (int i = 0; i < 2; i++) EXPECT_TRUE(pthread_create(&t[i], NULL, fn, &w[i]) == 0);
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    pthread_barrier_destroy(&start);
    for (int i = 0; i < 2; i++) w[i].start = NULL;
    EXPECT_EQ_INT(w[0].failures + w[1].failures, 0);
    return 0;
}

static void worker_init(worker_t *w, epx_comm_t comm, epx_buffer_t b, int rank, int nranks, int iterations)
{
    memset(w, 0, sizeof(*w));
    w->comm = comm;
    w->buffer = b;
    w->nranks = nranks;
    w->iterations = iterations;
    io_init(&w->io, rank, nranks);
}

/* Runs pairs of `fn` until one is refused (or the deadline); returns the refusals, -1 on failure. */
static long hammer_until_refused(void *(*fn)(void *), worker_t *w, epx_comm_t comm, epx_buffer_t b, int rank,
                                 int nranks, int iterations, const char *what)
{
    long refusals = 0;
    double t0 = epx_test_now_s();
    for (int round = 0; refusals == 0 && (round < 20 || epx_test_now_s() - t0 < PAIR_DEADLINE_S); round++) {
        for (int i = 0; i < 2; i++) worker_init(&w[i], comm, b, rank, nranks, iterations);
        if (run_pair(fn, w)) return -1;
        refusals += w[0].refusals + w[1].refusals;
        if (refusals > 0) printf("%s: %ld refusals in round %d\n", what, refusals, round);
    }
    return refusals;
}

/* One rank, two threads on one buffer, then on one comm: refusals, no failure, still usable. */
static int hammer_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    (void)ctx;
    epx_comm_t comm = io_comm(rank, nranks, id);
    EXPECT_TRUE(comm != NULL);
    epx_buffer_config_t cfg = epx_test_buffer_config(TMAX, HID, 1, 2 * nranks, EPX_MODE_HT);
    epx_buffer_t b;
    EXPECT_OK(epx_buffer_create(comm, &cfg, &b));
    static worker_t w[2];
    EXPECT_TRUE(hammer_until_refused(hammer_buffer, w, comm, b, rank, nranks, 200, "one buffer") > 0);
    worker_init(&w[0], comm, b, rank, nranks, 1);
    hammer_buffer(&w[0]);
    EXPECT_EQ_INT(w[0].failures, 0);
    EXPECT_OK(epx_buffer_destroy(b));

    EXPECT_TRUE(hammer_until_refused(hammer_comm, w, comm, NULL, rank, nranks, 50, "one comm") > 0);
    /* The communicator is intact: a buffer and a round trip on it. */
    EXPECT_OK(epx_buffer_create(comm, &cfg, &b));
    worker_init(&w[0], comm, b, rank, nranks, 1);
    hammer_buffer(&w[0]);
    EXPECT_EQ_INT(w[0].failures, 0);
    EXPECT_OK(epx_buffer_destroy(b));
    EXPECT_OK(epx_comm_destroy(comm));
    return 0;
}

static void *dispatch_thread(void *arg)
{
    worker_t *w = arg;
    epx_handle_t h;
    int64_t rows;
    w->res = dispatch(w, &h, &rows);
    if (w->res == EPX_SUCCESS) w->res = combine(w, h, rows);
    if (w->res == EPX_SUCCESS) w->res = epx_handle_destroy(h);
    return NULL;
}

static void *create_thread(void *arg)
{
    worker_t *w = arg;
    epx_buffer_config_t cfg = epx_test_buffer_config(TMAX, HID, 1, 2 * w->nranks, EPX_MODE_HT);
    w->res = epx_buffer_create(w->comm, &cfg, &w->buffer);
    return NULL;
}

/* Two ranks. Rank 1 comes late, so rank 0's first thread waits inside the collective; a second
 * thread of rank 0 entering the same buffer (or comm) is refused at once, and the ranks stay in
 * step: the refused call was not numbered and no peer heard of it. */
static int in_flight_body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    (void)ctx;
    epx_comm_t comm = io_comm(rank, nranks, id);
    EXPECT_TRUE(comm != NULL);
    static worker_t w;
    worker_init(&w, comm, NULL, rank, nranks, 1);
    for (int step = 0; step < 2; step++) {
        pthread_t t;
        if (rank == 1) usleep(400 * 1000);
        EXPECT_TRUE(pthread_create(&t, NULL, step == 0 ? create_thread : dispatch_thread, &w) == 0);
        if (rank == 0) {
            usleep(100 * 1000);
            double t0 = epx_test_now_s();
            epx_buffer_config_t cfg = epx_test_buffer_config(TMAX, HID, 1, 2 * nranks, EPX_MODE_HT);
            epx_buffer_t other = NULL;
            if (step == 0) {
                EXPECT_RES(epx_buffer_create(comm, &cfg, &other), EPX_ERR_INVALID_USAGE);
                EXPECT_MSG_HAS("in use by another thread");
                EXPECT_OK(epx_get_async_error(comm)); /* any thread may ask */
            } else {
                worker_t second;
                worker_init(&second, comm, w.buffer, rank, nranks, 1);
                epx_handle_t h;
                int64_t rows;
                EXPECT_RES(dispatch(&second, &h, &rows), EPX_ERR_INVALID_USAGE);
                EXPECT_MSG_HAS("in use by another thread");
                EXPECT_RES(epx_buffer_destroy(w.buffer), EPX_ERR_INVALID_USAGE);
            }
            EXPECT_TRUE(epx_test_now_s() - t0 < 0.2);
        }
        pthread_join(t, NULL);
        EXPECT_OK(w.res);
    }
    /* Still in step on both objects. */
    EXPECT_OK(epx_buffer_destroy(w.buffer));
    worker_init(&w, comm, NULL, rank, nranks, 1);
    create_thread(&w);
    EXPECT_OK(w.res);
    dispatch_thread(&w);
    EXPECT_OK(w.res);
    EXPECT_OK(epx_buffer_destroy(w.buffer));
    EXPECT_OK(epx_comm_destroy(comm));
    printf("rank %d: concurrent entries refused, ranks in step\n", rank);
    return 0;
}

int main(void)
{
    return io_main("threads", hammer_body, in_flight_body, 120);
}
