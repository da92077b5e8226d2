"""The vision worker process, forked by the vision zygote (workers/vision_zygote.py) with the weights
already in host RAM: it creates its device backend (on cuda: its CUDA context), uploads the tower
and projector, runs them once so that no kernel is compiled (or loaded from numba's disk cache)
during a request, registers with the broker (VISION_READY) and serves ENCODE until SHUTDOWN. It
exits then, so that everything it holds on the device, context included, goes back to the driver.

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
from moebus.cuda.kernels.compat import disk_cache_counts
from moebus.workers.cache_sizing import emulated_gpu
from moebus.workers.link import BrokerLink
from moebus.workers.loop import serve
from moebus.workers.vision_footprint import StartFootprint
from moebus.workers.vision_model import VisionModel, encode_scratch_bytes, make_vision_model

log = logging.getLogger("moebus.vision")


IMAGES_PER_PASS = 1


def charge_bytes(cfg, weights: dict, processor=None) -> int:
    """What the worker holds on its device: the weights as the cpu backend keeps them (float32)
    plus the scratch of one tower pass (an upper bound, workers/vision_model.py). What the cpu
    worker charges to the ledger, and the broker's cpu default of vision.vram_mib."""
    return 4 * sum(int(w.size) for w in weights.values()) + encode_scratch_bytes(cfg, IMAGES_PER_PASS, processor)


class VisionWorker:
    def __init__(self, model: VisionModel, processor, link: BrokerLink, limits: ImageLimits):
        self.model = model
        self.processor = processor
        self.link = link
        self.limits = limits

    def serve(self) -> int:
        """The worker loop (workers/loop.py). Returns the process exit status."""
        return serve(self.link, self.handle, self.failure)

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
        return EncodeReply(encode_id=msg.encode_id, generation=self.link.generation,
                           compute_s=time.perf_counter() - started, **self.model.encode_reply(pixels))


def warm_up(model: VisionModel, processor, cfg) -> None:
    """Run the tower once on a blank image (VisionModel.warm_up): no kernel compiles in a request."""
    model.warm_up(processor)


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


def run_vision_worker(settings, cfg, weights: dict, processor, connect: str, device: str, charge: int,
                      gpu: int) -> int:
    """Runs in the forked child of the zygote, on ``gpu`` (worker order; on cuda the zygote made it
    the only visible device). Raises on a failed start (the zygote reports why)."""
    started = time.perf_counter()
    if device == "cpu":  # before any allocation, as cudaMalloc would fail
        emulated_gpu(settings, gpu).allocate(charge, "vision")
    footprint = StartFootprint(device)  # cuda: the device's used bytes before this process has a context
    backend = make_backend(device)
    footprint.context_made(_driver_free(device))
    built = time.perf_counter()
    model = make_vision_model(cfg, weights, backend)
    footprint.weights_loaded(_driver_free(device, flush=True))
    uploaded = time.perf_counter()
    warm_up(model, processor, cfg)
    measured = footprint.done(_driver_free(device, flush=True))
    # each part of the start shares the GPU with the text workers' steps: which one costs them a gap
    log.info("vision worker start on gpu%d: device backend (context) %.3f s, weights %.3f s, warm-up %.3f s", gpu,
             built - started, uploaded - built, time.perf_counter() - uploaded)
    link = BrokerLink(connect, "vision", settings.broker.heartbeat_s, settings.broker.heartbeat_liveness,
                      server_key=settings.broker.curve_public_key)
    link.start(VisionReady(generation=link.generation, gpu=gpu, device=device, pid=os.getpid(),
                           device_bytes=charge if device == "cpu" else model.device_bytes,
                           measured_bytes=measured or 0,
                           num_image_tokens=cfg.num_image_tokens, hidden_size=cfg.text_hidden_size,
                           start_s=time.perf_counter() - started))
    log.info("vision worker ready on gpu%d (%s): %.1f MiB, started in %.2f s", gpu, device,
             model.device_bytes / (1 << 20), time.perf_counter() - started)
    if device == "cuda":
        log.info("vision worker footprint: %s", footprint.describe(model.device_bytes))
    log.info("vision worker kernels: %d loaded from the disk cache, %d compiled", *disk_cache_counts())
    try:
        return VisionWorker(model, processor, link, ImageLimits.from_settings(settings.vision)).serve()
    finally:
        link.close()
