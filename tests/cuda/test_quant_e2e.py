"""Quantized experts on the cuda device (numba's simulator) against the cpu device: the decode
GEMVs read fp8 / int4 slots and, for misses, the host store; the prefill runs through them too."""
import numpy as np
import pytest

from moebus.common import tiny_model
from moebus.workers.local import LocalModel
from tests.cuda.test_e2e import MICRO

pytestmark = pytest.mark.usefixtures("exact_quant_kernels")  # the exact kernels against the cpu device at 1e-4


@pytest.fixture(scope="module")
def micro_fp8_model(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(tiny_model.PRESETS, "micro", MICRO)
        patch.setitem(tiny_model.PRESET_SHARDED, "micro", False)
        return tiny_model.init_model(tmp_path_factory.mktemp("micro_fp8"), "qwen3_moe", "micro", experts_dtype="fp8")


@pytest.mark.parametrize("experts_dtype", ["fp8", "int4"])
def test_quantized_experts_match_the_cpu_device_with_misses(micro_fp8_model, experts_dtype):
    prompt = [5, 17, 42, 9, 77]
    runs = {}
    for device in ("cpu", "cuda"):  # half the experts resident: some steps read the host store
        model = LocalModel(micro_fp8_model, device=device, max_context=32, cache_fraction=0.5,
                           experts_dtype=experts_dtype)
        runs[device] = model.generate(prompt, 2)  # the prefill, then a decode step
        assert model.stages[0].experts.store.experts_dtype == experts_dtype
    assert runs["cuda"].tokens == runs["cpu"].tokens
    np.testing.assert_allclose(runs["cuda"].logprobs, runs["cpu"].logprobs, atol=1e-4)
