/*
 * The communicator: backend choice (through the registry), the exchange of peer information over
 * the bootstrap, topology (local ranks, nodes from the node ids, NVLink domain size), the
 * first-async-error record, and the news of a collective call a rank failed. The API layer
 * (src/api/comm.c) checks the arguments and the config first.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/bootstrap.h"
#include "core/internal.h"

epx_result_t epx_comm_check(epx_comm_t comm, const char *fn)
{
    if (!comm) return epx_error(EPX_ERR_INVALID_ARG, "%s: comm is NULL", fn);
    if (comm->magic != EPX_COMM_MAGIC)
        return epx_error(EPX_ERR_INVALID_ARG, "%s: comm %p is not a live communicator (magic 0x%08x)", fn,
                         (void *)comm, comm->magic);
    return EPX_SUCCESS;
}

/* FNV-1a over the hostname and the boot id, so containers sharing a name on different machines (or
 * one machine across reboots) do not look like one host. */
static uint64_t host_hash(const char *hostname)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (const char *c = hostname; *c; c++) h = (h ^ (unsigned char)*c) * 0x100000001b3ull;
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        char boot_id[64] = "";
        if (fgets(boot_id, sizeof(boot_id), f))
            for (const char *c = boot_id; *c && *c != '\n'; c++)
                h = (h ^ (unsigned char)*c) * 0x100000001b3ull;
        fclose(f);
    }
    return h;
}

static void fill_peer_info(epx_comm_t comm, const epx_comm_config_t *cfg, const epx_params_t *params,
                           epx_peer_info_t *me)
{
    memset(me, 0, sizeof(*me));
    me->rank = comm->rank;
    me->pid = (int32_t)getpid();
    me->pid_ns = epx_namespace_id("pid");
    if (gethostname(me->hostname, sizeof(me->hostname) - 1) != 0)
        snprintf(me->hostname, sizeof(me->hostname), "?");
    me->hostname[sizeof(me->hostname) - 1] = '\0';
    me->host_hash = host_hash(me->hostname);
    me->backend = (int32_t)comm->backend;
    /* The cuda backend resolves -1 to the current device in its comm_init. */
    me->cuda_device = comm->backend == EPX_BACKEND_CUDA ? cfg->cuda_device : -1;
    me->nranks = comm->nranks;
    /* EPX_NODE_ID first, so a launcher can split a job into emulated nodes without touching code. */
    if (params->node_id[0])
        snprintf(me->node_id, sizeof(me->node_id), "%s", params->node_id);
    else if (cfg->node_id && cfg->node_id[0])
        snprintf(me->node_id, sizeof(me->node_id), "%s", cfg->node_id);
    else
        snprintf(me->node_id, sizeof(me->node_id), "%.40s:%016llx", me->hostname,
                 (unsigned long long)me->host_hash);
}

/* Every rank holds the same peers array, so every rank reaches the same verdict here. */
static epx_result_t check_peers(epx_comm_t comm)
{
    const epx_peer_info_t *p = comm->peers;
    for (int r = 0; r < comm->nranks; r++) {
        if (p[r].rank != r)
            return epx_error(EPX_ERR_BOOTSTRAP,
                             "rank %d: the bootstrap allgather put rank %d's information in "
                             "slot %d",
                             comm->rank, p[r].rank, r);
        if (p[r].nranks != p[0].nranks)
            return epx_error(EPX_ERR_MISMATCH, "rank %d was told nranks = %d, rank 0 was told nranks = %d", r,
                             p[r].nranks, p[0].nranks);
        if (p[r].backend != p[0].backend)
            return epx_error(EPX_ERR_MISMATCH, "rank %d chose backend %s, rank 0 chose backend %s", r,
                             epx_backend_name(p[r].backend), epx_backend_name(p[0].backend));
        /* Strings from other processes are compared and printed: each must end inside its field. */
        if (!memchr(p[r].hostname, 0, sizeof(p[r].hostname)) || !memchr(p[r].node_id, 0, sizeof(p[r].node_id)))
            return epx_error(EPX_ERR_BOOTSTRAP,
                             "rank %d: rank %d's host name or node id is not a terminated string (a corrupt "
                             "bootstrap exchange)",
                             comm->rank, r);
    }
    return EPX_SUCCESS;
}

/* First rank of the node that starts at `first` ends (exclusive). */
static int node_end(const epx_peer_info_t *p, int nranks, int first)
{
    int r = first + 1;
    while (r < nranks && strcmp(p[r].node_id, p[first].node_id) == 0) r++;
    return r;
}

/* Nodes from the node ids: consecutive ranks, equal counts (the nvlink domains and the layout's
 * per-domain counts are blocks of consecutive ranks). Every rank holds the same table, so every
 * rank reaches the same verdict. */
static epx_result_t compute_nodes(epx_comm_t comm)
{
    const epx_peer_info_t *p = comm->peers;
    const int R = comm->nranks;
    const int per_node = node_end(p, R, 0);
    int num_nodes = 0;
    for (int first = 0; first < R; first = node_end(p, R, first), num_nodes++) {
        for (int q = 0; q < first; q++)
            if (strcmp(p[q].node_id, p[first].node_id) == 0)
                return epx_error(EPX_ERR_INVALID_ARG,
                                 "rank %d: node '%s' holds ranks %d and %d but not rank %d (node '%s'); the "
                                 "ranks of a node must be consecutive",
                                 comm->rank, p[first].node_id, q, first, first - 1, p[first - 1].node_id);
        const int end = node_end(p, R, first);
        if (end - first != per_node)
            return epx_error(EPX_ERR_INVALID_ARG,
                             "rank %d: node %d '%s' (ranks %d-%d) has %d ranks, node 0 '%s' (ranks 0-%d) has "
                             "%d; every node must hold as many ranks (nvlink domains are equal blocks of ranks)",
                             comm->rank, num_nodes, p[first].node_id, first, end - 1, end - first, p[0].node_id,
                             per_node - 1, per_node);
    }
    comm->ranks_per_node = per_node;
    comm->num_nodes = num_nodes;
    comm->node = comm->rank / per_node;
    comm->node_rank = comm->rank % per_node;
    return EPX_SUCCESS;
}

/* local_rank/local_nranks from the host hashes, the nodes from the node ids, then D (the node,
 * capped by the env) with its checks. */
static epx_result_t compute_topology(epx_comm_t comm, const epx_params_t *params)
{
    const epx_peer_info_t *p = comm->peers;
    const epx_peer_info_t *me = &p[comm->rank];
    comm->local_rank = 0;
    comm->local_nranks = 0;
    for (int r = 0; r < comm->nranks; r++)
        if (p[r].host_hash == me->host_hash) {
            if (r < comm->rank) comm->local_rank++;
            comm->local_nranks++;
        }
    if (comm->backend == EPX_BACKEND_HOST && comm->local_nranks != comm->nranks) {
        int other = 0;
        while (p[other].host_hash == me->host_hash) other++;
        return epx_error(EPX_ERR_UNSUPPORTED,
                         "the host backend needs every rank on one machine: rank %d is on "
                         "%s, rank %d on %s",
                         comm->rank, me->hostname, other, p[other].hostname);
    }
    EPX_CHECK(compute_nodes(comm));
    int32_t d = comm->ranks_per_node;
    int32_t cap = params->ranks_per_nvlink_domain;
    if (cap > 0 && cap < d) d = cap;
    if (comm->ranks_per_node % d != 0)
        return epx_error(EPX_ERR_INVALID_ARG,
                         "EPX_RANKS_PER_NVLINK_DOMAIN=%d gives %d ranks per nvlink domain, which does not "
                         "divide the %d ranks per node (nranks = %d, %d node(s))",
                         cap, d, comm->ranks_per_node, comm->nranks, comm->num_nodes);
    comm->ranks_per_domain = d;
    comm->num_domains = comm->nranks / d;
    return EPX_SUCCESS;
}

/* The env cap may differ between ranks, and a rank that rejects it must not leave the others waiting:
 * every rank shares its D (or its failure) and all reach the same verdict. */
static epx_result_t agree_on_domain(epx_comm_t comm, epx_result_t local)
{
    int32_t mine = local == EPX_SUCCESS ? comm->ranks_per_domain : -(int32_t)local;
    int32_t *all = calloc((size_t)comm->nranks, sizeof(*all));
    if (!all) return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: %d domain sizes", comm->rank, comm->nranks);
    char message[1024];
    epx_error_copy(message, sizeof(message));
    epx_result_t res = comm->bootstrap->allgather(comm->bootstrap_state, &mine, all, sizeof(mine));
    if (res == EPX_SUCCESS && local != EPX_SUCCESS) {
        epx_error_set_message(message);
        res = local;
    }
    for (int r = 0; r < comm->nranks && res == EPX_SUCCESS; r++) {
        if (all[r] < 0)
            res = epx_error(EPX_ERR_REMOTE, "rank %d: rank %d failed its topology checks (%s)", comm->rank, r,
                            epx_result_str((epx_result_t)(-(int64_t)all[r])));
        else if (all[r] != all[0])
            res = epx_error(EPX_ERR_MISMATCH,
                            "rank %d has %d ranks per nvlink domain, rank 0 has %d (is "
                            "EPX_RANKS_PER_NVLINK_DOMAIN the same everywhere?)",
                            r, all[r], all[0]);
    }
    free(all);
    return res;
}

epx_result_t epx_comm_create(int rank, int nranks, const epx_unique_id_t *id,
                             const epx_bootstrap_callbacks_t *callbacks, const epx_comm_config_t *config,
                             epx_comm_t *comm_out)
{
    const epx_params_t *params;
    EPX_CHECK(epx_params_get(&params));
    if (params->print_env) {
        static atomic_flag printed = ATOMIC_FLAG_INIT;
        if (!atomic_flag_test_and_set(&printed)) epx_params_print(stderr);
    }
    epx_backend_t backend = EPX_BACKEND_HOST;
    const epx_backend_ops_t *ops = NULL;
    EPX_CHECK(epx_backend_choose(config->backend, &backend, &ops));

    epx_result_t res = EPX_SUCCESS;
    epx_comm_t comm = calloc(1, sizeof(*comm));
    if (!comm) return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: communicator", rank);
    comm->rank = rank;
    comm->nranks = nranks;
    comm->backend = backend;
    comm->cuda_device = -1;
    comm->timeout_ms = config->timeout_ms > 0 ? config->timeout_ms : params->timeout_ms;
    comm->ops = ops;
    atomic_init(&comm->live_buffers, 0);
    atomic_init(&comm->busy, 0);
    atomic_init(&comm->async_result, EPX_SUCCESS);
    comm->peers = calloc((size_t)nranks, sizeof(*comm->peers));
    comm->agree_words = calloc((size_t)nranks, sizeof(*comm->agree_words));
    if (!comm->peers || !comm->agree_words) {
        res = epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: peer table for %d ranks", rank, nranks);
        goto err_free_peers;
    }
    if (callbacks)
        EPX_CHECK_GOTO(
            epx_bootstrap_callbacks_create(callbacks, rank, nranks, &comm->bootstrap, &comm->bootstrap_state),
            res, err_free_peers);
    else
        EPX_CHECK_GOTO(epx_bootstrap_tcp_create(id, rank, nranks, comm->timeout_ms, &comm->bootstrap,
                                                &comm->bootstrap_state),
                       res, err_free_peers);

    epx_peer_info_t me;
    fill_peer_info(comm, config, params, &me);
    EPX_CHECK_GOTO(comm->bootstrap->allgather(comm->bootstrap_state, &me, comm->peers, sizeof(me)), res,
                   err_close_bootstrap);
    EPX_CHECK_GOTO(check_peers(comm), res, err_close_bootstrap);
    EPX_CHECK_GOTO(agree_on_domain(comm, compute_topology(comm, params)), res, err_close_bootstrap);
    comm->magic = EPX_COMM_MAGIC;
    if (comm->ops->comm_init) EPX_CHECK_GOTO(comm->ops->comm_init(comm), res, err_clear_magic);
    epx_log_rank_g = rank;
    EPX_INFO(EPX_SUBSYS_INIT,
             "rank %d of %d: backend %s, local rank %d of %d, node %d '%s' of %d (%d ranks per node), "
             "%d ranks per nvlink domain, timeout %lld ms",
             rank, nranks, epx_backend_name(backend), comm->local_rank, comm->local_nranks, comm->node,
             comm->peers[rank].node_id, comm->num_nodes, comm->ranks_per_node, comm->ranks_per_domain,
             (long long)comm->timeout_ms);
    *comm_out = comm;
    return EPX_SUCCESS;

err_clear_magic:
    comm->magic = 0;
err_close_bootstrap:
    comm->bootstrap->close(comm->bootstrap_state);
err_free_peers:
    free(comm->peers);
    free(comm->agree_words);
    free(comm);
    return res;
}

void epx_comm_free(epx_comm_t comm)
{
    if (comm->ops && comm->ops->comm_destroy) comm->ops->comm_destroy(comm);
    comm->bootstrap->close(comm->bootstrap_state);
    comm->magic = 0;
    free(comm->peers);
    free(comm->agree_words);
    free(comm);
}

/* Writers serialize here; the message is complete before the result is published, so readers need
 * no lock. */
static pthread_mutex_t async_lock_g = PTHREAD_MUTEX_INITIALIZER;

epx_result_t epx_comm_get_async_error(epx_comm_t comm)
{
    if (comm->ops && comm->ops->poll_async) comm->ops->poll_async(comm);
    epx_result_t res = (epx_result_t)atomic_load_explicit(&comm->async_result, memory_order_acquire);
    if (res != EPX_SUCCESS) epx_error_set_message(comm->async_message);
    return res;
}

epx_result_t epx_comm_set_async_error(epx_comm_t comm, epx_result_t res, const char *message)
{
    if (!comm || res == EPX_SUCCESS) return res;
    pthread_mutex_lock(&async_lock_g);
    if (atomic_load_explicit(&comm->async_result, memory_order_relaxed) == EPX_SUCCESS) {
        if (message)
            snprintf(comm->async_message, sizeof(comm->async_message), "%s", message);
        else
            epx_error_copy(comm->async_message, sizeof(comm->async_message));
        atomic_store_explicit(&comm->async_result, (int)res, memory_order_release);
    }
    pthread_mutex_unlock(&async_lock_g);
    return res;
}

epx_result_t epx_comm_allgather(epx_comm_t comm, const void *send, void *recv, size_t bytes)
{
    EPX_CHECK(epx_comm_check(comm, "epx_comm_allgather"));
    if ((!send || !recv) && bytes)
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d: allgather of %zu bytes with a NULL buffer",
                         comm->rank, bytes);
    return comm->bootstrap->allgather(comm->bootstrap_state, send, recv, bytes);
}

epx_result_t epx_comm_barrier(epx_comm_t comm)
{
    EPX_CHECK(epx_comm_check(comm, "epx_comm_barrier"));
    return comm->bootstrap->barrier(comm->bootstrap_state);
}

epx_result_t epx_buffer_fail_collective(epx_buffer_t buffer, uint64_t seq, epx_result_t res, void *stream)
{
    char message[1024];
    epx_error_copy(message, sizeof(message));
    if (buffer->ops->fail_collective) buffer->ops->fail_collective(buffer, seq, res, stream);
    epx_error_set_message(message);
    return res;
}

const char *epx_call_name(int kind)
{
    static const char *const names[EPX_CALL_KIND_COUNT] = {
        "no call",        "epx_ht_dispatch", "epx_ht_combine", "epx_ll_dispatch",
        "epx_ll_combine", "epx_rm_dispatch", "epx_rm_combine"};
    return kind >= 0 && kind < EPX_CALL_KIND_COUNT ? names[kind] : "an unknown call";
}
