/*
 * epx-bench routing-map rows: dispatch with permute (bounded by the P an untimed eager call
 * learned, so no host wait) and weighted combine with unpermute, then on the GPU the HT
 * plain-copy ceiling of the same token bytes (R > 1) and a local device copy of the permuted rows.
 */
#include <stdio.h>
#include <stdlib.h>

#include "core/internal.h"
#include "tool.h"

typedef struct rm_run {
    bench_op_t o;
    int64_t P;            /* permuted rows, padding included */
    int64_t *group_start; /* [L + 1] padded group starts of the permuted layout */
    uint16_t *y, *combined, *hy;
    void *copy;
    epx_rm_dispatch_args_t a;
    epx_rm_dispatch_outputs_t out;
    epx_handle_t handle, ht;
} rm_run_t;

/* Destroying a dispatch handle synchronises: it stays outside the timed window. */
static int rm_before(void *ctx, int kind)
{
    rm_run_t *r = ctx;
    if (kind != K_RM_DISPATCH || !r->handle) return 0;
    epx_result_t res = epx_handle_destroy(r->handle);
    r->handle = NULL;
    return bench_call(r->o.b, "epx_handle_destroy", res);
}

static int rm_call(void *ctx, int kind)
{
    rm_run_t *r = ctx;
    bench_rank_t *b = r->o.b;
    epx_rm_combine_args_t ca = EPX_RM_COMBINE_ARGS_INIT;
    epx_rm_combine_outputs_t co = EPX_RM_COMBINE_OUTPUTS_INIT;
    switch (kind) {
    case K_RM_DISPATCH:
        if (bench_call(b, "epx_rm_dispatch", epx_rm_dispatch(r->o.buf, &r->a, &r->out))) return -1;
        r->handle = r->out.handle;
        return 0;
    case K_RM_COMBINE:
        ca.handle = r->handle;
        ca.x = tensor(b, r->y, EPX_DTYPE_BF16, 2, r->P, r->o.H, 0);
        ca.weighted = 1;
        ca.stream = b->stream;
        co.combined = tensor(b, r->combined, EPX_DTYPE_BF16, 2, r->o.T, r->o.H, 0);
        return bench_call(b, "epx_rm_combine", epx_rm_combine(r->o.buf, &ca, &co));
    case K_RM_CEIL_HT: return op_ht_ceiling(&r->o, r->ht, &r->a.hidden);
    case K_RM_CEIL_COPY:
        return mem_copy_async(b, r->copy, r->out.tokens.data, (size_t)(r->P * r->o.H) * r->o.esz) ? -1 : 0;
    default: return -1;
    }
}

/* Reads back and checks the permuted outputs of the last dispatch: P (device counter), tokens,
 * probs, fp8 scales and the padded per-expert counts. */
static void rm_check_tokens(rm_run_t *r, bench_check_t *ck)
{
    bench_rank_t *b = r->o.b;
    const bench_routing_t *rt = r->o.rt;
    const int64_t P = r->group_start[rt->L];
    const int fp8 = r->o.dtype == EPX_DTYPE_FP8_E4M3;
    const void *vt = mem_view(b, r->out.tokens.data, (size_t)(P * r->o.H) * r->o.esz);
    const float *vp = mem_view(b, r->out.probs.data, (size_t)P * sizeof(float));
    const float *vs =
        fp8 ? mem_view(b, r->out.scaling_factor.data, (size_t)(P * r->o.G) * sizeof(float)) : NULL;
    const int32_t *vper = mem_view(b, r->out.tokens_per_expert.data, (size_t)rt->L * sizeof(int32_t));
    const int32_t *vn = mem_view(b, r->out.num_tokens.data, sizeof(int32_t));
    if (vt && vp && vper && vn && (vs || !fp8)) {
        check_rm_tokens(ck, rt, r->o.dtype, r->o.H, r->group_start, vt, vp, vs);
        for (int j = 0; j < rt->L; j++)
            if (vper[j] != r->group_start[j + 1] - r->group_start[j])
                check_fail(ck, "tokens_per_expert", j, 0, vper[j],
                           (double)(r->group_start[j + 1] - r->group_start[j]));
        if (*vn != P) check_fail(ck, "num_tokens", 0, 0, *vn, (double)P);
    } else {
        check_fail(ck, "outputs (not readable)", 0, 0, 0, 0);
    }
    if (vn) mem_view_release(b, vn);
    if (vper) mem_view_release(b, vper);
    if (vs) mem_view_release(b, vs);
    if (vp) mem_view_release(b, vp);
    if (vt) mem_view_release(b, vt);
}

/* Untimed set-up of a row: outputs cleared so that the row's own calls must write them. */
static int rm_prepare(rm_run_t *r, int kind)
{
    bench_rank_t *b = r->o.b;
    const size_t c_bytes = (size_t)(r->o.T * r->o.H) * 2;
    if (kind == K_RM_DISPATCH)
        return mem_zero(b, r->out.tokens.data, (size_t)(r->P * r->o.H) * r->o.esz) ||
                       mem_zero(b, r->out.probs.data, (size_t)r->P * sizeof(float)) ||
                       mem_zero(b, r->out.tokens_per_expert.data, (size_t)r->o.rt->L * sizeof(int32_t)) ||
                       mem_zero(b, r->out.num_tokens.data, sizeof(int32_t))
                   ? -1
                   : 0;
    if (kind == K_RM_COMBINE)
        return mem_put(b, r->y, r->hy, (size_t)(r->P * r->o.H) * 2) || mem_zero(b, r->combined, c_bytes) ? -1
                                                                                                         : 0;
    return 0;
}

/* Bytes per rank, as the routing-map figures count them: the permuted rows this rank receives
 * (dispatch, with fp8 scales) and reads (combine); the HT ceiling the token rows sent once per
 * destination rank. */
static void rm_finish(rm_run_t *r, int kind, double us, bench_check_t *eager)
{
    bench_check_t ck = {bench_kinds[kind].name, r->o.b->rank, kind == K_RM_DISPATCH ? eager->bad : 0};
    const double P = (double)r->P, H = (double)r->o.H;
    if (kind == K_RM_DISPATCH) {
        rm_check_tokens(r, &ck);
        report(r->o.b, kind, ck.bad ? ROW_FAIL : ROW_OK, us, P * (double)row_bytes(r->o.dtype, r->o.H));
    } else if (kind == K_RM_COMBINE) {
        const uint16_t *v = mem_view(r->o.b, r->combined, (size_t)(r->o.T * r->o.H) * 2);
        if (v)
            check_weighted_combined(&ck, r->o.rt, r->o.H, v, 1);
        else
            check_fail(&ck, "combined (not readable)", 0, 0, 0, 0);
        if (v) mem_view_release(r->o.b, v);
        report(r->o.b, kind, ck.bad ? ROW_FAIL : ROW_OK, us, P * H * 2);
    } else {
        const double rows = kind == K_RM_CEIL_HT ? (double)r->o.rt->sent_rank_rows : P;
        report(r->o.b, kind, ROW_UNCHECKED, us, rows * H * (double)r->o.esz);
    }
}

/* The untimed eager dispatch (it learns P, checked like a timed one) and, for the HT ceiling, one
 * static HT dispatch of the same rows. */
static int rm_setup_calls(rm_run_t *r, void *topk, bench_mem_t *m, bench_check_t *ck)
{
    bench_rank_t *b = r->o.b;
    const int64_t RT = (int64_t)r->o.rt->R * r->o.T;
    int rc = bench_call(b, "epx_rm_dispatch", epx_rm_dispatch(r->o.buf, &r->a, &r->out));
    if (rc) return rc;
    /* The timed rows take P as their bound and size their buffers by the routing's P. */
    if (r->out.num_tokens_host != r->P) {
        check_fail(ck, "num_tokens (eager)", 0, 0, (double)r->out.num_tokens_host, (double)r->P);
        epx_handle_destroy(r->out.handle);
        return -1;
    }
    rm_check_tokens(r, ck);
    rc = bench_call(b, "epx_handle_destroy", epx_handle_destroy(r->out.handle));
    r->a.num_permuted_tokens = r->P;
    if (rc || !has_row(b, K_RM_CEIL_HT)) return rc;
    epx_ht_dispatch_args_t ha = EPX_HT_DISPATCH_ARGS_INIT;
    ha.x = r->a.hidden;
    ha.x_scales = r->a.scaling_factor;
    ha.topk_idx = tensor(b, topk, EPX_DTYPE_INT32, 2, r->o.T, r->o.rt->K, 0);
    ha.num_worst_tokens = RT;
    ha.stream = b->stream;
    epx_ht_dispatch_outputs_t ho = EPX_HT_DISPATCH_OUTPUTS_INIT;
    ho.recv_x = tensor(b, dev_take(b, m, (size_t)(RT * r->o.H) * r->o.esz), r->o.dtype, 2, RT, r->o.H, 0);
    if (ha.x_scales.data)
        ho.recv_x_scales = tensor(b, dev_take(b, m, (size_t)(RT * r->o.G) * sizeof(float)), EPX_DTYPE_FP32, 2,
                                  RT, r->o.G, 0);
    if (m->failed) return -1;
    rc = bench_call(b, "epx_ht_dispatch", epx_ht_dispatch(r->o.buf, &ha, &ho));
    r->ht = rc ? NULL : ho.handle;
    return rc ? rc : stream_sync(b);
}

int run_rm(bench_rank_t *b, epx_buffer_t buf, const bench_routing_t *rt)
{
    const bench_opts_t *opt = b->opt;
    rm_run_t r = {.o = op_start(b, buf, rt)};
    const int64_t T = r.o.T, H = r.o.H, G = r.o.G, E = rt->E, pad = opt->pad;
    const int K = rt->K, L = rt->L, me = b->rank, fp8 = r.o.fp8;
    bench_mem_t m = {0};
    int rc = -1;
    r.group_start = calloc((size_t)L + 1, sizeof(int64_t));
    if (!r.group_start) goto out;
    for (int j = 0; j < L; j++)
        r.group_start[j + 1] = r.group_start[j] + (rt->exp_off[j + 1] - rt->exp_off[j] + pad - 1) / pad * pad;
    /* Output rows: the buffer's capacity, capped near twice the balanced count (8 ranks may share
     * one GPU's memory), never below this routing's P. */
    r.P = r.group_start[L];
    int64_t cap = (int64_t)rt->R * T * (K < L ? K : L) + L * (pad - 1);
    if (cap > 2 * T * K + L * pad) cap = 2 * T * K + L * pad;
    if (cap < r.P) cap = r.P;
    bench_inputs_t in;
    if (op_inputs(&r.o, &m, r.o.dtype, &in)) goto out;
    uint8_t *map = dev_take(b, &m, (size_t)(T * E));
    float *probs = dev_take(b, &m, (size_t)(T * E) * sizeof(float));
    void *tokens = dev_take(b, &m, (size_t)(cap * H) * r.o.esz);
    float *tok_scales = dev_take(b, &m, (size_t)(cap * G) * sizeof(float));
    float *tok_probs = dev_take(b, &m, (size_t)cap * sizeof(float));
    int32_t *per_expert = dev_take(b, &m, (size_t)L * sizeof(int32_t));
    int32_t *num_tokens = dev_take(b, &m, sizeof(int32_t));
    r.y = dev_take(b, &m, (size_t)(r.P * H) * 2);
    r.combined = dev_take(b, &m, (size_t)(T * H) * 2);
    r.copy = dev_take(b, &m, has_row(b, K_RM_CEIL_COPY) ? (size_t)(cap * H) * r.o.esz : 1);
    uint8_t *hmap = host_take(&m, (size_t)(T * E));
    float *hprobs = host_take(&m, (size_t)(T * E) * sizeof(float));
    r.hy = host_take(&m, (size_t)(r.P * H) * 2);
    if (m.failed) goto out;

    for (int64_t t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
            hmap[t * E + in.htopk[t * K + k]] = 1;
            hprobs[t * E + in.htopk[t * K + k]] = in.hw[t * K + k];
        }
    /* Combine input in the permuted layout; padding rows stay zero. */
    for (int j = 0; j < L; j++)
        for (int64_t i = rt->exp_off[j]; i < rt->exp_off[j + 1]; i++)
            for (int64_t c = 0; c < H; c++)
                r.hy[(r.group_start[j] + i - rt->exp_off[j]) * H + c] =
                    epx_f32_to_bf16(value_of(rt->exp_src[i], rt->exp_tok[i], c, me * L + j));
    if (mem_put(b, map, hmap, (size_t)(T * E)) || mem_put(b, probs, hprobs, (size_t)(T * E) * sizeof(float)))
        goto out;

    r.a = (epx_rm_dispatch_args_t)EPX_RM_DISPATCH_ARGS_INIT;
    r.a.hidden = tensor(b, in.x, r.o.dtype, 2, T, H, 0);
    if (fp8) r.a.scaling_factor = tensor(b, in.x_scales, EPX_DTYPE_FP32, 2, T, G, 0);
    r.a.routing_map = tensor(b, map, EPX_DTYPE_BOOL, 2, T, E, 0);
    r.a.probs = tensor(b, probs, EPX_DTYPE_FP32, 2, T, E, 0);
    r.a.permute = 1;
    r.a.pad_multiple = (int32_t)pad;
    r.a.stream = b->stream;
    r.out = (epx_rm_dispatch_outputs_t)EPX_RM_DISPATCH_OUTPUTS_INIT;
    r.out.tokens = tensor(b, tokens, r.o.dtype, 2, cap, H, 0);
    if (fp8) r.out.scaling_factor = tensor(b, tok_scales, EPX_DTYPE_FP32, 2, cap, G, 0);
    r.out.probs = tensor(b, tok_probs, EPX_DTYPE_FP32, 1, cap, 0, 0);
    r.out.tokens_per_expert = tensor(b, per_expert, EPX_DTYPE_INT32, 1, L, 0, 0);
    r.out.num_tokens = tensor(b, num_tokens, EPX_DTYPE_INT32, 1, 1, 0, 0);

    bench_check_t eager = {"permute-dispatch (eager)", me, 0};
    rc = rm_setup_calls(&r, in.topk, &m, &eager);
    const bench_loop_t loop = {rm_call, rm_before, &r};
    for (int kind = K_RM_DISPATCH; kind <= K_RM_CEIL_COPY && rc == 0; kind++) {
        double us = 0;
        if (!has_row(b, kind)) continue;
        if ((rc = rm_prepare(&r, kind)) == 0 && (rc = time_row(b, &loop, kind, &us)) == 0)
            rm_finish(&r, kind, us, &eager);
    }
    if (rc == 0) rc = bench_call(b, "epx_comm_barrier", epx_comm_barrier(b->comm));
out:
    epx_handle_destroy(r.handle);
    epx_handle_destroy(r.ht);
    free(r.group_start);
    mem_release_all(b, &m);
    return rc;
}
