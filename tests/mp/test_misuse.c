/*
 * Objects used after their destroy (issue 11, defect 8): double destroy of a handle, buffer and
 * communicator, and calls with destroyed ones, return EPX_ERR_INVALID_USAGE with a message and
 * never touch freed memory (the suite runs under ASan in CI); the peers stay in step.
 */
#include <string.h>

#include "epx_test.h"

#define TMAX 4
#define HID  128

typedef struct io {
    _Alignas(16) uint16_t x[TMAX * HID];
    _Alignas(16) uint16_t recv[8 * TMAX * HID];
    _Alignas(16) uint16_t combined[TMAX * HID];
    int32_t topk[TMAX];
} io_t;

static epx_result_t dispatch(epx_buffer_t b, io_t *io, int nranks, epx_handle_t cached, epx_handle_t *h_out,
                             int64_t *rows_out)
{
    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
    a.x = epx_tensor_2d(io->x, EPX_DTYPE_BF16, TMAX, HID);
    if (!cached) a.topk_idx = epx_tensor_2d(io->topk, EPX_DTYPE_INT32, TMAX, 1);
    a.cached_handle = cached;
    o.recv_x = epx_tensor_2d(io->recv, EPX_DTYPE_BF16, (int64_t)nranks * TMAX, HID);
    epx_result_t res = epx_ht_dispatch(b, &a, &o);
    if (res == EPX_SUCCESS && h_out) *h_out = o.handle;
    if (res == EPX_SUCCESS && rows_out) *rows_out = o.num_recv_tokens_host;
    return res;
}

static epx_result_t combine(epx_buffer_t b, io_t *io, epx_handle_t h, int64_t rows)
{
    epx_ht_combine_args_t a = EPX_HT_COMBINE_ARGS_INIT;
    epx_ht_combine_outputs_t o = EPX_HT_COMBINE_OUTPUTS_INIT;
    a.handle = h;
    a.x = epx_tensor_2d(io->recv, EPX_DTYPE_BF16, rows, HID);
    o.combined_x = epx_tensor_2d(io->combined, EPX_DTYPE_BF16, TMAX, HID);
    return epx_ht_combine(b, &a, &o);
}

/* One dispatch and combine that must succeed: the ranks are still in step. */
static int round_trip(epx_buffer_t b, io_t *io, int nranks)
{
    epx_handle_t h;
    int64_t rows;
    EXPECT_OK(dispatch(b, io, nranks, NULL, &h, &rows));
    EXPECT_OK(combine(b, io, h, rows));
    EXPECT_OK(epx_handle_destroy(h));
    return 0;
}

#define EXPECT_STALE(call, what)                 \
    do {                                         \
        EXPECT_RES(call, EPX_ERR_INVALID_USAGE); \
        EXPECT_MSG_HAS(what);                    \
        EXPECT_MSG_HAS("was destroyed");         \
    } while (0)

static int body(int rank, int nranks, const epx_unique_id_t *id, void *ctx)
{
    (void)ctx;
    static io_t io;
    memset(&io, 0, sizeof(io));
    for (int t = 0; t < TMAX; t++) io.topk[t] = (t + rank) % (2 * nranks);
    epx_comm_config_t cc = EPX_COMM_CONFIG_INIT;
    cc.backend = EPX_BACKEND_HOST;
    cc.timeout_ms = 20000;
    epx_comm_t comm;
    EXPECT_OK(epx_comm_init(id, rank, nranks, &cc, &comm));
    epx_buffer_config_t cfg = epx_test_buffer_config(TMAX, HID, 1, 2 * nranks, EPX_MODE_HT);
    epx_buffer_t b;
    EXPECT_OK(epx_buffer_create(comm, &cfg, &b));

    /* A destroyed handle: every call that names it is refused, collective ones on every rank
     * alike (each rank's own check fails), and the buffer goes on. */
    epx_handle_t h;
    int64_t rows;
    EXPECT_OK(dispatch(b, &io, nranks, NULL, &h, &rows));
    EXPECT_OK(combine(b, &io, h, rows));
    EXPECT_OK(epx_handle_destroy(h));
    EXPECT_STALE(epx_handle_destroy(h), "epx_handle_destroy");
    epx_handle_info_t info;
    EXPECT_STALE(epx_handle_get_info(h, &info), "epx_handle_get_info");
    EXPECT_STALE(combine(b, &io, h, rows), "args.handle");
    EXPECT_STALE(dispatch(b, &io, nranks, h, NULL, NULL), "args.cached_handle");
    epx_tensor_t view;
    EXPECT_STALE(epx_ht_get_combine_input(b, h, &view), "handle");
    if (round_trip(b, &io, nranks)) return 1;

    /* A destroyed buffer. */
    EXPECT_OK(epx_buffer_destroy(b));
    EXPECT_STALE(epx_buffer_destroy(b), "buffer");
    EXPECT_STALE(epx_buffer_query_overflow(b), "buffer");
    EXPECT_STALE(dispatch(b, &io, nranks, NULL, NULL, NULL), "epx_ht_dispatch");
    epx_hook_t hook;
    memset(&hook, 0, sizeof(hook));
    hook.buffer = b;
    EXPECT_STALE(epx_hook_run(&hook, NULL), "epx_hook_run");

    /* The communicator still works, then is destroyed. */
    EXPECT_OK(epx_buffer_create(comm, &cfg, &b));
    if (round_trip(b, &io, nranks)) return 1;
    EXPECT_OK(epx_buffer_destroy(b));
    EXPECT_OK(epx_comm_destroy(comm));
    EXPECT_STALE(epx_comm_destroy(comm), "communicator");
    EXPECT_STALE(epx_buffer_create(comm, &cfg, &b), "epx_buffer_create");
    epx_topology_t topo;
    EXPECT_STALE(epx_comm_get_topology(comm, &topo), "epx_comm_get_topology");
    EXPECT_STALE(epx_get_async_error(comm), "epx_get_async_error");
    printf("rank %d: use after destroy refused\n", rank);
    return 0;
}

int main(void)
{
    if (epx_test_run_ranks(1, body, NULL, 60) || epx_test_run_ranks(2, body, NULL, 60)) {
        printf("misuse: FAILED\n");
        return 1;
    }
    printf("misuse: ok\n");
    return 0;
}
