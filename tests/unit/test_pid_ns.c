/*
 * The host backend's namespace rule at buffer creation (epx_share_check_pid_ns, over the peer
 * information of comm creation): ranks in one pid namespace pass; a rank in another makes every rank
 * fail at once with EPX_ERR_UNSUPPORTED naming two ranks that differ (before, the pid check refused
 * every peer and only a timeout said so), the same verdict on every rank; an unreadable namespace (0)
 * is not held against anyone.
 * A communicator made here records this process's own (readable) namespace.
 */
#include <string.h>

#include "core/internal.h"
#include "epx_test.h"

static epx_result_t check(const uint64_t *ids, int nranks, int rank)
{
    epx_peer_info_t peers[4];
    memset(peers, 0, sizeof(peers));
    for (int r = 0; r < nranks; r++) peers[r].pid_ns = ids[r];
    struct epx_comm comm;
    memset(&comm, 0, sizeof(comm));
    comm.rank = rank;
    comm.nranks = nranks;
    comm.peers = peers;
    return epx_share_check_pid_ns(&comm);
}

int main(void)
{
    const uint64_t one[4] = {7, 7, 7, 7}, split[4] = {7, 7, 9, 9}, unknown[3] = {7, 0, 7};
    /* Two known namespaces apart and one unknown: the verdict is the table's, the same on every rank
     * (the rank with the unknown one went on alone into the next collective and waited it out). */
    const uint64_t split_unknown[3] = {7, 9, 0};
    for (int r = 0; r < 4; r++) EXPECT_OK(check(one, 4, r));
    for (int r = 0; r < 4; r++) {
        EXPECT_RES(check(split, 4, r), EPX_ERR_UNSUPPORTED);
        EXPECT_MSG_HAS("ranks 0 and 2 run in different pid namespaces");
    }
    for (int r = 0; r < 3; r++) EXPECT_OK(check(unknown, 3, r));
    for (int r = 0; r < 3; r++) {
        EXPECT_RES(check(split_unknown, 3, r), EPX_ERR_UNSUPPORTED);
        EXPECT_MSG_HAS("ranks 0 and 1 run in different pid namespaces");
    }
    epx_unique_id_t id;
    EXPECT_OK(epx_get_unique_id(&id));
    epx_comm_t comm = NULL;
    EXPECT_OK(epx_test_host_comm(&id, 0, 1, 5000, &comm));
    EXPECT_TRUE(comm->peers[0].pid_ns != 0 && comm->peers[0].pid_ns == epx_namespace_id("pid"));
    EXPECT_OK(epx_comm_destroy(comm));
    printf("pid namespaces: one passes, a split fails on every rank naming two ranks apart\n");
    return 0;
}
