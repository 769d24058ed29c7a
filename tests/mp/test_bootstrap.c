/*
 * Communicator init over the TCP rendezvous and over caller callbacks (an independent shared-memory
 * allgather written here), topology, bootstrap allgather/barrier, and the failure paths: a missing
 * rank, ranks disagreeing on nranks, and the EPX_RANKS_PER_NVLINK_DOMAIN cap.
 */
#include <errno.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "boot_io.h"
#include "core/internal.h"
#include "epx_test.h"

#define MAX_RANKS     8
#define SLOT_BYTES    4096
#define RUN_TIMEOUT_S 60

/* ------------------------------------------------- shared-memory callbacks (the test's own) ---- */

typedef struct {
    _Atomic uint64_t written[MAX_RANKS]; /* round whose block the rank has put in its slot */
    _Atomic uint64_t read[MAX_RANKS];    /* round the rank has finished copying out */
    char slots[MAX_RANKS][SLOT_BYTES];
} shm_group_t;

typedef struct {
    shm_group_t *group;
    int rank, nranks;
    uint64_t round;
    int fail_with; /* non-zero: allgather returns this */
} shm_ctx_t;

/* Waits (at most 10 s) until every rank's counter reaches target. */
static int wait_all(_Atomic uint64_t *counters, int nranks, uint64_t target)
{
    double give_up = epx_test_now_s() + 10.0;
    for (;;) {
        int ready = 1;
        for (int r = 0; r < nranks; r++) ready &= atomic_load(&counters[r]) >= target;
        if (ready) return 0;
        if (epx_test_now_s() > give_up) return -1;
        usleep(50);
    }
}

static int shm_allgather(void *vctx, const void *send, void *recv, size_t bytes)
{
    shm_ctx_t *c = vctx;
    if (c->fail_with) return c->fail_with;
    if (bytes > SLOT_BYTES) return -2;
    uint64_t round = ++c->round;
    /* A slot is refilled only once every rank copied the previous round out. */
    if (wait_all(c->group->read, c->nranks, round - 1)) return -1;
    memcpy(c->group->slots[c->rank], send, bytes);
    atomic_store(&c->group->written[c->rank], round);
    if (wait_all(c->group->written, c->nranks, round)) return -1;
    for (int r = 0; r < c->nranks; r++) memcpy((char *)recv + (size_t)r * bytes, c->group->slots[r], bytes);
    atomic_store(&c->group->read[c->rank], round);
    return 0;
}

static int shm_barrier(void *vctx)
{
    char mine = 1, all[MAX_RANKS];
    return shm_allgather(vctx, &mine, all, 1);
}

/* --------------------------------------------------------------------------- cases ---- */

typedef struct {
    int use_callbacks;
    shm_group_t *group;    /* shared mapping for the callbacks */
    _Atomic int *arrivals; /* shared counter for the barrier check */
    int expect_d;          /* ranks per domain expected (0 = nranks) */
    const epx_unique_id_t *id_override;
} case_t;

static void *shared_alloc(size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static int init_comm(const case_t *c, shm_ctx_t *shm, int rank, int nranks, const epx_unique_id_t *id,
                     epx_comm_t *comm)
{
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    cfg.backend = EPX_BACKEND_HOST;
    if (!c->use_callbacks) {
        EXPECT_OK(epx_comm_init(c->id_override ? c->id_override : id, rank, nranks, &cfg, comm));
        return 0;
    }
    *shm = (shm_ctx_t){c->group, rank, nranks, 0, 0};
    epx_bootstrap_callbacks_t cb = {shm_allgather, shm_barrier, shm};
    EXPECT_OK(epx_comm_init_callbacks(&cb, rank, nranks, &cfg, comm));
    return 0;
}

static unsigned char pattern(int rank, size_t i, int round)
{
    return (unsigned char)(rank * 131 + i * 7 + round * 29 + 1);
}

static int check_allgather(epx_comm_t comm, int rank, int nranks, size_t bytes, int round)
{
    unsigned char *send = malloc(bytes), *recv = malloc(bytes * (size_t)nranks);
    EXPECT_TRUE(send && recv);
    for (size_t i = 0; i < bytes; i++) send[i] = pattern(rank, i, round);
    memset(recv, 0xee, bytes * (size_t)nranks);
    EXPECT_OK(epx_comm_allgather(comm, send, recv, bytes));
    for (int r = 0; r < nranks; r++)
        for (size_t i = 0; i < bytes; i++)
            if (recv[(size_t)r * bytes + i] != pattern(r, i, round)) {
                fprintf(stderr,
                        "rank %d: allgather of %zu bytes, round %d: block %d byte %zu = %u, expected %u\n",
                        rank, bytes, round, r, i, recv[(size_t)r * bytes + i], pattern(r, i, round));
                return 1;
            }
    free(send);
    free(recv);
    return 0;
}

static int rank_basic(int rank, int nranks, const epx_unique_id_t *id, void *vctx)
{
    const case_t *c = vctx;
    shm_ctx_t shm;
    epx_comm_t comm = NULL;
    if (init_comm(c, &shm, rank, nranks, id, &comm)) return 1;

    epx_topology_t t;
    EXPECT_OK(epx_comm_get_topology(comm, &t));
    int d = c->expect_d ? c->expect_d : nranks;
    EXPECT_EQ_INT(t.rank, rank);
    EXPECT_EQ_INT(t.nranks, nranks);
    EXPECT_EQ_INT(t.local_rank, rank);
    EXPECT_EQ_INT(t.local_nranks, nranks);
    EXPECT_EQ_INT(t.ranks_per_nvlink_domain, d);
    EXPECT_EQ_INT(t.num_nvlink_domains, nranks / d);
    EXPECT_EQ_INT(t.backend, EPX_BACKEND_HOST);
    EXPECT_EQ_INT(t.cuda_device, -1);
    /* The peer table: every rank's own entry, distinct processes. */
    EXPECT_EQ_INT(comm->peers[rank].pid, getpid());
    for (int r = 0; r < nranks; r++) {
        EXPECT_EQ_INT(comm->peers[r].rank, r);
        EXPECT_EQ_INT(comm->peers[r].nranks, nranks);
        for (int q = 0; q < r; q++) EXPECT_TRUE(comm->peers[q].pid != comm->peers[r].pid);
    }

    /* Odd sizes, repeated rounds; the TCP path also gets blocks larger than a socket buffer. */
    size_t sizes[] = {1, 37, 1000, 4096, 300000};
    int nsizes = c->use_callbacks ? 4 : 5;
    for (int round = 0; round < 3; round++)
        for (int s = 0; s < nsizes; s++)
            if (check_allgather(comm, rank, nranks, sizes[s], round)) return 1;

    /* Barrier: late arrivers increment after a delay; nobody may leave before all arrived. */
    usleep((useconds_t)(rank * 3000));
    atomic_fetch_add(c->arrivals, 1);
    EXPECT_OK(epx_comm_barrier(comm));
    EXPECT_EQ_INT(atomic_load(c->arrivals), nranks);
    EXPECT_OK(epx_comm_barrier(comm));
    EXPECT_OK(epx_get_async_error(comm));
    EXPECT_OK(epx_comm_destroy(comm));
    return 0;
}

static int run_basic(int nranks, int use_callbacks, int expect_d, const epx_unique_id_t *id_override)
{
    case_t c;
    memset(&c, 0, sizeof(c));
    c.use_callbacks = use_callbacks;
    c.expect_d = expect_d;
    c.id_override = id_override;
    c.group = shared_alloc(sizeof(shm_group_t));
    c.arrivals = shared_alloc(sizeof(*c.arrivals));
    EXPECT_TRUE(c.group && c.arrivals);
    int rc = epx_test_run_ranks(nranks, rank_basic, &c, RUN_TIMEOUT_S);
    munmap(c.group, sizeof(shm_group_t));
    munmap(c.arrivals, sizeof(*c.arrivals));
    if (rc)
        fprintf(stderr, "basic case failed: %d ranks, %s, expected D %d\n", nranks,
                use_callbacks ? "callbacks" : "tcp", expect_d);
    return rc;
}

/* Every rank expects the same result, within `max_s` seconds, with `needle` in the message. */
typedef struct {
    int told_nranks[MAX_RANKS];
    epx_result_t expect;
    const char *needle;
    double max_s;
} fail_case_t;

static int rank_fail(int rank, int nranks, const epx_unique_id_t *id, void *vctx)
{
    const fail_case_t *f = vctx;
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    cfg.backend = EPX_BACKEND_HOST;
    epx_comm_t comm = NULL;
    double t0 = epx_test_now_s();
    EXPECT_RES(epx_comm_init(id, rank, f->told_nranks[rank], &cfg, &comm), f->expect);
    double took = epx_test_now_s() - t0;
    if (took > f->max_s) {
        fprintf(stderr, "rank %d: failing init took %.2f s, more than %.2f s\n", rank, took, f->max_s);
        return 1;
    }
    if (f->needle) EXPECT_MSG_HAS(f->needle);
    EXPECT_TRUE(comm == NULL);
    return 0;
}


static int test_missing_rank(void)
{
    /* 3 of 4 ranks show up: everyone fails within the timeout (plus scheduling slack), naming it. */
    if (epx_test_set_env("EPX_TIMEOUT_MS", "1500")) return 1;
    fail_case_t f = {{4, 4, 4}, EPX_ERR_TIMEOUT, "missing: 3", 1.6};
    int rc = epx_test_run_ranks(3, rank_fail, &f, RUN_TIMEOUT_S);
    if (epx_test_set_env("EPX_TIMEOUT_MS", NULL)) return 1;
    return rc;
}

/* Rank 2 leaves after init: the survivors' next allgather fails, and every later collective repeats
 * that first failure's message instead of only saying that the bootstrap is out of step. */
static int rank_broken(int rank, int nranks, const epx_unique_id_t *id, void *vctx)
{
    (void)vctx;
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    cfg.backend = EPX_BACKEND_HOST;
    epx_comm_t comm = NULL;
    EXPECT_OK(epx_comm_init(id, rank, nranks, &cfg, &comm));
    if (rank == 2) _exit(0); /* its sockets close with it */
    int32_t mine = rank, all[3];
    EXPECT_TRUE(epx_comm_allgather(comm, &mine, all, sizeof(mine)) != EPX_SUCCESS);
    char first[128];
    snprintf(first, sizeof(first), "%s", epx_last_error_message());
    EXPECT_RES(epx_comm_allgather(comm, &mine, all, sizeof(mine)), EPX_ERR_BOOTSTRAP);
    EXPECT_MSG_HAS("earlier collective");
    first[60] = '\0'; /* the start of the first failure's message, repeated */
    EXPECT_MSG_HAS(first);
    EXPECT_RES(epx_comm_barrier(comm), EPX_ERR_BOOTSTRAP);
    EXPECT_MSG_HAS(first);
    return 0; /* no collective destroy: the comm lost a rank */
}

static int test_broken_repeats_cause(void)
{
    if (epx_test_set_env("EPX_TIMEOUT_MS", "5000")) return 1;
    int rc = epx_test_run_ranks(3, rank_broken, NULL, RUN_TIMEOUT_S);
    if (epx_test_set_env("EPX_TIMEOUT_MS", NULL)) return 1;
    return rc;
}

static int test_nranks_mismatch(void)
{
    if (epx_test_set_env("EPX_TIMEOUT_MS", "3000")) return 1;
    /* A peer thinks the job is larger than rank 0 does... */
    fail_case_t f1 = {{3, 3, 4}, EPX_ERR_MISMATCH, "nranks", 5.0};
    int rc = epx_test_run_ranks(3, rank_fail, &f1, RUN_TIMEOUT_S);
    /* ...or rank 0 waits for a rank that will never come: it gives up well before the timeout. */
    fail_case_t f2 = {{4, 3, 3}, EPX_ERR_MISMATCH, "nranks", 2.5};
    if (!rc) rc = epx_test_run_ranks(3, rank_fail, &f2, RUN_TIMEOUT_S);
    if (epx_test_set_env("EPX_TIMEOUT_MS", NULL)) return 1;
    return rc;
}

static int test_domain_cap(void)
{
    if (epx_test_set_env("EPX_RANKS_PER_NVLINK_DOMAIN", "2")) return 1;
    if (run_basic(4, 0, 2, NULL)) return 1;
    if (run_basic(4, 1, 2, NULL)) return 1;
    /* A cap above the detected size changes nothing. */
    if (epx_test_set_env("EPX_RANKS_PER_NVLINK_DOMAIN", "8")) return 1;
    if (run_basic(4, 0, 4, NULL)) return 1;
    if (epx_test_set_env("EPX_RANKS_PER_NVLINK_DOMAIN", "3")) return 1;
    fail_case_t f = {{4, 4, 4, 4}, EPX_ERR_INVALID_ARG, "EPX_RANKS_PER_NVLINK_DOMAIN", 5.0};
    int rc = epx_test_run_ranks(4, rank_fail, &f, RUN_TIMEOUT_S);
    if (epx_test_set_env("EPX_RANKS_PER_NVLINK_DOMAIN", NULL)) return 1;
    return rc;
}

/* Holds the id's address without listening on it. Once the process that made an id is gone, its port
 * is free until rank 0 binds it again, and any process binding a port meanwhile may take it (ctest runs
 * other tests beside this one). SO_REUSEADDR on both sockets and this one never listening let rank 0's
 * bind and listen succeed all the same. -1 (errno set) when another process has the port already. */
static int reserve_address(const epx_unique_id_t *id)
{
    const struct sockaddr_in sa = boot_addr(id);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
    if (fd >= 0 && setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) == 0 &&
        bind(fd, (const struct sockaddr *)&sa, sizeof(sa)) == 0)
        return fd;
    int err = errno;
    if (fd >= 0) close(fd);
    errno = err;
    return -1;
}

/* An id made by a process that is gone: rank 0 binds the address itself and the others retry until
 * it listens. The test keeps the port between the two (the library cannot: nothing of it is left
 * where the id was made); in the rare case that another process took the port in the moment after
 * the maker exited, it makes a new id. */
static int test_foreign_id(void)
{
    epx_unique_id_t *shared = shared_alloc(sizeof(*shared));
    EXPECT_TRUE(shared != NULL);
    int reserved = -1;
    for (int attempt = 0; attempt < 5 && reserved < 0; attempt++) {
        pid_t pid = fork();
        EXPECT_TRUE(pid >= 0);
        if (pid == 0) _exit(epx_get_unique_id(shared) == EPX_SUCCESS ? 0 : 1);
        int status = 0;
        EXPECT_TRUE(waitpid(pid, &status, 0) == pid);
        EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        reserved = reserve_address(shared);
        if (reserved < 0)
            fprintf(stderr, "foreign id: port %u was taken after its maker exited (%s); making another id\n",
                    (unsigned)ntohs(boot_id_fields(shared).port), strerror(errno));
    }
    EXPECT_TRUE(reserved >= 0);
    int rc = run_basic(3, 0, 0, shared);
    close(reserved);
    munmap(shared, sizeof(*shared));
    return rc;
}

/* A callback that fails is EPX_ERR_BOOTSTRAP with its return value in the message. */
static int test_failing_callback(void)
{
    shm_group_t *group = shared_alloc(sizeof(shm_group_t));
    EXPECT_TRUE(group != NULL);
    shm_ctx_t ctx = {group, 0, 1, 0, 7};
    epx_bootstrap_callbacks_t cb = {shm_allgather, shm_barrier, &ctx};
    epx_comm_t comm = NULL;
    EXPECT_RES(epx_comm_init_callbacks(&cb, 0, 1, NULL, &comm), EPX_ERR_BOOTSTRAP);
    EXPECT_MSG_HAS("returned 7");
    EXPECT_TRUE(comm == NULL);
    cb.barrier = NULL;
    EXPECT_RES(epx_comm_init_callbacks(&cb, 0, 1, NULL, &comm), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("barrier");
    EXPECT_RES(epx_comm_init_callbacks(NULL, 0, 1, NULL, &comm), EPX_ERR_INVALID_ARG);
    munmap(group, sizeof(shm_group_t));
    return 0;
}

int main(void)
{
    /* Quiet and fast defaults for the passing cases; failure cases set their own timeout. */
    if (epx_test_set_env("EPX_TIMEOUT_MS", NULL) || epx_test_set_env("EPX_RANKS_PER_NVLINK_DOMAIN", NULL)) return 1;
    const int counts[] = {1, 2, 3, 4, 8};
    for (int i = 0; i < 5; i++) {
        if (run_basic(counts[i], 0, 0, NULL)) return 1;
        if (run_basic(counts[i], 1, 0, NULL)) return 1;
    }
    int (*const failure_cases[])(void) = {test_foreign_id, test_failing_callback, test_missing_rank,
                                          test_nranks_mismatch, test_domain_cap, test_broken_repeats_cause};
    for (size_t i = 0; i < sizeof(failure_cases) / sizeof(failure_cases[0]); i++)
        if (failure_cases[i]()) return 1;
    printf("ok\n");
    return 0;
}
