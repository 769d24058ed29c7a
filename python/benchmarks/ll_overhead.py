"""Per-call host overhead of LL dispatch from Python against the C API called straight from C, on the
host backend with 1 rank and tiny shapes (the data movement is a few hundred bytes, so the figures are
dominated by call overhead). Prints the median of each over --iters calls, in microseconds. --torch passes
CPU torch tensors (outputs allocated by torch) instead of NumPy arrays."""

import argparse
import platform
import time

import numpy as np

import epx


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=10000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--torch", action="store_true", help="CPU torch tensors instead of NumPy arrays")
    args = ap.parse_args()

    comm = epx.Comm.from_unique_id(epx.get_unique_id(), 0, 1, backend="host")
    # T_max 1, H 128, K 1, E 1: one token of 256 bytes to one expert.
    buf = epx.Buffer(comm, 1, 128, 1, 1, modes="ll")
    x = np.zeros((1, 128), dtype=np.uint16)
    idx = np.zeros((1, 1), dtype=np.int64)
    framework = "numpy %s" % np.__version__
    if args.torch:
        import torch

        x = torch.zeros((1, 128), dtype=torch.bfloat16)
        idx = torch.zeros((1, 1), dtype=torch.int64)
        framework = "torch %s" % torch.__version__

    for _ in range(args.warmup):
        buf.ll_dispatch(x, idx)
    times = np.empty(args.iters, dtype=np.int64)
    clock = time.perf_counter_ns
    for i in range(args.iters):
        t0 = clock()
        buf.ll_dispatch(x, idx)
        times[i] = clock() - t0
    py_us = float(np.median(times)) / 1000.0
    c_us = epx._epx._bench_ll_dispatch_c(buf, x, idx, args.iters)

    print("epx %s, python %s, %s, %s" % (epx.__version__, platform.python_version(), framework,
                                        platform.processor() or platform.machine()))
    print("ll_dispatch, 1 rank, T=1 H=128 K=1 E=1, median of %d calls:" % args.iters)
    print("  C API (epx_ll_dispatch from C)   %8.2f us" % c_us)
    print("  Python (Buffer.ll_dispatch)      %8.2f us" % py_us)
    print("  Python overhead                  %8.2f us" % (py_us - c_us))


if __name__ == "__main__":
    main()
