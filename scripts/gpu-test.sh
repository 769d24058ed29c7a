#!/usr/bin/env bash
# Builds with the cuda backend, runs every GPU test (ranks share the GPUs under a private MPS
# control daemon when they outnumber them), compute-sanitizer memcheck and racecheck on a 2-rank
# run, then the GPU benchmark rows. Usage: scripts/gpu-test.sh LOGDIR. Ends within 10 minutes.
set -u -o pipefail
LOGDIR=${1:?usage: scripts/gpu-test.sh LOGDIR}
# EPX_GPU_PHASES picks what runs (default all): sanitize, tests, bench. EPX_GPU_CTEST_TIMEOUT caps
# each GPU test (seconds, default 300); EPX_GPU_CTEST_REGEX selects GPU tests by name;
# EPX_GPU_FAULT_TRIALS sets the trials of the cuda fault kill test (default 40).
PHASES=${EPX_GPU_PHASES:-sanitize,tests,bench}
phase() { case ",$PHASES," in *",$1,"*) return 0 ;; esac; return 1; }
mkdir -p "$LOGDIR" && LOGDIR=$(cd "$LOGDIR" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${EPX_BUILD_DIR:-$ROOT/build-gpu}
export NCCL_NVLS_ENABLE=0
START=$(date +%s)
status=0
log() { echo "[$(($(date +%s) - START)) s] $*" | tee -a "$LOGDIR/summary.log"; }

# shellcheck source=scripts/mps.sh
. "$ROOT/scripts/mps.sh"
mps_init epx-mps

log "build (cuda on) in $BUILD"
if ! { cmake -S "$ROOT" -B "$BUILD" -DEPX_CUDA=ON -DCMAKE_BUILD_TYPE=Release >"$LOGDIR/cmake.log" 2>&1 &&
       make -C "$BUILD" -j"$(nproc)" >"$LOGDIR/build.log" 2>&1; }; then
    log "build FAILED"; tail -30 "$LOGDIR/build.log"; exit 1
fi
nvidia-smi >"$LOGDIR/nvidia-smi.log" 2>&1
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')

# compute-sanitizer does not attach to MPS clients: run it before the daemon starts.
if phase sanitize && command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck; do
        log "compute-sanitizer $tool, 2 ranks"
        if timeout 200 compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 9 \
            env EPX_GPU_TEST_RANKS=2 EPX_GPU_TEST_QUICK=1 "$BUILD/tests/gpu_ht_ipc" >"$LOGDIR/sanitizer-$tool.log" 2>&1; then
            log "  $tool clean: $(grep -h 'ERROR SUMMARY' "$LOGDIR/sanitizer-$tool.log" | sort | uniq -c | tr '\n' ' ')"
        else
            log "  $tool FAILED (see sanitizer-$tool.log)"; status=1
        fi
    done
    log "compute-sanitizer memcheck, routing map, 2 ranks"
    if timeout 150 compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 \
        env EPX_GPU_TEST_RANKS=1,2 EPX_GPU_TEST_QUICK=1 "$BUILD/tests/gpu_rm" >"$LOGDIR/sanitizer-rm.log" 2>&1; then
        log "  rm memcheck clean"
    else
        log "  rm memcheck FAILED (see sanitizer-rm.log)"; status=1
    fi
    for tool in memcheck racecheck; do
        log "compute-sanitizer $tool, loop transport, 3 emulated nodes, normal and strict"
        if timeout 200 compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 9 \
            env EPX_NET_TEST_TRANSPORT=loop EPX_LOOP_TEST_SPLITS=3x1 EPX_GIN_TEST_ITERATIONS=5 \
            "$BUILD/tests/gin_transport/gpu_net_host" >"$LOGDIR/sanitizer-loop-$tool.log" 2>&1; then
            log "  loop $tool clean"
        else
            log "  loop $tool FAILED (see sanitizer-loop-$tool.log)"; status=1
        fi
    done
    # LL across 2 emulated nodes over the loop transport: memcheck in strict mode (queued puts landed by
    # other threads), racecheck in normal mode.
    for run in "memcheck 1" "racecheck 0"; do
        set -- $run
        log "compute-sanitizer $1, ll across 2 nodes, loop transport (strict $2)"
        if timeout 200 compute-sanitizer --tool "$1" --target-processes all --error-exitcode 9 \
            env EPX_GPU_TEST_NODES=1 EPX_TEST_NODE_SPLITS=2x1 EPX_NET_TRANSPORT=loop EPX_NET_LOOP_STRICT="$2" \
            EPX_GPU_TEST_QUICK=1 "$BUILD/tests/gpu_ll" >"$LOGDIR/sanitizer-ll-nodes-$1.log" 2>&1; then
            log "  ll nodes $1 clean"
        else
            log "  ll nodes $1 FAILED (see sanitizer-ll-nodes-$1.log)"; status=1
        fi
    done
    log "compute-sanitizer memcheck, ll, 2 ranks"
    if timeout 150 compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 \
        env EPX_GPU_TEST_RANKS=2 EPX_GPU_TEST_QUICK=1 "$BUILD/tests/gpu_ll" >"$LOGDIR/sanitizer-ll.log" 2>&1; then
        log "  ll memcheck clean"
    else
        log "  ll memcheck FAILED (see sanitizer-ll.log)"; status=1
    fi
fi

mps_start "$NGPU"

if phase tests; then
    # The issue-level repeat counts: LL runs 1000 dispatch+combine iterations with matching hashes.
    export EPX_GPU_TEST_LL_ITERS=${EPX_GPU_TEST_LL_ITERS:-1000}
    log "ctest -L gpu"
    if ctest --test-dir "$BUILD" -L gpu -R "${EPX_GPU_CTEST_REGEX:-.}" --output-on-failure \
        --timeout "${EPX_GPU_CTEST_TIMEOUT:-300}" \
        >"$LOGDIR/ctest-gpu.log" 2>&1; then
        log "  gpu tests passed"
    else
        log "  gpu tests FAILED"; status=1
    fi
    grep -E "tests passed|Passed|Failed|\*\*\*" "$LOGDIR/ctest-gpu.log" | tee -a "$LOGDIR/summary.log"
    # The ipc transport's kinds by name (the run above took the default, auto): the virtual-memory regions
    # passed as file descriptors, which must work here (no silent fallback), then the legacy handles.
    for kind in fd legacy; do
        log "gpu.ht_ipc with EPX_CUDA_IPC=$kind"
        if EPX_CUDA_IPC=$kind EPX_DEBUG=info EPX_DEBUG_SUBSYS=ipc timeout 200 "$BUILD/tests/gpu_ht_ipc" >"$LOGDIR/ipc-$kind.log" 2>&1 &&
            grep -q "peer regions of .* ($kind)" "$LOGDIR/ipc-$kind.log"; then
            log "  passed ($(grep -m1 -o "mapped [0-9]* peer regions of [0-9]* bytes ($kind)" "$LOGDIR/ipc-$kind.log"))"
        else
            log "  FAILED (see ipc-$kind.log)"; tail -5 "$LOGDIR/ipc-$kind.log"; status=1
        fi
    done
    # auto after a failed import on rank 1 (EPX_TEST_FAULT_IPC): every rank starts over with legacy handles.
    log "gpu.ht_ipc with EPX_CUDA_IPC=auto and rank 1's imports failed"
    if EPX_TEST_FAULT_IPC=1 EPX_GPU_TEST_RANKS=2,4 EPX_DEBUG=info EPX_DEBUG_SUBSYS=ipc timeout 200 \
        "$BUILD/tests/gpu_ht_ipc" >"$LOGDIR/ipc-fallback.log" 2>&1 &&
        grep -q "peer regions of .* (legacy)" "$LOGDIR/ipc-fallback.log" &&
        grep -q "legacy CUDA IPC instead" "$LOGDIR/ipc-fallback.log"; then
        log "  passed (fell back to legacy handles)"
    else
        log "  FAILED (see ipc-fallback.log)"; tail -5 "$LOGDIR/ipc-fallback.log"; status=1
    fi
    # A rank killed inside the descriptor exchange (EPX_TEST_FAULT_SHM=1:2): the survivor reports the
    # dead peer, and no fallback to legacy handles is tried (taken only when every rank saw the failure).
    log "gpu.ht_ipc, 2 ranks, rank 1 killed in the descriptor exchange"
    EPX_TEST_FAULT_SHM=1:2 EPX_GPU_TEST_RANKS=2 EPX_GPU_TEST_QUICK=1 EPX_DEBUG=info EPX_DEBUG_SUBSYS=ipc \
        timeout 100 "$BUILD/tests/gpu_ht_ipc" >"$LOGDIR/ipc-deadpeer.log" 2>&1
    if grep -qE "epx_buffer_create.* returned ERR_(REMOTE|BOOTSTRAP)" "$LOGDIR/ipc-deadpeer.log" &&
        ! grep -q "legacy CUDA IPC instead" "$LOGDIR/ipc-deadpeer.log"; then
        log "  passed ($(grep -m1 -oE "returned ERR_(REMOTE|BOOTSTRAP).*" "$LOGDIR/ipc-deadpeer.log" | cut -c1-160))"
    else
        log "  FAILED (see ipc-deadpeer.log)"; tail -8 "$LOGDIR/ipc-deadpeer.log"; status=1
    fi
    # The fault-injection kill test (docs/fault.md) on the cuda backend: ranks killed at random points
    # of init, buffer creation and every mode's loop; its table goes to the summary.
    log "fault kill test, cuda backend: ${EPX_GPU_FAULT_TRIALS:-40} trials, 2..4 ranks"
    if timeout 300 "$BUILD/tests/fault/fault_kill" --backend cuda --trials "${EPX_GPU_FAULT_TRIALS:-40}" \
        --max-ranks 4 >"$LOGDIR/fault-cuda.log" 2>&1; then
        log "  fault kill test passed"
    else
        log "  fault kill test FAILED (see fault-cuda.log)"; status=1
    fi
    sed -n '/^class/,$p' "$LOGDIR/fault-cuda.log" | tee -a "$LOGDIR/summary.log"
fi
phase bench || { log "done, status $status"; exit $status; }

# Benchmark rows, each next to its same-run ceiling or floor (epx-bench -h lists the flags; every
# output is checked). bench NAME SECONDS ARGS... keeps the table in bench-NAME.log.
BENCH=$BUILD/tools/epx-bench
bench() {
    local name=$1 secs=$2
    shift 2
    log "epx-bench $name: $*"
    timeout "$secs" "$BENCH" -B cuda "$@" >"$LOGDIR/bench-$name.log" 2>&1 ||
        { log "  epx-bench $name FAILED"; status=1; }
    cat "$LOGDIR/bench-$name.log" | tee -a "$LOGDIR/summary.log"
}
if [ -x "$BENCH" ]; then
    # HT, default and view mode, with the plain-copy ceiling: 8 ranks, 4096 tokens per rank, H 7168,
    # top-8, 256 experts, 16 SMs per rank, bf16 and fp8 dispatch, bf16 combine.
    for d in bf16 fp8; do
        bench "ht-$d" 150 -o ht,view -r 8 -t 4096 -H 7168 -k 8 -E 256 -S 16 -n 20 -w 3 -d "$d"
    done
    # Routing map: dispatch with permute / combine with unpermute, 4096 tokens per rank, H 7168, top-8,
    # no padding; 8 local experts per rank (8 ranks, 16 SMs each), then R = 1 with 256 local experts.
    bench rm-r8 120 -o permute -r 8 -t 4096 -H 7168 -k 8 -L 8 -p 1 -S 16 -n 20 -w 3
    bench rm-r1 90 -o permute -r 1 -t 4096 -H 7168 -k 8 -L 256 -p 1 -n 20 -w 3
    # The same with every SM of the GPU (a rank alone on it), as torch's kernels run in the baseline below.
    bench rm-r1-allsm 90 -o permute -r 1 -t 4096 -H 7168 -k 8 -L 256 -p 1 -n 20 -w 3 -S 132
fi
if python3 -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1; then
    log "torch permute baseline"
    timeout 120 python3 "$ROOT/bench/torch_permute.py" >"$LOGDIR/torch-permute.log" 2>&1 ||
        { log "  torch baseline FAILED"; status=1; }
    cat "$LOGDIR/torch-permute.log" | tee -a "$LOGDIR/summary.log"
fi
# LL: 128 tokens per rank, H 7168, top-8, 256 experts, 8 ranks with 16 SMs each: dispatch fp8,
# combine bf16, their hook halves and the same-run floor.
if [ -x "$BENCH" ]; then
    bench ll-r8 120 -o ll -r 8 -t 128 -H 7168 -k 8 -E 256 -S 16 -n 50 -w 5 -d fp8
    # The same view and LL rows over legacy IPC handles, in the same run: what the fd regions change.
    if [ "${EPX_GPU_IPC_AB:-1}" = 1 ]; then
        export EPX_CUDA_IPC=legacy
        bench view-bf16-legacy 120 -o view -r 8 -t 4096 -H 7168 -k 8 -E 256 -S 16 -n 20 -w 3 -d bf16
        bench ll-r8-legacy 120 -o ll -r 8 -t 128 -H 7168 -k 8 -E 256 -S 16 -n 50 -w 5 -d fp8
        unset EPX_CUDA_IPC
    fi
fi
log "done, status $status"
exit $status
