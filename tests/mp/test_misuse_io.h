/*
 * What the misuse and thread tests share: one small HT round trip's memory and calls, and a main
 * that runs a body on one rank and another on two.
 */
#ifndef EPX_TEST_MISUSE_IO_H
#define EPX_TEST_MISUSE_IO_H

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

/* Routing that reaches every rank of `nranks` (2 experts per rank, top-1). */
static inline void io_init(io_t *io, int rank, int nranks)
{
    memset(io, 0, sizeof(*io));
    for (int t = 0; t < TMAX; t++) io->topk[t] = (t + rank) % (2 * nranks);
}

/* An HT dispatch of TMAX tokens (cached when `cached` is not NULL); handle and row count on
 * success. */
static inline epx_result_t io_dispatch(epx_buffer_t b, io_t *io, int nranks, epx_handle_t cached,
                                       epx_handle_t *h_out, int64_t *rows_out)
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

static inline epx_result_t io_combine(epx_buffer_t b, io_t *io, epx_handle_t h, int64_t rows)
{
    epx_ht_combine_args_t a = EPX_HT_COMBINE_ARGS_INIT;
    epx_ht_combine_outputs_t o = EPX_HT_COMBINE_OUTPUTS_INIT;
    a.handle = h;
    a.x = epx_tensor_2d(io->recv, EPX_DTYPE_BF16, rows, HID);
    o.combined_x = epx_tensor_2d(io->combined, EPX_DTYPE_BF16, TMAX, HID);
    return epx_ht_combine(b, &a, &o);
}

/* A host communicator with a 20 s timeout (NULL on failure). */
static inline epx_comm_t io_comm(int rank, int nranks, const epx_unique_id_t *id)
{
    epx_comm_t comm = NULL;
    return epx_test_host_comm(id, rank, nranks, 20000, &comm) == EPX_SUCCESS ? comm : NULL;
}

/* Runs `one` on one rank, then `two` on two ranks; prints "<name>: ok" or "<name>: FAILED". */
static inline int io_main(const char *name, epx_test_rank_fn one, epx_test_rank_fn two, int timeout_s)
{
    const int failed =
        epx_test_run_ranks(1, one, NULL, timeout_s) || epx_test_run_ranks(2, two, NULL, timeout_s);
    printf("%s: %s\n", name, failed ? "FAILED" : "ok");
    return failed;
}

#endif
