"""Error paths: each raises the EpxError subclass of the library's result, carrying the library's
message (or, for what only the binding can see, a message naming the argument)."""

import os
import tempfile
import time

import numpy as np
import pytest

import epx
from mp import host_comm, run_ranks
from npref import bf16


def one_rank(**buffer_kw):
    comm = epx.Comm.from_unique_id(epx.get_unique_id(), 0, 1, backend="host")
    args = dict(max_tokens=4, hidden=128, num_topk=2, num_experts=4)
    args.update(buffer_kw)
    return comm, epx.Buffer(comm, **args)


def inputs(T=4, H=128):
    x = bf16(np.ones((T, H), dtype=np.float32))
    idx = np.array([[0, 1], [1, 2], [2, 3], [3, -1]], dtype=np.int64)[:T]
    return x, idx


def check(exc_info, cls, result, *fragments):
    err = exc_info.value
    assert isinstance(err, cls) and isinstance(err, epx.EpxError)
    assert err.result == result and err.code == getattr(type(err), "code", err.code)
    for f in fragments:
        assert f in err.message, "%r not in %r" % (f, err.message)
    assert err.message in str(err) and result in str(err)


def test_expert_out_of_range():
    _, buf = one_rank()
    x, idx = inputs()
    idx[1, 1] = 300
    with pytest.raises(epx.InvalidArgumentError) as e:
        buf.dispatch(x, idx)
    check(e, epx.InvalidArgumentError, "ERR_INVALID_ARG", "topk_idx[1][1] = 300", "out of range")
    with pytest.raises(epx.InvalidArgumentError) as e:
        buf.ll_dispatch(x, idx)
    check(e, epx.InvalidArgumentError, "ERR_INVALID_ARG", "300")
    with pytest.raises(epx.InvalidArgumentError) as e:
        buf.get_dispatch_layout(idx)
    check(e, epx.InvalidArgumentError, "ERR_INVALID_ARG", "300")


def test_repeated_expert_and_too_many_tokens():
    _, buf = one_rank()
    x, idx = inputs()
    idx[0] = [2, 2]
    with pytest.raises(epx.InvalidArgumentError) as e:
        buf.dispatch(x, idx)
    check(e, epx.InvalidArgumentError, "ERR_INVALID_ARG", "topk_idx[0]")
    big_x = bf16(np.ones((5, 128), dtype=np.float32))
    big_idx = np.zeros((5, 2), dtype=np.int64) - 1
    with pytest.raises(epx.InvalidArgumentError) as e:
        buf.dispatch(big_x, big_idx)
    check(e, epx.InvalidArgumentError, "ERR_INVALID_ARG", "5")


def test_non_contiguous_and_bad_dtype():
    _, buf = one_rank()
    x, idx = inputs()
    wide = bf16(np.ones((4, 256), dtype=np.float32))
    with pytest.raises(epx.InvalidArgumentError) as e:
        buf.dispatch(wide[:, ::2], idx)
    check(e, epx.InvalidArgumentError, "ERR_INVALID_ARG", "x is not contiguous")
    with pytest.raises(epx.InvalidArgumentError) as e:
        buf.dispatch(x.astype(np.float64), idx)
    check(e, epx.InvalidArgumentError, "ERR_INVALID_ARG", "x has DLPack dtype")
    with pytest.raises(epx.InvalidArgumentError) as e:
        buf.dispatch(x, idx.astype(np.float32))
    check(e, epx.InvalidArgumentError, "ERR_INVALID_ARG", "topk_idx")
    with pytest.raises(TypeError, match="DLPack"):
        buf.dispatch([[1, 2]], idx)


def test_shape_mismatch():
    _, buf = one_rank()
    x, idx = inputs()
    with pytest.raises(epx.InvalidArgumentError) as e:
        buf.dispatch(bf16(np.ones((4, 64), dtype=np.float32)), idx)
    check(e, epx.InvalidArgumentError, "ERR_INVALID_ARG", "x.shape[1] = 64")


def test_mode_not_enabled():
    _, buf = one_rank(modes="ll")
    x, idx = inputs()
    with pytest.raises(epx.InvalidArgumentError) as e:
        buf.dispatch(x, idx)
    check(e, epx.InvalidArgumentError, "ERR_INVALID_ARG")
    with pytest.raises(ValueError, match="mode 'bogus'"):
        one_rank(modes=["ht", "bogus"])


def test_bad_buffer_config():
    comm = epx.Comm.from_unique_id(epx.get_unique_id(), 0, 1, backend="host")
    with pytest.raises(epx.InvalidArgumentError) as e:
        epx.Buffer(comm, 4, 100, 2, 4, dispatch_dtypes="fp8")
    check(e, epx.InvalidArgumentError, "ERR_INVALID_ARG", "128")
    with pytest.raises(epx.InvalidArgumentError) as e:
        epx.Buffer(comm, 0, 128, 2, 4)
    check(e, epx.InvalidArgumentError, "ERR_INVALID_ARG", "max_tokens")


def test_bad_comm_args():
    with pytest.raises(epx.InvalidArgumentError) as e:
        epx.Comm.from_unique_id(epx.get_unique_id(), 3, 2, backend="host")
    check(e, epx.InvalidArgumentError, "ERR_INVALID_ARG", "rank")
    with pytest.raises(ValueError, match="128"):
        epx.Comm.from_unique_id(b"short", 0, 1)
    with pytest.raises(ValueError, match="backend"):
        epx.Comm.from_unique_id(epx.get_unique_id(), 0, 1, backend="tpu")


@pytest.mark.skipif(epx.build_info()["cuda"], reason="the linked library has its cuda backend")
def test_cuda_backend_unavailable():
    with pytest.raises(epx.UnsupportedError) as e:
        epx.Comm.from_unique_id(epx.get_unique_id(), 0, 1, backend="cuda")
    check(e, epx.UnsupportedError, "ERR_UNSUPPORTED", "cuda")


def test_ll_stale_handle_and_hook_twice():
    _, buf = one_rank()
    x, idx = inputs()
    w = np.ones(idx.shape, dtype=np.float32)
    first = buf.ll_dispatch(x, idx)
    buf.ll_dispatch(x, idx)
    buf.ll_dispatch(x, idx)  # reuses the first one's slot
    with pytest.raises(epx.InvalidArgumentError) as e:
        buf.ll_combine(first.recv_x, idx, w, first.handle)
    check(e, epx.InvalidArgumentError, "ERR_INVALID_ARG")
    out = buf.ll_dispatch(x, idx, return_recv_hook=True)
    out.hook()
    with pytest.raises(epx.InvalidArgumentError) as e:
        out.hook()
    check(e, epx.InvalidArgumentError, "ERR_INVALID_ARG")


def test_wrong_handle_kind():
    _, buf = one_rank()
    x, idx = inputs()
    ht = buf.dispatch(x, idx)
    with pytest.raises(TypeError, match="routing-map"):
        buf.rm_combine(ht.recv_x, ht.handle)


def test_callback_exception_is_the_cause():
    def allgather(data):
        raise RuntimeError("no network today")

    with pytest.raises(epx.BootstrapError) as e:
        epx.Comm.from_callbacks(allgather, lambda: None, 0, 1, backend="host")
    assert isinstance(e.value.__cause__, RuntimeError) and "no network today" in str(e.value.__cause__)
    assert e.value.result == "ERR_BOOTSTRAP"


def test_callbacks_one_rank():
    comm = epx.Comm.from_callbacks(lambda d: d, lambda: None, 0, 1, backend="host")
    assert (comm.rank, comm.nranks) == (0, 1)
    buf = epx.Buffer(comm, 4, 128, 2, 4)
    x, idx = inputs()
    assert buf.dispatch(x, idx).num_recv_tokens == 4


# ------------------------------------------------------------------------------------ across ranks


def _mismatch(rank, nranks, uid):
    comm = host_comm(rank, nranks, uid)
    try:
        epx.Buffer(comm, 4, 128 * (rank + 1), 2, 4)
    except epx.MismatchError as err:
        return err.result, "hidden" in err.message
    return None


def test_mismatch_on_every_rank():
    assert run_ranks(2, _mismatch) == [("ERR_MISMATCH", True)] * 2


def _remote(rank, nranks, uid):
    comm = host_comm(rank, nranks, uid)
    buf = epx.Buffer(comm, 4, 128, 2, 4)
    x, idx = inputs()
    if rank == 1:
        idx[0, 0] = 99
    try:
        buf.dispatch(x, idx)
    except epx.EpxError as err:
        return err.result, err.message
    return None


def test_remote_failure():
    (r0, m0), (r1, m1) = run_ranks(2, _remote)
    assert r1 == "ERR_INVALID_ARG" and "99" in m1
    assert r0 == "ERR_REMOTE" and "1" in m0


def _timeout(rank, nranks, uid):
    comm = host_comm(rank, nranks, uid, timeout_ms=300)
    buf = epx.Buffer(comm, 4, 128, 2, 4)
    x, idx = inputs()
    if rank == 1:
        time.sleep(1.5)  # never joins the dispatch
        return None
    start = time.monotonic()
    try:
        buf.dispatch(x, idx)
    except epx.EpxTimeoutError as err:
        return err.result, time.monotonic() - start < 1.4, isinstance(err, TimeoutError)
    return None


def test_timeout():
    assert run_ranks(2, _timeout)[0] == ("ERR_TIMEOUT", True, True)


def _file_collectives(directory, rank, nranks):
    """allgather/barrier through files in a shared directory (a stand-in for MPI or torch)."""
    state = {"round": 0}

    def allgather(data):
        n = state["round"]
        state["round"] += 1
        path = os.path.join(directory, "%d.%d" % (n, rank))
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.rename(path + ".tmp", path)
        deadline = time.monotonic() + 30
        parts = []
        for r in range(nranks):
            p = os.path.join(directory, "%d.%d" % (n, r))
            while not os.path.exists(p):
                if time.monotonic() > deadline:
                    raise TimeoutError("rank %d missing in round %d" % (r, n))
                time.sleep(0.001)
            with open(p, "rb") as f:
                parts.append(f.read())
        return b"".join(parts)

    return allgather, lambda: allgather(b"")


def _callbacks(rank, nranks, uid, directory):
    allgather, barrier = _file_collectives(directory, rank, nranks)
    comm = epx.Comm.from_callbacks(allgather, barrier, rank, nranks, backend="host")
    buf = epx.Buffer(comm, 4, 128, 2, 4 * nranks)
    x, idx = inputs()
    out = buf.dispatch(x, idx)
    return comm.rank, comm.nranks, out.num_recv_tokens


@pytest.mark.parametrize("nranks", [2, 4])
def test_callbacks_bootstrap(nranks):
    with tempfile.TemporaryDirectory() as d:
        got = run_ranks(nranks, _callbacks, directory=d)
    # Experts 0..3 all live on rank 0, which receives every rank's 4 tokens.
    assert got == [(r, nranks, 4 * nranks if r == 0 else 0) for r in range(nranks)]


def test_sizes_refused_before_allocation():
    # Sizes past what the buffer can hold are refused by the library by name, not by an allocation of
    # their size first (a layout of 2**40 rows asked for a 1 TiB output; a bound of 2**62 overflowed
    # torch's size check); bit sets past 32 bits are refused, not wrapped into other bits.
    comm = host_comm(0, 1, epx.get_unique_id())
    buf = epx.Buffer(comm, 8, 128, 2, 4)
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.int32), shape=(2**40, 2), strides=(0, 0))
    with pytest.raises(epx.InvalidArgumentError, match="more than the buffer's max_tokens"):
        buf.get_dispatch_layout(huge)
    x, rmap = np.zeros((2, 128), np.uint16), np.zeros((2, 4), bool)
    with pytest.raises(epx.InvalidArgumentError, match="num_dispatched_tokens"):
        buf.rm_dispatch(x, rmap, num_dispatched_tokens=2**62)
    with pytest.raises(epx.InvalidArgumentError, match="num_permuted_tokens"):
        buf.rm_dispatch(x, rmap, permute=True, num_permuted_tokens=2**62)
    assert buf.rm_dispatch(x, rmap, num_dispatched_tokens=3).tokens.shape == (3, 128)
    for bits in ({"modes": 2**32 + 2}, {"dispatch_dtypes": 2**40}):
        with pytest.raises(epx.InvalidArgumentError, match="bit sets"):
            epx.Buffer(comm, 8, 128, 2, 4, **bits)
    buf.destroy()
    comm.destroy()
