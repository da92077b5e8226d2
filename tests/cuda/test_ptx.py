"""GPU-only code (libdevice casts, shuffles, numba's typing of the real kernels) compiled to PTX for
sm_90 with the local CUDA toolkit's NVVM: no GPU needed, skipped without a toolkit."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cuda.ptx_check import find_cuda_home

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(find_cuda_home() is None, reason="no CUDA toolkit with NVVM and libdevice")
def test_every_kernel_compiles_for_sm90_without_f64_or_local_memory():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    run = subprocess.run([sys.executable, "-m", "tests.cuda.ptx_check"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
