#!/usr/bin/env bash
# Runs gpu.gin_host on the GPU machine: libepx's own GIN host setup (src/net/gin_host.c) through NCCL's
# proxy path and the test GIN plugin, one emulated node per rank. Builds libepx, the plugin
# (nccl-net-epxtest) and the test (gpu_net_host, transport gin) against the torch venv's pip NCCL found as
# scripts/gpu-gin-probe.sh finds it (the toolkit's when the wheel lacks the device headers), then runs the
# test with 2 ranks and with 4 (each: ring rounds, a 1000-iteration soak, a dead-peer case) and the LL suite
# across 2, 4 and 8 emulated nodes over GIN (gpu_ll; opt-in, EPX_GIN_LL=1: it does not pass yet), under a private
# MPS daemon, NCCL_DEBUG=INFO into one file per process. Every step under `timeout`, the whole within
# EPX_GIN_TEST_BUDGET_S seconds (default 540); a build directory kept from an earlier run (EPX_BUILD_DIR)
# makes the build quick. Ends with a table of each step's verdict and one line: gin-test verdict: PASS|FAIL.
# Usage: scripts/gpu-gin-test.sh [LOGDIR]
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOGDIR=${1:-$ROOT/gin-test-logs}
mkdir -p "$LOGDIR" && LOGDIR=$(cd "$LOGDIR" && pwd)
BUILD=${EPX_BUILD_DIR:-$ROOT/build-gintest}
PY=${EPX_TORCH_PYTHON:-/opt/torch/.venv/bin/python}
BUDGET=${EPX_GIN_TEST_BUDGET_S:-540}
START=$(date +%s)
STEPS=()    # "name|verdict|seconds"
FAILED=0
: >"$LOGDIR/summary.log"
log() { echo "[$(($(date +%s) - START)) s] $*" | tee -a "$LOGDIR/summary.log"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }
step() {  # name verdict seconds
    STEPS+=("$1|$2|$3")
    log "verdict $1: $2"
    case $2 in ok* | PASS* | skipped*) ;; *) FAILED=1 ;; esac
}
# Seconds for a step: at most `want`, never past the budget less `keep` for what follows.
secs_for() {  # want keep
    local s=$(($(left) - $2))
    [ "$s" -gt "$1" ] && s=$1
    echo "$s"
}

# shellcheck source=scripts/mps.sh
. "$ROOT/scripts/mps.sh"
# shellcheck source=scripts/pip-nccl.sh
. "$ROOT/scripts/pip-nccl.sh"
mps_init epx-gin-test-mps
finish() {
    mps_stop
    {
        echo "==== gin test summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(($(date +%s) - START)) s, logs in $LOGDIR)"
        printf '  %-16s %6s  %s\n' step seconds verdict
        local s name verdict secs
        for s in "${STEPS[@]}"; do
            IFS='|' read -r name verdict secs <<<"$s"
            printf '  %-16s %6s  %s\n' "$name" "$secs" "$verdict"
        done
        if [ "$FAILED" = 0 ] && [ "${#STEPS[@]}" -gt 0 ]; then
            echo "gin-test verdict: PASS"
        else
            echo "gin-test verdict: FAIL"
        fi
    } | tee -a "$LOGDIR/summary.log"
}
trap finish EXIT

# ---- NCCL from the venv's pip package: the root holding include/nccl.h and lib/libnccl.so* ----------
t0=$(date +%s)
NCCL_ROOT=$(pip_nccl "$PY" "$LOGDIR/nccl-find.log")
if [ -z "$NCCL_ROOT" ]; then
    step nccl "FAILED: no pip NCCL (include/nccl.h + lib/libnccl.so*) under $PY's site-packages" $(($(date +%s) - t0))
    exit 1
fi
NCCL_VER=$(pip_nccl_version "$NCCL_ROOT")
step nccl "ok: pip NCCL $NCCL_VER in $NCCL_ROOT" $(($(date +%s) - t0))
timeout 30 nvidia-smi >"$LOGDIR/nvidia-smi.log" 2>&1
NGPU=$(timeout 30 nvidia-smi -L 2>/dev/null | grep -c '^GPU')

# ---- configure and build: libepx, the plugin, the test --------------------------------------------
FOUND='epx: NCCL [0-9][0-9.]* found.*'
configure() {  # LOG, extra cmake arguments; 0 when NCCL was found and the GIN host setup is on
    local out=$LOGDIR/$1
    shift
    timeout "$(secs_for 120 100)" cmake -S "$ROOT" -B "$BUILD" -DEPX_CUDA=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DEPX_BUILD_TOOLS=OFF "$@" >"$out" 2>&1 &&
        grep -q "$FOUND" "$out" && grep -q 'epx: GIN host setup ON' "$out"
}
t0=$(date +%s)
if configure cmake.log -DEPX_NCCL_HOME="$NCCL_ROOT"; then
    step configure "ok: $(grep -o "$FOUND" "$LOGDIR/cmake.log" | tail -1)" $(($(date +%s) - t0))
elif configure cmake-fallback.log -DEPX_NCCL_HOME=; then
    # The wheel may lack nccl_device.h: the toolkit's headers, whose major.minor epx_gin_open checks against
    # the libnccl it loads.
    step configure "ok with the fallback: $(grep -o "$FOUND" "$LOGDIR/cmake-fallback.log" | tail -1)" \
        $(($(date +%s) - t0))
else
    step configure "FAILED: no usable NCCL >= 2.28 with nccl_device.h, or no GIN host setup (cmake*.log)" \
        $(($(date +%s) - t0))
    exit 1
fi
t0=$(date +%s)
if ! timeout "$(secs_for 170 45)" cmake --build "$BUILD" --target nccl-net-epxtest gpu_net_host gpu_ll \
    -j"$(nproc)" >"$LOGDIR/build.log" 2>&1; then
    step build "FAILED or out of time (build.log; a rerun with EPX_BUILD_DIR=$BUILD resumes it)" \
        $(($(date +%s) - t0))
    tail -20 "$LOGDIR/build.log"
    exit 1
fi
TEST=$BUILD/tests/gin_transport/gpu_net_host
PLUGIN=$BUILD/tests/gin_plugin/libnccl-net-epxtest.so
step build "ok: $(readelf -d "$TEST" 2>/dev/null | grep -o 'runpath: \[[^]]*\]' | head -1)" $(($(date +%s) - t0))

# ---- runs ---------------------------------------------------------------------------------------------
export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET
export EPX_GIN_TEST_PLUGIN=$PLUGIN
export EPX_TIMEOUT_MS=${EPX_TIMEOUT_MS:-15000}
mps_start "$NGPU"
if [ "$MPS_STARTED" = 1 ]; then
    step mps "ok: ranks share the GPU under a private MPS daemon" 0
else
    step mps "ok: not started, ranks time-slice the GPU" 0
fi

# run R: gpu_net_host (transport gin) with R ranks; stdout/stderr to ranks-R.log, NCCL's log to nccl-R/<host>.<pid>.log.
run() {
    local r=$1 secs rc line t0
    t0=$(date +%s)
    secs=$(secs_for 110 5)
    if [ "$secs" -lt 30 ]; then
        step "ranks-$r" "FAILED: not run, the time budget ($BUDGET s) is spent" 0
        return 1
    fi
    mkdir -p "$LOGDIR/nccl-$r"
    log "run $r ranks ($secs s at most)"
    NCCL_DEBUG_FILE="$LOGDIR/nccl-$r/%h.%p.log" EPX_GPU_TEST_RANKS=$r EPX_NET_TEST_TRANSPORT=gin \
        timeout -k 10 "$secs" "$TEST" >"$LOGDIR/ranks-$r.log" 2>&1
    rc=$?
    grep -E '^gin host( dead peer)?: [0-9]+ ranks: |FAILED' "$LOGDIR/ranks-$r.log" | head -20 | tee -a "$LOGDIR/summary.log"
    case $rc in
    0) line="PASS: ring rounds bit-exact, soak hashes equal across ranks, dead peer seen, closes bounded" ;;
    77) line="FAILED: skipped ($(tail -1 "$LOGDIR/ranks-$r.log"))" ;;
    124 | 137) line="FAILED: timed out after $secs s (last: $(tail -1 "$LOGDIR/ranks-$r.log"))" ;;
    *) line="FAILED: exit $rc: $(grep -m1 'FAILED' "$LOGDIR/ranks-$r.log" || tail -1 "$LOGDIR/ranks-$r.log")" ;;
    esac
    step "ranks-$r" "$line" $(($(date +%s) - t0))
    # Whether NCCL took the plugin's GIN table (any process's log says so).
    local want
    for want in "Loaded gin plugin EPX_GIN_TEST" "Assigned GIN plugin EPX_GIN_TEST"; do
        if grep -rqs "$want" "$LOGDIR/nccl-$r" "$LOGDIR/ranks-$r.log"; then
            step "log-$r" "ok: '$want' present" 0
        else
            step "log-$r" "FAILED: '$want' absent (nccl-$r/)" 0
        fi
    done
    return $rc
}
run 2
run 4
# The LL kernels across nodes over GIN (src/kernels/ll_net.cu): gpu_ll's suite on 2, 4 and 8 emulated nodes
# of one rank each, bit-exact against the reference, a 200-iteration soak, a silent and a killed peer.
ll_gin() {
    local t0 secs rc
    t0=$(date +%s)
    secs=$(secs_for 300 5)
    mkdir -p "$LOGDIR/nccl-ll"
    log "ll across ${EPX_GIN_LL_SPLITS:-2x1,4x1,8x1} nodes over gin ($secs s at most)"
    NCCL_DEBUG_FILE="$LOGDIR/nccl-ll/%h.%p.log" EPX_GPU_TEST_NODES=1 \
        EPX_TEST_NODE_SPLITS=${EPX_GIN_LL_SPLITS:-2x1,4x1,8x1} EPX_NET_TRANSPORT=gin \
        EPX_GPU_TEST_LL_ITERS=${EPX_GIN_LL_ITERS:-200} timeout -k 10 "$secs" "$BUILD/tests/gpu_ll" >"$LOGDIR/ll-gin.log" 2>&1
    rc=$?
    grep -E '^ll: |FAILED' "$LOGDIR/ll-gin.log" | grep -v stale | head -20 | tee -a "$LOGDIR/summary.log"
    if [ "$rc" = 0 ]; then
        step ll-gin "PASS: every LL case bit-exact, soak, silent and killed peer" $(($(date +%s) - t0))
    else
        step ll-gin "FAILED: exit $rc ($(grep -m1 -E 'FAILED|failed' "$LOGDIR/ll-gin.log" || tail -1 "$LOGDIR/ll-gin.log"))" \
            $(($(date +%s) - t0))
    fi
}
# Opt-in (EPX_GIN_LL=1): in its first runs rank 1's first dispatch of a double-buffered pair never
# signalled its rows and that rank hung past the deadline (docs/network.md, "What ran where").
[ "${EPX_GIN_LL:-0}" = 1 ] && ll_gin
log "done"

# The exit status is the verdict: 0 on PASS.
exit "$FAILED"
