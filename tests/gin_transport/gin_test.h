/*
 * The network transport tests' shared parts (GIN and loop): the byte pattern and the order-free hash
 * that the kernels (kernels.cu) and the host (test_net_host.c) both compute, so every received byte is
 * checked against a CPU computation; and the kernels' launchers (plain C). Regions: 0 the source, 1 the
 * destination. Signals: 0 the ring rounds, 1 soak data into slot 0, 2 soak acknowledgements, 3 never sent
 * (the dead-peer wait), 4 soak data into slot 1, 5 and 6 the weak-cover protocol's data and acknowledgement,
 * 7 to 9 the strong-other-peer protocol's. One data signal per slot: the soak's puts alternate contexts and
 * half are weak, so one shared count can be reached by iteration i+1's signal while iteration i's put is
 * still in flight.
 */
#ifndef EPX_GIN_TEST_H
#define EPX_GIN_TEST_H

#include <stdint.h>

#include "net/net.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__CUDACC__)
#define GIN_TEST_FN __host__ __device__ static inline
#else
#define GIN_TEST_FN static inline
#endif

#define GIN_REGION_BYTES (2ull << 20)
#define GIN_SRC          0
#define GIN_DST          1
#define GIN_SIG_RING     0
#define GIN_SIG_SOAK     1
#define GIN_SIG_ACK      2
#define GIN_SIG_NEVER    3
#define GIN_SIG_SOAK1    4 /* soak data into slot 1 (GIN_SIG_SOAK: slot 0) */
#define GIN_SIG_WRONG     5
#define GIN_SIG_WRONG_ACK 6
#define GIN_SIG_STRONG2   7 /* the strong-other-peer protocol: its strong signal, relay, acknowledgement */
#define GIN_SIG_RELAY     8
#define GIN_SIG_ACK2      9
#define GIN_NSIGNALS      10
#define GIN_WRONG_BYTES   65536ull
#define GIN_SOAK_MAX     65536ull              /* bytes of one soak iteration, at most */
#define GIN_SOAK_SLOT    (GIN_SOAK_MAX + 64ull) /* two slots per region, alternating */

GIN_TEST_FN uint64_t gin_mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Byte `index` that `sender` puts in round or iteration `iter` of the run seeded `seed`. */
GIN_TEST_FN unsigned char gin_pattern_byte(uint64_t seed, int sender, uint64_t iter, uint64_t index)
{
    const uint64_t w = gin_mix64(seed ^ ((uint64_t)(uint32_t)sender << 48) ^ (iter << 28) ^ (index >> 3));
    return (unsigned char)(w >> ((index & 7) * 8));
}

/* One byte's share of a hash that does not depend on the order bytes are visited in (a sum). */
GIN_TEST_FN uint64_t gin_byte_hash(uint64_t iter, uint64_t index, unsigned char b)
{
    return gin_mix64((iter << 40) ^ (index << 8) ^ b);
}

/* Soak iteration `i`: its size (1 .. GIN_SOAK_MAX) and its offset inside its slot (0 .. 7). */
GIN_TEST_FN uint64_t gin_soak_bytes(uint64_t seed, uint64_t i)
{
    return 1 + gin_mix64(seed ^ (i * 0x51ull)) % GIN_SOAK_MAX;
}
GIN_TEST_FN uint64_t gin_soak_offset(uint64_t seed, uint64_t i)
{
    return (i & 1) * GIN_SOAK_SLOT + (gin_mix64(seed ^ (i * 0x51ull) ^ 0xabcull) & 7);
}

/* Written by a kernel into mapped host memory; `done` last. */
typedef struct gin_kernel_result {
    int32_t post_status, wait_status, flush_status;
    uint32_t done;
    uint64_t signal_seen;
    uint64_t elapsed_ns;
    uint64_t iterations;    /* soak iterations completed */
    uint64_t failed_at;     /* soak iteration of the first failed operation */
    uint64_t sent_hash;     /* soak: what this rank generated and put */
    uint64_t recv_hash;     /* soak: what this rank received */
    uint64_t mismatches;    /* soak: received bytes that differ from the left rank's pattern */
} gin_kernel_result_t;

enum gin_ring_mode { GIN_MODE_STRONG = 0, GIN_MODE_WEAK = 1, GIN_MODE_SIGNAL = 2 };

typedef struct gin_ring_args {
    int32_t peer; /* the rank this one puts to */
    uint32_t ctx, mode, chunks;
    uint64_t bytes, src_offset, dst_offset;
    uint64_t signal_target; /* signal 0 must reach it: every round's adds from the left so far */
    uint64_t timeout_ns;
} gin_ring_args_t;

typedef struct gin_soak_args {
    unsigned char *src, *dst; /* this rank's regions 0 and 1 (epx_gin_region) */
    int32_t right, left;
    uint64_t seed, iterations, timeout_ns;
} gin_soak_args_t;

/* The protocols wrong on purpose: `dst` is this rank's destination region, checked against `left`'s pattern
 * of round `round`. weak cover: a plain put, then a WEAK signal read as covering it. strong other peer
 * (3 ranks or more): a plain put to the right, then a STRONG signal to the left read as covering it. */
enum gin_wrong_kind { GIN_WRONG_WEAK_COVER = 0, GIN_WRONG_STRONG_OTHER = 1 };
typedef struct gin_wrong_args {
    const unsigned char *dst;
    int32_t right, left, right2; /* right2: the right's right */
    uint32_t kind;
    uint64_t seed, round, timeout_ns;
} gin_wrong_args_t;

/* Each launches one kernel on `stream` writing `result` (a device pointer to mapped host memory) and
 * returns the launch's cudaError_t. */
int gin_launch_ring(const epx_net_t *net, void *stream, const gin_ring_args_t *args, gin_kernel_result_t *result);
int gin_launch_soak(const epx_net_t *net, void *stream, const gin_soak_args_t *args, gin_kernel_result_t *result);
int gin_launch_wrong(const epx_net_t *net, void *stream, const gin_wrong_args_t *args,
                     gin_kernel_result_t *result);
/* Waits for GIN_SIG_NEVER to reach 1 (it never does while the peer that would send it is dead). */
int gin_launch_wait(const epx_net_t *net, void *stream, uint64_t timeout_ns, gin_kernel_result_t *result);

#ifdef __cplusplus
}
#endif

#endif
