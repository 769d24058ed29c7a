#!/usr/bin/env bash
# The Python package on the GPU machine, offline: builds the library with its cuda backend and installs
# the extension linked against it (EPX_PYTHON_CUDA=1 pip install, no network), then runs the torch tests
# (native ops on 2, 4, 8 ranks sharing the GPUs under a private MPS daemon, the DeepEP scenario with a
# CUDA graph, the HybridEP front, Comm.from_torch over gloo and NCCL) and the example's torch path.
# Usage: scripts/gpu-python-test.sh LOGDIR. Ends within 5 minutes (EPX_PY_NUMPY=1 adds the NumPy tests;
# EPX_PEER_KIT=DIR adds the DeepEP peer tests and table, about 5 more minutes).
set -u -o pipefail
LOGDIR=${1:?usage: scripts/gpu-python-test.sh LOGDIR}
mkdir -p "$LOGDIR" && LOGDIR=$(cd "$LOGDIR" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
# The image's Python is the one with torch; EPX_PYTHON overrides.
PY=${EPX_PYTHON:-}
if [ -z "$PY" ]; then
    PY=/opt/torch/.venv/bin/python3
    [ -x "$PY" ] || PY=$(command -v python3)
fi
command -v nvcc >/dev/null || export PATH=$PATH:/usr/local/cuda/bin
# NVLink multicast stays off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# A hung collective fails with the library's timeout message well inside the tests' own limits.
export EPX_TIMEOUT_MS=${EPX_TIMEOUT_MS:-30000}
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
START=$(date +%s)
status=0
log() { echo "[$(($(date +%s) - START)) s] $*" | tee -a "$LOGDIR/summary.log"; }

# shellcheck source=scripts/mps.sh
. "$ROOT/scripts/mps.sh"
mps_init epx-py-mps

log "python: $PY; nvcc: $(command -v nvcc || echo none); cmake: $(command -v cmake || echo none)"
"$PY" -c "import torch, numpy, pytest; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'numpy', numpy.__version__, 'pytest', pytest.__version__)" 2>&1 | tee -a "$LOGDIR/summary.log"
nvidia-smi >"$LOGDIR/nvidia-smi.log" 2>&1
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
log "$NGPU GPU(s)"

# Build and install without network: the venv's setuptools builds in place; the library's CMake tree
# lives in build/python/libepx-cuda. Falls back to an in-place extension on PYTHONPATH.
log "EPX_PYTHON_CUDA=1 pip install --no-build-isolation --no-deps --no-index ."
if timeout 240 env EPX_PYTHON_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps --no-index -v \
    . >"$LOGDIR/pip-install.log" 2>&1; then
    log "  installed"
else
    log "  pip install FAILED (see pip-install.log); trying setup.py build_ext --inplace"
    tail -20 "$LOGDIR/pip-install.log"
    if timeout 240 env EPX_PYTHON_CUDA=1 "$PY" setup.py build_ext --inplace \
        >"$LOGDIR/build-ext.log" 2>&1; then
        export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
        log "  built in place; PYTHONPATH=$PYTHONPATH"
    else
        log "  build FAILED (see build-ext.log)"; tail -30 "$LOGDIR/build-ext.log"; exit 1
    fi
fi

# Smoke: the extension that gets imported has the cuda backend (a one-rank cuda communicator).
if (cd /tmp && "$PY" - >"$LOGDIR/smoke.log" 2>&1 <<'EOF'
import torch, epx
print("epx", epx.version(), "from", epx.__file__)
c = epx.Comm.from_unique_id(epx.get_unique_id(), 0, 1, backend="cuda", cuda_device=0)
print("backend", c.backend, "device", c.cuda_device)
assert c.backend == "cuda"
c.destroy()
EOF
); then
    log "  smoke: $(tr '\n' ' ' <"$LOGDIR/smoke.log")"
else
    log "  smoke FAILED: the installed epx has no working cuda backend"; cat "$LOGDIR/smoke.log"; exit 1
fi

mps_start "$NGPU"

TIMEOUT_ARGS=()
"$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT_ARGS=(--timeout=80)
run_pytest() {  # name, seconds, pytest args...
    local name=$1 secs=$2
    shift 2
    log "pytest $name"
    (cd python/tests && EPX_TEST_GPUS=$NGPU timeout "$secs" "$PY" -m pytest -v -rfE -p no:cacheprovider \
        "${TIMEOUT_ARGS[@]}" --junitxml="$LOGDIR/junit-$name.xml" "$@") >"$LOGDIR/pytest-$name.log" 2>&1
    local rc=$?
    grep -E "(PASSED|FAILED|ERROR|SKIPPED)( |$)" "$LOGDIR/pytest-$name.log" | sed 's/^/    /' |
        tee -a "$LOGDIR/summary.log"
    tail -1 "$LOGDIR/pytest-$name.log" | sed 's/^/  /' | tee -a "$LOGDIR/summary.log"
    if [ $rc -ne 0 ]; then log "  $name FAILED (rc $rc, see pytest-$name.log)"; status=1; fi
}

# torch on the CPU (host backend, gloo), then on the GPU: native ops, the DeepEP scenario with its CUDA
# graph, the HybridEP front, Comm.from_torch over gloo and NCCL.
run_pytest torch-cpu 60 test_torch_cpu.py
run_pytest torch-gpu-native 90 test_torch_gpu.py -k native
run_pytest torch-gpu-compat 90 test_torch_gpu.py -k "deep_ep or hybrid_ep"
run_pytest torch-gpu-from-torch 60 test_torch_gpu.py -k from_torch
if [ "${EPX_PY_NUMPY:-0}" = 1 ]; then
    run_pytest numpy 60 test_ops.py test_errors.py
fi

# The example's torch path: one process per GPU over NCCL (torchrun), at most 8.
NPROC=$(( NGPU < 1 ? 1 : (NGPU > 8 ? 8 : NGPU) ))
log "examples/moe_layer.py --torch, $NPROC process(es)"
if timeout 60 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    examples/moe_layer.py --torch >"$LOGDIR/example-torch.log" 2>&1; then
    grep -h "relative error" "$LOGDIR/example-torch.log" | sed 's/^/    /' | tee -a "$LOGDIR/summary.log"
else
    log "  example FAILED (see example-torch.log)"; tail -15 "$LOGDIR/example-torch.log"; status=1
fi
# The peer tests (EPX_PEER_KIT: a copy of the DeepEP measuring kit inside the tree, e.g. build-peer):
# DeepEP's own tests against epx.compat.deep_ep and the side-by-side table, with the verdict of
# scripts/gpu-peer-test.sh. The package installed above is the one measured (the kit's install phase is
# skipped unless PEER_PHASES names it); the kit starts its own MPS daemon.
if [ -n "${EPX_PEER_KIT:-}" ]; then
    mps_stop
    log "peer kit: scripts/gpu-peer-test.sh $EPX_PEER_KIT (phases ${PEER_PHASES:-deepep,view,anchor,tests})"
    if PEER_PHASES=${PEER_PHASES:-deepep,view,anchor,tests} "$ROOT/scripts/gpu-peer-test.sh" "$EPX_PEER_KIT" \
        "$LOGDIR/peer" >"$LOGDIR/peer.log" 2>&1; then
        log "  peer verdict PASS"
    else
        log "  peer verdict FAIL (see peer.log)"; status=1
    fi
    grep -E "^peer |^=== |^(row|dispatch|cached|combine|copy) |test_(intranode|low_latency)|^native|^front" \
        "$LOGDIR/peer.log" | awk '!seen[$0]++' | sed 's/^/    /' >>"$LOGDIR/summary.log"
fi
log "done, status $status"
exit $status
