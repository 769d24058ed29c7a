/*
 * epx-bench ranks: the body each forked rank runs (communicator, then one buffer per operation
 * group and every size on it), the timing of one row, and the rows a rank reports to the parent.
 */
#include <stdio.h>
#include <stdlib.h>

#include "core/internal.h"
#include "epx_harness.h"
#include "tool.h"

#ifdef EPX_BENCH_HOOKS
#include "bench/bench.h"
#endif

int bench_call(bench_rank_t *b, const char *what, epx_result_t res)
{
    if (res == EPX_SUCCESS) return 0;
    if (res == EPX_ERR_UNSUPPORTED) {
        b->unsupported = 1;
        return 1;
    }
    fprintf(stderr, "rank %d: %s failed: %s (%s)\n", b->rank, what, epx_result_name(res),
            epx_last_error_message());
    return -1;
}

int op_ht_ceiling(const bench_op_t *o, epx_handle_t handle, const epx_tensor_t *x)
{
#ifdef EPX_BENCH_HOOKS
    return bench_call(o->b, "epx_cuda_ht_ceiling", epx_cuda_ht_ceiling(o->buf, handle, x, o->b->stream));
#else
    (void)o, (void)handle, (void)x;
    return -1;
#endif
}

int op_ll_floor(const bench_op_t *o, int combine, const epx_ll_dispatch_args_t *args,
                const epx_ll_handle_t *handle)
{
#ifdef EPX_BENCH_HOOKS
    return bench_call(o->b, "epx_cuda_ll_floor",
                      epx_cuda_ll_floor(o->buf, combine, args, handle, o->b->stream));
#else
    (void)o, (void)combine, (void)args, (void)handle;
    return -1;
#endif
}

int op_ll_stamps_arm(const bench_op_t *o)
{
#ifdef EPX_BENCH_HOOKS
    return bench_call(o->b, "epx_cuda_ll_stamps_arm", epx_cuda_ll_stamps_arm(o->buf, o->b->stream));
#else
    (void)o;
    return -1;
#endif
}

int op_ll_stamps_read(const bench_op_t *o, unsigned long long out[8])
{
#ifdef EPX_BENCH_HOOKS
    return bench_call(o->b, "epx_cuda_ll_stamps_read", epx_cuda_ll_stamps_read(o->buf, out));
#else
    (void)o, (void)out;
    return -1;
#endif
}

int time_once(bench_rank_t *b, const bench_loop_t *loop, int kind, double *us)
{
    if (timed_begin(b)) return -1;
    int rc = loop->call(loop->ctx, kind);
    if (rc == 0 && timed_end(b, us)) rc = -1;
    return rc;
}

int time_row(bench_rank_t *b, const bench_loop_t *loop, int kind, double *median_us)
{
    const int warm = b->opt->warmup, n = b->opt->iters;
    double *samples = malloc(sizeof(double) * (size_t)(warm + n));
    if (!samples) return -1;
    int rc = 0;
    for (int it = 0; it < warm + n && rc == 0; it++) {
        if (loop->before && (rc = loop->before(loop->ctx, kind)) != 0) break;
        rc = time_once(b, loop, kind, &samples[it]);
    }
    if (rc == 0) rc = bench_call(b, "epx_get_async_error", epx_get_async_error(b->comm));
    if (rc == 0) *median_us = median(samples + warm, n);
    free(samples);
    return rc;
}

static bench_cell_t *cell_of(const bench_rank_t *b, int kind)
{
    for (int i = b->row0; i < b->row0 + b->nrow; i++)
        if (b->opt->rows[i].kind == kind) return &b->res->cells[i];
    return NULL;
}

int has_row(const bench_rank_t *b, int kind)
{
    return cell_of(b, kind) != NULL;
}

/* The share of `bytes` on the network and over NVLink (-1: one node, or a permute row). */
static void legs_of(const bench_rank_t *b, int kind, double bytes, double *net, double *nvl)
{
    const bench_routing_t *rt = b->rt;
    *net = *nvl = -1;
    if (!rt || b->ranks_per_node <= 0 || b->ranks_per_node >= b->nranks || kind >= K_RM_DISPATCH) return;
    const int ll = kind >= K_LL_DISPATCH;
    const double sent = (double)(ll ? rt->sent_expert_rows : rt->sent_rank_rows);
    *net = sent > 0 ? bytes * (double)(ll ? rt->net_expert_rows : rt->net_rank_rows) / sent : 0;
    *nvl = sent > 0 ? bytes * (double)(ll ? rt->nvl_expert_rows : rt->nvl_rank_rows) / sent : 0;
}

void report(bench_rank_t *b, int kind, int status, double median_us, double bytes)
{
    bench_cell_t *cell = cell_of(b, kind);
    if (!cell) return;
    cell->median_us = median_us;
    cell->bytes = bytes;
    legs_of(b, kind, bytes, &cell->net_bytes, &cell->nvl_bytes);
    atomic_store(&cell->status, status);
}

int run_end(bench_rank_t *b, int rc)
{
    if (rc < 0) return -1;
    for (int i = b->row0; i < b->row0 + b->nrow; i++) {
        bench_cell_t *cell = &b->res->cells[i];
        if (atomic_load(&cell->status) == ROW_PENDING)
            atomic_store(&cell->status, b->unsupported ? ROW_UNSUPPORTED : ROW_ERROR);
    }
    return 0;
}

bench_op_t op_start(bench_rank_t *b, epx_buffer_t buf, const bench_routing_t *rt)
{
    const epx_dtype_t dtype = b->opt->dtype;
    return (bench_op_t){b,
                        buf,
                        rt,
                        rt->T,
                        b->opt->hidden,
                        b->opt->hidden / 128,
                        dtype,
                        epx_dtype_size(dtype),
                        dtype == EPX_DTYPE_FP8_E4M3};
}

/* The rows of (group slot, size): contiguous in the plan. */
static void select_rows(bench_rank_t *b, int group, int size)
{
    b->row0 = b->nrow = 0;
    b->unsupported = 0;
    for (int i = 0; i < b->opt->nrows; i++)
        if (b->opt->rows[i].group == group && b->opt->rows[i].size == size) {
            if (!b->nrow) b->row0 = i;
            b->nrow++;
        }
}

/* One buffer per group, made for the largest size; the buffer settings are those the figures
 * in docs/benchmarks.md were measured with (dtypes, modes, pad, SMs). */
static int run_group(bench_rank_t *b, int group)
{
    const bench_opts_t *opt = b->opt;
    int64_t T_max = 0;
    for (int i = 0; i < opt->nsizes; i++)
        if (opt->sizes[group][i] > T_max) T_max = opt->sizes[group][i];
    const int experts = experts_of(opt, group);
    epx_buffer_config_t cfg = EPX_BUFFER_CONFIG_INIT;
    cfg.max_tokens = T_max;
    cfg.hidden = opt->hidden;
    cfg.num_topk = opt->topk;
    cfg.num_experts = experts;
    cfg.num_sms = opt->sms;
    cfg.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_BF16) | EPX_DTYPE_BIT(opt->dtype);
    if (group == GROUP_HT) {
        cfg.modes = EPX_MODE_HT;
        if (opt->hidden % 128 == 0) cfg.dispatch_dtypes |= EPX_DTYPE_BIT(EPX_DTYPE_FP8_E4M3);
    } else if (group == GROUP_LL) {
        cfg.modes = EPX_MODE_LL;
        cfg.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_BF16); /* LL casts bf16 input itself */
    } else {
        cfg.modes = EPX_MODE_HT | EPX_MODE_PERMUTE; /* HT for the same-bytes ceiling */
        cfg.max_pad_multiple = opt->pad;
    }
    epx_buffer_t buf = NULL;
    int rc = bench_call(b, "epx_buffer_create", epx_buffer_create(b->comm, &cfg, &buf));
    for (int i = 0; i < opt->nsizes && rc >= 0; i++) {
        select_rows(b, group, i);
        bench_routing_t rt;
        if (rc == 1) {
            b->unsupported = 1;
        } else if (routing_build(&rt, opt, b->rank, opt->sizes[group][i], experts) == 0) {
            routing_legs(&rt, b->ranks_per_node);
            b->rt = &rt;
            rc = group == GROUP_HT   ? run_ht(b, buf, &rt)
                 : group == GROUP_LL ? run_ll(b, buf, &rt, T_max)
                                     : run_rm(b, buf, &rt);
            b->rt = NULL;
            routing_free(&rt);
        } else {
            rc = -1;
        }
        if (run_end(b, rc) < 0) rc = -1;
    }
    /* Peers may still copy into this buffer (the ceilings do, unsynchronised) until all are here. */
    if (rc >= 0 && buf && bench_call(b, "epx_comm_barrier", epx_comm_barrier(b->comm))) rc = -1;
    epx_buffer_destroy(buf);
    return rc < 0 ? -1 : 0;
}

int rank_main(int rank, int nranks, const epx_unique_id_t *id, void *ctx, void *result)
{
    const bench_opts_t *opt = ctx;
    bench_rank_t b = {.opt = opt, .res = result, .rank = rank, .nranks = nranks, .gpu = opt->gpu};
    b.device = opt->gpu ? epx_harness_rank_device(rank, opt->ngpus) : -1;
    if (device_open(&b)) {
        device_close(&b);
        return 1;
    }
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    cfg.backend = b.gpu ? EPX_BACKEND_CUDA : EPX_BACKEND_HOST;
    /* --nodes: each rank's node id through the config (EPX_NODE_ID, when set, still wins). */
    char node_id[32];
    snprintf(node_id, sizeof(node_id), "bench-node%d", opt->nodes > 0 ? rank / (nranks / opt->nodes) : 0);
    if (opt->nodes > 0) cfg.node_id = node_id;
    cfg.cuda_device = b.device;
    int rc = bench_call(&b, "epx_comm_init", epx_comm_init(id, rank, nranks, &cfg, &b.comm)) ? 1 : 0;
    epx_topology_t topo;
    if (rc == 0 && epx_comm_get_topology(b.comm, &topo) == EPX_SUCCESS) {
        b.res->ranks_per_domain = topo.ranks_per_nvlink_domain;
        b.res->num_domains = topo.num_nvlink_domains;
    }
    /* The topology the library detected (node ids, never the launcher), before any row. */
    epx_node_topology_t nodes = EPX_NODE_TOPOLOGY_INIT;
    if (rc == 0 && epx_comm_get_node_topology(b.comm, &nodes) == EPX_SUCCESS) {
        b.ranks_per_node = nodes.ranks_per_node;
        b.res->num_nodes = nodes.num_nodes;
    }
    if (rc == 0 && rank == 0 && nodes.num_nodes > 0) {
        printf("# topology: %d node(s) x %d ranks per node, %d ranks per NVLink domain (%d domain(s)); "
               "rank 0 on node '%s'\n",
               nodes.num_nodes, nodes.ranks_per_node, nodes.ranks_per_nvlink_domain, nodes.num_nvlink_domains,
               nodes.node_id);
        if (nodes.num_nodes > 1)
            printf("# net_B, nvl_B: the bytes column by leg, per rank (ht, view: a row crosses the network once\n"
                   "#   per destination node, to the rank of the same local index, which forwards it over NVLink\n"
                   "#   to the node's other destinations; ll: straight to each expert's owner). The host backend\n"
                   "#   carries both legs through shared memory: these times are functional, not a network's\n");
        fflush(stdout);
    }
    for (int g = 0; g < opt->ngroups && rc == 0; g++) rc = run_group(&b, opt->groups[g]) ? 1 : 0;
    epx_comm_destroy(b.comm);
    device_close(&b);
    return rc;
}
