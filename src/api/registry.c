/*
 * The registry of the objects a caller holds (communicators, buffers, handles): every entry point
 * finds its object here, under one lock, before reading it, so a destroyed or foreign pointer is
 * refused without touching its memory, and takes the object for its thread (api/api.h).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"

/* Destroyed addresses kept to name the misuse; past this many the oldest knowledge is dropped
 * (a later stale call then reads as a foreign pointer, still without touching memory). */
#define RETIRED_MAX (1u << 20)

typedef struct entry {
    uintptr_t key; /* 0: empty */
    uint8_t kind;  /* epx_api_kind_t */
    uint8_t live;  /* 0: destroyed */
} entry_t;

/* Open addressing; entries are never removed one by one (no tombstones), only a destroyed one
 * turned live again when its address is reused, or all destroyed ones at a rebuild. */
static struct {
    pthread_mutex_t lock;
    entry_t *slots;
    size_t cap; /* power of two, or 0 */
    size_t used;
    size_t retired;
} reg_g = {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0, 0};

static size_t slot_of(uintptr_t key, size_t cap)
{
    return (size_t)(((uint64_t)key >> 4) * 0x9e3779b97f4a7c15ull >> 20) & (cap - 1);
}

static entry_t *find(uintptr_t key)
{
    if (!reg_g.cap) return NULL;
    for (size_t i = slot_of(key, reg_g.cap);; i = (i + 1) & (reg_g.cap - 1)) {
        if (reg_g.slots[i].key == key) return &reg_g.slots[i];
        if (reg_g.slots[i].key == 0) return NULL;
    }
}

/* Room for one more entry (a rebuild at twice the size, dropping destroyed entries past
 * RETIRED_MAX). Under the lock. */
static epx_result_t make_room(void)
{
    if (reg_g.cap && 2 * (reg_g.used + 1) <= reg_g.cap) return EPX_SUCCESS;
    const bool drop = reg_g.retired >= RETIRED_MAX;
    const size_t keep = drop ? reg_g.used - reg_g.retired : reg_g.used;
    size_t cap = 64;
    while (cap < 4 * (keep + 1)) cap *= 2;
    entry_t *slots = calloc(cap, sizeof(*slots));
    if (!slots) return epx_error(EPX_ERR_OUT_OF_MEMORY, "no memory for a registry of %zu objects", cap);
    for (size_t j = 0; j < reg_g.cap; j++) {
        const entry_t *e = &reg_g.slots[j];
        if (!e->key || (drop && !e->live)) continue;
        size_t i = slot_of(e->key, cap);
        while (slots[i].key) i = (i + 1) & (cap - 1);
        slots[i] = *e;
    }
    free(reg_g.slots);
    reg_g.slots = slots;
    reg_g.cap = cap;
    reg_g.used = keep;
    if (drop) reg_g.retired = 0;
    return EPX_SUCCESS;
}

epx_result_t epx_api_register(const void *obj, epx_api_kind_t kind)
{
    epx_result_t res = EPX_SUCCESS;
    pthread_mutex_lock(&reg_g.lock);
    entry_t *e = find((uintptr_t)obj);
    if (e) {
        if (!e->live) reg_g.retired--;
    } else if ((res = make_room()) == EPX_SUCCESS) {
        e = &reg_g.slots[slot_of((uintptr_t)obj, reg_g.cap)];
        while (e->key) e = e + 1 == reg_g.slots + reg_g.cap ? reg_g.slots : e + 1;
        e->key = (uintptr_t)obj;
        reg_g.used++;
    }
    if (e) {
        e->kind = (uint8_t)kind;
        e->live = 1;
    }
    pthread_mutex_unlock(&reg_g.lock);
    return res;
}

void epx_api_retire(const void *obj)
{
    pthread_mutex_lock(&reg_g.lock);
    entry_t *e = find((uintptr_t)obj);
    if (e && e->live) {
        e->live = 0;
        reg_g.retired++;
    }
    pthread_mutex_unlock(&reg_g.lock);
}

void epx_api_registry_lock(void)
{
    pthread_mutex_lock(&reg_g.lock);
}
void epx_api_registry_unlock(void)
{
    pthread_mutex_unlock(&reg_g.lock);
}

epx_api_state_t epx_api_lookup_locked(const void *obj, epx_api_kind_t kind)
{
    const entry_t *e = find((uintptr_t)obj);
    if (!e) return EPX_API_UNKNOWN;
    if (e->kind != kind) return e->live ? EPX_API_UNKNOWN : EPX_API_DESTROYED;
    return e->live ? EPX_API_LIVE : EPX_API_DESTROYED;
}

/* Takes `busy` for this thread or says who holds it. Under the lock (so destroy, which takes it
 * first, cannot free the object meanwhile). */
static epx_result_t take(atomic_int *busy, epx_comm_t comm, const char *what, const void *obj, const char *fn)
{
    int expected = 0;
    if (atomic_compare_exchange_strong_explicit(busy, &expected, 1, memory_order_acquire,
                                                memory_order_relaxed))
        return EPX_SUCCESS;
    return EPX_API_ERR(comm, EPX_ERR_INVALID_USAGE,
                       "%s: %s %p is in use by another thread (one thread at a time per %s; nothing was "
                       "done and no peer was told)",
                       fn, what, obj, what);
}

static epx_result_t destroyed(const char *what, const void *obj, const char *fn, const char *destroy_fn)
{
    return epx_error(EPX_ERR_INVALID_USAGE, "%s: %s %p was destroyed (%s) and may not be used again", fn,
                     what, obj, destroy_fn);
}

epx_result_t epx_api_find_comm(epx_comm_t comm, const char *fn)
{
    epx_error_clear();
    if (!comm) return epx_comm_check(comm, fn);
    epx_api_registry_lock();
    const epx_api_state_t state = epx_api_lookup_locked(comm, EPX_API_COMM);
    if (state == EPX_API_LIVE) return EPX_SUCCESS;
    epx_api_registry_unlock();
    if (state == EPX_API_DESTROYED) return destroyed("communicator", comm, fn, "epx_comm_destroy");
    /* A pointer never made here is not read: it may point anywhere, or nowhere. */
    return epx_error(EPX_ERR_INVALID_ARG,
                     "%s: comm %p is not a live communicator (destroyed, or not made by epx_comm_create)", fn,
                     (void *)comm);
}

epx_result_t epx_api_enter_comm(epx_comm_t comm, const char *fn)
{
    EPX_CHECK(epx_api_find_comm(comm, fn));
    epx_result_t res = take(&comm->busy, comm, "communicator", comm, fn);
    epx_api_registry_unlock();
    return res;
}

epx_result_t epx_api_enter_buffer(epx_buffer_t buffer, const char *fn)
{
    epx_error_clear();
    if (!buffer) return epx_error(EPX_ERR_INVALID_ARG, "buffer is NULL");
    epx_api_registry_lock();
    epx_result_t res;
    switch (epx_api_lookup_locked(buffer, EPX_API_BUFFER)) {
    case EPX_API_LIVE: res = take(&buffer->busy, buffer->comm, "buffer", buffer, fn); break;
    case EPX_API_DESTROYED: res = destroyed("buffer", buffer, fn, "epx_buffer_destroy"); break;
    default:
        res = epx_error(EPX_ERR_INVALID_ARG,
                        "buffer %p is not a live epx buffer (destroyed, or not made by "
                        "epx_buffer_create)",
                        (void *)buffer);
    }
    epx_api_registry_unlock();
    return res;
}

epx_result_t epx_api_enter_handle(epx_handle_t handle, const char *fn, epx_buffer_t *buffer_out)
{
    epx_error_clear();
    if (!handle) return epx_error(EPX_ERR_INVALID_ARG, "handle is NULL");
    epx_api_registry_lock();
    epx_result_t res;
    switch (epx_api_lookup_locked(handle, EPX_API_HANDLE)) {
    case EPX_API_LIVE:
        /* A live handle's buffer is live: it cannot be destroyed while it has handles. */
        res = take(&handle->buffer->busy, handle->buffer->comm, "buffer", handle->buffer, fn);
        if (res == EPX_SUCCESS) *buffer_out = handle->buffer;
        break;
    case EPX_API_DESTROYED: res = destroyed("handle", handle, fn, "epx_handle_destroy"); break;
    default:
        res = epx_error(EPX_ERR_INVALID_ARG, "handle %p is not a live handle%s", (void *)handle,
                        strcmp(fn, "epx_handle_destroy") == 0 ? " (destroyed twice?)" : "");
    }
    epx_api_registry_unlock();
    return res;
}

void epx_api_leave_comm(epx_comm_t comm)
{
    atomic_store_explicit(&comm->busy, 0, memory_order_release);
}
void epx_api_leave_buffer(epx_buffer_t buffer)
{
    atomic_store_explicit(&buffer->busy, 0, memory_order_release);
}
