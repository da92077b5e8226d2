"""Device backends: ``cpu`` (numpy, the reference of every op: cpu.py) and ``cuda`` (numba.cuda
kernels on one stream, cuda.py; graphs.py captures a decode step as a CUDA graph), and how a
backend's errors are read by the worker (a step that ran out of memory vs a poisoned context)."""
from __future__ import annotations


def make_backend(device: str, stack_bytes: int | None = None):
    """'cpu' or 'cuda'. (The op files hold kernels beside their references, so numba is imported
    either way; only the cuda backend creates a CUDA context, whose stack limit is ``stack_bytes``
    where MOEBUS_CUDA_STACK_BYTES is unset.)"""
    if device == "cpu":
        from moebus.cuda.backends.cpu import CpuBackend

        return CpuBackend()
    if device == "cuda":
        from moebus.cuda.backends.cuda import CudaBackend

        return CudaBackend(stack_bytes)
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


# CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (900) ... CUDA_ERROR_CAPTURED_EVENT / STREAM_CAPTURE_WRONG_THREAD (908): a
# call a stream capture refused (a synchronous copy in it, say); the capture fails, the context is fine once the
# capture has ended (graphs.CapturedStep._capture ends it), and the work runs eagerly instead.
CAPTURE_ERRORS = range(900, 909)


def is_capture_error(exc: BaseException) -> bool:
    """A driver call refused because a stream was capturing (CAPTURE_ERRORS)."""
    code = getattr(exc, "code", exc.args[0] if exc.args else None)
    try:
        return type(exc).__name__ == "CudaAPIError" and int(code) in CAPTURE_ERRORS
    except (TypeError, ValueError):
        return False


def is_fatal_device_error(exc: BaseException) -> bool:
    """True for errors after which the device (CUDA context) cannot be trusted any more. (A capture's
    refusal, is_capture_error, is one too, except where the capture that caused it was ended: the
    captures' own fallbacks.)"""
    if is_out_of_memory(exc):
        return False
    if isinstance(exc, MemoryError):
        return True
    module = type(exc).__module__ or ""
    return module.startswith("numba.cuda.cudadrv") or module.startswith("numba_cuda") or \
        type(exc).__name__ in ("CudaAPIError", "CudaSupportError", "CudaDriverError")


def passes_capture(exc: BaseException) -> bool:
    """Whether a failed capture passes ``exc`` on rather than falling back to eager launches: out of memory
    (the step fails, graphs stay on) or a fatal device error other than the capture's own refusal
    (is_capture_error: the capture has been ended, the context is fine)."""
    return is_out_of_memory(exc) or (is_fatal_device_error(exc) and not is_capture_error(exc))
