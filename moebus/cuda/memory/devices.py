"""Which device to run on, and how much memory each GPU has, without creating a CUDA context in the
calling process (the broker never owns a context; its workers do)."""
from __future__ import annotations

import shutil
import subprocess


def cuda_gpu_count() -> int:
    """GPUs the driver reports, via nvidia-smi (0 when there is none or no driver)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    return "cuda" if cuda_gpu_count() > 0 else "cpu"


def gpu_memory_mib(gpus: list[int]) -> list[float]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=20, check=True)
    total = {int(i): float(m) for i, m in (line.split(",") for line in out.stdout.strip().splitlines())}
    return [total[g] for g in gpus]
