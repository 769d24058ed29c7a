# Sourced by the GPU scripts that build against NCCL from a Python environment's pip package.
# pip_nccl PYTHON LOGFILE: prints the package's root (the folder holding include/nccl.h and
# lib/libnccl.so*), nothing when there is none; Python's errors go to LOGFILE. pip_nccl_version ROOT:
# its version from nccl.h (major.minor.patch).
pip_nccl() {
    timeout 60 "$1" - <<'PYEOF' 2>>"$2"
import glob, importlib.util, os, site
roots = []
try:
    spec = importlib.util.find_spec("nvidia.nccl")
    roots += list(spec.submodule_search_locations or []) if spec else []
except Exception:
    pass
for sp in site.getsitepackages():
    roots += glob.glob(os.path.join(sp, "nvidia", "*nccl*")) + glob.glob(os.path.join(sp, "nvidia", "cu*"))
for r in roots:
    if os.path.exists(os.path.join(r, "include", "nccl.h")) and glob.glob(os.path.join(r, "lib", "libnccl.so*")):
        print(r)
        break
PYEOF
}

pip_nccl_version() {
    sed -n 's/^#define NCCL_\(MAJOR\|MINOR\|PATCH\) *\([0-9]*\).*/\2/p' "$1/include/nccl.h" | paste -sd.
}
