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

int py_import_tensor(call_ctx_t *ctx, keep_t *keep, PyObject *obj, const char *name, int hint,
                     epx_tensor_t *t)
{
    memset(t, 0, sizeof(*t));
    if (obj == NULL || obj == Py_None) return 0;
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
    if (!capsule) goto fail_src;
    Py_DECREF(src);
    if (keep_add(keep, capsule) != 0) return -1;
    dl_managed_t *m = PyCapsule_GetPointer(capsule, "dltensor");
    if (!m) return -1;
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
    PyObject *dev = PyObject_CallMethodNoArgs(ref, py_state.str_dlpack_device);
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
    py_state.torch_tensor_type = tensor;
    py_state.torch_empty = empty;
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
    if (ctx->fw == FW_TORCH) {
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
    Py_DECREF(py_shape);
    if (!obj) return -1;
    if (ctx->fw != FW_TORCH) {
        /* A contiguous numpy array of our own: its address through the buffer protocol, without the
         * DLPack round trip (half of a small call's host time went there). */
        Py_buffer view;
        if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE) != 0) {
            Py_DECREF(obj);
            return -1;
        }
        memset(t, 0, sizeof(*t));
        t->data = view.buf;
        PyBuffer_Release(&view); /* the array itself stays alive as the call's output */
        t->dtype = dtype;
        t->ndim = ndim;
        for (int i = 0; i < ndim; i++) t->shape[i] = shape[i] > 0 ? shape[i] : 0;
        t->device_type = EPX_DEVICE_HOST;
        *obj_out = obj;
        return 0;
    }
    int hint = dtype == EPX_DTYPE_FP8_E4M3 ? HINT_FP8 : dtype == EPX_DTYPE_BOOL ? HINT_BOOL : HINT_NONE;
    if (py_import_tensor(ctx, keep, obj, name, hint, t) != 0) {
        Py_DECREF(obj);
        return -1;
    }
    if (ctx->fw == FW_TORCH && dtype == EPX_DTYPE_FP8_E4M3 && py_state.torch_fp8) {
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
