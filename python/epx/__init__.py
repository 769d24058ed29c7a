"""epx: expert-parallel dispatch and combine for Mixture-of-Experts models.

Python binding of libepx (the C library's semantics are in docs/reference.md). Tensors come in
through DLPack (numpy >= 1.22 arrays, torch tensors, anything with ``__dlpack__``); outputs are
allocated by the caller's framework: numpy in, numpy out; torch in, torch out on the same device.
Calls stay outside autograd, as DeepEP's do: a torch tensor that requires grad is read through its
detached view (the same memory), and outputs never require grad; wrap calls in an
``autograd.Function`` for gradients.

dtypes: bf16 is ``torch.bfloat16`` or, with numpy (which has no bfloat16), a ``uint16`` array of
bf16 bit patterns; fp8 e4m3 is ``torch.float8_e4m3fn`` or a ``uint8`` array where fp8 is expected;
``float32``, ``int32``, ``int64`` and ``bool`` are themselves. Outputs use the same conventions.

Streams: for cuda tensors every call runs on torch's current stream unless ``stream=`` (a
``cudaStream_t`` as int) is given; the host backend runs synchronously.

HT dispatch outputs (``Buffer(views=...)``; ``views=None`` takes ``epx.DEFAULT_VIEWS``, now ``False``):

- ``views=False``: recv_x, recv_x_scales, recv_topk_idx (in topk_idx's dtype) and recv_topk_weights are
  new arrays of their own, valid for as long as the caller holds them; combine reads x where it is. Two
  passes over the bytes per call (the library's buffer, then the caller's arrays).
- ``views="pooled"``: the outputs (recv_topk_idx int32) are views of one of the buffer's view areas, and
  still behave as memory of the caller's: no dispatch reuses an area while any array over it is alive (a
  torch tensor made through DLPack, a numpy array over the buffer protocol, or any slice or view of
  them). A dispatch goes to the first of areas 0..N-2 that nothing points into; when every one is held,
  it goes to the last area, the spare, and returns copies of its outputs (torch: ``clone()`` on the
  call's stream; numpy: ``copy()``), so no view of the spare is ever handed out. One pass over the bytes
  while areas are free, two when every area is held. On cuda, reuse is ordered on the dispatch's stream,
  as with torch's caching allocator: work on another stream that reads an output must be ordered before
  that stream (an event, ``wait_stream``) before the caller drops the output (``record_stream`` does not
  protect these tensors).
- ``views=True``: the outputs are views valid until a later dispatch reuses their area: a dispatch takes
  an area without alive views (current or stale) if there is one, else the least recently used, whose
  views become stale (with one area, the next view dispatch). For code that consumes the outputs before
  its next call, as MoE layers do; keep a copy (``.clone()``, ``.copy()``) of what must outlive that, e.g.
  outputs autograd saves.
- On a buffer with views (True or "pooled"), ``num_worst_tokens`` above the R * max_tokens rows that an
  area and the combine input hold (N_r never exceeds them) raises InvalidArgumentError, in every call of
  that buffer; a views=False buffer takes any bound (``combine_input`` then needs one within them).

``view_areas``: N areas, 1 to ``MAX_VIEW_AREAS`` (8); 0 gives 3 for "pooled" (two pooled and the spare)
and 1 otherwise. Each area holds R * max_tokens rows of x (in the widest of dispatch_dtypes), its fp8
scales, K int32 ids and K float32 weights: about 450 MiB with R = 8, max_tokens = 4096, H = 7168, K = 8
and bf16. On cuda the areas are allocated with the buffer; the host backend allocates an area when a
dispatch first uses it. Routing-map dispatches, LL calls and dispatches without views leave the areas
alone.

Combine on a buffer with views (True or "pooled") reads x from the library's buffer in one pass: a live
recv_x of a dispatch made with the handle, passed whole (bf16), is read where the dispatch put it;
``combine_input(handle)`` (the buffer's combine input: write the expert outputs into it; valid until the
next HT or routing-map combine or ``combine_input()`` of another handle) is read where it is, on any
buffer; any other x is first copied into the combine input. Writing the expert outputs over recv_x and
passing it back is the cheapest way. A view passed to a call after its area was reused raises
``StaleViewError`` (for numpy arrays whose base is the view the binding returned, and for any array
or torch tensor when no view of the area's current generation is alive; an array rebuilt from a
stale view's bytes, e.g. through a memoryview, while a current view lives, is read as it is), and a
dispatch refuses inputs that lie in the area it is about to write. A stale view passed to another
buffer is caller memory there.
``destroy()`` with views alive frees the buffer when the last one goes.

Library failures raise ``EpxError`` subclasses carrying the library's message (``.message``), the
result name (``.result``, e.g. ``"ERR_INVALID_ARG"``) and its code (``.code``). A collective call that
the binding itself rejects before it reaches the library (a dtype epx lacks, an object without DLPack, a
destroyed handle) raises as usual and is refused on the buffer (epx_buffer_refuse_collective), so the
peers' matching calls raise RemoteError instead of pairing with this rank's next call.
"""

import collections

from . import _epx
from ._epx import (  # noqa: F401  (re-exported)
    CombineOutput,
    DispatchOutput,
    Handle,
    Hook,
    Layout,
    LLCombineOutput,
    LLDispatchOutput,
    LLHandle,
    RoutingDispatchOutput,
    get_unique_id,
)

__all__ = [
    "Buffer", "Comm", "NodeTopology", "EpxError", "get_unique_id", "version", "build_info", "Handle", "LLHandle", "Hook", "Layout",
    "DispatchOutput", "CombineOutput", "LLDispatchOutput", "LLCombineOutput", "RoutingDispatchOutput",
    "bf16_to_float32", "float32_to_bf16", "StaleViewError", "DEFAULT_VIEWS", "MAX_VIEW_AREAS",
]

__version__ = _epx.version()
MAX_VIEW_AREAS = _epx.MAX_VIEW_AREAS


def version():
    """Version of the linked library ("major.minor.patch")."""
    return _epx.version()


def build_info():
    """What the linked library was built with (epx_get_build_info): a dict with ``cuda`` (the cuda
    backend), ``nccl``, ``nccl_version`` ("2.28.9", "" without), ``nccl_version_code`` (major * 10000 +
    minor * 100 + patch, 0 without) and ``network`` (a network transport: False in this version)."""
    return _epx.build_info()


# ---------------------------------------------------------------------------------------- errors


class EpxError(RuntimeError):
    """A failure reported by libepx. ``message``: the library's detail; ``result``: the result
    name ("ERR_TIMEOUT"); ``code``: its integer value."""

    result = "ERR_INTERNAL"
    code = 12
    message = ""

    def __str__(self):
        return "%s [%s]" % (self.message or (self.args[0] if self.args else ""), self.result)


class InvalidArgumentError(EpxError, ValueError):
    """EPX_ERR_INVALID_ARG."""


class UnsupportedError(EpxError):
    """EPX_ERR_UNSUPPORTED: not supported by this build, backend or device."""


class OutOfMemoryError(EpxError, MemoryError):
    """EPX_ERR_OUT_OF_MEMORY."""


class EpxTimeoutError(EpxError, TimeoutError):
    """EPX_ERR_TIMEOUT: a wait exceeded its deadline (EPX_TIMEOUT_MS)."""


class SystemCallError(EpxError, OSError):
    """EPX_ERR_SYSTEM: a system call failed."""


class CudaError(EpxError):
    """EPX_ERR_CUDA."""


class GraphCaptureError(EpxError):
    """EPX_ERR_GRAPH_CAPTURE: not allowed while the stream is being captured."""


class EpxOverflowError(EpxError):
    """EPX_ERR_OVERFLOW: rows past a caller-given upper bound were dropped."""


class MismatchError(EpxError):
    """EPX_ERR_MISMATCH: collective arguments differ across ranks."""


class RemoteError(EpxError):
    """EPX_ERR_REMOTE: a peer rank failed or left the operation."""


class BootstrapError(EpxError):
    """EPX_ERR_BOOTSTRAP: rendezvous or bootstrap callback failed."""


class InternalError(EpxError):
    """EPX_ERR_INTERNAL."""


class InvalidUsageError(EpxError):
    """EPX_ERR_INVALID_USAGE: an object used after its destroy, or by two threads at once."""


class StaleViewError(InvalidArgumentError):
    """A view of a buffer's memory (dispatch outputs or a combine input) passed to a call after a later
    call reused that memory."""


_ERRORS = {
    "ERR_INVALID_ARG": InvalidArgumentError,
    "ERR_UNSUPPORTED": UnsupportedError,
    "ERR_OUT_OF_MEMORY": OutOfMemoryError,
    "ERR_TIMEOUT": EpxTimeoutError,
    "ERR_SYSTEM": SystemCallError,
    "ERR_CUDA": CudaError,
    "ERR_GRAPH_CAPTURE": GraphCaptureError,
    "ERR_OVERFLOW": EpxOverflowError,
    "ERR_MISMATCH": MismatchError,
    "ERR_REMOTE": RemoteError,
    "ERR_BOOTSTRAP": BootstrapError,
    "ERR_INTERNAL": InternalError,
    "ERR_INVALID_USAGE": InvalidUsageError,
}
for _code, (_name, _cls) in enumerate(_ERRORS.items(), start=1):  # the order of EPX_RESULT_MAP
    _cls.result, _cls.code = _name, _code
_epx._set_error_classes(EpxError, _ERRORS)


def _copy_rows(dst, src, stream):
    """dst.copy_(src[:rows]) ordered on `stream` (None: torch's current one): a combine's device copy."""
    import torch

    src = src[:dst.shape[0]]
    if stream is None:
        dst.copy_(src)
    else:
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=dst.device)):
            dst.copy_(src)


def _own_copy(a, stream):
    """A copy of ``a`` of its own (numpy's copy, torch's clone) ordered on ``stream`` (None: torch's current
    one): the outputs of a pooled dispatch into the spare area."""
    if not hasattr(a, "clone"):
        return a.copy()
    if stream is None or a.device.type != "cuda":
        return a.clone()
    import torch

    with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=a.device)):
        return a.clone()


_epx._set_helpers(StaleViewError, _copy_rows, _own_copy)

# ---------------------------------------------------------------------------------------- comm


class NodeTopology(collections.namedtuple(
        "NodeTopology", "node num_nodes ranks_per_node local_rank ranks_per_nvlink_domain num_nvlink_domains "
        "node_id")):
    """The nodes the library derived from every rank's node id (Comm.topology): this rank's node index
    (nodes numbered by their lowest rank), the node count, ranks per node, this rank's index in its
    node, the NVLink domain size and count, and this rank's node id string."""


class Comm(_epx.Comm):
    """A communicator: this process's rank among ``nranks`` processes.

    Properties: rank, nranks, local_rank, local_nranks (of this machine), ranks_per_nvlink_domain,
    num_nvlink_domains, backend ("host" or "cuda"), cuda_device, topology (a NodeTopology: the nodes);
    peer_path(peer) says how this rank reaches a peer; barrier() waits for every rank. Destroyed when
    garbage-collected, or by destroy().

    node_id (the init's argument): ranks with one node id form a node; None or "" = the default.
    EPX_NODE_ID, when set and not empty, overrides it; without either, the node is the host."""

    @classmethod
    def from_unique_id(cls, unique_id, rank, nranks, backend="auto", cuda_device=-1, timeout_ms=0,
                       node_id=None):
        """Collective over ``nranks`` processes: rendezvous through ``unique_id`` (bytes from
        get_unique_id(), created once and sent to every rank). backend: "auto", "host" or "cuda";
        cuda_device -1 = the current device; timeout_ms 0 = EPX_TIMEOUT_MS; node_id: see Comm."""
        return _epx.comm_init(cls, bytes(unique_id), rank, nranks, backend, cuda_device, timeout_ms, node_id)

    @classmethod
    def from_callbacks(cls, allgather, barrier, rank, nranks, backend="auto", cuda_device=-1, timeout_ms=0,
                       node_id=None):
        """Collective; bootstraps through the caller's collectives. ``allgather(data: bytes) -> bytes``
        returns every rank's ``data`` concatenated in rank order; ``barrier()`` returns when all ranks
        called it. Both must stay usable while the communicator lives. An exception in a callback fails
        the init with BootstrapError (the exception is its ``__cause__``)."""
        return _epx.comm_init_callbacks(cls, allgather, barrier, rank, nranks, backend, cuda_device,
                                        timeout_ms, node_id)

    @property
    def topology(self):
        """A NodeTopology: node, num_nodes, ranks_per_node, local_rank (in the node),
        ranks_per_nvlink_domain, num_nvlink_domains, node_id."""
        return NodeTopology(*_epx.comm_node_topology(self))

    def peer_path(self, peer):
        """How this rank reaches rank ``peer``: "self", "ipc" (same node, load/store over NVLink) or
        "network" (another node). The host backend carries both through its shared memory."""
        return _epx.comm_peer_path(self, peer)

    def barrier(self):
        """Collective: returns when every rank called it, through the communicator's bootstrap (epx's own,
        or the callbacks' barrier); past EPX_TIMEOUT_MS, or when a peer is gone, it raises. Benchmarks
        align their iterations with it, as the C tools do."""
        _epx.comm_barrier(self)

    @classmethod
    def from_torch(cls, group=None, backend="auto", timeout_ms=0):
        """Collective over a torch.distributed process group (default: the world): bootstraps through
        its all_gather and barrier (gloo on the CPU, NCCL on the current CUDA device). The group's
        backend only carries the bootstrap: backend="auto" picks "cuda" (on torch's current device)
        whenever torch sees a GPU, also for a gloo group; pass backend="host" for CPU tensors."""
        import torch
        import torch.distributed as dist

        _epx._refresh_torch()
        rank = dist.get_rank(group)
        nranks = dist.get_world_size(group)
        on_cuda = _group_on_cuda(dist, group)
        device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")

        def allgather(data):
            send = torch.tensor(list(data), dtype=torch.uint8, device=device)
            parts = [torch.empty_like(send) for _ in range(nranks)]
            dist.all_gather(parts, send, group=group)
            return bytes(torch.cat(parts).cpu().tolist())

        def barrier():
            dist.barrier(group=group)

        cuda_device = -1
        if backend != "host" and torch.cuda.is_available():
            cuda_device = torch.cuda.current_device()
        return cls.from_callbacks(allgather, barrier, rank, nranks, backend, cuda_device, timeout_ms)

    @classmethod
    def from_mpi(cls, comm, backend="auto", timeout_ms=0, node_id=None):
        """Collective over an mpi4py communicator (any object with mpi4py's ``Get_rank()``, ``Get_size()``
        and ``allgather(obj) -> list``; ``Barrier()`` when it has one): bootstraps through them. The
        CUDA device is torch's current one where torch is importable and sees a GPU, else none (as
        from_callbacks with cuda_device=-1)."""
        for name in ("Get_rank", "Get_size", "allgather"):
            if not callable(getattr(comm, name, None)):
                raise TypeError("epx.Comm.from_mpi: comm has no %s(): pass an mpi4py communicator (got %s)"
                                % (name, type(comm).__name__))
        rank, nranks = int(comm.Get_rank()), int(comm.Get_size())

        def allgather(data):
            return b"".join(bytes(part) for part in comm.allgather(bytes(data)))

        def barrier():
            if callable(getattr(comm, "Barrier", None)):
                comm.Barrier()
            else:
                comm.allgather(b"")

        cuda_device = -1
        if backend != "host":
            try:
                import torch
            except ImportError:
                torch = None
            if torch is not None and torch.cuda.is_available():
                cuda_device = torch.cuda.current_device()
        return cls.from_callbacks(allgather, barrier, rank, nranks, backend, cuda_device, timeout_ms, node_id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def __repr__(self):
        return "epx.Comm(rank=%d, nranks=%d, backend=%r)" % (self.rank, self.nranks, self.backend)


def _group_on_cuda(dist, group):
    """Whether the group's collectives take CUDA tensors: NCCL alone, not gloo nor "cpu:gloo,cuda:nccl"
    (whose CPU half serves CPU tensors)."""
    name = str(dist.get_backend(group)).lower()
    return "nccl" in name and "gloo" not in name


# ---------------------------------------------------------------------------------------- buffer

_MODES = {"ht": _epx.MODE_HT, "ll": _epx.MODE_LL, "permute": _epx.MODE_PERMUTE, "all": _epx.MODE_ALL}
_DTYPES = {"bf16": 1, "fp32": 2, "fp8": 3, "fp8_e4m3": 3}


def _mask(value, table, what):
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        value = [value]
    mask = 0
    for item in value:
        if item not in table:
            raise ValueError("epx: %s %r is unknown; use %s" % (what, item, ", ".join(sorted(table))))
        bit = table[item]
        mask |= bit if what == "mode" else (1 << bit)
    return mask


# What Buffer(views=None) gives, read when a buffer is made: False, True or "pooled" (package docstring).
DEFAULT_VIEWS = False


class Buffer(_epx.Buffer):
    """A communication buffer, collective to create.

    Buffer(comm, max_tokens, hidden, num_topk, num_experts, modes="all", dispatch_dtypes=None,
           max_pad_multiple=0, num_sms=0, chunk_tokens=0, views=None, view_areas=0)

    modes: "all" or any of "ht", "ll", "permute" (a string, a list of them, or EPX_MODE_* bits).
    dispatch_dtypes: dtypes of x allowed in dispatch, any of "bf16", "fp32", "fp8" (default: bf16 and
    fp32, and fp8 when hidden % 128 == 0; fp8 asked for by name needs that too). Every rank must pass the
    same values.
    views: what HT dispatch returns (None: epx.DEFAULT_VIEWS, which is False). False: outputs of their
    own, and combine reads x where it is (two passes over the bytes each). True: views of the buffer's
    memory, valid until the next dispatch into their view area. "pooled": views that no dispatch reuses
    while they are alive, so they behave as outputs of their own; when every other area is held, a
    dispatch goes to a spare one and returns copies. With True and "pooled", combine reads x from the
    buffer (one pass): where the dispatch put it when x is its recv_x, else from the combine input (x
    copied there unless it is combine_input(handle)).
    view_areas: areas for the views, 1 to MAX_VIEW_AREAS (8), each R * max_tokens rows of x, scales,
    ids and weights; 0: 3 for "pooled", else 1. Every rank must pass the same values.
    Lifetimes and costs: see the package docstring. destroy() with views still alive frees the buffer
    when the last one goes.

    Methods (see each docstring): get_dispatch_layout, dispatch, combine, combine_input, ll_dispatch,
    ll_combine, get_combine_buffer, rm_dispatch, rm_combine, query_overflow, destroy."""

    def __init__(self, comm, max_tokens, hidden, num_topk, num_experts, modes="all", dispatch_dtypes=None,
                 max_pad_multiple=0, num_sms=0, chunk_tokens=0, views=None, view_areas=0):
        super().__init__(comm, max_tokens, hidden, num_topk, num_experts, _mask(modes, _MODES, "mode"),
                         _mask(dispatch_dtypes, _DTYPES, "dtype"), max_pad_multiple, num_sms, chunk_tokens,
                         DEFAULT_VIEWS if views is None else views, view_areas)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def __repr__(self):
        return "epx.Buffer(T_max=%d, H=%d, K=%d, E=%d, ranks=%d)" % (
            self.max_tokens, self.hidden, self.num_topk, self.num_experts, self.num_ranks)


# ---------------------------------------------------------------------------------------- refusals

# The collective calls a refusal names (epx_collective_t).
HT_DISPATCH, HT_COMBINE = _epx.COLLECTIVE_HT_DISPATCH, _epx.COLLECTIVE_HT_COMBINE
LL_DISPATCH, LL_COMBINE = _epx.COLLECTIVE_LL_DISPATCH, _epx.COLLECTIVE_LL_COMBINE
RM_DISPATCH, RM_COMBINE = _epx.COLLECTIVE_RM_DISPATCH, _epx.COLLECTIVE_RM_COMBINE


class collective:
    """For layers over Buffer (compat/): ``with collective(buffer, kind):`` -- the block makes this rank's
    collective call of ``kind`` on ``buffer`` (an epx.Buffer, or None when there is none yet). An exception
    raised in it before that call reached the library refuses the call, as the library refuses bad
    arguments: the peers' matching calls raise RemoteError instead of pairing with this rank's next call.
    The exception then propagates unchanged. Buffer's own methods do the same for what they reject. (A
    class rather than a generator: the fronts enter it on every call.)"""

    __slots__ = ("_buffer", "_kind", "_calls")

    def __init__(self, buffer, kind):
        self._buffer, self._kind = buffer, kind
        self._calls = buffer._collective_calls if buffer is not None else None

    def __enter__(self):
        return None

    def __exit__(self, exc_type, exc, tb):
        b = self._buffer
        if exc_type is not None and b is not None and not b.destroyed and b._collective_calls == self._calls:
            b._refuse(self._kind, exc)
        return False


# ---------------------------------------------------------------------------------------- numpy helpers


def float32_to_bf16(a):
    """numpy float32 array -> uint16 array of bf16 bit patterns (round to nearest even)."""
    import numpy as np

    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(np.asarray(a, dtype=np.float32))
    out = rounded.astype(np.uint16)
    out[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def bf16_to_float32(a):
    """uint16 array of bf16 bit patterns -> numpy float32 array (exact)."""
    import numpy as np

    return (np.ascontiguousarray(a, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
