"""HT dispatch outputs and the combine input as views of the buffer (Buffer(views=True), one view area) on
the host backend with 1, 2 and 3 ranks: bit-exact against the caller-owned path (views=False) and the
NumPy reference, every way combine takes x, the lifetime errors, static mode, fp8, cached dispatch,
destroy with live views, and torch CPU tensors."""

import numpy as np
import pytest

import epx
from mp import host_comm, one_rank_buffer, run_ranks
from npref import SEED, Problem, assert_equal, bf16, f32

RANKS = [1, 2, 3]


def problem(nranks, **kw):
    args = dict(seed=SEED, nranks=nranks, max_tokens=6, hidden=256, topk=3, experts=4 * nranks)
    args.update(kw)
    return Problem(**args)



def is_view(a):
    """Whether a numpy array lies over a buffer's memory (its base chain ends in a View)."""
    while isinstance(a, np.ndarray):
        a = a.base
    return isinstance(a, epx._epx.View)


def routed_to_all(p, nranks):
    """T_max tokens, each to one expert of every rank."""
    idx = np.full((p.T_max, p.K), -1, dtype=np.int64)
    idx[:, :nranks] = np.arange(nranks) * p.L
    return bf16(np.arange(p.T_max * p.H, dtype=np.float32).reshape(p.T_max, p.H) % 64), idx


def buffers(rank, nranks, uid, p, **kw):
    comm = host_comm(rank, nranks, uid)
    views = epx.Buffer(comm, p.T_max, p.H, p.K, p.E, modes="ht", views=True, **kw)
    owned = epx.Buffer(comm, p.T_max, p.H, p.K, p.E, modes="ht", views=False, **kw)
    return comm, views, owned


# ------------------------------------------------------------------------------------ bit-exact


def _dispatch_combine(rank, nranks, uid):
    p = problem(nranks)
    comm, vb, ob = buffers(rank, nranks, uid, p)
    assert vb.views and not ob.views
    x, idx, w = p.x[rank], p.topk_idx[rank], p.weights[rank]
    want_x, want_idx, want_w, want_counts = p.ht_dispatch(rank)

    own = ob.dispatch(x, idx, w)
    out = vb.dispatch(x, idx, w)
    assert all(is_view(a) for a in (out.recv_x, out.recv_topk_idx, out.recv_topk_weights))
    assert not any(is_view(a) for a in (own.recv_x, own.recv_topk_idx, out.num_recv_tokens_per_expert))
    assert out.recv_topk_idx.dtype == np.int32 and own.recv_topk_idx.dtype == np.int64
    assert out.num_recv_tokens == own.num_recv_tokens == len(want_x) == out.handle.num_recv_tokens
    for name, want in (("recv_x", want_x), ("recv_topk_idx", want_idx), ("recv_topk_weights", want_w),
                       ("num_recv_tokens_per_expert", want_counts),
                       ("rank_prefix_matrix", p.rank_prefix_matrix())):
        assert_equal(getattr(out, name), getattr(own, name), name + " (views vs own)", rank)
        assert_equal(getattr(out, name).astype(want.dtype), want, name, rank)
    assert_equal(np.array(out.num_recv_tokens_per_expert_list, dtype=np.int32), want_counts,
                 "num_recv_tokens_per_expert_list (views)", rank)

    # combine, x = the recv_x view (read where the dispatch put it), with the weights' view.
    want_comb = p.ht_combine(rank)
    y_own = p.expert_fn(own.recv_x, 1)
    ref = ob.combine(y_own, own.handle, own.recv_topk_weights)
    got = vb.combine(out.recv_x, out.handle, out.recv_topk_weights)
    assert vb._combines_by_source == (0, 0, 1) and ob._combines_by_source == (1, 0, 0)
    assert_equal(got.combined_x, ref.combined_x, "combined_x (x = recv_x view)", rank)
    assert_equal(got.combined_topk_weights, ref.combined_topk_weights, "combined_topk_weights", rank)

    # x = the combine input, written by the "experts": read where it is.
    y = p.expert_fn(out.recv_x, rank + 1)
    cin = vb.combine_input(out.handle)
    assert is_view(cin) and cin.shape == (len(want_x), p.H) and cin.dtype == np.uint16
    cin[:] = y
    got = vb.combine(cin, out.handle)
    assert_equal(got.combined_x, want_comb, "combined_x (x = combine_input)", rank)
    assert vb._combines_by_source == (0, 1, 1)

    # x = an independent array, with biases.
    bias = dict(bias0=x, bias1=bf16(f32(x) * 2))
    got = vb.combine(y.copy(), out.handle, **bias)
    assert_equal(got.combined_x, p.ht_combine(rank, with_bias=True), "combined_x (x = own array, biases)", rank)

    # Cached dispatch: new data through the same routing, into the same views.
    x2 = bf16(f32(x) + 1)
    cached = vb.dispatch(x2, handle=out.handle)
    assert cached.handle is out.handle and cached.recv_topk_idx is None and is_view(cached.recv_x)
    assert_equal(cached.recv_x, bf16(f32(want_x) + 1), "cached recv_x", rank)
    assert_equal(cached.recv_x, ob.dispatch(x2, handle=own.handle).recv_x, "cached recv_x (views vs own)", rank)
    got = vb.combine(cached.recv_x, out.handle)
    assert_equal(got.combined_x, ob.combine(bf16(f32(want_x) + 1), own.handle).combined_x, "cached combine", rank)
    return True


def _static_fp8(rank, nranks, uid):
    p = problem(nranks)
    comm, vb, ob = buffers(rank, nranks, uid, p, dispatch_dtypes=["bf16", "fp8"])
    x, idx, w = p.x[rank], p.topk_idx[rank], p.weights[rank]
    n = len(p.ht_rows(rank))
    worst = nranks * p.T_max
    st = vb.dispatch(x, idx, w, num_worst_tokens=worst)
    own = ob.dispatch(x, idx, w, num_worst_tokens=worst)
    assert is_view(st.recv_x) and st.recv_x.shape == (worst, p.H) and st.num_recv_tokens == -1
    assert int(st.num_recv_tokens_tensor[0]) == n == int(own.num_recv_tokens_tensor[0])
    for name in ("recv_x", "recv_topk_idx", "recv_topk_weights"):
        assert_equal(getattr(st, name)[:n], getattr(own, name)[:n], "static " + name, rank)
    # Cached, static: the bound's rows, the first n of them real.
    x2 = bf16(f32(x) - 1)
    cst = vb.dispatch(x2, handle=st.handle, num_worst_tokens=worst)
    assert is_view(cst.recv_x) and cst.recv_x.shape == (worst, p.H) and cst.num_recv_tokens == worst
    assert_equal(cst.recv_x[:n], ob.dispatch(x2, handle=own.handle, num_worst_tokens=worst).recv_x[:n],
         "static cached recv_x", rank)
    # Without the bound, a static handle's cached dispatch takes the handle's; another bound is refused.
    inh = vb.dispatch(x2, handle=st.handle)
    assert is_view(inh.recv_x) and inh.recv_x.shape == (worst, p.H)
    assert_equal(inh.recv_x[:n], cst.recv_x[:n], "static cached recv_x, bound taken from the handle", rank)
    try:
        vb.dispatch(x2, handle=st.handle, num_worst_tokens=worst - 1 if worst > 1 else worst + 1)
        raise AssertionError("a cached dispatch with another bound than its static handle's was accepted")
    except ValueError as exc:
        assert "num_worst_tokens" in str(exc), str(exc)
    cin = vb.combine_input(st.handle)
    assert cin.shape == (worst, p.H)
    cin[:n] = p.expert_fn(own.recv_x[:n], rank + 1)
    assert_equal(vb.combine(cin, st.handle).combined_x, p.ht_combine(rank), "static combine", rank)
    # A bound above R * T_max (the rows of an area and of the combine input) is refused on a buffer with
    # views, on every rank; a views=False buffer takes it.
    with pytest.raises(epx.InvalidArgumentError, match="num_worst_tokens = %d is above" % (worst + 1)):
        vb.dispatch(x, idx, num_worst_tokens=worst + 1)
    big = ob.dispatch(x, idx, num_worst_tokens=worst + 1)
    assert big.recv_x.shape == (worst + 1, p.H)
    assert_equal(ob.combine(big.recv_x, big.handle).combined_x, ob.combine(own.recv_x, own.handle).combined_x,
                 "combine of a bound above R * T_max", rank)

    # fp8: fresh and cached, with scales, against the caller-owned path.
    rng = np.random.default_rng(SEED + rank)
    x8 = rng.integers(0, 256, size=(p.tokens[rank], p.H), dtype=np.uint8)
    s8 = rng.random((p.tokens[rank], p.H // 128), dtype=np.float32)
    own = ob.dispatch(x8, idx, x_scales=s8)
    out = vb.dispatch(x8, idx, x_scales=s8)
    assert is_view(out.recv_x) and out.recv_x.dtype == np.uint8 and is_view(out.recv_x_scales)
    assert_equal(out.recv_x, own.recv_x, "fp8 recv_x", rank)
    assert_equal(out.recv_x_scales, own.recv_x_scales, "fp8 recv_x_scales", rank)
    cached = vb.dispatch(x8[::-1].copy(), x_scales=s8[::-1].copy(), handle=out.handle)
    ref = ob.dispatch(x8[::-1].copy(), x_scales=s8[::-1].copy(), handle=own.handle)
    assert is_view(cached.recv_x) and cached.num_recv_tokens == n == ref.num_recv_tokens
    assert_equal(cached.recv_x, ref.recv_x, "fp8 cached recv_x", rank)
    assert_equal(cached.recv_x_scales, ref.recv_x_scales, "fp8 cached scales", rank)
    return True


# ------------------------------------------------------------------------------------ lifetimes


def _lifetime(rank, nranks, uid):
    p = problem(nranks)
    comm = host_comm(rank, nranks, uid)
    buf = epx.Buffer(comm, p.T_max, p.H, p.K, p.E, modes="ht", views=True)
    x, idx, w = p.x[rank], p.topk_idx[rank], p.weights[rank]
    want_comb = p.ht_combine(rank)

    def round_trip(what):
        out = buf.dispatch(x, idx, w)
        cin = buf.combine_input(out.handle)
        cin[:] = p.expert_fn(out.recv_x, rank + 1)
        assert_equal(buf.combine(cin, out.handle).combined_x, want_comb, "combined_x after " + what, rank)

    old = buf.dispatch(x, idx, w)
    new = buf.dispatch(x, idx, w)
    with pytest.raises(epx.StaleViewError, match="x is a view of dispatch outputs"):
        buf.combine(old.recv_x, new.handle)
    with pytest.raises(epx.StaleViewError, match="topk_weights"):
        buf.combine(new.recv_x, new.handle, old.recv_topk_weights[1:])
    with pytest.raises(epx.StaleViewError):
        buf.dispatch(old.recv_x[:, :0], handle=new.handle)
    with pytest.raises(epx.StaleViewError, match="topk_idx"):  # every call checks its inputs
        buf.get_dispatch_layout(old.recv_topk_idx[:1])
    round_trip("stale recv views")
    # A dispatch reading its own outputs' memory (every token to every rank: no rank receives nothing).
    x_all, idx_all = routed_to_all(p, nranks)
    new = buf.dispatch(x_all, idx_all)
    with pytest.raises(epx.InvalidArgumentError, match="this dispatch rewrites"):
        buf.dispatch(new.recv_x[:p.T_max], idx_all)
    round_trip("a dispatch of its own outputs")

    # Combine inputs: stale after a combine, of another handle, or a part of one.
    out = buf.dispatch(x_all, idx_all)
    other = buf.dispatch(x, idx, w)
    cin = buf.combine_input(out.handle)
    with pytest.raises(epx.InvalidArgumentError, match="another handle"):
        buf.combine(cin, other.handle)
    cin = buf.combine_input(out.handle)
    with pytest.raises(epx.InvalidArgumentError, match="whole"):
        buf.combine(cin[:, :p.H // 2], out.handle)
    cin = buf.combine_input(other.handle)
    cin[:] = p.expert_fn(other.recv_x, rank + 1)
    assert_equal(buf.combine(cin, other.handle).combined_x, want_comb, "combined_x", rank)
    with pytest.raises(epx.StaleViewError, match="combine input"):
        buf.combine(cin, other.handle)
    cin_old = buf.combine_input(out.handle)
    buf.combine_input(other.handle)
    with pytest.raises(epx.StaleViewError, match="combine input"):
        buf.combine(cin_old, out.handle)
    round_trip("stale combine inputs")

    # One rank's stale view: its peers' matching combine raises RemoteError; all stay in step.
    out = buf.dispatch(x, idx, w)
    stale = out.recv_x
    out = buf.dispatch(x, idx, w)
    want = epx.StaleViewError if rank == 0 else (epx.RemoteError if nranks > 1 else None)
    if want is not None:
        with pytest.raises(want):
            buf.combine(stale if rank == 0 else out.recv_x, out.handle)
    round_trip("a refusal on rank 0")
    return True


@pytest.mark.parametrize("nranks", RANKS)
@pytest.mark.parametrize("worker", [_dispatch_combine, _static_fp8, _lifetime], ids=lambda w: w.__name__[1:])
def test_on_ranks(worker, nranks):
    run_ranks(nranks, worker)


def test_views_false_and_destroy():
    p = problem(1, ragged=False)
    comm, buf = one_rank_buffer(p, dispatch_dtypes=["bf16", "fp8"], views=True)
    x, idx = p.x[0], p.topk_idx[0]
    # An area is made once for the widest dtype: a (wider) bf16 dispatch after an fp8 one reuses it as
    # any dispatch does; the fp8 view goes stale (refused when passed back) and stays readable memory.
    x8 = np.full((p.T_max, p.H), 7, dtype=np.uint8)
    f8 = buf.dispatch(x8, idx, x_scales=np.ones((p.T_max, p.H // 128), dtype=np.float32))
    wide = buf.dispatch(x, idx)
    assert is_view(f8.recv_x) and is_view(wide.recv_x)
    assert f8.recv_x.sum() >= 0  # readable
    with pytest.raises(epx.StaleViewError):
        buf.dispatch(f8.recv_x, idx, x_scales=np.ones((p.T_max, p.H // 128), dtype=np.float32))
    # views=False on one call: outputs of their own, which no later call touches.
    own = buf.dispatch(x, idx, views=False)
    keep = own.recv_x.copy()
    assert not is_view(own.recv_x)
    buf.dispatch(bf16(f32(x) + 3), idx)
    assert_equal(own.recv_x, keep, "views=False recv_x after a later dispatch", 0)
    del f8
    f8 = buf.dispatch(x8, idx, x_scales=np.ones((p.T_max, p.H // 128), dtype=np.float32))
    assert is_view(f8.recv_x)
    # destroy() with views alive: refused calls, readable views, freed with the last one.
    out = buf.dispatch(x, idx)
    h = [out.handle, own.handle, f8.handle, wide.handle]
    for handle in h:
        handle.destroy()
    data = out.recv_x.copy()
    buf.destroy()
    comm.destroy()
    assert buf.destroyed
    with pytest.raises(ValueError, match="buffer was destroyed"):
        buf.dispatch(x, idx)
    with pytest.raises(ValueError, match="communicator was destroyed"):
        comm.rank
    assert_equal(out.recv_x, data, "recv_x after destroy", 0)
    del out, f8, own, wide
    buf.destroy()
    comm.destroy()


# ------------------------------------------------------------------------------------ torch


def _torch(rank, nranks, uid):
    import torch

    p = problem(nranks)
    comm, vb, ob = buffers(rank, nranks, uid, p)
    x, idx, w = (torch.from_numpy(a.copy()) for a in (p.x[rank].view(np.int16), p.topk_idx[rank], p.weights[rank]))
    x = x.view(torch.bfloat16)
    x_all, idx_all = (torch.from_numpy(a) for a in routed_to_all(p, nranks))
    x_all = x_all.view(torch.int16).view(torch.bfloat16)
    out = vb.dispatch(x, idx, w)
    own = ob.dispatch(x, idx, w)
    assert out.recv_x.dtype == torch.bfloat16 and out.recv_topk_idx.dtype == torch.int32
    for name in ("recv_x", "recv_topk_idx", "recv_topk_weights"):
        a, b = getattr(out, name), getattr(own, name)
        assert torch.equal(a.to(b.dtype), b), "rank %d: torch %s (seed %d)" % (rank, name, SEED)
    ref = ob.combine(own.recv_x, own.handle).combined_x
    assert torch.equal(vb.combine(out.recv_x, out.handle).combined_x, ref)
    cin = vb.combine_input(out.handle)
    assert cin.dtype == torch.bfloat16 and (cin.numel() == 0 or cin.data_ptr() != out.recv_x.data_ptr())
    cin.copy_(out.recv_x)
    assert torch.equal(vb.combine(cin, out.handle).combined_x, ref)
    assert torch.equal(vb.combine(out.recv_x.clone(), out.handle).combined_x, ref)
    # Stale by address: no view of the current generation is alive.
    out = vb.dispatch(x_all, idx_all)
    stale, handle = out.recv_x, out.handle
    del out, cin
    vb.dispatch(x_all, idx_all)
    with pytest.raises(epx.StaleViewError):
        vb.combine(stale, handle)
    return True


@pytest.mark.parametrize("nranks", [1, 2])
def test_torch_cpu(nranks):
    pytest.importorskip("torch")
    run_ranks(nranks, _torch)


def test_ll_combine_buffer_outlives_destroy():
    # The LL combine buffer is library memory too: destroy() with it alive waits for it (writing through it
    # after destroy() was a use after free), and frees the buffer when it goes.
    p = problem(1, ragged=False)
    comm, buf = one_rank_buffer(p)
    out = buf.ll_dispatch(p.x[0], p.topk_idx[0])
    view = buf.get_combine_buffer(out.handle)
    assert buf._views_alive == 1
    del out
    buf.destroy()
    assert buf.destroyed and buf._views_alive == 1
    view[...] = 0x3F80  # bf16 1.0: still the buffer's memory
    assert int(view.astype(np.int64).sum()) == 0x3F80 * view.size
    with pytest.raises(ValueError, match="buffer was destroyed"):
        buf.ll_dispatch(p.x[0], p.topk_idx[0])
    del view
    assert buf._views_alive == 0
    comm.destroy()


def test_uninitialised_buffer():
    # A Buffer whose __init__ never ran (a subclass that skips it, or __new__) raises instead of crashing.
    class Lazy(epx.Buffer):
        def __init__(self):
            pass

    for b in (Lazy(), epx.Buffer.__new__(epx.Buffer)):
        with pytest.raises(ValueError, match="never initialised"):
            b.comm
        with pytest.raises(ValueError):
            b.dispatch(np.zeros((1, 128), np.uint16), np.zeros((1, 1), np.int32))
        b.destroy()
