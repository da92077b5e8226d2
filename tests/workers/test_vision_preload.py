"""MOEBUS_VISION_WARM_UP=load (workers/vision_preload.py) where no GPU is: which cached kernel variants
load_cached_kernels loads (those of this device's magic tuple, not yet an overload, not launch-config
sensitive; read from the cache, never compiled; each bound, then added), that a failure is counted and
the others go on, and that LoadBeside's thread is joined by ``wait`` with the GIL's switch interval given
back. On a GPU the cycle of tools/device/vl13.sh measures it."""
import json
import logging
import os
import subprocess
import sys

import pytest

from moebus.cuda.kernels import compat
from moebus.workers import vision_preload
from moebus.workers.vision_preload import LoadBeside, load_cached_kernels, start_cublas
from tests.cuda.ptx_check import find_cuda_home
from tests.cuda.test_kernel_cache import ROOT

MAGIC = ("runtime", (9, 0))


class _Kernel:
    def __init__(self, sensitive=False):
        self.bound, self.launch_config_sensitive = 0, sensitive

    def bind(self):
        self.bound += 1


class _Cache:
    def __init__(self, entries, fail=()):
        self.entries, self.fail, self.loads = entries, fail, []
        self._cache_file = self

    def _load_index(self):
        return {(sig, magic, "v", ("h", "h")): f"f{i}" for i, (sig, magic) in enumerate(self.entries)}

    def load_overload(self, sig, _target):
        self.loads.append(sig)
        if sig in self.fail:
            raise OSError("gone")
        return None if sig == "stale" else _Kernel(sensitive=(sig == "lcs"))


class _Dispatcher:
    def __init__(self, cache, overloads=()):
        self._cache, self.overloads, self.added = cache, {k: object() for k in overloads}, []
        self.targetctx = self

    def codegen(self):
        return self

    def magic_tuple(self):
        return MAGIC

    def add_overload(self, kernel, argtypes):
        self.added.append((argtypes, kernel))
        self.overloads[argtypes] = kernel


@pytest.fixture
def kernels(monkeypatch):
    registry = []
    monkeypatch.setattr(compat, "_KERNELS", registry)
    monkeypatch.setattr(vision_preload, "_argtypes", lambda sig: sig)
    return registry


def test_only_this_devices_new_cached_variants_are_loaded_bound_and_added(kernels):
    cache = _Cache([("a", MAGIC), ("b", ("runtime", (8, 0))), ("seen", MAGIC), ("stale", MAGIC), ("lcs", MAGIC)])
    dispatcher = _Dispatcher(cache, overloads=["seen"])
    kernels.extend([dispatcher, object()])  # (a dispatcher without a disk cache: the simulator's)
    assert load_cached_kernels() == (1, 0)
    assert sorted(cache.loads) == ["a", "lcs", "stale"]  # not the other device's, not the one already there
    (argtypes, kernel), = dispatcher.added
    assert argtypes == "a" and kernel.bound == 1


def test_a_failed_variant_is_counted_and_the_others_load(kernels):
    first, second = _Dispatcher(_Cache([("x", MAGIC), ("y", MAGIC)], fail=("x",))), _Dispatcher(_Cache([("z", MAGIC)]))
    kernels.extend([first, second])
    assert load_cached_kernels() == (2, 1)
    assert [a for a, _ in first.added] == ["y"] and [a for a, _ in second.added] == ["z"]


def test_no_tensor_cores_no_cublas():
    class Backend:
        tensor_cores = None

    assert start_cublas(Backend()) is False


def test_the_thread_is_joined_and_the_switch_interval_given_back():
    switch_s = sys.getswitchinterval()
    beside = LoadBeside(backend=None, device="cpu")  # (cpu: nothing to load)
    assert sys.getswitchinterval() <= LoadBeside.SWITCH_S
    assert beside.wait() >= 0.0
    # (the interpreter keeps the interval in whole microseconds and truncates: a set of what get gave can
    # come back a microsecond lower, so "given back" is to the microsecond)
    assert sys.getswitchinterval() == pytest.approx(switch_s, abs=1.5e-6)
    assert beside.seconds is not None and beside.parts == {}


PRELOAD_CHECK = """
import json, sys
from moebus.cuda.kernels.kernel_cache import gpu_role, use_kernel_cache
use_kernel_cache(sys.argv[1], gpu_role(0))  # (before any kernel module is imported)
from tests.cuda.cache_check import _offline_cache
from tests.cuda.ptx_check import find_cuda_home
_, calls = _offline_cache(find_cuda_home(), (9, 0))
import moebus.cuda.backends.cuda  # (what the zygote imports: the kernels defined at module level)
from moebus.cuda.kernels import compat
from moebus.workers.vision_preload import load_cached_kernels
loaded, failed = load_cached_kernels()
again = load_cached_kernels()
names = sorted(k.py_func.__name__ for k in compat._KERNELS for _ in k.overloads)
print(json.dumps({"loaded": loaded, "failed": failed, "again": again, "nvvm": calls["nvvm"], "overloads": names,
                  "counts": compat.disk_cache_counts()}))
"""


@pytest.mark.skipif(find_cuda_home() is None, reason="no CUDA toolkit with NVVM and libdevice")
def test_the_real_dispatchers_cached_variants_load_without_a_compile(tmp_path):
    """numba's own dispatcher and disk cache (offline, tests/cuda/cache_check.py: the key of an H200, the
    module's load replaced by its PTX): a variant another process compiled becomes an overload, and NVVM is
    never called; a second call loads nothing more."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "NUMBA_CACHE_DIR")}
    fill = subprocess.run([sys.executable, "-m", "tests.cuda.cache_check", "--cache-dir", str(tmp_path), "--only",
                           "add_flat"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert fill.returncode == 0 and json.loads(fill.stdout.strip().splitlines()[-1])["data_files"] == 1, fill.stderr
    run = subprocess.run([sys.executable, "-c", PRELOAD_CHECK, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert (report["loaded"], report["failed"], report["nvvm"], report["again"]) == (1, 0, 0, [0, 0])
    assert report["overloads"] == ["add_flat"]


def test_each_part_s_device_memory_is_the_driver_s_free_bytes_before_less_after(caplog):
    frees = iter([1000 << 20, 962 << 20])
    beside = LoadBeside(backend=None, device="cpu", free_bytes=lambda: next(frees))
    beside.wait()
    free = beside._taken("cuBLAS", beside._free())  # (what _run does around a part on cuda)
    assert beside.taken == {"cuBLAS": 38 << 20} and free == 962 << 20
    beside.parts["cuBLAS"] = 0.044
    with caplog.at_level(logging.INFO, logger="moebus.vision"):
        beside.wait()
    assert "cuBLAS 44.0 ms +38.0 MiB" in caplog.text
    unread = LoadBeside(backend=None, device="cpu", free_bytes=lambda: 1 / 0)  # a failed read logs no figure
    unread.wait()
    assert unread._taken("cuBLAS", unread._free()) is None and unread.taken == {}
