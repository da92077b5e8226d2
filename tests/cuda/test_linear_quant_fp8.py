"""The one-round FP8 projection for one token (linear_quant_fp8.py, linear_quant.ONE_ROUND) against the
numpy reference."""
import numpy as np
import pytest

from moebus.common.fp8_dense import fp8_rows
from moebus.cuda.kernels import linear_quant, linear_quant_fp8
from moebus.cuda.kernels.linear_quant import linear_fp8_cuda, linear_fp8_ref
from tests.cuda.conftest import device, poisoned
from tests.cuda.test_linear_quant import _close, _weight


@pytest.mark.parametrize("rows,cols,hardware,early", [
    (5, 256, True, False),    # 8 rows a warp (16 words a row, 4 a lane): one partial group
    (7, 144, True, True),     # a partial edge block; 9 words a row, 3 a lane, the last past the row's end
    (130, 512, False, True),  # several groups, the last partial; e4m3 by bit moves (on a GPU)
    (6, 2048, True, False),   # q/k/v's rows: 2 a warp, 8 words a lane
    (3, 4096, True, True),    # o's rows: 1 a warp, 8 words a lane
])
def test_linear_fp8_one_round_matches_ref(rng, monkeypatch, rows, cols, hardware, early):
    monkeypatch.setattr(linear_quant, "ONE_ROUND", True)
    monkeypatch.setattr(linear_quant_fp8, "HARDWARE_E4M3", hardware)
    monkeypatch.setattr(linear_quant_fp8, "LOAD_BEFORE_WAIT", early)  # weights before the PDL wait
    codes, scales = fp8_rows(_weight(rng, rows, cols))
    x = rng.standard_normal((1, cols), dtype=np.float32)
    x_d, codes_d = device(x), device(codes)
    assert linear_quant_fp8.fits(x_d, codes_d, scales)
    out = poisoned((1, rows))
    linear_fp8_cuda(x_d, codes_d, device(scales), out)
    _close(out.copy_to_host(), linear_fp8_ref(x, codes, scales))


def test_rows_a_warp_keep_a_lanes_words_at_most_eight():
    assert [linear_quant_fp8.rows_for(c) for c in (256, 2048, 4096)] == [8, 2, 1]
    x, codes = device(np.zeros((1, 8192), np.float32)), device(np.zeros((4, 8192), np.uint8))
    assert not linear_quant_fp8.fits(x, codes, None)  # 16 words a lane: linear_quant.py's kernel
