/*
 * Nodes from node ids on the host backend: EPX_NODE_ID splits 1x4, 2x2, 4x1, 2x3 and 3x2 (set in
 * each rank before its init), every rank's node, local rank and counts and every peer path; the
 * precedence EPX_NODE_ID > config node_id > the host's identity; shapes the library refuses; an
 * HT dispatch under a 2x2 split giving the same bits as on one node (and the same combined weights);
 * and the combine's node tree (docs/reference.md, Sums) on values checked by hand.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"
#include "epx_test.h"

#define RUN_TIMEOUT_S 60

/* How each rank picks its node id: EPX_NODE_ID "<env_prefix><rank / env_per>" when env_per > 0,
 * else unset; the config's node_id "<cfg_prefix><rank / cfg_per>" when cfg_per > 0, else NULL. */
typedef struct split {
    int R;
    int env_per, cfg_per;
    const char *env_prefix, *cfg_prefix;
    int expect_per;         /* ranks per node the library must report (0: the case must fail) */
    const char *expect_msg; /* failing case: the message holds this */
    const char *cap;        /* EPX_RANKS_PER_NVLINK_DOMAIN or NULL */
    int expect_d;           /* ranks per nvlink domain (0: expect_per) */
} split_t;

static int set_node_env(const split_t *s, int rank)
{
    char id[EPX_NODE_ID_MAX];
    snprintf(id, sizeof(id), "%s%d", s->env_prefix ? s->env_prefix : "node", s->env_per ? rank / s->env_per : 0);
    if (epx_test_set_env("EPX_RANKS_PER_NVLINK_DOMAIN", s->cap)) return 1;
    return epx_test_set_env("EPX_NODE_ID", s->env_per > 0 ? id : NULL);
}

static int split_rank(int rank, int R, const epx_unique_id_t *id, void *ctx)
{
    const split_t *s = ctx;
    if (set_node_env(s, rank)) return 1;
    char cfg_id[EPX_NODE_ID_MAX];
    snprintf(cfg_id, sizeof(cfg_id), "%s%d", s->cfg_prefix ? s->cfg_prefix : "cfg", s->cfg_per ? rank / s->cfg_per : 0);
    epx_comm_config_t cc = EPX_COMM_CONFIG_INIT;
    cc.backend = EPX_BACKEND_HOST;
    cc.timeout_ms = 20000;
    cc.node_id = s->cfg_per > 0 ? cfg_id : NULL;
    epx_comm_t comm = NULL;
    if (!s->expect_per) {
        EXPECT_RES(epx_comm_init(id, rank, R, &cc, &comm), EPX_ERR_INVALID_ARG);
        EXPECT_MSG_HAS(s->expect_msg);
        return 0;
    }
    EXPECT_OK(epx_comm_init(id, rank, R, &cc, &comm));
    const int per = s->expect_per, d = s->expect_d ? s->expect_d : per;
    epx_node_topology_t nt = EPX_NODE_TOPOLOGY_INIT;
    EXPECT_OK(epx_comm_get_node_topology(comm, &nt));
    EXPECT_EQ_INT(nt.size, sizeof(nt));
    EXPECT_EQ_INT(nt.node, rank / per);
    EXPECT_EQ_INT(nt.num_nodes, R / per);
    EXPECT_EQ_INT(nt.ranks_per_node, per);
    EXPECT_EQ_INT(nt.local_rank, rank % per);
    EXPECT_EQ_INT(nt.ranks_per_nvlink_domain, d);
    EXPECT_EQ_INT(nt.num_nvlink_domains, R / d);
    char expect_id[EPX_NODE_ID_MAX] = "";
    if (s->env_per > 0)
        snprintf(expect_id, sizeof(expect_id), "%s%d", s->env_prefix ? s->env_prefix : "node", rank / s->env_per);
    else if (s->cfg_per > 0)
        snprintf(expect_id, sizeof(expect_id), "%s", cfg_id);
    else
        gethostname(expect_id, 40); /* the default id starts with the hostname */
    if (strncmp(nt.node_id, expect_id, strlen(expect_id)) != 0 || !expect_id[0]) {
        fprintf(stderr, "rank %d: node id '%s', expected '%s'\n", rank, nt.node_id, expect_id);
        return 1;
    }
    /* The old struct keeps its meaning: one machine, D as above. */
    epx_topology_t t;
    EXPECT_OK(epx_comm_get_topology(comm, &t));
    EXPECT_EQ_INT(t.local_nranks, R);
    EXPECT_EQ_INT(t.local_rank, rank);
    EXPECT_EQ_INT(t.ranks_per_nvlink_domain, d);
    EXPECT_EQ_INT(t.num_nvlink_domains, R / d);
    for (int p = 0; p < R; p++) {
        epx_path_t path = (epx_path_t)-1;
        EXPECT_OK(epx_comm_get_peer_path(comm, p, &path));
        EXPECT_EQ_INT(path, p == rank ? EPX_PATH_SELF : p / per == rank / per ? EPX_PATH_IPC : EPX_PATH_NETWORK);
    }
    /* Bad input: refused, output untouched. */
    epx_path_t untouched = (epx_path_t)7;
    EXPECT_RES(epx_comm_get_peer_path(comm, R, &untouched), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("out of range");
    EXPECT_RES(epx_comm_get_peer_path(comm, -1, &untouched), EPX_ERR_INVALID_ARG);
    EXPECT_EQ_INT(untouched, 7);
    EXPECT_RES(epx_comm_get_peer_path(comm, 0, NULL), EPX_ERR_INVALID_ARG);
    EXPECT_RES(epx_comm_get_node_topology(comm, NULL), EPX_ERR_INVALID_ARG);
    epx_node_topology_t small = {offsetof(epx_node_topology_t, node)};
    small.node = 99;
    EXPECT_RES(epx_comm_get_node_topology(comm, &small), EPX_ERR_INVALID_ARG);
    EXPECT_EQ_INT(small.node, 99);
    /* A caller compiled against a struct ending at num_nodes gets exactly that much. */
    epx_node_topology_t older;
    memset(&older, 0x5a, sizeof(older));
    older.size = offsetof(epx_node_topology_t, ranks_per_node);
    EXPECT_OK(epx_comm_get_node_topology(comm, &older));
    EXPECT_EQ_INT(older.num_nodes, R / per);
    EXPECT_EQ_INT(older.ranks_per_node, 0x5a5a5a5a);
    EXPECT_OK(epx_comm_destroy(comm));
    return 0;
}

static int run_splits(void)
{
    static const split_t splits[] = {
        /* EPX_NODE_ID splits; the last two also carry a config id that EPX_NODE_ID overrides. */
        {4, 4, 0, "n", NULL, 4, NULL, NULL, 0},
        {4, 2, 0, "n", NULL, 2, NULL, NULL, 0},
        {4, 1, 0, "n", NULL, 1, NULL, NULL, 0},
        {6, 3, 0, "n", NULL, 3, NULL, NULL, 0},
        {6, 2, 0, "n", NULL, 2, NULL, NULL, 0},
        {4, 1, 2, "env", "cfg", 1, NULL, NULL, 0},
        {6, 3, 1, "env", "cfg", 3, NULL, NULL, 0},
        /* The config's id alone; and nothing (one node, the host's identity). */
        {4, 0, 2, NULL, "cfg", 2, NULL, NULL, 0},
        {6, 0, 3, NULL, "cfg", 3, NULL, NULL, 0},
        {4, 0, 0, NULL, NULL, 4, NULL, NULL, 0},
        /* The cap cuts a node into domains; it must divide the ranks per node. */
        {8, 4, 0, "n", NULL, 4, NULL, "2", 2},
        {6, 3, 0, "n", NULL, 0, "does not divide the 3 ranks per node", "2", 0},
    };
    for (size_t i = 0; i < sizeof(splits) / sizeof(splits[0]); i++) {
        const split_t *s = &splits[i];
        printf("topology: %d ranks, EPX_NODE_ID per %d, config per %d, cap %s\n", s->R, s->env_per, s->cfg_per,
               s->cap ? s->cap : "none");
        fflush(stdout);
        if (epx_test_run_ranks(s->R, split_rank, (void *)s, RUN_TIMEOUT_S)) return 1;
    }
    return 0;
}

/* Shapes the library refuses, named in the message: "a a b" (2 + 1) and "a b a b". */
typedef struct bad_shape {
    int R;
    const char *ids[4];
    const char *expect_msg;
} bad_shape_t;

static int bad_shape_rank(int rank, int R, const epx_unique_id_t *id, void *ctx)
{
    const bad_shape_t *b = ctx;
    if (epx_test_set_env("EPX_RANKS_PER_NVLINK_DOMAIN", NULL) || epx_test_set_env("EPX_NODE_ID", b->ids[rank]))
        return 1;
    epx_comm_t comm = (epx_comm_t)0x1;
    EXPECT_RES(epx_test_host_comm(id, rank, R, 20000, &comm), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS(b->expect_msg);
    EXPECT_TRUE(comm == (epx_comm_t)0x1);
    return 0;
}

static int run_bad_shapes(void)
{
    static const bad_shape_t shapes[] = {
        {3, {"a", "a", "b"}, "node 1 'b' (ranks 2-2) has 1 ranks, node 0 'a' (ranks 0-1) has 2"},
        {4, {"a", "b", "a", "b"}, "node 'a' holds ranks 0 and 2 but not rank 1 (node 'b')"},
    };
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
        if (epx_test_run_ranks(shapes[i].R, bad_shape_rank, (void *)&shapes[i], RUN_TIMEOUT_S)) return 1;
    return 0;
}

/* Config checks that need no peer: a node id too long; a config whose size ends before node_id
 * (an older caller) has its node_id ignored, however it reads. */
static int local_config_rank(int rank, int R, const epx_unique_id_t *id, void *ctx)
{
    (void)ctx;
    if (epx_test_set_env("EPX_NODE_ID", NULL)) return 1;
    char too_long[EPX_NODE_ID_MAX + 1];
    memset(too_long, 'x', sizeof(too_long) - 1);
    too_long[sizeof(too_long) - 1] = '\0';
    epx_comm_config_t cc = EPX_COMM_CONFIG_INIT;
    cc.backend = EPX_BACKEND_HOST;
    cc.node_id = too_long;
    epx_comm_t comm = NULL;
    EXPECT_RES(epx_comm_init(id, rank, R, &cc, &comm), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("config->node_id");
    cc.size = offsetof(epx_comm_config_t, node_id);
    cc.node_id = (const char *)(uintptr_t)1; /* never read */
    EXPECT_OK(epx_comm_init(id, rank, R, &cc, &comm));
    epx_node_topology_t nt = EPX_NODE_TOPOLOGY_INIT;
    EXPECT_OK(epx_comm_get_node_topology(comm, &nt));
    EXPECT_EQ_INT(nt.num_nodes, 1);
    EXPECT_OK(epx_comm_destroy(comm));
    return 0;
}

/* ---------------------------------------------------------- HT under a 2x2 split ---- */

#define HT_TM   32
#define HT_H    128
#define HT_K    2
#define HT_L    2
#define HT_R    4

typedef struct ht_ctx {
    uint64_t seed;
    int per_node; /* 0: EPX_NODE_ID unset (one node) */
} ht_ctx_t;

typedef struct ht_result {
    uint64_t dispatch_hash, weights_hash;
    int64_t recv;
} ht_result_t;

/* Every rank draws every rank's routing from the seed: tokens to distinct experts or nowhere. */
static void ht_routing(uint64_t seed, int src, int64_t topk[HT_TM][HT_K])
{
    uint64_t st = seed * 1000003ull + (uint64_t)src;
    for (int t = 0; t < HT_TM; t++)
        for (int k = 0; k < HT_K; k++) {
            int64_t e;
            do {
                e = (int64_t)(epx_test_rand(&st) % (HT_R * HT_L + 2)) - 2; /* -2, -1: no expert */
                if (e < 0) e = -1;
            } while (k > 0 && e >= 0 && e == topk[t][0]);
            topk[t][k] = e;
        }
}

static int64_t ht_rows_on(uint64_t seed, int me)
{
    int64_t n = 0, topk[HT_TM][HT_K];
    for (int s = 0; s < HT_R; s++) {
        ht_routing(seed, s, topk);
        for (int t = 0; t < HT_TM; t++) {
            int hit = 0;
            for (int k = 0; k < HT_K; k++) hit |= topk[t][k] >= 0 && topk[t][k] / HT_L == me;
            n += hit;
        }
    }
    return n;
}

static int ht_rank(int rank, int R, const epx_unique_id_t *id, void *vctx, void *vresult)
{
    const ht_ctx_t *c = vctx;
    ht_result_t *out = vresult;
    char node[16];
    snprintf(node, sizeof(node), "ht%d", c->per_node ? rank / c->per_node : 0);
    if (epx_test_set_env("EPX_RANKS_PER_NVLINK_DOMAIN", NULL) ||
        epx_test_set_env("EPX_NODE_ID", c->per_node ? node : NULL))
        return 1;
    epx_comm_t comm;
    EXPECT_OK(epx_test_host_comm(id, rank, R, 20000, &comm));
    epx_node_topology_t nt = EPX_NODE_TOPOLOGY_INIT;
    EXPECT_OK(epx_comm_get_node_topology(comm, &nt));
    EXPECT_EQ_INT(nt.num_nodes, c->per_node ? R / c->per_node : 1);
    epx_buffer_config_t bc = epx_test_buffer_config(HT_TM, HT_H, HT_K, R * HT_L, EPX_MODE_HT);
    epx_buffer_t buf;
    EXPECT_OK(epx_buffer_create(comm, &bc, &buf));

    const int64_t N = ht_rows_on(c->seed, rank);
    int64_t topk[HT_TM][HT_K];
    ht_routing(c->seed, rank, topk);
    uint16_t x[HT_TM * HT_H], combined[HT_TM * HT_H];
    float w[HT_TM * HT_K], combined_w[HT_TM * HT_K];
    uint64_t st = c->seed ^ (0x51ull * (uint64_t)(rank + 1));
    for (int i = 0; i < HT_TM * HT_H; i++)
        x[i] = epx_f32_to_bf16((float)((int)(epx_test_rand(&st) % 2001) - 1000) / 256.0f);
    for (int i = 0; i < HT_TM * HT_K; i++) w[i] = (float)(epx_test_rand(&st) % 1000) / 997.0f;
    uint16_t *recv_x = calloc((size_t)N + 1, HT_H * 2);
    int64_t *recv_idx = calloc((size_t)N + 1, HT_K * 8);
    float *recv_w = calloc((size_t)N + 1, HT_K * 4);
    int32_t per_expert[HT_L], num_recv = -1;
    if (!recv_x || !recv_idx || !recv_w) return 1;

    epx_ht_dispatch_args_t da = epx_test_ht_dispatch_args(x, topk, w, HT_TM, HT_H, HT_K);
    epx_ht_dispatch_outputs_t dout = epx_test_ht_dispatch_outputs(recv_x, recv_idx, recv_w, N, HT_H, HT_K);
    dout.num_recv_tokens_per_expert = epx_tensor_1d(per_expert, EPX_DTYPE_INT32, HT_L);
    dout.num_recv_tokens = epx_tensor_1d(&num_recv, EPX_DTYPE_INT32, 1);
    EXPECT_OK(epx_ht_dispatch(buf, &da, &dout));
    EXPECT_EQ_INT(num_recv, N);
    uint64_t h = epx_test_fnv(recv_x, (size_t)N * HT_H * 2, EPX_TEST_FNV_INIT);
    h = epx_test_fnv(recv_idx, (size_t)N * HT_K * 8, h);
    h = epx_test_fnv(recv_w, (size_t)N * HT_K * 4, h);
    out->dispatch_hash = epx_test_fnv(per_expert, sizeof(per_expert), h);

    /* Expert outputs: the received rows, each scaled by its rank, so the sum mixes sources. */
    for (int64_t i = 0; i < N * HT_H; i++)
        recv_x[i] = epx_f32_to_bf16(epx_bf16_to_f32(recv_x[i]) * (1.0f + 0.125f * (float)rank));
    epx_ht_combine_args_t ca = epx_test_ht_combine_args(dout.handle, recv_x, recv_w, N, HT_H, HT_K);
    epx_ht_combine_outputs_t co = epx_test_ht_combine_outputs(combined, combined_w, HT_TM, HT_H, HT_K);
    EXPECT_OK(epx_ht_combine(buf, &ca, &co));
    /* combined_x follows the node tree (checked by hand below); the weights are the same on any split. */
    out->weights_hash = epx_test_fnv(combined_w, sizeof(combined_w), EPX_TEST_FNV_INIT);
    out->recv = N;
    EXPECT_OK(epx_handle_destroy(dout.handle));
    EXPECT_OK(epx_buffer_destroy(buf));
    EXPECT_OK(epx_comm_destroy(comm));
    free(recv_x);
    free(recv_idx);
    free(recv_w);
    return 0;
}

static int run_ht(uint64_t seed, int per_node, ht_result_t *results)
{
    ht_ctx_t c = {seed, per_node};
    epx_harness_opts_t opts = {"topology ht", HT_R, ht_rank, &c, sizeof(ht_result_t), RUN_TIMEOUT_S, NULL};
    epx_harness_report_t rep;
    int rc = epx_harness_run(&opts, &rep);
    if (rc == 0)
        for (int r = 0; r < HT_R; r++) results[r] = *(const ht_result_t *)epx_harness_result(&rep, r);
    if (rc >= 0) epx_harness_report_free(&rep);
    return rc != 0;
}

static int run_ht_same_bits(uint64_t seed)
{
    ht_result_t one[HT_R], split[HT_R];
    if (run_ht(seed, 0, one) || run_ht(seed, 2, split)) return 1;
    int64_t total = 0;
    for (int r = 0; r < HT_R; r++) {
        total += one[r].recv;
        if (memcmp(&one[r], &split[r], sizeof(one[r])) != 0) {
            fprintf(stderr,
                    "topology ht: rank %d: one node gave dispatch %016llx weights %016llx, 2x2 gave %016llx "
                    "%016llx (seed %llu)\n",
                    r, (unsigned long long)one[r].dispatch_hash, (unsigned long long)one[r].weights_hash,
                    (unsigned long long)split[r].dispatch_hash, (unsigned long long)split[r].weights_hash,
                    (unsigned long long)seed);
            return 1;
        }
    }
    EXPECT_TRUE(total > 0); /* rows did move */
    return 0;
}

/* ------------------------------------------------- the combine's node tree, by hand ---- */

/* Four ranks, one expert each. Every rank sends token 0 to all four and token 1 to ranks 2 and 3; rank
 * r's expert outputs are k_tree_y[r] in every channel, bias0 is 0.25. The sums (Pinned details, Sums):
 *   one node (1x4), and 4x1 (each partial one bf16 value, exact):
 *     token 0: -256 + 0.5 + 256 + 1 + 0.25 = 1.75        token 1: 256 + 1 + 0.25 = 257.25 -> 258
 *   2x2, sources on node 0 (node 1's partial 257 crosses as bf16 256, a tie rounded to even):
 *     token 0: (-256 + 0.5) + 256 + 0.25 = 0.75          token 1: 256 + 0.25 -> 256
 *   2x2, sources on node 1 (node 0's partial -255.5 crosses as -256):
 *     token 0: -256 + (256 + 1) + 0.25 = 1.25            token 1: (256 + 1) + 0.25 -> 258
 * so a flat sum (1.75, 258) is wrong on both nodes of the 2x2 split. */
static const float k_tree_y[HT_R] = {-256.0f, 0.5f, 256.0f, 1.0f};

typedef struct tree_case {
    int per_node;
    float expect[HT_R][2]; /* [source rank][token] */
} tree_case_t;

static int tree_rank(int rank, int R, const epx_unique_id_t *id, void *ctx)
{
    const tree_case_t *tc = ctx;
    enum { T = 2, H = 128, K = 4 };
    char node[16];
    snprintf(node, sizeof(node), "tree%d", rank / tc->per_node);
    if (epx_test_set_env("EPX_RANKS_PER_NVLINK_DOMAIN", NULL) || epx_test_set_env("EPX_NODE_ID", node))
        return 1;
    epx_comm_t comm;
    EXPECT_OK(epx_test_host_comm(id, rank, R, 20000, &comm));
    epx_buffer_config_t bc = epx_test_buffer_config(T, H, K, R, EPX_MODE_HT);
    epx_buffer_t buf;
    EXPECT_OK(epx_buffer_create(comm, &bc, &buf));
    const int64_t topk[T][K] = {{3, 0, 2, 1}, {-1, 2, -1, 3}};
    const int N = rank < 2 ? R : 2 * R; /* token 0 of every source; token 1 too on ranks 2 and 3 */
    float w[T][K], combined_w[T][K], recv_w[2 * HT_R][K];
    uint16_t x[T][H] = {{0}}, bias0[T][H], y[2 * HT_R][H], combined[T][H];
    int64_t recv_idx[2 * HT_R][K];
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) w[t][k] = 0.125f * (float)(rank + 1) + 0.0625f * (float)(t * K + k);
    epx_ht_dispatch_args_t da = epx_test_ht_dispatch_args(x, (void *)topk, w, T, H, K);
    epx_ht_dispatch_outputs_t dout = epx_test_ht_dispatch_outputs(y, recv_idx, recv_w, N, H, K);
    EXPECT_OK(epx_ht_dispatch(buf, &da, &dout));
    EXPECT_EQ_INT(dout.num_recv_tokens_host, N);
    for (int i = 0; i < N; i++)
        for (int c = 0; c < H; c++) y[i][c] = epx_f32_to_bf16(k_tree_y[rank]);
    for (int t = 0; t < T; t++)
        for (int c = 0; c < H; c++) bias0[t][c] = epx_f32_to_bf16(0.25f);
    epx_ht_combine_args_t ca = epx_test_ht_combine_args(dout.handle, y, recv_w, N, H, K);
    ca.bias0 = epx_tensor_2d(bias0, EPX_DTYPE_BF16, T, H);
    epx_ht_combine_outputs_t co = epx_test_ht_combine_outputs(combined, combined_w, T, H, K);
    EXPECT_OK(epx_ht_combine(buf, &ca, &co));
    for (int t = 0; t < T; t++) {
        for (int c = 0; c < H; c++)
            if (combined[t][c] != epx_f32_to_bf16(tc->expect[rank][t])) {
                fprintf(stderr, "rank %d (%d per node): combined_x[%d][%d] = %g, expected %g\n", rank,
                        tc->per_node, t, c, (double)epx_bf16_to_f32(combined[t][c]),
                        (double)tc->expect[rank][t]);
                return 1;
            }
        /* The weights come back exactly on any split: each slot's weight comes from one rank. */
        for (int k = 0; k < K; k++)
            if (combined_w[t][k] != (topk[t][k] >= 0 ? w[t][k] : 0.0f)) {
                fprintf(stderr, "rank %d (%d per node): combined_topk_weights[%d][%d] = %g, expected %g\n",
                        rank, tc->per_node, t, k, (double)combined_w[t][k], (double)w[t][k]);
                return 1;
            }
    }
    EXPECT_OK(epx_handle_destroy(dout.handle));
    EXPECT_OK(epx_buffer_destroy(buf));
    EXPECT_OK(epx_comm_destroy(comm));
    return 0;
}

static int run_tree(void)
{
    static const tree_case_t cases[] = {
        {4, {{1.75f, 258.0f}, {1.75f, 258.0f}, {1.75f, 258.0f}, {1.75f, 258.0f}}},
        {2, {{0.75f, 256.0f}, {0.75f, 256.0f}, {1.25f, 258.0f}, {1.25f, 258.0f}}},
        {1, {{1.75f, 258.0f}, {1.75f, 258.0f}, {1.75f, 258.0f}, {1.75f, 258.0f}}},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        printf("topology: combine tree, %d node(s) of %d ranks\n", HT_R / cases[i].per_node,
               cases[i].per_node);
        fflush(stdout);
        if (epx_test_run_ranks(HT_R, tree_rank, (void *)&cases[i], RUN_TIMEOUT_S)) return 1;
    }
    return 0;
}

int main(void)
{
    const uint64_t seed = epx_test_seed();
    if (run_splits()) return 1;
    if (run_bad_shapes()) return 1;
    if (epx_test_run_ranks(2, local_config_rank, NULL, RUN_TIMEOUT_S)) return 1;
    if (run_tree()) return 1;
    if (run_ht_same_bits(seed)) {
        fprintf(stderr, "topology: FAILED (seed %llu)\n", (unsigned long long)seed);
        return 1;
    }
    printf("topology: ok\n");
    return 0;
}
