"""DeepEP-compatible front over epx: `from epx.compat.deep_ep import Buffer, Config, EventOverlap` in place
of `from deep_ep import ...`. Method and argument names follow DeepEP for the supported subset; an argument
epx cannot honour raises NotImplementedError naming it. Needs torch.

Differences to know:
- epx buffers are sized by shape, not bytes: num_nvl_bytes / num_rdma_bytes are accepted and unused; the
  HT buffer is created on the first dispatch (collectively, with T_max = the largest T over the group,
  rounded up to a power of two, re-created when a later call needs more) and the LL buffer on the first
  low_latency_dispatch (or clean_low_latency_buffer) with the given num_max_dispatch_tokens_per_rank.
- Every call runs on the current stream; there is no separate communication stream, so
  allocate_on_comm_stream is accepted and has nothing to change, and async_finish returns an
  EventOverlap whose event was recorded on the current stream.
- Handles are epx objects (HT) or tuples whose first elements match DeepEP's (LL:
  (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts, epx handle)).
- Receive order is deterministic (docs/reference.md), not arrival order.
"""

import weakref

import epx


def _torch():
    import torch

    epx._epx._refresh_torch()
    return torch


def _unsupported(**kwargs):
    bad = [name for name, (value, default) in kwargs.items()
           if (value is not None if default is None else value != default)]
    if bad:
        raise NotImplementedError("epx.compat.deep_ep does not support: %s" % ", ".join(bad))


class Config:
    """DeepEP's performance configuration. epx tunes chunking itself; num_sms is passed to the buffer."""

    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
                 num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256):
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens


class EventOverlap:
    """A CUDA event (or None on the CPU) plus tensors to keep alive until it completed."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self):
        if self.event is not None:
            _torch().cuda.current_stream().wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.current_stream_wait()


def _event(tensor, async_finish):
    if not async_finish:
        return EventOverlap()
    torch = _torch()
    if tensor is not None and tensor.is_cuda:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream())
        return EventOverlap(ev)
    return EventOverlap()


def _wait(previous_event):
    if previous_event is not None:
        previous_event.current_stream_wait()


class Buffer:
    """DeepEP's Buffer over an epx communicator made from `group` (torch.distributed)."""

    num_sms = 20

    def __init__(self, group=None, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 explicitly_destroy=False, comm=None):
        _unsupported(allow_nvlink_for_low_latency_mode=(allow_nvlink_for_low_latency_mode, True))
        import torch.distributed as dist

        self.group = group
        self.comm = comm if comm is not None else epx.Comm.from_torch(group)
        self.rank = self.comm.rank
        self.group_size = self.comm.nranks
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self._dist = dist
        self._ht = None  # (key, epx.Buffer)
        self._ll = None
        self._handles = weakref.WeakSet()  # HT handles given out: destroy() frees them with their buffers

    # ------------------------------------------------------------------ misc

    @classmethod
    def set_num_sms(cls, new_num_sms):
        cls.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks=None):
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks=None):
        return Config(Buffer.num_sms)

    def get_num_rdma_ranks(self):
        return 1

    def get_rdma_rank(self):
        return 0

    def get_root_rdma_rank(self, global_=False):
        return 0

    def get_local_device_id(self):
        return self.comm.cuda_device

    def destroy(self):
        """Frees the buffers and the communicator; handles given out before become unusable."""
        for h in list(self._handles):
            h.epx.destroy()
        self._handles.clear()
        for b in (self._ht, self._ll):
            if b is not None:
                b[1].destroy()
        self._ht = self._ll = None
        self.comm.destroy()

    # ------------------------------------------------------------------ buffers

    def _ht_agree(self, T):
        """Collective: the largest T over the group. T None: this rank refuses its dispatch before any
        buffer is chosen; every rank then raises (the others RemoteError), and no buffer sees a call."""
        torch = _torch()
        # The group's own device: gloo reduces CPU tensors, NCCL CUDA ones.
        on_cuda = epx._group_on_cuda(self._dist, self.group)
        device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else "cpu"
        t = torch.tensor([T or 0, T is None], dtype=torch.int64, device=device)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.group)
        if T is not None and int(t[1].item()):
            err = epx.RemoteError("rank %d: a peer rank refused its dispatch" % self.rank)
            err.message = err.args[0]
            raise err
        return max(int(t[0].item()), 1)

    def _ht_buffer(self, T, H, K, E, config):
        need = self._ht_agree(T)
        if self._ht is not None:
            (h, k, e), buf = self._ht
            if (h, k, e) == (H, K, E) and buf.max_tokens >= need:
                return buf
        t_max = 1 << (need - 1).bit_length()
        dtypes = None if H % 128 == 0 else ["bf16", "fp32"]
        num_sms = config.num_sms if config is not None else Buffer.num_sms
        buf = epx.Buffer(self.comm, t_max, H, K, E, modes="ht", dispatch_dtypes=dtypes, num_sms=num_sms)
        self._ht = ((H, K, E), buf)
        return buf

    def _ll_buffer(self, t_max, H, K, E):
        if self._ll is not None:
            key, buf = self._ll
            if key == (t_max, H, K, E):
                return buf
            buf.destroy()
        buf = epx.Buffer(self.comm, t_max, H, K, E, modes="ll", dispatch_dtypes="bf16")
        self._ll = ((t_max, H, K, E), buf)
        return buf

    # ------------------------------------------------------------------ HT

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        """topk_idx [T, K] -> (num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [T, R] bool, EventOverlap). Computed with torch ops (not collective, no buffer)."""
        torch = _torch()
        _wait(previous_event)
        R, L = self.group_size, num_experts // self.group_size
        valid = topk_idx >= 0
        rank_of = torch.where(valid, topk_idx // L, torch.full_like(topk_idx, -1))
        ranks = torch.arange(R, device=topk_idx.device, dtype=topk_idx.dtype)
        is_token_in_rank = (rank_of.unsqueeze(-1) == ranks).any(dim=1)
        num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
        num_tokens_per_expert = torch.bincount(topk_idx[valid].long(), minlength=num_experts).to(torch.int32)
        return (num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank,
                _event(topk_idx, async_finish))

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        """x [T, H] bf16/fp32, or (x_fp8 [T, H], scales [T, H/128] fp32). Returns (recv_x (a tuple for
        fp8), recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, EventOverlap).
        Whatever this rank refuses, the others raise RemoteError (epx.collective)."""
        if handle is not None:
            with epx.collective(self._ht_of(handle), epx.HT_DISPATCH):
                _unsupported(num_tokens_per_rdma_rank=(num_tokens_per_rdma_rank, None))
                _wait(previous_event)
                x, scales = (x if isinstance(x, tuple) else (x, None))
                out = handle.buffer.dispatch(x, x_scales=scales, handle=handle.epx)
                recv_x = (out.recv_x, out.recv_x_scales) if scales is not None else out.recv_x
                return recv_x, None, None, None, handle, _event(x, async_finish)
        # Without a handle the ranks first agree on the buffer: a refusal before that rides on the agreement.
        try:
            _unsupported(num_tokens_per_rdma_rank=(num_tokens_per_rdma_rank, None))
            _wait(previous_event)
            x, scales = (x if isinstance(x, tuple) else (x, None))
            if topk_idx is None or num_tokens_per_expert is None:
                raise ValueError("dispatch without a handle needs topk_idx and num_tokens_per_expert "
                                 "(from get_dispatch_layout)")
            T, H = x.shape
            K, E = topk_idx.shape[1], num_tokens_per_expert.numel()
        except BaseException:
            self._ht_agree(None)
            raise
        buf = self._ht_buffer(T, H, K, E, config)
        with epx.collective(buf, epx.HT_DISPATCH):
            out = buf.dispatch(x, topk_idx, topk_weights, x_scales=scales, expert_alignment=expert_alignment,
                               num_worst_tokens=num_worst_tokens)
        recv_x = (out.recv_x, out.recv_x_scales) if scales is not None else out.recv_x
        counts = out.num_recv_tokens_per_expert.tolist()
        handle = _HTHandle(buf, out.handle)
        self._handles.add(handle)
        return (recv_x, out.recv_topk_idx, out.recv_topk_weights, counts, handle, _event(x, async_finish))

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        """x [N_r, H] bf16 -> (combined_x [T, H] bf16, combined_topk_weights or None, EventOverlap)."""
        with epx.collective(self._ht_of(handle), epx.HT_COMBINE):
            _wait(previous_event)
            bias0, bias1 = (bias if isinstance(bias, tuple) else (bias, None))
            out = handle.buffer.combine(x, handle.epx, topk_weights=topk_weights, bias0=bias0, bias1=bias1)
            return out.combined_x, out.combined_topk_weights, _event(x, async_finish)

    def _ht_of(self, handle):
        """The HT buffer a call with `handle` goes to: the handle's, else the current one (None if none)."""
        if isinstance(handle, _HTHandle):
            return handle.buffer
        return self._ht[1] if self._ht is not None else None

    def _ll_current(self):
        return self._ll[1] if self._ll is not None else None

    # ------------------------------------------------------------------ LL

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts, num_topk=None):
        """Collective. epx LL buffers need no cleaning; this creates the LL buffer for these shapes now
        (num_topk defaults to the one of the existing LL buffer, else 8)."""
        K = num_topk or (self._ll[0][2] if self._ll is not None else 8)
        self._ll_buffer(num_max_dispatch_tokens_per_rank, hidden, K, num_experts)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False,
                             return_recv_hook=False):
        """Returns (recv_x or (recv_x_fp8, scales [L, R*T_max, H/128] view), recv_count, handle,
        EventOverlap, hook or None). What this rank refuses is refused on the current LL buffer (the
        others raise RemoteError when their call goes to it too)."""
        with epx.collective(self._ll_current(), epx.LL_DISPATCH):
            _unsupported(dispatch_wait_recv_cost_stats=(dispatch_wait_recv_cost_stats, None))
            H = x.shape[1]
            buf = self._ll_buffer(num_max_dispatch_tokens_per_rank, H, topk_idx.shape[1], num_experts)
            out = buf.ll_dispatch(x, topk_idx, cumulative_local_expert_recv_stats, use_fp8=use_fp8,
                                  round_scale=round_scale, use_ue8m0=use_ue8m0,
                                  return_recv_hook=return_recv_hook)
        recv_x = (out.recv_x, out.recv_scales.transpose(1, 2)) if use_fp8 else out.recv_x
        handle = (out.src_info, out.layout_range, num_max_dispatch_tokens_per_rank, H, num_experts,
                  out.handle)
        return recv_x, out.recv_count, handle, _event(x, async_finish), out.hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None,
                            combine_wait_recv_cost_stats=None):
        """x [L, R*T_max, H] bf16 -> (combined_x [T, H] bf16, EventOverlap, hook or None)."""
        buf = self._ll_current()
        with epx.collective(buf, epx.LL_COMBINE):
            _unsupported(use_logfmt=(use_logfmt, False),
                         combine_wait_recv_cost_stats=(combine_wait_recv_cost_stats, None))
            if out is not None and return_recv_hook:
                raise NotImplementedError(
                    "epx.compat.deep_ep does not support: out together with return_recv_hook")
            if buf is None:
                raise RuntimeError("low_latency_combine before any low_latency_dispatch")
            res = buf.ll_combine(None if zero_copy else x, topk_idx, topk_weights, handle[-1],
                                 zero_copy=zero_copy, return_recv_hook=return_recv_hook)
        combined = res.combined_x
        if out is not None:
            out.copy_(combined)
            combined = out
        return combined, _event(topk_idx, async_finish), res.hook

    def get_next_low_latency_combine_buffer(self, handle):
        """The [L, R*T_max, H] bf16 region that low_latency_combine(..., zero_copy=True) reads."""
        return self._ll[1].get_combine_buffer(handle[-1])


class _HTHandle:
    """An HT dispatch's handle with the epx buffer it belongs to."""

    __slots__ = ("buffer", "epx", "__weakref__")

    def __init__(self, buffer, handle):
        self.buffer = buffer
        self.epx = handle
