/*
 * Two ranks (forked processes) on the host backend: HT dispatch sends each token to the ranks
 * holding its experts, every rank doubles what it received, HT combine sums it back.
 */
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <epx/epx.h>

#define NRANKS  2
#define TOKENS  4
#define HIDDEN  8
#define TOPK    2
#define EXPERTS 4 /* two per rank */

/* bf16 is the top half of an fp32; exact for the small integers used here. */
static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static int fail(int rank, const char *what, epx_result_t res)
{
    fprintf(stderr, "rank %d: %s: %s (%s)\n", rank, what, epx_strerror(res), epx_last_error_message());
    return 1;
}

static int run_rank(int rank, const epx_unique_id_t *id)
{
    epx_comm_config_t comm_cfg = EPX_COMM_CONFIG_INIT;
    comm_cfg.backend = EPX_BACKEND_HOST;
    epx_comm_t comm;
    epx_result_t res = epx_comm_init(id, rank, NRANKS, &comm_cfg, &comm);
    if (res != EPX_SUCCESS) return fail(rank, "epx_comm_init", res);

    epx_buffer_config_t buf_cfg = EPX_BUFFER_CONFIG_INIT;
    buf_cfg.max_tokens = TOKENS;
    buf_cfg.hidden = HIDDEN;
    buf_cfg.num_topk = TOPK;
    buf_cfg.num_experts = EXPERTS;
    buf_cfg.modes = EPX_MODE_HT;
    buf_cfg.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_BF16); /* fp8 would need hidden % 128 == 0 */
    epx_buffer_t buf;
    res = epx_buffer_create(comm, &buf_cfg, &buf);
    if (res != EPX_SUCCESS) {
        epx_comm_destroy(comm);
        return fail(rank, "epx_buffer_create", res);
    }

    /* Token t selects experts t % 4 and (t + 1) % 4: tokens 1 and 3 go to both ranks. */
    uint16_t x[TOKENS][HIDDEN];
    int32_t topk_idx[TOKENS][TOPK];
    for (int t = 0; t < TOKENS; t++) {
        for (int c = 0; c < HIDDEN; c++) x[t][c] = to_bf16((float)(rank * 50 + t * 8 + c));
        topk_idx[t][0] = t % EXPERTS;
        topk_idx[t][1] = (t + 1) % EXPERTS;
    }

    uint16_t recv_x[NRANKS * TOKENS][HIDDEN];
    epx_ht_dispatch_args_t dispatch = EPX_HT_DISPATCH_ARGS_INIT;
    dispatch.x = epx_tensor_2d(x, EPX_DTYPE_BF16, TOKENS, HIDDEN);
    dispatch.topk_idx = epx_tensor_2d(topk_idx, EPX_DTYPE_INT32, TOKENS, TOPK);
    dispatch.expert_alignment = 1;
    epx_ht_dispatch_outputs_t received = EPX_HT_DISPATCH_OUTPUTS_INIT;
    received.recv_x = epx_tensor_2d(recv_x, EPX_DTYPE_BF16, NRANKS * TOKENS, HIDDEN);
    res = epx_ht_dispatch(buf, &dispatch, &received);
    if (res != EPX_SUCCESS) {
        epx_buffer_destroy(buf);
        epx_comm_destroy(comm);
        return fail(rank, "epx_ht_dispatch", res);
    }

    /* The "experts": double every received row. */
    int64_t n = received.num_recv_tokens_host;
    for (int64_t i = 0; i < n; i++)
        for (int c = 0; c < HIDDEN; c++) recv_x[i][c] = to_bf16(2.0f * from_bf16(recv_x[i][c]));

    uint16_t out[TOKENS][HIDDEN];
    epx_ht_combine_args_t combine = EPX_HT_COMBINE_ARGS_INIT;
    combine.handle = received.handle;
    combine.x = epx_tensor_2d(recv_x, EPX_DTYPE_BF16, n, HIDDEN);
    epx_ht_combine_outputs_t combined = EPX_HT_COMBINE_OUTPUTS_INIT;
    combined.combined_x = epx_tensor_2d(out, EPX_DTYPE_BF16, TOKENS, HIDDEN);
    res = epx_ht_combine(buf, &combine, &combined);
    epx_handle_destroy(received.handle);
    epx_buffer_destroy(buf);
    epx_comm_destroy(comm);
    if (res != EPX_SUCCESS) return fail(rank, "epx_ht_combine", res);

    /* Each rank that received token t sent back 2 * x[t]. */
    int mismatches = 0;
    for (int t = 0; t < TOKENS; t++) {
        int ranks = (t % 2) ? 2 : 1;
        for (int c = 0; c < HIDDEN; c++)
            if (from_bf16(out[t][c]) != 2.0f * ranks * from_bf16(x[t][c])) mismatches++;
    }
    printf("rank %d: received %lld tokens, combined %d tokens, %d mismatches\n", rank, (long long)n, TOKENS,
           mismatches);
    return mismatches != 0;
}

int main(void)
{
    epx_unique_id_t id;
    epx_result_t res = epx_get_unique_id(&id);
    if (res != EPX_SUCCESS) return fail(-1, "epx_get_unique_id", res);
    fflush(stdout);
    pid_t pids[NRANKS];
    for (int rank = 0; rank < NRANKS; rank++) {
        pids[rank] = fork();
        if (pids[rank] == 0) {
            int rc = run_rank(rank, &id);
            fflush(stdout);
            _exit(rc);
        }
        if (pids[rank] < 0) return 1;
    }
    int failed = 0;
    for (int rank = 0; rank < NRANKS; rank++) {
        int status;
        if (waitpid(pids[rank], &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) failed = 1;
    }
    printf("%s\n", failed ? "FAILED" : "ok");
    return failed;
}
