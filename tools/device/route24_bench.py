"""Issue 16's follow-up (twenty-fourth session): route_end's WIDE path (more than 32 experts) against route_tail's
numba kernel on one token of Qwen3-30B-A3B's routing (128 experts, hidden 2048, top 8): the outputs bit for bit, then
LAUNCHES launches of one kernel for Nsight Compute to time (run under ncu, one process a variant).

    route24_bench.py VARIANT [EXPERTS DIM TOP_K]   VARIANT: route_tail, or route_end's WIDE_THREADS (256, 512, 1024)"""
import sys

import numpy as np

from moebus.cuda.dtypes import f32_to_bf16, to_f32
from moebus.cuda.kernels import route_end
from moebus.cuda.kernels.compat import cuda
from moebus.cuda.kernels.moe_quant_mma_ref import route_partials_ref
from moebus.cuda.kernels.norm_route import route_tail_cuda

LAUNCHES = 40


def main(argv) -> int:
    variant = argv[1]
    experts, dim, top_k = (int(v) for v in (argv[2:5] or (128, 2048, 8)))
    rng = np.random.default_rng(24)
    total = rng.standard_normal((1, dim), dtype=np.float32)
    norm_weight = f32_to_bf16(1 + 0.1 * rng.standard_normal(dim, dtype=np.float32))
    router = f32_to_bf16(rng.standard_normal((experts, dim), dtype=np.float32) * 0.3)
    partial = route_partials_ref(total[0], to_f32(norm_weight), to_f32(router))
    table = np.tile(np.arange(experts, dtype=np.int32), (3, 1))
    stream = cuda.stream()
    d = [cuda.to_device(np.ascontiguousarray(v), stream=stream) for v in (partial, total, norm_weight, table)]

    def outputs():
        return [cuda.device_array((1, dim), np.float32), cuda.device_array((1, top_k), np.int32),
                cuda.device_array((1, top_k), np.float32)] + [cuda.device_array(top_k, np.int32) for _ in range(3)]

    def run_tail(out):
        route_tail_cuda(d[0], d[1], d[2], 1e-6, top_k, True, d[3], 2, *out, stream=stream)

    def run_end(out):
        route_end.launch(d[0], d[1], d[2], 1e-6, top_k, True, d[3], 2, *out, stream)

    if variant != "route_tail":
        route_end.WIDE, route_end.WIDE_THREADS = True, int(variant)
        assert route_end.takes(d[0], d[1], d[2], top_k, stream), "route_end does not take it"
    theirs, ours = outputs(), outputs()
    run_tail(theirs)
    run = run_tail if variant == "route_tail" else run_end
    run(ours)
    same = all(np.array_equal(a.copy_to_host(stream=stream), b.copy_to_host(stream=stream))
               for a, b in zip(ours, theirs))
    print(f"{variant}: {experts} experts, dim {dim}, top {top_k}: outputs bit for bit {same}", flush=True)
    for _ in range(LAUNCHES):
        run(ours)
    stream.synchronize()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
