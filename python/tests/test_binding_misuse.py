"""The binding under hostile or careless callers: Python code that runs inside a call (an input's
__dlpack__, a numpy subclass's `base`), threads, and objects re-initialised after destroy."""

import gc
import sys
import threading
import time

import numpy as np
import pytest

import epx
from mp import run_ranks
from npref import bf16


def _host_buffer(views):
    comm = epx.Comm.from_unique_id(epx.get_unique_id(), 0, 1, backend="host")
    return comm, epx.Buffer(comm, 4, 128, 2, 4, views=views)


def _inputs():
    x = bf16(np.ones((4, 128), dtype=np.float32))
    idx = np.array([[0, 1], [1, 2], [2, 3], [3, -1]], dtype=np.int64)
    return x, idx


class CallsBack:
    """An input whose export runs `cb` first (any Python may run while the binding imports inputs)."""

    def __init__(self, arr, cb):
        self.arr, self.cb = arr, cb

    def __dlpack__(self, stream=None, **kw):
        self.cb()
        return self.arr.__dlpack__()

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


@pytest.mark.parametrize("views", [False, True])
def test_cached_handle_destroyed_while_importing(views):
    """The cached dispatch's handle destroyed by an input's export: the call raises, runs no uncached
    dispatch in its place, and leaves no handle behind (the buffer can be destroyed)."""
    comm, buf = _host_buffer(views)
    x, idx = _inputs()
    out = buf.dispatch(x, idx)
    h = out.handle
    with pytest.raises(ValueError, match="destroyed"):
        buf.dispatch(CallsBack(x, h.destroy), handle=h)
    del out, h
    gc.collect()
    buf.destroy()
    comm.destroy()


class ViewBaseDropper(np.ndarray):
    """A numpy subclass whose `base` drops the last reference to what it returns."""

    held = []

    @property
    def base(self):
        return ViewBaseDropper.held.pop() if ViewBaseDropper.held else None


def test_subclass_base_property():
    """A subclass's `base` is not followed (it may run any code): such an array is classified by
    address, and a combine of the dispatch's rows through it gives the same result."""
    comm, buf = _host_buffer(True)
    x, idx = _inputs()
    out = buf.dispatch(x, idx)
    want = buf.combine(np.array(out.recv_x), out.handle).combined_x.copy()
    out = buf.dispatch(x, idx)
    sub = np.asarray(out.recv_x).view(ViewBaseDropper)
    ViewBaseDropper.held.append(np.asarray(out.recv_x).base)
    got = buf.combine(sub, out.handle).combined_x
    np.testing.assert_array_equal(got, want)
    del out, sub, got
    ViewBaseDropper.held.clear()
    gc.collect()
    buf.destroy()
    comm.destroy()


def test_buffer_init_once():
    """Buffer.__init__ again, after destroy() too, is refused and leaks no reference to the comm."""
    comm, buf = _host_buffer(False)
    buf.destroy()
    before = sys.getrefcount(comm)
    for _ in range(20):
        with pytest.raises(RuntimeError, match="called twice"):
            epx._epx.Buffer.__init__(buf, comm, 4, 128, 2, 4)
    assert sys.getrefcount(comm) == before
    del buf
    comm.destroy()


def _barrier_lets_threads_run(rank, nranks, uid):
    comm = epx.Comm.from_unique_id(uid, rank, nranks, backend="host")
    ticks, stop = [0], threading.Event()

    def tick():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.01)

    comm.barrier()
    t = threading.Thread(target=tick)
    t.start()
    if rank == 1:
        time.sleep(0.5)  # rank 0 waits in the barrier meanwhile
    start = ticks[0]
    comm.barrier()
    during = ticks[0] - start
    stop.set()
    t.join()
    comm.destroy()
    # Rank 0 waited about 0.5 s: a thread that ticks every 10 ms ran many times meanwhile.
    assert rank == 1 or during >= 10, "rank 0: the other thread ran %d times during the barrier" % during
    return True


def test_barrier_releases_the_gil():
    assert run_ranks(2, _barrier_lets_threads_run) == [True, True]
