/*
 * The binding's object types: Comm (its creation is in _epx_comm.c), Buffer (its operations are in
 * _epx_ops.c), the Handle of a HT or routing-map dispatch, the LLHandle and Hook of LL calls, and the
 * struct-sequence types the operations return.
 */
#include "_epx.h"

#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------------------ Comm ---- */

/* Objects outlive their library half (destroy()): every use checks it is still there. */
static int check_alive(const void *library_object, const char *what)
{
    if (library_object) return 0;
    PyErr_Format(PyExc_ValueError, "epx: the %s was destroyed", what);
    return -1;
}

/* destroy() waits for the objects made from this one: they still use its library half. */
static int refuse_live_children(int live, const char *child, const char *parent, const char *advice)
{
    if (live <= 0) return 0;
    PyErr_Format(PyExc_RuntimeError, "epx: %d %s(s) of this %s are alive; destroy them%s first", live, child,
                 parent, advice);
    return -1;
}

int py_comm_check(CommObject *self)
{
    return check_alive(self->destroy_pending ? NULL : self->comm, "communicator");
}

static PyObject *comm_destroy(CommObject *self, PyObject *unused)
{
    if (self->comm && !self->destroy_pending) {
        /* Buffers destroyed while their views live free it when the last one goes. */
        if (self->live_buffers > 0 && self->live_buffers == self->pending_buffers) {
            self->destroy_pending = 1;
            Py_RETURN_NONE;
        }
        if (refuse_live_children(self->live_buffers, "buffer", "communicator", "") != 0) return NULL;
        /* In a forked child the communicator is the parent's: let it go here, leave the library alone. */
        epx_result_t res = py_foreign(self) ? EPX_SUCCESS : epx_comm_destroy(self->comm);
        if (res != EPX_SUCCESS) return py_raise_epx(res);
        self->comm = NULL;
    }
    Py_RETURN_NONE;
}

int py_foreign(const CommObject *comm)
{
    return comm && comm->owner_pid != 0 && comm->owner_pid != (long)getpid();
}

void py_comm_owned(CommObject *comm)
{
    comm->owner_pid = (long)getpid();
}

static void comm_dealloc(CommObject *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakrefs) PyObject_ClearWeakRefs((PyObject *)self);
    /* Buffers hold a reference to their comm, so none is alive here. */
    if (self->comm && !py_foreign(self)) epx_comm_destroy(self->comm);
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
    if (py_comm_check(self) != 0) return NULL;
    epx_result_t res = epx_get_async_error(self->comm);
    if (res == EPX_SUCCESS) Py_RETURN_NONE;
    py_raise_epx(res);
    return py_take_exception();
}

static PyObject *comm_topo_get(CommObject *self, void *field)
{
    if (py_comm_check(self) != 0) return NULL;
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

PyTypeObject py_comm_type = {
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

int py_buffer_check(BufferObject *self)
{
    return check_alive(self->destroy_pending ? NULL : self->buf, "buffer");
}

static int buffer_init(BufferObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"comm",        "max_tokens",   "hidden",          "num_topk",
                         "num_experts", "modes",        "dispatch_dtypes", "max_pad_multiple",
                         "num_sms",     "chunk_tokens", "views",           "view_areas",
                         NULL};
    CommObject *comm;
    long long max_tokens, hidden, modes = 0, dtypes = 0;
    PyObject *views_obj = Py_False;
    int views, view_areas = 0;
    /* The 32-bit fields are parsed in place; those not given keep their zero (the library's default). */
    epx_buffer_config_t cfg = EPX_BUFFER_CONFIG_INIT;
    if (self->buf || self->comm) { /* once per object, destroyed or not */
        PyErr_SetString(PyExc_RuntimeError, "epx: Buffer.__init__ called twice");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!LLii|LLiiiOi", kw, &py_comm_type, &comm, &max_tokens,
                                     &hidden, &cfg.num_topk, &cfg.num_experts, &modes, &dtypes,
                                     &cfg.max_pad_multiple, &cfg.num_sms, &cfg.chunk_tokens, &views_obj,
                                     &view_areas))
        return -1;
    /* Bit sets: a value past 32 bits is refused, not wrapped into other bits. */
    if (modes < 0 || modes > (long long)UINT32_MAX || dtypes < 0 || dtypes > (long long)UINT32_MAX) {
        py_raise_invalid("modes = %lld and dispatch_dtypes = %lld must be bit sets in [0, 2**32)", modes, dtypes);
        return -1;
    }
    cfg.modes = (uint32_t)modes;
    cfg.dispatch_dtypes = (uint32_t)dtypes;
    if (py_comm_check(comm) != 0 || py_views_mode(views_obj, &views) != 0) return -1;
    /* Pooled keeps a spare area besides those its views hold. */
    if (!view_areas) view_areas = views == VIEWS_POOLED ? 3 : 1;
    if (view_areas < 1 || view_areas > EPX_MAX_VIEW_AREAS) {
        py_raise_invalid(
            "view_areas = %d is out of range [1, %d] (0: the default, 3 with views=\"pooled\", else 1)",
            view_areas, EPX_MAX_VIEW_AREAS);
        return -1;
    }
    cfg.max_tokens = max_tokens;
    cfg.hidden = hidden;
    cfg.num_view_areas = view_areas;
    epx_result_t res;
    epx_buffer_t buf = NULL;
    WITHOUT_GIL(res = epx_buffer_create(comm->comm, &cfg, &buf));
    if (res != EPX_SUCCESS) {
        py_raise_epx(res);
        return -1;
    }
    if (py_ensure_numpy() != 0) PyErr_Clear(); /* numpy is optional when only torch tensors are used */
    self->buf = buf;
    self->cfg = cfg;
    self->R = comm->topo.nranks;
    self->L = cfg.num_experts / comm->topo.nranks;
    self->views = views;
    self->num_areas = view_areas;
    Py_INCREF(comm);
    self->comm = comm;
    comm->live_buffers++;
    return 0;
}

void py_buffer_free(BufferObject *self)
{
    if (!self->buf) return;
    CommObject *comm = self->comm;
    if (!py_foreign(comm)) epx_buffer_destroy(self->buf);
    self->buf = NULL;
    comm->live_buffers--;
    if (self->destroy_pending) comm->pending_buffers--;
    self->destroy_pending = 0;
    if (comm->destroy_pending && comm->live_buffers == 0 && comm->comm) {
        if (!py_foreign(comm)) epx_comm_destroy(comm->comm);
        comm->comm = NULL;
    }
}

PyObject *py_buffer_destroy(BufferObject *self, PyObject *unused)
{
    /* In a forked child the buffer is the parent's (a `with` block around a fork ends in both): the
     * child lets it go without telling the library, whose destroy would tell the peers. */
    if (self->buf && py_foreign(self->comm)) {
        py_buffer_free(self);
        Py_RETURN_NONE;
    }
    if (self->buf && !self->destroy_pending) {
        if (refuse_live_children(self->live_handles, "handle", "buffer", " (or drop them)") != 0) return NULL;
        /* Arrays over the buffer's memory may outlive this call: it is freed when the last one goes. */
        if (py_views_alive(self) > 0) {
            self->destroy_pending = 1;
            self->comm->pending_buffers++;
            Py_RETURN_NONE;
        }
        epx_result_t res = epx_buffer_destroy(self->buf);
        if (res != EPX_SUCCESS) return py_raise_epx(res);
        self->buf = NULL;
        self->comm->live_buffers--;
    }
    Py_RETURN_NONE;
}

static void buffer_dealloc(BufferObject *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakrefs) PyObject_ClearWeakRefs((PyObject *)self);
    py_buffer_free(self);
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

static PyObject *buffer_get(BufferObject *self, void *field)
{
    const char *f = field;
    if (!strcmp(f, "comm")) {
        if (!self->comm) {
            PyErr_SetString(PyExc_ValueError, "epx: the buffer was never initialised (Buffer.__init__ did not run)");
            return NULL;
        }
        Py_INCREF(self->comm);
        return (PyObject *)self->comm;
    }
    if (!strcmp(f, "max_tokens")) return PyLong_FromLongLong(self->cfg.max_tokens);
    if (!strcmp(f, "hidden")) return PyLong_FromLongLong(self->cfg.hidden);
    if (!strcmp(f, "num_topk")) return PyLong_FromLong(self->cfg.num_topk);
    if (!strcmp(f, "num_experts")) return PyLong_FromLong(self->cfg.num_experts);
    if (!strcmp(f, "num_local_experts")) return PyLong_FromLong(self->L);
    if (!strcmp(f, "num_ranks")) return PyLong_FromLong(self->R);
    if (!strcmp(f, "destroyed")) return PyBool_FromLong(self->buf == NULL || self->destroy_pending);
    if (!strcmp(f, "views")) return py_views_value(self->views);
    if (!strcmp(f, "view_areas")) return PyLong_FromLong(self->num_areas);
    if (!strcmp(f, "_views_alive")) return PyLong_FromLong(py_views_alive(self));
    if (!strcmp(f, "_combines_by_source")) {
        const uint64_t *n = self->combines_by_source;
        return Py_BuildValue("(KKK)", (unsigned long long)n[0], (unsigned long long)n[1],
                             (unsigned long long)n[2]);
    }
    if (!strcmp(f, "_collective_calls")) return PyLong_FromUnsignedLongLong(self->collective_calls);
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
    {"views", (getter)buffer_get, NULL,
     "What HT dispatch returns unless a call says otherwise: False (outputs of their own), True (views valid "
     "until the next dispatch into their area) or \"pooled\" (views no dispatch reuses while they live).",
     "views"},
    {"view_areas", (getter)buffer_get, NULL, "View areas of the HT dispatch outputs, R * T_max rows each.",
     "view_areas"},
    {"_views_alive", (getter)buffer_get, NULL, "Internal: views of the buffer's memory still referenced.",
     "_views_alive"},
    {"_combines_by_source", (getter)buffer_get, NULL,
     "Internal: HT combines made, by how they took x (x_in_buffer 0, 1, 2).", "_combines_by_source"},
    {"_collective_calls", (getter)buffer_get, NULL,
     "Internal: collective calls this binding passed to the library (made or refused).", "_collective_calls"},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

PyTypeObject py_buffer_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "epx._epx.Buffer",
    .tp_basicsize = sizeof(BufferObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A communication buffer (collective to create).",
    .tp_dealloc = (destructor)buffer_dealloc,
    .tp_traverse = (traverseproc)buffer_traverse,
    .tp_clear = (inquiry)buffer_clear,
    .tp_methods = py_buffer_methods,
    .tp_getset = buffer_getset,
    .tp_init = (initproc)buffer_init,
    .tp_new = PyType_GenericNew,
    .tp_weaklistoffset = offsetof(BufferObject, weakrefs),
    .tp_dictoffset = offsetof(BufferObject, dict),
};

/* ------------------------------------------------------------------ Handle (HT / routing map) ---- */

HandleObject *py_handle_new(BufferObject *buffer, epx_handle_t h, int kind, int permute, int64_t num_tokens)
{
    HandleObject *self = PyObject_GC_New(HandleObject, &py_handle_type);
    if (!self) {
        epx_handle_destroy(h);
        return NULL;
    }
    self->handle = h;
    Py_INCREF(buffer);
    self->buffer = buffer;
    self->kind = kind;
    self->permute = permute;
    self->fw = FW_NUMPY;
    self->num_tokens = num_tokens;
    self->hidden = buffer->cfg.hidden;
    self->id = ++buffer->handles_made;
    buffer->live_handles++;
    PyObject_GC_Track(self);
    return self;
}

static void handle_release(HandleObject *self)
{
    if (self->handle) {
        if (!py_foreign(self->buffer->comm)) epx_handle_destroy(self->handle);
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

/* A handle of another buffer is the library's to refuse, with its message. */
int py_handle_check(HandleObject *h, int kind)
{
    if (check_alive(h->handle, "handle") != 0) return -1;
    if (h->kind != kind) {
        PyErr_Format(PyExc_TypeError, "epx: the handle comes from a %s dispatch, this call needs a %s one",
                     h->kind == HANDLE_HT ? "HT" : "routing-map", kind == HANDLE_HT ? "HT" : "routing-map");
        return -1;
    }
    return 0;
}

static PyObject *handle_info(HandleObject *self, void *field)
{
    if (check_alive(self->handle, "handle") != 0) return NULL;
    epx_handle_info_t info;
    epx_result_t res;
    WITHOUT_GIL(res = epx_handle_get_info(self->handle, &info));
    if (res != EPX_SUCCESS) return py_raise_epx(res);
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

PyTypeObject py_handle_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "epx.Handle",
    .tp_basicsize = sizeof(HandleObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Routing of one HT or routing-map dispatch, for its combine (and cached dispatch).",
    .tp_dealloc = (destructor)handle_dealloc,
    .tp_traverse = (traverseproc)handle_traverse,
    .tp_methods = handle_methods,
    .tp_getset = handle_getset,
};

/* ------------------------------------------------------------------ LL handle and hook ---- */

/* Both start with BufferChildObject: one home for what their lifetime does. */
static PyObject *child_new(PyTypeObject *type, BufferObject *buffer, PyObject *held)
{
    BufferChildObject *self = PyObject_GC_New(BufferChildObject, type);
    if (!self) return NULL;
    Py_INCREF(buffer);
    self->buffer = buffer;
    Py_XINCREF(held);
    self->held = held;
    return (PyObject *)self;
}

static void child_dealloc(BufferChildObject *self)
{
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->buffer);
    Py_CLEAR(self->held);
    PyObject_GC_Del(self);
}

static int child_traverse(BufferChildObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->buffer);
    Py_VISIT(self->held);
    return 0;
}

PyObject *py_llhandle_new(BufferObject *buffer, const epx_ll_handle_t *h, call_ctx_t *ctx)
{
    LLHandleObject *self = (LLHandleObject *)child_new(&py_llhandle_type, buffer, ctx->device);
    if (!self) return NULL;
    self->h = *h;
    self->fw = ctx->fw;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static PyMemberDef llhandle_members[] = {
    {"seq", T_ULONGLONG, offsetof(LLHandleObject, h.seq), READONLY, "Collective sequence number."},
    {"slot", T_INT, offsetof(LLHandleObject, h.slot), READONLY, "Double-buffer slot (0 or 1)."},
    {"num_tokens", T_INT, offsetof(LLHandleObject, h.num_tokens), READONLY, "T of the dispatch."},
    {NULL},
};

PyTypeObject py_llhandle_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "epx.LLHandle",
    .tp_basicsize = sizeof(LLHandleObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Identifies one LL dispatch; pass it to ll_combine and get_combine_buffer.",
    .tp_dealloc = (destructor)child_dealloc,
    .tp_traverse = (traverseproc)child_traverse,
    .tp_members = llhandle_members,
};

typedef struct {
    BufferChildObject base; /* held: the outputs the receive half writes, alive until it ran */
    epx_hook_t hook;
    int ran;
} HookObject;

static PyObject *hook_call(HookObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"stream", NULL};
    PyObject *stream_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O", kw, &stream_obj)) return NULL;
    void *stream = NULL;
    if (stream_obj != Py_None) {
        stream = PyLong_AsVoidPtr(stream_obj);
        if (PyErr_Occurred()) return NULL;
    } else if (self->base.buffer->comm->topo.backend == EPX_BACKEND_CUDA && py_state.torch_current_stream) {
        PyObject *s = PyObject_CallNoArgs(py_state.torch_current_stream);
        PyObject *ptr = s ? PyObject_GetAttr(s, py_state.str_cuda_stream) : NULL;
        Py_XDECREF(s);
        if (!ptr) return NULL;
        stream = PyLong_AsVoidPtr(ptr);
        Py_DECREF(ptr);
    }
    epx_result_t res;
    WITHOUT_GIL(res = epx_hook_run(&self->hook, stream));
    if (res != EPX_SUCCESS) return py_raise_epx(res);
    self->ran = 1;
    Py_CLEAR(self->base.held);
    Py_RETURN_NONE;
}

PyTypeObject py_hook_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "epx.Hook",
    .tp_basicsize = sizeof(HookObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "hook(stream=None)\n--\n\nRuns the receive half of an LL call made with return_recv_hook=True "
              "(once).",
    .tp_dealloc = (destructor)child_dealloc,
    .tp_traverse = (traverseproc)child_traverse,
    .tp_call = (ternaryfunc)hook_call,
};

PyObject *py_hook_new(BufferObject *buffer, const epx_hook_t *h, PyObject *keep)
{
    HookObject *self = (HookObject *)child_new(&py_hook_type, buffer, keep);
    if (!self) return NULL;
    self->hook = *h;
    self->ran = 0;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

/* ------------------------------------------------------------------ result tuples ---- */

static PyStructSequence_Field layout_fields[] = {
    {"num_tokens_per_rank", "[R] int32"},
    {"num_tokens_per_expert", "[E] int32"},
    {"is_token_in_rank", "[T, R] bool"},
    {"num_tokens_per_domain", "[R / D] int32, or None with one NVLink domain"},
    {NULL},
};

static PyStructSequence_Field ht_dispatch_fields[] = {
    {"recv_x", "[N_r, H] (or [num_worst_tokens, H]) in x's dtype"},
    {"recv_x_scales", "[N_r, H/128] float32 for fp8 x, else None"},
    {"recv_topk_idx", "[N_r, K] local expert ids (-1 elsewhere), topk_idx's dtype; None for cached"},
    {"recv_topk_weights", "[N_r, K] float32 when topk_weights was given, else None"},
    {"num_recv_tokens_per_expert", "[L] int32 rounded up to expert_alignment; None for cached"},
    {"handle", "epx.Handle for combine and cached dispatch"},
    {"num_recv_tokens", "N_r (int; -1 in static mode, where num_recv_tokens_tensor has it)"},
    {"num_recv_tokens_tensor", "[1] int32 holding N_r in the tensors' memory (static mode), else None"},
    {"rank_prefix_matrix", "[R, R] int32: [s, d] = tokens ranks 0..s send rank d; None for cached "
                           "(attribute only: not part of the 8-tuple)"},
    {"num_recv_tokens_per_expert_list",
     "num_recv_tokens_per_expert as a list of L ints, read on the host without a device copy (the call "
     "waited for them); None in static mode and for cached (attribute only: not part of the 8-tuple)"},
    {NULL},
};

static PyStructSequence_Field ht_combine_fields[] = {
    {"combined_x", "[T, H] bf16"},
    {"combined_topk_weights", "[T, K] float32 when topk_weights was given, else None"},
    {NULL},
};

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

static PyStructSequence_Field ll_combine_fields[] = {
    {"combined_x", "[T, H] bf16 (valid after the hook ran with return_recv_hook)"},
    {"hook", "epx.Hook with return_recv_hook, else None"},
    {NULL},
};

static PyStructSequence_Field rm_dispatch_fields[] = {
    {"tokens", "[N_r or P (or the bound), H] in hidden's dtype"},
    {"scaling_factor", "[rows, H/128] float32 for fp8, else None"},
    {"probs", "[rows, L] float32 without permute, [rows] with; None without probs"},
    {"tokens_per_expert", "[L] int32 padded counts with permute, else None"},
    {"handle", "epx.Handle for rm_combine"},
    {"num_tokens", "N_r or P (the bound when one was given)"},
    {"num_tokens_tensor",
     "[1] int32 holding the real count in the tensors' memory (with a bound), else None"},
    {"local_map",
     "with local_map=True: [R*T_max, L] bool, row i the i-th received token's local experts (HT order, every "
     "received token whatever the bound), rows after them False; else None"},
    {NULL},
};

PyTypeObject *py_layout_type, *py_ht_dispatch_type, *py_ht_combine_type, *py_ll_dispatch_type,
    *py_ll_combine_type, *py_rm_dispatch_type;

/* The result types: module attribute, where the type goes, and its description (which outlives it). */
static struct {
    const char *attr;
    PyTypeObject **type;
    PyStructSequence_Desc desc;
} result_types[] = {
    {"Layout", &py_layout_type, {"epx.Layout", "Result of Buffer.get_dispatch_layout.", layout_fields, 4}},
    {"DispatchOutput",
     &py_ht_dispatch_type,
     {"epx.DispatchOutput", "Result of Buffer.dispatch.", ht_dispatch_fields, 8}},
    {"CombineOutput",
     &py_ht_combine_type,
     {"epx.CombineOutput", "Result of Buffer.combine.", ht_combine_fields, 2}},
    {"LLDispatchOutput",
     &py_ll_dispatch_type,
     {"epx.LLDispatchOutput", "Result of Buffer.ll_dispatch.", ll_dispatch_fields, 7}},
    {"LLCombineOutput",
     &py_ll_combine_type,
     {"epx.LLCombineOutput", "Result of Buffer.ll_combine.", ll_combine_fields, 2}},
    {"RoutingDispatchOutput",
     &py_rm_dispatch_type,
     {"epx.RoutingDispatchOutput", "Result of Buffer.rm_dispatch.", rm_dispatch_fields, 8}},
};

int py_add_result_types(PyObject *m)
{
    for (size_t i = 0; i < sizeof(result_types) / sizeof(result_types[0]); i++) {
        PyTypeObject *t = PyStructSequence_NewType(&result_types[i].desc);
        if (!t) return -1;
        Py_INCREF(t);
        if (PyModule_AddObject(m, result_types[i].attr, (PyObject *)t) < 0) {
            Py_DECREF(t);
            return -1;
        }
        *result_types[i].type = t;
    }
    return 0;
}

PyObject *py_make_result(PyTypeObject *type, int n, PyObject **items)
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
