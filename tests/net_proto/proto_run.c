/*
 * Setup and teardown of one prototype run (README.md): the host model, each rank's registered regions
 * and outputs (filled with garbage first, so a row nobody wrote cannot pass), one thread per rank. The
 * run's frame (proto_run_open, proto_run_threads, proto_run_close) serves the LL protocol too; the node
 * tables and a source's layout arrays serve the routing-map protocol too.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto_impl.h"
#include "reference.h"

int proto_same_bits(int quiet, int rank, const char *what, const void *got, const void *expected, int64_t n,
                    size_t elem, int64_t row)
{
    if (!quiet) return ref_check_bits(rank, what, got, expected, n, elem, row);
    return memcmp(got, expected, (size_t)n * elem) != 0;
}

static size_t align8(size_t n)
{
    return (n + 7) & ~(size_t)7;
}

void *proto_garbage(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (p) memset(p, 0xa5, bytes);
    return p;
}

/* ---- the frame of every run ------------------------------------------------------------------------ */

int proto_run_init(run_t *run, const proto_frame_t *f, char *err, size_t err_len)
{
    run->frame = f;
    run->N = f->nodes;
    run->P = f->per_node;
    run->R = f->nodes * f->per_node;
    run->E = f->E;
    run->K = f->K;
    run->H = f->H;
    run->T_max = f->T_max;
    run->timeout_ms = f->timeout_ms;
    run->err = err;
    run->err_len = err_len;
    err[0] = '\0';
    if (run->N < 1 || run->P < 1 || run->R > 16 || run->E < 1 || run->E % run->R || run->E > 2048 ||
        run->K < 1 || run->K > 64 || run->H < 1 || run->T_max < 1 || run->T_max > 0x7fffffff / run->R) {
        snprintf(err, err_len, "bad config: %d x %d ranks, E %d, K %d, H %lld, T_max %lld", run->N, run->P,
                 run->E, run->K, (long long)run->H, (long long)run->T_max);
        return 1;
    }
    run->L = run->E / run->R;
    return 0;
}

int proto_run_open(run_t *run, uint32_t ncontexts, uint32_t nsignals)
{
    run->err[0] = '\0';
    run->nodes = calloc((size_t)run->N, sizeof(node_shared_t));
    run->ranks = calloc((size_t)run->R, sizeof(rank_t));
    if (!run->nodes || !run->ranks || pthread_mutex_init(&run->err_lock, NULL)) {
        snprintf(run->err, run->err_len, "setup: out of memory");
        free(run->nodes);
        free(run->ranks);
        run->nodes = NULL;
        run->ranks = NULL;
        return 1;
    }
    run->mutex_ready = 1;
    for (int n = 0; n < run->N; n++) {
        atomic_init(&run->nodes[n].barrier, 0);
        atomic_init(&run->nodes[n].doorbell, 0);
    }
    const epx_net_model_config_t mc = {.nranks = run->R,
                                       .ncontexts = ncontexts,
                                       .nsignals = nsignals,
                                       .mode = run->frame->mode,
                                       .seed = run->frame->model_seed,
                                       .progress_in_wait = 1,
                                       .abort_word = &run->abort_word};
    if (epx_net_model_create(&mc, &run->model) != EPX_NET_OK) {
        snprintf(run->err, run->err_len, "model: %s", epx_net_model_message());
        return 1;
    }
    for (int r = 0; r < run->R; r++) {
        rank_t *rk = &run->ranks[r];
        *rk = (rank_t){.run = run, .r = r, .m = r / run->P, .l = r % run->P};
        rk->send = proto_garbage(run->region_bytes);
        rk->recv = proto_garbage(run->region_bytes);
        uint32_t region;
        if (!rk->send || !rk->recv ||
            epx_net_model_register(run->model, r, rk->send, run->region_bytes, &region) != EPX_NET_OK ||
            region != REGION_SEND ||
            epx_net_model_register(run->model, r, rk->recv, run->region_bytes, &region) != EPX_NET_OK ||
            region != REGION_RECV || epx_net_model_handle(run->model, r, &rk->net) != EPX_NET_OK) {
            snprintf(run->err, run->err_len, "setup: rank %d's regions (%zu bytes each)", r,
                     run->region_bytes);
            return 1;
        }
    }
    return 0;
}

int proto_run_threads(run_t *run, void *(*rank_main)(void *), proto_stats_t *stats)
{
    int started = 0;
    run->err[0] = '\0';
    for (; started < run->R; started++) {
        if (pthread_create(&run->ranks[started].thread, NULL, rank_main, &run->ranks[started])) {
            pthread_mutex_lock(&run->err_lock);
            if (!run->failed) snprintf(run->err, run->err_len, "rank %d: cannot start its thread", started);
            run->failed = 1;
            pthread_mutex_unlock(&run->err_lock);
            __atomic_store_n(&run->abort_word, 1, __ATOMIC_RELEASE);
            break;
        }
    }
    for (int r = 0; r < started; r++) pthread_join(run->ranks[r].thread, NULL);
    int rc = run->failed;
    /* A finished run leaves nothing in flight: every put carried a signal someone waited for. */
    const size_t pending = epx_net_model_pending(run->model);
    if (!rc && pending) {
        snprintf(run->err, run->err_len, "%zu operations still in flight after the run", pending);
        rc = 1;
    }
    memset(stats, 0, sizeof(*stats));
    for (int r = 0; r < run->R; r++) {
        const proto_stats_t *s = &run->ranks[r].stats;
        stats->net_bytes += s->net_bytes;
        stats->nvlink_bytes += s->nvlink_bytes;
        stats->self_bytes += s->self_bytes;
        stats->flat_net_bytes += s->flat_net_bytes;
        stats->dispatch_net_bytes += s->dispatch_net_bytes;
    }
    return rc;
}

int proto_run_tables(run_t *run)
{
    for (int n = 0; n < run->N; n++) {
        run->nodes[n].per_rank = calloc((size_t)run->R * (size_t)run->P, sizeof(int32_t));
        run->nodes[n].per_expert = calloc((size_t)run->R * (size_t)run->P * (size_t)run->L, sizeof(int32_t));
        if (!run->nodes[n].per_rank || !run->nodes[n].per_expert) return 1;
    }
    return 0;
}

int proto_layout_alloc(rank_t *rk, int64_t T)
{
    const run_t *run = rk->run;
    rk->node_mask = calloc((size_t)T * (size_t)run->N + 1, sizeof(uint32_t));
    rk->rank_index = calloc((size_t)T * (size_t)run->R + 1, sizeof(int32_t));
    rk->to_rank = calloc((size_t)run->R, sizeof(int32_t));
    rk->to_node = calloc((size_t)run->N, sizeof(int32_t));
    rk->per_expert = calloc((size_t)run->E, sizeof(int32_t));
    rk->remote_packets = calloc((size_t)run->N, sizeof(int32_t));
    return !rk->node_mask || !rk->rank_index || !rk->to_rank || !rk->to_node || !rk->per_expert ||
           !rk->remote_packets;
}

void proto_layout_free(rank_t *rk)
{
    free(rk->node_mask);
    free(rk->rank_index);
    free(rk->to_rank);
    free(rk->to_node);
    free(rk->per_expert);
    free(rk->remote_packets);
}

void proto_run_close(run_t *run)
{
    epx_net_model_destroy(run->model);
    run->model = NULL;
    for (int r = 0; run->ranks && r < run->R; r++) {
        free(run->ranks[r].send);
        free(run->ranks[r].recv);
    }
    for (int n = 0; run->nodes && n < run->N; n++) {
        free(run->nodes[n].per_rank);
        free(run->nodes[n].per_expert);
    }
    if (run->mutex_ready) pthread_mutex_destroy(&run->err_lock);
    free(run->ranks);
    free(run->nodes);
    run->ranks = NULL;
    run->nodes = NULL;
}

/* ---- the HT protocol's run ------------------------------------------------------------------------- */

void proto_output_free(proto_output_t *out, int R)
{
    for (int r = 0; r < R; r++) {
        free(out[r].x);
        free(out[r].src);
        free(out[r].tok);
        free(out[r].idx);
        free(out[r].w);
        free(out[r].per_expert);
        free(out[r].combined);
        free(out[r].combined_w);
    }
    memset(out, 0, sizeof(*out) * (size_t)R);
}

static int setup_rank(run_t *run, rank_t *rk, const proto_input_t *in, proto_output_t *out)
{
    const size_t rows = (size_t)run->R * (size_t)run->T_max, T = (size_t)in->T;
    const size_t H = (size_t)run->H, K = (size_t)run->K;
    rk->in = in;
    rk->out = out;
    rk->error = out->error;
    rk->error_len = sizeof(out->error);
    rk->y = proto_garbage(rows * H * 2);
    rk->own_part = calloc(T * H + 1, sizeof(float));
    rk->own_part_w = calloc(T * K + 1, sizeof(float));
    out->x = proto_garbage(rows * H * 2);
    out->src = proto_garbage(rows * 4);
    out->tok = proto_garbage(rows * 8);
    out->idx = proto_garbage(rows * K * 8);
    out->w = run->cfg->with_weights ? proto_garbage(rows * K * 4) : NULL;
    out->per_expert = proto_garbage((size_t)run->L * 4);
    out->combined = proto_garbage(T * H * 2);
    out->combined_w = run->cfg->with_weights ? proto_garbage(T * K * 4) : NULL;
    return proto_layout_alloc(rk, in->T) || !rk->y || !rk->own_part || !rk->own_part_w || !out->x ||
           !out->src || !out->tok || !out->idx || (run->cfg->with_weights && (!out->w || !out->combined_w)) ||
           !out->per_expert || !out->combined;
}

static void free_rank(rank_t *rk)
{
    free(rk->y);
    proto_layout_free(rk);
    free(rk->own_part);
    free(rk->own_part_w);
}

int proto_run(const proto_config_t *cfg, const proto_input_t *in, proto_make_y_fn make_y, void *y_ctx,
              proto_output_t *out, proto_stats_t *stats, char *err, size_t err_len)
{
    run_t run = {.cfg = cfg, .make_y = make_y, .y_ctx = y_ctx};
    const int R = cfg->frame.nodes * cfg->frame.per_node;
    memset(out, 0, sizeof(*out) * (size_t)(R > 0 && R <= 16 ? R : 0));
    if (proto_run_init(&run, &cfg->frame, err, err_len)) return 1;
    if (cfg->alignment < 1) {
        snprintf(err, err_len, "bad config: alignment %d", cfg->alignment);
        return 1;
    }
    run.cmsg = align8(4 * (1 + (size_t)run.P + (size_t)(run.P * run.L)));
    run.hdr = align8(4 * (2 + (size_t)run.P + (size_t)run.K * (cfg->with_weights ? 2 : 1)));
    run.dpkt = align8(run.hdr + 2 * (size_t)run.H);
    run.cpkt = align8(2 * (size_t)run.H + (cfg->with_weights ? 4 * (size_t)run.K : 0));
    run.off_dispatch = run.cmsg * (size_t)run.N;
    run.off_combine = run.off_dispatch + run.dpkt * (size_t)run.N * (size_t)run.T_max;
    run.region_bytes = run.off_combine + run.cpkt * (size_t)run.N * (size_t)run.T_max;
    int rc = proto_run_open(&run, 2, 2 + 2 * (uint32_t)run.N);
    if (!rc) rc = proto_run_tables(&run);
    for (int r = 0; !rc && r < run.R; r++) rc = setup_rank(&run, &run.ranks[r], &in[r], &out[r]);
    if (rc && !err[0]) snprintf(err, err_len, "setup failed");
    if (!rc) rc = proto_run_threads(&run, proto_rank_main, stats);
    for (int r = 0; run.ranks && r < run.R; r++) free_rank(&run.ranks[r]);
    proto_run_close(&run);
    return rc;
}
