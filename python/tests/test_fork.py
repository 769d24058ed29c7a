"""A process forked while epx objects are alive (multiprocessing's fork start method, a data loader's
workers): the child inherits the Python objects but not the library's threads, so dropping them there
must not touch the library (it would destroy the parent's objects, or wait forever on an inherited
lock). The parent keeps using them."""

import gc
import os
import time

import numpy as np

import epx
from mp import run_ranks
from npref import bf16


def _wait(pid, seconds):
    """The child's exit status, or None when it is still running after `seconds` (it is then killed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None


def test_forked_child_drops_objects():
    comm = epx.Comm.from_unique_id(epx.get_unique_id(), 0, 1, backend="host")
    buf = epx.Buffer(comm, 4, 128, 2, 4, views="pooled")
    x = bf16(np.ones((4, 128), dtype=np.float32))
    idx = np.array([[0, 1], [1, 2], [2, 3], [3, -1]], dtype=np.int64)
    out = buf.dispatch(x, idx)
    pid = os.fork()
    if pid == 0:  # the child: drop everything it inherited, then leave without Python's exit handlers
        code = 0
        try:
            del out
            del buf
            del comm
            gc.collect()
        except BaseException:  # noqa: BLE001 (reported through the exit code)
            code = 3
        os._exit(code)
    assert _wait(pid, 20) == 0, "the forked child did not drop the parent's epx objects cleanly"
    # The parent's objects are intact.
    again = buf.dispatch(x, idx)
    np.testing.assert_array_equal(np.asarray(again.recv_x), np.asarray(out.recv_x))
    comb = buf.combine(np.asarray(out.recv_x).copy(), out.handle)
    assert comb.combined_x.shape == (4, 128)
    del out, again, comb
    buf.destroy()
    comm.destroy()



def _child_destroys(rank, nranks, uid):
    comm = epx.Comm.from_unique_id(uid, rank, nranks, backend="host")
    buf = epx.Buffer(comm, 4, 128, 2, 2 * nranks, views=False)
    x = bf16(np.full((4, 128), rank + 1, dtype=np.float32))
    idx = np.array([[0, 1], [1, 2], [2, 3], [3, -1]], dtype=np.int64)
    out = buf.dispatch(x, idx)
    if rank == 0:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                out.handle.destroy()
                buf.destroy()
                comm.destroy()
            except BaseException:  # noqa: BLE001 (reported through the exit code)
                code = 3
            os._exit(code)
        assert _wait(pid, 20) == 0, "destroy() in the forked child failed"
    comm.barrier()
    # Both ranks' objects are intact: the peer saw no destroy.
    comb = buf.combine(out.recv_x, out.handle)
    assert comb.combined_x.shape == (4, 128)
    out.handle.destroy()
    buf.destroy()
    comm.destroy()
    return True


def test_forked_child_destroys_objects():
    """destroy() in a forked child (a `with` block around a fork ends in both processes) lets the
    child's references go and leaves the library alone: the parent and its peer go on."""
    assert run_ranks(2, _child_destroys) == [True, True]
