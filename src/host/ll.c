/*
 * Host backend low-latency dispatch/combine: two double-buffer slots per buffer, each with its
 * own LL_IN and LL_OUT areas; the receive halves can be deferred into hooks. Payloads:
 * LL_IN<i> = topk_idx int64 [T_max, K] then x bf16 [T_max, H]; LL_OUT<i> = y [L, R*T_max, H] bf16.
 * A failure is published in the area header (peers read it from there) and the area marked done.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "host/host.h"

enum { LL_PENDING_NONE = 0, LL_PENDING_DISPATCH = 1, LL_PENDING_COMBINE = 2 };

typedef struct ll_slot {
    uint64_t seq;  /* dispatch that owns the slot */
    int valid;     /* the dispatch's send half succeeded */
    int recv_done; /* its receive half ran successfully */
    int32_t num_tokens;
    int32_t *my_count;   /* [E] our tokens that selected expert e (dispatch send half) */
    int32_t *my_begin;   /* [E] first row of our block for e on its rank (receive half) */
    int32_t *recv_count; /* [L] rows received per local expert */
    /* Pending hook; the last one dropped unrun (its call, and the call that took the slot first). */
    int pending;
    uint64_t pending_seq;
    uint64_t dropped_seq, dropped_by, dropped_after;
    /* Dispatch receive half parameters. */
    epx_tensor_t recv_x, recv_scales, recv_count_out, src_info, layout_range, cumulative;
    int use_fp8, round_scale, use_ue8m0;
    /* Combine: copies of the caller's routing and where the result goes. */
    int64_t *comb_topk;  /* [T_max, K] */
    float *comb_weights; /* [T_max, K] */
    int32_t *comb_index; /* [T_max, K] index of t among our tokens that selected the expert */
    epx_tensor_t combined_x;
} ll_slot_t;

/* One allocation (host_alloc_parts) with the arrays of both slots. */
typedef struct ll_state {
    ll_slot_t slots[2];
    int32_t *counts;  /* [R, E] scratch: tokens of source s that selected e */
    int32_t *row_src; /* [L, R*T_max] scratch: s * T_max + t of each received row */
    host_pub_t *pubs; /* [R] */
    int32_t *cursor;  /* [L] scratch: rows placed so far per local expert */
} ll_state_t;

static ll_state_t *ll_state_of(host_buffer_t *hb)
{
    return (ll_state_t *)hb->ll_state;
}

#define LL_SLOT_ARRAYS 6
#define LL_SHARED_PARTS 5 /* the state and its four scratch arrays */

epx_result_t host_ll_init(host_buffer_t *hb)
{
    const epx_buffer_config_t *cfg = &hb->buffer->config;
    int64_t R = hb->nranks, E = cfg->num_experts, L = hb->buffer->num_local_experts;
    const size_t TK = (size_t)(cfg->max_tokens * cfg->num_topk);
    const size_t counts = (size_t)(R * E) * sizeof(int32_t);
    const size_t rows = (size_t)(L * R * cfg->max_tokens) * sizeof(int32_t);
    size_t bytes[LL_SHARED_PARTS + 2 * LL_SLOT_ARRAYS] = {
        sizeof(ll_state_t), counts, rows, (size_t)R * sizeof(host_pub_t), (size_t)L * sizeof(int32_t)};
    for (int i = 0; i < 2; i++) {
        size_t *slot = bytes + LL_SHARED_PARTS + i * LL_SLOT_ARRAYS;
        slot[0] = slot[1] = (size_t)E * sizeof(int32_t);
        slot[2] = (size_t)L * sizeof(int32_t);
        slot[3] = TK * sizeof(int64_t);
        slot[4] = TK * sizeof(float);
        slot[5] = TK * sizeof(int32_t);
    }
    void *parts[LL_SHARED_PARTS + 2 * LL_SLOT_ARRAYS];
    ll_state_t *st = host_alloc_parts(LL_SHARED_PARTS + 2 * LL_SLOT_ARRAYS, bytes, parts);
    if (!st)
        return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: ll state allocation failed (R=%lld, E=%lld)",
                         hb->rank, (long long)R, (long long)E);
    st->counts = parts[1];
    st->row_src = parts[2];
    st->pubs = parts[3];
    st->cursor = parts[4];
    for (int i = 0; i < 2; i++) {
        void **slot = parts + LL_SHARED_PARTS + i * LL_SLOT_ARRAYS;
        st->slots[i] = (ll_slot_t){.my_count = slot[0],
                                   .my_begin = slot[1],
                                   .recv_count = slot[2],
                                   .comb_topk = slot[3],
                                   .comb_weights = slot[4],
                                   .comb_index = slot[5]};
    }
    hb->ll_state = st;
    return EPX_SUCCESS;
}

/* A pending hook whose slot is reused (or whose buffer goes away) is dropped; marking its area
 * done keeps the peers from waiting on us for it. `by`: the call that took the slot (0: not a call). */
static void ll_drop_pending(host_buffer_t *hb, int slot, uint64_t by)
{
    ll_slot_t *sl = &ll_state_of(hb)->slots[slot];
    if (sl->pending != LL_PENDING_NONE) {
        sl->dropped_seq = sl->pending_seq;
        sl->dropped_by = by;
        sl->dropped_after = hb->call_seq; /* for a drop by no call: the last call made before it */
    }
    if (sl->pending == LL_PENDING_DISPATCH) {
        host_area_done(hb, (host_area_t)(HOST_AREA_LL_IN0 + slot), sl->pending_seq);
        sl->valid = 0;
    } else if (sl->pending == LL_PENDING_COMBINE) {
        host_area_done(hb, (host_area_t)(HOST_AREA_LL_OUT0 + slot), sl->pending_seq);
    }
    sl->pending = LL_PENDING_NONE;
}

void host_ll_fini(host_buffer_t *hb)
{
    ll_state_t *st = ll_state_of(hb);
    if (!st) return;
    for (int i = 0; i < 2; i++) ll_drop_pending(hb, i, 0);
    free(st);
    hb->ll_state = NULL;
}

static size_t ll_in_bytes(const epx_buffer_t b)
{
    return (size_t)b->config.max_tokens * ((size_t)b->config.num_topk * 8 + (size_t)b->config.hidden * 2);
}

static size_t ll_out_bytes(const host_buffer_t *hb)
{
    const epx_buffer_t b = hb->buffer;
    return (size_t)b->num_local_experts * (size_t)hb->nranks * (size_t)b->config.max_tokens *
           (size_t)b->config.hidden * 2;
}

/* What the workers of one pass over a slot read: the slot, the peers' area of the pass (LL_IN for
 * the dispatch copy, LL_OUT for the combine reduction) and the buffer's dimensions. */
typedef struct ll_pass {
    host_buffer_t *hb;
    ll_slot_t *sl;
    const int32_t *row_src;
    host_area_t area;
    int64_t T_max, H, K, L, RT;
} ll_pass_t;

static ll_pass_t ll_pass_of(host_buffer_t *hb, int slot, host_area_t slot0_area)
{
    const epx_buffer_t b = hb->buffer;
    ll_state_t *st = ll_state_of(hb);
    return (ll_pass_t){hb,
                       &st->slots[slot],
                       st->row_src,
                       (host_area_t)(slot0_area + slot),
                       b->config.max_tokens,
                       b->config.hidden,
                       b->config.num_topk,
                       b->num_local_experts,
                       (int64_t)hb->nranks * b->config.max_tokens};
}

/* ------------------------------------------------------------------------ dispatch ---- */

/* Casts one 128-channel group of bf16 to fp8 and returns its inverse scale. */
static float ll_cast_group(const uint16_t *src, uint8_t *dst, int pow2)
{
    float amax = 0.0f;
    for (int h = 0; h < 128; h++) {
        float a = fabsf(epx_bf16_to_f32(src[h]));
        if (a > amax) amax = a;
    }
    const float scale_inv = epx_fp8_scale_inv(amax, pow2);
    for (int h = 0; h < 128; h++) dst[h] = epx_f32_to_fp8_e4m3(epx_bf16_to_f32(src[h]) / scale_inv);
    return scale_inv;
}

/* Copies (or casts) received rows; index i = j * (R*T_max) + row. */
static void ll_copy_rows(void *vctx, int64_t begin, int64_t end)
{
    const ll_pass_t *c = vctx;
    const ll_slot_t *sl = c->sl;
    const int64_t H = c->H, G = H / 128, RT = c->RT;
    const size_t x_offset = (size_t)(c->T_max * c->K) * sizeof(int64_t);
    for (int64_t i = begin; i < end; i++) {
        int64_t j = i / RT, row = i % RT;
        if (row >= sl->recv_count[j]) continue;
        int64_t s = c->row_src[i] / c->T_max, t = c->row_src[i] % c->T_max;
        const uint16_t *src = (const uint16_t *)(host_area_ptr(c->hb, (int)s, c->area) + x_offset) + t * H;
        if (!sl->use_fp8) {
            memcpy((uint16_t *)sl->recv_x.data + i * H, src, (size_t)H * 2);
            continue;
        }
        uint8_t *dst = (uint8_t *)sl->recv_x.data + i * H;
        uint32_t packed = 0;
        for (int64_t g = 0; g < G; g++) {
            float scale_inv = ll_cast_group(src + g * 128, dst + g * 128, sl->round_scale || sl->use_ue8m0);
            if (!sl->use_ue8m0) {
                ((float *)sl->recv_scales.data)[(j * G + g) * RT + row] = scale_inv;
                continue;
            }
            packed |= epx_ue8m0_of(scale_inv) << (8 * (g % 4));
            if (g % 4 == 3) {
                ((int32_t *)sl->recv_scales.data)[(j * (H / 512) + g / 4) * RT + row] = (int32_t)packed;
                packed = 0;
            }
        }
    }
}

/* Receive half: every peer's LL_IN<slot> for sl->seq -> packed rows per local expert. */
static epx_result_t ll_dispatch_recv(host_buffer_t *hb, int slot)
{
    ll_state_t *st = ll_state_of(hb);
    ll_slot_t *sl = &st->slots[slot];
    const epx_buffer_t b = hb->buffer;
    int me = hb->rank, R = hb->nranks;
    int64_t E = b->config.num_experts, L = b->num_local_experts, K = b->config.num_topk;
    int64_t T_max = b->config.max_tokens, RT = (int64_t)R * T_max;
    host_area_t area = (host_area_t)(HOST_AREA_LL_IN0 + slot);
    uint64_t seq = sl->seq;

    epx_result_t res = host_area_wait_all(hb, area, seq, st->pubs);
    if (res != EPX_SUCCESS) goto out;
    const int64_t flags = sl->use_fp8 | sl->round_scale << 1 | sl->use_ue8m0 << 2;
    for (int s = 0; s < R && res == EPX_SUCCESS; s++)
        if (st->pubs[s].words[1] != flags)
            res = epx_error(EPX_ERR_MISMATCH,
                            "rank %d: ll dispatch call %llu: rank %d passes use_fp8 %d, round_scale %d, use_ue8m0 %d; "
                            "this rank %d, %d, %d (every rank passes the same)",
                            me, (unsigned long long)seq, s, (int)(st->pubs[s].words[1] & 1),
                            (int)(st->pubs[s].words[1] >> 1 & 1), (int)(st->pubs[s].words[1] >> 2 & 1), sl->use_fp8,
                            sl->round_scale, sl->use_ue8m0);
    if (res != EPX_SUCCESS) goto out;
    memset(st->counts, 0, (size_t)(R * E) * sizeof(int32_t));
    for (int s = 0; s < R && res == EPX_SUCCESS; s++) {
        int64_t T_s = st->pubs[s].words[0];
        if (T_s < 0 || T_s > T_max) {
            res = epx_error(EPX_ERR_INTERNAL,
                            "rank %d: peer %d published ll dispatch T = %lld outside [0, %lld]", me, s,
                            (long long)T_s, (long long)T_max);
            break;
        }
        /* Every id is in [-1, E): the source's API layer checked it before publishing. */
        const int64_t *topk = (const int64_t *)host_area_ptr(hb, s, area);
        for (int64_t i = 0; i < T_s * K; i++)
            if (topk[i] >= 0) st->counts[s * E + topk[i]]++;
    }
    if (res != EPX_SUCCESS) goto out;
    /* Rows of source s for expert e on rank e / L start after those of sources < s. */
    for (int64_t e = 0; e < E; e++) {
        int32_t begin = 0;
        for (int s = 0; s < me; s++) begin += st->counts[s * E + e];
        sl->my_begin[e] = begin;
    }
    for (int64_t j = 0; j < L; j++) {
        int64_t total = 0;
        for (int s = 0; s < R; s++) total += st->counts[s * E + me * L + j];
        if (total > RT) {
            res = epx_error(EPX_ERR_INTERNAL,
                            "rank %d: local expert %lld receives %lld rows, more than R*T_max = %lld", me,
                            (long long)j, (long long)total, (long long)RT);
            goto out;
        }
        sl->recv_count[j] = (int32_t)total;
    }
    /* Sources ascending, tokens ascending: the packed order of every local expert. The scratch is
     * the buffer's: past the exchange nothing fails on one rank alone (every rank checks the same
     * publications above), so no verdict step is needed. */
    int32_t *cursor = st->cursor;
    memset(cursor, 0, (size_t)L * sizeof(int32_t));
    for (int s = 0; s < R; s++) {
        const int64_t *topk = (const int64_t *)host_area_ptr(hb, s, area);
        int64_t T_s = st->pubs[s].words[0];
        for (int64_t t = 0; t < T_s; t++)
            for (int64_t k = 0; k < K; k++) {
                int64_t e = topk[t * K + k];
                if (e < me * L || e >= (me + 1) * L) continue;
                int64_t j = e - me * L;
                st->row_src[j * RT + cursor[j]++] = (int32_t)(s * T_max + t);
            }
    }

    ll_pass_t pass = ll_pass_of(hb, slot, HOST_AREA_LL_IN0);
    host_parallel_for(hb, L * RT, 64, ll_copy_rows, &pass);
    int32_t *recv_count = sl->recv_count_out.data;
    for (int64_t j = 0; j < L; j++) {
        recv_count[j] = sl->recv_count[j];
        if (sl->cumulative.data) { /* wraps modulo 2^32, as the device's atomic add does */
            int32_t *c = (int32_t *)sl->cumulative.data + j;
            *c = (int32_t)((uint32_t)*c + (uint32_t)sl->recv_count[j]);
        }
        if (sl->src_info.data)
            for (int64_t row = 0; row < sl->recv_count[j]; row++)
                ((int32_t *)sl->src_info.data)[j * RT + row] = st->row_src[j * RT + row] % (int32_t)T_max;
        if (sl->layout_range.data) {
            int64_t begin = 0;
            for (int s = 0; s < R; s++) {
                int64_t count = st->counts[s * E + me * L + j];
                ((int64_t *)sl->layout_range.data)[j * R + s] = count ? (begin << 32) | count : 0;
                begin += count;
            }
        }
    }
    sl->recv_done = 1;

out:
    host_area_done(hb, area, seq);
    if (res != EPX_SUCCESS) sl->valid = 0;
    return res;
}

epx_result_t host_ll_dispatch(epx_buffer_t buffer, uint64_t seq, const epx_ll_dispatch_args_t *args,
                              epx_ll_dispatch_outputs_t *outputs)
{
    host_buffer_t *hb = buffer->backend_state;
    ll_state_t *st = ll_state_of(hb);
    int64_t T = args->x.shape[0], H = buffer->config.hidden, K = buffer->config.num_topk;
    int64_t T_max = buffer->config.max_tokens, E = buffer->config.num_experts;
    /* The API layer counts every LL dispatch, failed ones included, so slots agree on all ranks. */
    int slot = (int)((buffer->ll_dispatches - 1) % 2);
    ll_slot_t *sl = &st->slots[slot];
    host_area_t area = (host_area_t)(HOST_AREA_LL_IN0 + slot);

    ll_drop_pending(hb, slot, seq);
    sl->seq = seq;
    sl->valid = 0;
    sl->recv_done = 0;
    sl->num_tokens = (int32_t)T;

    epx_result_t res = EPX_SUCCESS;
    if (hb->area_bytes[area] < ll_in_bytes(buffer) ||
        hb->area_bytes[HOST_AREA_LL_OUT0 + slot] < ll_out_bytes(hb))
        res = epx_error(EPX_ERR_INTERNAL, "rank %d: ll areas of %zu / %zu bytes, need %zu / %zu", hb->rank,
                        hb->area_bytes[area], hb->area_bytes[HOST_AREA_LL_OUT0 + slot], ll_in_bytes(buffer),
                        ll_out_bytes(hb));
    if (res == EPX_SUCCESS) res = host_area_acquire(hb, area);
    if (res == EPX_SUCCESS) {
        int64_t *topk = (int64_t *)host_area_ptr(hb, hb->rank, area);
        memset(sl->my_count, 0, (size_t)E * sizeof(int32_t));
        for (int64_t i = 0; i < T * K; i++) {
            topk[i] = host_topk_at(&args->topk_idx, i);
            if (topk[i] >= 0) sl->my_count[topk[i]]++;
        }
        host_copy((uint8_t *)topk + (size_t)(T_max * K) * sizeof(int64_t), args->x.data, (size_t)(T * H) * 2);
    }
    /* T and the call's cast flags (ranks must agree on them, as the cuda backend's call signature
     * checks). */
    int64_t words[2] = {T, (args->use_fp8 != 0) | (args->round_scale != 0) << 1 | (args->use_ue8m0 != 0) << 2};
    host_area_publish(hb, area, seq, EPX_CALL_LL_DISPATCH, (int32_t)res, words, 2);
    if (res != EPX_SUCCESS) {
        host_area_done(hb, area, seq);
        return res;
    }
    sl->valid = 1;
    sl->recv_x = outputs->recv_x;
    sl->recv_scales = outputs->recv_scales;
    sl->recv_count_out = outputs->recv_count;
    sl->src_info = outputs->src_info;
    sl->layout_range = outputs->layout_range;
    sl->cumulative = args->cumulative_recv_stats;
    sl->use_fp8 = args->use_fp8 != 0;
    sl->round_scale = args->round_scale != 0;
    sl->use_ue8m0 = args->use_ue8m0 != 0;

    epx_ll_handle_t handle = {seq, slot, (int32_t)T};
    if (args->return_recv_hook) {
        sl->pending = LL_PENDING_DISPATCH;
        sl->pending_seq = seq;
        host_area_hold(hb, area, seq); /* peers keep their LL_IN publication for the hook */
        outputs->handle = handle;
        outputs->hook = (epx_hook_t){buffer, seq, LL_PENDING_DISPATCH, slot};
        return EPX_SUCCESS;
    }
    res = ll_dispatch_recv(hb, slot);
    if (res == EPX_SUCCESS) outputs->handle = handle;
    return res;
}

/* ------------------------------------------------------------------------- combine ---- */

static void ll_reduce_tokens(void *vctx, int64_t begin, int64_t end)
{
    const ll_pass_t *c = vctx;
    const ll_slot_t *sl = c->sl;
    const int64_t H = c->H, K = c->K, L = c->L;
    uint16_t *out = sl->combined_x.data;
    float acc[512]; /* channel chunks: each channel still sums its slots k in ascending order */
    for (int64_t t = begin; t < end; t++) {
        for (int64_t h0 = 0; h0 < H; h0 += 512) {
            int64_t n = H - h0 < 512 ? H - h0 : 512;
            for (int64_t h = 0; h < n; h++) acc[h] = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                int64_t e = sl->comb_topk[t * K + k];
                if (e < 0) continue;
                float w = sl->comb_weights[t * K + k];
                int64_t r = e / L, j = e % L, row = sl->my_begin[e] + sl->comb_index[t * K + k];
                const uint16_t *y =
                    (const uint16_t *)host_area_ptr(c->hb, (int)r, c->area) + (j * c->RT + row) * H + h0;
                for (int64_t h = 0; h < n; h++) acc[h] += w * epx_bf16_to_f32(y[h]);
            }
            for (int64_t h = 0; h < n; h++) out[t * H + h0 + h] = epx_f32_to_bf16(acc[h]);
        }
    }
}

static epx_result_t ll_combine_recv(host_buffer_t *hb, int slot, uint64_t seq)
{
    ll_state_t *st = ll_state_of(hb);
    ll_slot_t *sl = &st->slots[slot];
    host_area_t area = (host_area_t)(HOST_AREA_LL_OUT0 + slot);
    epx_result_t res = host_area_wait_all(hb, area, seq, st->pubs);
    for (int r = 0; r < hb->nranks && res == EPX_SUCCESS; r++)
        if ((uint64_t)st->pubs[r].words[0] != sl->seq)
            res = epx_error(
                EPX_ERR_MISMATCH, "rank %d: ll combine of dispatch seq %llu, but rank %d combines seq %llu",
                hb->rank, (unsigned long long)sl->seq, r, (unsigned long long)st->pubs[r].words[0]);
    if (res == EPX_SUCCESS) {
        ll_pass_t pass = ll_pass_of(hb, slot, HOST_AREA_LL_OUT0);
        host_parallel_for(hb, sl->num_tokens, 4, ll_reduce_tokens, &pass);
    }
    host_area_done(hb, area, seq);
    return res;
}

/* The handle must name the dispatch that still owns its slot, and that dispatch's receive half
 * must have run here (its layout locates our rows). */
static epx_result_t ll_check_handle(host_buffer_t *hb, const epx_ll_handle_t *handle, const char *what)
{
    if (handle->slot < 0 || handle->slot > 1)
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d: %s: handle slot %d is not 0 or 1", hb->rank, what,
                         handle->slot);
    ll_slot_t *sl = &ll_state_of(hb)->slots[handle->slot];
    if (sl->seq != handle->seq || !sl->valid)
        return epx_error(EPX_ERR_INVALID_ARG,
                         "rank %d: %s: stale ll handle (dispatch seq %llu, slot %d now holds seq %llu%s)",
                         hb->rank, what, (unsigned long long)handle->seq, handle->slot,
                         (unsigned long long)sl->seq, sl->valid ? "" : ", failed");
    if (handle->num_tokens != sl->num_tokens)
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d: %s: handle has T = %d, its dispatch had T = %d",
                         hb->rank, what, handle->num_tokens, sl->num_tokens);
    if (!sl->recv_done)
        return epx_error(EPX_ERR_INVALID_ARG,
                         "rank %d: %s: the receive hook of dispatch seq %llu has not run", hb->rank, what,
                         (unsigned long long)handle->seq);
    return EPX_SUCCESS;
}

/* The caller's routing must be the dispatch's: T, and per expert as many tokens (counted into
 * seen[E], zeroed by the caller). Reads only: a combine refused here leaves the slot, and a combine
 * hook pending on it, as they were. */
static epx_result_t ll_check_routing(host_buffer_t *hb, const ll_slot_t *sl, const epx_ll_combine_args_t *args,
                                     int32_t *seen)
{
    int64_t T = sl->num_tokens, K = hb->buffer->config.num_topk, E = hb->buffer->config.num_experts;
    if (args->topk_idx.shape[0] != T)
        return epx_error(EPX_ERR_INVALID_ARG,
                         "rank %d: ll combine: topk_idx has %lld rows, the dispatch had T = %lld", hb->rank,
                         (long long)args->topk_idx.shape[0], (long long)T);
    for (int64_t i = 0; i < T * K; i++) {
        int64_t e = host_topk_at(&args->topk_idx, i); /* in [-1, E): checked by the API layer */
        if (e >= 0) seen[e]++;
    }
    for (int64_t e = 0; e < E; e++)
        if (seen[e] != sl->my_count[e])
            return epx_error(
                EPX_ERR_INVALID_ARG,
                "rank %d: ll combine: topk_idx differs from the dispatch's (expert %lld: %d tokens, %d at "
                "dispatch)",
                hb->rank, (long long)e, seen[e], sl->my_count[e]);
    return EPX_SUCCESS;
}

/* Copies the checked routing into the slot and finds, per (t, k), t's index among our tokens that
 * chose the expert (seen[E]: scratch). */
static void ll_take_routing(host_buffer_t *hb, ll_slot_t *sl, const epx_ll_combine_args_t *args, int32_t *seen)
{
    int64_t T = sl->num_tokens, K = hb->buffer->config.num_topk, E = hb->buffer->config.num_experts;
    memset(seen, 0, (size_t)E * sizeof(int32_t));
    for (int64_t i = 0; i < T * K; i++) {
        int64_t e = host_topk_at(&args->topk_idx, i);
        sl->comb_topk[i] = e;
        sl->comb_weights[i] = ((const float *)args->topk_weights.data)[i];
        sl->comb_index[i] = e >= 0 ? seen[e]++ : -1;
    }
}

epx_result_t host_ll_combine(epx_buffer_t buffer, uint64_t seq, const epx_ll_combine_args_t *args,
                             epx_ll_combine_outputs_t *outputs)
{
    host_buffer_t *hb = buffer->backend_state;
    ll_state_t *st = ll_state_of(hb);
    int slot = args->handle.slot;
    epx_result_t res = ll_check_handle(hb, &args->handle, "ll combine");
    int32_t *seen = NULL;
    if (res == EPX_SUCCESS && !(seen = calloc((size_t)buffer->config.num_experts, sizeof(int32_t))))
        res = epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: ll combine scratch allocation failed", hb->rank);
    ll_slot_t *sl = res == EPX_SUCCESS ? &st->slots[slot] : NULL;
    host_area_t area = (host_area_t)(HOST_AREA_LL_OUT0 + (slot == 1));
    if (res == EPX_SUCCESS) res = ll_check_routing(hb, sl, args, seen);
    if (res == EPX_SUCCESS && hb->area_bytes[area] < ll_out_bytes(hb))
        res = epx_error(EPX_ERR_INTERNAL, "rank %d: ll combine area of %zu bytes, need %zu", hb->rank,
                        hb->area_bytes[area], ll_out_bytes(hb));
    /* A refused combine touches no slot and no area (a hook pending on the slot stays runnable): the
     * failure reaches the peers through the failed-call record, whatever slot they wait on. */
    if (res != EPX_SUCCESS) {
        free(seen);
        return host_fail(hb, seq, res);
    }
    /* Which dispatch this combine names, before its first wait: ranks naming different ones fail at
     * once (their slots' areas would never meet). A refused call names none: its peers fail with
     * EPX_ERR_REMOTE naming it. */
    host_call_detail(hb, seq, args->handle.seq);
    if (sl->pending == LL_PENDING_COMBINE) ll_drop_pending(hb, slot, seq);
    ll_take_routing(hb, sl, args, seen);
    free(seen);
    res = host_area_acquire(hb, area);
    if (res == EPX_SUCCESS && !args->zero_copy) {
        int64_t H = buffer->config.hidden, RT = (int64_t)hb->nranks * buffer->config.max_tokens;
        uint16_t *dst = (uint16_t *)host_area_ptr(hb, hb->rank, area);
        const uint16_t *y = args->y.data;
        for (int64_t j = 0; j < buffer->num_local_experts; j++)
            memcpy(dst + j * RT * H, y + j * RT * H, (size_t)(sl->recv_count[j] * H) * 2);
    }
    int64_t words[1] = {(int64_t)args->handle.seq};
    host_area_publish(hb, area, seq, EPX_CALL_LL_COMBINE, (int32_t)res, words, 1);
    if (res != EPX_SUCCESS) {
        host_area_done(hb, area, seq);
        return res;
    }
    sl->combined_x = outputs->combined_x;
    if (args->return_recv_hook) {
        sl->pending = LL_PENDING_COMBINE;
        sl->pending_seq = seq;
        host_area_hold(hb, area, seq); /* peers keep their LL_OUT publication for the hook */
        outputs->hook = (epx_hook_t){buffer, seq, LL_PENDING_COMBINE, slot};
        return EPX_SUCCESS;
    }
    return ll_combine_recv(hb, slot, seq);
}

epx_result_t host_ll_get_combine_buffer(epx_buffer_t buffer, const epx_ll_handle_t *handle,
                                        epx_tensor_t *view_out)
{
    host_buffer_t *hb = buffer->backend_state;
    EPX_CHECK(ll_check_handle(hb, handle, "ll combine buffer"));
    host_area_t area = (host_area_t)(HOST_AREA_LL_OUT0 + handle->slot);
    if (hb->area_bytes[area] < ll_out_bytes(hb))
        return epx_error(EPX_ERR_INTERNAL, "rank %d: ll combine area of %zu bytes, need %zu", hb->rank,
                         hb->area_bytes[area], ll_out_bytes(hb));
    /* Our own unrun combine hook on this slot would hold the area forever. */
    if (ll_state_of(hb)->slots[handle->slot].pending == LL_PENDING_COMBINE) ll_drop_pending(hb, handle->slot, 0);
    EPX_CHECK(host_area_acquire(hb, area));
    *view_out = epx_tensor_3d(host_area_ptr(hb, hb->rank, area), EPX_DTYPE_BF16, buffer->num_local_experts,
                              (int64_t)hb->nranks * buffer->config.max_tokens, buffer->config.hidden);
    return EPX_SUCCESS;
}

epx_result_t host_hook_run(const epx_hook_t *hook, void *stream)
{
    (void)stream;
    host_buffer_t *hb = hook->buffer->backend_state;
    if (hook->slot < 0 || hook->slot > 1 ||
        (hook->kind != LL_PENDING_DISPATCH && hook->kind != LL_PENDING_COMBINE))
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d: hook with slot %d, kind %d is not an ll hook",
                         hb->rank, hook->slot, hook->kind);
    ll_slot_t *sl = &ll_state_of(hb)->slots[hook->slot];
    if ((sl->pending != hook->kind || sl->pending_seq != hook->seq) && sl->dropped_seq == hook->seq)
        return epx_error(EPX_ERR_INVALID_ARG,
                         "rank %d: hook of call %llu no longer runs: %s%llu took its slot %d before it ran (an LL "
                         "dispatch, combine or epx_ll_get_combine_buffer on a slot drops the slot's pending hook)",
                         hb->rank, (unsigned long long)hook->seq,
                         sl->dropped_by ? "call " : "epx_ll_get_combine_buffer after call ",
                         (unsigned long long)(sl->dropped_by ? sl->dropped_by : sl->dropped_after), hook->slot);
    if (sl->pending != hook->kind || sl->pending_seq != hook->seq)
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d: hook of call %llu already ran", hb->rank,
                         (unsigned long long)hook->seq);
    sl->pending = LL_PENDING_NONE;
    if (hook->kind == LL_PENDING_DISPATCH) return ll_dispatch_recv(hb, hook->slot);
    return ll_combine_recv(hb, hook->slot, hook->seq);
}
