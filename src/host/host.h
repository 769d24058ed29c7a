/*
 * Host (CPU) backend internals. Ranks are processes of one machine; each rank owns one
 * shared-memory region per buffer, mapped by every peer. Operations use a pull model: a rank
 * publishes its inputs in its own region, then every rank reads what it needs from its peers'
 * regions and writes its own outputs. Publications and completions are sequence numbers in
 * the region headers, so no global barrier is needed and hooks can split an operation.
 */
#ifndef EPX_HOST_HOST_H
#define EPX_HOST_HOST_H

#include <stdatomic.h>

#include "core/internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Areas of a rank's region. Each has an owner-written header and a payload whose format the
 * operation using it defines. An area is reused only after every peer reported done with it. */
typedef enum host_area {
    HOST_AREA_IN = 0,      /* HT / routing-map dispatch inputs: T_max token rows + metadata */
    HOST_AREA_COMBINE = 1, /* HT / routing-map combine inputs: R*T_max rows of fp32 width */
    HOST_AREA_LL_IN0 = 2,  /* LL dispatch inputs, slot 0 */
    HOST_AREA_LL_IN1 = 3,  /* LL dispatch inputs, slot 1 */
    HOST_AREA_LL_OUT0 = 4, /* LL combine inputs [L, R*T_max, H] bf16, slot 0 (zero-copy view) */
    HOST_AREA_LL_OUT1 = 5, /* slot 1 */
    HOST_AREA_COUNT = 6,
} host_area_t;

#define HOST_PUB_WORDS 16

/* What an owner publishes with an area: status and op-specific scalars (dtype, T, flags...). */
typedef struct host_pub {
    uint64_t seq;       /* collective sequence number */
    int32_t status;     /* EPX_SUCCESS or the owner's failure */
    int32_t op;         /* which call published (epx_call_kind_t) */
    int64_t words[HOST_PUB_WORDS];
} host_pub_t;

/* Owner-written control block of one area (cache-line separated). */
typedef struct host_area_ctrl {
    host_pub_t pub;                /* valid once pub_seq == pub.seq */
    _Atomic uint64_t pub_seq;      /* release-stored after payload and pub are written */
    char pad0[56];
    _Atomic uint64_t done_seq;     /* this rank finished reading peers' area for this seq */
    _Atomic uint64_t held_seq;     /* a pending hook of this rank will read peers' area for this seq */
    char pad1[48];
} host_area_ctrl_t;

/* Announcements of the latest calls kept in a region: a peer running the receive half of an older
 * call (an LL hook) still finds what that call was. */
#define HOST_CALL_RING 16

/* Start of every region. */
typedef struct host_region_hdr {
    uint64_t magic;
    int32_t rank;
    int32_t pid;
    _Atomic uint64_t failed_seq;   /* this rank failed collective call failed_seq */
    int32_t failed_status;
    _Atomic int32_t destroyed;     /* this rank destroyed its buffer: it reads and writes no more */
    _Atomic uint64_t verdict_seq;  /* this rank could complete call verdict_seq (host_verdict) */
    char pad[24];
    /* (seq << 8) | kind of call seq at [seq % HOST_CALL_RING], stored when the call starts */
    _Atomic uint64_t calls[HOST_CALL_RING];
    /* (seq << 8) | status of call seq at [seq % HOST_CALL_RING] when this rank failed it */
    _Atomic uint64_t failed_calls[HOST_CALL_RING];
    /* (low 32 bits of seq << 32) | what call seq works on, where its kind alone does not say it (an LL
     * combine: the low 32 bits of its dispatch's seq); stored before the call's first wait */
    _Atomic uint64_t call_details[HOST_CALL_RING];
    host_area_ctrl_t areas[HOST_AREA_COUNT];
} host_region_hdr_t;

/* The peer processes of a buffer, watched for exit (src/core/peers.c, shared with the cuda backend). */
typedef epx_peers_t host_peers_t;

/* Per-buffer state of the host backend. */
typedef struct host_buffer {
    epx_buffer_t buffer;
    int32_t rank, nranks;
    size_t region_bytes;
    size_t area_offset[HOST_AREA_COUNT];
    size_t area_bytes[HOST_AREA_COUNT];
    uint8_t **regions;                 /* [nranks] mappings; regions[rank] is our own */
    uint64_t last_pub_seq[HOST_AREA_COUNT]; /* what we last published into each area */
    uint64_t call_seq;                 /* the latest collective call started (begin_call) */
    void *ll_state;                    /* owned by ll.c (slots, pending hooks) */
    void *pool;                        /* thread pool (host_parallel_for) */
    uint8_t *ht_view[EPX_MAX_VIEW_AREAS]; /* HT dispatch outputs of view mode per area (private,
                                             src/host/ht.c) */
    size_t ht_view_bytes[EPX_MAX_VIEW_AREAS];
    host_peers_t peers;                /* opened first, closed last */
} host_buffer_t;

static inline host_region_hdr_t *host_hdr(const host_buffer_t *hb, int rank)
{
    return (host_region_hdr_t *)hb->regions[rank];
}
static inline uint8_t *host_area_ptr(const host_buffer_t *hb, int rank, host_area_t area)
{
    return hb->regions[rank] + hb->area_offset[area];
}

/* Creates this rank's region, maps every peer's (collective, through the comm's bootstrap) and
 * starts the worker pool; host_shm_fini undoes it without waiting on a peer (src/host/shm.c). */
epx_result_t host_shm_init(host_buffer_t *hb);
void host_shm_fini(host_buffer_t *hb);

/* The buffer's peer watcher (src/core/peers.c) under the host backend's names. */
static inline epx_result_t host_peers_open(host_peers_t *peers, epx_comm_t comm)
{
    return epx_peers_open(peers, comm);
}
static inline void host_peers_close(host_peers_t *peers)
{
    epx_peers_close(peers);
}
static inline int host_peer_exited(const host_peers_t *peers, int peer)
{
    return epx_peer_exited(peers, peer);
}

/* Area sizes for a normalized buffer config (0 for areas of modes not enabled). Every rank
 * computes the same numbers. */
void host_area_sizes(const epx_buffer_config_t *cfg, int nranks, size_t sizes_out[HOST_AREA_COUNT]);

/* Before writing our area: waits (bounded) until every peer reported done with what we last
 * published there. */
epx_result_t host_area_acquire(host_buffer_t *hb, host_area_t area);
/* Publishes our area for `seq` (payload already written): fills pub, then release-stores
 * pub_seq. */
void host_area_publish(host_buffer_t *hb, host_area_t area, uint64_t seq, epx_call_kind_t op, int32_t status,
                       const int64_t *words, int nwords);
/* Waits (bounded) for `peer`'s publication of `area` for `seq` and returns a copy of it.
 * EPX_ERR_MISMATCH when the peer announced another kind of call `seq` than ours;
 * EPX_ERR_REMOTE when the peer published a failure, failed call `seq`, destroyed its buffer or
 * exited;
 * EPX_ERR_TIMEOUT naming rank, peer, area, the awaited and the seen sequence numbers. */
epx_result_t host_area_wait(host_buffer_t *hb, int peer, host_area_t area, uint64_t seq, host_pub_t *pub_out);
/* Waits for every peer's publication (including our own) of `area` for `seq`; pubs_out may be
 * NULL or [nranks]. On failure of any peer, returns its error. */
epx_result_t host_area_wait_all(host_buffer_t *hb, host_area_t area, uint64_t seq, host_pub_t *pubs_out);
/* We finished reading peers' `area` for `seq` (also after a failure); a hold on it ends. */
void host_area_done(host_buffer_t *hb, host_area_t area, uint64_t seq);
/* A pending hook of ours will read peers' `area` for `seq` later: they keep it until host_area_done,
 * even after this rank failed a later call. */
void host_area_hold(host_buffer_t *hb, host_area_t area, uint64_t seq);
/* Marks collective call `seq` failed on this rank so waiting peers return EPX_ERR_REMOTE;
 * returns `res`. */
epx_result_t host_fail(host_buffer_t *hb, uint64_t seq, epx_result_t res);
/* The last step of a call before it writes any output or handle: every rank has learnt what it
 * receives and reports whether it can complete (`mine`). Returns EPX_SUCCESS only when every rank
 * can, so a call succeeds on all ranks or fails on all: a rank whose own check failed returns
 * `mine` (and tells the peers through host_fail), the others EPX_ERR_REMOTE naming it. Bounded;
 * notices dead, destroyed and mismatched peers. */
epx_result_t host_verdict(host_buffer_t *hb, uint64_t seq, epx_result_t mine);
/* ops->end_call: a failed call is told to the peers (host_fail); a successful one fails with
 * EPX_ERR_REMOTE when a peer failed this very call meanwhile. A timeout, and a peer that exited,
 * are kept as the comm's async error too. */
epx_result_t host_end_call(host_buffer_t *hb, uint64_t seq, epx_result_t res);
/* Announces collective call `seq` of `kind` in our region (ops->begin_call). */
void host_begin_call(host_buffer_t *hb, uint64_t seq, epx_call_kind_t kind);
/* Announces what call `seq` works on beyond its kind (an LL combine: its dispatch's seq), so that
 * ranks whose calls of one kind name different objects fail at once with EPX_ERR_MISMATCH. */
void host_call_detail(host_buffer_t *hb, uint64_t seq, uint64_t detail);
/* Tells the peers that we destroyed the buffer (ops->notify_destroy). */
void host_notify_destroy(host_buffer_t *hb);

/* One zeroed allocation cut into n parts of bytes[i] bytes, in order and 16-byte aligned; parts[i]
 * receives part i. A state made of several arrays is thus allocated, checked and freed once
 * (free() of the return value, which is parts[0]). NULL when out of memory. */
void *host_alloc_parts(int n, const size_t bytes[], void *parts[]);

/* Runs fn(ctx, begin, end) over [0, n) split across the buffer's worker threads (inline when
 * there is one thread or n is small). */
typedef void (*host_range_fn)(void *ctx, int64_t begin, int64_t end);
void host_parallel_for(host_buffer_t *hb, int64_t n, int64_t min_chunk, host_range_fn fn, void *ctx);

/* A topk_idx element (int32 or int64). Every id is in [-1, E) and none repeats within a token:
 * the API layer checked the values (epx_api_check_topk_idx) before any rank published them. */
static inline int64_t host_topk_at(const epx_tensor_t *t, int64_t i)
{
    return t->dtype == EPX_DTYPE_INT64 ? ((const int64_t *)t->data)[i] : ((const int32_t *)t->data)[i];
}

/* memcpy and memset of `bytes` that may be 0: a caller's empty tensor may have NULL data (the API
 * layer accepts it), which memcpy and memset must not see even for no bytes. */
static inline void host_copy(void *dst, const void *src, size_t bytes)
{
    if (bytes) memcpy(dst, src, bytes);
}

static inline void host_zero(void *dst, size_t bytes)
{
    if (bytes) memset(dst, 0, bytes);
}

/* The operations (types in core/internal.h): layout and HT in ht.c, LL in ll.c, routing map in
 * rm.c. */
epx_layout_op_t host_layout;
epx_ht_dispatch_op_t host_ht_dispatch;
epx_ht_combine_op_t host_ht_combine;
epx_ht_get_combine_input_op_t host_ht_get_combine_input;
epx_ll_dispatch_op_t host_ll_dispatch;
epx_ll_combine_op_t host_ll_combine;
epx_ll_get_combine_buffer_op_t host_ll_get_combine_buffer;
epx_hook_run_op_t host_hook_run;
epx_rm_dispatch_op_t host_rm_dispatch;
epx_rm_combine_op_t host_rm_combine;

/* LL state of a buffer with EPX_MODE_LL (ll.c). */
epx_result_t host_ll_init(host_buffer_t *hb);
void host_ll_fini(host_buffer_t *hb);

#ifdef __cplusplus
}
#endif

#endif /* EPX_HOST_HOST_H */
