"""HybridEP-compatible front over epx's routing-map operations: `HybridEPBuffer` with dispatch, combine,
dispatch_with_permute and combine_with_unpermute, and `indices_to_map`, called as HybridEP's (DeepEP's
hybrid-ep branch) are. Needs torch. docs/compat.md ("HybridEP") compares every call with HybridEP's; the
main differences:

- Handles are tuples laid out as HybridEP's (7 elements from dispatch; 9 from dispatch_with_permute, 11
  with fuse_permute_dispatch=True) with the fields callers read filled the same way:
  [3] num_dispatched_tokens_tensor (int32 [1]), [4] local_expert_routing_map ([N_r, L] bool, HT order),
  [5] of a 9-element handle row_id_map ([N_r, L] int32, permuted row + 1, 0 where not routed), the
  token count, and the permute handles' last element the overflow flag (int32 [1], 1 when rows past
  num_permuted_tokens were dropped). The other fields are epx's own state or None.
- A dispatch with a handle dispatches again with the routing the handle kept (same outputs; the
  routing exchange is not skipped).
- combine(probs=) / combine_with_unpermute(probs=) return the probs in [T, E] as HybridEP does; epx
  carries them in a second combine call (exact bytes).
- Every call runs on the current stream. Without an upper bound (num_dispatched_tokens /
  num_permuted_tokens) the host waits for the received count, as HybridEP's blocking mode does.
"""

import os

import epx
from epx.compat import _torch  # torch, imported on first use

_NUM_TOPK_FLOOR = 8  # experts per token a default buffer takes (see HybridEPBuffer)


def indices_to_map(topk_idx, topk_weights, num_of_tokens, num_of_experts):
    """HybridEP's helper: topk_idx [T, K] (and topk_weights [T, K]) -> (routing_map [T, E] bool, probs [T, E]
    float32, or None without weights), on topk_idx's device. Slots outside [0, E) (-1: no expert) select
    nothing; weights of a repeated id add up."""
    torch = _torch()
    T, E = num_of_tokens, num_of_experts
    if topk_idx is None:
        raise ValueError("indices_to_map needs topk_idx")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != T:
        raise ValueError("topk_idx must be [%d, K], got %s" % (T, list(topk_idx.shape)))
    # Slots outside [0, E) go to a spare column E, dropped after: scattering them onto a real expert
    # would select it.
    valid = (topk_idx >= 0) & (topk_idx < E)
    col = torch.where(valid, topk_idx, torch.full_like(topk_idx, E)).long()
    routing_map = torch.zeros((T, E + 1), dtype=torch.bool, device=topk_idx.device)
    routing_map.scatter_(1, col, torch.ones_like(valid))
    routing_map = routing_map[:, :E].contiguous()
    probs = None
    if topk_weights is not None:
        if topk_weights.shape != topk_idx.shape:
            raise ValueError("topk_weights %s must have topk_idx's shape %s"
                             % (list(topk_weights.shape), list(topk_idx.shape)))
        probs = torch.zeros((T, E + 1), dtype=torch.float32, device=topk_idx.device)
        probs.scatter_add_(1, col, topk_weights.float())
        probs = probs[:, :E].contiguous()
    return routing_map, probs


def _dense(t):
    """t made contiguous where it is a tensor that is not (HybridEP takes any strides, as autograd hands
    gradients to the backward calls; epx reads rows densely). None and contiguous tensors unchanged."""
    return t.contiguous() if t is not None and hasattr(t, "is_contiguous") and not t.is_contiguous() else t


def _unsupported(**kwargs):
    bad = [name for name, (value, default) in kwargs.items() if value != default]
    if bad:
        raise NotImplementedError("epx.compat.hybrid_ep does not support: %s" % ", ".join(bad))


class _State:
    """epx's part of a handle: the epx handle, the routing it was made from (for a dispatch with the
    handle) and the layout a combine needs."""

    def __init__(self, handle, permute, pad_multiple, routing_map, rows, tokens_per_expert, bounded=False,
                 lib_rows=None):
        self.bounded = bounded  # made with a bound: handle[3] and [4] have the bounded shapes
        # A bound past what the library can produce: the library made lib_rows rows, the front padded them to
        # the bound with zeros, and a combine hands the library its first lib_rows rows.
        self.lib_rows = lib_rows
        self.handle = handle
        self.permute = permute
        self.pad_multiple = pad_multiple
        self.routing_map = routing_map
        self.rows = rows
        self.tokens_per_expert = tokens_per_expert

    def __repr__(self):
        return "epx.compat.hybrid_ep handle state (permute=%s, rows=%d)" % (self.permute, self.rows)


class HybridEPBuffer:
    """HybridEP's buffer over an epx communicator made from `group` (torch.distributed).

    Accepted as HybridEP accepts them and without effect in epx: num_sms_preprocessing_api,
    num_blocks_permute, num_blocks_unpermute, load_cached_kernels, use_shared_buffer,
    enable_custom_allgather, use_mnnvl, and earlier releases' num_sms_permute_api. Earlier releases'
    names num_of_ranks_per_nvlink_domain and nvlink_domain_size (and the environment's NVLINK_DOMAIN_SIZE)
    stand for num_of_hybrid_ep_ranks_per_nvlink_domain; num_of_experts (keyword) may replace
    num_local_experts, or must equal num_local_experts times the group size. num_sms_dispatch_api /
    num_sms_combine_api (None = epx's default) give the buffer's num_sms, their maximum.

    epx's own keywords: num_topk, the most experts one token may select (default max(8,
    group size), at most E; a routing map selecting more is refused, naming num_topk); max_pad_multiple
    (largest pad_multiple, default 128); comm (an epx.Comm to use instead of creating one from group).

    Topology: num_of_hybrid_ep_ranks_per_nvlink_domain, else NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN,
    else the domain epx detected. It sets the width L * ranks_per_domain of dispatched probs (as in
    HybridEP) and the attributes local_rank, node_rank, num_of_nodes; epx's transport uses its own
    detection (EPX_RANKS_PER_NVLINK_DOMAIN)."""

    def __init__(self, group=None, hidden_dim=None, max_num_of_tokens_per_rank=None, num_local_experts=None,
                 use_fp8=False, num_sms_dispatch_api=None, num_sms_combine_api=None,
                 num_sms_preprocessing_api=None, num_blocks_permute=None, num_blocks_unpermute=None,
                 load_cached_kernels=False, use_shared_buffer=True, enable_custom_allgather=False,
                 num_of_hybrid_ep_ranks_per_nvlink_domain=None, use_mnnvl=None, *, num_topk=None,
                 max_pad_multiple=128, comm=None, num_sms_permute_api=None,
                 num_of_ranks_per_nvlink_domain=None, nvlink_domain_size=None, num_of_experts=None):
        # Keywords of earlier HybridEP releases: the domain size under two older names, the experts in all.
        for older in (num_of_ranks_per_nvlink_domain, nvlink_domain_size):
            if num_of_hybrid_ep_ranks_per_nvlink_domain is None:
                num_of_hybrid_ep_ranks_per_nvlink_domain = older
        if num_local_experts is None and num_of_experts is not None:
            group_size = comm.nranks if comm is not None else _torch().distributed.get_world_size(group)
            if num_of_experts % group_size:
                raise ValueError("num_of_experts = %d is not a multiple of the group size %d"
                                 % (num_of_experts, group_size))
            num_local_experts = num_of_experts // group_size
        if hidden_dim is None or max_num_of_tokens_per_rank is None or num_local_experts is None:
            raise ValueError(
                "HybridEPBuffer needs hidden_dim, max_num_of_tokens_per_rank and num_local_experts")
        self.group = group
        self.comm = comm if comm is not None else epx.Comm.from_torch(group)
        self.rank, self.group_size = self.comm.rank, self.comm.nranks
        if self.comm.local_nranks < self.comm.nranks:
            # Every rank sees the same topology: all raise here.
            if comm is None:
                self.comm.destroy()
            raise NotImplementedError(
                "epx.compat.hybrid_ep is intranode only: the group spans %d machines (HybridEP's internode "
                "RDMA path, num_of_nodes > 1 over the network) needs epx's network path"
                % (self.comm.nranks // max(self.comm.local_nranks, 1)))
        per_domain = num_of_hybrid_ep_ranks_per_nvlink_domain
        for name in ("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", "NVLINK_DOMAIN_SIZE"):  # the second: older
            if per_domain is None and os.getenv(name):
                per_domain = int(os.environ[name])
        if per_domain is None:
            per_domain = self.comm.ranks_per_nvlink_domain
            if per_domain < 1 or self.group_size % per_domain:
                per_domain = self.group_size
        if per_domain < 1 or self.group_size % per_domain:
            raise ValueError("num_of_hybrid_ep_ranks_per_nvlink_domain = %d does not divide the group size %d"
                             % (per_domain, self.group_size))
        self.num_of_hybrid_ep_ranks_per_nvlink_domain = per_domain
        self.local_rank = self.rank % per_domain
        self.node_rank = self.rank // per_domain
        self.num_of_nodes = self.group_size // per_domain
        self.num_local_experts = num_local_experts
        self.num_of_experts = self.num_experts = num_local_experts * self.group_size
        if num_of_experts is not None and num_of_experts != self.num_experts:
            if comm is None:
                self.comm.destroy()
            raise ValueError("num_of_experts = %d, but num_local_experts %d * group size %d = %d"
                             % (num_of_experts, num_local_experts, self.group_size, self.num_experts))
        self.hidden_dim = hidden_dim
        self.use_fp8 = use_fp8
        # HybridEP rounds the tokens per rank up to a multiple of 16 and sizes its buffer for at least 512
        # whatever was asked.
        self.max_num_of_tokens_per_rank = max(-(-max_num_of_tokens_per_rank // 16) * 16, 512)
        E = self.num_experts
        self.num_topk = min(E, num_topk or max(_NUM_TOPK_FLOOR, self.group_size))
        self.max_pad_multiple = max_pad_multiple
        sms = [n for n in (num_sms_dispatch_api, num_sms_combine_api) if n is not None]
        self.buffer = epx.Buffer(self.comm, self.max_num_of_tokens_per_rank, hidden_dim, self.num_topk, E,
                                 modes="permute", dispatch_dtypes=["bf16", "fp8"] if use_fp8 else ["bf16"],
                                 max_pad_multiple=max_pad_multiple, num_sms=max(sms) if sms else 0)

    def empty_jit_cache(self):
        """HybridEP's JIT cache; epx compiles nothing at run time."""

    def update_template_config(self, hidden_dim=None, num_of_tokens_per_rank=None, num_local_experts=None,
                               pad_multiple=None, use_fp8=None, fuse_permute_dispatch=False,
                               max_num_of_tokens_per_rank=None, **kernel_settings):
        """HybridEP's per-call kernel configuration, which may grow its buffer. epx's buffer is sized once:
        values it holds are accepted (kernel settings without effect), others raise ValueError naming
        them. max_num_of_tokens_per_rank is an earlier release's name of num_of_tokens_per_rank. Not
        collective; returns None (HybridEP returns its kernel config)."""
        if num_of_tokens_per_rank is None:
            num_of_tokens_per_rank = max_num_of_tokens_per_rank
        tokens_cap = self.max_num_of_tokens_per_rank
        checks = (("hidden_dim", hidden_dim, hidden_dim is None or hidden_dim == self.hidden_dim,
                   "the buffer's hidden_dim is %d" % self.hidden_dim),
                  ("num_of_tokens_per_rank", num_of_tokens_per_rank,
                   num_of_tokens_per_rank is None or num_of_tokens_per_rank <= tokens_cap,
                   "above the buffer's max_num_of_tokens_per_rank = %d (epx buffers do not grow)"
                   % self.max_num_of_tokens_per_rank),
                  ("num_local_experts", num_local_experts,
                   num_local_experts is None or num_local_experts == self.num_local_experts,
                   "the buffer has %d" % self.num_local_experts),
                  ("pad_multiple", pad_multiple,
                   pad_multiple is None or pad_multiple <= max(self.max_pad_multiple, 1),
                   "above the buffer's max_pad_multiple = %d" % self.max_pad_multiple),
                  ("use_fp8", use_fp8, not use_fp8 or self.use_fp8, "the buffer was made with use_fp8=False"))
        for name, value, ok, why in checks:
            if not ok:
                raise ValueError("update_template_config: %s = %s, %s" % (name, value, why))

    def destroy(self):
        """Frees the epx buffer now (handles must be gone). Not collective."""
        self.buffer.destroy()

    # ------------------------------------------------------------------------------ helpers

    def _routing(self, hidden, routing_map, probs, topk_idx, topk_weights, num_of_experts, handle):
        """(routing_map [T, E] bool, probs [T, E] float32 or None) from either form. With a handle the
        routing is the handle's (as HybridEP's cached dispatch uses its handle's metadata and reads only
        the probs, or topk_weights, of the call)."""
        torch = _torch()
        if routing_map is not None:  # routing_map wins over topk_idx, as in HybridEP
            if isinstance(routing_map, torch.Tensor) and routing_map.dtype != torch.bool:
                raise ValueError("routing_map must be torch.bool, got %s" % routing_map.dtype)
        elif topk_idx is not None:
            if num_of_experts is None:
                raise ValueError("num_of_experts is required with topk_idx")
            if num_of_experts != self.num_experts:
                raise ValueError("num_of_experts = %d, the buffer has %d (num_local_experts * group size)"
                                 % (num_of_experts, self.num_experts))
            routing_map, from_weights = indices_to_map(topk_idx, topk_weights if probs is None else None,
                                                       hidden.shape[0], self.num_experts)
            probs = probs if probs is not None else from_weights
        if handle is not None:
            if not isinstance(handle, tuple) or not handle or not isinstance(handle[0], _State):
                raise ValueError("handle is not one from this front")
            if topk_weights is not None and topk_idx is None and probs is None:
                raise ValueError("topk_weights with a handle needs topk_idx too (it places the weights), or "
                                 "pass probs [T, E]")
            routing_map = handle[0].routing_map
        if routing_map is None:
            raise ValueError("pass routing_map (and probs), topk_idx (and topk_weights) or a handle")
        return routing_map, probs

    def _hidden(self, hidden, scaling_factor):
        """HybridEP's fp8 rows are uint8 bit patterns: epx takes them as float8_e4m3fn. bf16 rows carry no
        scaling factor (HybridEP ignores one)."""
        torch = _torch()
        fp8 = getattr(torch, "float8_e4m3fn", None)
        if isinstance(hidden, torch.Tensor) and hidden.dtype not in (torch.bfloat16, torch.uint8, fp8):
            raise epx.InvalidArgumentError("hidden must be bf16, or uint8 (fp8 bits) with use_fp8=True (got "
                                           "%s)" % hidden.dtype)
        if hidden.dtype in (torch.uint8, fp8) and not self.use_fp8:
            raise ValueError("%s (fp8) hidden needs a buffer made with use_fp8=True" % hidden.dtype)
        if hidden.dtype == torch.uint8:
            hidden = hidden.view(fp8)
        if hidden.dtype != fp8:
            scaling_factor = None
        return hidden, scaling_factor

    def _dispatch(self, kind, hidden, scaling_factor, routing_map, probs, handle, permute, pad_multiple,
                  bound, num_of_tokens_per_rank):
        """The common part of both dispatches, inside the refusal block."""
        torch = _torch()
        if handle is not None and (not isinstance(handle, tuple) or not isinstance(handle[0], _State)
                                   or handle[0].permute != permute):
            raise ValueError("handle is not one from %s of this front" % kind)
        T = hidden.shape[0]
        if num_of_tokens_per_rank is not None and num_of_tokens_per_rank < T:
            raise ValueError("num_of_tokens_per_rank = %d is below this rank's %d tokens"
                             % (num_of_tokens_per_rank, T))
        if max(T, num_of_tokens_per_rank or 0) > self.max_num_of_tokens_per_rank:
            raise ValueError("%d tokens per rank exceed the buffer's max_num_of_tokens_per_rank = %d (epx "
                             "buffers do not grow)" % (max(T, num_of_tokens_per_rank or 0),
                                                      self.max_num_of_tokens_per_rank))
        if isinstance(probs, torch.Tensor) and probs.dtype != torch.float32:
            probs = probs.float()
        hidden, scaling_factor, routing_map, probs = (_dense(t) for t in (hidden, scaling_factor, routing_map,
                                                                          probs))
        x, sf = self._hidden(hidden, scaling_factor)
        # HybridEP sizes its outputs to any bound; epx refuses one past what the buffer can produce, so the
        # library gets the largest it takes and the front pads the rest (rows no dispatch can fill) with
        # zeros.
        lib_bound = min(bound, self._bound_cap(permute)) if bound is not None and bound >= 0 else bound
        kw = {"num_permuted_tokens": lib_bound} if permute else {"num_dispatched_tokens": lib_bound}
        try:
            out = self.buffer.rm_dispatch(x, routing_map, probs, sf, permute=permute,
                                          pad_multiple=pad_multiple, local_map=True, **kw)
        except epx.InvalidArgumentError as e:
            if "more than K =" not in str(e):
                raise
            raise epx.InvalidArgumentError("%s (K is HybridEPBuffer's num_topk=, by default max(%d, group size))"
                                           % (e, _NUM_TOPK_FLOOR)) from e
        tokens = out.tokens.view(torch.uint8) if hidden.dtype == torch.uint8 else out.tokens
        probs_out, sf_out, lib_rows = out.probs, out.scaling_factor, None
        if lib_bound is not None and bound is not None and bound > lib_bound:
            lib_rows = lib_bound
            fp8 = getattr(torch, "float8_e4m3fn", None)
            tokens = self._pad_rows(tokens.view(torch.uint8) if tokens.dtype == fp8 else tokens, bound)
            if out.tokens.dtype == fp8 and hidden.dtype != torch.uint8:
                tokens = tokens.view(fp8)
            probs_out, sf_out = self._pad_rows(probs_out, bound), self._pad_rows(sf_out, bound)
        return out, tokens, probs_out, sf_out, lib_rows

    def _bound_cap(self, permute):
        """The largest bound the library takes (docs/reference.md): R * T_max rows without permute; with it
        R * T_max * min(K, L) + L * (max_pad_multiple - 1)."""
        plain = self.group_size * self.max_num_of_tokens_per_rank
        if not permute:
            return plain
        L = self.num_local_experts
        return plain * min(self.num_topk, L) + L * (max(self.max_pad_multiple, 1) - 1)

    @staticmethod
    def _pad_rows(t, rows):
        """t [n, ...] -> [rows, ...] with zero rows after its own (t itself when it has the rows)."""
        if t is None or t.shape[0] >= rows:
            return t
        torch = _torch()
        return torch.cat([t, torch.zeros((rows - t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype,
                                          device=t.device)])

    def _local_map(self, out, bounded):
        """(num_dispatched_tokens_tensor [1] int32, local_expert_routing_map [N_r, L] bool) of this rank, from
        the dispatch's own local_map output (each received token's local experts, written on the device:
        no group operation, capturable). [N_r, L] without a bound, [R * T_max, L] (rows past N_r select
        nothing) with one."""
        torch = _torch()
        cols = torch.as_tensor(out.local_map)  # numpy inputs give a numpy map: the same memory as torch's
        count = cols.any(dim=1).sum(dtype=torch.int32).reshape(1)
        if not bounded:
            return count, cols[:int(count.item())]  # the host waits for N_r anyway without a bound
        return count, cols

    @staticmethod
    def _overflow_flag(out, bound):
        """HybridEP's overflow flag (the handle's last element): int32 [1], 1 when the real row count passed
        the bound (rows were dropped), computed on the device from the count the dispatch wrote there (no
        host wait, so a captured call keeps it current); 0 without a bound."""
        torch = _torch()
        if bound is None or out.num_tokens_tensor is None:
            device = out.tokens.device
            return torch.zeros(1, dtype=torch.int32, device=device)
        return (out.num_tokens_tensor > bound).to(torch.int32)

    def _replayed_map(self, handle, bounded, num_tokens):
        """handle[4] in the shape of a replay with (bounded) or without a bound: the same routing, so the
        same received rows; [N_r, L] is the bounded map's first N_r rows (N_r is on the host without a
        bound), and the bounded [R * T_max, L] the unbounded one padded with rows that select nothing."""
        local_map = handle[4]
        if local_map is None or handle[0].bounded == bounded:
            return local_map
        if not bounded:
            return local_map[:num_tokens]
        return self._pad_rows(local_map, self.group_size * self.max_num_of_tokens_per_rank)

    @staticmethod
    def _row_id_map(local_map, tokens_per_expert):
        """HybridEP's row_id_map [rows, L] int32: 1 + the permuted row of (received token i, local expert j),
        0 where i did not select j. Group j starts after the earlier groups' padded rows and keeps the
        received order, as the permuted layout does; computed on the device (no host wait)."""
        if local_map is None:
            return None
        torch = _torch()
        padded = tokens_per_expert.to(device=local_map.device, dtype=torch.int32)
        starts = torch.cumsum(padded, 0, dtype=torch.int32) - padded
        within = torch.cumsum(local_map.to(torch.int32), 0, dtype=torch.int32)
        return torch.where(local_map, starts.unsqueeze(0) + within, torch.zeros_like(within))

    def _wide_probs(self, probs):
        """epx's [N, L] probs -> HybridEP's [N, L * ranks_per_domain], this rank's experts at
        [local_rank * L, (local_rank + 1) * L), zero elsewhere."""
        if probs is None:
            return None
        L, lr = self.num_local_experts, self.local_rank
        wide = _torch().zeros((probs.shape[0], L * self.num_of_hybrid_ep_ranks_per_nvlink_domain),
                              dtype=probs.dtype, device=probs.device)
        wide[:, lr * L:(lr + 1) * L] = probs
        return wide

    def _pack_probs(self, state, probs):
        """HybridEP's combined probs travel in a second routing-map combine: each float32 prob as its 4
        bytes, each a bf16 integer in [0, 255], at columns 4 * e .. 4 * e + 3 of its expert e. Only the
        rank owning e writes those columns, so the combine's sum is exact and the float32 bits come back
        unchanged. Returns the [rows, 4 * E] uint8 payload (checked before any combine is made)."""
        torch = _torch()
        L, E, r = self.num_local_experts, self.num_experts, self.rank
        if not isinstance(probs, torch.Tensor):
            raise ValueError("probs must be a torch tensor")
        n = probs.shape[0]
        packed = torch.zeros((n, 4 * E), dtype=torch.uint8, device=probs.device)
        if state.permute:
            if probs.dim() != 1:
                raise ValueError("probs must be [rows] float32 (the dispatch's permuted probs), got %s"
                                 % (list(probs.shape),))
            ends = torch.cumsum(state.tokens_per_expert.to(probs.device, torch.int64), 0)
            j = torch.searchsorted(ends, torch.arange(n, device=probs.device), right=True).clamp_(max=L - 1)
            cols = (r * L + j).unsqueeze(1) * 4 + torch.arange(4, device=probs.device)
            packed.scatter_(1, cols, probs.float().contiguous().view(torch.uint8).reshape(n, 4))
        else:
            width = L * self.num_of_hybrid_ep_ranks_per_nvlink_domain
            if probs.dim() != 2 or probs.shape[1] != width:
                raise ValueError("probs must be [rows, %d] float32 (the dispatch's probs), got %s"
                                 % (width, list(probs.shape)))
            own = probs[:, self.local_rank * L:(self.local_rank + 1) * L].float().contiguous()
            packed[:, 4 * r * L:4 * (r + 1) * L] = own.view(torch.uint8).reshape(n, 4 * L)
        return packed

    def _combine_packed(self, state, packed):
        """[T, E] float32 from _pack_probs' payload, in ceil(4E / H) combines (one when 4E <= H)."""
        torch = _torch()
        n, width, H = packed.shape[0], packed.shape[1], self.hidden_dim
        out = torch.empty((state.handle.num_tokens, width), dtype=torch.uint8, device=packed.device)
        step = H // 4 * 4 or H  # whole floats per combine; below 4 channels, bytes one channel each
        for c in range(0, width, step):
            w = min(step, width - c)
            x = torch.zeros((n, H), dtype=torch.bfloat16, device=packed.device)
            x[:, :w] = packed[:, c:c + w].to(torch.bfloat16)
            y = self.buffer.rm_combine(x, state.handle)
            out[:, c:c + w] = y[:, :w].float().round().to(torch.uint8)
        return out.view(torch.float32)

    def _combine(self, state, hidden, probs, weighted):
        """The combine of the hidden rows, then (with probs) of the probs; both collective. Rows the front
        padded past the library's (state.lib_rows) are left out: no dispatch filled them."""
        if state.lib_rows is not None:
            n = state.lib_rows
            hidden = hidden[:n] if hidden is not None and hidden.shape[0] > n else hidden
            probs = probs[:n] if probs is not None and probs.shape[0] > n else probs
        hidden, probs = _dense(hidden), _dense(probs)
        with epx.collective(self.buffer, epx.RM_COMBINE):
            packed = self._pack_probs(state, probs) if probs is not None else None
            combined = self.buffer.rm_combine(hidden, state.handle, weighted=weighted)
        if packed is None:
            return combined, None
        with epx.collective(self.buffer, epx.RM_COMBINE):
            return combined, self._combine_packed(state, packed)

    # -------------------------------------------------------------------------------- calls

    def dispatch(self, hidden, scaling_factor=None, topk_idx=None, topk_weights=None, num_of_experts=None,
                 probs=None, routing_map=None, num_dispatched_tokens_tensor=None, num_dispatched_tokens=None,
                 handle=None, num_of_tokens_per_rank=None, async_mode=False):
        """hidden [T, H] bf16 (or uint8 fp8 bits with scaling_factor [T, H/128]) -> (dispatched_token
        [N_r, H], dispatched_probs [N_r, L * ranks_per_domain] or None, dispatched_scaling_factor or None,
        handle). num_dispatched_tokens bounds the rows (no host wait; capturable); the
        num_dispatched_tokens_tensor argument is not read (as in HybridEP)."""
        with epx.collective(self.buffer, epx.RM_DISPATCH):
            _unsupported(async_mode=(async_mode, False))
            routing_map, probs = self._routing(hidden, routing_map, probs, topk_idx, topk_weights,
                                               num_of_experts, handle)
            out, tokens, d_probs, d_sf, lib_rows = self._dispatch(
                "dispatch", hidden, scaling_factor, routing_map, probs, handle, False, 1,
                num_dispatched_tokens, num_of_tokens_per_rank)
        bounded = num_dispatched_tokens is not None
        if handle is not None:
            count, local_map = handle[3], self._replayed_map(handle, bounded, out.num_tokens)
        else:
            count, local_map = self._local_map(out, bounded)
        if count is None:
            count = _torch().tensor([out.num_tokens], dtype=_torch().int32)
        state = _State(out.handle, False, 1, routing_map, out.num_tokens, None, bounded, lib_rows)
        new_handle = (state, None, None, count, local_map, hidden.shape[0], None)
        return tokens, self._wide_probs(d_probs), d_sf, new_handle

    def combine(self, hidden, probs=None, handle=None):
        """hidden [N_r, H] bf16 -> (combined_token [T, H] bf16, combined_probs [T, E] float32 or None): an
        unweighted sum over ranks. probs ([N_r, L * ranks_per_domain]): this rank's columns go back."""
        with epx.collective(self.buffer, epx.RM_COMBINE):
            state = self._state(handle, False, "dispatch")
        return self._combine(state, hidden, probs, False)

    def dispatch_with_permute(self, hidden=None, *, topk_idx=None, topk_weights=None,
                              num_of_experts_per_rank=None, num_of_experts=None, use_fp8=None,
                              routing_map=None, probs=None, scaling_factor=None, num_permuted_tokens=None,
                              pad_multiple=None, handle=None, non_blocking=False,
                              fuse_permute_dispatch=False, num_dispatched_tokens=None, use_host_meta=None,
                              num_of_tokens_per_rank=None):
        """hidden [T, H] -> (dispatched_token [P, H], dispatched_probs [P] or None, dispatched_scaling_factor
        or None, tokens_per_expert [L] int32 (padded), handle). Rows are grouped by local expert, each group
        padded to pad_multiple with zero rows. num_permuted_tokens bounds the rows (no host wait;
        capturable); non_blocking needs it. The handle has HybridEP's 9 elements ([5] row_id_map), or its 11
        with fuse_permute_dispatch=True ([7] the unpadded tokens per expert); epx permutes inside the
        dispatch either way. num_dispatched_tokens has no effect."""
        with epx.collective(self.buffer, epx.RM_DISPATCH):
            if use_host_meta is not None:
                non_blocking = not use_host_meta
            if num_of_experts_per_rank not in (None, self.num_local_experts):
                raise ValueError("num_of_experts_per_rank = %d, the buffer has %d"
                                 % (num_of_experts_per_rank, self.num_local_experts))
            if non_blocking and (num_permuted_tokens is None or num_permuted_tokens < 0):
                raise ValueError("non_blocking=True needs num_permuted_tokens (an upper bound on the rows)")
            if hidden is None:
                raise ValueError("dispatch_with_permute needs hidden")
            fp8_rows = (_torch().uint8, getattr(_torch(), "float8_e4m3fn", None))
            if use_fp8 is not None and use_fp8 != (hidden.dtype in fp8_rows):
                raise ValueError("use_fp8=%s does not match hidden's dtype %s" % (use_fp8, hidden.dtype))
            routing_map, probs = self._routing(hidden, routing_map, probs, topk_idx, topk_weights,
                                               num_of_experts, handle)
            if pad_multiple is not None and pad_multiple < 0:
                raise ValueError("pad_multiple = %d must be >= 1 (0 or None: 1)" % pad_multiple)
            pad = pad_multiple if pad_multiple and pad_multiple > 0 else 1
            if handle is not None and handle[0].pad_multiple != pad:
                raise ValueError("pad_multiple = %d, the handle's dispatch used %d"
                                 % (pad, handle[0].pad_multiple))
            out, tokens, p_probs, p_sf, lib_rows = self._dispatch(
                "dispatch_with_permute", hidden, scaling_factor, routing_map, probs, handle, True, pad,
                num_permuted_tokens, num_of_tokens_per_rank)
        bounded = num_permuted_tokens is not None
        if handle is not None:
            count, local_map = handle[3], self._replayed_map(handle, bounded, out.num_tokens)
        else:
            count, local_map = self._local_map(out, bounded)
        state = _State(out.handle, True, pad, routing_map, out.num_tokens, out.tokens_per_expert, bounded,
                       lib_rows)
        T = hidden.shape[0]
        overflow = self._overflow_flag(out, num_permuted_tokens)
        if fuse_permute_dispatch:
            unpadded = local_map.sum(dim=0, dtype=_torch().int32) if local_map is not None else None
            new_handle = (state, None, None, count, local_map, None, None, unpadded, T, None, overflow)
        else:
            row_id_map = self._row_id_map(local_map, out.tokens_per_expert)
            new_handle = (state, None, None, count, local_map, row_id_map, T, None, overflow)
        return tokens, p_probs, p_sf, out.tokens_per_expert, new_handle

    def combine_with_unpermute(self, hidden=None, *, probs=None, handle=None, pad_multiple=None,
                               fuse_unpermute_combine=False, num_dispatched_tokens=None,
                               apply_probs_to_hidden=False, weighted=False, non_blocking=False):
        """hidden [P, H] bf16 in the permuted layout -> (combined_token [T, H] bf16, combined_probs [T, E]
        float32 or None): the sum over (rank, local expert) of the token's rows. apply_probs_to_hidden=True
        first multiplies each row by its entry of probs ([P] float32, needed then), as HybridEP does;
        weighted=True (epx's own) weights each row by the prob it was dispatched with, in the library.
        pad_multiple, when given, must be the dispatch's; fuse_unpermute_combine (either handle layout is
        taken), num_dispatched_tokens and non_blocking (a combine never waits on the host) have no effect."""
        with epx.collective(self.buffer, epx.RM_COMBINE):
            state = self._state(handle, True, "dispatch_with_permute")
            if pad_multiple and pad_multiple > 0 and pad_multiple != state.pad_multiple:
                raise ValueError("pad_multiple = %d, the handle's dispatch used %d"
                                 % (pad_multiple, state.pad_multiple))
            if apply_probs_to_hidden:
                hidden = self._apply_probs(hidden, probs, weighted)
        return self._combine(state, hidden, probs, weighted)

    @staticmethod
    def _apply_probs(hidden, probs, weighted):
        """hidden [P, H] * probs [P] (fp32 product, bf16 rows) for apply_probs_to_hidden."""
        torch = _torch()
        if weighted:
            raise ValueError("pass apply_probs_to_hidden=True or weighted=True, not both")
        if not isinstance(probs, torch.Tensor):
            raise ValueError("apply_probs_to_hidden=True needs probs (the dispatch's permuted probs)")
        if probs.dim() != 1 or probs.shape[0] != hidden.shape[0]:
            raise ValueError("apply_probs_to_hidden: probs must be [%d] (one per row of hidden), got %s"
                             % (hidden.shape[0], list(probs.shape)))
        return (hidden.float() * probs.float().unsqueeze(1)).to(torch.bfloat16)

    @staticmethod
    def _state(handle, permute, kind):
        if handle is None:
            raise ValueError("the handle is necessary for a combine")
        if not isinstance(handle, tuple) or not handle or not isinstance(handle[0], _State):
            raise ValueError("handle is not one from %s of this front" % kind)
        if handle[0].permute != permute:
            raise ValueError("handle comes from %s, not from %s" % (
                "dispatch_with_permute" if handle[0].permute else "dispatch", kind))
        return handle[0]
