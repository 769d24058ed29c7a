/*
 * epx_get_build_info reports what the build found: the cuda backend, and the NCCL version CMake's
 * discovery chose (EPX_TEST_NCCL_VERSION, passed by tests/CMakeLists.txt: "" without NCCL). The
 * network's refusal message says what to install in a build without NCCL.
 */
#include <stddef.h>
#include <string.h>

#include "core/network.h"
#include "epx_test.h"

#ifndef EPX_TEST_NCCL_VERSION
#error "tests/CMakeLists.txt passes EPX_TEST_NCCL_VERSION"
#endif

static int check_info(void)
{
    epx_build_info_t info = EPX_BUILD_INFO_INIT;
    memset((char *)&info + sizeof(info.size), 0x5a, sizeof(info) - sizeof(info.size));
    EXPECT_OK(epx_get_build_info(&info));
    EXPECT_EQ_INT(info.size, sizeof(info));
#ifdef EPX_HAVE_CUDA
    EXPECT_EQ_INT(info.cuda, 1);
#else
    EXPECT_EQ_INT(info.cuda, 0);
#endif
    EXPECT_EQ_INT(info.network, 0);
    const char *expect = EPX_TEST_NCCL_VERSION;
    if (expect[0] == '\0') {
        EXPECT_EQ_INT(info.nccl, 0);
        EXPECT_EQ_INT(info.nccl_version_code, 0);
        EXPECT_EQ_INT(info.nccl_version[0], 0);
    } else {
        EXPECT_EQ_INT(info.nccl, 1);
        if (strcmp(info.nccl_version, expect) != 0) {
            fprintf(stderr, "nccl_version '%.16s', the build found %s\n", info.nccl_version, expect);
            return 1;
        }
        int major = 0, minor = 0, patch = 0;
        EXPECT_EQ_INT(sscanf(expect, "%d.%d.%d", &major, &minor, &patch), 3);
        EXPECT_EQ_INT(info.nccl_version_code, major * 10000 + minor * 100 + patch);
        EXPECT_TRUE(info.nccl_version_code >= 22800);
    }
    printf("cuda %d, nccl %d (%s, code %d), network %d\n", (int)info.cuda, (int)info.nccl, info.nccl_version,
           (int)info.nccl_version_code, (int)info.network);
    return 0;
}

/* A caller compiled against an older, shorter struct: nothing past its size is written. */
static int check_sizes(void)
{
    epx_build_info_t info;
    memset(&info, 0x5a, sizeof(info));
    info.size = offsetof(epx_build_info_t, nccl);
    EXPECT_OK(epx_get_build_info(&info));
    EXPECT_EQ_INT(info.size, offsetof(epx_build_info_t, nccl));
    EXPECT_TRUE(info.cuda == 0 || info.cuda == 1);
    EXPECT_EQ_INT(info.nccl, 0x5a5a5a5a);
    EXPECT_EQ_INT((unsigned char)info.nccl_version[15], 0x5a);

    memset(&info, 0x5a, sizeof(info));
    info.size = offsetof(epx_build_info_t, cuda);
    EXPECT_RES(epx_get_build_info(&info), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("EPX_BUILD_INFO_INIT");
    EXPECT_EQ_INT(info.cuda, 0x5a5a5a5a);
    EXPECT_RES(epx_get_build_info(NULL), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("info is NULL");
    return 0;
}

static int check_message(void)
{
    char why[256];
    EXPECT_TRUE(epx_net_gin_unavailable(why, sizeof(why)) == why);
    printf("network: %s\n", why);
    if (EPX_TEST_NCCL_VERSION[0] == '\0') {
        /* Built without NCCL: the message says what to install and where the build looks. */
        EXPECT_TRUE(strstr(why, "built without NCCL") != NULL);
        EXPECT_TRUE(strstr(why, "NCCL >= 2.28") != NULL);
        EXPECT_TRUE(strstr(why, "pip install nvidia-nccl-cu13") != NULL);
        EXPECT_TRUE(strstr(why, "EPX_NCCL_HOME") != NULL);
        EXPECT_TRUE(strstr(why, "rebuild") != NULL);
    } else {
        EXPECT_TRUE(strstr(why, "built with NCCL " EPX_TEST_NCCL_VERSION) != NULL);
        EXPECT_TRUE(strstr(why, "not built yet") != NULL);
    }
    /* A short buffer gets a NUL-terminated prefix; an empty one is left alone. */
    char full[256], small[12];
    snprintf(full, sizeof(full), "%s", why);
    memset(small, 'x', sizeof(small));
    epx_net_gin_unavailable(small, sizeof(small));
    EXPECT_EQ_INT(small[sizeof(small) - 1], 0);
    EXPECT_TRUE(strncmp(small, full, sizeof(small) - 1) == 0);
    small[0] = 'x';
    epx_net_gin_unavailable(small, 0);
    EXPECT_EQ_INT(small[0], 'x');
    return 0;
}

int main(void)
{
    if (check_info() || check_sizes() || check_message()) return 1;
    printf("ok\n");
    return 0;
}
