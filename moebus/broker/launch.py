"""Start a broker the way `moebus serve` / `moebus broker` do: resolve the model and device, split
the layers over the GPUs, write the effective settings for the children, spawn the workers (and
the api when serving), run the loop, clean up."""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import zmq

from moebus.broker.broker import Broker
from moebus.broker.children import Child, python_argv
from moebus.broker.mps import MpsDaemon, vision_client_env
from moebus.broker.worker_pool import WorkerPool
from moebus.common.demo_model import demo_model_dir
from moebus.common.errors import ConfigError
from moebus.common.layer_split import proportional_split, split_layers
from moebus.common.model_config import load_config
from moebus.common.tokenizer import TextTokenizer
from moebus.cuda.memory.devices import gpu_memory_mib, resolve_device
from moebus.cuda.memory.ledger import MIB
from moebus.cuda.kernels.kernel_cache import VISION_ROLE, gpu_role, kernel_cache_env

log = logging.getLogger("moebus.broker")


def layer_ranges(settings, num_layers: int, device: str) -> list[range]:
    """``layer_split`` when given, else in proportion to each GPU's memory."""
    num_gpus = len(settings.gpus) if device == "cuda" else len(settings.emulated_vram_mib)
    if num_gpus > num_layers:
        raise ConfigError(f"{num_gpus} GPUs for a model of {num_layers} layers: at least one layer per GPU")
    split = settings.layer_split
    if split:
        if len(split) != num_gpus or sum(split) != num_layers or min(split) < 1:
            raise ConfigError(f"config key 'layer_split': needs {num_gpus} counts >= 1 summing to the model's "
                              f"{num_layers} layers (got {split!r})")
        return split_layers(num_layers, list(split))
    memory = _budgets_mib(settings, gpu_memory_mib(settings.gpus)) if device == "cuda" else \
        list(settings.emulated_vram_mib)
    return split_layers(num_layers, proportional_split(num_layers, memory))


def _budgets_mib(settings, totals_mib: list[float]) -> list[float]:
    """Each GPU's memory as moebus may use it (its VRAM budget where one is set)."""
    from moebus.workers.cache_sizing import budget_bytes

    return [(budget_bytes(settings, i, int(total * MIB)) or total * MIB) / MIB for i, total in enumerate(totals_mib)]


def run_broker(settings, serve_api: bool = False, spawn_workers: bool = True) -> int:
    if serve_api:  # refuse now, not by restarting an api that exits at once
        from moebus.api.auth import check_exposure

        check_exposure(settings.api)
    model_dir = str(Path(settings.model).resolve()) if settings.model else str(demo_model_dir())
    device = resolve_device(settings.device)
    config = load_config(model_dir)
    ranges = layer_ranges(settings, config.num_layers, device)
    mps_control = _mps_control(settings, device, spawn_workers)
    run_dir = Path(tempfile.mkdtemp(prefix="moebus-"))
    settings = settings.model_copy(update={"model": model_dir, "device": device, "broker": _own_keys(settings.broker),
                                           "emulated_vram_dir": settings.emulated_vram_dir or str(run_dir / "vram")})
    settings_file = run_dir / "settings.json"
    settings_file.write_text(json.dumps(settings.model_dump(mode="json"), indent=2))
    backend = settings.broker.backend.format(run_dir=run_dir)
    mps = MpsDaemon(run_dir, mps_control) if mps_control else None
    try:
        if mps is not None:
            mps.start()
        clients = mps.env if mps else {}
        remote = set(settings.broker.remote_gpus)  # these stages' workers join from elsewhere
        children = [_worker_child(settings, settings_file, i, r, backend, clients)
                    if spawn_workers and i not in remote else None for i, r in enumerate(ranges)]
        extra = [Child("api", python_argv("api", "--config", str(settings_file)),
                       error_file=run_dir / "api.start-error")] if serve_api else []
        log.info("model %s on %s: %s", model_dir, device, ", ".join(f"gpu{i} layers {r.start}-{r.stop - 1}"
                                                                       for i, r in enumerate(ranges)))
        pool = WorkerPool(ranges, children, settings.broker.heartbeat_s, settings.broker.heartbeat_liveness)
        vision = _vision_lifecycle(settings, settings_file, run_dir, len(ranges), backend, clients)
        broker = Broker(settings, config, TextTokenizer(model_dir, config.eos_token_ids), pool,
                        model_name=Path(model_dir).name, backend_address=backend, children=extra, vision=vision)
        status = broker.run()
    finally:
        if mps is not None:
            mps.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    if broker.fatal_error:  # the cli prints it last, as the reason of the exit
        raise ConfigError(broker.fatal_error)
    return status


def _own_keys(broker):
    """The CURVE pair of the broker's own children (workers, api): made per start and allow-listed,
    so that a broker on a non-loopback address lets its children in but nobody else unlisted. It
    reaches them in the settings file of the private (0700) run directory."""
    if broker.curve_client_public_key:
        return broker
    public, secret = (k.decode() for k in zmq.curve_keypair())
    return broker.model_copy(update={"curve_client_public_key": public, "curve_client_secret_key": secret})


def _mps_control(settings, device: str, spawn_workers: bool) -> str | None:
    """The MPS control program's path where ``mps: true`` (None where not asked); refused where it
    cannot apply, before anything is started."""
    if not settings.mps:
        return None
    if device != "cuda":
        raise ConfigError(f"config key 'mps': true needs device cuda (NVIDIA's Multi-Process Service), not {device}")
    if not spawn_workers:
        raise ConfigError("config key 'mps': true starts an MPS daemon for the workers this broker starts; "
                          "with --no-spawn start one for your workers yourself")
    return MpsDaemon.find_binary()


def _worker_child(settings, settings_file: Path, index: int, layers: range, backend: str,
                  clients: dict | None = None) -> Child:
    argv = python_argv("worker", "--gpu", str(index), "--layers", f"{layers.start}:{layers.stop}",
                       "--connect", backend, "--config", str(settings_file), "--model", settings.model,
                       "--device", settings.device)
    env = {"CUDA_VISIBLE_DEVICES": str(settings.gpus[index])} if settings.device == "cuda" else {}
    env.update(kernel_cache_env(settings.kernel_cache_dir, gpu_role(index)))  # a restart loads, not compiles
    env.update(clients or {})  # the MPS daemon's pipes (mps: true)
    return Child(f"gpu{index} worker", argv, env, error_file=settings_file.parent / f"gpu{index}.start-error")


def _vision_lifecycle(settings, settings_file: Path, run_dir: Path, num_gpus: int, backend: str,
                      clients: dict | None = None):
    """None for a model without a vision tower; else a factory of the broker's VisionLifecycle with
    the zygote as its child process (spawned at boot, it forks each vision worker)."""
    from moebus.broker.vision import VisionLifecycle
    from moebus.common.vision_config import load_vision_config

    vision_config = load_vision_config(settings.model)
    if vision_config is None:
        return None
    gpu = settings.vision.gpu
    if gpu != "auto" and gpu >= num_gpus:
        raise ConfigError(f"config key 'vision.gpu': {gpu} but there are {num_gpus} GPU(s)")
    control = str(run_dir / "vision-zygote.sock")
    zygote = _zygote_child(settings, settings_file, backend, control, clients)
    return lambda hooks, stats: VisionLifecycle(settings, vision_config, num_gpus, zygote, control, hooks, stats)


def _zygote_child(settings, settings_file: Path, backend: str, control: str, clients: dict | None = None) -> Child:
    argv = python_argv("vision-zygote", "--config", str(settings_file), "--model", settings.model,
                       "--device", settings.device, "--connect", backend, "--control", control)
    # the zygote makes no context; each forked worker sees only the GPU the broker placed it on
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, settings.gpus))} if settings.device == "cuda" else {}
    env.update(kernel_cache_env(settings.kernel_cache_dir, VISION_ROLE))  # its forked workers inherit it
    if settings.device == "cuda":  # under an MPS server (ours or the host's): after the text workers' kernels
        env.update(vision_client_env(settings.vision), **(clients or {}))
    return Child("vision zygote", argv, env, error_file=settings_file.parent / "vision-zygote.start-error")
