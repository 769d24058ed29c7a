/*
 * The core of the test GIN plugin: the operations NCCL's proxy thread posts through iput / iputSignal
 * on one context (one GIN collective communicator), kept in a bounded list and issued by progress
 * through a mover (memcpy and __atomic on the CPU, CUDA IPC copies later), with GIN's ordering rules,
 * fault injection and a teardown bounded by a deadline. Needs neither CUDA nor NCCL.
 *
 * Ordering (the rules of src/net/net.h, which a real NIC honours and nothing more):
 *  - the puts of a context may land in any order;
 *  - a STRONG signal is applied only after every put posted earlier on its context, and its own put,
 *    has completed; a WEAK signal only after its own put; signals are otherwise unordered.
 * Failure: the first failed operation (injected, or reported by the mover) puts the context in the
 * error state, like a queue pair in error: every operation not yet complete fails with a message
 * naming rank, peer, context and operation kind, and later posts are rejected. A signal whose
 * covered put failed is therefore never applied.
 * Threads: every call takes the context's mutex and never waits on anything else; ginq_close is the
 * only call that sleeps, and never past its deadline.
 */
#ifndef EPX_GIN_PLUGIN_QUEUE_H
#define EPX_GIN_PLUGIN_QUEUE_H

#include <stddef.h>
#include <stdint.h>

typedef enum ginq_result {
    GINQ_OK = 0,
    GINQ_EINVAL = 1,    /* an argument out of range: nothing was posted or changed */
    GINQ_EFULL = 2,     /* the context holds `capacity` requests not yet reported done */
    GINQ_ECLOSED = 3,   /* the context is closing or closed */
    GINQ_EFAILED = 4,   /* the operation (or the context, earlier) failed */
    GINQ_ETIMEDOUT = 5, /* close abandoned operations at its deadline */
    GINQ_ENOMEM = 6,
} ginq_result_t;

const char *ginq_result_name(ginq_result_t res);

/* Values equal NCCL's NCCL_NET_SIGNAL_OP_INC / _ADD, so the plugin passes iputSignal's signalOp on. */
typedef enum ginq_signal_op {
    GINQ_SIGNAL_NONE = 0,
    GINQ_SIGNAL_INC = 1, /* add 1 */
    GINQ_SIGNAL_ADD = 2, /* add signal_value */
} ginq_signal_op_t;

/* A registered region, symmetric over the ranks: the core checks offsets against `size`; only the
 * mover knows where the region lies on each rank (mover_data). */
typedef struct ginq_region {
    size_t size;
    void *mover_data;
} ginq_region_t;

/* One operation as iput / iputSignal describe it: bytes from (src, src_off) on the posting rank to
 * (dst, dst_off) on `peer`, then, with a signal, an atomic add on the 64-bit word at (signal,
 * signal_off) on `peer`. bytes == 0 with a signal is a signal alone. */
typedef struct ginq_desc {
    int peer;
    const ginq_region_t *src;
    uint64_t src_off;
    const ginq_region_t *dst;
    uint64_t dst_off;
    size_t bytes;
    ginq_signal_op_t signal_op;
    const ginq_region_t *signal;
    uint64_t signal_off;
    uint64_t signal_value;
    int signal_weak; /* 0: strong (NCCL 2.28's v11 proxy knows only strong signals) */
} ginq_desc_t;

/* An operation as the mover sees it. `ordinal` counts the context's posts from 1. */
typedef struct ginq_op {
    ginq_desc_t desc;
    int rank;
    int context;
    uint64_t ordinal;
    uint64_t signal_add; /* what the signal adds: 1 for INC, signal_value for ADD */
} ginq_op_t;

/* How operations move. Each start_* call begins one transfer and gives a token that poll reports on;
 * a transfer may complete inside start_* (poll then reports done at once). Calls come under the
 * context's mutex, from whichever thread drives progress or close; they must not block. On failure
 * a call returns non-zero (poll: -1) and writes a message of at most msg_len bytes into msg. */
typedef struct ginq_mover {
    void *state;
    int (*start_put)(void *state, const ginq_op_t *op, uint64_t *token, char *msg, size_t msg_len);
    int (*start_signal)(void *state, const ginq_op_t *op, uint64_t *token, char *msg, size_t msg_len);
    /* 1: done, 0: in flight, -1: failed. */
    int (*poll)(void *state, uint64_t token, char *msg, size_t msg_len);
    /* Optional: the token will never be polled again (done, or abandoned by close while in flight). */
    void (*release)(void *state, uint64_t token, int abandoned);
} ginq_mover_t;

/* Faults, from a string such as "delay_us=200,reorder=1,fail_nth=17,seed=3" (EPX_GIN_TEST_FAULTS):
 *   delay_us=N   hold operations N microseconds after their post before issuing them;
 *   delay_nth=K  hold only the K-th operation of each context (with delay_us), not every one;
 *   reorder=1    issue a context's puts in a seeded shuffled order and defer weak signals at random
 *                (strong signals still wait for the puts they cover);
 *   fail_nth=K   the K-th operation of each context (in post order, from 1) fails instead of issuing;
 *   seed=S       the seed of reorder's shuffle. */
typedef struct ginq_faults {
    uint64_t delay_us;
    uint64_t delay_nth;
    int reorder;
    uint64_t fail_nth;
    uint64_t seed;
} ginq_faults_t;

#define GINQ_FAULTS_ENV "EPX_GIN_TEST_FAULTS"

/* Parses `spec` (NULL or "" means no faults) into *out; on a bad key or value returns GINQ_EINVAL
 * with a message naming it in err, *out untouched. */
ginq_result_t ginq_faults_parse(const char *spec, ginq_faults_t *out, char *err, size_t err_len);

typedef struct ginq_config {
    int rank;     /* the posting rank, for messages */
    int nranks;   /* peers are 0 .. nranks-1 */
    int context;  /* this context's index, for messages */
    int capacity; /* requests held at most (posted and not yet reported done by ginq_test) */
    ginq_faults_t faults;
} ginq_config_t;

typedef struct ginq ginq_t;
typedef struct ginq_req ginq_req_t;

/* Creates a context; on bad configuration returns GINQ_EINVAL with the reason in err, *out untouched.
 * The mover is copied; its state must outlive the context. */
ginq_result_t ginq_create(const ginq_config_t *cfg, const ginq_mover_t *mover, char *err, size_t err_len,
                          ginq_t **out);

/* Posts one operation; *req_out is set only on GINQ_OK and stays valid until ginq_test reports it
 * done or failed. Rejections (EINVAL, EFULL, ECLOSED, EFAILED for a context in error) leave a message
 * for ginq_message. Issues nothing itself: progress does. */
ginq_result_t ginq_post(ginq_t *q, const ginq_desc_t *desc, ginq_req_t **req_out);

/* One pass: polls transfers in flight, issues what the ordering rules and faults allow, retires
 * completed operations. Returns GINQ_EFAILED once the context is in error, else GINQ_OK. */
ginq_result_t ginq_progress(ginq_t *q);

/* Reports on one request: *done = 0 while pending (GINQ_OK); *done = 1 with GINQ_OK when complete or
 * GINQ_EFAILED when failed, the failure's message in msg (may be NULL). Either way a request reported
 * done is released and its handle is invalid afterwards. Runs no progress. */
ginq_result_t ginq_test(ginq_t *q, ginq_req_t *req, int *done, char *msg, size_t msg_len);

/* Stops accepting posts and drives progress until every posted operation has completed, but for at
 * most deadline_ms: then each operation still queued or in flight fails ("abandoned at close") and
 * GINQ_ETIMEDOUT is returned with a message counting them. GINQ_EFAILED when the context was already
 * in error (the failure's message), GINQ_OK when everything drained. Never blocks past the deadline
 * (plus one progress pass). Requests stay testable until ginq_destroy. */
ginq_result_t ginq_close(ginq_t *q, uint64_t deadline_ms);
/* ginq_close for a close that began spent_ms ago (the caller drained for that long) with a deadline of
 * deadline_ms in all: it ends at what is left of it, and its messages count the whole close. */
ginq_result_t ginq_close_after(ginq_t *q, uint64_t spent_ms, uint64_t deadline_ms);

/* Frees the context and every request handle it gave. Call ginq_close first when operations may be
 * in flight: destroy abandons them without waiting. NULL is ignored. */
void ginq_destroy(ginq_t *q);

/* 1 when the context is in error (the first failure's message copied into msg), else 0. */
int ginq_failed(ginq_t *q, char *msg, size_t msg_len);

/* The most recent message (rejection or failure) of the context, "" when none. */
void ginq_message(ginq_t *q, char *msg, size_t msg_len);

/* Operations posted and not yet complete or failed (still queued or in flight). */
int ginq_outstanding(ginq_t *q);

#endif
