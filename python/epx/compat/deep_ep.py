"""DeepEP-compatible front over epx: `from epx.compat.deep_ep import Buffer, Config, EventOverlap` in place
of `from deep_ep import ...`. Calls, arguments and results follow DeepEP's intranode API (handles as DeepEP's
tuples, dispatch with or without top-k, static num_worst_tokens, LL with hooks, out, zero-copy, fp8); what
epx cannot honour raises NotImplementedError naming it. Needs torch. docs/compat.md lists every difference
from DeepEP and why.
"""

import os
import weakref

import epx
from epx.compat import _torch  # torch, imported on first use

from . import _deep_ep_ht as _ht

# topk_idx_t comes from __getattr__ (it needs torch); listing it lets `from ... import *` find it.
__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]


def __getattr__(name):  # torch is imported on first use, not with the module
    if name == "topk_idx_t":
        return _torch().int64
    # DeepEP's hybrid-ep branch serves HybridEPBuffer from the same package (its tests name
    # deep_ep.HybridEPBuffer): the HybridEP front's, imported on first use.
    if name in ("HybridEPBuffer", "indices_to_map"):
        from . import hybrid_ep

        return getattr(hybrid_ep, name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def _unsupported(**kwargs):
    bad = [name for name, (value, default) in kwargs.items()
           if (value is not None if default is None else value != default)]
    if bad:
        raise NotImplementedError("epx.compat.deep_ep does not support: %s" % ", ".join(bad))


# How HT dispatch outputs relate to the data buffer's memory, for Buffers made from now on (read from
# EPX_DEEPEP_VIEWS when the module is imported; docs/compat.md, "Native options"):
#   "pooled" (default): views of the buffer in areas reused only once no view of them is alive, copies when
#       every area is held: outputs behave as tensors of their own, as DeepEP's, with one pass over the bytes.
#   "0": copies (views=False).
#   "1": views valid until the next dispatch into their area (views=True, three areas: a dispatch takes one
#       no view of which is alive, else the least recently used), for MoE layers that consume the outputs
#       before the next call; no copies ever.
VIEWS = os.environ.get("EPX_DEEPEP_VIEWS", "pooled")


def _native_options():
    """THE place where the front chooses options of the native epx.Buffer for its HT data buffer: the view
    mode of VIEWS. A binding without pooled views makes copies (HTPath falls back to views=False)."""
    mode = str(VIEWS).strip().lower() or "pooled"
    if mode == "pooled":
        # view_areas=0 (the library's count) goes with it so that a binding without pooled views refuses the
        # keywords (TypeError) instead of taking "pooled" for true.
        return {"views": "pooled", "view_areas": 0}
    if mode == "1":
        return {"views": True, "view_areas": 3}
    if mode == "0":
        return {"views": False}
    raise ValueError("epx.compat.deep_ep: EPX_DEEPEP_VIEWS (deep_ep.VIEWS) must be pooled, 0 or 1 (got %r)"
                     % (VIEWS,))


class Config:
    """DeepEP's performance configuration. epx chunks by itself; num_sms is passed to the data buffer
    when the first dispatch makes it, the chunk sizes are kept and unused."""

    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
                 num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256):
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        """Bytes for num_nvl_bytes. epx sizes its buffers by shape and ignores the figure; this one is what
        DeepEP's ring buffers of this config take, so code that sums hints still gets a sane value."""
        channels = max(self.num_sms // 2, 1)
        per_token = hidden_bytes + 4 * 128 + 64
        return channels * num_ranks * self.num_max_nvl_chunked_recv_tokens * per_token + (1 << 20)

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        """0: intranode only (epx.compat.deep_ep has no network path)."""
        return 0


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


def _event(tensor, async_finish, extra=None):
    if not async_finish:
        return EventOverlap()
    torch = _torch()
    if tensor is not None and tensor.is_cuda:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream())
        return EventOverlap(ev, extra)
    return EventOverlap(None, extra)


def _wait(previous_event):
    if previous_event is not None:
        previous_event.current_stream_wait()


def _first_tensor(x):
    return x[0] if isinstance(x, tuple) else x


class Buffer:
    """DeepEP's Buffer over an epx communicator made from `group` (torch.distributed), or from `comm`: an
    mpi4py communicator, as DeepEP's `comm` (epx.Comm.from_mpi), or an epx.Comm. Collective to create, as
    DeepEP's."""

    num_sms = 20

    def __init__(self, group=None, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 use_fabric=False, explicitly_destroy=False, enable_shrink=False, comm=None):
        native_options = _native_options()  # a bad setting raises before anything collective
        self.group = group
        if comm is None:
            self.comm = epx.Comm.from_torch(group)
        elif isinstance(comm, epx.Comm):
            self.comm = comm
        else:
            self.comm = epx.Comm.from_mpi(comm)
        self._destroyed = False
        self.rank = self.comm.rank
        self.group_size = self.comm.nranks
        if self.comm.local_nranks < self.comm.nranks:
            # Every rank sees the same topology: all raise here.
            self.comm.destroy()
            raise NotImplementedError(
                "epx.compat.deep_ep is intranode only: the group spans %d machines (internode dispatch, "
                "num_rdma_bytes=%d over the network) needs epx's network path"
                % (self.comm.nranks // max(self.comm.local_nranks, 1), num_rdma_bytes))
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self._states = weakref.WeakSet()  # HT handles' states: destroy() frees their epx handles
        self._ht_path = _ht.HTPath(self.comm, native_options)
        self._ht_path.states = self._states
        self._ll = None  # ((T_max, H, K, E), epx.Buffer)
        self._mask = [0] * self.group_size  # enable_shrink: ranks this rank treats as absent in LL calls

    # ------------------------------------------------------------------ misc

    @staticmethod
    def is_sm90_compiled():
        """True: epx moves fp8 e4m3 on every backend."""
        return True

    @classmethod
    def set_num_sms(cls, new_num_sms):
        cls.num_sms = new_num_sms

    @staticmethod
    def capture():
        """An EventOverlap of an event recorded on the current stream (no event without CUDA)."""
        torch = _torch()
        if not torch.cuda.is_available():
            return EventOverlap()
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream())
        return EventOverlap(ev)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
        """Bytes of epx's LL buffer for these shapes (two slots of bf16 rows per local expert); epx sizes by
        shape and does not need the figure as num_rdma_bytes."""
        rows = num_max_dispatch_tokens_per_rank * num_ranks
        per_rank_experts = max(num_experts // max(num_ranks, 1), 1)
        return 2 * per_rank_experts * rows * (hidden * 2 + hidden // 128 * 4 + 16)

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

    def get_comm_stream(self):
        """The current stream: epx runs every call on the caller's stream. None on the CPU (the host
        backend has no streams, as its events are None)."""
        if self.comm.backend != "cuda":
            return None
        return _torch().cuda.current_stream()

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        raise NotImplementedError("epx.compat.deep_ep does not support: get_local_buffer_tensor (epx buffers "
                                  "are typed by shape, with no raw byte region to hand out)")

    def internode_dispatch(self, *args, **kwargs):
        raise NotImplementedError("epx.compat.deep_ep does not support: internode_dispatch (intranode only)")

    def internode_combine(self, *args, **kwargs):
        raise NotImplementedError("epx.compat.deep_ep does not support: internode_combine (intranode only)")

    def _check_live(self, what):
        if self._destroyed:
            raise ValueError("epx.compat.deep_ep: %s on a Buffer that was destroyed" % what)

    def destroy(self):
        """Frees the buffers and the communicator; handles given out before become unusable. Again: nothing."""
        if self._destroyed:
            return
        self._destroyed = True
        states = list(self._states)
        for state in states:
            state.epx.destroy()
        for state in states:
            if not state.buffer.destroyed:  # a data buffer a later, larger one replaced
                state.buffer.destroy()
        self._states.clear()
        self._ht_path.destroy()
        if self._ll is not None:
            self._ll[1].destroy()
        self._ll = None
        self.comm.destroy()

    # ------------------------------------------------------------------ HT

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        """topk_idx [T, K] -> (num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [T, R] bool, EventOverlap). Eleven torch kernels, no host synchronisation (not
        collective, no buffer)."""
        self._check_live("get_dispatch_layout")
        _wait(previous_event)
        per_rank, per_expert, is_token_in_rank = self._ht_path.layout(topk_idx, num_experts)
        return per_rank, None, per_expert, is_token_in_rank, _event(topk_idx, async_finish)

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        """x [T, H] bf16, or (x_fp8 [T, H], scales [T, H/128] fp32, any strides); other dtypes raise
        epx.InvalidArgumentError. Returns (recv_x (a tuple for fp8), recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, EventOverlap); a cached dispatch (with handle) returns
        (recv_x, None, None, None, None, EventOverlap), as DeepEP.
        Whatever this rank refuses, the others raise RemoteError (epx.collective)."""
        self._check_live("dispatch")
        if handle is not None:
            with epx.collective(self._ht_buffer_of(handle), epx.HT_DISPATCH):
                _ht.state_of(handle)
                _unsupported(num_tokens_per_rdma_rank=(num_tokens_per_rdma_rank, None),
                             topk_idx=(topk_idx, None), topk_weights=(topk_weights, None))
                _wait(previous_event)
            recv_x = self._ht_path.cached_dispatch(x, handle)
            return recv_x, None, None, None, None, _event(_first_tensor(x), async_finish)
        def precheck():
            _unsupported(num_tokens_per_rdma_rank=(num_tokens_per_rdma_rank, None))
            _wait(previous_event)

        num_sms = config.num_sms if config is not None else Buffer.num_sms
        recv_x, recv_idx, recv_w, counts, handle = self._ht_path.dispatch(
            x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
            expert_alignment, num_worst_tokens, num_sms, precheck=precheck)
        return recv_x, recv_idx, recv_w, counts, handle, _event(_first_tensor(x), async_finish)

    def _ht_buffer_of(self, handle):
        """The data buffer a call with `handle` goes to: the handle's, else the current one (None if none)."""
        if isinstance(handle, _ht.Handle):
            return handle._state.buffer
        return self._ht_path.data

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        """x [rows of the handle, H] bf16 -> (combined_x [T, H] bf16, combined_topk_weights or None,
        EventOverlap)."""
        self._check_live("combine")
        with epx.collective(self._ht_buffer_of(handle), epx.HT_COMBINE):
            _ht.state_of(handle)
            _wait(previous_event)
        combined, combined_w = self._ht_path.combine(x, handle, topk_weights, bias)
        return combined, combined_w, _event(x, async_finish)

    # ------------------------------------------------------------------ LL

    def _ll_current(self):
        return self._ll[1] if self._ll is not None else None

    def _ll_buffer(self, t_max, H, K, E):
        if self._ll is not None and self._ll[0] == (t_max, H, K, E):
            return self._ll[1]
        # The new buffer first (collective): when its creation fails (say one rank asked for other
        # shapes, so the others never joined), the current one stays, and calls that agree go on.
        buf = epx.Buffer(self.comm, t_max, H, K, E, modes="ll", dispatch_dtypes="bf16")
        if self._ll is not None:
            self._ll[1].destroy()
        self._ll = ((t_max, H, K, E), buf)
        return buf

    def _masked(self, topk_idx, num_experts):
        """enable_shrink: topk_idx with the experts of masked ranks set to -1 (itself when none is masked)."""
        if not any(self._mask):
            return topk_idx
        torch = _torch()
        L = num_experts // self.group_size
        masked = torch.tensor(self._mask, dtype=torch.bool, device=topk_idx.device)
        owner = torch.where(topk_idx >= 0, topk_idx // L, torch.zeros_like(topk_idx))
        return topk_idx.masked_fill(masked[owner] & (topk_idx >= 0), -1)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts, num_topk=None):
        """Collective. epx LL buffers need no cleaning; this makes the LL buffer for these shapes now
        (num_topk, an epx extra, defaults to the existing LL buffer's, else 8; a dispatch with another
        top-k width re-makes it)."""
        self._check_live("clean_low_latency_buffer")
        K = num_topk or (self._ll[0][2] if self._ll is not None else 8)
        self._ll_buffer(num_max_dispatch_tokens_per_rank, hidden, K, num_experts)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False,
                             return_recv_hook=False):
        """Returns (recv_x or (recv_x_fp8, scales [L, R*T_max, H/128] column-major view), recv_count, handle
        (DeepEP's 5-tuple), EventOverlap, hook or None). What this rank refuses is refused on the current LL
        buffer (the others raise RemoteError when their call goes to it too)."""
        self._check_live("low_latency_dispatch")
        with epx.collective(self._ll_current(), epx.LL_DISPATCH):
            _unsupported(dispatch_wait_recv_cost_stats=(dispatch_wait_recv_cost_stats, None))
            if x.dim() != 2 or topk_idx.dim() != 2:
                raise ValueError("epx.compat.deep_ep: low_latency_dispatch takes x [num_tokens, hidden] and topk_idx "
                                 "[num_tokens, num_topk] (got %d and %d dims)" % (x.dim(), topk_idx.dim()))
            if x.dtype != _torch().bfloat16:  # the LL buffer holds bf16 rows (fp8 is made from them)
                raise epx.InvalidArgumentError("epx.compat.deep_ep: low_latency_dispatch takes bf16 x (got "
                                               "%s)" % x.dtype)
            H = x.shape[1]
            buf = self._ll_buffer(num_max_dispatch_tokens_per_rank, H, topk_idx.shape[1], num_experts)
            out = buf.ll_dispatch(x, self._masked(topk_idx, num_experts), cumulative_local_expert_recv_stats,
                                  use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                                  return_recv_hook=return_recv_hook)
        recv_x = (out.recv_x, out.recv_scales.transpose(1, 2)) if use_fp8 else out.recv_x
        handle = LLHandle(out, num_max_dispatch_tokens_per_rank, H, num_experts, buf)
        keep = (x, topk_idx, recv_x, out.recv_count, cumulative_local_expert_recv_stats)
        return recv_x, out.recv_count, handle, _event(x, async_finish, keep), out.hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None,
                            combine_wait_recv_cost_stats=None):
        """x [L, R*T_max, H] bf16 -> (combined_x [T, H] bf16 (out when given), EventOverlap, hook or None).
        With return_recv_hook, combined_x (and out) hold the result once the hook ran. use_logfmt is
        accepted and the rows travel in bf16 (epx has no LogFMT encoding): the result is the exact combine,
        at least as precise as DeepEP's LogFMT one, without its smaller transfer."""
        self._check_live("low_latency_combine")
        buf = self._ll_current()
        with epx.collective(buf, epx.LL_COMBINE):
            _unsupported(combine_wait_recv_cost_stats=(combine_wait_recv_cost_stats, None))
            if buf is None:
                raise RuntimeError("epx.compat.deep_ep: low_latency_combine before any low_latency_dispatch")
            if not isinstance(handle, LLHandle) or handle.buffer is not buf:
                raise ValueError("epx.compat.deep_ep: handle must come from a low_latency_dispatch on the "
                                 "current LL buffer")
            if out is not None:
                want = (topk_idx.shape[0], handle[3])
                if tuple(out.shape) != want or out.dtype != _torch().bfloat16:
                    raise ValueError("epx.compat.deep_ep: out must be [num_tokens, hidden] = [%d, %d] bf16 (got %s "
                                     "%s)" % (want[0], want[1], list(out.shape), out.dtype))
            res = buf.ll_combine(None if zero_copy else x, self._masked(topk_idx, handle[4]), topk_weights,
                                 handle.epx, zero_copy=zero_copy, return_recv_hook=return_recv_hook)
        combined, hook = res.combined_x, res.hook
        if out is not None:
            if hook is None:
                out.copy_(combined)
            else:
                hook = _CopyAfterHook(hook, combined, out)
            combined = out
        keep = (x, topk_idx, topk_weights, combined)
        return combined, _event(topk_idx, async_finish, keep), hook

    def get_next_low_latency_combine_buffer(self, handle):
        """The [L, R*T_max, H] bf16 region that low_latency_combine(..., zero_copy=True) reads. It keeps the
        memory alive: a later re-make of the LL buffer (other shapes) or destroy() frees it when it goes."""
        self._check_live("get_next_low_latency_combine_buffer")
        return handle.buffer.get_combine_buffer(handle.epx)

    # ------------------------------------------------------------------ mask buffer (enable_shrink)

    def _check_shrink(self, what):
        self._check_live(what)
        if not self.enable_shrink:
            raise RuntimeError("epx.compat.deep_ep: %s needs Buffer(..., enable_shrink=True)" % what)

    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        """Local: this rank's LL calls treat rank_to_mask's experts as absent (mask) or present again."""
        self._check_shrink("low_latency_update_mask_buffer")
        if not 0 <= rank_to_mask < self.group_size:
            raise ValueError("epx.compat.deep_ep: rank_to_mask %d is not a rank of %d" % (rank_to_mask,
                                                                                      self.group_size))
        self._mask[rank_to_mask] = 1 if mask else 0

    def low_latency_query_mask_buffer(self, mask_status):
        """Writes this rank's mask into mask_status [R] int32 (1 = masked)."""
        self._check_shrink("low_latency_query_mask_buffer")
        torch = _torch()
        mask_status.copy_(torch.tensor(self._mask, dtype=mask_status.dtype, device="cpu"))

    def low_latency_clean_mask_buffer(self):
        self._check_shrink("low_latency_clean_mask_buffer")
        self._mask = [0] * self.group_size


class LLHandle(tuple):
    """DeepEP's LL handle: (src_info [L, R*T_max] int32, layout_range [L, R] int64,
    num_max_dispatch_tokens_per_rank, hidden, num_experts), with the epx handle and buffer beside it."""

    def __new__(cls, out, t_max, hidden, num_experts, buffer):
        obj = super().__new__(cls, (out.src_info, out.layout_range, t_max, hidden, num_experts))
        obj.epx, obj.buffer = out.handle, buffer
        return obj


class _CopyAfterHook:
    """The hook of an LL combine given `out`: runs the receive half, then fills out."""

    def __init__(self, hook, combined, out):
        self.hook, self.combined, self.out = hook, combined, out

    def __call__(self, *args, **kwargs):
        self.hook(*args, **kwargs)
        self.out.copy_(self.combined)
