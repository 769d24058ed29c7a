#!/usr/bin/env bash
# Configures, builds and runs the whole CTest suite with warnings as errors.
#   scripts/test.sh            build/       plain build
#   scripts/test.sh asan       build-asan/  ASan + UBSan
#   scripts/test.sh tsan       build-tsan/  TSan
# Further arguments go to cmake (e.g. -DEPX_CUDA=OFF).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
variant=${1:-}
[ $# -gt 0 ] && shift
case "$variant" in
  "" | plain) dir=build; flags=() ;;
  asan) dir=build-asan; flags=(-DEPX_SANITIZE=address) ;;
  tsan) dir=build-tsan; flags=(-DEPX_SANITIZE=thread) ;;
  *) echo "usage: scripts/test.sh [asan|tsan] [cmake options...]" >&2; exit 2 ;;
esac
build="$root/$dir"
cmake -S "$root" -B "$build" -DEPX_WERROR=ON "${flags[@]}" "$@"
cmake --build "$build" --parallel "$(nproc)"

runner=()
if [ "$variant" = tsan ]; then
  # TSan needs the memory layout it expects; kernels with high mmap ASLR entropy break it.
  if command -v setarch > /dev/null && setarch "$(uname -m)" -R true 2> /dev/null; then
    runner=(setarch "$(uname -m)" -R)
  fi
  export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1 second_deadlock_stack=1}
elif [ "$variant" = asan ]; then
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1 abort_on_error=0}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1 halt_on_error=1}
fi
cd "$build"
"${runner[@]}" ctest --output-on-failure --parallel "${CTEST_PARALLEL_LEVEL:-$(nproc)}"
