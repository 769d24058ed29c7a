/*
 * What the API entry points share beyond the argument checks of api/check.h: the checks of each
 * collective call, handle lifetimes (api/handle.c), and shorthands for the checks every
 * operation writes.
 */
#ifndef EPX_API_API_H
#define EPX_API_API_H

#include "api/check.h"

#ifdef __cplusplus
extern "C" {
#endif

#define BIT(d)       EPX_DTYPE_BIT(EPX_DTYPE_##d)
#define INDEX_DTYPES (BIT(INT32) | BIT(INT64))

/* Checks tensor `t` against a spec written inline; the enclosing function has `comm`. */
#define CHECK_TENSOR(t, ...) EPX_CHECK(epx_api_check_tensor(comm, (t), &(epx_tensor_spec_t){__VA_ARGS__}))
#define ARG_ERR(...)         EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, __VA_ARGS__)

/* The first checks of an operation (epx_api_read_call): `op` names it, `fn` is its entry in the
 * backend's table. The enclosing function has buffer, args, outputs and their copies a and o. */
#define READ_CALL(mode, op, fn)                                                                        \
    EPX_CHECK(epx_api_read_call(buffer, (mode), (op), buffer->ops->fn != NULL, a, sizeof(*a), args, o, \
                                sizeof(*o), outputs))

/* Writes one [out] field back when the caller's struct is large enough to hold it. */
#define WRITE_OUT(dst, src, type, field)                                             \
    do {                                                                             \
        if ((src)->size >= EPX_STRUCT_END(type, field)) (dst)->field = (src)->field; \
    } while (0)

/* The checks of each collective call (api/ht.c, api/ll.c, api/rm.c; api/collective.c runs them),
 * one signature for all: read the caller's args and outputs over the defaults already in a and o,
 * then check every argument against the buffer. `seq` is the call's own number (an LL combine
 * is later than the dispatch its handle names). Nothing is written to the caller's memory. */
#define EPX_API_CHECK_FN(op)                                                                          \
    epx_result_t epx_api_check_##op(epx_buffer_t buffer, uint64_t seq, const epx_##op##_args_t *args, \
                                    const epx_##op##_outputs_t *outputs, epx_##op##_args_t *a,        \
                                    epx_##op##_outputs_t *o)
EPX_API_CHECK_FN(ht_dispatch);
EPX_API_CHECK_FN(ht_combine);
EPX_API_CHECK_FN(ll_dispatch);
EPX_API_CHECK_FN(ll_combine);
EPX_API_CHECK_FN(rm_dispatch);
EPX_API_CHECK_FN(rm_combine);

/* Numbers a collective call of `kind` on `buffer` (held by the calling thread) and announces it
 * to the peers (backend begin_call) before any check, so a refused call is announced too
 * (api/collective.c). Returns the call's number. */
uint64_t epx_api_collective_begin(epx_buffer_t buffer, epx_call_kind_t kind);

/* A new handle for dispatch call `seq` of T tokens of `dtype`; when out of memory, the peers are
 * told (the call fails; `stream` is the call's). */
epx_result_t epx_api_handle_new(epx_buffer_t buffer, uint64_t seq, epx_handle_kind_t kind, int64_t T,
                                epx_dtype_t dtype, int32_t permute, void *stream, epx_handle_t *handle_out);
/* The backend's verdict `res` on filling a new handle: on success the handle is live (counted
 * on its buffer), on failure it is freed, the failure's message kept. Returns `res`. */
epx_result_t epx_api_handle_filled(epx_handle_t h, epx_result_t res);

/* ---------------------------------------------------------------- the object registry ---- */

/* Every object a caller holds is registered (api/registry.c) from creation until its destroy, and
 * its address stays known as destroyed after that. Entry points find their objects there under
 * one lock before reading them, so a stale or foreign pointer is refused without touching its
 * memory (EPX_ERR_INVALID_USAGE when it was destroyed), and take the object for the calling
 * thread: one thread at a time per comm and per buffer (a handle counts as part of its buffer). */
typedef enum epx_api_kind { EPX_API_COMM = 1, EPX_API_BUFFER, EPX_API_HANDLE } epx_api_kind_t;
typedef enum epx_api_state { EPX_API_UNKNOWN, EPX_API_LIVE, EPX_API_DESTROYED } epx_api_state_t;

/* Records `obj` as live (EPX_ERR_OUT_OF_MEMORY when the table cannot grow); its address may be
 * that of a destroyed object. */
epx_result_t epx_api_register(const void *obj, epx_api_kind_t kind);
/* Records `obj` as destroyed, before its memory is freed. */
void epx_api_retire(const void *obj);
/* The registry's lock, for readers that look an object up and copy from it under it. */
void epx_api_registry_lock(void);
void epx_api_registry_unlock(void);
epx_api_state_t epx_api_lookup_locked(const void *obj, epx_api_kind_t kind);

/* The start of an entry point (`fn` names it): clears the thread's error, finds the object and
 * takes it (its comm's or buffer's busy flag) for this thread. EPX_ERR_INVALID_ARG for NULL or a
 * pointer never made by the library, EPX_ERR_INVALID_USAGE for a destroyed object or one another
 * thread is inside. enter_handle takes the handle's buffer and returns it. */
epx_result_t epx_api_enter_comm(epx_comm_t comm, const char *fn);
/* enter_comm's checks without taking it, for the calls any thread may make (the async error):
 * on success the registry's lock is held, for the caller to read and unlock. */
epx_result_t epx_api_find_comm(epx_comm_t comm, const char *fn);
epx_result_t epx_api_enter_buffer(epx_buffer_t buffer, const char *fn);
epx_result_t epx_api_enter_handle(epx_handle_t handle, const char *fn, epx_buffer_t *buffer_out);
/* Gives the object back: every path out of an entry that took it. */
void epx_api_leave_comm(epx_comm_t comm);
void epx_api_leave_buffer(epx_buffer_t buffer);

/* An entry point's body: returns `call` (an expression over `buffer`) run while the buffer is
 * taken for this thread. */
#define EPX_API_HOLDING_BUFFER(buffer, fn, call)         \
    do {                                                 \
        EPX_CHECK(epx_api_enter_buffer((buffer), (fn))); \
        epx_result_t holding_res_ = (call);              \
        epx_api_leave_buffer(buffer);                    \
        return holding_res_;                             \
    } while (0)

#ifdef __cplusplus
}
#endif

#endif /* EPX_API_API_H */
