"""Every operation through the Python binding with NumPy on the host backend, 1, 2 and 4 ranks,
checked against the NumPy reference (npref.py) on every rank."""

import numpy as np
import pytest

import epx
from mp import host_comm, one_rank_buffer, run_ranks
from npref import SEED, Problem, assert_equal, bf16, f32

RANKS = [1, 2, 4]


def problem(nranks, **kw):
    args = dict(seed=SEED, nranks=nranks, max_tokens=6, hidden=128, topk=3, experts=4 * nranks)
    args.update(kw)
    return Problem(**args)



# ------------------------------------------------------------------------------------ topology


def _topology(rank, nranks, uid):
    comm = host_comm(rank, nranks, uid)
    return (comm.rank, comm.nranks, comm.local_rank, comm.local_nranks, comm.backend, comm.cuda_device,
            comm.ranks_per_nvlink_domain * comm.num_nvlink_domains, comm.get_async_error())


@pytest.mark.parametrize("nranks", RANKS)
def test_topology(nranks):
    for r, got in enumerate(run_ranks(nranks, _topology)):
        assert got == (r, nranks, r, nranks, "host", -1, nranks, None)


# ------------------------------------------------------------------------------------ layout + HT


def _ht(rank, nranks, uid, alignment, idx_dtype, with_bias, shape=None):
    p = problem(nranks, idx_dtype=idx_dtype, **(shape or {}))
    comm = host_comm(rank, nranks, uid)
    # Outputs of their own (recv_topk_idx in topk_idx's dtype, kept across the cached dispatch below);
    # the views of the default are tested in test_views.py.
    buf = epx.Buffer(comm, p.T_max, p.H, p.K, p.E, modes="ht", views=False)
    x, idx, w = p.x[rank], p.topk_idx[rank], p.weights[rank]

    per_rank, per_expert, in_rank = p.layout(rank)
    lay = buf.get_dispatch_layout(idx)
    assert_equal(lay.num_tokens_per_rank, per_rank, "num_tokens_per_rank", rank)
    assert_equal(lay.num_tokens_per_expert, per_expert, "num_tokens_per_expert", rank)
    assert_equal(lay.is_token_in_rank, in_rank, "is_token_in_rank", rank)
    assert lay.num_tokens_per_domain is None

    out = buf.dispatch(x, idx, w, expert_alignment=alignment)
    recv_x, recv_idx, recv_w, counts = p.ht_dispatch(rank, alignment)
    assert out.num_recv_tokens == len(recv_x) == out.handle.num_recv_tokens
    assert out.handle.num_tokens == p.tokens[rank]
    assert out.recv_x.dtype == np.uint16 and out.recv_topk_idx.dtype == idx_dtype
    assert_equal(out.recv_x, recv_x, "recv_x", rank)
    assert_equal(out.recv_topk_idx, recv_idx.astype(idx_dtype), "recv_topk_idx", rank)
    assert_equal(out.recv_topk_weights, recv_w, "recv_topk_weights", rank)
    assert_equal(out.num_recv_tokens_per_expert, counts, "num_recv_tokens_per_expert", rank)
    # The same counts read on the host, as a list (the call waited for them).
    assert isinstance(out.num_recv_tokens_per_expert_list, list)
    assert_equal(np.array(out.num_recv_tokens_per_expert_list, dtype=np.int32), counts,
                 "num_recv_tokens_per_expert_list", rank)
    assert_equal(out.rank_prefix_matrix, p.rank_prefix_matrix(), "rank_prefix_matrix", rank)
    assert len(out) == 8  # the matrix and the list are attributes, not part of the tuple

    # Cached dispatch: same routing, new data (x + 1 in bf16).
    x2 = bf16(f32(x) + 1)
    cached = buf.dispatch(x2, handle=out.handle)
    assert cached.handle is out.handle and cached.recv_topk_idx is None and cached.rank_prefix_matrix is None
    assert cached.num_recv_tokens_per_expert_list is None
    assert_equal(cached.recv_x, bf16(f32(recv_x) + 1), "cached recv_x", rank)
    # A bound on a default-mode handle's cached dispatch makes it static: outputs of that many rows, the
    # first rows in order, the rest dropped with the overflow flag set (as on cuda).
    bounded = buf.dispatch(x2, handle=out.handle, num_worst_tokens=1)
    assert bounded.recv_x.shape == (1, p.H) and bounded.num_recv_tokens == 1  # a cached call: its rows
    kept = min(1, len(recv_x))
    assert_equal(bounded.recv_x[:kept], bf16(f32(recv_x[:kept]) + 1), "bounded cached recv_x", rank)
    assert buf.query_overflow() is (len(recv_x) > 1)
    big = buf.dispatch(x2, handle=out.handle, num_worst_tokens=len(recv_x) + 2)
    assert big.recv_x.shape == (len(recv_x) + 2, p.H)
    assert_equal(big.recv_x[:len(recv_x)], bf16(f32(recv_x) + 1), "cached recv_x under a bound", rank)
    assert buf.query_overflow() is False

    y = p.expert_fn(out.recv_x, rank + 1)
    bias = dict(bias0=x, bias1=bf16(f32(x) * 2)) if with_bias else {}
    comb = buf.combine(y, out.handle, topk_weights=out.recv_topk_weights, **bias)
    assert_equal(comb.combined_x, p.ht_combine(rank, with_bias), "combined_x", rank)
    # The original weights come back for slots with an expert, 0 for -1 slots.
    assert_equal(comb.combined_topk_weights, np.where(idx >= 0, w, 0).astype(np.float32),
                 "combined_topk_weights", rank)

    # Static mode: outputs of num_worst_tokens rows, the real N_r in the tensor only (the call
    # returns without a sync on every backend, so the host figure is -1).
    worst = nranks * p.T_max
    st = buf.dispatch(x, idx, num_worst_tokens=worst)
    assert st.recv_x.shape == (worst, p.H) and st.num_recv_tokens == -1
    assert st.num_recv_tokens_per_expert_list is None  # static mode does not wait for the counts
    assert int(st.num_recv_tokens_tensor[0]) == len(recv_x)
    assert_equal(st.recv_x[:len(recv_x)], recv_x, "static recv_x", rank)
    assert buf.query_overflow() is False
    return True


@pytest.mark.parametrize("nranks", RANKS)
def test_ht(nranks):
    run_ranks(nranks, _ht, alignment=1, idx_dtype=np.int64, with_bias=False)


@pytest.mark.parametrize("nranks", [2, 4])
def test_ht_int32_aligned_bias(nranks):
    run_ranks(nranks, _ht, alignment=4, idx_dtype=np.int32, with_bias=True)


def _ht_fp8(rank, nranks, uid):
    p = problem(nranks)
    comm = host_comm(rank, nranks, uid)
    buf = epx.Buffer(comm, p.T_max, p.H, p.K, p.E, modes="ht", dispatch_dtypes=["fp8", "fp32"])
    rng = np.random.default_rng(SEED + 7 * rank)
    xs = [np.random.default_rng(SEED + 7 * s).integers(0, 256, size=(p.tokens[s], p.H), dtype=np.uint8)
          for s in range(nranks)]
    scales = [np.full((p.tokens[s], p.H // 128), s + 0.5, dtype=np.float32) for s in range(nranks)]
    del rng
    out = buf.dispatch(xs[rank], p.topk_idx[rank], x_scales=scales[rank])
    rows = p.ht_rows(rank)
    want_x = np.array([xs[s][t] for s, t in rows], dtype=np.uint8).reshape(len(rows), p.H)
    want_s = np.array([scales[s][t] for s, t in rows], dtype=np.float32).reshape(len(rows), 1)
    assert out.recv_x.dtype == np.uint8
    assert_equal(out.recv_x, want_x, "fp8 recv_x", rank)
    assert_equal(out.recv_x_scales, want_s, "recv_x_scales", rank)
    # fp32 x goes through unchanged.
    x32 = f32(p.x[rank])
    out32 = buf.dispatch(x32, p.topk_idx[rank])
    want32 = np.array([f32(p.x[s][t]) for s, t in rows], dtype=np.float32).reshape(len(rows), p.H)
    assert out32.recv_x.dtype == np.float32
    assert_equal(out32.recv_x, want32, "fp32 recv_x", rank)
    return True


@pytest.mark.parametrize("nranks", [1, 2])
def test_ht_fp8_fp32(nranks):
    run_ranks(nranks, _ht_fp8)


# ------------------------------------------------------------------------------------ LL


def _ll(rank, nranks, uid, hook, zero_copy, shape=None):
    p = problem(nranks, **(shape or {}))
    comm = host_comm(rank, nranks, uid)
    buf = epx.Buffer(comm, p.T_max, p.H, p.K, p.E, modes=["ll"])
    x, idx, w = p.x[rank], p.topk_idx[rank], p.weights[rank]
    stats = np.zeros(p.L, dtype=np.int32)
    out = buf.ll_dispatch(x, idx, stats, return_recv_hook=hook)
    if hook:
        assert callable(out.hook)
        out.hook()
    else:
        assert out.hook is None
    recv_x, count, src, layout = p.ll_dispatch(rank)
    assert_equal(out.recv_count, count, "recv_count", rank)
    assert_equal(stats, count, "cumulative_recv_stats", rank)
    assert_equal(out.layout_range, layout, "layout_range", rank)
    for j in range(p.L):
        n = int(count[j])
        assert_equal(out.recv_x[j, :n], recv_x[j, :n], "recv_x[%d]" % j, rank)
        assert_equal(out.src_info[j, :n], src[j, :n], "src_info[%d]" % j, rank)

    y = np.zeros_like(out.recv_x)
    for j in range(p.L):
        y[j] = p.expert_fn(out.recv_x[j], (rank * p.L + j) % 3 + 1)
    if zero_copy:
        view = buf.get_combine_buffer(out.handle)
        assert view.shape == y.shape and view.dtype == np.uint16
        view[...] = y
        comb = buf.ll_combine(None, idx, w, out.handle, zero_copy=True, return_recv_hook=hook)
    else:
        comb = buf.ll_combine(y, idx, w, out.handle, return_recv_hook=hook)
    if hook:
        comb.hook()
    assert_equal(comb.combined_x, p.ll_combine(rank), "ll combined_x", rank)
    return True


@pytest.mark.parametrize("nranks", RANKS)
@pytest.mark.parametrize("hook,zero_copy", [(False, False), (True, True)])
def test_ll(nranks, hook, zero_copy):
    run_ranks(nranks, _ll, hook=hook, zero_copy=zero_copy)


def _ll_fp8(rank, nranks, uid):
    p = problem(nranks, hidden=512)
    comm = host_comm(rank, nranks, uid)
    buf = epx.Buffer(comm, p.T_max, p.H, p.K, p.E, modes="ll")
    out = buf.ll_dispatch(p.x[rank], p.topk_idx[rank], use_fp8=True)
    rows = nranks * p.T_max
    assert out.recv_x.dtype == np.uint8 and out.recv_x.shape == (p.L, rows, p.H)
    assert out.recv_scales.shape == (p.L, p.H // 128, rows) and out.recv_scales.dtype == np.float32
    # Scales per the pinned cast (our values are exact).
    for j, i, _, want in p.ll_fp8_rows(rank):
        assert_equal(out.recv_scales[j, :, i], want, "fp8 scales", rank)
    ue = buf.ll_dispatch(p.x[rank], p.topk_idx[rank], use_fp8=True, round_scale=True, use_ue8m0=True)
    assert ue.recv_scales.dtype == np.int32 and ue.recv_scales.shape == (p.L, p.H // 512, rows)
    return True


@pytest.mark.parametrize("nranks", [1, 2])
def test_ll_fp8(nranks):
    run_ranks(nranks, _ll_fp8)


# ------------------------------------------------------------------------------------ routing map


def _rm(rank, nranks, uid, permute, weighted, pad, shape=None):
    p = problem(nranks, **(shape or {}))
    comm = host_comm(rank, nranks, uid)
    buf = epx.Buffer(comm, p.T_max, p.H, p.K, p.E, modes="permute", max_pad_multiple=max(pad, 1))
    rmap, probs = p.routing_map(rank), p.probs[rank]
    out = buf.rm_dispatch(p.x[rank], rmap, probs, permute=permute, pad_multiple=pad)
    tokens, want_probs, per_expert, rows = p.rm_dispatch(rank, permute, pad)
    assert out.num_tokens == len(tokens) == out.handle.num_recv_tokens
    assert_equal(out.tokens, tokens, "tokens", rank)
    assert_equal(out.probs, want_probs, "probs", rank)
    if permute:
        assert_equal(out.tokens_per_expert, per_expert, "tokens_per_expert", rank)
        y = np.zeros_like(out.tokens)
        for i, row in enumerate(rows):
            if row is not None:
                y[i] = p.expert_fn(out.tokens[i], row[2] + 2)
    else:
        assert out.tokens_per_expert is None
        y = p.expert_fn(out.tokens, rank + 1)
    comb = buf.rm_combine(y, out.handle, weighted=weighted)
    assert_equal(comb, p.rm_combine(rank, permute, weighted), "rm combined", rank)
    return True


@pytest.mark.parametrize("nranks", RANKS)
@pytest.mark.parametrize("permute,weighted,pad", [(False, False, 1), (True, True, 4), (True, False, 1)])
def test_rm(nranks, permute, weighted, pad):
    run_ranks(nranks, _rm, permute=permute, weighted=weighted, pad=pad)


def _rm_bound(rank, nranks, uid):
    p = problem(nranks, ragged=False)
    comm = host_comm(rank, nranks, uid)
    buf = epx.Buffer(comm, p.T_max, p.H, p.K, p.E, modes="permute")
    tokens, _, _, _ = p.rm_dispatch(rank, False, 1)
    n = len(tokens)
    # A bound above the real count: zero rows past it, no overflow.
    bound = min(n + 2, nranks * p.T_max)
    big = buf.rm_dispatch(p.x[rank], p.routing_map(rank), num_dispatched_tokens=bound)
    assert big.num_tokens == bound and big.tokens.shape == (bound, p.H)
    assert int(big.num_tokens_tensor[0]) == n
    assert_equal(big.tokens[:n], tokens, "bounded tokens", rank)
    assert not big.tokens[n:].any()
    assert buf.query_overflow() is False
    # A bound below it: rows dropped, overflow flagged once.
    small = buf.rm_dispatch(p.x[rank], p.routing_map(rank), num_dispatched_tokens=max(n - 1, 0))
    assert small.tokens.shape == (max(n - 1, 0), p.H)
    assert buf.query_overflow() is (n > 0)
    assert buf.query_overflow() is False
    return n


@pytest.mark.parametrize("nranks", [1, 2])
def test_rm_bounds(nranks):
    run_ranks(nranks, _rm_bound)


def _ht_static_overflow(rank, nranks, uid):
    p = problem(nranks, ragged=False)
    comm = host_comm(rank, nranks, uid)
    buf = epx.Buffer(comm, p.T_max, p.H, p.K, p.E, modes="ht")
    n = len(p.ht_rows(rank))
    out = buf.dispatch(p.x[rank], p.topk_idx[rank], num_worst_tokens=1)
    assert out.recv_x.shape == (1, p.H) and out.num_recv_tokens == -1
    assert int(out.num_recv_tokens_tensor[0]) == n
    assert buf.query_overflow() is (n > 1)
    return True


@pytest.mark.parametrize("nranks", [1, 2])
def test_ht_static_overflow(nranks):
    run_ranks(nranks, _ht_static_overflow)


# ------------------------------------------------------------------------------------ odd shapes


# (ranks, max_tokens, hidden, top-k, experts): one expert per rank, top-1, one token, a hidden of three
# 128-channel groups, more ranks than tokens, a top-k above 8 (odd, as many as the experts of 3 ranks).
ODD_SHAPES = [(2, 1, 128, 1, 2), (3, 7, 384, 2, 9), (5, 3, 128, 4, 10), (2, 64, 128, 9, 18), (6, 2, 128, 5, 12)]


@pytest.mark.parametrize("nranks,max_tokens,hidden,topk,experts", ODD_SHAPES)
def test_odd_shapes(nranks, max_tokens, hidden, topk, experts):
    shape = dict(max_tokens=max_tokens, hidden=hidden, topk=topk, experts=experts)
    run_ranks(nranks, _ht, alignment=4, idx_dtype=np.int32, with_bias=True, shape=shape)
    run_ranks(nranks, _ll, hook=True, zero_copy=True, shape=shape)
    run_ranks(nranks, _rm, permute=True, weighted=True, pad=4, shape=shape)
    run_ranks(nranks, _rm, permute=False, weighted=False, pad=1, shape=shape)


# ------------------------------------------------------------------------------------ lifetime


def test_handles_and_destroy_order():
    p = problem(1, ragged=False)
    comm, buf = one_rank_buffer(p)
    out = buf.dispatch(p.x[0], p.topk_idx[0])
    with pytest.raises(RuntimeError, match="buffer"):
        comm.destroy()
    with pytest.raises(RuntimeError, match="handle"):
        buf.destroy()
    out.handle.destroy()
    with pytest.raises(ValueError, match="handle was destroyed"):
        buf.combine(out.recv_x, out.handle)
    buf.destroy()
    with pytest.raises(ValueError, match="buffer was destroyed"):
        buf.get_dispatch_layout(p.topk_idx[0])
    comm.destroy()
    # Dropping every reference frees in the right order (handle -> buffer -> comm).
    comm, buf = one_rank_buffer(p)
    h = buf.dispatch(p.x[0], p.topk_idx[0]).handle
    del comm, buf
    assert h.num_tokens == p.T_max


# ------------------------------------------------------------------------------------ default dtypes


def _odd_hidden(rank, nranks, uid):
    """A hidden size that is not a multiple of 128 with the default dispatch dtypes: bf16 works, fp8 is
    refused by name."""
    p = problem(nranks, hidden=200)
    comm = host_comm(rank, nranks, uid)
    buf = epx.Buffer(comm, p.T_max, p.H, p.K, p.E, modes="ht", views=False)
    out = buf.dispatch(p.x[rank], p.topk_idx[rank], p.weights[rank])
    recv_x, _, _, _ = p.ht_dispatch(rank)
    assert_equal(out.recv_x, recv_x, "recv_x (hidden 200, default dtypes)", rank)
    x8 = np.zeros((p.tokens[rank], p.H), dtype=np.uint8)
    scales = np.ones((p.tokens[rank], 1), dtype=np.float32)
    # Every rank refuses the same call for itself.
    with pytest.raises(epx.InvalidArgumentError, match="fp8"):
        buf.dispatch(x8, p.topk_idx[rank], x_scales=scales)
    # The buffer goes on after the refused call.
    again = buf.dispatch(p.x[rank], p.topk_idx[rank], p.weights[rank])
    assert_equal(again.recv_x, recv_x, "recv_x after the refused fp8 call", rank)
    return True


@pytest.mark.parametrize("nranks", [1, 2])
def test_odd_hidden_default_dtypes(nranks):
    run_ranks(nranks, _odd_hidden)
