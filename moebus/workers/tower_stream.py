"""A vision tower's encoder layers streamed through a few layers' room on the device (issue 20;
``MOEBUS_VISION_STREAM_LAYERS``: on by default for LLaVA's towers since the H200 measured it, twenty-ninth
session; opt-in for Qwen3-VL's): LLaVA's through two slots, Qwen3-VL's through three.

The vision worker holds its tower's weights on the GPU while it lives (``idle_s`` after the last
image): so400m's 803 MiB of its 1,462 MiB on the H200, ~89 A3B experts the text's cache hands back
for it (twenty-sixth session: 675 slots idle, 541 through the image). Streamed, the encoder layers'
weights stay in pinned host memory and S device slots take them in turn: before the encode's first
kernel a side stream copies layers 0 .. S - 1; layer i waits for its copy, and once every kernel that
reads its weights is enqueued the side stream waits for them and copies layer i + S into that slot.
The device then holds S layers (~60 MiB for so400m at S = 2) and the weights outside the layers
(embeddings, projector, Qwen3-VL's mergers). Qwen3-VL's block adds the last block's fc2 bias in its
first norm, so its slots are released a block late and it needs three to copy one block ahead.

The cost: each encode reads the layers over PCIe (803 MiB, ~16 ms at the H200's ~50 GB/s) where the
resident tower computes in ~13.4 ms (its graph, warm): the encode's time becomes about the copy's,
and the link is shared with the text's misses read in place while it runs. The copies and their
event waits are captured in the tower's graph like its kernels (tower_graph.py), so a replay streams
too. Same launches on the same bits: the encode's results equal the resident tower's bit for bit.

In the simulator there are no events: copies there complete when they are enqueued."""
from __future__ import annotations

import logging
import os
import re
import time
import weakref

import numpy as np

from moebus.common.env_switches import switch_from_env
from moebus.common.errors import ConfigError
from moebus.workers.tower_graph import copy_pairs
from moebus.workers.vision_weight_pack import PAGE_BYTES, host_address, register_read_only

log = logging.getLogger("moebus.vision")
ALIGN_BYTES = 256  # each tensor's start in a slot (wide loads, cuBLAS)
# an encoder layer's tensors: LLaVA's "encoder.layers.{i}." (vision_weights.LAYER), Qwen3-VL's "blocks.{i}."
# (qwen3vl_weights.BLOCK); the zygote's pack puts them layer after layer in this order (packing_order)
LAYER_NAME = re.compile(r"^(encoder\.layers|blocks)\.(\d+)\.(.+)$")
HOST_MODES = ("copy", "register")


def host_mode_from_env(environ=os.environ) -> str:
    """``MOEBUS_VISION_STREAM_HOST``: where a streamed tower's layers are read from on the host.
    "copy" (default): a pinned buffer of their own, filled at the worker's start (so400m: 803 MiB, the
    start's +0.35-0.45 s on the H200, twenty-ninth session). "register" (not yet measured on a GPU):
    the zygote's packed weights themselves, registered with the driver read-only (cuMemHostRegister),
    where they lie layer after layer as the stream's blocks (vision_weight_pack.pack in packing_order:
    LLaVA's; Qwen3-VL's blocks add views of their fused bias, so theirs are copied), saving the buffer's
    allocation and fill and its host memory; a copy as before where they do not or the driver refuses."""
    mode = environ.get("MOEBUS_VISION_STREAM_HOST", "copy")
    if mode not in HOST_MODES:
        raise ConfigError(f"MOEBUS_VISION_STREAM_HOST must be one of {', '.join(HOST_MODES)} (got {mode!r})")
    return mode


def packing_order(names) -> list[str]:
    """``names`` ordered for one host buffer a streamed tower can read in place: every tensor outside
    the encoder layers first (in the given order), then layer 0's, layer 1's... each layer's by name,
    so that layer i's tensors are one block at i x the block's size, at the offsets LayerStream gives them."""
    names = list(names)
    layered = {name: LAYER_NAME.match(name) for name in names}
    rest = [name for name in names if layered[name] is None]
    in_layers = sorted((n for n in names if layered[n] is not None),
                       key=lambda n: (layered[n].group(1), int(layered[n].group(2)), layered[n].group(3)))
    return rest + in_layers


def stream_layers_from_env(environ=os.environ, tower: str = "siglip") -> bool:
    """``MOEBUS_VISION_STREAM_LAYERS`` (0 or 1), else a ConfigError naming it, raised where a vision
    model is made (the vision worker's start). Unset: on for LLaVA's towers (``tower`` "siglip" or
    "clip"; measured on the H200, twenty-ninth session: ~80 more slots through the image, the largest
    gaps lower, the cold image's first token within the runs' spread) unless the tower is cut in
    slices (MOEBUS_TOWER_SLICE_LAYERS > 0: a slice's graph cannot wait on another's copy), off for
    Qwen3-VL's ("qwen3_vl": its streamed tower is exact on a GPU but not yet timed)."""
    from moebus.workers import tower_slices

    default = tower != "qwen3_vl" and tower_slices.SLICE_LAYERS == 0
    return switch_from_env("MOEBUS_VISION_STREAM_LAYERS", environ, default=default)


def place_layers(backend, count: int, host_layer, weight, slots: int = 2, tower: str = "siglip"):
    """(the LayerStream or None, each of ``count`` layers' weights as the kernels read them): streamed
    through ``slots`` where the switch is on for ``tower`` (cuda), else each of ``host_layer(i)``'s
    arrays through ``weight`` (the tower's own upload)."""
    if backend.name == "cuda" and stream_layers_from_env(tower=tower):
        stream = LayerStream([host_layer(i) for i in range(count)], backend, slots)
        return stream, [stream.layer(i) for i in range(count)]
    return None, [{name: weight(array) for name, array in host_layer(i).items()} for i in range(count)]


def _round_up(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


class LayerStream:
    """The encoder layers' weights (``layers``: per layer, name -> host array; every layer the same
    names, shapes and dtypes) in one pinned host buffer, a layer a block, and ``slots`` device slots
    (2: a layer's weights are read by its own kernels only, LLaVA's; 3: also by the next layer's first
    kernel, Qwen3-VL's, whose block adds the last block's fc2 bias in its first norm)."""

    def __init__(self, layers: list[dict], ops, slots: int = 2):
        from moebus.cuda.kernels.compat import SIMULATOR, cuda

        if not layers:
            raise ValueError("no encoder layers to stream")
        first = layers[0]
        self.offsets, at = {}, 0
        for name, array in first.items():
            self.offsets[name] = at
            at += _round_up(max(int(array.nbytes), 1))
        self.block_bytes = _round_up(at)
        for i, layer in enumerate(layers):
            if {n: (a.shape, a.dtype) for n, a in layer.items()} != {n: (a.shape, a.dtype) for n, a in first.items()}:
                raise ValueError(f"encoder layer {i}'s tensors differ from layer 0's: the layers cannot share slots")
        self.num_layers = len(layers)
        started = time.perf_counter()
        self.host_source = "copy"  # or "packed" (the packed weights read in place), "registered" (and pinned)
        in_place = _blocks_in_place(layers, self.offsets, self.block_bytes) if host_mode_from_env() == "register" else None
        if in_place is not None:
            self.host, self.host_source = in_place, "packed"
            if not SIMULATOR:
                self.host_source = "registered" if _register_read_only(self, in_place) else "copy"
        if self.host_source == "copy":
            self.host = cuda.pinned_array(self.num_layers * self.block_bytes, np.uint8)
            pairs = []  # filled by COPY_THREADS threads in slices (so400m: 803 MiB at the worker's start)
            for i, layer in enumerate(layers):
                base = i * self.block_bytes
                for name, array in layer.items():
                    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
                    pairs.append((self.host[base + self.offsets[name] : base + self.offsets[name] + raw.size], raw))
            copy_pairs(pairs)
        log.info("the streamed tower's %d layers (%.0f MiB) on the host: %s in %.0f ms", self.num_layers,
                 self.host.nbytes / (1 << 20), {"copy": "a pinned copy", "packed": "the packed weights in place",
                                                "registered": "the packed weights registered read-only"}[self.host_source],
                 1e3 * (time.perf_counter() - started))
        self.slots = min(slots, self.num_layers)
        self.device = cuda.device_array(self.slots * self.block_bytes, np.uint8)
        self.views = [{name: self._view(slot, name, array) for name, array in first.items()}
                      for slot in range(self.slots)]
        self.ops, self.side = ops, cuda.stream()  # the compute stream is ops.stream, read at each use
        self.simulated = SIMULATOR
        make = (lambda: None) if SIMULATOR else (lambda: cuda.event(timing=False))
        self.copied, self.used = [make() for _ in range(self.slots)], [make() for _ in range(self.slots)]

    def _view(self, slot: int, name: str, array):
        start = slot * self.block_bytes + self.offsets[name]
        return self.device[start : start + array.nbytes].view(array.dtype).reshape(array.shape)

    @property
    def device_bytes(self) -> int:
        return int(self.device.size)

    def layer(self, i: int) -> dict:
        """Layer i's weights as the kernels read them: views of its slot (valid between ``before(i)``
        and ``after(i)`` in stream order)."""
        return self.views[i % self.slots]

    def begin(self) -> None:
        """Before the encode's first kernel: the side stream waits for the compute stream as it is (the
        last encode's reads of every slot) and copies the first layers, a slot each."""
        self._fork(self.used[0])
        for i in range(self.slots):
            self._copy(i)

    def before(self, i: int) -> None:
        """Layer i's kernels wait for its copy."""
        self._wait(self.copied[i % self.slots], self.ops.stream)

    def after(self, i: int) -> None:
        """Once every kernel that reads layer i's weights is enqueued: the side stream waits for them and
        copies layer i + slots into that slot."""
        if 0 <= i and i + self.slots < self.num_layers:
            self._fork(self.used[i % self.slots])
            self._copy(i + self.slots)

    def _copy(self, i: int) -> None:
        slot = i % self.slots
        target = self.device[slot * self.block_bytes : (slot + 1) * self.block_bytes]
        target.copy_to_device(self.host[i * self.block_bytes : (i + 1) * self.block_bytes], stream=self.side)
        self._record(self.copied[slot], self.side)

    def _fork(self, event) -> None:
        self._record(event, self.ops.stream)
        self._wait(event, self.side)

    def _record(self, event, stream) -> None:
        if self.simulated:
            return
        from cuda.bindings import driver as cu

        from moebus.cuda.backends.graphs import _stream_handle

        (err,) = cu.cuEventRecord(_handle(event), _stream_handle(stream))
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"the tower's layer stream: cuEventRecord {err}")

    def _wait(self, event, stream) -> None:
        if self.simulated:
            return
        from cuda.bindings import driver as cu

        from moebus.cuda.backends.graphs import _stream_handle

        (err,) = cu.cuStreamWaitEvent(_stream_handle(stream), _handle(event), 0)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"the tower's layer stream: cuStreamWaitEvent {err}")


def _blocks_in_place(layers: list[dict], offsets: dict, block_bytes: int) -> np.ndarray | None:
    """The layers' tensors as one uint8 view where they already lie as the stream's blocks (layer i's
    tensor ``name`` at i x ``block_bytes`` + ``offsets[name]`` of one buffer, its pages whole within it:
    the zygote's pack in packing_order), else None."""
    first_name = next(iter(offsets))
    first = layers[0][first_name]
    base = host_address(first) - offsets[first_name]
    for i, layer in enumerate(layers):
        for name, array in layer.items():
            if not array.flags.c_contiguous or host_address(array) != base + i * block_bytes + offsets[name]:
                return None
    root = first
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not root.flags.c_contiguous:
        return None
    start, size = base - host_address(root), len(layers) * block_bytes
    lo, hi = start - base % PAGE_BYTES, start + size + (-(base + size) % PAGE_BYTES)  # whole pages, for a registration
    if lo < 0 or hi > root.nbytes:
        return None
    return root.reshape(-1).view(np.uint8)[start : start + size]


def _register_read_only(owner, host: np.ndarray) -> bool:
    """Register ``host`` with the driver read-only (vision_weight_pack.register_read_only), unregistered when
    ``owner`` goes; False where the driver refuses (the caller copies instead)."""
    from cuda.bindings import driver as cu

    registered, err = register_read_only(host)
    if registered is None:
        log.warning("the streamed tower's packed layers could not be registered with the driver (%s): copied to "
                    "a pinned buffer instead", err)
        return False
    weakref.finalize(owner, cu.cuMemHostUnregister, registered)
    return True


def _handle(event) -> int:
    return int(getattr(event.handle, "value", event.handle))  # a bindings CUevent, or a ctypes handle
