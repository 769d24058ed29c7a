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
    uint8_t sign = signbit(f) ? 0x80 : 0;
    if (isnan(f)) return 0x7f;
    float a = fabsf(f);
    if (a >= 448.0f) return sign | 0x7e; /* saturate to the largest finite value */
    if (a < ldexpf(1.0f, -10)) {
        /* below half the smallest subnormal (2^-9): zero, ties to even (zero) */
        return sign;
    }
    int e;
    frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1) -> unbiased exponent e - 1 */
    int exp = e - 1;
    if (exp < -6) exp = -6; /* subnormal range: quantum 2^-9 */
    float quantum = ldexpf(1.0f, exp - 3);
    float q = a / quantum; /* exact: power-of-two scaling */
    float r = rintf(q);    /* round to nearest even (default rounding mode) */
    float value = r * quantum;
    if (value >= 448.0f) return sign | 0x7e;
    /* Re-encode the rounded value. */
    if (value < ldexpf(1.0f, -6)) return sign | (uint8_t)(value / ldexpf(1.0f, -9));
    frexpf(value, &e);
    exp = e - 1;
    int man = (int)(value / ldexpf(1.0f, exp - 3)) - 8;
    return sign | (uint8_t)((exp + 7) << 3) | (uint8_t)man;
}
