/*
 * The TCP rendezvous under hostile and broken connections: idle ones, partial, oversized and
 * unauthenticated hellos, duplicate and out-of-range ranks, rank 0's socket after the job (no fd
 * left in the launcher, nobody listening) and a missing rank 0 (bounded by the timeout).
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "boot_io.h"
#include "core/bootstrap.h"
#include "core/internal.h"
#include "core/socket.h"
#include "epx_test.h"

#define MAX_PROCS        8
#define MAX_IDLE         160
#define SHORT_TIMEOUT_MS 1500
/* Slack over a measured bound: process start-up and scheduling on a loaded machine. */
#define SLACK_S 0.1

/* A process's body: 0 when it saw what it expected. */
typedef int (*proc_fn)(int proc, const epx_unique_id_t *id, const void *ctx);

typedef struct {
    int told_rank[MAX_PROCS], nranks;
    epx_result_t expect;
    const char *needle; /* in the message of every failing process */
    int delay_ms[MAX_PROCS];
    int absent[MAX_PROCS]; /* exits without joining */
    double max_s;          /* the init returns within this */
} job_t;


static int rank_body(int proc, const epx_unique_id_t *id, const void *vctx)
{
    const job_t *j = vctx;
    if (j->absent[proc]) return 0;
    usleep((useconds_t)j->delay_ms[proc] * 1000);
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    cfg.backend = EPX_BACKEND_HOST;
    epx_comm_t comm = NULL;
    double t0 = epx_test_now_s();
    EXPECT_RES(epx_comm_init(id, j->told_rank[proc], j->nranks, &cfg, &comm), j->expect);
    double took = epx_test_now_s() - t0;
    if (took > j->max_s) {
        fprintf(stderr, "process %d: init took %.3f s, more than %.3f s\n", proc, took, j->max_s);
        return 1;
    }
    if (j->expect != EPX_SUCCESS) {
        if (j->needle) EXPECT_MSG_HAS(j->needle);
        return 0;
    }
    EXPECT_OK(epx_comm_barrier(comm));
    EXPECT_OK(epx_comm_destroy(comm));
    return 0;
}

/* Forks `nprocs` processes running fn; each is bounded by an alarm so the test never hangs. */
static int start_procs(int nprocs, proc_fn fn, const epx_unique_id_t *id, const void *ctx, pid_t *pids)
{
    fflush(stdout);
    fflush(stderr);
    for (int p = 0; p < nprocs; p++) {
        pids[p] = fork();
        EXPECT_TRUE(pids[p] >= 0);
        if (pids[p] == 0) {
            alarm(20);
            int rc = fn(p, id, ctx);
            fflush(stderr);
            _exit(rc ? 1 : 0);
        }
    }
    return 0;
}

static int wait_procs(int nprocs, const pid_t *pids)
{
    int failed = 0;
    for (int p = 0; p < nprocs; p++) {
        int status = 0;
        if (waitpid(pids[p], &status, 0) != pids[p] || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "process %d failed (status 0x%x)\n", p, status);
            failed = 1;
        }
    }
    return failed;
}

static int run_job(const epx_unique_id_t *id, int nprocs, const job_t *j)
{
    pid_t pids[MAX_PROCS];
    if (start_procs(nprocs, rank_body, id, j, pids)) return 1;
    return wait_procs(nprocs, pids);
}

/* A plain job of `nranks`: process p is rank p. */
static job_t plain_job(int nranks, double max_s)
{
    job_t j;
    memset(&j, 0, sizeof(j));
    for (int p = 0; p < MAX_PROCS; p++) j.told_rank[p] = p;
    j.nranks = nranks;
    j.expect = EPX_SUCCESS;
    j.max_s = max_s;
    return j;
}

/* Waits until rank 0 closes `fd`: the seconds it took, or -1 when it sent a byte or stayed open. */
static double seconds_to_eof(int fd, double limit_s)
{
    double t0 = epx_test_now_s();
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, (int)(limit_s * 1000)) <= 0) return -1;
    char byte;
    ssize_t n = recv(fd, &byte, 1, 0);
    if (n > 0) fprintf(stderr, "an unauthenticated connection received a byte\n");
    return n == 0 || (n < 0 && errno == ECONNRESET) ? epx_test_now_s() - t0 : -1;
}

/* Defect: one idle connection held the rendezvous until the timeout; R + 16 made it fail. The
 * same job also succeeds quickly behind more idle connections than rank 0 holds at once. */
static int test_idle_connections(void)
{
    const int nranks = 3, counts[] = {nranks + 16, EPX_BOOT_PENDING_MAX + 40};
    static int idle[MAX_IDLE];
    for (int c = 0; c < 2; c++) {
        epx_unique_id_t id;
        EXPECT_OK(epx_get_unique_id(&id));
        for (int i = 0; i < counts[c]; i++) EXPECT_TRUE((idle[i] = boot_connect(&id)) >= 0);
        job_t j = plain_job(nranks, 2.0);
        double t0 = epx_test_now_s();
        EXPECT_TRUE(run_job(&id, nranks, &j) == 0);
        printf("idle: job of %d ranks behind %d idle connections took %.3f s\n", nranks, counts[c],
               epx_test_now_s() - t0);
        /* Each idle connection learned nothing and is closed by now. */
        for (int i = 0; i < counts[c]; i++) {
            EXPECT_TRUE(seconds_to_eof(idle[i], 3.0) >= 0);
            close(idle[i]);
        }
    }
    return 0;
}

/* A partial hello is dropped after EPX_BOOT_HELLO_MS while the rendezvous goes on; a wrong secret
 * and an oversized hello are dropped at once; none of them receives a byte. */
static int test_bad_hellos(void)
{
    const int nranks = 2;
    epx_unique_id_t id;
    EXPECT_OK(epx_get_unique_id(&id));
    job_t j = plain_job(nranks, 4.0);
    j.delay_ms[1] = 2600; /* the rendezvous outlives the partial hello's deadline */
    pid_t pids[MAX_PROCS];
    if (start_procs(nranks, rank_body, &id, &j, pids)) return 1;

    epx_boot_hello_t wrong = boot_hello(&id, 1, nranks);
    wrong.tag[5] ^= 1;
    int fd_wrong = boot_connect(&id);
    EXPECT_TRUE(fd_wrong >= 0);
    EXPECT_TRUE(send(fd_wrong, &wrong, sizeof(wrong), 0) == (ssize_t)sizeof(wrong));
    double t = seconds_to_eof(fd_wrong, 1.0);
    EXPECT_TRUE(t >= 0 && t < 0.5);

    char big[sizeof(epx_boot_hello_t) + 1000];
    memset(big, 0x5a, sizeof(big));
    epx_boot_hello_t good = boot_hello(&id, 1, nranks);
    memcpy(big, &good, sizeof(good));
    int fd_big = boot_connect(&id);
    EXPECT_TRUE(fd_big >= 0);
    EXPECT_TRUE(send(fd_big, big, sizeof(big), 0) == (ssize_t)sizeof(big));
    t = seconds_to_eof(fd_big, 1.0);
    EXPECT_TRUE(t >= 0 && t < 0.5);

    int fd_part = boot_connect(&id);
    EXPECT_TRUE(fd_part >= 0);
    EXPECT_TRUE(send(fd_part, &good, sizeof(good) / 2, 0) == (ssize_t)(sizeof(good) / 2));
    t = seconds_to_eof(fd_part, 3.0);
    printf("bad hellos: a partial hello was dropped after %.3f s\n", t);
    EXPECT_TRUE(t > EPX_BOOT_HELLO_MS / 1000.0 - 0.2 && t < EPX_BOOT_HELLO_MS / 1000.0 + 0.5);
    close(fd_wrong);
    close(fd_big);
    close(fd_part);
    /* The real rank 1 arrives after all of that and the job succeeds. */
    return wait_procs(nranks, pids);
}

/* An impostor on rank 0's address (a process that took the port; here the test itself, with an id
 * it made by hand): the peer's hello must not carry the id's secret, and the impostor's verdict, which
 * it cannot sign, must make the peer's init fail with EPX_ERR_BOOTSTRAP naming the missing proof,
 * whatever the verdict says: success, a failure of the impostor's choice with its text, or a status
 * outside epx_result_t. */
static int impostor_case(int32_t status, const char *message)
{
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof(sa));
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(sa);
    EXPECT_TRUE(lfd >= 0 && bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) == 0 && listen(lfd, 4) == 0 &&
                getsockname(lfd, (struct sockaddr *)&sa, &len) == 0);
    epx_boot_id_t b;
    memset(&b, 0, sizeof(b));
    b.magic = EPX_BOOT_ID_MAGIC;
    b.addr = sa.sin_addr.s_addr;
    b.port = sa.sin_port;
    for (int i = 0; i < EPX_BOOT_SECRET_BYTES; i++) b.secret[i] = (unsigned char)(0xa0 + 7 * i);
    epx_unique_id_t id;
    memset(&id, 0, sizeof(id));
    memcpy(id.internal, &b, sizeof(b));
    job_t j = plain_job(2, 4.0);
    j.absent[0] = 1; /* rank 0 is the impostor */
    j.expect = EPX_ERR_BOOTSTRAP;
    j.needle = "without proof that it holds the unique id's secret";
    pid_t pids[MAX_PROCS];
    if (start_procs(2, rank_body, &id, &j, pids)) return 1;
    int fd = accept(lfd, NULL, NULL);
    EXPECT_TRUE(fd >= 0);
    epx_boot_hello_t hello;
    size_t got = 0;
    while (got < sizeof(hello)) {
        ssize_t n = recv(fd, (char *)&hello + got, sizeof(hello) - got, 0);
        if (n <= 0) break;
        got += (size_t)n;
    }
    EXPECT_TRUE(got == sizeof(hello) && hello.rank == 1 && hello.nranks == 2);
    /* Nothing of the secret travels: no 4 of its bytes in a row appear in the hello. */
    for (size_t i = 0; i + 4 <= sizeof(hello); i++)
        for (int k = 0; k + 4 <= EPX_BOOT_SECRET_BYTES; k++)
            EXPECT_TRUE(memcmp((const char *)&hello + i, b.secret + k, 4) != 0);
    boot_reply_t forged;
    memset(&forged, 0, sizeof(forged));
    forged.magic = BOOT_REPLY_MAGIC;
    forged.status = status;
    snprintf(forged.message, sizeof(forged.message), "%s", message);
    EXPECT_TRUE(send(fd, &forged, sizeof(forged), MSG_NOSIGNAL) == (ssize_t)sizeof(forged));
    const int rc = wait_procs(2, pids);
    close(fd);
    close(lfd);
    return rc;
}

static int test_impostor_rank0(void)
{
    return impostor_case(EPX_SUCCESS, "") ||
           impostor_case(EPX_ERR_MISMATCH, "rank 3 disagrees on nranks (this text is an impostor's)") ||
           impostor_case(999, "a status outside the enum") || impostor_case(-1, "a negative status");
}

/* Two processes as rank 1: every one fails at once with a message naming rank 1. */
static int test_duplicate_rank(void)
{
    epx_unique_id_t id;
    EXPECT_OK(epx_get_unique_id(&id));
    job_t j = plain_job(3, 1.5);
    j.told_rank[2] = 1;
    j.expect = EPX_ERR_BOOTSTRAP;
    j.needle = "as rank 1";
    return run_job(&id, 3, &j);
}

/* A hello with the secret and rank 7 of 2: refused, told why, and the job fails naming rank 7. */
static int test_rank_out_of_range(void)
{
    epx_unique_id_t id;
    EXPECT_OK(epx_get_unique_id(&id));
    int fd = boot_connect(&id);
    EXPECT_TRUE(fd >= 0);
    epx_boot_hello_t h = boot_hello(&id, 7, 2);
    EXPECT_TRUE(send(fd, &h, sizeof(h), 0) == (ssize_t)sizeof(h));
    job_t j = plain_job(2, 1.5);
    j.expect = EPX_ERR_BOOTSTRAP;
    j.needle = "rank 7";
    int rc = run_job(&id, 2, &j);
    /* The refused peer (authenticated) is told the verdict, which names it. */
    char reply[256] = {0};
    size_t got = 0;
    while (got < sizeof(reply)) {
        ssize_t n = recv(fd, reply + got, sizeof(reply) - got, 0);
        if (n <= 0) break;
        got += (size_t)n;
    }
    close(fd);
    EXPECT_TRUE(got > 16);
    reply[sizeof(reply) - 1] = '\0';
    EXPECT_TRUE(strstr(reply + 16, "rank 7") != NULL);
    return rc;
}

static int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    int n = 0;
    while (readdir(d)) n++;
    closedir(d);
    return n;
}

/* Defect: the launcher kept one listening socket per id, still accepting. Ten jobs leave the fd
 * count where the first left it, and nobody listens on a finished job's address. */
static int test_launcher_fds(void)
{
    int first = -1;
    for (int i = 0; i < 10; i++) {
        epx_unique_id_t id;
        EXPECT_OK(epx_get_unique_id(&id));
        job_t j = plain_job(2, 5.0);
        EXPECT_TRUE(run_job(&id, 2, &j) == 0);
        int fd = boot_connect(&id);
        if (fd >= 0) close(fd);
        EXPECT_TRUE(fd < 0);
        int n = count_fds();
        if (first < 0) first = n;
        if (n != first) {
            fprintf(stderr, "launcher fds: %d after job 1, %d after job %d\n", first, n, i + 1);
            return 1;
        }
    }
    return 0;
}

/* Every wait is bounded by EPX_TIMEOUT_MS: rank 0 missing (the launcher still holds its socket)
 * or rank 3 missing, the others fail within it. */
static int test_missing_ranks_bounded(void)
{
    const double bound = SHORT_TIMEOUT_MS / 1000.0 + SLACK_S;
    if (epx_test_set_env("EPX_TIMEOUT_MS", "1500")) return 1;
    epx_unique_id_t id;
    EXPECT_OK(epx_get_unique_id(&id));
    job_t j = plain_job(3, bound);
    j.absent[0] = 1;
    j.expect = EPX_ERR_TIMEOUT;
    if (run_job(&id, 3, &j)) return 1;
    EXPECT_OK(epx_get_unique_id(&id));
    j = plain_job(4, bound);
    j.expect = EPX_ERR_TIMEOUT;
    j.needle = "missing: 3";
    int rc = run_job(&id, 3, &j);
    return epx_test_set_env("EPX_TIMEOUT_MS", "6000") || rc;
}

/* EPX_SOCKET_IFNAME in NCCL's form, and loopback by default when the launcher puts the job on one
 * node. */
static int test_interface_choice(void)
{
    EXPECT_TRUE(epx_socket_ifname_matches("eth", "eth0") && !epx_socket_ifname_matches("eth", "ib0"));
    EXPECT_TRUE(epx_socket_ifname_matches("ib,eth", "eth1") && !epx_socket_ifname_matches("=eth", "eth0"));
    EXPECT_TRUE(epx_socket_ifname_matches("=eth0", "eth0") && !epx_socket_ifname_matches("^eth", "eth2"));
    EXPECT_TRUE(epx_socket_ifname_matches("^docker,lo", "ens5") && !epx_socket_ifname_matches("^=lo", "lo"));
    if (epx_test_set_env("LOCAL_WORLD_SIZE", "4") || epx_test_set_env("WORLD_SIZE", "4")) return 1;
    epx_unique_id_t id;
    EXPECT_OK(epx_get_unique_id(&id));
    int rc = boot_id_fields(&id).addr != htonl(INADDR_LOOPBACK);
    if (!rc) {
        job_t j = plain_job(2, 5.0);
        rc = run_job(&id, 2, &j);
    }
    if (epx_test_set_env("WORLD_SIZE", "8") || epx_test_set_env("EPX_SOCKET_IFNAME", "lo")) return 1;
    EXPECT_OK(epx_get_unique_id(&id));
    rc |= boot_id_fields(&id).addr != htonl(INADDR_LOOPBACK);
    job_t j = plain_job(2, 5.0);
    rc |= run_job(&id, 2, &j);
    if (epx_test_set_env("LOCAL_WORLD_SIZE", NULL) || epx_test_set_env("WORLD_SIZE", NULL) ||
        epx_test_set_env("EPX_SOCKET_IFNAME", "=nosuch0"))
        return 1;
    EXPECT_RES(epx_get_unique_id(&id), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("EPX_SOCKET_IFNAME=");
    return epx_test_set_env("EPX_SOCKET_IFNAME", NULL) || rc;
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    if (epx_test_set_env("EPX_TIMEOUT_MS", "6000") || epx_test_set_env("EPX_DEBUG", "error")) return 1;
    int (*const cases[])(void) = {test_idle_connections,  test_bad_hellos,   test_impostor_rank0,
                                  test_duplicate_rank,    test_rank_out_of_range, test_launcher_fds,
                                  test_missing_ranks_bounded, test_interface_choice};
    const char *names[] = {"idle connections",  "bad hellos",   "impostor rank 0", "duplicate rank",
                           "rank out of range", "launcher fds", "missing ranks bounded",
                           "interface choice"};
    int failed = 0;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int rc = cases[i]();
        printf("%s: %s\n", names[i], rc ? "FAILED" : "ok");
        fflush(stdout);
        failed |= rc;
    }
    return failed;
}
