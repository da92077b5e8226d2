"""A vision tower's weights as one host buffer, uploaded as one device buffer: the vision zygote packs
them once before it forks (``pack``), and each vision worker it forks makes one device allocation
and one copy (``DeviceWeights``) instead of one of each per tensor (~350 for Qwen3-VL's tower).
That is the better part of a cold start's upload (each allocation rounds to the driver's 2 MiB, and
each copy from pageable memory waits for the driver's staging), and the tensors' device arrays are
views at their offsets in the one buffer.

The copy goes through two pinned staging chunks in turn (UPLOAD_MODE "pinned", the default): COPY_THREADS
host threads fill one (tower_graph.copy_pairs) while the other's copy runs on the stream, instead of
the driver's single-threaded staging of pageable memory (H200: 800 MiB in 91-99 ms against 119 ms).
"pageable": one plain copy. "register" (not yet measured on a GPU): the buffer itself is registered
with the driver read-only (cuMemHostRegister; read-only, so the pages the worker shares with the
zygote stay shared) for one copy at the link's speed, then unregistered; pinned chunks if the driver
refuses. The buffer starts and ends on a page boundary for it.

``beside`` (the vision worker's start, UPLOAD_BESIDE): the device buffer is allocated at once and the
copy runs on a host thread and its own stream while the worker goes on (its first kernel and its
warm-up, whose results do not matter: it only loads kernels and starts cuBLAS); ``wait`` joins it
before the worker says it is ready."""
from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np

log = logging.getLogger("moebus.vision")

ALIGN_BYTES = 256  # every tensor starts at this alignment (wide loads, cuBLAS)
PAGE_BYTES = 4096  # the buffer's own alignment and size multiple (a host registration's unit)
CHUNK_BYTES = 32 << 20  # one pinned staging chunk
UPLOAD_MODE = os.environ.get("MOEBUS_VISION_UPLOAD", "pinned")  # or "pageable"
UPLOAD_BESIDE = os.environ.get("MOEBUS_VISION_UPLOAD_BESIDE", "1") != "0"  # 0: the worker's upload first, alone


class HostWeights(dict):
    """name -> array, each a C-contiguous view into ``buffer`` (one uint8 array) at an offset
    that is a multiple of ALIGN_BYTES."""

    def __init__(self, arrays: dict, buffer: np.ndarray):
        super().__init__(arrays)
        self.buffer = buffer


def pack(weights: dict) -> HostWeights:
    """The same tensors (same names, shapes, dtypes and values) as views into one buffer, in
    tower_stream.packing_order: the encoder layers last, layer after layer, so that a streamed tower
    may read its layers from this buffer in place (MOEBUS_VISION_STREAM_HOST=register)."""
    from moebus.workers.tower_stream import packing_order

    weights = {name: weights[name] for name in packing_order(weights)}
    offsets, total = {}, 0
    for name, array in weights.items():
        offsets[name] = total
        total += -(-max(int(array.nbytes), 1) // ALIGN_BYTES) * ALIGN_BYTES
    total = -(-max(total, 1) // PAGE_BYTES) * PAGE_BYTES
    raw = np.empty(total + PAGE_BYTES, np.uint8)
    start = -host_address(raw) % PAGE_BYTES
    buffer = raw[start : start + total]
    views = {}
    for name, array in weights.items():
        array = np.asarray(array)
        start = offsets[name]
        views[name] = view = buffer[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
        view[...] = array
    return HostWeights(views, buffer)


def host_address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


class DeviceWeights:
    """One device copy of a HostWeights' buffer; ``view(array)``: the device array of a host
    array that lies in the buffer (a view of it), None for one that does not."""

    def __init__(self, backend, host: HostWeights, beside: bool = False):
        """``beside``: the copy runs on a thread while the caller goes on; ``wait`` before trusting the values."""
        self.host = host.buffer
        self.base = host_address(self.host)
        self._thread, self._error, self._stream = None, None, backend.stream
        if not beside:
            self.device = upload_bytes(backend, self.host)
            return
        from moebus.cuda.kernels.compat import cuda

        self.device = cuda.device_array(self.host.size, np.uint8, stream=backend.stream)
        self._thread = threading.Thread(target=self._upload, name="vision-weights-upload", daemon=True)
        self._thread.start()

    def _upload(self) -> None:
        try:
            from moebus.cuda.kernels.compat import cuda

            upload_into(self.device, self.host, cuda.stream())
        except BaseException as e:  # noqa: BLE001 - raised again by wait()
            self._error = e

    def wait(self) -> float:
        """Seconds spent waiting for an upload begun ``beside`` (0 for one that was not); where the
        thread failed, the copy again here on the caller's stream (its error logged)."""
        if self._thread is None:
            return 0.0
        started = time.perf_counter()
        self._thread.join()
        self._thread = None
        if self._error is not None:
            log.warning("the vision weights' copy beside the warm-up failed (%s: %s): copied again now",
                        type(self._error).__name__, self._error)
            self._error = None
            upload_into(self.device, self.host, self._stream)
        return time.perf_counter() - started

    @property
    def nbytes(self) -> int:
        return int(self.host.nbytes)

    def view(self, array):
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous or array.nbytes == 0:
            return None
        start = host_address(array) - self.base
        if start < 0 or start + array.nbytes > self.host.nbytes:
            return None
        return self.device[start : start + array.nbytes].view(array.dtype).reshape(array.shape)


def upload_bytes(backend, host: np.ndarray, chunk_bytes: int = CHUNK_BYTES, mode: str | None = None):
    """A device copy of the 1-D uint8 array ``host``, complete when this returns (see the module's
    docstring for the two modes)."""
    from moebus.cuda.kernels.compat import cuda

    device = cuda.device_array(host.size, np.uint8, stream=backend.stream)
    return upload_into(device, host, backend.stream, chunk_bytes, mode)


def upload_into(device, host: np.ndarray, stream, chunk_bytes: int = CHUNK_BYTES, mode: str | None = None):
    """upload_bytes into the device array ``device`` (of host's size) on ``stream``; returns ``device``."""
    from moebus.cuda.kernels.compat import cuda

    mode = mode or UPLOAD_MODE
    if mode == "register" and _copy_registered(host, device, stream):
        return device
    if mode == "pageable" or host.size <= chunk_bytes:
        device.copy_to_device(host, stream=stream)
        stream.synchronize()
        return device
    from moebus.workers.tower_graph import copy_pairs

    staging = [cuda.pinned_array(chunk_bytes, np.uint8) for _ in range(2)]
    copied = [cuda.event(), cuda.event()]  # recorded after each staging chunk's last copy
    for i, start in enumerate(range(0, host.size, chunk_bytes)):
        k = i % 2
        if i >= 2:
            copied[k].synchronize()  # its previous copy has left it
        piece = host[start : start + chunk_bytes]
        chunk = staging[k][: piece.size]
        copy_pairs([(chunk, piece)])
        device[start : start + piece.size].copy_to_device(chunk, stream=stream)
        copied[k].record(stream)
    stream.synchronize()
    return device


def _copy_registered(host: np.ndarray, device, stream) -> bool:
    """One copy of ``host`` registered read-only with the driver for its length; False (nothing
    copied) where it cannot be registered (the simulator, an old driver, an unaligned buffer)."""
    from moebus.cuda.kernels.compat import SIMULATOR

    if SIMULATOR:
        return False
    from cuda.bindings import driver as cu

    registered, err = register_read_only(host)
    if registered is None:
        log.warning("the vision weights could not be registered with the driver (%s): pinned chunks instead", err)
        return False
    try:
        device.copy_to_device(host, stream=stream)
        stream.synchronize()
    finally:
        cu.cuMemHostUnregister(registered)
    return True


def register_read_only(host: np.ndarray):
    """``host``'s pages registered with the driver read-only (pages shared with the zygote stay shared; a
    copy from them runs at the link's speed, a captured graph may hold them): (the registered base, for
    cuMemHostUnregister, None) or (None, the driver's error)."""
    from cuda.bindings import driver as cu

    pointer = host_address(host)
    base = pointer - pointer % PAGE_BYTES
    size = -(-(pointer + host.nbytes - base) // PAGE_BYTES) * PAGE_BYTES
    (err,) = cu.cuMemHostRegister(base, size, cu.CU_MEMHOSTREGISTER_READ_ONLY)
    return (base, None) if err == cu.CUresult.CUDA_SUCCESS else (None, err)
