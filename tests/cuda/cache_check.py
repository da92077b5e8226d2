"""numba's on-disk kernel cache, filled and reused without a GPU: every launch wrapper runs as in
ptx_check (launches intercepted), and each kernel it would launch goes through the dispatcher's own
compile path (the one a launch takes: argument types, disk cache lookup, compile, save) for a real
GPU's compute capability, with the local toolkit's NVVM. Run twice on one directory: the first run
compiles and writes the cache, the second must load every kernel and call NVVM not once.

What this cannot show without a GPU: the driver loading the cached code. Offline a kernel is
compiled to PTX only (no driver to link a cubin), so the cache holds PTX; on a GPU the dispatcher
links the cubin before saving and the cache holds both.

    python -m tests.cuda.cache_check --cache-dir DIR [--cc 9.0] [--only NAME,...] [--variants N] [--expect-loaded]

Prints one JSON line: kernel variants, how many were compiled and loaded, NVVM calls, cache files.
Must run in a process where numba has not been imported with NUMBA_ENABLE_CUDASIM=1."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def _offline_cache(cuda_home: str, cc: tuple[int, int]):
    """The real dispatcher, its disk cache keyed as on a GPU of ``cc``; returns NVVM's call counter."""
    from tests.cuda.ptx_check import _offline_numba

    dispatcher_class = _offline_numba(cuda_home, cc)
    import numba.cuda.codegen as codegen
    import numba.cuda.dispatcher as dispatcher

    # the key's (runtime version, compute capability), which a GPU process reads from its context
    codegen.JITCUDACodegen.magic_tuple = lambda self: (("offline",), cc)
    codegen.CUDACodeLibrary._ensure_cc = lambda self, wanted: wanted or cc
    dispatcher._Kernel.bind = lambda self: self._codelibrary.get_asm_str(cc=cc)
    calls = {"nvvm": 0}
    compile_ir = codegen.nvvm.compile_ir

    def counted(*args, **kwargs):
        calls["nvvm"] += 1
        return compile_ir(*args, **kwargs)

    codegen.nvvm.compile_ir = counted
    return dispatcher_class, calls


def _report(dispatchers, num_variants: int, nvvm_calls: int, role_dir: Path) -> dict:
    from moebus.cuda.kernels.compat import disk_cache_counts

    files = sorted(p.suffix for p in role_dir.rglob("*") if p.suffix in (".nbi", ".nbc"))
    return {"kernel_variants": num_variants, "compiled": sum(sum(k._cache_misses.values()) for k in dispatchers),
            "loaded": sum(sum(k._cache_hits.values()) for k in dispatchers), "disk_cache_counts": disk_cache_counts(),
            "compiled_kernels": sorted({k.py_func.__name__ for k in dispatchers if sum(k._cache_misses.values())}),
            "nvvm_calls": nvvm_calls, "index_files": files.count(".nbi"), "data_files": files.count(".nbc"),
            "cache_dir": str(role_dir)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", required=True, help="the kernel_cache_dir setting")
    parser.add_argument("--cc", default="9.0")
    parser.add_argument("--cuda-home", default=None)
    parser.add_argument("--expect-loaded", action="store_true", help="fail unless every kernel came from the cache")
    parser.add_argument("--only", default="", help="comma list of kernel names (e.g. layernorm_rows,add_flat); default all")
    parser.add_argument("--variants", type=int, default=0, help="compile the first N variants found only (0: all)")
    args = parser.parse_args(argv)
    from moebus.cuda.kernels.kernel_cache import gpu_role, use_kernel_cache

    role_dir = use_kernel_cache(args.cache_dir, gpu_role(0))  # before any kernel module is imported
    from tests.cuda.ptx_check import exercise, find_cuda_home

    cuda_home = args.cuda_home or find_cuda_home()
    if cuda_home is None:
        print("no CUDA toolkit with NVVM and libdevice found (set CUDA_HOME)")
        return 2
    dispatcher_class, calls = _offline_cache(cuda_home, tuple(int(p) for p in args.cc.split(".")))
    only = set(filter(None, args.only.split(",")))
    kernels = {}

    def launch(kernel, *launch_args):
        if (not only or kernel.py_func.__name__ in only) and not (args.variants and len(kernels) >= args.variants):
            kernels.setdefault((id(kernel), kernel._compile_for_args(*launch_args)), kernel)

    dispatcher_class.__getitem__ = lambda kernel, config: (lambda *a: launch(kernel, *a))
    exercise(np.random.default_rng(0))
    report = _report(set(kernels.values()), len(kernels), calls["nvvm"], role_dir)
    print(json.dumps(report))
    everything_loaded = report["loaded"] == len(kernels) and not (report["compiled"] or calls["nvvm"])
    return 1 if args.expect_loaded and not everything_loaded else 0


if __name__ == "__main__":
    sys.exit(main())
