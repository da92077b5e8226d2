"""The vision worker process, forked by the vision zygote (workers/vision_zygote.py) with the weights
already in host RAM: it creates its device backend (on cuda: its CUDA context), uploads the tower
and projector (the copy runs on beside the rest, vision_weight_pack.UPLOAD_BESIDE), registers with the broker
(VISION_READY) and serves ENCODE until SHUTDOWN. A lazy start skips the blank-image warm-up by default: the
cold image's first encode loads the tower's kernels (WARM_UP_MODE below); a start at boot (vision.lazy false)
runs it before VISION_READY, so that no kernel is compiled or loaded during a request. It
exits then, so that everything it holds on the device, context included, goes back to the driver.

A cold image request waits for this start and the first encode, so the log splits both (INFO: the
fork, the context, the backend, the upload, the first kernel, the warm-up, the libraries loaded
since the fork; each of a worker's first encodes by decode and preprocess, tower and its path),
and the tower's graph of a new image size is captured after that encode's reply has left.

On the cpu device its memory is charged to the emulated GPU's ledger before anything is built, so
it really fails to start when the expert caches did not hand the memory back."""
from __future__ import annotations

import logging
import os
import time


from moebus.common.errors import RequestError
from moebus.common.images import ImageLimits, decode_image
from moebus.common.protocol import Encode, EncodeReply, VisionReady, WorkerError
from moebus.cuda.backends import make_backend
from moebus.cuda.kernels.compat import SIMULATOR, disk_cache_counts
from moebus.cuda.memory import context_limits
from moebus.workers import step_watch, tower_graph, tower_slices, tower_stream
from moebus.workers.cache_sizing import emulated_gpu
from moebus.workers.link import BrokerLink
from moebus.workers.loop import serve
from moebus.workers.vision_footprint import Nvml, StartFootprint, cuda_device_uuid
from moebus.workers.vision_model import VisionModel, encode_scratch_bytes, first_encode_bytes, make_vision_model
from moebus.workers.vision_preload import LoadBeside
from moebus.workers.vision_weight_pack import UPLOAD_BESIDE

log = logging.getLogger("moebus.vision")


IMAGES_PER_PASS = 1
LOGGED_ENCODES = 4  # a worker's first encodes are logged at INFO (a cold start's), later ones at DEBUG
# The blank-image warm-up (MOEBUS_VISION_WARM_UP): unset ("auto", the default) before VISION_READY only for a
# start at boot (vision.lazy false: no request waits for it), else as "load"; "0" never (a cold image's encode
# loads the kernels; on a fresh kernel cache compiles them); "1" always before VISION_READY, as before; "load" none,
# but cuBLAS's start and the cached kernels' loads on a thread (vision_preload.py) begun once VISION_READY is sent,
# which the first encode joins after its image's decode and preprocess.
WARM_UP_MODE = os.environ.get("MOEBUS_VISION_WARM_UP", "auto")


def charge_bytes(cfg, weights: dict, processor=None) -> int:
    """What the worker holds on its device: the weights as the cpu backend keeps them (float32)
    plus the scratch of one tower pass (an upper bound, workers/vision_model.py). What the cpu
    worker charges to the ledger, and the broker's cpu default of vision.vram_mib."""
    return 4 * sum(int(w.size) for w in weights.values()) + encode_scratch_bytes(cfg, IMAGES_PER_PASS, processor)


POSITIONS = "embeddings.position_embedding.weight"


def cuda_device_bytes(cfg, weights: dict, processor=None, streamed: bool | None = None) -> int:
    """What a LLaVA worker will hold on a cuda device beyond its context, before any start measured
    it: the weights in their stored dtype (the backend keeps them so) plus a first encode's scratch and
    loads (first_encode_bytes); with MOEBUS_VISION_STREAM_LAYERS (``streamed`` None: the setting) the
    encoder layers past the stream's two slots stay in host memory (each slot's tensors 256-aligned:
    4 KiB a slot counted for that).
    The zygote's hello carries it; the broker's first reserve for the tower on cuda comes from it."""
    from moebus.workers.vision_weights import LAYER

    streamed = tower_stream.stream_layers_from_env(tower=cfg.tower) if streamed is None else streamed
    total = sum(int(w.nbytes) for w in weights.values())
    if POSITIONS in weights:  # the tower keeps its position table as float32 (vision_model.py)
        total += 4 * int(weights[POSITIONS].size) - int(weights[POSITIONS].nbytes)
    if streamed and cfg.tower != "qwen3_vl" and cfg.num_layers_run > 2:
        kept = (LAYER.format(i=0), LAYER.format(i=1))
        layers = sum(int(w.nbytes) for name, w in weights.items()
                     if name.startswith(LAYER.split("{")[0]) and not name.startswith(kept))
        total += 2 * 4096 - layers
    return total + first_encode_bytes(cfg, IMAGES_PER_PASS, processor)


class VisionWorker:
    def __init__(self, model: VisionModel, processor, link: BrokerLink, limits: ImageLimits, beside=None,
                 device: str = "cpu", footprint=None, reckoned_bytes: int = 0):
        """``beside``: a vision_preload.LoadBeside still running (MOEBUS_VISION_WARM_UP=load or a lazy "auto"), or None.
        ``footprint``: the start's vision_footprint.StartFootprint, NVML still open, where VISION_READY's figure
        reckoned the first encode's scratch (``reckoned_bytes``): that encode's reply says what it measured."""
        self.model = model
        self.beside = beside
        self.processor = processor
        self.link = link
        self.limits = limits
        self.num_encodes = 0
        self.device = device
        self.gate = SliceGate(device) if tower_slices.SLICE_LAYERS > 0 and tower_slices.SLICE_WHEN == "busy" else None
        self.footprint, self.reckoned_bytes = footprint, reckoned_bytes

    def serve(self) -> int:
        """The worker loop (workers/loop.py). Returns the process exit status."""
        when = None if self.device == "cuda" else "reply"  # (no graphs elsewhere: nothing waits for NVML)
        try:
            return serve(CaptureAfterReply(self.link, self.model, when=when), self.handle, self.failure)
        finally:
            if self.footprint is not None:
                self.footprint.close()

    def failure(self, message, text: str, fatal: bool) -> WorkerError:
        return WorkerError(generation=self.link.generation, message=text, step_id=getattr(message, "encode_id", None),
                           fatal=fatal)

    def handle(self, message):
        if isinstance(message, Encode):
            return self.encode(message)
        raise ValueError(f"unexpected message {type(message).__name__}")

    def encode(self, msg: Encode) -> EncodeReply:
        started = time.perf_counter()
        pixels = []
        for i, data in enumerate(msg.images):
            try:
                image = decode_image(data.tobytes(), self.limits, f"images[{i}]")
            except RequestError as e:
                return EncodeReply(encode_id=msg.encode_id, generation=self.link.generation, error=e.message, image=i)
            with image:
                pixels.append(self.processor.preprocess(image))
        preprocessed = time.perf_counter()
        packed = getattr(self.model, "packed", None)
        copy_s = packed.wait() if packed is not None else 0.0  # (0 once it has ended)
        warm_s = self.beside.wait() if self.beside is not None else None
        self.beside = None
        gated = self.gate.apply(getattr(self.model, "graph", None)) if self.gate is not None else ""
        arrays = self.model.encode_reply(pixels)
        done = time.perf_counter()
        self.num_encodes += 1
        level = logging.INFO if self.num_encodes <= LOGGED_ENCODES else logging.DEBUG
        log.log(level, "encode %d: %d image(s), decode and preprocess %.1f ms, tower %.1f ms (%s)%s", self.num_encodes,
                len(pixels), 1e3 * (preprocessed - started), 1e3 * (done - preprocessed),
                tower_path(self.model),
                (f", of it the weights' copy {1e3 * copy_s:.1f} ms" if copy_s else "")
                + (f", before it the preload beside {1e3 * warm_s:.1f} ms" if warm_s is not None else "") + gated
                + self._stack_limit(level))
        return EncodeReply(encode_id=msg.encode_id, generation=self.link.generation, compute_s=done - started,
                           measured_bytes=self._measured_after_first_encode(), **arrays)

    def _measured_after_first_encode(self) -> int:
        """The footprint after the first encode where the start reckoned its scratch (the driver's count,
        NVML), logged beside that reckoning; 0 for every other encode, or where NVML cannot be read."""
        footprint = self.footprint
        if footprint is None or footprint.total_bytes is None or footprint.encode_bytes is not None:
            return 0
        total = footprint.after_first_encode()
        if total is None:
            return 0
        log.info("vision worker footprint after its first encode: %.1f MiB on the device (the start's %.1f MiB and "
                 "%.1f MiB more since, where the start reckoned %.1f MiB of scratch and loads)", total / (1 << 20),
                 (total - footprint.encode_bytes) / (1 << 20), footprint.encode_bytes / (1 << 20),
                 self.reckoned_bytes / (1 << 20))
        return total

    def _stack_limit(self, level: int) -> str:
        """Where the context's stack limit was lowered (MOEBUS_CUDA_STACK_BYTES, or a LLaVA worker's
        default): the limit now, in the first encodes' lines (the start's footprint is measured before
        the first encode; a launch that needs more stack raises the limit, and that memory is the
        worker's too)."""
        default = context_limits.vision_stack_bytes(self.model.cfg.tower)
        lowered = context_limits.stack_bytes_from_env(default=default) is not None
        if level != logging.INFO or self.device != "cuda" or SIMULATOR or not lowered:
            return ""
        return f", CUDA stack limit {context_limits.stack_limit_bytes()} B a thread"


def tower_path(model) -> str | None:
    """How the model's last encode ran (tower_graph.TowerGraph.path: its path, and its slices where cut)."""
    graph = getattr(model, "graph", None)
    return graph.path() if hasattr(graph, "path") else getattr(graph, "last_path", None)


class SliceGate:
    """tower_slices.SLICE_WHEN "busy": a sliced tower cuts between its slices only where the GPU was busy as
    the encode began (NVML's utilization >= SLICE_BUSY_PERCENT: the text workers decode beside it; the
    broker could say so in the ENCODE instead). Where NVML cannot be read (cpu, no pynvml) it cuts always."""

    def __init__(self, device: str, make_nvml=None):
        self.nvml = None
        try:
            if device != "cuda" and make_nvml is None:
                raise RuntimeError(f"no NVML on {device}")
            self.nvml = (make_nvml or (lambda: Nvml(cuda_device_uuid())))()
        except Exception as e:  # noqa: BLE001 - no NVML: the slices are always cut
            log.info("the tower's slices are cut in every encode (NVML: %s)", e)

    def apply(self, graph) -> str:
        """Turn ``graph``'s cuts on or off for the encode that begins; the log's note."""
        if graph is None or self.nvml is None:
            return ""
        percent = self.nvml.busy_percent()
        graph.pacer.on = percent >= tower_slices.SLICE_BUSY_PERCENT
        return f", GPU {percent}% busy: slices {'cut' if graph.pacer.on else 'back to back'}"


class CaptureAfterReply:
    """The broker link for the worker loop, whose ``send`` then captures the tower's graph of an
    image size seen for the first time (tower_graph.py): the reply is on its way first, so the
    capture (80-117 ms of host work for a 1024 px image on the H200) no longer delays the image
    request that brought the new size. tower_graph.CAPTURE_WHEN "idle": not after the reply but once
    NVML sees the GPU idle (under CAPTURE_BUSY_PERCENT), polled every POLL_S while ``recv`` waits, so
    not while the text workers decode beside it (issue 20; a boot warm-up's shape too); "next": the
    next encode of that size captures it. The log line says where the capture's host time went (its pinned buffers, the
    launches recorded, the instantiation)."""

    POLL_S = 0.05

    def __init__(self, link: BrokerLink, model, make_nvml=None, when: str | None = None):
        self.link, self.model = link, model
        self.when = when or tower_graph.CAPTURE_WHEN
        self.nvml = None
        if self.when == "idle":
            try:
                self.nvml = (make_nvml or (lambda: Nvml(cuda_device_uuid())))()
            except Exception as e:  # noqa: BLE001 - no NVML: the capture follows the reply
                log.info("the tower's capture follows the reply (NVML: %s)", e)
                self.when = "reply"
        # "idle": a boot warm-up's shape (vision.lazy false) is captured at the first idle GPU too
        self.waiting = self.when == "idle" and self._pending()

    def recv(self, timeout_s: float | None = None):
        if not self.waiting:
            return self.link.recv(timeout_s=timeout_s)
        end = None if timeout_s is None else time.perf_counter() + timeout_s
        while True:
            left = self.POLL_S if end is None else min(self.POLL_S, end - time.perf_counter())
            message = self.link.recv(timeout_s=max(left, 0.0))
            if message is not None:
                return message  # (an encode of that size captures it itself)
            if not self._pending():
                self.waiting = False
            else:
                percent = self.nvml.busy_percent()
                if percent < tower_graph.CAPTURE_BUSY_PERCENT:
                    self.waiting = False
                    self._capture(f"once the GPU was {percent}% busy")
            if not self.waiting or (end is not None and time.perf_counter() >= end):
                return None

    def send(self, message) -> None:
        self.link.send(message)
        if isinstance(message, EncodeReply) and message.error is None:
            if self.when == "reply":
                self._capture("after its reply")
            elif self.when == "idle":
                self.waiting = self._pending()

    def _pending(self) -> bool:
        graph = getattr(self.model, "graph", None)
        return graph.pending() if hasattr(graph, "pending") else True

    def _capture(self, when: str) -> None:
        seconds = self.model.capture_pending()
        if seconds is not None:
            parts = getattr(getattr(self.model, "graph", None), "capture_parts", "")
            log.info("tower graph of the last image size captured %s: %.1f ms%s", when, 1e3 * seconds,
                     f" ({parts})" if parts else "")


def warm_up(model: VisionModel, processor, cfg) -> None:
    """Run the tower once on a blank image (VisionModel.warm_up): no kernel compiles in a request."""
    model.warm_up(processor)


def first_kernel(backend) -> None:
    """One tiny kernel and its wait: what the first launch of a process loads (numba's launch path,
    the module) is timed apart from the warm-up's tower."""
    backend.zeros((1,))
    backend.synchronize()


def loaded_libraries() -> set[str]:
    """Shared libraries mapped into this process (/proc/self/maps; empty where there is none)."""
    try:
        with open("/proc/self/maps") as maps:
            return {line.rsplit("/", 1)[-1].strip() for line in maps if ".so" in line}
    except OSError:
        return set()


def _driver_free(device: str, flush: bool = False) -> int | None:
    """cuda: the driver's free bytes now (cuMemGetInfo); ``flush``: numba's deferred frees first, so
    that memory the warm-up let go of is not counted as the worker's. None elsewhere."""
    if device != "cuda":
        return None
    from numba import cuda

    from moebus.cuda.memory.vmm import device_memory_info

    context = cuda.current_context()
    if flush and hasattr(context, "deallocations"):  # not in the simulator
        context.deallocations.clear()
    return device_memory_info()[0]


def _driver(device: str) -> None:
    """cuda: numba's driver and its device 0 (cuInit, the device's attributes), no context: what a
    spare worker does before its start."""
    if device == "cuda":
        from numba.cuda.cudadrv.driver import driver

        driver.get_device(0)


def _context(device: str) -> None:
    if device == "cuda":
        from numba import cuda

        cuda.current_context()


def run_vision_worker(settings, cfg, weights: dict, processor, connect: str, device: str, charge: int,
                      gpu: int, forked_at: float | None = None, go=None) -> int:
    """Runs in the forked child of the zygote, on ``gpu`` (worker order; on cuda the zygote made it
    the only visible device); ``forked_at``: the zygote's time.time() at the fork. ``go``: this child
    is a spare, forked ahead (workers/vision_spare.py): it opens the driver (cuInit) and NVML, then
    ``go()`` blocks until the zygote starts it and returns the time.time() of that start (None: the
    spare is dropped, and it returns 0 at once). Raises on a failed start (the zygote reports why)."""
    libraries = loaded_libraries()
    prepared = None
    if go is not None:  # no context yet, nothing allocated: the device's memory is not touched before go
        began = time.perf_counter()
        footprint = StartFootprint(device, read=False)
        _driver(device)
        prepared = time.perf_counter() - began
        forked_at = go()
        if forked_at is None:
            return 0
    started = time.perf_counter()
    since_fork = time.time() - forked_at if forked_at is not None else 0.0
    if device == "cpu":  # before any allocation, as cudaMalloc would fail
        emulated_gpu(settings, gpu).allocate(charge, "vision")
    if go is not None:
        footprint.read_before()  # the caches have shrunk by now (the hand-back precedes the start)
    else:
        footprint = StartFootprint(device)  # cuda: the device's used bytes before this process has a context
    read = time.perf_counter()
    _context(device)
    contexted = time.perf_counter()
    backend = make_backend(device, context_limits.vision_stack_bytes(cfg.tower))
    footprint.context_made(_driver_free(device))
    built = time.perf_counter()
    model = make_vision_model(cfg, weights, backend, beside=UPLOAD_BESIDE)  # (beside: the copy runs on)
    footprint.weights_loaded(_driver_free(device, flush=True))
    uploaded = time.perf_counter()
    first_kernel(backend)
    launched = time.perf_counter()
    warm = WARM_UP_MODE == "1" or (WARM_UP_MODE == "auto" and not settings.vision.lazy)
    if warm:
        warm_up(model, processor, cfg)
    warmed = time.perf_counter()
    # (no warm-up: the first encode waits for the copy, after its image's decode and preprocess)
    waited = model.packed.wait() if warm and getattr(model, "packed", None) is not None else 0.0
    measured = footprint.done(_driver_free(device, flush=True), keep=not warm)
    # the first encode's scratch and loads come after VISION_READY: reckoned until that encode's reply says what
    # the worker then holds (VisionWorker.encode)
    reckoned = first_encode_bytes(cfg, IMAGES_PER_PASS, processor) if measured and not warm else 0
    if reckoned:
        measured += reckoned
    else:
        footprint.close()  # (nothing to read after the first encode)
    # each part of the start shares the GPU with the text workers' steps: which one costs them a gap
    log.info("vision worker start on gpu%d: fork %.3f s, NVML (cuInit, used bytes) %.3f s, context %.3f s, "
             "backend %.3f s, weights %.3f s, first kernel %.3f s, warm-up %.3f s (%s), then the weights' copy "
             "%.3f s more (%s)", gpu, since_fork, read - started, contexted - read, built - contexted,
             uploaded - built, launched - uploaded, warmed - launched, getattr(model.graph, "last_path", None),
             waited, "beside the first kernel and warm-up" if UPLOAD_BESIDE else "before them")
    if prepared is not None:
        log.info("vision worker was a spare: NVML, cuInit and the device %.3f s before its start", prepared)
    log.info("vision worker libraries loaded since the fork: %s", " ".join(sorted(loaded_libraries() - libraries))
             or "none")
    link = BrokerLink(connect, "vision", settings.broker.heartbeat_s, settings.broker.heartbeat_liveness,
                      server_key=settings.broker.curve_public_key)
    link.start(VisionReady(generation=link.generation, gpu=gpu, device=device, pid=os.getpid(),
                           device_bytes=charge if device == "cpu" else model.device_bytes,
                           measured_bytes=measured or 0,
                           num_image_tokens=cfg.num_image_tokens, hidden_size=cfg.text_hidden_size,
                           start_s=time.perf_counter() - started))
    # (after VISION_READY has gone: it runs while the ENCODE comes and its image is decoded)
    beside = (LoadBeside(backend, device, lambda: _driver_free(device))
              if WARM_UP_MODE in ("load", "auto") and not warm else None)
    log.info("vision worker ready on gpu%d (%s): %.1f MiB, started in %.2f s", gpu, device,
             model.device_bytes / (1 << 20), time.perf_counter() - started)
    if device == "cuda":
        log.info("vision worker footprint: %s%s", footprint.describe(model.device_bytes),
                 f"; reported {measured / (1 << 20):.1f} MiB with one encode's scratch and loads reckoned (no warm-up)"
                 if measured and not warm else "")
    log.info("vision worker kernels: %d loaded from the disk cache, %d compiled%s", *disk_cache_counts(),
             step_watch.compiled_names())
    try:
        return VisionWorker(model, processor, link, ImageLimits.from_settings(settings.vision), beside,
                            device, footprint=footprint if reckoned else None, reckoned_bytes=reckoned).serve()
    finally:
        link.close()
