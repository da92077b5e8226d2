"""Start a broker the way `moebus serve` / `moebus broker` do: resolve the model and device, split
the layers over the GPUs, write the effective settings for the children, spawn the workers (and
the api when serving), run the loop, clean up."""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from moebus.broker.broker import Broker
from moebus.broker.children import Child, python_argv
from moebus.broker.worker_pool import WorkerPool
from moebus.common.demo_model import demo_model_dir
from moebus.common.model_config import load_config
from moebus.common.tokenizer import TextTokenizer
from moebus.cuda.devices import gpu_memory_mib, resolve_device
from moebus.workers.local import split_layers

log = logging.getLogger("moebus.broker")


def layer_ranges(settings, num_layers: int, device: str) -> list[range]:
    """``layer_split`` when given, else in proportion to each GPU's memory."""
    num_gpus = len(settings.gpus) if device == "cuda" else len(settings.emulated_vram_mib)
    if settings.layer_split:
        if len(settings.layer_split) != num_gpus:
            from moebus.common.errors import ConfigError

            raise ConfigError(f"config key 'layer_split': {len(settings.layer_split)} entries for {num_gpus} GPU(s) "
                              f"(got {settings.layer_split!r})")
        return split_layers(num_layers, list(settings.layer_split))
    memory = gpu_memory_mib(settings.gpus) if device == "cuda" else list(settings.emulated_vram_mib)
    return split_layers(num_layers, proportional_split(num_layers, memory))


def proportional_split(num_layers: int, weights: list[float]) -> list[int]:
    """Layer counts proportional to ``weights``, each >= 1, summing to num_layers."""
    total = float(sum(weights)) or 1.0
    counts = [max(1, int(num_layers * w / total)) for w in weights]
    while sum(counts) > num_layers:
        counts[counts.index(max(counts))] -= 1
    order = sorted(range(len(weights)), key=lambda i: num_layers * weights[i] / total - counts[i], reverse=True)
    for i in order[: num_layers - sum(counts)]:
        counts[i] += 1
    return counts


def run_broker(settings, serve_api: bool = False, spawn_workers: bool = True) -> int:
    model_dir = str(Path(settings.model).resolve()) if settings.model else str(demo_model_dir())
    device = resolve_device(settings.device)
    config = load_config(model_dir)
    ranges = layer_ranges(settings, config.num_layers, device)
    run_dir = Path(tempfile.mkdtemp(prefix="moebus-"))
    settings = settings.model_copy(update={"model": model_dir, "device": device,
                                           "emulated_vram_dir": settings.emulated_vram_dir or str(run_dir / "vram")})
    settings_file = run_dir / "settings.json"
    settings_file.write_text(json.dumps(settings.model_dump(mode="json"), indent=2))
    backend = settings.broker.backend.format(run_dir=run_dir)
    remote = set(settings.broker.remote_gpus)  # these stages' workers join from elsewhere
    children = [_worker_child(settings, settings_file, i, r, backend) if spawn_workers and i not in remote else None
                for i, r in enumerate(ranges)]
    extra = [Child("api", python_argv("api", "--config", str(settings_file)))] if serve_api else []
    log.info("model %s on %s: %s", model_dir, device, ", ".join(f"gpu{i} layers {r.start}-{r.stop - 1}"
                                                                   for i, r in enumerate(ranges)))
    pool = WorkerPool(ranges, children, settings.broker.heartbeat_s, settings.broker.heartbeat_liveness)
    try:
        broker = Broker(settings, config, TextTokenizer(model_dir, config.eos_token_ids), pool,
                        model_name=Path(model_dir).name, backend_address=backend, children=extra)
        return broker.run()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _worker_child(settings, settings_file: Path, index: int, layers: range, backend: str) -> Child:
    argv = python_argv("worker", "--gpu", str(index), "--layers", f"{layers.start}:{layers.stop}",
                       "--connect", backend, "--config", str(settings_file), "--model", settings.model,
                       "--device", settings.device)
    env = {"CUDA_VISIBLE_DEVICES": str(settings.gpus[index])} if settings.device == "cuda" else {}
    return Child(f"gpu{index} worker", argv, env)
