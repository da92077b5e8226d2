"""Issue 16, seventeenth session (branch quant17): quant16_bench.py's sweep (per (experts, attention) one load
quantized at load, per setting the decode graphs recaptured, tok/s all resident at batch 1, CUPTI us a kernel, the
greedy ids and log p against the first setting of the same dtypes), without the 25%-MiB runs, with a setting's
"env.NAME" keys set as environment variables (MOEBUS_PDL=0: the kernels' true durations, as fuse16_step.py), and
a summary with the quantized GEMVs' us a call (gate|up, down, q|k|v, o).

    quant17_bench.py MODEL PLAN.json [PROFILE_STEPS]   (quant9_sweep.py's arguments; QUICK=1: a warm-up)
    quant17_bench.py --summary LOG"""
import os
import sys

import decode7_bench
import quant9_sweep
import quant15_bench


class _Environment:
    """getattr / setattr on os.environ (None: unset), for quant9_sweep's setattr(*constant(key), value)."""

    def __getattr__(self, name):
        return os.environ.get(name)

    def __setattr__(self, name, value):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(value)


_ENV = _Environment()


def constant(key: str):
    """decode7_bench.constant, and "env.NAME": the environment variable NAME."""
    return (_ENV, key[4:]) if key.startswith("env.") else decode7_bench.constant(key)


# the quantized GEMVs by their kernel label (quant9_sweep.kernel_table: the first of a name in a layer is v0)
KERNELS = (("gate|up", "moe_quant_round.quant_one_round v0"), ("down", "moe_quant_round.quant_one_round v1"),
           ("q|k|v", "linear_quant_fp8.fp8_dense_one_round v0"), ("o", "linear_quant_fp8.fp8_dense_one_round v1"),
           # on tensor cores (MOEBUS_QUANT_MMA; NVRTC names; q|k|v and o share one name: #0 and #1 in a layer)
           ("gate|up*", "moe_quant_mma_gate_up v0"), ("down*", "moe_quant_mma_down v0"),
           ("q|k|v*", "linear_quant_mma v0 #0"), ("o*", "linear_quant_mma v0 #1"))


def summary(path: str) -> None:
    quant15_bench.summary(path)
    print("== us a call (CUPTI; spans under PDL, true durations with PDL off); every kernel, us a layer")
    for r in quant9_sweep.log_rows(path):
        if r.get("section") != "decode" or not r.get("kernels"):
            continue
        k = r["kernels"]
        found = [f"{name} {k[label][1]:4.1f}" for name, label in KERNELS if label in k]
        if r["experts"] == "bf16" or not found:  # the four longest a layer
            found = [f"{label.split('.')[-1][:12]} {us:4.1f}" for label, (calls, us) in
                     sorted(k.items(), key=lambda kv: -kv[1][0] * kv[1][1])[:4]]
        every = sum(calls * us for calls, us in k.values()) / r["layers"]
        print(f"{r['experts']} {r['setting'][:18]:18} " + " ".join(found) + f" all {every:4.1f}")


def main() -> None:
    if sys.argv[1] == "--summary":
        summary(sys.argv[2])
        return
    import moebus.bench.decode as bench

    bench._in_process = quant15_bench._with_tokens(bench._in_process)
    quant9_sweep.constant = constant
    quant9_sweep.main()


if __name__ == "__main__":
    main()
