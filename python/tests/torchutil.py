"""Shared pieces of the torch tests: forked ranks with a torch.distributed group, and the same checks
as the NumPy tests (npref.py) on torch tensors."""

import os
import shutil
import socket
import tempfile

import numpy as np

from mp import run_ranks
from npref import f32


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank, nranks, port, backend="gloo"):
    """A torch.distributed group over a TCP store on `port` (an int), or over a file store at `port` (a
    path): no port that another process on the machine could take between its choice and its use."""
    import torch.distributed as dist

    if isinstance(port, str):
        dist.init_process_group(backend, init_method="file://" + port, rank=rank, world_size=nranks)
        return dist
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=rank, world_size=nranks)
    return dist


def _in_group(rank, nranks, uid, port, backend, worker, kwargs):
    dist = init_group(rank, nranks, port, backend)
    result = worker(rank, nranks, dist, **kwargs)
    dist.destroy_process_group()
    return result


def run_in_group(nranks, worker, backend="gloo", **kwargs):
    """run_ranks with a torch.distributed group: worker(rank, nranks, dist, **kwargs) on every rank, between
    the group's creation and its destruction; returns the workers' results by rank."""
    where = tempfile.mkdtemp(prefix="epx-group-")
    try:
        return run_ranks(nranks, _in_group, port=os.path.join(where, "store"), backend=backend, worker=worker,
                         kwargs=kwargs)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def to_torch(a, device, bf16=False):
    """numpy -> torch; uint16 bf16 bit patterns become torch.bfloat16 when bf16 is set."""
    import torch

    if bf16:
        return torch.from_numpy(f32(a)).to(torch.bfloat16).to(device)
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def bf16_bits(t):
    """torch.bfloat16 tensor -> numpy uint16 bit patterns."""
    import torch

    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)
