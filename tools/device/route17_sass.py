"""norm_route's in-flight kernel at the A3B shape (hidden 2048, 32 experts, 512 threads, the router over 16 blocks,
one token) compiled here for sm_90 (NVVM + ptxas + nvdisasm, no GPU) with the seventeenth session's switches
(ROUTER_EARLY, WARP_TAIL, SUMS_UNROLLED): registers, local memory, where the global loads sit against the PDL
wait, the fences and the block barriers.

    python tools/device/route17_sass.py [--nvdisasm PATH] [--dump DIR]   (the nvidia-cuda-nvdisasm wheel has one)"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from quant7_sass import sass  # noqa: E402
from tests.cuda.ptx_check import Compiler, _offline_numba, find_cuda_home  # noqa: E402

SETTINGS = (("defaults", {}), ("early", {"ROUTER_EARLY": True}), ("warp_tail", {"WARP_TAIL": True}),
            ("unrolled", {"SUMS_UNROLLED": True}),
            ("all", {"ROUTER_EARLY": True, "WARP_TAIL": True, "SUMS_UNROLLED": True}))


def where(ops: list[str]) -> str:
    """Global loads before / after the PDL wait (the first ACQBULK, griddepcontrol.wait's SASS), fences, barriers."""
    wait = next((i for i, op in enumerate(ops) if op.startswith("ACQBULK")), None)
    loads = [i for i, op in enumerate(ops) if op.startswith("LDG")]
    before = sum(i < wait for i in loads) if wait is not None else "?"
    fences = sorted({op for op in ops if op.startswith(("MEMBAR", "FENCE", "CCTL"))})
    def count(*names):
        return sum(op.startswith(names) for op in ops)

    return (f"LDG {len(loads)} ({before} before the wait); {'/'.join(fences) or 'no fence'}; BAR {count('BAR')}; "
            f"WARPSYNC {count('WARPSYNC')}; ATOM/RED {count('ATOM', 'RED')}; local {count('LDL', 'STL')}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvdisasm", default=os.environ.get("NVDISASM", "nvdisasm"))
    parser.add_argument("--dump", default=None)
    args = parser.parse_args(argv)
    cuda_home = find_cuda_home()
    dispatcher_class = _offline_numba(cuda_home, (9, 0))
    from moebus.cuda.kernels import norm_route

    f32 = np.zeros((1, 2048), np.float32)
    for name, values in SETTINGS:
        compiler = Compiler((9, 0), args.dump)
        dispatcher_class.__getitem__ = lambda kernel, config, c=compiler: (lambda *a: c.launch(kernel, config, a))
        old = {k: getattr(norm_route, k) for k in values}
        for k, v in values.items():
            setattr(norm_route, k, v)
        norm_route.norm_route_cuda(f32, f32, np.zeros(2048, np.uint16), 1e-6, np.zeros((32, 2048), np.uint16), 8, True,
                                   np.zeros((2, 32), np.int32), 1, np.zeros(1, np.int32), f32.copy(), f32.copy(),
                                   np.zeros((1, 8), np.int32), np.zeros((1, 8), np.float32),
                                   *(np.zeros(8, np.int32) for _ in range(3)), scratch=np.zeros((1, 32), np.float32))
        for k, v in old.items():
            setattr(norm_route, k, v)
        for key, (ptx, error) in compiler.results.items():
            if error:
                print(f"{name}: {key[0]} FAILED {error[:300]}")
                continue
            ops, info = sass(ptx, os.path.join(cuda_home, "bin", "ptxas"), args.nvdisasm)
            if args.dump:
                with open(os.path.join(args.dump, f"{name}.ops"), "w") as f:
                    f.write("\n".join(ops))
            print(f"{name}: {info}, {len(ops)} SASS; {where(ops)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
