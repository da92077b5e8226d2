
"""attention.dtype fp8 on the cuda device (numba's simulator here) against the cpu device, whose FP8
projections are the float32 dequantized weights (the FP8 GEMV's reference)."""
import numpy as np
import pytest

from moebus.cuda.kernels.linear_quant import Fp8Weight
from moebus.workers.local import LocalModel
from tests.cuda.test_e2e import micro_model  # noqa: F401 - the module's fixture

pytestmark = pytest.mark.usefixtures("exact_quant_kernels")  # the exact kernels against the cpu device at 1e-4


def test_fp8_attention_matches_the_cpu_device(micro_model):  # noqa: F811
    prompt = [5, 17, 42, 9, 77]
    cpu = LocalModel(micro_model, device="cpu", max_context=32, attention_dtype="fp8")
    cuda = LocalModel(micro_model, device="cuda", max_context=32, attention_dtype="fp8")
    layer = cuda.stages[0].layers[0]
    assert all(isinstance(w, Fp8Weight) for k, w in layer.items() if k in ("qkv", "q", "k", "v", "o"))
    assert isinstance(layer["o"], Fp8Weight)
    ours, ref = cuda.generate(prompt, 3), cpu.generate(prompt, 3)
    assert ours.tokens == ref.tokens
    np.testing.assert_allclose(ours.logprobs, ref.logprobs, atol=1e-4)
    bf16 = LocalModel(micro_model, device="cpu", max_context=32).generate(prompt, 3)
    assert not np.allclose(bf16.logprobs, ref.logprobs, atol=1e-7)  # the option changes the weights read
