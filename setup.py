"""Builds the epx Python package: the CPython extension (python/epx/_epx*.c) compiled together with the
library's C sources (host backend), so `pip install .` needs only a C compiler. EPX_PYTHON_CUDA=1 builds
the library with its cuda backend through CMake (needs nvcc) and links the extension against it."""

import glob
import os
import re
import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def library_version():
    text = open(os.path.join(ROOT, "include", "epx", "epx.h")).read()
    parts = [re.search(r"#define EPX_VERSION_%s (\d+)" % p, text).group(1)
             for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(parts)


# Python build products live apart from the CMake tree in build/ (ignored by git).
BUILD_BASE = os.path.join("build", "python")
os.makedirs(os.path.join(ROOT, BUILD_BASE), exist_ok=True)


# The extension's own files (relative paths under python/: the cuda build keeps only those of the list).
EXT_SOURCES = ["python/epx/" + name for name in ("_epx.c", "_epx_dlpack.c", "_epx_comm.c", "_epx_types.c",
                                                 "_epx_ops.c", "_epx_views.c")]
EXT_HEADERS = ["python/epx/_epx.h"]


def host_sources():
    found = []
    for sub in ("api", "core", "host"):
        found += sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "src", sub, "*.c")))
    return found


# The library's own flags (CMakeLists.txt): C11 with GNU extensions, no FMA contraction (sums must round
# alike everywhere), library symbols hidden so only PyInit__epx is exported.
C_FLAGS = ["-std=gnu11", "-ffp-contract=off", "-fvisibility=hidden", "-Wno-unused-parameter",
           "-Wno-missing-field-initializers"]


class BuildExt(build_ext):
    def build_extensions(self):
        if os.environ.get("EPX_PYTHON_CUDA", "0") not in ("", "0"):
            self._use_cmake_library()
            self.force = True  # a host-only extension built earlier looks up to date: relink it
        super().build_extensions()

    def _use_cmake_library(self):
        nvcc = find_nvcc()
        if not nvcc:
            raise RuntimeError("EPX_PYTHON_CUDA=1 needs nvcc (on PATH, in CUDACXX or /usr/local/cuda/bin)")
        cmake = shutil.which("cmake")
        if not cmake:
            raise RuntimeError("EPX_PYTHON_CUDA=1 needs cmake on PATH")
        # Outside the temporary build folder pip may use: the library's objects survive between installs.
        build_dir = os.environ.get("EPX_PYTHON_CMAKE_DIR") or os.path.join(ROOT, BUILD_BASE, "libepx-cuda")
        subprocess.check_call([cmake, "-S", ROOT, "-B", build_dir, "-DEPX_CUDA=ON", "-DEPX_BUILD_TESTS=OFF",
                               "-DEPX_BUILD_TOOLS=OFF", "-DCMAKE_BUILD_TYPE=Release",
                               "-DCMAKE_CUDA_COMPILER=" + nvcc])
        subprocess.check_call([cmake, "--build", build_dir, "--target", "epx_static", "-j",
                               str(os.cpu_count() or 2)])
        cuda_lib = cmake_cache(build_dir, "CUDAToolkit_LIBRARY_DIR")
        if not cuda_lib and cmake_cache(build_dir, "CUDA_CUDART"):
            cuda_lib = os.path.dirname(cmake_cache(build_dir, "CUDA_CUDART"))
        if not cuda_lib or not os.path.isdir(cuda_lib):
            cuda_lib = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "lib64")
        for ext in self.extensions:
            ext.sources = [s for s in ext.sources if s.startswith("python")]
            ext.extra_objects = [os.path.join(build_dir, "libepx.a")]
            ext.library_dirs += [cuda_lib, os.path.join(cuda_lib, "stubs")]
            ext.libraries += ["cudart", "cuda", "stdc++"]
            ext.runtime_library_dirs += [cuda_lib]
            # NCCL, where the library's build found it (its GIN host setup is in libepx.a then).
            for dep in static_deps(build_dir):
                ext.extra_link_args += [dep]
                ext.runtime_library_dirs += [os.path.dirname(dep)]


def find_nvcc():
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def static_deps(build_dir):
    """The libraries libepx.a needs besides the CUDA runtime (epx_static_deps.txt, written by CMake)."""
    try:
        with open(os.path.join(build_dir, "epx_static_deps.txt")) as f:
            return [line.strip() for line in f if line.strip()]
    except OSError:
        return []


def cmake_cache(build_dir, key):
    """A value from CMakeCache.txt (KEY:TYPE=value), or None."""
    try:
        with open(os.path.join(build_dir, "CMakeCache.txt")) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return line.split("=", 1)[1].strip()
    except OSError:
        pass
    return None


setup(
    version=library_version(),
    ext_modules=[
        Extension(
            "epx._epx",
            sources=EXT_SOURCES + host_sources(),
            depends=EXT_HEADERS,
            include_dirs=["include", "src"],
            define_macros=[("_GNU_SOURCE", None)],
            extra_compile_args=C_FLAGS,
            libraries=["m", "rt", "pthread"],
        )
    ],
    cmdclass={"build_ext": BuildExt},
    options={"build": {"build_base": BUILD_BASE}, "egg_info": {"egg_base": BUILD_BASE}},
)
