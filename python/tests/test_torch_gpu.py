"""torch CUDA tensors on the cuda backend, checked against the NumPy reference (npref.py): every native
operation on 2, 4 and 8 ranks sharing GPU 0 (run under MPS), the DeepEP front through a DeepEP-style
scenario (layout, dispatch, combine, LL with hook and zero-copy, LL captured in a CUDA graph and replayed
on new inputs), the HybridEP front (dispatch/combine, dispatch_with_permute/combine_with_unpermute) and
Comm.from_torch with a gloo and an NCCL group. Skipped without a GPU or without a cuda-enabled build
(EPX_PYTHON_CUDA=1 pip install .)."""

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def _gpu_ready():
    # Probe in a child: the forked ranks must not inherit an initialised CUDA driver.
    code = "import torch, sys; sys.exit(0 if torch.cuda.device_count() > 0 else 1)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


if not _gpu_ready():
    pytest.skip("no CUDA device", allow_module_level=True)

import epx  # noqa: E402
from epx.compat import deep_ep, hybrid_ep  # noqa: E402
from mp import run_ranks  # noqa: E402
from npref import Problem, bf16, f32  # noqa: E402
from test_ops import SEED, assert_equal  # noqa: E402
from torchutil import bf16_bits, free_port, init_group, to_torch  # noqa: E402

RANKS = [2, 4, 8]
DEV = torch.device("cuda", 0)
# GPUs the NCCL test may spread its ranks over (NCCL refuses two ranks on one GPU).
NUM_GPUS = int(os.environ.get("EPX_TEST_GPUS", "1"))


def problem(nranks):
    return Problem(SEED, nranks, 8, 256, 4, 4 * nranks)


def _cuda_comm(rank, nranks, uid):
    torch.cuda.set_device(0)
    comm = epx.Comm.from_unique_id(uid, rank, nranks, backend="cuda", cuda_device=0)
    assert (comm.rank, comm.nranks, comm.backend, comm.cuda_device) == (rank, nranks, "cuda", 0)
    return comm


def _inputs(p, rank):
    return (to_torch(p.x[rank], DEV, bf16=True), to_torch(p.topk_idx[rank], DEV),
            to_torch(p.weights[rank], DEV))


def _host(t):
    return t.detach().cpu().numpy()


def _scaled(t, factors, dims):
    """bf16(t * factor) with one factor per index of t's first dimension (the tests' "experts")."""
    f = torch.tensor(np.asarray(factors, dtype=np.float32), device=t.device).reshape((-1,) + (1,) * dims)
    return (t.float() * f).to(torch.bfloat16)


def _check_ll_dispatch(p, rank, recv_x, recv_count, src_info=None, layout_range=None, what="ll"):
    want_x, count, src, layout = p.ll_dispatch(rank)
    assert_equal(_host(recv_count), count, what + " recv_count", rank)
    if layout_range is not None:
        assert_equal(_host(layout_range), layout, what + " layout_range", rank)
    for j in range(p.L):
        n = int(count[j])
        assert_equal(bf16_bits(recv_x[j, :n]), want_x[j, :n], "%s recv_x[%d]" % (what, j), rank)
        if src_info is not None:
            assert_equal(_host(src_info[j, :n]), src[j, :n], "%s src_info[%d]" % (what, j), rank)


# ------------------------------------------------------------------------------------ native


def _native(rank, nranks, uid):
    p = problem(nranks)
    comm = _cuda_comm(rank, nranks, uid)
    buf = epx.Buffer(comm, p.T_max, p.H, p.K, p.E)
    x, idx, w = _inputs(p, rank)

    lay = buf.get_dispatch_layout(idx)
    want_rank, want_expert, want_in = p.layout(rank)
    assert lay.is_token_in_rank.is_cuda and lay.is_token_in_rank.dtype == torch.bool
    assert_equal(_host(lay.num_tokens_per_rank), want_rank, "num_tokens_per_rank", rank)
    assert_equal(_host(lay.num_tokens_per_expert), want_expert, "num_tokens_per_expert", rank)
    assert_equal(_host(lay.is_token_in_rank), want_in, "is_token_in_rank", rank)

    out = buf.dispatch(x, idx, w)
    assert out.recv_x.is_cuda and out.recv_x.dtype == torch.bfloat16
    want_x, want_idx, want_w, want_counts = p.ht_dispatch(rank)
    assert out.num_recv_tokens == len(want_x)
    assert_equal(bf16_bits(out.recv_x), want_x, "recv_x", rank)
    assert_equal(_host(out.recv_topk_idx), want_idx, "recv_topk_idx", rank)
    assert_equal(_host(out.recv_topk_weights), want_w, "recv_topk_weights", rank)
    assert_equal(_host(out.num_recv_tokens_per_expert), want_counts, "num_recv_tokens_per_expert", rank)
    # The mapped block's copy of the counts, read on the host by the binding.
    assert_equal(np.array(out.num_recv_tokens_per_expert_list, dtype=np.int32), want_counts,
                 "num_recv_tokens_per_expert_list", rank)
    # Combine on a side stream: the binding runs on torch's current stream, not the default one.
    y = _scaled(out.recv_x, [rank + 1] * out.recv_x.shape[0], 1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        comb = buf.combine(y, out.handle)
    torch.cuda.current_stream().wait_stream(side)
    assert_equal(bf16_bits(comb.combined_x), p.ht_combine(rank), "combined_x", rank)

    stats = torch.zeros(p.L, dtype=torch.int32, device=DEV)
    ll = buf.ll_dispatch(x, idx, stats, return_recv_hook=True)
    ll.hook()
    _check_ll_dispatch(p, rank, ll.recv_x, ll.recv_count, ll.src_info, ll.layout_range)
    assert_equal(_host(stats), p.ll_dispatch(rank)[1], "cumulative_recv_stats", rank)
    yl = _scaled(ll.recv_x, [(rank * p.L + j) % 3 + 1 for j in range(p.L)], 2)
    # An explicit stream (a cudaStream_t as int) instead of the current one.
    side.wait_stream(torch.cuda.current_stream())
    lc = buf.ll_combine(yl, idx, w, ll.handle, stream=side.cuda_stream)
    torch.cuda.current_stream().wait_stream(side)
    assert_equal(bf16_bits(lc.combined_x), p.ll_combine(rank), "ll combined_x", rank)

    # fp8 LL dispatch: float8_e4m3fn rows, column-major scales per the pinned cast.
    f8 = buf.ll_dispatch(x, idx, use_fp8=True)
    rows = nranks * p.T_max
    assert f8.recv_x.dtype == torch.float8_e4m3fn and tuple(f8.recv_x.shape) == (p.L, rows, p.H)
    assert f8.recv_scales.dtype == torch.float32 and tuple(f8.recv_scales.shape) == (p.L, p.H // 128, rows)
    qx, qs = f8.recv_x.float().cpu().numpy(), _host(f8.recv_scales)
    for j, i, v, want in p.ll_fp8_rows(rank):
        assert_equal(qs[j, :, i], want, "fp8 scales", rank)
        # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself, 1/8 with the scale's rounding.
        deq = qx[j, i].reshape(p.H // 128, 128) * qs[j, :, i][:, None]
        assert np.all(np.abs(deq - v) <= np.abs(v) / 8), "rank %d: fp8 row %d of expert %d" % (rank, i, j)
    # The fp8 dispatch has the same routing, so yl fits its layout.
    lc = buf.ll_combine(yl, idx, w, f8.handle)
    assert_equal(bf16_bits(lc.combined_x), p.ll_combine(rank), "ll combined_x after fp8", rank)

    rm = buf.rm_dispatch(x, to_torch(p.routing_map(rank), DEV), to_torch(p.probs[rank], DEV))
    want_tokens, want_probs, _, _ = p.rm_dispatch(rank, False, 1)
    assert_equal(bf16_bits(rm.tokens), want_tokens, "rm tokens", rank)
    assert_equal(_host(rm.probs), want_probs, "rm probs", rank)
    back = buf.rm_combine(_scaled(rm.tokens, [rank + 1] * rm.tokens.shape[0], 1), rm.handle)
    assert_equal(bf16_bits(back), p.rm_combine(rank, False, False), "rm combined", rank)

    rm = buf.rm_dispatch(x, to_torch(p.routing_map(rank), DEV), to_torch(p.probs[rank], DEV), permute=True,
                         pad_multiple=4)
    want_tokens, want_probs, want_per_expert, row_map = p.rm_dispatch(rank, True, 4)
    assert_equal(bf16_bits(rm.tokens), want_tokens, "permuted tokens", rank)
    assert_equal(_host(rm.probs), want_probs, "permuted probs", rank)
    assert_equal(_host(rm.tokens_per_expert), want_per_expert, "tokens_per_expert", rank)
    yp = _scaled(rm.tokens, [0 if r is None else r[2] + 2 for r in row_map], 1)
    back = buf.rm_combine(yp, rm.handle, weighted=True)
    assert_equal(bf16_bits(back), p.rm_combine(rank, True, True), "unpermuted", rank)
    assert comm.get_async_error() is None
    return True


@pytest.mark.parametrize("nranks", RANKS)
def test_native_cuda(nranks):
    run_ranks(nranks, _native)


# ------------------------------------------------------------------------------------ DeepEP front


def ll_combine_identity(p, rank):
    """LL combine of the received rows unchanged: sum over slots k ascending of w * x, fp32, one rounding."""
    x = f32(p.x[rank])
    out = np.zeros_like(x)
    for t in range(p.tokens[rank]):
        acc = np.zeros(p.H, dtype=np.float32)
        for k in range(p.K):
            if p.topk_idx[rank][t, k] >= 0:
                acc = (acc + p.weights[rank][t, k] * x[t]).astype(np.float32)
        out[t] = acc
    return bf16(out)


def _deep_ep_scenario(rank, nranks, uid, port):
    torch.cuda.set_device(0)
    dist = init_group(rank, nranks, port, backend="gloo")
    p = problem(nranks)
    comm = epx.Comm.from_unique_id(uid, rank, nranks, backend="cuda", cuda_device=0)
    buf = deep_ep.Buffer(dist.group.WORLD, int(1e9), 0, low_latency_mode=True, comm=comm)
    x, idx, w = _inputs(p, rank)

    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, p.E)
    want_rank, want_expert, want_in = p.layout(rank)
    assert_equal(_host(per_rank), want_rank, "deep_ep num_tokens_per_rank", rank)
    assert_equal(_host(per_expert), want_expert, "deep_ep num_tokens_per_expert", rank)
    assert_equal(_host(in_rank), want_in, "deep_ep is_token_in_rank", rank)
    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w, config=deep_ep.Buffer.get_dispatch_config(nranks), async_finish=True)
    event.current_stream_wait()
    want_x, want_idx, want_w, want_counts = p.ht_dispatch(rank)
    assert_equal(bf16_bits(recv_x), want_x, "deep_ep recv_x", rank)
    assert_equal(_host(recv_idx), want_idx, "deep_ep recv_topk_idx", rank)
    assert_equal(_host(recv_w), want_w, "deep_ep recv_topk_weights", rank)
    assert counts == want_counts.tolist()
    combined, _, event = buf.combine(_scaled(recv_x, [rank + 1] * recv_x.shape[0], 1), handle,
                                     async_finish=True)
    event.current_stream_wait()
    assert_equal(bf16_bits(combined), p.ht_combine(rank), "deep_ep combined", rank)
    # Cached dispatch with the handle: same rows again.
    again, _, _, _, _, _ = buf.dispatch(x, handle=handle)
    assert_equal(bf16_bits(again), want_x, "deep_ep cached recv_x", rank)

    # LL with the receive hook and a zero-copy combine.
    buf.clean_low_latency_buffer(p.T_max, p.H, p.E, num_topk=p.K)
    rx, rcount, llh, _, hook = buf.low_latency_dispatch(x, idx, p.T_max, p.E, use_fp8=False,
                                                        return_recv_hook=True)
    hook()
    _check_ll_dispatch(p, rank, rx, rcount, what="deep_ep ll")
    view = buf.get_next_low_latency_combine_buffer(llh)
    assert view.is_cuda and view.dtype == torch.bfloat16 and tuple(view.shape) == tuple(rx.shape)
    view.copy_(_scaled(rx, [(rank * p.L + j) % 3 + 1 for j in range(p.L)], 2))
    out, _, hook = buf.low_latency_combine(view, idx, w, llh, zero_copy=True, return_recv_hook=True)
    hook()
    assert_equal(bf16_bits(out), p.ll_combine(rank), "deep_ep ll combined", rank)
    # fp8 LL: DeepEP's (recv_x, scales [L, R*T_max, H/128]) pair.
    (qx, qs), rcount, llh, _, _ = buf.low_latency_dispatch(x, idx, p.T_max, p.E, use_fp8=True)
    assert qx.dtype == torch.float8_e4m3fn and tuple(qs.shape) == (p.L, nranks * p.T_max, p.H // 128)
    assert_equal(_host(rcount), p.ll_dispatch(rank)[1], "deep_ep fp8 recv_count", rank)
    buf.low_latency_combine(rx, idx, w, llh)
    # use_logfmt is accepted and carried in bf16: the combine of the bf16 rows above, exactly.
    rx, _, llh, _, _ = buf.low_latency_dispatch(x, idx, p.T_max, p.E, use_fp8=False)
    out, _, _ = buf.low_latency_combine(_scaled(rx, [(rank * p.L + j) % 3 + 1 for j in range(p.L)], 2), idx, w,
                                        llh, use_logfmt=True)
    torch.cuda.synchronize()
    assert_equal(bf16_bits(out), p.ll_combine(rank), "deep_ep ll combined with use_logfmt", rank)

    # LL dispatch + combine captured once (after an eager round of the same calls), replayed on new x.
    rx, _, llh, _, _ = buf.low_latency_dispatch(x, idx, p.T_max, p.E, use_fp8=False)
    buf.low_latency_combine(rx, idx, w, llh)
    torch.cuda.synchronize()
    x2 = (x.float() * 2).to(torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rx, rcount, llh, _, _ = buf.low_latency_dispatch(x, idx, p.T_max, p.E, use_fp8=False)
        out, _, _ = buf.low_latency_combine(rx, idx, w, llh)
    want = ll_combine_identity(p, rank)
    want2 = bf16(f32(want) * np.float32(2))  # a power of two: exact
    x1 = x.clone()
    for step, (src, expect) in enumerate([(x1, want), (x2, want2), (x1, want)]):
        x.copy_(src)
        rcount.fill_(-1)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_equal(_host(rcount), p.ll_dispatch(rank)[1], "graph recv_count (replay %d)" % step, rank)
        assert_equal(bf16_bits(out), expect, "graph ll combined (replay %d)" % step, rank)
    assert comm.get_async_error() is None
    dist.destroy_process_group()
    return True


@pytest.mark.parametrize("nranks", RANKS)
def test_deep_ep_scenario_with_graph(nranks):
    run_ranks(nranks, _deep_ep_scenario, port=free_port())


# ------------------------------------------------------------------------------------ HybridEP front


def _hybrid_ep(rank, nranks, uid, port):
    torch.cuda.set_device(0)
    dist = init_group(rank, nranks, port, backend="gloo")
    p = problem(nranks)
    comm = epx.Comm.from_unique_id(uid, rank, nranks, backend="cuda", cuda_device=0)
    buf = hybrid_ep.HybridEPBuffer(dist.group.WORLD, hidden_dim=p.H, max_num_of_tokens_per_rank=p.T_max,
                                   num_local_experts=p.L, num_topk=p.K, max_pad_multiple=4, comm=comm)
    x, idx, w = _inputs(p, rank)
    tokens, probs, _, handle = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_of_experts=p.E)
    want_tokens, want_probs, _, _ = p.rm_dispatch(rank, False, 1)
    assert tokens.is_cuda
    assert_equal(bf16_bits(tokens), want_tokens, "hybrid tokens", rank)
    lo = buf.local_rank * p.L  # HybridEP's probs span the NVLink domain's experts; this rank's at lo
    assert_equal(_host(probs[:, lo:lo + p.L].contiguous()), want_probs, "hybrid probs", rank)
    # handle[4], the local expert routing map: the received tokens in source order, this rank's columns.
    g = np.concatenate([p.routing_map(s) for s in range(nranks)])[:, rank * p.L:(rank + 1) * p.L]
    assert_equal(_host(handle[4]), g[g.any(axis=1)], "hybrid local_expert_routing_map", rank)
    combined, _ = buf.combine(_scaled(tokens, [rank + 1] * tokens.shape[0], 1), handle=handle)
    assert_equal(bf16_bits(combined), p.rm_combine(rank, False, False), "hybrid combined", rank)

    tokens, probs, _, per_expert, handle = buf.dispatch_with_permute(
        x, routing_map=to_torch(p.routing_map(rank), DEV), probs=to_torch(p.probs[rank], DEV), pad_multiple=4)
    want_tokens, want_probs, want_per_expert, row_map = p.rm_dispatch(rank, True, 4)
    assert_equal(bf16_bits(tokens), want_tokens, "hybrid permuted tokens", rank)
    assert_equal(_host(per_expert), want_per_expert, "hybrid tokens_per_expert", rank)
    y = _scaled(tokens, [0 if r is None else r[2] + 2 for r in row_map], 1)
    combined, _ = buf.combine_with_unpermute(y, handle=handle, weighted=True)
    assert_equal(bf16_bits(combined), p.rm_combine(rank, True, True), "hybrid unpermuted", rank)
    _, combined_probs = buf.combine_with_unpermute(y, probs=probs, handle=handle)
    assert_equal(_host(combined_probs), p.probs[rank], "hybrid combined probs", rank)
    # The same routing given as topk_idx/topk_weights, with an upper bound on the rows.
    capacity = nranks * p.T_max * min(p.K, p.L) + p.L * 3
    n = len(want_tokens)
    bound = min(n + 4, capacity)
    tokens, probs, _, per_expert, handle = buf.dispatch_with_permute(
        x, topk_idx=idx, topk_weights=w, num_of_experts=p.E, pad_multiple=4, num_permuted_tokens=bound,
        non_blocking=True)
    assert tokens.shape[0] == bound
    assert_equal(_host(per_expert), want_per_expert, "hybrid bounded tokens_per_expert", rank)
    assert_equal(bf16_bits(tokens[:n]), want_tokens, "hybrid bounded tokens", rank)
    assert_equal(bf16_bits(tokens[n:]), np.zeros((bound - n, p.H), np.uint16), "hybrid bound padding", rank)
    assert comm.get_async_error() is None
    dist.destroy_process_group()
    return True


@pytest.mark.parametrize("nranks", [2, 4])
def test_hybrid_ep_front(nranks):
    run_ranks(nranks, _hybrid_ep, port=free_port())


# ------------------------------------------------------------------------------------ Comm.from_torch


def _deep_ep_from_group(dist, rank, nranks):
    """A DeepEP Buffer made from the group alone (its comm from Comm.from_torch): one HT round trip."""
    p = problem(nranks)
    buf = deep_ep.Buffer(dist.group.WORLD, int(1e9), 0)
    assert (buf.comm.rank, buf.comm.nranks, buf.comm.backend) == (rank, nranks, "cuda")
    x, idx, w = _inputs(p, rank)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, p.E)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    assert_equal(bf16_bits(recv_x), p.ht_dispatch(rank)[0], "from_torch recv_x", rank)
    combined, _, _ = buf.combine(_scaled(recv_x, [rank + 1] * recv_x.shape[0], 1), handle)
    assert_equal(bf16_bits(combined), p.ht_combine(rank), "from_torch combined", rank)
    return buf


def _from_torch(rank, nranks, uid, port, backend, spread):
    torch.cuda.set_device(rank % spread)
    dist = init_group(rank, nranks, port, backend=backend)
    comm = epx.Comm.from_torch(backend="cuda")
    got = (comm.rank, comm.nranks, comm.backend, comm.cuda_device)
    comm.destroy()
    if spread == 1:  # the cuda backend's ranks share GPU 0 here; across GPUs it needs peer access
        _deep_ep_from_group(dist, rank, nranks)
    dist.destroy_process_group()
    return got


def test_comm_from_torch_gloo():
    n = 2
    got = run_ranks(n, _from_torch, port=free_port(), backend="gloo", spread=1)
    assert got == [(r, n, "cuda", 0) for r in range(n)]


def test_comm_from_torch_nccl():
    # NCCL needs one GPU per rank: with a single GPU only one rank joins.
    n = min(2, NUM_GPUS)
    got = run_ranks(n, _from_torch, port=free_port(), backend="nccl", spread=n)
    assert got == [(r, n, "cuda", r % n) for r in range(n)]
