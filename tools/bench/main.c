/*
 * epx-bench: times HT (and its view mode), LL and routing-map (permute) dispatch/combine over R
 * forked local ranks (host backend, or the GPU when the cuda backend and a device are there),
 * checks every output against values recomputed from the inputs, and prints each row next to
 * its same-run ceiling on the GPU. This file: options, the plan of rows, the table.
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"
#include "epx_harness.h"
#include "tool.h"

const bench_kind_info_t bench_kinds[K_COUNT] = {
    [K_HT_DISPATCH] = {"ht-dispatch", K_HT_CEILING, 0},
    [K_HT_CACHED] = {"ht-cached", K_HT_CEILING, 0},
    [K_HT_COMBINE] = {"ht-combine", K_HT_CEILING, 1},
    [K_HT_CEILING] = {"ht-ceiling", -2, 0},
    [K_VIEW_DISPATCH] = {"view-dispatch", K_HT_CEILING, 0},
    [K_VIEW_CACHED] = {"view-cached", K_HT_CEILING, 0},
    [K_VIEW_COMBINE] = {"view-combine", K_HT_CEILING, 1},
    [K_LL_DISPATCH] = {"ll-dispatch", K_LL_DISPATCH_BOUND, 0},
    [K_LL_DISPATCH_SEND] = {"ll-dispatch-send", K_LL_DISPATCH_BOUND, 0},
    [K_LL_DISPATCH_RECV] = {"ll-dispatch-recv", K_LL_DISPATCH_BOUND, 0},
    [K_LL_DISPATCH_FLOOR] = {"ll-dispatch-floor", -2, 0},
    [K_LL_COMBINE] = {"ll-combine", K_LL_COMBINE_BOUND, 1},
    [K_LL_COMBINE_SEND] = {"ll-combine-send", K_LL_COMBINE_BOUND, 1},
    [K_LL_COMBINE_RECV] = {"ll-combine-recv", K_LL_COMBINE_BOUND, 1},
    [K_LL_COMBINE_FLOOR] = {"ll-combine-floor", -2, 1},
    [K_LL_DISPATCH_BOUND] = {"ll-dispatch-bound", -3, 0},
    [K_LL_COMBINE_BOUND] = {"ll-combine-bound", -3, 1},
    [K_RM_DISPATCH] = {"permute-dispatch", K_RM_CEIL_COPY, 0},
    [K_RM_COMBINE] = {"permute-combine", K_RM_CEIL_COPY, 1},
    [K_RM_CEIL_HT] = {"permute-ceil-ht", -2, 0},
    [K_RM_CEIL_COPY] = {"permute-ceil-copy", -2, 0},
};

/* ------------------------------------------------------------------------- options ---- */

static void usage(FILE *f)
{
    fprintf(f, "usage: epx-bench [options]\n"
               "  -t N        tokens per rank (default 256 for ht, view and permute, 128 for ll)\n"
               "  -b N -e N -f F  sweep tokens per rank from -b to -e, multiplying by F (default 2)\n"
               "  -H N        hidden size (default 7168)\n"
               "  -k N        top-k (default 8)\n"
               "  -E N        experts (default 256; a multiple of the rank count)\n"
               "  -L N        local experts per rank for the permute rows (default: experts / ranks)\n"
               "  -p N        permute: pad each expert's rows to a multiple of N (default 16)\n"
               "  -S N        SMs a GPU kernel may take per rank (default 0: the library's choice)\n"
               "  -n N        timed iterations (default 10)\n"
               "  -w N        warm-up iterations (default 2)\n"
               "  -r N        ranks (default EPX_BENCH_RANKS, else the GPU count, else 4)\n"
               "  --nodes N   split the ranks into N emulated nodes of consecutive ranks (the comm config's\n"
               "              node id; EPX_NODE_ID, when set, wins; default: the host's identity); rows\n"
               "              then show the bytes per leg (network, NVLink)\n"
               "  --timeline  ll on the GPU: after the rows, 3 samples of every rank's LL kernels on the GPU's\n"
               "              clock (start and end of each half, and of the dispatch floor alone)\n"
               "  -o LIST     operations: ht,view,ll,permute (default all)\n"
               "  -d DTYPE    dispatch dtype: bf16 or fp8 (default bf16)\n"
               "  -B BACKEND  auto, host or cuda (default auto: cuda when built with it and a GPU is there)\n"
               "  -s SEED     routing seed (default 1)\n"
               "  --env       print the environment variables of the library and exit\n"
               "  -h          this help\n");
}

static int parse_int(const char *text, const char *flag, int64_t min, int64_t max, int64_t *out)
{
    char *end = NULL;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (errno || end == text || *end || v < min || v > max) {
        fprintf(stderr, "epx-bench: %s '%s' is not an integer in [%lld, %lld]\n", flag, text, (long long)min,
                (long long)max);
        return -1;
    }
    *out = v;
    return 0;
}

static int parse_int32(const char *text, const char *flag, int64_t min, int64_t max, int *out)
{
    int64_t v = 0;
    if (parse_int(text, flag, min, max, &v)) return -1;
    *out = (int)v;
    return 0;
}

static int parse_ops(const char *list, bench_opts_t *opt)
{
    static const char *const names[4] = {"ht", "view", "ll", "permute"};
    static const int groups[4] = {GROUP_HT, GROUP_HT, GROUP_LL, GROUP_PERMUTE};
    char copy[128], *save = NULL;
    snprintf(copy, sizeof(copy), "%s", list);
    opt->ngroups = opt->ht_rows = opt->view_rows = 0;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int op = -1, seen = 0;
        for (int i = 0; i < 4; i++)
            if (strcmp(tok, names[i]) == 0) op = i;
        if (op < 0) {
            fprintf(stderr, "epx-bench: -o: unknown operation '%s' (ht, view, ll, permute)\n", tok);
            return -1;
        }
        if (op == 0) opt->ht_rows = 1;
        if (op == 1) opt->view_rows = 1;
        for (int i = 0; i < opt->ngroups; i++) seen |= opt->groups[i] == groups[op];
        if (!seen) opt->groups[opt->ngroups++] = groups[op];
    }
    if (opt->ngroups == 0) fprintf(stderr, "epx-bench: -o names no operation\n");
    return opt->ngroups ? 0 : -1;
}

static int parse_args(int argc, char **argv, bench_opts_t *opt, int *print_env)
{
    static const struct option longs[] = {
        {"env", no_argument, NULL, 'V'}, {"help", no_argument, NULL, 'h'}, {"nodes", required_argument, NULL, 'N'},
        {"timeline", no_argument, NULL, 'M'},
        {NULL, 0, NULL, 0}};
    int64_t v = 0, begin = 0, end = 0;
    *opt = (bench_opts_t){.tok_factor = 2,
                          .hidden = 7168,
                          .topk = 8,
                          .experts = 256,
                          .pad = 16,
                          .iters = 10,
                          .warmup = 2,
                          .dtype = EPX_DTYPE_BF16,
                          .backend = EPX_BACKEND_AUTO,
                          .seed = 1};
    parse_ops("ht,view,ll,permute", opt);
    int c, rc = 0, ranks_given = 0;
    while (rc == 0 &&
           (c = getopt_long(argc, argv, "t:b:e:f:H:k:E:L:p:S:n:w:r:o:d:B:s:h", longs, NULL)) != -1) {
        char flag[3] = {'-', (char)c, 0};
        switch (c) {
        case 't':
        case 'b':
            rc = parse_int(optarg, flag, 1, INT32_MAX, &begin);
            if (c == 't') end = begin;
            opt->tokens_given = 1;
            break;
        case 'e':
            rc = parse_int(optarg, flag, 1, INT32_MAX, &end);
            opt->tokens_given = 1;
            break;
        case 'f': rc = parse_int(optarg, flag, 1, 1 << 20, &opt->tok_factor); break;
        case 'H': rc = parse_int(optarg, flag, 1, 1 << 24, &opt->hidden); break;
        case 'k': rc = parse_int32(optarg, flag, 1, 64, &opt->topk); break;
        case 'E': rc = parse_int32(optarg, flag, 1, 1 << 20, &opt->experts); break;
        case 'L': rc = parse_int32(optarg, flag, 1, 1 << 16, &opt->local_experts); break;
        case 'p': rc = parse_int32(optarg, flag, 1, 1 << 16, &opt->pad); break;
        case 'S': rc = parse_int32(optarg, flag, 0, 1 << 16, &opt->sms); break;
        case 'n': rc = parse_int32(optarg, flag, 1, 1000000, &opt->iters); break;
        case 'w': rc = parse_int32(optarg, flag, 0, 1000000, &opt->warmup); break;
        case 'r':
            rc = parse_int32(optarg, flag, 1, BENCH_MAX_RANKS, &opt->nranks);
            ranks_given = 1;
            break;
        case 'N': rc = parse_int32(optarg, "--nodes", 1, BENCH_MAX_RANKS, &opt->nodes); break;
        case 'M': opt->timeline = 1; break;
        case 's':
            rc = parse_int(optarg, flag, 0, INT64_MAX, &v);
            opt->seed = (uint64_t)v;
            break;
        case 'o': rc = parse_ops(optarg, opt); break;
        case 'd':
            if (strcmp(optarg, "bf16") == 0)
                opt->dtype = EPX_DTYPE_BF16;
            else if (strcmp(optarg, "fp8") == 0 || strcmp(optarg, "fp8_e4m3") == 0)
                opt->dtype = EPX_DTYPE_FP8_E4M3;
            else {
                fprintf(stderr, "epx-bench: -d '%s' is not bf16 or fp8\n", optarg);
                rc = -1;
            }
            break;
        case 'B':
            if (strcmp(optarg, "auto") == 0)
                opt->backend = EPX_BACKEND_AUTO;
            else if (strcmp(optarg, "host") == 0)
                opt->backend = EPX_BACKEND_HOST;
            else if (strcmp(optarg, "cuda") == 0)
                opt->backend = EPX_BACKEND_CUDA;
            else {
                fprintf(stderr, "epx-bench: -B '%s' is not auto, host or cuda\n", optarg);
                rc = -1;
            }
            break;
        case 'V': *print_env = 1; break;
        case 'h': usage(stdout); exit(0);
        default: usage(stderr); return -1;
        }
    }
    if (rc) return -1;
    /* EPX_BENCH_RANKS only where -r is not given (a malformed one is then an error). */
    const char *env_ranks = getenv("EPX_BENCH_RANKS");
    if (!ranks_given && env_ranks && *env_ranks &&
        parse_int32(env_ranks, "EPX_BENCH_RANKS", 1, BENCH_MAX_RANKS, &opt->nranks))
        return -1;
    if (optind < argc) {
        fprintf(stderr, "epx-bench: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (opt->tokens_given) {
        if (!begin) begin = end;
        if (!end) end = begin;
        if (end < begin) {
            fprintf(stderr, "epx-bench: -e %lld is below -b %lld\n", (long long)end, (long long)begin);
            return -1;
        }
        for (int64_t t = begin; t <= end && opt->nsizes < BENCH_MAX_SIZES; t *= opt->tok_factor) {
            for (int g = 0; g < GROUP_COUNT; g++) opt->sizes[g][opt->nsizes] = t;
            opt->nsizes++;
            if (opt->tok_factor == 1) break;
        }
    } else {
        opt->sizes[GROUP_HT][0] = opt->sizes[GROUP_PERMUTE][0] = 256;
        opt->sizes[GROUP_LL][0] = 128;
        opt->nsizes = 1;
    }
    return 0;
}

static int check_opts(const bench_opts_t *opt)
{
    if (opt->nodes > 0 && opt->nranks % opt->nodes != 0) {
        fprintf(stderr, "epx-bench: --nodes %d does not divide the %d ranks (nodes hold as many ranks each)\n",
                opt->nodes, opt->nranks);
        return -1;
    }
    for (int i = 0; i < opt->ngroups; i++) {
        const int g = opt->groups[i], experts = experts_of(opt, g);
        if (opt->topk > experts) {
            fprintf(stderr, "epx-bench: top-k %d is above the %d experts of the %s rows\n", opt->topk,
                    experts,
                    g == GROUP_PERMUTE ? "permute"
                    : g == GROUP_LL    ? "ll"
                                       : "ht");
            return -1;
        }
        if (experts % opt->nranks) {
            fprintf(stderr, "epx-bench: %d experts do not divide among %d ranks\n", experts, opt->nranks);
            return -1;
        }
    }
    if (opt->dtype == EPX_DTYPE_FP8_E4M3 && opt->hidden % 128) {
        fprintf(stderr, "epx-bench: fp8 needs a hidden size that is a multiple of 128, not %lld\n",
                (long long)opt->hidden);
        return -1;
    }
    return 0;
}

/* Every row, in the order the ranks run them: per group, per size, the group's kinds; ceiling
 * rows only where the bench hooks can time them. */
static int plan_rows(bench_opts_t *opt)
{
    static const int first[GROUP_COUNT] = {K_HT_DISPATCH, K_LL_DISPATCH, K_RM_DISPATCH};
    static const int last[GROUP_COUNT] = {K_VIEW_COMBINE, K_LL_COMBINE_BOUND, K_RM_CEIL_COPY};
    for (int i = 0; i < opt->ngroups; i++) {
        const int g = opt->groups[i];
        for (int s = 0; s < opt->nsizes; s++)
            for (int kind = first[g]; kind <= last[g]; kind++) {
                if (g == GROUP_HT && kind <= K_HT_COMBINE && !opt->ht_rows) continue;
                if (g == GROUP_HT && kind >= K_VIEW_DISPATCH && !opt->view_rows) continue;
                if (bench_kinds[kind].ceiling == -2 && !opt->ceilings) continue; /* bounds (-3) run anywhere */
                if (kind == K_RM_CEIL_HT && opt->nranks == 1) continue; /* no peer to copy to */
                if (opt->nrows == BENCH_MAX_ROWS) {
                    fprintf(stderr, "epx-bench: more than %d rows; sweep fewer sizes\n", BENCH_MAX_ROWS);
                    return -1;
                }
                opt->rows[opt->nrows++] = (bench_row_t){(int8_t)g, (int8_t)kind, (int16_t)s};
            }
    }
    return 0;
}

/* --------------------------------------------------------------------------- table ---- */

typedef struct bench_table {
    const bench_opts_t *opt;
    size_t result_bytes;
    int next;   /* the first row not printed yet */
    long seen;  /* cells reported so far (progress for the stall limit) */
    int failed; /* a printed row failed its check or a rank its run */
} bench_table_t;

static bench_table_t table;

/* The LL timeline samples: every rank's kernels on one clock (the GPU's %globaltimer), in us from
 * the sample's earliest dispatch-send start over the ranks; "floor" is the dispatch floor's kernel,
 * launched alone after a barrier, from its own earliest start. */
static void print_timeline(const epx_harness_report_t *rep)
{
    const int R = table.opt->nranks;
    const bench_result_t *r0 = epx_harness_result(rep, 0);
    if (!table.opt->timeline || !r0 || r0->timeline_n == 0) return;
    printf("# ll timeline (us on the GPU's clock from the earliest dispatch-send start of the sample; per\n"
           "#   kernel: start-end; events_us: the rank's dispatch + combine by CUDA events; floor: the\n"
           "#   dispatch floor launched alone after a barrier, from its earliest start)\n");
    for (int s = 0; s < r0->timeline_n; s++) {
        unsigned long long t0 = ~0ull, f0 = ~0ull;
        for (int r = 0; r < R; r++) {
            const bench_result_t *rr = epx_harness_result(rep, r);
            if (rr->timeline_n <= s) return;
            if (rr->timeline[s].call[0] && rr->timeline[s].call[0] < t0) t0 = rr->timeline[s].call[0];
            if (rr->timeline[s].floor[0] && rr->timeline[s].floor[0] < f0) f0 = rr->timeline[s].floor[0];
        }
        printf("# sample %d   disp-send        disp-recv        comb-send        comb-recv        events_us  floor\n", s);
        for (int r = 0; r < R; r++) {
            const bench_result_t *rr = epx_harness_result(rep, r);
            const bench_timeline_t *tl = &rr->timeline[s];
            printf("# rank %3d", r);
            for (int k = 0; k < 4; k++) {
                const unsigned long long a = tl->call[2 * k], e = tl->call[2 * k + 1];
                if (a && e >= a)
                    printf("  %7.1f-%-7.1f", (double)(a - t0) / 1e3, (double)(e - t0) / 1e3);
                else
                    printf("  %15s", "-");
            }
            printf("  %9.1f", tl->event_us);
            if (tl->floor[0] && tl->floor[1] >= tl->floor[0])
                printf("  %.1f-%.1f", (double)(tl->floor[0] - f0) / 1e3, (double)(tl->floor[1] - f0) / 1e3);
            printf("\n");
        }
    }
}

static const bench_cell_t *cell_at(const void *results, int rank, int row)
{
    const bench_result_t *res = (const void *)((const char *)results + (size_t)rank * table.result_bytes);
    return &res->cells[row];
}

/* Row `row` over every rank: the worst status, the slowest rank's median, bytes averaged. */
static int row_summary(const void *results, int row, double *us, double *bytes)
{
    int status = ROW_OK, unchecked = 1;
    *us = *bytes = 0;
    for (int r = 0; r < table.opt->nranks; r++) {
        const bench_cell_t *c = cell_at(results, r, row);
        const int s = atomic_load(&c->status);
        if (s == ROW_PENDING || s == ROW_ERROR)
            status = ROW_ERROR;
        else if (s == ROW_FAIL && status != ROW_ERROR)
            status = ROW_FAIL;
        else if (s == ROW_UNSUPPORTED && status == ROW_OK)
            status = ROW_UNSUPPORTED;
        unchecked &= s == ROW_UNCHECKED;
        if (c->median_us > *us) *us = c->median_us;
        *bytes += c->bytes / table.opt->nranks;
    }
    return status == ROW_OK && unchecked ? ROW_UNCHECKED : status;
}

static int row_done(const void *results, int row)
{
    for (int r = 0; r < table.opt->nranks; r++)
        if (atomic_load(&cell_at(results, r, row)->status) == ROW_PENDING) return 0;
    return 1;
}

/* The plan row of the same group and size that holds `kind`, or -1. */
static int row_of_kind(int row, int kind)
{
    const bench_opts_t *opt = table.opt;
    for (int i = 0; i < opt->nrows && kind >= 0; i++)
        if (opt->rows[i].kind == kind && opt->rows[i].group == opt->rows[row].group &&
            opt->rows[i].size == opt->rows[row].size)
            return i;
    return -1;
}

static void print_header(const bench_opts_t *opt)
{
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    char sms[32] = "the library's default";
    if (opt->sms) snprintf(sms, sizeof(sms), "%d", opt->sms);
    printf("# epx-bench %s: backend %s, %d ranks (forked processes; %s), iterations %d after %d warm-up, "
           "seed %llu\n",
           epx_version(), opt->gpu ? "cuda" : "host", opt->nranks,
           opt->gpu ? "GPUs shared round-robin"
                    : (opt->nranks > cores ? "more ranks than cores" : "one core or more each"),
           opt->iters, opt->warmup, (unsigned long long)opt->seed);
    if (opt->gpu)
        printf("# SMs per rank: %s\n", sms);
    else
        printf("# host: %ld cores\n", cores);
    printf("# time_us: median over iterations of each rank's time for one barrier-aligned call (%s); the\n"
           "#   slowest rank's median is shown; bytes and GB/s per rank, bytes averaged over the ranks\n",
           opt->gpu ? "CUDA events" : "CLOCK_MONOTONIC");
    printf(
        "# bytes: dispatch = token bytes the rank sends (ht, view: once per destination rank; ll: once\n"
        "#   per selected expert; permute: the permuted rows it receives); fp8 rows include their scales;\n"
        "#   combine = bf16 bytes (ht, view: sent back once per rank; ll: once per selected expert;\n"
        "#   permute: the permuted rows read); permute pads groups to %d rows\n",
        opt->pad);
    printf(
        "# ceil_us, ceil_GB/s: the same traffic with no protocol, timed in the same run (GPU only, but\n"
        "#   ll-*-bound); ratio = GB/s / ceil_GB/s. ht, view: plain copies of the same rows to the same\n"
        "#   peers (ht-ceiling); ll: one plain local copy of the call's bytes per rank, all ranks at once\n"
        "#   (ll-*-bound: the bytes at copy speed); ll-*-floor: the same stores with no wait or flag, shown\n"
        "#   alone; permute: a local device copy of the permuted rows (permute-ceil-copy; permute-ceil-ht:\n"
        "#   the HT copy of its token rows)\n");
    printf("%-17s %5s %7s %7s %5s %8s %-9s %11s %12s %9s %9s %9s %6s  %s\n", "op", "ranks", "tokens",
           "hidden", "topk", "experts", "dtype", "time_us", "bytes", "GB/s", "ceil_us", "ceil_GB/s", "ratio",
           "check");
    fflush(stdout);
}

static void print_row(const void *results, int row)
{
    static const char *const text[] = {"error", "ok", "FAIL", "unsupported", "error", "-"};
    const bench_opts_t *opt = table.opt;
    const bench_row_t *r = &opt->rows[row];
    double us, bytes, cus = 0, cbytes = 0;
    const int status = row_summary(results, row, &us, &bytes);
    const int crow = row_of_kind(row, bench_kinds[r->kind].ceiling);
    const int cstatus = crow >= 0 ? row_summary(results, crow, &cus, &cbytes) : ROW_ERROR;
    const char *dtype = bench_kinds[r->kind].combine ? "bf16" : epx_dtype_name(opt->dtype);
    printf("%-17s %5d %7lld %7lld %5d %8d %-9s", bench_kinds[r->kind].name, opt->nranks,
           (long long)opt->sizes[r->group][r->size], (long long)opt->hidden, opt->topk,
           experts_of(opt, r->group), dtype);
    if (status == ROW_ERROR || status == ROW_UNSUPPORTED || us <= 0)
        printf(" %11s %12s %9s", "-", "-", "-");
    else
        printf(" %11.1f %12.0f %9.2f", us, bytes, bytes / (us * 1e3));
    if (status != ROW_ERROR && status != ROW_UNSUPPORTED && cstatus == ROW_UNCHECKED && cus > 0 && us > 0)
        printf(" %9.1f %9.2f %6.2f", cus, cbytes / (cus * 1e3), (bytes / us) / (cbytes / cus));
    else
        printf(" %9s %9s %6s", "-", "-", "-");
    printf("  %s", text[status]);
    /* The legs, averaged over the ranks like the bytes, when the ranks span nodes. */
    double net = 0, nvl = 0;
    for (int q = 0; q < opt->nranks && net >= 0; q++) {
        const bench_cell_t *c = cell_at(results, q, row);
        net = c->net_bytes < 0 ? -1 : net + c->net_bytes / opt->nranks;
        nvl += c->nvl_bytes / opt->nranks;
    }
    if (net >= 0 && status != ROW_ERROR && status != ROW_UNSUPPORTED) printf("  net_B %.0f nvl_B %.0f", net, nvl);
    printf("\n");
    fflush(stdout);
    table.failed |= status == ROW_FAIL || status == ROW_ERROR;
}

/* Prints the rows that every rank (and the row's ceiling) reported; stops the run when a rank
 * failed, as the others would wait for it in their next collective. */
static int watch(void *ctx, void *results, int nfailed)
{
    (void)ctx;
    const bench_opts_t *opt = table.opt;
    while (table.next < opt->nrows && row_done(results, table.next)) {
        const int crow = row_of_kind(table.next, bench_kinds[opt->rows[table.next].kind].ceiling);
        if (crow >= 0 && !row_done(results, crow)) break;
        print_row(results, table.next++);
    }
    long seen = 0;
    for (int r = 0; r < opt->nranks; r++)
        for (int i = 0; i < opt->nrows; i++)
            seen += atomic_load(&cell_at(results, r, i)->status) != ROW_PENDING;
    const int progress = seen != table.seen;
    table.seen = seen;
    return nfailed ? -1 : progress;
}

int main(int argc, char **argv)
{
    static bench_opts_t opt;
    int print_env = 0;
    if (parse_args(argc, argv, &opt, &print_env)) return 2;
    if (print_env) {
        /* The table, then the verdict: a malformed value (marked in the table) fails the run. */
        epx_params_print(stdout);
        const epx_params_t *checked = NULL;
        if (epx_params_get(&checked) == EPX_SUCCESS) return 0;
        fprintf(stderr, "epx-bench: %s\n", epx_last_error_message());
        return 2;
    }
    const epx_params_t *params = NULL;
    if (epx_params_get(&params) != EPX_SUCCESS) {
        fprintf(stderr, "epx-bench: %s\n", epx_last_error_message());
        return 2;
    }
    opt.ngpus = opt.backend == EPX_BACKEND_HOST ? 0 : epx_harness_gpu_count();
    if (opt.backend == EPX_BACKEND_CUDA && opt.ngpus == 0) {
        fprintf(stderr, "epx-bench: -B cuda, but %s\n",
#ifdef EPX_HAVE_CUDA
                "no usable CUDA device was found"
#else
                "this build has no cuda backend"
#endif
        );
        return 2;
    }
    opt.gpu = opt.ngpus > 0;
#ifdef EPX_BENCH_HOOKS
    opt.ceilings = opt.gpu;
#endif
    if (opt.nranks == 0) opt.nranks = opt.gpu ? opt.ngpus : 4;
    if (check_opts(&opt) || plan_rows(&opt)) return 2;

    table.opt = &opt;
    table.result_bytes =
        (sizeof(bench_result_t) + (size_t)opt.nrows * sizeof(bench_cell_t) + 63) & ~(size_t)63;
    print_header(&opt);
    /* The stall limit: no rank reported for longer than the library's own timeout plus a margin. */
    epx_harness_opts_t run = {"epx-bench", opt.nranks,         rank_main,
                              &opt,        table.result_bytes, (double)params->timeout_ms / 1000.0 + 30.0,
                              watch};
    epx_harness_report_t rep;
    const int rc = epx_harness_run(&run, &rep);
    if (rc < 0) return 2;
    while (table.next < opt.nrows) print_row(rep.results, table.next++);
    print_timeline(&rep);
    const bench_result_t *r0 = epx_harness_result(&rep, 0);
    if (opt.gpu && r0->device_sms)
        printf("# rank 0: cuda device 0 with %d SMs; %d ranks per NVLink domain, %d domain(s)\n",
               r0->device_sms, r0->ranks_per_domain, r0->num_domains);
    epx_harness_report_free(&rep);
    if (rc || table.failed)
        fprintf(stderr, "epx-bench: FAILED (a check failed or a rank reported an error)\n");
    return rc || table.failed ? 1 : 0;
}
