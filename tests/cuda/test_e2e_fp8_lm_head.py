"""lm_head.dtype fp8 on the cuda device (numba's simulator here) against the cpu device, whose FP8
lm_head is the float32 dequantized weight: one sequence's decode through the FP8 GEMV, and a step of
more sequences than the tensor cores' min_rows through the weight dequantized a slice at a time
(linear_quant_slices.py), never whole."""
import numpy as np
import pytest

from moebus.cuda.kernels import linear_quant_slices
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.gemm import TensorCores
from moebus.cuda.kernels.gemm_host import HostBlas, cublas_blas
from moebus.cuda.kernels.linear_quant import Fp8Weight
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel
from tests.cuda.test_e2e import micro_model  # noqa: F401 - the module's fixture
from tests.cuda.test_linear_quant_slices import ScratchLog

pytestmark = pytest.mark.usefixtures("exact_quant_kernels")  # the exact kernels against the cpu device at 1e-4

PROMPTS = StepBatch(slots=[0, 1, 2, 3], starts=[0] * 4, lengths=[5, 4, 3, 3], tokens=list(range(20, 35)))


def test_fp8_lm_head_decode_matches_the_cpu_device(micro_model):  # noqa: F811
    prompt = [5, 17, 42, 9, 77]
    cpu = LocalModel(micro_model, device="cpu", max_context=32, lm_head_dtype="fp8")
    cuda = LocalModel(micro_model, device="cuda", max_context=32, lm_head_dtype="fp8")
    assert isinstance(cuda.stages[-1].lm_head, Fp8Weight)
    ours, ref = cuda.generate(prompt, 3), cpu.generate(prompt, 3)
    assert ours.tokens == ref.tokens
    np.testing.assert_allclose(ours.logprobs, ref.logprobs, atol=1e-4)


def test_many_sequences_logits_take_bounded_slices_and_match_the_cpu_device(micro_model, monkeypatch):  # noqa: F811
    """4 sequences, min_rows 3: the lm_head's 4 rows on the tensor cores, its 128 x 32 weight in slices
    of 48 rows (2 whole, one partial); bf16 holds e4m3 times a scale to 8 bits, so the logits are
    within 2^-8 of the cpu device's (test_linear_quant.py's tolerance for that path) and equal the
    whole weight's in one slice."""
    cpu = LocalModel(micro_model, device="cpu", max_context=32, lm_head_dtype="fp8")
    cuda = LocalModel(micro_model, device="cuda", max_context=32, lm_head_dtype="fp8")
    cuda.backend.tensor_cores = TensorCores(HostBlas() if SIMULATOR else cublas_blas(), min_rows=3)
    hidden = cuda.ckpt.config.hidden_size
    monkeypatch.setattr(linear_quant_slices, "SLICE_BYTES", 48 * hidden * 2)
    logs = []
    inner = linear_quant_slices.linear_fp8_sliced

    def logged(ops, tc, x, weight, out):  # the bf16 buffers the lm_head's product takes
        with ScratchLog(ops) as log:
            logs.append(log)
            return inner(ops, tc, x, weight, out)

    monkeypatch.setattr(linear_quant_slices, "linear_fp8_sliced", logged)
    want, got = cpu.step(PROMPTS, want_logits=True), cuda.step(PROMPTS, want_logits=True)
    vocab, rows = cuda.ckpt.config.vocab_size, PROMPTS.num_seqs
    assert len(logs) == 1  # the lm_head, once (the attention projections are bf16 here)
    assert sorted(logs[0].bf16_bytes) == sorted([2 * rows * hidden * 2, 48 * hidden * 2])  # x's parts, a slice
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-2, atol=1e-2 * np.abs(want.logits).max())
    np.testing.assert_array_equal(got.tokens, want.tokens)
    monkeypatch.setattr(linear_quant_slices, "SLICE_BYTES", vocab * hidden * 2)  # one slice: the whole weight
    whole = LocalModel(micro_model, device="cuda", max_context=32, lm_head_dtype="fp8")
    whole.backend.tensor_cores = cuda.backend.tensor_cores
    np.testing.assert_allclose(whole.step(PROMPTS, want_logits=True).logits, got.logits, rtol=1e-6, atol=1e-6)
