/*
 * The GIN probe: can NCCL load epx's test GIN plugin and run GIN put / signal kernels through its proxy
 * (CPU-assisted) path? One process per rank on one GPU, each its own emulated node (NCCL_HOSTID), the
 * kernels calling epx's net.h GIN transport (src/net/gin.cuh); NCCL's public host and device API only.
 * Every stage prints one line (harness.c); the parent prints the per-stage summary and the verdict.
 * A test instrument, not part of libepx, and not a CTest test: it needs a GPU and the plugin.
 * Passed on one H200 at 2 and 4 ranks (docs/benchmarks.md).
 */
#include <algorithm>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <vector>

#include "probe.h"

#define GUARD_BYTES 4096ull /* bytes past a put's end that must stay untouched */
#define SOAK_BYTES  65536ull

enum probe_mode { MODE_STRONG = 0, MODE_WEAK = 1, MODE_SIGNAL = 2 };
static const char *const mode_names[] = {"strong put-signal", "weak put-signal", "puts + strong signal"};

typedef struct kernel_args {
    epx_net_t net;
    int32_t peer;
    uint32_t ctx, mode, chunks, signal;
    uint64_t bytes, src_offset, dst_offset, signal_target, timeout_ns;
    kernel_result_t *result;
} kernel_args_t;

/* One thread: posts the round's pattern to the next rank in chunks with the mode's signals, waits for its
 * own incoming signal with a deadline, flushes its context. Every status goes to the host. */
__global__ void probe_kernel(kernel_args_t a)
{
    const uint64_t start = epx_net_now_ns();
    const uint64_t deadline = start + a.timeout_ns;
    const uint64_t chunk = (a.bytes + a.chunks - 1) / a.chunks;
    uint64_t before = 0;
    epx_net_signal_read(&a.net, a.signal, &before);
    epx_net_status_t post = EPX_NET_OK;
    uint32_t ops = 0;
    for (uint64_t off = 0; post == EPX_NET_OK && off < a.bytes; off += chunk, ops++) {
        const uint64_t len = a.bytes - off < chunk ? a.bytes - off : chunk;
        const uint64_t dst = a.dst_offset + off, src = a.src_offset + off;
        if (a.mode == MODE_WEAK)
            post = epx_net_put_signal(&a.net, a.ctx, a.peer, 1, dst, 0, src, len, a.signal, 1,
                                      EPX_NET_SIGNAL_WEAK);
        else if (a.mode == MODE_STRONG && off + len == a.bytes)
            post = epx_net_put_signal(&a.net, a.ctx, a.peer, 1, dst, 0, src, len, a.signal, 1,
                                      EPX_NET_SIGNAL_STRONG);
        else
            post = epx_net_put(&a.net, a.ctx, a.peer, 1, dst, 0, src, len);
    }
    if (post == EPX_NET_OK && a.mode == MODE_SIGNAL) {
        post = epx_net_signal_add(&a.net, a.ctx, a.peer, a.signal, 1, EPX_NET_SIGNAL_STRONG);
        ops++;
    }
    const epx_net_status_t wait = post == EPX_NET_OK
                                      ? epx_net_wait_signal(&a.net, a.signal, a.signal_target, deadline)
                                      : EPX_NET_ABORTED;
    uint64_t seen = 0;
    epx_net_signal_read(&a.net, a.signal, &seen);
    const epx_net_status_t flush = epx_net_flush(&a.net, a.ctx, deadline);
    a.result->post_status = post;
    a.result->wait_status = wait;
    a.result->flush_status = flush;
    a.result->ops_posted = ops;
    a.result->signal_before = before;
    a.result->signal_seen = seen;
    a.result->elapsed_ns = epx_net_now_ns() - start;
    __threadfence_system();
    a.result->done = 1;
}

typedef struct round_spec {
    int mode;
    uint64_t bytes, src_offset, dst_offset;
    uint32_t chunks;
} round_spec_t;

enum round_result { ROUND_OK = 0, ROUND_KERNEL, ROUND_DATA, ROUND_SETUP, ROUND_STOPPED };

static void nap_us(long us)
{
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

static uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* The bytes `sender` puts in round `round`: recomputable by the receiver. */
static void pattern_fill(unsigned char *dst, uint64_t n, int sender, uint64_t round)
{
    const uint64_t seed = mix64(((uint64_t)sender << 48) ^ (round << 8) ^ 0x65707867ull);
    for (uint64_t i = 0; i < n; i += 8) {
        const uint64_t w = mix64(seed + i / 8);
        memcpy(dst + i, &w, n - i < 8 ? n - i : 8);
    }
}

static unsigned char guard_byte(uint64_t i, uint64_t round)
{
    return (unsigned char)(0x5a ^ (i * 131) ^ round);
}

/* Waits for the round's kernel, bounded: past its deadline plus a grace (or when another rank failed) the
 * abort word is set, which ends every net.h wait; a kernel that still runs 5 s later is stuck in a post.
 * [out] for_peer: the abort word was set because another rank failed. */
static int wait_kernel(const probe_t *p, rank_state_t *s, int *for_peer, char *why, size_t why_len)
{
    *for_peer = 0;
    uint64_t deadline = probe_now_ns() + (uint64_t)(s->o->kernel_timeout_ms + HOST_GRACE_MS) * 1000000ull;
    int aborted = 0;
    for (;;) {
        const cudaError_t e = cudaStreamQuery(s->stream);
        if (e == cudaSuccess) return 1;
        if (e != cudaErrorNotReady) {
            snprintf(why, why_len, "the kernel failed: %s", cudaGetErrorString(e));
            return 0;
        }
        const uint64_t now = probe_now_ns();
        if (!aborted && (now > deadline || probe_aborted(p))) {
            *for_peer = now <= deadline;
            __atomic_store_n(s->abort_host, 1, __ATOMIC_RELEASE);
            aborted = 1;
            deadline = now + (uint64_t)HOST_GRACE_MS * 1000000ull;
        } else if (aborted && now > deadline) {
            s->kernel_stuck = 1;
            snprintf(why, why_len,
                     "the kernel still runs %d ms after the abort word was set: a post is blocked "
                     "inside NCCL (no descriptor credits: the proxy thread does not drain)",
                     HOST_GRACE_MS);
            return 0;
        }
        nap_us(20);
    }
}

/* Why a round's kernel did not return EPX_NET_OK everywhere, with NCCL's asynchronous error if any. */
static void describe_kernel(const rank_state_t *s, const kernel_args_t *a, char *why, size_t why_len)
{
    const kernel_result_t *r = s->res_host;
    int n;
    if (r->post_status != EPX_NET_OK)
        n = snprintf(why, why_len, "operation #%u of the round (counting from 1) returned %s", r->ops_posted,
                     epx_net_status_name((epx_net_status_t)r->post_status));
    else if (r->wait_status != EPX_NET_OK)
        n = snprintf(
            why, why_len,
            "waiting for signal %u from rank %d: %s after %.1f ms: read %llu at the start, %llu at the end, "
            "target %llu",
            a->signal, s->from, epx_net_status_name((epx_net_status_t)r->wait_status), r->elapsed_ns / 1e6,
            r->signal_before, r->signal_seen, (unsigned long long)a->signal_target);
    else
        n = snprintf(why, why_len, "flush of context %u: %s (the puts' source reads were not reported)",
                     a->ctx, epx_net_status_name((epx_net_status_t)r->flush_status));
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(s->comm, &async) == ncclSuccess && async != ncclSuccess &&
        async != ncclInProgress && n > 0 && (size_t)n < why_len)
        snprintf(why + n, why_len - (size_t)n, "; NCCL async error: %s (%s)", ncclGetErrorString(async),
                 ncclGetLastError(s->comm));
}

/* One round: this rank's pattern to the next rank on context ctx; the previous rank's bytes checked here
 * bit-exactly, and the guard bytes past them unchanged. */
static int run_round(probe_t *p, rank_state_t *s, const round_spec_t *rs, uint64_t round, uint32_t ctx,
                     uint64_t *sent_hash, uint64_t *got_hash, double *host_us, char *why, size_t why_len)
{
    const uint64_t n = rs->bytes, dst = rs->dst_offset;
    const uint64_t span = std::min(WINDOW_BYTES, dst + n + GUARD_BYTES);
    cudaError_t e;
    pattern_fill(s->h_src, n, s->rank, round);
    pattern_fill(s->h_expect, n, s->from, round);
    *sent_hash = probe_fnv(s->h_src, n, PROBE_FNV_SEED);
    for (uint64_t i = 0; i < span; i++) /* every byte the put must write starts as its complement */
        s->h_got[i] = i >= dst && i < dst + n ? (unsigned char)~s->h_expect[i - dst] : guard_byte(i, round);
    if ((e = cudaMemcpyAsync((char *)s->buf[0] + rs->src_offset, s->h_src, n, cudaMemcpyHostToDevice,
                             s->stream)) != cudaSuccess ||
        (e = cudaMemcpyAsync(s->buf[1], s->h_got, span, cudaMemcpyHostToDevice, s->stream)) != cudaSuccess ||
        (e = cudaStreamSynchronize(s->stream)) != cudaSuccess) {
        snprintf(why, why_len, "staging the round: %s", cudaGetErrorString(e));
        return ROUND_SETUP;
    }
    const uint64_t chunk = (n + rs->chunks - 1) / rs->chunks;
    s->expected_signal[rs->mode] += rs->mode == MODE_WEAK ? (n + chunk - 1) / chunk : 1; /* adds per round */
    memset((void *)s->res_host, 0, sizeof(*s->res_host));
    /* Every rank's destination is poisoned before any rank puts into it. */
    if (!probe_barrier(p, PROBE_BARRIER_ROUNDS, (s->o->stage_timeout_s - 2) * 1000, 1, why, why_len))
        return ROUND_STOPPED;
    kernel_args_t a;
    memset(&a, 0, sizeof(a));
    a.net = s->net;
    a.peer = s->peer;
    a.ctx = ctx;
    a.mode = (uint32_t)rs->mode;
    a.chunks = rs->chunks;
    a.signal = (uint32_t)rs->mode;
    a.bytes = n;
    a.src_offset = rs->src_offset;
    a.dst_offset = dst;
    a.signal_target = s->expected_signal[rs->mode];
    a.timeout_ns = (uint64_t)s->o->kernel_timeout_ms * 1000000ull;
    a.result = s->res_dev;
    const uint64_t t0 = probe_now_ns();
    probe_kernel<<<1, 1, 0, s->stream>>>(a);
    if ((e = cudaGetLastError()) != cudaSuccess) {
        snprintf(why, why_len, "kernel launch: %s", cudaGetErrorString(e));
        return ROUND_KERNEL;
    }
    int for_peer = 0;
    if (!wait_kernel(p, s, &for_peer, why, why_len)) return ROUND_KERNEL;
    *host_us = (double)(probe_now_ns() - t0) / 1e3;
    const kernel_result_t *r = s->res_host;
    if (!r->done) {
        snprintf(why, why_len, "the kernel ended without writing its result");
        return ROUND_KERNEL;
    }
    if (r->post_status != EPX_NET_OK || r->wait_status != EPX_NET_OK || r->flush_status != EPX_NET_OK) {
        describe_kernel(s, &a, why, why_len);
        /* Ended by the abort word set for another rank's failure: not this rank's failure. */
        const int ended_by_peer = for_peer && r->post_status == EPX_NET_OK &&
                                  (r->wait_status == EPX_NET_ABORTED || r->flush_status == EPX_NET_ABORTED);
        return ended_by_peer ? ROUND_STOPPED : ROUND_KERNEL;
    }
    if ((e = cudaMemcpyAsync(s->h_got, s->buf[1], span, cudaMemcpyDeviceToHost, s->stream)) != cudaSuccess ||
        (e = cudaStreamSynchronize(s->stream)) != cudaSuccess) {
        snprintf(why, why_len, "reading the destination back: %s", cudaGetErrorString(e));
        return ROUND_SETUP;
    }
    uint64_t bad = 0, first = 0, guard_bad = 0, guard_first = 0;
    for (uint64_t i = 0; i < span; i++) {
        const int inside = i >= dst && i < dst + n;
        if (s->h_got[i] == (inside ? s->h_expect[i - dst] : guard_byte(i, round))) continue;
        if (inside && bad++ == 0) first = i;
        if (!inside && guard_bad++ == 0) guard_first = i;
    }
    *got_hash = probe_fnv(s->h_got + dst, n, PROBE_FNV_SEED);
    if (bad || guard_bad) {
        snprintf(why, why_len,
                 "%llu of %llu bytes from rank %d differ (first at offset %llu: got 0x%02x, expected "
                 "0x%02x); %llu bytes "
                 "outside the put changed (first at offset %llu)",
                 (unsigned long long)bad, (unsigned long long)n, s->from, (unsigned long long)(first - dst),
                 bad ? s->h_got[first] : 0, bad ? s->h_expect[first - dst] : 0, (unsigned long long)guard_bad,
                 (unsigned long long)guard_first);
        return ROUND_DATA;
    }
    return ROUND_OK;
}

/* Strong and weak put-signals and puts followed by a bare strong signal, 4 bytes to 4 MiB, with and without
 * offsets, over the contexts in turn. */
static const round_spec_t rounds[] = {
    {MODE_STRONG, 4, 0, 0, 1},          {MODE_STRONG, 4096, 0, 0, 4},     {MODE_STRONG, 65540, 8, 4100, 4},
    {MODE_STRONG, 4ull << 20, 0, 0, 4}, {MODE_WEAK, 4, 0, 0, 1},          {MODE_WEAK, 4096, 0, 0, 4},
    {MODE_WEAK, 65540, 8, 4100, 4},     {MODE_WEAK, 4ull << 20, 0, 0, 4}, {MODE_SIGNAL, 4096, 0, 0, 4},
    {MODE_SIGNAL, 65540, 8, 4100, 4},
};
#define NROUNDS ((int)(sizeof(rounds) / sizeof(rounds[0])))

static int stage_rounds(probe_t *p, rank_state_t *s)
{
    char what[160], why[512];
    probe_begin(p, PROBE_STAGE_KERNEL,
                "put/signal rounds: 3 signal modes, 4 bytes to 4 MiB, contexts in turn");
    for (int i = 0; i < NROUNDS; i++) {
        const round_spec_t *rs = &rounds[i];
        const uint32_t ctx = (uint32_t)i % s->net.ncontexts;
        snprintf(what, sizeof(what), "round %d: %s, %llu bytes, context %u", i, mode_names[rs->mode],
                 (unsigned long long)rs->bytes, ctx);
        probe_progress(p, what);
        uint64_t sent = 0, got = 0;
        double us = 0;
        const int rc = run_round(p, s, rs, (uint64_t)i, ctx, &sent, &got, &us, why, sizeof(why));
        if (rc == ROUND_STOPPED) {
            probe_skip(p, "%s: %s", what, why);
            probe_record(p, PROBE_STAGE_DATA, PROBE_SKIPPED, "stopped at round %d", i);
            return 0;
        }
        if (rc == ROUND_DATA) {
            probe_ok(p, "kernels of rounds 0..%d returned EPX_NET_OK", i);
            probe_begin(p, PROBE_STAGE_DATA, "the failed round's check");
            return probe_fail(p, 1, "%s: %s", what, why);
        }
        if (rc != ROUND_OK) {
            probe_fail(p, 1, "%s: %s", what, why);
            if (i > 0) probe_record(p, PROBE_STAGE_DATA, PROBE_SKIPPED, "rounds 0..%d were bit-exact", i - 1);
            return 0;
        }
        probe_say(p,
                  "round %d ok: %s, %llu bytes, offsets %llu -> %llu, context %u: signal %u reached %llu, "
                  "%.1f us in "
                  "the kernel, %.1f us on the host; rank %d's bytes bit-exact",
                  i, mode_names[rs->mode], (unsigned long long)rs->bytes, (unsigned long long)rs->src_offset,
                  (unsigned long long)rs->dst_offset, ctx, (unsigned)rs->mode, s->res_host->signal_seen,
                  s->res_host->elapsed_ns / 1e3, us, s->from);
    }
    probe_ok(p, "%d rounds: every post, signal wait and flush returned EPX_NET_OK", NROUNDS);
    probe_record(p, PROBE_STAGE_DATA, PROBE_OK,
                 "%d rounds bit-exact from rank %d, bytes past each put untouched", NROUNDS, s->from);
    return 1;
}

/* Many small rounds: strong and weak in turn over every context, odd sizes and offsets, each checked and
 * hashed; the parent compares each rank's received hash with what its sender hashed. */
static int stage_soak(probe_t *p, rank_state_t *s)
{
    const int iters = s->o->iterations;
    if (iters == 0) {
        probe_record(p, PROBE_STAGE_SOAK, PROBE_SKIPPED, "0 iterations asked");
        probe_set_hashes(p, PROBE_FNV_SEED, PROBE_FNV_SEED, 0);
        return 1;
    }
    char what[160], why[512];
    snprintf(what, sizeof(what), "%d iterations of ~64 KiB, strong and weak in turn, every context, hashed",
             iters);
    probe_begin(p, PROBE_STAGE_SOAK, what);
    std::vector<double> host_us((size_t)iters);
    uint64_t sent_total = PROBE_FNV_SEED, got_total = PROBE_FNV_SEED;
    for (int it = 0; it < iters; it++) {
        const round_spec_t rs = {it % 2 ? MODE_WEAK : MODE_STRONG, SOAK_BYTES + (uint64_t)(it % 13),
                                 (uint64_t)(it * 264) % 4096, (uint64_t)(it * 520) % 8192, 2};
        const uint32_t ctx = (uint32_t)(it / 2) % s->net.ncontexts;
        snprintf(what, sizeof(what), "soak iteration %d: %s, %llu bytes, context %u", it, mode_names[rs.mode],
                 (unsigned long long)rs.bytes, ctx);
        probe_progress(p, what);
        uint64_t sent = 0, got = 0;
        const int rc = run_round(p, s, &rs, 1000000ull + (uint64_t)it, ctx, &sent, &got, &host_us[(size_t)it],
                                 why, sizeof(why));
        if (rc == ROUND_STOPPED) {
            probe_skip(p, "%s: %s", what, why);
            return 0;
        }
        if (rc != ROUND_OK) return probe_fail(p, 1, "%s: %s", what, why);
        sent_total = probe_fnv(&sent, sizeof(sent), sent_total);
        got_total = probe_fnv(&got, sizeof(got), got_total);
        if ((it + 1) % 250 == 0) probe_say(p, "soak: %d of %d iterations bit-exact", it + 1, iters);
    }
    probe_set_hashes(p, sent_total, got_total, (uint64_t)iters);
    std::sort(host_us.begin(), host_us.end());
    return probe_ok(
        p,
        "%d iterations bit-exact; sent hash 0x%016llx, received 0x%016llx; round on the host min %.1f "
        "us, median %.1f us, max %.1f us",
        iters, (unsigned long long)sent_total, (unsigned long long)got_total, host_us.front(),
        host_us[host_us.size() / 2], host_us.back());
}

static int rank_main(probe_t *p, void *arg)
{
    static rank_state_t state;
    rank_state_t *s = &state;
    s->o = (const probe_opts_t *)arg;
    s->rank = probe_rank(p);
    s->nranks = probe_nranks(p);
    s->peer = (s->rank + 1) % s->nranks;
    s->from = (s->rank + s->nranks - 1) % s->nranks;
    if (!(probe_setup(p, s) && stage_rounds(p, s) && stage_soak(p, s))) s->failed = 1;
    probe_teardown(p, s);
    return s->failed;
}

static void usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [-n RANKS] [-p PLUGIN | -P] [-i ITERATIONS] [-t STAGE_S] [-k KERNEL_MS] [-d]\n"
            "  -n  ranks, one process and one emulated node each (default 2, 2..%d)\n"
            "  -p  NCCL_NET_PLUGIN for every rank: a path to libnccl-net-epxtest.so or a name\n"
            "      (default: NCCL_NET_PLUGIN as the environment has it)\n"
            "  -P  unset NCCL_NET_PLUGIN (NCCL's own failure without a GIN backend)\n"
            "  -i  soak iterations (default 1000, 0 skips the soak)\n"
            "  -t  watchdog: seconds any stage of a rank may take (default 60)\n"
            "  -k  a kernel's signal wait and flush deadline in ms (default 10000)\n"
            "  -d  create the device communicator before registering the windows\n",
            argv0, PROBE_MAX_RANKS);
}

static int parse_int(const char *s, int lo, int hi, const char *what, int *out)
{
    char *end = NULL;
    const long v = strtol(s, &end, 10);
    if (!s[0] || *end || v < lo || v > hi) {
        fprintf(stderr, "gin-probe: %s '%s' is not a number in %d..%d\n", what, s, lo, hi);
        return 0;
    }
    *out = (int)v;
    return 1;
}

int main(int argc, char **argv)
{
    probe_opts_t o = {2, 1000, 60, 10000, 0, 0, NULL};
    int c;
    while ((c = getopt(argc, argv, "n:p:Pi:t:k:dh")) != -1) {
        int good = 1;
        switch (c) {
        case 'n': good = parse_int(optarg, 2, PROBE_MAX_RANKS, "-n", &o.nranks); break;
        case 'p': o.plugin = optarg; break;
        case 'P': o.no_plugin = 1; break;
        case 'i': good = parse_int(optarg, 0, 1000000, "-i", &o.iterations); break;
        case 't': good = parse_int(optarg, 10, 3600, "-t", &o.stage_timeout_s); break;
        case 'k': good = parse_int(optarg, 100, 600000, "-k", &o.kernel_timeout_ms); break;
        case 'd': o.devcomm_first = 1; break;
        default: usage(argv[0]); return c == 'h' ? 0 : 2;
        }
        if (!good) return 2;
    }
    if (optind != argc || (o.plugin && o.no_plugin)) {
        usage(argv[0]);
        return 2;
    }
    /* A round may take the kernel's deadline, the host's grace and the abort's grace, under the watchdog. */
    const int round_s = (o.kernel_timeout_ms + 2 * HOST_GRACE_MS) / 1000 + 5;
    if (o.stage_timeout_s < round_s) {
        fprintf(stderr, "gin-probe: -t %d is shorter than one bounded round (%d s with -k %d)\n",
                o.stage_timeout_s, round_s, o.kernel_timeout_ms);
        return 2;
    }
    const char *plugin = o.no_plugin                 ? "none (NCCL_NET_PLUGIN unset)"
                         : o.plugin                  ? o.plugin
                         : getenv("NCCL_NET_PLUGIN") ? getenv("NCCL_NET_PLUGIN")
                                                     : "(unset)";
    char title[768];
    snprintf(title, sizeof(title), "%d ranks, plugin %s, %s first, %d soak iterations, NCCL headers %d",
             o.nranks, plugin, o.devcomm_first ? "device communicator" : "windows", o.iterations,
             NCCL_VERSION_CODE);
    printf("gin-probe: %s; watchdog %d s per stage, kernel deadline %d ms\n", title, o.stage_timeout_s,
           o.kernel_timeout_ms);
    const probe_run_opts_t run = {o.nranks, o.stage_timeout_s, title, PROBE_STAGE_DATA};
    return probe_run(&run, rank_main, &o);
}
