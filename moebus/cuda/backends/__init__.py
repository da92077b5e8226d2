"""Device backends: ``cpu`` (numpy, the reference of every op: cpu.py) and ``cuda`` (numba.cuda
kernels on one stream, cuda.py; graphs.py captures a decode step as a CUDA graph), and how a
backend's errors are read by the worker (a step that ran out of memory vs a poisoned context)."""
from __future__ import annotations


def make_backend(device: str):
    """'cpu' or 'cuda'. (The op files hold kernels beside their references, so numba is imported
    either way; only the cuda backend creates a CUDA context.)"""
    if device == "cpu":
        from moebus.cuda.backends.cpu import CpuBackend

        return CpuBackend()
    if device == "cuda":
        from moebus.cuda.backends.cuda import CudaBackend

        return CudaBackend()
    raise ValueError(f"unknown device {device!r}")


CUDA_ERROR_OUT_OF_MEMORY = 2


def is_out_of_memory(exc: BaseException) -> bool:
    """A device allocation that failed (the driver's or the emulated GPU's): the step fails, the
    context is fine, and the worker keeps serving."""
    from moebus.cuda.memory.ledger import OutOfMemory

    if isinstance(exc, OutOfMemory):
        return True
    code = getattr(exc, "code", exc.args[0] if exc.args else None)  # numba: CudaAPIError(code, msg)
    try:
        return type(exc).__name__ == "CudaAPIError" and int(code) == CUDA_ERROR_OUT_OF_MEMORY
    except (TypeError, ValueError):
        return False


def is_fatal_device_error(exc: BaseException) -> bool:
    """True for errors after which the device (CUDA context) cannot be trusted any more."""
    if is_out_of_memory(exc):
        return False
    if isinstance(exc, MemoryError):
        return True
    module = type(exc).__module__ or ""
    return module.startswith("numba.cuda.cudadrv") or module.startswith("numba_cuda") or \
        type(exc).__name__ in ("CudaAPIError", "CudaSupportError", "CudaDriverError")
