/*
 * The backend registry: one row per backend with its name, its function table (NULL when this
 * build lacks it) and how to tell whether this machine can run it.
 */
#include "core/internal.h"

typedef struct backend_entry {
    epx_backend_t id;
    const char *name;             /* as topologies and messages name it */
    const char *platform;         /* what it needs, in messages ("CUDA") */
    const epx_backend_ops_t *ops; /* NULL: not in this build */
    int (*device_count)(void);    /* usable devices; NULL: always usable */
} backend_entry_t;

/* In order of preference for EPX_BACKEND_AUTO. */
static const backend_entry_t backends_g[] = {
#ifdef EPX_HAVE_CUDA
    {EPX_BACKEND_CUDA, "cuda", "CUDA", &epx_cuda_backend_ops, epx_cuda_device_count},
#else
    {EPX_BACKEND_CUDA, "cuda", "CUDA", NULL, NULL},
#endif
    {EPX_BACKEND_HOST, "host", "CPU", &epx_host_backend_ops, NULL},
};

#define NUM_BACKENDS (sizeof(backends_g) / sizeof(backends_g[0]))

static const backend_entry_t *find_backend(int id)
{
    for (size_t i = 0; i < NUM_BACKENDS; i++)
        if ((int)backends_g[i].id == id) return &backends_g[i];
    return NULL;
}

static int usable(const backend_entry_t *b)
{
    return b->ops && (!b->device_count || b->device_count() > 0);
}

const char *epx_backend_name(int backend)
{
    if (backend == EPX_BACKEND_AUTO) return "auto";
    const backend_entry_t *b = find_backend(backend);
    return b ? b->name : "unknown";
}

epx_result_t epx_backend_choose(epx_backend_t requested, epx_backend_t *chosen_out,
                                const epx_backend_ops_t **ops_out)
{
    const backend_entry_t *b = NULL;
    if (requested == EPX_BACKEND_AUTO) {
        for (size_t i = 0; i < NUM_BACKENDS && !b; i++)
            if (usable(&backends_g[i])) b = &backends_g[i];
        if (!b) return epx_error(EPX_ERR_INTERNAL, "no backend of this build is usable");
    } else {
        b = find_backend(requested);
        if (!b) return epx_error(EPX_ERR_INVALID_ARG, "backend %d is not an epx_backend_t", (int)requested);
        if (!b->ops)
            return epx_error(EPX_ERR_UNSUPPORTED, "backend %s was requested but this build has no %s support",
                             b->name, b->platform);
        if (!usable(b))
            return epx_error(EPX_ERR_UNSUPPORTED, "backend %s was requested but no %s device is usable",
                             b->name, b->platform);
    }
    *chosen_out = b->id;
    *ops_out = b->ops;
    return EPX_SUCCESS;
}
