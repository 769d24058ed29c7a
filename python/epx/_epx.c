/*
 * CPython extension over the epx C ABI: communicator, buffer, handle and hook objects. Tensors come
 * in through DLPack (__dlpack__) and outputs are allocated through the caller's framework (numpy in,
 * numpy out; torch in, torch out on the same device), so the binding never owns tensor memory.
 * This file holds the module (its functions, state and initialisation) and the error mapping; the
 * other _epx_*.c files hold tensors (DLPack), communicator creation, the object types and the operations.
 */
#include "_epx.h"

#include <stdarg.h>
#include <string.h>

py_state_t py_state;

/* ------------------------------------------------------------------ errors ---- */

/* Raises the EpxError subclass of `res` with `detail`, else the result's own text. */
static PyObject *raise_result(epx_result_t res, const char *detail)
{
    const char *name = epx_result_name(res);
    const char *message = detail && detail[0] ? detail : epx_strerror(res);
    PyObject *cls = (res >= 0 && res < PY_NUM_RESULTS && py_state.error_classes[res])
                        ? py_state.error_classes[res]
                        : py_state.error_base;
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

PyObject *py_raise_epx(epx_result_t res)
{
    /* Copy first: building the exception may call back into the library on this thread. */
    char detail[1024];
    snprintf(detail, sizeof(detail), "%s", epx_last_error_message());
    return raise_result(res, detail);
}

PyObject *py_raise_invalid(const char *fmt, ...)
{
    char detail[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof(detail), fmt, ap);
    va_end(ap);
    return raise_result(EPX_ERR_INVALID_ARG, detail);
}

PyObject *py_take_exception(void)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

/* ------------------------------------------------------------------ refusals ---- */

/* The result a refused call stands for: an EpxError's own, EPX_ERR_OUT_OF_MEMORY for MemoryError,
 * else EPX_ERR_INVALID_ARG (what a bad argument is in the library). */
static epx_result_t refusal_code(PyObject *exc)
{
    if (PyObject_IsInstance(exc, py_state.error_base) == 1) {
        PyObject *code = PyObject_GetAttrString(exc, "code");
        long value = code && PyLong_Check(code) ? PyLong_AsLong(code) : -1;
        Py_XDECREF(code);
        PyErr_Clear();
        if (value > 0 && value < PY_NUM_RESULTS) return (epx_result_t)value;
    }
    if (PyErr_GivenExceptionMatches(exc, PyExc_MemoryError)) return EPX_ERR_OUT_OF_MEMORY;
    return EPX_ERR_INVALID_ARG;
}

int py_refuse(BufferObject *buffer, int kind, PyObject *exc)
{
    if (!buffer->buf || buffer->destroy_pending) return 0; /* destroyed: no call to number */
    /* "TypeError: epx: x (list) does not support ...": the peers' logs and this rank's last
     * library message name the refusal. */
    char reason[1024];
    PyObject *text = exc ? PyObject_Str(exc) : NULL;
    const char *detail = text ? PyUnicode_AsUTF8(text) : NULL;
    if (!detail) PyErr_Clear();
    snprintf(reason, sizeof(reason), "rank %d: %s: %s", buffer->comm->topo.rank,
             exc ? Py_TYPE(exc)->tp_name : "refused", detail ? detail : "(no message)");
    Py_XDECREF(text);
    const epx_result_t code = exc ? refusal_code(exc) : EPX_ERR_INVALID_ARG;
    buffer->collective_calls++;
    const epx_result_t res =
        epx_buffer_refuse_collective(buffer->buf, (epx_collective_t)kind, code, reason, NULL);
    if (res == code) return 0;
    py_raise_epx(res); /* the buffer is busy in another thread, or `kind` is unknown */
    return -1;
}

void py_refuse_pending(BufferObject *buffer, int kind)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (py_refuse(buffer, kind, value) != 0) PyErr_Clear(); /* the call's own exception comes first */
    PyErr_Restore(type, value, tb);
}

/* ------------------------------------------------------------------ module functions ---- */

static PyObject *mod_get_unique_id(PyObject *mod, PyObject *unused)
{
    epx_unique_id_t id;
    epx_result_t res = epx_get_unique_id(&id);
    if (res != EPX_SUCCESS) return py_raise_epx(res);
    return PyBytes_FromStringAndSize(id.internal, EPX_UNIQUE_ID_BYTES);
}

static PyObject *mod_version(PyObject *mod, PyObject *unused)
{
    return PyUnicode_FromString(epx_version());
}

static PyObject *mod_build_info(PyObject *mod, PyObject *unused)
{
    epx_build_info_t info = EPX_BUILD_INFO_INIT;
    epx_result_t res = epx_get_build_info(&info);
    if (res != EPX_SUCCESS) return py_raise_epx(res);
    return Py_BuildValue("{s:O,s:O,s:s,s:i,s:O}", "cuda", info.cuda ? Py_True : Py_False, "nccl",
                         info.nccl ? Py_True : Py_False, "nccl_version", info.nccl_version, "nccl_version_code",
                         (int)info.nccl_version_code, "network", info.network ? Py_True : Py_False);
}

static PyObject *mod_refresh_torch(PyObject *mod, PyObject *unused)
{
    py_refresh_torch();
    return PyBool_FromLong(py_state.torch_empty != NULL);
}

static PyObject *mod_set_error_classes(PyObject *mod, PyObject *args)
{
    PyObject *base, *classes;
    if (!PyArg_ParseTuple(args, "OO!", &base, &PyDict_Type, &classes)) return NULL;
    Py_INCREF(base);
    Py_XSETREF(py_state.error_base, base);
    for (int code = 1; code < PY_NUM_RESULTS; code++) {
        PyObject *cls = PyDict_GetItemString(classes, epx_result_name((epx_result_t)code));
        Py_XINCREF(cls);
        Py_XSETREF(py_state.error_classes[code], cls);
    }
    Py_RETURN_NONE;
}

/* _set_helpers(StaleViewError, copy_rows, own_copy): what the package defines for the binding. */
static PyObject *mod_set_helpers(PyObject *mod, PyObject *args)
{
    PyObject *stale, *copy_rows, *own_copy;
    if (!PyArg_ParseTuple(args, "OOO", &stale, &copy_rows, &own_copy)) return NULL;
    Py_INCREF(stale);
    Py_XSETREF(py_state.stale_view_error, stale);
    Py_INCREF(copy_rows);
    Py_XSETREF(py_state.copy_rows, copy_rows);
    Py_INCREF(own_copy);
    Py_XSETREF(py_state.own_copy, own_copy);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"get_unique_id", mod_get_unique_id, METH_NOARGS,
     "get_unique_id() -> bytes\n--\n\nA 128-byte rendezvous token (TCP, hosted by rank 0); send it to every "
     "rank."},
    {"version", mod_version, METH_NOARGS, "version() -> str\n--\n\nVersion of the linked library."},
    {"build_info", mod_build_info, METH_NOARGS, "Internal: use epx.build_info()."},
    {"comm_init", KWFN(py_comm_init), METH_VARARGS | METH_KEYWORDS, "Internal: use Comm.from_unique_id."},
    {"comm_init_callbacks", KWFN(py_comm_init_callbacks), METH_VARARGS | METH_KEYWORDS,
     "Internal: use Comm.from_callbacks or Comm.from_torch."},
    {"comm_node_topology", py_comm_node_topology, METH_O, "Internal: use Comm.topology."},
    {"comm_peer_path", py_comm_peer_path, METH_VARARGS, "Internal: use Comm.peer_path."},
    {"comm_barrier", py_comm_barrier, METH_O, "Internal: use Comm.barrier."},
    {"_refresh_torch", mod_refresh_torch, METH_NOARGS, "Internal: pick up torch once it is imported."},
    {"_set_error_classes", mod_set_error_classes, METH_VARARGS, "Internal: the EpxError hierarchy."},
    {"_set_helpers", mod_set_helpers, METH_VARARGS, "Internal: StaleViewError and the copies through torch."},
    {"_bench_ll_dispatch_c", py_bench_ll_dispatch_c, METH_VARARGS,
     "Internal: median microseconds of epx_ll_dispatch called from C."},
    {NULL},
};

/* ------------------------------------------------------------------ initialisation ---- */

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

PyMODINIT_FUNC PyInit__epx(void)
{
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    py_state.str_dlpack = PyUnicode_InternFromString("__dlpack__");
    py_state.str_dlpack_device = PyUnicode_InternFromString("__dlpack_device__");
    py_state.str_device = PyUnicode_InternFromString("device");
    py_state.str_dtype = PyUnicode_InternFromString("dtype");
    py_state.str_view = PyUnicode_InternFromString("view");
    py_state.str_stream = PyUnicode_InternFromString("stream");
    py_state.str_cuda_stream = PyUnicode_InternFromString("cuda_stream");
    py_state.str_base = PyUnicode_InternFromString("base");
    py_state.error_base = PyErr_NewException("epx._epx.EpxError", PyExc_RuntimeError, NULL);
    if (!py_state.error_base || add_type(m, &py_comm_type, "Comm") ||
        add_type(m, &py_buffer_type, "Buffer") || add_type(m, &py_handle_type, "Handle") ||
        add_type(m, &py_llhandle_type, "LLHandle") || add_type(m, &py_hook_type, "Hook") ||
        add_type(m, &py_view_type, "View"))
        goto fail;
    if (py_add_result_types(m) != 0) goto fail;
    if (PyModule_AddIntConstant(m, "MODE_HT", EPX_MODE_HT) ||
        PyModule_AddIntConstant(m, "MODE_LL", EPX_MODE_LL) ||
        PyModule_AddIntConstant(m, "MODE_PERMUTE", EPX_MODE_PERMUTE) ||
        PyModule_AddIntConstant(m, "MODE_ALL", EPX_MODE_ALL) ||
        PyModule_AddIntConstant(m, "UNIQUE_ID_BYTES", EPX_UNIQUE_ID_BYTES) ||
        PyModule_AddIntConstant(m, "MAX_VIEW_AREAS", EPX_MAX_VIEW_AREAS) ||
        PyModule_AddIntConstant(m, "COLLECTIVE_HT_DISPATCH", EPX_COLLECTIVE_HT_DISPATCH) ||
        PyModule_AddIntConstant(m, "COLLECTIVE_HT_COMBINE", EPX_COLLECTIVE_HT_COMBINE) ||
        PyModule_AddIntConstant(m, "COLLECTIVE_LL_DISPATCH", EPX_COLLECTIVE_LL_DISPATCH) ||
        PyModule_AddIntConstant(m, "COLLECTIVE_LL_COMBINE", EPX_COLLECTIVE_LL_COMBINE) ||
        PyModule_AddIntConstant(m, "COLLECTIVE_RM_DISPATCH", EPX_COLLECTIVE_RM_DISPATCH) ||
        PyModule_AddIntConstant(m, "COLLECTIVE_RM_COMBINE", EPX_COLLECTIVE_RM_COMBINE))
        goto fail;
    /* numpy is imported lazily: torch-only users need not have it. */
    if (py_ensure_numpy() != 0) PyErr_Clear();
    py_refresh_torch();
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
