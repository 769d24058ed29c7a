/*
 * Objects used after their destroy (issue 11, defect 8): double destroy of a handle, buffer and
 * communicator, and calls with destroyed ones, return EPX_ERR_INVALID_USAGE with a message and
 * never touch freed memory (the suite runs under ASan in CI); the peers stay in step.
 */
#include "test_misuse_io.h"

/* One dispatch and combine that must succeed: the ranks are still in step. */
static int round_trip(epx_buffer_t b, io_t *io, int nranks)
{
    epx_handle_t h;
    int64_t rows;
    EXPECT_OK(io_dispatch(b, io, nranks, NULL, &h, &rows));
    EXPECT_OK(io_combine(b, io, h, rows));
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
    io_init(&io, rank, nranks);
    epx_comm_t comm = io_comm(rank, nranks, id);
    EXPECT_TRUE(comm != NULL);
    epx_buffer_config_t cfg = epx_test_buffer_config(TMAX, HID, 1, 2 * nranks, EPX_MODE_HT);
    epx_buffer_t b;
    EXPECT_OK(epx_buffer_create(comm, &cfg, &b));

    /* A destroyed handle: every call that names it is refused, collective ones on every rank
     * alike (each rank's own check fails), and the buffer goes on. */
    epx_handle_t h;
    int64_t rows;
    EXPECT_OK(io_dispatch(b, &io, nranks, NULL, &h, &rows));
    EXPECT_OK(io_combine(b, &io, h, rows));
    EXPECT_OK(epx_handle_destroy(h));
    EXPECT_STALE(epx_handle_destroy(h), "epx_handle_destroy");
    epx_handle_info_t info;
    EXPECT_STALE(epx_handle_get_info(h, &info), "epx_handle_get_info");
    EXPECT_STALE(io_combine(b, &io, h, rows), "args.handle");
    EXPECT_STALE(io_dispatch(b, &io, nranks, h, NULL, NULL), "args.cached_handle");
    epx_tensor_t view;
    EXPECT_STALE(epx_ht_get_combine_input(b, h, &view), "handle");
    if (round_trip(b, &io, nranks)) return 1;

    /* A destroyed buffer. */
    EXPECT_OK(epx_buffer_destroy(b));
    EXPECT_STALE(epx_buffer_destroy(b), "buffer");
    EXPECT_STALE(epx_buffer_query_overflow(b), "buffer");
    EXPECT_STALE(io_dispatch(b, &io, nranks, NULL, NULL, NULL), "epx_ht_dispatch");
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
    return io_main("misuse", body, body, 60);
}
