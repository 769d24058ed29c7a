/*
 * Library memory handed to Python: the View type (DLPack and buffer-protocol export of part of a
 * buffer's memory), the generations of the two HT areas whose views the binding returns (dispatch
 * outputs, combine input), and how a tensor passed back in is recognised as one of those views.
 */
#include "_epx.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ areas ---- */

static area_t *area_of(BufferObject *b, int kind)
{
    return kind == VIEW_RECV ? &b->recv : kind == VIEW_CIN ? &b->cin : NULL;
}

int py_views_alive(const BufferObject *b)
{
    return b->recv.live + b->recv.stale + b->cin.live + b->cin.stale;
}

void py_area_reuse(BufferObject *b, int kind)
{
    area_t *a = area_of(b, kind);
    a->gen++;
    a->stale += a->live;
    a->live = 0;
    a->handle = NULL;
    a->rows = 0;
}

void py_area_returned(BufferObject *b, int kind, const epx_tensor_t *views, int n)
{
    area_t *a = area_of(b, kind);
    /* Without stale views the old bytes matter no more (the host backend may have moved them). */
    if (!a->stale) a->lo = a->hi = NULL;
    for (int i = 0; i < n; i++) {
        if (!views[i].data) continue;
        size_t bytes = epx_dtype_size(views[i].dtype);
        for (int d = 0; d < views[i].ndim; d++) bytes *= (size_t)views[i].shape[d];
        const char *lo = views[i].data, *hi = lo + bytes;
        if (!a->lo || lo < a->lo) a->lo = lo;
        if (!a->hi || hi > a->hi) a->hi = hi;
    }
}

/* The View a numpy array was made over (its base chain ends there), or NULL. */
static ViewObject *numpy_view_of(PyObject *obj)
{
    if (!py_state.numpy_ndarray || !PyObject_TypeCheck(obj, py_state.numpy_ndarray)) return NULL;
    PyObject *o = obj;
    Py_INCREF(o);
    for (int depth = 0; depth < 16; depth++) {
        PyObject *base = PyObject_GetAttr(o, py_state.str_base);
        Py_DECREF(o);
        if (!base) {
            PyErr_Clear();
            return NULL;
        }
        if (Py_IS_TYPE(base, &py_view_type)) {
            Py_DECREF(base); /* obj keeps it alive */
            return (ViewObject *)base;
        }
        if (base == Py_None || !PyObject_TypeCheck(base, py_state.numpy_ndarray)) {
            Py_DECREF(base);
            return NULL;
        }
        o = base;
    }
    Py_DECREF(o);
    return NULL;
}

int py_view_classify(BufferObject *b, PyObject *obj, const epx_tensor_t *t, epx_handle_t *handle_out)
{
    *handle_out = NULL;
    if (!t->data || (!b->recv.hi && !b->cin.hi)) return AT_NONE;
    /* numpy arrays lead to their View: exact. */
    ViewObject *v = numpy_view_of(obj);
    if (v && v->owner == b && v->kind != VIEW_PLAIN) {
        const area_t *a = area_of(b, v->kind);
        *handle_out = v->handle;
        if (v->kind == VIEW_RECV) return v->gen == a->gen ? AT_RECV : AT_RECV_STALE;
        return v->gen == a->gen ? AT_CIN : AT_CIN_STALE;
    }
    /* Otherwise (torch) by address: inside an area with no view of the current generation alive, it
     * is stale; with one alive it counts as current (a stale view held next to a current one cannot be
     * told apart there). */
    const int kinds[] = {VIEW_RECV, VIEW_CIN};
    for (int i = 0; i < 2; i++) {
        const area_t *a = area_of(b, kinds[i]);
        const char *p = t->data;
        if (!a->lo || p < a->lo || p >= a->hi) continue;
        if (kinds[i] == VIEW_CIN) *handle_out = a->handle;
        if (kinds[i] == VIEW_RECV) return a->live > 0 ? AT_RECV : AT_RECV_STALE;
        return a->live > 0 ? AT_CIN : AT_CIN_STALE;
    }
    return AT_NONE;
}

int py_raise_stale(const char *name, const char *what)
{
    PyObject *cls = py_state.stale_view_error ? py_state.stale_view_error : PyExc_ValueError;
    PyErr_Format(cls,
                 "epx: %s is a view of %s that a later call on this buffer reused; keep a copy "
                 "(.copy() / .clone()) of what must outlive it, or make the buffer with views=False",
                 name, what);
    return -1;
}

/* ------------------------------------------------------------------ HT calls ---- */

/* Whether this dispatch returns views: the call's views= else the buffer's, except for a bound above
 * R * T_max (no dispatch reaches it; such calls keep caller-owned outputs as before views), and on the
 * host backend a dtype wider than any earlier view dispatch while views are alive (the host's view
 * array grows, and may move, for it). */
int py_dispatch_views(BufferObject *self, PyObject *views_obj, const epx_tensor_t *x, int64_t num_worst)
{
    int views = self->views;
    if (views_obj != Py_None && (views = PyObject_IsTrue(views_obj)) < 0) return -1;
    if (!views || num_worst > (int64_t)self->R * self->cfg.max_tokens) return 0;
    const size_t elem = epx_dtype_size(x->dtype);
    if (self->comm->topo.backend == EPX_BACKEND_HOST && elem > self->view_elem_max &&
        self->recv.live + self->recv.stale > 0)
        return 0;
    return 1;
}

/* The handle's rows of x copied into its combine input, for the view combine to read from there.
 * Host memory is copied here; device memory through torch on the call's stream. */
int py_stage_combine_input(BufferObject *self, HandleObject *h, PyObject *x_obj, const epx_tensor_t *x,
                           PyObject *stream_obj)
{
    epx_tensor_t in;
    epx_result_t res;
    WITHOUT_GIL(res = epx_ht_get_combine_input(self->buf, h->handle, &in));
    if (res != EPX_SUCCESS) {
        py_raise_epx(res);
        return -1;
    }
    const int64_t rows = in.shape[0], H = self->cfg.hidden;
    const int compact = !x->strides[0] && !x->strides[1];
    if (x->dtype != EPX_DTYPE_BF16 || x->ndim != 2 || x->shape[1] != H || x->shape[0] < rows || !compact) {
        py_raise_invalid("x must be a contiguous [>= %lld, %lld] bf16 tensor (N_r or num_worst_tokens rows); "
                         "got %s with %d dimensions, shape[0] = %lld",
                         (long long)rows, (long long)H, epx_dtype_name(x->dtype), (int)x->ndim,
                         (long long)(x->ndim > 0 ? x->shape[0] : 0));
        return -1;
    }
    if (x->device_type != in.device_type ||
        (in.device_type == EPX_DEVICE_CUDA && x->device_id != in.device_id)) {
        py_raise_invalid("x is in %s memory (device %d); the buffer's is %s memory (device %d)",
                         x->device_type == EPX_DEVICE_CUDA ? "cuda" : "host", (int)x->device_id,
                         in.device_type == EPX_DEVICE_CUDA ? "cuda" : "host", (int)in.device_id);
        return -1;
    }
    py_area_reuse(self, VIEW_CIN); /* its earlier views see these rows now */
    const size_t bytes = (size_t)rows * (size_t)H * 2;
    if (!bytes) return 0;
    if (in.device_type == EPX_DEVICE_HOST) {
        WITHOUT_GIL(memcpy(in.data, x->data, bytes));
        return 0;
    }
    if (!py_state.copy_rows) {
        PyErr_SetString(PyExc_RuntimeError, "epx: the package did not register its device copy");
        return -1;
    }
    PyObject *dst = py_view_export(self, &in, VIEW_PLAIN, NULL, FW_TORCH);
    PyObject *done =
        dst ? PyObject_CallFunctionObjArgs(py_state.copy_rows, dst, x_obj, stream_obj, NULL) : NULL;
    Py_XDECREF(dst);
    Py_XDECREF(done);
    return done ? 0 : -1;
}

PyObject *py_buffer_combine_input(BufferObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"handle", NULL};
    HandleObject *h;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!", kw, &py_handle_type, &h)) return NULL;
    if (py_buffer_check(self) != 0 || py_handle_check(h, HANDLE_HT) != 0) return NULL;
    epx_tensor_t t;
    epx_result_t res;
    WITHOUT_GIL(res = epx_ht_get_combine_input(self->buf, h->handle, &t));
    if (res != EPX_SUCCESS) return py_raise_epx(res);
    /* The rows of another handle replace the ones its views show. */
    if (self->cin.handle != h->handle) py_area_reuse(self, VIEW_CIN);
    PyObject *out = py_view_export(self, &t, VIEW_CIN, h->handle, h->fw);
    if (!out) return NULL;
    self->cin.handle = h->handle;
    self->cin.rows = t.shape[0];
    py_area_returned(self, VIEW_CIN, &t, 1);
    return out;
}

/* ------------------------------------------------------------------ View ---- */

static dl_dtype_t dl_dtype_of(epx_dtype_t d)
{
    switch (d) {
    case EPX_DTYPE_BF16: return (dl_dtype_t){DL_BFLOAT, 16, 1};
    case EPX_DTYPE_FP32: return (dl_dtype_t){DL_FLOAT, 32, 1};
    case EPX_DTYPE_INT32: return (dl_dtype_t){DL_INT, 32, 1};
    case EPX_DTYPE_INT64: return (dl_dtype_t){DL_INT, 64, 1};
    case EPX_DTYPE_BOOL: return (dl_dtype_t){DL_BOOL, 8, 1};
    default: return (dl_dtype_t){DL_UINT, 8, 1}; /* fp8 and uint8: bytes (torch views them as fp8) */
    }
}

typedef struct {
    dl_managed_t m;
    int64_t shape[EPX_MAX_DIMS];
    PyObject *view;
} view_managed_t;

static void view_managed_delete(dl_managed_t *m)
{
    view_managed_t *vm = (view_managed_t *)m;
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_XDECREF(vm->view);
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

/* The consumer's tensor keeps this View (so its area's count, and the buffer) alive until it goes. */
static PyObject *view_dlpack(ViewObject *self, PyObject *args, PyObject *kwargs)
{
    view_managed_t *vm = calloc(1, sizeof(*vm));
    if (!vm) return PyErr_NoMemory();
    const int cuda = self->t.device_type == EPX_DEVICE_CUDA;
    vm->m.dl_tensor.data = self->t.data;
    vm->m.dl_tensor.device.device_type = cuda ? DL_CUDA : DL_CPU;
    vm->m.dl_tensor.device.device_id = cuda ? self->t.device_id : 0;
    vm->m.dl_tensor.ndim = self->t.ndim;
    vm->m.dl_tensor.dtype = dl_dtype_of(self->t.dtype);
    for (int i = 0; i < self->t.ndim; i++) vm->shape[i] = self->t.shape[i];
    vm->m.dl_tensor.shape = vm->shape;
    vm->m.dl_tensor.strides = NULL;
    vm->m.deleter = view_managed_delete;
    Py_INCREF(self);
    vm->view = (PyObject *)self;
    PyObject *capsule = PyCapsule_New(&vm->m, "dltensor", view_capsule_destructor);
    if (!capsule) view_managed_delete(&vm->m);
    return capsule;
}

static PyObject *view_dlpack_device(ViewObject *self, PyObject *unused)
{
    int cuda = self->t.device_type == EPX_DEVICE_CUDA;
    return Py_BuildValue("ii", cuda ? DL_CUDA : DL_CPU, cuda ? (int)self->t.device_id : 0);
}

/* Buffer protocol for numpy: the bytes, writable (numpy gives them the dtype). */
static int view_getbuffer(ViewObject *self, Py_buffer *view, int flags)
{
    int64_t n = (int64_t)epx_dtype_size(self->t.dtype);
    for (int i = 0; i < self->t.ndim; i++) n *= self->t.shape[i];
    if (self->t.device_type != EPX_DEVICE_HOST) {
        PyErr_SetString(PyExc_BufferError, "epx: device memory has no buffer protocol");
        return -1;
    }
    return PyBuffer_FillInfo(view, (PyObject *)self, self->t.data, (Py_ssize_t)n, 0, flags);
}

static void view_dealloc(ViewObject *self)
{
    BufferObject *b = self->owner;
    area_t *a = b ? area_of(b, self->kind) : NULL;
    if (a) {
        if (self->gen == a->gen)
            a->live--;
        else
            a->stale--;
        if (!a->stale && !a->live) a->lo = a->hi = NULL;
        if (b->destroy_pending && !py_views_alive(b)) py_buffer_free(b);
    }
    Py_CLEAR(self->owner);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyBufferProcs view_as_buffer = {(getbufferproc)view_getbuffer, NULL};

static PyMethodDef view_methods[] = {
    {"__dlpack__", KWFN(view_dlpack), METH_VARARGS | METH_KEYWORDS, "DLPack export."},
    {"__dlpack_device__", (PyCFunction)view_dlpack_device, METH_NOARGS, "DLPack device."},
    {NULL},
};

PyTypeObject py_view_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "epx._epx.View",
    .tp_basicsize = sizeof(ViewObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Library memory exported through DLPack and the buffer protocol.",
    .tp_dealloc = (destructor)view_dealloc,
    .tp_methods = view_methods,
    .tp_as_buffer = &view_as_buffer,
};

/* torch: the capsule straight to torch's importer (torch.from_dlpack's Python wrapper costs a few
 * microseconds per tensor); fp8 bytes are then viewed as float8_e4m3fn. */
static PyObject *torch_tensor_of(ViewObject *view)
{
    if (!py_state.torch_from_dlpack) {
        PyObject *torch = PyImport_ImportModule("torch");
        if (!torch) return NULL;
        PyObject *c = PyObject_GetAttrString(torch, "_C");
        PyObject *fn = c ? PyObject_GetAttrString(c, "_from_dlpack") : NULL;
        Py_XDECREF(c);
        if (!fn) {
            PyErr_Clear();
            fn = PyObject_GetAttrString(torch, "from_dlpack");
        }
        Py_DECREF(torch);
        if (!fn) return NULL;
        py_state.torch_from_dlpack = fn;
    }
    PyObject *capsule = view_dlpack(view, NULL, NULL);
    if (!capsule) return NULL;
    PyObject *out = PyObject_CallOneArg(py_state.torch_from_dlpack, capsule);
    Py_DECREF(capsule);
    if (out && view->t.dtype == EPX_DTYPE_FP8_E4M3 && py_state.torch_fp8)
        Py_SETREF(out, PyObject_CallMethodOneArg(out, py_state.str_view, py_state.torch_fp8));
    return out;
}

/* numpy: an ndarray over the View's buffer (its base), with the binding's dtype conventions. */
static PyObject *numpy_array_of(ViewObject *view)
{
    if (py_ensure_numpy() != 0) return NULL;
    PyObject *shape = PyTuple_New(view->t.ndim);
    if (!shape) return NULL;
    for (int i = 0; i < view->t.ndim; i++) PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(view->t.shape[i]));
    PyObject *args = PyTuple_Pack(1, shape);
    PyObject *kwargs =
        Py_BuildValue("{sOsO}", "dtype", py_state.numpy_dtypes[view->t.dtype], "buffer", (PyObject *)view);
    PyObject *out = args && kwargs ? PyObject_Call((PyObject *)py_state.numpy_ndarray, args, kwargs) : NULL;
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    Py_DECREF(shape);
    return out;
}

PyObject *py_view_export(BufferObject *b, const epx_tensor_t *t, int kind, epx_handle_t handle, int fw)
{
    ViewObject *view = PyObject_New(ViewObject, &py_view_type);
    if (!view) return NULL;
    view->t = *t;
    view->kind = kind;
    view->handle = handle;
    Py_INCREF(b);
    view->owner = b;
    area_t *a = area_of(b, kind);
    view->gen = a ? a->gen : 0;
    if (a) a->live++;
    PyObject *out = fw == FW_TORCH ? torch_tensor_of(view) : numpy_array_of(view);
    Py_DECREF(view);
    return out;
}
