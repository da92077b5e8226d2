"""lm_head.dtype fp8 on the cpu device: the logits are those of the same model whose lm_head is its
dequantized FP8 weight (fp8_dense's codes times scales, what the FP8 GEMV computes with), a tied
lm_head quantizes a copy and leaves the embedding table as stored, and the emulated GPU is charged
the FP8 bytes so the expert cache gets the rest."""
import numpy as np
import pytest

from moebus.common.fp8_dense import fp8_rows, fp8_rows_nbytes
from moebus.cuda.kernels.linear_quant import fp8_rows_dequantize
from moebus.workers.cache_sizing import stage_dense_bytes
from moebus.workers.local import LocalModel
from tests.models import tied_copy

PROMPTS = [[5, 17, 99, 3, 42, 7, 250], [11, 12], list(range(30, 70))]


def _dequantized_head(model: LocalModel) -> LocalModel:
    """``model`` (bf16 lm_head) with its lm_head replaced by the dequantized FP8 weight."""
    stage = model.stages[-1]
    stage.lm_head = stage.ops.weight(fp8_rows_dequantize(*fp8_rows(model.ckpt.lm_head())))
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_fp8_lm_head_logits_are_the_dequantized_weights(model_dirs, tmp_path, tied):
    model_dir = tied_copy(model_dirs["init_qwen3"], tmp_path / "tied") if tied else model_dirs["init_qwen3"]
    fp8 = LocalModel(model_dir, lm_head_dtype="fp8")
    ref = _dequantized_head(LocalModel(model_dir))
    ours, want = fp8.prefill_logits(PROMPTS), ref.prefill_logits(PROMPTS)
    np.testing.assert_allclose(ours, want, atol=1e-5, rtol=0)
    bf16 = LocalModel(model_dir).prefill_logits(PROMPTS)
    assert not np.allclose(bf16, ours, atol=1e-7)  # the option changes the weights read
    assert np.abs(bf16 - ours).max() < 0.05 * np.abs(bf16).max()  # ... by e4m3's rounding, no more
    np.testing.assert_array_equal(fp8.stages[0].embed, fp8.ckpt.embedding())  # the table stays as stored
    assert fp8.generate(PROMPTS[0], 4).tokens == ref.generate(PROMPTS[0], 4).tokens


def test_a_bad_lm_head_dtype_names_the_accepted_ones(model_dirs):
    with pytest.raises(ValueError, match="lm_head dtype 'int4': choose one of bf16, fp8"):
        LocalModel(model_dirs["init_qwen3"], lm_head_dtype="int4")


def test_the_dense_bytes_count_the_fp8_lm_head(model_dirs):
    model = LocalModel(model_dirs["init_qwen3"])
    ckpt, stage = model.ckpt, model.stages[-1]
    vocab, hidden = ckpt.config.vocab_size, ckpt.config.hidden_size
    bf16, fp8 = (stage_dense_bytes(ckpt, stage.layer_range, True, True, 0, dtype) for dtype in ("bf16", "fp8"))
    assert bf16 - fp8 == 2 * vocab * hidden - fp8_rows_nbytes(vocab, hidden) > 0
    assert fp8_rows_nbytes(vocab, hidden) == vocab * hidden + vocab * -(-hidden // 128) * 4
    assert fp8_rows_nbytes(151_936, 2048) / 2**20 == pytest.approx(306.0, abs=0.1)  # the A3B's: 593.5 MiB bf16


def test_the_dense_bytes_count_fp8_attention(model_dirs):
    """attention.dtype fp8: q, k, v and o as codes and row scales, the norms as stored."""
    from moebus.common.fp8_dense import PROJECTIONS

    model = LocalModel(model_dirs["init_qwen3"])
    ckpt, stage = model.ckpt, model.stages[-1]
    bf16, fp8 = (stage_dense_bytes(ckpt, stage.layer_range, True, True, 0, "bf16", dtype) for dtype in ("bf16", "fp8"))
    saved = sum(t.nbytes - fp8_rows_nbytes(*t.shape) for i in stage.layer_range
                for name, t in ckpt.attention(i).items() if name in PROJECTIONS)
    assert bf16 - fp8 == saved > 0


def test_the_dense_bytes_count_the_embedding_only_where_it_is_in_vram(model_dirs, monkeypatch):
    """The token embedding lives in mapped host memory (cuda/memory/host_table.py): the first stage's
    emulated VRAM is charged for it only with MOEBUS_EMBEDDING_VRAM=1, as a cuda worker's would be."""
    model = LocalModel(model_dirs["init_qwen3"])
    ckpt, stage = model.ckpt, model.stages[0]
    host = stage_dense_bytes(ckpt, stage.layer_range, True, True, 0)
    monkeypatch.setenv("MOEBUS_EMBEDDING_VRAM", "1")
    assert stage_dense_bytes(ckpt, stage.layer_range, True, True, 0) - host == ckpt.embedding().nbytes > 0
