/*
 * The backend registry: which backends this build has, what they are called, and whether one can
 * run here. core/backend.c is the one place core names a backend's function table; backends
 * define the tables declared below and include nothing of each other.
 */
#ifndef EPX_CORE_BACKEND_H
#define EPX_CORE_BACKEND_H

#include "epx/epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The function table every backend fills (core/internal.h). */
typedef struct epx_backend_ops epx_backend_ops_t;

/* "auto", a backend's name ("host", "cuda"), or "unknown". */
const char *epx_backend_name(int backend);
/* Resolves `requested` to a backend this build has and this machine can run, with its table:
 * EPX_BACKEND_AUTO takes the first usable one in order of preference (cuda, then host).
 * EPX_ERR_UNSUPPORTED when the requested one is not built or has no usable device. */
epx_result_t epx_backend_choose(epx_backend_t requested, epx_backend_t *chosen_out,
                                const epx_backend_ops_t **ops_out);

extern const epx_backend_ops_t epx_host_backend_ops; /* src/host/backend.c */
#ifdef EPX_HAVE_CUDA
extern const epx_backend_ops_t epx_cuda_backend_ops; /* src/cuda/backend.c */
/* Number of usable CUDA devices (0 when the driver or device is missing). */
int epx_cuda_device_count(void);
#endif

#ifdef __cplusplus
}
#endif

#endif /* EPX_CORE_BACKEND_H */
