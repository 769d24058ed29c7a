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

