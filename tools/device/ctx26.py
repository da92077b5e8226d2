"""One H200 (twenty-sixth session): what a CUDA context holds of the device and what its limits give back.
A vision worker's context is ~526 MiB of its 1,462 MiB charge (the cache hands that many slots back for
every image). The driver reserves local memory for every resident thread (stack size x 2,048 threads x
132 SMs: ~264 MiB at the default 1 KiB), and a printf FIFO and malloc heap. This prints the free MiB
after the context and after lowering each limit (cuCtxSetLimit), then after a numba kernel's launch
(does the driver grow it back?).   python3 tools/device/ctx26.py"""
import ctypes

from numba import cuda

MIB = 1 << 20
LIMITS = {"stack": 0, "printf fifo": 1, "malloc heap": 2}
lib = ctypes.CDLL("libcuda.so.1")


def free_mib() -> float:
    free, _ = cuda.current_context().get_memory_info()
    return free / MIB


def limit(which: int) -> int:
    value = ctypes.c_size_t()
    assert lib.cuCtxGetLimit(ctypes.byref(value), ctypes.c_int(which)) == 0
    return value.value


def set_limit(which: int, value: int) -> int:
    return lib.cuCtxSetLimit(ctypes.c_int(which), ctypes.c_size_t(value))


cuda.current_context()
print(f"context made: free {free_mib():.1f} MiB; limits " + ", ".join(f"{n} {limit(v)} B" for n, v in LIMITS.items()))
for name, value in (("stack", 256), ("printf fifo", 0), ("malloc heap", 0)):
    before = free_mib()
    rc = set_limit(LIMITS[name], value)
    print(f"{name} -> {value} B: rc {rc}, now {limit(LIMITS[name])} B, free {before:.1f} -> {free_mib():.1f} MiB")


@cuda.jit
def scale(x, a):
    i = cuda.grid(1)
    if i < x.size:
        x[i] *= a


x = cuda.to_device([1.0] * 1024)
scale[4, 256](x, 2.0)
cuda.synchronize()
print(f"after a kernel: free {free_mib():.1f} MiB, stack {limit(0)} B")
