/* Result codes and strings come from one table; version and dtype helpers agree with the header. */
#include <string.h>

#include "core/internal.h"
#include "epx_test.h"

int main(void)
{
    EXPECT_TRUE(strcmp(epx_result_name(EPX_SUCCESS), "SUCCESS") == 0);
    EXPECT_TRUE(strcmp(epx_result_name(EPX_ERR_TIMEOUT), "ERR_TIMEOUT") == 0);
    EXPECT_TRUE(strstr(epx_strerror(EPX_ERR_GRAPH_CAPTURE), "captured") != NULL);
    EXPECT_TRUE(strcmp(epx_strerror((epx_result_t)999), "unknown result") == 0);
    EXPECT_EQ_INT(epx_version_code(), EPX_VERSION_CODE);
    char expect[32];
    snprintf(expect, sizeof(expect), "%d.%d.%d", EPX_VERSION_MAJOR, EPX_VERSION_MINOR, EPX_VERSION_PATCH);
    EXPECT_TRUE(strcmp(epx_version(), expect) == 0);
    /* The last error message is per thread and set by the detecting call. */
    EXPECT_EQ_INT(epx_error(EPX_ERR_INVALID_ARG, "field %s", "x"), EPX_ERR_INVALID_ARG);
    EXPECT_TRUE(strcmp(epx_last_error_message(), "field x") == 0);
    /* bf16 rounding: ties to even, NaN stays NaN. */
    EXPECT_EQ_INT(epx_f32_to_bf16(1.0f), 0x3f80);
    EXPECT_EQ_INT(epx_f32_to_bf16(epx_bf16_to_f32(0x3f81)), 0x3f81);
    union { uint32_t u; float f; } c = {.u = 0x3f808000u}; /* exactly between 0x3f80 and 0x3f81 */
    EXPECT_EQ_INT(epx_f32_to_bf16(c.f), 0x3f80);
    c.u = 0x3f818000u;
    EXPECT_EQ_INT(epx_f32_to_bf16(c.f), 0x3f82);
    /* fp8 e4m3: every finite code round-trips, values saturate at 448. */
    for (int v = 0; v < 256; v++) {
        if ((v & 0x7f) == 0x7f) continue; /* NaN codes */
        float f = epx_fp8_e4m3_to_f32((uint8_t)v);
        uint8_t back = epx_f32_to_fp8_e4m3(f);
        if (v == 0x80) { EXPECT_EQ_INT(back, 0x80); continue; }
        EXPECT_EQ_INT(back, v);
    }
    EXPECT_EQ_INT(epx_f32_to_fp8_e4m3(1000.0f), 0x7e);
    EXPECT_EQ_INT(epx_f32_to_fp8_e4m3(-1000.0f), 0xfe);
    EXPECT_TRUE(epx_fp8_e4m3_to_f32(0x7e) == 448.0f);
    /* 1.0625 is halfway between 1.0 (0x38) and 1.125 (0x39): ties to even gives 0x38. */
    EXPECT_EQ_INT(epx_f32_to_fp8_e4m3(1.0625f), 0x38);
    printf("ok\n");
    return 0;
}
