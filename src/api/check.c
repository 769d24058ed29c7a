/*
 * Argument checks shared by the API entry points (see check.h). Every failure names the
 * argument and carries the numbers involved, and nothing here writes to a caller's memory.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "api/api.h"

epx_result_t epx_api_error(epx_comm_t comm, epx_result_t code, const char *fmt, ...)
{
    char message[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof(message), fmt, ap);
    va_end(ap);
    if (comm) return epx_error(code, "rank %d: %s", comm->rank, message);
    return epx_error(code, "%s", message);
}

epx_result_t epx_api_read_struct(epx_comm_t comm, void *dst, size_t dst_size, const void *src,
                                 const char *what)
{
    if (!src) return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "%s is NULL", what);
    size_t size;
    uint32_t version;
    memcpy(&size, src, sizeof(size));
    if (size < EPX_STRUCT_MIN_SIZE)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG,
                           "%s->size = %zu is below %zu, the size and version fields (initialise the "
                           "struct with its EPX_*_INIT macro)",
                           what, size, (size_t)EPX_STRUCT_MIN_SIZE);
    memcpy(&version, (const char *)src + offsetof(epx_buffer_config_t, version), sizeof(version));
    /* Struct layouts only grow within a major release; another major may have moved fields. */
    if (version / 10000 != EPX_VERSION_MAJOR)
        return EPX_API_ERR(comm, EPX_ERR_UNSUPPORTED,
                           "%s->version = %u was compiled against epx %u.%u.%u; this library is %d.%d.%d",
                           what, version, version / 10000, version / 100 % 100, version % 100,
                           EPX_VERSION_MAJOR, EPX_VERSION_MINOR, EPX_VERSION_PATCH);
    memcpy(dst, src, size < dst_size ? size : dst_size);
    return EPX_SUCCESS;
}

const char *epx_api_dtype_list(uint32_t mask, char *buf, size_t cap)
{
    int count = 0, total = 0;
    size_t used = 0;
    buf[0] = '\0';
    for (int d = 1; d < EPX_DTYPE_COUNT_; d++)
        if (mask & EPX_DTYPE_BIT(d)) total++;
    for (int d = 1; d < EPX_DTYPE_COUNT_ && used < cap; d++) {
        if (!(mask & EPX_DTYPE_BIT(d))) continue;
        const char *sep = count == 0 ? "" : (count == total - 1 ? " or " : ", ");
        int n = snprintf(buf + used, cap - used, "%s%s", sep, epx_dtype_str((epx_dtype_t)d));
        if (n < 0) break;
        used += (size_t)n;
        count++;
    }
    if (total == 0) snprintf(buf, cap, "none");
    return buf;
}

/* Past this many bytes a config is refused, so no backend's layout arithmetic (uint64) can wrap. */
#define EPX_MAX_BUFFER_BYTES 0x1p56L

/* A generous bound, computed without wrapping, on the bytes any backend reserves for a config: every
 * area of every mode, each taken several times over (the backends' own layouts are below it). */
static long double config_bytes_bound(const epx_buffer_config_t *c, int nranks)
{
    const long double R = nranks, T = (long double)c->max_tokens, H = (long double)c->hidden;
    const long double K = c->num_topk, E = c->num_experts;
    const long double pad = c->max_pad_multiple > 1 ? c->max_pad_multiple : 1;
    const long double views = c->num_view_areas > 1 ? c->num_view_areas : 1;
    const long double row = H * 4 + (H / 128 + 1) * 4 + K * 16 + E * 5 + 64; /* a token row and its metadata */
    const long double ht = R * T * row * (8 + 2 * views);
    const long double ll = E * T * (H * 2 + 64) * 8 + T * K * H * 8 + R * E * 16;
    const long double rm = E * (pad - 1) * (H * 2 + 4) * 2 + R * T * K * (H * 2 + 8) + (T / 32 + 2) * (E + R) * 8;
    return ht + ll + rm + (1 << 20);
}

epx_result_t epx_api_buffer_config_normalize(epx_comm_t comm, const epx_buffer_config_t *config, int nranks,
                                             epx_buffer_config_t *out)
{
    epx_buffer_config_t c = {.size = sizeof(c), .version = EPX_VERSION_CODE};
    if (nranks < 1) return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "nranks = %d must be >= 1", nranks);
    EPX_CHECK(epx_api_read_struct(comm, &c, sizeof(c), config, "config"));
    c.size = sizeof(c);
    c.version = EPX_VERSION_CODE;
    if (c.modes == 0) c.modes = EPX_MODE_ALL;
    if (c.modes & ~EPX_MODE_ALL)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG,
                           "config.modes = 0x%x has bits outside EPX_MODE_ALL (0x%x)", c.modes, EPX_MODE_ALL);
    /* The default takes fp8 only where the hidden size allows it (a multiple of 128); asking for fp8
     * explicitly with another hidden size is refused below. */
    if (c.dispatch_dtypes == 0)
        c.dispatch_dtypes =
            EPX_API_DISPATCH_DTYPES & (c.hidden % 128 == 0 ? ~0u : ~EPX_DTYPE_BIT(EPX_DTYPE_FP8_E4M3));
    if (c.dispatch_dtypes & ~EPX_API_DISPATCH_DTYPES)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG,
                           "config.dispatch_dtypes = 0x%x allows dtypes other than bf16, fp32 and fp8_e4m3",
                           c.dispatch_dtypes);
    if (c.max_pad_multiple == 0) c.max_pad_multiple = 128;
    if (c.max_pad_multiple < 0)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "config.max_pad_multiple = %d must be >= 0",
                           c.max_pad_multiple);
    if (c.max_tokens < 1)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "config.max_tokens = %lld must be >= 1",
                           (long long)c.max_tokens);
    /* Received row counts (N_r <= nranks * max_tokens) travel as int32 everywhere. */
    if (c.max_tokens > INT32_MAX / nranks)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG,
                           "config.max_tokens = %lld times nranks = %d exceeds %d (row counts are int32)",
                           (long long)c.max_tokens, nranks, INT32_MAX);
    if (c.hidden < 1 || c.hidden > INT32_MAX)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "config.hidden = %lld is out of range [1, %d]",
                           (long long)c.hidden, INT32_MAX);
    if (c.num_topk < 1 || c.num_topk > EPX_MAX_TOPK)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "config.num_topk = %d is out of range [1, %d]",
                           c.num_topk, EPX_MAX_TOPK);
    if (c.num_experts < 1)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "config.num_experts = %d must be >= 1", c.num_experts);
    if (c.num_experts % nranks != 0)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG,
                           "config.num_experts = %d is not a multiple of nranks = %d", c.num_experts, nranks);
    if (c.num_topk > c.num_experts)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "config.num_topk = %d exceeds num_experts = %d",
                           c.num_topk, c.num_experts);
    /* LL needs no granularity of its own: its fp8 calls are checked per call (hidden % 128). */
    if (c.hidden % 128 != 0 && (c.dispatch_dtypes & EPX_DTYPE_BIT(EPX_DTYPE_FP8_E4M3)))
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG,
                           "config.hidden = %lld is not a multiple of 128, which fp8 dispatch needs (leave "
                           "fp8_e4m3 out of dispatch_dtypes)",
                           (long long)c.hidden);
    if (c.num_sms < 0)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "config.num_sms = %d must be >= 0", c.num_sms);
    if (c.chunk_tokens < 0)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "config.chunk_tokens = %d must be >= 0",
                           c.chunk_tokens);
    if (c.num_view_areas == 0) c.num_view_areas = 1;
    if (c.num_view_areas < 1 || c.num_view_areas > EPX_MAX_VIEW_AREAS)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "config.num_view_areas = %d is out of range [0, %d]",
                           c.num_view_areas, EPX_MAX_VIEW_AREAS);
    const long double bound = config_bytes_bound(&c, nranks);
    if (bound > EPX_MAX_BUFFER_BYTES)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG,
                           "the config asks for about %.3Lg bytes of buffer per rank (max_tokens = %lld, hidden = "
                           "%lld, num_topk = %d, num_experts = %d, nranks = %d), more than the %.3Lg any backend "
                           "can lay out",
                           bound, (long long)c.max_tokens, (long long)c.hidden, c.num_topk, c.num_experts, nranks,
                           (long double)EPX_MAX_BUFFER_BYTES);
    *out = c;
    return EPX_SUCCESS;
}

/* ------------------------------------------------------------- buffers, modes, handles ---- */

static const char *mode_name(uint32_t mode)
{
    switch (mode) {
    case EPX_MODE_HT: return "EPX_MODE_HT";
    case EPX_MODE_LL: return "EPX_MODE_LL";
    case EPX_MODE_PERMUTE: return "EPX_MODE_PERMUTE";
    default: return "?";
    }
}

epx_result_t epx_api_read_call(epx_buffer_t buffer, uint32_t mode, const char *op, bool implemented, void *a,
                               size_t a_size, const void *args, void *o, size_t o_size, const void *outputs)
{
    EPX_CHECK(epx_api_read_struct(buffer->comm, a, a_size, args, "args"));
    EPX_CHECK(epx_api_read_struct(buffer->comm, o, o_size, outputs, "outputs"));
    EPX_CHECK(epx_api_check_mode(buffer, mode, op));
    if (!implemented) return epx_api_unsupported(buffer, op);
    return EPX_SUCCESS;
}

epx_result_t epx_api_check_mode(epx_buffer_t buffer, uint32_t mode, const char *op)
{
    if (buffer->config.modes & mode) return EPX_SUCCESS;
    char modes[64] = "";
    for (uint32_t m = 1; m <= EPX_MODE_PERMUTE; m <<= 1)
        if (buffer->config.modes & m) {
            if (modes[0]) strcat(modes, "|");
            strcat(modes, mode_name(m));
        }
    return EPX_API_ERR(buffer->comm, EPX_ERR_INVALID_ARG,
                       "%s needs a buffer created with %s; this buffer's modes are %s", op, mode_name(mode),
                       modes);
}

epx_result_t epx_api_unsupported(epx_buffer_t buffer, const char *op)
{
    return EPX_API_ERR(buffer->comm, EPX_ERR_UNSUPPORTED, "the %s backend does not implement %s",
                       buffer->ops->name, op);
}

epx_result_t epx_api_check_tokens(epx_buffer_t buffer, const char *name, int64_t T)
{
    if (T > buffer->config.max_tokens)
        return EPX_API_ERR(buffer->comm, EPX_ERR_INVALID_ARG,
                           "%s has %lld tokens, more than the buffer's max_tokens = %lld", name, (long long)T,
                           (long long)buffer->config.max_tokens);
    return EPX_SUCCESS;
}

/* A dtype of `call_dtypes` that x has must also be one the buffer was sized for. */
static epx_result_t check_dispatch_dtype(epx_buffer_t buffer, const epx_tensor_t *x, const char *name,
                                         uint32_t call_dtypes)
{
    if (x->dtype > EPX_DTYPE_INVALID && x->dtype < EPX_DTYPE_COUNT_ &&
        (call_dtypes & EPX_DTYPE_BIT(x->dtype)) &&
        !(buffer->config.dispatch_dtypes & EPX_DTYPE_BIT(x->dtype))) {
        char allowed[96];
        const int fp8_odd = x->dtype == EPX_DTYPE_FP8_E4M3 && buffer->config.hidden % 128 != 0;
        return EPX_API_ERR(
            buffer->comm, EPX_ERR_INVALID_ARG,
            "%s has dtype %s, which the buffer was not created for (config.dispatch_dtypes allows %s%s)", name,
            epx_dtype_str(x->dtype),
            epx_api_dtype_list(buffer->config.dispatch_dtypes, allowed, sizeof(allowed)),
            fp8_odd ? "; fp8 needs hidden % 128 == 0" : "");
    }
    return EPX_SUCCESS;
}

epx_result_t epx_api_check_dispatch_x(epx_buffer_t buffer, const epx_tensor_t *x, const char *name,
                                      uint32_t call_dtypes)
{
    const uint32_t dtypes = call_dtypes & buffer->config.dispatch_dtypes;
    EPX_CHECK(check_dispatch_dtype(buffer, x, name, call_dtypes));
    EPX_CHECK(epx_api_check_tensor(
        buffer->comm, x,
        &(epx_tensor_spec_t){
            name, dtypes, 2, {EPX_ANY_DIM, buffer->config.hidden}, "T,H", EPX_TENSOR_TOKENS}));
    return epx_api_check_tokens(buffer, name, x->shape[0]);
}

epx_result_t epx_api_check_x_scales(epx_buffer_t buffer, const epx_tensor_t *x, const char *x_name,
                                    const epx_tensor_t *scales, const char *scales_name)
{
    const int64_t T = x->shape[0], H = buffer->config.hidden;
    if (x->dtype == EPX_DTYPE_FP8_E4M3)
        return epx_api_check_tensor(
            buffer->comm, scales,
            &(epx_tensor_spec_t){scales_name, EPX_DTYPE_BIT(EPX_DTYPE_FP32), 2, {T, H / 128}, "T,H/128", 0});
    if (epx_api_present(scales))
        return EPX_API_ERR(buffer->comm, EPX_ERR_INVALID_ARG,
                           "%s is given but %s is %s (scales go with fp8_e4m3 only)", scales_name, x_name,
                           epx_dtype_str(x->dtype));
    return EPX_SUCCESS;
}

epx_result_t epx_api_check_handle(epx_buffer_t buffer, epx_handle_t handle, epx_handle_kind_t kind,
                                  const char *name)
{
    epx_comm_t comm = buffer->comm;
    static const char *kinds[] = {"?", "HT", "routing-map"};
    if (!handle) return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "%s is NULL", name);
    /* Read under the registry's lock: a handle of another buffer may be destroyed meanwhile. */
    epx_api_registry_lock();
    const epx_api_state_t state = epx_api_lookup_locked(handle, EPX_API_HANDLE);
    const epx_handle_kind_t handle_kind = state == EPX_API_LIVE ? handle->kind : (epx_handle_kind_t)0;
    const epx_buffer_t owner = state == EPX_API_LIVE ? handle->buffer : NULL;
    epx_api_registry_unlock();
    if (state == EPX_API_DESTROYED)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_USAGE,
                           "%s = %p was destroyed (epx_handle_destroy) and may not be used again", name,
                           (void *)handle);
    if (state != EPX_API_LIVE)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG,
                           "%s = %p is not a live handle (destroyed, or not made by a dispatch)", name,
                           (void *)handle);
    int have = handle_kind == EPX_HANDLE_RM ? 2 : handle_kind == EPX_HANDLE_HT ? 1 : 0;
    if (handle_kind != kind)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "%s is a %s handle; this call needs a %s handle", name,
                           kinds[have], kinds[kind]);
    if (owner != buffer)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "%s belongs to another buffer (%p, not %p)", name,
                           (void *)owner, (void *)buffer);
    return EPX_SUCCESS;
}

epx_result_t epx_api_check_ll_handle(epx_buffer_t buffer, const epx_ll_handle_t *h, uint64_t next_seq,
                                     const char *name)
{
    epx_comm_t comm = buffer->comm;
    if (h->slot != 0 && h->slot != 1)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "%s.slot = %d is not 0 or 1", name, h->slot);
    if (h->num_tokens < 0 || h->num_tokens > buffer->config.max_tokens)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "%s.num_tokens = %d is out of range [0, %lld]", name,
                           h->num_tokens, (long long)buffer->config.max_tokens);
    if (h->seq == 0 || h->seq >= next_seq)
        return EPX_API_ERR(
            comm, EPX_ERR_INVALID_ARG,
            "%s.seq = %llu is not a dispatch made on this buffer (%llu collective calls so far)", name,
            (unsigned long long)h->seq, (unsigned long long)(next_seq - 1));
    return EPX_SUCCESS;
}

/* ----------------------------------------------------------------------------- tensors ---- */

/* The i-th comma-separated name of `dims` ("" when there is none). */
static const char *dim_name(const char *dims, int i, char *buf, size_t cap)
{
    const char *p = dims;
    buf[0] = '\0';
    for (int k = 0; k < i && p; k++) {
        p = strchr(p, ',');
        if (p) p++;
    }
    if (!p) return buf;
    size_t n = strcspn(p, ",");
    if (n >= cap) n = cap - 1;
    memcpy(buf, p, n);
    buf[n] = '\0';
    return buf;
}

epx_result_t epx_api_check_tensor(epx_comm_t comm, const epx_tensor_t *t, const epx_tensor_spec_t *s)
{
    const char *n = s->name;
    char names[160], dim[48];
    if (!t->data) {
        if (s->flags & EPX_TENSOR_OPTIONAL) return EPX_SUCCESS;
        bool empty = false;
        if (t->ndim == s->ndim)
            for (int i = 0; i < t->ndim; i++) empty |= t->shape[i] == 0;
        if (!empty)
            return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "%s.data is NULL (a [%s] tensor is required)", n,
                               s->dims);
    }
    if (t->dtype <= EPX_DTYPE_INVALID || t->dtype >= EPX_DTYPE_COUNT_ ||
        !(s->dtypes & EPX_DTYPE_BIT(t->dtype)))
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "%s has dtype %s (%d); expected %s", n,
                           epx_dtype_str(t->dtype), (int)t->dtype,
                           epx_api_dtype_list(s->dtypes, names, sizeof(names)));
    if (t->ndim != s->ndim)
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "%s has %d dimensions; expected %d ([%s])", n,
                           (int)t->ndim, (int)s->ndim, s->dims);
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] < 0)
            return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "%s.shape[%d] = %lld is negative", n, i,
                               (long long)t->shape[i]);
        if (s->shape[i] == EPX_ANY_DIM) continue;
        dim_name(s->dims, i, dim, sizeof(dim));
        if (i == 0 && (s->flags & EPX_TENSOR_MIN_ROWS)) {
            if (t->shape[0] < s->shape[0])
                return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG,
                                   "%s.shape[0] = %lld rows is too small: %s = %lld rows are needed", n,
                                   (long long)t->shape[0], dim, (long long)s->shape[0]);
        } else if (t->shape[i] != s->shape[i]) {
            return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "%s.shape[%d] = %lld, expected %s = %lld ([%s])", n,
                               i, (long long)t->shape[i], dim, (long long)s->shape[i], s->dims);
        }
    }
    /* Dims of size 0 count as 1 for strides (as frameworks do), and for the overflow guard. */
    size_t elem = epx_dtype_bytes(t->dtype);
    int64_t span = 1, limit = INT64_MAX / (int64_t)elem;
    for (int i = 0; i < t->ndim; i++) {
        int64_t d = t->shape[i] > 0 ? t->shape[i] : 1;
        if (span > limit / d)
            return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "%s is too large: its byte size overflows int64",
                               n);
        span *= d;
    }
    bool all_zero = true;
    for (int i = 0; i < t->ndim; i++) all_zero &= t->strides[i] == 0;
    if (!all_zero) {
        int64_t stride = 1;
        for (int i = t->ndim - 1; i >= 0; i--) {
            if (t->strides[i] != stride)
                return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG,
                                   "%s is not contiguous: strides[%d] = %lld, expected %lld (row-major)", n,
                                   i, (long long)t->strides[i], (long long)stride);
            stride *= t->shape[i] > 0 ? t->shape[i] : 1;
        }
    }
    if (comm && comm->backend == EPX_BACKEND_CUDA) {
        if (t->device_type != EPX_DEVICE_CUDA || t->device_id != comm->cuda_device)
            return EPX_API_ERR(
                comm, EPX_ERR_INVALID_ARG,
                "%s is in %s memory (device %d); the cuda backend needs memory of cuda device %d", n,
                t->device_type == EPX_DEVICE_CUDA ? "cuda" : "host", (int)t->device_id, comm->cuda_device);
    } else if (t->device_type != EPX_DEVICE_HOST) {
        return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG,
                           "%s has device_type %d; the host backend needs host memory (EPX_DEVICE_HOST)", n,
                           (int)t->device_type);
    }
    if (t->data) {
        uintptr_t addr = (uintptr_t)t->data;
        if (addr % elem != 0)
            return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG,
                               "%s.data = %p is not aligned to its %zu-byte elements", n, t->data, elem);
        if ((s->flags & EPX_TENSOR_TOKENS) && addr % 16 != 0)
            return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG,
                               "%s.data = %p is not aligned to 16 bytes (token rows)", n, t->data);
    }
    return EPX_SUCCESS;
}

epx_result_t epx_api_check_recv_rows(epx_comm_t comm, epx_tensor_t *x, const char *x_name,
                                     epx_tensor_t *scales, const char *scales_name, epx_dtype_t dtype,
                                     int64_t rows, const char *count, int64_t H)
{
    char dims[64];
    snprintf(dims, sizeof(dims), "%s,H", count);
    EPX_CHECK(epx_api_check_tensor(
        comm, x,
        &(epx_tensor_spec_t){
            x_name, EPX_DTYPE_BIT(dtype), 2, {rows, H}, dims, EPX_TENSOR_MIN_ROWS | EPX_TENSOR_TOKENS}));
    if (dtype != EPX_DTYPE_FP8_E4M3) {
        memset(scales, 0, sizeof(*scales)); /* fp8 only: not written */
        return EPX_SUCCESS;
    }
    snprintf(dims, sizeof(dims), "%s,H/128", count);
    return epx_api_check_tensor(
        comm, scales,
        &(epx_tensor_spec_t){
            scales_name, EPX_DTYPE_BIT(EPX_DTYPE_FP32), 2, {rows, H / 128}, dims, EPX_TENSOR_MIN_ROWS});
}

static inline int64_t index_at(const epx_tensor_t *t, int64_t i)
{
    return t->dtype == EPX_DTYPE_INT64 ? ((const int64_t *)t->data)[i] : ((const int32_t *)t->data)[i];
}

epx_result_t epx_api_check_topk_idx(epx_comm_t comm, const epx_tensor_t *t, int64_t num_experts,
                                    const char *name)
{
    if (!t->data || t->device_type != EPX_DEVICE_HOST) return EPX_SUCCESS;
    int64_t T = t->shape[0], K = t->shape[1];
    for (int64_t i = 0; i < T; i++) {
        for (int64_t k = 0; k < K; k++) {
            int64_t v = index_at(t, i * K + k);
            if (v < -1 || v >= num_experts)
                return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG,
                                   "%s[%lld][%lld] = %lld is out of range [-1, %lld)", name, (long long)i,
                                   (long long)k, (long long)v, (long long)num_experts);
            if (v < 0) continue;
            for (int64_t j = 0; j < k; j++)
                if (index_at(t, i * K + j) == v)
                    return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG,
                                       "%s[%lld] selects expert %lld twice (slots %lld and %lld)", name,
                                       (long long)i, (long long)v, (long long)j, (long long)k);
        }
    }
    return EPX_SUCCESS;
}

epx_result_t epx_api_check_routing_map(epx_comm_t comm, const epx_tensor_t *t, int64_t num_topk,
                                       const char *name)
{
    if (!t->data || t->device_type != EPX_DEVICE_HOST) return EPX_SUCCESS;
    int64_t T = t->shape[0], E = t->shape[1];
    const uint8_t *m = (const uint8_t *)t->data;
    for (int64_t i = 0; i < T; i++) {
        int64_t selected = 0, past = -1; /* past: the column of the first true entry past the K-th */
        for (int64_t e = 0; e < E; e++) {
            uint8_t v = m[i * E + e];
            if (v > 1)
                return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG, "%s[%lld][%lld] = %u is not a bool (0 or 1)",
                                   name, (long long)i, (long long)e, (unsigned)v);
            selected += v;
            if (v && selected == num_topk + 1) past = e;
        }
        if (selected > num_topk)
            return EPX_API_ERR(comm, EPX_ERR_INVALID_ARG,
                               "%s[%lld] selects %lld experts, more than K = %lld (column %lld is past them)", name,
                               (long long)i, (long long)selected, (long long)num_topk, (long long)past);
    }
    return EPX_SUCCESS;
}
