/*
 * epx-bench internals, shared by its files: options, the plan of rows and the table (main.c),
 * inputs built from (rank, token, channel) (inputs.c), output checks (check.c), memory and timing
 * on the host or the device (device.c), the ranks (rank.c) and the operations (ops_*.c).
 */
#ifndef EPX_TOOLS_BENCH_TOOL_H
#define EPX_TOOLS_BENCH_TOOL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "epx/epx.h"

#define BENCH_MAX_SIZES 64
#define BENCH_MAX_RANKS 256
#define BENCH_MAX_ROWS  1024

/* Operation groups: each runs on a buffer of its own. ht and view share one (and one ceiling). */
enum { GROUP_HT = 0, GROUP_LL, GROUP_PERMUTE, GROUP_COUNT };

/* Every row the bench can print. A ceiling (or floor) row times the same traffic with no
 * protocol, through the bench-only hooks, on the GPU only. */
typedef enum bench_kind {
    K_HT_DISPATCH,
    K_HT_CACHED,
    K_HT_COMBINE,
    K_HT_CEILING,
    K_VIEW_DISPATCH,
    K_VIEW_CACHED,
    K_VIEW_COMBINE,
    K_LL_DISPATCH,
    K_LL_DISPATCH_SEND,
    K_LL_DISPATCH_RECV,
    K_LL_DISPATCH_FLOOR,
    K_LL_COMBINE,
    K_LL_COMBINE_SEND,
    K_LL_COMBINE_RECV,
    K_LL_COMBINE_FLOOR,
    K_LL_DISPATCH_BOUND,
    K_LL_COMBINE_BOUND,
    K_RM_DISPATCH,
    K_RM_COMBINE,
    K_RM_CEIL_HT,
    K_RM_CEIL_COPY,
    K_COUNT
} bench_kind_t;

/* What the table says of each kind: its name, the ceiling it is compared with (-1: none; a
 * ceiling row itself has -2, a bound row -3: a plain local copy of the same bytes, which every
 * backend can time) and whether its bytes are bf16 combine rows. */
typedef struct bench_kind_info {
    const char *name;
    int8_t ceiling;
    int8_t combine;
} bench_kind_info_t;

extern const bench_kind_info_t bench_kinds[K_COUNT];

enum { ROW_PENDING = 0, ROW_OK, ROW_FAIL, ROW_UNSUPPORTED, ROW_ERROR, ROW_UNCHECKED };

/* One printed row: which group, size and kind. */
typedef struct bench_row {
    int8_t group, kind;
    int16_t size;
} bench_row_t;

typedef struct bench_opts {
    int64_t sizes[GROUP_COUNT][BENCH_MAX_SIZES];
    int nsizes, tokens_given;
    int64_t tok_factor, hidden;
    int topk, experts, local_experts, pad, sms, iters, warmup, nranks;
    int nodes; /* --nodes: EPX_NODE_ID set per rank to split the ranks into this many nodes (0: not set) */
    int timeline; /* --timeline: LL calls whose kernels stamp their start and end (bench hooks, GPU) */
    int groups[GROUP_COUNT], ngroups, ht_rows, view_rows;
    epx_dtype_t dtype;
    epx_backend_t backend;
    uint64_t seed;
    int gpu, ngpus, ceilings; /* ceilings: bench hooks built in and the cuda backend in use */
    int nrows;
    bench_row_t rows[BENCH_MAX_ROWS];
} bench_opts_t;

/* What one rank reports for one row; status is written last. */
typedef struct bench_cell {
    atomic_int status;
    double median_us;
    double bytes;
    double net_bytes, nvl_bytes; /* the legs of `bytes` when ranks span nodes (-1: not counted) */
} bench_cell_t;

/* One rank's slot of the shared result block. */
enum { BENCH_TIMELINE_SAMPLES = 3 };

/* One LL timeline sample of a rank: per kernel (EPX_LL_STAMP_* order: dispatch send, dispatch
 * receive, combine send, combine receive) the first block's start and the last warp's end in
 * %globaltimer ns, then the dispatch floor's pair; event_us: the pair's time by CUDA events. */
typedef struct bench_timeline {
    unsigned long long call[8], floor[2];
    double event_us;
} bench_timeline_t;

typedef struct bench_result {
    int32_t device_sms, ranks_per_domain, num_domains, num_nodes;
    int32_t timeline_n; /* samples in timeline */
    bench_timeline_t timeline[BENCH_TIMELINE_SAMPLES];
    bench_cell_t cells[];
} bench_result_t;

typedef struct bench_rank {
    const bench_opts_t *opt;
    bench_result_t *res;
    int rank, nranks, gpu, device;
    void *stream;
    void *ev_start, *ev_stop; /* cuda events of the samples */
    uint64_t t0;              /* host start of a sample */
    epx_comm_t comm;
    int row0, nrow; /* the rows of the (group, size) being run */
    int unsupported;
    int ranks_per_node;           /* as the library reports it */
    const struct bench_routing *rt; /* of the (group, size) being run: report() splits bytes into legs */
} bench_rank_t;

/* ---------------------------------------------------------------- inputs (inputs.c) ---- */

float value_of(int src, int64_t token, int64_t channel, int tag);
uint8_t fp8_byte_of(int src, int64_t token, int64_t channel);
float scale_of(int src, int64_t token, int64_t group);
float weight_of(int src, int64_t token, int k);

/* Routing of every rank (each rank recomputes all of it) and what rank `me` should receive. */
typedef struct bench_routing {
    int64_t T;
    int R, K, E, L, me;
    int32_t *topk;    /* [R][T][K] */
    int64_t n_ht;     /* rows HT dispatch delivers to me */
    int32_t *ht_src;  /* [n_ht] source rank, HT order */
    int32_t *ht_tok;  /* [n_ht] source token */
    int64_t *exp_off; /* [L + 1] rows per local expert (source rank, then token order) */
    int32_t *exp_src; /* [exp_off[L]] */
    int32_t *exp_tok;
    int32_t *exp_k;           /* slot k of that expert in the source token's topk */
    int64_t sent_rank_rows;   /* my tokens times their destination ranks */
    int64_t sent_expert_rows; /* my tokens times their selected experts */
    /* Legs when ranks span nodes (routing_legs): HT rows cross the network once per destination
     * node (to the rank of my local index there) and NVLink to each other destination rank of the
     * node, the forwarding rank's copies counted on it; LL rows go straight to each expert's owner. */
    int64_t net_rank_rows, nvl_rank_rows, net_expert_rows, nvl_expert_rows;
    int ranks_per_node; /* R on one node: the combines' reduction tree (docs/reference.md, Sums) */
} bench_routing_t;

int routing_build(bench_routing_t *rt, const bench_opts_t *opt, int me, int64_t T, int experts);
void routing_free(bench_routing_t *rt);
/* Fills the legs of rt for nodes of `ranks_per_node` consecutive ranks. */
void routing_legs(bench_routing_t *rt, int ranks_per_node);
int token_on_rank(const bench_routing_t *rt, int s, int64_t t, int r);
/* This rank's x [T, H] (and fp8 scales [T, H/128]) in host staging. */
void fill_x(void *x, float *scales, epx_dtype_t dtype, int me, int64_t T, int64_t H);
/* This rank's topk_idx and weights [T, K]. */
void fill_topk(const bench_routing_t *rt, int32_t *idx, float *w);
/* Bytes of one dispatched row: H elements, plus fp32 scales per 128 channels for fp8. */
int64_t row_bytes(epx_dtype_t dtype, int64_t H);
int experts_of(const bench_opts_t *opt, int group);

/* ------------------------------------------------------------------ checks (check.c) ---- */

/* Counts mismatches and prints the first few (rank, row, where, got, want). */
typedef struct bench_check {
    const char *what;
    int rank;
    int64_t bad;
} bench_check_t;

void check_fail(bench_check_t *ck, const char *field, int64_t row, int64_t col, double got, double want);
/* Row `row` of a dispatch output holding token (src, token) as dispatched in `dtype`. */
void check_x_row(bench_check_t *ck, const char *field, epx_dtype_t dtype, const void *row_data, int64_t row,
                 int src, int64_t token, int64_t H);
void check_scales_row(bench_check_t *ck, const char *field, const float *got, int64_t row, int src,
                      int64_t token, int64_t G);
/* HT receive rows [0, n) (topk: optional recv_topk_idx). */
void check_ht_recv(bench_check_t *ck, const bench_routing_t *rt, epx_dtype_t dtype, int64_t H, int64_t n,
                   const void *x, const float *scales, const int32_t *topk);
/* combined [T, H] of an HT combine (sum over the ranks that held each token, node by node when the
 * ranks span nodes: docs/reference.md, Sums). */
void check_ht_combined(bench_check_t *ck, const bench_routing_t *rt, int64_t H, const uint16_t *combined);
/* LL receive side: recv_count [L], recv_x [L, slots, H], fp8 scales [L, H/128, slots]. */
void check_ll_recv(bench_check_t *ck, const bench_routing_t *rt, int fp8, int64_t H, int64_t slots,
                   const int32_t *count, const void *x, const float *scales);
/* combined [T, H] of an LL or a weighted routing-map combine: sum of weight * expert output over
 * the token's experts; `tree` (routing map): node by node when the ranks span nodes. */
void check_weighted_combined(bench_check_t *ck, const bench_routing_t *rt, int64_t H, const uint16_t *combined,
                             int tree);
/* Permuted tokens [P, H] with padded groups group_start[L + 1], probs [P], scales [P, H/128]. */
void check_rm_tokens(bench_check_t *ck, const bench_routing_t *rt, epx_dtype_t dtype, int64_t H,
                     const int64_t *group_start, const void *tokens, const float *probs, const float *scales);

/* -------------------------------------------- memory, tensors and timing (device.c) ---- */

void *mem_alloc(bench_rank_t *b, size_t bytes);
void mem_free(bench_rank_t *b, void *p);
/* Copies host staging to tensor memory, ordered before later work on the rank's stream. */
int mem_put(bench_rank_t *b, void *dst, const void *src, size_t bytes);
int mem_zero(bench_rank_t *b, void *dst, size_t bytes);
/* Waits for the work queued on the rank's stream. */
int stream_sync(bench_rank_t *b);
/* A host-readable copy (or, on the host, the memory itself) after the stream's work; release
 * it with mem_view_release. */
const void *mem_view(bench_rank_t *b, const void *src, size_t bytes);
void mem_view_release(bench_rank_t *b, const void *view);
/* Device-to-device copy on the rank's stream (the routing-map local-copy ceiling). */
int mem_copy_async(bench_rank_t *b, void *dst, const void *src, size_t bytes);

/* Everything one (group, size) run allocates; freed in one place. failed: an allocation failed
 * (checked once after all of them). */
typedef struct bench_mem {
    void *dev[20];
    void *host[8];
    int failed;
} bench_mem_t;

void *dev_take(bench_rank_t *b, bench_mem_t *m, size_t bytes);
void *host_take(bench_mem_t *m, size_t bytes);
void mem_release_all(bench_rank_t *b, bench_mem_t *m);

epx_tensor_t tensor(bench_rank_t *b, void *data, epx_dtype_t dtype, int ndim, int64_t d0, int64_t d1,
                    int64_t d2);

/* A barrier of all ranks, then the start of a sample: CUDA events on the rank's stream, else
 * CLOCK_MONOTONIC. */
int timed_begin(bench_rank_t *b);
/* The end of a sample: waits for the rank's stream and stores the time in *us. */
int timed_end(bench_rank_t *b, double *us);
/* The rank's GPU, stream and events (cuda backend); device_close undoes what was made. */
int device_open(bench_rank_t *b);
void device_close(bench_rank_t *b);
/* The middle sample (the upper one of an even count); sorts v. */
double median(double *v, int n);

/* ------------------------------------------------------------------- ranks (rank.c) ---- */

/* One row timed warm-up + iterations times in a row, each sample after a barrier; `before`
 * (optional) runs untimed ahead of each barrier. Both return bench_call results. */
typedef struct bench_loop {
    int (*call)(void *ctx, int kind);
    int (*before)(void *ctx, int kind);
    void *ctx;
} bench_loop_t;

/* Returns 0 with the median in *median_us, else the first failing bench_call result. */
int time_row(bench_rank_t *b, const bench_loop_t *loop, int kind, double *median_us);
/* One sample of row `kind`: barrier, start, the call, stop. */
int time_once(bench_rank_t *b, const bench_loop_t *loop, int kind, double *us);

/* Maps a call's result: 0 on success, 1 for EPX_ERR_UNSUPPORTED (remembered), -1 otherwise
 * (printed with the call's name). */
int bench_call(bench_rank_t *b, const char *what, epx_result_t res);
int has_row(const bench_rank_t *b, int kind);
/* Records this rank's row `kind` of the current (group, size); rows not in the plan are ignored. */
void report(bench_rank_t *b, int kind, int status, double median_us, double bytes);
/* The end of a (group, size) run with result rc: rows left unreported become unsupported after
 * an unsupported call. Returns -1 on a fatal error, else 0. */
int run_end(bench_rank_t *b, int rc);

/* The body of every rank. */
int rank_main(int rank, int nranks, const epx_unique_id_t *id, void *ctx, void *result);

/* ------------------------------------------------------------- operations (ops_*.c) ---- */

/* What every operation's run starts from: the rank, the buffer, the routing and the shape. */
typedef struct bench_op {
    bench_rank_t *b;
    epx_buffer_t buf;
    const bench_routing_t *rt;
    int64_t T, H, G; /* G: fp8 scale groups of 128 channels */
    epx_dtype_t dtype;
    size_t esz;
    int fp8;
} bench_op_t;

bench_op_t op_start(bench_rank_t *b, epx_buffer_t buf, const bench_routing_t *rt);

/* The bench hooks (GPU only, rank.c): the plain-copy ceiling of an HT dispatch's rows
 * (epx_cuda_ht_ceiling) and the LL floor (epx_cuda_ll_floor); -1 in builds without them. */
int op_ht_ceiling(const bench_op_t *o, epx_handle_t handle, const epx_tensor_t *x);
int op_ll_floor(const bench_op_t *o, int combine, const epx_ll_dispatch_args_t *args,
                const epx_ll_handle_t *handle);
/* The LL timeline hooks (epx_cuda_ll_stamps_arm / _read); -1 in builds without them. */
int op_ll_stamps_arm(const bench_op_t *o);
int op_ll_stamps_read(const bench_op_t *o, unsigned long long out[8]);

/* This rank's inputs in tensor memory (inputs.c): x [T, H] in `dtype` with fp8 scales
 * [T, H/128] (NULL for bf16), topk_idx and weights [T, K], and their host copies. */
typedef struct bench_inputs {
    void *x;
    float *x_scales;
    int32_t *topk, *htopk;
    float *w, *hw;
} bench_inputs_t;

/* Takes the memory from m and uploads; 0 or -1. */
int op_inputs(const bench_op_t *o, bench_mem_t *m, epx_dtype_t dtype, bench_inputs_t *in);

/* Each runs every row of its group at one size on `buf`; 0, or -1 on a fatal error. */
int run_ht(bench_rank_t *b, epx_buffer_t buf, const bench_routing_t *rt);
int run_ll(bench_rank_t *b, epx_buffer_t buf, const bench_routing_t *rt, int64_t T_max);
int run_rm(bench_rank_t *b, epx_buffer_t buf, const bench_routing_t *rt);

#endif /* EPX_TOOLS_BENCH_TOOL_H */
