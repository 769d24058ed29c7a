#!/usr/bin/env bash
# Configures and builds epx in build/, then runs epx-bench; arguments go to epx-bench
# (epx-bench -h lists them). Without a GPU it forks 4 ranks on the host backend.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cmake -S "$root" -B "$root/build"
cmake --build "$root/build" --parallel "$(nproc)" --target epx-bench
exec "$root/build/tools/epx-bench" "$@"
