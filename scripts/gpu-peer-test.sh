#!/usr/bin/env bash
# Runs the DeepEP measuring kit (kept beside the project, not part of it: it builds DeepEP V1 on the
# GPU machine, prints DeepEP and epx side by side and runs DeepEP's own tests against
# epx.compat.deep_ep) and turns its summary into a verdict. Usage:
#   scripts/gpu-peer-test.sh KIT_DIR LOGDIR [--check FILE]
# KIT_DIR: the kit's folder (a copy of it inside the tree, e.g. build-peer, travels to the GPU machine).
# The kit's knobs pass through (PEER_PHASES, PEER_RANKS, PEER_BUDGET_S, ...); PEER_VIEW_ARGS defaults to
# epx-bench's view rows at 16 SMs. Fails when any anchor check fails, when test_intranode.py passes
# fewer than its 24 checks at some R, or when test_low_latency.py does not end with rc 0 (its kineto
# timing included: epx's LL kernels are one `epx_ll::dispatch` and one `epx_ll::combine`, docs/compat.md).
# --check FILE only judges a saved log.
set -u -o pipefail
if [ "${1:-}" = "--check" ]; then
    CHECK_ONLY=${2:?usage: scripts/gpu-peer-test.sh --check LOG}
else
    KIT=${1:?usage: scripts/gpu-peer-test.sh KIT_DIR LOGDIR}
    LOGDIR=${2:?usage: scripts/gpu-peer-test.sh KIT_DIR LOGDIR}
    CHECK_ONLY=
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export NCCL_NVLS_ENABLE=0
log() { echo "peer: $*"; }
# shellcheck source=scripts/mps.sh
. "$ROOT/scripts/mps.sh"

# The verdict on a kit log: prints one line per finding, returns non-zero on any failure.
judge() {
    local log=$1 status=0 line
    if ! grep -q "check ok" "$log"; then
        echo "peer: no anchor check in the log"; status=1
    fi
    if grep -E "check (FAIL|failed)|: check [^o]" "$log"; then
        echo "peer: an anchor check failed"; status=1
    fi
    while IFS= read -r line; do
        case "$line" in
        *"test_intranode R="*)
            if ! echo "$line" | grep -q "rc 0, 24 'passed'"; then echo "peer FAIL: $line"; status=1; else echo "peer ok: $line"; fi ;;
        *"test_low_latency R="* | *"test_low_latency(--"*") R="*)
            if echo "$line" | grep -q "rc 0,"; then
                echo "peer ok: $line"
            else
                echo "peer FAIL: $line"; status=1
            fi ;;
        esac
    done < <(grep -E "test_(intranode|low_latency(\(--[a-z-]+\))?) R=[0-9]+:" "$log" | awk '!seen[$0]++')
    if [[ ",${PEER_PHASES:-tests}," == *,tests,* ]] && ! grep -qE "test_intranode R=[0-9]+:" "$log"; then
        echo "peer: DeepEP's tests did not run"; status=1
    fi
    return $status
}

# Measurements after the kit's own run, on what it built (each skipped when its knob is empty or 0):
#  PEER_OPTIN=1: the kit's table again with the front's single-pass opt-in (EPX_DEEPEP_VIEWS=1), DeepEP
#      beside it in the same run (docs/compat.md, "Native options").
#  PEER_LL_FLAGS ("--use-logfmt --disable-nvlink"): DeepEP's test_low_latency.py against the front once per
#      flag and R, its launcher patched as the kit patches it; judged as the kit's default run.
#  PEER_NATIVE=1: bench/compat_profile.py per R: the native Python rows with views=1 in static mode, each
#      call aligned by an epx barrier as epx-bench aligns the C view rows the kit printed.
extras() {
    local R flag W=${PEER_WORK:-/tmp/peer-work} PY=${PEER_PYTHON:-/opt/torch/.venv/bin/python3} port=29700 t rc
    local ranks=${PEER_RANKS:-8 4 2} llflags=${PEER_LL_FLAGS---use-logfmt --disable-nvlink}
    [ -x "$PY" ] || PY=$(command -v python3)
    if [ "${PEER_OPTIN:-1}" = 1 ]; then
        echo "=== opt-in: EPX_DEEPEP_VIEWS=1 (the front's 'epx compat' column below is the single-pass opt-in)"
        EPX_DEEPEP_VIEWS=1 PEER_PHASES=anchor PEER_LIBS=deepep,epx PEER_BUDGET_S=${PEER_OPTIN_BUDGET_S:-200} \
            bash "$KIT/run.sh" "$ROOT" "$LOGDIR/kit-optin" 2>&1 | sed -n '/^=== anchor R=/,/^=== end anchor/p'
    fi
    # The kit's daemon ended with its run: the ranks below share the GPU through one of this script's.
    mps_init epx-peer-mps
    mps_start "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')"
    if [ -n "$llflags" ]; then
        rm -rf "$W/tests-flags" && cp -r "$KIT/deepep-tests" "$W/tests-flags" && chmod -R u+w "$W/tests-flags" &&
            (cd "$W/tests-flags" && for p in "$KIT"/deepep-tests-*.patch; do
                GIT_CEILING_DIRECTORIES=$W git apply "$p" || patch -s -p1 --forward <"$p" || exit 1; done) ||
            { echo "peer: could not prepare DeepEP's tests for the flag runs"; return; }
        for flag in $llflags; do
            for R in $ranks; do
                port=$((port + 1))
                (cd "$W/tests-flags" && MASTER_ADDR=127.0.0.1 MASTER_PORT=$port PEER_NUM_SMS=16 \
                    PYTHONPATH=$KIT/shim timeout -k 5 90 "$PY" test_low_latency.py --num-processes "$R" $flag) \
                    >"$LOGDIR/ll$flag-R$R.log" 2>&1
                rc=$?
                t=$(grep -E '^[A-Za-z_][A-Za-z0-9_.]*(Error|Exception)(:|$)' "$LOGDIR/ll$flag-R$R.log" |
                    grep -v ProcessRaisedException | head -1 | cut -c1-200)
                echo "  test_low_latency($flag) R=$R: rc $rc, $(grep -c ' passed' "$LOGDIR/ll$flag-R$R.log") 'passed' line(s)${t:+; first error: $t}"
                grep -E "GB/s" "$LOGDIR/ll$flag-R$R.log" | head -2 | sed 's/^/      /'
            done
        done
    fi
    if [ "${PEER_NATIVE:-1}" = 1 ]; then
        for R in $ranks; do
            echo "=== native Python, views=1, static, epx barrier: R=$R"
            (cd /tmp && timeout -k 5 100 "$PY" "$ROOT/bench/compat_profile.py" --ranks "$R" --iters 30 --warmup 10 \
                --native-views 1 --front-views 1 --barrier epx --no-profile --deadline 90) 2>&1 | grep -v "^#" | tail -16
        done
    fi
}

if [ -n "$CHECK_ONLY" ]; then
    judge "$CHECK_ONLY"
    exit $?
fi
[ -f "$KIT/run.sh" ] || { echo "peer: no run.sh in $KIT"; exit 2; }
KIT=$(cd "$KIT" && pwd)
mkdir -p "$LOGDIR" && LOGDIR=$(cd "$LOGDIR" && pwd)
export PEER_VIEW_ARGS=${PEER_VIEW_ARGS:--o view -S 16}
bash "$KIT/run.sh" "$ROOT" "$LOGDIR/kit" 2>&1 | tee "$LOGDIR/kit-run.log"
extras 2>&1 | tee -a "$LOGDIR/kit-run.log"
judge "$LOGDIR/kit-run.log" | tee "$LOGDIR/verdict.log"
status=${PIPESTATUS[0]}
echo "peer verdict: $([ "$status" = 0 ] && echo PASS || echo FAIL)"
exit "$status"
