/*
 * The operations of a Buffer (layout, HT, LL and routing-map dispatch and combine), the method table
 * that names them, and the C baseline of the LL call-overhead benchmark. Each operation imports its
 * tensors, allocates its outputs through the caller's framework, runs the library call without the GIL
 * and returns the outputs as a struct sequence. A collective operation that fails before its library
 * call refuses that call (COLLECTIVE_METHOD), so the peers' matching calls fail too.
 */
#include "_epx.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#define COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* ------------------------------------------------------------------ one call's tensors ---- */

/* What one operation holds while it runs: the imported tensors (kept until the library call returns)
 * and the outputs, each in its slot of the result. */
#define MAX_ITEMS 10
typedef struct {
    keep_t keep;
    call_ctx_t ctx;
    int nitems;
    PyObject *items[MAX_ITEMS];
} call_t;

/* An output, allocated when `when` holds, into the result slot of its index in the table. */
typedef struct {
    int when;
    epx_dtype_t dtype;
    int ndim;
    int64_t shape[EPX_MAX_DIMS];
    const char *name;
    epx_tensor_t *t;
} tensor_out_t;

/* Starts a call of `nitems` results: framework and device from `ref`, the tensors `in`, and the stream
 * (when `stream` is given). On failure return call_fail(c). */
static int call_open(call_t *c, int nitems, PyObject *ref, PyObject *stream_arg, const tensor_in_t *in,
                     int n_in, void **stream)
{
    memset(c, 0, sizeof(*c));
    c->nitems = nitems;
    if (py_ctx_init(&c->ctx, &c->keep, ref, stream_arg) != 0) return -1;
    for (int i = 0; i < n_in; i++)
        if (py_import_tensor(&c->ctx, &c->keep, in[i].obj, in[i].name, in[i].hint, in[i].t) != 0) return -1;
    return stream ? py_stream_of(&c->ctx, stream) : 0;
}

static int call_alloc(call_t *c, const tensor_out_t *out, int n)
{
    for (int i = 0; i < n; i++)
        if (out[i].when && py_alloc_tensor(&c->ctx, &c->keep, out[i].dtype, out[i].ndim, out[i].shape,
                                           out[i].name, &c->items[i], out[i].t) != 0)
            return -1;
    return 0;
}

/* Drops everything the call holds; returns NULL for the caller to return. */
static PyObject *call_fail(call_t *c)
{
    py_keep_release(&c->keep);
    for (int i = 0; i < c->nitems; i++) Py_CLEAR(c->items[i]);
    return NULL;
}

/* After the library call: the imported tensors go; on failure so do the outputs, and `res` is raised. */
static int call_end(call_t *c, epx_result_t res)
{
    py_keep_release(&c->keep);
    if (res == EPX_SUCCESS) return 0;
    call_fail(c);
    py_raise_epx(res);
    return -1;
}

static PyObject *call_result(call_t *c, PyTypeObject *type)
{
    return py_make_result(type, c->nitems, c->items);
}

/* ------------------------------------------------------------------ layout ---- */

static PyObject *buffer_layout(BufferObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"topk_idx", "stream", NULL};
    PyObject *topk_obj, *stream_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O", kw, &topk_obj, &stream_obj)) return NULL;
    if (py_buffer_check(self) != 0) return NULL;
    call_t c;
    epx_tensor_t topk;
    epx_layout_outputs_t out = EPX_LAYOUT_OUTPUTS_INIT;
    void *stream;
    const tensor_in_t in[] = {{topk_obj, "topk_idx", HINT_NONE, &topk}};
    if (call_open(&c, 4, topk_obj, stream_obj, in, COUNT(in), &stream) != 0 ||
        py_check_views_in(self, in, COUNT(in), NULL) != 0)
        return call_fail(&c);
    int64_t R = self->R, E = self->cfg.num_experts, T = topk.ndim >= 1 ? topk.shape[0] : 0;
    /* Past max_tokens the library refuses the call: no output of that size first. */
    if (T > self->cfg.max_tokens) T = 0;
    int64_t ndom = self->comm->topo.num_nvlink_domains;
    const tensor_out_t outs[] = {
        {1, EPX_DTYPE_INT32, 1, {R}, "num_tokens_per_rank", &out.num_tokens_per_rank},
        {1, EPX_DTYPE_INT32, 1, {E}, "num_tokens_per_expert", &out.num_tokens_per_expert},
        {1, EPX_DTYPE_BOOL, 2, {T, R}, "is_token_in_rank", &out.is_token_in_rank},
        {ndom > 1, EPX_DTYPE_INT32, 1, {ndom}, "num_tokens_per_domain", &out.num_tokens_per_domain},
    };
    if (call_alloc(&c, outs, COUNT(outs)) != 0) return call_fail(&c);
    epx_result_t res;
    WITHOUT_GIL(res = epx_get_dispatch_layout(self->buf, &topk, &out, stream));
    if (call_end(&c, res) != 0) return NULL;
    return call_result(&c, py_layout_type);
}

/* ------------------------------------------------------------------ HT ---- */

/* The rows HT dispatch outputs are allocated for: the cached handle's count, the static bound, or the
 * worst case (sliced to N_r afterwards). */
static int ht_dispatch_rows(BufferObject *self, HandleObject *cached, int64_t num_worst, int64_t *cap)
{
    if (!cached) {
        *cap = num_worst > 0 ? num_worst : (int64_t)self->R * self->cfg.max_tokens;
        return 0;
    }
    epx_handle_info_t info;
    epx_result_t r = epx_handle_get_info(cached->handle, &info);
    if (r != EPX_SUCCESS) {
        py_raise_epx(r);
        return -1;
    }
    /* Static mode (a bound, on a handle of either mode): that many rows, as the library writes. */
    *cap = num_worst > 0 ? num_worst : info.num_recv_tokens;
    return 0;
}

/* The outputs of a view-mode dispatch into `area` as arrays over the buffer (slots 0-3), or copies of
 * them (the pooled spare). */
static int dispatch_export_views(BufferObject *self, call_t *c, const epx_ht_dispatch_outputs_t *o,
                                 HandleObject *h, area_t *area, int copy, PyObject *stream_obj)
{
    const epx_tensor_t views[] = {o->recv_x, o->recv_x_scales, o->recv_topk_idx, o->recv_topk_weights};
    area->x = o->recv_x.data;
    area->dtype = o->recv_x.dtype;
    area->rows = o->recv_x.shape[0];
    area->handle_id = h->id;
    const size_t elem = epx_dtype_size(o->recv_x.dtype);
    if (elem > area->elem_max) area->elem_max = elem;
    for (int i = 0; i < COUNT(views); i++)
        if (views[i].data && !(c->items[i] = py_view_export(self, &views[i], area, NULL, c->ctx.fw)))
            return -1;
    py_area_returned(area, views, COUNT(views));
    return copy ? py_own_copies(c->items, COUNT(views), stream_obj) : 0;
}

COLLECTIVE_METHOD(buffer_dispatch, EPX_COLLECTIVE_HT_DISPATCH)
{
    static char *kw[] = {"x",
                         "topk_idx",
                         "topk_weights",
                         "x_scales",
                         "handle",
                         "expert_alignment",
                         "num_worst_tokens",
                         "stream",
                         "views",
                         NULL};
    PyObject *x_obj, *topk_obj = Py_None, *weights_obj = Py_None, *scales_obj = Py_None,
                     *handle_obj = Py_None;
    PyObject *stream_obj = Py_None, *views_obj = Py_None;
    int expert_alignment = 1;
    long long num_worst = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|OOOOiLOO", kw, &x_obj, &topk_obj, &weights_obj,
                                     &scales_obj, &handle_obj, &expert_alignment, &num_worst, &stream_obj,
                                     &views_obj))
        return NULL;
    if (py_buffer_check(self) != 0) return NULL;
    HandleObject *cached = NULL;
    if (handle_obj != Py_None) {
        if (!PyObject_TypeCheck(handle_obj, &py_handle_type)) {
            PyErr_SetString(PyExc_TypeError, "epx: handle must be an epx.Handle from Buffer.dispatch");
            return NULL;
        }
        cached = (HandleObject *)handle_obj;
        if (py_handle_check(cached, HANDLE_HT) != 0) return NULL;
    }
    call_t c;
    epx_ht_dispatch_args_t a = EPX_HT_DISPATCH_ARGS_INIT;
    epx_ht_dispatch_outputs_t o = EPX_HT_DISPATCH_OUTPUTS_INIT;
    const tensor_in_t in[] = {
        {x_obj, "x", HINT_FP8, &a.x},
        {scales_obj, "x_scales", HINT_NONE, &a.x_scales},
        {topk_obj, "topk_idx", HINT_NONE, &a.topk_idx},
        {weights_obj, "topk_weights", HINT_NONE, &a.topk_weights},
    };
    if (call_open(&c, 10, x_obj, stream_obj, in, COUNT(in), &a.stream) != 0) return call_fail(&c);
    area_t *area;
    int copy;
    if (py_dispatch_area(self, views_obj, num_worst, &area, &copy) != 0 ||
        py_check_views_in(self, in, COUNT(in), area) != 0)
        return call_fail(&c);
    const int views = area != NULL;
    /* Importing the inputs ran Python (__dlpack__, another thread): the handle may be gone since. */
    if (cached && py_handle_check(cached, HANDLE_HT) != 0) return call_fail(&c);
    a.cached_handle = cached ? cached->handle : NULL;
    a.expert_alignment = expert_alignment;
    a.num_worst_tokens = num_worst;
    a.recv_in_buffer = views;
    a.view_area = views ? (int32_t)(area - self->recv) : 0;
    int64_t H = self->cfg.hidden, K = self->cfg.num_topk, L = self->L, cap = 0;
    if (!views && ht_dispatch_rows(self, cached, num_worst, &cap) != 0) return call_fail(&c);
    epx_dtype_t xd = a.x.dtype == EPX_DTYPE_INVALID ? EPX_DTYPE_BF16 : a.x.dtype;
    epx_dtype_t id = a.topk_idx.dtype == EPX_DTYPE_INT64 ? EPX_DTYPE_INT64 : EPX_DTYPE_INT32;
    /* Slots 5 and 6 (handle, N_r) are filled after the call; with views, slots 0-3 too. */
    const tensor_out_t outs[] = {
        {!views, xd, 2, {cap, H}, "recv_x", &o.recv_x},
        {!views && xd == EPX_DTYPE_FP8_E4M3,
         EPX_DTYPE_FP32,
         2,
         {cap, H / 128},
         "recv_x_scales",
         &o.recv_x_scales},
        {!views && !cached && a.topk_idx.data, id, 2, {cap, K}, "recv_topk_idx", &o.recv_topk_idx},
        {!views && !cached && a.topk_weights.data,
         EPX_DTYPE_FP32,
         2,
         {cap, K},
         "recv_topk_weights",
         &o.recv_topk_weights},
        {!cached, EPX_DTYPE_INT32, 1, {L}, "num_recv_tokens_per_expert", &o.num_recv_tokens_per_expert},
        [7] = {!cached && num_worst > 0, EPX_DTYPE_INT32, 1, {1}, "num_recv_tokens", &o.num_recv_tokens},
        [8] = {!cached, EPX_DTYPE_INT32, 2, {self->R, self->R}, "rank_prefix_matrix", &o.rank_prefix_matrix},
    };
    if (call_alloc(&c, outs, COUNT(outs)) != 0) return call_fail(&c);
    /* The counts as a list too where the call waits for them (default mode): no device read. */
    int32_t *host_counts = NULL;
    if (!cached && num_worst <= 0 && a.topk_idx.data) {
        host_counts = PyMem_Malloc((size_t)(L > 0 ? L : 1) * sizeof(int32_t));
        if (!host_counts) {
            PyErr_NoMemory();
            return call_fail(&c);
        }
        o.num_recv_tokens_per_expert_host = host_counts;
    }
    epx_result_t res;
    COLLECTIVE_CALL(self, res = epx_ht_dispatch(self->buf, &a, &o));
    if (views) {
        py_area_reuse(area); /* whatever the outcome: the call may have written there */
        area->used = ++self->area_clock;
    }
    if (call_end(&c, res) != 0) {
        PyMem_Free(host_counts);
        return NULL;
    }
    if (host_counts) {
        c.items[9] = PyList_New(L);
        for (int64_t j = 0; c.items[9] && j < L; j++) {
            PyObject *v = PyLong_FromLong(host_counts[j]);
            if (!v)
                Py_CLEAR(c.items[9]);
            else
                PyList_SET_ITEM(c.items[9], j, v);
        }
        PyMem_Free(host_counts);
        if (!c.items[9]) return call_fail(&c);
    }
    HandleObject *h = cached;
    if (cached) {
        Py_INCREF(cached);
    } else {
        h = py_handle_new(self, o.handle, HANDLE_HT, 0, a.x.shape[0]);
        if (!h) return call_fail(&c);
        h->fw = c.ctx.fw;
    }
    c.items[5] = (PyObject *)h;
    /* A cached dispatch reports its rows (N_r, or the bound). */
    c.items[6] = PyLong_FromLongLong(!cached ? o.num_recv_tokens_host : views ? o.recv_x.shape[0] : cap);
    if (!c.items[6]) return call_fail(&c);
    if (views) {
        if (dispatch_export_views(self, &c, &o, h, area, copy, stream_obj) != 0) return call_fail(&c);
        return call_result(&c, py_ht_dispatch_type);
    }
    if (num_worst <= 0 && !cached)
        for (int i = 0; i < 4; i++)
            if (py_slice_rows(&c.items[i], o.num_recv_tokens_host, cap) != 0) return call_fail(&c);
    return call_result(&c, py_ht_dispatch_type);
}

COLLECTIVE_METHOD(buffer_combine, EPX_COLLECTIVE_HT_COMBINE)
{
    static char *kw[] = {"x", "handle", "topk_weights", "bias0", "bias1", "stream", NULL};
    PyObject *x_obj, *weights_obj = Py_None, *b0 = Py_None, *b1 = Py_None, *stream_obj = Py_None;
    HandleObject *h;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!|OOOO", kw, &x_obj, &py_handle_type, &h, &weights_obj,
                                     &b0, &b1, &stream_obj))
        return NULL;
    if (py_buffer_check(self) != 0 || py_handle_check(h, HANDLE_HT) != 0) return NULL;
    call_t c;
    epx_ht_combine_args_t a = EPX_HT_COMBINE_ARGS_INIT;
    epx_ht_combine_outputs_t o = EPX_HT_COMBINE_OUTPUTS_INIT;
    a.handle = h->handle;
    const tensor_in_t in[] = {
        {x_obj, "x", HINT_NONE, &a.x},
        {weights_obj, "topk_weights", HINT_NONE, &a.topk_weights},
        {b0, "bias0", HINT_NONE, &a.bias0},
        {b1, "bias1", HINT_NONE, &a.bias1},
    };
    if (call_open(&c, 2, x_obj, stream_obj, in, COUNT(in), &a.stream) != 0) return call_fail(&c);
    if (py_combine_source(self, h, in, COUNT(in), &a, stream_obj) != 0) return call_fail(&c);
    int64_t T = h->num_tokens, H = self->cfg.hidden, K = self->cfg.num_topk;
    const tensor_out_t outs[] = {
        {1, EPX_DTYPE_BF16, 2, {T, H}, "combined_x", &o.combined_x},
        {a.topk_weights.data != NULL,
         EPX_DTYPE_FP32,
         2,
         {T, K},
         "combined_topk_weights",
         &o.combined_topk_weights},
    };
    if (call_alloc(&c, outs, COUNT(outs)) != 0) return call_fail(&c);
    epx_result_t res;
    COLLECTIVE_CALL(self, res = epx_ht_combine(self->buf, &a, &o));
    py_area_reuse(&self->cin);
    if (call_end(&c, res) != 0) return NULL;
    self->combines_by_source[a.x_in_buffer]++;
    return call_result(&c, py_ht_combine_type);
}

/* ------------------------------------------------------------------ LL ---- */

/* The outputs of an LL dispatch, in the slots of LLDispatchOutput. */
static int ll_dispatch_alloc(call_t *c, BufferObject *self, int use_fp8, int use_ue8m0,
                             epx_ll_dispatch_outputs_t *o)
{
    int64_t L = self->L, R = self->R, rows = (int64_t)self->R * self->cfg.max_tokens, H = self->cfg.hidden;
    const tensor_out_t outs[] = {
        {1, use_fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16, 3, {L, rows, H}, "recv_x", &o->recv_x},
        /* fp8 scales: float32 per 128 channels, or with ue8m0 four exponents packed per int32 */
        {use_fp8,
         use_ue8m0 ? EPX_DTYPE_INT32 : EPX_DTYPE_FP32,
         3,
         {L, H / (use_ue8m0 ? 512 : 128), rows},
         "recv_scales",
         &o->recv_scales},
        {1, EPX_DTYPE_INT32, 1, {L}, "recv_count", &o->recv_count},
        {1, EPX_DTYPE_INT32, 2, {L, rows}, "src_info", &o->src_info},
        {1, EPX_DTYPE_INT64, 2, {L, R}, "layout_range", &o->layout_range},
    };
    return call_alloc(c, outs, COUNT(outs));
}

COLLECTIVE_METHOD(buffer_ll_dispatch, EPX_COLLECTIVE_LL_DISPATCH)
{
    static char *kw[] = {"x",           "topk_idx",  "cumulative_recv_stats", "use_fp8",
                         "round_scale", "use_ue8m0", "return_recv_hook",      "stream",
                         NULL};
    PyObject *x_obj, *topk_obj, *stats_obj = Py_None, *stream_obj = Py_None;
    int use_fp8 = 0, round_scale = 0, use_ue8m0 = 0, hook = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|OppppO", kw, &x_obj, &topk_obj, &stats_obj, &use_fp8,
                                     &round_scale, &use_ue8m0, &hook, &stream_obj))
        return NULL;
    if (py_buffer_check(self) != 0) return NULL;
    call_t c;
    epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
    epx_ll_dispatch_outputs_t o = EPX_LL_DISPATCH_OUTPUTS_INIT;
    const tensor_in_t in[] = {
        {x_obj, "x", HINT_NONE, &a.x},
        {topk_obj, "topk_idx", HINT_NONE, &a.topk_idx},
        {stats_obj, "cumulative_recv_stats", HINT_NONE, &a.cumulative_recv_stats},
    };
    if (call_open(&c, 7, x_obj, stream_obj, in, COUNT(in), &a.stream) != 0 ||
        py_check_views_in(self, in, COUNT(in), NULL) != 0)
        return call_fail(&c);
    a.use_fp8 = use_fp8;
    a.round_scale = round_scale;
    a.use_ue8m0 = use_ue8m0;
    a.return_recv_hook = hook;
    if (ll_dispatch_alloc(&c, self, use_fp8, use_ue8m0, &o) != 0) return call_fail(&c);
    epx_result_t res;
    COLLECTIVE_CALL(self, res = epx_ll_dispatch(self->buf, &a, &o));
    /* The handle takes its own reference to ctx.device, which keep holds: make it before keep goes. */
    if (res == EPX_SUCCESS) c.items[5] = py_llhandle_new(self, &o.handle, &c.ctx);
    if (call_end(&c, res) != 0) return NULL;
    if (!c.items[5]) return call_fail(&c);
    if (hook) {
        PyObject **it = c.items;
        PyObject *outs = PyTuple_Pack(5, it[0], it[1] ? it[1] : Py_None, it[2], it[3], it[4]);
        it[6] = outs ? py_hook_new(self, &o.hook, outs) : NULL;
        Py_XDECREF(outs);
        if (!it[6]) return call_fail(&c);
    }
    return call_result(&c, py_ll_dispatch_type);
}

static PyObject *buffer_get_combine_buffer(BufferObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"handle", NULL};
    LLHandleObject *h;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!", kw, &py_llhandle_type, &h)) return NULL;
    if (py_buffer_check(self) != 0) return NULL;
    epx_tensor_t t;
    epx_result_t res;
    WITHOUT_GIL(res = epx_ll_get_combine_buffer(self->buf, &h->h, &t));
    if (res != EPX_SUCCESS) return py_raise_epx(res);
    return py_view_export(self, &t, NULL, NULL, h->fw);
}

COLLECTIVE_METHOD(buffer_ll_combine, EPX_COLLECTIVE_LL_COMBINE)
{
    static char *kw[] = {"y",         "topk_idx",         "topk_weights", "handle",
                         "zero_copy", "return_recv_hook", "stream",       NULL};
    PyObject *y_obj, *topk_obj, *weights_obj, *stream_obj = Py_None;
    LLHandleObject *h;
    int zero_copy = 0, hook = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO!|ppO", kw, &y_obj, &topk_obj, &weights_obj,
                                     &py_llhandle_type, &h, &zero_copy, &hook, &stream_obj))
        return NULL;
    if (py_buffer_check(self) != 0) return NULL;
    call_t c;
    epx_ll_combine_args_t a = EPX_LL_COMBINE_ARGS_INIT;
    epx_ll_combine_outputs_t o = EPX_LL_COMBINE_OUTPUTS_INIT;
    a.handle = h->h;
    a.zero_copy = zero_copy;
    a.return_recv_hook = hook;
    const tensor_in_t in[] = {
        {y_obj, "y", HINT_NONE, &a.y},
        {topk_obj, "topk_idx", HINT_NONE, &a.topk_idx},
        {weights_obj, "topk_weights", HINT_NONE, &a.topk_weights},
    };
    /* With zero_copy y may be None: topk_idx then decides the framework. */
    PyObject *ref = y_obj != Py_None ? y_obj : topk_obj;
    if (call_open(&c, 2, ref, stream_obj, in, COUNT(in), &a.stream) != 0 ||
        py_check_views_in(self, in, COUNT(in), NULL) != 0)
        return call_fail(&c);
    const tensor_out_t outs[] = {
        {1, EPX_DTYPE_BF16, 2, {h->h.num_tokens, self->cfg.hidden}, "combined_x", &o.combined_x},
    };
    if (call_alloc(&c, outs, COUNT(outs)) != 0) return call_fail(&c);
    epx_result_t res;
    COLLECTIVE_CALL(self, res = epx_ll_combine(self->buf, &a, &o));
    if (call_end(&c, res) != 0) return NULL;
    if (hook) {
        c.items[1] = py_hook_new(self, &o.hook, c.items[0]);
        if (!c.items[1]) return call_fail(&c);
    }
    return call_result(&c, py_ll_combine_type);
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

/* The rows routing-map dispatch outputs are allocated for: the bound when one was given (an invalid
 * one is the library's to refuse), else the most the dispatch can produce. */
static int64_t rm_dispatch_rows(BufferObject *self, int64_t bound, int permute, int pad_multiple)
{
    const int64_t L = self->L, R = self->R, Tm = self->cfg.max_tokens, K = self->cfg.num_topk;
    const int64_t plain = R * Tm, grouped = R * Tm * (K < L ? K : L);
    const int64_t max_pad = self->cfg.max_pad_multiple > 0 ? self->cfg.max_pad_multiple : 128;
    if (bound >= 0) {
        /* A bound past what the buffer can ever produce gets no rows: the library refuses it by name
         * (collectively) instead of this allocation failing on its size. */
        return bound <= (permute ? grouped + L * (max_pad - 1) : plain) ? bound : 0;
    }
    /* Likewise a pad_multiple above the buffer's max_pad_multiple. */
    if (permute && pad_multiple > max_pad) return 0;
    return permute ? grouped + L * ((pad_multiple > 0 ? pad_multiple : 1) - 1) : plain;
}

COLLECTIVE_METHOD(buffer_rm_dispatch, EPX_COLLECTIVE_RM_DISPATCH)
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
                         "local_map",
                         NULL};
    PyObject *x_obj, *map_obj, *probs_obj = Py_None, *sf_obj = Py_None, *nd_obj = Py_None, *np_obj = Py_None;
    PyObject *stream_obj = Py_None;
    int permute = 0, pad_multiple = 1, local_map = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|OOpiOOOp", kw, &x_obj, &map_obj, &probs_obj, &sf_obj,
                                     &permute, &pad_multiple, &nd_obj, &np_obj, &stream_obj, &local_map))
        return NULL;
    if (py_buffer_check(self) != 0) return NULL;
    call_t c;
    epx_rm_dispatch_args_t a = EPX_RM_DISPATCH_ARGS_INIT;
    epx_rm_dispatch_outputs_t o = EPX_RM_DISPATCH_OUTPUTS_INIT;
    if (parse_bound(nd_obj, &a.num_dispatched_tokens) != 0 ||
        parse_bound(np_obj, &a.num_permuted_tokens) != 0)
        return NULL;
    a.permute = permute;
    a.pad_multiple = pad_multiple;
    const tensor_in_t in[] = {
        {x_obj, "hidden", HINT_FP8, &a.hidden},
        {sf_obj, "scaling_factor", HINT_NONE, &a.scaling_factor},
        {map_obj, "routing_map", HINT_BOOL, &a.routing_map},
        {probs_obj, "probs", HINT_NONE, &a.probs},
    };
    if (call_open(&c, 8, x_obj, stream_obj, in, COUNT(in), &a.stream) != 0) return call_fail(&c);
    if (py_check_views_in(self, in, COUNT(in), NULL) != 0) return call_fail(&c);
    int64_t H = self->cfg.hidden, L = self->L;
    int64_t bound = permute ? a.num_permuted_tokens : a.num_dispatched_tokens;
    int64_t cap = rm_dispatch_rows(self, bound, permute, pad_multiple);
    epx_dtype_t xd = a.hidden.dtype == EPX_DTYPE_INVALID ? EPX_DTYPE_BF16 : a.hidden.dtype;
    /* Slots 4 and 5 (handle, row count) are filled after the call; probs are [rows] with permute. */
    const tensor_out_t outs[] = {
        {1, xd, 2, {cap, H}, "tokens", &o.tokens},
        {xd == EPX_DTYPE_FP8_E4M3, EPX_DTYPE_FP32, 2, {cap, H / 128}, "scaling_factor", &o.scaling_factor},
        {a.probs.data != NULL, EPX_DTYPE_FP32, permute ? 1 : 2, {cap, L}, "probs", &o.probs},
        {permute, EPX_DTYPE_INT32, 1, {L}, "tokens_per_expert", &o.tokens_per_expert},
        [6] = {bound >= 0, EPX_DTYPE_INT32, 1, {1}, "num_tokens", &o.num_tokens},
        {local_map, EPX_DTYPE_BOOL, 2, {(int64_t)self->R * self->cfg.max_tokens, L}, "local_map", &o.local_map},
    };
    if (call_alloc(&c, outs, COUNT(outs)) != 0) return call_fail(&c);
    epx_result_t res;
    COLLECTIVE_CALL(self, res = epx_rm_dispatch(self->buf, &a, &o));
    if (call_end(&c, res) != 0) return NULL;
    c.items[4] = (PyObject *)py_handle_new(self, o.handle, HANDLE_RM, permute, a.hidden.shape[0]);
    c.items[5] = PyLong_FromLongLong(o.num_tokens_host);
    if (!c.items[4] || !c.items[5]) return call_fail(&c);
    if (bound < 0)
        for (int i = 0; i < 3; i++)
            if (py_slice_rows(&c.items[i], o.num_tokens_host, cap) != 0) return call_fail(&c);
    return call_result(&c, py_rm_dispatch_type);
}

COLLECTIVE_METHOD(buffer_rm_combine, EPX_COLLECTIVE_RM_COMBINE)
{
    static char *kw[] = {"x", "handle", "weighted", "stream", NULL};
    PyObject *x_obj, *stream_obj = Py_None;
    HandleObject *h;
    int weighted = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!|pO", kw, &x_obj, &py_handle_type, &h, &weighted,
                                     &stream_obj))
        return NULL;
    if (py_buffer_check(self) != 0 || py_handle_check(h, HANDLE_RM) != 0) return NULL;
    call_t c;
    epx_rm_combine_args_t a = EPX_RM_COMBINE_ARGS_INIT;
    epx_rm_combine_outputs_t o = EPX_RM_COMBINE_OUTPUTS_INIT;
    a.handle = h->handle;
    a.weighted = weighted;
    const tensor_in_t in[] = {{x_obj, "x", HINT_NONE, &a.x}};
    if (call_open(&c, 1, x_obj, stream_obj, in, COUNT(in), &a.stream) != 0) return call_fail(&c);
    if (py_check_views_in(self, in, COUNT(in), NULL) != 0) return call_fail(&c);
    const tensor_out_t outs[] = {
        {1, EPX_DTYPE_BF16, 2, {h->num_tokens, self->cfg.hidden}, "combined", &o.combined},
    };
    if (call_alloc(&c, outs, COUNT(outs)) != 0) return call_fail(&c);
    epx_result_t res;
    COLLECTIVE_CALL(self, res = epx_rm_combine(self->buf, &a, &o));
    py_area_reuse(&self->cin);
    if (call_end(&c, res) != 0) return NULL;
    return c.items[0];
}

static PyObject *buffer_query_overflow(BufferObject *self, PyObject *unused)
{
    if (py_buffer_check(self) != 0) return NULL;
    epx_result_t res;
    WITHOUT_GIL(res = epx_buffer_query_overflow(self->buf));
    if (res == EPX_ERR_OVERFLOW) Py_RETURN_TRUE;
    if (res != EPX_SUCCESS) return py_raise_epx(res);
    Py_RETURN_FALSE;
}

/* _refuse(kind, exc): for layers above the binding that refuse a collective call themselves. */
static PyObject *buffer_refuse(BufferObject *self, PyObject *args)
{
    int kind;
    PyObject *exc;
    if (!PyArg_ParseTuple(args, "iO", &kind, &exc)) return NULL;
    if (py_refuse(self, kind, exc) != 0) return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ C baseline ---- */

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

/* Runs `iters` LL dispatches (until one fails), the time of each in `times`. */
static epx_result_t time_ll_dispatch(epx_buffer_t buf, const epx_ll_dispatch_args_t *a,
                                     epx_ll_dispatch_outputs_t *o, int iters, int64_t *times)
{
    epx_result_t res = EPX_SUCCESS;
    for (int i = 0; i < iters && res == EPX_SUCCESS; i++) {
        int64_t t0 = now_ns();
        res = epx_ll_dispatch(buf, a, o);
        times[i] = now_ns() - t0;
    }
    return res;
}

/* _bench_ll_dispatch_c(buffer, x, topk_idx, iters) -> median microseconds of epx_ll_dispatch called
 * straight from C with preallocated outputs: the baseline the Python call overhead is measured against. */
PyObject *py_bench_ll_dispatch_c(PyObject *mod, PyObject *args)
{
    BufferObject *self;
    PyObject *x_obj, *topk_obj;
    int iters;
    if (!PyArg_ParseTuple(args, "O!OOi", &py_buffer_type, &self, &x_obj, &topk_obj, &iters)) return NULL;
    if (py_buffer_check(self) != 0 || iters < 1) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "epx: iters must be >= 1");
        return NULL;
    }
    call_t c;
    PyObject *result = NULL;
    epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
    epx_ll_dispatch_outputs_t o = EPX_LL_DISPATCH_OUTPUTS_INIT;
    int64_t *times = malloc(sizeof(int64_t) * (size_t)iters);
    if (!times) return PyErr_NoMemory();
    const tensor_in_t in[] = {{x_obj, "x", HINT_NONE, &a.x}, {topk_obj, "topk_idx", HINT_NONE, &a.topk_idx}};
    /* No stream: the call runs on the default one, as a C caller's would. */
    if (call_open(&c, 5, x_obj, Py_None, in, COUNT(in), NULL) != 0 ||
        ll_dispatch_alloc(&c, self, 0, 0, &o) != 0)
        goto out;
    epx_result_t res;
    WITHOUT_GIL(res = time_ll_dispatch(self->buf, &a, &o, iters, times));
    if (res != EPX_SUCCESS) {
        py_raise_epx(res);
        goto out;
    }
    qsort(times, (size_t)iters, sizeof(int64_t), cmp_i64);
    result = PyFloat_FromDouble((double)times[iters / 2] / 1000.0);
out:
    call_fail(&c);
    free(times);
    return result;
}

/* ------------------------------------------------------------------ method table ---- */

PyMethodDef py_buffer_methods[] = {
    {"get_dispatch_layout", KWFN(buffer_layout), METH_VARARGS | METH_KEYWORDS,
     "get_dispatch_layout(topk_idx, *, stream=None) -> Layout\n--\n\n"
     "Counts derived from topk_idx [T, K] int32/int64 (-1 = no expert). Not collective. Returns\n"
     "Layout(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, R]\n"
     "bool, num_tokens_per_domain [R/D] int32 or None)."},
    {"dispatch", KWFN(buffer_dispatch), METH_VARARGS | METH_KEYWORDS,
     "dispatch(x, topk_idx=None, topk_weights=None, *, x_scales=None, handle=None, expert_alignment=1,\n"
     "         num_worst_tokens=0, stream=None, views=None) -> DispatchOutput\n--\n\n"
     "HT dispatch (collective). x [T, H] bf16 (torch.bfloat16 or numpy uint16 bit patterns), float32 or\n"
     "fp8 e4m3 (torch.float8_e4m3fn or numpy uint8) with x_scales [T, H/128] float32; topk_idx [T, K]\n"
     "int32/int64; topk_weights [T, K] float32. handle=: cached dispatch with that handle's routing.\n"
     "num_worst_tokens > 0: static mode, outputs have that many rows. Otherwise outputs have N_r rows.\n"
     "views (None: the buffer's; False, True or \"pooled\", True staying pooled on a pooled buffer):\n"
     "with True, recv_x, recv_x_scales, recv_topk_idx (int32) and recv_topk_weights are views of one of\n"
     "the buffer's view areas, valid until a later dispatch reuses that area; with \"pooled\" no\n"
     "dispatch reuses it while they are alive (or they are copies, when every area is held); with\n"
     "False they are new arrays of their own (recv_topk_idx in topk_idx's dtype)."},
    {"combine", KWFN(buffer_combine), METH_VARARGS | METH_KEYWORDS,
     "combine(x, handle, topk_weights=None, bias0=None, bias1=None, *, stream=None) -> CombineOutput\n--\n\n"
     "HT combine (collective). x [>= N_r, H] bf16; topk_weights [>= N_r, K] float32; bias0/bias1 [T, H]\n"
     "bf16. x = combine_input(handle) is read where it is; so, on a buffer with views, is x = the live\n"
     "recv_x of a dispatch made with this handle (whole, bf16), and any other x is first copied into the\n"
     "combine input.\n"
     "Returns CombineOutput(combined_x [T, H] bf16, combined_topk_weights [T, K] float32 or None)."},
    {"combine_input", KWFN(py_buffer_combine_input), METH_VARARGS | METH_KEYWORDS,
     "combine_input(handle) -> tensor\n--\n\n"
     "The [N_r (or num_worst_tokens), H] bf16 rows in the buffer's memory that combine(x, handle) reads\n"
     "without a copy when x is this array: write the expert outputs into it. Valid until the next HT or\n"
     "routing-map combine on this buffer, or combine_input() of another handle. Not collective."},
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
     "            num_dispatched_tokens=None, num_permuted_tokens=None, stream=None, local_map=False) -> "
     "RoutingDispatchOutput\n"
     "--\n\nRouting-map dispatch (collective). hidden [T, H] bf16 or fp8 (+ scaling_factor [T, H/128]\n"
     "float32); routing_map [T, E] bool; probs [T, E] float32. permute groups rows by local expert, each\n"
     "group padded to pad_multiple. A bound sizes the outputs (rows past it are dropped, see\n"
     "query_overflow); without one outputs have exactly N_r or P rows. local_map=True adds the received\n"
     "tokens' local experts ([R*T_max, L] bool, no host wait)."},
    {"rm_combine", KWFN(buffer_rm_combine), METH_VARARGS | METH_KEYWORDS,
     "rm_combine(x, handle, weighted=False, *, stream=None) -> tensor\n--\n\n"
     "Inverse of rm_dispatch (collective): x [>= rows, H] bf16 in the dispatch's output layout; returns\n"
     "[T, H] bf16. With permute this is combine-with-unpermute (weighted by probs when weighted=True)."},
    {"query_overflow", (PyCFunction)buffer_query_overflow, METH_NOARGS,
     "query_overflow() -> bool\n--\n\nTrue (and the flag cleared) when a call with an upper bound dropped "
     "rows."},
    {"_refuse", (PyCFunction)buffer_refuse, METH_VARARGS,
     "_refuse(kind, exc)\n--\n\nInternal: refuses this rank's collective call of `kind` (COLLECTIVE_*)\n"
     "for the exception `exc` that stopped it before it reached the library; the peers raise RemoteError."},
    {"destroy", (PyCFunction)py_buffer_destroy, METH_NOARGS,
     "destroy()\n--\n\nFrees the buffer now (handles must be gone). Not collective."},
    {NULL},
};
