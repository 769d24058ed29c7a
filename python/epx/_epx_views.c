/*
 * Library memory handed to Python: the View type (DLPack and buffer-protocol export of part of a
 * buffer's memory), the generations of the HT areas whose views the binding returns (the view areas of
 * the dispatch outputs, the combine input), which area a dispatch writes, how a tensor passed back in is
 * recognised as one of those views, and how a combine takes its x accordingly.
 */
#include "_epx.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ modes and areas ---- */

int py_views_mode(PyObject *obj, int *mode_out)
{
    if (PyUnicode_Check(obj)) {
        if (PyUnicode_CompareWithASCIIString(obj, "pooled") == 0) {
            *mode_out = VIEWS_POOLED;
            return 0;
        }
    } else if (PyBool_Check(obj) || PyLong_Check(obj)) {
        const long v = PyLong_AsLong(obj);
        if (v == 0 || v == 1) {
            *mode_out = v ? VIEWS_ON : VIEWS_OFF;
            return 0;
        }
        PyErr_Clear();
    }
    PyObject *repr = PyObject_Repr(obj);
    const char *text = repr ? PyUnicode_AsUTF8(repr) : NULL;
    if (!text) PyErr_Clear();
    py_raise_invalid("views = %.100s is none of False, True and \"pooled\"", text ? text : "?");
    Py_XDECREF(repr);
    return -1;
}

PyObject *py_views_value(int mode)
{
    if (mode == VIEWS_POOLED) return PyUnicode_FromString("pooled");
    return PyBool_FromLong(mode);
}

int py_views_alive(const BufferObject *b)
{
    int n = b->cin.live + b->cin.stale + b->plain_live;
    for (int k = 0; k < b->num_areas; k++) n += b->recv[k].live + b->recv[k].stale;
    return n;
}

void py_area_reuse(area_t *a)
{
    a->gen++;
    a->stale += a->live;
    a->live = 0;
    a->handle = NULL;
    a->rows = 0;
    a->x = NULL;
}

void py_area_returned(area_t *a, const epx_tensor_t *views, int n)
{
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

static int area_held(const area_t *a)
{
    return a->live + a->stale > 0;
}

/* The area a view-mode dispatch writes. Pooled: the first of areas 0..N-2 that no alive view points
 * into, else the spare N-1, whose outputs go back as copies (*copy) so that none of its views is ever
 * alive. Views: the first area without alive views, else the least recently used one. */
static area_t *pick_area(BufferObject *b, int mode, int *copy)
{
    const int n = b->num_areas, pooled = mode == VIEWS_POOLED;
    *copy = 0;
    for (int k = 0; k < n - pooled; k++)
        if (!area_held(&b->recv[k])) return &b->recv[k];
    if (pooled) {
        *copy = 1;
        return &b->recv[n - 1];
    }
    area_t *lru = &b->recv[0];
    for (int k = 1; k < n; k++)
        if (b->recv[k].used < lru->used) lru = &b->recv[k];
    return lru;
}

/* A call's views= overrides the buffer's mode; True on a pooled buffer stays pooled. On a buffer with
 * views a bound above R * T_max is refused (no view area nor the combine input holds its rows, and a
 * per-rank fallback to outputs of their own would split the ranks' calls). An area's memory never moves
 * (the library allocates it for the widest dtype once). */
int py_dispatch_area(BufferObject *self, PyObject *views_obj, int64_t num_worst, area_t **area_out,
                     int *copy_out)
{
    *area_out = NULL;
    *copy_out = 0;
    int mode = self->views;
    if (views_obj != Py_None) {
        if (py_views_mode(views_obj, &mode) != 0) return -1;
        if (mode == VIEWS_ON && self->views == VIEWS_POOLED) mode = VIEWS_POOLED;
    }
    const int64_t cap = (int64_t)self->R * self->cfg.max_tokens;
    if (self->views != VIEWS_OFF && num_worst > cap) {
        py_raise_invalid("num_worst_tokens = %lld is above the %lld rows (R * max_tokens) that a view area and "
                         "the combine input of a buffer with views hold (N_r never exceeds them); pass a bound "
                         "up to %lld, or use a buffer made with views=False",
                         (long long)num_worst, (long long)cap, (long long)cap);
        return -1;
    }
    if (mode == VIEWS_OFF) return 0;
    int copy;
    area_t *a = pick_area(self, mode, &copy);
    *area_out = a;
    *copy_out = copy;
    return 0;
}

/* The View a numpy array was made over (its base chain ends there), or NULL; a new reference. The chain
 * is followed through exact ndarrays only: a subclass's `base` may be a property that runs any code (and
 * could drop the last reference to what it returns); such an array is classified by address. */
static ViewObject *numpy_view_of(PyObject *obj)
{
    if (!py_state.numpy_ndarray || !Py_IS_TYPE(obj, (PyTypeObject *)py_state.numpy_ndarray)) return NULL;
    PyObject *o = obj;
    Py_INCREF(o);
    for (int depth = 0; depth < 16; depth++) {
        PyObject *base = PyObject_GetAttr(o, py_state.str_base);
        Py_DECREF(o);
        if (!base) {
            PyErr_Clear();
            return NULL;
        }
        if (Py_IS_TYPE(base, &py_view_type)) return (ViewObject *)base;
        if (!Py_IS_TYPE(base, (PyTypeObject *)py_state.numpy_ndarray)) {
            Py_DECREF(base);
            return NULL;
        }
        o = base;
    }
    Py_DECREF(o);
    return NULL;
}

int py_view_classify(BufferObject *b, PyObject *obj, const epx_tensor_t *t, area_t **area_out,
                     epx_handle_t *handle_out)
{
    *area_out = NULL;
    *handle_out = NULL;
    if (!t->data || !py_views_alive(b)) return AT_NONE;
    /* numpy arrays lead to their View: exact. */
    ViewObject *v = numpy_view_of(obj);
    if (v && v->owner == b && v->area) {
        *area_out = v->area;
        *handle_out = v->handle;
        const int current = v->gen == v->area->gen, recv = v->kind == VIEW_RECV;
        Py_DECREF(v);
        if (recv) return current ? AT_RECV : AT_RECV_STALE;
        return current ? AT_CIN : AT_CIN_STALE;
    }
    Py_XDECREF(v);
    /* Otherwise (torch) by address: inside an area with no view of the current generation alive, it
     * is stale; with one alive it counts as current (a stale view held next to a current one cannot be
     * told apart there). */
    const char *p = t->data;
    for (int k = 0; k <= b->num_areas; k++) {
        area_t *a = k < b->num_areas ? &b->recv[k] : &b->cin;
        if (!a->lo || p < a->lo || p >= a->hi) continue;
        *area_out = a;
        if (a == &b->cin) {
            *handle_out = a->handle;
            return a->live > 0 ? AT_CIN : AT_CIN_STALE;
        }
        return a->live > 0 ? AT_RECV : AT_RECV_STALE;
    }
    return AT_NONE;
}

static int raise_stale(const char *name, int at)
{
    PyObject *cls = py_state.stale_view_error ? py_state.stale_view_error : PyExc_ValueError;
    PyErr_Format(cls,
                 "epx: %s is a view of %s that a later call on this buffer reused; keep a copy "
                 "(.copy() / .clone()) of what must outlive it, or make the buffer with views=False or "
                 "views=\"pooled\"",
                 name, at == AT_RECV_STALE ? "dispatch outputs" : "a combine input");
    return -1;
}

int py_check_views_in(BufferObject *self, const tensor_in_t *in, int n, const area_t *rewritten)
{
    for (int i = 0; i < n; i++) {
        area_t *area;
        epx_handle_t vh;
        const int at = py_view_classify(self, in[i].obj, in[i].t, &area, &vh);
        if (at == AT_RECV_STALE || at == AT_CIN_STALE) return raise_stale(in[i].name, at);
        if (rewritten && at == AT_RECV && area == rewritten) {
            py_raise_invalid("%s is a view of this buffer's dispatch outputs, which this dispatch rewrites; "
                             "pass a copy",
                             in[i].name);
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ HT calls ---- */

/* The handle's rows of x copied into its combine input, for the view combine to read from there.
 * Host memory is copied here; device memory through torch on the call's stream. */
static int stage_combine_input(BufferObject *self, HandleObject *h, PyObject *x_obj, const epx_tensor_t *x,
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
    py_area_reuse(&self->cin); /* its earlier views see these rows now */
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
    PyObject *dst = py_view_export(self, &in, NULL, NULL, FW_TORCH);
    PyObject *done =
        dst ? PyObject_CallFunctionObjArgs(py_state.copy_rows, dst, x_obj, stream_obj, NULL) : NULL;
    Py_XDECREF(dst);
    Py_XDECREF(done);
    return done ? 0 : -1;
}

static int is_contiguous_2d(const epx_tensor_t *x, int64_t rows, int64_t cols)
{
    return x->ndim == 2 && x->shape[0] == rows && x->shape[1] == cols && !x->strides[0] && !x->strides[1];
}

/* Whether x is, whole, the bf16 recv_x of the latest dispatch into `area`, made with h. */
static int is_dispatch_x(const BufferObject *self, const area_t *area, const HandleObject *h,
                         const epx_tensor_t *x)
{
    return area->x && x->data == area->x && area->handle_id == h->id && area->dtype == EPX_DTYPE_BF16 &&
           x->dtype == EPX_DTYPE_BF16 && is_contiguous_2d(x, area->rows, self->cfg.hidden);
}

int py_combine_source(BufferObject *self, HandleObject *h, const tensor_in_t *in, int n,
                      epx_ht_combine_args_t *a, PyObject *stream_obj)
{
    if (py_check_views_in(self, in + 1, n - 1, NULL) != 0) return -1;
    area_t *area;
    epx_handle_t vh;
    const int at = py_view_classify(self, in[0].obj, &a->x, &area, &vh);
    if (at == AT_RECV_STALE || at == AT_CIN_STALE) return raise_stale("x", at);
    if (at == AT_CIN) {
        if (vh != h->handle) {
            py_raise_invalid("x is the combine input of another handle; get this handle's with "
                             "combine_input(handle)");
            return -1;
        }
        if ((const char *)a->x.data != self->cin.lo || a->x.dtype != EPX_DTYPE_BF16 ||
            !is_contiguous_2d(&a->x, self->cin.rows, self->cfg.hidden)) {
            py_raise_invalid("x is part of the handle's combine input; pass combine_input(handle) whole");
            return -1;
        }
    } else if (self->views == VIEWS_OFF) {
        return 0; /* every rank passes x where it is (or the combine input) */
    } else if (at == AT_RECV && is_dispatch_x(self, area, h, &a->x)) {
        a->x_in_buffer = 2; /* read where the dispatch put it */
        return 0;
    } else if (stage_combine_input(self, h, in[0].obj, &a->x, stream_obj) != 0) {
        return -1;
    }
    a->x_in_buffer = 1;
    memset(&a->x, 0, sizeof(a->x));
    return 0;
}

int py_own_copies(PyObject **items, int n, PyObject *stream_obj)
{
    if (!py_state.own_copy) {
        PyErr_SetString(PyExc_RuntimeError, "epx: the package did not register its copy");
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (!items[i]) continue;
        PyObject *copy = PyObject_CallFunctionObjArgs(py_state.own_copy, items[i], stream_obj, NULL);
        if (!copy) return -1;
        Py_SETREF(items[i], copy); /* the view goes, and with it the area's count */
    }
    return 0;
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
    if (self->cin.handle != h->handle) py_area_reuse(&self->cin);
    PyObject *out = py_view_export(self, &t, &self->cin, h->handle, h->fw);
    if (!out) return NULL;
    self->cin.handle = h->handle;
    self->cin.rows = t.shape[0];
    py_area_returned(&self->cin, &t, 1);
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
    area_t *a = self->area;
    if (a) {
        if (self->gen == a->gen)
            a->live--;
        else
            a->stale--;
        if (!a->stale && !a->live) a->lo = a->hi = NULL;
    } else {
        b->plain_live--;
    }
    if (b->destroy_pending && !py_views_alive(b)) py_buffer_free(b);
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

PyObject *py_view_export(BufferObject *b, const epx_tensor_t *t, area_t *a, epx_handle_t handle, int fw)
{
    ViewObject *view = PyObject_New(ViewObject, &py_view_type);
    if (!view) return NULL;
    view->t = *t;
    view->kind = !a ? VIEW_PLAIN : a == &b->cin ? VIEW_CIN : VIEW_RECV;
    view->area = a;
    view->handle = handle;
    Py_INCREF(b);
    view->owner = b;
    view->gen = a ? a->gen : 0;
    if (a)
        a->live++;
    else
        b->plain_live++;
    PyObject *out = fw == FW_TORCH ? torch_tensor_of(view) : numpy_array_of(view);
    Py_DECREF(view);
    return out;
}
