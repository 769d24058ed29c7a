"""A complete MoE layer forward over epx: router top-k, HT dispatch, per-expert matmul, HT combine.

CPU (host backend, NumPy, ranks are forked processes):   python examples/moe_layer.py --ranks 2
GPUs (cuda backend, PyTorch, one process per GPU):
    torchrun --nproc-per-node 8 examples/moe_layer.py --torch

Every rank checks its output against the same layer computed locally without communication (each
rank can rebuild every expert's weights from the seed), and the exit code says whether they agree.
"""

import argparse
import os
import sys

import numpy as np

import epx

TOKENS, HIDDEN, FFN, EXPERTS_PER_RANK, TOPK = 16, 256, 64, 2, 2


def expert_weights(e, hidden=HIDDEN, ffn=FFN):
    rng = np.random.default_rng(1000 + e)
    w1 = (rng.standard_normal((hidden, ffn)) / np.sqrt(hidden)).astype(np.float32)
    w2 = (rng.standard_normal((ffn, hidden)) / np.sqrt(ffn)).astype(np.float32)
    return w1, w2


def expert_mlp(x, w1, w2):
    return np.maximum(x @ w1, 0) @ w2


def router(x, num_experts, rng_seed=7):
    """Softmax router with top-k; returns expert ids [T, K] int64 and renormalised weights [T, K]."""
    wr = np.random.default_rng(rng_seed).standard_normal((x.shape[1], num_experts)).astype(np.float32)
    logits = x @ wr
    idx = np.argsort(-logits, axis=1)[:, :TOPK]
    top = np.take_along_axis(logits, idx, axis=1)
    w = np.exp(top - top.max(axis=1, keepdims=True))
    return idx.astype(np.int64), (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def moe_forward_numpy(buf, x, rank):
    """x [T, H] float32 on this rank -> [T, H] float32 (bf16 on the wire)."""
    L = buf.num_local_experts
    idx, weights = router(x, buf.num_experts)
    out = buf.dispatch(epx.float32_to_bf16(x), idx, weights)
    recv = epx.bf16_to_float32(out.recv_x)
    # Each received token: sum over the local experts it selected, weighted by its router weight
    # (HT combine sums the ranks' rows unweighted, so the weighting happens here).
    y = np.zeros_like(recv)
    for j in range(L):
        w1, w2 = expert_weights(rank * L + j)
        sel = (out.recv_topk_idx == j)
        rows = sel.any(axis=1)
        if rows.any():
            gate = (out.recv_topk_weights * sel).sum(axis=1)[rows, None]
            y[rows] += gate * expert_mlp(recv[rows], w1, w2)
    combined = buf.combine(epx.float32_to_bf16(y), out.handle)
    return epx.bf16_to_float32(combined.combined_x)


def reference(x, num_experts):
    idx, weights = router(x, num_experts)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(TOPK):
            w1, w2 = expert_weights(int(idx[t, k]))
            x_bf16 = epx.bf16_to_float32(epx.float32_to_bf16(x[t:t + 1]))
            out[t] += weights[t, k] * expert_mlp(x_bf16, w1, w2)[0]
    return out


def run_rank_numpy(rank, nranks, uid):
    comm = epx.Comm.from_unique_id(uid, rank, nranks, backend="host")
    num_experts = EXPERTS_PER_RANK * nranks
    buf = epx.Buffer(comm, TOKENS, HIDDEN, TOPK, num_experts, modes="ht", dispatch_dtypes="bf16")
    x = np.random.default_rng(rank).standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    got = moe_forward_numpy(buf, x, rank)
    want = reference(x, num_experts)
    err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-6))
    # bf16 rounding of the expert outputs on the wire and of the sum: relative error ~ 2^-8.
    ok = err < 2e-2
    print("rank %d: %d tokens, %d experts, max relative error %.2e %s" % (rank, TOKENS, num_experts, err,
                                                                      "ok" if ok else "FAIL"), flush=True)
    return ok


def main_numpy(nranks):
    uid = epx.get_unique_id()
    pids = []
    for rank in range(nranks):
        pid = os.fork()
        if pid == 0:
            ok = False
            try:
                ok = run_rank_numpy(rank, nranks, uid)
            finally:
                os._exit(0 if ok else 1)
        pids.append(pid)
    return 0 if all(os.waitpid(p, 0)[1] == 0 for p in pids) else 1


def main_torch():
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank, nranks = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    comm = epx.Comm.from_torch()
    num_experts = EXPERTS_PER_RANK * nranks
    buf = epx.Buffer(comm, TOKENS, HIDDEN, TOPK, num_experts, modes="ht", dispatch_dtypes="bf16")
    dev = torch.device("cuda")
    x_np = np.random.default_rng(rank).standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    idx_np, w_np = router(x_np, num_experts)
    x = torch.from_numpy(x_np).to(dev)
    out = buf.dispatch(x.to(torch.bfloat16), torch.from_numpy(idx_np).to(dev), torch.from_numpy(w_np).to(dev))
    recv = out.recv_x.float()
    y = torch.zeros_like(recv)
    L = buf.num_local_experts
    for j in range(L):
        w1, w2 = (torch.from_numpy(w).to(dev) for w in expert_weights(rank * L + j))
        sel = out.recv_topk_idx == j
        rows = sel.any(dim=1)
        if rows.any():
            gate = (out.recv_topk_weights * sel).sum(dim=1)[rows, None]
            y[rows] += gate * (torch.relu(recv[rows] @ w1) @ w2)
    got = buf.combine(y.to(torch.bfloat16), out.handle).combined_x.float().cpu().numpy()
    want = reference(x_np, num_experts)
    err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-6))
    ok = err < 2e-2
    print("rank %d: max relative error %.2e %s" % (rank, err, "ok" if ok else "FAIL"), flush=True)
    del out  # its handle must be freed before the buffer
    buf.destroy()
    comm.destroy()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="forked ranks on the host backend (NumPy)")
    ap.add_argument("--torch", action="store_true", help="PyTorch on GPUs, launched by torchrun")
    a = ap.parse_args()
    if not a.torch and a.ranks < 1:
        ap.error("--ranks must be at least 1 (got %d)" % a.ranks)
    sys.exit(main_torch() if a.torch else main_numpy(a.ranks))
