"""Pooled dispatch outputs (Buffer(views="pooled")) and view areas (view_areas=N) on the host backend with
1, 2 and 3 ranks, numpy and torch CPU: pooled outputs keep their bits while held, through later fresh,
cached, fp8 and static dispatches; a released area is picked again; with every area held the outputs are
copies; combine reads a recv_x view where the dispatch put it (x_in_buffer = 2) with the bits of the copy
path; ranks that hold and ranks that drop their outputs agree with views=False; views=True with two areas;
calls without views leave the areas alone; bad view_areas; destroy with pooled views alive."""

import numpy as np
import pytest

import epx
from mp import host_comm, one_rank_buffer, run_ranks
from npref import SEED, assert_equal, bf16, f32
from test_views import is_view, problem, routed_to_all

RANKS = [1, 2, 3]
FRAMEWORKS = ["numpy", "torch"]
ROWS = ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights")
OUTPUTS = ROWS + ("num_recv_tokens_per_expert",)


class Numpy:
    """How the tests make inputs for, and read outputs of, one framework: numpy arrays as they are."""

    @staticmethod
    def arr(a, fp8=False):
        return np.ascontiguousarray(a)

    @staticmethod
    def bits(a):
        return None if a is None else np.asarray(a)

    @staticmethod
    def ptr(a):
        return a.__array_interface__["data"][0]

    @staticmethod
    def part(a):
        """A view of a slice of `a` (what keeps it alive is a's View, through numpy's base chain)."""
        return a.view(np.int16)[1:, ::2]


class Torch:
    """torch CPU tensors: bf16 from uint16 bit patterns, fp8 from uint8 bytes."""

    @staticmethod
    def arr(a, fp8=False):
        import torch

        a = np.ascontiguousarray(a)
        if a.dtype == np.uint16:
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        t = torch.from_numpy(a.copy())
        return t.view(torch.float8_e4m3fn) if fp8 else t

    @staticmethod
    def bits(t):
        import torch

        if t is None:
            return None
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        if t.dtype == torch.float8_e4m3fn:
            return t.view(torch.uint8).numpy()
        return t.numpy()

    @staticmethod
    def ptr(t):
        return t.data_ptr()

    @staticmethod
    def part(t):
        """A view of a slice of `t` (what keeps it alive is the storage's DLPack deleter)."""
        import torch

        return t[1:].view(torch.int16)[:, ::2]


def framework(name):
    if name == "torch":
        pytest.importorskip("torch")
        return Torch
    return Numpy


def run(nranks, fn, fw):
    framework(fw)
    run_ranks(nranks, fn, fw=fw)


def buffers(rank, nranks, uid, p, views="pooled", **kw):
    """A buffer with `views` and a caller-owned one (the reference) on one communicator."""
    comm = host_comm(rank, nranks, uid)
    vb = epx.Buffer(comm, p.T_max, p.H, p.K, p.E, modes="ht", views=views, **kw)
    ob = epx.Buffer(comm, p.T_max, p.H, p.K, p.E, modes="ht", views=False, **kw)
    return comm, vb, ob


def rank_setup(rank, nranks, uid, fw, **kw):
    """What a rank of a test needs: the framework `fw`, the problem, and buffers(**kw) (without the comm,
    which the buffers keep)."""
    F = framework(fw)
    p = problem(nranks)
    _, vb, ob = buffers(rank, nranks, uid, p, **kw)
    return F, p, vb, ob


def ranks_and_frameworks(nranks):
    """Parametrizes a test(nranks, fw) over the rank counts `nranks` and the frameworks."""

    def parametrize(test):
        return pytest.mark.parametrize("fw", FRAMEWORKS)(pytest.mark.parametrize("nranks", nranks)(test))

    return parametrize


def inputs(F, p, rank, shift=0):
    """This rank's x (shifted by `shift`), topk_idx and topk_weights in framework F."""
    return F.arr(bf16(f32(p.x[rank]) + shift)), F.arr(p.topk_idx[rank]), F.arr(p.weights[rank])


def snapshot(F, out):
    return {name: None if getattr(out, name) is None else F.bits(getattr(out, name)).copy()
            for name in OUTPUTS}


def check_outputs(F, got, want, what, rank, rows=None):
    """got and want (DispatchOutputs, or got's snapshot) agree on every output; `rows`: only the first rows
    of the row outputs count (static mode)."""
    for name in OUTPUTS:
        g = got[name] if isinstance(got, dict) else F.bits(getattr(got, name))
        w = want[name] if isinstance(want, dict) else F.bits(getattr(want, name))
        assert (g is None) == (w is None), "rank %d: %s %s present in one only" % (rank, what, name)
        if g is None:
            continue
        if rows is not None and name in ROWS:
            g, w = g[:rows], w[:rows]
        assert_equal(g.astype(w.dtype), w, "%s %s" % (what, name), rank)


def in_buffer(F, buf, a, alive_before):
    """Whether a (just returned) is a view of the buffer: numpy by its base, torch by the views count."""
    if F is Numpy:
        return is_view(a)
    return buf._views_alive > alive_before


def sources(buf, before):
    """How the combines since `before` (a _combines_by_source) took x: (x_in_buffer 0, 1, 2) counts."""
    return tuple(n - m for n, m in zip(buf._combines_by_source, before))


# ------------------------------------------------------------------------------------ lifetimes


def _survive(rank, nranks, uid, fw):
    F, p, pb, ob = rank_setup(rank, nranks, uid, fw, dispatch_dtypes=["bf16", "fp8"])
    assert pb.views == "pooled" and pb.view_areas == 3 and ob.views is False
    x, idx, w = inputs(F, p, rank)
    first, own = pb.dispatch(x, idx, w), ob.dispatch(x, idx, w)
    assert F is Torch or all(is_view(getattr(first, name)) for name in ("recv_x", "recv_topk_idx"))
    assert F.bits(first.recv_topk_idx).dtype == np.int32
    check_outputs(F, first, own, "first", rank)
    held = snapshot(F, first)

    rng = np.random.default_rng(SEED + rank)
    x8 = rng.integers(0, 256, size=(p.tokens[rank], p.H), dtype=np.uint8)
    s8 = rng.random((p.tokens[rank], p.H // 128), dtype=np.float32)
    worst = nranks * p.T_max
    calls = [
        ("fresh", lambda b, h: b.dispatch(inputs(F, p, rank, 1)[0], idx, w)),
        ("cached", lambda b, h: b.dispatch(inputs(F, p, rank, -2)[0], handle=h)),
        ("fp8", lambda b, h: b.dispatch(F.arr(x8, fp8=True), idx, w, x_scales=F.arr(s8))),
        ("fp8 cached",
         lambda b, h: b.dispatch(F.arr(x8[::-1], fp8=True), x_scales=F.arr(s8[::-1]), handle=h)),
        ("static", lambda b, h: b.dispatch(inputs(F, p, rank, 3)[0], idx, w, num_worst_tokens=worst)),
    ]
    n = first.num_recv_tokens
    kept = []
    for i, (what, call) in enumerate(calls):
        got, ref = call(pb, first.handle), call(ob, own.handle)
        rows = n if what == "static" else None
        check_outputs(F, got, ref, what, rank, rows)
        if i % 2 == 0:  # hold some (the first of them takes the last free area), drop the others
            kept.append((what, got, snapshot(F, ref), rows))
    check_outputs(F, snapshot(F, first), held, "first output after five dispatches", rank)
    for what, got, ref, rows in kept:
        check_outputs(F, got, ref, what + " output, held", rank, rows)
    before = pb._combines_by_source
    got = pb.combine(first.recv_x, first.handle, first.recv_topk_weights)
    ref = ob.combine(own.recv_x, own.handle, own.recv_topk_weights)
    assert_equal(F.bits(got.combined_x), F.bits(ref.combined_x), "combined_x of the first output", rank)
    assert_equal(F.bits(got.combined_topk_weights), F.bits(ref.combined_topk_weights), "combined weights",
                 rank)
    assert sum(sources(pb, before)) == 1 and sources(pb, before)[0] == 0
    return True


def _reuse(rank, nranks, uid, fw):
    F, p, pb, ob = rank_setup(rank, nranks, uid, fw)
    x_all, idx_all = routed_to_all(p, nranks)  # every rank receives R * T_max rows
    idx = F.arr(idx_all)

    def dispatch(shift):
        x = F.arr(bf16(f32(x_all) + shift))
        alive = pb._views_alive
        out, ref = pb.dispatch(x, idx), ob.dispatch(x, idx)
        check_outputs(F, out, ref, "dispatch %d" % shift, rank)
        return out, snapshot(F, ref), in_buffer(F, pb, out.recv_x, alive)

    a, _, a_view = dispatch(0)
    b, _, b_view = dispatch(1)
    assert a_view and b_view
    pa, pb_ = F.ptr(a.recv_x), F.ptr(b.recv_x)
    assert pa != pb_
    # A slice of a's recv_x and b's recv_topk_idx alone keep areas 0 and 1.
    part, b_idx = F.part(a.recv_x), b.recv_topk_idx
    del a, b
    c, c_ref, c_view = dispatch(2)
    assert not c_view and F.ptr(c.recv_x) not in (pa, pb_), "rank %d: outputs with every area held" % rank
    if F is Numpy:
        assert not any(is_view(getattr(c, name)) for name in ("recv_x", "recv_topk_idx"))
    # Copies are the caller's: the next dispatch into the spare leaves them as they were.
    d, _, d_view = dispatch(3)
    assert not d_view
    check_outputs(F, snapshot(F, c), c_ref, "copied outputs after another spare dispatch", rank)
    del part
    e, _, e_view = dispatch(4)
    assert e_view and F.ptr(e.recv_x) == pa, "rank %d: released area 0 was not picked again" % rank
    del b_idx
    f, _, f_view = dispatch(5)
    assert f_view and F.ptr(f.recv_x) == pb_, "rank %d: released area 1 was not picked again" % rank
    del e
    g, _, _ = dispatch(6)
    assert F.ptr(g.recv_x) == pa
    return True


@ranks_and_frameworks(RANKS)
@pytest.mark.parametrize("body", [_survive, _reuse], ids=lambda body: body.__name__[1:])
def test_lifetimes(body, nranks, fw):
    run(nranks, body, fw)


def _mixed(rank, nranks, uid, fw):
    """Rank 0 holds every output (its areas fill, then it gets copies); the others drop theirs."""
    F, p, pb, ob = rank_setup(rank, nranks, uid, fw)
    kept = []
    before = pb._combines_by_source
    rounds = 6
    for i in range(rounds):
        x, idx, w = inputs(F, p, rank, i)
        got, ref = pb.dispatch(x, idx, w), ob.dispatch(x, idx, w)
        check_outputs(F, got, ref, "round %d" % i, rank)
        # The experts write their outputs over recv_x, which combine then reads.
        y = p.expert_fn(F.bits(ref.recv_x), rank + 1 + i)
        F.bits(got.recv_x)[:] = y
        comb = pb.combine(got.recv_x, got.handle, got.recv_topk_weights)
        want = ob.combine(F.arr(y), ref.handle, ref.recv_topk_weights)
        assert_equal(F.bits(comb.combined_x), F.bits(want.combined_x), "combined_x round %d" % i, rank)
        assert_equal(F.bits(comb.combined_topk_weights), F.bits(want.combined_topk_weights),
                     "combined weights round %d" % i, rank)
        if rank == 0:
            kept.append((i, got, snapshot(F, got)))
        del got
    for i, got, held in kept:
        check_outputs(F, snapshot(F, got), held, "held output of round %d" % i, rank)
    n = sources(pb, before)
    assert n[0] == 0 and sum(n) == rounds
    if rank == 0:
        assert n[1] >= rounds - 2, "rank 0: %s combines by source" % (n,)
    return True


@ranks_and_frameworks([2, 3])
def test_mixed_ranks(nranks, fw):
    run(nranks, _mixed, fw)


# ------------------------------------------------------------------------------------ combine


def _combine_in_place(rank, nranks, uid, fw, views):
    F, p, vb, ob = rank_setup(rank, nranks, uid, fw, views=views)
    x_all, idx_all = routed_to_all(p, nranks)
    w_all = (np.arange(p.T_max * p.K, dtype=np.float32).reshape(p.T_max, p.K) % 4 + 1) / 4
    x, idx, w = F.arr(x_all), F.arr(idx_all), F.arr(w_all)
    out, own = vb.dispatch(x, idx, w), ob.dispatch(x, idx, w)
    y = p.expert_fn(F.bits(own.recv_x), rank + 1)
    ref = ob.combine(F.arr(y), own.handle, own.recv_topk_weights)

    def combine(x_arg, handle, want_source, what, weights=None):
        before = vb._combines_by_source
        got = vb.combine(x_arg, handle, weights)
        n = [0, 0, 0]
        n[want_source] = 1
        assert sources(vb, before) == tuple(n), "rank %d: %s took x as %s" % (rank, what, sources(vb, before))
        assert_equal(F.bits(got.combined_x), F.bits(ref.combined_x), what, rank)
        return got

    # The experts write over recv_x: combine reads it where the dispatch put it, with the copy's bits.
    F.bits(out.recv_x)[:] = y
    got = combine(out.recv_x, out.handle, 2, "x = recv_x", out.recv_topk_weights)
    assert_equal(F.bits(got.combined_topk_weights), F.bits(ref.combined_topk_weights), "weights", rank)
    combine(F.arr(F.bits(out.recv_x).copy()), out.handle, 1, "x = a copy of recv_x")
    # Ranks may mix the two.
    combine(out.recv_x if rank % 2 else F.arr(y), out.handle, 2 if rank % 2 else 1, "mixed ranks")
    # Another handle of the same routing: the rows are copied into the combine input (views=True: out's
    # area now holds other's outputs, which are dropped at once).
    other = vb.dispatch(x, idx, w).handle
    combine(out.recv_x if views == "pooled" else F.arr(y), other, 1, "another handle's recv_x")
    # Cached: its own recv_x view, read in place too.
    cached = vb.dispatch(x, handle=other)
    assert_equal(F.bits(cached.recv_x), F.bits(own.recv_x), "cached recv_x", rank)
    F.bits(cached.recv_x)[:] = y
    combine(cached.recv_x, other, 2, "x = cached recv_x")
    del cached
    # Static: the bound's rows, the first N_r of them real.
    st = vb.dispatch(x, idx, num_worst_tokens=nranks * p.T_max)
    assert st.recv_x.shape[0] == nranks * p.T_max
    F.bits(st.recv_x)[:] = y
    combine(st.recv_x, st.handle, 2, "x = static recv_x")
    # A call's views=False: outputs of their own, whose recv_x is copied into the combine input.
    own2 = vb.dispatch(x, idx, w, views=False)
    assert F is Torch or not is_view(own2.recv_x)
    F.bits(own2.recv_x)[:] = y
    combine(own2.recv_x, own2.handle, 1, "x = recv_x of a dispatch without views")
    return True


@pytest.mark.parametrize("views", [True, "pooled"])
@ranks_and_frameworks(RANKS)
def test_combine_in_place(nranks, fw, views):
    framework(fw)
    run_ranks(nranks, _combine_in_place, fw=fw, views=views)


# ------------------------------------------------------------------------------------ views=True, areas


def _two_areas(rank, nranks, uid, fw):
    """views=True, view_areas=2: an area without views first, else the least recently used one."""
    F, p, vb, ob = rank_setup(rank, nranks, uid, fw, views=True, view_areas=2)
    assert vb.views is True and vb.view_areas == 2
    x_all, idx_all = routed_to_all(p, nranks)
    idx = F.arr(idx_all)

    def dispatch(shift):
        x = F.arr(bf16(f32(x_all) + shift))
        out, ref = vb.dispatch(x, idx), ob.dispatch(x, idx)
        check_outputs(F, out, ref, "dispatch %d" % shift, rank)
        return out, ref

    a, a_ref = dispatch(0)
    b, _ = dispatch(1)
    pa, pb_ = F.ptr(a.recv_x), F.ptr(b.recv_x)
    assert pa != pb_
    check_outputs(F, a, a_ref, "first output across one dispatch", rank)
    del b
    c, _ = dispatch(2)  # area 1 has no views: taken, though area 0 is the least recently used
    assert F.ptr(c.recv_x) == pb_
    check_outputs(F, a, a_ref, "first output across two dispatches", rank)
    before = vb._combines_by_source
    want = ob.combine(a_ref.recv_x, a_ref.handle).combined_x
    assert_equal(F.bits(vb.combine(a.recv_x, a.handle).combined_x), F.bits(want), "combine of a", rank)
    assert sources(vb, before) == (0, 0, 1)
    d, _ = dispatch(3)  # both held: area 0, the least recently used, is reused
    assert F.ptr(d.recv_x) == pa
    if F is Torch:
        del d  # torch views are told stale by address: only while no current view of the area lives
    with pytest.raises(epx.StaleViewError, match="x is a view of dispatch outputs"):
        vb.combine(a.recv_x, a.handle)
    with pytest.raises(epx.StaleViewError, match="topk_idx"):
        vb.dispatch(F.arr(x_all), a.recv_topk_idx)
    # Both ranks refused in step: the buffer goes on.
    e, e_ref = dispatch(4)
    want = ob.combine(e_ref.recv_x, e_ref.handle).combined_x
    got = vb.combine(e.recv_x, e.handle).combined_x
    assert_equal(F.bits(got), F.bits(want), "combine after the refusals", rank)
    return True


@ranks_and_frameworks([1, 2])
def test_two_areas(nranks, fw):
    run(nranks, _two_areas, fw)


def _other_calls(rank, nranks, uid):
    """A routing-map dispatch and a dispatch without views leave the view areas alone; a call's views=."""
    p = problem(nranks)
    comm = host_comm(rank, nranks, uid)
    vb = epx.Buffer(comm, p.T_max, p.H, p.K, p.E, views=True)
    x, idx, w = p.x[rank], p.topk_idx[rank], p.weights[rank]
    out = vb.dispatch(x, idx, w)
    held = snapshot(Numpy, out)
    vb.rm_dispatch(x, p.routing_map(rank), p.probs[rank])
    own = vb.dispatch(bf16(f32(x) + 1), idx, w, views=False)
    assert not is_view(own.recv_x) and own.recv_topk_idx.dtype == np.int64
    check_outputs(Numpy, snapshot(Numpy, out), held, "views after rm and caller-owned dispatches", rank)
    before = vb._combines_by_source
    out.recv_x[:] = p.expert_fn(out.recv_x, rank + 1)
    assert_equal(vb.combine(out.recv_x, out.handle).combined_x, p.ht_combine(rank), "combined_x", rank)
    assert sources(vb, before) == (0, 0, 1)

    pb = epx.Buffer(comm, p.T_max, p.H, p.K, p.E, modes="ht", views="pooled", view_areas=2)
    a = pb.dispatch(x, idx, w)
    b = pb.dispatch(x, idx, w, views=True)  # True on a pooled buffer stays pooled: area 0 is held
    assert is_view(a.recv_x) and not is_view(b.recv_x)
    check_outputs(Numpy, b, a, "a spare copy", rank)
    c = pb.dispatch(x, idx, w, views=False)
    assert not is_view(c.recv_x) and c.recv_topk_idx.dtype == np.int64
    check_outputs(Numpy, c, a, "a call's views=False", rank)
    # view_areas=1 with "pooled": the only area is the spare, every output a copy.
    one = epx.Buffer(comm, p.T_max, p.H, p.K, p.E, modes="ht", views="pooled", view_areas=1)
    for i in range(2):
        d = one.dispatch(x, idx, w)
        assert not any(is_view(getattr(d, name)) for name in ROWS if getattr(d, name) is not None)
        assert one._views_alive == 0
        check_outputs(Numpy, d, a, "one area, dispatch %d" % i, rank)
    return True


@pytest.mark.parametrize("nranks", [1, 2])
def test_other_calls(nranks):
    run_ranks(nranks, _other_calls)


# ------------------------------------------------------------------------------------ arguments, destroy


def test_bad_view_areas():
    comm = epx.Comm.from_unique_id(epx.get_unique_id(), 0, 1, backend="host")
    args = (comm, 4, 128, 2, 4)
    for views in (True, "pooled"):
        for bad in (-1, 9):
            match = r"view_areas = %d is out of range \[1, 8\]" % bad
            with pytest.raises(epx.InvalidArgumentError, match=match):
                epx.Buffer(*args, views=views, view_areas=bad)
    with pytest.raises(epx.InvalidArgumentError, match="views = 'shared' is none of False, True and"):
        epx.Buffer(*args, views="shared")
    with pytest.raises(epx.InvalidArgumentError, match="views = 2"):
        epx.Buffer(*args, views=2)
    assert epx.MAX_VIEW_AREAS == 8
    assert epx.Buffer(*args).views == epx.DEFAULT_VIEWS
    assert [epx.Buffer(*args, views=v).view_areas for v in (False, True, "pooled")] == [1, 1, 3]
    assert epx.Buffer(*args, views="pooled", view_areas=8).view_areas == 8
    with pytest.raises(epx.InvalidArgumentError, match="views = 'x'"):
        epx.Buffer(*args, views=True).dispatch(np.zeros((1, 128), np.uint16), np.zeros((1, 2), np.int32),
                                               views="x")


def test_destroy_with_pooled_views():
    p = problem(1, ragged=False)
    comm, buf = one_rank_buffer(p, views="pooled")
    x, idx, w = p.x[0], p.topk_idx[0], p.weights[0]
    a = buf.dispatch(x, idx, w)
    b = buf.dispatch(bf16(f32(x) + 1), idx, w)
    c = buf.dispatch(bf16(f32(x) + 2), idx, w)  # a copy: a and b hold areas 0 and 1
    assert is_view(a.recv_x) and is_view(b.recv_x) and not is_view(c.recv_x)
    held = [snapshot(Numpy, o) for o in (a, b, c)]
    part = b.recv_x[1:]
    for o in (a, b, c):
        o.handle.destroy()
    buf.destroy()
    comm.destroy()
    assert buf.destroyed and buf._views_alive > 0
    with pytest.raises(ValueError, match="buffer was destroyed"):
        buf.dispatch(x, idx)
    for o, want in zip((a, b, c), held):
        check_outputs(Numpy, snapshot(Numpy, o), want, "output after destroy", 0)
    del a, b
    assert buf._views_alive == 1  # part keeps b's recv_x
    assert_equal(part, held[1]["recv_x"][1:], "a slice after destroy", 0)
    del part
    assert buf._views_alive == 0
    buf.destroy()
    comm.destroy()
