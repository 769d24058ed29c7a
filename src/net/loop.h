/*
 * The `loop` test transport of net.h: ranks of different emulated nodes on one machine exchange through
 * CUDA IPC mappings that only this transport holds (kernels never see a peer's address: they name
 * regions and offsets through net.h, as they would on a NIC). A test instrument, never a production path.
 * This header is the state both sides share: the host setup (src/net/loop_host.c) fills it and copies it
 * to device memory, the device code (src/net/loop.cuh) reads it through the handle's `impl`.
 *
 * Normal mode: a put copies its bytes at once (the posting thread), a signal is a system-scope atomic add
 * after a fence. Strict mode does what GIN's rules allow and a NIC may do, so kernels that pass on it do
 * not rely on more than the rules:
 *  - a plain put is queued, not copied: it lands when a STRONG signal (or put with one) of its context
 *    goes to the same peer, at a flush of its context, or when its queue slot is needed again;
 *  - queued puts land newest first, and every put's bytes are copied last 16-byte word first;
 *  - a WEAK signal (with or without its own put) is applied at once: it passes the context's queued puts;
 *  - a STRONG signal delivers only the queued puts of its context to its own peer (not to other peers).
 * So a weak signal read as covering earlier puts, a strong one read as covering puts to another peer, or
 * a reader relying on put order sees stale bytes here (tests/gin_transport shows it).
 */
#ifndef EPX_NET_LOOP_H
#define EPX_NET_LOOP_H

#include <stdint.h>

#define EPX_NET_LOOP_MAX_REGIONS  16
#define EPX_NET_LOOP_MAX_RANKS    64
#define EPX_NET_LOOP_MAX_CONTEXTS 8
#define EPX_NET_LOOP_QUEUE        4096 /* strict mode: queued puts per context before a slot is reused */
#define EPX_NET_LOOP_POST_WAIT_NS 2000000000ull /* what a post may wait for a slot being delivered */

/* A queued put (strict mode). `state` is 4 * ticket + phase: phase 0 the slot is free for that ticket,
 * 1 the ticket's put is queued, 2 it is being copied. A slot goes free for ticket + QUEUE when its put
 * has landed. */
typedef struct epx_net_loop_entry {
    unsigned long long state;
    int32_t peer;
    uint32_t pad;
    uint64_t bytes;
    uint8_t *dst;
    const uint8_t *src;
} epx_net_loop_entry_t;

/* What a loop handle's `impl` points to, in the rank's device memory. */
typedef struct epx_net_loop {
    uint32_t nregions;
    uint32_t strict;
    uint64_t region_bytes[EPX_NET_LOOP_MAX_REGIONS];    /* equal on every rank */
    uint8_t *base[EPX_NET_LOOP_MAX_RANKS][EPX_NET_LOOP_MAX_REGIONS]; /* rank r's region i, mapped here */
    unsigned long long *signals[EPX_NET_LOOP_MAX_RANKS];             /* rank r's signal words, mapped here */
    unsigned long long *tail;    /* strict: [ncontexts] tickets handed out */
    epx_net_loop_entry_t *queue; /* strict: [ncontexts][EPX_NET_LOOP_QUEUE] */
} epx_net_loop_t;

#endif
