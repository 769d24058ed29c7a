"""How the binding reads torch tensors: a plain torch.Tensor is described from its own attributes (data
pointer, shape, strides, dtype) instead of a DLPack round trip; anything else takes the DLPack path. Both
must give the same results and the same refusals. One rank on the host backend, CPU tensors."""

import pytest

torch = pytest.importorskip("torch")

import epx  # noqa: E402

T, H, K, E = 8, 256, 4, 8


@pytest.fixture(scope="module")
def buf():
    comm = epx.Comm.from_unique_id(epx.get_unique_id(), 0, 1, backend="host")
    b = epx.Buffer(comm, 2 * T, H, K, E, modes="ht", dispatch_dtypes=["bf16", "fp8"])
    yield b
    b.destroy()
    comm.destroy()


def inputs(seed=0, rows=T):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, H, generator=g).to(torch.bfloat16)
    idx = torch.rand(rows, E, generator=g).topk(K, dim=1).indices
    w = torch.rand(rows, K, generator=g)
    return x, idx, w


class Wrapped(torch.Tensor):
    """A tensor subclass: not a plain torch.Tensor, so the binding goes through DLPack."""


def dispatched(buf, x, idx, w):
    out = buf.dispatch(x, idx, w)
    return out.recv_x.clone(), out.recv_topk_idx.clone(), out.recv_topk_weights.clone()


def test_plain_and_dlpack_paths_agree(buf):
    x, idx, w = inputs()
    plain = dispatched(buf, x, idx, w)
    sub = dispatched(buf, x.as_subclass(Wrapped), idx.as_subclass(Wrapped), w.as_subclass(Wrapped))
    for a, b in zip(plain, sub):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
    # One rank: every token comes back to itself, in order.
    assert torch.equal(plain[0].view(torch.int16), x.view(torch.int16))
    assert torch.equal(plain[1], idx)


def test_storage_offset_is_read(buf):
    # A contiguous slice that starts inside its storage: its data pointer, not the storage's, is read.
    big_x, big_idx, big_w = inputs(seed=1, rows=2 * T)
    x, idx, w = big_x[T:], big_idx[T:], big_w[T:]
    assert x.storage_offset() > 0
    got = dispatched(buf, x, idx, w)
    want = dispatched(buf, x.clone(), idx.clone(), w.clone())
    assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
    assert torch.equal(got[0].view(torch.int16), x.view(torch.int16))
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_fp8_input(buf):
    x, idx, _ = inputs(seed=2)
    v = x.float().view(T, H // 128, 128)
    scales = v.abs().amax(dim=2).clamp(min=1e-4) / 448.0
    x8 = (v / scales.unsqueeze(2)).view(T, H).to(torch.float8_e4m3fn)
    out = buf.dispatch(x8, idx, x_scales=scales)
    assert out.recv_x.dtype == torch.float8_e4m3fn
    assert torch.equal(out.recv_x.view(torch.uint8), x8.view(torch.uint8))
    assert torch.equal(out.recv_x_scales, scales)


def test_refusals_stay(buf):
    x, idx, w = inputs(seed=3)
    before = buf.dispatch(x, idx, w).recv_x.clone()
    # Non-contiguous x keeps its strides, which the library refuses by name.
    wide = torch.zeros(T, 2 * H, dtype=torch.bfloat16)
    with pytest.raises(epx.InvalidArgumentError, match="x"):
        buf.dispatch(wide[:, ::2], idx, w)
    # A dtype epx has none of.
    with pytest.raises(epx.InvalidArgumentError):
        buf.dispatch(x.to(torch.float16), idx, w)
    # A tensor that requires grad is read through its detached view (test_torch_cpu: its results); this
    # one is still refused, for its dtype, by name.
    with pytest.raises(epx.InvalidArgumentError, match="x has dtype fp32"):
        buf.dispatch(x.float().requires_grad_(), idx, w)
    # Too many dimensions.
    with pytest.raises(epx.InvalidArgumentError, match="dimensions"):
        buf.dispatch(x.view(1, 1, 1, 1, 1, 1, 1, 1, 1, T, H), idx, w)
    assert torch.equal(buf.dispatch(x, idx, w).recv_x.view(torch.int16), before.view(torch.int16))


def test_outputs_are_tensors_of_their_own(buf):
    # Outputs come from a kept empty tensor's new_empty: each call's are fresh tensors of the right dtype,
    # shape and device, sharing no memory with another call's or with the kept tensor.
    x, idx, w = inputs(seed=4)
    a = buf.dispatch(x, idx, w)
    b = buf.dispatch(x, idx, w)
    for name in ("recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert",
                 "rank_prefix_matrix"):
        ta, tb = getattr(a, name), getattr(b, name)
        assert ta.device.type == "cpu" and ta.dtype == tb.dtype and ta.shape == tb.shape, name
        assert ta.numel() > 0 and ta.data_ptr() != tb.data_ptr(), name
    assert a.recv_x.dtype == torch.bfloat16 and a.recv_topk_idx.dtype == torch.int64
    assert a.recv_topk_weights.dtype == torch.float32 and a.rank_prefix_matrix.dtype == torch.int32
    a.recv_x.zero_()
    assert torch.equal(b.recv_x.view(torch.int16), x.view(torch.int16))


@pytest.mark.skipif(not hasattr(torch, "_neg_view"), reason="this torch has no negative views")
def test_negative_view_is_read_by_value(buf):
    # A negative view shares its base's bytes; its values are their negation. DLPack would export the
    # bytes; the binding reads the view's values.
    x, idx, w = inputs(seed=5)
    nx = torch._neg_view(x)
    assert nx.is_neg()
    want = buf.dispatch(-x, idx, w).recv_x.clone()
    got = buf.dispatch(nx, idx, w).recv_x.clone()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # The same through the DLPack path (a subclass), where the view is resolved before the export.
    sub = nx.as_subclass(Wrapped)
    assert sub.is_neg()
    got = buf.dispatch(sub, idx, w).recv_x
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
