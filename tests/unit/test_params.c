/*
 * Environment parameters: defaults, every malformed value is EPX_ERR_INVALID_ARG naming the variable,
 * and single-rank communicator argument checks, config handling and the async-error record.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "epx_test.h"

static const char *const all_vars[] = {"EPX_TIMEOUT_MS",    "EPX_RANKS_PER_NVLINK_DOMAIN",
                                       "EPX_HOST_THREADS",  "EPX_DEBUG",
                                       "EPX_DEBUG_SUBSYS",  "EPX_BOOTSTRAP_ADDR",
                                       "EPX_SOCKET_IFNAME", "EPX_SHM_DIR",
                                       "EPX_PRINT_ENV",     "EPX_CUDA_IPC",
                                       "EPX_NET_TRANSPORT", "EPX_NET_LOOP_STRICT"};

static int test_defaults(void)
{
    for (size_t i = 0; i < sizeof(all_vars) / sizeof(all_vars[0]); i++) unsetenv(all_vars[i]);
    EXPECT_OK(epx_params_reload());
    const epx_params_t *p = NULL;
    EXPECT_OK(epx_params_get(&p));
    EXPECT_EQ_INT(p->timeout_ms, 100000);
    EXPECT_EQ_INT(p->ranks_per_nvlink_domain, 0);
    EXPECT_EQ_INT(p->host_threads, 0);
    EXPECT_EQ_INT(p->debug_level, EPX_LOG_WARN);
    EXPECT_EQ_INT(p->debug_subsys, EPX_SUBSYS_ALL);
    EXPECT_TRUE(strcmp(p->bootstrap_addr, "") == 0);
    EXPECT_TRUE(strcmp(p->socket_ifname, "") == 0);
    EXPECT_TRUE(strcmp(p->shm_dir, "/dev/shm") == 0);
    EXPECT_EQ_INT(p->print_env, 0);
    EXPECT_TRUE(strcmp(p->cuda_ipc, "auto") == 0);
    EXPECT_TRUE(strcmp(p->net_transport, "") == 0);
    EXPECT_EQ_INT(p->net_loop_strict, 0);
    /* A valid value is taken. */
    setenv("EPX_TIMEOUT_MS", "2500", 1);
    setenv("EPX_DEBUG_SUBSYS", "init,bootstrap", 1);
    EXPECT_OK(epx_params_reload());
    EXPECT_OK(epx_params_get(&p));
    EXPECT_EQ_INT(p->timeout_ms, 2500);
    EXPECT_EQ_INT(p->debug_subsys, EPX_SUBSYS_INIT | EPX_SUBSYS_BOOTSTRAP);
    unsetenv("EPX_TIMEOUT_MS");
    unsetenv("EPX_DEBUG_SUBSYS");
    EXPECT_OK(epx_params_reload());
    return 0;
}

/* name=value must fail on reload and on every later get until it is fixed. */
static int expect_malformed(const char *name, const char *value)
{
    setenv(name, value, 1);
    EXPECT_RES(epx_params_reload(), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS(name);
    const epx_params_t *p = NULL;
    EXPECT_RES(epx_params_get(&p), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS(name);
    unsetenv(name);
    EXPECT_OK(epx_params_reload());
    return 0;
}

static int expect_bad_bootstrap_addr(const char *value)
{
    setenv("EPX_BOOTSTRAP_ADDR", value, 1);
    EXPECT_OK(epx_params_reload()); /* a string is well-formed for the table; get_unique_id parses it */
    epx_unique_id_t id;
    memset(&id, 0xab, sizeof(id));
    EXPECT_RES(epx_get_unique_id(&id), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("EPX_BOOTSTRAP_ADDR");
    EXPECT_EQ_INT((unsigned char)id.internal[0], 0xab); /* nothing written on failure */
    unsetenv("EPX_BOOTSTRAP_ADDR");
    EXPECT_OK(epx_params_reload());
    return 0;
}

static int test_malformed(void)
{
    if (expect_malformed("EPX_TIMEOUT_MS", "abc")) return 1;
    if (expect_malformed("EPX_TIMEOUT_MS", "0")) return 1;
    if (expect_malformed("EPX_TIMEOUT_MS", "-5")) return 1;
    if (expect_malformed("EPX_TIMEOUT_MS", "12ms")) return 1;
    if (expect_malformed("EPX_DEBUG", "loud")) return 1;
    if (expect_malformed("EPX_NET_LOOP_STRICT", "yes")) return 1;
    if (expect_malformed("EPX_DEBUG_SUBSYS", "foo")) return 1;
    if (expect_malformed("EPX_DEBUG_SUBSYS", "init,foo")) return 1;
    if (expect_malformed("EPX_RANKS_PER_NVLINK_DOMAIN", "x")) return 1;
    if (expect_malformed("EPX_RANKS_PER_NVLINK_DOMAIN", "-1")) return 1;
    if (expect_malformed("EPX_PRINT_ENV", "yes")) return 1;
    if (expect_malformed("EPX_CUDA_IPC", "vmm")) return 1;
    if (expect_malformed("EPX_CUDA_IPC", "fdx")) return 1;
    if (expect_malformed("EPX_CUDA_IPC", "")) return 1;
    if (expect_malformed("EPX_NET_TRANSPORT", "bogus")) return 1;
    if (expect_malformed("EPX_NET_TRANSPORT", "loopx")) return 1;
    /* A choice in another case is taken as the table spells it. */
    const epx_params_t *p;
    setenv("EPX_NET_TRANSPORT", "LOOP", 1);
    setenv("EPX_CUDA_IPC", "Legacy", 1);
    EXPECT_OK(epx_params_reload());
    EXPECT_OK(epx_params_get(&p));
    EXPECT_TRUE(strcmp(p->net_transport, "loop") == 0);
    EXPECT_TRUE(strcmp(p->cuda_ipc, "legacy") == 0);
    unsetenv("EPX_NET_TRANSPORT");
    unsetenv("EPX_CUDA_IPC");
    EXPECT_OK(epx_params_reload());
    const char *bad_addrs[] = {"nonsense", "127.0.0.1",    "127.0.0.1:",   ":80",         "127.0.0.1:99999",
                               "1.2.3:80", "127.0.0.1:8x", "localhost:80", "127.0.0.1:-1"};
    for (size_t i = 0; i < sizeof(bad_addrs) / sizeof(bad_addrs[0]); i++)
        if (expect_bad_bootstrap_addr(bad_addrs[i])) return 1;
    /* An interface that does not exist is named in the error. */
    setenv("EPX_SOCKET_IFNAME", "epxnoif9", 1);
    EXPECT_OK(epx_params_reload());
    epx_unique_id_t id;
    EXPECT_RES(epx_get_unique_id(&id), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("EPX_SOCKET_IFNAME");
    unsetenv("EPX_SOCKET_IFNAME");
    EXPECT_OK(epx_params_reload());
    EXPECT_RES(epx_get_unique_id(NULL), EPX_ERR_INVALID_ARG);
    return 0;
}

/* A malformed env makes comm init fail cleanly, without touching comm_out. */
static int test_comm_init_bad_env(void)
{
    epx_unique_id_t id;
    EXPECT_OK(epx_get_unique_id(&id));
    const char *vars[] = {"EPX_TIMEOUT_MS", "EPX_DEBUG", "EPX_RANKS_PER_NVLINK_DOMAIN"};
    const char *vals[] = {"abc", "loud", "x"};
    for (int i = 0; i < 3; i++) {
        setenv(vars[i], vals[i], 1);
        epx_params_reload();
        epx_comm_t comm = (epx_comm_t)(uintptr_t)0x1234;
        EXPECT_RES(epx_comm_init(&id, 0, 1, NULL, &comm), EPX_ERR_INVALID_ARG);
        EXPECT_MSG_HAS(vars[i]);
        EXPECT_TRUE(comm == (epx_comm_t)(uintptr_t)0x1234);
        unsetenv(vars[i]);
        EXPECT_OK(epx_params_reload());
    }
    /* The id is still usable afterwards. */
    epx_comm_t comm = NULL;
    EXPECT_OK(epx_comm_init(&id, 0, 1, NULL, &comm));
    EXPECT_OK(epx_comm_destroy(comm));
    return 0;
}

static int test_comm_args(void)
{
    epx_unique_id_t id;
    EXPECT_OK(epx_get_unique_id(&id));
    epx_comm_t comm = NULL;
    EXPECT_RES(epx_comm_init(NULL, 0, 1, NULL, &comm), EPX_ERR_INVALID_ARG);
    EXPECT_RES(epx_comm_init(&id, 0, 1, NULL, NULL), EPX_ERR_INVALID_ARG);
    EXPECT_RES(epx_comm_init(&id, 0, 0, NULL, &comm), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("nranks = 0");
    EXPECT_RES(epx_comm_init(&id, -1, 2, NULL, &comm), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("rank -1");
    EXPECT_RES(epx_comm_init(&id, 2, 2, NULL, &comm), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("[0, 2)");
    epx_unique_id_t junk;
    memset(&junk, 0, sizeof(junk));
    EXPECT_RES(epx_comm_init(&junk, 0, 1, NULL, &comm), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("unique id");

    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    cfg.size = 0;
    EXPECT_RES(epx_comm_init(&id, 0, 1, &cfg, &comm), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("config->size");
    cfg = (epx_comm_config_t)EPX_COMM_CONFIG_INIT;
    cfg.version = 0;
    EXPECT_RES(epx_comm_init(&id, 0, 1, &cfg, &comm), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("config->version");
    cfg = (epx_comm_config_t)EPX_COMM_CONFIG_INIT;
    cfg.backend = (epx_backend_t)7;
    EXPECT_RES(epx_comm_init(&id, 0, 1, &cfg, &comm), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("config->backend = 7");
    cfg = (epx_comm_config_t)EPX_COMM_CONFIG_INIT;
    cfg.timeout_ms = -3;
    EXPECT_RES(epx_comm_init(&id, 0, 1, &cfg, &comm), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("config->timeout_ms");
#ifndef EPX_HAVE_CUDA
    cfg = (epx_comm_config_t)EPX_COMM_CONFIG_INIT;
    cfg.backend = EPX_BACKEND_CUDA;
    EXPECT_RES(epx_comm_init(&id, 0, 1, &cfg, &comm), EPX_ERR_UNSUPPORTED);
    EXPECT_MSG_HAS("cuda");
#endif

    /* An older caller's shorter config: fields past its size keep their defaults. */
    cfg = (epx_comm_config_t)EPX_COMM_CONFIG_INIT;
    cfg.backend = EPX_BACKEND_HOST;
    cfg.timeout_ms = 77; /* beyond the short size: must be ignored */
    cfg.size = offsetof(epx_comm_config_t, backend) + sizeof(cfg.backend);
    EXPECT_OK(epx_comm_init(&id, 0, 1, &cfg, &comm));
    EXPECT_EQ_INT(comm->timeout_ms, 100000);
    epx_topology_t topo;
    EXPECT_OK(epx_comm_get_topology(comm, &topo));
    EXPECT_EQ_INT(topo.rank, 0);
    EXPECT_EQ_INT(topo.nranks, 1);
    EXPECT_EQ_INT(topo.local_rank, 0);
    EXPECT_EQ_INT(topo.local_nranks, 1);
    EXPECT_EQ_INT(topo.ranks_per_nvlink_domain, 1);
    EXPECT_EQ_INT(topo.num_nvlink_domains, 1);
    EXPECT_EQ_INT(topo.backend, EPX_BACKEND_HOST);
    EXPECT_EQ_INT(topo.cuda_device, -1);
    EXPECT_RES(epx_comm_get_topology(comm, NULL), EPX_ERR_INVALID_ARG);
    EXPECT_OK(epx_comm_destroy(comm));

    /* The config's timeout wins over the env. */
    EXPECT_OK(epx_get_unique_id(&id));
    cfg = (epx_comm_config_t)EPX_COMM_CONFIG_INIT;
    cfg.backend = EPX_BACKEND_HOST;
    cfg.timeout_ms = 1234;
    EXPECT_OK(epx_comm_init(&id, 0, 1, &cfg, &comm));
    EXPECT_EQ_INT(comm->timeout_ms, 1234);

    /* Single-rank collectives copy the block. */
    char send[5] = "abcd", recv[5] = "";
    EXPECT_OK(epx_comm_allgather(comm, send, recv, sizeof(send)));
    EXPECT_TRUE(memcmp(send, recv, sizeof(send)) == 0);
    EXPECT_OK(epx_comm_barrier(comm));

    /* The first async error is kept with its message; later ones are dropped. */
    EXPECT_OK(epx_get_async_error(comm));
    EXPECT_EQ_INT(epx_comm_set_async_error(comm, EPX_ERR_TIMEOUT, "rank 0: peer 1 stalled on channel 2"),
                  EPX_ERR_TIMEOUT);
    EXPECT_EQ_INT(epx_comm_set_async_error(comm, EPX_ERR_REMOTE, "later failure"), EPX_ERR_REMOTE);
    EXPECT_RES(epx_get_async_error(comm), EPX_ERR_TIMEOUT);
    EXPECT_TRUE(strcmp(epx_last_error_message(), "rank 0: peer 1 stalled on channel 2") == 0);
    EXPECT_RES(epx_get_async_error(comm), EPX_ERR_TIMEOUT);

    /* Destroy refuses while buffers live, and frees nothing. */
    atomic_store(&comm->live_buffers, 1);
    EXPECT_RES(epx_comm_destroy(comm), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("live buffer");
    EXPECT_EQ_INT(comm->magic, EPX_COMM_MAGIC);
    atomic_store(&comm->live_buffers, 0);
    EXPECT_OK(epx_comm_destroy(comm));
    EXPECT_OK(epx_comm_destroy(NULL));

    /* NULL and foreign objects are rejected. */
    EXPECT_RES(epx_get_async_error(NULL), EPX_ERR_INVALID_ARG);
    EXPECT_RES(epx_comm_get_topology(NULL, &topo), EPX_ERR_INVALID_ARG);
    struct epx_comm fake;
    memset(&fake, 0, sizeof(fake));
    EXPECT_RES(epx_comm_get_topology(&fake, &topo), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("not a live communicator");
    /* A pointer the library never made is not read (it would fault, or be a use after free). */
    EXPECT_RES(epx_comm_get_topology((epx_comm_t)(uintptr_t)0x1000, &topo), EPX_ERR_INVALID_ARG);
    EXPECT_RES(epx_comm_destroy((epx_comm_t)(uintptr_t)0x1000), EPX_ERR_INVALID_ARG);
    EXPECT_RES(epx_get_async_error((epx_comm_t)(uintptr_t)0x1000), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("not a live communicator");
    EXPECT_RES(epx_comm_destroy(&fake), EPX_ERR_INVALID_ARG);
    EXPECT_RES(epx_get_async_error(&fake), EPX_ERR_INVALID_ARG);
    return 0;
}

/* EPX_BOOTSTRAP_ADDR and EPX_SOCKET_IFNAME=lo give ids a single rank can use. */
static int test_address_choice(void)
{
    setenv("EPX_BOOTSTRAP_ADDR", "127.0.0.1:0", 1);
    EXPECT_OK(epx_params_reload());
    epx_unique_id_t id;
    EXPECT_OK(epx_get_unique_id(&id));
    epx_comm_t comm = NULL;
    EXPECT_OK(epx_comm_init(&id, 0, 1, NULL, &comm));
    EXPECT_OK(epx_comm_destroy(comm));
    unsetenv("EPX_BOOTSTRAP_ADDR");
    setenv("EPX_SOCKET_IFNAME", "lo", 1);
    EXPECT_OK(epx_params_reload());
    EXPECT_OK(epx_get_unique_id(&id));
    EXPECT_OK(epx_comm_init(&id, 0, 1, NULL, &comm));
    EXPECT_OK(epx_comm_destroy(comm));
    unsetenv("EPX_SOCKET_IFNAME");
    EXPECT_OK(epx_params_reload());
    return 0;
}

int main(void)
{
    if (test_defaults() || test_malformed() || test_comm_init_bad_env() || test_comm_args() ||
        test_address_choice())
        return 1;
    printf("ok\n");
    return 0;
}
