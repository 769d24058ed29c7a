/*
 * The small fixed case of the agreement and verdict tests: TM tokens of H bf16 values per rank,
 * token t routed to experts t % E and (t + 1) % E (topk_idx and routing map), on a communicator
 * and buffer on the rank's GPU; round trips come back as x * (number of ranks a token went to).
 */
#ifndef EPX_GPU_SMALL_FIXTURE_H
#define EPX_GPU_SMALL_FIXTURE_H

#include <string.h>

#include "core/internal.h"
#include "gpu_test.h"

#define TIMEOUT_MS 30000
#define H          256
#define TM         32
#define K          2
#define E          8

/* A test uses the fields it needs; the others stay NULL. */
typedef struct fixture {
    int rank, R, device;
    epx_comm_t comm;
    epx_buffer_t buf;
    gpu_arena_t da;
    void *x, *topk, *map, *rx, *out; /* inputs; R * TM rows received; TM rows combined */
    void *x8, *scales, *rx8, *rscales;
    void *w, *lrx, *lcnt; /* LL combine weights, LL recv_x and recv_count */
    void *small;          /* one row, too few to receive into */
} fixture_t;

/* Token t's value in column c on `rank` before any round trip. */
static inline int fixture_x(int rank, int t, int c)
{
    return 1 + (rank * TM + t + c) % 16;
}

/* Connects, creates the buffer for `modes` (and `dispatch_dtypes` unless 0) and allocates x, topk,
 * map, rx and out. Returns 0, or 1 after reporting. */
static inline int fixture_begin(fixture_t *f, const gpu_ctx_t *ctx, const epx_unique_id_t *id, int rank,
                                int R, uint32_t modes, uint32_t dispatch_dtypes)
{
    memset(f, 0, sizeof(*f));
    f->rank = rank;
    f->R = R;
    if (gpu_test_comm(ctx, id, rank, R, TIMEOUT_MS, &f->comm, &f->device)) return 1;
    epx_buffer_config_t bc = epx_test_buffer_config(TM, H, K, E, modes);
    if (dispatch_dtypes) bc.dispatch_dtypes = dispatch_dtypes;
    EXPECT_OK(epx_buffer_create(f->comm, &bc, &f->buf));
    uint16_t hx[TM * H];
    int32_t topk[TM * K];
    uint8_t map[TM * E];
    memset(map, 0, sizeof(map));
    for (int t = 0; t < TM; t++) {
        for (int c = 0; c < H; c++) hx[t * H + c] = epx_f32_to_bf16((float)fixture_x(rank, t, c));
        topk[t * K] = t % E;
        topk[t * K + 1] = (t + 1) % E;
        map[t * E + t % E] = 1;
        map[t * E + (t + 1) % E] = 1;
    }
    f->x = gpu_alloc(&f->da, sizeof(hx), hx);
    f->topk = gpu_alloc(&f->da, sizeof(topk), topk);
    f->map = gpu_alloc(&f->da, sizeof(map), map);
    f->rx = gpu_alloc(&f->da, (size_t)R * TM * H * 2, NULL);
    f->out = gpu_alloc(&f->da, (size_t)TM * H * 2, NULL);
    EXPECT_TRUE(f->x && f->topk && f->map && f->rx && f->out);
    return 0;
}

/* out holds every token's copies summed: x * (number of ranks it went to), or x * 2 for an LL
 * combine with weight 1 on both slots; exact for these small values. A mismatch is reported as
 * "<what> after <after>: <name>[t][c] = ...". */
static inline int fixture_check_combined(const fixture_t *f, int ll, const char *what, const char *after,
                                         const char *name)
{
    const int rank = f->rank, L = E / f->R;
    uint16_t got[TM * H];
    EXPECT_TRUE(cudaMemcpy(got, f->out, sizeof(got), cudaMemcpyDeviceToHost) == cudaSuccess);
    for (int t = 0; t < TM; t++) {
        const int copies = ll || (t % E) / L != ((t + 1) % E) / L ? 2 : 1;
        for (int c = 0; c < H; c++) {
            const uint16_t want = epx_f32_to_bf16((float)(copies * fixture_x(rank, t, c)));
            if (got[t * H + c] != want)
                return ref_fail(rank, "%s after %s: %s[%d][%d] = 0x%04x, expected 0x%04x", what, after, name,
                                t, c, got[t * H + c], want);
        }
    }
    return 0;
}

#endif
