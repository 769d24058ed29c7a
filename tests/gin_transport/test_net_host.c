/*
 * gpu.gin_host and gpu.net_loop: a network transport of libepx end to end on one machine, through net.h
 * only. R forked ranks, each making a cuda-backend epx comm over the TCP bootstrap.
 *  - gin (EPX_NET_TEST_TRANSPORT=gin): libepx's GIN host setup (src/net/gin_host.c), each rank its own
 *    emulated node (NCCL_HOSTID, EPX_NODE_ID), NCCL loading the test GIN plugin (tests/gin_plugin) for its
 *    proxy path. Plugin: EPX_GIN_TEST_PLUGIN (the built one); skipped without it.
 *  - loop (EPX_NET_TEST_TRANSPORT=loop): the loop test transport (src/net/loop_host.c), ranks split into
 *    emulated nodes NxP (EPX_NODE_ID per node; EPX_LOOP_TEST_SPLITS, default 2x1,2x2,2x4,4x2), each split
 *    run in normal and in strict mode.
 * Kernels (kernels.cu) use net.h over the handle: ring rounds (strong, weak and bare signals, odd sizes and
 * offsets) checked bit-exact by the host against a CPU-computed pattern, and a soak of 1000 iterations whose
 * hashes the parent compares across ranks; the transport's close within its deadline. The loop runs add two
 * protocols that are wrong on purpose (a plain put, then a WEAK signal read as covering it; with 3 ranks or
 * more a plain put to the right, then a STRONG signal to the left read as covering it): in normal mode they
 * read the right bytes, in strict mode they must read none of them, and the bytes must land at the flush.
 * The dead-peer case: the last rank exits without closing; the survivors' signal wait must end with
 * EPX_ERR_REMOTE naming it within the timeout (EPX_TIMEOUT_MS, 20 s by default), and close must return
 * within its deadline. Ranks (gin): EPX_GPU_TEST_RANKS (2,4); soak: EPX_GIN_TEST_ITERATIONS (1000).
 * gin passed on one H200 at 2 and 4 ranks.
 */
#include <cuda_runtime.h>
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/internal.h"
#include "gin_test.h"
#include "gpu_test.h"
#include "net/loop_host.h"
#if EPX_TEST_HAVE_GIN
#include "net/gin_host.h"
#ifndef EPX_GIN_TEST_PLUGIN_PATH
#error "tests/gin_transport/CMakeLists.txt passes the plugin's path"
#endif
#else
typedef struct epx_gin epx_gin_t;
#endif

#define SLACK_MS 3000 /* what a bounded call may take past its deadline on a loaded machine */

typedef struct run_ctx {
    gpu_ctx_t gpu;
    const char *plugin;
    const char *name;   /* "gin host" or "loop" */
    int loop;           /* the loop transport (else GIN) */
    int strict;         /* loop: strict mode */
    int per_node;       /* loop: ranks per emulated node */
    int dead_peer;      /* the last rank exits after the first round */
    int64_t timeout_ms; /* the comm's: every wait of open, the kernels and close */
    uint64_t iterations;
} run_ctx_t;

typedef struct rank_result {
    uint64_t sent_hash, recv_hash, iterations;
    double open_ms, soak_ms, wait_ms, close_ms;
} rank_result_t;

typedef struct rank_state {
    int rank, nranks, left, right;
    const run_ctx_t *c;
    epx_comm_t comm;
    epx_gin_t *gin;
    epx_loop_t *lp;
    epx_net_t net;
    cudaStream_t stream;
    gin_kernel_result_t *res_host, *res_dev;
    unsigned char *host; /* GIN_REGION_BYTES of staging */
} rank_state_t;

static int fail(const rank_state_t *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(const rank_state_t *s, const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s rank %d/%d: FAILED: %s\n", s->c->name, s->rank, s->nranks, line);
    return 1;
}

/* In a function of a rank_state_t *s returning int: a failed CUDA call reports and returns 1. */
#define CUDA_TRY(call)                                                                  \
    do {                                                                                \
        cudaError_t e_ = (call);                                                        \
        if (e_ != cudaSuccess) return fail(s, "%s: %s", #call, cudaGetErrorString(e_)); \
    } while (0)
#define EPX_TRY(call)                                                                            \
    do {                                                                                         \
        epx_result_t r_ = (call);                                                                \
        if (r_ != EPX_SUCCESS)                                                                   \
            return fail(s, "%s: %s (%s)", #call, epx_result_name(r_), epx_last_error_message()); \
    } while (0)

static double ms_since(uint64_t t0)
{
    return (double)(epx_time_ns() - t0) / 1e6;
}

/* The transport's calls (the open one: loop or GIN). */
#if !EPX_TEST_HAVE_GIN
static epx_result_t epx_gin_poll(epx_gin_t *g)
{
    (void)g;
    return EPX_ERR_UNSUPPORTED;
}
static void epx_gin_abort(epx_gin_t *g)
{
    (void)g;
}
static void *epx_gin_region(const epx_gin_t *g, int i)
{
    (void)g;
    (void)i;
    return NULL;
}
static epx_result_t epx_gin_wait_result(epx_gin_t *g, epx_net_status_t st, const char *w)
{
    (void)g;
    (void)st;
    (void)w;
    return EPX_ERR_UNSUPPORTED;
}
static epx_result_t epx_gin_close(epx_gin_t *g)
{
    (void)g;
    return EPX_SUCCESS;
}
#endif
static epx_result_t t_poll(rank_state_t *s)
{
    return s->lp ? epx_loop_poll(s->lp) : epx_gin_poll(s->gin);
}
static void t_abort(rank_state_t *s)
{
    if (s->lp)
        epx_loop_abort(s->lp);
    else
        epx_gin_abort(s->gin);
}
static unsigned char *t_region(rank_state_t *s, int i)
{
    return s->lp ? epx_loop_region(s->lp, i) : epx_gin_region(s->gin, i);
}
static epx_result_t t_wait_result(rank_state_t *s, epx_net_status_t st, const char *what)
{
    return s->lp ? epx_loop_wait_result(s->lp, st, what) : epx_gin_wait_result(s->gin, st, what);
}
static epx_result_t t_close(rank_state_t *s)
{
    const epx_result_t r = s->lp ? epx_loop_close(s->lp) : epx_gin_close(s->gin);
    s->lp = NULL;
    s->gin = NULL;
    return r;
}

/* GIN: each rank its own emulated node, NCCL's proxy GIN through the test plugin, on loopback. Loop: ranks
 * per_node to a node. */
static void rank_env(int rank, const run_ctx_t *c)
{
    char name[64];
    if (c->loop) {
        snprintf(name, sizeof(name), "epx-loop-node-%d", rank / c->per_node);
        setenv("EPX_NODE_ID", name, 1);
        epx_params_reload();
        return;
    }
    snprintf(name, sizeof(name), "epx-gin-host-node-%d", rank);
    setenv("NCCL_HOSTID", name, 1);
    setenv("EPX_NODE_ID", name, 1);
    setenv("NCCL_NET_PLUGIN", c->plugin, 1);
    setenv("NCCL_GIN_TYPE", "2", 0);
    setenv("NCCL_SOCKET_IFNAME", "lo", 0);
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    epx_params_reload();
}

enum { KERNEL_OK = 0, KERNEL_FAILED = 1, KERNEL_STUCK = 2 };

/* Waits for the stream's kernel at most limit_ms, asking the transport's poll about the peers meanwhile (it
 * sets the abort word when one is gone). Past the limit the abort word ends every wait; a kernel still
 * running 5 s later is stuck in a post and the rank must leave without teardown. */
static int wait_kernel(rank_state_t *s, int64_t limit_ms, double *ms_out)
{
    const uint64_t t0 = epx_time_ns();
    uint64_t deadline = t0 + (uint64_t)limit_ms * 1000000ull;
    int aborted = 0;
    for (uint32_t i = 0;; i++) {
        const cudaError_t e = cudaStreamQuery(s->stream);
        if (e == cudaSuccess) break;
        if (e != cudaErrorNotReady) return fail(s, "the kernel failed: %s", cudaGetErrorString(e));
        if ((i & 15) == 0 && t_poll(s) != EPX_SUCCESS && !aborted) {
            printf("%s rank %d: %s\n", s->c->name, s->rank, epx_last_error_message());
            aborted = 1;
        }
        if (epx_time_ns() > deadline) {
            if (aborted) {
                fail(s, "the kernel still runs 5 s after the abort word was set: stuck in a post");
                return KERNEL_STUCK;
            }
            t_abort(s);
            aborted = 1;
            deadline = epx_time_ns() + 5000000000ull;
        }
        struct timespec nap = {0, 200000};
        nanosleep(&nap, NULL);
    }
    if (ms_out) *ms_out = ms_since(t0);
    return s->res_host->done ? KERNEL_OK : fail(s, "the kernel ended without writing its result");
}

static unsigned char guard_byte(uint64_t i, uint64_t round)
{
    return (unsigned char)(0x5a ^ (i * 131) ^ round);
}

typedef struct ring_round {
    uint32_t mode, chunks;
    uint64_t bytes, src_offset, dst_offset;
} ring_round_t;

static const ring_round_t ring_rounds[] = {
    {GIN_MODE_STRONG, 1, 4, 0, 0},           {GIN_MODE_WEAK, 3, 4097, 8, 3},
    {GIN_MODE_SIGNAL, 4, 1u << 20, 0, 4096}, {GIN_MODE_STRONG, 8, (2u << 20) - 8192, 64, 4103},
    {GIN_MODE_WEAK, 2, 65541, 1, 0},
};

/* Signal adds one round brings: one per chunk for weak put-signals, else one. */
static uint64_t round_adds(const ring_round_t *r)
{
    if (r->mode != GIN_MODE_WEAK) return 1;
    const uint64_t chunk = (r->bytes + r->chunks - 1) / r->chunks;
    return (r->bytes + chunk - 1) / chunk;
}

/* The kernel's statuses, all EPX_NET_OK, or the error the transport's wait_result makes of the first other.
 */
static int kernel_statuses(rank_state_t *s, const char *what)
{
    const gin_kernel_result_t *k = s->res_host;
    const int32_t st[3] = {k->post_status, k->wait_status, k->flush_status};
    static const char *const names[3] = {"post", "signal wait", "flush"};
    for (int i = 0; i < 3; i++)
        if (st[i] != EPX_NET_OK) {
            char op[128];
            snprintf(op, sizeof(op), "%s: %s", what, names[i]);
            const epx_result_t r = t_wait_result(s, (epx_net_status_t)st[i], op);
            return fail(s, "%s (%s; signal seen %" PRIu64 ")", epx_last_error_message(), epx_result_name(r),
                        k->signal_seen);
        }
    return 0;
}

/* One ring round: our pattern to the right, the left's into our destination, whose every byte is then
 * compared with the CPU's expectation (outside the put: untouched guard bytes). */
static int ring_round(rank_state_t *s, int round, uint64_t *target)
{
    const ring_round_t *r = &ring_rounds[round];
    const uint64_t seed = s->c->gpu.seed;
    unsigned char *src = t_region(s, GIN_SRC), *dst = t_region(s, GIN_DST);
    for (uint64_t k = 0; k < r->bytes; k++) s->host[k] = gin_pattern_byte(seed, s->rank, (uint64_t)round, k);
    CUDA_TRY(cudaMemcpy(src + r->src_offset, s->host, r->bytes, cudaMemcpyHostToDevice));
    for (uint64_t k = 0; k < GIN_REGION_BYTES; k++) s->host[k] = guard_byte(k, (uint64_t)round);
    for (uint64_t k = 0; k < r->bytes; k++)
        s->host[r->dst_offset + k] = (unsigned char)~gin_pattern_byte(seed, s->left, (uint64_t)round, k);
    CUDA_TRY(cudaMemcpy(dst, s->host, GIN_REGION_BYTES, cudaMemcpyHostToDevice));
    /* No rank puts before its right neighbour has prepared the destination. */
    EPX_TRY(epx_comm_barrier(s->comm));
    *target += round_adds(r);
    gin_ring_args_t a = {s->right,
                         (uint32_t)round % s->net.ncontexts,
                         r->mode,
                         r->chunks,
                         r->bytes,
                         r->src_offset,
                         r->dst_offset,
                         *target,
                         (uint64_t)s->c->timeout_ms * 1000000ull};
    memset(s->res_host, 0, sizeof(*s->res_host));
    CUDA_TRY((cudaError_t)gin_launch_ring(&s->net, s->stream, &a, s->res_dev));
    double ms = 0;
    const int k = wait_kernel(s, s->c->timeout_ms + SLACK_MS, &ms);
    if (k != KERNEL_OK) return k;
    char what[96];
    snprintf(what, sizeof(what), "ring round %d", round);
    if (kernel_statuses(s, what)) return 1;
    CUDA_TRY(cudaMemcpy(s->host, dst, GIN_REGION_BYTES, cudaMemcpyDeviceToHost));
    uint64_t bad = 0, first = UINT64_MAX;
    for (uint64_t i = 0; i < GIN_REGION_BYTES; i++) {
        const int inside = i >= r->dst_offset && i < r->dst_offset + r->bytes;
        const unsigned char want = inside
                                       ? gin_pattern_byte(seed, s->left, (uint64_t)round, i - r->dst_offset)
                                       : guard_byte(i, (uint64_t)round);
        if (s->host[i] != want) {
            if (!bad) first = i;
            bad++;
        }
    }
    if (bad)
        return fail(
            s,
            "ring round %d: %" PRIu64 " of %d bytes differ from rank %d's pattern or the guard; first at "
            "byte %" PRIu64 " (the put covers %" PRIu64 " .. %" PRIu64 ")",
            round, bad, (int)GIN_REGION_BYTES, s->left, first, r->dst_offset, r->dst_offset + r->bytes);
    printf("%s rank %d/%d: ring round %d ok: %" PRIu64 " bytes from rank %d bit-exact, mode %u, %.2f ms\n",
           s->c->name, s->rank, s->nranks, round, r->bytes, s->left, r->mode, ms);
    return 0;
}

/* The soak's hash of `sender`'s bytes over every iteration, on the CPU. */
static uint64_t soak_hash(uint64_t seed, int sender, uint64_t iterations)
{
    uint64_t h = 0;
    for (uint64_t i = 0; i < iterations; i++) {
        const uint64_t n = gin_soak_bytes(seed, i);
        for (uint64_t k = 0; k < n; k++) h += gin_byte_hash(i, k, gin_pattern_byte(seed, sender, i, k));
    }
    return h;
}

static int soak(rank_state_t *s, rank_result_t *out)
{
    EPX_TRY(epx_comm_barrier(s->comm));
    gin_soak_args_t a = {t_region(s, GIN_SRC),
                         t_region(s, GIN_DST),
                         s->right,
                         s->left,
                         s->c->gpu.seed,
                         s->c->iterations,
                         (uint64_t)s->c->timeout_ms * 1000000ull};
    memset(s->res_host, 0, sizeof(*s->res_host));
    CUDA_TRY((cudaError_t)gin_launch_soak(&s->net, s->stream, &a, s->res_dev));
    /* Meanwhile the CPU computes what must have gone and come. */
    const uint64_t want_sent = soak_hash(a.seed, s->rank, a.iterations);
    const uint64_t want_recv = soak_hash(a.seed, s->left, a.iterations);
    const int k = wait_kernel(s, 2 * s->c->timeout_ms + 120000, &out->soak_ms);
    if (k != KERNEL_OK) return k;
    const gin_kernel_result_t *r = s->res_host;
    if (kernel_statuses(s, "the soak"))
        return fail(s, "the soak stopped at iteration %" PRIu64, r->failed_at);
    out->sent_hash = r->sent_hash;
    out->recv_hash = r->recv_hash;
    out->iterations = r->iterations;
    if (r->iterations != a.iterations)
        return fail(s, "the soak ran %" PRIu64 " of %" PRIu64 " iterations", r->iterations, a.iterations);
    if (r->mismatches)
        return fail(s, "the soak received %" PRIu64 " bytes that differ from rank %d's pattern",
                    r->mismatches, s->left);
    if (r->sent_hash != want_sent || r->recv_hash != want_recv)
        return fail(s,
                    "soak hashes: sent %016" PRIx64 " (the CPU's %016" PRIx64 "), received %016" PRIx64
                    " (the CPU's for rank %d %016" PRIx64 ")",
                    r->sent_hash, want_sent, r->recv_hash, s->left, want_recv);
    printf("%s rank %d/%d: soak ok: %" PRIu64 " iterations in %.0f ms, sent %016" PRIx64
           ", received %016" PRIx64 " (both as the CPU computed)\n",
           s->c->name, s->rank, s->nranks, r->iterations, out->soak_ms, r->sent_hash, r->recv_hash);
    return 0;
}

/* The survivors' view of a dead peer: the wait for a signal only it would send must end with
 * EPX_ERR_REMOTE naming it, within the timeout. */
static int dead_peer_wait(rank_state_t *s, rank_result_t *out)
{
    const int victim = s->nranks - 1;
    memset(s->res_host, 0, sizeof(*s->res_host));
    CUDA_TRY((cudaError_t)gin_launch_wait(&s->net, s->stream, (uint64_t)s->c->timeout_ms * 1000000ull,
                                          s->res_dev));
    const int k = wait_kernel(s, s->c->timeout_ms + SLACK_MS, &out->wait_ms);
    if (k != KERNEL_OK) return k;
    const epx_net_status_t st = (epx_net_status_t)s->res_host->wait_status;
    const epx_result_t r = t_wait_result(s, st, "the wait for a signal from the dead rank");
    char name[32];
    snprintf(name, sizeof(name), "rank %d ", victim);
    if (r != EPX_ERR_REMOTE || !strstr(epx_last_error_message(), name) ||
        !strstr(epx_last_error_message(), "exited"))
        return fail(s, "the wait ended with %s, wait_result gave %s (%s); expected EPX_ERR_REMOTE naming %s",
                    epx_net_status_name(st), epx_result_name(r), epx_last_error_message(), name);
    if (out->wait_ms > (double)(s->c->timeout_ms + SLACK_MS))
        return fail(s, "the wait took %.0f ms, past the %lld ms timeout", out->wait_ms,
                    (long long)s->c->timeout_ms);
    printf("%s rank %d/%d: dead peer seen in %.0f ms (%s): %s\n", s->c->name, s->rank, s->nranks,
           out->wait_ms, epx_net_status_name(st), epx_last_error_message());
    return 0;
}

/* The protocols wrong on purpose (loop only; kernels.cu): weak cover (a plain put, then a WEAK signal read
 * as covering it) and, with 3 ranks or more, strong other peer (a plain put to the right, then a STRONG
 * signal to the left read as covering it). Normal mode copies at the post, so every byte is there; strict
 * mode keeps the put queued until the sender's flush, which comes after the reader's acknowledgement, so no
 * byte is. Either way every byte is there once every rank's kernel has ended (the flush delivered it). */
static int wrong_protocol(rank_state_t *s, rank_result_t *out, uint32_t kind)
{
    static const char *const names[2] = {"weak-cover", "strong-other-peer"};
    if (kind == GIN_WRONG_STRONG_OTHER && s->nranks < 3) return 0;
    const uint64_t seed = s->c->gpu.seed, round = 100 + kind, bytes = GIN_WRONG_BYTES;
    unsigned char *src = t_region(s, GIN_SRC), *dst = t_region(s, GIN_DST);
    for (uint64_t k = 0; k < bytes; k++) s->host[k] = gin_pattern_byte(seed, s->rank, round, k);
    CUDA_TRY(cudaMemcpy(src, s->host, bytes, cudaMemcpyHostToDevice));
    for (uint64_t k = 0; k < bytes; k++)
        s->host[k] = (unsigned char)~gin_pattern_byte(seed, s->left, round, k);
    CUDA_TRY(cudaMemcpy(dst, s->host, bytes, cudaMemcpyHostToDevice));
    EPX_TRY(epx_comm_barrier(s->comm));
    gin_wrong_args_t a = {dst,  s->right, s->left, (s->rank + 2) % s->nranks,
                          kind, seed,     round,   (uint64_t)s->c->timeout_ms * 1000000ull};
    memset(s->res_host, 0, sizeof(*s->res_host));
    CUDA_TRY((cudaError_t)gin_launch_wrong(&s->net, s->stream, &a, s->res_dev));
    const int k = wait_kernel(s, s->c->timeout_ms + SLACK_MS, &out->wait_ms);
    if (k != KERNEL_OK) return k;
    if (kernel_statuses(s, names[kind])) return 1;
    const uint64_t stale = s->res_host->mismatches, want = s->c->strict ? bytes : 0;
    if (stale != want)
        return fail(s,
                    "the %s protocol read %" PRIu64 " of %" PRIu64 " bytes before they landed; %s mode must "
                    "show %" PRIu64,
                    names[kind], stale, bytes, s->c->strict ? "strict" : "normal", want);
    /* The left rank's flush (which lands its put) may end after our kernel did: wait for every kernel. */
    EPX_TRY(epx_comm_barrier(s->comm));
    CUDA_TRY(cudaMemcpy(s->host, dst, bytes, cudaMemcpyDeviceToHost));
    for (uint64_t i = 0; i < bytes; i++)
        if (s->host[i] != gin_pattern_byte(seed, s->left, round, i))
            return fail(s, "the %s put had not landed after the sender's flush (byte %" PRIu64 ")",
                        names[kind], i);
    printf("%s rank %d/%d: %s protocol read %" PRIu64 " stale bytes of %" PRIu64 " (%s mode), all landed at "
           "the flush\n",
           s->c->name, s->rank, s->nranks, names[kind], stale, bytes, s->c->strict ? "strict" : "normal");
    return 0;
}

static int open_transport(rank_state_t *s, rank_result_t *out)
{
    uint64_t t0 = epx_time_ns();
    epx_loop_open_args_t args; /* the GIN args take the same shape */
    memset(&args, 0, sizeof(args));
    args.nregions = 2;
    args.region_bytes[GIN_SRC] = args.region_bytes[GIN_DST] = GIN_REGION_BYTES;
    args.contexts = 2;
    args.nsignals = GIN_NSIGNALS;
    args.strict = s->c->strict;
    if (s->c->loop) {
        EPX_TRY(epx_loop_open(s->comm, &args, &s->lp));
        s->net = epx_loop_net(s->lp);
    } else {
#if EPX_TEST_HAVE_GIN
        epx_gin_open_args_t gin;
        memset(&gin, 0, sizeof(gin));
        gin.nregions = args.nregions;
        memcpy(gin.region_bytes, args.region_bytes, sizeof(gin.region_bytes));
        gin.contexts = args.contexts;
        gin.nsignals = args.nsignals;
        EPX_TRY(epx_gin_open(s->comm, &gin, &s->gin));
        s->net = epx_gin_net(s->gin);
#else
        return fail(s, "this build has no GIN host setup");
#endif
    }
    out->open_ms = ms_since(t0);
    printf("%s rank %d/%d: open ok in %.0f ms: %u contexts, %u signals\n", s->c->name, s->rank, s->nranks,
           out->open_ms, s->net.ncontexts, s->net.nsignals);
    return 0;
}

static int rank_run(rank_state_t *s, rank_result_t *out)
{
    if (open_transport(s, out)) return 1;
    uint64_t target = 0;
    int rc = ring_round(s, 0, &target);
    const int rounds = s->c->dead_peer ? 1 : (int)(sizeof(ring_rounds) / sizeof(ring_rounds[0]));
    for (int round = 1; rc == 0 && round < rounds; round++) rc = ring_round(s, round, &target);
    for (uint32_t kind = 0; rc == 0 && !s->c->dead_peer && s->c->loop && kind < 2; kind++)
        rc = wrong_protocol(s, out, kind);
    if (rc == 0 && !s->c->dead_peer) rc = soak(s, out);
    if (rc == 0 && s->c->dead_peer) {
        EPX_TRY(epx_comm_barrier(s->comm));
        if (s->rank == s->nranks - 1) {
            printf("%s rank %d/%d: exits without closing the transport\n", s->c->name, s->rank, s->nranks);
            fflush(stdout);
            _exit(0);
        }
        rc = dead_peer_wait(s, out);
    }
    if (rc == KERNEL_STUCK) {
        fflush(NULL);
        _exit(3); /* a kernel still uses the handle: no teardown is safe */
    }
    const uint64_t t0 = epx_time_ns();
    const epx_result_t closed = t_close(s);
    out->close_ms = ms_since(t0);
    const epx_result_t want = s->c->dead_peer ? EPX_ERR_REMOTE : EPX_SUCCESS;
    if (rc == 0 && closed != want)
        rc = fail(s, "close returned %s (%s), expected %s", epx_result_name(closed), epx_last_error_message(),
                  epx_result_name(want));
    if (rc == 0 && out->close_ms > (double)(s->c->timeout_ms + SLACK_MS))
        rc = fail(s, "close took %.0f ms, past its %lld ms deadline", out->close_ms,
                  (long long)s->c->timeout_ms);
    if (rc == 0)
        printf("%s rank %d/%d: close %s in %.0f ms\n", s->c->name, s->rank, s->nranks,
               epx_result_name(closed), out->close_ms);
    return rc;
}

static int rank_body(int rank, int nranks, const epx_unique_id_t *id, void *arg, void *result)
{
    const run_ctx_t *c = arg;
    rank_state_t st;
    memset(&st, 0, sizeof(st));
    rank_state_t *s = &st;
    s->rank = rank;
    s->nranks = nranks;
    s->left = (rank + nranks - 1) % nranks;
    s->right = (rank + 1) % nranks;
    s->c = c;
    rank_env(rank, c);
    int device = 0;
    if (gpu_test_comm(&c->gpu, id, rank, nranks, (int)c->timeout_ms, &s->comm, &device)) return 1;
    CUDA_TRY(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
    CUDA_TRY(cudaHostAlloc((void **)&s->res_host, sizeof(*s->res_host), cudaHostAllocMapped));
    CUDA_TRY(cudaHostGetDevicePointer((void **)&s->res_dev, s->res_host, 0));
    CUDA_TRY(cudaMallocHost((void **)&s->host, GIN_REGION_BYTES));
    const int rc = rank_run(s, result);
    if (s->lp || s->gin) t_close(s); /* a failed step left it open: bounded like any close */
    cudaFreeHost(s->host);
    cudaFreeHost(s->res_host);
    cudaStreamDestroy(s->stream);
    epx_comm_destroy(s->comm);
    return rc;
}

/* R ranks: the main case, then the dead-peer case; the parent compares the soak hashes around the ring. */
static int run_nranks(int nranks, void *arg)
{
    run_ctx_t *c = arg;
    for (int dead = 0; dead < 2; dead++) {
        if (dead && nranks < 2) continue;
        c->dead_peer = dead;
        char label[96];
        snprintf(label, sizeof(label), "%s%s", c->name, dead ? " dead peer" : "");
        epx_harness_opts_t o = {label, nranks, rank_body, c, sizeof(rank_result_t), 200, NULL};
        epx_harness_report_t report;
        const int rc = epx_harness_run(&o, &report);
        int bad = rc != 0;
        for (int r = 0; !bad && !dead && r < nranks; r++) {
            const rank_result_t *me = epx_harness_result(&report, r);
            const rank_result_t *left = epx_harness_result(&report, (r + nranks - 1) % nranks);
            if (me->recv_hash != left->sent_hash) {
                fprintf(stderr, "%s: rank %d received hash %016" PRIx64 ", rank %d sent %016" PRIx64 "\n",
                        label, r, me->recv_hash, (r + nranks - 1) % nranks, left->sent_hash);
                bad = 1;
            }
        }
        for (int r = 0; r < nranks && report.results; r++) {
            const rank_result_t *x = epx_harness_result(&report, r);
            printf("%s: %d ranks, rank %d: open %.0f ms, soak %.0f ms, wait %.0f ms, close %.0f ms\n", label,
                   nranks, r, x->open_ms, x->soak_ms, x->wait_ms, x->close_ms);
        }
        epx_harness_report_free(&report);
        printf("%s: %d ranks: %s\n", label, nranks, bad ? "FAILED" : "ok");
        if (bad) return 1;
    }
    return 0;
}

/* The loop transport: every split NxP of EPX_LOOP_TEST_SPLITS, normal mode then strict mode. */
static int run_loop(run_ctx_t *c)
{
    const char *env = getenv("EPX_LOOP_TEST_SPLITS");
    char list[256];
    snprintf(list, sizeof(list), "%s", env && env[0] ? env : "2x1,2x2,2x4,4x2");
    int ran = 0;
    for (char *save = NULL, *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int nodes = 0, per = 0;
        if (sscanf(tok, "%dx%d", &nodes, &per) != 2 || nodes < 1 || per < 1 || nodes * per > 16) {
            fprintf(stderr, "loop: bad split '%s' in EPX_LOOP_TEST_SPLITS (NxP, at most 16 ranks)\n", tok);
            return 1;
        }
        for (int strict = 0; strict < 2; strict++) {
            char name[64];
            snprintf(name, sizeof(name), "loop %dx%d %s", nodes, per, strict ? "strict" : "normal");
            c->name = name;
            c->per_node = per;
            c->strict = strict;
            printf("%s: %d emulated nodes of %d ranks\n", name, nodes, per);
            if (run_nranks(nodes * per, c)) return 1;
            ran++;
        }
    }
    printf("loop: all passed (%d runs)\n", ran);
    return 0;
}

int main(void)
{
    run_ctx_t c;
    memset(&c, 0, sizeof(c));
    const int g = gpu_test_init(&c.gpu);
    if (g) return g;
    const char *tr = getenv("EPX_NET_TEST_TRANSPORT");
    c.loop = !tr || strcmp(tr, "gin") != 0;
    const char *it = getenv("EPX_GIN_TEST_ITERATIONS");
    c.iterations = it && atoll(it) > 0 ? (uint64_t)atoll(it) : 1000;
    /* The comm's timeout, hence open's, every kernel wait's and close's deadline. */
    const char *t = getenv("EPX_TIMEOUT_MS");
    c.timeout_ms = t && atoll(t) > 0 ? atoll(t) : 20000;
    if (c.loop) {
        printf("loop: seed %" PRIu64 ", %" PRIu64 " soak iterations, timeout %lld ms\n", c.gpu.seed,
               c.iterations, (long long)c.timeout_ms);
        return run_loop(&c);
    }
#if EPX_TEST_HAVE_GIN
    c.name = "gin host";
    c.plugin = getenv("EPX_GIN_TEST_PLUGIN");
    if (!c.plugin || !c.plugin[0]) c.plugin = EPX_GIN_TEST_PLUGIN_PATH;
    if (access(c.plugin, R_OK) != 0) {
        printf("no test GIN plugin at %s (%s; build the target nccl-net-epxtest or set EPX_GIN_TEST_PLUGIN): "
               "skipped\n",
               c.plugin, strerror(errno));
        return EPX_TEST_SKIP;
    }
    printf("gin host: plugin %s, seed %" PRIu64 ", %" PRIu64 " soak iterations, timeout %lld ms\n", c.plugin,
           c.gpu.seed, c.iterations, (long long)c.timeout_ms);
    return epx_harness_each_nranks("gin host", "EPX_GPU_TEST_RANKS", "2,4", 16, run_nranks, &c);
#else
    printf("gin: this build has no GIN host setup (NCCL): skipped\n");
    return EPX_TEST_SKIP;
#endif
}
