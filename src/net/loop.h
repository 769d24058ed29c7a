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
 *  - a WEAK signal (bare, or with its own put) is queued too: it lands (its put first) when the posting
 *    rank next waits for a signal (or flushes the context, or a strong signal to that peer needs its put),
 *    so it passes the context's queued plain puts and trails the rank's later operations;
 *  - queued operations land newest first, and every put's bytes are copied last 16-byte word first;
 *  - a STRONG signal lands only the queued puts of its context to its own peer (not to other peers).
 * So a weak signal read as covering earlier puts or as ordered with later signals, a strong one read as
 * covering puts to another peer, or a reader relying on put order sees stale values here
 * (tests/gin_transport shows it).
 */
#ifndef EPX_NET_LOOP_H
#define EPX_NET_LOOP_H

#include <stdint.h>

#define EPX_NET_LOOP_MAX_REGIONS  16
#define EPX_NET_LOOP_MAX_RANKS    64
#define EPX_NET_LOOP_MAX_CONTEXTS 8
#define EPX_NET_LOOP_QUEUE        4096 /* strict mode: queued puts per context before a slot is reused */
#define EPX_NET_LOOP_POST_WAIT_NS 2000000000ull /* what a post may wait for a slot being delivered */

/* What a queued operation does when it lands. */
enum { EPX_NET_LOOP_PUT = 0, EPX_NET_LOOP_PUT_SIGNAL = 1, EPX_NET_LOOP_SIGNAL = 2 };

/* A queued operation (strict mode). `state` is 4 * ticket + phase: phase 0 the slot is free for that
 * ticket, 1 the ticket's operation is queued, 2 it is landing. A slot goes free for ticket + QUEUE once
 * its operation has landed. */
typedef struct epx_net_loop_entry {
    unsigned long long state;
    int32_t peer;
    uint32_t kind; /* EPX_NET_LOOP_PUT, _PUT_SIGNAL (a weak one), _SIGNAL (a weak one) */
    uint64_t bytes;
    uint8_t *dst;
    const uint8_t *src;
    uint32_t signal;
    uint32_t pad;
    uint64_t add;
} epx_net_loop_entry_t;

/* What a loop handle's `impl` points to, in the rank's device memory. */
typedef struct epx_net_loop {
    uint32_t nregions;
    uint32_t strict;
    uint64_t region_bytes[EPX_NET_LOOP_MAX_REGIONS];                 /* equal on every rank */
    uint8_t *base[EPX_NET_LOOP_MAX_RANKS][EPX_NET_LOOP_MAX_REGIONS]; /* rank r's region i, mapped here */
    unsigned long long *signals[EPX_NET_LOOP_MAX_RANKS];             /* rank r's signal words, mapped here */
    unsigned long long *tail;    /* strict: [ncontexts] tickets handed out, then [ncontexts] weak
                                    operations queued and not landed yet */
    epx_net_loop_entry_t *queue; /* strict: [ncontexts][EPX_NET_LOOP_QUEUE] */
} epx_net_loop_t;

#endif
