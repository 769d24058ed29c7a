/*
 * Tensors in and out of the binding: DLPack import with its dtype and device mapping, the stream a call
 * runs on, and outputs allocated through the caller's framework (numpy or torch).
 */
#include "_epx.h"

#include <stdlib.h>
#include <string.h>

static max_align_t g_empty_data; /* the data of zero-element tensors exported with a NULL pointer */

/* ------------------------------------------------------------------ tensors in ---- */

void py_keep_release(keep_t *k)
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

/* The DLPack capsule of `src`. On cuda the producer orders its pending work before the stream we run
 * on. DLPack's stream numbers: -1 = no synchronisation (a torch tensor consumed on torch's current
 * stream, which already orders its work: asking torch to sync would record an event per tensor, inside
 * a capture too), 1 = the legacy default stream (cudaStream_t 0), else the stream's handle. */
static PyObject *export_capsule(call_ctx_t *ctx, PyObject *method, PyObject *src)
{
    if (ctx->dl_device_type != DL_CUDA) return PyObject_CallNoArgs(method);
    void *s = resolve_stream(ctx);
    if (PyErr_Occurred()) return NULL;
    int same_stream = ctx->stream_is_torch_current && ctx->fw == FW_TORCH &&
                      PyObject_TypeCheck(src, (PyTypeObject *)py_state.torch_tensor_type);
    PyObject *stream = same_stream ? PyLong_FromLong(-1) : s ? PyLong_FromVoidPtr(s) : PyLong_FromLong(1);
    if (!stream) return NULL;
    PyObject *kwargs = Py_BuildValue("{OO}", py_state.str_stream, stream);
    Py_DECREF(stream);
    PyObject *empty = PyTuple_New(0);
    PyObject *capsule = kwargs && empty ? PyObject_Call(method, empty, kwargs) : NULL;
    Py_XDECREF(empty);
    Py_XDECREF(kwargs);
    return capsule;
}

/* The pending exception, raised again with the same type and the argument's name in front ("epx: x:
 * ..."), the original as its __cause__: the framework's own message names no argument. */
static void name_pending_error(const char *name)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (!type) return;
    if (tb && value) PyException_SetTraceback(value, tb);
    PyErr_Format(type, "epx: %s could not be imported: %S", name, value ? value : Py_None);
    PyObject *type2, *value2, *tb2;
    PyErr_Fetch(&type2, &value2, &tb2);
    PyErr_NormalizeException(&type2, &value2, &tb2);
    if (value2 && value) PyException_SetCause(value2, Py_NewRef(value));
    PyErr_Restore(type2, value2, tb2);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

/* Fills `t` from the DLPack tensor `d` (already known to fit epx's dimension limit). */
static int describe_tensor(const dl_tensor_t *d, const char *name, int hint, epx_tensor_t *t)
{
    t->dtype = map_dtype(d->dtype, hint);
    if (t->dtype == EPX_DTYPE_INVALID) {
        py_raise_invalid(
            "%s has DLPack dtype (code %d, %d bits, %d lanes), which is none of epx's dtypes "
            "(bf16 as torch.bfloat16 or uint16 bit patterns, fp32, fp8_e4m3, int32, int64, bool, "
            "uint8)",
            name, d->dtype.code, d->dtype.bits, d->dtype.lanes);
        return -1;
    }
    if (d->device.device_type == DL_CPU || d->device.device_type == DL_CUDA_HOST) {
        t->device_type = EPX_DEVICE_HOST;
    } else if (d->device.device_type == DL_CUDA) {
        t->device_type = EPX_DEVICE_CUDA;
    } else {
        py_raise_invalid("%s is on DLPack device type %d; epx takes host (cpu) or cuda memory", name,
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
}

/* ------------------------------------------------------------------ torch without DLPack ---- */

/* Interned attribute names of the torch fast path. */
static struct {
    PyObject *is_cuda, *is_cpu, *requires_grad, *layout, *data_ptr, *shape, *stride, *get_device, *new_empty;
    PyObject *is_neg, *is_conj, *resolve_neg, *resolve_conj, *detach;
} g_names;

static int names_ready(void)
{
    if (g_names.detach) return 1;
#define NAME_(f) (g_names.f = g_names.f ? g_names.f : PyUnicode_InternFromString(#f))
    if (!NAME_(is_cuda) || !NAME_(is_cpu) || !NAME_(requires_grad) || !NAME_(layout) || !NAME_(data_ptr) ||
        !NAME_(shape) || !NAME_(stride) || !NAME_(get_device) || !NAME_(new_empty) || !NAME_(is_neg) ||
        !NAME_(is_conj) || !NAME_(resolve_neg) || !NAME_(resolve_conj) || !NAME_(detach)) {
        PyErr_Clear();
        return 0;
    }
#undef NAME_
    return 1;
}

/* 1 for True, 0 for False, -1 for anything else or an error (cleared); consumes v. */
static int bool_of(PyObject *v)
{
    if (!v) {
        PyErr_Clear();
        return -1;
    }
    const int r = v == Py_True ? 1 : v == Py_False ? 0 : -1;
    Py_DECREF(v);
    return r;
}

/* obj's attribute `name` as a flag (bool_of). */
static int attr_flag(PyObject *obj, PyObject *name)
{
    return bool_of(PyObject_GetAttr(obj, name));
}

/* What obj.name() returns, as a flag (bool_of). */
static int method_flag(PyObject *obj, PyObject *name)
{
    return bool_of(PyObject_CallMethodNoArgs(obj, name));
}

/* Where a plain torch.Tensor lives, read from the tensor (no __dlpack_device__): DL_CUDA with its index,
 * or DL_CPU. 0 when that cannot be told this way (another device, a subclass): the DLPack path decides. */
static int torch_device_of(PyObject *obj, int *type, int *id)
{
    if (!py_state.torch_tensor_type || Py_TYPE(obj) != (PyTypeObject *)py_state.torch_tensor_type ||
        !names_ready())
        return 0;
    int cuda = attr_flag(obj, g_names.is_cuda);
    if (cuda == 1) {
        PyObject *d = PyObject_CallMethodNoArgs(obj, g_names.get_device);
        long v = d ? PyLong_AsLong(d) : -1;
        Py_XDECREF(d);
        if (v < 0 || PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        *type = DL_CUDA;
        *id = (int)v;
        return 1;
    }
    if (cuda == 0 && attr_flag(obj, g_names.is_cpu) == 1) {
        *type = DL_CPU;
        *id = 0;
        return 1;
    }
    return 0;
}

/* The DLPack dtype a torch dtype object exports as (lanes 0: none of epx's). */
static dl_dtype_t torch_dl_dtype(PyObject *dt)
{
    static const struct {
        epx_dtype_t epx;
        dl_dtype_t dl;
    } map[] = {
        {EPX_DTYPE_BF16, {DL_BFLOAT, 16, 1}}, {EPX_DTYPE_FP32, {DL_FLOAT, 32, 1}},
        {EPX_DTYPE_INT32, {DL_INT, 32, 1}},   {EPX_DTYPE_INT64, {DL_INT, 64, 1}},
        {EPX_DTYPE_BOOL, {DL_BOOL, 8, 1}},
    };
    for (size_t i = 0; i < sizeof(map) / sizeof(map[0]); i++)
        if (dt == py_state.torch_dtypes[map[i].epx]) return map[i].dl;
    if (py_state.torch_fp8 && dt == py_state.torch_fp8) return (dl_dtype_t){DL_FLOAT8_E4M3FN, 8, 1};
    if (dt == py_state.torch_uint8) return (dl_dtype_t){DL_UINT, 8, 1};
    return (dl_dtype_t){0, 0, 0};
}

/* Reads a tuple of ints (torch.Size, stride()) into v[0..n); the count, or -1 (error cleared). */
static int read_ints(PyObject *tuple, int64_t *v, int max)
{
    if (!tuple || !PyTuple_Check(tuple)) return -1;
    const Py_ssize_t n = PyTuple_GET_SIZE(tuple);
    if (n > max) return (int)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        v[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, i));
        if (v[i] == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return -1;
        }
    }
    return (int)n;
}

/* A plain torch.Tensor described from its own attributes (data_ptr, shape, stride, dtype), without the
 * DLPack round trip (several us of Python per tensor, most of a small call's host time), where DLPack
 * would add nothing: a strided tensor (one that required grad comes detached, resolved()) on the host,
 * or on cuda consumed on torch's current stream. Returns 1 when described, 0 for the DLPack path, -1 on
 * error (raised). */
static int import_torch(call_ctx_t *ctx, keep_t *keep, PyObject *obj, const char *name, int hint,
                        epx_tensor_t *t)
{
    int type, id;
    if (ctx->fw != FW_TORCH || !py_state.torch_strided || !torch_device_of(obj, &type, &id)) return 0;
    if (type == DL_CUDA) {
        if (ctx->dl_device_type != DL_CUDA) return 0;
        void *s = resolve_stream(ctx);
        if (PyErr_Occurred()) return -1;
        (void)s;
        if (!ctx->stream_is_torch_current) return 0; /* DLPack orders torch's work before that stream */
    }
    PyObject *layout = PyObject_GetAttr(obj, g_names.layout);
    const int strided = layout == py_state.torch_strided;
    Py_XDECREF(layout);
    PyObject *dt = strided ? PyObject_GetAttr(obj, py_state.str_dtype) : NULL;
    dl_dtype_t dl = dt ? torch_dl_dtype(dt) : (dl_dtype_t){0, 0, 0};
    Py_XDECREF(dt);
    if (!dl.lanes) {
        PyErr_Clear();
        return 0;
    }
    int64_t shape[EPX_MAX_DIMS + 1], strides[EPX_MAX_DIMS + 1];
    PyObject *sh = PyObject_GetAttr(obj, g_names.shape);
    PyObject *st = sh ? PyObject_CallMethodNoArgs(obj, g_names.stride) : NULL;
    PyObject *ptr = st ? PyObject_CallMethodNoArgs(obj, g_names.data_ptr) : NULL;
    const int nd = read_ints(sh, shape, EPX_MAX_DIMS), ns = read_ints(st, strides, EPX_MAX_DIMS);
    void *data = ptr ? PyLong_AsVoidPtr(ptr) : NULL;
    Py_XDECREF(sh);
    Py_XDECREF(st);
    Py_XDECREF(ptr);
    if (PyErr_Occurred() || nd < 0 || ns != nd) {
        PyErr_Clear();
        return 0;
    }
    if (nd > EPX_MAX_DIMS) {
        py_raise_invalid("%s has %d dimensions; epx tensors have at most %d", name, nd, EPX_MAX_DIMS);
        return -1;
    }
    Py_INCREF(obj);
    if (keep_add(keep, obj) != 0) return -1; /* the tensor's memory stays until the call ends */
    dl_tensor_t d = {data, {type, id}, nd, dl, shape, strides, 0};
    return describe_tensor(&d, name, hint, t) == 0 ? 1 : -1;
}

/* A torch tensor that requires grad: its detached view (the same memory; epx reads and writes tensors
 * outside autograd, as DeepEP's calls do, and DLPack refuses such a tensor). A negative or conjugate
 * view: its resolved copy (whose bytes are its values; DLPack would export the view's bytes). Anything
 * else: obj itself. A new reference; NULL on error. */
static PyObject *resolved(const call_ctx_t *ctx, PyObject *obj)
{
    Py_INCREF(obj);
    if (ctx->fw != FW_TORCH || !py_state.torch_tensor_type ||
        !PyObject_TypeCheck(obj, (PyTypeObject *)py_state.torch_tensor_type) || !names_ready())
        return obj;
    if (attr_flag(obj, g_names.requires_grad) == 1) Py_SETREF(obj, PyObject_CallMethodNoArgs(obj, g_names.detach));
    if (!obj) return NULL;
    if (method_flag(obj, g_names.is_neg) == 1) Py_SETREF(obj, PyObject_CallMethodNoArgs(obj, g_names.resolve_neg));
    if (obj && method_flag(obj, g_names.is_conj) == 1)
        Py_SETREF(obj, PyObject_CallMethodNoArgs(obj, g_names.resolve_conj));
    return obj;
}

/* The DLPack path of py_import_tensor. */
static int import_dlpack(call_ctx_t *ctx, keep_t *keep, PyObject *obj, const char *name, int hint,
                         epx_tensor_t *t)
{
    PyObject *src = obj;
    Py_INCREF(src);
    /* torch's fp8 may not export through DLPack: export its bytes and keep the meaning here. */
    if (ctx->fw == FW_TORCH && py_state.torch_fp8 &&
        PyObject_TypeCheck(obj, (PyTypeObject *)py_state.torch_tensor_type)) {
        PyObject *dt = PyObject_GetAttr(obj, py_state.str_dtype);
        if (!dt) goto fail_src;
        int is_fp8 = dt == py_state.torch_fp8;
        Py_DECREF(dt);
        if (is_fp8) {
            Py_DECREF(src);
            src = PyObject_CallMethodOneArg(obj, py_state.str_view, py_state.torch_uint8);
            if (!src) return -1;
            hint = HINT_FP8;
        }
    }
    PyObject *method = PyObject_GetAttr(src, py_state.str_dlpack);
    if (!method) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "epx: %s (%.100s) does not support the DLPack protocol (__dlpack__)",
                     name, Py_TYPE(obj)->tp_name);
        goto fail_src;
    }
    PyObject *capsule = export_capsule(ctx, method, src);
    Py_DECREF(method);
    if (!capsule) {
        name_pending_error(name);
        goto fail_src;
    }
    Py_DECREF(src);
    if (keep_add(keep, capsule) != 0) return -1;
    dl_managed_t *m = PyCapsule_GetPointer(capsule, "dltensor");
    if (!m) {
        name_pending_error(name);
        return -1;
    }
    const dl_tensor_t *d = &m->dl_tensor;
    if (d->ndim > EPX_MAX_DIMS) {
        py_raise_invalid("%s has %d dimensions; epx tensors have at most %d", name, (int)d->ndim,
                         EPX_MAX_DIMS);
        return -1;
    }
    return describe_tensor(d, name, hint, t);

fail_src:
    Py_DECREF(src);
    return -1;
}

int py_import_tensor(call_ctx_t *ctx, keep_t *keep, PyObject *obj, const char *name, int hint,
                     epx_tensor_t *t)
{
    memset(t, 0, sizeof(*t));
    if (obj == NULL || obj == Py_None) return 0;
    PyObject *held = resolved(ctx, obj); /* the call keeps what it reads (keep) until it ends */
    if (!held) return -1;
    int res = import_torch(ctx, keep, held, name, hint, t);
    res = res == 0 ? import_dlpack(ctx, keep, held, name, hint, t) : res < 0 ? -1 : 0;
    Py_DECREF(held);
    return res;
}

int py_ctx_init(call_ctx_t *ctx, keep_t *keep, PyObject *ref, PyObject *stream_arg)
{
    memset(ctx, 0, sizeof(*ctx));
    ctx->stream_arg = stream_arg;
    ctx->dl_device_type = DL_CPU;
    if (py_state.numpy_ndarray && PyObject_TypeCheck(ref, py_state.numpy_ndarray)) {
        ctx->fw = FW_NUMPY;
        return 0;
    }
    if (!py_state.torch_empty) py_refresh_torch();
    if (py_state.torch_tensor_type && PyObject_TypeCheck(ref, (PyTypeObject *)py_state.torch_tensor_type)) {
        ctx->fw = FW_TORCH;
        PyObject *device = PyObject_GetAttr(ref, py_state.str_device);
        if (!device || keep_add(keep, device) != 0) return -1;
        ctx->device = device;
    }
    if (ctx->fw == FW_TORCH && torch_device_of(ref, &ctx->dl_device_type, &ctx->device_id)) return 0;
    PyObject *dev = PyObject_CallMethodNoArgs(ref, py_state.str_dlpack_device);
    if (!dev) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "epx: %.100s does not support the DLPack protocol (__dlpack_device__)",
                     Py_TYPE(ref)->tp_name);
        return -1;
    }
    int type = 0, id = 0;
    int ok = PyTuple_Check(dev) && PyArg_ParseTuple(dev, "ii", &type, &id);
    Py_DECREF(dev);
    if (!ok) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "epx: %.100s.__dlpack_device__() did not return a (device type, device id) "
                     "tuple of ints", Py_TYPE(ref)->tp_name);
        return -1;
    }
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
    if (ctx->dl_device_type == DL_CUDA && ctx->fw == FW_TORCH && py_state.torch_raw_stream) {
        /* torch's C entry: the current stream's handle without building a torch.cuda.Stream. */
        PyObject *ptr = PyObject_CallFunction(py_state.torch_raw_stream, "i", ctx->device_id);
        if (ptr) {
            ctx->stream = PyLong_AsVoidPtr(ptr);
            Py_DECREF(ptr);
            if (!PyErr_Occurred()) {
                ctx->stream_is_torch_current = 1;
                ctx->stream_resolved = 1;
                return ctx->stream;
            }
        }
        PyErr_Clear(); /* the Python entry below decides */
    }
    if (ctx->dl_device_type == DL_CUDA && ctx->fw == FW_TORCH && py_state.torch_current_stream) {
        PyObject *s = PyObject_CallOneArg(py_state.torch_current_stream, ctx->device);
        if (!s) return NULL;
        PyObject *ptr = PyObject_GetAttr(s, py_state.str_cuda_stream);
        Py_DECREF(s);
        if (!ptr) return NULL;
        ctx->stream = PyLong_AsVoidPtr(ptr);
        Py_DECREF(ptr);
        ctx->stream_is_torch_current = 1;
    }
    ctx->stream_resolved = !PyErr_Occurred();
    return ctx->stream;
}

int py_stream_of(call_ctx_t *ctx, void **out)
{
    *out = resolve_stream(ctx);
    return PyErr_Occurred() ? -1 : 0;
}

/* ------------------------------------------------------------------ tensors out ---- */

int py_ensure_numpy(void)
{
    if (py_state.numpy_empty) return 0;
    PyObject *np = PyImport_ImportModule("numpy");
    if (!np) return -1;
    py_state.numpy_empty = PyObject_GetAttrString(np, "empty");
    py_state.numpy_ndarray = (PyTypeObject *)PyObject_GetAttrString(np, "ndarray");
    PyObject *dtype = PyObject_GetAttrString(np, "dtype");
    static const char *names[EPX_DTYPE_COUNT_] = {NULL,    "uint16", "float32", "uint8",
                                                  "int32", "int64",  "bool",    "uint8"};
    for (int i = 1; i < EPX_DTYPE_COUNT_ && dtype; i++)
        py_state.numpy_dtypes[i] = PyObject_CallFunction(dtype, "s", names[i]);
    Py_XDECREF(dtype);
    Py_DECREF(np);
    return py_state.numpy_empty && py_state.numpy_ndarray ? 0 : -1;
}

void py_refresh_torch(void)
{
    if (py_state.torch_empty) return;
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
    for (int i = 1; i < EPX_DTYPE_COUNT_; i++)
        py_state.torch_dtypes[i] = PyObject_GetAttrString(torch, names[i]);
    py_state.torch_uint8 = PyObject_GetAttrString(torch, "uint8");
    py_state.torch_fp8 = PyObject_GetAttrString(torch, "float8_e4m3fn");
    if (!py_state.torch_fp8) PyErr_Clear();
    PyObject *cuda = PyObject_GetAttrString(torch, "cuda");
    if (cuda) {
        py_state.torch_current_stream = PyObject_GetAttrString(cuda, "current_stream");
        Py_DECREF(cuda);
    }
    PyErr_Clear();
    PyObject *c = PyObject_GetAttrString(torch, "_C");
    py_state.torch_raw_stream = c ? PyObject_GetAttrString(c, "_cuda_getCurrentRawStream") : NULL;
    Py_XDECREF(c);
    PyErr_Clear();
    py_state.torch_strided = PyObject_GetAttrString(torch, "strided");
    PyErr_Clear();
    py_state.torch_tensor_type = tensor;
    py_state.torch_empty = empty;
}

/* An empty torch tensor of `dtype` on the call's device, kept per device and dtype: outputs are made
 * with its new_empty(shape), which takes the dtype and device from it instead of parsing them as keyword
 * arguments on every call (about half of torch.empty's cost for the small outputs of LL calls). NULL (no
 * error) where there is none to keep: the caller takes torch.empty. Borrowed. */
static PyObject *torch_template(const call_ctx_t *ctx, epx_dtype_t dtype)
{
    enum { CUDA_SLOTS = 16 };
    static PyObject *kept[1 + CUDA_SLOTS][EPX_DTYPE_COUNT_];
    const int slot = ctx->dl_device_type == DL_CPU                                  ? 0
                     : ctx->dl_device_type == DL_CUDA && ctx->device_id >= 0 &&
                             ctx->device_id < CUDA_SLOTS                            ? 1 + ctx->device_id
                                                                                    : -1;
    if (slot < 0 || dtype <= 0 || dtype >= EPX_DTYPE_COUNT_ || !ctx->device || !names_ready() ||
        !py_state.torch_empty || !py_state.torch_dtypes[dtype])
        return NULL;
    if (!kept[slot][dtype]) {
        /* fp8 outputs are made as torch's float8 directly when torch has it (no view per call). */
        PyObject *tdt = dtype == EPX_DTYPE_FP8_E4M3 && py_state.torch_fp8 ? py_state.torch_fp8
                                                                         : py_state.torch_dtypes[dtype];
        PyObject *kwargs = Py_BuildValue("{sOsO}", "dtype", tdt, "device", ctx->device);
        PyObject *args = Py_BuildValue("((i))", 0);
        kept[slot][dtype] = kwargs && args ? PyObject_Call(py_state.torch_empty, args, kwargs) : NULL;
        Py_XDECREF(kwargs);
        Py_XDECREF(args);
        if (!kept[slot][dtype]) PyErr_Clear();
    }
    return kept[slot][dtype];
}

/* A contiguous output of our own making (numpy array or torch tensor from a template): its description
 * from what we asked for, without asking the framework. A zero-element tensor's NULL data gets the
 * stand-in address, as describe_tensor gives it. */
static void describe_own(epx_tensor_t *t, void *data, epx_dtype_t dtype, int ndim, const int64_t *shape,
                         int cuda, int device_id)
{
    memset(t, 0, sizeof(*t));
    t->dtype = dtype;
    t->ndim = ndim;
    int empty = 0;
    for (int i = 0; i < ndim; i++) {
        t->shape[i] = shape[i] > 0 ? shape[i] : 0;
        empty |= t->shape[i] == 0;
    }
    t->data = data || !empty ? data : (void *)&g_empty_data;
    t->device_type = cuda ? EPX_DEVICE_CUDA : EPX_DEVICE_HOST;
    t->device_id = cuda ? device_id : 0;
}
/* *obj_out gets the new reference the caller returns (for torch fp8, the float8 view of the exported
 * bytes). */
int py_alloc_tensor(call_ctx_t *ctx, keep_t *keep, epx_dtype_t dtype, int ndim, const int64_t *shape,
                    const char *name, PyObject **obj_out, epx_tensor_t *t)
{
    *obj_out = NULL;
    PyObject *py_shape = PyTuple_New(ndim);
    if (!py_shape) return -1;
    for (int i = 0; i < ndim; i++)
        PyTuple_SET_ITEM(py_shape, i, PyLong_FromLongLong(shape[i] > 0 ? shape[i] : 0));
    PyObject *obj = NULL;
    PyObject *tmpl = ctx->fw == FW_TORCH ? torch_template(ctx, dtype) : NULL;
    if (tmpl) {
        /* new_empty(d0, d1, ...): torch parses separate ints faster than a tuple (about 0.4 us less per
         * output here, a quarter of an LL dispatch's Python overhead with four outputs). */
        PyObject *slots[2 + EPX_MAX_DIMS], **argv = slots + 1; /* slots[0]: the offset's spare slot */
        argv[0] = tmpl;
        for (int i = 0; i < ndim && i < EPX_MAX_DIMS; i++) argv[1 + i] = PyTuple_GET_ITEM(py_shape, i);
        obj = ndim > 0 && ndim <= EPX_MAX_DIMS
                  ? PyObject_VectorcallMethod(g_names.new_empty, argv,
                                              (size_t)(1 + ndim) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL)
                  : PyObject_CallMethodOneArg(tmpl, g_names.new_empty, py_shape);
        Py_DECREF(py_shape);
        if (!obj) return -1;
        /* Our own new tensor: contiguous, of the template's dtype and device, no grad, no neg or conj
         * view. Only its address is read (the general import asks torch for about ten attributes). On
         * cuda only when the call runs on torch's current stream, where the allocator's own ordering
         * holds; on another stream the DLPack import below orders it. */
        void *s = ctx->dl_device_type == DL_CUDA ? resolve_stream(ctx) : NULL;
        (void)s;
        if (PyErr_Occurred()) {
            Py_DECREF(obj);
            return -1;
        }
        const int cuda_ok = ctx->dl_device_type == DL_CUDA && ctx->stream_is_torch_current;
        if (ctx->dl_device_type == DL_CPU || cuda_ok) {
            PyObject *ptr = PyObject_CallMethodNoArgs(obj, g_names.data_ptr);
            void *data = ptr ? PyLong_AsVoidPtr(ptr) : NULL;
            Py_XDECREF(ptr);
            if (PyErr_Occurred()) {
                Py_DECREF(obj);
                return -1;
            }
            describe_own(t, data, dtype, ndim, shape, ctx->dl_device_type == DL_CUDA, ctx->device_id);
            *obj_out = obj;
            return 0;
        }
        py_shape = NULL;
    } else if (ctx->fw == FW_TORCH) {
        PyObject *kwargs =
            Py_BuildValue("{sOsO}", "dtype", py_state.torch_dtypes[dtype], "device", ctx->device);
        PyObject *args = PyTuple_Pack(1, py_shape);
        obj = kwargs && args ? PyObject_Call(py_state.torch_empty, args, kwargs) : NULL;
        Py_XDECREF(kwargs);
        Py_XDECREF(args);
    } else {
        obj =
            PyObject_CallFunctionObjArgs(py_state.numpy_empty, py_shape, py_state.numpy_dtypes[dtype], NULL);
    }
    Py_XDECREF(py_shape);
    if (!obj) return -1;
    if (ctx->fw != FW_TORCH) {
        /* A contiguous numpy array of our own: its address through the buffer protocol, without the
         * DLPack round trip (half of a small call's host time went there). */
        Py_buffer view;
        if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE) != 0) {
            Py_DECREF(obj);
            return -1;
        }
        describe_own(t, view.buf, dtype, ndim, shape, 0, 0);
        PyBuffer_Release(&view); /* the array itself stays alive as the call's output */
        *obj_out = obj;
        return 0;
    }
    int hint = dtype == EPX_DTYPE_FP8_E4M3 ? HINT_FP8 : dtype == EPX_DTYPE_BOOL ? HINT_BOOL : HINT_NONE;
    if (py_import_tensor(ctx, keep, obj, name, hint, t) != 0) {
        Py_DECREF(obj);
        return -1;
    }
    if (ctx->fw == FW_TORCH && dtype == EPX_DTYPE_FP8_E4M3 && py_state.torch_fp8 && !tmpl) {
        PyObject *view = PyObject_CallMethodOneArg(obj, py_state.str_view, py_state.torch_fp8);
        Py_DECREF(obj);
        if (!view) return -1;
        obj = view;
    }
    *obj_out = obj;
    return 0;
}

int py_slice_rows(PyObject **obj, int64_t n, int64_t cap)
{
    if (!*obj || n >= cap) return 0;
    PyObject *s = PySequence_GetSlice(*obj, 0, (Py_ssize_t)n);
    if (!s) return -1;
    Py_SETREF(*obj, s);
    return 0;
}
