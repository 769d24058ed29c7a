/*
 * Argument checking shared by the API entry points: versioned structs, buffer configs, the
 * buffer, mode and handles of a call, tensor descriptors against an expected shape, and the
 * values of host-memory index tensors.
 */
#ifndef EPX_API_CHECK_H
#define EPX_API_CHECK_H

#include <stdbool.h>
#include <stddef.h>

#include "core/internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes from the start of `type` to the end of `field`. */
#define EPX_STRUCT_END(type, field) (offsetof(type, field) + sizeof(((type *)0)->field))
/* Smallest size a versioned struct may declare: its size and version fields. */
#define EPX_STRUCT_MIN_SIZE EPX_STRUCT_END(epx_buffer_config_t, version)

/* The dtypes a buffer may be asked to dispatch (its dispatch_dtypes default). */
#define EPX_API_DISPATCH_DTYPES \
    (EPX_DTYPE_BIT(EPX_DTYPE_BF16) | EPX_DTYPE_BIT(EPX_DTYPE_FP32) | EPX_DTYPE_BIT(EPX_DTYPE_FP8_E4M3))

/* epx_error with the "rank N: " prefix every API message carries (none without a comm). */
epx_result_t epx_api_error(epx_comm_t comm, epx_result_t code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
#define EPX_API_ERR(comm, code, ...) epx_api_error((comm), (code), __VA_ARGS__)

/* Copies min(src->size, dst_size) bytes of the caller's struct over dst, which holds the
 * defaults. `what` names the argument in messages ("args", "config"). A size below the size
 * and version fields is EPX_ERR_INVALID_ARG; a version of another major release is
 * EPX_ERR_UNSUPPORTED. */
epx_result_t epx_api_read_struct(epx_comm_t comm, void *dst, size_t dst_size, const void *src,
                                 const char *what);

/* Reads a caller's buffer config, applies the defaults and checks it for `nranks` ranks
 * (nothing crosses ranks here). */
epx_result_t epx_api_buffer_config_normalize(epx_comm_t comm, const epx_buffer_config_t *config, int nranks,
                                             epx_buffer_config_t *out);

/* "bf16, fp32 or fp8_e4m3" for a mask of EPX_DTYPE_BIT()s. */
const char *epx_api_dtype_list(uint32_t mask, char *buf, size_t cap);

/* Reads the caller's `args` and `outputs` over the defaults in `a` and `o` (a_size and o_size
 * bytes), then checks that the buffer was created for `mode` and that its backend implements
 * the call (`implemented`); `op` names the call in messages. */
epx_result_t epx_api_read_call(epx_buffer_t buffer, uint32_t mode, const char *op, bool implemented, void *a,
                               size_t a_size, const void *args, void *o, size_t o_size, const void *outputs);
/* The buffer was created for `mode`. */
epx_result_t epx_api_check_mode(epx_buffer_t buffer, uint32_t mode, const char *op);
/* EPX_ERR_UNSUPPORTED naming the backend and `op`. */
epx_result_t epx_api_unsupported(epx_buffer_t buffer, const char *op);
/* T tokens fit the buffer's max_tokens. */
epx_result_t epx_api_check_tokens(epx_buffer_t buffer, const char *name, int64_t T);
/* Dispatched tokens: `x` [T, H] of a dtype of `call_dtypes` the buffer was created for, T at most
 * max_tokens; `name` names it. */
epx_result_t epx_api_check_dispatch_x(epx_buffer_t buffer, const epx_tensor_t *x, const char *name,
                                      uint32_t call_dtypes);
/* The scales of dispatched tokens: [T, H/128] fp32 when x is fp8, absent otherwise. */
epx_result_t epx_api_check_x_scales(epx_buffer_t buffer, const epx_tensor_t *x, const char *x_name,
                                    const epx_tensor_t *scales, const char *scales_name);
/* A live handle of `kind` made on this buffer. */
epx_result_t epx_api_check_handle(epx_buffer_t buffer, epx_handle_t handle, epx_handle_kind_t kind,
                                  const char *name);
/* An LL handle of a dispatch made on this buffer before sequence number `next_seq`. */
epx_result_t epx_api_check_ll_handle(epx_buffer_t buffer, const epx_ll_handle_t *h, uint64_t next_seq,
                                     const char *name);

#define EPX_TENSOR_OPTIONAL 0x1u /* data == NULL means absent */
#define EPX_TENSOR_MIN_ROWS 0x2u /* shape[0] is a capacity: at least the expected value */
#define EPX_TENSOR_TOKENS 0x4u   /* token rows: data aligned to 16 bytes */

#define EPX_ANY_DIM (-1) /* in epx_tensor_spec_t.shape: any size */

/* What a tensor argument must look like. */
typedef struct epx_tensor_spec {
    const char *name; /* as messages name it: "x", "outputs.recv_x" */
    uint32_t dtypes;  /* EPX_DTYPE_BIT()s accepted */
    int32_t ndim;
    int64_t shape[EPX_MAX_DIMS]; /* expected sizes, EPX_ANY_DIM for free ones */
    const char *dims;            /* names of the expected sizes, comma-separated: "T,H" */
    unsigned flags;              /* EPX_TENSOR_* */
} epx_tensor_spec_t;

/* Checks pointer, dtype, ndim, shape (or capacity), contiguity, device and alignment. A
 * required tensor may have a NULL data pointer only when it holds no elements. */
epx_result_t epx_api_check_tensor(epx_comm_t comm, const epx_tensor_t *t, const epx_tensor_spec_t *spec);

static inline bool epx_api_present(const epx_tensor_t *t) { return t->data != NULL; }

/* The received rows of a dispatch, `rows` of them (`count` names the number in messages): `x`
 * [rows, H] of `dtype` and, for fp8, `scales` [rows, H/128] fp32 (cleared otherwise: not
 * written); x_name and scales_name name the two outputs. */
epx_result_t epx_api_check_recv_rows(epx_comm_t comm, epx_tensor_t *x, const char *x_name,
                                     epx_tensor_t *scales, const char *scales_name, epx_dtype_t dtype,
                                     int64_t rows, const char *count, int64_t H);

/* Values of a checked [T, K] int32/int64 topk_idx in host memory: each in [-1, E), no
 * non-negative id twice within a token. This is the one check of host ids: the host backend
 * relies on it. Device tensors are left to the backend. */
epx_result_t epx_api_check_topk_idx(epx_comm_t comm, const epx_tensor_t *t, int64_t num_experts,
                                    const char *name);
/* Values of a checked [T, E] bool routing map in host memory: 0 or 1, at most K per row. */
epx_result_t epx_api_check_routing_map(epx_comm_t comm, const epx_tensor_t *t, int64_t num_topk,
                                       const char *name);

#ifdef __cplusplus
}
#endif

#endif /* EPX_API_CHECK_H */
