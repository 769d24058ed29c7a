"""Inputs the binding rejects before the library call (a dtype epx lacks, a list, a big-endian array, a
destroyed handle, an argument a compat front cannot honour): the call is refused on the buffer, so the
peers' matching calls raise RemoteError well before the timeout instead of pairing with the next call,
and the ranks stay in step: the following calls succeed everywhere with the right data."""

import time

import numpy as np
import pytest

import epx
from epx.compat.hybrid_ep import HybridEPBuffer
from mp import host_comm, refused_here_or_remote, run_ranks
from npref import bf16, f32

T, H, K = 4, 128, 2
TIMEOUT_MS = 4000
PROMPT_S = 1.5  # a told peer returns well within the timeout


def routing(rank, nranks):
    """Token t of `rank` selects experts (t + rank) % E and (t + rank + 1) % E; E = 2R, L = 2."""
    E = 2 * nranks
    return np.array([[(t + rank) % E, (t + rank + 1) % E] for t in range(T)], dtype=np.int64)


def inputs(rank, nranks):
    x = np.arange(T * H, dtype=np.float32).reshape(T, H) % 16 + 16 * rank  # exact in bf16, doubled too
    idx = routing(rank, nranks)
    rmap = np.zeros((T, 2 * nranks), dtype=np.bool_)
    np.put_along_axis(rmap, idx, True, axis=1)
    return bf16(x), idx, np.ones((T, K), dtype=np.float32), rmap


def ranks_of(idx):
    """Per token, how many distinct ranks its experts live on (L = 2)."""
    return np.array([len(set(int(e) // 2 for e in row)) for row in idx])


def expect_rows(rank, nranks):
    """Tokens of every rank that reach `rank` (an HT or routing-map dispatch's N_r)."""
    return sum(int(any(int(e) // 2 == rank for e in row))
               for s in range(nranks) for row in routing(s, nranks))


# ------------------------------------------------------------------------------- the families

class Family:
    """A dispatch and its combine; check() tells whether the combined rows are right."""

    def __init__(self, rank, nranks, buf):
        self.rank, self.nranks, self.buf = rank, nranks, buf
        self.x, self.idx, self.w, self.rmap = inputs(rank, nranks)

    def round_trip(self):
        out = self.dispatch()
        self.combine(out)
        self.release(out)


class HT(Family):
    def dispatch(self, x=None, idx=None):
        out = self.buf.dispatch(self.x if x is None else x, self.idx if idx is None else idx)
        assert out.num_recv_tokens == expect_rows(self.rank, self.nranks)
        return out

    def combine(self, out, x=None, handle=None):
        got = self.buf.combine(out.recv_x if x is None else x, out.handle if handle is None else handle)
        np.testing.assert_array_equal(f32(got.combined_x), f32(self.x) * ranks_of(self.idx)[:, None])

    def release(self, out):
        out.handle.destroy()


class LL(Family):
    def dispatch(self, x=None, idx=None):
        out = self.buf.ll_dispatch(self.x if x is None else x, self.idx if idx is None else idx)
        assert int(out.recv_count.sum()) == sum(int((routing(s, self.nranks) // 2 == self.rank).sum())
                                                for s in range(self.nranks))
        return out

    def combine(self, out, w=None):
        got = self.buf.ll_combine(out.recv_x, self.idx, self.w if w is None else w, out.handle)
        np.testing.assert_array_equal(f32(got.combined_x), f32(self.x) * K)

    def release(self, out):
        pass


class RM(Family):
    def dispatch(self, x=None):
        out = self.buf.rm_dispatch(self.x if x is None else x, self.rmap)
        assert out.num_tokens == expect_rows(self.rank, self.nranks)
        return out

    def combine(self, out, handle=None):
        got = self.buf.rm_combine(out.tokens, out.handle if handle is None else handle)
        np.testing.assert_array_equal(f32(got), f32(self.x) * ranks_of(self.idx)[:, None])

    def release(self, out):
        out.handle.destroy()


def destroyed(out):
    out.handle.destroy()
    return out.handle


# (name, family, call on the refusing rank (its family object f and a valid dispatch's output d, or None
# for a dispatch), the error it raises). The others make the valid call.
CASES = [
    ("float64 x", HT, lambda f, d: f.dispatch(x=f32(f.x).astype(np.float64)), epx.InvalidArgumentError),
    ("float16 x", LL, lambda f, d: f.dispatch(x=f32(f.x).astype(np.float16)), epx.InvalidArgumentError),
    ("int16 topk_idx", HT, lambda f, d: f.dispatch(idx=f.idx.astype(np.int16)), epx.InvalidArgumentError),
    ("list x", HT, lambda f, d: f.combine(d, x=d.recv_x.tolist()), TypeError),
    ("big-endian x", RM, lambda f, d: f.dispatch(x=f.x.astype(">u2")), BufferError),
    ("destroyed handle", HT, lambda f, d: f.combine(d, handle=destroyed(d)), ValueError),
    ("destroyed handle", RM, lambda f, d: f.combine(d, handle=destroyed(d)), ValueError),
    ("list weights", LL, lambda f, d: f.combine(d, w=f.w.tolist()), TypeError),
]
COMBINES = {"list x", "destroyed handle", "list weights"}


def _refused(rank, nranks, uid, case):
    name, family, bad, error = CASES[case]
    comm = host_comm(rank, nranks, uid, timeout_ms=TIMEOUT_MS)
    f = family(rank, nranks, epx.Buffer(comm, T, H, K, 2 * nranks))
    refuser = case % nranks
    d = f.dispatch() if name in COMBINES else None
    start = time.monotonic()
    e = refused_here_or_remote(rank == refuser, lambda: bad(f, d),
                               lambda: f.combine(d) if d is not None else f.dispatch(), error=error)
    if rank != refuser:
        assert e.value.result == "ERR_REMOTE" and str(refuser) in e.value.message
    took = time.monotonic() - start
    if d is not None and name != "destroyed handle":
        f.combine(d)  # the dispatch's handle still pairs
    if d is not None and not (rank == refuser and name == "destroyed handle"):
        f.release(d)
    f.round_trip()
    f.round_trip()
    return took


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("case", range(len(CASES)), ids=["%s-%s" % (c[0], c[1].__name__) for c in CASES])
def test_refused_call_reaches_peers(nranks, case):
    took = run_ranks(nranks, _refused, case=case)
    assert max(took) < PROMPT_S, took


def _ll_slots(rank, nranks, uid):
    """A refused LL dispatch takes its slot on every rank: the dispatch after the next one reuses the
    first one's slot everywhere, so the first handle is stale on every rank alike."""
    comm = host_comm(rank, nranks, uid, timeout_ms=TIMEOUT_MS)
    f = LL(rank, nranks, epx.Buffer(comm, T, H, K, 2 * nranks))
    first = f.dispatch()
    if rank == 0:
        with pytest.raises(TypeError):
            f.buf.ll_dispatch(f.x.tolist(), f.idx)
    else:
        with pytest.raises(epx.RemoteError):
            f.dispatch()
    second = f.dispatch()
    with pytest.raises((epx.InvalidArgumentError, epx.RemoteError)):
        f.combine(first)
    f.combine(second)
    return True


@pytest.mark.parametrize("nranks", [2, 3])
def test_refused_ll_dispatch_keeps_slots(nranks):
    assert run_ranks(nranks, _ll_slots) == [True] * nranks


def _compat(rank, nranks, uid):
    """A compat front's own rejection (pure Python) is refused the same way."""
    comm = host_comm(rank, nranks, uid, timeout_ms=TIMEOUT_MS)
    hep = HybridEPBuffer(hidden_dim=H, max_num_of_tokens_per_rank=T, num_local_experts=2, num_topk=K,
                         comm=comm)
    x, idx, _, rmap = inputs(rank, nranks)
    start = time.monotonic()
    if rank == nranks - 1:
        with pytest.raises(NotImplementedError, match="async_mode"):
            hep.dispatch(x, routing_map=rmap, async_mode=True)
    else:
        with pytest.raises(epx.RemoteError):
            hep.dispatch(x, routing_map=rmap)
    took = time.monotonic() - start
    tokens, _, _, handle = hep.dispatch(x, routing_map=rmap)
    if rank == 0:
        with pytest.raises(ValueError, match="probs"):
            hep.combine(tokens, probs=tokens, handle=handle)
    else:
        with pytest.raises(epx.RemoteError):
            hep.combine(tokens, handle=handle)
    combined, _ = hep.combine(tokens, handle=handle)
    np.testing.assert_array_equal(f32(combined), f32(x) * ranks_of(idx)[:, None])
    return took


@pytest.mark.parametrize("nranks", [2, 3])
def test_compat_rejection_reaches_peers(nranks):
    pytest.importorskip("torch")  # the HybridEP front works on torch tensors
    assert max(run_ranks(nranks, _compat)) < PROMPT_S


def test_one_rank_goes_on():
    """On one rank a refusal tells no one and the next call works; a destroyed buffer has no one to tell."""
    comm = host_comm(0, 1, epx.get_unique_id())
    buf = epx.Buffer(comm, T, H, K, 2)
    f = HT(0, 1, buf)
    calls = buf._collective_calls
    with pytest.raises(epx.InvalidArgumentError):
        f.dispatch(x=f32(f.x).astype(np.float64))
    assert buf._collective_calls == calls + 1
    f.round_trip()
    buf.destroy()
    with pytest.raises(ValueError, match="destroyed"):
        f.dispatch()


def _deep_ep(rank, nranks, dist):
    """The DeepEP front: a refusal before the count exchange is refused on the front's notify buffer;
    later ones (in the binding) are refused on the data buffer. Needs torch."""
    import torch

    from epx.compat import deep_ep
    from npref import Problem
    from test_torch_cpu import inputs as torch_inputs
    from torchutil import bf16_bits

    p = Problem(11, nranks, T, H, K, 2 * nranks, ragged=False)
    comm = epx.Comm.from_torch(dist.group.WORLD, backend="host", timeout_ms=TIMEOUT_MS)
    buf = deep_ep.Buffer(dist.group.WORLD, 0, 0, comm=comm)
    x, idx, w = torch_inputs(p, rank)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, p.E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    refuser = nranks - 1
    refused_here_or_remote(rank == refuser,
                           lambda: buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert),
                           lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout), match="topk_idx")
    recv_x, _, _, counts, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
    want_x, _, _, want_counts = p.ht_dispatch(rank)
    np.testing.assert_array_equal(bf16_bits(recv_x), want_x)
    assert counts == want_counts.tolist()
    if rank == 0:
        with pytest.raises(epx.InvalidArgumentError):
            buf.dispatch(x.double(), handle=handle)
    else:
        with pytest.raises(epx.RemoteError):
            buf.dispatch(x, handle=handle)
    y = (recv_x.float() * (rank + 1)).to(torch.bfloat16)
    refused_here_or_remote(rank == refuser, lambda: buf.combine(y.tolist(), handle), lambda: buf.combine(y, handle),
                           error=TypeError)
    combined, _, _ = buf.combine(y, handle)
    np.testing.assert_array_equal(bf16_bits(combined), p.ht_combine(rank))
    buf.destroy()
    return True


@pytest.mark.parametrize("nranks", [2, 3])
def test_deep_ep_rejection_reaches_peers(nranks):
    pytest.importorskip("torch")
    from torchutil import run_in_group

    assert run_in_group(nranks, _deep_ep) == [True] * nranks
