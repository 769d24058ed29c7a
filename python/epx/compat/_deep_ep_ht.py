"""The high-throughput half of epx.compat.deep_ep: DeepEP's intranode dispatch and combine over epx.Buffer.

A dispatch without a handle is one epx dispatch on the data buffer: its own count exchange gives every
rank the rank prefix matrix, its N_r and its per-expert counts, so no notify step runs before it. The
data buffer is made (collectively) by the first dispatch, after an agreement on the shapes through a
small epx dispatch on a buffer made at construction (the "agreement buffer": each rank sends every rank
one row of int32 fields, carried as the bits of fp32 elements). The agreement runs again only when a
data dispatch failed on some rank: every rank sees that failure (the failing rank refuses the call, so
the others' calls raise RemoteError), and every rank then says in its row whether it did not fit the
buffer (every rank re-makes it alike and dispatches again) or refused the call (every rank raises).
"""

import epx
from epx.compat import _torch  # torch, imported on first use

# Fields of an agreement row: status, T, the top-k width the call needs, E, H.
_STATUS, _T, _K, _E, _H = range(5)
_NUM_FIELDS = 5
# Row statuses: the call can go on (its shapes say whether it fits), or this rank refused it.
_OK, _REFUSED = 0, 1
# Constant device tensors an HTPath keeps before its cache starts over (ragged T makes one per distinct T).
_MAX_CONSTANTS = 256


class _State:
    """What a handle needs: the data buffer it belongs to, the epx handle, the caller's top-k width, and the
    rows of its dispatch's outputs (N_r, or num_worst_tokens in static mode)."""

    __slots__ = ("buffer", "epx", "num_topk", "rows", "__weakref__")

    def __init__(self, buffer, handle, num_topk, rows):
        self.buffer, self.epx, self.num_topk, self.rows = buffer, handle, num_topk, rows


class _NoFit(Exception):
    """This rank's call does not fit the data buffer: it refuses the data call, and the agreement follows."""


class _Request:
    """One dispatch without a handle: the caller's arguments, checked by check() (which raises what the
    caller gets), and the shapes the data buffer must hold (T: its rows per rank)."""

    __slots__ = ("x", "scales", "per_rank", "in_rank", "per_expert", "topk_idx", "topk_weights", "alignment",
                 "worst", "precheck", "T", "K", "E", "H", "R")

    def __init__(self, R, x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                 topk_weights, expert_alignment, num_worst_tokens, precheck):
        self.R, self.x, self.scales = R, x, None
        self.per_rank, self.in_rank, self.per_expert = num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert
        self.topk_idx, self.topk_weights, self.alignment = topk_idx, topk_weights, expert_alignment
        self.worst, self.precheck = num_worst_tokens, precheck
        self.T = self.K = self.E = self.H = None

    def check(self):
        """DeepEP's contract for a dispatch without a handle; sets T, K, E, H. Idempotent."""
        if self.T is not None:
            return
        if self.precheck is not None:
            self.precheck()
        R = self.R
        x, self.scales = split_x(self.x)
        if x.dim() != 2:
            raise ValueError("epx.compat.deep_ep: x must be [num_tokens, hidden] (got %d dims)" % x.dim())
        if self.per_expert is None:
            raise ValueError("epx.compat.deep_ep: dispatch without a handle needs num_tokens_per_expert "
                             "(from get_dispatch_layout)")
        E = self.per_expert.numel()
        if E % R != 0 or E == 0:
            raise ValueError("epx.compat.deep_ep: num_experts %d must be a positive multiple of the %d ranks"
                             % (E, R))
        if self.topk_idx is None and self.in_rank is None:
            raise ValueError("epx.compat.deep_ep: dispatch without a handle needs is_token_in_rank "
                             "(or topk_idx)")
        if self.in_rank is not None and (tuple(self.in_rank.shape) != (x.shape[0], R)
                                         or self.in_rank.dtype != _torch().bool):
            raise ValueError("epx.compat.deep_ep: is_token_in_rank must be [num_tokens, num_ranks] = [%d, %d] "
                             "bool (got %s %s)" % (x.shape[0], R, list(self.in_rank.shape), self.in_rank.dtype))
        if self.topk_idx is None and self.worst > 0:
            raise ValueError("epx.compat.deep_ep: num_worst_tokens needs topk_idx and topk_weights "
                             "(as in DeepEP)")
        if self.topk_idx is not None and self.topk_idx.dim() != 2:
            raise ValueError("epx.compat.deep_ep: topk_idx must be [num_tokens, num_topk]")
        if (self.topk_idx is not None and self.topk_weights is not None
                and tuple(self.topk_weights.shape) != tuple(self.topk_idx.shape)):
            raise ValueError("epx.compat.deep_ep: topk_weights must have topk_idx's shape %s (got %s)"
                             % (list(self.topk_idx.shape), list(self.topk_weights.shape)))
        self.x = x
        # The rows a buffer is sized by: T, and in static mode num_worst_tokens over the R sources (the
        # combine of a static handle reads that many rows from the buffer).
        self.T = max(x.shape[0], -(-max(self.worst, 0) // R))
        self.H, self.E = x.shape[1], E
        self.K = self.topk_idx.shape[1] if self.topk_idx is not None else R


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


def split_x(x):
    """(x, scales) or x -> (x, contiguous scales or None), refusing what DeepEP's dispatch is not given: bf16
    x, or fp8 e4m3 x with fp32 scales (the data buffer holds these two only). DeepEP takes column-major
    scales too."""
    torch = _torch()
    x, scales = x if isinstance(x, tuple) else (x, None)
    if scales is None:
        if x.dtype != torch.bfloat16:
            raise epx.InvalidArgumentError("epx.compat.deep_ep: x must be bf16, or a tuple (fp8 e4m3 x, fp32 "
                                           "scales) (got x of dtype %s)" % x.dtype)
        return x, None
    if x.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32:
        raise epx.InvalidArgumentError("epx.compat.deep_ep: an fp8 x is a tuple (float8_e4m3fn x, float32 "
                                       "scales) (got x of dtype %s, scales of dtype %s)"
                                       % (x.dtype, scales.dtype))
    if x.dim() != 2 or x.shape[1] % 128 != 0:
        raise ValueError("epx.compat.deep_ep: an fp8 x must be [num_tokens, hidden] with hidden a multiple "
                         "of 128 (got shape %s)" % (list(x.shape),))
    if not scales.is_contiguous():
        scales = scales.contiguous()
    return x, scales


class HTPath:
    """The agreement buffer (made now, collectively) and the data buffer (made by the first dispatch)."""

    def __init__(self, comm, native_options):
        self.comm = comm
        self.R, self.rank = comm.nranks, comm.rank
        self.device = "cuda:%d" % comm.cuda_device if comm.backend == "cuda" else "cpu"
        self.width = 8  # _NUM_FIELDS, padded
        self.notify = epx.Buffer(comm, self.R, self.width, 1, self.R, modes="ht", dispatch_dtypes="fp32")
        self.data = None  # epx.Buffer for the tokens
        self.counts = None  # epx.Buffer for the per-expert counts of dispatches without top-k
        self.native_options = native_options
        self.states = None  # WeakSet of _State, set by the owner
        self._constants = {}  # (what, device, ...) -> [read-only tensor, event or None], see _constant

    def destroy(self):
        for b in (self.data, self.notify, self.counts):
            if b is not None:
                b.destroy()
        self.data = self.notify = self.counts = None
        self._constants.clear()

    @staticmethod
    def _fits(T, K, E, H, d):
        """Whether a call of these shapes fits data buffer d (None: no buffer yet)."""
        return (d is not None and T <= d.max_tokens and K <= d.num_topk and E == d.num_experts
                and H == d.hidden)

    # ------------------------------------------------------------------ per-call helpers

    def _constant(self, key, make):
        """The tensor make() returns, made once per key and never written after. On cuda a call on another
        stream than the one that made it waits for the making (an event, dropped once it completed)."""
        entry = self._constants.get(key)
        if entry is None:
            if len(self._constants) >= _MAX_CONSTANTS:
                self._constants.clear()
            t = make()
            made = None
            if t.is_cuda:
                made = _torch().cuda.Event()
                made.record(_torch().cuda.current_stream(t.device))
            entry = self._constants[key] = [t, made]
        t, made = entry
        if made is not None:
            if made.query():
                entry[1] = None
            else:
                _torch().cuda.current_stream(t.device).wait_event(made)
        return t

    def _rows_constant(self, key, rows, make):
        """_constant with at least `rows` rows: make(n) makes n >= rows, again when they fall short."""
        entry = self._constants.get(key)
        if entry is not None and entry[0].shape[0] < rows:
            del self._constants[key]
        return self._constant(key, lambda: make(_pow2(max(rows, 64))))

    def _pad(self, t, width, value):
        """t [N, k] -> [N, width] with `value` in the new columns (t itself when already that wide): one cat
        with a cached block of `value`."""
        if t is None or t.shape[1] == width:
            return t
        torch = _torch()
        N, extra = t.shape[0], width - t.shape[1]
        fill = self._rows_constant(("fill", t.device, t.dtype, extra, value), N, lambda n: torch.full(
            (n, extra), value, dtype=t.dtype, device=t.device))
        return torch.cat([t, fill[:N]], dim=1)

    def layout(self, topk_idx, num_experts):
        """DeepEP's get_dispatch_layout in eleven torch kernels and no host synchronisation: returns
        (num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool)."""
        torch = _torch()
        R = self.R
        if topk_idx.dim() != 2 or num_experts <= 0 or num_experts % R != 0:
            raise ValueError("epx.compat.deep_ep: get_dispatch_layout needs topk_idx [num_tokens, num_topk] "
                             "and num_experts a multiple of the %d ranks (got %d dims, %d experts)"
                             % (R, topk_idx.dim(), num_experts))
        device, L = topk_idx.device, num_experts // R
        d = self.data
        if (d is not None and topk_idx.is_cuda and num_experts == d.num_experts
                and topk_idx.shape[0] <= d.max_tokens and topk_idx.shape[1] == d.num_topk):
            # epx's layout kernel (one launch) once the data buffer exists for these shapes.
            out = d.get_dispatch_layout(topk_idx)
            return out.num_tokens_per_rank, out.num_tokens_per_expert, out.is_token_in_rank
        ranks = self._constant(("ranks", device, topk_idx.dtype),
                               lambda: torch.arange(R, dtype=topk_idx.dtype, device=device))
        # Floor division keeps -1 (no expert) at -1, which matches no rank.
        rank_of = torch.div(topk_idx, L, rounding_mode="floor")
        is_token_in_rank = (rank_of.unsqueeze(-1) == ranks).any(dim=1)
        num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
        # Counts per expert in bins 2..E+1 of E+3 (bincount would read the largest id on the host): bin 1
        # takes the -1 slots, bins 0 and E+2 the ids outside [-1, E). Such an id makes every count -1, as
        # the library's layout kernel writes them, without a wait for the device (the dispatch that follows
        # refuses the ids by name).
        one = self._constant(("one", device), lambda: torch.ones(1, dtype=torch.int32, device=device))
        slot = (topk_idx.clamp(-2, num_experts) + 2).reshape(-1)
        bins = torch.zeros(num_experts + 3, dtype=torch.int32, device=device)
        bins.index_add_(0, slot, one.expand(slot.numel()))
        poisoned = bins[::num_experts + 2].any()  # bins 0 and E+2
        per_expert = bins[2:num_experts + 2].masked_fill(poisoned, -1)
        num_tokens_per_rank = num_tokens_per_rank.masked_fill(poisoned, -1)
        return num_tokens_per_rank, per_expert, is_token_in_rank

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                 topk_weights, expert_alignment, num_worst_tokens, num_sms, precheck=None):
        """DeepEP's dispatch without a handle. Returns (recv_x, recv_topk_idx, recv_topk_weights, counts,
        handle). precheck() runs first among the checks: what it raises is refused like them."""
        req = _Request(self.R, x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                       topk_weights, expert_alignment, num_worst_tokens, precheck)
        failure = None
        if self.data is not None:
            buf = self.data
            try:
                out = self._call(buf, req)
            except Exception as exc:
                if req.worst > 0:
                    # A static call makes no host wait: on cuda a peer's refusal reaches this rank only as an
                    # asynchronous error, so no rank can count on the others joining an agreement.
                    raise
                # A default-mode call that failed, failed on every rank: the agreement follows everywhere.
                failure = exc
                # Kept without its traceback: the frames there hold the buffer, which a re-make must free.
                failure.__traceback__ = None
            else:
                return self._result(buf, req, out)
            del buf
        self._agree(req, failure, num_sms)
        del failure
        buf = self.data
        return self._result(buf, req, self._call(buf, req))

    def _call(self, buf, req):
        """The data dispatch on `buf`; the checks, and the fit, are refused on it."""
        with epx.collective(buf, epx.HT_DISPATCH):
            req.check()
            if not self._fits(req.T, req.K, req.E, req.H, buf):
                if req.worst > 0:
                    raise ValueError(
                        "epx.compat.deep_ep: this num_worst_tokens dispatch (T %d with num_worst_tokens %d, "
                        "top-k width %d, E %d, hidden %d) does not fit the buffer made by earlier calls, and a "
                        "static call cannot re-make it (it makes no host synchronisation, so the ranks cannot "
                        "agree on a new buffer). The buffer must hold T = max(T, ceil(num_worst_tokens / "
                        "ranks)) = %d tokens per rank: make one call without num_worst_tokens with that many "
                        "tokens (and this top-k width, E and hidden) first, or make the static call first"
                        % (req.x.shape[0], req.worst, req.K, req.E, req.H, req.T))
                raise _NoFit("epx.compat.deep_ep: rank %d's dispatch (T %d, top-k width %d, E %d, hidden %d) "
                             "does not fit the data buffer; every rank agrees on a new one"
                             % (self.rank, req.T, req.K, req.E, req.H))
            return self._data_call(buf, req)

    def _agree(self, req, failure, num_sms):
        """Every rank's row on the agreement buffer, read on the host: raises on every rank when one refused
        the call (its own error there, RemoteError elsewhere), else (re-)makes the data buffer when a rank's
        call does not fit it (every rank decides alike). `failure`: this rank's failed data call, if any."""
        torch = _torch()
        status, fields = _OK, [0, 0, 0, 0]
        if failure is None or isinstance(failure, (_NoFit, epx.RemoteError)):
            try:
                req.check()
                fields = [req.T, req.K, req.E, req.H]
            except Exception as exc:
                failure, status = exc, _REFUSED
        else:
            status = _REFUSED
        row = torch.tensor([status] + fields + [0] * (self.width - _NUM_FIELDS), dtype=torch.int32)
        got = self._exchange_rows(self.notify, row.view(1, -1).expand(self.R, -1))
        heads = got[:, :_NUM_FIELDS].cpu().tolist()
        refused = [s for s, head in enumerate(heads) if head[_STATUS] != _OK]
        if status != _OK:
            raise failure
        if refused:
            raise epx.RemoteError("epx.compat.deep_ep: rank %d refused this dispatch" % refused[0])
        if len({(h[_E], h[_H]) for h in heads}) > 1:
            raise ValueError("epx.compat.deep_ep: the ranks' dispatches disagree on num_experts and hidden "
                             "(per rank: %s)" % ", ".join("%d: E %d, H %d" % (s, h[_E], h[_H])
                                                           for s, h in enumerate(heads)))
        if all(self._fits(h[_T], h[_K], h[_E], h[_H], self.data) for h in heads):
            return
        t_max = _pow2(max(max(h[_T] for h in heads), 1))
        if self.data is not None:
            t_max = max(t_max, self.data.max_tokens)
        # Room for a dispatch without top-k (one slot per rank) from the start: no re-make when one comes.
        k = max(max(h[_K] for h in heads), self.R)
        H, E = req.H, req.E
        # DeepEP's dtypes only (split_x): rows are sized for 2-byte elements, not for fp32.
        dtypes = ["bf16", "fp8"] if H % 128 == 0 else ["bf16"]
        # Handles keep the buffer they were made on: an old one lives until its last handle goes. Dropped
        # first, so that one no handle holds is freed before the new one is made (a failed making leaves
        # no data buffer on any rank: the next call agrees again).
        self.data = None
        if self.counts is None or self.counts.hidden != E // self.R:
            if self.counts is not None:
                self.counts.destroy()
            self.counts = None
            self.counts = epx.Buffer(self.comm, self.R, E // self.R, 1, self.R, modes="ht", dispatch_dtypes="fp32")
        self.data = self._make_data(t_max, H, k, E, dtypes, num_sms)

    def _data_call(self, buf, req):
        """buf.dispatch of the request (num_worst_tokens, or the default mode's host wait for N_r)."""
        torch = _torch()
        R, x = self.R, req.x
        if req.topk_idx is None:
            # One slot per destination rank: that rank's first expert.
            firsts = self._constant(("firsts", x.device, req.E), lambda: (
                torch.arange(R, dtype=torch.int64, device=x.device) * (req.E // R)).view(1, R))
            main_idx = torch.where(req.in_rank.to(torch.bool), firsts, -1)
            main_w = None
        else:
            main_idx, main_w = req.topk_idx, req.topk_weights
        main_idx = self._pad(main_idx, buf.num_topk, -1)
        main_w = self._pad(main_w, buf.num_topk, 0.0)
        return buf.dispatch(x, main_idx, main_w, x_scales=req.scales, expert_alignment=req.alignment,
                            num_worst_tokens=req.worst)

    def _result(self, buf, req, out):
        """dispatch()'s tuple from the data dispatch's outputs."""
        torch = _torch()
        R, rank = self.R, self.rank
        recv_x = (out.recv_x, out.recv_x_scales) if req.scales is not None else out.recv_x
        prefix = out.rank_prefix_matrix
        recv_idx = recv_w = None
        K_user = req.topk_idx.shape[1] if req.topk_idx is not None else 0
        # DeepEP's list of received tokens per local expert (aligned); empty in static mode, as there. Read
        # first: the default mode's call returned after its kernels, so the read waits for nothing, where
        # after the launches below it would wait for them too.
        if req.worst > 0:
            counts = []
        elif req.topk_idx is not None:
            # The binding read them on the host (the call waited for them); no device copy.
            counts = out.num_recv_tokens_per_expert_list
        else:
            counts = self._expert_counts(req)
        if req.topk_idx is not None:
            # One copy at most: the caller's width, and the caller's dtype (views of the buffer hold int32).
            narrow = out.recv_topk_idx[:, :K_user]  # DeepEP returns contiguous ids
            recv_idx = (narrow.contiguous() if narrow.dtype == req.topk_idx.dtype
                        else narrow.to(req.topk_idx.dtype, memory_format=torch.contiguous_format))
            recv_w = out.recv_topk_weights
            if recv_w is not None and K_user < buf.num_topk:
                recv_w = recv_w[:, :K_user].contiguous()
            if req.worst > 0:
                self._clean_tail(recv_idx, recv_w, prefix[R - 1, rank])
        state = _State(buf, out.handle, K_user, out.recv_x.shape[0])
        self.states.add(state)
        return recv_x, recv_idx, recv_w, counts, Handle(prefix, req.in_rank, state)

    def _make_data(self, t_max, H, k, E, dtypes, num_sms):
        """The data buffer with the native options; without pooled views in this epx, with copies. The
        keywords are refused before anything collective and alike on every rank, so all fall back alike."""
        def make():
            return epx.Buffer(self.comm, t_max, H, k, E, modes="ht", dispatch_dtypes=dtypes, num_sms=num_sms,
                              **self.native_options)

        try:
            return make()
        except TypeError as exc:
            if self.native_options.get("views") != "pooled" or "view" not in str(exc):
                raise
        self.native_options = {"views": False}
        return make()

    def _exchange_rows(self, buf, rows):
        """rows [R, w] of int32 values (row d for rank d) -> [R, w] int32, row s from rank s: one static-mode
        dispatch on `buf` (hidden w, fp32), the values carried in the bits of its fp32 elements."""
        torch = _torch()
        R = self.R
        rows = rows.to(device=self.device, dtype=torch.int32).contiguous().view(torch.float32)
        slots = self._constant(("rank slots", self.device),
                               lambda: torch.arange(R, dtype=torch.int64, device=self.device).view(R, 1))
        return buf.dispatch(rows, slots, num_worst_tokens=R).recv_x.view(torch.int32)

    def _expert_counts(self, req):
        """A dispatch without top-k routes one slot per rank, so its own counts say nothing per expert: as
        DeepEP's notify step does, every rank sends each rank its slice of num_tokens_per_expert (a small
        dispatch on the counts buffer, made with the data buffer), and the slices are summed here (aligned)."""
        R, L = self.R, req.E // self.R
        with epx.collective(self.counts, epx.HT_DISPATCH):
            got = self._exchange_rows(self.counts, req.per_expert.reshape(R, L))
        align = max(int(req.alignment), 1)
        return [-(-c // align) * align for c in got.sum(dim=0).tolist()]

    def _clean_tail(self, recv_idx, recv_w, n_recv_device):
        """Static mode: rows past N_r get topk_idx -1 (DeepEP's fill) and weight 0, without a host read."""
        torch = _torch()
        rows, device = recv_idx.shape[0], recv_idx.device
        numbers = self._rows_constant(("row numbers", device), rows, lambda n: torch.arange(n, device=device))
        past = (numbers[:rows] >= n_recv_device).view(-1, 1)
        recv_idx.masked_fill_(past, -1)
        if recv_w is not None:
            recv_w.masked_fill_(past, 0)

    # ------------------------------------------------------------------ cached dispatch, combine

    def cached_dispatch(self, x, handle):
        state = state_of(handle)
        with epx.collective(state.buffer, epx.HT_DISPATCH):
            x, scales = split_x(x)
            out = state.buffer.dispatch(x, x_scales=scales, handle=state.epx)
        # A static-mode handle's cached dispatch is static too: num_worst_tokens rows, as DeepEP's.
        recv_x, recv_scales = out.recv_x, out.recv_x_scales
        return (recv_x, recv_scales) if scales is not None else recv_x

    def combine(self, x, handle, topk_weights, bias):
        state = state_of(handle)
        buf = state.buffer
        with epx.collective(buf, epx.HT_COMBINE):
            bias0, bias1 = bias if isinstance(bias, tuple) else (bias, None)
            k = topk_weights.shape[1] if topk_weights is not None and topk_weights.dim() == 2 else None
            if k is not None and k > buf.num_topk:
                raise ValueError("epx.compat.deep_ep: topk_weights has %d columns, more than the data buffer's "
                                 "num_topk = %d" % (k, buf.num_topk))
            weights = self._pad(topk_weights, buf.num_topk, 0.0) if k is not None else topk_weights
            out = buf.combine(x, state.epx, topk_weights=weights, bias0=bias0, bias1=bias1)
        combined_w = out.combined_topk_weights
        if combined_w is not None and k is not None and k < buf.num_topk:
            combined_w = combined_w[:, :k].contiguous()
        return out.combined_x, combined_w
