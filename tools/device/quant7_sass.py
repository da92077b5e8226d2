"""The expert GEMVs' SASS for sm_90, compiled here (NVVM + ptxas + nvdisasm, no GPU): instructions per
kernel by class, so that "bound by instructions or by bytes" can be argued before a device call.
A3B shapes (D 2048, I 768); 1 and 8 tokens; bf16 (moe_ffn.py) against fp8 / int4 (moe_quant.py).

    python tools/device/quant7_sass.py [--nvdisasm PATH] [--dump DIR]

The counts are static (the kernels' rounds are unrolled, and at one token a gate|up row is one
round), so per-warp work at one token is about the count of the loop body."""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.cuda.ptx_check import Compiler, _offline_numba, find_cuda_home  # noqa: E402

CLASSES = {"load": ("LDG", "LD", "LDS", "LDC", "ULDC"), "store": ("STG", "ST", "STS"),
           "float": ("FFMA", "FMUL", "FADD", "FSETP", "FMNMX", "MUFU", "FCHK"),
           "int": ("IMAD", "IADD3", "LOP3", "SHF", "LEA", "ISETP", "IMNMX", "PRMT", "SEL", "I2F", "F2I", "IABS",
                   "BMSK", "SGXT", "POPC", "FLO", "VIMNMX", "I2FP", "F2FP", "IMUL", "HADD2", "HFMA2"),
           "shuffle": ("SHFL",), "control": ("BRA", "EXIT", "BSSY", "BSYNC", "BAR", "WARPSYNC", "CALL", "RET")}


def opcode_class(op: str) -> str:
    base = op.split(".")[0]
    for name, ops in CLASSES.items():
        if base in ops:
            return name
    return "other"


def sass(ptx: str, ptxas: str, nvdisasm: str) -> tuple[list[str], str]:
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        info = subprocess.run([ptxas, "-arch=sm_90", "-v", src, "-o", cubin], capture_output=True, text=True).stderr
        text = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text)
    regs = re.search(r"Used (\d+) registers", info)
    return ops, (regs.group(1) if regs else "?") + " regs" + (" LOCAL" if "bytes stack frame" in info and
                                                              not re.search(r"0 bytes stack frame", info) else "")


def exercise(tokens_list, dtypes, hardware=False):
    from moebus.common.quant_layout import ExpertLayout
    from moebus.cuda.kernels import moe_ffn, moe_quant

    moe_quant.hardware_e4m3 = lambda chunk: hardware  # no GPU to ask here

    rng = np.random.default_rng(0)
    hidden, inter = 2048, 768
    for dtype in dtypes:
        for tokens in tokens_list:
            pairs = np.arange(tokens * 8, dtype=np.int32)
            x = rng.standard_normal((tokens, hidden), dtype=np.float32)
            out, scratch = np.empty((tokens * 8, hidden), np.float32), np.empty((tokens * 8, inter), np.float32)
            if dtype == "bf16":
                moe_ffn.expert_ffn_cuda(x, pairs // 8, pairs % 4, pairs, np.zeros((4, 3 * hidden * inter), np.uint16),
                                        hidden, inter, out, scratch)
            else:
                layout = ExpertLayout(dtype, hidden, inter)
                moe_quant.expert_ffn_quant_cuda(x, pairs // 8, pairs % 4, pairs,
                                                np.zeros((4, layout.blob_bytes), np.uint8), layout, out, scratch)
            yield dtype, tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvdisasm", default=os.environ.get("NVDISASM", "nvdisasm"))
    parser.add_argument("--tokens", default="1,8")
    parser.add_argument("--dtypes", default="bf16,fp8,int4")
    parser.add_argument("--dump", default=None)
    args = parser.parse_args(argv)
    cuda_home = find_cuda_home()
    dispatcher_class = _offline_numba(cuda_home, (9, 0))
    ptxas = os.path.join(cuda_home, "bin", "ptxas")
    cases = [(d, int(t), hw) for d in args.dtypes.split(",") for t in args.tokens.split(",")
             for hw in ((False, True) if d == "fp8" else (False,))]
    for dtype, tokens, hardware in cases:
        compiler = Compiler((9, 0))
        dispatcher_class.__getitem__ = lambda kernel, config, c=compiler: (lambda *a: c.launch(kernel, config, a))
        list(exercise([tokens], [dtype], hardware))
        dtype += "/hw" if hardware else ""
        for n, ((name, _, _), (ptx, error)) in enumerate(compiler.results.items()):
            if error:
                print(f"{dtype} T={tokens} {name}: {error[:200]}")
                continue
            ops, info = sass(ptx, ptxas, args.nvdisasm)
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                with open(os.path.join(args.dump, f"{dtype.replace('/', '_')}_{tokens}_{n}_{name[-10:]}.ptx"), "w") as f:
                    f.write(ptx)
            by_class = collections.Counter(opcode_class(op) for op in ops)
            top = collections.Counter(op.split(".")[0] for op in ops).most_common(8)
            print(f"{dtype:7} T={tokens} {name:14} {info:14} {len(ops):5} SASS: "
                  + " ".join(f"{k} {by_class[k]}" for k in CLASSES if by_class[k]) + f" other {by_class['other']}"
                  + "  | " + " ".join(f"{op} {n}" for op, n in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
