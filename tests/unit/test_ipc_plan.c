/*
 * The cuda ipc transport's plan (src/cuda/ipc_plan.h), which every rank computes from the same
 * allgathered records: the kind of export (auto takes fd only where every rank can and all share their
 * namespaces), the mapped size (the largest granularity), and the refusals. Pure: no GPU needed.
 */
#include "cuda/ipc_plan.h"
#include "epx_test.h"

#define MIB (1ull << 20)
#define R_MAX 8

typedef struct {
    epx_cuda_ipc_rec_t rec[R_MAX];
    int R;
} ranks_t;

/* R ranks alike: fd and fabric capable, 2 MiB granularity for both, one namespace each, auto. */
static ranks_t alike(int R, uint64_t total)
{
    ranks_t t;
    memset(&t, 0, sizeof(t));
    t.R = R;
    for (int r = 0; r < R; r++)
        t.rec[r] = (epx_cuda_ipc_rec_t){EPX_CUDA_IPC_CAN_FD | EPX_CUDA_IPC_CAN_FABRIC, EPX_CUDA_IPC_AUTO, total,
                                        2 * MIB, 2 * MIB, 11, 22};
    return t;
}

/* Every rank's plan; they must agree (kind, bytes, result). */
static int plan_all(const ranks_t *t, epx_result_t *res, int *kind, uint64_t *bytes)
{
    for (int me = 0; me < t->R; me++) {
        int k = -1;
        uint64_t b = 0;
        const epx_result_t x = epx_cuda_ipc_plan(me, t->R, t->rec, NULL, &k, &b);
        if (me == 0) {
            *res = x;
            *kind = k;
            *bytes = b;
        }
        EXPECT_EQ_INT(x, *res);
        if (x == EPX_SUCCESS) {
            EXPECT_EQ_INT(k, *kind);
            EXPECT_EQ_INT(b, *bytes);
        }
    }
    return 0;
}

static int test_auto(void)
{
    epx_result_t res;
    int kind;
    uint64_t bytes;
    /* Everyone can: fd, rounded up to the granularity. */
    ranks_t t = alike(4, 5 * MIB + 1);
    EXPECT_EQ_INT(plan_all(&t, &res, &kind, &bytes), 0);
    EXPECT_EQ_INT(res, EPX_SUCCESS);
    EXPECT_EQ_INT(kind, EPX_CUDA_IPC_FD);
    EXPECT_EQ_INT(bytes, 6 * MIB);
    /* The largest granularity of all ranks (and a rank that knows none). */
    t.rec[2].gran = 8 * MIB;
    t.rec[3].gran = 0;
    EXPECT_EQ_INT(plan_all(&t, &res, &kind, &bytes), 0);
    EXPECT_EQ_INT(bytes, 8 * MIB);
    /* fd ignores the fabric handles' granularity. */
    t.rec[1].gran_fabric = 32 * MIB;
    EXPECT_EQ_INT(plan_all(&t, &res, &kind, &bytes), 0);
    EXPECT_EQ_INT(bytes, 8 * MIB);
    /* None known anywhere: 2 MiB. */
    for (int r = 0; r < 4; r++) t.rec[r].gran = 0;
    EXPECT_EQ_INT(plan_all(&t, &res, &kind, &bytes), 0);
    EXPECT_EQ_INT(bytes, 6 * MIB);
    /* One rank without the fd export: legacy everywhere, the region's own size. */
    t = alike(4, 5 * MIB + 1);
    t.rec[1].can = EPX_CUDA_IPC_CAN_FABRIC;
    EXPECT_EQ_INT(plan_all(&t, &res, &kind, &bytes), 0);
    EXPECT_EQ_INT(res, EPX_SUCCESS);
    EXPECT_EQ_INT(kind, EPX_CUDA_IPC_LEGACY);
    EXPECT_EQ_INT(bytes, 5 * MIB + 1);
    /* One rank in another pid namespace, or another network namespace: legacy everywhere. */
    for (int which = 0; which < 2; which++) {
        t = alike(3, MIB);
        if (which)
            t.rec[2].net_ns = 99;
        else
            t.rec[2].pid_ns = 99;
        EXPECT_EQ_INT(plan_all(&t, &res, &kind, &bytes), 0);
        EXPECT_EQ_INT(res, EPX_SUCCESS);
        EXPECT_EQ_INT(kind, EPX_CUDA_IPC_LEGACY);
    }
    /* Auto never picks fabric, even where every rank has it. */
    t = alike(2, MIB);
    for (int r = 0; r < 2; r++) t.rec[r].can = EPX_CUDA_IPC_CAN_FABRIC;
    EXPECT_EQ_INT(plan_all(&t, &res, &kind, &bytes), 0);
    EXPECT_EQ_INT(kind, EPX_CUDA_IPC_LEGACY);
    return 0;
}

static int test_named(void)
{
    epx_result_t res;
    int kind;
    uint64_t bytes;
    ranks_t t = alike(3, 3 * MIB);
    for (int r = 0; r < 3; r++) t.rec[r].asked = EPX_CUDA_IPC_FABRIC;
    EXPECT_EQ_INT(plan_all(&t, &res, &kind, &bytes), 0);
    EXPECT_EQ_INT(kind, EPX_CUDA_IPC_FABRIC);
    EXPECT_EQ_INT(bytes, 4 * MIB);
    /* Fabric takes the fabric handles' granularity (the fd one may differ), the largest of all ranks. */
    t.rec[1].gran_fabric = 16 * MIB;
    t.rec[0].gran = 64 * MIB;
    EXPECT_EQ_INT(plan_all(&t, &res, &kind, &bytes), 0);
    EXPECT_EQ_INT(kind, EPX_CUDA_IPC_FABRIC);
    EXPECT_EQ_INT(bytes, 16 * MIB);
    t = alike(3, 3 * MIB);
    for (int r = 0; r < 3; r++) t.rec[r].asked = EPX_CUDA_IPC_FABRIC;
    /* Fabric asked, rank 2 cannot: refused by name on every rank. */
    t.rec[2].can = EPX_CUDA_IPC_CAN_FD;
    EXPECT_EQ_INT(plan_all(&t, &res, &kind, &bytes), 0);
    EXPECT_EQ_INT(res, EPX_ERR_UNSUPPORTED);
    EXPECT_MSG_HAS("EPX_CUDA_IPC=fabric, but rank 2 cannot use it");
    /* fd asked, namespaces differ: refused, naming the namespaces; this rank's missing driver call too. */
    t = alike(2, MIB);
    for (int r = 0; r < 2; r++) t.rec[r].asked = EPX_CUDA_IPC_FD;
    t.rec[1].pid_ns = 5;
    int k = -1;
    uint64_t b = 0;
    EXPECT_RES(epx_cuda_ipc_plan(0, 2, t.rec, "cuMemCreate", &k, &b), EPX_ERR_UNSUPPORTED);
    EXPECT_MSG_HAS("namespaces");
    EXPECT_MSG_HAS("lacks cuMemCreate");
    EXPECT_EQ_INT(k, -1); /* nothing written on failure */
    /* legacy asked where fd would do: legacy. */
    t = alike(2, MIB);
    for (int r = 0; r < 2; r++) t.rec[r].asked = EPX_CUDA_IPC_LEGACY;
    EXPECT_EQ_INT(plan_all(&t, &res, &kind, &bytes), 0);
    EXPECT_EQ_INT(kind, EPX_CUDA_IPC_LEGACY);
    EXPECT_EQ_INT(bytes, MIB);
    return 0;
}

static int test_mismatch(void)
{
    epx_result_t res;
    int kind;
    uint64_t bytes;
    ranks_t t = alike(3, MIB);
    t.rec[1].total = 2 * MIB;
    EXPECT_EQ_INT(plan_all(&t, &res, &kind, &bytes), 0);
    EXPECT_EQ_INT(res, EPX_ERR_MISMATCH);
    t = alike(3, MIB);
    t.rec[2].asked = EPX_CUDA_IPC_LEGACY;
    EXPECT_EQ_INT(plan_all(&t, &res, &kind, &bytes), 0);
    EXPECT_EQ_INT(res, EPX_ERR_MISMATCH);
    EXPECT_MSG_HAS("EPX_CUDA_IPC differs");
    return 0;
}

int main(void)
{
    if (test_auto() || test_named() || test_mismatch()) return 1;
    printf("ok\n");
    return 0;
}
