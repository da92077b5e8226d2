"""GPU-only code (libdevice casts, shuffles, numba's typing of the real kernels) compiled to PTX for
sm_90 with the local CUDA toolkit's NVVM: no GPU needed, skipped without a toolkit."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cuda.ptx_check import find_cuda_home

ROOT = Path(__file__).resolve().parents[2]
SHARDS = 2


@pytest.mark.skipif(find_cuda_home() is None, reason="no CUDA toolkit with NVVM and libdevice")
def test_every_kernel_compiles_for_sm90_without_f64_or_local_memory():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    # two shards side by side: the check is CPU-bound (NVVM) and the rest of the suite runs on one core
    shards = [subprocess.Popen([sys.executable, "-m", "tests.cuda.ptx_check", "--shard", f"{i}/{SHARDS}"], cwd=ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for i in range(SHARDS)]
    outputs = [shard.communicate(timeout=600)[0] for shard in shards]
    for shard, output in zip(shards, outputs):
        assert shard.returncode == 0, output[-4000:]
        assert " with problems" in output, output[-4000:]
    checked = sum(int(output.rsplit("\n", 2)[-2].split()[0]) for output in outputs)
    total = int(outputs[0].rsplit("(shard ", 1)[1].split(" of ", 1)[1].split(")")[0])
    assert checked == total, f"the shards checked {checked} of {total} kernel variants"
