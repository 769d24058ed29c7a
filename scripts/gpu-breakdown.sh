#!/usr/bin/env bash
# Where the time of an LL call goes, and what each SM buys, on the GPU machine: epx-bench rows that
# differ in one factor each, so differences place the time. Usage: scripts/gpu-breakdown.sh LOGDIR.
#  1. ncu, one rank alone (no MPS: ncu does not profile MPS clients): the LL kernels' duration, DRAM
#     and L2 throughput, occupancy. ncu replays each profiled kernel; LL kernels wait on peers, so a
#     single rank (its own only peer) is what can be replayed.
#  2. LL, 128 tokens per rank: ranks 1, 2, 4, 8 sharing the GPU under MPS at 16 SMs each (what sharing
#     costs), then 8 ranks at 32 to 512 tokens (fixed cost against cost per byte).
#  2b. --timeline at 8 and 4 ranks: every rank's LL kernels (start, end) on the GPU's clock.
#  3. SM sweep at 8 ranks: LL and HT view mode with 4, 8, 16 and 24 SMs per rank.
#  4. (EPX_BREAKDOWN_COMPAT=1) bench/compat_profile.py at 2 and 8 ranks: where the time of the DeepEP
#     front's full dispatch goes (layout, notify exchange, data dispatch), with the profiler's kernel list.
# Every step under `timeout`; the whole within EPX_BREAKDOWN_BUDGET_S (default 300). Builds in
# EPX_BUILD_DIR (default build-gpu, shared with gpu-test.sh) unless EPX_BREAKDOWN_NOBUILD=1.
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOGDIR=${1:?usage: gpu-breakdown.sh LOGDIR}
mkdir -p "$LOGDIR" && LOGDIR=$(cd "$LOGDIR" && pwd)
BUILD=${EPX_BUILD_DIR:-$ROOT/build-gpu}
BUDGET=${EPX_BREAKDOWN_BUDGET_S:-300}
START=$(date +%s)
: >"$LOGDIR/summary.log"
log() { echo "[$(($(date +%s) - START)) s] $*" | tee -a "$LOGDIR/summary.log"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }

# shellcheck source=scripts/mps.sh
. "$ROOT/scripts/mps.sh"
mps_init epx-breakdown-mps

if [ "${EPX_BREAKDOWN_NOBUILD:-0}" != 1 ]; then
    log "build (cuda on) in $BUILD"
    timeout 200 cmake -S "$ROOT" -B "$BUILD" -DEPX_CUDA=ON -DCMAKE_BUILD_TYPE=Release >"$LOGDIR/cmake.log" 2>&1 &&
        timeout 300 cmake --build "$BUILD" --target epx-bench -j"$(nproc)" >"$LOGDIR/build.log" 2>&1 ||
        { log "build FAILED"; tail -20 "$LOGDIR/build.log"; exit 1; }
fi
BENCH=$BUILD/tools/epx-bench
COMMON=(-B cuda -H 7168 -k 8 -E 256)

# row NAME SECONDS ARGS...: the table lines of one epx-bench run, prefixed with NAME.
row() {
    local name=$1 secs=$2
    shift 2
    if [ "$(left)" -lt 15 ]; then
        log "$name: skipped (the budget of $BUDGET s is spent)"
        return
    fi
    [ "$secs" -gt "$(($(left) - 5))" ] && secs=$(($(left) - 5))
    timeout -k 5 "$secs" "$BENCH" "${COMMON[@]}" "$@" >"$LOGDIR/$name.log" 2>&1 ||
        log "$name: FAILED or timed out (exit $?; $name.log)"
    grep -E '^(ll|view)-|^# (ll timeline|sample|rank +[0-9])|^#   ' "$LOGDIR/$name.log" | sed "s/^/$name  /" |
        tee -a "$LOGDIR/summary.log"
}

# 1. ncu, one rank, no MPS.
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
if [ -n "$NCU" ]; then
    log "ncu: one rank, LL fp8, 128 tokens (kernels ll_*, one launch each after warm-up)"
    timeout 120 "$NCU" --clock-control none --target-processes all --kernel-name regex:'ll_(dispatch|combine)_' \
        --launch-skip 8 --launch-count 4 --section SpeedOfLight --section LaunchStats --section Occupancy \
        "$BENCH" "${COMMON[@]}" -o ll -r 1 -t 128 -S 16 -n 3 -w 1 -d fp8 >"$LOGDIR/ncu-ll-r1.log" 2>&1 ||
        log "ncu: exit $? (ncu-ll-r1.log)"
    grep -E '^  [a-z_]+_kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Grid Size|Block Size' \
        "$LOGDIR/ncu-ll-r1.log" | sed 's/^/ncu  /' | tee -a "$LOGDIR/summary.log"
else
    log "ncu: not found"
fi

mps_start 1
# 2. LL: ranks sharing the GPU, then tokens per rank.
for r in 1 2 4 8; do row "ll-r$r-t128" 60 -o ll -r "$r" -t 128 -S 16 -n 50 -w 5 -d fp8; done
row ll-r8-tsweep 90 -o ll -r 8 -b 32 -e 512 -f 4 -S 16 -n 30 -w 5 -d fp8
# Every rank's LL kernels on the GPU's clock (--timeline), 8 and 4 ranks.
row ll-r8-timeline 60 -o ll -r 8 -t 128 -S 16 -n 10 -w 3 -d fp8 --timeline
row ll-r4-timeline 60 -o ll -r 4 -t 128 -S 16 -n 10 -w 3 -d fp8 --timeline
# 3. SM sweep, 8 ranks.
for s in 4 8 16 24; do row "ll-r8-s$s" 45 -o ll -r 8 -t 128 -S "$s" -n 30 -w 5 -d fp8; done
for s in 4 8 16 24; do row "view-r8-s$s" 60 -o view -r 8 -t 4096 -S "$s" -n 10 -w 2 -d bf16; done
# 4. The compat front's full dispatch, part by part.
if [ "${EPX_BREAKDOWN_COMPAT:-0}" = 1 ]; then
    PY=/opt/torch/.venv/bin/python3
    log "EPX_PYTHON_CUDA=1 pip install (the torch venv)"
    if timeout 200 env EPX_PYTHON_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps --no-index . \
        >"$LOGDIR/pip-install.log" 2>&1; then
        for r in 2 8; do
            [ "$(left)" -lt 40 ] && { log "compat-r$r: skipped (budget)"; continue; }
            log "compat_profile R=$r"
            timeout -k 5 $(($(left) - 10 < 120 ? $(left) - 10 : 120)) "$PY" "$ROOT/bench/compat_profile.py" \
                --ranks "$r" --iters 20 --warmup 5 --native-views 1 --deadline 100 \
                >"$LOGDIR/compat-r$r.log" 2>&1 || log "compat-r$r: exit $?"
            tail -45 "$LOGDIR/compat-r$r.log" | tee -a "$LOGDIR/summary.log"
        done
    else
        log "pip install FAILED (pip-install.log)"
    fi
fi
log "done"
