/*
 * The test GIN plugin's queue core (queue.h): a fixed pool of request slots per context, an active
 * list in post order, and progress passes that issue puts (in order, or shuffled under reorder),
 * signals when the puts they cover have completed, and retire what is done. One mutex per context.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "queue.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define GINQ_MSG_LEN 256

typedef enum part_state { PART_NONE = 0, PART_WAIT, PART_ISSUED, PART_DONE } part_state_t;
typedef enum slot_state { SLOT_FREE = 0, SLOT_ACTIVE, SLOT_DONE, SLOT_FAILED } slot_state_t;

struct ginq_req {
    ginq_op_t op;
    slot_state_t state;
    part_state_t put, sig;
    uint64_t put_token, sig_token;
    uint64_t hold_until_ns;
    struct ginq_req *prev, *next; /* the active list in post order; `next` links the free list */
    char msg[GINQ_MSG_LEN];
};

struct ginq {
    pthread_mutex_t mutex;
    ginq_config_t cfg;
    ginq_mover_t mover;
    ginq_req_t *slots;
    ginq_req_t *free_list;
    ginq_req_t *head, *tail; /* active: posted, neither complete nor failed */
    ginq_req_t **candidates; /* scratch for one pass, capacity entries */
    int held;                /* slots not free */
    int outstanding;         /* slots active */
    uint64_t posted;
    uint64_t rng;
    int closing;
    int failed;
    char failure[GINQ_MSG_LEN];
    char message[GINQ_MSG_LEN];
};

const char *ginq_result_name(ginq_result_t res)
{
    switch (res) {
    case GINQ_OK: return "GINQ_OK";
    case GINQ_EINVAL: return "GINQ_EINVAL";
    case GINQ_EFULL: return "GINQ_EFULL";
    case GINQ_ECLOSED: return "GINQ_ECLOSED";
    case GINQ_EFAILED: return "GINQ_EFAILED";
    case GINQ_ETIMEDOUT: return "GINQ_ETIMEDOUT";
    case GINQ_ENOMEM: return "GINQ_ENOMEM";
    }
    return "GINQ_UNKNOWN";
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t next_rand(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void copy_text(char *dst, size_t len, const char *src)
{
    if (dst && len > 0) snprintf(dst, len, "%s", src);
}

static void set_message(ginq_t *q, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_message(ginq_t *q, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(q->message, sizeof(q->message), fmt, ap);
    va_end(ap);
}

static const char *op_kind(const ginq_op_t *op)
{
    if (op->desc.signal_op == GINQ_SIGNAL_NONE) return "put";
    return op->desc.bytes > 0 ? "put-signal" : "signal";
}

/* ---- faults ------------------------------------------------------------------------------------- */

static int parse_u64(const char *text, uint64_t *out)
{
    if (!text[0] || text[0] == '-' || text[0] == '+') return -1;
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno || *end) return -1;
    *out = (uint64_t)v;
    return 0;
}

ginq_result_t ginq_faults_parse(const char *spec, ginq_faults_t *out, char *err, size_t err_len)
{
    ginq_faults_t faults = {0};
    if (!out) {
        copy_text(err, err_len, "fault spec: no output given");
        return GINQ_EINVAL;
    }
    if (spec && spec[0]) {
        char *copy = strdup(spec);
        if (!copy) return GINQ_ENOMEM;
        char *save = NULL;
        for (char *item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
            char *eq = strchr(item, '=');
            uint64_t value = 0;
            if (!eq || parse_u64(eq + 1, &value)) {
                if (err && err_len)
                    snprintf(err, err_len, "fault spec '%s': '%s' is not key=unsigned", spec, item);
                free(copy);
                return GINQ_EINVAL;
            }
            *eq = '\0';
            if (!strcmp(item, "delay_us")) {
                faults.delay_us = value;
            } else if (!strcmp(item, "delay_nth")) {
                faults.delay_nth = value;
            } else if (!strcmp(item, "reorder") && value <= 1) {
                faults.reorder = (int)value;
            } else if (!strcmp(item, "fail_nth")) {
                faults.fail_nth = value;
            } else if (!strcmp(item, "seed")) {
                faults.seed = value;
            } else {
                if (err && err_len)
                    snprintf(err, err_len,
                             "fault spec '%s': unknown key or bad value '%s' (keys: delay_us, delay_nth, "
                             "reorder=0|1, fail_nth, seed)",
                             spec, item);
                free(copy);
                return GINQ_EINVAL;
            }
        }
        free(copy);
    }
    *out = faults;
    return GINQ_OK;
}

/* ---- lifetime ----------------------------------------------------------------------------------- */

ginq_result_t ginq_create(const ginq_config_t *cfg, const ginq_mover_t *mover, char *err, size_t err_len,
                          ginq_t **out)
{
    const char *why = NULL;
    if (!cfg || !mover || !out)
        why = "missing config, mover or output";
    else if (cfg->nranks < 1)
        why = "nranks must be at least 1";
    else if (cfg->rank < 0 || cfg->rank >= cfg->nranks)
        why = "rank out of range";
    else if (cfg->capacity < 1)
        why = "capacity must be at least 1";
    else if (!mover->start_put || !mover->start_signal || !mover->poll)
        why = "mover lacks start_put, start_signal or poll";
    if (why) {
        if (err && err_len)
            snprintf(err, err_len, "gin queue (rank %d, context %d): %s", cfg ? cfg->rank : -1,
                     cfg ? cfg->context : -1, why);
        return GINQ_EINVAL;
    }
    ginq_t *q = calloc(1, sizeof(*q));
    if (!q) return GINQ_ENOMEM;
    q->slots = calloc((size_t)cfg->capacity, sizeof(*q->slots));
    q->candidates = calloc((size_t)cfg->capacity, sizeof(*q->candidates));
    if (!q->slots || !q->candidates || pthread_mutex_init(&q->mutex, NULL)) {
        free(q->slots);
        free(q->candidates);
        free(q);
        return GINQ_ENOMEM;
    }
    q->cfg = *cfg;
    q->mover = *mover;
    q->rng = cfg->faults.seed * 0x2545f4914f6cdd1dull + (uint64_t)cfg->context + 1;
    for (int i = cfg->capacity - 1; i >= 0; i--) {
        q->slots[i].next = q->free_list;
        q->free_list = &q->slots[i];
    }
    *out = q;
    return GINQ_OK;
}

static void release_tokens(ginq_t *q, ginq_req_t *r, int abandoned)
{
    if (!q->mover.release) return;
    if (r->put == PART_ISSUED) q->mover.release(q->mover.state, r->put_token, abandoned);
    if (r->sig == PART_ISSUED) q->mover.release(q->mover.state, r->sig_token, abandoned);
}

void ginq_destroy(ginq_t *q)
{
    if (!q) return;
    for (ginq_req_t *r = q->head; r; r = r->next) release_tokens(q, r, 1);
    pthread_mutex_destroy(&q->mutex);
    free(q->candidates);
    free(q->slots);
    free(q);
}

/* ---- list and failure --------------------------------------------------------------------------- */

static void unlink_active(ginq_t *q, ginq_req_t *r)
{
    if (r->prev)
        r->prev->next = r->next;
    else
        q->head = r->next;
    if (r->next)
        r->next->prev = r->prev;
    else
        q->tail = r->prev;
    r->prev = r->next = NULL;
    q->outstanding--;
}

/* Fails one active operation with its message; with `abandoned` its transfers in flight are given up. */
static void fail_one(ginq_t *q, ginq_req_t *r, const char *msg)
{
    release_tokens(q, r, 1);
    copy_text(r->msg, sizeof(r->msg), msg);
    r->state = SLOT_FAILED;
    unlink_active(q, r);
    copy_text(q->message, sizeof(q->message), msg);
}

/* Puts the context in error: `cause` failed, and so does everything else not yet complete. */
static void enter_error(ginq_t *q, ginq_req_t *cause, const char *why)
{
    char msg[GINQ_MSG_LEN];
    snprintf(msg, sizeof(msg), "rank %d: %s #%" PRIu64 " to peer %d on context %d failed: %s", q->cfg.rank,
             op_kind(&cause->op), cause->op.ordinal, cause->op.desc.peer, q->cfg.context, why);
    fail_one(q, cause, msg);
    if (!q->failed) {
        q->failed = 1;
        copy_text(q->failure, sizeof(q->failure), msg);
    }
    while (q->head) {
        ginq_req_t *r = q->head;
        char other[GINQ_MSG_LEN];
        snprintf(other, sizeof(other),
                 "rank %d: %s #%" PRIu64
                 " to peer %d on context %d abandoned: the context failed at %s #%" PRIu64,
                 q->cfg.rank, op_kind(&r->op), r->op.ordinal, r->op.desc.peer, q->cfg.context,
                 op_kind(&cause->op), cause->op.ordinal);
        fail_one(q, r, other);
    }
    copy_text(q->message, sizeof(q->message), msg);
}

/* ---- posting ------------------------------------------------------------------------------------ */

static int range_ok(const ginq_region_t *region, uint64_t off, uint64_t bytes)
{
    return region && off <= region->size && bytes <= region->size - off;
}

static const char *check_desc(const ginq_t *q, const ginq_desc_t *d)
{
    if (d->peer < 0 || d->peer >= q->cfg.nranks) return "peer out of range";
    if (d->signal_op != GINQ_SIGNAL_NONE && d->signal_op != GINQ_SIGNAL_INC &&
        d->signal_op != GINQ_SIGNAL_ADD)
        return "unknown signal op";
    if (d->bytes == 0 && d->signal_op == GINQ_SIGNAL_NONE) return "empty operation (no bytes, no signal)";
    if (d->bytes > 0 && !range_ok(d->src, d->src_off, d->bytes)) return "source range outside its region";
    if (d->bytes > 0 && !range_ok(d->dst, d->dst_off, d->bytes))
        return "destination range outside its region";
    if (d->signal_op != GINQ_SIGNAL_NONE) {
        if (d->signal_off % sizeof(uint64_t)) return "signal offset not 8-byte aligned";
        if (!range_ok(d->signal, d->signal_off, sizeof(uint64_t))) return "signal word outside its region";
    }
    return NULL;
}

ginq_result_t ginq_post(ginq_t *q, const ginq_desc_t *desc, ginq_req_t **req_out)
{
    if (!q) return GINQ_EINVAL;
    ginq_result_t res = GINQ_OK;
    pthread_mutex_lock(&q->mutex);
    const char *why = !desc || !req_out ? "missing descriptor or request output" : check_desc(q, desc);
    if (why) {
        set_message(q, "rank %d: post on context %d rejected: %s (peer %d of %d, %zu bytes)", q->cfg.rank,
                    q->cfg.context, why, desc ? desc->peer : -1, q->cfg.nranks, desc ? desc->bytes : 0);
        res = GINQ_EINVAL;
    } else if (q->closing) {
        set_message(q, "rank %d: post on context %d rejected: the context is closing", q->cfg.rank,
                    q->cfg.context);
        res = GINQ_ECLOSED;
    } else if (q->failed) {
        set_message(q, "rank %d: post on context %d rejected: the context is in error (%s)", q->cfg.rank,
                    q->cfg.context, q->failure);
        res = GINQ_EFAILED;
    } else if (!q->free_list) {
        set_message(q,
                    "rank %d: post on context %d rejected: %d requests held (capacity); test finished ones",
                    q->cfg.rank, q->cfg.context, q->held);
        res = GINQ_EFULL;
    } else {
        ginq_req_t *r = q->free_list;
        q->free_list = r->next;
        memset(r, 0, sizeof(*r));
        r->op.desc = *desc;
        r->op.rank = q->cfg.rank;
        r->op.context = q->cfg.context;
        r->op.ordinal = ++q->posted;
        r->op.signal_add = desc->signal_op == GINQ_SIGNAL_INC ? 1 : desc->signal_value;
        r->state = SLOT_ACTIVE;
        r->put = desc->bytes > 0 ? PART_WAIT : PART_NONE;
        r->sig = desc->signal_op != GINQ_SIGNAL_NONE ? PART_WAIT : PART_NONE;
        const ginq_faults_t *f = &q->cfg.faults;
        if (f->delay_us && (!f->delay_nth || f->delay_nth == r->op.ordinal))
            r->hold_until_ns = now_ns() + f->delay_us * 1000ull;
        r->prev = q->tail;
        if (q->tail)
            q->tail->next = r;
        else
            q->head = r;
        q->tail = r;
        q->held++;
        q->outstanding++;
        *req_out = r;
    }
    pthread_mutex_unlock(&q->mutex);
    return res;
}

/* ---- progress ----------------------------------------------------------------------------------- */

/* Starts one part (put or signal) of r, or fails it as injected; 0 on success. */
static int start_part(ginq_t *q, ginq_req_t *r, int signal_part)
{
    char why[GINQ_MSG_LEN] = "";
    int first_part = !signal_part || r->put == PART_NONE;
    if (first_part && q->cfg.faults.fail_nth == r->op.ordinal) {
        snprintf(why, sizeof(why), "injected fault (fail_nth=%" PRIu64 ")", q->cfg.faults.fail_nth);
        enter_error(q, r, why);
        return -1;
    }
    uint64_t token = 0;
    int rc = signal_part ? q->mover.start_signal(q->mover.state, &r->op, &token, why, sizeof(why))
                         : q->mover.start_put(q->mover.state, &r->op, &token, why, sizeof(why));
    if (rc) {
        enter_error(q, r, why[0] ? why : "the mover could not start it");
        return -1;
    }
    if (signal_part) {
        r->sig = PART_ISSUED;
        r->sig_token = token;
    } else {
        r->put = PART_ISSUED;
        r->put_token = token;
    }
    return 0;
}

/* Polls every transfer in flight; -1 when one failed (the context is then in error). */
static int poll_all(ginq_t *q)
{
    for (ginq_req_t *r = q->head; r; r = r->next) {
        for (int signal_part = 0; signal_part < 2; signal_part++) {
            part_state_t *part = signal_part ? &r->sig : &r->put;
            uint64_t token = signal_part ? r->sig_token : r->put_token;
            if (*part != PART_ISSUED) continue;
            char why[GINQ_MSG_LEN] = "";
            int rc = q->mover.poll(q->mover.state, token, why, sizeof(why));
            if (rc < 0) {
                enter_error(q, r, why[0] ? why : "the mover reported a failed transfer");
                return -1;
            }
            if (rc == 1) {
                *part = PART_DONE;
                if (q->mover.release) q->mover.release(q->mover.state, token, 0);
            }
        }
    }
    return 0;
}

static int due(const ginq_req_t *r, uint64_t now)
{
    return r->hold_until_ns <= now;
}

static int issue_puts(ginq_t *q, uint64_t now)
{
    int n = 0;
    for (ginq_req_t *r = q->head; r; r = r->next)
        if (r->put == PART_WAIT && due(r, now)) q->candidates[n++] = r;
    if (q->cfg.faults.reorder) {
        for (int i = n - 1; i > 0; i--) {
            int j = (int)(next_rand(&q->rng) % (uint64_t)(i + 1));
            ginq_req_t *t = q->candidates[i];
            q->candidates[i] = q->candidates[j];
            q->candidates[j] = t;
        }
    }
    for (int i = 0; i < n; i++) {
        /* Under reorder some puts wait a pass, so later posts overtake them; one always goes. */
        if (q->cfg.faults.reorder && i > 0 && (next_rand(&q->rng) & 1)) continue;
        if (start_part(q, q->candidates[i], 0)) return -1;
    }
    return 0;
}

static int issue_signals(ginq_t *q, uint64_t now)
{
    /* The lowest ordinal whose put has not completed: strong signals at or past it must wait. */
    uint64_t first_open_put = UINT64_MAX;
    for (ginq_req_t *r = q->head; r; r = r->next)
        if ((r->put == PART_WAIT || r->put == PART_ISSUED) && r->op.ordinal < first_open_put)
            first_open_put = r->op.ordinal;
    for (ginq_req_t *r = q->head, *next; r; r = next) {
        next = r->next;
        if (r->sig != PART_WAIT || !due(r, now)) continue;
        if (r->put == PART_WAIT || r->put == PART_ISSUED) continue;
        if (!r->op.desc.signal_weak && first_open_put < r->op.ordinal) continue;
        if (r->op.desc.signal_weak && q->cfg.faults.reorder && (next_rand(&q->rng) & 1)) continue;
        if (start_part(q, r, 1)) return -1;
    }
    return 0;
}

static void retire(ginq_t *q)
{
    for (ginq_req_t *r = q->head, *next; r; r = next) {
        next = r->next;
        if ((r->put == PART_NONE || r->put == PART_DONE) && (r->sig == PART_NONE || r->sig == PART_DONE)) {
            r->state = SLOT_DONE;
            unlink_active(q, r);
        }
    }
}

/* One pass with the mutex held. */
static void progress_locked(ginq_t *q)
{
    uint64_t now = now_ns();
    if (q->failed || issue_puts(q, now) || poll_all(q) || issue_signals(q, now) || poll_all(q)) return;
    retire(q);
}

ginq_result_t ginq_progress(ginq_t *q)
{
    if (!q) return GINQ_EINVAL;
    pthread_mutex_lock(&q->mutex);
    progress_locked(q);
    ginq_result_t res = q->failed ? GINQ_EFAILED : GINQ_OK;
    pthread_mutex_unlock(&q->mutex);
    return res;
}

/* ---- completion and teardown -------------------------------------------------------------------- */

ginq_result_t ginq_test(ginq_t *q, ginq_req_t *req, int *done, char *msg, size_t msg_len)
{
    if (!q || !done) return GINQ_EINVAL;
    ginq_result_t res = GINQ_OK;
    pthread_mutex_lock(&q->mutex);
    uintptr_t first = (uintptr_t)q->slots, at = (uintptr_t)req;
    int ours = at >= first && at < first + (size_t)q->cfg.capacity * sizeof(*req) &&
               (at - first) % sizeof(*req) == 0;
    if (!ours || req->state == SLOT_FREE) {
        set_message(q, "rank %d: test on context %d: request %p is not outstanding here", q->cfg.rank,
                    q->cfg.context, (void *)req);
        res = GINQ_EINVAL;
    } else if (req->state == SLOT_ACTIVE) {
        *done = 0;
    } else {
        *done = 1;
        if (req->state == SLOT_FAILED) {
            copy_text(msg, msg_len, req->msg);
            res = GINQ_EFAILED;
        }
        req->state = SLOT_FREE;
        req->next = q->free_list;
        q->free_list = req;
        q->held--;
    }
    pthread_mutex_unlock(&q->mutex);
    return res;
}

static const char *where_stuck(const ginq_req_t *r, uint64_t now)
{
    if (!due(r, now)) return "still held by the delay fault";
    if (r->put == PART_ISSUED || r->sig == PART_ISSUED) return "in flight";
    if (r->put == PART_WAIT) return "still queued";
    return "its signal waiting for earlier puts";
}

ginq_result_t ginq_close(ginq_t *q, uint64_t deadline_ms)
{
    return ginq_close_after(q, 0, deadline_ms);
}

ginq_result_t ginq_close_after(ginq_t *q, uint64_t spent_ms, uint64_t deadline_ms)
{
    if (!q) return GINQ_EINVAL;
    uint64_t now0 = now_ns(), spent_ns = spent_ms * 1000000ull;
    uint64_t start = now0 > spent_ns ? now0 - spent_ns : 0;
    uint64_t end = start + deadline_ms * 1000000ull;
    pthread_mutex_lock(&q->mutex);
    q->closing = 1;
    for (;;) {
        progress_locked(q);
        if (!q->head) break;
        uint64_t now = now_ns();
        if (now >= end) break;
        pthread_mutex_unlock(&q->mutex);
        uint64_t nap = end - now < 50000 ? end - now : 50000;
        struct timespec ts = {0, (long)nap};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&q->mutex);
    }
    ginq_result_t res = GINQ_OK;
    if (q->head) {
        uint64_t now = now_ns();
        int abandoned = 0;
        while (q->head) {
            ginq_req_t *r = q->head;
            char msg[GINQ_MSG_LEN];
            snprintf(msg, sizeof(msg),
                     "rank %d: %s #%" PRIu64 " to peer %d on context %d abandoned at close after %" PRIu64
                     " ms: %s",
                     q->cfg.rank, op_kind(&r->op), r->op.ordinal, r->op.desc.peer, q->cfg.context,
                     (uint64_t)((now - start) / 1000000ull), where_stuck(r, now));
            if (!q->failed) {
                q->failed = 1;
                copy_text(q->failure, sizeof(q->failure), msg);
            }
            fail_one(q, r, msg);
            abandoned++;
        }
        set_message(q,
                    "rank %d: context %d closed with %d operations abandoned after the %" PRIu64
                    " ms deadline (first: %s)",
                    q->cfg.rank, q->cfg.context, abandoned, deadline_ms, q->failure);
        res = GINQ_ETIMEDOUT;
    } else if (q->failed) {
        copy_text(q->message, sizeof(q->message), q->failure);
        res = GINQ_EFAILED;
    }
    pthread_mutex_unlock(&q->mutex);
    return res;
}

/* ---- queries ------------------------------------------------------------------------------------ */

int ginq_failed(ginq_t *q, char *msg, size_t msg_len)
{
    if (!q) return 0;
    pthread_mutex_lock(&q->mutex);
    int failed = q->failed;
    if (failed) copy_text(msg, msg_len, q->failure);
    pthread_mutex_unlock(&q->mutex);
    return failed;
}

void ginq_message(ginq_t *q, char *msg, size_t msg_len)
{
    if (!q) {
        copy_text(msg, msg_len, "");
        return;
    }
    pthread_mutex_lock(&q->mutex);
    copy_text(msg, msg_len, q->message);
    pthread_mutex_unlock(&q->mutex);
}

int ginq_outstanding(ginq_t *q)
{
    if (!q) return 0;
    pthread_mutex_lock(&q->mutex);
    int n = q->outstanding;
    pthread_mutex_unlock(&q->mutex);
    return n;
}
