/* Seed selection, and the multi-rank launcher of the tests over the shared harness. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "epx_test.h"

uint64_t epx_test_seed(void)
{
    const char *env = getenv("EPX_TEST_SEED");
    uint64_t seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);
    printf("seed %llu (EPX_TEST_SEED to replay)\n", (unsigned long long)seed);
    fflush(stdout);
    return seed;
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
