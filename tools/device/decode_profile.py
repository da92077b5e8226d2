"""GPU time of a captured decode step by kernel (torch.profiler's CUPTI trace sees each kernel node
of a replayed CUDA graph), per step, beside the step's wall time. Usage:
decode_profile.py MODEL_DIR [BATCH...] — greedy decode after a 32-token prompt, 4 warm steps (the
graph is captured on the first), then 16 profiled steps (PROFILE_PLAIN=1: not profiled, for ncu)."""
import os
import re
import sys
import time
from collections import defaultdict

from torch.profiler import ProfilerActivity, profile

from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel

PROMPT = [(7 * i + 3) % 1000 + 10 for i in range(32)]
WARM, STEPS = 4, 16
PLAIN = os.environ.get("PROFILE_PLAIN") == "1"


def short_name(name: str) -> str:
    """The Python function's name out of numba's mangled kernel name (cuBLAS's kept as it is)."""
    parts = re.findall(r"\d+([A-Za-z_][A-Za-z0-9_]*)", name)
    words = [p for p in parts if p not in ("cudapy", "moebus", "cuda", "kernels") and not p.startswith("_3c")]
    return ".".join(words[:2]) if name.startswith("_ZN") and words else name[:60]


def profile_batch(model, batch: int, num_layers: int) -> None:
    model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[len(PROMPT)] * batch, tokens=PROMPT * batch))
    last, pos = [PROMPT[-1]] * batch, len(PROMPT)

    def step():
        nonlocal last, pos
        out = model.step(StepBatch(slots=range(batch), starts=[pos] * batch, lengths=[1] * batch, tokens=last))
        last, pos = [int(t) for t in out.tokens], pos + 1

    for _ in range(WARM):
        step()
    if PLAIN:  # under ncu, which owns the profiling counters
        for _ in range(STEPS):
            step()
        return
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(STEPS):
            step()
        wall_ms = (time.perf_counter() - start) * 1e3 / STEPS
    by_name = defaultdict(lambda: [0, 0.0])
    variants = defaultdict(dict)  # short name -> {mangled name: #n}: qkv, o and lm_head are 3 linear kernels
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            name = short_name(e.name)
            number = variants[name].setdefault(e.name, len(variants[name]) + 1)
            row = by_name[f"{name} #{number}"]
            row[0] += 1
            row[1] += e.device_time_total
    total_us = sum(r[1] for r in by_name.values()) / STEPS
    print(f"== batch {batch}: wall {wall_ms:.3f} ms/step, GPU busy {total_us / 1e3:.3f} ms/step, "
          f"{total_us / num_layers:.1f} us/layer")
    print(f"{'kernel':<52} {'calls/step':>10} {'us/call':>9} {'us/step':>9} {'share':>6}")
    for name, (calls, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        name = name if len(name) <= 52 else name[:46] + "…" + name[name.rindex(" #"):]
        print(f"{name:<52} {calls / STEPS:>10.1f} {us / calls:>9.2f} {us / STEPS:>9.1f} "
              f"{us / STEPS / total_us:>6.1%}")


def main() -> None:
    model_dir, batches = sys.argv[1], [int(b) for b in sys.argv[2:]] or [1, 8]
    model = LocalModel(model_dir, device="cuda", num_slots=max(batches), max_context=256)
    num_layers = model.ckpt.config.num_layers
    for batch in batches:
        profile_batch(model, batch, num_layers)


if __name__ == "__main__":
    main()
