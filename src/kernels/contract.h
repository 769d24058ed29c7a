/*
 * The contract between the cuda backend's host side (src/cuda) and its kernels
 * (src/kernels): the registered region's layout, the error record, and one argument struct
 * per kernel family with its extern "C" launcher. Plain C so both compilers read it.
 */
#ifndef EPX_KERNELS_CONTRACT_H
#define EPX_KERNELS_CONTRACT_H

#include <stddef.h>
#include <stdint.h>

#include "net/net.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EPX_CUDA_MAX_RANKS 64

/* What a device wait was waiting for (error record's `what`). */
typedef enum epx_cuda_wait {
    EPX_CUDA_WAIT_DISPATCH_ACK = 1,  /* receiver's release of our rows in its dispatch area */
    EPX_CUDA_WAIT_DISPATCH_DATA = 2, /* sender's dispatch rows */
    EPX_CUDA_WAIT_COMBINE_ACK = 3,
    EPX_CUDA_WAIT_COMBINE_DATA = 4,
    EPX_CUDA_WAIT_BAD_EXPERT = 5,    /* not a wait: an expert id out of range in device topk_idx */
    EPX_CUDA_WAIT_CAPACITY = 6,      /* not a wait: N_r above the output capacity */
    EPX_CUDA_WAIT_CALL = 7,          /* not a wait: the peer's call differs from ours (call words) */
    EPX_CUDA_WAIT_ACCEPT = 8,        /* receiver's acceptance of its row count (accept words) */
    EPX_CUDA_WAIT_BAD_MAP = 9,       /* not a wait: a routing_map row with more than K true entries */
} epx_cuda_wait_t;

/* The call word every collective kernel posts to every peer when it starts: epoch << 24 | signature.
 * The signature holds what the ranks' calls must agree on; a peer whose word for the same epoch
 * differs makes the call fail with EPX_ERR_MISMATCH on every rank (each rank reads every peer's). */
#define EPX_CUDA_SIG_BITS 24
#define EPX_CUDA_SIG_MASK ((1ull << EPX_CUDA_SIG_BITS) - 1)
enum {
    EPX_CUDA_CALL_HT_DISPATCH = 1,
    EPX_CUDA_CALL_HT_COMBINE = 2,
    EPX_CUDA_CALL_RM_DISPATCH = 3,
    EPX_CUDA_CALL_RM_COMBINE = 4,
    EPX_CUDA_CALL_LL_DISPATCH = 5,
    EPX_CUDA_CALL_LL_COMBINE = 6,
};
/* Signature fields: kind (bits 0-3), dtype (4-7), flags (8-15), low byte of the handle's dispatch
 * call (16-23; combines and cached dispatches). */
#define EPX_CUDA_SIG_CACHED  (1u << 8)  /* HT dispatch: args.cached_handle */
#define EPX_CUDA_SIG_VIEW    (1u << 9)  /* HT: recv_in_buffer (dispatch), x_in_buffer (combine) */
#define EPX_CUDA_SIG_PERMUTE (1u << 10) /* routing map: permute */
#define EPX_CUDA_SIG_PROBS   (1u << 11) /* routing map: probs given */
static inline uint32_t epx_cuda_sig(int kind, int dtype, uint32_t flags, uint64_t handle_seq)
{
    return (uint32_t)kind | (uint32_t)(dtype & 15) << 4 | flags | (uint32_t)(handle_seq & 0xff) << 16;
}

/* First failure of an epoch, written by the device into host-mapped memory. `code` is written
 * last (after a system fence), so a non-zero code means the rest is complete. */
typedef struct epx_cuda_err_record {
    int32_t code; /* epx_result_t; 0 = none */
    int32_t rank;
    int32_t peer;
    int32_t channel; /* block index of the waiter */
    int32_t what;    /* epx_cuda_wait_t */
    int32_t pad;
    uint64_t epoch;
    uint64_t seen;
    uint64_t expected;
    int32_t expert; /* expert the waiter served (LL), -1 = none */
    int32_t pad2;
} epx_cuda_err_record_t;

/* Host-mapped per-buffer block (cudaHostAllocMapped). */
typedef struct epx_cuda_host_block {
    epx_cuda_err_record_t err;
    int32_t abort_flag; /* host sets it at teardown: every device wait gives up */
    int32_t overflow;   /* static mode dropped rows */
    int64_t num_recv;   /* N_r of the last dispatch (-1 when it failed) */
    int64_t bad_where;  /* 1 + token * EPX_MAX_TOPK + slot of an invalid device topk_idx entry, 0 = none */
    int64_t bad_value;
    uint64_t gone;      /* ~0: the word a destroyed buffer copies into every peer's fail[rank] */
    uint64_t dead;      /* ~0: the word the watcher copies into our own fail[peer] when peer's
                           process exited */
} epx_cuda_host_block_t;
/* The block's allocation goes on with L int32 (EPX_CUDA_HOST_COUNTS): the per-expert counts of the last
 * default-mode HT dispatch with top-k, which the host copies to the caller after its wait. */
#define EPX_CUDA_HOST_COUNTS(block) ((int32_t *)((epx_cuda_host_block_t *)(block) + 1))

/* Start of every rank's registered region. Words indexed [peer] are written by that peer
 * (system-scope release), the rest only by the owner. Every counter is an epoch: the number of
 * collective operations the buffer has run, the same on every rank, so nothing is reset. */
typedef struct epx_cuda_ctrl {
    uint64_t disp_flag[EPX_CUDA_MAX_RANKS];  /* [src] epoch whose rows src has placed here */
    uint64_t disp_count[EPX_CUDA_MAX_RANKS]; /* [src] rows src placed (written before flag) */
    uint64_t disp_ack[EPX_CUDA_MAX_RANKS];   /* [dst] epoch dst finished reading our rows */
    uint64_t comb_flag[EPX_CUDA_MAX_RANKS];
    uint64_t comb_ack[EPX_CUDA_MAX_RANKS];
    uint64_t fail[EPX_CUDA_MAX_RANKS];       /* [peer] epoch at which peer failed its checks */
    uint64_t epoch;                          /* last finished collective */
    uint64_t disp_last;                      /* epoch of the last dispatch */
    uint64_t comb_last;                      /* epoch of the last combine */
    uint64_t err_epoch;                      /* epoch of the last recorded error */
    uint32_t done_counter[8];                /* last-block detection, one per kernel kind */
    /* HT view mode (appended): */
    uint64_t cnt_flag[EPX_CUDA_MAX_RANKS];    /* [src] epoch whose disp_count src posted before sending */
    uint64_t view_ack[EPX_CUDA_MAX_RANKS];    /* [dst] epoch before dst's next view dispatch: dst's
                                                 views of our earlier rows are dead */
    uint64_t comb_rows[EPX_CUDA_MAX_RANKS];   /* [rank] rows of rank's combine input (before comb_flag) */
    uint64_t comb_base[EPX_CUDA_MAX_RANKS];   /* [rank] first row of our tokens there (before comb_flag) */
    uint64_t comb_pulled[EPX_CUDA_MAX_RANKS]; /* [src] epoch src finished reading our combine input */
    uint64_t view_last;                       /* epoch of the last view dispatch */
    uint32_t view_done_counter[4];            /* last-block detection of the view kernels */
    /* [epoch & 1][peer] peer's call word (EPX_CUDA_SIG_BITS): a peer is at most one collective
     * ahead of any kernel of ours that reads it, so the word of our epoch stays until we read it. */
    uint64_t call[2][EPX_CUDA_MAX_RANKS];
    /* [peer] epoch of a dispatch whose row count peer accepted: its outputs hold every row it
     * receives. A receiver whose outputs are too small writes its fail word for that epoch instead,
     * so every rank's call fails (contract: common.cuh accept_counts). */
    uint64_t accept[EPX_CUDA_MAX_RANKS];
    /* [dst] (epoch << 8) | the view area dst's outputs of its view dispatch `epoch` go to, written by
     * dst when that dispatch starts (senders wait for it, then write there). */
    uint64_t view_area[EPX_CUDA_MAX_RANKS];
    /* [rank] offset in rank's region of its view-mode combine rows (comb_x, or its dispatch view's
     * area), written before comb_flag. */
    uint64_t comb_xoff[EPX_CUDA_MAX_RANKS];
    /* [src][dst] rows src sends dst in its latest routed dispatch, written by src (its whole row, to
     * every peer) before disp_flag: every receiver learns the rank prefix matrix. */
    int32_t disp_rows[EPX_CUDA_MAX_RANKS][EPX_CUDA_MAX_RANKS];
} epx_cuda_ctrl_t;

/* Byte offsets inside a region (all ranks use the same numbers). */
typedef struct epx_cuda_layout {
    uint64_t disp_x;      /* [R][T_max][x_stride] token bytes */
    uint64_t disp_scales; /* [R][T_max][H/128] fp32 */
    uint64_t disp_idx;    /* [R][T_max][K] int32 remapped */
    uint64_t disp_w;      /* [R][T_max][K] fp32 */
    uint64_t disp_src;    /* [R][T_max] int32 */
    uint64_t comb_x;      /* [R][T_max][H] bf16 */
    uint64_t comb_w;      /* [R][T_max][K] fp32 */
    uint64_t expert_scratch; /* [L] int32, owner only */
    uint64_t total;
    uint64_t x_stride;    /* bytes per dispatch row (16-aligned, widest allowed dtype) */
    /* Routing-map areas (src/cuda/rm.c; 0 without EPX_MODE_PERMUTE). */
    uint64_t rm_within;   /* [R][T_max][K] int32: row of (token, expert) among the source's */
    uint64_t rm_cnt;      /* [R][L] int32: tokens of source s per local expert */
    uint64_t rm_comb;     /* [T_max][K][H] bf16 unpermute rows (aliases comb_x when K <= R) */
    uint64_t rm_scratch;  /* owner only: [T_max/32 + 1][E + R] int32 tile counts, totals */
    /* Low-latency areas (src/cuda/ll.c; epx_cuda_ll_layout_t inside, 0 bytes without EPX_MODE_LL). */
    uint64_t ll;
    /* HT view-mode final layout (rows in HT order, R*T_max of them; views point here). */
    uint64_t view_x;      /* [R*T_max][row_bytes of the call's dtype] */
    uint64_t view_scales; /* [R*T_max][H/128] fp32 */
    uint64_t view_idx;    /* [R*T_max][K] int32 remapped */
    uint64_t view_w;      /* [R*T_max][K] fp32 */
    uint64_t view_src;    /* [R*T_max] int32 */
    uint64_t view_stride; /* bytes from one view area's five arrays to the next area's (view_x etc.
                             are those of area 0) */
} epx_cuda_layout_t;

/* Per-handle device state (one slab). */
typedef struct epx_cuda_handle_dev {
    int32_t *send_row;    /* [T_max][R]: row of token t in r's slice for us, -1 = not sent */
    int32_t *send_count;  /* [R] */
    int32_t *recv_src;    /* [R*T_max]: source token index of each received row */
    int32_t *recv_prefix; /* [R+1]: first row of each source */
    int32_t *rows_valid;  /* [1]: received rows actually written (min(N_r, capacity)) */
    int64_t *bad;         /* [2]: 1 + token * EPX_MAX_TOPK + slot of a bad topk_idx entry the call's layout
                             found (0 = none), its value; the receive kernel clears it */
} epx_cuda_handle_dev_t;

/* Common part of every collective kernel's arguments. */
typedef struct epx_cuda_common {
    uint8_t *peers[EPX_CUDA_MAX_RANKS]; /* regions; peers[rank] is ours */
    epx_cuda_layout_t lay;
    epx_cuda_host_block_t *host;        /* device pointer of the mapped block */
    int32_t rank, nranks;
    int32_t num_local_experts, num_topk;
    int64_t hidden, max_tokens;
    uint64_t timeout_ns;
    int32_t num_blocks, num_threads;
    uint32_t call_sig; /* this call's signature (epx_cuda_sig); 0: posts and checks nothing */
    int32_t pad;
} epx_cuda_common_t;

typedef struct epx_cuda_layout_args {
    const void *topk_idx; /* [T][K] */
    int32_t idx_is_64;
    int64_t num_tokens;
    int32_t num_topk, num_experts, nranks, num_local_experts;
    /* optional outputs (NULL = skip) */
    int32_t *send_row;           /* [T][R] */
    int32_t *num_tokens_per_rank; /* [R] */
    int32_t *num_tokens_per_expert; /* [E] */
    uint8_t *is_token_in_rank;   /* [T][R] */
    int32_t *num_tokens_per_domain; /* [R/D] */
    int32_t ranks_per_domain;
    epx_cuda_host_block_t *host; /* bad ids go to the host's bad_where (NULL: not there) */
    int64_t *bad;                /* inside a dispatch: the handle's bad word (the call fails on the
                                    device); NULL: a standalone layout, whose counts become -1 */
    int32_t rank;
} epx_cuda_layout_args_t;

typedef struct epx_cuda_dispatch_args {
    epx_cuda_common_t c;
    epx_cuda_handle_dev_t h;
    int64_t num_tokens;
    int32_t cached;
    const uint8_t *x;
    int64_t row_bytes;        /* H * elem */
    const float *x_scales;    /* NULL unless fp8 */
    int32_t num_scales;       /* H/128 for fp8 */
    const void *topk_idx;
    int32_t idx_is_64;
    const float *topk_weights; /* may be NULL */
    /* receive side */
    uint8_t *recv_x;
    float *recv_scales;
    void *recv_topk_idx;
    int32_t recv_idx_is_64;
    float *recv_topk_weights;
    int32_t *num_recv_tokens_per_expert;
    int32_t *host_expert_counts; /* the mapped block's counts (device pointer) or NULL: the same values */
    int32_t *num_recv_tokens;
    int32_t *rank_prefix_matrix; /* [R][R] or NULL */
    int64_t capacity;
    int32_t static_mode;
    int32_t expert_alignment;
    int32_t view; /* recv_in_buffer: rows go to their final place in the receiver's view area */
    int32_t view_area; /* view mode: our outputs' area (each receiver posts its own) */
} epx_cuda_dispatch_args_t;

typedef struct epx_cuda_combine_args {
    epx_cuda_common_t c;
    epx_cuda_handle_dev_t h;
    int64_t num_tokens;       /* T on this rank (source side) */
    const uint16_t *x;        /* [N_r][H] bf16 */
    const float *topk_weights; /* [N_r][K] or NULL */
    const uint16_t *bias0, *bias1;
    uint16_t *combined_x;
    float *combined_topk_weights;
    int32_t in_buffer;        /* x_in_buffer: x is in our region at x_off; sources pull it */
    uint64_t x_off;           /* in_buffer: comb_x, or the view_x of the dispatch view's area */
} epx_cuda_combine_args_t;

/* Launchers: each enqueues on `stream` and returns a cudaError_t value (0 = success). */
int epx_cuda_launch_layout(const epx_cuda_layout_args_t *args, void *stream);
int epx_cuda_launch_dispatch(const epx_cuda_dispatch_args_t *args, void *stream);
int epx_cuda_launch_combine(const epx_cuda_combine_args_t *args, void *stream);
/* This rank failed its checks: bump the epoch and release every peer (see epx_cuda_ctrl_t). */
int epx_cuda_launch_fail(const epx_cuda_common_t *c, void *stream);
/* HT view mode (recv_in_buffer / x_in_buffer): one pass over the bytes.
 * Dispatch: the sender posts its per-destination counts, reads the lower sources' counts from
 * each destination to get its rows' final positions, and writes every row (scales, remapped ids,
 * weights, source index) there; the receiver waits and computes counts. A receiver's areas are
 * released at its next dispatch (the views live until then).
 * Each receiver posts the view area its outputs go to; senders write there.
 * Combine: every rank posts where its input rows are (comb_x, written by the caller, or the
 * handle's dispatch view); each source pulls
 * the rows of its tokens from the peers and reduces; the kernel ends when every source is done
 * with our rows. */
int epx_cuda_launch_dispatch_view(const epx_cuda_dispatch_args_t *args, void *stream);
int epx_cuda_launch_combine_view(const epx_cuda_combine_args_t *args, void *stream);

/* ------------------------------------------------ routing-map dispatch/combine (rm.cu) ---- */

#define EPX_CUDA_RM_DONE_SEND 4 /* done_counter slots of the routing-map kernels */
#define EPX_CUDA_RM_DONE_RECV 5
#define EPX_CUDA_RM_DONE_COMB_SEND 6
#define EPX_CUDA_RM_DONE_COMB_REDUCE 7
#define EPX_CUDA_RM_DROPPED (-2)   /* perm_row: the row fell past the bound */

/* Per-handle device state of a routing-map dispatch (one slab). */
typedef struct epx_cuda_rm_handle_dev {
    /* source side */
    int32_t *send_row;    /* [T_max][R]: row of token t among this tile's tokens for r, -1 = not sent */
    int32_t *src_sel;     /* [T_max][K]: selected experts ascending, -1 padded */
    int32_t *src_within;  /* [T_max][K]: row of (t, expert) among this tile's tokens of that expert */
    float *src_prob;      /* [T_max][K] */
    /* receiver side, indexed by the row in HT order */
    int32_t *recv_src;    /* [R*T_max]: source token */
    int32_t *perm_row;    /* [R*T_max][K]: output row of (row, k), -1 = expert not here, -2 = dropped */
    int32_t *recv_prefix; /* [R+1]: first row of each source */
    int32_t *meta;        /* [2]: rows received (N_r), rows written without permute (min(N_r, limit)) */
    int32_t *local_row;   /* [T_max]: HT row of our own token t here (valid where send_row[t][rank] >= 0);
                             combine reads our own rows from x through it instead of pushing them */
    int64_t *bad;         /* [2]: 1 + token of a routing_map row with more than K true entries (0 = none),
                             the column of its first entry past K; the receive kernel clears it */
} epx_cuda_rm_handle_dev_t;

typedef struct epx_cuda_rm_args {
    epx_cuda_common_t c;
    epx_cuda_rm_handle_dev_t h;
    int64_t num_tokens;        /* T of this rank */
    int32_t num_experts;
    int32_t permute, pad_multiple;
    /* dispatch */
    const uint8_t *hidden;     /* [T][row_bytes] */
    int64_t row_bytes;
    const float *scales;       /* [T][num_scales] or NULL */
    int32_t num_scales;
    const uint8_t *routing_map; /* [T][E] */
    const float *probs;        /* [T][E] or NULL */
    uint8_t *tokens;
    float *out_scales;
    float *out_probs;          /* [limit][L] without permute, [limit] with */
    int32_t *tokens_per_expert;
    int32_t *num_tokens_out;
    uint8_t *local_map;        /* [local_map_rows][L] bool or NULL: received token i's local experts */
    int64_t local_map_rows;
    int64_t limit;             /* the bound, or the outputs' capacity without one */
    int32_t bounded;
    /* combine */
    const uint16_t *x;         /* [>= rows][H] bf16 */
    uint16_t *combined;        /* [T][H] bf16 */
    int32_t weighted;
} epx_cuda_rm_args_t;

int epx_cuda_launch_rm_dispatch(const epx_cuda_rm_args_t *args, void *stream);
int epx_cuda_launch_rm_combine(const epx_cuda_rm_args_t *args, void *stream);

/* ------------------------------------------------------ low-latency dispatch/combine (ll.cu) ---- */

/* Flags of the LL operations, at lay.ll of every region. Words indexed [slot][peer] are written by
 * that peer (system-scope release); the rest only by the owner. Values are collective epochs (the
 * ctrl's epoch counter, which LL operations advance like every other collective). */
typedef struct epx_cuda_ll_ctrl {
    uint64_t disp_flag[2][EPX_CUDA_MAX_RANKS]; /* [slot][src] epoch whose rows src placed here */
    uint64_t disp_ack[2][EPX_CUDA_MAX_RANKS];  /* [slot][dst] epoch dst finished reading our rows */
    uint64_t comb_flag[2][EPX_CUDA_MAX_RANKS]; /* [slot][expert rank] epoch of its combine rows */
    uint64_t comb_ack[2][EPX_CUDA_MAX_RANKS];  /* [slot][src] epoch src finished reading our rows */
    uint64_t disp_epoch[2];                    /* owner: epoch of the slot's last dispatch */
    uint64_t comb_epoch[2];                    /* owner: epoch of the slot's last combine */
    uint32_t done_counter[2][4];               /* owner: [slot][kernel] last-block detection (hooks of
                                                  both slots may run at once on two streams) */
    uint64_t refused[2][2];                    /* owner: [slot][0 dispatch, 1 combine] epoch of the
                                                  slot's call that this rank refused (a bad id in its
                                                  topk_idx): its receive half poisons, waits for nothing */
    /* Buffers across nodes (src/kernels/ll_net.cu), owner only: [slot] dispatches and combines of the
     * slot so far; the epoch of the first failed call (0: none), after which every call fails at once. */
    uint64_t net_disp[2];
    uint64_t net_comb[2];
    uint64_t net_failed;
} epx_cuda_ll_ctrl_t;

/* Absolute byte offsets of the LL areas inside a region (the same on every rank). */
typedef struct epx_cuda_ll_layout {
    uint64_t ctrl;       /* epx_cuda_ll_ctrl_t */
    uint64_t cnt;        /* [2][R][L] int32: rows source s placed for each of our local experts */
    uint64_t disp;       /* [2][L][R][T_max] rows of row_stride bytes: x, fp32 scales, int32 t, k */
    uint64_t comb;       /* [2][T_max][K][H] bf16: the expert rows of our tokens, by (t, k) */
    uint64_t zc;         /* [2][L][R*T_max][H] bf16: zero-copy combine input (owner only) */
    uint64_t meta;       /* [2][L][R*T_max] int2 (t, s * 64 + k) of each packed row (owner only) */
    uint64_t rcount;     /* [2][L] int32 rows received per local expert (owner only) */
    uint64_t total;      /* bytes of all LL areas */
    uint64_t row_stride; /* bytes per dispatch row; the last 16 hold t and k */
} epx_cuda_ll_layout_t;

/* LL on a buffer whose ranks span nodes: every LL byte goes through the network transport (net.h), to
 * the node's own ranks too; the region keeps only what no peer touches (ctrl, meta, rcount). Two
 * transport regions, the same offsets on every rank, one area per double-buffer slot:
 *  RECV (region 0): what peers put here;  SEND (region 1): what our puts read. */
enum { EPX_LL_NET_RECV = 0, EPX_LL_NET_SEND = 1 };
typedef struct epx_cuda_ll_net_layout {
    uint64_t recv_slot; /* bytes of one slot's RECV area */
    uint64_t r_cnt;     /* [R][L] int32: rows source s placed for each of our local experts */
    uint64_t r_disp;    /* [L][R][T_max] rows of row_stride bytes (as epx_cuda_ll_layout_t.disp) */
    uint64_t r_comb;    /* [T_max][K][H] bf16: the expert rows of our tokens, by (t, k) */
    uint64_t recv_bytes;
    uint64_t send_slot; /* bytes of one slot's SEND area */
    uint64_t s_cnt;     /* [E] int32: our rows per expert (rank r's at r * L) */
    uint64_t s_msg;     /* [T_max][row_stride]: each token's row, cast once */
    uint64_t s_tail;    /* [T_max][K][16]: (t, k) of each (token, destination) */
    uint64_t s_zc;      /* [L][R*T_max][H] bf16: combine input (the zero-copy view) */
    uint64_t send_bytes;
} epx_cuda_ll_net_layout_t;

/* Signals of the network path (each rank has 9R), counts of events, never reset: per slot DISP(s) source
 * s's rows landed, COMB(o) owner o's rows landed, DACK(r) r read our dispatch rows, CACK(r) r read our
 * combine rows; FAIL(s) s failed a call. Contexts: the dispatch of slot 0, 1, the combine of slot 0, 1. */
#define EPX_LL_NET_SIG_DISP(R, slot, s) ((uint32_t)((slot) * (R) + (s)))
#define EPX_LL_NET_SIG_COMB(R, slot, o) ((uint32_t)(2 * (R) + (slot) * (R) + (o)))
#define EPX_LL_NET_SIG_DACK(R, slot, r) ((uint32_t)(4 * (R) + (slot) * (R) + (r)))
#define EPX_LL_NET_SIG_CACK(R, slot, r) ((uint32_t)(6 * (R) + (slot) * (R) + (r)))
#define EPX_LL_NET_SIG_FAIL(R, s)       ((uint32_t)(8 * (R) + (s)))
#define EPX_LL_NET_SIGNALS(R)           (9 * (R))
#define EPX_LL_NET_CONTEXTS             4

typedef struct epx_cuda_ll_args {
    epx_cuda_common_t c;
    epx_cuda_ll_layout_t ll;
    /* Across nodes (net.transport != EPX_NET_TRANSPORT_NONE): the transport, its layout and our own
     * RECV and SEND regions. */
    epx_net_t net;
    epx_cuda_ll_net_layout_t nl;
    uint8_t *net_recv, *net_send;
    int32_t slot;
    int32_t num_experts;
    int32_t drop_disp;  /* release this slot's dispatch rows whose receive half never ran */
    int32_t drop_comb;  /* release this slot's combine rows whose receive half never ran */
    int32_t floor_only; /* benchmark floor: the same stores, no waits, flags or epochs */
    int32_t use_fp8, round_scale, use_ue8m0;
    int32_t phase; /* EPX_LL_PHASE_*: which half the launch runs (set by the launchers) */
    /* Benchmark timeline (NULL: off): per kernel k (EPX_LL_STAMP_*), [2k] the earliest block start
     * and [2k + 1] the latest warp end, in %globaltimer ns (one clock for every rank of a GPU). */
    unsigned long long *stamps;
    int64_t num_tokens;
    const void *topk_idx; /* [T][K] */
    int32_t idx_is_64;
    /* dispatch */
    const uint16_t *x;    /* [T][H] bf16 */
    void *recv_x;         /* [L][R*T_max][H] */
    void *recv_scales;
    int32_t *recv_count;  /* [L] */
    int32_t *src_info;    /* [L][R*T_max] or NULL */
    int64_t *layout_range; /* [L][R] or NULL */
    int32_t *cumulative;  /* [L] or NULL */
    /* combine */
    const uint16_t *y;    /* [L][R*T_max][H] bf16 */
    const float *topk_weights; /* [T][K] */
    uint16_t *combined_x; /* [T][H] */
} epx_cuda_ll_args_t;

enum { EPX_LL_PHASE_SEND, EPX_LL_PHASE_RECV };
enum { EPX_LL_STAMP_DISP_SEND, EPX_LL_STAMP_DISP_RECV, EPX_LL_STAMP_COMB_SEND, EPX_LL_STAMP_COMB_RECV,
       EPX_LL_STAMP_KERNELS };

int epx_cuda_launch_ll_dispatch_send(const epx_cuda_ll_args_t *args, void *stream);
int epx_cuda_launch_ll_dispatch_recv(const epx_cuda_ll_args_t *args, void *stream);
int epx_cuda_launch_ll_combine_send(const epx_cuda_ll_args_t *args, void *stream);
int epx_cuda_launch_ll_combine_recv(const epx_cuda_ll_args_t *args, void *stream);
/* This rank fails the collective about to get the next epoch: release both combine slots and, with
 * drop_disp, the dispatch slot `slot`, so the peers' next LL calls do not wait for us. */
int epx_cuda_launch_ll_fail(const epx_cuda_ll_args_t *args, void *stream);
/* The same four halves on a buffer across nodes (src/kernels/ll_net.cu): `dispatch` 1 or 0 (combine),
 * `phase` EPX_LL_PHASE_*. */
int epx_cuda_launch_ll_net(const epx_cuda_ll_args_t *args, int dispatch, int32_t phase, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* EPX_KERNELS_CONTRACT_H */
