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

enum { GIN = 0, LOOP = 1 };

/* The shape both opens take. */
typedef struct shape {
    int32_t nregions;
    uint64_t region_bytes[16];
    int32_t contexts, nsignals;
} shape_t;

static shape_t good_shape(void)
{
    shape_t a;
    memset(&a, 0, sizeof(a));
    a.nregions = 2;
    a.region_bytes[0] = 1 << 20;
    a.region_bytes[1] = 4096;
    a.contexts = 2;
    a.nsignals = 4;
    return a;
}

/* The transport's open with `a` (NULL: args NULL), the handle written to *out (NULL: out NULL). */
static epx_result_t open_with(int which, epx_comm_t comm, const shape_t *a, void **out)
{
    if (which == GIN) {
        epx_gin_open_args_t g;
        memset(&g, 0, sizeof(g));
        if (a) {
            g.nregions = a->nregions;
            memcpy(g.region_bytes, a->region_bytes, sizeof(g.region_bytes));
            g.contexts = a->contexts;
            g.nsignals = a->nsignals;
        }
        return epx_gin_open(comm, a ? &g : NULL, (epx_gin_t **)out);
    }
#if EPX_TEST_LOOP
    epx_loop_open_args_t l;
    memset(&l, 0, sizeof(l));
    if (a) {
        l.nregions = a->nregions;
        memcpy(l.region_bytes, a->region_bytes, sizeof(l.region_bytes));
        l.contexts = a->contexts;
        l.nsignals = a->nsignals;
        l.strict = 1;
    }
    return epx_loop_open(comm, a ? &l : NULL, (epx_loop_t **)out);
#else
    (void)comm;
    (void)out;
    return EPX_ERR_UNSUPPORTED;
#endif
}

/* The open with `a` fails with `res`, its message holds `needle`, and *out is left as it was. */
static int refused(int which, epx_comm_t comm, const shape_t *a, epx_result_t res, const char *needle)
{
    void *const sentinel = (void *)(uintptr_t)0x5a5a5a5a;
    void *out = sentinel;
    EXPECT_RES(open_with(which, comm, a, &out), res);
    EXPECT_MSG_HAS(needle);
    EXPECT_TRUE(out == sentinel);
    printf("%s refused (%s): %s\n", which == GIN ? "gin" : "loop", epx_result_name(res),
           epx_last_error_message());
    return 0;
}

static int check_arguments(int which, epx_comm_t comm)
{
    shape_t a = good_shape();
    if (refused(which, NULL, &a, EPX_ERR_INVALID_ARG, "comm is NULL")) return 1;
    if (refused(which, comm, NULL, EPX_ERR_INVALID_ARG, "args is NULL")) return 1;
    EXPECT_RES(open_with(which, comm, &a, NULL), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("out is NULL");
    a.nregions = 0;
    if (refused(which, comm, &a, EPX_ERR_INVALID_ARG, "nregions 0 is outside [1, 16]")) return 1;
    a.nregions = 17;
    if (refused(which, comm, &a, EPX_ERR_INVALID_ARG, "nregions 17")) return 1;
    a = good_shape();
    a.region_bytes[1] = 0;
    if (refused(which, comm, &a, EPX_ERR_INVALID_ARG, "region_bytes[1] is 0")) return 1;
    a = good_shape();
    a.contexts = 0;
    if (refused(which, comm, &a, EPX_ERR_INVALID_ARG, "contexts 0")) return 1;
    a = good_shape();
    a.nsignals = -1;
    if (refused(which, comm, &a, EPX_ERR_INVALID_ARG, "nsignals -1")) return 1;
    if (which == LOOP) { /* the loop transport has at most 8 contexts; NCCL decides GIN's */
        a = good_shape();
        a.contexts = 9;
        if (refused(which, comm, &a, EPX_ERR_INVALID_ARG, "contexts 9 is above 8")) return 1;
    }
    /* A region past nregions is not looked at. */
    a = good_shape();
    a.nregions = 1;
    a.region_bytes[1] = 0;
    void *out = NULL;
    EXPECT_TRUE(open_with(which, comm, &a, &out) != EPX_ERR_INVALID_ARG);
    EXPECT_TRUE(out == NULL);
    return 0;
}

static int check_refusal(int which, epx_comm_t comm)
{
    const shape_t a = good_shape();
    if (which == LOOP) {
        if (refused(which, comm, &a, EPX_ERR_UNSUPPORTED,
                    "loop transport needs a communicator of the cuda backend"))
            return 1;
#if EPX_TEST_LOOP
        EXPECT_OK(epx_loop_close(NULL));
#endif
        return 0;
    }
#if EPX_TEST_GIN_HOST
    if (refused(which, comm, &a, EPX_ERR_UNSUPPORTED,
                "needs a communicator of the cuda backend, not the host backend"))
        return 1;
#else
    char why[256];
    epx_net_gin_unavailable(why, sizeof(why));
    if (refused(which, comm, &a, EPX_ERR_UNSUPPORTED, why)) return 1;
#endif
    EXPECT_OK(epx_gin_close(NULL));
    return 0;
}

int main(void)
{
    epx_unique_id_t id;
    EXPECT_OK(epx_get_unique_id(&id));
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    cfg.backend = EPX_BACKEND_HOST;
    epx_comm_t comm = NULL;
    EXPECT_OK(epx_comm_init(&id, 0, 1, &cfg, &comm));
    int rc = check_arguments(GIN, comm) || check_refusal(GIN, comm);
    if (!rc && EPX_TEST_LOOP) rc = check_arguments(LOOP, comm) || check_refusal(LOOP, comm);
    if (!EPX_TEST_LOOP) printf("no loop transport in this build (it needs the cuda backend)\n");
    EXPECT_OK(epx_comm_destroy(comm));
    if (rc) return 1;
    printf("ok\n");
    return 0;
}
