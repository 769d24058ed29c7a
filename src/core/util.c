/*
 * Time and the host-side backoff of polling loops. (The number formats are in core/numeric.h.)
 */
#include <sched.h>
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


/* SipHash-2-4 (Aumasson and Bernstein): a keyed pseudorandom function, here the bootstrap's message
 * authentication (core/bootstrap.c). Little-endian reads, as the reference. */
static uint64_t sip_rotl(uint64_t x, int b)
{
    return (x << b) | (x >> (64 - b));
}

#define SIP_ROUND(v0, v1, v2, v3)                                                  \
    do {                                                                           \
        v0 += v1, v1 = sip_rotl(v1, 13), v1 ^= v0, v0 = sip_rotl(v0, 32);          \
        v2 += v3, v3 = sip_rotl(v3, 16), v3 ^= v2;                                 \
        v0 += v3, v3 = sip_rotl(v3, 21), v3 ^= v0;                                 \
        v2 += v1, v1 = sip_rotl(v1, 17), v1 ^= v2, v2 = sip_rotl(v2, 32);          \
    } while (0)

static uint64_t sip_le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

uint64_t epx_siphash24(const unsigned char key[16], const void *data, size_t len)
{
    const unsigned char *in = data;
    const uint64_t k0 = sip_le64(key), k1 = sip_le64(key + 8);
    uint64_t v0 = 0x736f6d6570736575ull ^ k0, v1 = 0x646f72616e646f6dull ^ k1;
    uint64_t v2 = 0x6c7967656e657261ull ^ k0, v3 = 0x7465646279746573ull ^ k1;
    const size_t whole = len - len % 8;
    for (size_t i = 0; i < whole; i += 8) {
        const uint64_t m = sip_le64(in + i);
        v3 ^= m;
        SIP_ROUND(v0, v1, v2, v3);
        SIP_ROUND(v0, v1, v2, v3);
        v0 ^= m;
    }
    uint64_t b = (uint64_t)len << 56;
    for (size_t i = 0; i < len % 8; i++) b |= (uint64_t)in[whole + i] << (8 * i);
    v3 ^= b;
    SIP_ROUND(v0, v1, v2, v3);
    SIP_ROUND(v0, v1, v2, v3);
    v0 ^= b;
    v2 ^= 0xff;
    for (int i = 0; i < 4; i++) SIP_ROUND(v0, v1, v2, v3);
    return v0 ^ v1 ^ v2 ^ v3;
}
