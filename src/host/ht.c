/*
 * Host backend: dispatch layout and HT dispatch (routed and cached); the combine is in ht_combine.c.
 * Each source publishes its tokens in its IN area; every rank pulls the rows routed to it, in (source
 * rank, source token) order. View mode puts the dispatch outputs in a private per-buffer array.
 */
#include <stdlib.h>
#include <string.h>

#include "host/ht.h"

/* Publication words of HT dispatch. */
enum {
    W_T = 0,
    W_DTYPE,
    W_HAS_WEIGHTS,
    W_CACHED,
    W_HANDLE_SEQ,
    W_WANTS_WEIGHTS,
    W_WORST,
    W_VIEW,
    W_DISPATCH_COUNT
};

/* Byte offsets of the HT dispatch payload in an IN area (sized by host_area_sizes). */
typedef struct in_layout {
    size_t x, scales, topk, weights;
} in_layout_t;

static in_layout_t in_layout_of(const epx_buffer_config_t *cfg)
{
    const size_t Tm = (size_t)cfg->max_tokens, H = (size_t)cfg->hidden, K = (size_t)cfg->num_topk;
    in_layout_t l;
    l.x = 0;
    l.scales = Tm * H * 4;
    l.topk = (l.scales + Tm * (H / 128) * 4 + 7) / 8 * 8;
    l.weights = l.topk + Tm * K * 8;
    return l;
}

/* View mode: points the four row outputs at the private array of the call's view area, `rows` rows
 * each. The array is made at the first use of the area for R*T_max rows of the widest dtype the
 * buffer allows and never moves, so no view of an area ever points at freed memory. */
static epx_result_t set_views(host_buffer_t *hb, const epx_ht_dispatch_args_t *args,
                              epx_ht_dispatch_outputs_t *o, int64_t rows, int routed)
{
    const epx_buffer_config_t *cfg = &hb->buffer->config;
    const size_t cap = (size_t)hb->nranks * (size_t)cfg->max_tokens, H = (size_t)cfg->hidden;
    const size_t K = (size_t)cfg->num_topk;
    const uint32_t dt = cfg->dispatch_dtypes;
    const size_t elem = (dt & EPX_DTYPE_BIT(EPX_DTYPE_FP32))   ? 4
                        : (dt & EPX_DTYPE_BIT(EPX_DTYPE_BF16)) ? 2
                                                               : 1;
    const size_t ns = args->x.dtype == EPX_DTYPE_FP8_E4M3 ? H / 128 : 0;
    const size_t ns_max = (dt & EPX_DTYPE_BIT(EPX_DTYPE_FP8_E4M3)) ? H / 128 : 0;
    const size_t off_scales = (cap * H * elem + 15) / 16 * 16, off_idx = off_scales + cap * ns_max * 4;
    const size_t off_w = off_idx + cap * K * 4, bytes = off_w + cap * K * 4;
    const int k = args->view_area;
    if (hb->ht_view_bytes[k] < bytes) {
        uint8_t *p = realloc(hb->ht_view[k], bytes);
        if (!p)
            return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: cannot allocate %zu bytes of dispatch views",
                             hb->rank, bytes);
        hb->ht_view[k] = p;
        hb->ht_view_bytes[k] = bytes;
    }
    o->recv_x = epx_tensor_2d(hb->ht_view[k], args->x.dtype, rows, (int64_t)H);
    if (ns) o->recv_x_scales = epx_tensor_2d(hb->ht_view[k] + off_scales, EPX_DTYPE_FP32, rows, (int64_t)ns);
    if (!routed) return EPX_SUCCESS;
    o->recv_topk_idx = epx_tensor_2d(hb->ht_view[k] + off_idx, EPX_DTYPE_INT32, rows, (int64_t)K);
    if (args->topk_weights.data)
        o->recv_topk_weights = epx_tensor_2d(hb->ht_view[k] + off_w, EPX_DTYPE_FP32, rows, (int64_t)K);
    return EPX_SUCCESS;
}

/* ----------------------------------------------------------------------------- layout ---- */

epx_result_t host_layout(epx_buffer_t buffer, const epx_tensor_t *topk_idx, epx_layout_outputs_t *outputs,
                         void *stream)
{
    const int R = buffer->comm->nranks, L = buffer->num_local_experts, E = buffer->config.num_experts;
    const int64_t T = topk_idx->shape[0], K = topk_idx->shape[1];
    const int D = buffer->comm->ranks_per_domain > 0 ? buffer->comm->ranks_per_domain : R;
    int32_t *per_rank = outputs->num_tokens_per_rank.data;
    int32_t *per_expert = outputs->num_tokens_per_expert.data;
    uint8_t *in_rank = outputs->is_token_in_rank.data;
    int32_t *per_domain = outputs->num_tokens_per_domain.data;
    int64_t *domain_seen = calloc((size_t)R / (size_t)D + 1, sizeof(int64_t));
    if (!domain_seen)
        return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: cannot allocate layout scratch",
                         buffer->comm->rank);

    memset(per_rank, 0, (size_t)R * sizeof(int32_t));
    memset(per_expert, 0, (size_t)E * sizeof(int32_t));
    host_zero(in_rank, (size_t)(T * R));
    if (per_domain) memset(per_domain, 0, (size_t)(R / D) * sizeof(int32_t));
    for (int d = 0; d <= R / D; d++) domain_seen[d] = -1;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t k = 0; k < K; k++) {
            int64_t e = host_topk_at(topk_idx, t * K + k);
            if (e < 0) continue;
            int r = (int)(e / L), d = r / D;
            per_expert[e]++;
            if (!in_rank[t * R + r]) {
                in_rank[t * R + r] = 1;
                per_rank[r]++;
            }
            if (domain_seen[d] != t) {
                domain_seen[d] = t;
                if (per_domain) per_domain[d]++;
            }
        }
    }
    free(domain_seen);
    return EPX_SUCCESS;
}

/* ------------------------------------------------------------------- publish (source) ---- */

typedef struct publish_ctx {
    const epx_ht_dispatch_args_t *args;
    uint8_t *area;
    in_layout_t lay;
    int64_t H, K, nscales;
    size_t row_bytes;
    int routed; /* also topk and weights */
} publish_ctx_t;

static void publish_rows(void *vctx, int64_t begin, int64_t end)
{
    publish_ctx_t *c = vctx;
    const epx_ht_dispatch_args_t *a = c->args;
    memcpy(c->area + c->lay.x + (size_t)begin * c->row_bytes,
           (const uint8_t *)a->x.data + (size_t)begin * c->row_bytes, (size_t)(end - begin) * c->row_bytes);
    if (c->nscales)
        memcpy(c->area + c->lay.scales + (size_t)(begin * c->nscales) * 4,
               (const float *)a->x_scales.data + begin * c->nscales,
               (size_t)((end - begin) * c->nscales) * 4);
    if (!c->routed) return;
    int64_t *topk = (int64_t *)(c->area + c->lay.topk);
    for (int64_t i = begin * c->K; i < end * c->K; i++) topk[i] = host_topk_at(&a->topk_idx, i);
    if (a->topk_weights.data)
        memcpy(c->area + c->lay.weights + (size_t)(begin * c->K) * 4,
               (const float *)a->topk_weights.data + begin * c->K, (size_t)((end - begin) * c->K) * 4);
}

/* -------------------------------------------------------------- routing (every rank) ---- */

typedef struct count_ctx {
    host_buffer_t *hb;
    const host_pub_t *pubs;
    in_layout_t lay;
    int R, me, L;
    int64_t K, Tm;
    int32_t *cnt;      /* [R * R]: tokens of source s going to rank r */
    int32_t *stamp;    /* [R * R]: last token of s that counted r */
    int32_t *incoming; /* [R * Tm]: tokens of s coming to us, at s * Tm */
} count_ctx_t;

static void count_sources(void *vctx, int64_t begin, int64_t end)
{
    count_ctx_t *c = vctx;
    for (int64_t s = begin; s < end; s++) {
        const int64_t T = c->pubs[s].words[W_T];
        const int64_t *topk = (const int64_t *)(host_area_ptr(c->hb, (int)s, HOST_AREA_IN) + c->lay.topk);
        int32_t *cnt = c->cnt + s * c->R, *stamp = c->stamp + s * c->R, *in = c->incoming + s * c->Tm;
        int32_t n_in = 0;
        for (int r = 0; r < c->R; r++) stamp[r] = -1;
        for (int64_t t = 0; t < T; t++) {
            for (int64_t k = 0; k < c->K; k++) {
                int64_t e = topk[t * c->K + k];
                if (e < 0) continue;
                int r = (int)(e / c->L);
                if (stamp[r] == (int32_t)t) continue;
                stamp[r] = (int32_t)t;
                cnt[r]++;
                if (r == c->me) in[n_in++] = (int32_t)t;
            }
        }
    }
}

typedef struct copy_ctx {
    host_buffer_t *hb;
    const epx_ht_dispatch_outputs_t *out;
    in_layout_t lay;
    const int32_t *src_rank, *src_token;
    int me, L;
    int64_t H, K, nscales;
    size_t row_bytes;
    int routed; /* write recv_topk_idx / recv_topk_weights too */
} copy_ctx_t;

static void copy_rows(void *vctx, int64_t begin, int64_t end)
{
    copy_ctx_t *c = vctx;
    const epx_ht_dispatch_outputs_t *o = c->out;
    for (int64_t i = begin; i < end; i++) {
        const int s = c->src_rank[i];
        const int64_t t = c->src_token[i];
        const uint8_t *area = host_area_ptr(c->hb, s, HOST_AREA_IN);
        memcpy((uint8_t *)o->recv_x.data + (size_t)i * c->row_bytes,
               area + c->lay.x + (size_t)t * c->row_bytes, c->row_bytes);
        if (c->nscales && o->recv_x_scales.data)
            memcpy((float *)o->recv_x_scales.data + i * c->nscales,
                   area + c->lay.scales + (size_t)(t * c->nscales) * 4, (size_t)c->nscales * 4);
        if (!c->routed) continue;
        const int64_t *topk = (const int64_t *)(area + c->lay.topk) + t * c->K;
        const float *weights = (const float *)(area + c->lay.weights) + t * c->K;
        for (int64_t k = 0; k < c->K; k++) {
            int64_t e = topk[k];
            int64_t local = (e >= 0 && e / c->L == c->me) ? e - (int64_t)c->me * c->L : -1;
            if (o->recv_topk_idx.data) {
                if (o->recv_topk_idx.dtype == EPX_DTYPE_INT64)
                    ((int64_t *)o->recv_topk_idx.data)[i * c->K + k] = local;
                else
                    ((int32_t *)o->recv_topk_idx.data)[i * c->K + k] = (int32_t)local;
            }
            if (o->recv_topk_weights.data)
                ((float *)o->recv_topk_weights.data)[i * c->K + k] = local >= 0 ? weights[k] : 0.0f;
        }
    }
}

/* ------------------------------------------------------------ agreement of the ranks ---- */

/* Every rank sees the same publications, so every rank reaches the same verdict in these (ht.h). */

epx_result_t host_ht_check_op(const host_buffer_t *hb, const host_pub_t *pub, int p, int32_t op,
                              const char *what)
{
    if (pub->op == op) return EPX_SUCCESS;
    return epx_error(EPX_ERR_MISMATCH, "rank %d: call %llu is %s here but rank %d made operation %d",
                     hb->rank, (unsigned long long)pub->seq, what, p, pub->op);
}

epx_result_t host_ht_check_same(const host_buffer_t *hb, const host_pub_t *pubs, int p, int word,
                                const char *flag, const char *handle)
{
    const long long mine = pubs[p].words[word], first = pubs[0].words[word];
    if (mine == first) return EPX_SUCCESS;
    if (handle)
        return epx_error(EPX_ERR_MISMATCH,
                         "rank %d: %s handles come from different dispatches: call %lld on rank 0, %lld on "
                         "rank %d",
                         hb->rank, handle, first, mine, p);
    return epx_error(EPX_ERR_MISMATCH, "rank %d: ranks disagree on %s: rank 0 passes %lld, rank %d %lld",
                     hb->rank, flag, first, p, mine);
}

epx_result_t host_ht_check_weights(const host_buffer_t *hb, const host_pub_t *pubs, int wants, int has,
                                   const char *output)
{
    int asks = -1, lacks = -1;
    for (int p = 0; p < hb->nranks; p++) {
        if (pubs[p].words[wants] && asks < 0) asks = p;
        if (!pubs[p].words[has] && lacks < 0) lacks = p;
    }
    if (asks >= 0 && lacks >= 0)
        return epx_error(EPX_ERR_MISMATCH, "rank %d: rank %d asks for %s but rank %d passes no topk_weights",
                         hb->rank, asks, output, lacks);
    return EPX_SUCCESS;
}

static epx_result_t check_dispatch_pubs(const host_buffer_t *hb, const host_pub_t *pubs)
{
    const int me = hb->rank;
    const host_pub_t *z = &pubs[0];
    for (int p = 0; p < hb->nranks; p++) {
        const host_pub_t *a = &pubs[p];
        EPX_CHECK(host_ht_check_op(hb, a, p, EPX_CALL_HT_DISPATCH, "an HT dispatch"));
        if (a->words[W_DTYPE] != z->words[W_DTYPE])
            return epx_error(EPX_ERR_MISMATCH,
                             "rank %d: ranks disagree on the dtype of x: rank 0 passes %s, rank %d %s", me,
                             epx_dtype_str((epx_dtype_t)z->words[W_DTYPE]), p,
                             epx_dtype_str((epx_dtype_t)a->words[W_DTYPE]));
        if (a->words[W_CACHED] != z->words[W_CACHED])
            return epx_error(EPX_ERR_MISMATCH, "rank %d: rank 0 %s a cached handle, rank %d %s", me,
                             z->words[W_CACHED] ? "passes" : "passes no", p,
                             a->words[W_CACHED] ? "does" : "does not");
        if (a->words[W_CACHED]) EPX_CHECK(host_ht_check_same(hb, pubs, p, W_HANDLE_SEQ, NULL, "cached"));
        EPX_CHECK(host_ht_check_same(hb, pubs, p, W_VIEW, "recv_in_buffer", NULL));
    }
    return host_ht_check_weights(hb, pubs, W_WANTS_WEIGHTS, W_HAS_WEIGHTS, "recv_topk_weights");
}

/* Fails when an output given with per-row shape has fewer than `rows` rows. A required one counts
 * even without data (an empty tensor may have none): it holds no row. */
static epx_result_t check_rows(int rank, const epx_tensor_t *t, const char *name, int64_t rows,
                               int64_t arriving, int required)
{
    if ((t->data || required) && t->shape[0] < rows)
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d: %s has room for %lld rows, %lld arrive", rank, name,
                         (long long)t->shape[0], (long long)arriving);
    return EPX_SUCCESS;
}

/* recv_x is required unless the outputs are views (view: set after this check). */
static epx_result_t check_dispatch_capacity(int rank, const epx_ht_dispatch_outputs_t *o, int64_t rows,
                                            int64_t arriving, int routed, int view)
{
    EPX_CHECK(check_rows(rank, &o->recv_x, "recv_x", rows, arriving, !view));
    EPX_CHECK(check_rows(rank, &o->recv_x_scales, "recv_x_scales", rows, arriving, 0));
    if (!routed) return EPX_SUCCESS;
    EPX_CHECK(check_rows(rank, &o->recv_topk_idx, "recv_topk_idx", rows, arriving, 0));
    EPX_CHECK(check_rows(rank, &o->recv_topk_weights, "recv_topk_weights", rows, arriving, 0));
    return EPX_SUCCESS;
}

/* Scratch of a dispatch (the routing arrays only when routed), allocated before anything is
 * published; `block` holds it all. */
typedef struct dispatch_scratch {
    void *block;
    host_pub_t *pubs;
    int32_t *cnt, *stamp, *incoming;
    int64_t *run;  /* [R]: rows so far of our tokens per destination */
    int64_t *seen; /* [R]: last own token counted for a destination */
} dispatch_scratch_t;

static epx_result_t scratch_alloc(const host_buffer_t *hb, int routed, dispatch_scratch_t *s)
{
    const size_t R = (size_t)hb->nranks, Tm = (size_t)hb->buffer->config.max_tokens;
    const size_t r = routed ? R : 0; /* the routing arrays are empty when not routed */
    const size_t cells = r * R * sizeof(int32_t), incoming = r * Tm * sizeof(int32_t);
    const size_t bytes[] = {R * sizeof(host_pub_t), cells, cells, incoming, r * sizeof(int64_t),
                            r * sizeof(int64_t)};
    void *parts[6];
    void *block = host_alloc_parts(6, bytes, parts);
    if (!block)
        return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: cannot allocate dispatch scratch for %zu ranks",
                         hb->rank, R);
    /* The parts in member order. */
    *s = (dispatch_scratch_t){block, parts[0], parts[1], parts[2], parts[3], parts[4], parts[5]};
    return EPX_SUCCESS;
}

/* Everything a routed dispatch can fail at, after the exchange and before the verdict: counts,
 * capacities, views and the handle's state (*st_out). Writes no output. */
static epx_result_t dispatch_plan(host_buffer_t *hb, uint64_t seq, const epx_ht_dispatch_args_t *args,
                                  epx_ht_dispatch_outputs_t *outputs, dispatch_scratch_t *sc,
                                  host_ht_state_t **st_out)
{
    epx_buffer_t buffer = hb->buffer;
    const epx_buffer_config_t *cfg = &buffer->config;
    const int R = hb->nranks, me = hb->rank, L = buffer->num_local_experts;
    const int64_t K = cfg->num_topk, T = args->x.shape[0];
    const int64_t worst = args->num_worst_tokens > 0 ? args->num_worst_tokens : 0;
    const host_pub_t *pubs = sc->pubs;
    const in_layout_t lay = in_layout_of(cfg);

    count_ctx_t cc = {hb, pubs, lay, R, me, L, K, cfg->max_tokens, sc->cnt, sc->stamp, sc->incoming};
    host_parallel_for(hb, R, 1, count_sources, &cc);

    int64_t arriving = 0;
    for (int s = 0; s < R; s++) arriving += sc->cnt[s * R + me];
    const int64_t kept = worst > 0 && arriving > worst ? worst : arriving;
    EPX_CHECK(check_dispatch_capacity(me, outputs, worst > 0 ? worst : kept, arriving, 1, args->recv_in_buffer != 0));
    if (args->recv_in_buffer) EPX_CHECK(set_views(hb, args, outputs, worst > 0 ? worst : kept, 1));

    const size_t prefix = ((size_t)R + 1) * sizeof(int64_t), kept_rows = ((size_t)kept + 1) * sizeof(int32_t);
    const size_t token_rows = ((size_t)(T * R) + 1) * sizeof(int32_t);
    const size_t bytes[] = {sizeof(host_ht_state_t), prefix, kept_rows, kept_rows, token_rows};
    void *parts[5];
    host_ht_state_t *st = host_alloc_parts(5, bytes, parts);
    if (!st)
        return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: cannot allocate the dispatch handle for %lld rows",
                         me, (long long)kept);
    *st = (host_ht_state_t){.dispatch_seq = seq,
                            .nranks = R,
                            .num_tokens = T,
                            .num_recv = kept,
                            .num_arriving = arriving,
                            .recv_prefix = parts[1],
                            .recv_src_rank = parts[2],
                            .recv_src_token = parts[3],
                            .token_rows = parts[4]};

    /* Receiver side: rows in (source rank, source token) order, cut at the static bound. */
    int64_t row = 0;
    for (int s = 0; s < R; s++) {
        st->recv_prefix[s] = row < kept ? row : kept;
        const int32_t n = sc->cnt[s * R + me];
        for (int32_t i = 0; i < n; i++, row++)
            if (row < kept) {
                st->recv_src_rank[row] = s;
                st->recv_src_token[row] = sc->incoming[(int64_t)s * cfg->max_tokens + i];
            }
    }
    st->recv_prefix[R] = kept;

    /* Source side: where each of our tokens lands on each rank (-1 if not sent or dropped). Each
     * rank's own bound decides its drops: bounds may differ between ranks. */
    for (int r = 0; r < R; r++) {
        sc->run[r] = 0;
        sc->seen[r] = -1;
        for (int s = 0; s < me; s++) sc->run[r] += sc->cnt[s * R + r];
    }
    const int64_t *own_topk = (const int64_t *)(host_area_ptr(hb, me, HOST_AREA_IN) + lay.topk);
    for (int64_t t = 0; t < T; t++) {
        int32_t *rows = st->token_rows + t * R;
        for (int r = 0; r < R; r++) rows[r] = -1;
        for (int64_t k = 0; k < K; k++) {
            int64_t e = own_topk[t * K + k];
            if (e < 0) continue;
            int r = (int)(e / L);
            if (sc->seen[r] == t) continue;
            sc->seen[r] = t;
            int64_t landed = sc->run[r]++;
            int64_t bound = pubs[r].words[W_WORST];
            rows[r] = bound > 0 && landed >= bound ? -1 : (int32_t)landed;
        }
    }
    *st_out = st;
    return EPX_SUCCESS;
}

/* After every rank's verdict passed: writes the outputs and fills the handle; cannot fail. */
static void dispatch_commit(host_buffer_t *hb, uint64_t seq, const epx_ht_dispatch_args_t *args,
                            epx_ht_dispatch_outputs_t *outputs, epx_handle_t handle,
                            const dispatch_scratch_t *sc, host_ht_state_t *st)
{
    epx_buffer_t buffer = hb->buffer;
    const epx_buffer_config_t *cfg = &buffer->config;
    const int R = hb->nranks, me = hb->rank, L = buffer->num_local_experts;
    const int64_t K = cfg->num_topk, H = cfg->hidden;
    const int64_t worst = args->num_worst_tokens > 0 ? args->num_worst_tokens : 0;
    const epx_dtype_t dtype = args->x.dtype;
    const in_layout_t lay = in_layout_of(cfg);
    const int64_t arriving = st->num_arriving;

    /* Per local expert counts over every arriving token, dropped or not; into the tensor, or the host
     * array when the tensor is absent (then copied to the array below). */
    int32_t *per_expert = outputs->num_recv_tokens_per_expert.data
                              ? (int32_t *)outputs->num_recv_tokens_per_expert.data
                              : outputs->num_recv_tokens_per_expert_host;
    if (per_expert) {
        const int64_t align = args->expert_alignment > 1 ? args->expert_alignment : 1;
        memset(per_expert, 0, (size_t)L * sizeof(int32_t));
        for (int s = 0; s < R; s++) {
            const int64_t *topk = (const int64_t *)(host_area_ptr(hb, s, HOST_AREA_IN) + lay.topk);
            for (int32_t i = 0; i < sc->cnt[s * R + me]; i++) {
                const int64_t t = sc->incoming[(int64_t)s * cfg->max_tokens + i];
                for (int64_t k = 0; k < K; k++) {
                    int64_t e = topk[t * K + k];
                    if (e >= 0 && e / L == me) per_expert[e - (int64_t)me * L]++;
                }
            }
        }
        for (int j = 0; j < L; j++) per_expert[j] = (int32_t)((per_expert[j] + align - 1) / align * align);
        if (outputs->num_recv_tokens_per_expert_host &&
            per_expert != outputs->num_recv_tokens_per_expert_host)
            memcpy(outputs->num_recv_tokens_per_expert_host, per_expert, (size_t)L * sizeof(int32_t));
    }
    /* The rank prefix matrix: every source's count per destination, summed down the sources. */
    if (outputs->rank_prefix_matrix.data) {
        int32_t *m = outputs->rank_prefix_matrix.data;
        for (int d = 0; d < R; d++) {
            int32_t sum = 0;
            for (int s = 0; s < R; s++) m[s * R + d] = sum += sc->cnt[s * R + d];
        }
    }

    copy_ctx_t xc = {hb,
                     outputs,
                     lay,
                     st->recv_src_rank,
                     st->recv_src_token,
                     me,
                     L,
                     H,
                     K,
                     dtype == EPX_DTYPE_FP8_E4M3 ? H / 128 : 0,
                     (size_t)H * epx_dtype_bytes(dtype),
                     1};
    host_parallel_for(hb, st->num_recv, 16, copy_rows, &xc);

    if (outputs->num_recv_tokens.data) ((int32_t *)outputs->num_recv_tokens.data)[0] = (int32_t)arriving;
    /* Static mode returns before the device could know N_r on every backend: -1, as on cuda. */
    outputs->num_recv_tokens_host = worst > 0 ? -1 : arriving;
    if (worst > 0 && arriving > worst) {
        atomic_store_explicit(&buffer->overflow, 1, memory_order_release);
        EPX_INFO(EPX_SUBSYS_HT, "rank %d: call %llu: %lld rows arrive, num_worst_tokens %lld: rows dropped",
                 me, (unsigned long long)seq, (long long)arriving, (long long)worst);
    }
    handle->num_tokens = st->num_tokens;
    /* In static mode the handle has the bound's rows on every backend (a device cannot learn N_r
     * without a sync); the rows past N_r contribute nothing to the combine. */
    handle->num_recv = worst > 0 ? worst : st->num_recv;
    handle->x_dtype = dtype;
    handle->backend_state = st;
}

/* The rows a cached dispatch writes: the handle's, at most num_worst_tokens in static mode (a bound
 * on a default-mode handle drops the rows past it, as a static dispatch does). */
static int64_t cached_rows(const epx_ht_dispatch_args_t *args, const host_ht_state_t *st)
{
    return args->num_worst_tokens > 0 && args->num_worst_tokens < st->num_recv ? args->num_worst_tokens
                                                                               : st->num_recv;
}

static epx_result_t cached_plan(host_buffer_t *hb, const epx_ht_dispatch_args_t *args,
                                epx_ht_dispatch_outputs_t *outputs, const host_ht_state_t *st)
{
    const int64_t rows = args->num_worst_tokens > 0 ? args->num_worst_tokens : st->num_recv;
    EPX_CHECK(check_dispatch_capacity(hb->rank, outputs, cached_rows(args, st), st->num_recv, 0,
                                      args->recv_in_buffer != 0));
    if (args->recv_in_buffer) EPX_CHECK(set_views(hb, args, outputs, rows, 0));
    return EPX_SUCCESS;
}

/* The same routing drops the same rows again (and a bound below the handle's rows drops the rest):
 * the overflow flag is set as by a static dispatch. */
static void cached_commit(host_buffer_t *hb, uint64_t seq, const epx_ht_dispatch_args_t *args,
                          epx_ht_dispatch_outputs_t *outputs, const host_ht_state_t *st)
{
    const epx_buffer_config_t *cfg = &hb->buffer->config;
    const int64_t H = cfg->hidden;
    const epx_dtype_t dtype = args->x.dtype;
    copy_ctx_t xc = {hb,
                     outputs,
                     in_layout_of(cfg),
                     st->recv_src_rank,
                     st->recv_src_token,
                     hb->rank,
                     hb->buffer->num_local_experts,
                     H,
                     cfg->num_topk,
                     dtype == EPX_DTYPE_FP8_E4M3 ? H / 128 : 0,
                     (size_t)H * epx_dtype_bytes(dtype),
                     0};
    const int64_t rows = cached_rows(args, st);
    host_parallel_for(hb, rows, 16, copy_rows, &xc);
    /* As a routed dispatch reports it, and as the cuda backend does: -1 in static mode. */
    outputs->num_recv_tokens_host = args->num_worst_tokens > 0 ? -1 : st->num_arriving;
    if (st->num_arriving > rows) {
        atomic_store_explicit(&hb->buffer->overflow, 1, memory_order_release);
        EPX_INFO(EPX_SUBSYS_HT, "rank %d: cached call %llu: %lld rows arrive, %lld kept: rows dropped",
                 hb->rank, (unsigned long long)seq, (long long)st->num_arriving, (long long)rows);
    }
}

epx_result_t host_ht_dispatch(epx_buffer_t buffer, uint64_t seq, const epx_ht_dispatch_args_t *args,
                              epx_ht_dispatch_outputs_t *outputs, epx_handle_t handle)
{
    host_buffer_t *hb = buffer->backend_state;
    const epx_buffer_config_t *cfg = &buffer->config;
    const int cached = args->cached_handle != NULL;
    const host_ht_state_t *cst = cached ? args->cached_handle->backend_state : NULL;
    const int64_t T = args->x.shape[0], H = cfg->hidden;
    const epx_dtype_t dtype = args->x.dtype;

    if (cached && (!cst || args->cached_handle->kind != EPX_HANDLE_HT))
        return host_fail(
            hb, seq,
            epx_error(EPX_ERR_INVALID_ARG, "rank %d: cached_handle is not an HT dispatch handle", hb->rank));
    dispatch_scratch_t sc = {0};
    epx_result_t res = scratch_alloc(hb, !cached, &sc);
    if (res != EPX_SUCCESS) return host_fail(hb, seq, res);
    res = host_area_acquire(hb, HOST_AREA_IN);
    if (res != EPX_SUCCESS) {
        host_fail(hb, seq, res);
        goto out;
    }

    publish_ctx_t pc = {args,
                        host_area_ptr(hb, hb->rank, HOST_AREA_IN),
                        in_layout_of(cfg),
                        H,
                        cfg->num_topk,
                        dtype == EPX_DTYPE_FP8_E4M3 ? H / 128 : 0,
                        (size_t)H * epx_dtype_bytes(dtype),
                        !cached};
    host_parallel_for(hb, T, 64, publish_rows, &pc);
    int64_t words[W_DISPATCH_COUNT] = {0};
    words[W_T] = T;
    words[W_DTYPE] = dtype;
    words[W_HAS_WEIGHTS] = !cached && args->topk_weights.data != NULL;
    words[W_CACHED] = cached;
    words[W_HANDLE_SEQ] = cached ? (int64_t)cst->dispatch_seq : 0;
    words[W_WANTS_WEIGHTS] = !cached && outputs->recv_topk_weights.data != NULL;
    words[W_WORST] = !cached && args->num_worst_tokens > 0 ? args->num_worst_tokens : 0;
    words[W_VIEW] = args->recv_in_buffer != 0;
    host_area_publish(hb, HOST_AREA_IN, seq, EPX_CALL_HT_DISPATCH, EPX_SUCCESS, words, W_DISPATCH_COUNT);

    host_ht_state_t *st = NULL;
    res = host_area_wait_all(hb, HOST_AREA_IN, seq, sc.pubs);
    if (res == EPX_SUCCESS) res = check_dispatch_pubs(hb, sc.pubs);
    if (res == EPX_SUCCESS)
        res = cached ? cached_plan(hb, args, outputs, cst) : dispatch_plan(hb, seq, args, outputs, &sc, &st);
    /* Nothing is written before every rank knows it can complete the call. */
    res = host_verdict(hb, seq, res);
    if (res == EPX_SUCCESS && cached) cached_commit(hb, seq, args, outputs, cst);
    if (res == EPX_SUCCESS && !cached) dispatch_commit(hb, seq, args, outputs, handle, &sc, st);
    if (res != EPX_SUCCESS) free(st);
out:
    /* Also after a failure: peers may reuse their IN areas. */
    host_area_done(hb, HOST_AREA_IN, seq);
    free(sc.block);
    return res;
}
