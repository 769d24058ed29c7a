/*
 * epx-bench LL rows: dispatch (bf16 or fp8 cast) and combine (bf16) whole, then their send and
 * receive halves (return_recv_hook), on the GPU the same-run floors (the same stores to the same
 * peers with no wait or flag), and the bounds the LL rows are compared with: one plain local copy of
 * the call's bytes per rank, all ranks at once (what the bytes cost at copy speed, on any backend).
 * Each iteration times every row once, in that order, each call after a barrier; the last
 * iteration's outputs are checked.
 */
#include <stdio.h>
#include <stdlib.h>

#include "core/internal.h"
#include "tool.h"

/* The order of the calls within one iteration. */
enum { LL_KINDS = 10 };
static const int ll_order[LL_KINDS] = {
    K_LL_DISPATCH,     K_LL_COMBINE,        K_LL_DISPATCH_SEND, K_LL_DISPATCH_RECV,  K_LL_COMBINE_SEND,
    K_LL_COMBINE_RECV, K_LL_DISPATCH_FLOOR, K_LL_COMBINE_FLOOR, K_LL_DISPATCH_BOUND, K_LL_COMBINE_BOUND};

typedef struct ll_run {
    bench_op_t o;
    int64_t slots; /* rows per local expert: every token of every rank */
    epx_ll_dispatch_args_t a;
    epx_ll_dispatch_outputs_t out;
    epx_ll_combine_args_t ca;
    epx_ll_combine_outputs_t co;
    double bytes[2];           /* per rank: [0] dispatch, [1] combine (as the rows count them) */
    void *copy_src, *copy_dst; /* the bound rows' copy, max(bytes) each */
} ll_run_t;

static int ll_call(void *ctx, int kind)
{
    ll_run_t *l = ctx;
    bench_rank_t *b = l->o.b;
    const int hook = kind != K_LL_DISPATCH && kind != K_LL_COMBINE;
    switch (kind) {
    case K_LL_DISPATCH:
    case K_LL_DISPATCH_SEND:
        l->a.return_recv_hook = hook;
        return bench_call(b, "epx_ll_dispatch", epx_ll_dispatch(l->o.buf, &l->a, &l->out));
    case K_LL_COMBINE:
    case K_LL_COMBINE_SEND:
        l->ca.return_recv_hook = hook;
        l->ca.handle = l->out.handle;
        return bench_call(b, "epx_ll_combine", epx_ll_combine(l->o.buf, &l->ca, &l->co));
    case K_LL_DISPATCH_RECV:
        return bench_call(b, "dispatch epx_hook_run", epx_hook_run(&l->out.hook, b->stream));
    case K_LL_COMBINE_RECV:
        return bench_call(b, "combine epx_hook_run", epx_hook_run(&l->co.hook, b->stream));
    case K_LL_DISPATCH_FLOOR:
    case K_LL_COMBINE_FLOOR: return op_ll_floor(&l->o, kind == K_LL_COMBINE_FLOOR, &l->a, &l->out.handle);
    case K_LL_DISPATCH_BOUND:
    case K_LL_COMBINE_BOUND:
        return mem_copy_async(b, l->copy_dst, l->copy_src, (size_t)l->bytes[kind == K_LL_COMBINE_BOUND]) ? -1
                                                                                                         : 0;
    default: return -1;
    }
}

/* Checks what the last dispatch and combine wrote (whole or through their hooks), then clears
 * it so that the next pair must write it again. */
static int ll_check(ll_run_t *l, bench_check_t *ckd, bench_check_t *ckc)
{
    bench_rank_t *b = l->o.b;
    const int L = l->o.rt->L;
    const size_t x_bytes = (size_t)(L * l->slots * l->o.H) * (l->o.fp8 ? 1 : 2);
    const size_t s_bytes = (size_t)(L * l->o.G * l->slots) * sizeof(float),
                 c_bytes = (size_t)(l->o.T * l->o.H) * 2;
    const int32_t *vcount = mem_view(b, l->out.recv_count.data, (size_t)L * sizeof(int32_t));
    const void *vx = mem_view(b, l->out.recv_x.data, x_bytes);
    const float *vs = l->o.fp8 ? mem_view(b, l->out.recv_scales.data, s_bytes) : NULL;
    const uint16_t *vc = mem_view(b, l->co.combined_x.data, c_bytes);
    if (vcount && vx && (vs || !l->o.fp8))
        check_ll_recv(ckd, l->o.rt, l->o.fp8, l->o.H, l->slots, vcount, vx, vs);
    else
        check_fail(ckd, "outputs (not readable)", 0, 0, 0, 0);
    if (vc)
        check_weighted_combined(ckc, l->o.rt, l->o.H, vc, 0);
    else
        check_fail(ckc, "combined (not readable)", 0, 0, 0, 0);
    if (vc) mem_view_release(b, vc);
    if (vs) mem_view_release(b, vs);
    if (vx) mem_view_release(b, vx);
    if (vcount) mem_view_release(b, vcount);
    if (mem_zero(b, l->out.recv_count.data, (size_t)L * sizeof(int32_t)) ||
        mem_zero(b, l->out.recv_x.data, x_bytes) ||
        (l->o.fp8 && mem_zero(b, l->out.recv_scales.data, s_bytes)) ||
        mem_zero(b, l->co.combined_x.data, c_bytes))
        return -1;
    return 0;
}

/* Each row, with the bytes run_ll counted for it (dispatch or combine). */
static void ll_report(ll_run_t *l, double *samples, bench_check_t *ck)
{
    const bench_opts_t *opt = l->o.b->opt;
    const int warm = opt->warmup, n = opt->iters;
    for (int i = 0; i < LL_KINDS; i++) {
        const int kind = ll_order[i];
        const int comb = bench_kinds[kind].combine, reference = bench_kinds[kind].ceiling < -1;
        const int whole = kind == K_LL_DISPATCH || kind == K_LL_COMBINE;
        const bench_check_t *c = &ck[2 * !whole + comb];
        const int status = reference ? ROW_UNCHECKED : c->bad ? ROW_FAIL : ROW_OK;
        if (has_row(l->o.b, kind))
            report(l->o.b, kind, status, median(samples + i * (warm + n) + warm, n), l->bytes[comb]);
    }
}

/* Timeline samples (--timeline): after a barrier, one LL dispatch and combine (whole calls, timed by
 * events too) with the kernels stamping their start and end, then the dispatch floor alone. */
static int ll_timeline(ll_run_t *l)
{
    bench_rank_t *b = l->o.b;
    const bench_loop_t loop = {ll_call, NULL, l};
    int rc = 0;
    b->res->timeline_n = 0;
    for (int s = 0; s < BENCH_TIMELINE_SAMPLES && rc == 0; s++) {
        bench_timeline_t *tl = &b->res->timeline[s];
        double us_d = 0, us_c = 0;
        rc = op_ll_stamps_arm(&l->o);
        if (rc == 0) rc = time_once(b, &loop, K_LL_DISPATCH, &us_d);
        if (rc == 0) rc = time_once(b, &loop, K_LL_COMBINE, &us_c);
        if (rc == 0) rc = op_ll_stamps_read(&l->o, tl->call);
        tl->event_us = us_d + us_c;
        if (rc == 0) rc = bench_call(b, "epx_comm_barrier", epx_comm_barrier(b->comm));
        if (rc == 0) rc = op_ll_stamps_arm(&l->o);
        if (rc == 0) rc = ll_call(l, K_LL_DISPATCH_FLOOR);
        unsigned long long fl[8] = {0};
        if (rc == 0) rc = op_ll_stamps_read(&l->o, fl);
        tl->floor[0] = fl[0], tl->floor[1] = fl[1];
        if (rc == 0) b->res->timeline_n = s + 1;
    }
    return rc;
}

int run_ll(bench_rank_t *b, epx_buffer_t buf, const bench_routing_t *rt, int64_t T_max)
{
    const bench_opts_t *opt = b->opt;
    ll_run_t l = {.o = op_start(b, buf, rt), .slots = (int64_t)rt->R * T_max};
    const int64_t T = l.o.T, H = l.o.H, G = l.o.G, slots = l.slots;
    const int K = rt->K, L = rt->L, me = b->rank, warm = opt->warmup, n = opt->iters;
    const epx_dtype_t recv_dtype = l.o.fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
    bench_mem_t m = {0};
    bench_inputs_t in;
    int rc = op_inputs(&l.o, &m, EPX_DTYPE_BF16, &in); /* LL casts bf16 input itself */
    void *recv_x = dev_take(b, &m, (size_t)(L * slots * H) * epx_dtype_size(recv_dtype));
    float *recv_scales = dev_take(b, &m, (size_t)(L * G * slots) * sizeof(float));
    int32_t *recv_count = dev_take(b, &m, (size_t)L * sizeof(int32_t));
    uint16_t *y = dev_take(b, &m, (size_t)(L * slots * H) * 2);
    uint16_t *combined = dev_take(b, &m, (size_t)(T * H) * 2);
    uint16_t *hrow = host_take(&m, (size_t)H * 2);
    double *samples = host_take(&m, sizeof(double) * LL_KINDS * (size_t)(warm + n));
    /* Bytes per rank, as the peer counts them: each token once per selected expert, each way. */
    const double pairs = (double)rt->sent_expert_rows;
    l.bytes[0] = pairs * (double)row_bytes(recv_dtype, H);
    l.bytes[1] = pairs * (double)H * 2;
    const size_t copy_bytes = (size_t)(l.bytes[0] > l.bytes[1] ? l.bytes[0] : l.bytes[1]);
    const int bounds = has_row(b, K_LL_DISPATCH_BOUND) || has_row(b, K_LL_COMBINE_BOUND);
    l.copy_src = dev_take(b, &m, bounds && copy_bytes ? copy_bytes : 1);
    l.copy_dst = dev_take(b, &m, bounds && copy_bytes ? copy_bytes : 1);
    if (rc || m.failed) {
        rc = -1;
        goto out;
    }
    /* Combine input: only the valid rows of each local expert, in the dispatch's packed layout. */
    for (int j = 0; j < L; j++)
        for (int64_t i = rt->exp_off[j]; i < rt->exp_off[j + 1]; i++) {
            for (int64_t c = 0; c < H; c++)
                hrow[c] = epx_f32_to_bf16(value_of(rt->exp_src[i], rt->exp_tok[i], c, me * L + j));
            if (mem_put(b, y + ((int64_t)j * slots + i - rt->exp_off[j]) * H, hrow, (size_t)H * 2)) {
                rc = -1;
                goto out;
            }
        }

    l.a = (epx_ll_dispatch_args_t)EPX_LL_DISPATCH_ARGS_INIT;
    l.a.x = tensor(b, in.x, EPX_DTYPE_BF16, 2, T, H, 0);
    l.a.topk_idx = tensor(b, in.topk, EPX_DTYPE_INT32, 2, T, K, 0);
    l.a.use_fp8 = l.o.fp8;
    l.a.stream = b->stream;
    l.out = (epx_ll_dispatch_outputs_t)EPX_LL_DISPATCH_OUTPUTS_INIT;
    l.out.recv_x = tensor(b, recv_x, recv_dtype, 3, L, slots, H);
    if (l.o.fp8) l.out.recv_scales = tensor(b, recv_scales, EPX_DTYPE_FP32, 3, L, G, slots);
    l.out.recv_count = tensor(b, recv_count, EPX_DTYPE_INT32, 1, L, 0, 0);
    l.ca = (epx_ll_combine_args_t)EPX_LL_COMBINE_ARGS_INIT;
    l.ca.y = tensor(b, y, EPX_DTYPE_BF16, 3, L, slots, H);
    l.ca.topk_idx = l.a.topk_idx;
    l.ca.topk_weights = tensor(b, in.w, EPX_DTYPE_FP32, 2, T, K, 0);
    l.ca.stream = b->stream;
    l.co = (epx_ll_combine_outputs_t)EPX_LL_COMBINE_OUTPUTS_INIT;
    l.co.combined_x = tensor(b, combined, EPX_DTYPE_BF16, 2, T, H, 0);

    /* [0] dispatch and [1] combine whole, [2] and [3] through their hooks */
    bench_check_t ck[4] = {{"ll-dispatch", me, 0},
                           {"ll-combine", me, 0},
                           {"ll-dispatch (hook)", me, 0},
                           {"ll-combine (hook)", me, 0}};
    const bench_loop_t loop = {ll_call, NULL, &l};
    rc = 0;
    for (int it = 0; it < warm + n && rc == 0; it++)
        for (int i = 0; i < LL_KINDS && rc == 0; i++) {
            if (!has_row(b, ll_order[i])) continue;
            rc = time_once(b, &loop, ll_order[i], &samples[i * (warm + n) + it]);
            if (rc == 0 && it == warm + n - 1 &&
                (ll_order[i] == K_LL_COMBINE || ll_order[i] == K_LL_COMBINE_RECV))
                rc = ll_check(&l, &ck[ll_order[i] == K_LL_COMBINE ? 0 : 2],
                              &ck[ll_order[i] == K_LL_COMBINE ? 1 : 3]);
        }
    if (rc == 0) rc = bench_call(b, "epx_get_async_error", epx_get_async_error(b->comm));
    if (rc == 0) ll_report(&l, samples, ck);
    if (rc == 0 && opt->timeline && opt->ceilings) rc = ll_timeline(&l);
out:
    mem_release_all(b, &m);
    return rc;
}
