"""What a lazy vision worker's first encode would load, loaded on a thread instead
(``MOEBUS_VISION_WARM_UP=load``): begun once the start has sent VISION_READY, it runs while the broker's ENCODE
comes in and its image is decoded and preprocessed; the encode joins it before the tower.
On the H200 (thirteenth session's first call) the first encode without a warm-up paid ~40-48 ms for cuBLAS's
first product (its library's start, whatever the shape) and ~20-25 ms for the tower's kernels loaded from
numba's disk cache; both need the worker's context, so neither can go into the zygote or the spare.

It does no tower pass: one 16 x 16 x 16 product on the backend's cuBLAS handle and stream, then every variant
that the vision role's disk cache holds for this device, of every kernel defined so far, loaded into the
context (``load_cached_kernels``: read from the cache, never compiled; a variant whose entry is missing or stale
is left to its first launch, as before). "Defined so far" is the kernels defined at module level (the zygote
imports their modules): a kernel made by a factory (layernorm's, the vision attention's, per storage or head
size) exists only once the tower first asks for it, so it still loads in the encode. A failure is logged and
leaves the rest to the encode.

Each part's device memory is logged too (the driver's free bytes before and after it, device-wide): a lazy
start's first encode took 244 MiB more than the start on the H100 (thirty-second session) where its arrays are
reckoned at 128; on the H200 (thirty-third) cuBLAS's start took 98 MiB of the rest (its 32 MiB workspace with
it), the kernels loaded here none."""
from __future__ import annotations

import logging
import sys
import threading
import time

import numpy as np

log = logging.getLogger("moebus.vision")
MIB = 1 << 20


def start_cublas(backend) -> bool:
    """One tiny product on ``backend``'s tensor cores (cuBLAS starts); False where there are none."""
    tensor_cores = getattr(backend, "tensor_cores", None)
    if tensor_cores is None:
        return False
    from moebus.cuda.kernels.compat import cuda
    from moebus.cuda.kernels.gemm import COMPUTE_32F, OP_N, OP_T, R_16BF, address

    side = 16
    a = cuda.device_array((side, side), np.uint16, stream=backend.stream)
    c = cuda.device_array((side, side), np.float32, stream=backend.stream)
    tensor_cores.blas.gemm(backend.stream, OP_T, OP_N, side, side, side, address(a), R_16BF, side, address(a), R_16BF,
                           side, address(c), side, compute=COMPUTE_32F)
    backend.stream.synchronize()  # (before the two arrays go)
    return True


def load_cached_kernels() -> tuple[int, int]:
    """(variants loaded, variants that failed) of every kernel this process defined whose disk cache
    (numba's index, NUMBA_CACHE_DIR) holds a variant for this device: each read from the cache, added as
    the dispatcher's overload and bound to the current context (its module loaded), as its first launch
    would. Never compiles; a launch-config-sensitive variant is left to its launch."""
    from moebus.cuda.kernels import compat

    loaded = failed = 0
    for dispatcher in list(compat._KERNELS):
        cache = getattr(dispatcher, "_cache", None)
        index_file = getattr(cache, "_cache_file", None)
        if index_file is None or not getattr(cache, "_enabled", True):
            continue
        if getattr(cache, "is_launch_config_sensitive", lambda: False)():
            continue  # (its variants are keyed by the launch's configuration too: left to the launch)
        try:
            magic = dispatcher.targetctx.codegen().magic_tuple()
            keys = [key for key in index_file._load_index() if len(key) == 4 and key[1] == magic]
        except Exception:  # noqa: BLE001 - left to the first launch
            failed += 1
            continue
        for key in keys:
            try:
                argtypes = _argtypes(key[0])
                if argtypes in dispatcher.overloads:
                    continue
                kernel = cache.load_overload(key[0], dispatcher.targetctx)
                if kernel is None or getattr(kernel, "launch_config_sensitive", False):
                    continue
                kernel.bind()  # the module, loaded into this context
                dispatcher.add_overload(kernel, argtypes)
                loaded += 1
            except Exception as e:  # noqa: BLE001 - left to the first launch
                failed += 1
                log.debug("kernel %s %s not preloaded: %s", getattr(dispatcher, "__name__", "?"), key[0], e)
    return loaded, failed


def _argtypes(sig):
    """The argument types of a cached variant's signature (the dispatcher's overloads' key)."""
    from numba.core import sigutils

    return sigutils.normalize_signature(sig)[0]


class LoadBeside:
    """``MOEBUS_VISION_WARM_UP=load``: cuBLAS's start and the cached kernels on a thread (same context,
    same stream); ``wait`` joins it (the encode, after its image's decode and preprocess). The GIL's switch
    interval is lowered meanwhile, so that the decode waits less for it."""

    SWITCH_S = 0.001

    def __init__(self, backend, device: str, free_bytes=None):
        """``free_bytes``: a callable giving the driver's free bytes of the device (None: not logged)."""
        self.backend, self.device, self.free_bytes = backend, device, free_bytes
        self.seconds, self.parts, self.taken = None, {}, {}
        self._switch_s = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_s, self.SWITCH_S))
        self._thread = threading.Thread(target=self._run, name="vision-preload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            if self.device == "cuda":
                from numba import cuda

                cuda.current_context()  # (the primary context, current on this thread too)
                free = self._free()
                begun = time.perf_counter()
                if start_cublas(self.backend):
                    self.parts["cuBLAS"] = time.perf_counter() - begun
                    free = self._taken("cuBLAS", free)
                begun = time.perf_counter()
                loaded, failed = load_cached_kernels()
                name = f"{loaded} kernels ({failed} failed)"
                self.parts[name] = time.perf_counter() - begun
                self._taken(name, free)
        except Exception as e:  # noqa: BLE001 - the encode loads what is missing
            log.warning("vision preload failed (%s: %s)", type(e).__name__, e)
        self.seconds = time.perf_counter() - started

    def _free(self) -> int | None:
        try:
            return self.free_bytes() if self.free_bytes is not None else None
        except Exception as e:  # noqa: BLE001 - a figure for the log only
            log.debug("vision preload: free bytes not read (%s)", e)
            return None

    def _taken(self, name: str, free_before: int | None) -> int | None:
        """Records the device memory the part ``name`` took (free before it less free now); the free now."""
        free = self._free()
        if free is not None and free_before is not None:
            self.taken[name] = free_before - free
        return free

    def _mib(self, name: str) -> str:
        return f" +{self.taken[name] / MIB:.1f} MiB" if name in self.taken else ""

    def wait(self) -> float:
        """Seconds spent waiting for it."""
        started = time.perf_counter()
        self._thread.join()
        sys.setswitchinterval(self._switch_s)
        log.info("vision preload beside: %.1f ms (%s)", 1e3 * (self.seconds or 0.0),
                 ", ".join(f"{name} {1e3 * s:.1f} ms{self._mib(name)}" for name, s in self.parts.items()) or "nothing")
        return time.perf_counter() - started
