/*
 * Creating a communicator (the Comm type itself is in _epx_types.c): from a unique id, or from Python
 * bootstrap callbacks that the library calls back, with the GIL taken, while it creates the communicator;
 * and its nodes and peer paths.
 */
#include "_epx.h"

#include <string.h>

static void comm_note_callback_error(CommObject *self)
{
    if (!self->callback_error)
        self->callback_error = py_take_exception();
    else
        PyErr_Clear();
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

/* The config both ways of creating a communicator take. The backend is checked first, then the types
 * of the other arguments (`types_ok`, else a TypeError saying `type_error`). */
static int comm_config(PyObject *backend_obj, int types_ok, const char *type_error, int cuda_device,
                       int timeout_ms, const char *node_id, epx_comm_config_t *cfg)
{
    if (parse_backend(backend_obj, &cfg->backend) != 0) return -1;
    if (!types_ok) {
        PyErr_SetString(PyExc_TypeError, type_error);
        return -1;
    }
    cfg->cuda_device = cuda_device;
    cfg->timeout_ms = timeout_ms;
    cfg->node_id = node_id; /* the library copies it during the init */
    return 0;
}

/* Raises the error of `res` with `cause` (the exception a bootstrap callback raised meanwhile, or NULL;
 * stolen) as its __cause__. Returns NULL. */
static PyObject *comm_raise(epx_result_t res, PyObject *cause)
{
    py_raise_epx(res);
    if (cause) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        PyException_SetCause(value, cause); /* steals cause */
        PyErr_Restore(type, value, tb);
    }
    return NULL;
}

static PyObject *comm_finish_init(CommObject *self, epx_result_t res)
{
    if (res != EPX_SUCCESS) {
        PyObject *cause = self->callback_error;
        self->callback_error = NULL;
        Py_DECREF(self);
        return comm_raise(res, cause);
    }
    res = epx_comm_get_topology(self->comm, &self->topo);
    if (res != EPX_SUCCESS) {
        Py_DECREF(self);
        return py_raise_epx(res);
    }
    return (PyObject *)self;
}

/* _epx.comm_init(cls, unique_id, rank, nranks, backend, cuda_device, timeout_ms, node_id) */
PyObject *py_comm_init(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"cls",         "unique_id",  "rank",    "nranks", "backend",
                         "cuda_device", "timeout_ms", "node_id", NULL};
    PyTypeObject *cls;
    Py_buffer uid;
    int rank, nranks, cuda_device = -1, timeout_ms = 0;
    PyObject *backend_obj = NULL;
    const char *node_id = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!y*ii|Oiiz", kw, &PyType_Type, &cls, &uid, &rank, &nranks,
                                     &backend_obj, &cuda_device, &timeout_ms, &node_id))
        return NULL;
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    if (comm_config(backend_obj, PyType_IsSubtype(cls, &py_comm_type),
                    "epx: cls must be a subclass of epx.Comm", cuda_device, timeout_ms, node_id, &cfg) != 0) {
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
    CommObject *self = (CommObject *)cls->tp_alloc(cls, 0);
    if (!self) return NULL;
    py_comm_owned(self);
    epx_result_t res;
    WITHOUT_GIL(res = epx_comm_init(&id, rank, nranks, &cfg, &self->comm));
    return comm_finish_init(self, res);
}

/* _epx.comm_init_callbacks(cls, allgather, barrier, rank, nranks, backend, cuda_device, timeout_ms,
 * node_id) */
PyObject *py_comm_init_callbacks(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"cls",     "allgather",   "barrier",    "rank",    "nranks",
                         "backend", "cuda_device", "timeout_ms", "node_id", NULL};
    PyTypeObject *cls;
    PyObject *allgather, *barrier, *backend_obj = NULL;
    int rank, nranks, cuda_device = -1, timeout_ms = 0;
    const char *node_id = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!OOii|Oiiz", kw, &PyType_Type, &cls, &allgather, &barrier,
                                     &rank, &nranks, &backend_obj, &cuda_device, &timeout_ms, &node_id))
        return NULL;
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    int types_ok =
        PyType_IsSubtype(cls, &py_comm_type) && PyCallable_Check(allgather) && PyCallable_Check(barrier);
    if (comm_config(backend_obj, types_ok,
                    "epx: cls must subclass epx.Comm; allgather and barrier must be callable", cuda_device,
                    timeout_ms, node_id, &cfg) != 0)
        return NULL;
    CommObject *self = (CommObject *)cls->tp_alloc(cls, 0);
    if (!self) return NULL;
    py_comm_owned(self);
    Py_INCREF(allgather);
    Py_INCREF(barrier);
    self->allgather = allgather;
    self->barrier = barrier;
    self->topo.nranks = nranks; /* the allgather callback sizes its result with it */
    epx_bootstrap_callbacks_t cbs = {cb_allgather, cb_barrier, self};
    epx_result_t res;
    WITHOUT_GIL(res = epx_comm_init_callbacks(&cbs, rank, nranks, &cfg, &self->comm));
    return comm_finish_init(self, res);
}

/* _epx.comm_node_topology(comm) -> (node, num_nodes, ranks_per_node, local_rank, ranks_per_nvlink_domain,
 * num_nvlink_domains, node_id) */
PyObject *py_comm_node_topology(PyObject *mod, PyObject *arg)
{
    if (!PyObject_TypeCheck(arg, &py_comm_type)) return PyErr_Format(PyExc_TypeError, "epx: expected an epx.Comm");
    CommObject *self = (CommObject *)arg;
    if (py_comm_check(self) != 0) return NULL;
    epx_node_topology_t t = EPX_NODE_TOPOLOGY_INIT;
    epx_result_t res = epx_comm_get_node_topology(self->comm, &t);
    if (res != EPX_SUCCESS) return py_raise_epx(res);
    return Py_BuildValue("(iiiiiis)", t.node, t.num_nodes, t.ranks_per_node, t.local_rank,
                         t.ranks_per_nvlink_domain, t.num_nvlink_domains, t.node_id);
}

/* _epx.comm_peer_path(comm, peer) -> "self", "ipc" or "network" */
PyObject *py_comm_peer_path(PyObject *mod, PyObject *args)
{
    PyObject *obj;
    int peer;
    if (!PyArg_ParseTuple(args, "O!i", &py_comm_type, &obj, &peer)) return NULL;
    CommObject *self = (CommObject *)obj;
    if (py_comm_check(self) != 0) return NULL;
    epx_path_t path;
    epx_result_t res = epx_comm_get_peer_path(self->comm, peer, &path);
    if (res != EPX_SUCCESS) return py_raise_epx(res);
    return PyUnicode_FromString(path == EPX_PATH_SELF ? "self" : path == EPX_PATH_IPC ? "ipc" : "network");
}

PyObject *py_comm_barrier(PyObject *mod, PyObject *arg)
{
    if (!PyObject_TypeCheck(arg, &py_comm_type)) {
        PyErr_SetString(PyExc_TypeError, "epx: comm_barrier takes an epx.Comm");
        return NULL;
    }
    CommObject *self = (CommObject *)arg;
    if (py_comm_check(self) != 0) return NULL;
    /* Without the GIL, as every call where ranks wait on each other: other threads go on (a callback
     * communicator's barrier and allgather take the GIL themselves, cb_barrier and cb_allgather). */
    epx_result_t res;
    WITHOUT_GIL(res = epx_comm_barrier(self->comm));
    if (res != EPX_SUCCESS) {
        PyObject *cause = self->callback_error;
        self->callback_error = NULL;
        return comm_raise(res, cause);
    }
    Py_RETURN_NONE;
}
