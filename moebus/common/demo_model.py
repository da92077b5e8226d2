"""The embedded default model: made on first use into the user's cache directory and reused."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from moebus.common.tiny_model import init_model

log = logging.getLogger("moebus")
DEMO_NAME = "demo-llava-qwen3_moe-v2"  # v2: a SigLIP tower around the v1 language model


def cache_dir() -> Path:
    root = os.environ.get("MOEBUS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moebus")
    return Path(root)


def demo_model_dir() -> Path:
    """The demo model's directory, made atomically (a half-written directory is never used)."""
    target = cache_dir() / DEMO_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("making the embedded demo model in %s (once)", target)
    scratch = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        init_model(scratch, "qwen3_moe", "demo", seed=0, vision="siglip")
        try:
            scratch.rename(target)
        except OSError:  # another process made it first
            pass
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
