/*
 * A peer that exited is noticed at once even while nobody has reaped it: one rank of three exits
 * after buffer creation and its parent leaves it a zombie; the survivors' LL dispatch must fail
 * with EPX_ERR_REMOTE long before the comm's timeout (20 s here).
 */
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "epx_test.h"

#define NRANKS  3
#define TMAX    4
#define HID     128
#define TOPK    2
#define NEXP    6
#define DEAD    2
#define LIMIT_S 1.5

/* A survivor's body: returns 0 when its dispatch failed with EPX_ERR_REMOTE within LIMIT_S. */
static int rank_body(int rank, const epx_unique_id_t *id)
{
    epx_comm_t comm;
    epx_buffer_t buf;
    /* A timeout far above LIMIT_S: only a noticed death passes. */
    EXPECT_OK(epx_test_host_comm(id, rank, NRANKS, 20000, &comm));
    const epx_buffer_config_t cfg = epx_test_buffer_config(TMAX, HID, TOPK, NEXP, EPX_MODE_LL);
    EXPECT_OK(epx_buffer_create(comm, &cfg, &buf));
    if (rank == DEAD) {
        /* Give the survivors time to start waiting for our publication, then leave unreaped. */
        usleep(200000);
        _exit(0);
    }
    static uint16_t x[TMAX * HID], recv_x[NEXP / NRANKS * NRANKS * TMAX * HID];
    static int32_t topk[TMAX * TOPK], count[NEXP / NRANKS];
    for (int t = 0; t < TMAX; t++)
        for (int k = 0; k < TOPK; k++) topk[t * TOPK + k] = (t + k * 3) % NEXP;
    epx_ll_dispatch_args_t args = EPX_LL_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(x, EPX_DTYPE_BF16, TMAX, HID);
    args.topk_idx = epx_tensor_2d(topk, EPX_DTYPE_INT32, TMAX, TOPK);
    epx_ll_dispatch_outputs_t out = EPX_LL_DISPATCH_OUTPUTS_INIT;
    out.recv_x = epx_tensor_3d(recv_x, EPX_DTYPE_BF16, NEXP / NRANKS, NRANKS * TMAX, HID);
    out.recv_count = epx_tensor_1d(count, EPX_DTYPE_INT32, NEXP / NRANKS);
    const double t0 = epx_test_now_s();
    EXPECT_RES(epx_ll_dispatch(buf, &args, &out), EPX_ERR_REMOTE);
    const double waited = epx_test_now_s() - t0;
    if (waited > LIMIT_S) {
        fprintf(stderr, "rank %d: the dead peer was noticed after %.3f s\n", rank, waited);
        return 1;
    }
    EXPECT_MSG_HAS("exited");
    return 0;
}

/* 1 when `pid` is a zombie (exited, not reaped). */
static int is_zombie(pid_t pid)
{
    char path[64], text[512];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    ssize_t n = read(fd, text, sizeof(text) - 1);
    close(fd);
    text[n > 0 ? n : 0] = '\0';
    const char *paren = strrchr(text, ')');
    return paren && paren[1] == ' ' && paren[2] == 'Z';
}

/* Waits for `pid` (and only it) for at most limit_s; kills it past that. Returns its exit status
 * or -1. */
static int wait_one(pid_t pid, double limit_s)
{
    const double end = epx_test_now_s() + limit_s;
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
        if (epx_test_now_s() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            return -1;
        }
        usleep(1000);
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int main(void)
{
    epx_unique_id_t id;
    EXPECT_OK(epx_get_unique_id(&id));
    fflush(NULL);
    pid_t pids[NRANKS];
    for (int r = 0; r < NRANKS; r++) {
        pids[r] = fork();
        EXPECT_TRUE(pids[r] >= 0);
        if (pids[r] == 0) _exit(rank_body(r, &id));
    }
    int failed = 0;
    for (int r = 0; r < NRANKS; r++) {
        if (r == DEAD) continue;
        const int status = wait_one(pids[r], 30.0);
        if (status != 0) fprintf(stderr, "death: survivor %d ended with status %d\n", r, status);
        failed |= status != 0;
    }
    /* The dead rank must have been a zombie all along: only now is it reaped. */
    const int zombie = is_zombie(pids[DEAD]);
    if (!zombie) fprintf(stderr, "death: rank %d was not a zombie\n", DEAD);
    const int dead_status = wait_one(pids[DEAD], 5.0);
    EXPECT_TRUE(!failed && zombie && dead_status == 0);
    printf("death: ok\n");
    return 0;
}
