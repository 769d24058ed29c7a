"""The high-throughput half of epx.compat.deep_ep: DeepEP's intranode dispatch and combine over epx.Buffer.

A dispatch without a handle first exchanges counts, as DeepEP's notify step does, through a small epx
dispatch on a buffer made at construction (the "notify buffer"): each rank sends every rank one row of int32
values (carried as the bits of the buffer's fp32 elements) with its num_tokens_per_rank, the destination's
slice of num_tokens_per_expert and a few shape fields. From the rows every rank learns the rank prefix
matrix, its N_r and its per-expert counts, and every rank that reads them on the host takes the same
decision on the data buffer (create it, grow it), so no CPU collective is needed per call.

Per call the front keeps to few torch kernels and to one host wait: the rows are gathered from the counts
in two kernels (their constant parts are device tensors made once per shape), the host reads them in one
device->host copy, and get_dispatch_layout makes no host synchronisation.
"""

import epx

# Fields of a notify row after the R counts: T, the top-k width the call needs, static mode, E, H.
_T, _K, _WORST, _E, _H = range(5)
_NUM_FIELDS = 5
# Local experts a notify row has room for (DeepEP sizes its notify region from num_nvl_bytes instead).
MAX_LOCAL_EXPERTS = 1024
# Constant device tensors an HTPath keeps before its cache starts over (ragged T makes one per distinct T).
_MAX_CONSTANTS = 256


def _torch():
    import torch

    epx._epx._refresh_torch()
    return torch


class _State:
    """What a handle needs: the data buffer it belongs to, the epx handle, the caller's top-k width, and the
    rows of its dispatch's outputs (N_r, or num_worst_tokens in static mode)."""

    __slots__ = ("buffer", "epx", "num_topk", "rows", "__weakref__")

    def __init__(self, buffer, handle, num_topk, rows):
        self.buffer, self.epx, self.num_topk, self.rows = buffer, handle, num_topk, rows


class _NoFit(Exception):
    """This rank's tokens do not fit the data buffer: it refuses the data call it makes before the host read."""


class _Notified:
    """What the notify exchange found out, for the data dispatch that follows: x and its scales, E, static
    mode, the rank prefix matrix, the data buffer, and from the host read (None without one) N_r and the
    received tokens per local expert."""

    __slots__ = ("x", "scales", "E", "worst", "prefix", "buf", "n_recv", "experts", "early", "shape", "fits")

    def __init__(self, x, scales, E, worst):
        self.x, self.scales, self.E, self.worst = x, scales, E, worst
        self.prefix = self.buf = self.n_recv = self.experts = self.early = self.shape = self.fits = None


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
    """The notify buffer (made now, collectively) and the data buffer (made by the first dispatch)."""

    def __init__(self, comm, native_options):
        self.comm = comm
        self.R, self.rank = comm.nranks, comm.rank
        self.width = self.R + _NUM_FIELDS + MAX_LOCAL_EXPERTS
        self.notify = epx.Buffer(comm, self.R, self.width, 1, self.R, modes="ht", dispatch_dtypes="fp32")
        self.data = None  # epx.Buffer for the tokens
        self.native_options = native_options
        self.states = None  # WeakSet of _State, set by the owner
        self._constants = {}  # (what, device, ...) -> [read-only tensor, event or None], see _constant
        self._pinned = None  # page-locked [R, width] int32: the host copy of the notify rows

    def destroy(self):
        for b in (self.data, self.notify):
            if b is not None:
                b.destroy()
        self.data = self.notify = None
        self._constants.clear()

    def _fits(self, T, K, E, H):
        d = self.data
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

    @staticmethod
    def _upload(values, dtype, device):
        """A device tensor of host values; on cuda through page-locked memory without a stream sync."""
        torch = _torch()
        t = torch.tensor(values, dtype=dtype, device="cpu")  # whatever torch's default device is
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)

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
        """DeepEP's get_dispatch_layout in seven torch kernels and no host synchronisation: returns
        (num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool)."""
        torch = _torch()
        R = self.R
        if topk_idx.dim() != 2 or num_experts % R != 0:
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
        # Counts per expert with a spare bin E for the -1 slots (-1 mod E + 1 = E); bincount would read the
        # largest id on the host.
        one = self._constant(("one", device), lambda: torch.ones(1, dtype=torch.int32, device=device))
        slot = topk_idx.remainder(num_experts + 1).reshape(-1)
        per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
        per_expert.index_add_(0, slot, one.expand(slot.numel()))
        return num_tokens_per_rank, per_expert[:num_experts], is_token_in_rank

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                 topk_weights, expert_alignment, num_worst_tokens, num_sms):
        """DeepEP's dispatch without a handle: the notify exchange, then the data dispatch. Returns (recv_x,
        recv_topk_idx, recv_topk_weights, counts, handle). A rejection before the notify exchange is refused
        on the notify buffer."""
        notified = self.exchange(x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                                 num_worst_tokens, num_sms)
        return self.send(notified, is_token_in_rank, topk_idx, topk_weights, expert_alignment,
                         num_worst_tokens)

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
            fields = (T, K_need, int(worst), E, H)
            rows = self._notify_rows(num_tokens_per_rank, num_tokens_per_expert, fields, x.device)
            topk = self._constant(("notify topk", x.device),
                                  lambda: torch.arange(R, dtype=torch.int64, device=x.device).view(R, 1))
            counts = self.notify.dispatch(rows, topk, num_worst_tokens=R).recv_x.view(torch.int32)
        n = _Notified(x, scales, E, worst)
        n.prefix = counts[:, :R].cumsum(dim=0, dtype=torch.int32)
        fits = self._fits(T, K_need, E, H)
        n.shape, n.fits = (T, K_need, E, H, num_sms), fits
        if not worst and self.data is not None:
            # The data dispatch goes first (send()); the rows come to the host meanwhile.
            n.early = self._start_read(counts)
            return n
        heads = None
        if not (worst and fits):
            heads, n.experts = self._read_rows(counts, E // R)
            n.n_recv = sum(head[self.rank] for head in heads)
        n.buf = self._choose(heads, T, K_need, E, H, fits, num_sms)
        return n

    def send(self, n, is_token_in_rank, topk_idx, topk_weights, expert_alignment, num_worst_tokens):
        """The data dispatch after exchange(); returns dispatch()'s tuple."""
        torch = _torch()
        R, rank = self.R, self.rank
        out = self._send_early(n, is_token_in_rank, topk_idx, topk_weights, expert_alignment) if n.early else None
        if out is None:
            out = self._data_call(n, n.buf, is_token_in_rank, topk_idx, topk_weights, expert_alignment,
                                  num_worst_tokens if n.worst else n.n_recv)
        buf = n.buf
        recv_x = (out.recv_x, out.recv_x_scales) if n.scales is not None else out.recv_x
        recv_idx = recv_w = None
        K_user = topk_idx.shape[1] if topk_idx is not None else 0
        if topk_idx is not None:
            # One copy at most: the caller's width, and the caller's dtype (views of the buffer hold int32).
            recv_idx = out.recv_topk_idx[:, :K_user].to(topk_idx.dtype, memory_format=torch.contiguous_format)
            recv_w = out.recv_topk_weights
            if recv_w is not None and K_user < buf.num_topk:
                recv_w = recv_w[:, :K_user].contiguous()
            if n.worst:
                self._clean_tail(recv_idx, recv_w, n.n_recv, n.prefix[R - 1, rank])
        if n.worst:
            counts = []
        else:
            align = max(int(expert_alignment), 1)
            counts = [-(-c // align) * align for c in n.experts]
        state = _State(buf, out.handle, K_user, out.recv_x.shape[0])
        self.states.add(state)
        return recv_x, recv_idx, recv_w, counts, Handle(n.prefix, is_token_in_rank, state)

    def _data_call(self, n, buf, is_token_in_rank, topk_idx, topk_weights, expert_alignment, rows):
        """The data dispatch on `buf` (num_worst_tokens `rows`, 0 for N_r rows), refused there on a rejection."""
        torch = _torch()
        R, x = self.R, n.x
        with epx.collective(buf, epx.HT_DISPATCH):
            if topk_idx is None:
                # One slot per destination rank: that rank's first expert.
                firsts = self._constant(("firsts", x.device, n.E), lambda: (
                    torch.arange(R, dtype=torch.int64, device=x.device) * (n.E // R)).view(1, R))
                main_idx = torch.where(is_token_in_rank.to(torch.bool), firsts, -1)
                main_w = None
            else:
                main_idx, main_w = topk_idx, topk_weights
            main_idx = self._pad(main_idx, buf.num_topk, -1)
            main_w = self._pad(main_w, buf.num_topk, 0.0)
            return buf.dispatch(x, main_idx, main_w, x_scales=n.scales, expert_alignment=expert_alignment,
                                num_worst_tokens=rows)

    def _send_early(self, n, is_token_in_rank, topk_idx, topk_weights, expert_alignment):
        """A dispatch without num_worst_tokens on an existing data buffer: the data dispatch runs right after
        the notify exchange on the device (no host wait between them) while the notify rows travel to the
        host; the rows then decide, as everywhere, whether the buffer fitted every rank. A rank that does
        not fit refuses the data call (its peers' calls raise RemoteError); when some rank did not fit, every
        rank re-makes the buffer and returns None (send() dispatches again on the new one), unless a rank
        without a host read went on with the old buffer, in which case this call fails on every rank."""
        T, K, E, H, num_sms = n.shape
        buf, out, failure = self.data, None, None
        try:
            with epx.collective(buf, epx.HT_DISPATCH):
                if not n.fits:
                    raise _NoFit()
            if n.fits:
                out = self._data_call(n, buf, is_token_in_rank, topk_idx, topk_weights, expert_alignment, 0)
        except _NoFit:
            pass
        except epx.RemoteError as exc:
            failure = exc
            # Kept without its traceback: the frames there hold the old buffer, which must be able to go.
            failure.__traceback__ = None
        heads, n.experts = self._finish_read(n.early, E // self.R)
        n.n_recv = sum(head[self.rank] for head in heads)
        n.buf = self._choose(heads, T, K, E, H, n.fits, num_sms, refuse=False)
        if n.buf is not buf:
            return None
        if out is None:
            if failure is not None:
                raise failure
            raise ValueError(
                "epx.compat.deep_ep: this dispatch (T %d, top-k width %d, E %d, hidden %d) does not fit the "
                "buffer made by earlier calls, and a num_worst_tokens call of another rank cannot re-make it "
                "(that takes a host sync on every rank); make one call without num_worst_tokens first"
                % (T, K, E, H))
        return out

    def _notify_rows(self, num_tokens_per_rank, num_tokens_per_expert, fields, device):
        """[R, width] fp32 whose bits are the int32 rows: two kernels (a cat of the counts and the fields,
        a gather into the rows by a cached index); the fields' device copy is made once per distinct tuple."""
        torch = _torch()
        R = self.R
        L = num_tokens_per_expert.numel() // R
        tail = self._constant(("fields", device, fields),
                              lambda: self._upload(list(fields) + [0], torch.int32, device))
        index = self._constant(("row index", device, L), lambda: self._row_index(L).to(device))
        flat = torch.cat([num_tokens_per_rank.reshape(-1).to(device=device, dtype=torch.int32),
                          num_tokens_per_expert.reshape(-1).to(device=device, dtype=torch.int32), tail])
        return flat.index_select(0, index.view(-1)).view(R, self.width).view(torch.float32)

    def _row_index(self, L):
        """Where each element of the notify rows comes from in cat(num_tokens_per_rank [R],
        num_tokens_per_expert [E], fields [_NUM_FIELDS], 0): row d gets the counts, the fields, destination
        d's L experts, then zeros."""
        torch = _torch()
        R, E, F = self.R, self.R * L, _NUM_FIELDS
        cpu = dict(dtype=torch.int64, device="cpu")  # whatever torch's default device is
        index = torch.full((R, self.width), R + E + F, **cpu)
        index[:, :R] = torch.arange(R, **cpu)
        index[:, R:R + F] = torch.arange(R + E, R + E + F, **cpu)
        index[:, R + F:R + F + L] = R + torch.arange(E, **cpu).view(R, L)
        return index

    def _read_rows(self, counts, L):
        """From the notify rows [R, width] int32, in one device->host copy: each source's row head (its R
        counts and shape fields) and this rank's received tokens per local expert, as lists."""
        return self._finish_read(self._start_read(counts), L)

    def _start_read(self, counts):
        """Starts the device->host copy of the notify rows (on cuda into page-locked memory, without
        waiting); _finish_read waits for it."""
        torch = _torch()
        if not counts.is_cuda:
            return counts, None
        if self._pinned is None or self._pinned.shape != counts.shape:
            self._pinned = torch.empty(counts.shape, dtype=torch.int32, device="cpu", pin_memory=True)
        self._pinned.copy_(counts, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(counts.device))
        return self._pinned, done

    def _finish_read(self, started, L):
        rows, done = started
        if done is not None:
            done.synchronize()
        n = self.R + _NUM_FIELDS
        return rows[:, :n].tolist(), rows[:, n:n + L].sum(dim=0).tolist()

    def _choose(self, heads, T, K, E, H, fits, num_sms, refuse=True):
        """The data buffer for this call. Every rank that read the notify rows (heads) knows every rank's
        shapes and whether that rank read them too; the buffer is (re-)made only when all did, so all
        make it. A rank that does not fit otherwise refuses the call on the current buffer."""
        if heads is None:
            return self.data
        fields = [head[self.R:] for head in heads]
        fit = [self._fits(f[_T], f[_K], f[_E], f[_H]) for f in fields]
        everyone_read = all(not (f[_WORST] and ok) for f, ok in zip(fields, fit))
        if all(fit):
            return self.data
        if not everyone_read:
            if not refuse:  # the caller's data call stood for this rank already
                return self.data
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
        k = max(max(f[_K] for f in fields), self.R)
        # DeepEP's dtypes only (split_x): rows are sized for 2-byte elements, not for fp32.
        dtypes = ["bf16", "fp8"] if H % 128 == 0 else ["bf16"]
        # Handles keep the buffer they were made on: an old one lives until its last handle goes.
        self.data = self._make_data(t_max, H, k, E, dtypes, num_sms)
        return self.data

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

    def _clean_tail(self, recv_idx, recv_w, n_recv, n_recv_device):
        """Static mode: rows past N_r get topk_idx -1 (DeepEP's fill) and weight 0."""
        torch = _torch()
        if n_recv is not None:
            recv_idx[n_recv:] = -1
            if recv_w is not None:
                recv_w[n_recv:] = 0
            return
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
            weights = self._pad(topk_weights, buf.num_topk, 0.0) if k is not None else topk_weights
            out = buf.combine(x, state.epx, topk_weights=weights, bias0=bias0, bias1=bias1)
        combined_w = out.combined_topk_weights
        if combined_w is not None and k is not None and k < buf.num_topk:
            combined_w = combined_w[:, :k].contiguous()
        return out.combined_x, combined_w
