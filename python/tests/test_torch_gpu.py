"""torch CUDA tensors on the cuda backend: native operations on 2, 4 and 8 ranks sharing GPU 0 (run
under MPS), the DeepEP front through a DeepEP-style scenario (layout, dispatch, combine, LL with hook,
LL captured in a CUDA graph) and Comm.from_torch with an NCCL group. Skipped without a GPU and a
cuda-enabled build (EPX_PYTHON_CUDA=1 pip install .)."""

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
from epx.compat import deep_ep  # noqa: E402
from mp import run_ranks  # noqa: E402
from npref import Problem, bf16, f32  # noqa: E402
from test_ops import SEED, assert_equal  # noqa: E402
from torchutil import bf16_bits, free_port, init_group, to_torch  # noqa: E402

RANKS = [2, 4, 8]


def problem(nranks):
    return Problem(SEED, nranks, 8, 256, 4, 4 * nranks)


def _cuda_comm(rank, nranks, uid):
    torch.cuda.set_device(0)
    return epx.Comm.from_unique_id(uid, rank, nranks, backend="cuda", cuda_device=0)


def _native(rank, nranks, uid):
    p = problem(nranks)
    comm = _cuda_comm(rank, nranks, uid)
    buf = epx.Buffer(comm, p.T_max, p.H, p.K, p.E)
    dev = torch.device("cuda", 0)
    x = to_torch(p.x[rank], dev, bf16=True)
    idx = to_torch(p.topk_idx[rank], dev)
    w = to_torch(p.weights[rank], dev)
    lay = buf.get_dispatch_layout(idx)
    want_rank, want_expert, want_in = p.layout(rank)
    assert_equal(lay.num_tokens_per_rank.cpu().numpy(), want_rank, "num_tokens_per_rank", rank)
    out = buf.dispatch(x, idx, w)
    assert out.recv_x.is_cuda
    want_x, want_idx, want_w, _ = p.ht_dispatch(rank)
    assert_equal(bf16_bits(out.recv_x), want_x, "recv_x", rank)
    assert_equal(out.recv_topk_idx.cpu().numpy(), want_idx, "recv_topk_idx", rank)
    y = (out.recv_x.float() * (rank + 1)).to(torch.bfloat16)
    comb = buf.combine(y, out.handle)
    assert_equal(bf16_bits(comb.combined_x), p.ht_combine(rank), "combined_x", rank)

    ll = buf.ll_dispatch(x, idx, return_recv_hook=True)
    ll.hook()
    _, count, _, _ = p.ll_dispatch(rank)
    assert_equal(ll.recv_count.cpu().numpy(), count, "recv_count", rank)
    yl = torch.zeros_like(ll.recv_x)
    for j in range(p.L):
        yl[j] = (ll.recv_x[j].float() * ((rank * p.L + j) % 3 + 1)).to(torch.bfloat16)
    lc = buf.ll_combine(yl, idx, w, ll.handle)
    assert_equal(bf16_bits(lc.combined_x), p.ll_combine(rank), "ll combined_x", rank)

    rm = buf.rm_dispatch(x, to_torch(p.routing_map(rank), dev), to_torch(p.probs[rank], dev), permute=True,
                         pad_multiple=4)
    want_tokens, _, want_per_expert, _ = p.rm_dispatch(rank, True, 4)
    assert_equal(bf16_bits(rm.tokens), want_tokens, "permuted tokens", rank)
    assert_equal(rm.tokens_per_expert.cpu().numpy(), want_per_expert, "tokens_per_expert", rank)
    assert comm.get_async_error() is None
    return True


@pytest.mark.parametrize("nranks", RANKS)
def test_native_cuda(nranks):
    run_ranks(nranks, _native)


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


def _deep_ep_graph(rank, nranks, uid, port):
    torch.cuda.set_device(0)
    dist = init_group(rank, nranks, port, backend="gloo")
    p = problem(nranks)
    comm = epx.Comm.from_unique_id(uid, rank, nranks, backend="cuda", cuda_device=0)
    buf = deep_ep.Buffer(dist.group.WORLD, 0, 0, low_latency_mode=True, comm=comm)
    dev = torch.device("cuda", 0)
    x = to_torch(p.x[rank], dev, bf16=True)
    idx = to_torch(p.topk_idx[rank], dev)
    w = to_torch(p.weights[rank], dev)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, p.E)
    recv_x, _, _, _, handle, event = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w, async_finish=True)
    event.current_stream_wait()
    combined, _, _ = buf.combine((recv_x.float() * (rank + 1)).to(torch.bfloat16), handle)
    assert_equal(bf16_bits(combined), p.ht_combine(rank), "deep_ep combined", rank)

    buf.clean_low_latency_buffer(p.T_max, p.H, p.E, num_topk=p.K)
    # LL dispatch + combine captured once, replayed twice.
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            rx, rcount, llh, _, _ = buf.low_latency_dispatch(x, idx, p.T_max, p.E, use_fp8=False)
            out, _, _ = buf.low_latency_combine(rx, idx, w, llh)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        _, count, _, _ = p.ll_dispatch(rank)
        assert_equal(rcount.cpu().numpy(), count, "graph recv_count", rank)
        assert_equal(bf16_bits(out), ll_combine_identity(p, rank), "graph ll combined", rank)
    dist.destroy_process_group()
    return True


@pytest.mark.parametrize("nranks", [2, 4])
def test_deep_ep_scenario_with_graph(nranks):
    run_ranks(nranks, _deep_ep_graph, port=free_port())


def _from_torch_nccl(rank, nranks, uid, port):
    torch.cuda.set_device(0)
    dist = init_group(rank, nranks, port, backend="nccl")
    comm = epx.Comm.from_torch()
    got = (comm.rank, comm.nranks, comm.backend)
    comm.destroy()
    dist.destroy_process_group()
    return got


def test_comm_from_torch_nccl():
    # NCCL needs one GPU per rank; with a single GPU only one rank can join.
    n = min(2, int(os.environ.get("EPX_TEST_GPUS", "1")))
    assert run_ranks(n, _from_torch_nccl, port=free_port()) == [(r, n, "cuda") for r in range(n)]
