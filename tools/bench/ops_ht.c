/*
 * epx-bench HT rows: dispatch (static shape, fresh routing), cached dispatch and combine, the
 * same-run plain-copy ceiling (GPU), then the single-pass view mode's three rows. Every row is
 * timed on its own (warm-up + iterations, a barrier before each call) and its outputs checked.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "tool.h"

typedef struct ht_run {
    bench_op_t o;
    int64_t cap; /* the static shape: every token of every rank */
    int32_t *num_recv, *recv_topk, *recv_per_expert;
    uint16_t *y, *combined, *hy;
    epx_ht_dispatch_args_t a, av;
    epx_ht_dispatch_outputs_t out, cached_out, view_out, view_cached_out;
    epx_handle_t handle, vhandle;
} ht_run_t;

static int ht_combine(ht_run_t *h, epx_handle_t handle, int x_in_buffer)
{
    bench_rank_t *b = h->o.b;
    epx_ht_combine_args_t ca = EPX_HT_COMBINE_ARGS_INIT;
    ca.handle = handle;
    if (!x_in_buffer) ca.x = tensor(b, h->y, EPX_DTYPE_BF16, 2, h->cap, h->o.H, 0);
    ca.x_in_buffer = x_in_buffer;
    ca.stream = b->stream;
    epx_ht_combine_outputs_t co = EPX_HT_COMBINE_OUTPUTS_INIT;
    co.combined_x = tensor(b, h->combined, EPX_DTYPE_BF16, 2, h->o.T, h->o.H, 0);
    return bench_call(b, "epx_ht_combine", epx_ht_combine(h->o.buf, &ca, &co));
}

/* A cached dispatch of the default (view == 0) or the view mode. */
static int ht_cached(ht_run_t *h, int view)
{
    epx_ht_dispatch_args_t ac = view ? h->av : h->a;
    ac.cached_handle = view ? h->vhandle : h->handle;
    ac.topk_idx.data = NULL;
    if (view) h->view_cached_out = (epx_ht_dispatch_outputs_t)EPX_HT_DISPATCH_OUTPUTS_INIT;
    return bench_call(h->o.b, "cached epx_ht_dispatch",
                      epx_ht_dispatch(h->o.buf, &ac, view ? &h->view_cached_out : &h->cached_out));
}

/* The timed call of each row, as the HT figures of docs/benchmarks.md were measured: a fresh
 * dispatch destroys the previous handle inside its timed window. */
static int ht_call(void *ctx, int kind)
{
    ht_run_t *h = ctx;
    bench_rank_t *b = h->o.b;
    epx_tensor_t in_view;
    int rc;
    switch (kind) {
    case K_HT_DISPATCH:
        if (h->handle) epx_handle_destroy(h->handle);
        h->handle = NULL;
        rc = bench_call(b, "epx_ht_dispatch", epx_ht_dispatch(h->o.buf, &h->a, &h->out));
        if (rc == 0) h->handle = h->out.handle;
        return rc;
    case K_HT_CACHED: return ht_cached(h, 0);
    case K_HT_COMBINE: return ht_combine(h, h->handle, 0);
    case K_HT_CEILING: return op_ht_ceiling(&h->o, h->handle, &h->a.x);
    case K_VIEW_DISPATCH:
        if (h->vhandle) epx_handle_destroy(h->vhandle);
        h->vhandle = NULL;
        h->view_out = (epx_ht_dispatch_outputs_t)EPX_HT_DISPATCH_OUTPUTS_INIT;
        h->view_out.num_recv_tokens = h->out.num_recv_tokens;
        rc = bench_call(b, "view epx_ht_dispatch", epx_ht_dispatch(h->o.buf, &h->av, &h->view_out));
        if (rc == 0) h->vhandle = h->view_out.handle;
        return rc;
    case K_VIEW_CACHED: return ht_cached(h, 1);
    case K_VIEW_COMBINE:
        rc = bench_call(b, "epx_ht_get_combine_input",
                        epx_ht_get_combine_input(h->o.buf, h->vhandle, &in_view));
        return rc ? rc : ht_combine(h, h->vhandle, 1);
    default: return -1;
    }
}

/* Reads back and checks receive rows: N_r (device counter) when given, x, fp8 scales, and the
 * optional topk_idx and per-expert counts. */
static void ht_check_recv(ht_run_t *h, bench_check_t *ck, const epx_ht_dispatch_outputs_t *o, int with_count)
{
    bench_rank_t *b = h->o.b;
    const bench_routing_t *rt = h->o.rt;
    const int64_t n = rt->n_ht;
    const int fp8 = h->o.dtype == EPX_DTYPE_FP8_E4M3;
    const void *vx = mem_view(b, o->recv_x.data, (size_t)(n * h->o.H) * h->o.esz);
    const float *vs = fp8 ? mem_view(b, o->recv_x_scales.data, (size_t)(n * h->o.G) * sizeof(float)) : NULL;
    const int32_t *vt =
        o->recv_topk_idx.data ? mem_view(b, o->recv_topk_idx.data, (size_t)(n * rt->K) * 4) : NULL;
    const int32_t *vper = o->num_recv_tokens_per_expert.data
                              ? mem_view(b, o->num_recv_tokens_per_expert.data, (size_t)rt->L * 4)
                              : NULL;
    const int32_t *vn = with_count ? mem_view(b, h->num_recv, sizeof(int32_t)) : NULL;
    if (!vx || (fp8 && !vs) || (o->recv_topk_idx.data && !vt) ||
        (o->num_recv_tokens_per_expert.data && !vper) || (with_count && !vn))
        check_fail(ck, "outputs (not readable)", 0, 0, 0, 0);
    else
        check_ht_recv(ck, rt, h->o.dtype, h->o.H, n, vx, vs, vt);
    if (vn && *vn != n) check_fail(ck, "num_recv_tokens", 0, 0, *vn, (double)n);
    for (int j = 0; vper && j < rt->L; j++)
        if (vper[j] != rt->exp_off[j + 1] - rt->exp_off[j])
            check_fail(ck, "num_recv_tokens_per_expert", j, 0, vper[j],
                       (double)(rt->exp_off[j + 1] - rt->exp_off[j]));
    if (vn) mem_view_release(b, vn);
    if (vper) mem_view_release(b, vper);
    if (vt) mem_view_release(b, vt);
    if (vs) mem_view_release(b, vs);
    if (vx) mem_view_release(b, vx);
}

static void ht_check_combined(ht_run_t *h, bench_check_t *ck)
{
    const uint16_t *v = mem_view(h->o.b, h->combined, (size_t)(h->o.T * h->o.H) * 2);
    if (!v) {
        check_fail(ck, "combined (not readable)", 0, 0, 0, 0);
        return;
    }
    check_ht_combined(ck, h->o.rt, h->o.H, v);
    mem_view_release(h->o.b, v);
}

/* An untimed default-mode dispatch with every optional output (receive order, topk_idx,
 * per-expert counts, N_r on the host), checked; its errors count for the first dispatch row. */
static int ht_full_dispatch(ht_run_t *h, bench_check_t *ck)
{
    bench_rank_t *b = h->o.b;
    epx_ht_dispatch_args_t fa = h->a;
    fa.num_worst_tokens = 0;
    fa.expert_alignment = 1;
    epx_ht_dispatch_outputs_t fo = h->out;
    fo.recv_topk_idx = tensor(b, h->recv_topk, EPX_DTYPE_INT32, 2, h->cap, h->o.rt->K, 0);
    fo.num_recv_tokens_per_expert = tensor(b, h->recv_per_expert, EPX_DTYPE_INT32, 1, h->o.rt->L, 0, 0);
    int rc = bench_call(b, "epx_ht_dispatch", epx_ht_dispatch(h->o.buf, &fa, &fo));
    if (rc) return rc;
    if (fo.num_recv_tokens_host != h->o.rt->n_ht)
        check_fail(ck, "num_recv_tokens", 0, 0, (double)fo.num_recv_tokens_host, (double)h->o.rt->n_ht);
    else
        ht_check_recv(h, ck, &fo, 1);
    epx_handle_destroy(fo.handle);
    return 0;
}

/* Untimed set-up of a row: outputs cleared so that the row's own call must write them, the
 * combine inputs written. */
static int ht_prepare(ht_run_t *h, int kind)
{
    bench_rank_t *b = h->o.b;
    const size_t x_bytes = (size_t)(h->o.rt->n_ht * h->o.H) * h->o.esz,
                 s_bytes = (size_t)(h->o.rt->n_ht * h->o.G) * 4;
    const size_t y_bytes = (size_t)(h->o.rt->n_ht * h->o.H) * 2;
    const int fp8 = h->o.dtype == EPX_DTYPE_FP8_E4M3;
    switch (kind) {
    case K_HT_DISPATCH:
    case K_HT_CACHED:
        return mem_zero(b, h->out.recv_x.data, x_bytes) ||
                       (fp8 && mem_zero(b, h->out.recv_x_scales.data, s_bytes)) ||
                       mem_zero(b, h->num_recv, sizeof(int32_t))
                   ? -1
                   : 0;
    case K_HT_COMBINE:
        return mem_zero(b, h->y, (size_t)(h->cap * h->o.H) * 2) || mem_put(b, h->y, h->hy, y_bytes) ||
                       mem_zero(b, h->combined, (size_t)(h->o.T * h->o.H) * 2)
                   ? -1
                   : 0;
    case K_HT_CEILING:
        /* The ceiling copies the rows of a static dispatch's routing: make one if no row did. */
        if (h->handle) return 0;
        if (bench_call(b, "epx_ht_dispatch", epx_ht_dispatch(h->o.buf, &h->a, &h->out))) return -1;
        h->handle = h->out.handle;
        return 0;
    case K_VIEW_DISPATCH: return mem_zero(b, h->num_recv, sizeof(int32_t));
    case K_VIEW_CACHED:
        return mem_zero(b, h->view_out.recv_x.data, x_bytes) ||
                       (fp8 && mem_zero(b, h->view_out.recv_x_scales.data, s_bytes))
                   ? -1
                   : 0;
    case K_VIEW_COMBINE: {
        epx_tensor_t in_view;
        if (bench_call(b, "epx_ht_get_combine_input",
                       epx_ht_get_combine_input(h->o.buf, h->vhandle, &in_view)))
            return -1;
        return mem_zero(b, in_view.data, (size_t)(in_view.shape[0] * h->o.H) * 2) ||
                       mem_put(b, in_view.data, h->hy, y_bytes) ||
                       mem_zero(b, h->combined, (size_t)(h->o.T * h->o.H) * 2)
                   ? -1
                   : 0;
    }
    default: return 0;
    }
}

/* Checks the row's outputs and reports it. Bytes per rank: dispatch the token rows sent once per
 * destination rank (fp8 with scales), combine the bf16 rows sent back, the ceiling the same rows
 * without scales. */
static void ht_finish(ht_run_t *h, int kind, bench_check_t *ck, double us)
{
    const bench_routing_t *rt = h->o.rt;
    const double rows = (double)rt->sent_rank_rows;
    double bytes = rows * (double)row_bytes(h->o.dtype, h->o.H);
    int status = ROW_OK;
    switch (kind) {
    case K_HT_DISPATCH: ht_check_recv(h, ck, &h->out, 1); break;
    case K_HT_CACHED: ht_check_recv(h, ck, &h->cached_out, 0); break;
    case K_VIEW_DISPATCH: ht_check_recv(h, ck, &h->view_out, 1); break;
    case K_VIEW_CACHED: ht_check_recv(h, ck, &h->view_cached_out, 0); break;
    case K_HT_COMBINE:
    case K_VIEW_COMBINE:
        ht_check_combined(h, ck);
        bytes = rows * (double)h->o.H * 2;
        break;
    default: status = ROW_UNCHECKED; bytes = rows * (double)h->o.H * (double)h->o.esz;
    }
    if (status == ROW_OK && ck->bad) status = ROW_FAIL;
    report(h->o.b, kind, status, us, bytes);
}

int run_ht(bench_rank_t *b, epx_buffer_t buf, const bench_routing_t *rt)
{
    ht_run_t h = {.o = op_start(b, buf, rt), .cap = (int64_t)rt->R * rt->T};
    const int fp8 = h.o.fp8, K = rt->K;
    const int64_t T = h.o.T, H = h.o.H, G = h.o.G, cap = h.cap;
    bench_mem_t m = {0};
    bench_inputs_t in;
    int rc = op_inputs(&h.o, &m, h.o.dtype, &in);
    void *recv_x = dev_take(b, &m, (size_t)(cap * H) * h.o.esz);
    float *recv_scales = dev_take(b, &m, (size_t)(cap * G) * sizeof(float));
    h.recv_topk = dev_take(b, &m, (size_t)(cap * K) * sizeof(int32_t));
    h.recv_per_expert = dev_take(b, &m, (size_t)rt->L * sizeof(int32_t));
    h.num_recv = dev_take(b, &m, sizeof(int32_t));
    h.y = dev_take(b, &m, (size_t)(cap * H) * 2);
    h.combined = dev_take(b, &m, (size_t)(T * H) * 2);
    h.hy = host_take(&m, (size_t)((rt->n_ht ? rt->n_ht : 1) * H) * 2);
    if (rc || m.failed) {
        rc = -1;
        goto out;
    }
    /* Combine input: the row received from (s, t) as this rank's "expert output" for it. */
    for (int64_t i = 0; i < rt->n_ht; i++)
        for (int64_t c = 0; c < H; c++)
            h.hy[i * H + c] = epx_f32_to_bf16(value_of(rt->ht_src[i], rt->ht_tok[i], c, b->rank));

    h.a = (epx_ht_dispatch_args_t)EPX_HT_DISPATCH_ARGS_INIT;
    h.a.x = tensor(b, in.x, h.o.dtype, 2, T, H, 0);
    if (fp8) h.a.x_scales = tensor(b, in.x_scales, EPX_DTYPE_FP32, 2, T, G, 0);
    h.a.topk_idx = tensor(b, in.topk, EPX_DTYPE_INT32, 2, T, K, 0);
    h.a.num_worst_tokens = cap;
    h.a.stream = b->stream;
    h.out = (epx_ht_dispatch_outputs_t)EPX_HT_DISPATCH_OUTPUTS_INIT;
    h.out.recv_x = tensor(b, recv_x, h.o.dtype, 2, cap, H, 0);
    if (fp8) h.out.recv_x_scales = tensor(b, recv_scales, EPX_DTYPE_FP32, 2, cap, G, 0);
    h.out.num_recv_tokens = tensor(b, h.num_recv, EPX_DTYPE_INT32, 1, 1, 0, 0);
    h.cached_out = h.out;
    h.av = h.a; /* view mode: outputs in the library's buffer */
    h.av.recv_in_buffer = 1;

    bench_check_t full = {"ht-dispatch (default mode)", b->rank, 0};
    rc = ht_full_dispatch(&h, &full);
    const bench_loop_t loop = {ht_call, NULL, &h};
    for (int kind = K_HT_DISPATCH; kind <= K_VIEW_COMBINE && rc == 0; kind++) {
        if (!has_row(b, kind)) continue;
        bench_check_t ck = {bench_kinds[kind].name, b->rank, 0};
        if (kind == K_HT_DISPATCH || (kind == K_VIEW_DISPATCH && !has_row(b, K_HT_DISPATCH)))
            ck.bad = full.bad;
        double us = 0;
        if ((rc = ht_prepare(&h, kind)) == 0 && (rc = time_row(b, &loop, kind, &us)) == 0)
            ht_finish(&h, kind, &ck, us);
    }
    if (rc == 0) rc = bench_call(b, "epx_comm_barrier", epx_comm_barrier(b->comm));
out:
    epx_handle_destroy(h.handle);
    epx_handle_destroy(h.vhandle);
    mem_release_all(b, &m);
    return rc;
}
