/*
 * cuda backend: device selection and the function table. Operations that have no GPU
 * implementation yet answer EPX_ERR_UNSUPPORTED naming themselves.
 */
#include <cuda_runtime.h>

#include "core/internal.h"

int epx_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

static epx_result_t unsupported(const char *what)
{
    return epx_error(EPX_ERR_UNSUPPORTED, "the cuda backend does not implement %s yet", what);
}

static epx_result_t cuda_buffer_create(epx_buffer_t buffer) { return unsupported("buffers"); }
static void cuda_buffer_destroy(epx_buffer_t buffer) {}
static void cuda_handle_free(epx_handle_t handle) {}
static void cuda_fail_collective(epx_buffer_t buffer, uint64_t seq, epx_result_t res) {}

const epx_backend_ops_t epx_cuda_backend_ops = {
    .name = "cuda",
    .buffer_create = cuda_buffer_create,
    .buffer_destroy = cuda_buffer_destroy,
    .handle_free = cuda_handle_free,
    .fail_collective = cuda_fail_collective,
};
