/*
 * Link probe of the NCCL discovery (cmake/EpxNccl.cmake) and of the aarch64 cross build
 * (scripts/cross-aarch64.sh): a program that calls into libnccl, so linking it with the target's
 * compiler fails for a library of another architecture. Declared here rather than through nccl.h,
 * which needs the CUDA runtime headers; ncclResult_t is an enum, returned like an int.
 */
int ncclGetVersion(int *version);

int main(void)
{
    int version = 0;
    return ncclGetVersion(&version) != 0 || version <= 0;
}
