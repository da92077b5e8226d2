"""FP8 checkpoints as Qwen publishes them, against transformers running the same weights
dequantized (a float32 copy: non-expert projections rounded to bf16 as moebus loads them, experts
exact under experts.dtype fp8, bf16-rounded under bf16): greedy tokens equal, logprobs within 1e-3."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moebus.common.fp8_convert import dequantized_copy, fp8_copy  # noqa: E402
from moebus.common.tiny_model import init_model  # noqa: E402
from moebus.workers.local import LocalModel  # noqa: E402
from tests.models import hf_greedy  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42, 7, 250], [11, 12], list(range(30, 70))]


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory, model_dirs):
    root = tmp_path_factory.mktemp("fp8")
    return {"init_qwen3": init_model(root / "init_qwen3", "qwen3_moe", experts_dtype="fp8"),
            "hf_qwen3": fp8_copy(model_dirs["hf_qwen3_bf16"], root / "hf_qwen3"),
            "hf_mixtral": fp8_copy(model_dirs["hf_mixtral_bf16"], root / "hf_mixtral")}


def _pair(fp8_dirs, tmp_path, name, experts_dtype, attention_dtype="bf16"):
    ref_dir = dequantized_copy(fp8_dirs[name], tmp_path / "ref", experts_exact=experts_dtype == "fp8",
                               attention_exact=attention_dtype == "fp8")
    hf = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    return hf, LocalModel(fp8_dirs[name], num_slots=4, max_context=128, experts_dtype=experts_dtype,
                          attention_dtype=attention_dtype)


def _log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    return logits - logits.max(-1, keepdims=True) - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))


@pytest.mark.parametrize("name", ["init_qwen3", "hf_qwen3", "hf_mixtral"])
@pytest.mark.parametrize("experts_dtype,attention_dtype", [("fp8", "bf16"), ("bf16", "bf16"), ("fp8", "fp8")])
def test_fp8_checkpoint_matches_transformers_on_the_dequantized_weights(fp8_dirs, tmp_path, name, experts_dtype,
                                                                        attention_dtype):
    """attention_dtype fp8: the checkpoint's own q/k/v/o codes and scales, read as FP8."""
    hf, ours = _pair(fp8_dirs, tmp_path, name, experts_dtype, attention_dtype)
    logits = ours.prefill_logits(PROMPTS)
    for prompt, row in zip(PROMPTS, logits):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1].numpy()
        assert np.abs(_log_softmax(row) - _log_softmax(ref)).max() < 1e-3
        assert np.abs(ref).max() > 1.0
    assert ours.generate(PROMPTS[0], 32).tokens == hf_greedy(hf, PROMPTS[0], 32)
