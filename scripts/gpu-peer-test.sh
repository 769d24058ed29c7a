#!/usr/bin/env bash
# Runs the DeepEP measuring kit (kept beside the project, not part of it: it builds DeepEP V1 on the
# GPU machine, prints DeepEP and epx side by side and runs DeepEP's own tests against
# epx.compat.deep_ep) and turns its summary into a verdict. Usage:
#   scripts/gpu-peer-test.sh KIT_DIR LOGDIR [--check FILE]
# KIT_DIR: the kit's folder (a copy of it inside the tree, e.g. build-peer, travels to the GPU machine).
# The kit's knobs pass through (PEER_PHASES, PEER_RANKS, PEER_BUDGET_S, ...); PEER_VIEW_ARGS defaults to
# epx-bench's view rows at 16 SMs. Fails when any anchor check fails, when test_intranode.py passes
# fewer than its 24 checks at some R, or when test_low_latency.py stops anywhere but in its kineto
# helper (the documented kernel-name artefact, docs/compat.md). --check FILE only judges a saved log.
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
        *"test_low_latency R="*)
            if echo "$line" | grep -q "rc 0" ||
                echo "$line" | grep -q "Errors of the kernel dispatch in the profiling table"; then
                echo "peer ok: $line"
            else
                echo "peer FAIL: $line"; status=1
            fi ;;
        esac
    done < <(grep -E "test_(intranode|low_latency) R=[0-9]+:" "$log" | awk '!seen[$0]++')
    if ! grep -qE "test_intranode R=[0-9]+:" "$log"; then
        echo "peer: DeepEP's tests did not run"; status=1
    fi
    return $status
}

if [ -n "$CHECK_ONLY" ]; then
    judge "$CHECK_ONLY"
    exit $?
fi
[ -f "$KIT/run.sh" ] || { echo "peer: no run.sh in $KIT"; exit 2; }
mkdir -p "$LOGDIR" && LOGDIR=$(cd "$LOGDIR" && pwd)
export PEER_VIEW_ARGS=${PEER_VIEW_ARGS:--o view -S 16}
bash "$KIT/run.sh" "$ROOT" "$LOGDIR/kit" 2>&1 | tee "$LOGDIR/kit-run.log"
judge "$LOGDIR/kit-run.log" | tee "$LOGDIR/verdict.log"
status=${PIPESTATUS[0]}
echo "peer verdict: $([ "$status" = 0 ] && echo PASS || echo FAIL)"
exit "$status"
