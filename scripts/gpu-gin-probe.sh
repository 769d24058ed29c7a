#!/usr/bin/env bash
# Answers, on the GPU machine, whether NCCL (the torch venv's pip package) loads epx's test GIN plugin and
# runs GIN put / signal kernels through its proxy (CPU-assisted) path: builds only the plugin
# (nccl-net-epxtest) and the probe (gin_probe) against the venv's NCCL, runs the probe with 2 then 4 ranks
# (one emulated node each) under a private MPS daemon with NCCL's INFO log, prints the NCCL lines that show
# the plugin and its GIN table were taken, and runs once without the plugin for NCCL's own failure.
# Diagnostic runs (windows registered after the device communicator; no MPS) follow only when the first
# run fails. Usage: scripts/gpu-gin-probe.sh [LOGDIR]. Every step under `timeout`; the whole within
# EPX_GIN_PROBE_BUDGET_S seconds (default 540). Ends with a summary of each step's verdict.
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOGDIR=${1:-$ROOT/gin-probe-logs}
mkdir -p "$LOGDIR" && LOGDIR=$(cd "$LOGDIR" && pwd)
BUILD=${EPX_BUILD_DIR:-$ROOT/build-ginprobe}
PY=${EPX_TORCH_PYTHON:-/opt/torch/.venv/bin/python}
BUDGET=${EPX_GIN_PROBE_BUDGET_S:-540}
START=$(date +%s)
VERDICTS=()
: >"$LOGDIR/summary.log"
log() { echo "[$(($(date +%s) - START)) s] $*" | tee -a "$LOGDIR/summary.log"; }
verdict() { VERDICTS+=("$1: $2"); log "verdict $1: $2"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }

# shellcheck source=scripts/mps.sh
. "$ROOT/scripts/mps.sh"
# shellcheck source=scripts/pip-nccl.sh
. "$ROOT/scripts/pip-nccl.sh"
mps_init epx-gin-mps
finish() {
    mps_stop
    {
        echo "==== gin probe summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), logs in $LOGDIR)"
        for v in "${VERDICTS[@]}"; do echo "  $v"; done
    } | tee -a "$LOGDIR/summary.log"
}
trap finish EXIT

# ---- NCCL from the venv's pip package: the root holding include/nccl.h and lib/libnccl.so* ----------
NCCL_ROOT=$(pip_nccl "$PY" "$LOGDIR/nccl-find.log")
if [ -z "$NCCL_ROOT" ]; then
    verdict nccl "FAILED: no pip NCCL (include/nccl.h + lib/libnccl.so*) under $PY's site-packages"
    exit 1
fi
NCCL_LIB=$NCCL_ROOT/lib
NCCL_VER=$(pip_nccl_version "$NCCL_ROOT")
log "pip NCCL $NCCL_VER in $NCCL_ROOT (nccl_device.h: $([ -f "$NCCL_ROOT/include/nccl_device.h" ] && echo yes || echo no))"
nvidia-smi >"$LOGDIR/nvidia-smi.log" 2>&1
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')

# ---- build: the plugin and the probe only ------------------------------------------------------------
FOUND='epx: NCCL [0-9][0-9.]* found.*'
configure() {  # LOG, extra cmake arguments; 0 when NCCL was found
    local out=$LOGDIR/$1
    shift
    timeout 300 cmake -S "$ROOT" -B "$BUILD" -DEPX_CUDA=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >"$out" 2>&1 &&
        grep -q "$FOUND" "$out"
}
log "configure against $NCCL_ROOT"
if configure cmake.log -DEPX_NCCL_HOME="$NCCL_ROOT"; then
    verdict configure "ok: $(grep -o "$FOUND" "$LOGDIR/cmake.log" | tail -1)"
else
    # The wheel may lack the device headers: fall back to the discovery's other candidates (the toolkit's);
    # the probe refuses a libnccl whose major.minor differs from its headers.
    log "NCCL from $NCCL_ROOT not usable ($(grep -o 'epx: NCCL not found.*' "$LOGDIR/cmake.log" | tail -1)); trying the toolkit's"
    if configure cmake-fallback.log -DEPX_NCCL_HOME=; then
        verdict configure "ok with the fallback: $(grep -o "$FOUND" "$LOGDIR/cmake-fallback.log" | tail -1)"
    else
        verdict configure "FAILED: no usable NCCL >= 2.28 with nccl_device.h (cmake.log)"
        exit 1
    fi
fi
TARGETS=$(timeout 60 cmake --build "$BUILD" --target help 2>/dev/null)
if ! grep -q gin_probe <<<"$TARGETS"; then
    verdict build "FAILED: no gin_probe target: tests/CMakeLists.txt lacks add_subdirectory(gin_probe)"
    exit 1
fi
log "build nccl-net-epxtest and gin_probe"
if ! timeout 400 cmake --build "$BUILD" --target nccl-net-epxtest gin_probe -j"$(nproc)" >"$LOGDIR/build.log" 2>&1; then
    verdict build "FAILED (build.log)"
    tail -30 "$LOGDIR/build.log"
    exit 1
fi
PLUGIN=$BUILD/tests/gin_plugin/libnccl-net-epxtest.so
PROBE=$BUILD/tests/gin_probe/gin_probe
verdict build "ok: exports $(nm -D --defined-only "$PLUGIN" | grep -o 'ncclGinPlugin_v11\|ncclNetPlugin_v11' | paste -sd' ')"
export LD_LIBRARY_PATH=$NCCL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET

# probe NAME SECONDS ARGS...: one run into NAME.log; records its verdict line; 0 on PASS.
probe() {
    local name=$1 secs=$2 rc
    shift 2
    if [ "$(left)" -lt 30 ]; then
        verdict "$name" "skipped: the time budget ($BUDGET s) is spent"
        return 2
    fi
    [ "$secs" -gt "$(($(left) - 10))" ] && secs=$(($(left) - 10))
    log "run $name ($secs s at most): gin_probe $*"
    timeout -k 10 "$secs" "$PROBE" "$@" >"$LOGDIR/$name.log" 2>&1
    rc=$?
    sed -n '/^gin-probe summary/,/^gin-probe verdict/p' "$LOGDIR/$name.log" | tee -a "$LOGDIR/summary.log"
    local line
    line=$(grep -m1 '^gin-probe verdict' "$LOGDIR/$name.log" | sed 's/^gin-probe verdict: //')
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        line="TIMED OUT after $secs s (last lines: $(tail -2 "$LOGDIR/$name.log" | tr '\n' ' '))"
    fi
    verdict "$name" "${line:-no verdict line, exit $rc (see $name.log)}"
    return $rc
}

# The NCCL INFO / WARN lines that show whether the plugin, its net table and its GIN table were taken.
plugin_lines() {
    log "$1: NCCL's plugin and GIN lines (counted over all ranks)"
    local pattern="NET/Plugin|Loaded (net|gin) plugin|Assigned (NET|GIN) plugin|Initialized NET plugin"
    pattern+="|external network plugin|EPX_GIN_TEST|GIN|NCCL WARN"
    grep -E "$pattern" \
        "$LOGDIR/$1.log" | sed -E 's/^[^ ]+:[0-9]+:[0-9]+ //; s/ \[[0-9]+\]//' | sort | uniq -c | sort -rn | head -40 |
        tee -a "$LOGDIR/summary.log"
    local want
    for want in "Loaded net plugin EPX_GIN_TEST" "Loaded gin plugin EPX_GIN_TEST" "Assigned GIN plugin EPX_GIN_TEST" \
        "EPX_GIN_TEST: GIN plugin (proxy type" "EPX_GIN_TEST: rank .* connected"; do
        if grep -q "$want" "$LOGDIR/$1.log"; then
            VERDICTS+=("$1 log: '$want' present")
        else
            VERDICTS+=("$1 log: '$want' ABSENT")
        fi
    done
}

mps_start "$NGPU"
if [ "$MPS_STARTED" = 1 ]; then
    verdict mps "ranks share the GPU under a private MPS daemon"
else
    verdict mps "not started: ranks time-slice the GPU"
fi

# 1. The question itself: 2 ranks, then 4, through the plugin.
probe plugin-2ranks 170 -p "$PLUGIN" -n 2 -i 1000 -t 40 -k 8000
first=$?
plugin_lines plugin-2ranks
probe plugin-4ranks 170 -p "$PLUGIN" -n 4 -i 1000 -t 40 -k 8000
# 2. For the record: NCCL's own failure with no GIN backend ("GIN not supported").
probe no-plugin 80 -P -n 2 -i 0 -t 30 -k 5000
if grep -q '^gin-probe verdict: FAIL.*stage devcomm-create' "$LOGDIR/no-plugin.log"; then
    VERDICTS+=("no-plugin: failed at devcomm-create, as expected without a GIN backend")
fi
if grep -q "GIN not supported" "$LOGDIR/no-plugin.log"; then
    VERDICTS+=("no-plugin log: NCCL says 'GIN not supported' (expected without a GIN backend)")
else
    VERDICTS+=("no-plugin log: no 'GIN not supported' line (see no-plugin.log)")
fi
# 3. Diagnostics, only when the first run failed: the other registration order, then no MPS.
if [ $first -ne 0 ]; then
    probe plugin-2ranks-devcomm-first 120 -p "$PLUGIN" -n 2 -i 100 -d -t 40 -k 8000
    if [ "$MPS_STARTED" = 1 ]; then
        mps_stop
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        probe plugin-2ranks-no-mps 120 -p "$PLUGIN" -n 2 -i 100 -t 40 -k 8000
    fi
fi
# The answer, from the first run.
first_verdict=$(grep -m1 '^gin-probe verdict' "$LOGDIR/plugin-2ranks.log" | sed 's/^gin-probe verdict: //')
if [ $first -eq 0 ]; then
    answer="YES: NCCL $NCCL_VER loaded the plugin; the kernels' GIN puts and signals went through NCCL's proxy"
    answer+=" path bit-exactly (plugin-2ranks; plugin-4ranks above)"
elif ! grep -q "stage comm-init ok" "$LOGDIR/plugin-2ranks.log"; then
    answer="UNDETERMINED: the run failed before NCCL's communicator existed: $first_verdict"
elif ! grep -q "Loaded gin plugin EPX_GIN_TEST" "$LOGDIR/plugin-2ranks.log"; then
    answer="NO (evidence for blocked): NCCL $NCCL_VER did not take the plugin's GIN table; see its lines above"
else
    answer="NOT YET: NCCL took the plugin's GIN table, but the run failed: $first_verdict"
fi
verdict answer "$answer"
log "done"
