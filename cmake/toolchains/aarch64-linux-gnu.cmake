# Cross-compiling for 64-bit Arm Linux with Debian's cross compiler (apt-get install gcc-aarch64-linux-gnu).
#   cmake -S . -B build-aarch64 --toolchain cmake/toolchains/aarch64-linux-gnu.cmake -DEPX_CUDA=OFF
# Libraries and headers come from the cross sysroot only, except places named explicitly (EPX_NCCL_HOME,
# NCCL_HOME); programs (python, nvcc) from the build machine.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(EPX_CROSS_TRIPLE aarch64-linux-gnu)
set(CMAKE_C_COMPILER ${EPX_CROSS_TRIPLE}-gcc)

set(CMAKE_FIND_ROOT_PATH /usr/${EPX_CROSS_TRIPLE})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
