/*
 * The library's self-description: result strings, the thread's last error, the version and the
 * dtype table, each read from core (core/error.c, core/dtype.c).
 */
#include "core/internal.h"

EPX_API const char *epx_strerror(epx_result_t result)
{
    return epx_result_text(result);
}

EPX_API const char *epx_result_name(epx_result_t result)
{
    return epx_result_str(result);
}

EPX_API const char *epx_last_error_message(void)
{
    return epx_error_message();
}

EPX_API const char *epx_version(void)
{
#define EPX_STR2_(x) #x
#define EPX_STR_(x)  EPX_STR2_(x)
    return EPX_STR_(EPX_VERSION_MAJOR) "." EPX_STR_(EPX_VERSION_MINOR) "." EPX_STR_(EPX_VERSION_PATCH);
}

EPX_API int epx_version_code(void)
{
    return EPX_VERSION_CODE;
}

EPX_API size_t epx_dtype_size(epx_dtype_t dtype)
{
    return epx_dtype_bytes(dtype);
}

EPX_API const char *epx_dtype_name(epx_dtype_t dtype)
{
    return epx_dtype_str(dtype);
}
