/* The dtype table: element sizes and names (the API's epx_dtype_size/epx_dtype_name read it). */
#include "core/internal.h"

size_t epx_dtype_bytes(epx_dtype_t dtype)
{
    switch (dtype) {
    case EPX_DTYPE_BF16: return 2;
    case EPX_DTYPE_FP32: return 4;
    case EPX_DTYPE_FP8_E4M3: return 1;
    case EPX_DTYPE_INT32: return 4;
    case EPX_DTYPE_INT64: return 8;
    case EPX_DTYPE_BOOL: return 1;
    case EPX_DTYPE_UINT8: return 1;
    default: return 0;
    }
}

const char *epx_dtype_str(epx_dtype_t dtype)
{
    switch (dtype) {
    case EPX_DTYPE_BF16: return "bf16";
    case EPX_DTYPE_FP32: return "fp32";
    case EPX_DTYPE_FP8_E4M3: return "fp8_e4m3";
    case EPX_DTYPE_INT32: return "int32";
    case EPX_DTYPE_INT64: return "int64";
    case EPX_DTYPE_BOOL: return "bool";
    case EPX_DTYPE_UINT8: return "uint8";
    default: return "invalid";
    }
}
