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

**Keys that hold across processes** (``stable_closure_keys``, ``MOEBUS_STABLE_KERNEL_KEYS``, default 1): numba's
key for a kernel built by a factory hashes the pickle of its closure's values. A value that is a device
function defined inside the factory is pickled by value with the globals it calls, and a numba intrinsic
among them (pdl.prefetch_l2, quant_words' conversions) pickles with a uuid made per process: such a kernel's
key differed in every process, so every worker start compiled it again (attention_decode's decode kernel,
whose ask_l2 calls prefetch_l2: the "1 compiled" of every start in the fifteenth session's calls). With the
switch on, the closure is hashed with each intrinsic pickled as its name and definition instead.
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


def stable_closure_keys() -> bool:
    """Make numba's disk-cache key of a kernel with a closure the same in every process (see the module's
    doc): numba's Cache._index_key, once per process, with the closure's hash taken over a pickle where
    each intrinsic is its name and definition. False where MOEBUS_STABLE_KERNEL_KEYS is off or this numba's
    key is not the shape expected (then numba's own key stays)."""
    if os.environ.get("MOEBUS_STABLE_KERNEL_KEYS", "1").strip().lower() not in _ON:
        return False
    try:
        from numba.cuda.core import caching
        from numba.cuda.extending import _Intrinsic  # noqa: F401 - what stable_dumps needs
        from numba.cuda.serialize import NumbaPickler  # noqa: F401
    except ImportError:  # another numba-cuda: its own keys
        return False
    if getattr(caching.Cache._index_key, "stable_closure", False):
        return True
    numba_key = caching.Cache._index_key

    def index_key(self, sig, codegen):
        key = numba_key(self, sig, codegen)
        closure = self._py_func.__closure__
        if closure is None or not (isinstance(key, tuple) and isinstance(key[-1], tuple) and len(key[-1]) == 2):
            return key
        try:
            stable = hashlib.sha256(stable_dumps(tuple(cell.cell_contents for cell in closure))).hexdigest()
        except Exception:  # noqa: BLE001 - whatever numba's pickle refuses: numba's own key
            return key
        return key[:-1] + ((key[-1][0], stable),)

    index_key.stable_closure = True
    caching.Cache._index_key = index_key
    return True


def stable_dumps(value) -> bytes:
    """numba's pickle of ``value`` (serialize.dumps) with each intrinsic reduced to its name and definition
    (not its per-process uuid)."""
    import io

    from numba.cuda.extending import _Intrinsic
    from numba.cuda.serialize import NumbaPickler

    class StablePickler(NumbaPickler):
        def reducer_override(self, obj):
            if isinstance(obj, _Intrinsic):
                return intrinsic_named, (obj._name, obj._defn)
            return super().reducer_override(obj)

    with io.BytesIO() as buffer:
        StablePickler(buffer, protocol=4).dump(value)
        return buffer.getvalue()


def intrinsic_named(name: str, defn):
    """What stable_dumps reduces an intrinsic to (a key's bytes only: never unpickled)."""
    raise RuntimeError(f"intrinsic {name}: a kernel cache key, not an object to rebuild")
