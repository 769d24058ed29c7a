"""torch CPU tensors through the binding and the compat fronts (DeepEP, HybridEP) with a gloo group,
checked against the NumPy reference. Skipped where torch is not installed."""

import pytest

torch = pytest.importorskip("torch")

import epx  # noqa: E402
from epx.compat import deep_ep, hybrid_ep  # noqa: E402
from mp import run_ranks  # noqa: E402
from npref import SEED, Problem, assert_equal  # noqa: E402
from torchutil import bf16_bits, run_in_group, to_torch  # noqa: E402



def problem(nranks):
    return Problem(SEED, nranks, 6, 128, 3, 4 * nranks)


def host_buffer(rank, nranks, uid):
    """The problem and an epx.Buffer for it on the host backend."""
    p = problem(nranks)
    comm = epx.Comm.from_unique_id(uid, rank, nranks, backend="host")
    return p, epx.Buffer(comm, p.T_max, p.H, p.K, p.E)


def inputs(p, rank, T=None):
    """x (bf16), topk_idx and topk_weights of `rank` (its first T tokens) as CPU torch tensors."""
    rows = slice(T)
    return (to_torch(p.x[rank][rows], "cpu", bf16=True), to_torch(p.topk_idx[rank][rows], "cpu"),
            to_torch(p.weights[rank][rows], "cpu"))


def _native(rank, nranks, uid):
    p, buf = host_buffer(rank, nranks, uid)
    x, idx, w = inputs(p, rank)
    out = buf.dispatch(x, idx, w)
    assert isinstance(out.recv_x, torch.Tensor) and out.recv_x.dtype == torch.bfloat16
    recv_x, recv_idx, _, _ = p.ht_dispatch(rank)
    assert_equal(bf16_bits(out.recv_x), recv_x, "torch recv_x", rank)
    assert_equal(out.recv_topk_idx.numpy(), recv_idx, "torch recv_topk_idx", rank)
    y = (out.recv_x.float() * (rank + 1)).to(torch.bfloat16)
    comb = buf.combine(y, out.handle)
    assert_equal(bf16_bits(comb.combined_x), p.ht_combine(rank), "torch combined_x", rank)
    ll = buf.ll_dispatch(x, idx)
    _, count, _, _ = p.ll_dispatch(rank)
    assert_equal(ll.recv_count.numpy(), count, "torch recv_count", rank)
    return True


def _ll_handles(rank, nranks, uid):
    # LL handles keep the torch.device of their dispatch; a handle holding a reference it does not own
    # corrupts whatever reuses the device object's memory once the call's own reference is dropped.
    p, buf = host_buffer(rank, nranks, uid)
    x, idx, _ = inputs(p, rank)
    _, count, _, _ = p.ll_dispatch(rank)
    handles, devices = [], []
    for i in range(64):
        ll = buf.ll_dispatch(x, idx)
        handles.append(ll.handle)
        devices.append(torch.device("cpu", 0))  # objects of the same size reuse freed device memory
        assert_equal(ll.recv_count.numpy(), count, "torch recv_count (call %d)" % i, rank)
    del handles
    assert all(d == torch.device("cpu", 0) for d in devices)
    return True


def _no_tokens(rank, nranks, uid):
    # Rank 0 has no tokens. torch exports tensors without elements with a NULL data pointer (which must
    # not read as "absent") and views of nothing with arbitrary strides (which must not read as strided).
    p, buf = host_buffer(rank, nranks, uid)
    T = 0 if rank == 0 else p.tokens[rank]
    x, idx, w = inputs(p, rank, T)
    out = buf.dispatch(x, idx, w)
    assert out.recv_topk_idx is not None and out.recv_topk_weights is not None
    assert out.recv_topk_idx.shape[1] == p.K and out.recv_topk_weights.shape[1] == p.K
    comb = buf.combine(out.recv_x, out.handle, out.recv_topk_weights)
    assert tuple(comb.combined_x.shape) == (T, p.H) and comb.combined_topk_weights is not None
    ll = buf.ll_dispatch(x, idx)
    assert tuple(ll.recv_count.shape) == (p.L,)
    if T == 0:
        routing_map = torch.zeros(p.E, 0, dtype=torch.bool).t()  # [0, E] view with strides (1, 0)
        probs = torch.zeros(p.E, 0).t()
    else:
        routing_map, probs = to_torch(p.routing_map(rank), "cpu"), to_torch(p.probs[rank], "cpu")
    rm = buf.rm_dispatch(x, routing_map, probs)
    assert rm.probs is not None and tuple(rm.probs.shape)[1:] == (p.L,)
    return True


def _requires_grad(rank, nranks, uid):
    """Inputs that require grad (training code calls from inside an autograd.Function) are read as they
    are, the same results as their detached copies; epx's calls stay outside autograd."""
    p, buf = host_buffer(rank, nranks, uid)
    x, idx, w = inputs(p, rank)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = buf.dispatch(xg, idx, wg)
    recv_x, _, recv_w, _ = p.ht_dispatch(rank)
    assert_equal(bf16_bits(out.recv_x), recv_x, "recv_x of inputs that require grad", rank)
    assert not out.recv_x.requires_grad
    y = (out.recv_x.float() * (rank + 1)).to(torch.bfloat16).requires_grad_(True)
    comb = buf.combine(y, out.handle)
    assert_equal(bf16_bits(comb.combined_x), p.ht_combine(rank), "combined_x of y that requires grad", rank)
    ll = buf.ll_dispatch(xg, idx)
    _, count, _, _ = p.ll_dispatch(rank)
    assert_equal(ll.recv_count.numpy(), count, "ll recv_count of x that requires grad", rank)
    assert xg.requires_grad and xg.grad is None  # the caller's tensor is left as it was
    return True


# Native calls on CPU tensors; each worker runs on 1 and 2 ranks.
@pytest.mark.parametrize("nranks", [1, 2])
@pytest.mark.parametrize("worker", [_native, _ll_handles, _no_tokens, _requires_grad],
                         ids=lambda worker: worker.__name__[1:])
def test_torch(worker, nranks):
    run_ranks(nranks, worker)


def _deep_ep(rank, nranks, dist):
    p = problem(nranks)
    # backend="host": on a machine with a GPU "auto" would pick the cuda backend for these CPU tensors.
    comm = epx.Comm.from_torch(dist.group.WORLD, backend="host")
    buf = deep_ep.Buffer(dist.group.WORLD, int(1e8), 0, comm=comm)
    x, idx, w = inputs(p, rank)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, p.E)
    want_rank, want_expert, want_in = p.layout(rank)
    assert_equal(per_rank.numpy(), want_rank, "deep_ep num_tokens_per_rank", rank)
    assert_equal(per_expert.numpy(), want_expert, "deep_ep num_tokens_per_expert", rank)
    assert_equal(in_rank.numpy(), want_in, "deep_ep is_token_in_rank", rank)
    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w, config=deep_ep.Buffer.get_dispatch_config(nranks))
    want_x, want_idx, want_w, want_counts = p.ht_dispatch(rank)
    assert_equal(bf16_bits(recv_x), want_x, "deep_ep recv_x", rank)
    assert counts == want_counts.tolist()
    y = (recv_x.float() * (rank + 1)).to(torch.bfloat16)
    combined, _, _ = buf.combine(y, handle, async_finish=True)
    assert_equal(bf16_bits(combined), p.ht_combine(rank), "deep_ep combined", rank)
    # LL with hook and zero-copy combine.
    rx, rcount, llh, _, hook = buf.low_latency_dispatch(x, idx, p.T_max, p.E, use_fp8=False,
                                                        return_recv_hook=True)
    hook()
    _, count, _, _ = p.ll_dispatch(rank)
    assert_equal(rcount.numpy(), count, "deep_ep recv_count", rank)
    view = buf.get_next_low_latency_combine_buffer(llh)
    for j in range(p.L):
        view[j] = (rx[j].float() * ((rank * p.L + j) % 3 + 1)).to(torch.bfloat16)
    out, _, _ = buf.low_latency_combine(view, idx, w, llh, zero_copy=True)
    assert_equal(bf16_bits(out), p.ll_combine(rank), "deep_ep ll combined", rank)
    # use_logfmt is accepted and carried in bf16: the exact combine again.
    out, _, _ = buf.low_latency_combine(view, idx, w, llh, use_logfmt=True)
    assert_equal(bf16_bits(out), p.ll_combine(rank), "deep_ep ll combined with use_logfmt", rank)
    buf.destroy()
    return True


def _hybrid_ep(rank, nranks, dist):
    p = problem(nranks)
    buf = hybrid_ep.HybridEPBuffer(dist.group.WORLD, hidden_dim=p.H, max_num_of_tokens_per_rank=p.T_max,
                                   num_local_experts=p.L, num_topk=p.K, max_pad_multiple=4,
                                   comm=epx.Comm.from_torch(dist.group.WORLD, backend="host"))
    x, idx, w = inputs(p, rank)
    tokens, probs, _, handle = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_of_experts=p.E)
    want_tokens, want_probs, _, _ = p.rm_dispatch(rank, False, 1)
    assert_equal(bf16_bits(tokens), want_tokens, "hybrid tokens", rank)
    lo = buf.local_rank * p.L  # HybridEP's probs span the NVLink domain's experts; this rank's at lo
    assert_equal(probs[:, lo:lo + p.L].contiguous().numpy(), want_probs, "hybrid probs", rank)
    combined, _ = buf.combine((tokens.float() * (rank + 1)).to(torch.bfloat16), handle=handle)
    assert_equal(bf16_bits(combined), p.rm_combine(rank, False, False), "hybrid combined", rank)
    tokens, probs, _, per_expert, handle = buf.dispatch_with_permute(
        x, routing_map=to_torch(p.routing_map(rank), "cpu"), probs=to_torch(p.probs[rank], "cpu"),
        pad_multiple=4)
    want_tokens, want_probs, want_per_expert, rows = p.rm_dispatch(rank, True, 4)
    assert_equal(bf16_bits(tokens), want_tokens, "hybrid permuted tokens", rank)
    assert_equal(per_expert.numpy(), want_per_expert, "hybrid tokens_per_expert", rank)
    y = torch.zeros_like(tokens)
    for i, row in enumerate(rows):
        if row is not None:
            y[i] = (tokens[i].float() * (row[2] + 2)).to(torch.bfloat16)
    combined, _ = buf.combine_with_unpermute(y, handle=handle, weighted=True)
    assert_equal(bf16_bits(combined), p.rm_combine(rank, True, True), "hybrid unpermuted", rank)
    _, combined_probs = buf.combine_with_unpermute(y, probs=probs, handle=handle)
    assert_equal(combined_probs.numpy(), p.probs[rank], "hybrid combined probs", rank)
    return True


# The DeepEP and HybridEP fronts over a torch.distributed group, on 1 and 2 ranks.
@pytest.mark.parametrize("nranks", [1, 2])
@pytest.mark.parametrize("worker", [_deep_ep, _hybrid_ep], ids=lambda worker: worker.__name__[1:])
def test_front(worker, nranks):
    run_in_group(nranks, worker)


def _from_torch(rank, nranks, dist):
    comm = epx.Comm.from_torch(backend="host")
    got = (comm.rank, comm.nranks, comm.backend)
    comm.destroy()
    return got


def test_comm_from_torch_gloo():
    assert run_in_group(2, _from_torch) == [(0, 2, "host"), (1, 2, "host")]
