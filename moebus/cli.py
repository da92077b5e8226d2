"""moebus serve | broker | worker | api | generate | vram | keys | init-model | bench"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import warnings

from moebus.common.errors import MoebusError


def _settings(args, **extra):
    from moebus.common.settings import load_settings

    flags = {k: getattr(args, k, None) for k in ("model", "device")}
    return load_settings(getattr(args, "config", None), **flags, **extra)


# numba's driver logs every failed driver call as an ERROR before raising, and polling an event or
# stream that has not finished "fails" with CUDA_ERROR_NOT_READY, which numba then reads as False
# (Event.query): a normal answer, not a fault. An operator greps for ERROR; keep the word for faults.
NUMBA_DRIVER_LOGGERS = ("numba.cuda.cudadrv.driver", "numba_cuda.numba.cuda.cudadrv.driver")
NOT_READY_POLL = re.compile(r"Call to cu(Event|Stream)Query results in CUDA_ERROR_NOT_READY")


class NotReadyPollFilter(logging.Filter):
    """Drops exactly numba's report of a not-ready event or stream poll; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return NOT_READY_POLL.fullmatch(record.getMessage()) is None


def _logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    logging.getLogger("moebus").setLevel(logging.DEBUG if verbose else logging.INFO)
    for name in NUMBA_DRIVER_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, NotReadyPollFilter) for f in logger.filters):
            logger.addFilter(NotReadyPollFilter())
    # numba reports small launches as "under-utilization"; decode launches are small on purpose
    warnings.filterwarnings("ignore", message=".*will likely result in GPU under-utilization")


def cmd_serve(args) -> int:
    from moebus.broker.launch import run_broker

    api = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = _settings(args)
    if api:
        settings = settings.model_copy(update={"api": settings.api.model_copy(update=api)})
    return run_broker(settings, serve_api=True)


def cmd_broker(args) -> int:
    from moebus.broker.launch import run_broker

    return run_broker(_settings(args), serve_api=False, spawn_workers=not args.no_spawn)


def cmd_worker(args) -> int:
    from moebus.broker.launch import layer_ranges
    from moebus.common.demo_model import demo_model_dir
    from moebus.common.model_config import load_config
    from moebus.cuda.memory.devices import resolve_device
    from moebus.cuda.kernels.kernel_cache import gpu_role, use_kernel_cache

    settings = _settings(args)
    use_kernel_cache(settings.kernel_cache_dir, gpu_role(args.gpu))  # a worker started by hand, too
    from moebus.workers.gpu_worker import run_worker  # imports the kernels: after the cache directory is set

    model_dir = settings.model or str(demo_model_dir())
    device = resolve_device(settings.device)
    if args.layers:
        start, stop = (int(x) for x in args.layers.split(":"))
        layers = range(start, stop)
    else:
        layers = layer_ranges(settings, load_config(model_dir).num_layers, device)[args.gpu]
    return run_worker(settings, model_dir, args.gpu, layers, args.connect, device)


def cmd_vision_zygote(args) -> int:
    from moebus.common.demo_model import demo_model_dir
    from moebus.cuda.memory.devices import resolve_device
    from moebus.workers.vision_zygote import run_zygote

    settings = _settings(args)
    return run_zygote(settings, settings.model or str(demo_model_dir()), args.connect, resolve_device(settings.device),
                      args.control)


def cmd_api(args) -> int:
    from moebus.api.server import run_api

    settings = _settings(args)
    api = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    return run_api(settings.model_copy(update={"api": settings.api.model_copy(update=api)}))


def cmd_generate(args) -> int:
    from moebus.cli_generate import generate

    result = generate(args)
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
    return 0


def cmd_vram(args) -> int:
    from moebus.client import Client

    settings = _settings(args)
    client = Client(args.connect or settings.broker.frontend, timeout_s=args.timeout,
                    server_key=settings.broker.curve_public_key)
    try:
        reply = client.vram(None if args.query else (args.reserve_mib or None), query=args.query)
    finally:
        client.close()
    print(json.dumps(reply) if args.json else reply["line"])
    return 0


def cmd_keys(args) -> int:
    import zmq

    public, secret = zmq.curve_keypair()
    print(json.dumps({"curve_public_key": public.decode(), "curve_secret_key": secret.decode()}, indent=2))
    return 0


def cmd_init_model(args) -> int:
    from moebus.common.tiny_model import init_model

    from tqdm import tqdm

    path = init_model(args.dir, args.arch, args.preset, seed=args.seed, dtype=args.dtype, num_layers=args.layers,
                      num_experts=args.experts, progress=lambda it: tqdm(it, desc="writing shards", unit="shard"),
                      vision=args.vision, experts_dtype=args.experts_dtype)
    print(path)
    return 0


def cmd_bench(args) -> int:
    from moebus.bench import run_bench

    return run_bench(args.what, args.rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moebus", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, model=True):
        sp.add_argument("--config", help="JSON settings file (else $MOEBUS_CONFIG)")
        if model:
            sp.add_argument("--model", help="Hugging Face model directory (default: the embedded demo model)")
            sp.add_argument("--device", choices=["auto", "cuda", "cpu"])
        sp.add_argument("-v", "--verbose", action="store_true")

    sp = sub.add_parser("serve", help="broker + GPU workers + OpenAI-compatible HTTP api")
    common(sp)
    sp.add_argument("--host")
    sp.add_argument("--port", type=int)
    sp.set_defaults(func=cmd_serve)

    sp = sub.add_parser("broker", help="the broker alone (spawns its workers unless --no-spawn)")
    common(sp)
    sp.add_argument("--no-spawn", action="store_true", help="wait for workers started elsewhere")
    sp.set_defaults(func=cmd_broker)

    sp = sub.add_parser("worker", help="one GPU worker joining a broker")
    common(sp)
    sp.add_argument("--gpu", type=int, required=True, help="stage / GPU index in worker order")
    sp.add_argument("--connect", required=True, help="the broker's backend address")
    sp.add_argument("--layers", help="START:STOP (default: from layer_split / the GPU memory split)")
    sp.set_defaults(func=cmd_worker)

    sp = sub.add_parser("vision-zygote", help="(spawned by the broker) the standby process that forks vision workers")
    common(sp)
    sp.add_argument("--connect", required=True, help="the broker's backend address")
    sp.add_argument("--control", required=True, help="the Unix socket path the broker asks for starts on")
    sp.set_defaults(func=cmd_vision_zygote)

    sp = sub.add_parser("api", help="the HTTP api alone (talks to a running broker)")
    common(sp, model=False)
    sp.add_argument("--host")
    sp.add_argument("--port", type=int)
    sp.set_defaults(func=cmd_api)

    sp = sub.add_parser("generate", help="generate from a prompt and print the result")
    common(sp)
    group = sp.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt")
    group.add_argument("--prompt-tokens", help="comma-separated token ids")
    sp.add_argument("--max-tokens", type=int, default=16)
    sp.add_argument("--temperature", type=float, default=0.0)
    sp.add_argument("--top-p", type=float, default=1.0)
    sp.add_argument("--top-k", type=int, default=0)
    sp.add_argument("--seed", type=int)
    sp.add_argument("--json", action="store_true", help="print one JSON object: tokens, text, logprobs")
    sp.add_argument("--connect", help="use a running broker at this frontend address")
    sp.add_argument("--local", action="store_true", help="run in this process, without broker and workers")
    sp.set_defaults(func=cmd_generate)

    sp = sub.add_parser("vram", help="shrink the expert caches to leave RESERVE MiB free per GPU; bare: regrow")
    sp.add_argument("reserve_mib", nargs="*", type=float)
    sp.add_argument("--query", action="store_true", help="report without changing anything")
    sp.add_argument("--connect", help="the broker's frontend (default: broker.frontend of the settings)")
    sp.add_argument("--config", help="JSON settings file (else $MOEBUS_CONFIG)")
    sp.add_argument("--timeout", type=float, default=60.0)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_vram, verbose=False)

    sp = sub.add_parser("keys", help="print a new CURVE key pair for broker.curve_public_key / curve_secret_key")
    sp.set_defaults(func=cmd_keys, verbose=False)

    sp = sub.add_parser("init-model", help="write a Hugging Face model directory with random weights")
    sp.add_argument("dir")
    sp.add_argument("--arch", choices=["qwen3_moe", "mixtral", "qwen3_vl_moe"], default="qwen3_moe")
    sp.add_argument("--preset", choices=["tiny", "demo", "a3b"], default="tiny",
                    help="tiny: tests; demo: the embedded default; a3b: Qwen3-30B-A3B's shapes")
    sp.add_argument("--layers", type=int, help="override the preset's number of layers")
    sp.add_argument("--experts", type=int, help="override the preset's experts per MoE layer (a full-depth model "
                    "with the per-token work of the preset, in less disk)")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    sp.add_argument("--experts-dtype", choices=["bf16", "fp8"], default="bf16",
                    help="fp8: an FP8 checkpoint as Qwen publishes one (e4m3, 128x128 block scales)")
    sp.add_argument("--vision", choices=["siglip", "clip"],
                    help="a LLaVA directory: this vision tower (a3b: SigLIP-so400m's shape) around the language model")
    sp.set_defaults(func=cmd_init_model, verbose=False)

    sp = sub.add_parser("bench", help="benchmarks that print figures (decode, kernels, ...)")
    sp.add_argument("what")
    sp.add_argument("rest", nargs=argparse.REMAINDER)
    sp.set_defaults(func=cmd_bench, verbose=False)
    return p


def _tell_parent(message: str) -> None:
    """A child of the broker that cannot start leaves its reason where the broker reads it
    (broker/children.py), so that serve ends at once with it instead of restarting the child."""
    from moebus.broker.children import START_ERROR_ENV

    path = os.environ.get(START_ERROR_ENV)
    if path:
        try:
            with open(path, "w") as f:
                f.write(message)
        except OSError:
            pass  # the message is on stderr too


def main(argv=None) -> int:
    # The cpu device runs many small matmuls per step: BLAS threads spinning between them cost more
    # than they give on the small hosts this path is for (measured: batch-8 decode 2.6x faster).
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    args = build_parser().parse_args(argv)
    _logging(getattr(args, "verbose", False))
    try:
        return args.func(args) or 0
    except MoebusError as e:
        print(f"moebus: error: {e}", file=sys.stderr)
        _tell_parent(str(e))
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
