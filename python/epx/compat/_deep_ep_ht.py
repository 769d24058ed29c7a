"""The high-throughput half of epx.compat.deep_ep: DeepEP's intranode dispatch and combine over epx.Buffer.

A dispatch without a handle first exchanges counts, as DeepEP's notify step does, through a small epx
dispatch on a buffer made at construction (the "notify buffer"): each rank sends every rank one fp32 row
with its num_tokens_per_rank, the destination's slice of num_tokens_per_expert and a few shape fields.
From the rows every rank learns the rank prefix matrix, its N_r and its per-expert counts, and every rank
that reads them on the host takes the same decision on the data buffer (create it, grow it), so no CPU
collective is needed per call.
"""

import epx

# Fields of a notify row after the R counts: T, the top-k width the call needs, static mode, E, H.
_T, _K, _WORST, _E, _H = range(5)
_NUM_FIELDS = 5
# Local experts a notify row has room for (DeepEP sizes its notify region from num_nvl_bytes instead).
MAX_LOCAL_EXPERTS = 1024


def _torch():
    import torch

    epx._epx._refresh_torch()
    return torch


class _State:
    """What a handle needs: the data buffer it belongs to, the epx handle, the caller's top-k width."""

    __slots__ = ("buffer", "epx", "num_topk", "__weakref__")

    def __init__(self, buffer, handle, num_topk):
        self.buffer, self.epx, self.num_topk = buffer, handle, num_topk


class _Notified:
    """What the notify exchange found out, for the data dispatch that follows: x and its scales, E, static
    mode, the rank prefix matrix, the data buffer, and from the host read (None without one) N_r and the
    received tokens per local expert."""

    __slots__ = ("x", "scales", "E", "worst", "prefix", "buf", "n_recv", "experts")

    def __init__(self, x, scales, E, worst):
        self.x, self.scales, self.E, self.worst = x, scales, E, worst
        self.prefix = self.buf = self.n_recv = self.experts = None


class Handle(tuple):
    """DeepEP's intranode handle layout: (rank_prefix_matrix [R, R] int32, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head). epx has no channels and keeps
    the source index inside the library, so elements 1, 2, 3 and 5 are None; element 4 is the
    is_token_in_rank the dispatch was given (None when it had only topk_idx)."""

    def __new__(cls, rank_prefix_matrix, is_token_in_rank, state):
        obj = super().__new__(cls, (rank_prefix_matrix, None, None, None, is_token_in_rank, None))
        obj._state = state
        return obj


def state_of(handle):
    if not isinstance(handle, Handle):
        raise TypeError("epx.compat.deep_ep: handle must be the handle a dispatch returned (got %s)"
                        % type(handle).__name__)
    return handle._state


def _pow2(n):
    return 1 << max(n - 1, 0).bit_length()


def pad_columns(t, width, value):
    """t [N, k] -> [N, width] with `value` in the new columns (t itself when already that wide)."""
    if t is None or t.shape[1] == width:
        return t
    torch = _torch()
    fill = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype, device=t.device)
    return torch.cat([t, fill], dim=1)


def split_x(x):
    """(x, scales) or x -> (x, contiguous scales or None), refusing what DeepEP's dispatch is not given: bf16
    x, or fp8 e4m3 x with fp32 scales (the data buffer holds these two only). DeepEP takes column-major
    scales too."""
    torch = _torch()
    x, scales = x if isinstance(x, tuple) else (x, None)
    if scales is None:
        if x.dtype != torch.bfloat16:
            raise epx.InvalidArgumentError("epx.compat.deep_ep: x must be bf16, or a tuple (fp8 e4m3 x, fp32 scales) (got x of "
                            "dtype %s)" % x.dtype)
        return x, None
    if x.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32:
        raise epx.InvalidArgumentError("epx.compat.deep_ep: an fp8 x is a tuple (float8_e4m3fn x, float32 scales) (got x of "
                        "dtype %s, scales of dtype %s)" % (x.dtype, scales.dtype))
    if x.dim() != 2 or x.shape[1] % 128 != 0:
        raise ValueError("epx.compat.deep_ep: an fp8 x must be [num_tokens, hidden] with hidden a multiple of 128 "
                         "(got shape %s)" % (list(x.shape),))
    if not scales.is_contiguous():
        scales = scales.contiguous()
    return x, scales


class HTPath:
    """The notify buffer (made now, collectively) and the data buffer (made by the first dispatch)."""

    def __init__(self, comm, native_options):
        self.comm = comm
        self.R, self.rank = comm.nranks, comm.rank
        self.width = self.R + _NUM_FIELDS + MAX_LOCAL_EXPERTS
        self.notify = epx.Buffer(comm, self.R, self.width, 1, self.R, modes="ht", dispatch_dtypes="fp32")
        self.data = None  # epx.Buffer for the tokens
        self.native_options = native_options
        self.states = None  # WeakSet of _State, set by the owner

    def destroy(self):
        for b in (self.data, self.notify):
            if b is not None:
                b.destroy()
        self.data = self.notify = None

    def _fits(self, T, K, E, H):
        d = self.data
        return (d is not None and T <= d.max_tokens and K <= d.num_topk and E == d.num_experts
                and H == d.hidden)

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                 topk_weights, expert_alignment, num_worst_tokens, num_sms):
        """DeepEP's dispatch without a handle: the notify exchange, then the data dispatch. Returns (recv_x,
        recv_topk_idx, recv_topk_weights, counts, handle). A rejection before the notify exchange is refused
        on the notify buffer."""
        notified = self.exchange(x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                                 num_worst_tokens, num_sms)
        return self.send(notified, is_token_in_rank, topk_idx, topk_weights, expert_alignment, num_worst_tokens)

    def exchange(self, x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                 num_worst_tokens, num_sms):
        """The notify exchange and what follows from it on the host: the rank prefix matrix, the host read
        of the rows (unless a static call fits) and the data buffer. Returns a _Notified for send()."""
        torch = _torch()
        R = self.R
        with epx.collective(self.notify, epx.HT_DISPATCH):
            x, scales = split_x(x)
            if x.dim() != 2:
                raise ValueError("epx.compat.deep_ep: x must be [num_tokens, hidden] (got %d dims)" % x.dim())
            T, H = x.shape
            if num_tokens_per_expert is None:
                raise ValueError("epx.compat.deep_ep: dispatch without a handle needs num_tokens_per_expert "
                                 "(from get_dispatch_layout)")
            E = num_tokens_per_expert.numel()
            if E % R != 0 or E // R > MAX_LOCAL_EXPERTS:
                raise ValueError("epx.compat.deep_ep: num_experts %d must be a multiple of the %d ranks with "
                                 "at most %d local experts" % (E, R, MAX_LOCAL_EXPERTS))
            if topk_idx is None and is_token_in_rank is None:
                raise ValueError("epx.compat.deep_ep: dispatch without a handle needs is_token_in_rank "
                                 "(or topk_idx)")
            if topk_idx is None and num_worst_tokens > 0:
                raise ValueError("epx.compat.deep_ep: num_worst_tokens needs topk_idx and topk_weights "
                                 "(as in DeepEP)")
            if topk_idx is not None and topk_idx.dim() != 2:
                raise ValueError("epx.compat.deep_ep: topk_idx must be [num_tokens, num_topk]")
            K_need = topk_idx.shape[1] if topk_idx is not None else R
            worst = num_worst_tokens > 0
            if num_tokens_per_rank is None:
                num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
            rows = self._notify_rows(num_tokens_per_rank, num_tokens_per_expert, (T, K_need, worst, E, H),
                                     x.device)
            recv = self.notify.dispatch(rows, self._notify_topk(x.device), num_worst_tokens=R).recv_x
        n = _Notified(x, scales, E, worst)
        n.prefix = recv[:, :R].cumsum(dim=0).to(torch.int32)
        fits = self._fits(T, K_need, E, H)
        host = None
        if not (worst and fits):
            L = E // R
            experts = recv[:, R + _NUM_FIELDS:R + _NUM_FIELDS + L]
            head = torch.cat([recv[:, :R + _NUM_FIELDS].flatten(), experts.sum(dim=0)])
            host = [int(v) for v in head.tolist()]
            n.n_recv = sum(host[s * (R + _NUM_FIELDS) + self.rank] for s in range(R))
            n.experts = host[R * (R + _NUM_FIELDS):]
        n.buf = self._choose(host, T, K_need, E, H, fits, num_sms)
        return n

    def send(self, n, is_token_in_rank, topk_idx, topk_weights, expert_alignment, num_worst_tokens):
        """The data dispatch after exchange(); returns dispatch()'s tuple."""
        torch = _torch()
        R, rank, x, buf = self.R, self.rank, n.x, n.buf
        with epx.collective(buf, epx.HT_DISPATCH):
            if topk_idx is None:
                L = n.E // R
                T = x.shape[0]
                firsts = torch.arange(R, device=x.device, dtype=torch.int64) * L
                main_idx = torch.where(is_token_in_rank.to(torch.bool), firsts.expand(T, R),
                                       torch.full((T, R), -1, dtype=torch.int64, device=x.device))
                main_w = None
            else:
                main_idx, main_w = topk_idx, topk_weights
            main_idx = pad_columns(main_idx, buf.num_topk, -1)
            main_w = pad_columns(main_w, buf.num_topk, 0.0)
            out = buf.dispatch(x, main_idx, main_w, x_scales=n.scales, expert_alignment=expert_alignment,
                               num_worst_tokens=num_worst_tokens if n.worst else n.n_recv)
        recv_x = (out.recv_x, out.recv_x_scales) if n.scales is not None else out.recv_x
        recv_idx = recv_w = None
        K_user = topk_idx.shape[1] if topk_idx is not None else 0
        if topk_idx is not None:
            recv_idx, recv_w = out.recv_topk_idx, out.recv_topk_weights
            if K_user < buf.num_topk:
                recv_idx = recv_idx[:, :K_user].contiguous()
                recv_w = recv_w[:, :K_user].contiguous() if recv_w is not None else None
            if n.worst:
                self._clean_tail(recv_idx, recv_w, n.n_recv, n.prefix[R - 1, rank])
        if n.worst:
            counts = []
        else:
            align = max(int(expert_alignment), 1)
            counts = [-(-c // align) * align for c in n.experts]
        state = _State(buf, out.handle, K_user)
        self.states.add(state)
        return recv_x, recv_idx, recv_w, counts, Handle(n.prefix, is_token_in_rank, state)

    def _notify_rows(self, num_tokens_per_rank, num_tokens_per_expert, fields, device):
        torch = _torch()
        R = self.R
        L = num_tokens_per_expert.numel() // R
        rows = torch.zeros((R, self.width), dtype=torch.float32, device=device)
        rows[:, :R] = num_tokens_per_rank.to(device=device, dtype=torch.float32).view(1, R)
        rows[:, R:R + _NUM_FIELDS] = torch.tensor([float(v) for v in fields], dtype=torch.float32,
                                                  device=device).view(1, _NUM_FIELDS)
        rows[:, R + _NUM_FIELDS:R + _NUM_FIELDS + L] = num_tokens_per_expert.to(
            device=device, dtype=torch.float32).view(R, L)
        return rows

    def _notify_topk(self, device):
        torch = _torch()
        return torch.arange(self.R, dtype=torch.int64, device=device).view(self.R, 1)

    def _choose(self, host, T, K, E, H, fits, num_sms):
        """The data buffer for this call. Every rank that read the notify rows (host) knows every rank's
        shapes and whether that rank read them too; the buffer is (re-)made only when all did, so all
        make it. A rank that does not fit otherwise refuses the call on the current buffer."""
        if host is None:
            return self.data
        R, n = self.R, self.R + _NUM_FIELDS
        fields = [host[s * n + R:s * n + n] for s in range(R)]
        fit = [self._fits(f[_T], f[_K], f[_E], f[_H]) for f in fields]
        everyone_read = all(not (f[_WORST] and ok) for f, ok in zip(fields, fit))
        if all(fit):
            return self.data
        if not everyone_read:
            with epx.collective(self.data, epx.HT_DISPATCH):
                if not fits:
                    raise ValueError(
                        "epx.compat.deep_ep: this dispatch (T %d, top-k width %d, E %d, hidden %d) does not "
                        "fit the buffer made by earlier calls, and a num_worst_tokens call cannot re-make it "
                        "(that takes a host sync on every rank); make one call without num_worst_tokens "
                        "first" % (T, K, E, H))
            return self.data
        t_max = _pow2(max(max(f[_T] for f in fields), 1))
        if self.data is not None:
            t_max = max(t_max, self.data.max_tokens)
        # Room for a dispatch without top-k (one slot per rank) from the start: no re-make when one comes.
        k = max(max(f[_K] for f in fields), R)
        # DeepEP's dtypes only (split_x): rows are sized for 2-byte elements, not for fp32.
        dtypes = ["bf16", "fp8"] if H % 128 == 0 else ["bf16"]
        # Handles keep the buffer they were made on: an old one lives until its last handle goes.
        self.data = epx.Buffer(self.comm, t_max, H, k, E, modes="ht", dispatch_dtypes=dtypes, num_sms=num_sms,
                               **self.native_options)
        return self.data

    @staticmethod
    def _clean_tail(recv_idx, recv_w, n_recv, n_recv_device):
        """Static mode: rows past N_r get topk_idx -1 (DeepEP's fill) and weight 0."""
        torch = _torch()
        if n_recv is not None:
            recv_idx[n_recv:] = -1
            if recv_w is not None:
                recv_w[n_recv:] = 0
            return
        past = torch.arange(recv_idx.shape[0], device=recv_idx.device) >= n_recv_device
        recv_idx.masked_fill_(past.view(-1, 1), -1)
        if recv_w is not None:
            recv_w.masked_fill_(past.view(-1, 1), 0)

    # ------------------------------------------------------------------ cached dispatch, combine

    def cached_dispatch(self, x, handle):
        state = state_of(handle)
        with epx.collective(state.buffer, epx.HT_DISPATCH):
            x, scales = split_x(x)
            out = state.buffer.dispatch(x, x_scales=scales, handle=state.epx)
        return (out.recv_x, out.recv_x_scales) if scales is not None else out.recv_x

    def combine(self, x, handle, topk_weights, bias):
        state = state_of(handle)
        buf = state.buffer
        with epx.collective(buf, epx.HT_COMBINE):
            bias0, bias1 = bias if isinstance(bias, tuple) else (bias, None)
            k = topk_weights.shape[1] if topk_weights is not None and topk_weights.dim() == 2 else None
            weights = pad_columns(topk_weights, buf.num_topk, 0.0) if k is not None else topk_weights
            out = buf.combine(x, state.epx, topk_weights=weights, bias0=bias0, bias1=bias1)
        combined_w = out.combined_topk_weights
        if combined_w is not None and k is not None and k < buf.num_topk:
            combined_w = combined_w[:, :k].contiguous()
        return out.combined_x, combined_w
