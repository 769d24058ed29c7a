/*
 * cuda backend LL operations: the LL areas of the region, the two double-buffer slots with their
 * pending receive halves (hooks), stale-handle checks, the zero-copy view and the failure path.
 * No host synchronisation: device errors reach the comm through the poller. Kernels: src/kernels
 * (LL).
 */
#include <cuda_runtime.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "core/network.h"
#include "cuda/cuda.h"
#include "net/loop_host.h"
#ifdef EPX_HAVE_GIN_HOST
#include "net/gin_host.h"
#endif

enum { LL_PENDING_NONE = 0, LL_PENDING_DISPATCH = 1, LL_PENDING_COMBINE = 2 };

typedef struct ll_slot {
    uint64_t seq;  /* dispatch that owns the slot (0: none) */
    int valid;     /* its send half was launched */
    int recv_done; /* its receive half was launched */
    int32_t num_tokens;
    int pending; /* LL_PENDING_*: a receive half waiting for its hook */
    uint64_t pending_seq;
    epx_cuda_ll_args_t recv_args; /* the pending receive half */
    cudaEvent_t sent;             /* after the send half (eager calls), for a hook on another stream */
    int sent_recorded;
} ll_slot_t;

typedef struct cuda_ll {
    epx_cuda_ll_layout_t lay;
    /* Across nodes (src/kernels/ll_net.cu): the transport (one of loop, gin), its layout and our two
     * regions. */
    epx_loop_t *loop;
    void *gin;           /* epx_gin_t, in builds with the GIN host setup */
    atomic_int net_gone; /* the transport reported a peer gone: polled no more (its verdict stands) */
    epx_net_t net;
    epx_cuda_ll_net_layout_t nl;
    uint8_t *net_recv, *net_send;
    ll_slot_t slots[2];
    uint64_t dispatches_seen; /* buffer->ll_dispatches at our last dispatch */
    uint64_t last_disp_epoch; /* epoch of our last LL dispatch (0: none, or given back) */
} cuda_ll_t;

static uint64_t ll_align(uint64_t v, uint64_t a)
{
    return (v + a - 1) / a * a;
}

/* Offsets relative to `base`; the same numbers on every rank. */
static void ll_compute(epx_buffer_t b, uint64_t base, epx_cuda_ll_layout_t *l)
{
    /* Across nodes the areas peers write or read are the transport's (ll_net_compute): none here. */
    const uint64_t here = b->comm->num_nodes > 1 ? 0 : 1;
    const uint64_t R = (uint64_t)b->comm->nranks, T = (uint64_t)b->config.max_tokens;
    const uint64_t H = (uint64_t)b->config.hidden, K = (uint64_t)b->config.num_topk;
    const uint64_t L = (uint64_t)b->num_local_experts, RT = R * T;
    memset(l, 0, sizeof(*l));
    l->row_stride = ll_align(2 * H, 16) + 16; /* bf16 row, or fp8 row + H/128 fp32 scales; then t, k */
    uint64_t off = base;
    l->ctrl = off;
    off = ll_align(off + sizeof(epx_cuda_ll_ctrl_t), 256);
    l->cnt = off;
    off = ll_align(off + here * 2 * R * L * 4, 256);
    l->disp = off;
    off = ll_align(off + here * 2 * L * RT * l->row_stride, 256);
    l->comb = off;
    off = ll_align(off + here * 2 * T * K * H * 2, 256);
    l->zc = off;
    off = ll_align(off + here * 2 * L * RT * H * 2, 256);
    l->meta = off;
    off = ll_align(off + 2 * L * RT * 8, 256);
    l->rcount = off;
    off = ll_align(off + 2 * L * 4, 256);
    l->total = off - base;
}

/* The transport regions of a buffer across nodes (contract.h: epx_cuda_ll_net_layout_t). */
static void ll_net_compute(epx_buffer_t b, uint64_t row_stride, epx_cuda_ll_net_layout_t *n)
{
    const uint64_t R = (uint64_t)b->comm->nranks, T = (uint64_t)b->config.max_tokens;
    const uint64_t H = (uint64_t)b->config.hidden, K = (uint64_t)b->config.num_topk;
    const uint64_t L = (uint64_t)b->num_local_experts, E = (uint64_t)b->config.num_experts;
    memset(n, 0, sizeof(*n));
    uint64_t off = 0;
    n->r_cnt = off;
    off = ll_align(off + R * L * 4, 256);
    n->r_disp = off;
    off = ll_align(off + L * R * T * row_stride, 256);
    n->r_comb = off;
    off = ll_align(off + T * K * H * 2, 256);
    n->recv_slot = off;
    n->recv_bytes = 2 * off;
    off = 0;
    n->s_cnt = off;
    off = ll_align(off + E * 4, 256);
    n->s_msg = off;
    off = ll_align(off + T * row_stride, 256);
    n->s_tail = off;
    off = ll_align(off + T * K * 16, 256);
    n->s_zc = off;
    off = ll_align(off + L * R * T * H * 2, 256);
    n->send_slot = off;
    n->send_bytes = 2 * off;
}

/* Opens the network transport of a buffer across nodes (collective): EPX_NET_TRANSPORT=loop takes the
 * loop test transport (EPX_NET_LOOP_STRICT=1 its strict mode), gin NCCL's GIN (builds with NCCL). */
static epx_result_t ll_net_open(cuda_buffer_t *cb, cuda_ll_t *ll)
{
    epx_buffer_t b = cb->buffer;
    epx_comm_t comm = b->comm;
    const int me = comm->rank;
    const epx_params_t *p = NULL;
    EPX_CHECK(epx_params_get(&p));
    const char *t = p->net_transport;
    const int loop = strcmp(t, "loop") == 0, gin = strcmp(t, "gin") == 0;
    if (!loop && !gin)
        return epx_error(
            EPX_ERR_UNSUPPORTED,
            "rank %d: an LL buffer across %d nodes needs a network transport: EPX_NET_TRANSPORT=gin "
            "(NCCL GIN) or loop (the test transport, every rank on one machine), not '%s'",
            me, comm->num_nodes, t);
    ll_net_compute(b, ll->lay.row_stride, &ll->nl);
    if (gin) {
#ifdef EPX_HAVE_GIN_HOST
        epx_gin_open_args_t a;
        memset(&a, 0, sizeof(a));
        a.nregions = 2;
        a.region_bytes[EPX_LL_NET_RECV] = ll->nl.recv_bytes;
        a.region_bytes[EPX_LL_NET_SEND] = ll->nl.send_bytes;
        a.contexts = EPX_LL_NET_CONTEXTS;
        a.nsignals = EPX_LL_NET_SIGNALS(comm->nranks);
        epx_gin_t *g = NULL;
        EPX_CHECK(epx_gin_open(comm, &a, &g));
        ll->gin = g;
        ll->net = epx_gin_net(g);
        ll->net_recv = epx_gin_region(g, EPX_LL_NET_RECV);
        ll->net_send = epx_gin_region(g, EPX_LL_NET_SEND);
#else
        char why[192];
        return epx_error(EPX_ERR_UNSUPPORTED, "rank %d: EPX_NET_TRANSPORT=gin: %s", me,
                         epx_net_gin_unavailable(why, sizeof(why)));
#endif
    } else {
        epx_loop_open_args_t a;
        memset(&a, 0, sizeof(a));
        a.nregions = 2;
        a.region_bytes[EPX_LL_NET_RECV] = ll->nl.recv_bytes;
        a.region_bytes[EPX_LL_NET_SEND] = ll->nl.send_bytes;
        a.contexts = EPX_LL_NET_CONTEXTS;
        a.nsignals = EPX_LL_NET_SIGNALS(comm->nranks);
        a.strict = p->net_loop_strict != 0;
        EPX_CHECK(epx_loop_open(comm, &a, &ll->loop));
        ll->net = epx_loop_net(ll->loop);
        ll->net_recv = epx_loop_region(ll->loop, EPX_LL_NET_RECV);
        ll->net_send = epx_loop_region(ll->loop, EPX_LL_NET_SEND);
    }
    EPX_INFO(EPX_SUBSYS_LL,
             "rank %d: ll across %d nodes over %s%s: %llu + %llu bytes of regions, %u contexts", me,
             comm->num_nodes, t, loop && p->net_loop_strict ? " (strict)" : "",
             (unsigned long long)ll->nl.recv_bytes, (unsigned long long)ll->nl.send_bytes, ll->net.ncontexts);
    return EPX_SUCCESS;
}

uint64_t epx_cuda_ll_bytes(epx_buffer_t buffer)
{
    if (!(buffer->config.modes & EPX_MODE_LL)) return 0;
    epx_cuda_ll_layout_t l;
    ll_compute(buffer, 0, &l);
    return l.total;
}

epx_result_t epx_cuda_ll_init(cuda_buffer_t *cb)
{
    epx_buffer_t b = cb->buffer;
    const int me = b->comm->rank;
    cuda_ll_t *ll = calloc(1, sizeof(*ll));
    if (!ll) return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: ll state", me);
    ll_compute(b, cb->lay.ll, &ll->lay);
    for (int i = 0; i < 2; i++) {
        epx_result_t res =
            epx_cuda_check(cudaEventCreateWithFlags(&ll->slots[i].sent, cudaEventDisableTiming),
                           "cudaEventCreate(ll slot)", me);
        if (res != EPX_SUCCESS) {
            if (i == 1) (void)cudaEventDestroy(ll->slots[0].sent);
            free(ll);
            return res;
        }
    }
    if (b->comm->num_nodes > 1) {
        epx_result_t res = ll_net_open(cb, ll);
        if (res != EPX_SUCCESS) {
            for (int i = 0; i < 2; i++) (void)cudaEventDestroy(ll->slots[i].sent);
            free(ll);
            return res;
        }
    }
    cb->ll = ll;
    return EPX_SUCCESS;
}

void epx_cuda_ll_abort(cuda_buffer_t *cb)
{
    cuda_ll_t *ll = cb->ll;
    if (ll && ll->loop) epx_loop_abort(ll->loop);
#ifdef EPX_HAVE_GIN_HOST
    if (ll && ll->gin) epx_gin_abort(ll->gin);
#endif
}

epx_result_t epx_cuda_ll_poll(cuda_buffer_t *cb)
{
    cuda_ll_t *ll = cb->ll;
    if (!ll || atomic_load(&ll->net_gone)) return EPX_SUCCESS; /* said once: the abort word is set */
    epx_result_t res = EPX_SUCCESS;
    if (ll->loop) res = epx_loop_poll(ll->loop);
#ifdef EPX_HAVE_GIN_HOST
    if (ll->gin) res = epx_gin_poll(ll->gin);
#endif
    if (res != EPX_SUCCESS) atomic_store(&ll->net_gone, 1);
    return res;
}

void epx_cuda_ll_fini(cuda_buffer_t *cb)
{
    cuda_ll_t *ll = cb->ll;
    if (!ll) return;
    for (int i = 0; i < 2; i++) (void)cudaEventDestroy(ll->slots[i].sent);
    epx_result_t res = EPX_SUCCESS;
    if (ll->loop) res = epx_loop_close(ll->loop);
#ifdef EPX_HAVE_GIN_HOST
    if (ll->gin) res = epx_gin_close(ll->gin);
#endif
    if (res != EPX_SUCCESS)
        EPX_WARN(EPX_SUBSYS_LL, "rank %d: closing the network transport: %s", cb->buffer->comm->rank,
                 epx_last_error_message());
    free(ll);
    cb->ll = NULL;
    if (cb->ll_stamps) (void)cudaFree(cb->ll_stamps);
    cb->ll_stamps = NULL;
}

void epx_cuda_ll_fill(cuda_buffer_t *cb, int slot, epx_cuda_ll_args_t *a)
{
    const cuda_ll_t *ll = cb->ll;
    memset(a, 0, sizeof(*a));
    epx_cuda_fill_common(cb, &a->c);
    a->ll = ll->lay;
    a->slot = slot;
    a->num_experts = cb->buffer->config.num_experts;
    a->stamps = cb->ll_stamps;
    a->net = ll->net;
    a->nl = ll->nl;
    a->net_recv = ll->net_recv;
    a->net_send = ll->net_send;
}

/* The launch of one half: the network path on a buffer across nodes. */
static int ll_launch_half(const epx_cuda_ll_args_t *a, int dispatch, int32_t phase, void *stream)
{
    if (a->net.transport != EPX_NET_TRANSPORT_NONE) return epx_cuda_launch_ll_net(a, dispatch, phase, stream);
    if (dispatch)
        return phase == EPX_LL_PHASE_SEND ? epx_cuda_launch_ll_dispatch_send(a, stream)
                                          : epx_cuda_launch_ll_dispatch_recv(a, stream);
    return phase == EPX_LL_PHASE_SEND ? epx_cuda_launch_ll_combine_send(a, stream)
                                      : epx_cuda_launch_ll_combine_recv(a, stream);
}

/* Starts an LL call. A device failure of an earlier LL call reaches the comm now rather than at
 * the poller's next look, so a caller that synchronised and then calls again sees it in
 * epx_get_async_error. */
static epx_result_t ll_begin(epx_cuda_op_t *op, epx_buffer_t buffer, uint64_t seq, void *stream)
{
    cuda_buffer_t *cb = buffer->backend_state;
    const cuda_ll_t *ll = cb->ll;
    const volatile epx_cuda_host_block_t *hb = cb->host;
    if (ll && hb->err.code != 0) {
        (void)epx_cuda_report_record(cb, 1, 0);
        /* Across nodes a device failure leaves the ranks' call counts out of step (docs/reference.md). */
        if (ll->net.transport != EPX_NET_TRANSPORT_NONE)
            return epx_error(
                (epx_result_t)hb->err.code,
                "rank %d: an LL call of this buffer across nodes failed at collective epoch %llu (see "
                "epx_get_async_error); the ranks are out of step: destroy the buffer",
                buffer->comm->rank, (unsigned long long)hb->err.epoch);
    }
    return epx_cuda_op_begin(op, buffer, seq, stream);
}

/* Our last LL dispatch met another kind of call on a peer (EPX_ERR_MISMATCH recorded at its epoch,
 * the peer's call word not an LL dispatch): that peer took no LL slot, so ours is given back and
 * every rank's next LL dispatch takes the same slot. The device releases what the failed epoch
 * held (release_if_failed). Seen when the record has arrived: after the caller synchronised with
 * the failed call (its error reached it). */
static void ll_give_back_slot(cuda_buffer_t *cb, cuda_ll_t *ll)
{
    const volatile epx_cuda_host_block_t *hb = cb->host;
    if (ll->last_disp_epoch == 0 || hb->err.code != EPX_ERR_MISMATCH || hb->err.epoch != ll->last_disp_epoch)
        return;
    if (((uint32_t)hb->err.expected & 15) != EPX_CUDA_CALL_LL_DISPATCH ||
        ((uint32_t)hb->err.seen & 15) == EPX_CUDA_CALL_LL_DISPATCH)
        return;
    ll->last_disp_epoch = 0;
    cb->buffer->ll_dispatches--;
    EPX_INFO(EPX_SUBSYS_LL, "rank %d: ll dispatch of epoch %llu met another kind of call: its slot is given back",
             cb->buffer->comm->rank, (unsigned long long)hb->err.epoch);
}

/* A new call on `slot` drops the slot's receive half that never ran; the send kernel releases it. */
static void ll_take_drops(ll_slot_t *sl, epx_cuda_ll_args_t *a)
{
    a->drop_disp = sl->pending == LL_PENDING_DISPATCH;
    a->drop_comb = sl->pending == LL_PENDING_COMBINE;
    sl->pending = LL_PENDING_NONE;
}

/* After the send half: its event, for a hook run on another stream (not under capture). */
static void ll_mark_sent(ll_slot_t *sl, const epx_cuda_op_t *op)
{
    sl->sent_recorded = 0;
    if (op->capturing) return;
    if (cudaEventRecord(sl->sent, (cudaStream_t)op->stream) == cudaSuccess)
        sl->sent_recorded = 1;
    else
        (void)cudaGetLastError();
}

void epx_cuda_ll_dispatch_args(const epx_ll_dispatch_args_t *args, epx_cuda_ll_args_t *a)
{
    a->use_fp8 = args->use_fp8 != 0;
    a->round_scale = args->round_scale != 0;
    a->use_ue8m0 = args->use_ue8m0 != 0;
    a->num_tokens = args->x.shape[0];
    a->topk_idx = args->topk_idx.data;
    a->idx_is_64 = args->topk_idx.dtype == EPX_DTYPE_INT64;
    a->x = args->x.data;
}

epx_result_t epx_cuda_ll_dispatch(epx_buffer_t buffer, uint64_t seq, const epx_ll_dispatch_args_t *args,
                                  epx_ll_dispatch_outputs_t *outputs)
{
    cuda_buffer_t *cb = buffer->backend_state;
    cuda_ll_t *ll = cb->ll;
    const int me = buffer->comm->rank;
    epx_cuda_op_t op;
    EPX_CHECK(ll_begin(&op, buffer, seq, args->stream)); /* peers must not wait for us */
    if (!ll)
        return epx_cuda_op_refuse(&op, epx_error(EPX_ERR_INTERNAL, "rank %d: buffer has no ll state", me));
    ll_give_back_slot(cb, ll);
    const int slot = (int)((buffer->ll_dispatches - 1) % 2);
    ll_slot_t *sl = &ll->slots[slot];

    epx_cuda_ll_args_t a;
    epx_cuda_ll_fill(cb, slot, &a);
    ll_take_drops(sl, &a);
    sl->seq = seq;
    sl->valid = 0;
    sl->recv_done = 0;
    sl->num_tokens = (int32_t)args->x.shape[0];
    epx_cuda_ll_dispatch_args(args, &a);
    a.recv_x = outputs->recv_x.data;
    a.recv_scales = outputs->recv_scales.data;
    a.recv_count = outputs->recv_count.data;
    a.src_info = outputs->src_info.data;
    a.layout_range = outputs->layout_range.data;
    a.cumulative = args->cumulative_recv_stats.data;
    a.c.call_sig = epx_cuda_sig(EPX_CUDA_CALL_LL_DISPATCH, a.use_fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16, 0, 0);

    EPX_CHECK(epx_cuda_op_sent(&op, ll_launch_half(&a, 1, EPX_LL_PHASE_SEND, args->stream),
                               "ll dispatch send launch"));
    ll->dispatches_seen = buffer->ll_dispatches;
    ll->last_disp_epoch = op.epoch;
    ll_mark_sent(sl, &op);
    sl->valid = 1;
    EPX_TRACE(EPX_SUBSYS_LL, "rank %d: ll dispatch seq %llu epoch %llu slot %d T %lld%s%s", me,
              (unsigned long long)seq, (unsigned long long)op.epoch, slot, (long long)a.num_tokens,
              a.use_fp8 ? " fp8" : "", args->return_recv_hook ? " hook" : "");
    epx_ll_handle_t handle = {seq, slot, sl->num_tokens};
    a.drop_disp = a.drop_comb = 0;
    if (args->return_recv_hook) {
        sl->recv_args = a;
        sl->pending = LL_PENDING_DISPATCH;
        sl->pending_seq = seq;
        outputs->handle = handle;
        outputs->hook = (epx_hook_t){buffer, seq, LL_PENDING_DISPATCH, slot};
        return epx_cuda_op_record(&op);
    }
    EPX_CHECK(epx_cuda_op_launched(&op, ll_launch_half(&a, 1, EPX_LL_PHASE_RECV, args->stream),
                                   "ll dispatch recv launch"));
    sl->recv_done = 1;
    outputs->handle = handle;
    return EPX_SUCCESS;
}

epx_result_t epx_cuda_ll_check_handle(cuda_buffer_t *cb, const epx_ll_handle_t *handle, const char *what)
{
    cuda_ll_t *ll = cb->ll;
    const int me = cb->buffer->comm->rank;
    if (!ll) return epx_error(EPX_ERR_INTERNAL, "rank %d: %s: buffer has no ll state", me, what);
    if (handle->slot < 0 || handle->slot > 1)
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d: %s: handle slot %d is not 0 or 1", me, what,
                         handle->slot);
    const ll_slot_t *sl = &ll->slots[handle->slot];
    if (sl->seq != handle->seq || !sl->valid)
        return epx_error(EPX_ERR_INVALID_ARG,
                         "rank %d: %s: stale ll handle (dispatch seq %llu, slot %d now holds seq %llu%s)", me,
                         what, (unsigned long long)handle->seq, handle->slot, (unsigned long long)sl->seq,
                         sl->valid ? "" : ", failed");
    if (handle->num_tokens != sl->num_tokens)
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d: %s: handle has T = %d, its dispatch had T = %d", me,
                         what, handle->num_tokens, sl->num_tokens);
    if (!sl->recv_done)
        return epx_error(EPX_ERR_INVALID_ARG,
                         "rank %d: %s: the receive hook of dispatch seq %llu has not run", me, what,
                         (unsigned long long)handle->seq);
    return EPX_SUCCESS;
}

void *epx_cuda_ll_zc_ptr(cuda_buffer_t *cb, int slot)
{
    cuda_ll_t *ll = cb->ll;
    epx_buffer_t b = cb->buffer;
    if (ll->net_send) return ll->net_send + (uint64_t)slot * ll->nl.send_slot + ll->nl.s_zc;
    const uint64_t view = (uint64_t)b->num_local_experts * (uint64_t)b->comm->nranks *
                          (uint64_t)b->config.max_tokens * (uint64_t)b->config.hidden * 2;
    return cb->region + ll->lay.zc + (uint64_t)slot * view;
}

epx_result_t epx_cuda_ll_combine(epx_buffer_t buffer, uint64_t seq, const epx_ll_combine_args_t *args,
                                 epx_ll_combine_outputs_t *outputs)
{
    cuda_buffer_t *cb = buffer->backend_state;
    cuda_ll_t *ll = cb->ll;
    const int me = buffer->comm->rank;
    epx_cuda_op_t op;
    EPX_CHECK(ll_begin(&op, buffer, seq, args->stream));
    epx_result_t res = epx_cuda_ll_check_handle(cb, &args->handle, "ll combine");
    if (res == EPX_SUCCESS && args->topk_idx.shape[0] != args->handle.num_tokens)
        res = epx_error(EPX_ERR_INVALID_ARG,
                        "rank %d: ll combine: topk_idx has %lld rows, the dispatch had T = %d", me,
                        (long long)args->topk_idx.shape[0], args->handle.num_tokens);
    if (res != EPX_SUCCESS) return epx_cuda_op_refuse(&op, res);
    const int slot = args->handle.slot;
    ll_slot_t *sl = &ll->slots[slot];
    epx_cuda_ll_args_t a;
    epx_cuda_ll_fill(cb, slot, &a);
    ll_take_drops(sl, &a);
    a.num_tokens = args->handle.num_tokens;
    a.topk_idx = args->topk_idx.data;
    a.idx_is_64 = args->topk_idx.dtype == EPX_DTYPE_INT64;
    a.y = args->zero_copy ? (const uint16_t *)epx_cuda_ll_zc_ptr(cb, slot) : (const uint16_t *)args->y.data;
    a.topk_weights = args->topk_weights.data;
    a.combined_x = outputs->combined_x.data;
    a.c.call_sig = epx_cuda_sig(EPX_CUDA_CALL_LL_COMBINE, 0, 0, args->handle.seq);
    EPX_CHECK(epx_cuda_op_sent(&op, ll_launch_half(&a, 0, EPX_LL_PHASE_SEND, args->stream),
                               "ll combine send launch"));
    ll_mark_sent(sl, &op);
    EPX_TRACE(EPX_SUBSYS_LL, "rank %d: ll combine seq %llu of dispatch %llu epoch %llu slot %d%s%s", me,
              (unsigned long long)seq, (unsigned long long)args->handle.seq, (unsigned long long)op.epoch,
              slot, args->zero_copy ? " zero-copy" : "", args->return_recv_hook ? " hook" : "");
    a.drop_disp = a.drop_comb = 0;
    if (args->return_recv_hook) {
        sl->recv_args = a;
        sl->pending = LL_PENDING_COMBINE;
        sl->pending_seq = seq;
        outputs->hook = (epx_hook_t){buffer, seq, LL_PENDING_COMBINE, slot};
        return epx_cuda_op_record(&op);
    }
    return epx_cuda_op_launched(&op, ll_launch_half(&a, 0, EPX_LL_PHASE_RECV, args->stream),
                                "ll combine recv launch");
}

epx_result_t epx_cuda_ll_get_combine_buffer(epx_buffer_t buffer, const epx_ll_handle_t *handle,
                                            epx_tensor_t *view_out)
{
    cuda_buffer_t *cb = buffer->backend_state;
    EPX_CHECK(epx_cuda_ll_check_handle(cb, handle, "ll combine buffer"));
    /* The view is this rank's own memory: no peer writes it, and the previous combine of the slot
     * read it earlier on the caller's stream. The caller's writes must be ordered before the combine
     * on its stream (a cudaMemcpy from pageable memory on the legacy stream is not). */
    epx_tensor_t v =
        epx_tensor_3d(epx_cuda_ll_zc_ptr(cb, handle->slot), EPX_DTYPE_BF16, buffer->num_local_experts,
                      (int64_t)buffer->comm->nranks * buffer->config.max_tokens, buffer->config.hidden);
    v.device_type = EPX_DEVICE_CUDA;
    v.device_id = cb->device;
    *view_out = v;
    return EPX_SUCCESS;
}

epx_result_t epx_cuda_hook_run(const epx_hook_t *hook, void *stream)
{
    epx_buffer_t buffer = hook->buffer;
    cuda_buffer_t *cb = buffer->backend_state;
    cuda_ll_t *ll = cb->ll;
    const int me = buffer->comm->rank;
    if (!ll || hook->slot < 0 || hook->slot > 1 ||
        (hook->kind != LL_PENDING_DISPATCH && hook->kind != LL_PENDING_COMBINE))
        return epx_error(EPX_ERR_INVALID_ARG, "rank %d: hook with slot %d, kind %d is not an ll hook", me,
                         hook->slot, hook->kind);
    ll_slot_t *sl = &ll->slots[hook->slot];
    if (sl->pending != hook->kind || sl->pending_seq != hook->seq)
        return epx_error(EPX_ERR_INVALID_ARG,
                         "rank %d: hook of seq %llu already ran or its slot %d was reused", me,
                         (unsigned long long)hook->seq, hook->slot);
    /* The receive half belongs to the epoch its send half took: nothing here is refused. */
    epx_cuda_op_t op;
    EPX_CHECK(ll_begin(&op, buffer, 0, stream));
    /* A hook run on another stream than its send half still follows it. */
    if (sl->sent_recorded && !op.capturing)
        EPX_CHECK(epx_cuda_check(cudaStreamWaitEvent((cudaStream_t)stream, sl->sent, 0),
                                 "cudaStreamWaitEvent", me));
    const int is_dispatch = hook->kind == LL_PENDING_DISPATCH;
    const int err = ll_launch_half(&sl->recv_args, is_dispatch, EPX_LL_PHASE_RECV, stream);
    EPX_CHECK(
        epx_cuda_op_launched(&op, err, is_dispatch ? "ll dispatch recv launch" : "ll combine recv launch"));
    sl->pending = LL_PENDING_NONE;
    if (is_dispatch) sl->recv_done = 1;
    return EPX_SUCCESS;
}

void epx_cuda_ll_on_fail(cuda_buffer_t *cb, void *stream)
{
    cuda_ll_t *ll = cb->ll;
    if (!ll) return;
    epx_buffer_t b = cb->buffer;
    epx_cuda_ll_args_t a;
    epx_cuda_ll_fill(cb, 0, &a);
    if (b->ll_dispatches != ll->dispatches_seen) {
        /* The failed call was an LL dispatch: its slot's old contents are abandoned. */
        ll->dispatches_seen = b->ll_dispatches;
        a.slot = (int)((b->ll_dispatches - 1) % 2);
        a.drop_disp = 1;
        ll_slot_t *sl = &ll->slots[a.slot];
        sl->pending = LL_PENDING_NONE;
        sl->valid = 0;
        sl->recv_done = 0;
        sl->seq = 0;
    }
    /* Across nodes nothing is released: a call refused on every rank (the same bad handle everywhere)
     * moved no signal, so the ranks stay in step; where only some refuse, the others' waits on them end
     * at the deadline and fail the buffer (src/kernels/ll_net.cu). */
    if (ll->net.transport != EPX_NET_TRANSPORT_NONE) return;
    if (epx_cuda_launch_ll_fail(&a, stream) != cudaSuccess) (void)cudaGetLastError();
}
