#!/usr/bin/env python3
"""Where the time of epx.compat.deep_ep goes, call by call, next to the native epx.Buffer, R ranks on one GPU.

R processes (torch.multiprocessing spawn, a gloo group over a file store) all use cuda:0; start an MPS
daemon before, so that their kernels run side by side. Every rank makes DeepEP-like inputs: x bf16 [T, H],
topk_idx int64 = the top-K of random scores over E experts, fp32 weights, and an fp8 copy of x with one fp32
scale per 128 channels. A row is the median of --iters timings with CUDA events after --warmup, each
iteration preceded by torch.cuda.synchronize() and a barrier (the gloo group's, or with --barrier epx an epx
host communicator's over epx's own bootstrap, as epx-bench aligns its C rows); the slowest rank's median is shown, then
the fastest's.

Rows of the front (per --front-views setting): get_dispatch_layout; the dispatch without a handle (one
data dispatch since the front carries no notify step; a front with an `exchange` step also gets its two
parts timed); layout + dispatch (what DeepEP's figure covers); cached dispatch bf16 and fp8; combine. Rows of the native
epx.Buffer (modes "ht", dtypes bf16 and fp8, --num-sms; per --native-views): dispatch, cached bf16, cached
fp8, combine. Then rank 0 prints, from torch.profiler, the kernels (and copies) one iteration of the
front's layout + dispatch, cached dispatch and combine launches, with their total device time.

--cpu runs the same over epx's host backend on CPU tensors (small shapes unless given; host clock; the
profile lists aten ops), which checks the script where there is no GPU. Usage:
    python3 bench/compat_profile.py [--ranks 8] [--tokens 4096] [--hidden 7168] [--topk 8] [--experts 256]
        [--num-sms 16] [--iters 20] [--warmup 5] [--front-views default] [--native-views 0,1,pooled]
        [--no-profile] [--timeout-ms 20000] [--deadline 110] [--cpu]
epx must be importable (for the GPU: EPX_PYTHON_CUDA=1 pip install .).
"""
import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
import traceback

GPU_SHAPES = dict(tokens=4096, hidden=7168, topk=8, experts=256)
CPU_SHAPES = dict(tokens=64, hidden=256, topk=4, experts=16)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    for name in GPU_SHAPES:
        ap.add_argument("--" + name, type=int, default=None, help="default %d (%d with --cpu)"
                        % (GPU_SHAPES[name], CPU_SHAPES[name]))
    ap.add_argument("--num-sms", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--front-views", default="default",
                    help="comma list of EPX_DEEPEP_VIEWS settings for the front (default: the environment's)")
    ap.add_argument("--native-views", default="0,1,pooled", help="comma list of views= for the native rows")
    ap.add_argument("--no-profile", action="store_true", help="skip the torch.profiler tables")
    ap.add_argument("--timeout-ms", type=int, default=20000, help="epx timeout of the bench's communicators")
    ap.add_argument("--deadline", type=float, default=110.0, help="seconds before the ranks are killed")
    ap.add_argument("--cpu", action="store_true", help="host backend, CPU tensors")
    ap.add_argument("--barrier", choices=("gloo", "epx"), default="gloo",
                    help="what aligns each timed call: the gloo group's barrier, or the barrier of an epx host "
                         "communicator over epx's own bootstrap (as epx-bench aligns its C rows)")
    a = ap.parse_args(argv)
    for name, value in (CPU_SHAPES if a.cpu else GPU_SHAPES).items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    if a.experts % a.ranks or a.topk > a.experts or a.iters < 1:
        ap.error("experts must be a multiple of ranks, topk <= experts, iters >= 1")
    return a


# ---------------------------------------------------------------------------------------- one rank


class Ctx:
    """What every row needs: the group, the clock, the inputs, the options and the rows printed so far."""

    def __init__(self, a, rank, torch, dist):
        self.a, self.rank, self.torch, self.dist = a, rank, torch, dist
        self.cuda = not a.cpu
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.profiles = []
        self.epx_comm = None  # --barrier epx: an epx host communicator used only for its barrier

    def barrier(self):
        if self.epx_comm is not None:
            self.epx_comm.barrier()
        else:
            self.dist.barrier()

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = self.torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def us(self, start, end):
        return start.elapsed_time(end) * 1e3 if self.cuda else (end - start) * 1e6


def make_inputs(ctx):
    torch, a = ctx.torch, ctx.a
    T, H, K, E = a.tokens, a.hidden, a.topk, a.experts
    g = torch.Generator(device=ctx.device).manual_seed(1234 + ctx.rank)
    x = torch.randn((T, H), generator=g, device=ctx.device).to(torch.bfloat16)
    scores = torch.rand((T, E), generator=g, device=ctx.device)
    idx = scores.topk(K, dim=1).indices.to(torch.int64)
    w = torch.rand((T, K), generator=g, device=ctx.device, dtype=torch.float32)
    fp8 = None
    if H % 128 == 0:
        v = x.float().view(T, H // 128, 128)
        scales = v.abs().amax(dim=2).clamp(min=1e-4) / 448.0
        fp8 = ((v / scales.unsqueeze(2)).view(T, H).to(torch.float8_e4m3fn), scales.contiguous())
    return x, idx, w, fp8


def measure(ctx, body, nparts):
    """Medians (us) of the nparts parts of body(mark), which calls mark() after each part."""
    samples = [[] for _ in range(nparts)]
    for i in range(ctx.a.warmup + ctx.a.iters):
        ctx.sync()
        ctx.barrier()
        marks = [ctx.mark()]
        body(lambda: marks.append(ctx.mark()))
        ctx.sync()
        if len(marks) != nparts + 1:
            raise RuntimeError("the row marked %d parts, not %d" % (len(marks) - 1, nparts))
        if i >= ctx.a.warmup:
            for k in range(nparts):
                samples[k].append(ctx.us(marks[k], marks[k + 1]))
    return [statistics.median(s) for s in samples]


def host_time(ctx, call):
    """This rank's median host time (us) of call(), each after a sync and a barrier."""
    times = []
    for i in range(ctx.a.warmup + ctx.a.iters):
        ctx.sync()
        ctx.barrier()
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        if i >= ctx.a.warmup:
            times.append((t1 - t0) * 1e6)
    ctx.sync()
    return statistics.median(times)


def row(ctx, names, body):
    """Times body on every rank; rank 0 prints each name with the slowest and fastest rank's median, or the
    error of the first rank that had one. Never raises."""
    names = [names] if isinstance(names, str) else names
    try:
        values, error = measure(ctx, body, len(names)), None
    except Exception as exc:  # noqa: BLE001 - a failed row is reported, the next one runs
        first_line = (str(exc).splitlines() or [""])[0]
        values, error = [None] * len(names), "%s: %s" % (type(exc).__name__, first_line)
        try:
            ctx.sync()
        except Exception:  # noqa: BLE001
            pass
    report(ctx, names, values, error)


def report(ctx, names, values, error):
    gathered = [None] * ctx.dist.get_world_size()
    ctx.dist.all_gather_object(gathered, (values, error))
    if ctx.rank != 0:
        return
    for k, name in enumerate(names):
        errors = [(r, e) for r, (_, e) in enumerate(gathered) if e]
        if errors:
            print("%-48s %s (rank %d)" % (name, errors[0][1][:150], errors[0][0]), flush=True)
            continue
        per_rank = [v[k] for v, _ in gathered]
        slowest = max(range(len(per_rank)), key=per_rank.__getitem__)
        print("%-48s %10.1f %10.1f %6d" % (name, per_rank[slowest], min(per_rank), slowest), flush=True)


def set_front_views(deep_ep, mode):
    """The front's view setting (EPX_DEEPEP_VIEWS) for buffers made from now on."""
    if mode == "default":
        return
    os.environ["EPX_DEEPEP_VIEWS"] = mode
    if hasattr(deep_ep, "VIEWS"):
        deep_ep.VIEWS = mode


def front_rows(ctx, epx, deep_ep, inputs, mode):
    a, torch = ctx.a, ctx.torch
    x, idx, w, fp8 = inputs
    E = a.experts
    set_front_views(deep_ep, mode)
    backend = "cuda" if ctx.cuda else "host"
    comm = epx.Comm.from_torch(ctx.dist.group.WORLD, backend=backend, timeout_ms=a.timeout_ms)
    try:
        buf = deep_ep.Buffer(ctx.dist.group.WORLD, comm=comm, explicitly_destroy=True)
    except BaseException:
        comm.destroy()
        raise
    setting = getattr(deep_ep, "VIEWS", None) or os.environ.get("EPX_DEEPEP_VIEWS", "default")
    cfg = deep_ep.Config(a.num_sms)
    try:
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                      num_tokens_per_expert=per_expert)

        def dispatch(current=x):
            return buf.dispatch(current, topk_idx=idx, topk_weights=w, config=cfg, **layout)

        dispatch()  # makes the data buffer
        # The mode in effect: a binding without pooled views gives copies ("pooled->0").
        views = getattr(buf._ht_path, "native_options", {}).get("views", setting)
        effective = {False: "0", True: "1"}.get(views, str(views))
        tag = "front[%s] " % (setting if effective == setting else "%s->%s" % (setting, effective))
        row(ctx, tag + "get_dispatch_layout", lambda mark: (buf.get_dispatch_layout(idx, E), mark()))
        row(ctx, tag + "dispatch", lambda mark: (dispatch(), mark()))
        path = buf._ht_path
        if hasattr(path, "exchange"):
            def parts(mark):
                notified = path.exchange(x, per_rank, in_rank, per_expert, idx, 0, a.num_sms)
                mark()
                path.send(notified, in_rank, idx, w, 1, 0)
                mark()

            row(ctx, [tag + "  notify exchange + host read", tag + "  data dispatch"], parts)

        def full(mark):
            pr, _, pe, ir, _ = buf.get_dispatch_layout(idx, E)
            buf.dispatch(x, num_tokens_per_rank=pr, is_token_in_rank=ir, num_tokens_per_expert=pe,
                         topk_idx=idx, topk_weights=w, config=cfg)
            mark()

        row(ctx, tag + "layout + dispatch", full)
        handle = dispatch()[4]
        row(ctx, tag + "cached dispatch bf16",
            lambda mark: (buf.dispatch(x, handle=handle, config=cfg), mark()))
        if fp8 is not None:
            row(ctx, tag + "cached dispatch fp8", lambda mark: (buf.dispatch(fp8, handle=handle, config=cfg),
                                                                 mark()))
        recv_x, _, recv_w, _, handle, _ = dispatch()
        row(ctx, tag + "combine", lambda mark: (buf.combine(recv_x, handle, topk_weights=recv_w, config=cfg),
                                                 mark()))
        if not ctx.a.no_profile:
            profile(ctx, tag, buf, full, x, handle, recv_x, recv_w, cfg)
        del recv_x, recv_w, handle
    finally:
        buf.destroy()


def native_rows(ctx, epx, inputs, views):
    a = ctx.a
    x, idx, w, fp8 = inputs
    T, H, K, E = a.tokens, a.hidden, a.topk, a.experts
    backend = "cuda" if ctx.cuda else "host"
    comm = epx.Comm.from_torch(ctx.dist.group.WORLD, backend=backend, timeout_ms=a.timeout_ms)
    tag = "native[views=%s] " % views
    value = {"0": False, "1": True}.get(views, views)
    extra = {"view_areas": 0} if value == "pooled" else {}
    buf = None
    try:
        try:
            dtypes = ["bf16", "fp8"] if fp8 else ["bf16"]
            buf = epx.Buffer(comm, T, H, K, E, modes="ht", dispatch_dtypes=dtypes, num_sms=a.num_sms,
                             views=value, **extra)
        except Exception as exc:  # noqa: BLE001 - e.g. a binding without this view mode
            report(ctx, [tag + "buffer"], [None], "%s: %s" % (type(exc).__name__, exc))
            return
        handle = buf.dispatch(x, idx, w).handle
        row(ctx, tag + "dispatch", lambda mark: (buf.dispatch(x, idx, w), mark()))
        row(ctx, tag + "cached dispatch bf16", lambda mark: (buf.dispatch(x, handle=handle), mark()))
        if fp8 is not None:
            row(ctx, tag + "cached dispatch fp8", lambda mark: (buf.dispatch(fp8[0], x_scales=fp8[1],
                                                                             handle=handle), mark()))
        out = buf.dispatch(x, idx, w)
        recv_x, handle = out.recv_x, out.handle
        del out
        row(ctx, tag + "combine", lambda mark: (buf.combine(recv_x, handle), mark()))
        del recv_x, handle
        if value is True:
            # Static mode (num_worst_tokens = R * T, no host wait), as epx-bench's C view rows are timed.
            worst = ctx.dist.get_world_size() * T
            row(ctx, tag + "static dispatch", lambda mark: (buf.dispatch(x, idx, w, num_worst_tokens=worst),
                                                            mark()))
            # The C view row's own inputs: int32 ids, no weights (no recv_topk_weights to carry).
            idx32 = idx.to(ctx.torch.int32)
            row(ctx, tag + "static dispatch int32 ids, no weights",
                lambda mark: (buf.dispatch(x, idx32, num_worst_tokens=worst), mark()))
            # The host's time inside the call (device time before its launches is host time too).
            report(ctx, [tag + "static dispatch: host time of the call"],
                   [host_time(ctx, lambda: buf.dispatch(x, idx32, num_worst_tokens=worst))], None)
            out = buf.dispatch(x, idx, w, num_worst_tokens=worst)
            recv_x, handle = out.recv_x, out.handle
            del out
            # The combine first: a later dispatch into the one view area makes recv_x stale.
            row(ctx, tag + "static combine", lambda mark: (buf.combine(recv_x, handle), mark()))
            row(ctx, tag + "static cached bf16", lambda mark: (buf.dispatch(x, handle=handle), mark()))
            if fp8 is not None:
                row(ctx, tag + "static cached fp8", lambda mark: (buf.dispatch(fp8[0], x_scales=fp8[1],
                                                                               handle=handle), mark()))
            del recv_x, handle
    finally:
        if buf is not None:
            buf.destroy()  # handles are gone with the rows' frames; a view still alive defers the free
        comm.destroy()


def profile(ctx, tag, buf, full, x, handle, recv_x, recv_w, cfg):
    """One iteration of each call on every rank, profiled on rank 0. The combine goes first: with
    EPX_DEEPEP_VIEWS=1 a later dispatch would leave recv_x stale."""
    calls = [("combine", lambda mark: buf.combine(recv_x, handle, topk_weights=recv_w, config=cfg)),
             ("cached dispatch bf16", lambda mark: buf.dispatch(x, handle=handle, config=cfg)),
             ("layout + dispatch", full)]
    for name, fn in calls:
        ctx.sync()
        ctx.dist.barrier()
        if ctx.rank != 0:
            fn(lambda: None)
            ctx.sync()
            continue
        from torch.profiler import ProfilerActivity, profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
        with torch_profile(activities=activities) as prof:
            fn(lambda: None)
            ctx.sync()
        ctx.profiles.append((tag + name, prof))


def kernel_table(ctx, prof):
    """Lines 'count  total us  name' of the device events (kernels, copies), or of the aten ops on the CPU."""
    from torch.autograd import DeviceType

    totals = {}
    for evt in prof.events():
        if ctx.cuda:
            if getattr(evt, "device_type", None) != DeviceType.CUDA:
                continue
        elif not evt.name.startswith("aten::") or evt.cpu_parent is not None:
            continue  # the CPU: top-level aten ops only (each is one kernel or copy on a GPU, roughly)
        count, total = totals.get(evt.name, (0, 0.0))
        totals[evt.name] = (count + 1, total + evt.time_range.elapsed_us())
    ordered = sorted(totals.items(), key=lambda item: -item[1][1])
    lines = ["%6d %10.1f  %s" % (count, total, name[:100]) for name, (count, total) in ordered]
    launches = sum(c for c, _ in totals.values())
    return lines, launches


def print_profiles(ctx):
    for name, prof in ctx.profiles:
        try:
            lines, launches = kernel_table(ctx, prof)
            what = "device events (kernels and copies)" if ctx.cuda else "top-level aten ops"
            print("\n## %s: %d %s\n %5s %10s  %s" % (name, launches, what, "count", "total us", "name"))
            print("\n".join(lines) if lines else "  (none recorded)")
        except Exception as exc:  # noqa: BLE001
            print("\n## %s: no table (%s: %s)" % (name, type(exc).__name__, exc))


def rank_main(rank, a, store_path):
    import torch
    import torch.distributed as dist

    if not a.cpu:
        torch.cuda.set_device(0)
    store = dist.FileStore(store_path, a.ranks)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=a.ranks,
                            timeout=datetime.timedelta(seconds=max(a.deadline, 10)))
    ctx = None
    try:
        import epx
        from epx.compat import deep_ep

        ctx = Ctx(a, rank, torch, dist)
        if a.barrier == "epx":
            uid = [epx.get_unique_id() if rank == 0 else None]
            dist.broadcast_object_list(uid, src=0)
            ctx.epx_comm = epx.Comm.from_unique_id(uid[0], rank, a.ranks, backend="host",
                                                   timeout_ms=a.timeout_ms)
        inputs = make_inputs(ctx)
        if rank == 0:
            device = torch.cuda.get_device_name(0) if ctx.cuda else "CPU, host backend"
            print("# epx %s, torch %s, %d ranks on %s; T %d, H %d, top-%d, %d experts, %d SMs; median of %d "
                  "after %d warm-ups (us)" % (epx.version(), torch.__version__, a.ranks, device, a.tokens,
                                               a.hidden, a.topk, a.experts, a.num_sms, a.iters, a.warmup))
            print("%-48s %10s %10s %6s" % ("row", "slowest", "fastest", "rank"), flush=True)
        for mode in a.front_views.split(","):
            try:
                front_rows(ctx, epx, deep_ep, inputs, mode.strip())
            except Exception as exc:  # noqa: BLE001 - setup or teardown of the front failed
                report(ctx, ["front[%s]" % mode], [None], "%s: %s" % (type(exc).__name__, exc))
        for views in a.native_views.split(","):
            if views.strip():
                try:
                    native_rows(ctx, epx, inputs, views.strip())
                except Exception as exc:  # noqa: BLE001
                    report(ctx, ["native[views=%s]" % views], [None], "%s: %s" % (type(exc).__name__, exc))
        if rank == 0:
            print_profiles(ctx)
        sys.stdout.flush()
    except Exception:
        print("rank %d failed:\n%s" % (rank, traceback.format_exc()), file=sys.stderr, flush=True)
        raise
    finally:
        if ctx is not None and ctx.epx_comm is not None:
            ctx.epx_comm.destroy()
        dist.destroy_process_group()


def main(argv=None):
    a = parse_args(argv)
    import torch.multiprocessing as mp

    fd, store_path = tempfile.mkstemp(prefix="epx-compat-profile-")
    os.close(fd)
    os.unlink(store_path)  # the FileStore makes it
    deadline = time.monotonic() + a.deadline
    ctx = mp.spawn(rank_main, args=(a, store_path), nprocs=a.ranks, join=False)
    status = 0
    try:
        while True:
            try:
                if ctx.join(timeout=1):
                    break
            except Exception as exc:  # noqa: BLE001 - a rank raised or died: the others are ended below
                first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
                print("compat_profile: %s" % first_line, file=sys.stderr)
                status = 1
                break
            if time.monotonic() > deadline:
                print("compat_profile: ranks still running after %.0f s; ending them" % a.deadline,
                      file=sys.stderr)
                status = 1
                break
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        if os.path.exists(store_path):
            os.unlink(store_path)
    return status


if __name__ == "__main__":
    sys.exit(main())
