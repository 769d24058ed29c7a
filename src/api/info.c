/*
 * The library's self-description: result strings, the thread's last error, the version, what the
 * build holds and the dtype table, each read from core (core/error.c, core/network.c, core/dtype.c).
 */
#include <string.h>

#include "core/internal.h"
#include "core/network.h"

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

EPX_API epx_result_t epx_get_build_info(epx_build_info_t *info)
{
    const size_t head = offsetof(epx_build_info_t, cuda) + sizeof(info->cuda);
    epx_error_clear();
    if (!info) return epx_error(EPX_ERR_INVALID_ARG, "info is NULL");
    if (info->size < head)
        return epx_error(EPX_ERR_INVALID_ARG,
                         "info->size = %zu is smaller than %zu; initialize it with EPX_BUILD_INFO_INIT",
                         info->size, head);
    epx_build_info_t b;
    memset(&b, 0, sizeof(b));
#ifdef EPX_HAVE_CUDA
    b.cuda = 1;
#endif
    epx_net_build_info(&b);
    /* The caller's size stays as it was: copy what follows it. */
    const size_t n = info->size < sizeof(b) ? info->size : sizeof(b);
    memcpy((char *)info + sizeof(b.size), (const char *)&b + sizeof(b.size), n - sizeof(b.size));
    return EPX_SUCCESS;
}

EPX_API size_t epx_dtype_size(epx_dtype_t dtype)
{
    return epx_dtype_bytes(dtype);
}

EPX_API const char *epx_dtype_name(epx_dtype_t dtype)
{
    return epx_dtype_str(dtype);
}
