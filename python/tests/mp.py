"""Runs a test body on R forked ranks (multiprocessing, fork) that meet through one unique id, and
reports every rank's failure with its traceback."""

import gc
import multiprocessing as mp
import os
import time
import traceback

import pytest

import epx

DEADLINE_S = 120


def _child(fn, rank, nranks, uid, queue, kwargs):
    try:
        result = fn(rank, nranks, uid, **kwargs)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        # Flush the queue's feeder thread, then skip the atexit handlers inherited from pytest.
        queue.close()
        queue.join_thread()
        os._exit(0)


def run_ranks(nranks, fn, **kwargs):
    """Calls fn(rank, nranks, uid, **kwargs) in nranks forked processes; returns their results by rank."""
    # Garbage of this process (e.g. a buffer an earlier in-process test left in an exception's frames) must
    # not be finalized in a child: destroying a host buffer there waits forever on its inherited state.
    gc.collect()
    ctx = mp.get_context("fork")
    uid = epx.get_unique_id()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, r, nranks, uid, queue, kwargs)) for r in range(nranks)]
    for p in procs:
        p.start()
    results, errors, reported = {}, [], set()
    deadline = time.monotonic() + DEADLINE_S
    dead_since = None
    while len(reported) < nranks:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            rank, ok, value = queue.get(timeout=min(left, 0.5))
        except Exception:  # noqa: BLE001 - queue.Empty
            # A rank that died without reporting (a crash) leaves its peers waiting for it until their
            # timeout: report it now, after a grace period for reports still in the queue's pipe.
            dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode not in (None, 0)]
            if dead:
                dead_since = dead_since or time.monotonic()
                if time.monotonic() - dead_since > 2:
                    errors.extend("rank %d: died with exit code %d without reporting" % (r, procs[r].exitcode)
                                  for r in dead)
                    break
            continue
        reported.add(rank)
        if ok:
            results[rank] = value
        else:
            errors.append("rank %d:\n%s" % (rank, value))
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    if len(results) != nranks:
        raise AssertionError("ranks %s did not report within %d s" %
                             (sorted(set(range(nranks)) - set(results)), DEADLINE_S))
    return [results[r] for r in range(nranks)]


def host_comm(rank, nranks, uid, **kw):
    return epx.Comm.from_unique_id(uid, rank, nranks, backend="host", **kw)


def one_rank_buffer(p, **kw):
    """A host communicator of one rank and a Buffer(**kw) on it for problem p's sizes."""
    comm = host_comm(0, 1, epx.get_unique_id())
    return comm, epx.Buffer(comm, p.T_max, p.H, p.K, p.E, **kw)


def refused_here_or_remote(refusing, refuse, peer, error=ValueError, match=None):
    """On the refusing rank refuse() raises `error` (its message matching `match`); on every other rank
    peer() raises epx.RemoteError. Returns the raised exception's pytest.ExceptionInfo."""
    if refusing:
        with pytest.raises(error, match=match) as e:
            refuse()
    else:
        with pytest.raises(epx.RemoteError) as e:
            peer()
    return e
