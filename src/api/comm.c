/*
 * The communicator's entry points: the unique id, init over the TCP rendezvous or the caller's
 * callbacks, destroy, topology and the async error. Arguments and the config are checked here;
 * core/comm.c builds, frees and reads the communicator.
 */
#include <stdio.h>
#include <string.h>

#include "api/api.h"
#include "core/bootstrap.h"

/* Copies min(config->size, sizeof) bytes over the defaults and checks the result. */
static epx_result_t read_config(const epx_comm_config_t *config, epx_comm_config_t *out)
{
    epx_comm_config_t defaults = EPX_COMM_CONFIG_INIT;
    *out = defaults;
    if (!config) return EPX_SUCCESS;
    size_t head = offsetof(epx_comm_config_t, version) + sizeof(config->version);
    if (config->size < head)
        return epx_error(EPX_ERR_INVALID_ARG,
                         "config->size = %zu is smaller than the config header (%zu); "
                         "initialize it with EPX_COMM_CONFIG_INIT",
                         config->size, head);
    if (config->version == 0 || config->version / 10000 != EPX_VERSION_MAJOR)
        return epx_error(EPX_ERR_INVALID_ARG, "config->version = %u is not of major version %d",
                         (unsigned)config->version, EPX_VERSION_MAJOR);
    size_t n = config->size < sizeof(*out) ? config->size : sizeof(*out);
    memcpy(out, config, n);
    out->size = sizeof(*out);
    if (out->backend != EPX_BACKEND_AUTO && out->backend != EPX_BACKEND_HOST &&
        out->backend != EPX_BACKEND_CUDA)
        return epx_error(EPX_ERR_INVALID_ARG, "config->backend = %d is not an epx_backend_t",
                         (int)out->backend);
    if (out->cuda_device < -1)
        return epx_error(EPX_ERR_INVALID_ARG, "config->cuda_device = %d (use -1 for the current device)",
                         out->cuda_device);
    if (out->timeout_ms < 0)
        return epx_error(EPX_ERR_INVALID_ARG, "config->timeout_ms = %d is negative", out->timeout_ms);
    if (out->node_id && strnlen(out->node_id, EPX_NODE_ID_MAX) >= EPX_NODE_ID_MAX)
        return epx_error(EPX_ERR_INVALID_ARG, "config->node_id is longer than %d bytes", EPX_NODE_ID_MAX - 1);
    return EPX_SUCCESS;
}

/* The checks both inits share, before anything is created. */
static epx_result_t comm_init(int rank, int nranks, const epx_unique_id_t *id,
                              const epx_bootstrap_callbacks_t *callbacks, const epx_comm_config_t *config,
                              epx_comm_t *comm_out)
{
    if (!comm_out) return epx_error(EPX_ERR_INVALID_ARG, "comm_out is NULL");
    if (nranks < 1) return epx_error(EPX_ERR_INVALID_ARG, "nranks = %d must be at least 1", nranks);
    if (rank < 0 || rank >= nranks)
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d is out of range [0, %d)", rank, nranks);
    epx_comm_config_t cfg;
    EPX_CHECK(read_config(config, &cfg));
    epx_comm_t comm;
    EPX_CHECK(epx_comm_create(rank, nranks, id, callbacks, &cfg, &comm));
    /* Past the rendezvous a failure here is local (out of memory for one table entry). */
    epx_result_t res = epx_api_register(comm, EPX_API_COMM);
    if (res != EPX_SUCCESS) {
        epx_comm_free(comm);
        return res;
    }
    *comm_out = comm;
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_get_unique_id(epx_unique_id_t *id_out)
{
    epx_error_clear();
    if (!id_out) return epx_error(EPX_ERR_INVALID_ARG, "id_out is NULL");
    return epx_bootstrap_unique_id(id_out);
}

EPX_API epx_result_t epx_comm_init(const epx_unique_id_t *id, int rank, int nranks,
                                   const epx_comm_config_t *config, epx_comm_t *comm_out)
{
    epx_error_clear();
    if (!id) return epx_error(EPX_ERR_INVALID_ARG, "id is NULL");
    return comm_init(rank, nranks, id, NULL, config, comm_out);
}

EPX_API epx_result_t epx_comm_init_callbacks(const epx_bootstrap_callbacks_t *callbacks, int rank, int nranks,
                                             const epx_comm_config_t *config, epx_comm_t *comm_out)
{
    epx_error_clear();
    if (!callbacks) return epx_error(EPX_ERR_INVALID_ARG, "callbacks is NULL");
    if (!callbacks->allgather || !callbacks->barrier)
        return epx_error(EPX_ERR_INVALID_ARG, "callbacks->%s is NULL",
                         !callbacks->allgather ? "allgather" : "barrier");
    return comm_init(rank, nranks, NULL, callbacks, config, comm_out);
}

EPX_API epx_result_t epx_comm_destroy(epx_comm_t comm)
{
    epx_error_clear();
    if (!comm) return EPX_SUCCESS;
    EPX_CHECK(epx_api_enter_comm(comm, "epx_comm_destroy"));
    int live = atomic_load(&comm->live_buffers);
    if (live > 0) {
        epx_api_leave_comm(comm);
        return epx_error(EPX_ERR_INVALID_ARG,
                         "rank %d: the communicator still has %d live buffer(s); destroy "
                         "them first",
                         comm->rank, live);
    }
    epx_api_retire(comm);
    epx_comm_free(comm);
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_comm_get_topology(epx_comm_t comm, epx_topology_t *topo_out)
{
    /* Read under the registry's lock: any thread may ask. */
    EPX_CHECK(epx_api_find_comm(comm, "epx_comm_get_topology"));
    if (!topo_out) {
        epx_api_registry_unlock();
        return epx_error(EPX_ERR_INVALID_ARG, "topo_out is NULL");
    }
    epx_topology_t t;
    t.rank = comm->rank;
    t.nranks = comm->nranks;
    t.local_rank = comm->local_rank;
    t.local_nranks = comm->local_nranks;
    t.ranks_per_nvlink_domain = comm->ranks_per_domain;
    t.num_nvlink_domains = comm->num_domains;
    t.backend = comm->backend;
    t.cuda_device = comm->backend == EPX_BACKEND_CUDA ? comm->cuda_device : -1;
    epx_api_registry_unlock();
    *topo_out = t;
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_get_async_error(epx_comm_t comm)
{
    /* Any thread may ask, even while another is inside a call on the comm. */
    EPX_CHECK(epx_api_find_comm(comm, "epx_get_async_error"));
    epx_result_t res = epx_comm_get_async_error(comm);
    epx_api_registry_unlock();
    return res;
}

EPX_API epx_result_t epx_comm_get_node_topology(epx_comm_t comm, epx_node_topology_t *topo)
{
    const size_t head = offsetof(epx_node_topology_t, node) + sizeof(topo->node);
    EPX_CHECK(epx_api_find_comm(comm, "epx_comm_get_node_topology"));
    epx_result_t res = EPX_SUCCESS;
    if (!topo)
        res = epx_error(EPX_ERR_INVALID_ARG, "topo is NULL");
    else if (topo->size < head)
        res = epx_error(EPX_ERR_INVALID_ARG,
                        "topo->size = %zu is smaller than %zu; initialize it with EPX_NODE_TOPOLOGY_INIT",
                        topo->size, head);
    if (res != EPX_SUCCESS) {
        epx_api_registry_unlock();
        return res;
    }
    epx_node_topology_t t;
    memset(&t, 0, sizeof(t));
    t.node = comm->node;
    t.num_nodes = comm->num_nodes;
    t.ranks_per_node = comm->ranks_per_node;
    t.local_rank = comm->node_rank;
    t.ranks_per_nvlink_domain = comm->ranks_per_domain;
    t.num_nvlink_domains = comm->num_domains;
    snprintf(t.node_id, sizeof(t.node_id), "%s", comm->peers[comm->rank].node_id);
    epx_api_registry_unlock();
    /* The caller's size stays as it was: copy what follows it. */
    const size_t n = topo->size < sizeof(t) ? topo->size : sizeof(t);
    memcpy((char *)topo + sizeof(t.size), (const char *)&t + sizeof(t.size), n - sizeof(t.size));
    return EPX_SUCCESS;
}

EPX_API epx_result_t epx_comm_get_peer_path(epx_comm_t comm, int peer, epx_path_t *path_out)
{
    EPX_CHECK(epx_api_find_comm(comm, "epx_comm_get_peer_path"));
    epx_result_t res = EPX_SUCCESS;
    epx_path_t path = EPX_PATH_SELF;
    if (!path_out)
        res = epx_error(EPX_ERR_INVALID_ARG, "path_out is NULL");
    else if (peer < 0 || peer >= comm->nranks)
        res = epx_error(EPX_ERR_INVALID_ARG, "rank %d: peer %d is out of range [0, %d)", comm->rank, peer,
                        comm->nranks);
    else if (peer != comm->rank)
        path = peer / comm->ranks_per_node == comm->node ? EPX_PATH_IPC : EPX_PATH_NETWORK;
    epx_api_registry_unlock();
    if (res == EPX_SUCCESS) *path_out = path;
    return res;
}
