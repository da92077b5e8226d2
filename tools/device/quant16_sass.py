"""moe_quant_round.py's one-round kernels at A3B shapes compiled here for sm_90 (no GPU), as quant15_sass.py, with
the hand-unrolled word loop as a seventh field: registers, SASS, global loads against the barrier, local memory.

    python tools/device/quant16_sass.py --nvdisasm PATH [--shapes cols:rows:mats:hardware:min_blocks:fmt:unrolled,...]"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quant15_sass import SIGNATURE, sass, where_loads  # noqa: E402
from tests.cuda.ptx_check import _offline_numba, find_cuda_home  # noqa: E402

SHAPES = ("2048:1:2:0:0:int4:0,2048:1:2:0:0:int4:1,2048:2:2:0:0:int4:0,2048:2:2:0:0:int4:1,2048:4:2:0:0:int4:0,"
          "2048:4:2:0:0:int4:1,768:8:1:0:0:int4:0,768:8:1:0:0:int4:1,768:16:1:0:0:int4:1,"
          "2048:1:2:1:0:fp8:0,2048:1:2:1:0:fp8:1,2048:2:2:1:0:fp8:1,768:8:1:1:0:fp8:0,768:8:1:1:0:fp8:1")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvdisasm", default=os.environ.get("NVDISASM", "nvdisasm"))
    parser.add_argument("--shapes", default=SHAPES, help="cols:rows:mats:hardware:min_blocks:fmt:unrolled,...")
    args = parser.parse_args(argv)
    cuda_home = find_cuda_home()
    _offline_numba(cuda_home, (9, 0))
    from numba import cuda

    from moebus.cuda.kernels import moe_quant_round

    for shape in args.shapes.split(","):
        cols, rows, mats, hardware, min_blocks, fmt, unrolled = shape.split(":")
        cols, rows, mats, hardware, min_blocks = (int(v) for v in (cols, rows, mats, hardware, min_blocks))
        fn = moe_quant_round.one_round_kernel(cols, mats, rows, True, bool(hardware), 128, min_blocks, fmt,
                                              unrolled=unrolled == "1")
        ptx, _ = cuda.compile_ptx(fn.py_func, f"void({', '.join(SIGNATURE)})", cc=(9, 0),
                                  launch_bounds=(128, min_blocks) if min_blocks else None)
        ops, info = sass(ptx, os.path.join(cuda_home, "bin", "ptxas"), args.nvdisasm)
        print(f"{fmt} cols {cols} rows {rows} mats {mats} hardware {hardware} min_blocks {min_blocks} unrolled {unrolled}: "
              f"{info}, {len(ops)} SASS; {where_loads(ops)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
