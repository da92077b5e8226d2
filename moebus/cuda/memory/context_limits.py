"""A CUDA context's stack limit, lowered where ``MOEBUS_CUDA_STACK_BYTES`` asks (unset: the driver's).

The driver reserves local memory for every thread the GPU can hold at once: the per-thread stack
limit (1 KiB by default) x 2,048 threads x 132 SMs on an H200, ~264 MiB of every context (a vision
worker's context is ~526 MiB of its ~1.46 GiB charge, twenty-sixth session). Our kernels need far
less: none of the 200 numba kernel variants has local-memory traffic (tests/cuda/ptx_check.py), so
what is left is cuBLAS's and the CUDA C kernels' needs. Set low when the context is made, before any kernel: the
driver raises it at a launch that needs more ("automatically increases the per-thread stack size for
each kernel launch as needed", and keeps it), so the reservation ends at what the process's largest
kernel needs — reached during a worker's warm-up, before its cache is sized. Unset, a LLaVA vision
worker sets 64 B (VISION_STACK_BYTES: on the H200 its footprint 606 -> 358 MiB with the tower streamed,
the limit still 64 B after its encodes, twenty-ninth session); the text workers and Qwen3-VL's vision
worker keep the driver's (not yet measured there)."""
from __future__ import annotations

import ctypes
import logging
import os

from moebus.common.errors import ConfigError

log = logging.getLogger("moebus.worker")
CU_LIMIT_STACK_SIZE = 0
VISION_STACK_BYTES = 64  # a LLaVA vision worker's limit where MOEBUS_CUDA_STACK_BYTES is unset
# A context's size before one was measured on a GPU (the broker's first reserve for a vision worker): 512 MiB with
# the driver's stack limit (the seed's ~0.5 GiB; the H200's 526 in the twenty-sixth session); with a lowered limit,
# what is left without the local memory (the H200 at 64 B: 277.6 MiB, of it 64 B x 2,048 x 132 SMs = 16.5)
# plus that limit's local memory on a GPU of up to CONTEXT_SMS_BOUND SMs (H100 / H200 132, B200 148).
CONTEXT_MIB = 512
CONTEXT_BASE_MIB = 264
CONTEXT_SMS_BOUND = 160
THREADS_PER_SM = 2048


def stack_bytes_from_env(environ=os.environ, default: int | None = None) -> int | None:
    """MOEBUS_CUDA_STACK_BYTES, else ``default`` (None: the driver's)."""
    text = environ.get("MOEBUS_CUDA_STACK_BYTES", "")
    if not text:
        return default
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) <= 1 << 20:  # '²' is a digit int() refuses
        raise ConfigError(f"MOEBUS_CUDA_STACK_BYTES must be a byte count from 1 to 1048576 (each GPU thread's stack "
                          f"at the context's start; unset: the driver's 1024), got {text!r}")
    return int(text)


def context_mib(stack_bytes: int | None) -> int:
    """The MiB a context takes before any was measured, its stack limit ``stack_bytes`` a thread
    (None: the driver's): 512 with the driver's; with a lowered one 264 plus that limit's local
    memory on up to 160 SMs (284 at 64 B, where the H200 measured 277.6), never more than 512."""
    if stack_bytes is None:
        return CONTEXT_MIB
    local = stack_bytes * THREADS_PER_SM * CONTEXT_SMS_BOUND
    return min(CONTEXT_MIB, CONTEXT_BASE_MIB + -(-local // (1 << 20)))


def vision_stack_bytes(tower: str) -> int | None:
    """A vision worker's stack limit where MOEBUS_CUDA_STACK_BYTES is unset: 64 B for LLaVA's towers
    (measured), the driver's for Qwen3-VL's."""
    return None if tower == "qwen3_vl" else VISION_STACK_BYTES


def vision_context_mib(tower: str, environ=os.environ) -> int:
    """``context_mib`` of a vision worker of ``tower`` under this environment's MOEBUS_CUDA_STACK_BYTES
    (a value the worker will refuse at its start counts as the driver's here: it only sizes a reserve)."""
    try:
        stack = stack_bytes_from_env(environ, default=vision_stack_bytes(tower))
    except ConfigError:
        stack = None
    return context_mib(stack)


def lower_stack_limit(environ=os.environ, default: int | None = None) -> tuple[int, int] | None:
    """On the current context (call before any kernel): the stack limit from the environment, else
    ``default``; returns (bytes before, bytes now), or None where neither asks for one."""
    wanted = stack_bytes_from_env(environ, default)
    if wanted is None:
        return None
    before = stack_limit_bytes()
    _check(ctypes.CDLL("libcuda.so.1").cuCtxSetLimit(ctypes.c_int(CU_LIMIT_STACK_SIZE), ctypes.c_size_t(wanted)),
           "cuCtxSetLimit")
    now = stack_limit_bytes()
    log.info("CUDA stack limit %d B a thread (the driver's %d B; MOEBUS_CUDA_STACK_BYTES%s)", now, before,
             "" if environ.get("MOEBUS_CUDA_STACK_BYTES") else " unset: this worker's default")
    return before, now


def stack_limit_bytes() -> int:
    """The current context's stack limit a thread (the driver raises a lowered one at a launch that
    needs more: the vision worker logs it after its first encodes, where the limit is lowered)."""
    lib = ctypes.CDLL("libcuda.so.1")
    now = ctypes.c_size_t()
    _check(lib.cuCtxGetLimit(ctypes.byref(now), ctypes.c_int(CU_LIMIT_STACK_SIZE)), "cuCtxGetLimit")
    return now.value


def _check(rc: int, call: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{call} failed with CUresult {rc}")
