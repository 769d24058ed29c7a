#!/usr/bin/env python3
"""Plain-PyTorch baseline for routing-map permute / unpermute on one GPU (R = 1, all experts local).

Times, with CUDA events (median of --iters after warm-up): the permute of hidden [T, H] bf16 into
expert-grouped rows with index_select, the weighted combine back with index_add_ in fp32, and a plain
device copy of the same bytes as the permuted output. epx's own R = 1 figures come from
epx-bench -o permute -r 1 -L 256 -p 1. Usage: python3 bench/torch_permute.py [--tokens 4096] [--hidden 7168]
[--topk 8] [--experts 256] [--iters 50]
"""
import argparse
import statistics

import torch


def timed(fn, iters, warm=5):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for i in range(warm + iters):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warm:
            samples.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(samples)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    T, H, K, E = a.tokens, a.hidden, a.topk, a.experts
    hidden = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
    scores = torch.rand(T, E, device=dev, generator=g)
    topk_idx = scores.topk(K, dim=1).indices
    routing_map = torch.zeros(T, E, device=dev, dtype=torch.bool).scatter_(1, topk_idx, True)
    probs = torch.softmax(scores, dim=1) * routing_map

    # Row map of the permuted layout: tokens grouped by expert, ascending token order inside a group.
    token_of_row = routing_map.t().contiguous().nonzero()[:, 1]  # [T*K], expert-major
    expert_of_row = routing_map.t().contiguous().nonzero()[:, 0]
    row_probs = probs[token_of_row, expert_of_row]
    rows = token_of_row.numel()

    permuted = torch.empty(rows, H, device=dev, dtype=torch.bfloat16)
    copy_dst = torch.empty_like(permuted)
    combined = torch.empty(T, H, device=dev, dtype=torch.float32)

    def permute():
        torch.index_select(hidden, 0, token_of_row, out=permuted)

    def combine():
        combined.zero_()
        combined.index_add_(0, token_of_row, permuted.float() * row_probs.unsqueeze(1))
        return combined.to(torch.bfloat16)

    def copy():
        copy_dst.copy_(permuted)

    permute()
    us_perm, us_comb, us_copy = timed(permute, a.iters), timed(combine, a.iters), timed(copy, a.iters)
    gb = rows * H * 2 / 1e9
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}, T {T}, H {H}, top-{K}, {E} experts, "
          f"{rows} permuted rows, bf16")
    print(f"{'operation':<32} {'us':>10} {'GB/s':>10}")
    print(f"{'permute (index_select)':<32} {us_perm:10.1f} {gb / (us_perm * 1e-6):10.1f}")
    print(f"{'combine (index_add_, fp32)':<32} {us_comb:10.1f} {gb / (us_comb * 1e-6):10.1f}")
    print(f"{'plain copy of the same bytes':<32} {us_copy:10.1f} {gb / (us_copy * 1e-6):10.1f}")


if __name__ == "__main__":
    main()
