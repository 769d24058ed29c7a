/*
 * Host backend routing-map dispatch (with or without permute) and its combine. Every rank reads
 * every peer's compacted routing from the IN area, so receivers build their outputs and sources
 * learn where each of their tokens lands; combine then pulls rows from the peers' COMBINE areas.
 * A failure is published in the area header (peers read it from there) and the area marked done.
 */
#include <stdlib.h>
#include <string.h>

#include "host/host.h"

/* Words of the IN publication. */
enum { RM_W_T = 0, RM_W_DTYPE, RM_W_PERMUTE, RM_W_HAS_PROBS, RM_W_PAD, RM_W_BOUND, RM_W_COUNT };

/* One place a source token went: rank, row in that rank's COMBINE payload (-1: dropped by the
 * rank's bound), and the prob of (token, expert) for weighted unpermute. */
typedef struct rm_entry {
    int32_t rank;
    int32_t row;
    float prob;
} rm_entry_t;

/* What a routing-map handle keeps on this rank: one allocation with its arrays (rm_handle_new). */
typedef struct rm_handle {
    uint64_t dispatch_seq;
    int permute;
    int has_probs;
    int64_t num_tokens;
    /* Source side: entries of token t are entries[entry_begin[t] .. entry_begin[t+1]), ranks
     * ascending then local experts ascending (the pinned summation order). */
    int64_t *entry_begin;
    rm_entry_t *entries;
    /* Receiver side: rows of our output that go to COMBINE. Without permute, rows [0, kept);
     * with permute, per local expert j, rows [group_begin[j], group_begin[j] + kept[j]) go to
     * compact_begin[j] (padding rows are never read). */
    int64_t kept_rows;
    int64_t *group_begin, *kept, *compact_begin; /* [L] */
} rm_handle_t;

/* Layout of the IN payload (fixed offsets, so a peer's dtype does not change them). */
typedef struct rm_in_layout {
    size_t x, scales, sel, prob, total;
} rm_in_layout_t;

static rm_in_layout_t rm_in_layout(const epx_buffer_t b)
{
    size_t T_max = (size_t)b->config.max_tokens, H = (size_t)b->config.hidden, K = (size_t)b->config.num_topk;
    rm_in_layout_t l;
    l.x = 0;
    l.scales = (T_max * H * 2 + 7) & ~(size_t)7;
    l.sel = l.scales + T_max * (H / 128) * 4;
    l.prob = l.sel + T_max * K * 4;
    l.total = l.prob + T_max * K * 4;
    return l;
}

static int64_t rm_round_up(int64_t v, int64_t m)
{
    return m > 1 ? (v + m - 1) / m * m : v;
}

/* A handle with room for T tokens of up to K entries each and L local experts. */
static rm_handle_t *rm_handle_new(int64_t T, int64_t K, int64_t L)
{
    const size_t begins = (size_t)(T + 1) * sizeof(int64_t),
                 entries = (size_t)(T * K + 1) * sizeof(rm_entry_t);
    const size_t experts = (size_t)L * sizeof(int64_t);
    const size_t bytes[] = {sizeof(rm_handle_t), begins, entries, experts, experts, experts};
    void *parts[6];
    rm_handle_t *h = host_alloc_parts(6, bytes, parts);
    if (h)
        *h = (rm_handle_t){.entry_begin = parts[1],
                           .entries = parts[2],
                           .group_begin = parts[3],
                           .kept = parts[4],
                           .compact_begin = parts[5]};
    return h;
}

/* ------------------------------------------------------------------------ dispatch ---- */

/* Everything a rank derives from all peers' routing; `block` holds the arrays. */
typedef struct rm_plan {
    void *block;
    int R;
    int64_t E, L, T_max, K;
    int32_t *cnt;         /* [R, E] tokens of source s that selected e */
    int32_t *rank_cnt;    /* [R, R] tokens of source s with an expert on rank r */
    int64_t *group_begin; /* [E] padded first row of expert e's group on its rank */
    int64_t *compact;     /* [E] first compact row of expert e's group on its rank */
    int64_t *pad;         /* [R] pad_multiple of rank r */
    int64_t *bound;       /* [R] bound of rank r, -1 for none */
    int64_t *real;        /* [R] real row count (N_r or P) of rank r */
} rm_plan_t;

static const int32_t *rm_sel(host_buffer_t *hb, const rm_in_layout_t *lay, int s)
{
    return (const int32_t *)(host_area_ptr(hb, s, HOST_AREA_IN) + lay->sel);
}
static const float *rm_prob(host_buffer_t *hb, const rm_in_layout_t *lay, int s)
{
    return (const float *)(host_area_ptr(hb, s, HOST_AREA_IN) + lay->prob);
}

/* The caller frees p->block (also after a failure; p starts zeroed). */
static epx_result_t rm_plan_build(host_buffer_t *hb, const rm_in_layout_t *lay, const host_pub_t *pubs,
                                  int permute, rm_plan_t *p)
{
    const epx_buffer_t b = hb->buffer;
    const int R = hb->nranks;
    const int64_t E = b->config.num_experts, L = b->num_local_experts, K = b->config.num_topk;
    const int64_t Tm = b->config.max_tokens;
    const size_t counts = (size_t)R * sizeof(int32_t); /* per source */
    const size_t ranks = (size_t)R * sizeof(int64_t), experts = (size_t)E * sizeof(int64_t);
    const size_t bytes[] = {counts * (size_t)E, counts * (size_t)R, experts, experts, ranks, ranks, ranks};
    void *part[7];
    void *block = host_alloc_parts(7, bytes, part);
    if (!block)
        return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: routing-map plan allocation failed", hb->rank);
    /* The parts in member order. */
    *p = (rm_plan_t){block, R, E, L, Tm, K, part[0], part[1], part[2], part[3], part[4], part[5], part[6]};
    for (int s = 0; s < R; s++) {
        const int32_t *sel = rm_sel(hb, lay, s);
        p->pad[s] = pubs[s].words[RM_W_PAD] > 0 ? pubs[s].words[RM_W_PAD] : 1;
        p->bound[s] = pubs[s].words[RM_W_BOUND];
        for (int64_t t = 0; t < pubs[s].words[RM_W_T]; t++) {
            int last_rank = -1;
            for (int64_t k = 0; k < K; k++) {
                int32_t e = sel[t * K + k];
                if (e < 0) break;
                if (e >= E)
                    return epx_error(EPX_ERR_INTERNAL,
                                     "rank %d: peer %d published expert %d for token %lld, E = %lld",
                                     hb->rank, s, e, (long long)t, (long long)E);
                p->cnt[s * E + e]++;
                if (e / L != last_rank) p->rank_cnt[s * R + e / L]++;
                last_rank = (int)(e / L);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        int64_t padded = 0, compact = 0, n = 0;
        for (int64_t j = 0; j < L; j++) {
            int64_t e = r * L + j, count = 0;
            for (int s = 0; s < R; s++) count += p->cnt[s * E + e];
            p->group_begin[e] = padded;
            p->compact[e] = compact;
            padded += rm_round_up(count, p->pad[r]);
            compact += count;
        }
        for (int s = 0; s < R; s++) n += p->rank_cnt[s * R + r];
        p->real[r] = permute ? padded : n;
    }
    return EPX_SUCCESS;
}

/* Source rows of one output row: (s, t) and the expert; s = -1 for a zero row. */
typedef struct rm_row_src {
    int32_t s, t, e;
} rm_row_src_t;

typedef struct rm_fill_ctx {
    host_buffer_t *hb;
    const rm_in_layout_t *lay;
    const rm_row_src_t *src;
    const epx_rm_dispatch_outputs_t *out;
    size_t esize;
    int permute;
} rm_fill_ctx_t;

static void rm_fill_rows(void *vctx, int64_t begin, int64_t end)
{
    rm_fill_ctx_t *c = vctx;
    host_buffer_t *hb = c->hb;
    int64_t H = hb->buffer->config.hidden, G = H / 128, K = hb->buffer->config.num_topk;
    int64_t L = hb->buffer->num_local_experts, me = hb->rank;
    const epx_rm_dispatch_outputs_t *out = c->out;
    for (int64_t row = begin; row < end; row++) {
        const rm_row_src_t *rs = &c->src[row];
        uint8_t *tok = (uint8_t *)out->tokens.data + (size_t)row * (size_t)H * c->esize;
        float *sf = out->scaling_factor.data ? (float *)out->scaling_factor.data + row * G : NULL;
        float *pr = NULL;
        if (out->probs.data) pr = (float *)out->probs.data + (c->permute ? row : row * L);
        if (rs->s < 0) {
            memset(tok, 0, (size_t)H * c->esize);
            if (sf) memset(sf, 0, (size_t)G * sizeof(float));
            if (pr) memset(pr, 0, (size_t)(c->permute ? 1 : L) * sizeof(float));
            continue;
        }
        const uint8_t *in = host_area_ptr(hb, rs->s, HOST_AREA_IN);
        memcpy(tok, in + c->lay->x + (size_t)rs->t * (size_t)H * c->esize, (size_t)H * c->esize);
        if (sf)
            memcpy(sf, in + c->lay->scales + (size_t)(rs->t * G) * sizeof(float), (size_t)G * sizeof(float));
        if (!pr) continue;
        const int32_t *sel = (const int32_t *)(in + c->lay->sel) + rs->t * K;
        const float *prob = (const float *)(in + c->lay->prob) + rs->t * K;
        if (c->permute) {
            *pr = 0.0f;
            for (int64_t k = 0; k < K && sel[k] >= 0; k++)
                if (sel[k] == rs->e) *pr = prob[k];
        } else {
            memset(pr, 0, (size_t)L * sizeof(float));
            for (int64_t k = 0; k < K && sel[k] >= 0; k++)
                if (sel[k] / L == me) pr[sel[k] - me * L] = prob[k];
        }
    }
}

/* outputs.local_map: row i for the i-th token received (sources ascending, their tokens ascending, all
 * of them whatever the bound), true at the local experts it selected; the rows after them false. */
static void rm_fill_local_map(host_buffer_t *hb, const rm_in_layout_t *lay, const host_pub_t *pubs,
                              const epx_tensor_t *map)
{
    const int64_t L = hb->buffer->num_local_experts, K = hb->buffer->config.num_topk, me = hb->rank;
    uint8_t *out = map->data;
    int64_t i = 0;
    for (int s = 0; s < hb->nranks; s++) {
        const int32_t *sel = rm_sel(hb, lay, s);
        for (int64_t t = 0; t < pubs[s].words[RM_W_T]; t++) {
            uint8_t *row = out + i * L;
            int any = 0;
            memset(row, 0, (size_t)L);
            for (int64_t k = 0; k < K && sel[t * K + k] >= 0; k++)
                if (sel[t * K + k] / L == me) {
                    row[sel[t * K + k] - me * L] = 1;
                    any = 1;
                }
            i += any;
        }
    }
    host_zero(out + i * L, (size_t)((map->shape[0] - i) * L));
}

/* Compacts our routing map (and probs) into the IN area: per token the selected experts
 * ascending, -1 padded to K. */
static epx_result_t rm_publish_routing(host_buffer_t *hb, const rm_in_layout_t *lay,
                                       const epx_rm_dispatch_args_t *args, int64_t T)
{
    int64_t E = hb->buffer->config.num_experts, K = hb->buffer->config.num_topk;
    uint8_t *area = host_area_ptr(hb, hb->rank, HOST_AREA_IN);
    int32_t *sel = (int32_t *)(area + lay->sel);
    float *prob = (float *)(area + lay->prob);
    const uint8_t *map = args->routing_map.data;
    const float *probs = args->probs.data;
    for (int64_t t = 0; t < T; t++) {
        int64_t k = 0;
        for (int64_t e = 0; e < E; e++) {
            if (!map[t * E + e]) continue;
            if (k == K)
                return epx_error(EPX_ERR_INVALID_ARG,
                                 "rank %d: routing_map[%lld] selects more than K = %lld experts (column %lld is "
                                 "past them)",
                                 hb->rank, (long long)t, (long long)K, (long long)e);
            sel[t * K + k] = (int32_t)e;
            prob[t * K + k] = probs ? probs[t * E + e] : 0.0f;
            k++;
        }
        for (; k < K; k++) {
            sel[t * K + k] = -1;
            prob[t * K + k] = 0.0f;
        }
    }
    return EPX_SUCCESS;
}

/* Every rank sees the same publications, so every rank reports a disagreement identically. */
static epx_result_t rm_check_agreement(host_buffer_t *hb, const host_pub_t *pubs)
{
    static const char *const what[] = {"", "dtype", "permute flag", "presence of probs"};
    for (int w = RM_W_DTYPE; w <= RM_W_HAS_PROBS; w++)
        for (int s = 1; s < hb->nranks; s++)
            if (pubs[s].words[w] != pubs[0].words[w]) {
                if (w == RM_W_DTYPE)
                    return epx_error(
                        EPX_ERR_MISMATCH,
                        "rank %d: routing-map dispatch dtype differs: rank 0 passes %s, rank %d passes %s",
                        hb->rank, epx_dtype_str((epx_dtype_t)pubs[0].words[w]), s,
                        epx_dtype_str((epx_dtype_t)pubs[s].words[w]));
                return epx_error(
                    EPX_ERR_MISMATCH,
                    "rank %d: routing-map dispatch %s differs: rank 0 has %lld, rank %d has %lld", hb->rank,
                    what[w], (long long)pubs[0].words[w], s, (long long)pubs[s].words[w]);
            }
    for (int s = 0; s < hb->nranks; s++)
        if (pubs[s].words[RM_W_T] < 0 || pubs[s].words[RM_W_T] > hb->buffer->config.max_tokens)
            return epx_error(EPX_ERR_INTERNAL, "rank %d: peer %d published T = %lld outside [0, %lld]",
                             hb->rank, s, (long long)pubs[s].words[RM_W_T],
                             (long long)hb->buffer->config.max_tokens);
    return EPX_SUCCESS;
}

/* Where each of our tokens lands on every rank (entries in the pinned summation order). */
static epx_result_t rm_build_source_map(host_buffer_t *hb, const rm_in_layout_t *lay, const rm_plan_t *p,
                                        int permute, int64_t T, rm_handle_t *h)
{
    int R = p->R, me = hb->rank;
    int64_t E = p->E, L = p->L, K = p->K;
    const int32_t *sel = rm_sel(hb, lay, me);
    const float *prob = rm_prob(hb, lay, me);
    int64_t *seen = calloc((size_t)(E > R ? E : R), sizeof(int64_t)); /* earlier tokens per expert/rank */
    if (!seen) return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: routing-map handle allocation failed", me);
    int64_t n = 0;
    for (int64_t t = 0; t < T; t++) {
        h->entry_begin[t] = n;
        int last_rank = -1;
        for (int64_t k = 0; k < K; k++) {
            int32_t e = sel[t * K + k];
            if (e < 0) break;
            int r = (int)(e / L);
            int64_t padded_row, row;
            if (permute) {
                int64_t within = seen[e]++;
                for (int s = 0; s < me; s++) within += p->cnt[s * E + e];
                padded_row = p->group_begin[e] + within;
                row = p->compact[e] + within;
            } else {
                if (r == last_rank) continue;
                int64_t within = seen[r]++;
                for (int s = 0; s < me; s++) within += p->rank_cnt[s * R + r];
                padded_row = row = within;
            }
            last_rank = r;
            rm_entry_t *ent = &h->entries[n++];
            ent->rank = r;
            ent->row = (p->bound[r] >= 0 && padded_row >= p->bound[r]) ? -1 : (int32_t)row;
            ent->prob = prob[t * K + k];
        }
    }
    h->entry_begin[T] = n;
    free(seen);
    return EPX_SUCCESS;
}

/* Our output rows: which (source, token) each holds, zero rows where padding or past the real
 * count; only the first out_rows are built. */
static epx_result_t rm_build_rows(host_buffer_t *hb, const rm_in_layout_t *lay, const host_pub_t *pubs,
                                  const rm_plan_t *p, int permute, int64_t out_rows, rm_row_src_t **rows_out)
{
    int R = p->R, me = hb->rank;
    int64_t E = p->E, L = p->L, K = p->K;
    rm_row_src_t *rows = malloc((size_t)(out_rows > 0 ? out_rows : 1) * sizeof(rm_row_src_t));
    int64_t *cursor = calloc((size_t)L, sizeof(int64_t));
    if (!rows || !cursor) {
        free(rows);
        free(cursor);
        return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: routing-map row map allocation failed", me);
    }
    for (int64_t i = 0; i < out_rows; i++) rows[i] = (rm_row_src_t){-1, -1, -1};
    int64_t n = 0;
    for (int s = 0; s < R; s++) {
        const int32_t *sel = rm_sel(hb, lay, s);
        for (int64_t t = 0; t < pubs[s].words[RM_W_T]; t++) {
            int hit = 0;
            for (int64_t k = 0; k < K; k++) {
                int32_t e = sel[t * K + k];
                if (e < 0) break;
                if (e / L != me) continue;
                if (permute) {
                    int64_t row = p->group_begin[e] + cursor[e - me * L]++;
                    if (row < out_rows) rows[row] = (rm_row_src_t){s, (int32_t)t, e};
                } else {
                    hit = 1;
                }
            }
            if (hit) {
                if (n < out_rows) rows[n] = (rm_row_src_t){s, (int32_t)t, -1};
                n++;
            }
        }
    }
    free(cursor);
    (void)E;
    *rows_out = rows;
    return EPX_SUCCESS;
}

/* Without a bound, every output must hold the real row count (known only after the exchange). */
static epx_result_t rm_check_capacity(int me, const epx_rm_dispatch_outputs_t *outputs, int64_t bound,
                                      int64_t real)
{
    if (bound >= 0) return EPX_SUCCESS;
    int64_t cap = outputs->tokens.shape[0];
    const char *name = "tokens";
    if (outputs->scaling_factor.data && outputs->scaling_factor.shape[0] < cap) {
        cap = outputs->scaling_factor.shape[0];
        name = "scaling_factor";
    }
    if (outputs->probs.data && outputs->probs.shape[0] < cap) {
        cap = outputs->probs.shape[0];
        name = "probs";
    }
    if (cap < real)
        return epx_error(EPX_ERR_INVALID_ARG,
                         "rank %d: routing-map dispatch receives %lld rows, %s holds %lld", me,
                         (long long)real, name, (long long)cap);
    return EPX_SUCCESS;
}

epx_result_t host_rm_dispatch(epx_buffer_t buffer, uint64_t seq, const epx_rm_dispatch_args_t *args,
                              epx_rm_dispatch_outputs_t *outputs, epx_handle_t handle)
{
    host_buffer_t *hb = buffer->backend_state;
    int me = hb->rank, R = hb->nranks;
    int64_t T = args->hidden.shape[0], H = buffer->config.hidden, L = buffer->num_local_experts;
    int permute = args->permute != 0;
    int64_t my_bound = permute ? args->num_permuted_tokens : args->num_dispatched_tokens;
    if (my_bound < 0) my_bound = -1;
    epx_dtype_t dtype = args->hidden.dtype;
    size_t esize = epx_dtype_bytes(dtype);
    rm_in_layout_t lay = rm_in_layout(buffer);
    host_pub_t *pubs = NULL;
    rm_plan_t plan = {0};
    rm_row_src_t *rows = NULL;
    rm_handle_t *h = NULL;

    /* Send half: always publish (with our failure, if any) so peers never wait for us. */
    epx_result_t res = EPX_SUCCESS;
    if (hb->area_bytes[HOST_AREA_IN] < lay.total)
        res = epx_error(EPX_ERR_INTERNAL,
                        "rank %d: routing-map dispatch needs an IN area of %zu bytes, it has %zu", me,
                        lay.total, hb->area_bytes[HOST_AREA_IN]);
    if (res == EPX_SUCCESS) res = host_area_acquire(hb, HOST_AREA_IN);
    if (res == EPX_SUCCESS) res = rm_publish_routing(hb, &lay, args, T);
    if (res == EPX_SUCCESS) {
        uint8_t *area = host_area_ptr(hb, me, HOST_AREA_IN);
        host_copy(area + lay.x, args->hidden.data, (size_t)(T * H) * esize);
        if (args->scaling_factor.data)
            host_copy(area + lay.scales, args->scaling_factor.data, (size_t)(T * (H / 128)) * sizeof(float));
    }
    int64_t words[RM_W_COUNT] = {
        T, (int64_t)dtype, permute, args->probs.data != NULL, permute ? args->pad_multiple : 1, my_bound};
    host_area_publish(hb, HOST_AREA_IN, seq, EPX_CALL_RM_DISPATCH, (int32_t)res, words, RM_W_COUNT);
    if (res != EPX_SUCCESS) {
        host_fail(hb, seq, res);
        goto out;
    }

    /* Receive half: everything that can fail, then the verdict, then the outputs. */
    pubs = calloc((size_t)R, sizeof(host_pub_t));
    h = rm_handle_new(T, buffer->config.num_topk, L);
    if (!pubs || !h)
        res = epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: routing-map dispatch allocation failed", me);
    if (res == EPX_SUCCESS) res = host_area_wait_all(hb, HOST_AREA_IN, seq, pubs);
    if (res == EPX_SUCCESS) res = rm_check_agreement(hb, pubs);
    if (res == EPX_SUCCESS) res = rm_plan_build(hb, &lay, pubs, permute, &plan);
    const int64_t real = res == EPX_SUCCESS ? plan.real[me] : 0;
    const int64_t out_rows = my_bound >= 0 ? my_bound : real;
    if (res == EPX_SUCCESS) res = rm_check_capacity(me, outputs, my_bound, real);
    if (res == EPX_SUCCESS) res = rm_build_source_map(hb, &lay, &plan, permute, T, h);
    if (res == EPX_SUCCESS) res = rm_build_rows(hb, &lay, pubs, &plan, permute, out_rows, &rows);
    res = host_verdict(hb, seq, res);
    if (res != EPX_SUCCESS) goto out;

    h->dispatch_seq = seq;
    h->permute = permute;
    h->has_probs = args->probs.data != NULL;
    h->num_tokens = T;
    h->kept_rows = out_rows < real ? out_rows : real;
    for (int64_t j = 0; j < L; j++) {
        int64_t e = me * L + j, count = 0;
        for (int s = 0; s < R; s++) count += plan.cnt[s * plan.E + e];
        h->group_begin[j] = plan.group_begin[e];
        h->compact_begin[j] = plan.compact[e];
        int64_t room = out_rows - plan.group_begin[e];
        h->kept[j] = room < 0 ? 0 : (room < count ? room : count);
        if (permute && outputs->tokens_per_expert.data)
            ((int32_t *)outputs->tokens_per_expert.data)[j] = (int32_t)rm_round_up(count, plan.pad[me]);
    }

    rm_fill_ctx_t ctx = {hb, &lay, rows, outputs, esize, permute};
    host_parallel_for(hb, out_rows, 16, rm_fill_rows, &ctx);
    if (outputs->local_map.data) rm_fill_local_map(hb, &lay, pubs, &outputs->local_map);
    if (outputs->num_tokens.data) ((int32_t *)outputs->num_tokens.data)[0] = (int32_t)real;
    outputs->num_tokens_host = out_rows;
    if (real > out_rows) {
        atomic_store(&buffer->overflow, 1);
        EPX_INFO(EPX_SUBSYS_PERMUTE,
                 "rank %d: routing-map dispatch seq %llu dropped %lld rows past the bound %lld", me,
                 (unsigned long long)seq, (long long)(real - out_rows), (long long)out_rows);
    }
    handle->num_tokens = T;
    /* With a bound the handle covers the bound's rows (as on a device, which cannot learn the
     * real count without a sync); rows past the real count contribute nothing to the combine. */
    handle->num_recv = out_rows;
    handle->permute = permute;
    handle->x_dtype = dtype;
    handle->backend_state = h;
    outputs->handle = handle;
    h = NULL;

out:
    host_area_done(hb, HOST_AREA_IN, seq);
    free(plan.block);
    free(rows);
    free(h);
    free(pubs);
    return res;
}

/* ------------------------------------------------------------------------- combine ---- */

typedef struct rm_reduce_ctx {
    host_buffer_t *hb;
    const rm_handle_t *h;
    uint16_t *out;
    int weighted;
} rm_reduce_ctx_t;

/* The pinned two-level sum: the entries of one node (ranks ascending, then local experts) make a
 * partial, the partials join over nodes ascending, remote ones through bf16; with one node, exactly
 * the flat sum. */
static void rm_reduce_tokens(void *vctx, int64_t begin, int64_t end)
{
    rm_reduce_ctx_t *c = vctx;
    const rm_handle_t *h = c->h;
    const int P = c->hb->buffer->comm->ranks_per_node, own = c->hb->buffer->comm->node;
    int64_t H = c->hb->buffer->config.hidden;
    float acc[512], part[512]; /* channel chunks: each channel still sums in the pinned order */
    for (int64_t t = begin; t < end; t++) {
        for (int64_t h0 = 0; h0 < H; h0 += 512) {
            int64_t n = H - h0 < 512 ? H - h0 : 512;
            for (int64_t i = 0; i < n; i++) acc[i] = 0.0f;
            for (int64_t x = h->entry_begin[t]; x < h->entry_begin[t + 1];) {
                const int node = h->entries[x].rank / P;
                int any = 0;
                for (int64_t i = 0; i < n; i++) part[i] = 0.0f;
                for (; x < h->entry_begin[t + 1] && h->entries[x].rank / P == node; x++) {
                    const rm_entry_t *ent = &h->entries[x];
                    if (ent->row < 0) continue;
                    const uint16_t *y = (const uint16_t *)host_area_ptr(c->hb, ent->rank, HOST_AREA_COMBINE) +
                                        (int64_t)ent->row * H + h0;
                    if (c->weighted)
                        for (int64_t i = 0; i < n; i++) part[i] += ent->prob * epx_bf16_to_f32(y[i]);
                    else
                        for (int64_t i = 0; i < n; i++) part[i] += epx_bf16_to_f32(y[i]);
                    any = 1;
                }
                if (any)
                    for (int64_t i = 0; i < n; i++)
                        acc[i] = epx_add_node_partial(acc[i], part[i], node != own);
            }
            for (int64_t i = 0; i < n; i++) c->out[t * H + h0 + i] = epx_f32_to_bf16(acc[i]);
        }
    }
}

epx_result_t host_rm_combine(epx_buffer_t buffer, uint64_t seq, const epx_rm_combine_args_t *args,
                             epx_rm_combine_outputs_t *outputs)
{
    host_buffer_t *hb = buffer->backend_state;
    const rm_handle_t *h = args->handle->backend_state;
    int me = hb->rank, R = hb->nranks;
    int64_t H = buffer->config.hidden, L = buffer->num_local_experts;
    int weighted = h && h->permute && args->weighted;
    host_pub_t *pubs = NULL;

    epx_result_t res = EPX_SUCCESS;
    if (!h)
        res =
            epx_error(EPX_ERR_INVALID_ARG, "rank %d: routing-map combine: the handle holds no dispatch", me);
    else if (weighted && !h->has_probs)
        res = epx_error(EPX_ERR_INVALID_ARG, "rank %d: weighted routing-map combine needs probs at dispatch",
                        me);
    else if ((size_t)h->kept_rows * (size_t)H * 2 > hb->area_bytes[HOST_AREA_COMBINE])
        res = epx_error(EPX_ERR_INTERNAL,
                        "rank %d: routing-map combine needs %lld rows of %lld bf16, the COMBINE area "
                        "holds %zu bytes",
                        me, (long long)h->kept_rows, (long long)H, hb->area_bytes[HOST_AREA_COMBINE]);
    epx_result_t acq = host_area_acquire(hb, HOST_AREA_COMBINE);
    if (res == EPX_SUCCESS) res = acq;
    if (res == EPX_SUCCESS) {
        uint16_t *dst = (uint16_t *)host_area_ptr(hb, me, HOST_AREA_COMBINE);
        const uint16_t *x = args->x.data;
        if (!h->permute) {
            host_copy(dst, x, (size_t)(h->kept_rows * H) * 2);
        } else {
            for (int64_t j = 0; j < L; j++)
                host_copy(dst + h->compact_begin[j] * H, x + h->group_begin[j] * H,
                          (size_t)(h->kept[j] * H) * 2);
        }
    }
    int64_t words[1] = {h ? (int64_t)h->dispatch_seq : -1};
    host_area_publish(hb, HOST_AREA_COMBINE, seq, EPX_CALL_RM_COMBINE, (int32_t)res, words, 1);
    if (res != EPX_SUCCESS) goto out;

    pubs = calloc((size_t)R, sizeof(host_pub_t));
    if (!pubs) {
        res = epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: routing-map combine allocation failed", me);
        goto out;
    }
    EPX_CHECK_GOTO(host_area_wait_all(hb, HOST_AREA_COMBINE, seq, pubs), res, out);
    for (int r = 0; r < R; r++)
        if ((uint64_t)pubs[r].words[0] != h->dispatch_seq) {
            res =
                epx_error(EPX_ERR_MISMATCH,
                          "rank %d: routing-map combine of dispatch seq %llu, but rank %d combines seq %lld",
                          me, (unsigned long long)h->dispatch_seq, r, (long long)pubs[r].words[0]);
            goto out;
        }
    rm_reduce_ctx_t ctx = {hb, h, outputs->combined.data, weighted};
    host_parallel_for(hb, h->num_tokens, 4, rm_reduce_tokens, &ctx);

out:
    host_area_done(hb, HOST_AREA_COMBINE, seq);
    free(pubs);
    return res;
}
