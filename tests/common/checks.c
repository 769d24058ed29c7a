/*
 * The checking helpers of the multi-process suites (reference.h): failure reports carrying the
 * seed and case, bit-exact comparison, arenas, a rank's host session, overflow and handle checks.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epx_test.h"
#include "reference.h"

static uint64_t ref_seed_g;
static char ref_case_g[256];

void ref_set_seed(uint64_t seed)
{
    ref_seed_g = seed;
}

void ref_set_case(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ref_case_g, sizeof(ref_case_g), fmt, ap);
    va_end(ap);
}

int ref_fail(int rank, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fprintf(stderr, "FAIL seed %llu rank %d [%s]: %s\n", (unsigned long long)ref_seed_g, rank, ref_case_g,
            msg);
    fflush(stderr);
    return 1;
}

int ref_check_bits(int rank, const char *what, const void *got, const void *expected, int64_t n, size_t elem,
                   int64_t row_elems)
{
    const uint8_t *g = got, *e = expected;
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++)
        if (memcmp(g + (size_t)i * elem, e + (size_t)i * elem, elem) != 0) {
            if (first < 0) first = i;
            bad++;
        }
    if (!bad) return 0;
    uint64_t gv = 0, ev = 0;
    memcpy(&gv, g + (size_t)first * elem, elem < 8 ? elem : 8);
    memcpy(&ev, e + (size_t)first * elem, elem < 8 ? elem : 8);
    if (row_elems < 1) row_elems = 1;
    return ref_fail(rank, "%s[%lld][%lld] = 0x%llx, expected 0x%llx (%lld of %lld elements differ)", what,
                    (long long)(first / row_elems), (long long)(first % row_elems), (unsigned long long)gv,
                    (unsigned long long)ev, (long long)bad, (long long)n);
}

int ref_check_overflow(int rank, epx_buffer_t buf, epx_result_t expected)
{
    epx_result_t q = epx_buffer_query_overflow(buf);
    if (q != expected)
        return ref_fail(rank, "epx_buffer_query_overflow = %s, expected %s", epx_result_name(q),
                        epx_result_name(expected));
    q = epx_buffer_query_overflow(buf);
    if (q != EPX_SUCCESS)
        return ref_fail(rank, "second epx_buffer_query_overflow = %s, expected SUCCESS (flag not cleared)",
                        epx_result_name(q));
    return 0;
}

int ref_check_handle(int rank, epx_handle_t handle, int64_t T, int64_t n_recv, int R, int64_t L)
{
    epx_handle_info_t info;
    const epx_result_t res = epx_handle_get_info(handle, &info);
    if (res != EPX_SUCCESS) {
        ref_fail(rank, "epx_handle_get_info: %s (%s)", epx_result_name(res), epx_last_error_message());
        return 2;
    }
    if (info.num_tokens == T && info.num_recv_tokens == n_recv && info.num_ranks == R &&
        info.num_local_experts == L)
        return 0;
    return ref_fail(rank, "handle info {%lld, %lld, %d, %d}, expected {%lld, %lld, %d, %lld}",
                    (long long)info.num_tokens, (long long)info.num_recv_tokens, info.num_ranks,
                    info.num_local_experts, (long long)T, (long long)n_recv, R, (long long)L);
}

void *ref_arena_alloc(ref_arena_t *a, size_t bytes)
{
    void *ptr = a->n < (int)(sizeof(a->ptrs) / sizeof(a->ptrs[0])) ? ref_alloc(bytes) : NULL;
    if (!ptr) {
        ref_fail(-1, "test arena: cannot allocate %zu bytes (%d blocks held)", bytes, a->n);
        exit(3);
    }
    a->ptrs[a->n++] = ptr;
    return ptr;
}

void *ref_arena_garbage(ref_arena_t *a, size_t bytes)
{
    void *ptr = ref_arena_alloc(a, bytes);
    memset(ptr, 0xa5, bytes);
    return ptr;
}

void ref_arena_free(ref_arena_t *a)
{
    for (int i = 0; i < a->n; i++) free(a->ptrs[i]);
    a->n = 0;
}

int ref_session_open(const epx_unique_id_t *id, int rank, int nranks, const epx_buffer_config_t *cfg,
                     ref_session_t *s)
{
    s->comm = NULL;
    s->buf = NULL;
    epx_result_t res = epx_test_host_comm(id, rank, nranks, 30000, &s->comm);
    if (res == EPX_SUCCESS) res = epx_buffer_create(s->comm, cfg, &s->buf);
    if (res == EPX_SUCCESS) return 0;
    ref_fail(rank, "%s: %s (%s)", s->comm ? "epx_buffer_create" : "epx_comm_init", epx_result_name(res),
             epx_last_error_message());
    ref_session_close(s);
    return 2;
}

void ref_session_close(ref_session_t *s)
{
    if (s->buf) epx_buffer_destroy(s->buf);
    if (s->comm) epx_comm_destroy(s->comm);
    s->buf = NULL;
    s->comm = NULL;
}

bool ref_fast_mode(void)
{
#if defined(__SANITIZE_ADDRESS__)
    return true;
#else
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
    return true;
#endif
#endif
    const char *v = getenv("CI_FAST");
    return v && *v && strcmp(v, "0") != 0;
#endif
}
