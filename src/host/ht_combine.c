/*
 * Host backend: HT combine, the mirror image of the dispatch (ht.c) through the COMBINE areas: each
 * rank stages its expert outputs in its own area, and every source rank pulls the rows of its tokens
 * back and sums them. With x_in_buffer = 1 the caller wrote its rows there already
 * (epx_ht_get_combine_input).
 */
#include <stdlib.h>
#include <string.h>

#include "host/ht.h"

/* Publication words of HT combine. */
enum { C_ROWS = 0, C_HAS_WEIGHTS, C_HANDLE_SEQ, C_WANTS_WEIGHTS, C_IN_BUFFER, C_COUNT };

static epx_result_t check_combine_pubs(const host_buffer_t *hb, const host_pub_t *pubs)
{
    for (int p = 0; p < hb->nranks; p++) {
        EPX_CHECK(host_ht_check_op(hb, &pubs[p], p, EPX_CALL_HT_COMBINE, "an HT combine"));
        EPX_CHECK(host_ht_check_same(hb, pubs, p, C_HANDLE_SEQ, NULL, "combine"));
        EPX_CHECK(host_ht_check_same(hb, pubs, p, C_IN_BUFFER, "x_in_buffer", NULL));
    }
    return host_ht_check_weights(hb, pubs, C_WANTS_WEIGHTS, C_HAS_WEIGHTS, "combined_topk_weights");
}

typedef struct combine_ctx {
    host_buffer_t *hb;
    const host_ht_state_t *st;
    const epx_ht_combine_args_t *args;
    const epx_ht_combine_outputs_t *out;
    int R;
    int64_t H, K;
    size_t weights_offset;
} combine_ctx_t;

/* The pinned two-level sum: per node (ranks ascending within it) a partial, then the partials over
 * nodes ascending, remote ones through bf16; with one node, exactly the flat sum over ranks. */
static void combine_tokens(void *vctx, int64_t begin, int64_t end)
{
    combine_ctx_t *c = vctx;
    const int R = c->R, P = c->hb->buffer->comm->ranks_per_node, own = c->hb->buffer->comm->node;
    const int64_t H = c->H, K = c->K;
    const uint16_t *bias0 = c->args->bias0.data, *bias1 = c->args->bias1.data;
    uint16_t *out = c->out->combined_x.data;
    float *out_w = c->out->combined_topk_weights.data;
    for (int64_t t = begin; t < end; t++) {
        const int32_t *rows = c->st->token_rows + t * R;
        for (int64_t h = 0; h < H; h++) {
            float acc = 0.0f;
            for (int first = 0; first < R; first += P) {
                float part = 0.0f;
                int any = 0;
                for (int r = first; r < first + P; r++) {
                    if (rows[r] < 0) continue;
                    const uint16_t *x = (const uint16_t *)host_area_ptr(c->hb, r, HOST_AREA_COMBINE);
                    part += epx_bf16_to_f32(x[(int64_t)rows[r] * H + h]);
                    any = 1;
                }
                if (any) acc = epx_add_node_partial(acc, part, first / P != own);
            }
            if (bias0) acc += epx_bf16_to_f32(bias0[t * H + h]);
            if (bias1) acc += epx_bf16_to_f32(bias1[t * H + h]);
            out[t * H + h] = epx_f32_to_bf16(acc);
        }
        if (!out_w) continue;
        /* Flat over ranks, whatever the nodes: with the dispatch's weights one rank adds each slot. */
        for (int64_t k = 0; k < K; k++) {
            float acc = 0.0f;
            for (int r = 0; r < R; r++) {
                if (rows[r] < 0) continue;
                const float *w =
                    (const float *)(host_area_ptr(c->hb, r, HOST_AREA_COMBINE) + c->weights_offset);
                acc += w[(int64_t)rows[r] * K + k];
            }
            out_w[t * K + k] = acc;
        }
    }
}

typedef struct stage_ctx {
    const epx_ht_combine_args_t *args;
    uint8_t *area;
    int64_t H, K;
    size_t weights_offset;
} stage_ctx_t;

static void stage_rows(void *vctx, int64_t begin, int64_t end)
{
    stage_ctx_t *c = vctx;
    const size_t row = (size_t)c->H * 2;
    if (c->args->x_in_buffer != 1) /* 1: the caller wrote the rows into the area already */
        memcpy(c->area + (size_t)begin * row, (const uint8_t *)c->args->x.data + (size_t)begin * row,
               (size_t)(end - begin) * row);
    if (c->args->topk_weights.data)
        memcpy(c->area + c->weights_offset + (size_t)(begin * c->K) * 4,
               (const float *)c->args->topk_weights.data + begin * c->K, (size_t)((end - begin) * c->K) * 4);
}

epx_result_t host_ht_combine(epx_buffer_t buffer, uint64_t seq, const epx_ht_combine_args_t *args,
                             epx_ht_combine_outputs_t *outputs)
{
    host_buffer_t *hb = buffer->backend_state;
    const epx_buffer_config_t *cfg = &buffer->config;
    const host_ht_state_t *st = args->handle->backend_state;
    const int R = hb->nranks;
    const int64_t H = cfg->hidden, K = cfg->num_topk;
    const size_t weights_offset = (size_t)R * (size_t)cfg->max_tokens * (size_t)H * 2;
    epx_result_t res;

    if (!st || args->handle->kind != EPX_HANDLE_HT)
        return host_fail(hb, seq,
                         epx_error(EPX_ERR_INVALID_ARG,
                                   "rank %d: the combine handle is not an HT dispatch handle", hb->rank));
    host_pub_t *pubs = calloc((size_t)R, sizeof(host_pub_t));
    if (!pubs)
        return host_fail(
            hb, seq,
            epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: cannot allocate %d publications", hb->rank, R));
    res = host_area_acquire(hb, HOST_AREA_COMBINE);
    if (res != EPX_SUCCESS) {
        host_fail(hb, seq, res);
        goto out;
    }
    stage_ctx_t sc = {args, host_area_ptr(hb, hb->rank, HOST_AREA_COMBINE), H, K, weights_offset};
    host_parallel_for(hb, st->num_recv, 64, stage_rows, &sc);
    int64_t words[C_COUNT] = {0};
    words[C_ROWS] = st->num_recv;
    words[C_HAS_WEIGHTS] = args->topk_weights.data != NULL;
    words[C_HANDLE_SEQ] = (int64_t)st->dispatch_seq;
    words[C_WANTS_WEIGHTS] = outputs->combined_topk_weights.data != NULL;
    words[C_IN_BUFFER] = args->x_in_buffer != 0;
    host_area_publish(hb, HOST_AREA_COMBINE, seq, EPX_CALL_HT_COMBINE, EPX_SUCCESS, words, C_COUNT);

    res = host_area_wait_all(hb, HOST_AREA_COMBINE, seq, pubs);
    if (res == EPX_SUCCESS) res = check_combine_pubs(hb, pubs);
    if (res == EPX_SUCCESS) {
        combine_ctx_t cc = {hb, st, args, outputs, R, H, K, weights_offset};
        host_parallel_for(hb, st->num_tokens, 4, combine_tokens, &cc);
    }
out:
    host_area_done(hb, HOST_AREA_COMBINE, seq);
    free(pubs);
    return res;
}

epx_result_t host_ht_get_combine_input(epx_buffer_t buffer, epx_handle_t handle, epx_tensor_t *view_out)
{
    host_buffer_t *hb = buffer->backend_state;
    const host_ht_state_t *st = handle->backend_state;
    const int64_t H = buffer->config.hidden;
    if (!st) return epx_error(EPX_ERR_INVALID_ARG, "rank %d: the handle has no HT dispatch state", hb->rank);
    /* The handle's rows: num_worst_tokens in static mode (of which the first N_r are read). */
    const int64_t rows = handle->num_recv;
    const int64_t cap = (int64_t)hb->nranks * buffer->config.max_tokens;
    if (rows > cap)
        return epx_error(EPX_ERR_INVALID_ARG,
                         "rank %d: the handle has %lld rows (num_worst_tokens), above the %lld rows "
                         "(R * max_tokens) of the combine input in the buffer",
                         hb->rank, (long long)rows, (long long)cap);
    /* Peers may still be reading the rows of our previous combine. */
    EPX_CHECK(host_area_acquire(hb, HOST_AREA_COMBINE));
    *view_out = epx_tensor_2d(host_area_ptr(hb, hb->rank, HOST_AREA_COMBINE), EPX_DTYPE_BF16, rows, H);
    return EPX_SUCCESS;
}
