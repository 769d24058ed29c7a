/*
 * The public header's struct initializers, compiled as C99 and as C++11 with the warnings users turn
 * on (-Wall -Wextra -pedantic -Werror, missing-field-initializers included): each sets size (and
 * version), the documented defaults, and zero elsewhere. Needs only the header.
 */
#include <stdio.h>

#include <epx/epx.h>

static int failures;

#define CHECK(cond)                                                       \
    do {                                                                  \
        if (!(cond)) {                                                    \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                                   \
        }                                                                 \
    } while (0)

#define CHECK_PLAIN(type, macro)                                            \
    do {                                                                    \
        type v_ = macro;                                                    \
        CHECK(v_.size == sizeof(type) && v_.version == EPX_VERSION_CODE); \
    } while (0)

int main(void)
{
    CHECK_PLAIN(epx_buffer_config_t, EPX_BUFFER_CONFIG_INIT);
    CHECK_PLAIN(epx_layout_outputs_t, EPX_LAYOUT_OUTPUTS_INIT);
    CHECK_PLAIN(epx_ht_dispatch_args_t, EPX_HT_DISPATCH_ARGS_INIT);
    CHECK_PLAIN(epx_ht_dispatch_outputs_t, EPX_HT_DISPATCH_OUTPUTS_INIT);
    CHECK_PLAIN(epx_ht_combine_args_t, EPX_HT_COMBINE_ARGS_INIT);
    CHECK_PLAIN(epx_ht_combine_outputs_t, EPX_HT_COMBINE_OUTPUTS_INIT);
    CHECK_PLAIN(epx_ll_dispatch_args_t, EPX_LL_DISPATCH_ARGS_INIT);
    CHECK_PLAIN(epx_ll_dispatch_outputs_t, EPX_LL_DISPATCH_OUTPUTS_INIT);
    CHECK_PLAIN(epx_ll_combine_args_t, EPX_LL_COMBINE_ARGS_INIT);
    CHECK_PLAIN(epx_ll_combine_outputs_t, EPX_LL_COMBINE_OUTPUTS_INIT);
    CHECK_PLAIN(epx_rm_dispatch_outputs_t, EPX_RM_DISPATCH_OUTPUTS_INIT);
    CHECK_PLAIN(epx_rm_combine_args_t, EPX_RM_COMBINE_ARGS_INIT);
    CHECK_PLAIN(epx_rm_combine_outputs_t, EPX_RM_COMBINE_OUTPUTS_INIT);

    epx_comm_config_t comm = EPX_COMM_CONFIG_INIT;
    CHECK(comm.size == sizeof(comm) && comm.version == EPX_VERSION_CODE);
    CHECK(comm.backend == EPX_BACKEND_AUTO && comm.cuda_device == -1 && comm.timeout_ms == 0 && !comm.node_id);

    epx_rm_dispatch_args_t rm = EPX_RM_DISPATCH_ARGS_INIT;
    CHECK(rm.size == sizeof(rm) && rm.version == EPX_VERSION_CODE);
    CHECK(rm.pad_multiple == 1 && rm.num_dispatched_tokens == -1 && rm.num_permuted_tokens == -1);
    CHECK(!rm.hidden.data && !rm.routing_map.data && !rm.probs.data && !rm.stream);

    epx_buffer_config_t cfg = EPX_BUFFER_CONFIG_INIT;
    CHECK(cfg.max_tokens == 0 && cfg.hidden == 0 && cfg.modes == 0 && cfg.num_view_areas == 0);
    epx_ht_dispatch_args_t ht = EPX_HT_DISPATCH_ARGS_INIT;
    CHECK(!ht.x.data && !ht.cached_handle && ht.num_worst_tokens == 0 && ht.recv_in_buffer == 0);

    epx_node_topology_t topo = EPX_NODE_TOPOLOGY_INIT;
    CHECK(topo.size == sizeof(topo) && topo.num_nodes == 0 && topo.node_id[0] == 0);
    epx_build_info_t info = EPX_BUILD_INFO_INIT;
    CHECK(info.size == sizeof(info) && info.nccl == 0 && info.nccl_version[0] == 0);

    printf("%s: %d struct initializers %s\n",
#ifdef __cplusplus
           "C++",
#else
           "C",
#endif
           17, failures ? "FAILED" : "ok");
    return failures != 0;
}
