/*
 * What the C files of the epx._epx extension share: the DLPack ABI, the module state, the object
 * layouts and the functions one file defines for the others. Every name shared between the files starts
 * with py_ so it cannot meet a library symbol when the extension links the library's objects.
 */
#ifndef EPX_PYTHON_EXT_H
#define EPX_PYTHON_EXT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stddef.h>
#include <stdint.h>

#include <epx/epx.h>

/* ------------------------------------------------------------------ DLPack (v0.8 ABI) ---- */

typedef struct {
    int32_t device_type;
    int32_t device_id;
} dl_device_t;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} dl_dtype_t;

typedef struct {
    void *data;
    dl_device_t device;
    int32_t ndim;
    dl_dtype_t dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} dl_tensor_t;

typedef struct dl_managed {
    dl_tensor_t dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct dl_managed *self);
} dl_managed_t;

enum { DL_INT = 0, DL_UINT = 1, DL_FLOAT = 2, DL_BFLOAT = 4, DL_BOOL = 6, DL_FLOAT8_E4M3FN = 10 };
enum { DL_CPU = 1, DL_CUDA = 2, DL_CUDA_HOST = 3 };

/* ------------------------------------------------------------------ module state ---- */

/* Result codes are 0..PY_NUM_RESULTS - 1 (the map's values are dense). */
enum {
    PY_NUM_RESULTS = 0
#define PY_COUNT_RESULT_(name, value, text) +1
    EPX_RESULT_MAP(PY_COUNT_RESULT_)
#undef PY_COUNT_RESULT_
};

typedef struct {
    PyObject *error_base;                    /* epx.EpxError */
    PyObject *error_classes[PY_NUM_RESULTS]; /* by result code */
    PyObject *numpy_empty, *numpy_dtypes[EPX_DTYPE_COUNT_];
    PyTypeObject *numpy_ndarray;
    PyObject *torch_empty, *torch_tensor_type, *torch_dtypes[EPX_DTYPE_COUNT_], *torch_fp8;
    PyObject *torch_uint8, *torch_current_stream;
    PyObject *torch_raw_stream; /* torch._C._cuda_getCurrentRawStream(index) -> int, where torch has it */
    PyObject *torch_strided;    /* torch.strided */
    PyObject *str_dlpack, *str_dlpack_device, *str_device, *str_dtype, *str_view;
    PyObject *str_stream, *str_cuda_stream, *str_base;
    PyObject *torch_from_dlpack; /* torch._C._from_dlpack, else torch.from_dlpack */
    PyObject *stale_view_error;  /* epx.StaleViewError */
    PyObject *copy_rows;         /* epx._copy_rows(dst, src, stream): device copies through torch */
    PyObject *own_copy;          /* epx._own_copy(a, stream): a copy of its own (numpy copy, torch clone) */
} py_state_t;

extern py_state_t py_state;

enum framework { FW_NUMPY = 1, FW_TORCH = 2 };

/* dtype hints: what an ambiguous DLPack dtype means for this argument. */
enum { HINT_NONE = 0, HINT_FP8 = 1, HINT_BOOL = 2 };

/* Handle kinds: the dispatch a Handle comes from. */
enum { HANDLE_HT = 1, HANDLE_RM = 2 };

/* Runs a library call with the GIL released: ranks wait on each other inside, other threads go on. */
#define WITHOUT_GIL(stmt)            \
    do {                             \
        Py_BEGIN_ALLOW_THREADS stmt; \
        Py_END_ALLOW_THREADS         \
    } while (0)

#define KWFN(f) (PyCFunction)(void (*)(void))(f)

/* ------------------------------------------------------------------ tensors of one call ---- */

/* Imported tensors keep their DLPack capsule (and so the producer's memory) until the call ends. */
#define MAX_TENSORS 16
typedef struct {
    PyObject *keep[MAX_TENSORS];
    int count;
} keep_t;

/* A tensor argument: the object (None or NULL = absent), its name in errors, its dtype hint. */
typedef struct {
    PyObject *obj;
    const char *name;
    int hint;
    epx_tensor_t *t;
} tensor_in_t;

/* What every tensor of one call shares: the framework and device of its reference tensor. */
typedef struct {
    int fw;
    int dl_device_type;
    int device_id;
    PyObject *device; /* torch.device of the reference tensor (borrowed from keep: dangles after
                       * py_keep_release, so take a reference before releasing keep) */
    PyObject *stream_arg;
    void *stream;
    int stream_resolved;
    int stream_is_torch_current; /* stream came from torch.cuda.current_stream() */
} call_ctx_t;

/* ------------------------------------------------------------------ objects ---- */

/* The kinds of library memory a View exports: untracked (the LL combine buffer, a copy's target), the HT
 * dispatch outputs (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights) and the HT combine input. */
enum { VIEW_PLAIN = 0, VIEW_RECV = 1, VIEW_CIN = 2 };

/* What a buffer's HT dispatch returns (Buffer(views=...)): outputs of their own, views valid until the
 * next dispatch into their area, or views that no dispatch reuses while they are alive. */
enum { VIEWS_OFF = 0, VIEWS_ON = 1, VIEWS_POOLED = 2 };

/* One area of a buffer's memory that the binding returns views of: a view area of the dispatch outputs
 * (epx_ht_dispatch_args_t.view_area) or the combine input. Every call that reuses the area starts a new
 * generation; views of earlier generations are stale. */
typedef struct {
    uint64_t gen;
    int live;            /* View objects of the current generation still referenced */
    int stale;           /* View objects of earlier generations still referenced */
    const char *lo, *hi; /* bytes the views of the area cover (stale ones included) */
    epx_handle_t handle; /* VIEW_CIN: the handle the current rows belong to (compared, never used) */
    int64_t rows;        /* rows of the current combine input, or of the latest recv_x */
    /* VIEW_RECV: the latest dispatch into the area (x NULL: none usable), for a combine that reads its
     * recv_x there (x_in_buffer = 2); when the area was last used (least recently used goes first); the
     * widest dtype dispatched into it (host: its array's size). */
    const void *x;
    epx_dtype_t dtype;
    uint64_t handle_id;
    uint64_t used;
    size_t elem_max;
} area_t;

typedef struct {
    PyObject_HEAD epx_comm_t comm;
    epx_topology_t topo;
    PyObject *allgather; /* bootstrap callbacks (Comm.from_callbacks); must live as long as comm */
    PyObject *barrier;
    PyObject *callback_error; /* first exception raised by a callback */
    int live_buffers;
    int pending_buffers; /* buffers whose destroy() waits for their views to go */
    int destroy_pending; /* destroy() ran while pending buffers remained: freed with the last one */
    PyObject *weakrefs;
    long owner_pid; /* the process that made it: a forked child never frees the library's objects */
} CommObject;

/* True in a process forked after `comm` was made: the library's objects are the parent's, and the
 * child's copies of their threads and locks are not to be touched (deallocation skips them). */
int py_foreign(const CommObject *comm);
/* Marks `comm` as made by this process (right after it is allocated). */
void py_comm_owned(CommObject *comm);

typedef struct {
    PyObject_HEAD epx_buffer_t buf;
    CommObject *comm;
    epx_buffer_config_t cfg;
    int32_t R, L;
    int live_handles;
    uint64_t collective_calls; /* collective calls (made or refused) this binding passed to the library */
    int views;                 /* VIEWS_*: what HT dispatch returns unless a call says otherwise */
    int num_areas;             /* view areas of the dispatch outputs (config.num_view_areas) */
    int destroy_pending;       /* destroy() ran while views were alive: freed with the last one */
    int plain_live;            /* alive views of no area (the LL combine buffer): they hold the buffer too */
    uint64_t handles_made;     /* numbers the HT handles (HandleObject.id) */
    uint64_t area_clock;       /* view-mode dispatches made (area_t.used) */
    uint64_t combines_by_source[3];       /* HT combines made, by x_in_buffer (0, 1, 2) */
    area_t recv[EPX_MAX_VIEW_AREAS], cin; /* VIEW_RECV areas and VIEW_CIN */
    PyObject *weakrefs;
    PyObject *dict;
} BufferObject;

typedef struct {
    PyObject_HEAD epx_handle_t handle;
    BufferObject *buffer;
    int kind; /* HANDLE_HT or HANDLE_RM */
    int permute;
    int fw;      /* framework of the dispatch: its combine input view is one of that framework */
    uint64_t id; /* the buffer's number for it (a freed handle's address may come back) */
    int64_t num_tokens;
    int64_t hidden;
} HandleObject;

/* What LL handles and hooks start with: the buffer they belong to and one more object they hold. */
typedef struct {
    PyObject_HEAD BufferObject *buffer;
    PyObject *held; /* LL handle: torch device of the dispatch, or NULL; hook: the outputs it writes */
} BufferChildObject;

typedef struct {
    BufferChildObject base;
    epx_ll_handle_t h;
    int fw;
} LLHandleObject;

/* A DLPack and buffer-protocol producer over library memory; keeps the buffer alive. */
typedef struct {
    PyObject_HEAD epx_tensor_t t;
    BufferObject *owner;
    int kind;            /* VIEW_* */
    area_t *area;        /* the owner's area it lies in (NULL: VIEW_PLAIN) */
    uint64_t gen;        /* generation of its area when made */
    epx_handle_t handle; /* VIEW_CIN: the handle it was made for */
} ViewObject;

extern PyTypeObject py_comm_type, py_buffer_type, py_handle_type, py_llhandle_type, py_hook_type,
    py_view_type;
extern PyTypeObject *py_layout_type, *py_ht_dispatch_type, *py_ht_combine_type, *py_ll_dispatch_type,
    *py_ll_combine_type, *py_rm_dispatch_type;

/* ------------------------------------------------------------------ _epx.c: errors ---- */

/* Raise the EpxError subclass of `res` with the library's detail for this thread; return NULL. */
PyObject *py_raise_epx(epx_result_t res);
/* An invalid argument the binding itself detects (dtype or device that has no epx equivalent). */
PyObject *py_raise_invalid(const char *fmt, ...);
/* The pending exception, normalised and with its traceback attached; the error indicator is cleared. */
PyObject *py_take_exception(void);
/* Refuses this rank's collective call of `kind` (epx_collective_t) on `buffer` for the exception
 * `exc` that stopped it before the library call, so the peers return EPX_ERR_REMOTE instead of
 * pairing it with this rank's next call. Nothing to do when the buffer was destroyed. Returns -1
 * with an exception set only when the refusal itself could not be made. */
int py_refuse(BufferObject *buffer, int kind, PyObject *exc);
/* py_refuse for the pending exception, which stays pending unchanged. */
void py_refuse_pending(BufferObject *buffer, int kind);

/* A collective method `name` of Buffer: its body (the block that follows) converts and checks the
 * inputs, then makes its library call through COLLECTIVE_CALL. When the body fails before that
 * call, the call is refused for the pending exception, which the method then raises. */
#define COLLECTIVE_METHOD(name, kind)                                                    \
    static PyObject *name##_body(BufferObject *self, PyObject *args, PyObject *kwargs);  \
    static PyObject *name(BufferObject *self, PyObject *args, PyObject *kwargs)          \
    {                                                                                    \
        const uint64_t calls = self->collective_calls;                                   \
        PyObject *result = name##_body(self, args, kwargs);                              \
        if (!result && self->collective_calls == calls) py_refuse_pending(self, (kind)); \
        return result;                                                                   \
    }                                                                                    \
    static PyObject *name##_body(BufferObject *self, PyObject *args, PyObject *kwargs)

/* The library call of a collective method (`stmt` assigns its result), counted and run without
 * the GIL. */
#define COLLECTIVE_CALL(self, stmt) \
    do {                            \
        (self)->collective_calls++; \
        WITHOUT_GIL(stmt);          \
    } while (0)

/* ------------------------------------------------------------------ _epx_dlpack.c ---- */

void py_keep_release(keep_t *k);
/* Sets the call's framework and device from its reference tensor (the first tensor argument). */
int py_ctx_init(call_ctx_t *ctx, keep_t *keep, PyObject *ref, PyObject *stream_arg);
/* Reads `obj` through DLPack into `t`. None leaves `t` absent (data NULL). */
int py_import_tensor(call_ctx_t *ctx, keep_t *keep, PyObject *obj, const char *name, int hint,
                     epx_tensor_t *t);
/* The stream the call runs on (explicit, else torch's current one for cuda tensors, else NULL). */
int py_stream_of(call_ctx_t *ctx, void **out);
/* Allocates a contiguous output through the call's framework and imports it into `t`. */
int py_alloc_tensor(call_ctx_t *ctx, keep_t *keep, epx_dtype_t dtype, int ndim, const int64_t *shape,
                    const char *name, PyObject **obj_out, epx_tensor_t *t);
/* obj[:n] when n is below its first dimension (the default HT mode sizes outputs for the worst case). */
int py_slice_rows(PyObject **obj, int64_t n, int64_t cap);
int py_ensure_numpy(void);
/* Picks up torch if the process imported it; the binding never imports torch itself. */
void py_refresh_torch(void);

/* ------------------------------------------------------------------ _epx_comm.c ---- */

PyObject *py_comm_init(PyObject *mod, PyObject *args, PyObject *kwargs);
PyObject *py_comm_init_callbacks(PyObject *mod, PyObject *args, PyObject *kwargs);
PyObject *py_comm_node_topology(PyObject *mod, PyObject *arg);
PyObject *py_comm_peer_path(PyObject *mod, PyObject *args);
PyObject *py_comm_barrier(PyObject *mod, PyObject *arg);

/* ------------------------------------------------------------------ _epx_types.c ---- */

/* Refuse a communicator, buffer or handle whose library object was destroyed. */
int py_comm_check(CommObject *self);
int py_buffer_check(BufferObject *self);
PyObject *py_buffer_destroy(BufferObject *self, PyObject *unused);
/* ... and a handle of the other kind (HANDLE_HT, HANDLE_RM). */
int py_handle_check(HandleObject *h, int kind);
/* A Handle over `h` (destroyed when the object cannot be made). */
HandleObject *py_handle_new(BufferObject *buffer, epx_handle_t h, int kind, int permute, int64_t num_tokens);
PyObject *py_llhandle_new(BufferObject *buffer, const epx_ll_handle_t *h, call_ctx_t *ctx);
/* The receive half of an LL call; `keep` (the outputs it writes) stays alive until it ran. */
PyObject *py_hook_new(BufferObject *buffer, const epx_hook_t *h, PyObject *keep);
/* Builds a struct sequence, stealing the references in items (NULL becomes None). */
PyObject *py_make_result(PyTypeObject *type, int n, PyObject **items);
/* Creates the result struct-sequence types and adds them to the module. */
int py_add_result_types(PyObject *m);

/* ------------------------------------------------------------------ _epx_views.c ---- */

/* Where a tensor passed in lies among a buffer's views (py_view_classify). */
enum { AT_NONE = 0, AT_RECV, AT_RECV_STALE, AT_CIN, AT_CIN_STALE };

/* The VIEWS_* of `obj` (False, True or "pooled"). */
int py_views_mode(PyObject *obj, int *mode_out);
/* The value Buffer.views shows for a VIEWS_* mode. */
PyObject *py_views_value(int mode);
/* Library memory `t` of `buffer` as an array of framework `fw` (numpy, or torch on t's device) over a
 * new View counted in `area` (NULL: untracked). */
PyObject *py_view_export(BufferObject *buffer, const epx_tensor_t *t, area_t *area, epx_handle_t handle,
                         int fw);
/* A call is about to reuse `area`: its views so far become stale. */
void py_area_reuse(area_t *area);
/* The views just returned over `area`: the bytes they cover. */
void py_area_returned(area_t *area, const epx_tensor_t *views, int n);
/* Which of `buffer`'s views the tensor `t` (imported from `obj`) is; *area_out: the area it lies in;
 * *handle_out: a VIEW_CIN view's handle. */
int py_view_classify(BufferObject *buffer, PyObject *obj, const epx_tensor_t *t, area_t **area_out,
                     epx_handle_t *handle_out);
/* HT views of the buffer still referenced (its destroy waits for them). */
int py_views_alive(const BufferObject *buffer);
/* The view area an HT dispatch with `views_obj` (None: the buffer's mode) and this x writes, or NULL
 * for outputs of their own; *copy_out: the area is the pooled spare, whose outputs the call copies. */
int py_dispatch_area(BufferObject *buffer, PyObject *views_obj, int64_t num_worst, area_t **area_out,
                     int *copy_out);
/* Refuses a tensor of `in` that is a stale view of the buffer, or one that lies in `rewritten` (the
 * area the call is about to write; NULL: none). */
int py_check_views_in(BufferObject *buffer, const tensor_in_t *in, int n, const area_t *rewritten);
/* How an HT combine takes x (in[0]; in[1..n-1]: its other tensors): where it is (x_in_buffer 0), from
 * the combine input (1: x is combine_input(handle), else copied there on buffers with views), or as the
 * handle's dispatch view (2). Refuses stale views. */
int py_combine_source(BufferObject *buffer, HandleObject *h, const tensor_in_t *in, int n,
                      epx_ht_combine_args_t *a, PyObject *stream_obj);
/* Replaces each of the `n` arrays in `items` (NULL: absent) by a copy of its own, ordered on the call's
 * stream. */
int py_own_copies(PyObject **items, int n, PyObject *stream_obj);
/* Buffer.combine_input(handle). */
PyObject *py_buffer_combine_input(BufferObject *self, PyObject *args, PyObject *kwargs);
/* Frees the library buffer now (and the communicator when its destroy was waiting for it). */
void py_buffer_free(BufferObject *buffer);

/* ------------------------------------------------------------------ _epx_ops.c ---- */

extern PyMethodDef py_buffer_methods[];
PyObject *py_bench_ll_dispatch_c(PyObject *mod, PyObject *args);

#endif /* EPX_PYTHON_EXT_H */
