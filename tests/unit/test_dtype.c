/*
 * Dtype sizes and names, versioned-struct reading and buffer-config normalisation, the API
 * layer's dispatch to a backend (driven through a fake communicator and a recording backend so
 * that no transport is needed), and the backend registry.
 */
#include <string.h>

#include "api/api.h"
#include "core/internal.h"
#include "epx_test.h"

/* ------------------------------------------------------------------ recording backend ---- */

static int calls_ht_dispatch, calls_fail;
static uint64_t last_fail_seq, last_dispatch_seq;
static epx_result_t last_fail_res;
static void *last_fail_stream;

static void fake_fail(epx_buffer_t buffer, uint64_t seq, epx_result_t res, void *stream)
{
    calls_fail++;
    last_fail_seq = seq;
    last_fail_res = res;
    last_fail_stream = stream;
    epx_error(EPX_ERR_INTERNAL, "the backend's own message must not replace the caller's");
}
static epx_result_t fake_ht_dispatch(epx_buffer_t buffer, uint64_t seq, const epx_ht_dispatch_args_t *args,
                                     epx_ht_dispatch_outputs_t *outputs, epx_handle_t handle)
{
    calls_ht_dispatch++;
    last_dispatch_seq = seq;
    handle->num_recv = 3;
    outputs->num_recv_tokens_host = 3;
    return EPX_SUCCESS;
}

/* The test builds its buffer by hand and frees handles without backend state: only these. */
static const epx_backend_ops_t fake_ops = {
    .name = "fake", .fail_collective = fake_fail, .ht_dispatch = fake_ht_dispatch};

/* A buffer config of T_max tokens of H channels, K of E experts (the rest defaults). */
static epx_buffer_config_t config_of(int64_t max_tokens, int64_t hidden, int32_t num_topk,
                                     int32_t num_experts)
{
    epx_buffer_config_t c = EPX_BUFFER_CONFIG_INIT;
    c.max_tokens = max_tokens;
    c.hidden = hidden;
    c.num_topk = num_topk;
    c.num_experts = num_experts;
    return c;
}

static int test_dtypes(void)
{
    static const struct {
        epx_dtype_t d;
        size_t size;
        const char *name;
    } table[] = {
        {EPX_DTYPE_BF16, 2, "bf16"},   {EPX_DTYPE_FP32, 4, "fp32"},   {EPX_DTYPE_FP8_E4M3, 1, "fp8_e4m3"},
        {EPX_DTYPE_INT32, 4, "int32"}, {EPX_DTYPE_INT64, 8, "int64"}, {EPX_DTYPE_BOOL, 1, "bool"},
        {EPX_DTYPE_UINT8, 1, "uint8"},
    };
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
        EXPECT_EQ_INT(epx_dtype_size(table[i].d), table[i].size);
        EXPECT_TRUE(strcmp(epx_dtype_name(table[i].d), table[i].name) == 0);
    }
    EXPECT_EQ_INT(EPX_DTYPE_COUNT_, 8); /* a new dtype needs a row above */
    EXPECT_EQ_INT(epx_dtype_size(EPX_DTYPE_INVALID), 0);
    EXPECT_EQ_INT(epx_dtype_size((epx_dtype_t)99), 0);
    EXPECT_EQ_INT(epx_dtype_size((epx_dtype_t)-1), 0);
    EXPECT_TRUE(strcmp(epx_dtype_name(EPX_DTYPE_INVALID), "invalid") == 0);
    EXPECT_TRUE(strcmp(epx_dtype_name((epx_dtype_t)99), "invalid") == 0);
    char buf[64];
    EXPECT_TRUE(strcmp(epx_api_dtype_list(EPX_DTYPE_BIT(EPX_DTYPE_BF16) | EPX_DTYPE_BIT(EPX_DTYPE_FP32) |
                                              EPX_DTYPE_BIT(EPX_DTYPE_FP8_E4M3),
                                          buf, sizeof(buf)),
                       "bf16, fp32 or fp8_e4m3") == 0);
    EXPECT_TRUE(strcmp(epx_api_dtype_list(EPX_DTYPE_BIT(EPX_DTYPE_INT64), buf, sizeof(buf)), "int64") == 0);
    return 0;
}

static int test_struct_reading(void)
{
    epx_ht_dispatch_args_t dst;
    epx_ht_dispatch_args_t src;
    memset(&src, 0, sizeof(src));
    src.version = EPX_VERSION_CODE;
    src.expert_alignment = 4;
    src.num_worst_tokens = 9;

    memset(&dst, 0, sizeof(dst));
    src.size = 0;
    EXPECT_RES(epx_api_read_struct(NULL, &dst, sizeof(dst), &src, "args"), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("args->size = 0");
    src.size = EPX_STRUCT_MIN_SIZE - 1;
    EXPECT_RES(epx_api_read_struct(NULL, &dst, sizeof(dst), &src, "args"), EPX_ERR_INVALID_ARG);
    EXPECT_EQ_INT(dst.expert_alignment, 0); /* nothing copied on failure */
    EXPECT_RES(epx_api_read_struct(NULL, &dst, sizeof(dst), NULL, "args"), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("args is NULL");

    /* A struct from an older caller stops before expert_alignment: the default stays. */
    dst.expert_alignment = 1;
    dst.num_worst_tokens = 0;
    src.size = offsetof(epx_ht_dispatch_args_t, expert_alignment);
    EXPECT_OK(epx_api_read_struct(NULL, &dst, sizeof(dst), &src, "args"));
    EXPECT_EQ_INT(dst.expert_alignment, 1);
    EXPECT_EQ_INT(dst.num_worst_tokens, 0);
    /* A newer caller's larger struct: the known prefix is read. */
    unsigned char bigger[sizeof(src) + 32];
    memset(bigger, 0xee, sizeof(bigger));
    src.size = sizeof(bigger);
    memcpy(bigger, &src, sizeof(src));
    EXPECT_OK(epx_api_read_struct(NULL, &dst, sizeof(dst), bigger, "args"));
    EXPECT_EQ_INT(dst.expert_alignment, 4);
    EXPECT_EQ_INT(dst.num_worst_tokens, 9);
    /* Another major release may have moved fields. */
    src.size = sizeof(src);
    src.version = (EPX_VERSION_MAJOR + 1) * 10000;
    EXPECT_RES(epx_api_read_struct(NULL, &dst, sizeof(dst), &src, "args"), EPX_ERR_UNSUPPORTED);
    EXPECT_MSG_HAS("args->version");
    return 0;
}

static int test_buffer_config(void)
{
    epx_buffer_config_t in = config_of(16, 256, 4, 8);
    epx_buffer_config_t out;
    EXPECT_OK(epx_api_buffer_config_normalize(NULL, &in, 4, &out));
    EXPECT_EQ_INT(out.modes, EPX_MODE_ALL);
    EXPECT_EQ_INT(out.dispatch_dtypes, EPX_DTYPE_BIT(EPX_DTYPE_BF16) | EPX_DTYPE_BIT(EPX_DTYPE_FP32) |
                                           EPX_DTYPE_BIT(EPX_DTYPE_FP8_E4M3));
    EXPECT_EQ_INT(out.max_pad_multiple, 128);
    EXPECT_EQ_INT(out.max_tokens, 16);

    /* A config whose size stops before `modes` keeps the defaults after it. */
    epx_buffer_config_t short_cfg = in;
    short_cfg.size = offsetof(epx_buffer_config_t, modes);
    short_cfg.modes = 0x40; /* beyond the caller's size: never read */
    EXPECT_OK(epx_api_buffer_config_normalize(NULL, &short_cfg, 4, &out));
    EXPECT_EQ_INT(out.modes, EPX_MODE_ALL);
    short_cfg.size = 0;
    EXPECT_RES(epx_api_buffer_config_normalize(NULL, &short_cfg, 4, &out), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("config->size = 0");

    struct {
        const char *needle;
        int nranks;
        epx_buffer_config_t cfg;
    } bad[] = {
        {"config.max_tokens = 0", 4, in},
        {"config.hidden = 0", 4, in},
        {"config.num_topk = 65", 4, in},
        {"config.num_topk = 0", 4, in},
        {"config.num_experts = 6 is not a multiple of nranks = 4", 4, in},
        {"config.num_topk = 4 exceeds num_experts = 2", 2, in},
        {"config.modes = 0x8", 4, in},
        {"config.dispatch_dtypes", 4, in},
        {"not a multiple of 128, which fp8", 4, in},
        {"config.max_pad_multiple = -1", 4, in},
        {"config.num_sms = -1", 4, in},
    };
    bad[0].cfg.max_tokens = 0;
    bad[1].cfg.hidden = 0;
    bad[2].cfg.num_topk = 65;
    bad[3].cfg.num_topk = 0;
    bad[4].cfg.num_experts = 6;
    bad[5].cfg.num_experts = 2;
    bad[6].cfg.modes = 0x8;
    bad[7].cfg.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_INT32);
    bad[8].cfg.hidden = 200;
    bad[8].cfg.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_BF16) | EPX_DTYPE_BIT(EPX_DTYPE_FP8_E4M3);
    bad[9].cfg.max_pad_multiple = -1;
    bad[10].cfg.num_sms = -1;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        memset(&out, 0x5c, sizeof(out));
        EXPECT_RES(epx_api_buffer_config_normalize(NULL, &bad[i].cfg, bad[i].nranks, &out),
                   EPX_ERR_INVALID_ARG);
        EXPECT_MSG_HAS(bad[i].needle);
        EXPECT_EQ_INT(out.max_tokens, 0x5c5c5c5c5c5c5c5cll); /* untouched */
    }
    /* A hidden size that is not a multiple of 128 is fine for bf16 only, LL included (its fp8 calls
     * are refused per call). */
    epx_buffer_config_t odd = in;
    odd.hidden = 200;
    odd.modes = EPX_MODE_ALL;
    odd.dispatch_dtypes = EPX_DTYPE_BIT(EPX_DTYPE_BF16);
    EXPECT_OK(epx_api_buffer_config_normalize(NULL, &odd, 4, &out));
    /* The default dtypes leave fp8 out where the hidden size cannot take it, and keep it where it can. */
    odd.dispatch_dtypes = 0;
    EXPECT_OK(epx_api_buffer_config_normalize(NULL, &odd, 4, &out));
    EXPECT_EQ_INT(out.dispatch_dtypes, EPX_DTYPE_BIT(EPX_DTYPE_BF16) | EPX_DTYPE_BIT(EPX_DTYPE_FP32));
    odd.hidden = 384;
    EXPECT_OK(epx_api_buffer_config_normalize(NULL, &odd, 4, &out));
    EXPECT_EQ_INT(out.dispatch_dtypes, EPX_DTYPE_BIT(EPX_DTYPE_BF16) | EPX_DTYPE_BIT(EPX_DTYPE_FP32) |
                                           EPX_DTYPE_BIT(EPX_DTYPE_FP8_E4M3));
    odd.hidden = 200;
    /* Row counts are int32: nranks * max_tokens must fit. */
    odd.max_tokens = (int64_t)1 << 30;
    EXPECT_RES(epx_api_buffer_config_normalize(NULL, &odd, 4, &out), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("row counts are int32");
    return 0;
}

static int test_entry_points_without_objects(void)
{
    EXPECT_OK(epx_buffer_destroy(NULL));
    EXPECT_OK(epx_handle_destroy(NULL));
    epx_buffer_t b = (epx_buffer_t)(uintptr_t)0x99;
    epx_buffer_config_t cfg = EPX_BUFFER_CONFIG_INIT;
    EXPECT_RES(epx_buffer_create(NULL, &cfg, &b), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("comm is NULL");
    EXPECT_TRUE(b == (epx_buffer_t)(uintptr_t)0x99);
    EXPECT_RES(epx_buffer_query_overflow(NULL), EPX_ERR_INVALID_ARG);
    EXPECT_RES(epx_ht_dispatch(NULL, NULL, NULL), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("buffer is NULL");
    /* A stale object is recognised by its magic. */
    struct epx_buffer dead;
    memset(&dead, 0, sizeof(dead));
    EXPECT_RES(epx_rm_combine(&dead, NULL, NULL), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("not a live epx buffer");
    epx_hook_t hook;
    memset(&hook, 0, sizeof(hook));
    EXPECT_RES(epx_hook_run(&hook, NULL), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("hook->buffer is NULL");
    return 0;
}

/* The API layer over a recording backend: sequence numbers, fail_collective on a failed check,
 * handles, [out] fields, and EPX_ERR_UNSUPPORTED for operations the backend lacks. */
static int test_fake_backend(void)
{
    struct epx_comm comm;
    memset(&comm, 0, sizeof(comm));
    comm.magic = EPX_COMM_MAGIC;
    comm.nranks = 1;
    comm.local_nranks = 1;
    comm.ranks_per_domain = 1;
    comm.num_domains = 1;
    comm.backend = EPX_BACKEND_HOST;
    comm.cuda_device = -1;
    comm.ops = &fake_ops;
    struct epx_buffer buffer;
    memset(&buffer, 0, sizeof(buffer));
    epx_buffer_config_t cfg = config_of(4, 128, 1, 2);
    EXPECT_OK(epx_api_buffer_config_normalize(&comm, &cfg, 1, &buffer.config));
    buffer.magic = EPX_BUFFER_MAGIC;
    buffer.comm = &comm;
    buffer.num_local_experts = 2;
    buffer.ops = &fake_ops;
    /* Entry points reach only registered objects. */
    EXPECT_OK(epx_api_register(&buffer, EPX_API_BUFFER));

    _Alignas(16) uint16_t x[4 * 128];
    _Alignas(16) uint16_t recv[8 * 128];
    int32_t topk[4] = {0, 1, -1, 1};
    epx_ht_dispatch_args_t a = {.size = sizeof(a), .version = EPX_VERSION_CODE};
    epx_ht_dispatch_outputs_t o = {.size = sizeof(o), .version = EPX_VERSION_CODE};
    a.x = epx_tensor_2d(x, EPX_DTYPE_BF16, 4, 128);
    a.topk_idx = epx_tensor_2d(topk, EPX_DTYPE_INT32, 4, 1);
    o.recv_x = epx_tensor_2d(recv, EPX_DTYPE_BF16, 8, 128);
    o.num_recv_tokens_host = -5;

    EXPECT_OK(epx_ht_dispatch(&buffer, &a, &o));
    EXPECT_EQ_INT(calls_ht_dispatch, 1);
    EXPECT_EQ_INT(last_dispatch_seq, 1);
    EXPECT_EQ_INT(o.num_recv_tokens_host, 3);
    EXPECT_TRUE(o.handle != NULL);
    EXPECT_EQ_INT(atomic_load(&buffer.live_handles), 1);
    epx_handle_info_t info;
    EXPECT_OK(epx_handle_get_info(o.handle, &info));
    EXPECT_EQ_INT(info.num_tokens, 4);
    EXPECT_EQ_INT(info.num_recv_tokens, 3);
    EXPECT_EQ_INT(info.num_local_experts, 2);
    epx_handle_t h = o.handle;

    /* A failed check: the backend op is not called, peers are told with the call's seq and
     * stream (so a capture of that stream survives), and the caller keeps the message of its own
     * failure. */
    topk[2] = 2;
    o.handle = NULL;
    a.stream = (void *)&calls_fail;
    EXPECT_RES(epx_ht_dispatch(&buffer, &a, &o), EPX_ERR_INVALID_ARG);
    EXPECT_MSG_HAS("topk_idx[2][0] = 2 is out of range [-1, 2)");
    EXPECT_EQ_INT(calls_ht_dispatch, 1);
    EXPECT_EQ_INT(calls_fail, 1);
    EXPECT_EQ_INT(last_fail_seq, 2);
    EXPECT_EQ_INT(last_fail_res, EPX_ERR_INVALID_ARG);
    EXPECT_TRUE(last_fail_stream == (void *)&calls_fail);
    EXPECT_TRUE(o.handle == NULL);

    /* An operation the backend lacks is refused by name, and still counts as a collective. */
    epx_ht_combine_args_t ca = {.size = sizeof(ca), .version = EPX_VERSION_CODE};
    epx_ht_combine_outputs_t co = {.size = sizeof(co), .version = EPX_VERSION_CODE};
    ca.handle = h;
    EXPECT_RES(epx_ht_combine(&buffer, &ca, &co), EPX_ERR_UNSUPPORTED);
    EXPECT_MSG_HAS("the fake backend does not implement epx_ht_combine");
    EXPECT_EQ_INT(last_fail_seq, 3);
    EXPECT_EQ_INT(buffer.seq, 3);
    /* Not collective: no sequence number taken. */
    epx_tensor_t topk_t = epx_tensor_2d(topk, EPX_DTYPE_INT32, 4, 1);
    epx_layout_outputs_t lo = {.size = sizeof(lo), .version = EPX_VERSION_CODE};
    EXPECT_RES(epx_get_dispatch_layout(&buffer, &topk_t, &lo, NULL), EPX_ERR_UNSUPPORTED);
    EXPECT_EQ_INT(buffer.seq, 3);

    /* Overflow is read and cleared from the buffer when the backend has no query. */
    atomic_store(&buffer.overflow, 1);
    EXPECT_RES(epx_buffer_query_overflow(&buffer), EPX_ERR_OVERFLOW);
    EXPECT_OK(epx_buffer_query_overflow(&buffer));

    EXPECT_OK(epx_handle_destroy(h));
    EXPECT_EQ_INT(atomic_load(&buffer.live_handles), 0);
    epx_api_retire(&buffer);
    return 0;
}

/* The registry names the backends, resolves AUTO to one this build can run and refuses the rest. */
static int test_backend_registry(void)
{
    EXPECT_TRUE(strcmp(epx_backend_name(EPX_BACKEND_AUTO), "auto") == 0);
    EXPECT_TRUE(strcmp(epx_backend_name(EPX_BACKEND_HOST), "host") == 0);
    EXPECT_TRUE(strcmp(epx_backend_name(EPX_BACKEND_CUDA), "cuda") == 0);
    EXPECT_TRUE(strcmp(epx_backend_name(9), "unknown") == 0);
    epx_backend_t chosen = EPX_BACKEND_AUTO;
    const epx_backend_ops_t *ops = NULL;
    EXPECT_OK(epx_backend_choose(EPX_BACKEND_HOST, &chosen, &ops));
    EXPECT_EQ_INT(chosen, EPX_BACKEND_HOST);
    EXPECT_TRUE(ops == &epx_host_backend_ops);
    EXPECT_OK(epx_backend_choose(EPX_BACKEND_AUTO, &chosen, &ops));
    EXPECT_TRUE(ops != NULL && strcmp(ops->name, epx_backend_name(chosen)) == 0);
    EXPECT_RES(epx_backend_choose((epx_backend_t)9, &chosen, &ops), EPX_ERR_INVALID_ARG);
#ifndef EPX_HAVE_CUDA
    EXPECT_EQ_INT(chosen, EPX_BACKEND_HOST);
    EXPECT_RES(epx_backend_choose(EPX_BACKEND_CUDA, &chosen, &ops), EPX_ERR_UNSUPPORTED);
    EXPECT_MSG_HAS("backend cuda was requested but this build has no CUDA support");
#endif
    return 0;
}

int main(void)
{
    if (test_dtypes() || test_struct_reading() || test_buffer_config() ||
        test_entry_points_without_objects() || test_fake_backend() || test_backend_registry())
        return 1;
    printf("ok\n");
    return 0;
}
