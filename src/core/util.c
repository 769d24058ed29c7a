/*
 * Time, host-side backoff for polling loops, and the fp8 e4m3 conversions shared by the host
 * backend, the tools and the tests' expectations.
 */
#include <math.h>
#include <sched.h>
#include <string.h>
#include <time.h>

#include "core/internal.h"

uint64_t epx_time_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void epx_backoff(uint32_t iteration)
{
    if (iteration < 64) return;
    if (iteration < 256) {
        sched_yield();
        return;
    }
    /* Ranks may outnumber cores: sleep so the rank we wait for gets to run. */
    uint32_t us = iteration < 1024 ? 5 : (iteration < 4096 ? 20 : 100);
    struct timespec ts = {0, (long)us * 1000};
    nanosleep(&ts, NULL);
}

float epx_fp8_e4m3_to_f32(uint8_t v)
{
    int sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 0x7;
    float out;
    if (exp == 0xf && man == 0x7) return sign ? -NAN : NAN;
    if (exp == 0)
        out = ldexpf((float)man, -9); /* subnormal: man/8 * 2^-6 */
    else
        out = ldexpf(1.0f + (float)man / 8.0f, exp - 7);
    return sign ? -out : out;
}

uint8_t epx_f32_to_fp8_e4m3(float f)
{
    union { float f; uint32_t u; } c = {f};
    uint8_t sign = (uint8_t)((c.u >> 24) & 0x80u);
    uint32_t a = c.u & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7f;          /* NaN */
    if (a >= 0x43e00000u) return sign | 0x7e; /* |f| >= 448 (inf too): saturate */
    if (a < 0x3c800000u) {
        /* Below 2^-6: e4m3 subnormals, quantum 2^-9; the scaling is exact, rintf rounds to
         * nearest even, and 8 (= 2^-6) is the encoding of the smallest normal. */
        union { uint32_t u; float f; } m = {a};
        return sign | (uint8_t)rintf(m.f * 512.0f);
    }
    /* Normal: round the 23-bit mantissa to 3 bits (nearest even; a carry bumps the exponent),
     * then rebias the exponent from 127 to 7. */
    uint32_t rounded = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
    uint32_t code = rounded - (120u << 3);
    return sign | (uint8_t)(code > 0x7eu ? 0x7eu : code);
}
