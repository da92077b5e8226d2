"""The on-disk kernel cache: every kernel is jitted through compat.kernel (cache=True), each process
role gets its own directory under kernel_cache_dir, the broker hands it to every child, and (with a
CUDA toolkit, no GPU needed) a second process loads the kernels that a first one compiled."""
import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moebus.broker import launch
from moebus.common.settings import Settings
from moebus.cuda.kernels import kernel_cache
from moebus.cuda.kernels.kernel_cache import VISION_ROLE, gpu_role, kernel_cache_env, role_cache_dir, use_kernel_cache
from tests.cuda.ptx_check import find_cuda_home

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "moebus" / "cuda"


def _is_cuda_jit(node) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return isinstance(target, ast.Attribute) and target.attr == "jit" and getattr(target.value, "id", "") == "cuda"


def _is_device_jit(node) -> bool:
    return isinstance(node, ast.Call) and any(k.arg == "device" for k in node.keywords)


def test_every_kernel_is_jitted_through_compat_kernel():
    # a bare @cuda.jit kernel would compile again in every process
    bare = []
    for path in sorted(CUDA_DIR.rglob("*.py")):
        if path.name == "compat.py":  # where kernel() itself calls cuda.jit
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.Call)):
                jits = node.decorator_list if isinstance(node, ast.FunctionDef) else [node]
                bare += [f"{path.name}:{j.lineno}" for j in jits if _is_cuda_jit(j) and not _is_device_jit(j)]
    assert bare == [], f"kernels jitted without compat.kernel: {bare}"


def test_each_role_has_its_own_directory_under_the_setting(tmp_path):
    fingerprint = kernel_cache.source_fingerprint()
    assert kernel_cache_env(str(tmp_path), gpu_role(1)) == {"NUMBA_CACHE_DIR": str(tmp_path / fingerprint / "gpu1")}
    assert role_cache_dir(str(tmp_path), VISION_ROLE) == tmp_path / fingerprint / "vision"


def test_unset_setting_means_the_user_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEBUS_CACHE_DIR", str(tmp_path))
    assert Settings(kernel_cache_dir="").kernel_cache_dir is None
    assert role_cache_dir(None, "gpu0") == tmp_path / "kernels" / kernel_cache.source_fingerprint() / "gpu0"


def test_fingerprint_changes_with_any_kernel_source(tmp_path, monkeypatch):
    # numba's key would not see a changed device function in another file: the directory must
    shutil.copytree(CUDA_DIR, tmp_path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(kernel_cache, "_SOURCES", tmp_path)
    before = kernel_cache.source_fingerprint()
    assert before == kernel_cache.source_fingerprint()
    loads = tmp_path / "kernels" / "loads.py"
    loads.write_text(loads.read_text().replace("<< 16", "<<16", 1))
    assert kernel_cache.source_fingerprint() != before


def test_use_kernel_cache_points_numba_at_the_role_directory(tmp_path, monkeypatch):
    from numba.cuda.core import config

    monkeypatch.setenv("NUMBA_CACHE_DIR", "")
    monkeypatch.setattr(config, "CACHE_DIR", "")
    path = use_kernel_cache(str(tmp_path), gpu_role(0))
    assert path == role_cache_dir(str(tmp_path), "gpu0")
    assert os.environ["NUMBA_CACHE_DIR"] == config.CACHE_DIR == str(path)


def test_broker_exports_each_childs_directory(tmp_path):
    settings = Settings(kernel_cache_dir=str(tmp_path), model=str(tmp_path), device="cpu")
    settings_file = tmp_path / "settings.json"
    workers = [launch._worker_child(settings, settings_file, i, range(i, i + 1), "ipc://b") for i in range(2)]
    zygote = launch._zygote_child(settings, settings_file, "ipc://b", str(tmp_path / "control.sock"))
    exported = [child.env["NUMBA_CACHE_DIR"] for child in (*workers, zygote)]
    assert exported == [str(role_cache_dir(str(tmp_path), role)) for role in ("gpu0", "gpu1", "vision")]


def test_a_process_no_broker_started_caches_in_the_local_role_directory(tmp_path):
    # not numba's default beside the sources, which an edit to compat.py would not invalidate
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "NUMBA_CACHE_DIR")}
    env["MOEBUS_CACHE_DIR"] = str(tmp_path)
    code = "import moebus.cuda.kernels.layernorm as m; print(m._layernorm_kernel('f32')._cache.cache_path)"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    local = tmp_path / "kernels" / kernel_cache.source_fingerprint() / "local"
    assert Path(run.stdout.strip()).parent == local


def test_an_unwritable_directory_means_no_disk_cache_rather_than_numbas_fallbacks(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBA_CACHE_DIR"] = str(blocker / "kernels")
    code = ("import moebus.cuda.kernels.layernorm as m, moebus.cuda.kernels.scatter as s\n"
            "print(type(m._layernorm_kernel('f32')._cache).__name__, type(s.scatter_rows_flat._cache).__name__)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.split() == ["NullCache", "NullCache"]
    assert "kernels are not cached on disk" in run.stderr


def _cache_check(cache_dir: Path, *flags: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "NUMBA_CACHE_DIR")}
    run = subprocess.run([sys.executable, "-m", "tests.cuda.cache_check", "--cache-dir", str(cache_dir),
                          "--only", "layernorm_rows,layernorm_held_rows,add_flat,attend", *flags],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(find_cuda_home() is None, reason="no CUDA toolkit with NVVM and libdevice")
def test_a_second_process_loads_the_kernels_instead_of_compiling(tmp_path):
    # a module-level kernel (add_flat), closures over device functions (layernorm_rows, or
    # layernorm_held_rows where the row fits in registers: one per weight storage and store, the float32
    # rows' or split_epilogues' bf16 parts) and over ints that size shared memory (attend: one per head_dim)
    first = _cache_check(tmp_path)
    assert first["kernel_variants"] == first["compiled"] == first["nvvm_calls"] == first["data_files"] == 9
    second = _cache_check(tmp_path, "--expect-loaded")
    assert (second["loaded"], second["compiled"], second["nvvm_calls"]) == (9, 0, 0)
    assert first["disk_cache_counts"] == [0, 9] and second["disk_cache_counts"] == [9, 0]  # what the workers log
    assert second["cache_dir"] == str(role_cache_dir(str(tmp_path), "gpu0"))


FILL_TARGET = """
import os
import moebus.cuda.backends.cuda  # what the vision zygote imports on cuda
from moebus.cuda.kernels.compat import load_numba_target
from numba.cuda.cudadrv import driver
threads = len(os.listdir("/proc/self/task"))
load_numba_target()
print(threads, len(os.listdir("/proc/self/task")), driver.driver.pid)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_the_zygote_fills_numbas_target_without_a_context_or_a_thread(tmp_path):
    # it runs before the zygote forks: a CUDA context or a thread there would break every child
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "NUMBA_CACHE_DIR")}
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # as moebus.cli sets them
    env["MOEBUS_CACHE_DIR"] = str(tmp_path)
    run = subprocess.run([sys.executable, "-c", FILL_TARGET], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    before, after, driver_pid = run.stdout.split()
    assert (after, driver_pid) == (before, "None")


def _closure_over_an_intrinsic():
    """A device function made by a factory, which calls an intrinsic (as attention_decode's ask_l2 calls
    pdl.prefetch_l2), in a kernel's closure: what numba's key pickles by value."""
    from numba.cuda.extending import _Intrinsic

    def codegen_of_nothing(typingctx, x):
        return None

    intrinsic = _Intrinsic("prefetch_like", codegen_of_nothing)

    def make():
        def ask(x):
            return intrinsic(x)
        return ask
    return (make(),), intrinsic


def test_a_closures_key_bytes_leave_out_the_intrinsics_per_process_uuid():
    from numba.cuda.serialize import dumps

    first, one = _closure_over_an_intrinsic()
    second, other = _closure_over_an_intrinsic()  # another process's twin: the same, but its own uuid
    assert one._uuid != other._uuid and dumps(first) != dumps(second)  # numba's own key: per process
    assert kernel_cache.stable_dumps(first) == kernel_cache.stable_dumps(second)


def test_stable_keys_replace_only_the_closures_hash(monkeypatch):
    from numba.cuda.core import caching

    monkeypatch.setattr(caching.Cache, "_index_key", caching.Cache._index_key)  # restored after the test
    monkeypatch.setenv("MOEBUS_STABLE_KERNEL_KEYS", "0")
    assert kernel_cache.stable_closure_keys() is False
    monkeypatch.setenv("MOEBUS_STABLE_KERNEL_KEYS", "1")
    assert kernel_cache.stable_closure_keys() is True and kernel_cache.stable_closure_keys() is True
    codegen = type("Codegen", (), {"magic_tuple": lambda self: ("sm_90",)})()
    cells, _ = _closure_over_an_intrinsic()
    ask = cells[0]

    def kernel(x):
        return ask(x)
    fake = type("FakeCache", (), {"_py_func": kernel})()
    key = caching.Cache._index_key(fake, ("int32",), codegen)
    twin_cells, _ = _closure_over_an_intrinsic()
    twin_ask = twin_cells[0]

    def twin(x):
        return twin_ask(x)
    assert caching.Cache._index_key(type("FakeCache", (), {"_py_func": twin})(), ("int32",), codegen) == key
    assert key[0] == ("int32",) and key[1] == ("sm_90",)


@pytest.mark.skipif(find_cuda_home() is None, reason="no CUDA toolkit with NVVM and libdevice")
def test_a_kernel_closed_over_an_intrinsic_loads_in_a_second_process(tmp_path):
    # attention_decode's decode kernel: ask_l2 (in its closure) calls pdl.prefetch_l2, an intrinsic whose
    # pickle carries a per-process uuid; without stable keys every process compiled it again. Two of its 20
    # variants (all 20: ~100 s of NVVM on CI's box)
    def check(*flags):
        env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "NUMBA_CACHE_DIR")}
        run = subprocess.run([sys.executable, "-m", "tests.cuda.cache_check", "--cache-dir", str(tmp_path),
                              "--only", "attention_split_merge", "--variants", "2", *flags], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
        return json.loads(run.stdout.strip().splitlines()[-1])
    first = check()
    assert first["kernel_variants"] == first["compiled"] > 0
    second = check("--expect-loaded")
    assert (second["loaded"], second["compiled"], second["nvvm_calls"]) == (first["kernel_variants"], 0, 0)
