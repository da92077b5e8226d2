"""Test-wide setup. numba reads NUMBA_ENABLE_CUDASIM when it is first imported, so it is set here,
before any test module imports numba: without a GPU the cuda kernels run in numba's simulator.
Set MOEBUS_TEST_GPU=1 to run the same tests on a real GPU."""
import os

if os.environ.get("MOEBUS_TEST_GPU") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """name -> directory of each tiny test model (made once per session)."""
    from tests.models import make_hf_model, make_init_model

    root = tmp_path_factory.mktemp("models")
    return {
        "init_qwen3": make_init_model(root / "init_qwen3", "qwen3_moe"),
        "init_mixtral": make_init_model(root / "init_mixtral", "mixtral"),
        "hf_qwen3_bf16": make_hf_model(root / "hf_qwen3_bf16", "qwen3_moe", "bf16"),
        "hf_qwen3_f32": make_hf_model(root / "hf_qwen3_f32", "qwen3_moe", "f32"),
        "hf_mixtral_bf16": make_hf_model(root / "hf_mixtral_bf16", "mixtral", "bf16"),
        "hf_mixtral_f16": make_hf_model(root / "hf_mixtral_f16", "mixtral", "f16"),
    }


@pytest.fixture(scope="session")
def tiny_model(model_dirs):
    return model_dirs["init_qwen3"]


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """The embedded demo model (~100 MB of experts), made once per session."""
    from moebus.common.tiny_model import init_model

    return init_model(tmp_path_factory.mktemp("demo") / "demo", "qwen3_moe", "demo", seed=0)


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory):
    """A tiny LLaVA (SigLIP tower) saved by transformers with its LlavaProcessor, made once per session."""
    from tests.vision_models import make_hf_llava

    return make_hf_llava(tmp_path_factory.mktemp("llava") / "siglip")


# ---- `make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`) -------------
# Work units: a test module goes to one worker whole (its module fixtures are made once), and every
# test that uses a package-scoped fixture (the one `moebus serve` of tests/api, of tests/e2e) goes
# with the rest of its package's users (one service, in the order the tests expect). Units start
# longest first so that the last one to finish is short (SLOW_FIRST: rough seconds, an order only).
# xdist's own loadgroup marks a group by appending it to the node id, which pytest 9.2's node ids
# no longer take (pytest-xdist issue 1386: the marks are silently ignored); so the workers write
# each test's unit to a file that a scheduler of ours (loadscope's, by unit) reads.
SLOW_FIRST = {  # seconds of each unit in one run on a loaded 2-core box (session 9, 2 workers): an order only
    "tests/cuda/test_ptx.py": 140,
    "tests/e2e": 150,  # the users of tests/e2e's one service
    "tests/e2e/test_vision_lifecycle.py": 120,
    "tests/api": 100,
    "tests/docker/test_docker.py": 95,
    "tests/cuda/test_prefill_tensor_cores.py": 65,
    "tests/cuda/test_e2e.py": 65,
    "tests/e2e/test_split.py": 61,
    "tests/e2e/test_make_serve.py": 59,
    "tests/cuda/test_decode_tensor_cores.py": 45,
    "tests/cuda/test_moe_quant.py": 44,
    "tests/cuda/test_bench_kernels.py": 43,
    "tests/cuda/test_prefetch_stage.py": 43,
    "tests/e2e/test_vision_fidelity.py": 38,
    "tests/cuda/test_layer_recycling.py": 38,
    "tests/e2e/test_deadlines.py": 37,
    "tests/cuda/test_qwen3vl_stage.py": 36,
    "tests/cuda/test_quant_e2e.py": 35,
    "tests/e2e/test_soak.py": 32,
    "tests/e2e/test_ledger_broker.py": 32,
    "tests/cuda/test_flash_attention.py": 31,
    "tests/cuda/test_e2e_fp8_attention.py": 31,
}
# Units that must not run at the same time as each other: both build the package from this tree
# (`pip install .` / `make serve`'s `pip install -e .` write build/ and moebus.egg-info here).
SAME_WORKER = {"tests/docker/test_docker.py": "builds-the-tree", "tests/e2e/test_make_serve.py": "builds-the-tree"}
UNITS_FILE = "MOEBUS_TEST_UNITS"  # environment: where the workers write {node id: unit}


def _distributed(config) -> bool:
    return hasattr(config, "workerinput") or config.getoption("dist", "no") != "no"


def pytest_configure(config):
    if _distributed(config) and not hasattr(config, "workerinput"):  # the controller, before it starts workers
        import tempfile

        os.environ[UNITS_FILE] = os.path.join(tempfile.mkdtemp(prefix="moebus-test-units-"), "units.json")


def pytest_unconfigure(config):
    path = os.environ.get(UNITS_FILE)
    if path and not hasattr(config, "workerinput"):
        import shutil

        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _work_unit(item) -> str:
    module = item.nodeid.split("::", 1)[0]
    for mark in item.iter_markers("xdist_group"):
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    if module in SAME_WORKER:
        return SAME_WORKER[module]
    for defs in item._fixtureinfo.name2fixturedefs.values():
        if defs and defs[-1].scope == "package":
            return defs[-1].baseid or "tests"
    return module


def pytest_collection_modifyitems(config, items):
    if not _distributed(config):
        return  # one process: the collection's own order
    units = {}
    for item in items:
        units.setdefault(_work_unit(item), []).append(item)
    seconds = dict(SLOW_FIRST)
    for module, unit in SAME_WORKER.items():
        seconds[unit] = seconds.get(unit, 0) + SLOW_FIRST.get(module, 0)
    order = sorted(units, key=lambda unit: -seconds.get(unit, 0))  # stable: the others keep the collection's order
    items[:] = [item for unit in order for item in units[unit]]
    path = os.environ.get(UNITS_FILE)
    if path and hasattr(config, "workerinput"):  # every worker writes the same; the last rename wins
        import json

        scratch = f"{path}.{config.workerinput['workerid']}"
        with open(scratch, "w") as f:
            json.dump({item.nodeid: unit for unit in order for item in units[unit]}, f)
        os.replace(scratch, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`: loadscope's scheduler over the units above (whole units to one worker, in
    the order the workers collected them: run with --no-loadscope-reorder)."""
    if config.getoption("dist") != "loadgroup":
        return None
    import json

    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        units: dict | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.units is None:  # read once every worker has collected (and written the file)
                with open(os.environ[UNITS_FILE]) as f:
                    self.units = json.load(f)
            return self.units.get(nodeid) or nodeid.split("::", 1)[0]

    return UnitScheduling(config, log)
