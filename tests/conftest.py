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
