/*
 * The host backend's namespace rule at buffer creation (epx_share_check_pid_ns): ranks in one pid
 * namespace pass; a rank in another makes every rank fail at once with EPX_ERR_UNSUPPORTED naming a
 * rank of the other side (before, the pid check refused every peer and only a timeout said so);
 * an unreadable namespace (0) is not held against anyone. This process's own id is readable.
 */
#include "core/internal.h"
#include "epx_test.h"

int main(void)
{
    const uint64_t one[4] = {7, 7, 7, 7}, split[4] = {7, 7, 9, 9}, unknown[3] = {7, 0, 7};
    for (int r = 0; r < 4; r++) EXPECT_OK(epx_share_check_pid_ns(r, one, 4));
    for (int r = 0; r < 4; r++) {
        EXPECT_RES(epx_share_check_pid_ns(r, split, 4), EPX_ERR_UNSUPPORTED);
        EXPECT_MSG_HAS(r < 2 ? "rank 2 runs in another pid namespace" : "rank 0 runs in another pid namespace");
    }
    for (int r = 0; r < 3; r++) EXPECT_OK(epx_share_check_pid_ns(r, unknown, 3));
    EXPECT_TRUE(epx_namespace_id("pid") != 0);
    printf("pid namespaces: one passes, a split fails on every rank naming the other side\n");
    return 0;
}
