"""One H200 (thirty-first session; issue 20): what of a fresh context's device memory its limits hold, read as the
vision worker's is (a LLaVA vision worker's context is 277.6 MiB at its 64 B stack limit, 31 A3B slots the cache
hands back through every image). Lowers, in turn, the stack (64 B), the printf FIFO, the malloc heap, the device
runtime's pending launches and sync depth, and prints the driver's free MiB after each (a limit whose memory is
only taken at a first use frees nothing here); then one numba kernel. Also the SMs and threads an SM, which
context_limits.context_mib bounds (2,048 x 160). Replaces ctx26.py (the twenty-sixth session's, whose output no
call kept; gap25.sh's CTX=1 runs this now).   python3 tools/device/ctx31.py"""
import ctypes

from moebus.cuda.kernels.compat import cuda  # (numba-cuda 0.68 under numpy 2.5 needs compat's np.row_stack first)

MIB = 1 << 20
LIMITS = {"stack": (0, 64), "printf fifo": (1, 0), "malloc heap": (2, 0), "sync depth": (3, 0),
          "pending launches": (4, 0)}
lib = ctypes.CDLL("libcuda.so.1")


def free_mib() -> float:
    free, _ = cuda.current_context().get_memory_info()
    return free / MIB


def limit(which: int) -> int:
    value = ctypes.c_size_t()
    rc = lib.cuCtxGetLimit(ctypes.byref(value), ctypes.c_int(which))
    return value.value if rc == 0 else -rc


device = cuda.get_current_device()
try:
    print(f"SMs {device.MULTIPROCESSOR_COUNT}, threads an SM {device.MAX_THREADS_PER_MULTI_PROCESSOR}")
except AttributeError as e:  # (an attribute numba does not name)
    print(f"SMs / threads an SM not read: {e}")
start = free_mib()
print(f"context made: free {start:.1f} MiB; limits " + ", ".join(f"{n} {limit(w)} B" for n, (w, _) in LIMITS.items()))
for name, (which, value) in LIMITS.items():
    before = free_mib()
    rc = lib.cuCtxSetLimit(ctypes.c_int(which), ctypes.c_size_t(value))
    print(f"{name} -> {value}: rc {rc}, now {limit(which)}, free {before:.1f} -> {free_mib():.1f} MiB")


@cuda.jit
def scale(x, a):
    i = cuda.grid(1)
    if i < x.size:
        x[i] *= a


x = cuda.to_device([1.0] * 1024)
scale[4, 256](x, 2.0)
cuda.synchronize()
print(f"after a kernel: free {free_mib():.1f} MiB ({free_mib() - start:+.1f} since the context), limits "
      + ", ".join(f"{n} {limit(w)}" for n, (w, _) in LIMITS.items()))
