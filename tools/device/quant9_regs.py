"""The quantized decode GEMVs' work shapes compiled for sm_90 here (NVVM + ptxas, no GPU): per variant
its registers a thread, local memory, the blocks of its launch at A3B shapes and what that makes of
132 SMs (blocks an SM by registers, waves), and the seconds NVVM took (what a variant costs a device
call on a fresh machine). Settings as in quant9_sweep.py ("module.CONSTANT": value).

    python tools/device/quant9_regs.py [SETTINGS.json | PLAN.json]"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.cuda.ptx_check import Compiler, _offline_numba, find_cuda_home  # noqa: E402

SMS, REGISTERS, MAX_BLOCKS, MAX_WARPS = 132, 65536, 32, 64
HIDDEN, INTER, EXPERTS_A_TOKEN = 2048, 768, 8
PROJECTIONS = {"qkv": (5120, 2048), "o": (2048, 4096)}


def ptxas(ptx: str, cuda_home: str) -> tuple[int, bool]:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        info = subprocess.run([os.path.join(cuda_home, "bin", "ptxas"), "-arch=sm_90", "-v", f.name, "-o", os.devnull],
                              capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", info)
    return int(regs.group(1)) if regs else 0, bool(re.search(r"[1-9]\d* bytes (stack frame|spill)", info))


def launches(tokens: int):
    """(name, kernel launch) of the quantized decode GEMVs at A3B shapes, ``tokens`` a pass (runs of
    ``tokens`` pairs on each of 8 experts, as bench decode's batch of one prompt's copies)."""
    from moebus.common.quant_layout import ExpertLayout
    from moebus.cuda.kernels import linear_quant, moe_quant

    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, HIDDEN), dtype=np.float32)
    pairs = np.arange(tokens * EXPERTS_A_TOKEN, dtype=np.int32)
    slots = (pairs // tokens).astype(np.int32)  # sorted by slot: runs of `tokens`
    for fmt in ("fp8", "int4"):
        layout = ExpertLayout(fmt, HIDDEN, INTER)
        moe_quant.expert_ffn_quant_cuda(x, pairs % tokens, slots, pairs, np.zeros((8, layout.blob_bytes), np.uint8),
                                        layout, np.empty((len(pairs), HIDDEN), np.float32),
                                        np.empty((len(pairs), INTER), np.float32))
        yield fmt
    for name, (rows, cols) in PROJECTIONS.items():
        linear_quant.linear_fp8_cuda(rng.standard_normal((tokens, cols), dtype=np.float32), np.zeros((rows, cols), np.uint8),
                                     np.zeros((rows, cols // 128), np.float32), np.empty((tokens, rows), np.float32))
        yield name


def main() -> None:
    settings = [["defaults", {}]]
    if len(sys.argv) > 1:
        with open(sys.argv[1]) as f:
            settings = json.load(f)
        if settings and len(settings[0]) == 3:  # a quant9_sweep.py plan: its settings, each once
            settings = list({json.dumps(s): s for _, _, part in settings for s in part}.values())
    cuda_home = find_cuda_home()
    dispatcher = _offline_numba(cuda_home, (9, 0))
    from moebus.cuda.kernels import linear_quant, moe_quant, quant_words

    modules = {"moe_quant": moe_quant, "linear_quant": linear_quant}
    defaults = {k: getattr(modules[k.split(".")[0]], k.split(".")[1]) for _, v in settings for k in v if "." in k}
    seen = {}
    for name, values in settings:
        for key, value in {**defaults, **values}.items():
            if "." in key:
                setattr(modules[key.split(".")[0]], key.split(".")[1], value)
        print(f"== {name} {values}")
        for tokens in (1, 8):
            for hardware in ((False, True) if tokens > 2 else (False,)):
                moe_quant.hardware_e4m3 = linear_quant.hardware_e4m3 = lambda chunk, h=hardware: h
                quant_words.hardware_e4m3 = moe_quant.hardware_e4m3
                if tokens > 2 and not hardware:
                    continue  # runs of 3+ decode e4m3 by the instruction on an H200
                compiler = Compiler((9, 0))
                grids = []

                def launch(kernel, config, args, compiler=compiler, grids=grids):
                    started = time.perf_counter()
                    compiler.launch(kernel, config, args)
                    grids.append((kernel, config, time.perf_counter() - started))

                dispatcher.__getitem__ = lambda kernel, config: (lambda *a: launch(kernel, config, a))
                for what in launches(tokens):
                    for kernel, config, nvvm_s in grids:
                        key = (id(kernel),)
                        if key not in seen:
                            ptx, error = next(r for k, r in compiler.results.items() if k[2] == id(kernel))
                            if error:
                                print(f"   {what} T={tokens}: {error[:200]}")
                                seen[key] = None
                                continue
                            seen[key] = ptxas(ptx, cuda_home) + (nvvm_s,)
                        if seen[key] is None:
                            continue
                        regs, local, seconds = seen[key]
                        grid, block = config[0], config[1]
                        blocks = int(np.prod(grid)) if isinstance(grid, tuple) else int(grid)
                        if what in ("fp8", "int4"):  # blocks of pairs that start no run return at once
                            blocks //= tokens
                        per_sm = min(MAX_BLOCKS, MAX_WARPS * 32 // block, REGISTERS // (max(regs, 1) * block))
                        print(f"   T={tokens} {what:5} {kernel.py_func.__name__:10} grid {str(grid):12} {regs:3d} regs"
                              f"{' LOCAL' if local else ''}  {per_sm} blocks/SM  {blocks / (per_sm * SMS):5.2f} waves  "
                              f"(compiled in {seconds:.1f} s)")
                    grids.clear()


if __name__ == "__main__":
    main()
