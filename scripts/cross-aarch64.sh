#!/usr/bin/env bash
# Cross-builds the host library (and epx-bench) for aarch64 with Debian's gcc-aarch64-linux-gnu, installed
# when missing, and checks every result is AArch64. Then the NCCL discovery for aarch64: the aarch64 wheel of
# nvidia-nccl-cu13 is downloaded into a temporary folder and found through EPX_NCCL_HOME with -DEPX_NCCL=ON,
# and a probe is linked against the library found with the cross linker; the discovery must also refuse a
# library built for this machine. Without network the wheel part is skipped with a note; a discovery failure
# or a library of the wrong architecture with the wheel present fails the script.
#   scripts/cross-aarch64.sh [build dir]        (default: build-aarch64/)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$root/build-aarch64}
triple=aarch64-linux-gnu
cross_cc=$triple-gcc
toolchain=$root/cmake/toolchains/$triple.cmake

if ! command -v "$cross_cc" > /dev/null; then
  sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  echo "installing: gcc-$triple"
  "${sudo[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q "gcc-$triple"
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Every ELF file given (each member of an archive) is for AArch64.
check_aarch64() {
  local f machines
  for f in "$@"; do
    machines=$(readelf -h "$f" | sed -n 's/^ *Machine: *//p' | sort -u)
    if [ "$machines" != AArch64 ]; then
      echo "error: $f is for '${machines//$'\n'/, }', not AArch64" >&2
      return 1
    fi
    if command -v file > /dev/null; then file -L "$f"; else echo "$f: $machines"; fi
  done
}

# The NCCL status line of a configure log: "epx: NCCL <version> found (...): include <dir>, library <file>",
# or why none was taken.
nccl_status() { sed -n 's/^-- \(epx: NCCL .*\)$/\1/p' "$1" | head -n 1; }

echo "--- cross build for $triple (host library, epx-bench)"
# NCCL on AUTO, with no place named: what discovery finds by itself must be for aarch64.
env -u EPX_NCCL_HOME -u NCCL_HOME cmake -S "$root" -B "$build" --toolchain "$toolchain" -DEPX_CUDA=OFF \
  -DEPX_BUILD_TESTS=OFF -DEPX_BUILD_TOOLS=ON -DEPX_WERROR=ON -DEPX_NCCL=AUTO -UEPX_NCCL_HOME -UNCCL_HOME |
  tee "$tmp/configure.log"
cmake --build "$build" --parallel "$(nproc)"
so=$(readlink -f "$build/libepx.so")
check_aarch64 "$so" "$build/libepx.a" "$build/tools/epx-bench"
# What this machine has (a CUDA toolkit's NCCL, a pip package) is for another architecture: never taken.
if nccl_status "$tmp/configure.log" | grep -q "^epx: NCCL [0-9]"; then
  echo "error: the aarch64 configure took an NCCL of this machine: $(nccl_status "$tmp/configure.log")" >&2
  exit 1
fi

echo "--- NCCL discovery for $triple"
# The discovery refuses a library of another architecture: one built here, behind headers of a usable version.
fake=$tmp/host-nccl
mkdir -p "$fake/include/nccl_device" "$fake/lib"
printf '#define NCCL_MAJOR 2\n#define NCCL_MINOR 28\n#define NCCL_PATCH 0\n' > "$fake/include/nccl.h"
touch "$fake/include/nccl_device.h" "$fake/include/nccl_device/gin.h"
echo 'int ncclGetVersion(int *v) { *v = 22800; return 0; }' > "$tmp/host_nccl.c"
"${CC:-gcc}" -shared -fPIC -o "$fake/lib/libnccl.so" "$tmp/host_nccl.c"
if cmake -S "$root" -B "$tmp/build-host-nccl" --toolchain "$toolchain" -DEPX_CUDA=OFF -DEPX_BUILD_TESTS=OFF \
  -DEPX_BUILD_TOOLS=OFF -DEPX_NCCL=ON -DEPX_NCCL_HOME="$fake" > "$tmp/host-nccl.log" 2>&1; then
  echo "error: the aarch64 configure accepted an NCCL built for $(uname -m):" >&2
  nccl_status "$tmp/host-nccl.log" >&2
  exit 1
fi
grep -q "does not link for aarch64" "$tmp/host-nccl.log" || {
  cat "$tmp/host-nccl.log" >&2
  echo "error: the aarch64 configure failed, but not for the library's architecture" >&2
  exit 1
}
echo "an NCCL built for $(uname -m) is refused"

# The real library: the aarch64 wheel, whichever manylinux tag the index has.
wheel_dir=$tmp/wheel
if ! python3 -m pip download -q --no-deps --only-binary=:all: --no-cache-dir --retries 1 --timeout 30 \
  --platform manylinux_2_18_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64 \
  --platform manylinux_2_28_aarch64 -d "$wheel_dir" nvidia-nccl-cu13 > "$tmp/pip.log" 2>&1; then
  echo "note: could not download the aarch64 wheel of nvidia-nccl-cu13 (no network or no pip?):" \
    "$(tail -n 1 "$tmp/pip.log")"
  echo "note: NCCL discovery for $triple not exercised; the plain cross build passed"
  exit 0
fi
wheel=$(ls "$wheel_dir"/nvidia_nccl_cu13-*.whl)
wheel_version=$(basename "$wheel" | cut -d- -f2)
echo "wheel: $(basename "$wheel")"
# Only the headers and the library; the wheel goes with the temporary folder.
python3 - "$wheel" "$tmp/nccl" << 'EOF'
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist()
                               if n.startswith("nvidia/nccl/include/") or n.startswith("nvidia/nccl/lib/libnccl.so")])
EOF
rm -rf "$wheel_dir"
home=$tmp/nccl/nvidia/nccl
cmake -S "$root" -B "$build" --toolchain "$toolchain" -DEPX_NCCL=ON -DEPX_NCCL_HOME="$home" | tee "$tmp/configure.log"
status_line=$(nccl_status "$tmp/configure.log")
lib=$(echo "$status_line" | sed -n 's/.*, library \(.*\)$/\1/p')
case "$status_line" in
  "epx: NCCL $wheel_version found (EPX_NCCL_HOME $home)"*) ;;
  *) echo "error: expected NCCL $wheel_version from $home, got: $status_line" >&2; exit 1 ;;
esac
case "$lib" in
  "$home"/lib/libnccl.so*) ;;
  *) echo "error: the library found ($lib) is not the wheel's" >&2; exit 1 ;;
esac
check_aarch64 "$lib"
# The probe links with the cross linker against exactly the library found; its own dependencies
# (libstdc++ and so on) need not be in the cross sysroot.
"$cross_cc" -o "$tmp/nccl_probe" "$root/cmake/nccl_probe.c" "$lib" -Wl,--allow-shlib-undefined
check_aarch64 "$tmp/nccl_probe"
cmake --build "$build" --parallel "$(nproc)"
check_aarch64 "$so"
# libepx does not link NCCL yet.
if readelf -d "$so" | grep -q 'NEEDED.*libnccl'; then
  echo "error: libepx links libnccl" >&2
  exit 1
fi
echo "NCCL $wheel_version for $triple found and linked"
