"""epx.compat.hybrid_ep against HybridEP's contract, with torch CPU tensors on the host backend (gloo group,
forked ranks): the call sequences HybridEP's own tests make (dispatch by topk_idx and by routing map, with
and without probs, scaling_factor given with bf16; combine with probs; dispatch_with_permute with a pad
multiple, bounds and a handle; combine_with_unpermute with probs; fp8 as uint8; ragged and empty ranks),
each checked against a reference computed here from every rank's inputs."""

import pytest

torch = pytest.importorskip("torch")

import epx  # noqa: E402
from epx.compat.hybrid_ep import HybridEPBuffer, indices_to_map  # noqa: E402
from torchutil import run_in_group  # noqa: E402

H, L, TOPK, PAD, T_MAX = 256, 2, 3, 4, 24


def bits(t):
    return t.contiguous().view(torch.uint8)


def same(a, b, what, rank):
    assert a is not None and b is not None, "%s: missing (rank %d)" % (what, rank)
    assert a.dtype == b.dtype and a.shape == b.shape, "%s: %s %s vs %s %s (rank %d)" % (
        what, a.dtype, list(a.shape), b.dtype, list(b.shape), rank)
    assert torch.equal(bits(a), bits(b)), "%s differs (rank %d)" % (what, rank)


def inputs(rank, T, E, fp8=False):
    """Rank-seeded tokens with TOPK distinct experts each (weights not 1, so columns cannot be confused)."""
    g = torch.Generator().manual_seed(1000 + rank)
    if fp8:
        hidden = torch.randint(0, 256, (T, H), dtype=torch.uint8, generator=g)
        hidden[(hidden & 0x7F) == 0x7F] = 0  # no NaN patterns: rows are compared by value in combine
    else:
        hidden = torch.randn((T, H), generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(T)]) if T else \
        torch.zeros((0, TOPK), dtype=torch.int64)
    weights = torch.rand((T, TOPK), generator=g) + 0.5
    routing_map = torch.zeros((T, E), dtype=torch.bool)
    probs = torch.zeros((T, E))
    routing_map.scatter_(1, idx, True)
    probs.scatter_(1, idx, weights)
    sf = torch.randn((T, H // 128), generator=g)
    return hidden, sf, idx, weights, routing_map, probs


class Ref:
    """What rank `rank` must receive: every rank's rows that selected one of its experts, in source-rank
    then token order (HybridEP's TorchRef order), and the permuted, padded layout of the same."""

    def __init__(self, dist, rank, nranks, hidden, sf, routing_map, probs):
        def gather(t):
            n = torch.tensor([t.shape[0]])
            counts = [torch.zeros_like(n) for _ in range(nranks)]
            dist.all_gather(counts, n)
            pad = torch.zeros((T_MAX,) + tuple(t.shape[1:]), dtype=t.dtype)
            pad[:t.shape[0]] = t
            raw = pad.view(torch.uint8) if t.dtype != torch.bool else pad.to(torch.uint8)
            parts = [torch.empty_like(raw) for _ in range(nranks)]
            dist.all_gather(parts, raw)
            parts = [p.view(t.dtype) if t.dtype != torch.bool else p.bool() for p in parts]
            return torch.cat([p[:int(c)] for p, c in zip(parts, counts)])

        lo, hi = rank * L, (rank + 1) * L
        g_map = gather(routing_map)
        keep = g_map[:, lo:hi].any(dim=1)
        self.tokens = gather(hidden)[keep]
        self.sf = gather(sf)[keep]
        self.probs = gather(probs)[keep][:, lo:hi]
        self.local_map = g_map[keep][:, lo:hi]
        rows, prows, srows, per_expert = [], [], [], []
        for j in range(L):
            sel = self.local_map[:, j]
            n = int(sel.sum())
            padded = -(-n // PAD) * PAD
            per_expert.append(padded)
            for src, dst in ((self.tokens, rows), (self.probs[:, j], prows), (self.sf, srows)):
                block = src[sel]
                dst.append(torch.cat([block, torch.zeros((padded - n,) + tuple(block.shape[1:]),
                                                         dtype=block.dtype)]))
        self.p_tokens, self.p_probs, self.p_sf = torch.cat(rows), torch.cat(prows), torch.cat(srows)
        self.tokens_per_expert = torch.tensor(per_expert, dtype=torch.int32)


def check_row_id_map(row_id_map, local_map, permuted, received, rank):
    """row_id_map[i, j] - 1 is the permuted row of received token i for local expert j (0: not routed)."""
    n = received.shape[0]
    assert row_id_map.dtype == torch.int32 and row_id_map.shape == local_map.shape
    assert torch.equal(row_id_map[:n] > 0, local_map[:n]) and not row_id_map[n:].any()
    i, j = local_map[:n].nonzero(as_tuple=True)
    rows = row_id_map[i, j].long() - 1
    assert rows.unique().numel() == rows.numel(), "row_id_map repeats a row (rank %d)" % rank
    same(permuted[rows], received[i], "rows through row_id_map", rank)


def expect_combined(combined, hidden, routing_map, rank):
    """Every selected expert sent the token back unchanged: the sum is hidden * (experts selected)."""
    want = hidden.float() * routing_map.sum(dim=1, keepdim=True).float()
    assert combined.shape == hidden.shape and combined.dtype == torch.bfloat16
    assert torch.allclose(combined.float(), want, rtol=1e-2, atol=1e-2), "combined (rank %d)" % rank


def _buffer(dist, **kw):
    comm = epx.Comm.from_torch(dist.group.WORLD, backend="host")
    return HybridEPBuffer(dist.group.WORLD, hidden_dim=H, max_num_of_tokens_per_rank=T_MAX,
                          num_local_experts=L, max_pad_multiple=PAD, comm=comm, **kw)


def _tokens(rank, ragged):
    return (0, 7, 13)[rank % 3] if ragged else 16


def _dispatch_combine(rank, nranks, dist, ragged):
    buf = _buffer(dist)
    E = buf.num_of_experts
    assert (buf.num_of_hybrid_ep_ranks_per_nvlink_domain * buf.num_of_nodes, buf.local_rank) == \
        (nranks, rank % buf.num_of_hybrid_ep_ranks_per_nvlink_domain)
    hidden, sf, idx, w, rmap, probs = inputs(rank, _tokens(rank, ragged), E)
    ref = Ref(dist, rank, nranks, hidden, sf, rmap, probs)
    lo = buf.local_rank * L
    for by_topk in (True, False):
        for with_probs in (True, False):
            route = dict(topk_idx=idx, topk_weights=w if with_probs else None, num_of_experts=E) if by_topk \
                else dict(routing_map=rmap, probs=probs if with_probs else None)
            tokens, d_probs, d_sf, handle = buf.dispatch(hidden=hidden, scaling_factor=sf, **route)
            same(tokens, ref.tokens, "dispatched tokens", rank)
            assert d_sf is None and len(handle) == 7
            assert int(handle[3].cpu().item()) == ref.tokens.shape[0]
            same(handle[4], ref.local_map, "local_expert_routing_map", rank)
            if with_probs:
                assert d_probs.shape == (tokens.shape[0], L * buf.num_of_hybrid_ep_ranks_per_nvlink_domain)
                same(d_probs[:, lo:lo + L].contiguous(), ref.probs, "dispatched probs", rank)
                assert not d_probs[:, :lo].any() and not d_probs[:, lo + L:].any()
            else:
                assert d_probs is None
            copies = handle[4].sum(dim=1, keepdim=True)
            y = (tokens.float() * copies).to(torch.bfloat16)
            combined, c_probs = buf.combine(y, d_probs, handle)
            expect_combined(combined, hidden, rmap, rank)
            if with_probs:
                same(c_probs, probs, "combined probs", rank)
            else:
                assert c_probs is None
    # A bound: the rows are the bound's, the real count is in handle[3]; a combine takes those rows.
    bound = nranks * T_MAX
    tokens, _, _, handle = buf.dispatch(hidden, sf, routing_map=rmap, probs=probs,
                                        num_dispatched_tokens=bound)
    n = ref.tokens.shape[0]
    assert tokens.shape[0] == bound and int(handle[3].item()) == n
    same(tokens[:n].contiguous(), ref.tokens, "bounded tokens", rank)
    y = tokens.clone()
    assert handle[4].shape == (nranks * buf.max_num_of_tokens_per_rank, L) and not handle[4][n:].any()
    same(handle[4][:n], ref.local_map, "bounded local_expert_routing_map", rank)
    y[:n] = (tokens[:n].float() * handle[4][:n].sum(dim=1, keepdim=True)).to(torch.bfloat16)
    combined, _ = buf.combine(y, handle=handle)
    expect_combined(combined, hidden, rmap, rank)
    # A dispatch with the handle repeats the routing it was made with.
    again, _, _, _ = buf.dispatch(hidden, handle=handle, num_dispatched_tokens=bound)
    same(again, tokens, "dispatch with a handle", rank)
    # A bound past the buffer's R * T_max rows: the same rows, zeros after; the combine takes them all.
    big = nranks * buf.max_num_of_tokens_per_rank + 3
    tokens, d_probs, _, handle = buf.dispatch(hidden, sf, routing_map=rmap, probs=probs,
                                              num_dispatched_tokens=big)
    assert tokens.shape[0] == big and d_probs.shape[0] == big and not tokens[n:].any()
    same(tokens[:n].contiguous(), ref.tokens, "tokens past the cap", rank)
    y = torch.zeros_like(tokens)
    y[:n] = (tokens[:n].float() * handle[4][:n].sum(dim=1, keepdim=True)).to(torch.bfloat16)
    combined, _ = buf.combine(y, handle=handle)
    expect_combined(combined, hidden, rmap, rank)
    return True


@pytest.mark.parametrize("nranks,ragged", [(2, False), (3, False), (3, True)])
def test_dispatch_combine(nranks, ragged):
    assert run_in_group(nranks, _dispatch_combine, ragged=ragged) == [True] * nranks


def strided(t):
    """t's values in a tensor that is not contiguous (every other column of a wider one)."""
    wide = torch.zeros((t.shape[0], 2 * t.shape[1]), dtype=t.dtype)
    wide[:, ::2] = t
    out = wide[:, ::2]
    assert not out.is_contiguous() or t.shape[0] <= 1
    return out


def _strided(rank, nranks, dist):
    """Inputs of any strides, as HybridEP takes them (autograd hands the backward calls such gradients):
    the same results as contiguous ones, in every call."""
    buf = _buffer(dist)
    E = buf.num_of_experts
    hidden, sf, idx, w, rmap, probs = inputs(rank, 16, E)
    want, want_probs, _, handle = buf.dispatch(hidden=hidden, routing_map=rmap, probs=probs)
    got, got_probs, _, _ = buf.dispatch(hidden=strided(hidden), routing_map=strided(rmap), probs=strided(probs))
    same(got, want, "tokens from strided inputs", rank)
    same(got_probs, want_probs, "probs from strided inputs", rank)
    y = (want.float() * handle[4].sum(dim=1, keepdim=True)).to(torch.bfloat16)
    combined, c_probs = buf.combine(strided(y), strided(want_probs), handle)
    expect_combined(combined, hidden, rmap, rank)
    same(c_probs, probs, "combined probs from strided inputs", rank)
    p_want, pp_want, _, _, p_handle = buf.dispatch_with_permute(hidden=hidden, routing_map=rmap, probs=probs,
                                                                  pad_multiple=PAD)
    p_got, pp_got, _, _, _ = buf.dispatch_with_permute(hidden=strided(hidden), routing_map=strided(rmap),
                                                       probs=strided(probs), pad_multiple=PAD)
    same(p_got, p_want, "permuted tokens from strided inputs", rank)
    same(pp_got, pp_want, "permuted probs from strided inputs", rank)
    # A gradient expanded from one row (stride 0), as autograd may hand one.
    grad = p_want[:1].expand(p_want.shape[0], -1)
    c_want, _ = buf.combine_with_unpermute(hidden=grad.contiguous(), handle=p_handle, pad_multiple=PAD)
    c_got, _ = buf.combine_with_unpermute(hidden=grad, handle=p_handle, pad_multiple=PAD)
    same(c_got, c_want, "unpermuted combine of an expanded gradient", rank)
    return True


def test_strided_inputs():
    assert run_in_group(2, _strided) == [True] * 2


def _permute(rank, nranks, dist, ragged):
    buf = _buffer(dist)
    E = buf.num_of_experts
    hidden, sf, idx, w, rmap, probs = inputs(rank, _tokens(rank, ragged), E)
    ref = Ref(dist, rank, nranks, hidden, sf, rmap, probs)
    for by_topk in (True, False):
        for with_probs in (True, False):
            route = dict(topk_idx=idx, topk_weights=w if with_probs else None, num_of_experts=E) if by_topk \
                else dict(routing_map=rmap, probs=probs if with_probs else None)
            tokens, p_probs, p_sf, per_expert, handle = buf.dispatch_with_permute(
                hidden=hidden, scaling_factor=sf, pad_multiple=PAD, num_of_experts_per_rank=L, **route)
            same(tokens, ref.p_tokens, "permuted tokens", rank)
            same(per_expert, ref.tokens_per_expert, "tokens_per_expert", rank)
            assert p_sf is None
            # HybridEP's tests unpack the 9 elements and read [3] and [4]; [5] is the row id map.
            _, _, _, num_dispatched, local_map, row_id_map, _, _, _ = handle
            assert int(num_dispatched.item()) == ref.tokens.shape[0]
            same(local_map, ref.local_map, "local_expert_routing_map", rank)
            check_row_id_map(row_id_map, local_map, tokens, ref.tokens, rank)
            if with_probs:
                same(p_probs, ref.p_probs, "permuted probs", rank)
            else:
                assert p_probs is None
            combined, c_probs = buf.combine_with_unpermute(hidden=tokens, probs=p_probs, handle=handle,
                                                           pad_multiple=PAD)
            expect_combined(combined, hidden, rmap, rank)
            if with_probs:
                same(c_probs, probs, "combined probs", rank)
            # Replay with the handle and the real count as the bound (HybridEP's backward pattern).
            replay, r_probs, _, _, _ = buf.dispatch_with_permute(
                hidden=hidden, scaling_factor=sf, handle=handle, pad_multiple=PAD,
                num_permuted_tokens=int(per_expert.sum()), **({"probs": probs} if with_probs else {}))
            same(replay, tokens, "replayed tokens", rank)
            if with_probs:
                same(r_probs, p_probs, "replayed probs", rank)
    # non_blocking with a worst-case bound: the real rows first, zeros after; the combine takes them all.
    bound = nranks * T_MAX * TOPK
    tokens, p_probs, _, per_expert, handle = buf.dispatch_with_permute(
        hidden=hidden, routing_map=rmap, probs=probs, pad_multiple=PAD, num_permuted_tokens=bound,
        non_blocking=True)
    P = ref.p_tokens.shape[0]
    assert tokens.shape[0] == bound and not tokens[P:].any() and not p_probs[P:].any()
    same(tokens[:P].contiguous(), ref.p_tokens, "bounded permuted tokens", rank)
    same(handle[4][:ref.tokens.shape[0]], ref.local_map, "bounded local_expert_routing_map", rank)
    check_row_id_map(handle[5], handle[4], tokens, ref.tokens, rank)
    combined, c_probs = buf.combine_with_unpermute(hidden=tokens, probs=p_probs, handle=handle,
                                                   pad_multiple=PAD)
    expect_combined(combined, hidden, rmap, rank)
    same(c_probs, probs, "bounded combined probs", rank)
    with pytest.raises(ValueError, match="num_permuted_tokens"):
        buf.dispatch_with_permute(hidden=hidden, routing_map=rmap, non_blocking=True)
    # A bound past what the buffer can ever produce (HybridEP sizes its output to any bound, e.g. T * R *
    # TOPK with few local experts): the same rows, zeros after, and the combine takes them all.
    cap = nranks * buf.max_num_of_tokens_per_rank * min(buf.num_topk, L) + L * (PAD - 1)
    big = cap + 5
    tokens, p_probs, _, per_expert, handle = buf.dispatch_with_permute(
        hidden=hidden, routing_map=rmap, probs=probs, pad_multiple=PAD, num_permuted_tokens=big,
        non_blocking=True, use_fp8=False)
    assert tokens.shape[0] == big and p_probs.shape[0] == big
    assert not tokens[P:].any() and not p_probs[P:].any()
    same(tokens[:P].contiguous(), ref.p_tokens, "permuted tokens past the cap", rank)
    assert int(handle[-1].item()) == 0
    combined, c_probs = buf.combine_with_unpermute(hidden=tokens, probs=p_probs, handle=handle,
                                                   pad_multiple=PAD)
    expect_combined(combined, hidden, rmap, rank)
    same(c_probs, probs, "combined probs past the cap", rank)
    combined, _ = buf.combine_with_unpermute(hidden=tokens, probs=p_probs, handle=handle,
                                             apply_probs_to_hidden=True)
    assert combined.shape == hidden.shape
    return True


@pytest.mark.parametrize("nranks,ragged", [(2, False), (3, True)])
def test_dispatch_with_permute(nranks, ragged):
    assert run_in_group(nranks, _permute, ragged=ragged) == [True] * nranks


def test_indices_to_map():
    """HybridEP's helper: -1 (and other ids outside [0, E)) select nothing; a repeated id's weights add."""
    idx = torch.tensor([[0, 3, -1], [2, 2, 5], [-1, -1, -1]])
    w = torch.tensor([[0.5, 0.25, 9.0], [1.0, 2.0, 0.125], [7.0, 7.0, 7.0]])
    rmap, probs = indices_to_map(idx, w, 3, 4)
    assert rmap.dtype == torch.bool and probs.dtype == torch.float32
    assert rmap.tolist() == [[True, False, False, True], [False, False, True, False], [False] * 4]
    assert probs.tolist() == [[0.5, 0, 0, 0.25], [0, 0, 3.0, 0], [0, 0, 0, 0]]
    assert indices_to_map(idx, None, 3, 4)[1] is None
    with pytest.raises(ValueError, match="topk_weights"):
        indices_to_map(idx, w[:, :2], 3, 4)


def test_internode_group_refused():
    """A group over several machines (HybridEP's RDMA path) is refused when the buffer is made."""
    class TwoMachines:
        rank, nranks, local_nranks = 0, 8, 4
    with pytest.raises(NotImplementedError, match="spans 2 machines"):
        HybridEPBuffer(None, hidden_dim=H, max_num_of_tokens_per_rank=T_MAX, num_local_experts=L,
                       comm=TwoMachines())


def _callers(rank, nranks, dist):
    """The call sequences of HybridEP's newer test and of Megatron-LM's fused_a2a (HybridEPDispatch /
    HybridEPCombine, forward and backward), with their keywords and unpacking."""
    import inspect

    buf = _buffer(dist)
    E = buf.num_of_experts
    hidden, sf, idx, w, rmap, probs = inputs(rank, _tokens(rank, True), E)
    ref = Ref(dist, rank, nranks, hidden, sf, rmap, probs)
    # A cached dispatch as HybridEP's benchmark makes it: topk_idx, topk_weights and the handle.
    _, d_probs, _, handle = buf.dispatch(hidden=hidden, scaling_factor=sf, topk_idx=idx, topk_weights=w,
                                         num_of_experts=E)
    again, again_probs, _, _ = buf.dispatch(hidden=hidden, scaling_factor=sf, topk_idx=idx,
                                            topk_weights=w * 2, num_of_experts=E, handle=handle)
    same(again, ref.tokens, "cached dispatch by topk_idx", rank)
    same(again_probs, d_probs * 2, "cached dispatch's new probs", rank)
    # apply_probs_to_hidden: probs that sum to 1 per token give the token back.
    norm = probs / probs.sum(dim=1, keepdim=True).clamp(min=1e-30)
    tokens, p_probs, _, _, handle = buf.dispatch_with_permute(hidden=hidden, routing_map=rmap, probs=norm,
                                                              scaling_factor=sf, pad_multiple=PAD)
    combined, c_probs = buf.combine_with_unpermute(hidden=tokens, probs=p_probs, handle=handle,
                                                   pad_multiple=PAD, apply_probs_to_hidden=True)
    assert torch.allclose(combined.float(), hidden.float(), atol=2e-5, rtol=1e-2), "weighted (rank %d)" % rank
    same(c_probs, norm, "apply_probs_to_hidden combined probs", rank)
    with pytest.raises(ValueError, match="needs probs"):
        buf.combine_with_unpermute(hidden=tokens, handle=handle, apply_probs_to_hidden=True)
    # Megatron-LM: the fused flag only where the signature has it; forward, then backward through
    # combine_with_unpermute and a dispatch_with_permute with the handle alone.
    assert "fuse_permute_dispatch" in inspect.signature(HybridEPBuffer.dispatch_with_permute).parameters
    for fused in (False, True):
        extra = {"fuse_permute_dispatch": fused} if fused else {}
        x, d_probs, d_sf, per_expert, handle = buf.dispatch_with_permute(
            hidden=hidden, routing_map=rmap, probs=probs, scaling_factor=None, num_of_experts_per_rank=L,
            pad_multiple=PAD, num_permuted_tokens=None, non_blocking=False, **extra)
        same(x, ref.p_tokens, "Megatron forward tokens", rank)
        assert d_sf is None and len(handle) == (11 if fused else 9)
        if fused:
            same(handle[7], ref.local_map.sum(dim=0, dtype=torch.int32), "handle[7] tokens per expert", rank)
            assert handle[8] == hidden.shape[0]
        else:
            assert handle[6] == hidden.shape[0]
        grad_x, grad_probs = buf.combine_with_unpermute(
            hidden=x, probs=d_probs, handle=handle, pad_multiple=PAD,
            **({"fuse_unpermute_combine": fused} if fused else {}))
        expect_combined(grad_x, hidden, rmap, rank)
        same(grad_probs, probs, "Megatron backward probs", rank)
        back, _, _, _, _ = buf.dispatch_with_permute(hidden=hidden, scaling_factor=None, handle=handle,
                                                     pad_multiple=PAD, num_permuted_tokens=None, **extra)
        same(back, ref.p_tokens, "Megatron combine backward", rank)
    # update_template_config: what the buffer holds is accepted, growth is refused by name.
    buf.update_template_config(hidden_dim=H, num_of_tokens_per_rank=T_MAX, num_local_experts=L,
                               pad_multiple=PAD, use_fp8=False, num_of_stages_dispatch_api=4)
    with pytest.raises(ValueError, match="num_of_tokens_per_rank"):
        buf.update_template_config(num_of_tokens_per_rank=buf.max_num_of_tokens_per_rank + 1)
    with pytest.raises(ValueError, match="hidden_dim"):
        buf.update_template_config(hidden_dim=H * 2)
    return True


@pytest.mark.parametrize("nranks", [2, 3])
def test_hybrid_ep_callers(nranks):
    assert run_in_group(nranks, _callers) == [True] * nranks


def _fp8(rank, nranks, dist):
    buf = _buffer(dist, use_fp8=True, num_sms_dispatch_api=None, num_sms_combine_api=None)
    E = buf.num_of_experts
    hidden, sf, idx, w, rmap, probs = inputs(rank, _tokens(rank, True), E, fp8=True)
    ref = Ref(dist, rank, nranks, hidden, sf, rmap, probs)
    tokens, d_probs, d_sf, handle = buf.dispatch(hidden=hidden, scaling_factor=sf, topk_idx=idx,
                                                 topk_weights=w, num_of_experts=E)
    same(tokens, ref.tokens, "fp8 tokens (uint8)", rank)
    same(d_sf, ref.sf, "fp8 scaling factor", rank)
    tokens, p_probs, p_sf, _, handle = buf.dispatch_with_permute(
        hidden=hidden, scaling_factor=sf, routing_map=rmap, probs=probs, pad_multiple=PAD)
    same(tokens, ref.p_tokens, "fp8 permuted tokens", rank)
    same(p_sf, ref.p_sf, "fp8 permuted scaling factor", rank)
    same(p_probs, ref.p_probs, "fp8 permuted probs", rank)
    rows = tokens.view(torch.float8_e4m3fn).float().to(torch.bfloat16)
    combined, c_probs = buf.combine_with_unpermute(hidden=rows, probs=p_probs, handle=handle,
                                                   pad_multiple=PAD)
    want = hidden.view(torch.float8_e4m3fn).float().to(torch.bfloat16)
    expect_combined(combined, want, rmap, rank)
    same(c_probs, probs, "fp8 combined probs", rank)
    return True


@pytest.mark.parametrize("nranks", [2, 3])
def test_fp8_as_uint8(nranks):
    assert run_in_group(nranks, _fp8) == [True] * nranks


def _refusals(rank, nranks, dist):
    """A rejection by the front on one rank reaches the peers as RemoteError; the next calls pair up."""
    buf = _buffer(dist)
    E = buf.num_of_experts
    hidden, sf, idx, w, rmap, probs = inputs(rank, 8, E)
    tokens, d_probs, _, handle = buf.dispatch(hidden, routing_map=rmap, probs=probs)
    bad = d_probs[:, :1] if rank == 0 else d_probs
    with pytest.raises(ValueError if rank == 0 else epx.RemoteError):
        buf.combine(tokens, bad, handle)
    with pytest.raises(ValueError if rank == nranks - 1 else epx.RemoteError):
        buf.dispatch(hidden, topk_idx=idx, num_of_experts=E + (rank == nranks - 1))
    with pytest.raises(epx.InvalidArgumentError if rank == 0 else epx.RemoteError,
                       match="float32" if rank == 0 else None):
        buf.dispatch(hidden.float() if rank == 0 else hidden, routing_map=rmap)
    with pytest.raises(ValueError, match="handle comes from dispatch"):
        buf.combine_with_unpermute(hidden=tokens, handle=handle)
    # topk_weights with a handle but no topk_idx cannot be placed (they were dropped: probs None).
    with pytest.raises(ValueError if rank == 0 else epx.RemoteError, match="needs topk_idx" if rank == 0 else None):
        buf.dispatch(hidden, topk_weights=w if rank == 0 else None, probs=None if rank == 0 else probs,
                     handle=handle)
    with pytest.raises(ValueError if rank == 0 else epx.RemoteError, match="pad_multiple" if rank == 0 else None):
        buf.dispatch_with_permute(hidden=hidden, routing_map=rmap, pad_multiple=-4 if rank == 0 else 2)
    _, c_probs = buf.combine(tokens, d_probs, handle)
    same(c_probs, probs, "combined probs after refusals", rank)
    return True


def _replay_bounds(rank, nranks, dist):
    """A handle made with a bound and replayed without one (and the reverse) gives handle[4] in the replay's
    shape, equal to a fresh dispatch's: [N_r, L] without a bound, [R * T_max, L] with one."""
    buf = _buffer(dist)
    E = buf.num_of_experts
    hidden, sf, idx, w, rmap, probs = inputs(rank, _tokens(rank, True), E)
    _, _, _, bounded = buf.dispatch(hidden, routing_map=rmap, num_dispatched_tokens=nranks * T_MAX)
    _, _, _, plain = buf.dispatch(hidden, routing_map=rmap)
    tokens, _, _, replay = buf.dispatch(hidden, handle=bounded)
    same(replay[4], plain[4], "handle[4] of a bounded handle replayed without a bound", rank)
    assert replay[4].shape[0] == tokens.shape[0]
    _, _, _, replay_b = buf.dispatch(hidden, handle=plain, num_dispatched_tokens=nranks * T_MAX)
    same(replay_b[4], bounded[4], "handle[4] of a plain handle replayed with a bound", rank)
    return True


@pytest.mark.parametrize("nranks", [2, 3])
def test_replay_across_bounds(nranks):
    assert run_in_group(nranks, _replay_bounds) == [True] * nranks


def _tiny_hidden(rank, nranks, dist):
    """Combined probs travel as bytes in bf16 channels: a hidden size below 4 still carries them."""
    comm = epx.Comm.from_torch(dist.group.WORLD, backend="host")
    buf = HybridEPBuffer(dist.group.WORLD, hidden_dim=2, max_num_of_tokens_per_rank=T_MAX, num_local_experts=L,
                         max_pad_multiple=PAD, comm=comm)
    E = buf.num_of_experts
    _, _, _, _, rmap, probs = inputs(rank, 5, E)
    hidden = torch.randn((5, 2)).to(torch.bfloat16)
    tokens, d_probs, _, handle = buf.dispatch(hidden, routing_map=rmap, probs=probs)
    _, c_probs = buf.combine(tokens, d_probs, handle)
    same(c_probs, probs, "combined probs at hidden 2", rank)
    return True


def test_tiny_hidden_probs():
    assert run_in_group(2, _tiny_hidden) == [True] * 2


@pytest.mark.parametrize("nranks", [2, 3])
def test_refusals_reach_peers(nranks):
    assert run_in_group(nranks, _refusals) == [True] * nranks


def _token_drop(rank, nranks, dist):
    """HybridEP's token-drop pattern: a bound below the real permuted rows drops the tail; the permute
    handles' last element is the overflow flag (1 then, 0 with room), and combine_with_unpermute takes
    non_blocking=True."""
    buf = _buffer(dist)
    E = buf.num_of_experts
    hidden, sf, idx, w, rmap, probs = inputs(rank, 16, E)
    _, _, _, per_expert, _ = buf.dispatch_with_permute(hidden=hidden, routing_map=rmap, probs=probs,
                                                       pad_multiple=PAD)
    real = int(per_expert.sum())
    for fused in (False, True):
        for bound, dropped in ((real // 2, real // 2 < real), (real, False), (real + 64, False)):
            tokens, p_probs, _, _, handle = buf.dispatch_with_permute(
                hidden=hidden, routing_map=rmap, probs=probs, pad_multiple=PAD, num_permuted_tokens=bound,
                non_blocking=True, fuse_permute_dispatch=fused)
            assert len(handle) == (11 if fused else 9)
            flag = handle[-1]
            assert flag.dtype == torch.int32 and flag.shape == (1,)
            assert int(flag.item()) == int(dropped), "overflow flag %s at bound %d of %d rows (rank %d)" % (
                flag.tolist(), bound, real, rank)
            assert buf.buffer.query_overflow() == dropped
            combined, c_probs = buf.combine_with_unpermute(hidden=tokens, probs=p_probs, handle=handle,
                                                           pad_multiple=PAD, non_blocking=True)
            assert combined.shape == hidden.shape and c_probs.shape == probs.shape
            if not dropped:
                expect_combined(combined, hidden, rmap, rank)
                same(c_probs, probs, "combined probs with room", rank)
    # Without a bound nothing can be dropped.
    _, _, _, _, handle = buf.dispatch_with_permute(hidden=hidden, routing_map=rmap, pad_multiple=PAD)
    assert int(handle[-1].item()) == 0
    return True


@pytest.mark.parametrize("nranks", [2, 3])
def test_token_drop_overflow_flag(nranks):
    assert run_in_group(nranks, _token_drop) == [True] * nranks


def _sizes_and_names(rank, nranks, dist):
    """Tokens per rank round up to a multiple of 16 (HybridEP's template rounding), so a rank at the
    rounded count fits; a routing map past K names num_topk; DeepEP's package name serves HybridEPBuffer."""
    import epx.compat.deep_ep as deep_ep

    assert deep_ep.HybridEPBuffer is HybridEPBuffer and deep_ep.indices_to_map is indices_to_map
    comm = epx.Comm.from_torch(dist.group.WORLD, backend="host")
    buf = HybridEPBuffer(dist.group.WORLD, hidden_dim=H, max_num_of_tokens_per_rank=600, num_local_experts=L,
                         max_pad_multiple=PAD, comm=comm, num_topk=2)
    assert buf.max_num_of_tokens_per_rank == 608
    E = buf.num_of_experts
    hidden = torch.randn((608, H)).to(torch.bfloat16)
    rmap = torch.zeros((608, E), dtype=torch.bool)
    rmap[:, 0] = True
    tokens, _, _, _ = buf.dispatch(hidden, routing_map=rmap)
    assert tokens.shape[0] == (608 * nranks if rank == 0 else 0)
    rmap[0, :3] = True  # three experts where K = 2
    with pytest.raises(epx.InvalidArgumentError, match="num_topk="):
        buf.dispatch(hidden, routing_map=rmap)
    return True


def _older_names(rank, nranks, dist):
    """Earlier releases' keywords: the domain size under its older names, num_of_experts for the experts,
    num_sms_permute_api; update_template_config's max_num_of_tokens_per_rank; use_fp8 with float8 rows."""
    comm = epx.Comm.from_torch(dist.group.WORLD, backend="host")
    buf = HybridEPBuffer(dist.group.WORLD, hidden_dim=H, max_num_of_tokens_per_rank=T_MAX,
                         num_of_experts=L * nranks, max_pad_multiple=PAD, comm=comm, nvlink_domain_size=nranks,
                         num_sms_permute_api=4, use_fp8=True)
    assert buf.num_local_experts == L and buf.num_of_hybrid_ep_ranks_per_nvlink_domain == nranks
    buf.update_template_config(max_num_of_tokens_per_rank=buf.max_num_of_tokens_per_rank)
    with pytest.raises(ValueError, match="num_of_tokens_per_rank"):
        buf.update_template_config(max_num_of_tokens_per_rank=buf.max_num_of_tokens_per_rank + 1)
    with pytest.raises(ValueError, match="num_of_experts"):
        HybridEPBuffer(dist.group.WORLD, hidden_dim=H, max_num_of_tokens_per_rank=T_MAX, num_local_experts=L,
                       num_of_experts=L * nranks + 1, comm=comm)
    hidden, sf, _, _, rmap, _ = inputs(rank, 8, buf.num_of_experts, fp8=True)
    tokens, _, scales, _, handle = buf.dispatch_with_permute(
        hidden=hidden.view(torch.float8_e4m3fn), scaling_factor=sf, routing_map=rmap, pad_multiple=PAD,
        use_fp8=True)
    assert tokens.dtype == torch.float8_e4m3fn and scales is not None
    return True


def test_older_keywords():
    assert run_in_group(2, _older_names) == [True] * 2


def test_token_rounding_and_topk_message():
    assert run_in_group(2, _sizes_and_names) == [True] * 2
