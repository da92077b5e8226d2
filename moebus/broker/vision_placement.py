"""Where the vision worker goes, decided from figures rather than found out by a failed start. The
zygote says what a vision worker charges (its ``hello``); each GPU worker says, in its INFO, the
most MiB its GPU can have free once its cache hands back all it may (``max_free_mib``: free now
plus every segment above one expert group). A GPU can host the vision worker when that is at
least what must be free there (``vision.vram_mib`` for it, or the default by device).

``vision.gpu: auto`` picks, among the GPUs that can, the one left with the most room; a fixed
``vision.gpu`` is checked. When none can, ``problem`` says by how many MiB each falls short and
which setting changes that; the broker logs it at boot, shows it in /health and /v1/cache, and
answers image requests with it at once instead of failing a start."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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


def default_vram_mib(device: str, num_gpus: int, vision_gpu: int, charge_bytes: int) -> list[int]:
    """cuda: [1800] on one GPU; 1700 on the vision GPU and 600 on each other one (the seed's
    measured split: context + tower + activations on the vision GPU, and room for the embeddings'
    traffic and the loaned prefill scratch elsewhere). cpu: exactly what the vision worker charges
    to the emulated GPU's ledger (its weights as the cpu backend holds them plus the activations of
    one tower pass: the worker encodes one image at a time), in whole MiB, on the vision GPU only."""
    if device == "cuda":
        return [1800] if num_gpus == 1 else [1700 if g == vision_gpu else 600 for g in range(num_gpus)]
    need = -(-charge_bytes // MIB) + 1
    return [need if g == vision_gpu else 0 for g in range(num_gpus)]


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
