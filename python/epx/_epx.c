/*
 * CPython extension over the epx C ABI: communicator, buffer, handle and hook objects. Tensors come
 * in through DLPack (__dlpack__) and outputs are allocated through the caller's framework (numpy in,
 * numpy out; torch in, torch out on the same device), so the binding never owns tensor memory.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

static PyObject *g_error_base;                          /* epx.EpxError */
static PyObject *g_error_classes[EPX_ERR_INTERNAL + 1]; /* by result code */
static PyObject *g_numpy_empty, *g_numpy_dtypes[EPX_DTYPE_COUNT_];
static PyObject *g_torch_empty, *g_torch_tensor_type, *g_torch_dtypes[EPX_DTYPE_COUNT_], *g_torch_fp8;
static PyObject *g_torch_uint8, *g_torch_current_stream;
static PyObject *g_str_dlpack, *g_str_dlpack_device, *g_str_device, *g_str_dtype, *g_str_view;
static PyObject *g_str_stream, *g_str_cuda_stream;
static PyTypeObject *g_numpy_ndarray;
static max_align_t g_empty_data; /* the data of zero-element tensors exported with a NULL pointer */

enum framework { FW_NUMPY = 1, FW_TORCH = 2 };

/* ------------------------------------------------------------------ errors ---- */

/* Raises the EpxError subclass of `res` with the library's detail for this thread. */
static PyObject *raise_result(epx_result_t res, const char *detail)
{
    const char *name = epx_result_name(res);
    const char *message = detail && detail[0] ? detail : epx_strerror(res);
    PyObject *cls =
        (res >= 0 && res <= EPX_ERR_INTERNAL && g_error_classes[res]) ? g_error_classes[res] : g_error_base;
    PyObject *exc = PyObject_CallFunction(cls, "s", message);
    if (!exc) return NULL;
    PyObject *py_name = PyUnicode_FromString(name), *py_msg = PyUnicode_FromString(message);
    PyObject *py_code = PyLong_FromLong((long)res);
    if (py_name && py_msg && py_code && PyObject_SetAttrString(exc, "result", py_name) == 0 &&
        PyObject_SetAttrString(exc, "message", py_msg) == 0 &&
        PyObject_SetAttrString(exc, "code", py_code) == 0)
        PyErr_SetObject(cls, exc);
    Py_XDECREF(py_name);
    Py_XDECREF(py_msg);
    Py_XDECREF(py_code);
    Py_DECREF(exc);
    return NULL;
}

static PyObject *raise_epx(epx_result_t res)
{
    /* Copy first: building the exception may call back into the library on this thread. */
    char detail[1024];
    snprintf(detail, sizeof(detail), "%s", epx_last_error_message());
    return raise_result(res, detail);
}

/* An invalid argument the binding itself detects (dtype or device that has no epx equivalent). */
static PyObject *raise_invalid(const char *fmt, ...)
{
    char detail[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof(detail), fmt, ap);
    va_end(ap);
    return raise_result(EPX_ERR_INVALID_ARG, detail);
}

/* ------------------------------------------------------------------ tensors in ---- */

/* Imported tensors keep their DLPack capsule (and so the producer's memory) until the call ends. */
#define MAX_TENSORS 16
typedef struct {
    PyObject *keep[MAX_TENSORS];
    int count;
} keep_t;

static void keep_release(keep_t *k)
{
    for (int i = 0; i < k->count; i++) Py_CLEAR(k->keep[i]);
    k->count = 0;
}

static int keep_add(keep_t *k, PyObject *obj)
{
    if (k->count == MAX_TENSORS) {
        Py_DECREF(obj);
        PyErr_SetString(PyExc_RuntimeError, "epx: too many tensors in one call");
        return -1;
    }
    k->keep[k->count++] = obj;
    return 0;
}

/* What every tensor of one call shares: the framework and device of its reference tensor. */
typedef struct {
    int fw;
    int dl_device_type;
    int device_id;
    PyObject *device; /* torch.device of the reference tensor (borrowed from keep: dangles after
                       * keep_release, so take a reference before releasing keep) */
    PyObject *stream_arg;
    void *stream;
    int stream_resolved;
    int stream_is_torch_current; /* stream came from torch.cuda.current_stream() */
} call_ctx_t;

/* dtype hints: what an ambiguous DLPack dtype means for this argument. */
enum { HINT_NONE = 0, HINT_FP8 = 1, HINT_BOOL = 2 };

static epx_dtype_t map_dtype(dl_dtype_t d, int hint)
{
    if (d.lanes != 1) return EPX_DTYPE_INVALID;
    switch (d.code) {
    case DL_BFLOAT: return d.bits == 16 ? EPX_DTYPE_BF16 : EPX_DTYPE_INVALID;
    case DL_FLOAT: return d.bits == 32 ? EPX_DTYPE_FP32 : EPX_DTYPE_INVALID;
    case DL_FLOAT8_E4M3FN: return d.bits == 8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_INVALID;
    case DL_INT: return d.bits == 32 ? EPX_DTYPE_INT32 : d.bits == 64 ? EPX_DTYPE_INT64 : EPX_DTYPE_INVALID;
    case DL_BOOL: return d.bits == 8 ? EPX_DTYPE_BOOL : EPX_DTYPE_INVALID;
    case DL_UINT:
        /* numpy has no bf16 or fp8: uint16 arrays carry bf16 bit patterns, uint8 ones fp8 or bools. */
        if (d.bits == 16) return EPX_DTYPE_BF16;
        if (d.bits == 8)
            return hint == HINT_FP8    ? EPX_DTYPE_FP8_E4M3
                   : hint == HINT_BOOL ? EPX_DTYPE_BOOL
                                       : EPX_DTYPE_UINT8;
        return EPX_DTYPE_INVALID;
    }
    return EPX_DTYPE_INVALID;
}

static void *resolve_stream(call_ctx_t *ctx);
static void refresh_torch(void);

/* Reads `obj` through DLPack into `t`. None leaves `t` absent (data NULL). */
static int import_tensor(call_ctx_t *ctx, keep_t *keep, PyObject *obj, const char *name, int hint,
                         epx_tensor_t *t)
{
    memset(t, 0, sizeof(*t));
    if (obj == NULL || obj == Py_None) return 0;
    PyObject *src = obj;
    Py_INCREF(src);
    /* torch's fp8 may not export through DLPack: export its bytes and keep the meaning here. */
    if (ctx->fw == FW_TORCH && g_torch_fp8 && PyObject_TypeCheck(obj, (PyTypeObject *)g_torch_tensor_type)) {
        PyObject *dt = PyObject_GetAttr(obj, g_str_dtype);
        if (!dt) goto fail_src;
        int is_fp8 = dt == g_torch_fp8;
        Py_DECREF(dt);
        if (is_fp8) {
            Py_DECREF(src);
            src = PyObject_CallMethodOneArg(obj, g_str_view, g_torch_uint8);
            if (!src) return -1;
            hint = HINT_FP8;
        }
    }
    PyObject *method = PyObject_GetAttr(src, g_str_dlpack);
    if (!method) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "epx: %s (%.100s) does not support the DLPack protocol (__dlpack__)",
                     name, Py_TYPE(obj)->tp_name);
        goto fail_src;
    }
    PyObject *capsule;
    if (ctx->dl_device_type == DL_CUDA) {
        /* The producer orders its pending work before the stream we run on. DLPack's stream numbers:
         * -1 = no synchronisation (a torch tensor consumed on torch's current stream, which already
         * orders its work: asking torch to sync would record an event per tensor, inside a capture
         * too), 1 = the legacy default stream (cudaStream_t 0), else the stream's handle. */
        void *s = resolve_stream(ctx);
        if (PyErr_Occurred()) {
            Py_DECREF(method);
            goto fail_src;
        }
        int same_stream = ctx->stream_is_torch_current && ctx->fw == FW_TORCH &&
                          PyObject_TypeCheck(src, (PyTypeObject *)g_torch_tensor_type);
        PyObject *stream = same_stream ? PyLong_FromLong(-1) : s ? PyLong_FromVoidPtr(s) : PyLong_FromLong(1);
        if (!stream) {
            Py_DECREF(method);
            goto fail_src;
        }
        PyObject *kwargs = Py_BuildValue("{OO}", g_str_stream, stream);
        Py_DECREF(stream);
        PyObject *empty = PyTuple_New(0);
        capsule = kwargs && empty ? PyObject_Call(method, empty, kwargs) : NULL;
        Py_XDECREF(empty);
        Py_XDECREF(kwargs);
    } else {
        capsule = PyObject_CallNoArgs(method);
    }
    Py_DECREF(method);
    if (!capsule) goto fail_src;
    Py_DECREF(src);
    if (keep_add(keep, capsule) != 0) return -1;
    dl_managed_t *m = PyCapsule_GetPointer(capsule, "dltensor");
    if (!m) return -1;
    const dl_tensor_t *d = &m->dl_tensor;
    if (d->ndim > EPX_MAX_DIMS) {
        raise_invalid("%s has %d dimensions; epx tensors have at most %d", name, (int)d->ndim, EPX_MAX_DIMS);
        return -1;
    }
    t->dtype = map_dtype(d->dtype, hint);
    if (t->dtype == EPX_DTYPE_INVALID) {
        raise_invalid("%s has DLPack dtype (code %d, %d bits, %d lanes), which is none of epx's dtypes (bf16 "
                      "as torch.bfloat16 or uint16 bit patterns, fp32, fp8_e4m3, int32, int64, bool, uint8)",
                      name, d->dtype.code, d->dtype.bits, d->dtype.lanes);
        return -1;
    }
    if (d->device.device_type == DL_CPU || d->device.device_type == DL_CUDA_HOST) {
        t->device_type = EPX_DEVICE_HOST;
    } else if (d->device.device_type == DL_CUDA) {
        t->device_type = EPX_DEVICE_CUDA;
    } else {
        raise_invalid("%s is on DLPack device type %d; epx takes host (cpu) or cuda memory", name,
                      (int)d->device.device_type);
        return -1;
    }
    t->device_id = d->device.device_id;
    t->data = (char *)d->data + d->byte_offset;
    t->ndim = d->ndim;
    int compact = 1, empty = 0;
    int64_t stride = 1;
    for (int i = d->ndim - 1; i >= 0; i--) {
        t->shape[i] = d->shape[i];
        if (d->strides) t->strides[i] = d->strides[i];
        /* A dimension of size 1 has no meaningful stride (frameworks put anything there). */
        if (d->strides && d->shape[i] != 1 && d->strides[i] != stride) compact = 0;
        stride *= d->shape[i] > 0 ? d->shape[i] : 1;
        empty |= d->shape[i] == 0;
    }
    /* Compact tensors go in as "contiguous"; others keep their strides and the library refuses them.
     * A tensor without elements has no layout to refuse (torch gives views of nothing any strides). */
    if (compact || empty) memset(t->strides, 0, sizeof(t->strides));
    /* torch exports tensors without elements with a NULL data pointer, which the library reads as an
     * absent optional tensor: a given empty tensor gets an address that is never dereferenced instead. */
    if (!d->data && empty) t->data = &g_empty_data;
    return 0;

fail_src:
    Py_DECREF(src);
    return -1;
}

/* Sets the call's framework and device from its reference tensor (the first tensor argument). */
static int ctx_init(call_ctx_t *ctx, keep_t *keep, PyObject *ref, PyObject *stream_arg)
{
    memset(ctx, 0, sizeof(*ctx));
    ctx->stream_arg = stream_arg;
    ctx->dl_device_type = DL_CPU;
    if (g_numpy_ndarray && PyObject_TypeCheck(ref, g_numpy_ndarray)) {
        ctx->fw = FW_NUMPY;
        return 0;
    }
    if (!g_torch_empty) refresh_torch();
    if (g_torch_tensor_type && PyObject_TypeCheck(ref, (PyTypeObject *)g_torch_tensor_type)) {
        ctx->fw = FW_TORCH;
        PyObject *device = PyObject_GetAttr(ref, g_str_device);
        if (!device || keep_add(keep, device) != 0) return -1;
        ctx->device = device;
    }
    PyObject *dev = PyObject_CallMethodNoArgs(ref, g_str_dlpack_device);
    if (!dev) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "epx: %.100s does not support the DLPack protocol (__dlpack_device__)",
                     Py_TYPE(ref)->tp_name);
        return -1;
    }
    int type = 0, id = 0;
    int ok = PyArg_ParseTuple(dev, "ii", &type, &id);
    Py_DECREF(dev);
    if (!ok) return -1;
    ctx->dl_device_type = type;
    ctx->device_id = id;
    if (!ctx->fw) {
        if (type != DL_CPU) {
            PyErr_Format(
                PyExc_TypeError,
                "epx: outputs for %.100s on a device cannot be allocated; pass torch tensors (or numpy "
                "arrays on the host)",
                Py_TYPE(ref)->tp_name);
            return -1;
        }
        ctx->fw = FW_NUMPY; /* any other host array: numpy outputs */
    }
    return 0;
}

/* The stream of the call: the explicit `stream=` value, else torch's current stream for cuda
 * tensors, else NULL (the host backend ignores it). */
static void *resolve_stream(call_ctx_t *ctx)
{
    if (ctx->stream_resolved) return ctx->stream;
    if (ctx->stream_arg && ctx->stream_arg != Py_None) {
        ctx->stream = PyLong_AsVoidPtr(ctx->stream_arg);
        ctx->stream_resolved = !PyErr_Occurred();
        return ctx->stream;
    }
    if (ctx->dl_device_type == DL_CUDA && ctx->fw == FW_TORCH && g_torch_current_stream) {
        PyObject *s = PyObject_CallOneArg(g_torch_current_stream, ctx->device);
        if (!s) return NULL;
        PyObject *ptr = PyObject_GetAttr(s, g_str_cuda_stream);
        Py_DECREF(s);
        if (!ptr) return NULL;
        ctx->stream = PyLong_AsVoidPtr(ptr);
        Py_DECREF(ptr);
        ctx->stream_is_torch_current = 1;
    }
    ctx->stream_resolved = !PyErr_Occurred();
    return ctx->stream;
}

static int stream_of(call_ctx_t *ctx, void **out)
{
    *out = resolve_stream(ctx);
    return PyErr_Occurred() ? -1 : 0;
}

/* ------------------------------------------------------------------ tensors out ---- */

static int ensure_numpy(void)
{
    if (g_numpy_empty) return 0;
    PyObject *np = PyImport_ImportModule("numpy");
    if (!np) return -1;
    g_numpy_empty = PyObject_GetAttrString(np, "empty");
    g_numpy_ndarray = (PyTypeObject *)PyObject_GetAttrString(np, "ndarray");
    PyObject *dtype = PyObject_GetAttrString(np, "dtype");
    static const char *names[EPX_DTYPE_COUNT_] = {NULL,    "uint16", "float32", "uint8",
                                                  "int32", "int64",  "bool",    "uint8"};
    for (int i = 1; i < EPX_DTYPE_COUNT_ && dtype; i++)
        g_numpy_dtypes[i] = PyObject_CallFunction(dtype, "s", names[i]);
    Py_XDECREF(dtype);
    Py_DECREF(np);
    return g_numpy_empty && g_numpy_ndarray ? 0 : -1;
}

/* Picks up torch if the process imported it; the binding never imports torch itself. */
static void refresh_torch(void)
{
    if (g_torch_empty) return;
    PyObject *modules = PyImport_GetModuleDict();
    PyObject *torch = PyDict_GetItemString(modules, "torch");
    if (!torch) return;
    PyObject *tensor = PyObject_GetAttrString(torch, "Tensor");
    PyObject *empty = PyObject_GetAttrString(torch, "empty");
    if (!tensor || !empty) {
        /* torch still importing (partially initialised): try again on the next call */
        PyErr_Clear();
        Py_XDECREF(tensor);
        Py_XDECREF(empty);
        return;
    }
    static const char *names[EPX_DTYPE_COUNT_] = {NULL,    "bfloat16", "float32", "uint8",
                                                  "int32", "int64",    "bool",    "uint8"};
    for (int i = 1; i < EPX_DTYPE_COUNT_; i++) g_torch_dtypes[i] = PyObject_GetAttrString(torch, names[i]);
    g_torch_uint8 = PyObject_GetAttrString(torch, "uint8");
    g_torch_fp8 = PyObject_GetAttrString(torch, "float8_e4m3fn");
    if (!g_torch_fp8) PyErr_Clear();
    PyObject *cuda = PyObject_GetAttrString(torch, "cuda");
    if (cuda) {
        g_torch_current_stream = PyObject_GetAttrString(cuda, "current_stream");
        Py_DECREF(cuda);
    }
    PyErr_Clear();
    g_torch_tensor_type = tensor;
    g_torch_empty = empty;
}

/* Allocates a contiguous output through the call's framework and imports it into `t`. *obj_out gets
 * the new reference the caller returns (for torch fp8, the float8 view of the exported bytes). */
static int alloc_tensor(call_ctx_t *ctx, keep_t *keep, epx_dtype_t dtype, int ndim, const int64_t *shape,
                        const char *name, PyObject **obj_out, epx_tensor_t *t)
{
    *obj_out = NULL;
    PyObject *py_shape = PyTuple_New(ndim);
    if (!py_shape) return -1;
    for (int i = 0; i < ndim; i++)
        PyTuple_SET_ITEM(py_shape, i, PyLong_FromLongLong(shape[i] > 0 ? shape[i] : 0));
    PyObject *obj = NULL;
    if (ctx->fw == FW_TORCH) {
        PyObject *kwargs = Py_BuildValue("{sOsO}", "dtype", g_torch_dtypes[dtype], "device", ctx->device);
        PyObject *args = PyTuple_Pack(1, py_shape);
        obj = kwargs && args ? PyObject_Call(g_torch_empty, args, kwargs) : NULL;
        Py_XDECREF(kwargs);
        Py_XDECREF(args);
    } else {
        obj = PyObject_CallFunctionObjArgs(g_numpy_empty, py_shape, g_numpy_dtypes[dtype], NULL);
    }
    Py_DECREF(py_shape);
    if (!obj) return -1;
    int hint = dtype == EPX_DTYPE_FP8_E4M3 ? HINT_FP8 : dtype == EPX_DTYPE_BOOL ? HINT_BOOL : HINT_NONE;
    if (import_tensor(ctx, keep, obj, name, hint, t) != 0) {
        Py_DECREF(obj);
        return -1;
    }
    if (ctx->fw == FW_TORCH && dtype == EPX_DTYPE_FP8_E4M3 && g_torch_fp8) {
        PyObject *view = PyObject_CallMethodOneArg(obj, g_str_view, g_torch_fp8);
        Py_DECREF(obj);
        if (!view) return -1;
        obj = view;
    }
    *obj_out = obj;
    return 0;
}

/* obj[:n] when n is below its first dimension (the default HT mode sizes outputs for the worst case). */
static int slice_rows(PyObject **obj, int64_t n, int64_t cap)
{
    if (!*obj || n >= cap) return 0;
    PyObject *s = PySequence_GetSlice(*obj, 0, (Py_ssize_t)n);
    if (!s) return -1;
    Py_SETREF(*obj, s);
    return 0;
}

/* ------------------------------------------------------------------ Comm ---- */

typedef struct {
    PyObject_HEAD epx_comm_t comm;
    epx_topology_t topo;
    PyObject *allgather; /* bootstrap callbacks (Comm.from_callbacks); must live as long as comm */
    PyObject *barrier;
    PyObject *callback_error; /* first exception raised by a callback */
    int live_buffers;
    PyObject *weakrefs;
} CommObject;

static PyTypeObject CommType;

static int comm_check(CommObject *self)
{
    if (!self->comm) {
        PyErr_SetString(PyExc_ValueError, "epx: the communicator was destroyed");
        return -1;
    }
    return 0;
}

static void comm_note_callback_error(CommObject *self)
{
    if (!self->callback_error) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb) PyException_SetTraceback(value, tb);
        self->callback_error = value;
        Py_XDECREF(type);
        Py_XDECREF(tb);
    } else {
        PyErr_Clear();
    }
}

static int cb_allgather(void *ctx, const void *send, void *recv, size_t bytes)
{
    CommObject *self = ctx;
    PyGILState_STATE gil = PyGILState_Ensure();
    int rc = -1;
    PyObject *arg = PyBytes_FromStringAndSize(send, (Py_ssize_t)bytes);
    PyObject *res = arg ? PyObject_CallOneArg(self->allgather, arg) : NULL;
    Py_XDECREF(arg);
    if (res) {
        Py_buffer view;
        if (PyObject_GetBuffer(res, &view, PyBUF_SIMPLE) == 0) {
            size_t want = bytes * (size_t)self->topo.nranks;
            if ((size_t)view.len == want) {
                memcpy(recv, view.buf, want);
                rc = 0;
            } else {
                PyErr_Format(PyExc_ValueError,
                             "epx: allgather callback returned %zd bytes, expected %zu (%zu x %d ranks)",
                             view.len, want, bytes, (int)self->topo.nranks);
            }
            PyBuffer_Release(&view);
        }
        Py_DECREF(res);
    }
    if (rc != 0) comm_note_callback_error(self);
    PyGILState_Release(gil);
    return rc;
}

static int cb_barrier(void *ctx)
{
    CommObject *self = ctx;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *res = PyObject_CallNoArgs(self->barrier);
    int rc = res ? 0 : -1;
    Py_XDECREF(res);
    if (rc != 0) comm_note_callback_error(self);
    PyGILState_Release(gil);
    return rc;
}

static int parse_backend(PyObject *obj, epx_backend_t *out)
{
    if (obj == NULL || obj == Py_None) {
        *out = EPX_BACKEND_AUTO;
        return 0;
    }
    const char *s = PyUnicode_Check(obj) ? PyUnicode_AsUTF8(obj) : NULL;
    if (s && strcmp(s, "auto") == 0)
        *out = EPX_BACKEND_AUTO;
    else if (s && strcmp(s, "host") == 0)
        *out = EPX_BACKEND_HOST;
    else if (s && strcmp(s, "cuda") == 0)
        *out = EPX_BACKEND_CUDA;
    else {
        PyErr_Format(PyExc_ValueError, "epx: backend = %R; use \"auto\", \"host\" or \"cuda\"", obj);
        return -1;
    }
    return 0;
}

static PyObject *comm_finish_init(CommObject *self, epx_result_t res)
{
    if (res != EPX_SUCCESS) {
        PyObject *cause = self->callback_error;
        self->callback_error = NULL;
        Py_DECREF(self);
        raise_epx(res);
        if (cause) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            PyException_SetCause(value, cause); /* steals cause */
            PyErr_Restore(type, value, tb);
        }
        return NULL;
    }
    res = epx_comm_get_topology(self->comm, &self->topo);
    if (res != EPX_SUCCESS) {
        Py_DECREF(self);
        return raise_epx(res);
    }
    return (PyObject *)self;
}

/* _epx.comm_init(cls, unique_id, rank, nranks, backend, cuda_device, timeout_ms) */
static PyObject *py_comm_init(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"cls", "unique_id", "rank", "nranks", "backend", "cuda_device", "timeout_ms", NULL};
    PyTypeObject *cls;
    Py_buffer uid;
    int rank, nranks, cuda_device = -1, timeout_ms = 0;
    PyObject *backend_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!y*ii|Oii", kw, &PyType_Type, &cls, &uid, &rank, &nranks,
                                     &backend_obj, &cuda_device, &timeout_ms))
        return NULL;
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    if (parse_backend(backend_obj, &cfg.backend) != 0 || !PyType_IsSubtype(cls, &CommType)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "epx: cls must be a subclass of epx.Comm");
        PyBuffer_Release(&uid);
        return NULL;
    }
    if (uid.len != EPX_UNIQUE_ID_BYTES) {
        PyErr_Format(PyExc_ValueError, "epx: unique_id has %zd bytes, expected %d (from epx.get_unique_id())",
                     uid.len, EPX_UNIQUE_ID_BYTES);
        PyBuffer_Release(&uid);
        return NULL;
    }
    epx_unique_id_t id;
    memcpy(id.internal, uid.buf, EPX_UNIQUE_ID_BYTES);
    PyBuffer_Release(&uid);
    cfg.cuda_device = cuda_device;
    cfg.timeout_ms = timeout_ms;
    CommObject *self = (CommObject *)cls->tp_alloc(cls, 0);
    if (!self) return NULL;
    epx_result_t res;
    Py_BEGIN_ALLOW_THREADS res = epx_comm_init(&id, rank, nranks, &cfg, &self->comm);
    Py_END_ALLOW_THREADS return comm_finish_init(self, res);
}

/* _epx.comm_init_callbacks(cls, allgather, barrier, rank, nranks, backend, cuda_device, timeout_ms) */
static PyObject *py_comm_init_callbacks(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"cls",     "allgather",   "barrier",    "rank", "nranks",
                         "backend", "cuda_device", "timeout_ms", NULL};
    PyTypeObject *cls;
    PyObject *allgather, *barrier, *backend_obj = NULL;
    int rank, nranks, cuda_device = -1, timeout_ms = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!OOii|Oii", kw, &PyType_Type, &cls, &allgather, &barrier,
                                     &rank, &nranks, &backend_obj, &cuda_device, &timeout_ms))
        return NULL;
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    if (parse_backend(backend_obj, &cfg.backend) != 0) return NULL;
    if (!PyType_IsSubtype(cls, &CommType) || !PyCallable_Check(allgather) || !PyCallable_Check(barrier)) {
        PyErr_SetString(PyExc_TypeError,
                        "epx: cls must subclass epx.Comm; allgather and barrier must be callable");
        return NULL;
    }
    cfg.cuda_device = cuda_device;
    cfg.timeout_ms = timeout_ms;
    CommObject *self = (CommObject *)cls->tp_alloc(cls, 0);
    if (!self) return NULL;
    Py_INCREF(allgather);
    Py_INCREF(barrier);
    self->allgather = allgather;
    self->barrier = barrier;
    self->topo.nranks = nranks; /* the allgather callback sizes its result with it */
    epx_bootstrap_callbacks_t cbs = {cb_allgather, cb_barrier, self};
    epx_result_t res;
    Py_BEGIN_ALLOW_THREADS res = epx_comm_init_callbacks(&cbs, rank, nranks, &cfg, &self->comm);
    Py_END_ALLOW_THREADS return comm_finish_init(self, res);
}

static PyObject *comm_destroy(CommObject *self, PyObject *unused)
{
    if (self->comm) {
        if (self->live_buffers > 0) {
            PyErr_Format(PyExc_RuntimeError,
                         "epx: %d buffer(s) of this communicator are alive; destroy them first",
                         self->live_buffers);
            return NULL;
        }
        epx_result_t res = epx_comm_destroy(self->comm);
        if (res != EPX_SUCCESS) return raise_epx(res);
        self->comm = NULL;
    }
    Py_RETURN_NONE;
}

static void comm_dealloc(CommObject *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakrefs) PyObject_ClearWeakRefs((PyObject *)self);
    /* Buffers hold a reference to their comm, so none is alive here. */
    if (self->comm) epx_comm_destroy(self->comm);
    Py_CLEAR(self->allgather);
    Py_CLEAR(self->barrier);
    Py_CLEAR(self->callback_error);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int comm_traverse(CommObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->allgather);
    Py_VISIT(self->barrier);
    Py_VISIT(self->callback_error);
    return 0;
}

static PyObject *comm_get_async_error(CommObject *self, PyObject *unused)
{
    if (comm_check(self) != 0) return NULL;
    epx_result_t res = epx_get_async_error(self->comm);
    if (res == EPX_SUCCESS) Py_RETURN_NONE;
    raise_epx(res);
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

static PyObject *comm_topo_get(CommObject *self, void *field)
{
    if (comm_check(self) != 0) return NULL;
    const char *f = field;
    const epx_topology_t *t = &self->topo;
    if (!strcmp(f, "rank")) return PyLong_FromLong(t->rank);
    if (!strcmp(f, "nranks")) return PyLong_FromLong(t->nranks);
    if (!strcmp(f, "local_rank")) return PyLong_FromLong(t->local_rank);
    if (!strcmp(f, "local_nranks")) return PyLong_FromLong(t->local_nranks);
    if (!strcmp(f, "ranks_per_nvlink_domain")) return PyLong_FromLong(t->ranks_per_nvlink_domain);
    if (!strcmp(f, "num_nvlink_domains")) return PyLong_FromLong(t->num_nvlink_domains);
    if (!strcmp(f, "cuda_device")) return PyLong_FromLong(t->cuda_device);
    if (!strcmp(f, "backend")) return PyUnicode_FromString(t->backend == EPX_BACKEND_CUDA ? "cuda" : "host");
    Py_RETURN_NONE;
}

static PyGetSetDef comm_getset[] = {
    {"rank", (getter)comm_topo_get, NULL, "This process's rank.", "rank"},
    {"nranks", (getter)comm_topo_get, NULL, "Number of ranks R.", "nranks"},
    {"local_rank", (getter)comm_topo_get, NULL, "Index among the ranks of this machine.", "local_rank"},
    {"local_nranks", (getter)comm_topo_get, NULL, "Ranks on this machine.", "local_nranks"},
    {"ranks_per_nvlink_domain", (getter)comm_topo_get, NULL, "D: ranks per NVLink domain.",
     "ranks_per_nvlink_domain"},
    {"num_nvlink_domains", (getter)comm_topo_get, NULL, "R / D.", "num_nvlink_domains"},
    {"backend", (getter)comm_topo_get, NULL, "The backend chosen: \"host\" or \"cuda\".", "backend"},
    {"cuda_device", (getter)comm_topo_get, NULL, "CUDA device ordinal, -1 for the host backend.",
     "cuda_device"},
    {NULL},
};

static PyMethodDef comm_methods[] = {
    {"destroy", (PyCFunction)comm_destroy, METH_NOARGS,
     "destroy()\n--\n\nFrees the communicator now (its buffers must be destroyed first). Not collective."},
    {"get_async_error", (PyCFunction)comm_get_async_error, METH_NOARGS,
     "get_async_error()\n--\n\nThe first asynchronous failure seen by this communicator's buffers as an "
     "EpxError instance (not raised), or None. Never blocks."},
    {NULL},
};

static PyTypeObject CommType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "epx._epx.Comm",
    .tp_basicsize = sizeof(CommObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "An epx communicator (create with Comm.from_unique_id, from_callbacks or from_torch).",
    .tp_dealloc = (destructor)comm_dealloc,
    .tp_traverse = (traverseproc)comm_traverse,
    .tp_methods = comm_methods,
    .tp_getset = comm_getset,
    .tp_weaklistoffset = offsetof(CommObject, weakrefs),
};

/* ------------------------------------------------------------------ Buffer ---- */

typedef struct {
    PyObject_HEAD epx_buffer_t buf;
    CommObject *comm;
    epx_buffer_config_t cfg;
    int32_t R, L;
    int live_handles;
    PyObject *weakrefs;
    PyObject *dict;
} BufferObject;

static PyTypeObject BufferType;

static int buffer_check(BufferObject *self)
{
    if (!self->buf) {
        PyErr_SetString(PyExc_ValueError, "epx: the buffer was destroyed");
        return -1;
    }
    return 0;
}

static int buffer_init(BufferObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"comm",  "max_tokens",      "hidden",           "num_topk", "num_experts",
                         "modes", "dispatch_dtypes", "max_pad_multiple", "num_sms",  "chunk_tokens",
                         NULL};
    CommObject *comm;
    long long max_tokens, hidden;
    int num_topk, num_experts, max_pad_multiple = 0, num_sms = 0, chunk_tokens = 0;
    unsigned int modes = 0, dtypes = 0;
    if (self->buf) {
        PyErr_SetString(PyExc_RuntimeError, "epx: Buffer.__init__ called twice");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!LLii|IIiii", kw, &CommType, &comm, &max_tokens, &hidden,
                                     &num_topk, &num_experts, &modes, &dtypes, &max_pad_multiple, &num_sms,
                                     &chunk_tokens))
        return -1;
    if (comm_check(comm) != 0) return -1;
    epx_buffer_config_t cfg = EPX_BUFFER_CONFIG_INIT;
    cfg.max_tokens = max_tokens;
    cfg.hidden = hidden;
    cfg.num_topk = num_topk;
    cfg.num_experts = num_experts;
    cfg.modes = modes;
    cfg.dispatch_dtypes = dtypes;
    cfg.max_pad_multiple = max_pad_multiple;
    cfg.num_sms = num_sms;
    cfg.chunk_tokens = chunk_tokens;
    epx_result_t res;
    epx_buffer_t buf = NULL;
    Py_BEGIN_ALLOW_THREADS res = epx_buffer_create(comm->comm, &cfg, &buf);
    Py_END_ALLOW_THREADS if (res != EPX_SUCCESS)
    {
        raise_epx(res);
        return -1;
    }
    if (ensure_numpy() != 0) PyErr_Clear(); /* numpy is optional when only torch tensors are used */
    self->buf = buf;
    self->cfg = cfg;
    self->R = comm->topo.nranks;
    self->L = num_experts / comm->topo.nranks;
    Py_INCREF(comm);
    self->comm = comm;
    comm->live_buffers++;
    return 0;
}

static void buffer_release(BufferObject *self)
{
    if (self->buf) {
        epx_buffer_destroy(self->buf);
        self->buf = NULL;
        self->comm->live_buffers--;
    }
}

static PyObject *buffer_destroy(BufferObject *self, PyObject *unused)
{
    if (self->buf) {
        if (self->live_handles > 0) {
            PyErr_Format(PyExc_RuntimeError,
                         "epx: %d handle(s) of this buffer are alive; destroy them (or drop them) first",
                         self->live_handles);
            return NULL;
        }
        epx_result_t res = epx_buffer_destroy(self->buf);
        if (res != EPX_SUCCESS) return raise_epx(res);
        self->buf = NULL;
        self->comm->live_buffers--;
    }
    Py_RETURN_NONE;
}

static void buffer_dealloc(BufferObject *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakrefs) PyObject_ClearWeakRefs((PyObject *)self);
    buffer_release(self);
    Py_CLEAR(self->comm);
    Py_CLEAR(self->dict);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int buffer_traverse(BufferObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->comm);
    Py_VISIT(self->dict);
    return 0;
}

static int buffer_clear(BufferObject *self)
{
    Py_CLEAR(self->dict);
    return 0;
}

/* ------------------------------------------------------------------ Handle (HT / routing map) ---- */

typedef struct {
    PyObject_HEAD epx_handle_t handle;
    BufferObject *buffer;
    int kind; /* 1 HT, 2 routing map */
    int permute;
    int64_t num_tokens;
    int64_t hidden;
} HandleObject;

static PyTypeObject HandleType;

static HandleObject *handle_new(BufferObject *buffer, epx_handle_t h, int kind, int permute,
                                int64_t num_tokens)
{
    HandleObject *self = PyObject_GC_New(HandleObject, &HandleType);
    if (!self) {
        epx_handle_destroy(h);
        return NULL;
    }
    self->handle = h;
    Py_INCREF(buffer);
    self->buffer = buffer;
    self->kind = kind;
    self->permute = permute;
    self->num_tokens = num_tokens;
    self->hidden = buffer->cfg.hidden;
    buffer->live_handles++;
    PyObject_GC_Track(self);
    return self;
}

static void handle_release(HandleObject *self)
{
    if (self->handle) {
        epx_handle_destroy(self->handle);
        self->handle = NULL;
        self->buffer->live_handles--;
    }
}

static PyObject *handle_destroy_m(HandleObject *self, PyObject *unused)
{
    handle_release(self);
    Py_RETURN_NONE;
}

static void handle_dealloc(HandleObject *self)
{
    PyObject_GC_UnTrack(self);
    handle_release(self);
    Py_CLEAR(self->buffer);
    PyObject_GC_Del(self);
}

static int handle_traverse(HandleObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->buffer);
    return 0;
}

static int handle_check(HandleObject *h, BufferObject *buffer, int kind)
{
    if (!h->handle) {
        PyErr_SetString(PyExc_ValueError, "epx: the handle was destroyed");
        return -1;
    }
    if (h->kind != kind) {
        PyErr_Format(PyExc_TypeError, "epx: the handle comes from a %s dispatch, this call needs a %s one",
                     h->kind == 1 ? "HT" : "routing-map", kind == 1 ? "HT" : "routing-map");
        return -1;
    }
    (void)buffer; /* a handle of another buffer is the library's to refuse, with its message */
    return 0;
}

static PyObject *handle_info(HandleObject *self, void *field)
{
    if (!self->handle) {
        PyErr_SetString(PyExc_ValueError, "epx: the handle was destroyed");
        return NULL;
    }
    epx_handle_info_t info;
    epx_result_t res;
    Py_BEGIN_ALLOW_THREADS res = epx_handle_get_info(self->handle, &info);
    Py_END_ALLOW_THREADS if (res != EPX_SUCCESS) return raise_epx(res);
    const char *f = field;
    if (!strcmp(f, "num_tokens")) return PyLong_FromLongLong(info.num_tokens);
    if (!strcmp(f, "num_recv_tokens")) return PyLong_FromLongLong(info.num_recv_tokens);
    if (!strcmp(f, "num_ranks")) return PyLong_FromLong(info.num_ranks);
    return PyLong_FromLong(info.num_local_experts);
}

static PyObject *handle_is_permuted(HandleObject *self, void *unused)
{
    return PyBool_FromLong(self->permute);
}

static PyGetSetDef handle_getset[] = {
    {"num_tokens", (getter)handle_info, NULL, "T this rank dispatched.", "num_tokens"},
    {"num_recv_tokens", (getter)handle_info, NULL,
     "N_r (HT, routing map) or P (permute); on cuda static modes this waits for the dispatch.",
     "num_recv_tokens"},
    {"num_ranks", (getter)handle_info, NULL, "R.", "num_ranks"},
    {"num_local_experts", (getter)handle_info, NULL, "L.", "num_local_experts"},
    {"permute", (getter)handle_is_permuted, NULL, "Routing-map handle of a dispatch with permute.", NULL},
    {NULL},
};

static PyMethodDef handle_methods[] = {
    {"destroy", (PyCFunction)handle_destroy_m, METH_NOARGS,
     "destroy()\n--\n\nFrees the handle now (otherwise when it is garbage-collected)."},
    {NULL},
};

static PyTypeObject HandleType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "epx.Handle",
    .tp_basicsize = sizeof(HandleObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Routing of one HT or routing-map dispatch, for its combine (and cached dispatch).",
    .tp_dealloc = (destructor)handle_dealloc,
    .tp_traverse = (traverseproc)handle_traverse,
    .tp_methods = handle_methods,
    .tp_getset = handle_getset,
};

/* ------------------------------------------------------------------ LL handle, hook, view ---- */

typedef struct {
    PyObject_HEAD epx_ll_handle_t h;
    BufferObject *buffer;
    int fw;
    PyObject *device; /* torch device of the dispatch, or NULL */
} LLHandleObject;

static PyTypeObject LLHandleType;

static void llhandle_dealloc(LLHandleObject *self)
{
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->buffer);
    Py_CLEAR(self->device);
    PyObject_GC_Del(self);
}

static int llhandle_traverse(LLHandleObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->buffer);
    Py_VISIT(self->device);
    return 0;
}

static PyMemberDef llhandle_members[] = {
    {"seq", T_ULONGLONG, offsetof(LLHandleObject, h.seq), READONLY, "Collective sequence number."},
    {"slot", T_INT, offsetof(LLHandleObject, h.slot), READONLY, "Double-buffer slot (0 or 1)."},
    {"num_tokens", T_INT, offsetof(LLHandleObject, h.num_tokens), READONLY, "T of the dispatch."},
    {NULL},
};

static PyTypeObject LLHandleType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "epx.LLHandle",
    .tp_basicsize = sizeof(LLHandleObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Identifies one LL dispatch; pass it to ll_combine and get_combine_buffer.",
    .tp_dealloc = (destructor)llhandle_dealloc,
    .tp_traverse = (traverseproc)llhandle_traverse,
    .tp_members = llhandle_members,
};

typedef struct {
    PyObject_HEAD epx_hook_t hook;
    BufferObject *buffer;
    PyObject *keep; /* the outputs the receive half writes: alive until it ran */
    int ran;
} HookObject;

static PyTypeObject HookType;

static void hook_dealloc(HookObject *self)
{
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->buffer);
    Py_CLEAR(self->keep);
    PyObject_GC_Del(self);
}

static int hook_traverse(HookObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->buffer);
    Py_VISIT(self->keep);
    return 0;
}

static PyObject *hook_call(HookObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"stream", NULL};
    PyObject *stream_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O", kw, &stream_obj)) return NULL;
    void *stream = NULL;
    if (stream_obj != Py_None) {
        stream = PyLong_AsVoidPtr(stream_obj);
        if (PyErr_Occurred()) return NULL;
    } else if (self->buffer->comm->topo.backend == EPX_BACKEND_CUDA && g_torch_current_stream) {
        PyObject *s = PyObject_CallNoArgs(g_torch_current_stream);
        PyObject *ptr = s ? PyObject_GetAttr(s, g_str_cuda_stream) : NULL;
        Py_XDECREF(s);
        if (!ptr) return NULL;
        stream = PyLong_AsVoidPtr(ptr);
        Py_DECREF(ptr);
    }
    epx_result_t res;
    Py_BEGIN_ALLOW_THREADS res = epx_hook_run(&self->hook, stream);
    Py_END_ALLOW_THREADS if (res != EPX_SUCCESS) return raise_epx(res);
    self->ran = 1;
    Py_CLEAR(self->keep);
    Py_RETURN_NONE;
}

static PyTypeObject HookType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "epx.Hook",
    .tp_basicsize = sizeof(HookObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "hook(stream=None)\n--\n\nRuns the receive half of an LL call made with return_recv_hook=True "
              "(once).",
    .tp_dealloc = (destructor)hook_dealloc,
    .tp_traverse = (traverseproc)hook_traverse,
    .tp_call = (ternaryfunc)hook_call,
};

static PyObject *hook_new(BufferObject *buffer, const epx_hook_t *h, PyObject *keep)
{
    HookObject *self = PyObject_GC_New(HookObject, &HookType);
    if (!self) return NULL;
    self->hook = *h;
    Py_INCREF(buffer);
    self->buffer = buffer;
    Py_XINCREF(keep);
    self->keep = keep;
    self->ran = 0;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

/* A DLPack producer over library memory (the zero-copy combine region); keeps the buffer alive. */
typedef struct {
    PyObject_HEAD epx_tensor_t t;
    PyObject *owner;
} ViewObject;

typedef struct {
    dl_managed_t m;
    int64_t shape[EPX_MAX_DIMS];
    PyObject *owner;
} view_managed_t;

static void view_managed_delete(dl_managed_t *m)
{
    view_managed_t *vm = (view_managed_t *)m;
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_XDECREF(vm->owner);
    PyGILState_Release(gil);
    free(vm);
}

static void view_capsule_destructor(PyObject *capsule)
{
    /* Not consumed: still ours to free. */
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        dl_managed_t *m = PyCapsule_GetPointer(capsule, "dltensor");
        if (m && m->deleter) m->deleter(m);
    }
}

static PyObject *view_dlpack(ViewObject *self, PyObject *args, PyObject *kwargs)
{
    view_managed_t *vm = calloc(1, sizeof(*vm));
    if (!vm) return PyErr_NoMemory();
    vm->m.dl_tensor.data = self->t.data;
    vm->m.dl_tensor.device.device_type = self->t.device_type == EPX_DEVICE_CUDA ? DL_CUDA : DL_CPU;
    vm->m.dl_tensor.device.device_id = self->t.device_type == EPX_DEVICE_CUDA ? self->t.device_id : 0;
    vm->m.dl_tensor.ndim = self->t.ndim;
    vm->m.dl_tensor.dtype = (dl_dtype_t){DL_BFLOAT, 16, 1};
    for (int i = 0; i < self->t.ndim; i++) vm->shape[i] = self->t.shape[i];
    vm->m.dl_tensor.shape = vm->shape;
    vm->m.dl_tensor.strides = NULL;
    vm->m.deleter = view_managed_delete;
    Py_INCREF(self->owner);
    vm->owner = self->owner;
    PyObject *capsule = PyCapsule_New(&vm->m, "dltensor", view_capsule_destructor);
    if (!capsule) view_managed_delete(&vm->m);
    return capsule;
}

static PyObject *view_dlpack_device(ViewObject *self, PyObject *unused)
{
    int cuda = self->t.device_type == EPX_DEVICE_CUDA;
    return Py_BuildValue("ii", cuda ? DL_CUDA : DL_CPU, cuda ? (int)self->t.device_id : 0);
}

/* Buffer protocol for numpy: bf16 as uint16 ("H"), writable. */
static int view_getbuffer(ViewObject *self, Py_buffer *view, int flags)
{
    int64_t n = 1;
    for (int i = 0; i < self->t.ndim; i++) n *= self->t.shape[i];
    if (self->t.device_type != EPX_DEVICE_HOST) {
        PyErr_SetString(PyExc_BufferError, "epx: device memory has no buffer protocol");
        return -1;
    }
    return PyBuffer_FillInfo(view, (PyObject *)self, self->t.data, (Py_ssize_t)(n * 2), 0, flags);
}

static void view_dealloc(ViewObject *self)
{
    Py_CLEAR(self->owner);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyBufferProcs view_as_buffer = {(getbufferproc)view_getbuffer, NULL};

static PyMethodDef view_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))view_dlpack, METH_VARARGS | METH_KEYWORDS, "DLPack export."},
    {"__dlpack_device__", (PyCFunction)view_dlpack_device, METH_NOARGS, "DLPack device."},
    {NULL},
};

static PyTypeObject ViewType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "epx._epx.View",
    .tp_basicsize = sizeof(ViewObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Library memory exported through DLPack and the buffer protocol.",
    .tp_dealloc = (destructor)view_dealloc,
    .tp_methods = view_methods,
    .tp_as_buffer = &view_as_buffer,
};

/* ------------------------------------------------------------------ result tuples ---- */

static PyStructSequence_Field layout_fields[] = {
    {"num_tokens_per_rank", "[R] int32"},
    {"num_tokens_per_expert", "[E] int32"},
    {"is_token_in_rank", "[T, R] bool"},
    {"num_tokens_per_domain", "[R / D] int32, or None with one NVLink domain"},
    {NULL},
};
static PyStructSequence_Desc layout_desc = {"epx.Layout", "Result of Buffer.get_dispatch_layout.",
                                            layout_fields, 4};

static PyStructSequence_Field ht_dispatch_fields[] = {
    {"recv_x", "[N_r, H] (or [num_worst_tokens, H]) in x's dtype"},
    {"recv_x_scales", "[N_r, H/128] float32 for fp8 x, else None"},
    {"recv_topk_idx", "[N_r, K] local expert ids (-1 elsewhere), topk_idx's dtype; None for cached"},
    {"recv_topk_weights", "[N_r, K] float32 when topk_weights was given, else None"},
    {"num_recv_tokens_per_expert", "[L] int32 rounded up to expert_alignment; None for cached"},
    {"handle", "epx.Handle for combine and cached dispatch"},
    {"num_recv_tokens", "N_r (int)"},
    {"num_recv_tokens_tensor", "[1] int32 holding N_r in the tensors' memory (static mode), else None"},
    {NULL},
};
static PyStructSequence_Desc ht_dispatch_desc = {"epx.DispatchOutput", "Result of Buffer.dispatch.",
                                                 ht_dispatch_fields, 8};

static PyStructSequence_Field ht_combine_fields[] = {
    {"combined_x", "[T, H] bf16"},
    {"combined_topk_weights", "[T, K] float32 when topk_weights was given, else None"},
    {NULL},
};
static PyStructSequence_Desc ht_combine_desc = {"epx.CombineOutput", "Result of Buffer.combine.",
                                                ht_combine_fields, 2};

static PyStructSequence_Field ll_dispatch_fields[] = {
    {"recv_x", "[L, R*T_max, H] bf16, or fp8_e4m3 with use_fp8"},
    {"recv_scales", "fp8: [L, H/128, R*T_max] float32 (storage order); ue8m0: [L, H/512, R*T_max] int32"},
    {"recv_count", "[L] int32"},
    {"src_info", "[L, R*T_max] int32 source token index"},
    {"layout_range", "[L, R] int64 (begin << 32) | count"},
    {"handle", "epx.LLHandle"},
    {"hook", "epx.Hook with return_recv_hook, else None"},
    {NULL},
};
static PyStructSequence_Desc ll_dispatch_desc = {"epx.LLDispatchOutput", "Result of Buffer.ll_dispatch.",
                                                 ll_dispatch_fields, 7};

static PyStructSequence_Field ll_combine_fields[] = {
    {"combined_x", "[T, H] bf16 (valid after the hook ran with return_recv_hook)"},
    {"hook", "epx.Hook with return_recv_hook, else None"},
    {NULL},
};
static PyStructSequence_Desc ll_combine_desc = {"epx.LLCombineOutput", "Result of Buffer.ll_combine.",
                                                ll_combine_fields, 2};

static PyStructSequence_Field rm_dispatch_fields[] = {
    {"tokens", "[N_r or P (or the bound), H] in hidden's dtype"},
    {"scaling_factor", "[rows, H/128] float32 for fp8, else None"},
    {"probs", "[rows, L] float32 without permute, [rows] with; None without probs"},
    {"tokens_per_expert", "[L] int32 padded counts with permute, else None"},
    {"handle", "epx.Handle for rm_combine"},
    {"num_tokens", "N_r or P (the bound when one was given)"},
    {"num_tokens_tensor",
     "[1] int32 holding the real count in the tensors' memory (with a bound), else None"},
    {NULL},
};
static PyStructSequence_Desc rm_dispatch_desc = {"epx.RoutingDispatchOutput", "Result of Buffer.rm_dispatch.",
                                                 rm_dispatch_fields, 7};

static PyTypeObject *LayoutType, *HTDispatchType, *HTCombineType, *LLDispatchType, *LLCombineType,
    *RMDispatchType;

/* Builds a struct sequence, stealing the references in items (NULL becomes None). */
static PyObject *make_result(PyTypeObject *type, int n, PyObject **items)
{
    PyObject *r = PyStructSequence_New(type);
    if (!r) {
        for (int i = 0; i < n; i++) Py_XDECREF(items[i]);
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        PyObject *v = items[i];
        if (!v) {
            v = Py_None;
            Py_INCREF(v);
        }
        PyStructSequence_SET_ITEM(r, i, v);
    }
    return r;
}

static void drop_all(int n, PyObject **items)
{
    for (int i = 0; i < n; i++) Py_CLEAR(items[i]);
}

/* ------------------------------------------------------------------ layout ---- */

static PyObject *buffer_layout(BufferObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"topk_idx", "stream", NULL};
    PyObject *topk_obj, *stream_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O", kw, &topk_obj, &stream_obj)) return NULL;
    if (buffer_check(self) != 0) return NULL;
    keep_t keep = {{0}, 0};
    call_ctx_t ctx;
    PyObject *items[4] = {NULL};
    epx_tensor_t topk;
    epx_layout_outputs_t out = EPX_LAYOUT_OUTPUTS_INIT;
    void *stream;
    if (ctx_init(&ctx, &keep, topk_obj, stream_obj) != 0) goto fail;
    if (import_tensor(&ctx, &keep, topk_obj, "topk_idx", HINT_NONE, &topk) != 0) goto fail;
    int64_t R = self->R, E = self->cfg.num_experts, T = topk.ndim >= 1 ? topk.shape[0] : 0;
    int64_t ndom = self->comm->topo.num_nvlink_domains;
    if (alloc_tensor(&ctx, &keep, EPX_DTYPE_INT32, 1, &R, "num_tokens_per_rank", &items[0],
                     &out.num_tokens_per_rank) != 0 ||
        alloc_tensor(&ctx, &keep, EPX_DTYPE_INT32, 1, &E, "num_tokens_per_expert", &items[1],
                     &out.num_tokens_per_expert) != 0 ||
        alloc_tensor(&ctx, &keep, EPX_DTYPE_BOOL, 2, (int64_t[]){T, R}, "is_token_in_rank", &items[2],
                     &out.is_token_in_rank) != 0)
        goto fail;
    if (ndom > 1 && alloc_tensor(&ctx, &keep, EPX_DTYPE_INT32, 1, &ndom, "num_tokens_per_domain", &items[3],
                                 &out.num_tokens_per_domain) != 0)
        goto fail;
    if (stream_of(&ctx, &stream) != 0) goto fail;
    epx_result_t res;
    Py_BEGIN_ALLOW_THREADS res = epx_get_dispatch_layout(self->buf, &topk, &out, stream);
    Py_END_ALLOW_THREADS keep_release(&keep);
    if (res != EPX_SUCCESS) {
        drop_all(4, items);
        return raise_epx(res);
    }
    return make_result(LayoutType, 4, items);
fail:
    keep_release(&keep);
    drop_all(4, items);
    return NULL;
}

/* ------------------------------------------------------------------ HT ---- */

static PyObject *buffer_dispatch(BufferObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"x",      "topk_idx",         "topk_weights",     "x_scales",
                         "handle", "expert_alignment", "num_worst_tokens", "stream",
                         NULL};
    PyObject *x_obj, *topk_obj = Py_None, *weights_obj = Py_None, *scales_obj = Py_None,
                     *handle_obj = Py_None;
    PyObject *stream_obj = Py_None;
    int expert_alignment = 1;
    long long num_worst = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|OOOOiLO", kw, &x_obj, &topk_obj, &weights_obj,
                                     &scales_obj, &handle_obj, &expert_alignment, &num_worst, &stream_obj))
        return NULL;
    if (buffer_check(self) != 0) return NULL;
    HandleObject *cached = NULL;
    if (handle_obj != Py_None) {
        if (!PyObject_TypeCheck(handle_obj, &HandleType)) {
            PyErr_SetString(PyExc_TypeError, "epx: handle must be an epx.Handle from Buffer.dispatch");
            return NULL;
        }
        cached = (HandleObject *)handle_obj;
        if (handle_check(cached, self, 1) != 0) return NULL;
    }
    keep_t keep = {{0}, 0};
    call_ctx_t ctx;
    PyObject *items[8] = {NULL};
    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
    if (ctx_init(&ctx, &keep, x_obj, stream_obj) != 0) goto fail;
    if (import_tensor(&ctx, &keep, x_obj, "x", HINT_FP8, &a.x) != 0 ||
        import_tensor(&ctx, &keep, scales_obj, "x_scales", HINT_NONE, &a.x_scales) != 0 ||
        import_tensor(&ctx, &keep, topk_obj, "topk_idx", HINT_NONE, &a.topk_idx) != 0 ||
        import_tensor(&ctx, &keep, weights_obj, "topk_weights", HINT_NONE, &a.topk_weights) != 0)
        goto fail;
    a.cached_handle = cached ? cached->handle : NULL;
    a.expert_alignment = expert_alignment;
    a.num_worst_tokens = num_worst;
    if (stream_of(&ctx, &a.stream) != 0) goto fail;

    int64_t H = self->cfg.hidden, K = self->cfg.num_topk, L = self->L;
    int64_t cap;
    if (cached) {
        epx_handle_info_t info;
        epx_result_t r = epx_handle_get_info(cached->handle, &info);
        if (r != EPX_SUCCESS) {
            raise_epx(r);
            goto fail;
        }
        cap = info.num_recv_tokens;
    } else {
        cap = num_worst > 0 ? num_worst : (int64_t)self->R * self->cfg.max_tokens;
    }
    epx_dtype_t xd = a.x.dtype == EPX_DTYPE_INVALID ? EPX_DTYPE_BF16 : a.x.dtype;
    if (alloc_tensor(&ctx, &keep, xd, 2, (int64_t[]){cap, H}, "recv_x", &items[0], &o.recv_x) != 0) goto fail;
    if (xd == EPX_DTYPE_FP8_E4M3 && alloc_tensor(&ctx, &keep, EPX_DTYPE_FP32, 2, (int64_t[]){cap, H / 128},
                                                 "recv_x_scales", &items[1], &o.recv_x_scales) != 0)
        goto fail;
    if (!cached) {
        epx_dtype_t id = a.topk_idx.dtype == EPX_DTYPE_INT64 ? EPX_DTYPE_INT64 : EPX_DTYPE_INT32;
        if (a.topk_idx.data && alloc_tensor(&ctx, &keep, id, 2, (int64_t[]){cap, K}, "recv_topk_idx",
                                            &items[2], &o.recv_topk_idx) != 0)
            goto fail;
        if (a.topk_weights.data && alloc_tensor(&ctx, &keep, EPX_DTYPE_FP32, 2, (int64_t[]){cap, K},
                                                "recv_topk_weights", &items[3], &o.recv_topk_weights) != 0)
            goto fail;
        if (alloc_tensor(&ctx, &keep, EPX_DTYPE_INT32, 1, &L, "num_recv_tokens_per_expert", &items[4],
                         &o.num_recv_tokens_per_expert) != 0)
            goto fail;
        if (num_worst > 0 && alloc_tensor(&ctx, &keep, EPX_DTYPE_INT32, 1, (int64_t[]){1}, "num_recv_tokens",
                                          &items[7], &o.num_recv_tokens) != 0)
            goto fail;
    }
    epx_result_t res;
    Py_BEGIN_ALLOW_THREADS res = epx_ht_dispatch(self->buf, &a, &o);
    Py_END_ALLOW_THREADS keep_release(&keep);
    if (res != EPX_SUCCESS) {
        drop_all(8, items);
        return raise_epx(res);
    }
    if (cached) {
        Py_INCREF(cached);
        items[5] = (PyObject *)cached;
    } else {
        items[5] = (PyObject *)handle_new(self, o.handle, 1, 0, a.x.shape[0]);
        if (!items[5]) goto fail_after;
    }
    items[6] = PyLong_FromLongLong(cached ? cap : o.num_recv_tokens_host);
    if (!items[6]) goto fail_after;
    if (num_worst <= 0 && !cached) {
        int64_t n = o.num_recv_tokens_host;
        for (int i = 0; i < 4; i++)
            if (slice_rows(&items[i], n, cap) != 0) goto fail_after;
    }
    return make_result(HTDispatchType, 8, items);
fail_after:
    drop_all(8, items);
    return NULL;
fail:
    keep_release(&keep);
    drop_all(8, items);
    return NULL;
}

static PyObject *buffer_combine(BufferObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"x", "handle", "topk_weights", "bias0", "bias1", "stream", NULL};
    PyObject *x_obj, *handle_obj, *weights_obj = Py_None, *b0 = Py_None, *b1 = Py_None, *stream_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!|OOOO", kw, &x_obj, &HandleType, &handle_obj,
                                     &weights_obj, &b0, &b1, &stream_obj))
        return NULL;
    if (buffer_check(self) != 0) return NULL;
    HandleObject *h = (HandleObject *)handle_obj;
    if (handle_check(h, self, 1) != 0) return NULL;
    keep_t keep = {{0}, 0};
    call_ctx_t ctx;
    PyObject *items[2] = {NULL};
    epx_ht_combine_args_t a = EPX_HT_COMBINE_ARGS_INIT;
    epx_ht_combine_outputs_t o = EPX_HT_COMBINE_OUTPUTS_INIT;
    a.handle = h->handle;
    if (ctx_init(&ctx, &keep, x_obj, stream_obj) != 0) goto fail;
    if (import_tensor(&ctx, &keep, x_obj, "x", HINT_NONE, &a.x) != 0 ||
        import_tensor(&ctx, &keep, weights_obj, "topk_weights", HINT_NONE, &a.topk_weights) != 0 ||
        import_tensor(&ctx, &keep, b0, "bias0", HINT_NONE, &a.bias0) != 0 ||
        import_tensor(&ctx, &keep, b1, "bias1", HINT_NONE, &a.bias1) != 0)
        goto fail;
    if (stream_of(&ctx, &a.stream) != 0) goto fail;
    int64_t T = h->num_tokens, H = self->cfg.hidden, K = self->cfg.num_topk;
    if (alloc_tensor(&ctx, &keep, EPX_DTYPE_BF16, 2, (int64_t[]){T, H}, "combined_x", &items[0],
                     &o.combined_x) != 0)
        goto fail;
    if (a.topk_weights.data &&
        alloc_tensor(&ctx, &keep, EPX_DTYPE_FP32, 2, (int64_t[]){T, K}, "combined_topk_weights", &items[1],
                     &o.combined_topk_weights) != 0)
        goto fail;
    epx_result_t res;
    Py_BEGIN_ALLOW_THREADS res = epx_ht_combine(self->buf, &a, &o);
    Py_END_ALLOW_THREADS keep_release(&keep);
    if (res != EPX_SUCCESS) {
        drop_all(2, items);
        return raise_epx(res);
    }
    return make_result(HTCombineType, 2, items);
fail:
    keep_release(&keep);
    drop_all(2, items);
    return NULL;
}

/* ------------------------------------------------------------------ LL ---- */

static PyObject *new_ll_handle(BufferObject *self, const epx_ll_handle_t *h, call_ctx_t *ctx)
{
    LLHandleObject *lh = PyObject_GC_New(LLHandleObject, &LLHandleType);
    if (!lh) return NULL;
    lh->h = *h;
    Py_INCREF(self);
    lh->buffer = self;
    lh->fw = ctx->fw;
    Py_XINCREF(ctx->device);
    lh->device = ctx->device;
    PyObject_GC_Track(lh);
    return (PyObject *)lh;
}

static PyObject *buffer_ll_dispatch(BufferObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"x",           "topk_idx",  "cumulative_recv_stats", "use_fp8",
                         "round_scale", "use_ue8m0", "return_recv_hook",      "stream",
                         NULL};
    PyObject *x_obj, *topk_obj, *stats_obj = Py_None, *stream_obj = Py_None;
    int use_fp8 = 0, round_scale = 0, use_ue8m0 = 0, hook = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|OppppO", kw, &x_obj, &topk_obj, &stats_obj, &use_fp8,
                                     &round_scale, &use_ue8m0, &hook, &stream_obj))
        return NULL;
    if (buffer_check(self) != 0) return NULL;
    keep_t keep = {{0}, 0};
    call_ctx_t ctx;
    PyObject *items[7] = {NULL};
    epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
    epx_ll_dispatch_outputs_t o = EPX_LL_DISPATCH_OUTPUTS_INIT;
    if (ctx_init(&ctx, &keep, x_obj, stream_obj) != 0) goto fail;
    if (import_tensor(&ctx, &keep, x_obj, "x", HINT_NONE, &a.x) != 0 ||
        import_tensor(&ctx, &keep, topk_obj, "topk_idx", HINT_NONE, &a.topk_idx) != 0 ||
        import_tensor(&ctx, &keep, stats_obj, "cumulative_recv_stats", HINT_NONE, &a.cumulative_recv_stats) !=
            0)
        goto fail;
    a.use_fp8 = use_fp8;
    a.round_scale = round_scale;
    a.use_ue8m0 = use_ue8m0;
    a.return_recv_hook = hook;
    if (stream_of(&ctx, &a.stream) != 0) goto fail;
    int64_t L = self->L, R = self->R, rows = (int64_t)self->R * self->cfg.max_tokens, H = self->cfg.hidden;
    if (alloc_tensor(&ctx, &keep, use_fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16, 3, (int64_t[]){L, rows, H},
                     "recv_x", &items[0], &o.recv_x) != 0)
        goto fail;
    if (use_fp8 && use_ue8m0) {
        if (alloc_tensor(&ctx, &keep, EPX_DTYPE_INT32, 3, (int64_t[]){L, H / 512, rows}, "recv_scales",
                         &items[1], &o.recv_scales) != 0)
            goto fail;
    } else if (use_fp8) {
        if (alloc_tensor(&ctx, &keep, EPX_DTYPE_FP32, 3, (int64_t[]){L, H / 128, rows}, "recv_scales",
                         &items[1], &o.recv_scales) != 0)
            goto fail;
    }
    if (alloc_tensor(&ctx, &keep, EPX_DTYPE_INT32, 1, &L, "recv_count", &items[2], &o.recv_count) != 0 ||
        alloc_tensor(&ctx, &keep, EPX_DTYPE_INT32, 2, (int64_t[]){L, rows}, "src_info", &items[3],
                     &o.src_info) != 0 ||
        alloc_tensor(&ctx, &keep, EPX_DTYPE_INT64, 2, (int64_t[]){L, R}, "layout_range", &items[4],
                     &o.layout_range) != 0)
        goto fail;
    epx_result_t res;
    Py_BEGIN_ALLOW_THREADS res = epx_ll_dispatch(self->buf, &a, &o);
    Py_END_ALLOW_THREADS if (res != EPX_SUCCESS)
    {
        keep_release(&keep);
        drop_all(7, items);
        return raise_epx(res);
    }
    /* The handle takes its own reference to ctx.device, which keep holds: release keep only after. */
    items[5] = new_ll_handle(self, &o.handle, &ctx);
    keep_release(&keep);
    if (!items[5]) goto fail_after;
    if (hook) {
        PyObject *outs =
            PyTuple_Pack(5, items[0], items[1] ? items[1] : Py_None, items[2], items[3], items[4]);
        items[6] = outs ? hook_new(self, &o.hook, outs) : NULL;
        Py_XDECREF(outs);
        if (!items[6]) goto fail_after;
    }
    return make_result(LLDispatchType, 7, items);
fail_after:
    drop_all(7, items);
    return NULL;
fail:
    keep_release(&keep);
    drop_all(7, items);
    return NULL;
}

static PyObject *buffer_get_combine_buffer(BufferObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"handle", NULL};
    LLHandleObject *h;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!", kw, &LLHandleType, &h)) return NULL;
    if (buffer_check(self) != 0) return NULL;
    ViewObject *view = PyObject_New(ViewObject, &ViewType);
    if (!view) return NULL;
    Py_INCREF(self);
    view->owner = (PyObject *)self;
    epx_result_t res;
    Py_BEGIN_ALLOW_THREADS res = epx_ll_get_combine_buffer(self->buf, &h->h, &view->t);
    Py_END_ALLOW_THREADS if (res != EPX_SUCCESS)
    {
        Py_DECREF(view);
        return raise_epx(res);
    }
    PyObject *out = NULL;
    if (h->fw == FW_TORCH) {
        PyObject *torch = PyImport_ImportModule("torch");
        if (torch) {
            out = PyObject_CallMethod(torch, "from_dlpack", "O", (PyObject *)view);
            Py_DECREF(torch);
        }
    } else {
        /* numpy through the buffer protocol: writable, and the array keeps the view (and buffer) alive. */
        PyObject *np = PyImport_ImportModule("numpy");
        PyObject *flat =
            np ? PyObject_CallMethod(np, "frombuffer", "OO", (PyObject *)view, g_numpy_dtypes[EPX_DTYPE_BF16])
               : NULL;
        if (flat) {
            PyObject *shape = Py_BuildValue("(LLL)", (long long)view->t.shape[0], (long long)view->t.shape[1],
                                            (long long)view->t.shape[2]);
            out = shape ? PyObject_CallMethod(flat, "reshape", "O", shape) : NULL;
            Py_XDECREF(shape);
            Py_DECREF(flat);
        }
        Py_XDECREF(np);
    }
    Py_DECREF(view);
    return out;
}

static PyObject *buffer_ll_combine(BufferObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"y",         "topk_idx",         "topk_weights", "handle",
                         "zero_copy", "return_recv_hook", "stream",       NULL};
    PyObject *y_obj, *topk_obj, *weights_obj, *stream_obj = Py_None;
    LLHandleObject *h;
    int zero_copy = 0, hook = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO!|ppO", kw, &y_obj, &topk_obj, &weights_obj,
                                     &LLHandleType, &h, &zero_copy, &hook, &stream_obj))
        return NULL;
    if (buffer_check(self) != 0) return NULL;
    keep_t keep = {{0}, 0};
    call_ctx_t ctx;
    PyObject *items[2] = {NULL};
    epx_ll_combine_args_t a = EPX_LL_COMBINE_ARGS_INIT;
    epx_ll_combine_outputs_t o = EPX_LL_COMBINE_OUTPUTS_INIT;
    a.handle = h->h;
    a.zero_copy = zero_copy;
    a.return_recv_hook = hook;
    /* With zero_copy y may be None: topk_idx then decides the framework. */
    if (ctx_init(&ctx, &keep, y_obj != Py_None ? y_obj : topk_obj, stream_obj) != 0) goto fail;
    if (import_tensor(&ctx, &keep, y_obj, "y", HINT_NONE, &a.y) != 0 ||
        import_tensor(&ctx, &keep, topk_obj, "topk_idx", HINT_NONE, &a.topk_idx) != 0 ||
        import_tensor(&ctx, &keep, weights_obj, "topk_weights", HINT_NONE, &a.topk_weights) != 0)
        goto fail;
    if (stream_of(&ctx, &a.stream) != 0) goto fail;
    if (alloc_tensor(&ctx, &keep, EPX_DTYPE_BF16, 2, (int64_t[]){h->h.num_tokens, self->cfg.hidden},
                     "combined_x", &items[0], &o.combined_x) != 0)
        goto fail;
    epx_result_t res;
    Py_BEGIN_ALLOW_THREADS res = epx_ll_combine(self->buf, &a, &o);
    Py_END_ALLOW_THREADS keep_release(&keep);
    if (res != EPX_SUCCESS) {
        drop_all(2, items);
        return raise_epx(res);
    }
    if (hook) {
        items[1] = hook_new(self, &o.hook, items[0]);
        if (!items[1]) {
            drop_all(2, items);
            return NULL;
        }
    }
    return make_result(LLCombineType, 2, items);
fail:
    keep_release(&keep);
    drop_all(2, items);
    return NULL;
}

/* ------------------------------------------------------------------ routing map ---- */

static int parse_bound(PyObject *obj, int64_t *out)
{
    *out = -1;
    if (obj == Py_None) return 0;
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

static PyObject *buffer_rm_dispatch(BufferObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"hidden",
                         "routing_map",
                         "probs",
                         "scaling_factor",
                         "permute",
                         "pad_multiple",
                         "num_dispatched_tokens",
                         "num_permuted_tokens",
                         "stream",
                         NULL};
    PyObject *x_obj, *map_obj, *probs_obj = Py_None, *sf_obj = Py_None, *nd_obj = Py_None, *np_obj = Py_None;
    PyObject *stream_obj = Py_None;
    int permute = 0, pad_multiple = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|OOpiOOO", kw, &x_obj, &map_obj, &probs_obj, &sf_obj,
                                     &permute, &pad_multiple, &nd_obj, &np_obj, &stream_obj))
        return NULL;
    if (buffer_check(self) != 0) return NULL;
    keep_t keep = {{0}, 0};
    call_ctx_t ctx;
    PyObject *items[7] = {NULL};
    epx_rm_dispatch_args_t a = EPX_RM_DISPATCH_ARGS_INIT;
    epx_rm_dispatch_outputs_t o = EPX_RM_DISPATCH_OUTPUTS_INIT;
    if (parse_bound(nd_obj, &a.num_dispatched_tokens) != 0 ||
        parse_bound(np_obj, &a.num_permuted_tokens) != 0)
        return NULL;
    a.permute = permute;
    a.pad_multiple = pad_multiple;
    if (ctx_init(&ctx, &keep, x_obj, stream_obj) != 0) goto fail;
    if (import_tensor(&ctx, &keep, x_obj, "hidden", HINT_FP8, &a.hidden) != 0 ||
        import_tensor(&ctx, &keep, sf_obj, "scaling_factor", HINT_NONE, &a.scaling_factor) != 0 ||
        import_tensor(&ctx, &keep, map_obj, "routing_map", HINT_BOOL, &a.routing_map) != 0 ||
        import_tensor(&ctx, &keep, probs_obj, "probs", HINT_NONE, &a.probs) != 0)
        goto fail;
    if (stream_of(&ctx, &a.stream) != 0) goto fail;
    int64_t H = self->cfg.hidden, L = self->L, R = self->R, Tm = self->cfg.max_tokens, K = self->cfg.num_topk;
    int64_t bound = permute ? a.num_permuted_tokens : a.num_dispatched_tokens;
    int64_t cap;
    if (bound >= 0) {
        cap = bound; /* an invalid bound is the library's to refuse */
    } else if (permute) {
        int64_t pad = pad_multiple > 0 ? pad_multiple : 1;
        cap = R * Tm * (K < L ? K : L) + L * (pad - 1);
    } else {
        cap = R * Tm;
    }
    epx_dtype_t xd = a.hidden.dtype == EPX_DTYPE_INVALID ? EPX_DTYPE_BF16 : a.hidden.dtype;
    if (alloc_tensor(&ctx, &keep, xd, 2, (int64_t[]){cap, H}, "tokens", &items[0], &o.tokens) != 0) goto fail;
    if (xd == EPX_DTYPE_FP8_E4M3 && alloc_tensor(&ctx, &keep, EPX_DTYPE_FP32, 2, (int64_t[]){cap, H / 128},
                                                 "scaling_factor", &items[1], &o.scaling_factor) != 0)
        goto fail;
    if (a.probs.data) {
        int rc = permute ? alloc_tensor(&ctx, &keep, EPX_DTYPE_FP32, 1, &cap, "probs", &items[2], &o.probs)
                         : alloc_tensor(&ctx, &keep, EPX_DTYPE_FP32, 2, (int64_t[]){cap, L}, "probs",
                                        &items[2], &o.probs);
        if (rc != 0) goto fail;
    }
    if (permute && alloc_tensor(&ctx, &keep, EPX_DTYPE_INT32, 1, &L, "tokens_per_expert", &items[3],
                                &o.tokens_per_expert) != 0)
        goto fail;
    if (bound >= 0 && alloc_tensor(&ctx, &keep, EPX_DTYPE_INT32, 1, (int64_t[]){1}, "num_tokens", &items[6],
                                   &o.num_tokens) != 0)
        goto fail;
    epx_result_t res;
    Py_BEGIN_ALLOW_THREADS res = epx_rm_dispatch(self->buf, &a, &o);
    Py_END_ALLOW_THREADS keep_release(&keep);
    if (res != EPX_SUCCESS) {
        drop_all(7, items);
        return raise_epx(res);
    }
    items[4] = (PyObject *)handle_new(self, o.handle, 2, permute, a.hidden.shape[0]);
    items[5] = PyLong_FromLongLong(o.num_tokens_host);
    if (!items[4] || !items[5]) goto fail_after;
    if (bound < 0)
        for (int i = 0; i < 3; i++)
            if (slice_rows(&items[i], o.num_tokens_host, cap) != 0) goto fail_after;
    return make_result(RMDispatchType, 7, items);
fail_after:
    drop_all(7, items);
    return NULL;
fail:
    keep_release(&keep);
    drop_all(7, items);
    return NULL;
}

static PyObject *buffer_rm_combine(BufferObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"x", "handle", "weighted", "stream", NULL};
    PyObject *x_obj, *handle_obj, *stream_obj = Py_None;
    int weighted = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!|pO", kw, &x_obj, &HandleType, &handle_obj, &weighted,
                                     &stream_obj))
        return NULL;
    if (buffer_check(self) != 0) return NULL;
    HandleObject *h = (HandleObject *)handle_obj;
    if (handle_check(h, self, 2) != 0) return NULL;
    keep_t keep = {{0}, 0};
    call_ctx_t ctx;
    PyObject *out_obj = NULL;
    epx_rm_combine_args_t a = EPX_RM_COMBINE_ARGS_INIT;
    epx_rm_combine_outputs_t o = EPX_RM_COMBINE_OUTPUTS_INIT;
    a.handle = h->handle;
    a.weighted = weighted;
    if (ctx_init(&ctx, &keep, x_obj, stream_obj) != 0) goto fail;
    if (import_tensor(&ctx, &keep, x_obj, "x", HINT_NONE, &a.x) != 0) goto fail;
    if (stream_of(&ctx, &a.stream) != 0) goto fail;
    if (alloc_tensor(&ctx, &keep, EPX_DTYPE_BF16, 2, (int64_t[]){h->num_tokens, self->cfg.hidden}, "combined",
                     &out_obj, &o.combined) != 0)
        goto fail;
    epx_result_t res;
    Py_BEGIN_ALLOW_THREADS res = epx_rm_combine(self->buf, &a, &o);
    Py_END_ALLOW_THREADS keep_release(&keep);
    if (res != EPX_SUCCESS) {
        Py_DECREF(out_obj);
        return raise_epx(res);
    }
    return out_obj;
fail:
    keep_release(&keep);
    Py_XDECREF(out_obj);
    return NULL;
}

static PyObject *buffer_query_overflow(BufferObject *self, PyObject *unused)
{
    if (buffer_check(self) != 0) return NULL;
    epx_result_t res;
    Py_BEGIN_ALLOW_THREADS res = epx_buffer_query_overflow(self->buf);
    Py_END_ALLOW_THREADS if (res == EPX_ERR_OVERFLOW) Py_RETURN_TRUE;
    if (res != EPX_SUCCESS) return raise_epx(res);
    Py_RETURN_FALSE;
}

static PyObject *buffer_get(BufferObject *self, void *field)
{
    const char *f = field;
    if (!strcmp(f, "comm")) {
        Py_INCREF(self->comm);
        return (PyObject *)self->comm;
    }
    if (!strcmp(f, "max_tokens")) return PyLong_FromLongLong(self->cfg.max_tokens);
    if (!strcmp(f, "hidden")) return PyLong_FromLongLong(self->cfg.hidden);
    if (!strcmp(f, "num_topk")) return PyLong_FromLong(self->cfg.num_topk);
    if (!strcmp(f, "num_experts")) return PyLong_FromLong(self->cfg.num_experts);
    if (!strcmp(f, "num_local_experts")) return PyLong_FromLong(self->L);
    if (!strcmp(f, "num_ranks")) return PyLong_FromLong(self->R);
    if (!strcmp(f, "destroyed")) return PyBool_FromLong(self->buf == NULL);
    Py_RETURN_NONE;
}

static PyGetSetDef buffer_getset[] = {
    {"comm", (getter)buffer_get, NULL, "The communicator.", "comm"},
    {"max_tokens", (getter)buffer_get, NULL, "T_max.", "max_tokens"},
    {"hidden", (getter)buffer_get, NULL, "H.", "hidden"},
    {"num_topk", (getter)buffer_get, NULL, "K.", "num_topk"},
    {"num_experts", (getter)buffer_get, NULL, "E.", "num_experts"},
    {"num_local_experts", (getter)buffer_get, NULL, "L = E / R.", "num_local_experts"},
    {"num_ranks", (getter)buffer_get, NULL, "R.", "num_ranks"},
    {"destroyed", (getter)buffer_get, NULL, "Whether destroy() ran.", "destroyed"},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

#define KWFN(f) (PyCFunction)(void (*)(void))(f)
static PyMethodDef buffer_methods[] = {
    {"get_dispatch_layout", KWFN(buffer_layout), METH_VARARGS | METH_KEYWORDS,
     "get_dispatch_layout(topk_idx, *, stream=None) -> Layout\n--\n\n"
     "Counts derived from topk_idx [T, K] int32/int64 (-1 = no expert). Not collective. Returns\n"
     "Layout(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, R]\n"
     "bool, num_tokens_per_domain [R/D] int32 or None)."},
    {"dispatch", KWFN(buffer_dispatch), METH_VARARGS | METH_KEYWORDS,
     "dispatch(x, topk_idx=None, topk_weights=None, *, x_scales=None, handle=None, expert_alignment=1,\n"
     "         num_worst_tokens=0, stream=None) -> DispatchOutput\n--\n\n"
     "HT dispatch (collective). x [T, H] bf16 (torch.bfloat16 or numpy uint16 bit patterns), float32 or\n"
     "fp8 e4m3 (torch.float8_e4m3fn or numpy uint8) with x_scales [T, H/128] float32; topk_idx [T, K]\n"
     "int32/int64; topk_weights [T, K] float32. handle=: cached dispatch with that handle's routing.\n"
     "num_worst_tokens > 0: static mode, outputs have that many rows. Otherwise outputs have N_r rows\n"
     "(allocated for R*T_max and sliced)."},
    {"combine", KWFN(buffer_combine), METH_VARARGS | METH_KEYWORDS,
     "combine(x, handle, topk_weights=None, bias0=None, bias1=None, *, stream=None) -> CombineOutput\n--\n\n"
     "HT combine (collective). x [>= N_r, H] bf16; topk_weights [>= N_r, K] float32; bias0/bias1 [T, H]\n"
     "bf16. Returns CombineOutput(combined_x [T, H] bf16, combined_topk_weights [T, K] float32 or None)."},
    {"ll_dispatch", KWFN(buffer_ll_dispatch), METH_VARARGS | METH_KEYWORDS,
     "ll_dispatch(x, topk_idx, cumulative_recv_stats=None, *, use_fp8=False, round_scale=False,\n"
     "            use_ue8m0=False, return_recv_hook=False, stream=None) -> LLDispatchOutput\n--\n\n"
     "LL dispatch (collective). x [T, H] bf16; topk_idx [T, K] int32/int64; cumulative_recv_stats [L]\n"
     "int32 (received counts are added). Returns LLDispatchOutput(recv_x [L, R*T_max, H], recv_scales,\n"
     "recv_count [L] int32, src_info [L, R*T_max] int32, layout_range [L, R] int64, handle, hook)."},
    {"get_combine_buffer", KWFN(buffer_get_combine_buffer), METH_VARARGS | METH_KEYWORDS,
     "get_combine_buffer(handle) -> tensor\n--\n\n"
     "The [L, R*T_max, H] bf16 region in library memory that ll_combine(..., zero_copy=True) of this\n"
     "handle reads (numpy uint16 for a numpy dispatch, torch.bfloat16 for torch). Valid until that combine."},
    {"ll_combine", KWFN(buffer_ll_combine), METH_VARARGS | METH_KEYWORDS,
     "ll_combine(y, topk_idx, topk_weights, handle, *, zero_copy=False, return_recv_hook=False,\n"
     "           stream=None) -> LLCombineOutput\n--\n\n"
     "LL combine (collective). y [L, R*T_max, H] bf16 in the dispatch's layout (None with zero_copy);\n"
     "topk_idx/topk_weights [T, K] as passed to the dispatch. Returns LLCombineOutput(combined_x [T, H]\n"
     "bf16, hook)."},
    {"rm_dispatch", KWFN(buffer_rm_dispatch), METH_VARARGS | METH_KEYWORDS,
     "rm_dispatch(hidden, routing_map, probs=None, scaling_factor=None, *, permute=False, pad_multiple=1,\n"
     "            num_dispatched_tokens=None, num_permuted_tokens=None, stream=None) -> "
     "RoutingDispatchOutput\n"
     "--\n\nRouting-map dispatch (collective). hidden [T, H] bf16 or fp8 (+ scaling_factor [T, H/128]\n"
     "float32); routing_map [T, E] bool; probs [T, E] float32. permute groups rows by local expert, each\n"
     "group padded to pad_multiple. A bound sizes the outputs (rows past it are dropped, see\n"
     "query_overflow); without one outputs have exactly N_r or P rows."},
    {"rm_combine", KWFN(buffer_rm_combine), METH_VARARGS | METH_KEYWORDS,
     "rm_combine(x, handle, weighted=False, *, stream=None) -> tensor\n--\n\n"
     "Inverse of rm_dispatch (collective): x [>= rows, H] bf16 in the dispatch's output layout; returns\n"
     "[T, H] bf16. With permute this is combine-with-unpermute (weighted by probs when weighted=True)."},
    {"query_overflow", (PyCFunction)buffer_query_overflow, METH_NOARGS,
     "query_overflow() -> bool\n--\n\nTrue (and the flag cleared) when a call with an upper bound dropped "
     "rows."},
    {"destroy", (PyCFunction)buffer_destroy, METH_NOARGS,
     "destroy()\n--\n\nFrees the buffer now (handles must be gone). Not collective."},
    {NULL},
};

static PyTypeObject BufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "epx._epx.Buffer",
    .tp_basicsize = sizeof(BufferObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A communication buffer (collective to create).",
    .tp_dealloc = (destructor)buffer_dealloc,
    .tp_traverse = (traverseproc)buffer_traverse,
    .tp_clear = (inquiry)buffer_clear,
    .tp_methods = buffer_methods,
    .tp_getset = buffer_getset,
    .tp_init = (initproc)buffer_init,
    .tp_new = PyType_GenericNew,
    .tp_weaklistoffset = offsetof(BufferObject, weakrefs),
    .tp_dictoffset = offsetof(BufferObject, dict),
};

/* ------------------------------------------------------------------ module functions ---- */

static PyObject *py_get_unique_id(PyObject *mod, PyObject *unused)
{
    epx_unique_id_t id;
    epx_result_t res = epx_get_unique_id(&id);
    if (res != EPX_SUCCESS) return raise_epx(res);
    return PyBytes_FromStringAndSize(id.internal, EPX_UNIQUE_ID_BYTES);
}

static PyObject *py_version(PyObject *mod, PyObject *unused)
{
    return PyUnicode_FromString(epx_version());
}

static PyObject *py_refresh_torch(PyObject *mod, PyObject *unused)
{
    refresh_torch();
    return PyBool_FromLong(g_torch_empty != NULL);
}

static PyObject *py_set_error_classes(PyObject *mod, PyObject *args)
{
    PyObject *base, *classes;
    if (!PyArg_ParseTuple(args, "OO!", &base, &PyDict_Type, &classes)) return NULL;
    Py_INCREF(base);
    Py_XSETREF(g_error_base, base);
    for (int code = 1; code <= EPX_ERR_INTERNAL; code++) {
        PyObject *cls = PyDict_GetItemString(classes, epx_result_name((epx_result_t)code));
        Py_XINCREF(cls);
        Py_XSETREF(g_error_classes[code], cls);
    }
    Py_RETURN_NONE;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* _bench_ll_dispatch_c(buffer, x, topk_idx, iters) -> median microseconds of epx_ll_dispatch called
 * straight from C with preallocated outputs: the baseline the Python call overhead is measured against. */
static PyObject *py_bench_ll_dispatch_c(PyObject *mod, PyObject *args)
{
    BufferObject *self;
    PyObject *x_obj, *topk_obj;
    int iters;
    if (!PyArg_ParseTuple(args, "O!OOi", &BufferType, &self, &x_obj, &topk_obj, &iters)) return NULL;
    if (buffer_check(self) != 0 || iters < 1) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "epx: iters must be >= 1");
        return NULL;
    }
    keep_t keep = {{0}, 0};
    call_ctx_t ctx;
    PyObject *objs[4] = {NULL};
    PyObject *result = NULL;
    epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
    epx_ll_dispatch_outputs_t o = EPX_LL_DISPATCH_OUTPUTS_INIT;
    int64_t L = self->L, R = self->R, rows = (int64_t)self->R * self->cfg.max_tokens, H = self->cfg.hidden;
    int64_t *times = malloc(sizeof(int64_t) * (size_t)iters);
    if (!times) return PyErr_NoMemory();
    if (ctx_init(&ctx, &keep, x_obj, Py_None) != 0 ||
        import_tensor(&ctx, &keep, x_obj, "x", HINT_NONE, &a.x) != 0 ||
        import_tensor(&ctx, &keep, topk_obj, "topk_idx", HINT_NONE, &a.topk_idx) != 0 ||
        alloc_tensor(&ctx, &keep, EPX_DTYPE_BF16, 3, (int64_t[]){L, rows, H}, "recv_x", &objs[0],
                     &o.recv_x) != 0 ||
        alloc_tensor(&ctx, &keep, EPX_DTYPE_INT32, 1, &L, "recv_count", &objs[1], &o.recv_count) != 0 ||
        alloc_tensor(&ctx, &keep, EPX_DTYPE_INT32, 2, (int64_t[]){L, rows}, "src_info", &objs[2],
                     &o.src_info) != 0 ||
        alloc_tensor(&ctx, &keep, EPX_DTYPE_INT64, 2, (int64_t[]){L, R}, "layout_range", &objs[3],
                     &o.layout_range) != 0)
        goto out;
    epx_result_t res = EPX_SUCCESS;
    Py_BEGIN_ALLOW_THREADS for (int i = 0; i < iters && res == EPX_SUCCESS; i++)
    {
        int64_t t0 = now_ns();
        res = epx_ll_dispatch(self->buf, &a, &o);
        times[i] = now_ns() - t0;
    }
    Py_END_ALLOW_THREADS if (res != EPX_SUCCESS)
    {
        raise_epx(res);
        goto out;
    }
    qsort(times, (size_t)iters, sizeof(int64_t), cmp_i64);
    result = PyFloat_FromDouble((double)times[iters / 2] / 1000.0);
out:
    keep_release(&keep);
    drop_all(4, objs);
    free(times);
    return result;
}

static PyMethodDef module_methods[] = {
    {"get_unique_id", py_get_unique_id, METH_NOARGS,
     "get_unique_id() -> bytes\n--\n\nA 128-byte rendezvous token (TCP, hosted by rank 0); send it to every "
     "rank."},
    {"version", py_version, METH_NOARGS, "version() -> str\n--\n\nVersion of the linked library."},
    {"comm_init", KWFN(py_comm_init), METH_VARARGS | METH_KEYWORDS, "Internal: use Comm.from_unique_id."},
    {"comm_init_callbacks", KWFN(py_comm_init_callbacks), METH_VARARGS | METH_KEYWORDS,
     "Internal: use Comm.from_callbacks or Comm.from_torch."},
    {"_refresh_torch", py_refresh_torch, METH_NOARGS, "Internal: pick up torch once it is imported."},
    {"_set_error_classes", py_set_error_classes, METH_VARARGS, "Internal: the EpxError hierarchy."},
    {"_bench_ll_dispatch_c", py_bench_ll_dispatch_c, METH_VARARGS,
     "Internal: median microseconds of epx_ll_dispatch called from C."},
    {NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_epx", "C binding of libepx.", -1,
                                        module_methods};

static int add_type(PyObject *m, PyTypeObject *t, const char *name)
{
    if (PyType_Ready(t) < 0) return -1;
    Py_INCREF(t);
    if (PyModule_AddObject(m, name, (PyObject *)t) < 0) {
        Py_DECREF(t);
        return -1;
    }
    return 0;
}

static PyTypeObject *new_struct_type(PyObject *m, PyStructSequence_Desc *desc, const char *name)
{
    PyTypeObject *t = PyStructSequence_NewType(desc);
    if (!t) return NULL;
    Py_INCREF(t);
    if (PyModule_AddObject(m, name, (PyObject *)t) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return t;
}

PyMODINIT_FUNC PyInit__epx(void)
{
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    g_str_dlpack = PyUnicode_InternFromString("__dlpack__");
    g_str_dlpack_device = PyUnicode_InternFromString("__dlpack_device__");
    g_str_device = PyUnicode_InternFromString("device");
    g_str_dtype = PyUnicode_InternFromString("dtype");
    g_str_view = PyUnicode_InternFromString("view");
    g_str_stream = PyUnicode_InternFromString("stream");
    g_str_cuda_stream = PyUnicode_InternFromString("cuda_stream");
    g_error_base = PyErr_NewException("epx._epx.EpxError", PyExc_RuntimeError, NULL);
    if (!g_error_base || add_type(m, &CommType, "Comm") || add_type(m, &BufferType, "Buffer") ||
        add_type(m, &HandleType, "Handle") || add_type(m, &LLHandleType, "LLHandle") ||
        add_type(m, &HookType, "Hook") || add_type(m, &ViewType, "View"))
        goto fail;
    if (!(LayoutType = new_struct_type(m, &layout_desc, "Layout")) ||
        !(HTDispatchType = new_struct_type(m, &ht_dispatch_desc, "DispatchOutput")) ||
        !(HTCombineType = new_struct_type(m, &ht_combine_desc, "CombineOutput")) ||
        !(LLDispatchType = new_struct_type(m, &ll_dispatch_desc, "LLDispatchOutput")) ||
        !(LLCombineType = new_struct_type(m, &ll_combine_desc, "LLCombineOutput")) ||
        !(RMDispatchType = new_struct_type(m, &rm_dispatch_desc, "RoutingDispatchOutput")))
        goto fail;
    if (PyModule_AddIntConstant(m, "MODE_HT", EPX_MODE_HT) ||
        PyModule_AddIntConstant(m, "MODE_LL", EPX_MODE_LL) ||
        PyModule_AddIntConstant(m, "MODE_PERMUTE", EPX_MODE_PERMUTE) ||
        PyModule_AddIntConstant(m, "MODE_ALL", EPX_MODE_ALL) ||
        PyModule_AddIntConstant(m, "UNIQUE_ID_BYTES", EPX_UNIQUE_ID_BYTES))
        goto fail;
    /* numpy is imported lazily: torch-only users need not have it. */
    if (ensure_numpy() != 0) PyErr_Clear();
    refresh_torch();
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
