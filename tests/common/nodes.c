/*
 * Node splits of the multi-process suites: which splits to run (EPX_TEST_NODE_SPLITS), a session
 * whose ranks form the split's nodes (EPX_NODE_ID set in each rank before its init), and the loop
 * that runs a suite's cases under every split.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reference.h"

int ref_node_splits(ref_split_t *out)
{
    const char *env = getenv("EPX_TEST_NODE_SPLITS");
    const char *list = env ? env : "1x4,2x2,4x1,2x3,3x2";
    int n = 0;
    for (const char *p = list; *p;) {
        char *end;
        const long nodes = strtol(p, &end, 10);
        const long per = *end == 'x' ? strtol(end + 1, &end, 10) : 0;
        if (nodes < 1 || per < 1 || nodes * per > REF_MAX_RANKS || (*end && *end != ',') ||
            n == REF_MAX_SPLITS) {
            fprintf(stderr,
                    "EPX_TEST_NODE_SPLITS '%s': bad entry at '%s' (want NxP with N*P <= %d, at most %d)\n",
                    list, p, REF_MAX_RANKS, REF_MAX_SPLITS);
            return -1;
        }
        out[n++] = (ref_split_t){(int)nodes, (int)per};
        p = *end ? end + 1 : end;
    }
    return n;
}

int ref_session_open_nodes(const epx_unique_id_t *id, int rank, int nranks, int per_node,
                           const epx_buffer_config_t *cfg, ref_session_t *s)
{
    char node[32];
    snprintf(node, sizeof(node), "split-node%d", per_node > 0 ? rank / per_node : 0);
    if (epx_test_set_env("EPX_NODE_ID", per_node > 0 ? node : NULL)) {
        ref_fail(rank, "cannot set EPX_NODE_ID");
        return 2;
    }
    if (ref_session_open(id, rank, nranks, cfg, s)) return 2;
    epx_node_topology_t nt = EPX_NODE_TOPOLOGY_INIT;
    const int per = per_node > 0 ? per_node : nranks;
    const epx_result_t res = epx_comm_get_node_topology(s->comm, &nt);
    if (res == EPX_SUCCESS && nt.node == rank / per && nt.num_nodes == nranks / per &&
        nt.ranks_per_node == per)
        return 0;
    ref_fail(rank, "node topology: %s, node %d of %d, %d ranks per node; expected node %d of %d, %d per node",
             epx_result_name(res), nt.node, nt.num_nodes, nt.ranks_per_node, rank / per, nranks / per, per);
    ref_session_close(s);
    return 2;
}

int ref_run_split_cases(const char *name, const void *cases, size_t n, size_t size, size_t per_node_offset,
                        epx_test_rank_fn fn, int timeout_s, uint64_t seed)
{
    ref_split_t splits[REF_MAX_SPLITS];
    const int nsplits = ref_node_splits(splits);
    void *c = malloc(size);
    int failed = nsplits < 0 || !c;
    for (int i = 0; i < nsplits && c; i++) {
        const int R = splits[i].nodes * splits[i].per_node;
        printf("%s: %d node(s) of %d ranks\n", name, splits[i].nodes, splits[i].per_node);
        fflush(stdout);
        for (size_t k = 0; k < n; k++) {
            memcpy(c, (const char *)cases + k * size, size);
            int E;
            memcpy(&E, (const char *)c + sizeof(int), sizeof(E));
            if (E % R != 0) {
                printf("%s: split case %zu skipped: %d experts on %d ranks\n", name, k, E, R);
                continue;
            }
            memcpy(c, &R, sizeof(R));
            memcpy((char *)c + per_node_offset, &splits[i].per_node, sizeof(int));
            if (epx_test_run_ranks(R, fn, c, timeout_s)) {
                fprintf(stderr, "FAILED: %s split case %zu on %dx%d ranks (seed %llu)\n", name, k,
                        splits[i].nodes, splits[i].per_node, (unsigned long long)seed);
                failed = 1;
            }
        }
    }
    free(c);
    printf(failed ? "%s splits: FAILED\n" : "%s splits: ok\n", name);
    return failed;
}
