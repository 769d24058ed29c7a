/* Seed, buffer config, HT call, clock and hash helpers, and the multi-rank launcher over the harness. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "core/internal.h"
#include "epx_test.h"

uint64_t epx_test_seed(void)
{
    const char *env = getenv("EPX_TEST_SEED");
    uint64_t seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);
    printf("seed %llu (EPX_TEST_SEED to replay)\n", (unsigned long long)seed);
    fflush(stdout);
    return seed;
}

epx_buffer_config_t epx_test_buffer_config(int64_t max_tokens, int64_t hidden, int num_topk, int num_experts,
                                           uint32_t modes)
{
    const epx_buffer_config_t cfg = {.size = sizeof(epx_buffer_config_t),
                                     .version = EPX_VERSION_CODE,
                                     .max_tokens = max_tokens,
                                     .hidden = hidden,
                                     .num_topk = num_topk,
                                     .num_experts = num_experts,
                                     .modes = modes};
    return cfg;
}

epx_ht_dispatch_args_t epx_test_ht_dispatch_args(void *x, void *topk_idx, void *topk_weights, int64_t T,
                                                 int64_t H, int64_t K)
{
    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    a.x = epx_tensor_2d(x, EPX_DTYPE_BF16, T, H);
    a.topk_idx = epx_tensor_2d(topk_idx, EPX_DTYPE_INT64, T, K);
    a.topk_weights = epx_tensor_2d(topk_weights, EPX_DTYPE_FP32, T, K);
    return a;
}

epx_ht_dispatch_outputs_t epx_test_ht_dispatch_outputs(void *recv_x, void *recv_topk_idx,
                                                       void *recv_topk_weights, int64_t N, int64_t H,
                                                       int64_t K)
{
    epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
    o.recv_x = epx_tensor_2d(recv_x, EPX_DTYPE_BF16, N, H);
    o.recv_topk_idx = epx_tensor_2d(recv_topk_idx, EPX_DTYPE_INT64, N, K);
    o.recv_topk_weights = epx_tensor_2d(recv_topk_weights, EPX_DTYPE_FP32, N, K);
    return o;
}

epx_ht_combine_args_t epx_test_ht_combine_args(epx_handle_t handle, void *x, void *topk_weights, int64_t N,
                                               int64_t H, int64_t K)
{
    epx_ht_combine_args_t a = EPX_HT_COMBINE_ARGS_INIT;
    a.handle = handle;
    a.x = epx_tensor_2d(x, EPX_DTYPE_BF16, N, H);
    a.topk_weights = epx_tensor_2d(topk_weights, EPX_DTYPE_FP32, N, K);
    return a;
}

epx_ht_combine_outputs_t epx_test_ht_combine_outputs(void *combined_x, void *combined_topk_weights, int64_t T,
                                                     int64_t H, int64_t K)
{
    epx_ht_combine_outputs_t o = EPX_HT_COMBINE_OUTPUTS_INIT;
    o.combined_x = epx_tensor_2d(combined_x, EPX_DTYPE_BF16, T, H);
    o.combined_topk_weights = epx_tensor_2d(combined_topk_weights, EPX_DTYPE_FP32, T, K);
    return o;
}

epx_result_t epx_test_host_comm(const epx_unique_id_t *id, int rank, int nranks, int timeout_ms,
                                epx_comm_t *comm_out)
{
    epx_comm_config_t cc = EPX_COMM_CONFIG_INIT;
    cc.backend = EPX_BACKEND_HOST;
    cc.timeout_ms = timeout_ms;
    return epx_comm_init(id, rank, nranks, &cc, comm_out);
}

double epx_test_now_s(void)
{
    return (double)epx_time_ns() * 1e-9;
}

uint64_t epx_test_fnv(const void *data, size_t n, uint64_t h)
{
    const uint8_t *b = data;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* The tests' rank bodies take no result slot: adapt them to the harness's. */
typedef struct adapter {
    epx_test_rank_fn fn;
    void *ctx;
} adapter_t;

static int adapt(int rank, int nranks, const epx_unique_id_t *id, void *ctx, void *result)
{
    const adapter_t *a = ctx;
    (void)result;
    return a->fn(rank, nranks, id, a->ctx);
}

int epx_test_run_ranks(int nranks, epx_test_rank_fn fn, void *ctx, int timeout_s)
{
    adapter_t a = {fn, ctx};
    return epx_harness_run_simple("ranks", nranks, adapt, &a, timeout_s);
}

int epx_test_run_cases(const char *name, const void *cases, size_t n, size_t size, epx_test_rank_fn fn,
                       int timeout_s, uint64_t seed)
{
    int failed = 0;
    for (size_t i = 0; i < n; i++) {
        void *c = (char *)(uintptr_t)cases + i * size; /* the ranks only read it */
        const int nranks = *(const int *)c;
        if (epx_test_run_ranks(nranks, fn, c, timeout_s)) {
            fprintf(stderr, "FAILED: %s case %zu on %d ranks (seed %llu)\n", name, i, nranks,
                    (unsigned long long)seed);
            failed = 1;
        }
    }
    printf(failed ? "%s: FAILED\n" : "%s: ok\n", name);
    return failed;
}

int epx_test_set_env(const char *name, const char *value)
{
    if (value)
        setenv(name, value, 1);
    else
        unsetenv(name);
    /* Parsed in this process before forking, so the ranks inherit the values. */
    EXPECT_OK(epx_params_reload());
    return 0;
}
