"""``moebus generate``: through a running broker (--connect), through a private broker and its
workers started for this one call (the default), or in this process (--local)."""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from moebus.broker.children import python_argv
from moebus.common.errors import ConfigError, Unavailable


def _sampling(args) -> dict:
    return {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "seed": args.seed}


def _prompt(args) -> dict:
    if args.prompt_tokens is not None:
        return {"prompt_tokens": [int(t) for t in args.prompt_tokens.split(",") if t.strip()]}
    return {"prompt": args.prompt}


def _local(args) -> dict:
    from moebus.common.demo_model import demo_model_dir
    from moebus.common.settings import load_settings
    from moebus.common.tokenizer import TextTokenizer
    from moebus.cuda.memory.devices import resolve_device
    from moebus.workers.kv_cache import resolve_kv_dtype
    from moebus.workers.local import LocalModel

    model_dir = args.model or str(demo_model_dir())
    settings = load_settings(args.config)  # the experts' and the KV cache's dtypes, as the served workers read them
    device = resolve_device(args.device or "auto")
    model = LocalModel(model_dir, device=device, experts_dtype=settings.experts.dtype,
                       kv_dtype=resolve_kv_dtype(settings.kv_dtype, device))
    tokenizer = TextTokenizer(model_dir, model.ckpt.config.eos_token_ids)
    prompt = _prompt(args).get("prompt_tokens") or tokenizer.encode(args.prompt)
    s = _sampling(args)
    gen = model.generate(prompt, s["max_tokens"], s["temperature"], s["top_k"], s["top_p"], s["seed"],
                         stop_ids=tokenizer.stop_ids)
    text_ids = [t for t in gen.tokens if t not in tokenizer.stop_ids]
    return {"tokens": gen.tokens, "text": tokenizer.decode(text_ids), "logprobs": gen.logprobs,
            "finish_reason": gen.finish_reason}


def _through(address: str, args, server_key: str | None = None) -> dict:
    from moebus.client import Client

    client = Client(address, server_key=server_key)
    try:
        result = client.generate(**_prompt(args), **_sampling(args)).collect()
    finally:
        client.close()
    return {k: result[k] for k in ("tokens", "text", "logprobs", "finish_reason")}


@contextmanager
def private_broker(flags: list[str], env: dict | None = None, quiet: bool = True, timeout_s: float = 600):
    """A broker (and its workers) of our own on a private ipc address, ready; yields the address
    and stops it afterwards. ``flags``: command-line flags of ``moebus broker``. A broker that
    exits first (a start that cannot succeed) raises its own last error line; when ``quiet`` its
    output goes to a file that only that line is read from."""
    with tempfile.TemporaryDirectory(prefix="moebus-private-") as tmp:
        address = f"ipc://{Path(tmp) / 'frontend.sock'}"
        log_path = Path(tmp) / "broker.log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(python_argv("broker", *flags),
                                    env=dict(os.environ, **(env or {}), MOEBUS_BROKER__FRONTEND=address),
                                    stderr=log_file if quiet else None)
        try:
            _wait_ready(proc, address, timeout_s, log_path if quiet else None)
            yield address
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait_ready(proc, address: str, timeout_s: float, log_path: Path | None) -> None:
    from moebus.client import Client

    client = Client(address)
    try:
        deadline = time.monotonic() + timeout_s
        while not client.ping(timeout_s=1.0):
            if proc.poll() is not None:
                reason = _last_error(log_path) if log_path else None
                raise ConfigError(reason) if reason else Unavailable(
                    f"the broker exited with status {proc.returncode}")
            if time.monotonic() > deadline:
                raise Unavailable("the broker did not become ready")
    finally:
        client.close()


def _last_error(log_path: Path) -> str | None:
    """The broker's own reason for exiting: its last ``moebus: error:`` line (cli.py prints it)."""
    prefix = "moebus: error: "
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.startswith(prefix)]
    return lines[-1][len(prefix):] if lines else None


def generate(args) -> dict:
    if args.local:
        return _local(args)
    if args.connect:
        from moebus.common.settings import load_settings

        return _through(args.connect, args, load_settings(args.config).broker.curve_public_key)
    flags = [arg for flag in ("config", "model", "device") if getattr(args, flag, None)
             for arg in (f"--{flag}", getattr(args, flag))]
    with private_broker(flags, quiet=not args.verbose) as address:
        return _through(address, args)
