/*
 * unit.net_refuse: what the network transports' opens refuse, and how, in every build. epx_gin_open: bad
 * arguments get EPX_ERR_INVALID_ARG naming the argument, the output untouched; good arguments on a
 * host-backend communicator: a build with the GIN host setup refuses the backend (the transport needs the
 * cuda backend), a build without it (no NCCL, or no cuda backend) says what it lacks with
 * src/core/network.c's message. epx_loop_open (cuda builds, where the loop test transport exists): the same
 * argument checks (its contexts bounded too) and the refusal of a host-backend communicator.
 */
#include <string.h>

#include "core/network.h"
#include "epx_test.h"
#include "net/gin_host.h"
#if EPX_TEST_LOOP
#include "net/loop_host.h"
#endif

#ifndef EPX_TEST_GIN_HOST
#error "tests/gin_transport/CMakeLists.txt passes EPX_TEST_GIN_HOST"
#endif

static epx_gin_open_args_t good_args(void)
{
    epx_gin_open_args_t a;
    memset(&a, 0, sizeof(a));
    a.nregions = 2;
    a.region_bytes[0] = 1 << 20;
    a.region_bytes[1] = 4096;
    a.contexts = 2;
    a.nsignals = 4;
    return a;
}

/* epx_gin_open with `a` fails with `res`, its message holds `needle`, and *out is left as it was. */
static int refused(epx_comm_t comm, const epx_gin_open_args_t *a, epx_result_t res, const char *needle)
{
    epx_gin_t *const sentinel = (epx_gin_t *)(uintptr_t)0x5a5a5a5a;
    epx_gin_t *out = sentinel;
    EXPECT_RES(epx_gin_open(comm, a, &out), res);
    EXPECT_MSG_HAS(needle);
    EXPECT_TRUE(out == sentinel);
    printf("refused (%s): %s\n", epx_result_name(res), epx_last_error_message());
    return 0;
}

static int check_arguments(epx_comm_t comm)
{
    epx_gin_open_args_t a = good_args();
    if (refused(NULL, &a, EPX_ERR_INVALID_ARG, "comm is NULL")) return 1;
    if (refused(comm, NULL, EPX_ERR_INVALID_ARG, "args is NULL")) return 1;
    EXPECT_RES(epx_gin_open(comm, &a, NULL), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("out is NULL");
    a.nregions = 0;
    if (refused(comm, &a, EPX_ERR_INVALID_ARG, "nregions 0 is outside [1, 16]")) return 1;
    a.nregions = EPX_GIN_MAX_REGIONS + 1;
    if (refused(comm, &a, EPX_ERR_INVALID_ARG, "nregions 17")) return 1;
    a = good_args();
    a.region_bytes[1] = 0;
    if (refused(comm, &a, EPX_ERR_INVALID_ARG, "region_bytes[1] is 0")) return 1;
    a = good_args();
    a.contexts = 0;
    if (refused(comm, &a, EPX_ERR_INVALID_ARG, "contexts 0")) return 1;
    a = good_args();
    a.nsignals = -1;
    if (refused(comm, &a, EPX_ERR_INVALID_ARG, "nsignals -1")) return 1;
    /* A region past nregions is not looked at. */
    a = good_args();
    a.nregions = 1;
    a.region_bytes[1] = 0;
    epx_gin_t *out = NULL;
    EXPECT_TRUE(epx_gin_open(comm, &a, &out) != EPX_ERR_INVALID_ARG);
    EXPECT_TRUE(out == NULL);
    return 0;
}

static int check_refusal(epx_comm_t comm)
{
    const epx_gin_open_args_t a = good_args();
#if EPX_TEST_GIN_HOST
    if (refused(comm, &a, EPX_ERR_UNSUPPORTED, "needs a communicator of the cuda backend, not the host backend"))
        return 1;
#else
    char why[256];
    epx_net_gin_unavailable(why, sizeof(why));
    if (refused(comm, &a, EPX_ERR_UNSUPPORTED, why)) return 1;
#endif
    EXPECT_OK(epx_gin_close(NULL));
    return 0;
}

#if EPX_TEST_LOOP
static epx_loop_open_args_t loop_args(void)
{
    epx_loop_open_args_t a;
    memset(&a, 0, sizeof(a));
    a.nregions = 2;
    a.region_bytes[0] = 1 << 20;
    a.region_bytes[1] = 4096;
    a.contexts = 2;
    a.nsignals = 4;
    a.strict = 1;
    return a;
}

/* epx_loop_open with `a` fails with `res`, its message holds `needle`, and *out is left as it was. */
static int loop_refused(epx_comm_t comm, const epx_loop_open_args_t *a, epx_result_t res, const char *needle)
{
    epx_loop_t *const sentinel = (epx_loop_t *)(uintptr_t)0x5a5a5a5a;
    epx_loop_t *out = sentinel;
    EXPECT_RES(epx_loop_open(comm, a, &out), res);
    EXPECT_MSG_HAS(needle);
    EXPECT_TRUE(out == sentinel);
    printf("loop refused (%s): %s\n", epx_result_name(res), epx_last_error_message());
    return 0;
}

static int check_loop(epx_comm_t comm)
{
    epx_loop_open_args_t a = loop_args();
    if (loop_refused(NULL, &a, EPX_ERR_INVALID_ARG, "comm is NULL")) return 1;
    if (loop_refused(comm, NULL, EPX_ERR_INVALID_ARG, "args is NULL")) return 1;
    EXPECT_RES(epx_loop_open(comm, &a, NULL), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("out is NULL");
    a.nregions = EPX_NET_LOOP_MAX_REGIONS + 1;
    if (loop_refused(comm, &a, EPX_ERR_INVALID_ARG, "nregions 17 is outside [1, 16]")) return 1;
    a = loop_args();
    a.region_bytes[0] = 0;
    if (loop_refused(comm, &a, EPX_ERR_INVALID_ARG, "region_bytes[0] is 0")) return 1;
    a = loop_args();
    a.contexts = EPX_NET_LOOP_MAX_CONTEXTS + 1;
    if (loop_refused(comm, &a, EPX_ERR_INVALID_ARG, "contexts 9 is above 8")) return 1;
    a = loop_args();
    a.nsignals = 0;
    if (loop_refused(comm, &a, EPX_ERR_INVALID_ARG, "nsignals 0 is below 1")) return 1;
    a = loop_args();
    if (loop_refused(comm, &a, EPX_ERR_UNSUPPORTED, "loop transport needs a communicator of the cuda backend"))
        return 1;
    EXPECT_OK(epx_loop_close(NULL));
    return 0;
}
#else
static int check_loop(epx_comm_t comm)
{
    (void)comm;
    printf("no loop transport in this build (it needs the cuda backend)\n");
    return 0;
}
#endif

int main(void)
{
    epx_unique_id_t id;
    EXPECT_OK(epx_get_unique_id(&id));
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    cfg.backend = EPX_BACKEND_HOST;
    epx_comm_t comm = NULL;
    EXPECT_OK(epx_comm_init(&id, 0, 1, &cfg, &comm));
    const int rc = check_arguments(comm) || check_refusal(comm) || check_loop(comm);
    EXPECT_OK(epx_comm_destroy(comm));
    if (rc) return 1;
    printf("ok\n");
    return 0;
}
