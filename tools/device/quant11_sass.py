"""Where ptxas puts the quantized decode GEMVs' loads (sm_90, compiled here: NVVM + ptxas + nvdisasm, no
GPU), per work-shape setting (quant9_regs.py's settings JSON): registers, SASS instructions, and the
global loads issued *after* the first FFMA of the kernel. The PTX issues a round's words, scales and x
before the first use (moe_quant.py), but ptxas may sink them next to their uses to save registers: each
load issued after compute has begun is another dependent round trip to memory in that warp's chain
(the eleventh session found the int4 gate|up issuing its 8 weight words in 4 batches that way).

    python tools/device/quant11_sass.py --nvdisasm PATH [SETTINGS.json | PLAN.json]     (quant9_regs.py's formats)"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from quant7_sass import sass  # noqa: E402
from quant9_regs import launches  # noqa: E402
from tests.cuda.ptx_check import Compiler, _offline_numba, find_cuda_home  # noqa: E402


KINDS = {"words": (".64",), "x": (".128",)}  # 8-byte loads: weight words; 16-byte: x; the rest: scales, tables


def kind(op: str) -> str:
    return next((k for k, ends in KINDS.items() if op.endswith(ends)), "4-byte")


def late_loads(ops: list[str]) -> dict:
    """{kind: (global loads, of them after the first FFMA, groups of those split by FFMAs)}."""
    ffma = [i for i, op in enumerate(ops) if op.startswith("FFMA")]
    first = ffma[0] if ffma else len(ops)
    out = {}
    for name in (*KINDS, "4-byte"):
        loads = [i for i, op in enumerate(ops) if op.startswith("LDG") and kind(op) == name]
        late = [i for i in loads if i > first]
        groups, last = 0, None
        for i in late:
            if last is None or any(last < f < i for f in ffma):
                groups += 1
            last = i
        out[name] = (len(loads), len(late), groups)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvdisasm", default=os.environ.get("NVDISASM", "nvdisasm"))
    parser.add_argument("--tokens", default="1")
    parser.add_argument("settings", nargs="?")
    args = parser.parse_args(argv)
    settings = [["defaults", {}]]
    if args.settings:
        with open(args.settings) as f:
            settings = json.load(f)
        if settings and len(settings[0]) == 3 and isinstance(settings[0][2], list) and settings[0][2] \
                and isinstance(settings[0][2][0], list):  # a quant9_sweep.py plan: its settings, each once
            settings = list({json.dumps(s[:2]): s[:2] for _, _, part in settings for s in part}.values())
    cuda_home = find_cuda_home()
    dispatcher = _offline_numba(cuda_home, (9, 0))
    ptxas = os.path.join(cuda_home, "bin", "ptxas")
    from moebus.cuda.kernels import linear_quant, moe_quant, quant_words

    modules = {"moe_quant": moe_quant, "linear_quant": linear_quant, "quant_words": quant_words}
    defaults = {k: getattr(modules[k.split(".")[0]], k.split(".")[1]) for _, v, *_ in settings for k in v}
    for name, values, *_ in settings:
        for key, value in {**defaults, **values}.items():
            setattr(modules[key.split(".")[0]], key.split(".")[1], value)
        print(f"== {name} {values}")
        for tokens in (int(t) for t in args.tokens.split(",")):
            hardware = quant_words.HARDWARE_E4M3_MIN_RUN <= tokens
            moe_quant.hardware_e4m3 = linear_quant.hardware_e4m3 = lambda chunk, h=hardware: h
            compiler = Compiler((9, 0))
            dispatcher.__getitem__ = lambda kernel, config, c=compiler: (lambda *a: c.launch(kernel, config, a))
            for what in launches(tokens):
                pass
            for (kname, _, _), (ptx, error) in compiler.results.items():
                if error:
                    print(f"   T={tokens} {kname}: {error[:200]}")
                    continue
                ops, info = sass(ptx, ptxas, args.nvdisasm)
                where = late_loads(ops)
                print(f"   T={tokens} {kname[-10:]:10} {info:9} {len(ops):5} SASS; loads (all/after the first FFMA/in "
                      "groups): " + ", ".join(f"{k} {a}/{b}/{c}" for k, (a, b, c) in where.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
