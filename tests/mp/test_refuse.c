/*
 * epx_buffer_refuse_collective on 2 and 3 ranks: for each kind of collective call, one rank refuses
 * it while the others make it validly; they return EPX_ERR_REMOTE well before the timeout, and the
 * next calls pair and carry the right data (LL slots included). Misuse of the call tells no one.
 */
#include "core/numeric.h"
#include "test_misuse_io.h"

#define TIMEOUT_MS 20000
#define PROMPT_S   5.0 /* a told peer returns well within the timeout */
#define NCALLS     6   /* the kinds: EPX_COLLECTIVE_HT_DISPATCH .. EPX_COLLECTIVE_RM_COMBINE */

typedef struct ctx {
    int rank, nranks, L;
    epx_buffer_t b;
    io_t io;
    float weights[TMAX];        /* 1.0: top-1 combines return x */
    uint8_t rmap[TMAX * 2 * 3]; /* [T, E] bool, E = 2R */
    int32_t recv_count[2];
    epx_ll_handle_t ll;
    epx_handle_t h;
    int64_t rows;
    int ll_dispatches; /* LL dispatches so far, refused ones included: the slot of the next */
} ctx_t;

/* x[t][c] from (rank, token, channel), exact in bf16. */
static void fill(ctx_t *c)
{
    io_init(&c->io, c->rank, c->nranks);
    const int E = 2 * c->nranks;
    memset(c->rmap, 0, sizeof(c->rmap));
    for (int t = 0; t < TMAX; t++) {
        for (int ch = 0; ch < HID; ch++)
            c->io.x[t * HID + ch] = epx_f32_to_bf16((float)(c->rank * 32 + t * 8 + ch % 8));
        c->weights[t] = 1.0f;
        c->rmap[t * E + c->io.topk[t]] = 1;
    }
}

/* The combined rows equal x: each token went to one expert and came back once. */
static int combined_is_x(const ctx_t *c, const char *what)
{
    if (memcmp(c->io.combined, c->io.x, sizeof(c->io.x)) == 0) return 0;
    fprintf(stderr, "rank %d: %s: combined rows differ from x\n", c->rank, what);
    return 1;
}

/* ------------------------------------------------------------------------ the calls ---- */

static epx_result_t ht_dispatch(ctx_t *c)
{
    return io_dispatch(c->b, &c->io, c->nranks, NULL, &c->h, &c->rows);
}

static epx_result_t ht_combine(ctx_t *c)
{
    memset(c->io.combined, 0, sizeof(c->io.combined));
    return io_combine(c->b, &c->io, c->h, c->rows);
}

static epx_result_t ll_dispatch(ctx_t *c)
{
    const int64_t rows = (int64_t)c->nranks * TMAX;
    epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
    epx_ll_dispatch_outputs_t o = EPX_LL_DISPATCH_OUTPUTS_INIT;
    a.x = epx_tensor_2d(c->io.x, EPX_DTYPE_BF16, TMAX, HID);
    a.topk_idx = epx_tensor_2d(c->io.topk, EPX_DTYPE_INT32, TMAX, 1);
    o.recv_x = epx_tensor_3d(c->io.recv, EPX_DTYPE_BF16, c->L, rows, HID);
    o.recv_count = epx_tensor_1d(c->recv_count, EPX_DTYPE_INT32, c->L);
    c->ll_dispatches++;
    epx_result_t res = epx_ll_dispatch(c->b, &a, &o);
    if (res == EPX_SUCCESS) c->ll = o.handle;
    return res;
}

static epx_result_t ll_combine(ctx_t *c)
{
    const int64_t rows = (int64_t)c->nranks * TMAX;
    epx_ll_combine_args_t a = EPX_LL_COMBINE_ARGS_INIT;
    epx_ll_combine_outputs_t o = EPX_LL_COMBINE_OUTPUTS_INIT;
    a.handle = c->ll;
    a.y = epx_tensor_3d(c->io.recv, EPX_DTYPE_BF16, c->L, rows, HID);
    a.topk_idx = epx_tensor_2d(c->io.topk, EPX_DTYPE_INT32, TMAX, 1);
    a.topk_weights = epx_tensor_2d(c->weights, EPX_DTYPE_FP32, TMAX, 1);
    memset(c->io.combined, 0, sizeof(c->io.combined));
    o.combined_x = epx_tensor_2d(c->io.combined, EPX_DTYPE_BF16, TMAX, HID);
    return epx_ll_combine(c->b, &a, &o);
}

static epx_result_t rm_dispatch(ctx_t *c)
{
    epx_rm_dispatch_args_t a = EPX_RM_DISPATCH_ARGS_INIT;
    epx_rm_dispatch_outputs_t o = EPX_RM_DISPATCH_OUTPUTS_INIT;
    a.hidden = epx_tensor_2d(c->io.x, EPX_DTYPE_BF16, TMAX, HID);
    a.routing_map = epx_tensor_2d(c->rmap, EPX_DTYPE_BOOL, TMAX, 2 * c->nranks);
    o.tokens = epx_tensor_2d(c->io.recv, EPX_DTYPE_BF16, (int64_t)c->nranks * TMAX, HID);
    epx_result_t res = epx_rm_dispatch(c->b, &a, &o);
    if (res == EPX_SUCCESS) {
        c->h = o.handle;
        c->rows = o.num_tokens_host;
    }
    return res;
}

static epx_result_t rm_combine(ctx_t *c)
{
    epx_rm_combine_args_t a = EPX_RM_COMBINE_ARGS_INIT;
    epx_rm_combine_outputs_t o = EPX_RM_COMBINE_OUTPUTS_INIT;
    a.handle = c->h;
    a.x = epx_tensor_2d(c->io.recv, EPX_DTYPE_BF16, c->rows, HID);
    memset(c->io.combined, 0, sizeof(c->io.combined));
    o.combined = epx_tensor_2d(c->io.combined, EPX_DTYPE_BF16, TMAX, HID);
    return epx_rm_combine(c->b, &a, &o);
}

typedef epx_result_t (*call_fn)(ctx_t *c);

/* By kind - 1: the dispatch and the combine of each family. */
static const struct {
    call_fn dispatch, combine;
    int ll;
} families[3] = {{ht_dispatch, ht_combine, 0}, {ll_dispatch, ll_combine, 1}, {rm_dispatch, rm_combine, 0}};

static epx_result_t release(ctx_t *c, int family)
{
    if (family == 1) return EPX_SUCCESS;
    epx_result_t res = epx_handle_destroy(c->h);
    c->h = NULL;
    return res;
}

/* A dispatch and combine of `family` on every rank, checked. */
static int round_trip(ctx_t *c, int family, const char *what)
{
    EXPECT_OK(families[family].dispatch(c));
    if (families[family].ll) EXPECT_EQ_INT(c->ll.slot, (c->ll_dispatches - 1) % 2);
    EXPECT_OK(families[family].combine(c));
    if (combined_is_x(c, what)) return 1;
    EXPECT_OK(release(c, family));
    return 0;
}

/* ------------------------------------------------------------------------- the cases ---- */

/* Rank `refuser` refuses the call of `kind` (with `code`), the others make it: they return
 * EPX_ERR_REMOTE promptly, the refuser `expected` with its reason. */
static int refused_call(ctx_t *c, epx_collective_t kind, int refuser, epx_result_t code,
                        epx_result_t expected)
{
    const int family = ((int)kind - 1) / 2, is_combine = ((int)kind - 1) % 2;
    call_fn call = is_combine ? families[family].combine : families[family].dispatch;
    char reason[96];
    snprintf(reason, sizeof(reason), "rank %d: the binding refused kind %d", refuser, (int)kind);
    if (c->rank == refuser) {
        if (kind == EPX_COLLECTIVE_LL_DISPATCH) c->ll_dispatches++;
        EXPECT_RES(epx_buffer_refuse_collective(c->b, kind, code, reason, NULL), expected);
        EXPECT_TRUE(strcmp(epx_last_error_message(), reason) == 0);
        return 0;
    }
    const double start = epx_test_now_s();
    EXPECT_RES(call(c), EPX_ERR_REMOTE);
    const double took = epx_test_now_s() - start;
    if (took > PROMPT_S) {
        fprintf(stderr, "rank %d: kind %d: EPX_ERR_REMOTE after %.1f s\n", c->rank, (int)kind, took);
        return 1;
    }
    return 0;
}

/* For each kind: a refusal on one rank, then calls of that family that must pair and be right. */
static int refuse_each_kind(ctx_t *c)
{
    static const epx_result_t codes[][2] = {
        {EPX_ERR_INVALID_ARG, EPX_ERR_INVALID_ARG},     {EPX_SUCCESS, EPX_ERR_INVALID_ARG},
        {(epx_result_t)999, EPX_ERR_INVALID_ARG},       {EPX_ERR_UNSUPPORTED, EPX_ERR_UNSUPPORTED},
        {EPX_ERR_OUT_OF_MEMORY, EPX_ERR_OUT_OF_MEMORY}, {EPX_ERR_INVALID_USAGE, EPX_ERR_INVALID_USAGE},
    };
    for (int k = EPX_COLLECTIVE_HT_DISPATCH; k <= EPX_COLLECTIVE_RM_COMBINE; k++) {
        const epx_collective_t kind = (epx_collective_t)k;
        const int family = (k - 1) / 2, is_combine = (k - 1) % 2, refuser = k % c->nranks;
        char what[32];
        snprintf(what, sizeof(what), "after kind %d", k);
        if (is_combine) EXPECT_OK(families[family].dispatch(c));
        if (refused_call(c, kind, refuser, codes[k - 1][0], codes[k - 1][1])) return 1;
        if (is_combine) {
            /* The dispatch's handle is still good: its combine now pairs on every rank. */
            EXPECT_OK(families[family].combine(c));
            if (combined_is_x(c, what)) return 1;
            EXPECT_OK(release(c, family));
        }
        if (round_trip(c, family, what)) return 1;
    }
    return 0;
}

/* LL slots: dispatch A, a refused dispatch, dispatch B (A's slot again): A's handle is stale on
 * every rank alike, and B combines. */
static int ll_slots_in_step(ctx_t *c)
{
    EXPECT_OK(ll_dispatch(c));
    const epx_ll_handle_t first = c->ll;
    if (refused_call(c, EPX_COLLECTIVE_LL_DISPATCH, 0, EPX_ERR_INVALID_ARG, EPX_ERR_INVALID_ARG)) return 1;
    EXPECT_OK(ll_dispatch(c));
    EXPECT_EQ_INT(c->ll.slot, first.slot);
    const epx_ll_handle_t second = c->ll;
    c->ll = first;
    const epx_result_t stale = ll_combine(c);
    EXPECT_TRUE(stale == EPX_ERR_INVALID_ARG || stale == EPX_ERR_REMOTE);
    c->ll = second;
    EXPECT_OK(ll_combine(c));
    return combined_is_x(c, "ll after a refused dispatch");
}

/* Misuse tells no one and numbers nothing: a valid round trip follows on every rank. */
static int misuse(ctx_t *c)
{
    EXPECT_RES(epx_buffer_refuse_collective(NULL, EPX_COLLECTIVE_HT_DISPATCH, EPX_ERR_INVALID_ARG, "x", NULL),
               EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("buffer is NULL");
    EXPECT_RES(epx_buffer_refuse_collective(c->b, (epx_collective_t)0, EPX_ERR_INVALID_ARG, "x", NULL),
               EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("kind = 0");
    EXPECT_RES(epx_buffer_refuse_collective(c->b, (epx_collective_t)7, EPX_ERR_INVALID_ARG, "x", NULL),
               EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("kind = 7");
    if (round_trip(c, 0, "after misuse")) return 1;
    /* Without a reason the message names the call. */
    if (c->rank == 1) {
        EXPECT_RES(
            epx_buffer_refuse_collective(c->b, EPX_COLLECTIVE_RM_DISPATCH, EPX_ERR_INVALID_ARG, NULL, NULL),
            EPX_ERR_INVALID_ARG);
        EXPECT_MSG_HAS("epx_rm_dispatch");
    } else {
        EXPECT_RES(rm_dispatch(c), EPX_ERR_REMOTE);
    }
    return round_trip(c, 2, "after a refusal without reason");
}

static int body(int rank, int nranks, const epx_unique_id_t *id, void *arg)
{
    (void)arg;
    static ctx_t c;
    memset(&c, 0, sizeof(c));
    c.rank = rank;
    c.nranks = nranks;
    c.L = 2;
    fill(&c);
    epx_comm_t comm = NULL;
    EXPECT_OK(epx_test_host_comm(id, rank, nranks, TIMEOUT_MS, &comm));
    epx_buffer_config_t cfg = epx_test_buffer_config(TMAX, HID, 1, 2 * nranks, 0);
    EXPECT_OK(epx_buffer_create(comm, &cfg, &c.b));
    if (refuse_each_kind(&c) || ll_slots_in_step(&c) || misuse(&c)) return 1;

    EXPECT_OK(epx_buffer_destroy(c.b));
    EXPECT_RES(epx_buffer_refuse_collective(c.b, EPX_COLLECTIVE_HT_DISPATCH, EPX_ERR_INVALID_ARG, "x", NULL),
               EPX_ERR_INVALID_USAGE);
    EXPECT_OK(epx_comm_destroy(comm));
    printf("rank %d of %d: refusals told and in step\n", rank, nranks);
    return 0;
}

int main(void)
{
    const int failed = epx_test_run_ranks(2, body, NULL, 120) || epx_test_run_ranks(3, body, NULL, 120);
    printf("refuse: %s\n", failed ? "FAILED" : "ok");
    return failed;
}
