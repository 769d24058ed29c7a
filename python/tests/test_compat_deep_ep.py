"""epx.compat.deep_ep driven the way DeepEP's intranode and low-latency tests drive DeepEP (dispatch with and
without top-k, cached, num_worst_tokens, combine with weights, LL with hooks / out / zero-copy / fp8, the
mask buffer), on CPU torch tensors over the host backend with a gloo group; every result is checked against
a reference computed here from all ranks' inputs. Skipped where torch is not installed."""

import pytest

torch = pytest.importorskip("torch")

import epx  # noqa: E402
from epx.compat import deep_ep  # noqa: E402
from mp import refused_here_or_remote  # noqa: E402
from torchutil import run_in_group  # noqa: E402

SEED = 20240611
H = 256  # fp8 needs a multiple of 128


def make_inputs(rank, nranks, T, K, E, seed=SEED):
    """Rank `rank`'s x (bf16, from (rank, token, channel)), topk_idx (distinct experts, some -1) and weights;
    every rank can rebuild every other rank's."""
    g = torch.Generator().manual_seed(seed * 131 + rank)
    x = (torch.randn((T, H), generator=g) * 4).to(torch.bfloat16)
    x[:, 0] = rank
    scores = torch.rand((T, E), generator=g)
    topk_idx = torch.topk(scores, K, dim=1).indices.to(torch.int64)
    drop = torch.rand((T, K), generator=g) < 0.15
    topk_idx[drop] = -1
    weights = torch.rand((T, K), generator=g, dtype=torch.float32) + 0.5
    return x, topk_idx, weights


def tokens(rank, nranks):
    return 5 + 3 * rank + (rank % 2)  # ragged


def rank_sets(topk_idx, nranks, L):
    """[T, R] bool: the ranks each token goes to."""
    owner = torch.where(topk_idx >= 0, topk_idx // L, torch.full_like(topk_idx, -1))
    return (owner.unsqueeze(-1) == torch.arange(nranks)).any(dim=1)


def ht_reference(rank, nranks, K, E):
    """What rank receives in HT order: rows (x, local topk_idx, weights), the prefix matrix, expert counts."""
    L = E // nranks
    xs, idxs, ws = [], [], []
    prefix, per_expert = torch.zeros((nranks, nranks), dtype=torch.int32), torch.zeros(L)
    running = torch.zeros(nranks, dtype=torch.int32)
    for s in range(nranks):
        x, idx, w = make_inputs(s, nranks, tokens(s, nranks), K, E)
        in_rank = rank_sets(idx, nranks, L)
        running += in_rank.sum(dim=0).to(torch.int32)
        prefix[s] = running
        sel = in_rank[:, rank]
        mine = (idx >= rank * L) & (idx < (rank + 1) * L)
        local = torch.where(mine, idx - rank * L, torch.full_like(idx, -1))
        xs.append(x[sel])
        idxs.append(local[sel])
        ws.append(torch.where(local[sel] >= 0, w[sel], torch.zeros_like(w[sel])))
        per_expert += torch.bincount(idx[idx >= 0], minlength=E)[rank * L:(rank + 1) * L]
    return torch.cat(xs), torch.cat(idxs), torch.cat(ws), prefix, [int(c) for c in per_expert]


def per_token_fp8(x):
    """x [T, H] -> (fp8 [T, H], scales [T, H/128] in column-major storage, as DeepEP's test passes them)."""
    v = x.float().view(x.shape[0], -1, 128)
    scale = v.abs().amax(dim=2).clamp(min=1e-4) / 448.0
    q = (v / scale.unsqueeze(2)).to(torch.float8_e4m3fn).view(x.shape)
    return q, scale.T.contiguous().T


def exact(a, b, what):
    if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16:
        a, b = a.float(), b.float()  # bf16 -> fp32 is exact; -0 (a token sent nowhere) equals 0
    assert torch.equal(a, b), "%s differs:\n%s\n%s" % (what, a, b)


class NoCollectives:
    """Fails any torch.distributed collective made inside the block (DeepEP makes none per call)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier", "all_to_all")

    def __init__(self, dist):
        self.dist, self.saved = dist, {}

    def __enter__(self):
        for name in self.NAMES:
            self.saved[name] = getattr(self.dist, name)

            def refuse(*a, _name=name, **k):
                raise AssertionError("torch.distributed.%s called inside a dispatch/combine" % _name)

            setattr(self.dist, name, refuse)

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.dist, name, fn)


def make_buffer(dist, num_rdma_bytes=0, **kw):
    comm = epx.Comm.from_torch(dist.group.WORLD, backend="host")
    return deep_ep.Buffer(dist.group.WORLD, int(1e8), num_rdma_bytes, comm=comm, explicitly_destroy=True,
                          **kw)


# ------------------------------------------------------------------ HT, as test_intranode.py


def _intranode(rank, nranks, dist, K):
    E = 4 * nranks
    L = E // nranks
    T = tokens(rank, nranks)
    buf = make_buffer(dist)
    x, idx, w = make_inputs(rank, nranks, T, K, E)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    want_x, want_idx, want_w, want_prefix, want_counts = ht_reference(rank, nranks, K, E)
    n_recv = want_x.shape[0]
    x_fp8 = per_token_fp8(x)
    assert not x_fp8[1].is_contiguous()
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    # The first dispatch makes the data buffer (a bootstrap collective, once); later calls make none.
    buf.dispatch(x, topk_idx=idx, **layout)
    with NoCollectives(dist):
        for previous in (False, True):
            for async_mode in (False, True):
                for current in (x, x_fp8):
                    for with_topk in (False, True):
                        args = dict(layout, x=current, config=deep_ep.Config(24, 8, 256),
                                    async_finish=async_mode)
                        if with_topk:
                            args.update(topk_idx=idx, topk_weights=w)
                        if previous:
                            args["previous_event"] = buf.capture()
                        recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(**args)
                        event.current_stream_wait()
                        assert isinstance(handle, tuple) and len(handle) == 6
                        exact(handle[0], want_prefix, "rank prefix matrix")
                        assert counts == want_counts, (counts, want_counts)
                        if isinstance(current, tuple):
                            assert recv_x[0].dtype == torch.float8_e4m3fn and recv_x[0].shape[0] == n_recv
                            q, s = recv_x[0].float().view(n_recv, H // 128, 128), recv_x[1].unsqueeze(2)
                            back = (q * s).view(n_recv, H)
                            assert torch.allclose(back, want_x.float(), rtol=0.07, atol=1e-3)
                            recv_x = back.to(torch.bfloat16)
                        else:
                            exact(recv_x, want_x, "recv_x")
                        if with_topk:
                            exact(recv_idx, want_idx, "recv_topk_idx")
                            exact(recv_w, want_w, "recv_topk_weights")
                            worst = nranks * 16
                            args["num_worst_tokens"] = worst
                            wx, widx, ww, empty, _, ev = buf.dispatch(**args)
                            ev.current_stream_wait()
                            wx = wx[0] if isinstance(wx, tuple) else wx
                            assert empty == [] and wx.shape[0] == worst and widx.shape == (worst, K)
                            exact(widx[:n_recv], want_idx, "static recv_topk_idx")
                            exact(ww[:n_recv], want_w, "static recv_topk_weights")
                            assert bool((widx[n_recv:] == -1).all()), "rows past N_r must hold -1"
                        else:
                            assert recv_idx is None and recv_w is None
                            cargs = dict(x=current, handle=handle, async_finish=async_mode)
                            if previous:
                                cargs["previous_event"] = buf.capture()
                            again, n1, n2, n3, n4, ev = buf.dispatch(**cargs)
                            ev.current_stream_wait()
                            assert (n1, n2, n3, n4) == (None, None, None, None)
                            again = again[0].float() if isinstance(again, tuple) else again
                            if not isinstance(current, tuple):
                                exact(again, want_x, "cached recv_x")
                        comb_args = dict(x=recv_x, handle=handle, async_finish=async_mode)
                        if with_topk:
                            comb_args["topk_weights"] = recv_w
                        combined, combined_w, ev = buf.combine(**comb_args)
                        ev.current_stream_wait()
                        times = in_rank.sum(dim=1, keepdim=True).float()
                        if not isinstance(current, tuple):
                            exact(combined, (x.float() * times).to(torch.bfloat16), "combined_x")
                        if with_topk:
                            want_cw = torch.where(idx >= 0, w, torch.zeros_like(w))
                            exact(combined_w, want_cw, "combined weights")
                        else:
                            assert combined_w is None
    # A larger T later re-makes the data buffer (decided alike on every rank from the notify rows).
    big = make_inputs(rank, nranks, 40 + rank, K, E, seed=7)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(big[1], E)
    recv_x, _, _, _, handle, _ = buf.dispatch(big[0], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert, topk_idx=big[1])
    combined, _, _ = buf.combine(recv_x, handle)
    times = in_rank.sum(dim=1, keepdim=True).float()
    exact(combined, (big[0].float() * times).to(torch.bfloat16), "combined_x after growth")
    assert int(handle[0][-1, rank]) == recv_x.shape[0]
    # Only the last rank's tokens outgrow the buffer: the data call the others make before their host
    # read fails (that rank refuses it), and every rank re-makes the buffer and dispatches again.
    old = buf._ht_path.data
    T_big = old.max_tokens + 5 if rank == nranks - 1 else 40 + rank
    big = make_inputs(rank, nranks, T_big, K, E, seed=9)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(big[1], E)
    recv_x, _, _, _, handle, _ = buf.dispatch(big[0], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert, topk_idx=big[1])
    assert buf._ht_path.data is not old and buf._ht_path.data.max_tokens >= T_big
    del old
    combined, _, _ = buf.combine(recv_x, handle)
    times = in_rank.sum(dim=1, keepdim=True).float()
    exact(combined, (big[0].float() * times).to(torch.bfloat16), "combined_x after one rank's growth")
    buf.destroy()


@pytest.mark.parametrize("nranks,K", [(2, 3), (4, 3), (4, 6)])
def test_intranode_sequence(nranks, K):
    run_in_group(nranks, _intranode, K=K)


def _refusals(rank, nranks, dist):
    E, K = 2 * nranks, 2
    T = tokens(rank, nranks)
    buf = make_buffer(dist)
    x, idx, w = make_inputs(rank, nranks, T, K, E)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    refuser = nranks - 1
    # The first call, ranks disagreeing on hidden: the agreement tells every rank, all raise the same error.
    odd_x = torch.zeros((x.shape[0], x.shape[1] // 2), dtype=torch.bfloat16) if rank == refuser else x
    with pytest.raises(ValueError, match="disagree on num_experts and hidden"):
        buf.dispatch(odd_x, topk_idx=idx, **layout)
    assert buf._ht_path.data is None
    # Before the first data buffer: no routing at all.
    refused_here_or_remote(rank == refuser,
                           lambda: buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert),
                           lambda: buf.dispatch(x, **layout), match="is_token_in_rank")
    # Static mode without top-k (DeepEP asserts the same).
    refused_here_or_remote(rank == refuser, lambda: buf.dispatch(x, num_worst_tokens=64, **layout),
                           lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=64, **layout),
                           match="num_worst_tokens")
    # DeepEP's dtypes only: bf16, or (fp8, fp32 scales); the data buffer holds no others.
    refused_here_or_remote(rank == refuser, lambda: buf.dispatch(x.float(), topk_idx=idx, **layout),
                           lambda: buf.dispatch(x, topk_idx=idx, **layout), error=epx.InvalidArgumentError,
                           match="float32")
    recv_x, _, _, counts, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
    want_x, _, _, _, want_counts = ht_reference(rank, nranks, K, E)
    exact(recv_x, want_x, "recv_x after refusals")
    assert counts == want_counts
    q, s = per_token_fp8(x)
    refused_here_or_remote(rank == 0, lambda: buf.dispatch((q, s.double()), handle=handle),
                           lambda: buf.dispatch(x, handle=handle), error=epx.InvalidArgumentError,
                           match="float64")
    refused_here_or_remote(rank == 0, lambda: buf.dispatch(x.half(), handle=handle),
                           lambda: buf.dispatch(x, handle=handle), error=epx.InvalidArgumentError,
                           match="float16")
    # Combine with something that is not a handle, on one rank.
    refused_here_or_remote(rank == 0, lambda: buf.combine(recv_x, (1, 2, 3)), lambda: buf.combine(recv_x, handle),
                           error=TypeError, match="handle")
    # A refusal after the data buffer exists (the agreement tells every rank): the refuser raises its own
    # error, the others RemoteError, and the next call pairs as usual.
    refused_here_or_remote(rank == refuser,
                           lambda: buf.dispatch(x, topk_idx=idx[:, :1].float(), **layout),
                           lambda: buf.dispatch(x, topk_idx=idx, **layout), match="topk_idx")
    # A static call with T past the buffer cannot grow it (no host sync, so no agreement): the rank that
    # does not fit refuses, the others raise RemoteError; the buffer stays.
    old = buf._ht_path.data
    big = make_inputs(rank, nranks, old.max_tokens + 3, K, E, seed=3) if rank == refuser else (x, idx, w)
    pr, _, pe, ir, _ = buf.get_dispatch_layout(big[1], E)
    big_layout = dict(num_tokens_per_rank=pr, is_token_in_rank=ir, num_tokens_per_expert=pe)

    def too_many():
        buf.dispatch(big[0], topk_idx=big[1], topk_weights=big[2], num_worst_tokens=4 * nranks, **big_layout)

    refused_here_or_remote(rank == refuser, too_many, too_many, match="num_worst_tokens")
    assert buf._ht_path.data is old
    del old
    # Weights narrower than the ids (DeepEP asserts equal shapes; they were zero-padded), and a combine
    # with weights wider than the data buffer's top-k (they gave a negative pad width).
    refused_here_or_remote(rank == refuser,
                           lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w[:, :1].contiguous(), **layout),
                           lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout),
                           match="topk_weights must have topk_idx's shape")
    wide = torch.ones((recv_x.shape[0], buf._ht_path.data.num_topk + 1), dtype=torch.float32)
    refused_here_or_remote(rank == 0, lambda: buf.combine(recv_x, handle, topk_weights=wide),
                           lambda: buf.combine(recv_x, handle), match="more than the data buffer.s num_topk")
    # is_token_in_rank must be [T, R] bool, as DeepEP asserts ([T, 1] was broadcast: tokens went to the
    # wrong ranks).
    for bad in (in_rank[:, :1].contiguous(), in_rank.to(torch.int32)):
        refused_here_or_remote(rank == refuser,
                               lambda: buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=bad,
                                                    num_tokens_per_expert=per_expert),
                               lambda: buf.dispatch(x, **layout), match="is_token_in_rank must be")
    combined, _, _ = buf.combine(recv_x, handle)
    exact(combined, (x.float() * in_rank.sum(dim=1, keepdim=True).float()).to(torch.bfloat16), "combined")
    # Narrow top-k (K below the ranks) gives contiguous recv_topk_idx, as DeepEP's; no stream on the CPU.
    narrow_idx = idx[:, :1].to(torch.int32).contiguous()  # the buffer's own id dtype: no copy by dtype
    nr, _, ne, ni, _ = buf.get_dispatch_layout(narrow_idx, E)
    _, r_idx, _, _, _, _ = buf.dispatch(x, topk_idx=narrow_idx, topk_weights=w[:, :1].contiguous(),
                                        num_tokens_per_rank=nr, is_token_in_rank=ni, num_tokens_per_expert=ne)
    assert r_idx.is_contiguous() and r_idx.view(-1).numel() == r_idx.numel()
    assert buf.get_comm_stream() is None
    buf.destroy()


@pytest.mark.parametrize("nranks", [2, 4])
def test_refusals_reach_peers(nranks):
    run_in_group(nranks, _refusals)


def _data_dtypes(rank, nranks, dist):
    """The data buffer is made for DeepEP's dtypes only: bf16, plus fp8 where hidden allows it."""
    E, K = 2 * nranks, 2
    made = []

    class Recording(epx.Buffer):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("dispatch_dtypes"))
            super().__init__(*args, **kwargs)

    saved, epx.Buffer = epx.Buffer, Recording
    try:
        buf = make_buffer(dist)
        for hidden in (256, 192):
            _, idx, w = make_inputs(rank, nranks, tokens(rank, nranks), K, E, seed=hidden)
            x = torch.full((idx.shape[0], hidden), float(rank), dtype=torch.bfloat16)
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
            layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                          num_tokens_per_expert=per_expert)
            recv_x, _, _, _, _, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
            data_made = [m for m in made if m != "fp32"]  # the agreement and counts buffers carry fp32
            assert data_made[-1] == (["bf16", "fp8"] if hidden % 128 == 0 else ["bf16"]), made
            assert recv_x.shape[1] == hidden and bool((recv_x[:, 0] >= 0).all())
        q = torch.zeros((x.shape[0], 192), dtype=torch.float8_e4m3fn)
        s = torch.ones((x.shape[0], 1), dtype=torch.float32)
        refused_here_or_remote(rank == 0, lambda: buf.dispatch((q, s), topk_idx=idx, **layout),
                               lambda: buf.dispatch(x, topk_idx=idx, **layout), match="multiple of 128")
        buf.destroy()
    finally:
        epx.Buffer = saved


def test_data_buffer_dtypes():
    run_in_group(2, _data_dtypes)



def buffer_in_mode(dist, mode):
    """A front Buffer made with deep_ep.VIEWS = mode (the module setting restored after)."""
    saved, deep_ep.VIEWS = deep_ep.VIEWS, mode
    try:
        return make_buffer(dist)
    finally:
        deep_ep.VIEWS = saved

def _per_call_work(rank, nranks, dist):
    """The torch ops the front makes per call, seen through a TorchDispatchMode on CPU tensors: no op that
    synchronises with the host on a GPU (nonzero, bincount, boolean indexing, item), no host->device upload of
    shape fields once they were seen, and few kernels (view-like ops and the binding's allocations aside)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    free = {"view", "unsqueeze", "expand", "slice", "select", "reshape", "_reshape_alias", "detach", "alias",
            "_unsafe_view", "as_strided", "is_pinned", "empty", "new_empty", "empty_strided", "t", "transpose"}
    syncs = {"nonzero", "bincount", "index", "masked_select", "_local_scalar_dense", "item", "lift_fresh"}
    E, K = 4 * nranks, 3
    # Copies: with views recv_topk_idx takes one more kernel (int32 -> int64).
    buf = buffer_in_mode(dist, "0")
    x, idx, w = make_inputs(rank, nranks, tokens(rank, nranks), K, E)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
    with Ops() as seen_layout:
        got = buf.get_dispatch_layout(idx, E)
    with Ops() as seen_dispatch:
        recv_x, _, _, counts, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
    want_in_rank = rank_sets(idx, nranks, E // nranks)
    exact(got[3], want_in_rank, "is_token_in_rank")
    exact(got[0], want_in_rank.sum(dim=0).to(torch.int32), "num_tokens_per_rank")
    exact(got[2], torch.bincount(idx[idx >= 0], minlength=E).to(torch.int32), "num_tokens_per_expert")
    assert got[1] is None and got[0].dtype == got[2].dtype == torch.int32 and got[3].dtype == torch.bool
    want_x, _, _, want_prefix, want_counts = ht_reference(rank, nranks, K, E)
    exact(recv_x, want_x, "recv_x")
    exact(handle[0], want_prefix, "rank prefix matrix")
    assert counts == want_counts
    for what, names, most in (("get_dispatch_layout", seen_layout.names, 11),
                              ("dispatch", seen_dispatch.names, 4)):
        assert not syncs & set(names), "%s makes %s" % (what, sorted(syncs & set(names)))
        kernels = [n for n in names if n not in free]
        assert len(kernels) <= most, "%s makes %d kernels, at most %d expected: %s" % (
            what, len(kernels), most, kernels)
    del recv_x, handle
    buf.destroy()


def test_per_call_work():
    run_in_group(2, _per_call_work)


def _view_modes(rank, nranks, dist, mode):
    """deep_ep.VIEWS (EPX_DEEPEP_VIEWS): every mode gives DeepEP's results when outputs are consumed before
    the next call; "pooled" and "0" keep outputs as tensors of their own across later dispatches."""
    E, K = 4 * nranks, 3
    buf = buffer_in_mode(dist, mode)
    x, idx, w = make_inputs(rank, nranks, tokens(rank, nranks), K, E)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    want_x, want_idx, want_w, want_prefix, want_counts = ht_reference(rank, nranks, K, E)
    times = in_rank.sum(dim=1, keepdim=True).float()
    want_combined = (x.float() * times).to(torch.bfloat16)
    kept = []
    for worst in (0, nranks * 16):
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                                   num_worst_tokens=worst, **layout)
        n = want_x.shape[0]
        assert recv_idx.dtype == torch.int64 and recv_x.shape[0] == (worst or n)
        exact(recv_x[:n], want_x, "recv_x")
        exact(recv_idx[:n], want_idx, "recv_topk_idx")
        exact(recv_w[:n], want_w, "recv_topk_weights")
        assert bool((recv_idx[n:] == -1).all()) and bool((recv_w[n:] == 0).all())
        assert counts == ([] if worst else want_counts)
        exact(handle[0], want_prefix, "rank prefix matrix")
        combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
        exact(combined, want_combined, "combined_x")
        exact(combined_w, torch.where(idx >= 0, w, torch.zeros_like(w)), "combined weights")
        again = buf.dispatch((x.float() * 2).to(torch.bfloat16), handle=handle)[0]
        exact(again[:n], (want_x.float() * 2).to(torch.bfloat16), "cached recv_x")
        combined, _, _ = buf.combine(again, handle)
        exact(combined, (want_combined.float() * 2).to(torch.bfloat16), "combined cached")
        kept.append((recv_x[:n].clone(), recv_x, recv_idx, recv_w))
    data = buf._ht_path.data
    if mode == "1":
        assert data.views is True or data.views == 1
    else:
        assert data.views is False or buf._ht_path.native_options["views"] == "pooled"
        # DeepEP's contract: outputs are the caller's, whatever later dispatches did.
        first, recv_x, recv_idx, recv_w = kept[0]
        exact(recv_x, first, "recv_x of an earlier dispatch")
        exact(recv_idx, want_idx, "recv_topk_idx of an earlier dispatch")
        exact(recv_w, want_w, "recv_topk_weights of an earlier dispatch")
    del kept, recv_x, recv_idx, recv_w, handle, again
    buf.destroy()


@pytest.mark.parametrize("mode", ["pooled", "0", "1"])
def test_view_modes(mode):
    run_in_group(2, _view_modes, mode=mode)


def _pooled_request(rank, nranks, dist):
    """The front asks for pooled views with view_areas (so a binding without them refuses the keyword) and
    makes copies where the binding refuses it; a bad setting raises before anything is made."""
    seen = []

    class WithPooledViews(epx.Buffer):  # stands in for a binding that takes views="pooled"
        def __init__(self, *args, views=False, view_areas=None, **kwargs):
            seen.append((views, view_areas))
            super().__init__(*args, **kwargs)

    import inspect

    E, K = 2 * nranks, 2
    x, idx, w = make_inputs(rank, nranks, tokens(rank, nranks), K, E)
    saved = deep_ep.VIEWS, epx.Buffer
    pooled = {"views": "pooled", "view_areas": 0}
    has_pooled = "view_areas" in inspect.signature(epx.Buffer.__init__).parameters
    try:
        deep_ep.VIEWS = "pooled"
        real = pooled if has_pooled else {"views": False}
        for binding, want in ((WithPooledViews, pooled), (saved[1], real)):
            epx.Buffer = binding
            buf = make_buffer(dist)
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
            recv_x = buf.dispatch(x, topk_idx=idx, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                  num_tokens_per_expert=per_expert)[0]
            exact(recv_x, ht_reference(rank, nranks, K, E)[0], "recv_x")
            assert buf._ht_path.native_options == want, buf._ht_path.native_options
            del recv_x
            buf.destroy()
        # The agreement and counts buffers are made without views; the data buffer asks for pooled ones.
        assert [v for v in seen if v != (False, None)] == [("pooled", 0)], seen
        deep_ep.VIEWS = "yes"
        comm = epx.Comm.from_torch(dist.group.WORLD, backend="host")
        with pytest.raises(ValueError, match="EPX_DEEPEP_VIEWS"):
            deep_ep.Buffer(dist.group.WORLD, comm=comm)
        comm.destroy()
    finally:
        deep_ep.VIEWS, epx.Buffer = saved


def test_pooled_views_requested():
    run_in_group(2, _pooled_request)


class MPIStandIn:
    """The three calls of an mpi4py communicator that DeepEP's comm= path uses (no Barrier: the front must
    do without), over the torch group."""

    def __init__(self, dist):
        self.dist = dist

    def Get_rank(self):
        return self.dist.get_rank()

    def Get_size(self):
        return self.dist.get_world_size()

    def allgather(self, obj):
        out = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(out, obj)
        return out


def _mpi_comm(rank, nranks, dist):
    buf = deep_ep.Buffer(None, int(1e8), 0, comm=MPIStandIn(dist), explicitly_destroy=True)
    assert (buf.rank, buf.group_size) == (rank, nranks) and isinstance(buf.comm, epx.Comm)
    if buf.comm.backend == "host":
        E, K = 2 * nranks, 2
        x, idx, w = make_inputs(rank, nranks, tokens(rank, nranks), K, E)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
                                                  is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        combined, _, _ = buf.combine(recv_x, handle)
        # Every receiving rank sends the row back unchanged: the sum is x times the ranks it went to.
        ranks = in_rank.sum(dim=1, dtype=torch.float32).view(-1, 1)
        assert torch.equal(combined, (x.float() * ranks).to(torch.bfloat16))
    buf.destroy()
    with pytest.raises(TypeError, match="Get_rank"):
        deep_ep.Buffer(None, int(1e8), 0, comm=object())


def test_mpi_comm():
    run_in_group(2, _mpi_comm)


def test_front_surface():
    assert deep_ep.topk_idx_t == torch.int64
    assert deep_ep.Buffer.is_sm90_compiled() is True
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) > 0
    assert isinstance(deep_ep.Buffer.capture(), deep_ep.EventOverlap)
    assert deep_ep.Config(24, 8, 256).get_nvl_buffer_size_hint(7168 * 2, 8) > 0
    with pytest.raises(AttributeError):
        deep_ep.no_such_name


# ------------------------------------------------------------------ LL, as test_low_latency.py


def ll_reference(rank, nranks, T, K, E, masked=()):
    """Per local expert of rank: the rows it receives (source rank ascending, then token) and src_info."""
    L = E // nranks
    rows, srcs = [[] for _ in range(L)], [[] for _ in range(L)]
    for s in range(nranks):
        x, idx, _ = make_inputs(s, nranks, T, K, E)
        for j in range(L):
            e = rank * L + j
            if rank in masked:
                continue
            hit = (idx == e).any(dim=1).nonzero().flatten()
            rows[j].append(x[hit])
            srcs[j].append(hit.to(torch.int32))
    return [torch.cat(r) if r else torch.zeros((0, H), dtype=torch.bfloat16) for r in rows], \
        [torch.cat(s) if s else torch.zeros(0, dtype=torch.int32) for s in srcs]


def ll_combine_reference(x, idx, w, scale_of):
    """sum over slots k ascending of w * y, y = x scaled per expert (the test's stand-in for the expert)."""
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(idx.shape[1]):
        valid = idx[:, k] >= 0
        y = (x.float() * scale_of(idx[:, k].clamp(min=0)).view(-1, 1)).to(torch.bfloat16).float()
        acc = torch.where(valid.view(-1, 1), acc + w[:, k:k + 1] * y, acc)
    return acc.to(torch.bfloat16)


def _low_latency(rank, nranks, dist):
    T, K, E = 6, 3, 4 * nranks
    L = E // nranks
    buf = make_buffer(dist, low_latency_mode=True, enable_shrink=True,
                      num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, nranks, E))
    x, idx, w = make_inputs(rank, nranks, T, K, E)
    buf.clean_low_latency_buffer(T, H, E, num_topk=K)
    want_rows, want_src = ll_reference(rank, nranks, T, K, E)

    def scale_of(e):
        return (e % 3 + 1).float()

    with NoCollectives(dist):
        for hook_mode in (False, True):
            for use_fp8 in (False, True):
                stats = torch.zeros(L, dtype=torch.int32)
                recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
                    x, idx, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
                    async_finish=not hook_mode, return_recv_hook=hook_mode)
                hook() if hook_mode else event.current_stream_wait()
                assert len(handle) == 5 and handle[2:] == (T, H, E)
                src_info, layout_range = handle[0], handle[1]
                for j in range(L):
                    n = want_rows[j].shape[0]
                    assert int(recv_count[j]) == n and int(stats[j]) == n
                    assert int((layout_range[j] & 0xFFFFFFFF).sum()) == n
                    exact(src_info[j, :n], want_src[j], "src_info")
                    if use_fp8:
                        q, s = recv_x
                        assert s.shape == (L, nranks * T, H // 128) and not s.is_contiguous()
                        back = (q[j, :n].float().view(n, H // 128, 128) * s[j, :n].unsqueeze(2)).view(n, H)
                        assert torch.allclose(back, want_rows[j].float(), rtol=0.07, atol=1e-3)
                    else:
                        exact(recv_x[j, :n], want_rows[j], "LL recv_x")
                if use_fp8:
                    continue
                y = torch.stack([(recv_x[j].float() * scale_of(torch.tensor(rank * L + j))).to(torch.bfloat16)
                                 for j in range(L)])
                want = ll_combine_reference(x, idx, w, scale_of)
                for zero_copy in (False, True):
                    if zero_copy:
                        buf.get_next_low_latency_combine_buffer(handle)[:, :, :] = y
                    out = torch.empty((T, H), dtype=torch.bfloat16)
                    combined, event, chook = buf.low_latency_combine(
                        y, idx, w, handle, zero_copy=zero_copy, async_finish=not hook_mode,
                        return_recv_hook=hook_mode, out=out)
                    chook() if hook_mode else event.current_stream_wait()
                    assert combined is out
                    exact(out, want, "LL combined (zero_copy=%s, hook=%s)" % (zero_copy, hook_mode))
        # use_logfmt: accepted, carried in bf16 (no LogFMT encoding): the exact combine.
        combined, event, _ = buf.low_latency_combine(y, idx, w, handle, use_logfmt=True)
        event.current_stream_wait()
        exact(combined, want, "LL combined with use_logfmt")
        refused_here_or_remote(rank == 0, lambda: buf.low_latency_dispatch(x.float(), idx, T, E),
                               lambda: buf.low_latency_dispatch(x, idx, T, E), error=epx.InvalidArgumentError,
                               match="float32")
        # The mask buffer: every rank masks the last rank, whose experts then receive nothing and whose
        # slots combine as absent.
        status = torch.zeros(nranks, dtype=torch.int32)
        buf.low_latency_update_mask_buffer(nranks - 1, True)
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0] * (nranks - 1) + [1]
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        masked_rows, _ = ll_reference(rank, nranks, T, K, E, masked=(nranks - 1,))
        assert recv_count.tolist() == [r.shape[0] for r in masked_rows]
        y = torch.stack([(recv_x[j].float() * scale_of(torch.tensor(rank * L + j))).to(torch.bfloat16)
                         for j in range(L)])
        combined, _, _ = buf.low_latency_combine(y, idx, w, handle)
        live = idx.masked_fill(idx >= (nranks - 1) * L, -1)
        exact(combined, ll_combine_reference(x, live, w, scale_of), "LL combined with a masked rank")
        buf.low_latency_clean_mask_buffer()
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0] * nranks
    buf.destroy()


@pytest.mark.parametrize("nranks", [2, 4])
def test_low_latency_sequence(nranks):
    run_in_group(nranks, _low_latency)


def _no_shrink(rank, nranks, dist):
    buf = make_buffer(dist)
    with pytest.raises(RuntimeError, match="enable_shrink"):
        buf.low_latency_update_mask_buffer(0, True)
    buf.destroy()


def test_mask_buffer_needs_enable_shrink():
    run_in_group(2, _no_shrink)


def _misuse(rank, nranks, dist):
    T, K, E = 5, 2, 2 * nranks
    buf = make_buffer(dist, low_latency_mode=True)
    x, idx, w = make_inputs(rank, nranks, T, K, E)
    # Layout (local, no wait for the device): an id outside [-1, E) makes every count -1, as epx's layout
    # kernel does (they were counted as other experts), and the dispatch refuses it by name.
    for wrong in (E, E + 1, -2):
        bad = idx.clone()
        bad[1, 0] = wrong
        per_rank, _, per_expert, _, _ = buf.get_dispatch_layout(bad, E)
        assert (per_rank == -1).all() and (per_expert == -1).all(), (wrong, per_rank, per_expert)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    assert (per_rank >= 0).all() and (per_expert >= 0).all()
    with pytest.raises(ValueError, match="num_experts"):
        buf.get_dispatch_layout(idx, 0)
    # LL: x and ids must be 2-d; out must be [T, H] bf16 (it was broadcast or converted). The LL buffer is
    # made first, so that the refusal reaches the peer through it.
    buf.clean_low_latency_buffer(T, H, E, num_topk=K)
    refused_here_or_remote(rank == 0, lambda: buf.low_latency_dispatch(x[0], idx, T, E, use_fp8=False),
                           lambda: buf.low_latency_dispatch(x, idx, T, E, use_fp8=False), match="2|dims")
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    y = buf.get_next_low_latency_combine_buffer(handle)
    y[:, :, :] = recv_x
    for out in (torch.empty((2, T, H), dtype=torch.bfloat16), torch.empty((T, H), dtype=torch.int32)):
        refused_here_or_remote(rank == 0, lambda: buf.low_latency_combine(recv_x, idx, w, handle, out=out),
                               lambda: buf.low_latency_combine(recv_x, idx, w, handle),
                               match="out must be")
    del y
    # After destroy(): a clear error naming the call, and destroy() again does nothing.
    buf.destroy()
    for call in (lambda: buf.dispatch(x, topk_idx=idx), lambda: buf.get_dispatch_layout(idx, E),
                 lambda: buf.low_latency_dispatch(x, idx, T, E), lambda: buf.combine(x, None),
                 lambda: buf.low_latency_update_mask_buffer(0, True), buf.low_latency_clean_mask_buffer):
        with pytest.raises(ValueError, match="on a Buffer that was destroyed"):
            call()
    buf.destroy()


def test_misuse_raises():
    run_in_group(2, _misuse)
