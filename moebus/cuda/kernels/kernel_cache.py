"""Where compiled kernels live between processes, so that a worker (re)start or a vision cold start
loads them from disk instead of compiling them with NVVM (kernels are jitted with ``cache=True``
through ``compat.kernel``; numba keeps them under ``NUMBA_CACHE_DIR``).

Layout: ``<kernel_cache_dir>/<fingerprint>/<role>``.
- *fingerprint*: a hash of every source file under moebus/cuda and of numba-cuda's version. numba's own
  key sees the kernel's signature and bytecode, its closure's values, the GPU's compute capability
  and the CUDA version, and its file's mtime and size, but not the device functions it calls from
  other files (compat.py, loads.py): a change there must not load a stale kernel, so it gets a
  fresh tree. The switches of ``COMPILE_ENV`` (they change what a kernel compiles to without changing
  its source) are hashed in as on or off.
- *role*: ``gpu<i>`` for the stage-i worker, ``vision`` for the vision zygote and its workers. numba
  lets two processes that add entries to one function's index at once pair an entry with the other's
  data file (a wrong kernel on a later load); one writer per directory rules that out, at the price of
  compiling once per role on the very first start.

No numba import here: the broker sets the variable for children that have not imported numba yet.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import sys
from pathlib import Path

VISION_ROLE = "vision"
LOCAL_ROLE = "local"  # a process no broker started (bench, generate --local, GPU tests)
_SOURCES = Path(__file__).resolve().parents[1]  # moebus/cuda: the kernels and everything they import
# switches read when kernels are compiled, with their defaults (pdl.py: MOEBUS_PDL_TRIGGER)
COMPILE_ENV = {"MOEBUS_PDL_TRIGGER": "1"}
_ON = ("1", "on", "true", "yes")


def gpu_role(index: int) -> str:
    return f"gpu{index}"


def compile_switch(name: str) -> bool:
    """Whether the COMPILE_ENV switch ``name`` is on (unset: its default)."""
    return os.environ.get(name, COMPILE_ENV[name]).strip().lower() in _ON


def source_fingerprint() -> str:
    """16 hex digits over the paths and bytes of moebus/cuda/**/*.py, the numba-cuda version and the
    COMPILE_ENV switches, each as on or off (unset: its default)."""
    digest = hashlib.sha256(_numba_cuda_version().encode() + b"\0")
    for name in COMPILE_ENV:
        digest.update(f"{name}={int(compile_switch(name))}".encode() + b"\0")
    for path in sorted(_SOURCES.rglob("*.py")):
        digest.update(path.relative_to(_SOURCES).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _numba_cuda_version() -> str:
    try:
        return importlib.metadata.version("numba-cuda")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def kernel_cache_root(kernel_cache_dir: str | None) -> Path:
    """The ``kernel_cache_dir`` setting, or ``$MOEBUS_CACHE_DIR/kernels`` when unset."""
    if kernel_cache_dir:
        return Path(kernel_cache_dir).expanduser().absolute()
    from moebus.common.demo_model import cache_dir  # the demo model's root; imported only when needed

    return cache_dir() / "kernels"


def role_cache_dir(kernel_cache_dir: str | None, role: str) -> Path:
    return kernel_cache_root(kernel_cache_dir) / source_fingerprint() / role


def kernel_cache_env(kernel_cache_dir: str | None, role: str) -> dict[str, str]:
    """The environment a child process of this role gets (numba reads it when first imported)."""
    return {"NUMBA_CACHE_DIR": str(role_cache_dir(kernel_cache_dir, role))}


def use_kernel_cache(kernel_cache_dir: str | None, role: str) -> Path:
    """Point this process's kernel cache at its role's directory, for a process that was not started
    with the variable (a worker started by hand). Call it before the kernel modules are imported:
    a kernel keeps the directory it saw when it was defined."""
    path = role_cache_dir(kernel_cache_dir, role)
    os.environ["NUMBA_CACHE_DIR"] = str(path)
    config = sys.modules.get("numba.cuda.core.config")
    if config is not None:  # numba already read the environment: kernels defined from now on see it
        config.CACHE_DIR = str(path)
    return path
