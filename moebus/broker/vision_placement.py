"""Where the vision worker goes, decided from figures rather than found out by a failed start. The
zygote says what a vision worker charges (its ``hello``); each GPU worker says, in its INFO, the
most MiB its GPU can have free once its cache hands back all it may (``max_free_mib``: free now
plus every segment above one expert group). A GPU can host the vision worker when that is at
least what must be free there (``vision.vram_mib`` for it, else on cuda what the last start there
measured, plus a margin, else the default by device).

``vision.gpu: auto`` picks, among the GPUs that can, the one left with the most room; a fixed
``vision.gpu`` is checked. When none can, ``problem`` says by how many MiB each falls short and
which setting changes that; the broker logs it at boot, shows it in /health and /v1/cache, and
answers image requests with it at once instead of failing a start."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

from moebus.broker import vision_qwen3vl
from moebus.common.env_switches import number_from_env
from moebus.cuda.memory.context_limits import vision_context_mib

log = logging.getLogger("moebus.broker")
MIB = 1 << 20


@dataclass(frozen=True)
class Placement:
    gpu: int | None  # where the vision worker starts; None: no GPU can make room
    need_mib: float  # MiB that must be free on that GPU (on the first candidate when none can)
    max_free_mib: tuple  # per GPU, as the workers last reported it (None: not reported)
    problem: str | None = None

    def to_dict(self) -> dict:
        return {"gpu": self.gpu, "need_mib": self.need_mib, "max_free_mib": list(self.max_free_mib),
                "problem": self.problem}


def default_vram_mib(device: str, num_gpus: int, vision_gpu: int, charge_bytes: int,
                     cuda_vision_mib: int | None = None) -> list[int]:
    """cuda: [1800] on one GPU; 1700 on the vision GPU and 600 on each other one (the seed's
    measured split: context + tower + activations on the vision GPU, and room for the embeddings'
    traffic and the loaned prefill scratch elsewhere); ``cuda_vision_mib`` (a start's measured
    footprint, or Qwen3-VL's derived from its tower, broker/vision_qwen3vl.py) replaces the vision
    GPU's figure. cpu: exactly what the vision
    worker charges to the emulated GPU's ledger (its weights as the cpu backend holds them plus the
    activations of one tower pass: the worker encodes one image at a time), in whole MiB, on the
    vision GPU only."""
    if device == "cuda":
        mine = cuda_vision_mib or (1800 if num_gpus == 1 else 1700)
        return [mine if g == vision_gpu else 600 for g in range(num_gpus)]
    need = -(-charge_bytes // MIB) + 1
    return [need if g == vision_gpu else 0 for g in range(num_gpus)]


# above a start's measured footprint: what the next start may take more. 16 since the thirty-second session, where
# the H100's two lazy starts' footprints after their first encode agreed within 2 MiB (601.6, 603.6; 244.0 MiB each
# since the start): the 5% share (~30 MiB there) is then the larger; 64 before.
MEASURED_MARGIN_MIB = 16
MEASURED_MARGIN_SHARE = 0.05  # (the driver's rounding, a larger image's scratch), the larger of the two


def margin_mib_from_env(environ=os.environ) -> float:
    """``MOEBUS_VISION_RESERVE_MARGIN_MIB`` (default 16): the least MiB a reserve adds to a measured footprint
    (5% of it where that is more). Every MiB of it is a MiB of experts the vision GPU's cache hands back
    through each image (replayed on the cpu, the slots the image takes explain its share of the text streams'
    largest gap: docs/performance.md, thirty-first session); what the next start may take beyond the last
    one's measure comes out of the room beside the reserve. A number >= 0, else a ConfigError naming it, at
    the broker's start."""
    return number_from_env("MOEBUS_VISION_RESERVE_MARGIN_MIB", str(MEASURED_MARGIN_MIB),
                           "MiB a vision reserve adds to a measured footprint", environ)


def measured_reserve_mib(measured_bytes: int, margin_mib: float = MEASURED_MARGIN_MIB) -> int:
    """The reserve for a vision worker whose last start on that GPU took ``measured_bytes`` (the
    driver's count, context included: workers/vision_footprint.py), in whole MiB with a margin of
    ``margin_mib`` or 5%, the larger."""
    mib = measured_bytes / MIB
    return int(-(-(mib + max(margin_mib, MEASURED_MARGIN_SHARE * mib)) // 1))


def memory_setting(device: str) -> str:
    """The setting that gives a GPU more memory for moebus."""
    return "emulated_vram_mib" if device == "cpu" else "gpu_memory_mib (or free VRAM that other programs hold)"


def place(choice: int | str, num_gpus: int, need_of: Callable[[int], float], max_free: list,
          device: str) -> Placement:
    """``choice``: ``vision.gpu`` ("auto" or a GPU index); ``need_of(g)``: MiB that must be free on
    GPU g to start the vision worker there; ``max_free``: the workers' ``max_free_mib`` (None for a
    GPU that has not said: it is assumed to fit, as nothing better is known)."""
    candidates = list(range(num_gpus)) if choice == "auto" else [int(choice)]
    fits = [g for g in candidates if max_free[g] is None or max_free[g] >= need_of(g)]
    if fits:
        best = max(fits, key=lambda g: (float("inf") if max_free[g] is None else max_free[g] - need_of(g), -g))
        return Placement(best, need_of(best), tuple(max_free))
    short = "; ".join(f"gpu{g} can free at most {max_free[g]:.1f} MiB of the {need_of(g):.1f} MiB it needs there "
                      f"({need_of(g) - max_free[g]:.1f} MiB missing)" for g in candidates)
    others = [g for g in range(num_gpus) if g not in candidates and (max_free[g] is None or max_free[g] >= need_of(g))]
    fix = (f"vision.gpu: auto would place it on gpu{others[0]}" if others else
           f"give a GPU more memory ({memory_setting(device)}), or lower max_batch / max_context (its KV cache)")
    return Placement(None, need_of(candidates[0]), tuple(max_free),
                     f"no GPU can make room for the vision worker: {short}; {fix}")


def short_of(need_mib: float, free_mib: float | None, gpu: int, device: str) -> str:
    """Why a start that was placed still found no room: another program holds the memory."""
    if free_mib is None:
        return ""
    return (f"; gpu{gpu} had {free_mib:.1f} MiB free after the hand-back, {max(need_mib - free_mib, 0):.1f} MiB "
            f"short of the {need_mib:.1f} MiB the vision worker needs (another program holds VRAM there?); "
            f"vision.gpu chooses the GPU, {memory_setting(device)} gives it more")


class PlacementMixin:
    """VisionLifecycle's placement methods (a mixin: the state is the lifecycle's, named below)."""

    settings: object
    vision: object  # the vision settings
    num_gpus: int
    zygote_info: dict | None
    placement: Placement | None
    hooks: object
    measured_bytes: dict  # gpu -> what the last vision start there took (VISION_READY's measured_bytes)
    margin_mib: float  # margin_mib_from_env()

    @property
    def gpu(self) -> int:
        """The vision worker's GPU: placed, else the fixed setting (auto: gpu0 until placed)."""
        if self.placement is not None and self.placement.gpu is not None:
            return self.placement.gpu
        return self.vision.gpu if self.vision.gpu != "auto" else 0

    def reserves(self, gpu: int | None = None) -> list[float | None]:
        """MiB to hand back per GPU for a vision worker on ``gpu`` (default: its current GPU): the
        operator's ``vision.vram_mib``, else on the vision GPU what the last start there measured
        (plus a margin; cuda; LLaVA's warm-up encodes a full image, Qwen3-VL's a small one, so for
        Qwen3-VL at least the figure from its tower); before a LLaVA start was measured there, a
        context and what the zygote reckons the worker holds (its ``cuda_bytes``: the weights as
        stored, two layers of them where they are streamed, and an encode's scratch), with the same
        margin (the context as reckoned for the worker's stack limit: cuda/memory/context_limits.py,
        284 MiB at a LLaVA worker's 64 B); else the default."""
        gpu = self.gpu if gpu is None else gpu
        charge = (self.zygote_info or {}).get("charge_bytes", 0)
        measured = self.measured_bytes.get(gpu)  # what the last start there really took (cuda)
        if not measured and not self.processor:  # LLaVA's first start there: a context + the zygote's reckoning
            cuda_bytes = (self.zygote_info or {}).get("cuda_bytes") or 0
            measured = vision_context_mib(self.config.tower) * MIB + cuda_bytes if cuda_bytes else None
        mine = measured_reserve_mib(measured, self.margin_mib) if measured else None
        if self.processor:  # Qwen3-VL warms up on a small image: a large one's scratch is in its tower figure
            mine = max(mine or 0, vision_qwen3vl.cuda_vision_mib(self.config, self.processor))
        values = self.vision.vram_mib or default_vram_mib(self.settings.device, self.num_gpus, gpu, charge, mine)
        values = [float(v) for v in values[: self.num_gpus]]
        return values + [None] * (self.num_gpus - len(values))

    def record_measured(self, gpu: int, measured_bytes: int, what: str) -> None:
        """A vision worker on ``gpu`` said what it holds there as the driver counts it (``what``: its
        start, or its first encode where the start reckoned that encode's scratch): the next hand-back
        there frees that and a margin. 0 (not measured, or cpu) changes nothing."""
        if not measured_bytes:
            return
        self.measured_bytes[gpu] = measured_bytes
        log.info("vision worker's %s took %.1f MiB of gpu%d (the driver's count): the next hand-back there frees "
                 "%s MiB", what, measured_bytes / MIB, gpu, self.reserves(gpu)[gpu])

    def measured_mib(self) -> list[float | None]:
        """Per GPU (worker order), what the last vision start there measured (None: none yet). A list,
        as every per-GPU figure in INFO: the wire's maps take string keys only."""
        return [round(self.measured_bytes[g] / MIB, 1) if g in self.measured_bytes else None
                for g in range(self.num_gpus)]

    def _need_mib(self, gpu: int) -> float:
        """MiB that must be free on ``gpu`` to start the worker there. On cpu the charge the zygote
        measured (the worker charges exactly that to the ledger; the default reserve only rounds it
        up), on cuda the reserve (the context and the device's own copy are not known before the
        start); a ``vision.vram_mib`` that the operator set is taken as needed in either case."""
        reserve = self.reserves(gpu)[gpu] or 0.0
        charge_mib = (self.zygote_info or {}).get("charge_bytes", 0) / MIB
        if self.settings.device != "cpu":
            return reserve or charge_mib
        return max(charge_mib, reserve) if self.vision.vram_mib else charge_mib

    def _place(self) -> Placement | None:
        """Decide (again) where the vision worker goes; None until the zygote and every GPU worker
        have reported. Logs when the decision changes: at boot, and whenever the figures change it."""
        infos = self.hooks.worker_info()
        if self.zygote_info is None or any(not info for info in infos):
            return None
        max_free = [info.get("max_free_mib") for info in infos]
        placement = place(self.vision.gpu, self.num_gpus, self._need_mib, max_free, self.settings.device)
        # logged when the decision changes, not its figures (free VRAM moves a little all the time)
        if self.placement is None or (placement.gpu, placement.problem is None) != \
                (self.placement.gpu, self.placement.problem is None):
            if placement.problem:
                log.error("%s", placement.problem)
            else:
                log.info("vision worker placed on gpu%d: it needs %.1f MiB free there, its cache can free up to %s",
                         placement.gpu, placement.need_mib,
                         "?" if max_free[placement.gpu] is None else f"{max_free[placement.gpu]:.1f} MiB")
        self.placement = placement
        return placement
