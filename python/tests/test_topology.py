"""Comm.topology and Comm.peer_path on the host backend: node splits through the node_id argument, and
EPX_NODE_ID overriding it (in a fresh process: the library reads its environment once per process)."""

import os
import subprocess
import sys

import pytest

import epx
from mp import host_comm, run_ranks


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
