"""moe_quant_round.py's one-round kernels at A3B shapes, compiled here for sm_90 (NVVM + ptxas + nvdisasm, no
GPU), and linear_quant_fp8.py's projection: registers, SASS instructions, and where the global loads sit against the block barrier (BAR) and
the first FFMA: every weight load (LDG.E.128) should come before the barrier.

    python tools/device/quant15_sass.py --nvdisasm PATH [--shapes cols:rows:mats:hardware:min_blocks,...]"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from quant7_sass import sass  # noqa: E402
from tests.cuda.ptx_check import _offline_numba, find_cuda_home  # noqa: E402

SIGNATURE = ("uint64[:, ::1]", "int32[::1]", "int32[::1]", "uint64[:, ::1]", "float32[:, ::1]", "uint64[:, ::1]",
             "float32[:, ::1]", "int64", "int64", "int64", "int64", "int64", "int64", "int32[::1]", "float32[:, ::1]")
DENSE = ("uint64[:, ::1]", "uint64[:, ::1]", "float32[:, ::1]", "int64", "float32[:, ::1]")


def where_loads(ops: list[str]) -> str:
    bar = next((i for i, op in enumerate(ops) if op.startswith("BAR")), len(ops))
    ffma = next((i for i, op in enumerate(ops) if op.startswith("FFMA")), len(ops))
    local = sum(op.startswith(("STL", "LDL")) for op in ops)
    wide = [i for i, op in enumerate(ops) if op.startswith("LDG") and op.endswith(".128")]
    other = [i for i, op in enumerate(ops) if op.startswith("LDG") and not op.endswith(".128")]
    return (f"16-byte loads {len(wide)} ({sum(i > bar for i in wide)} after BAR, {sum(i > ffma for i in wide)} after the "
            f"first FFMA); other global loads {len(other)} ({sum(i > bar for i in other)} after BAR); local loads/stores {local}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvdisasm", default=os.environ.get("NVDISASM", "nvdisasm"))
    parser.add_argument("--shapes", default="2048:2:2:1:4,2048:2:2:1:0,2048:1:2:1:0,2048:1:2:0:0,768:8:1:1:0,768:8:1:0:0,"
                        "768:4:1:0:0,768:4:1:1:0,2048:2:0:1:0,2048:2:0:0:0,4096:1:0:1:0,4096:1:0:0:0,"
                        "2048:1:2:0:0:int4,2048:2:2:0:0:int4,2048:4:2:0:0:int4,768:8:1:0:0:int4,768:16:1:0:0:int4",
                        help="cols:rows:mats:hardware:min_blocks[:fmt],... (mats 0: the FP8 projection)")
    args = parser.parse_args(argv)
    cuda_home = find_cuda_home()
    _offline_numba(cuda_home, (9, 0))
    from numba import cuda

    from moebus.cuda.kernels import linear_quant_fp8, moe_quant_round

    for shape in args.shapes.split(","):
        cols, rows, mats, hardware, min_blocks = (int(v) for v in shape.split(":")[:5])
        fmt = shape.split(":")[5] if shape.count(":") == 5 else "fp8"
        if mats:
            fn = moe_quant_round.one_round_kernel(cols, mats, rows, True, bool(hardware), 128, min_blocks, fmt)
            signature = SIGNATURE
        else:  # linear_quant_fp8.py's projection
            fn, signature = linear_quant_fp8.dense_kernel(cols, rows, True, bool(hardware), 128, min_blocks), DENSE
        ptx, _ = cuda.compile_ptx(fn.py_func, f"void({', '.join(signature)})", cc=(9, 0),
                                  launch_bounds=(128, min_blocks) if min_blocks else None)
        ops, info = sass(ptx, os.path.join(cuda_home, "bin", "ptxas"), args.nvdisasm)
        print(f"{fmt} cols {cols} rows {rows} mats {mats} hardware {hardware} min_blocks {min_blocks}: {info}, {len(ops)} SASS; "
              f"{where_loads(ops)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
