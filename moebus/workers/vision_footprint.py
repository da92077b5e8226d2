"""What a vision worker's start takes from its GPU, as the driver counts it: its CUDA context, the
tower's weights, the encode's scratch and pools, the modules its kernels load. The broker sizes
the next hand-back from it (broker/vision_placement.py) instead of a fixed default, since the
weights the model counts (``device_bytes``) are only a part of it.

Every process's memory on a GPU comes out of one pool, so "before" must be read before this
process has a context: NVML (libnvidia-ml, which the driver installs; no context needed) gives the
device's used bytes then and after the warm-up, and the difference is the start's footprint. The
GPU is found by its UUID (cuDeviceGetUuid needs cuInit, not a context). The text workers decode
meanwhile, but their memory does not move between steps (graphs and pools are sized before
READY; the cache moves only on VRAM requests, and none is sent while the vision worker starts).
cuMemGetInfo once the context exists splits the footprint into the context and the rest.

Where NVML cannot be read (no pynvml, no library, another driver) the footprint is unknown (None):
the broker keeps its default reserve rather than trust a figure without the context."""
from __future__ import annotations

import logging

log = logging.getLogger("moebus.vision")
MIB = 1 << 20


def uuid_text(raw: bytes) -> str:
    """NVML's spelling of a 16-byte device UUID: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx."""
    h = bytes(raw)[:16].hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def cuda_device_uuid() -> str:
    """The UUID of this process's CUDA device 0 (after CUDA_VISIBLE_DEVICES), without a context."""
    from cuda.bindings import driver as cu

    (err,) = cu.cuInit(0)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuInit: {err}")
    err, device = cu.cuDeviceGet(0)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuDeviceGet: {err}")
    get_uuid = getattr(cu, "cuDeviceGetUuid_v2", None) or cu.cuDeviceGetUuid
    err, uuid = get_uuid(device)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuDeviceGetUuid: {err}")
    return uuid_text(uuid.bytes)


class Nvml:
    """The used bytes of one GPU, by UUID, through NVML (nvidia-ml-py's ``pynvml``, the cuda extra's;
    the library itself, libnvidia-ml, comes with the driver)."""

    def __init__(self, uuid: str):
        import pynvml

        self.pynvml = pynvml
        pynvml.nvmlInit()
        try:
            self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid.encode())
        except Exception:
            pynvml.nvmlShutdown()
            raise

    def used_bytes(self) -> int:
        return int(self.pynvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def busy_percent(self) -> int:
        """The share of the last sample period (1/6 to 1 s) in which a kernel ran on the GPU, any context's."""
        return int(self.pynvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)

    def close(self) -> None:
        self.pynvml.nvmlShutdown()


class StartFootprint:
    """Read before the context (``StartFootprint()``), then ``context_made()`` once it exists and
    ``done()`` after the warm-up: ``total_bytes`` (None: unknown) and its parts for the log; a start
    without a warm-up reads once more after its first encode (``after_first_encode``).
    ``read=False`` (a spare worker, forked ahead: vision_zygote.py) opens NVML (and cuInit) now and
    reads the used bytes only at ``read_before()``, once the hand-back has shrunk the caches."""

    def __init__(self, device: str, make_nvml=None, read: bool = True):
        self.device = device
        self.nvml = None
        self.before_used = self.context_free = self.weights_free = self.after_free = self.after_used = None
        self.total_bytes = self.context_bytes = self.encode_bytes = None
        if device != "cuda":
            return
        try:
            self.nvml = (make_nvml or (lambda: Nvml(cuda_device_uuid())))()
        except Exception as e:  # noqa: BLE001 - no NVML: the footprint stays unknown, the start goes on
            log.info("vision worker footprint not measured (NVML: %s); the broker keeps its default reserve", e)
            self.nvml = None
        if read:
            self.read_before()

    def read_before(self) -> None:
        """The device's used bytes now, before this process has a context."""
        if self.nvml is None:
            return
        try:
            self.before_used = self.nvml.used_bytes()
        except Exception as e:  # noqa: BLE001 - as in __init__
            log.info("vision worker footprint not measured (NVML: %s); the broker keeps its default reserve", e)
            self.nvml.close()
            self.nvml = None

    def context_made(self, free_bytes: int | None) -> None:
        """The driver's free bytes (cuMemGetInfo) as soon as the context exists."""
        self.context_free = free_bytes

    def weights_loaded(self, free_bytes: int | None) -> None:
        """The driver's free bytes once the weights are up (the rest is the warm-up's)."""
        self.weights_free = free_bytes

    def done(self, free_bytes: int | None, keep: bool = False) -> int | None:
        """After the warm-up (numba's deferred frees flushed): the footprint in bytes, or None.
        ``keep``: NVML stays open for ``after_first_encode`` (a start without a warm-up)."""
        used = self._read("", keep)
        if used is None:
            return None
        self.after_used = used
        self.total_bytes = max(0, used - self.before_used)
        self.after_free = free_bytes
        if self.context_free is not None and free_bytes is not None:
            self.context_bytes = max(0, self.total_bytes - max(0, self.context_free - free_bytes))
        return self.total_bytes

    def after_first_encode(self) -> int | None:
        """After the first encode of a start without a warm-up (``done(keep=True)``): the footprint
        with what that encode and the loads beside it took (its scratch and step pool, cuBLAS's
        workspace, the modules its kernels loaded), as the driver counts it; None where unknown.
        The device's other memory does not fall meanwhile (the caches moved before the start; a text
        worker's step taking buffers beside the reserve only adds), so this errs on the large side.
        NVML stays open (its shutdown is not on the encode's reply path) until ``close()``."""
        used = self._read(" after its first encode", keep=True) if self.total_bytes is not None else None
        if used is None:
            return None
        self.encode_bytes = max(0, used - self.after_used)
        self.total_bytes += self.encode_bytes
        return self.total_bytes

    def _read(self, when: str, keep: bool) -> int | None:
        """NVML's used bytes of the device now (None: unknown, and NVML closed); ``keep``: NVML stays open."""
        if self.nvml is None:
            return None
        try:
            used = self.nvml.used_bytes()
        except Exception as e:  # noqa: BLE001 - the figure stays unknown, the worker goes on
            log.info("vision worker footprint%s not measured (NVML: %s)", when, e)
            self.close()
            return None
        if not keep:
            self.close()
        return used

    def close(self) -> None:
        if self.nvml is not None:
            self.nvml.close()
            self.nvml = None

    def describe(self, weights_bytes: int) -> str:
        """The footprint and, where the driver's free bytes were read, its parts: the context, the
        weights' upload (the model counts ``weights_bytes`` of arrays) and the warm-up's."""
        if self.total_bytes is None:
            return "not measured"
        parts = [f"the model's arrays {weights_bytes / MIB:.1f} MiB"]
        if self.context_bytes is not None:
            parts.insert(0, f"context {self.context_bytes / MIB:.1f} MiB")
        if None not in (self.context_free, self.weights_free, self.after_free):
            parts.append(f"upload {(self.context_free - self.weights_free) / MIB:.1f} MiB, "
                         f"warm-up {(self.weights_free - self.after_free) / MIB:.1f} MiB")
        return f"{self.total_bytes / MIB:.1f} MiB on the device ({'; '.join(parts)})"
