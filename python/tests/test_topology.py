"""Comm.topology and Comm.peer_path on the host backend: node splits through the node_id argument, and
EPX_NODE_ID overriding it (in a fresh process: the library reads its environment once per process); an HT
combine under a 2x2 split against a NumPy model of the node tree (docs/reference.md, Sums)."""

import os
import subprocess
import sys

import numpy as np
import pytest

import epx
from mp import host_comm, run_ranks
from npref import SEED, assert_equal, bf16, f32


def _split_body(rank, nranks, uid, per):
    with host_comm(rank, nranks, uid, node_id="n%d" % (rank // per)) as comm:
        topo = comm.topology
        paths = [comm.peer_path(p) for p in range(nranks)]
        with pytest.raises(epx.InvalidArgumentError, match="out of range"):
            comm.peer_path(nranks)
        return tuple(topo), paths


@pytest.mark.parametrize("nodes,per", [(1, 4), (2, 2), (4, 1), (2, 3), (3, 2)])
def test_node_split(nodes, per):
    if "EPX_NODE_ID" in os.environ:
        pytest.skip("EPX_NODE_ID is set: it overrides node_id")
    nranks = nodes * per
    results = run_ranks(nranks, _split_body, per=per)
    for rank in range(nranks):
        topo, paths = results[rank]
        topo = epx.NodeTopology(*topo)
        assert topo == (rank // per, nodes, per, rank % per, per, nodes, "n%d" % (rank // per))
        assert paths == ["self" if p == rank else "ipc" if p // per == rank // per else "network"
                         for p in range(nranks)]


def _default_body(rank, nranks, uid):
    with host_comm(rank, nranks, uid) as comm:
        return tuple(comm.topology), comm.local_nranks


def test_default_is_one_node():
    if "EPX_NODE_ID" in os.environ:
        pytest.skip("EPX_NODE_ID is set")
    for rank, (topo, local_nranks) in enumerate(run_ranks(2, _default_body)):
        topo = epx.NodeTopology(*topo)
        assert (topo.node, topo.num_nodes, topo.ranks_per_node, topo.local_rank) == (0, 1, 2, rank)
        assert local_nranks == 2
        assert topo.node_id.startswith(os.uname().nodename[:40])


def test_env_overrides_node_id():
    code = ("import epx\n"
            "c = epx.Comm.from_unique_id(epx.get_unique_id(), 0, 1, backend='host', node_id='from-config')\n"
            "print(c.topology.node_id, c.topology.num_nodes, c.peer_path(0))\n")
    env = dict(os.environ, EPX_NODE_ID="from-env")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["from-env", "1", "self"]


def test_node_id_too_long():
    with pytest.raises(epx.InvalidArgumentError, match="node_id"):
        epx.Comm.from_unique_id(epx.get_unique_id(), 0, 1, backend="host", node_id="x" * 64)


# ------------------------------------------------------------------------------ the combine tree

TREE_T, TREE_H, TREE_K, TREE_L = 8, 256, 3, 2


def _tree_inputs(s, nranks):
    """Source rank s's x (bf16, values of every magnitude so that sums round) and topk_idx."""
    rng = np.random.default_rng(SEED * 7919 + s)
    x = bf16(rng.standard_normal((TREE_T, TREE_H)).astype(np.float32) * np.float32(16))
    idx = np.full((TREE_T, TREE_K), -1, dtype=np.int64)
    for t in range(TREE_T):
        k = int(rng.integers(1, TREE_K + 1))
        idx[t, :k] = rng.choice(nranks * TREE_L, size=k, replace=False)
    # Tokens 0 and 1 reach the two first and the two last ranks, so that under any split of the ranks
    # into two nodes every source has a remote partial of two rows: its bf16 rounding then shows.
    idx[0] = [0, TREE_L, (nranks - 1) * TREE_L]
    idx[1] = [(nranks - 1) * TREE_L, (nranks - 2) * TREE_L, 0]
    return x, idx


def _expert(x, r):
    """Rank r's expert output for a received row: x times a factor of r, rounded to bf16."""
    return bf16(f32(x) * np.float32(1.0 + 0.3 * r))


def _tree_combine(s, nranks, per):
    """combined_x of source s: per node, its ranks' rows summed in fp32 (ranks ascending); then the nodes
    ascending, a remote node's partial rounded to bf16; then bias0 (x itself) and one rounding. Also the
    flat sum over ranks, to show that the split changes the result."""
    x, idx = _tree_inputs(s, nranks)
    holds = [[any(e >= 0 and e // TREE_L == r for e in idx[t]) for r in range(nranks)] for t in range(TREE_T)]
    acc = np.zeros((TREE_T, TREE_H), dtype=np.float32)
    flat = np.zeros((TREE_T, TREE_H), dtype=np.float32)
    for t in range(TREE_T):
        for n in range(nranks // per):
            ranks = [r for r in range(n * per, (n + 1) * per) if holds[t][r]]
            if not ranks:
                continue
            part = np.zeros(TREE_H, dtype=np.float32)
            for r in ranks:
                part = part + f32(_expert(x[t], r))
                flat[t] = flat[t] + f32(_expert(x[t], r))
            acc[t] = acc[t] + (part if n == s // per else f32(bf16(part)))
    return bf16(acc + f32(x)), bf16(flat + f32(x))


def _tree_body(rank, nranks, uid, per):
    with host_comm(rank, nranks, uid, node_id="t%d" % (rank // per)) as comm:
        assert tuple(comm.topology)[1:3] == (nranks // per, per)
        with epx.Buffer(comm, TREE_T, TREE_H, TREE_K, nranks * TREE_L, modes="ht", views=False) as buf:
            x, idx = _tree_inputs(rank, nranks)
            out = buf.dispatch(x, idx)
            comb = buf.combine(_expert(out.recv_x, rank), out.handle, bias0=x)
            out.handle.destroy()
        tree, flat = _tree_combine(rank, nranks, per)
        assert_equal(comb.combined_x, tree, "combined_x under %d nodes of %d" % (nranks // per, per), rank)
        return int((tree != flat).sum())


@pytest.mark.parametrize("nodes,per", [(2, 2), (1, 4)])
def test_combine_tree(nodes, per):
    if "EPX_NODE_ID" in os.environ:
        pytest.skip("EPX_NODE_ID is set: it overrides node_id")
    differ = sum(run_ranks(nodes * per, _tree_body, per=per))
    # Two nodes: remote partials through bf16 change some sums; one node: the flat sum exactly.
    assert (differ > 0) == (nodes > 1), "%d elements differ from the flat sum (seed %d)" % (differ, SEED)


# ------------------------------------------------------------------------------------ barrier


def _barrier(rank, nranks, uid):
    import time

    comm = host_comm(rank, nranks, uid)
    comm.barrier()  # every rank has its comm
    if rank == 0:
        time.sleep(0.3)
    t0 = time.monotonic()
    comm.barrier()
    return time.monotonic() - t0


@pytest.mark.parametrize("nranks", [2, 3])
def test_barrier_waits_for_every_rank(nranks):
    waited = run_ranks(nranks, _barrier)
    # The others waited for rank 0, which entered 0.3 s late.
    assert all(w >= 0.25 for w in waited[1:]), waited


def test_barrier_callback_exception_is_the_cause():
    armed = []

    def barrier():
        if armed:  # the init's own barriers pass
            raise RuntimeError("the launcher is gone")

    comm = epx.Comm.from_callbacks(lambda d: d, barrier, 0, 1, backend="host")
    armed.append(True)
    with pytest.raises(epx.BootstrapError) as e:
        comm.barrier()
    assert isinstance(e.value.__cause__, RuntimeError) and "the launcher is gone" in str(e.value.__cause__)
    armed.clear()
    comm.barrier()  # the communicator stays usable
