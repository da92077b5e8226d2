"""The attention projections for attention.dtype fp8 and the lm_head for lm_head.dtype fp8: an FP8
checkpoint's own codes and scales, a bf16 checkpoint's quantized at load; both dequantize to what
they stand for."""
import numpy as np

from moebus.common.checkpoint import Checkpoint
from moebus.common.fp8_dense import attention_fp8, concat_rows, fp8_rows, fp8_rows_nbytes, lm_head_fp8
from moebus.common.quant import fp8_dequantize
from moebus.common.tiny_model import init_model
from moebus.cuda.dtypes import to_f32
from moebus.cuda.kernels.linear_quant import fp8_rows_dequantize
from tests.models import fp8_lm_head_copy, tied_copy


def test_an_fp8_checkpoint_keeps_its_own_codes_and_scales(tmp_path):
    ckpt = Checkpoint(init_model(tmp_path / "fp8", experts_dtype="fp8"))
    got = attention_fp8(ckpt, 1, ckpt.attention(1))
    for key, name in (("q", "q_proj"), ("o", "o_proj")):
        codes, block_scales = ckpt.fp8_tensor(f"model.layers.1.self_attn.{name}.weight")
        np.testing.assert_array_equal(got[key][0], codes)
        np.testing.assert_array_equal(fp8_rows_dequantize(*got[key]), fp8_dequantize(codes, block_scales))


def test_a_bf16_checkpoint_is_quantized_at_load(tmp_path):
    ckpt = Checkpoint(init_model(tmp_path / "bf16"))
    tensors = ckpt.attention(0)
    got = attention_fp8(ckpt, 0, tensors)
    assert set(got) == {"q", "k", "v", "o"}
    for key, (codes, scales) in got.items():
        w = to_f32(tensors[key])
        np.testing.assert_array_equal(codes, fp8_rows(w)[0])
        assert np.abs(fp8_rows_dequantize(codes, scales) - w).max() <= np.abs(w).max() / 16  # e4m3: 3 mantissa bits


def test_concat_rows_keeps_each_part():
    rng = np.random.default_rng(0)
    a, b = (fp8_rows(rng.standard_normal((rows, 136), dtype=np.float32)) for rows in (5, 3))
    codes, scales = concat_rows([a, b])
    np.testing.assert_array_equal(fp8_rows_dequantize(codes, scales)[5:], fp8_rows_dequantize(*b))


def test_a_bf16_lm_head_is_quantized_at_load(tmp_path):
    ckpt = Checkpoint(init_model(tmp_path / "bf16"))
    codes, scales = lm_head_fp8(ckpt)
    want = fp8_rows(to_f32(ckpt.lm_head()))
    np.testing.assert_array_equal(codes, want[0])
    np.testing.assert_array_equal(scales, want[1])
    assert codes.nbytes + scales.nbytes == fp8_rows_nbytes(*ckpt.lm_head().shape)


def test_an_fp8_checkpoints_unconverted_lm_head_is_quantized_at_load(tmp_path):
    ckpt = Checkpoint(init_model(tmp_path / "fp8", experts_dtype="fp8"))  # modules_to_not_convert: lm_head
    assert ckpt.fp8_tensor("lm_head.weight") is None
    np.testing.assert_array_equal(lm_head_fp8(ckpt)[0], fp8_rows(ckpt.lm_head())[0])


def test_an_lm_head_stored_as_fp8_keeps_its_codes_and_scales(tmp_path):
    ckpt = Checkpoint(fp8_lm_head_copy(init_model(tmp_path / "bf16"), tmp_path / "fp8_head"))
    stored_codes, block_scales = ckpt.fp8_tensor("lm_head.weight")
    codes, scales = lm_head_fp8(ckpt)
    np.testing.assert_array_equal(codes, stored_codes)
    np.testing.assert_array_equal(fp8_rows_dequantize(codes, scales), fp8_dequantize(stored_codes, block_scales))


def test_a_tied_lm_head_is_a_quantized_copy_of_the_embedding_table(tmp_path):
    ckpt = Checkpoint(tied_copy(init_model(tmp_path / "bf16"), tmp_path / "tied"))
    table = ckpt.embedding().copy()
    codes, _ = lm_head_fp8(ckpt)
    np.testing.assert_array_equal(codes, fp8_rows(to_f32(table))[0])
    np.testing.assert_array_equal(ckpt.embedding(), table)  # the table itself is read as stored
