"""Where a decode step's GPU time goes, op by op, at the real shapes: the eager path with a CUDA
event pair around every backend op. A spin kernel first holds the stream while Python enqueues the
whole step, so the events time the kernels back to back (not the launch gaps between them).
Usage: op_profile.py MODEL_DIR [BATCH...]"""
import os
import sys
from collections import defaultdict

os.environ["MOEBUS_CUDA_GRAPHS"] = "0"
import numpy as np  # noqa: E402

from moebus.cuda.kernels.compat import cuda, float32  # noqa: E402
from moebus.workers.batch import StepBatch  # noqa: E402
from moebus.workers.local import LocalModel  # noqa: E402

OPS = ["embedding", "rmsnorm", "add_rmsnorm", "combine_add_rmsnorm", "qkv_rope_store", "linear", "add", "rope", "kv_store", "attention",
       "topk_softmax", "route_pairs", "expert_ffn", "combine", "sample"]
model_dir, batches = sys.argv[1], [int(b) for b in sys.argv[2:]] or [1, 8]
model = LocalModel(model_dir, device="cuda", num_slots=max(batches), max_context=128)
ops = model.backend
records = []


def timed(name, fn):
    def wrapper(*args, **kwargs):
        label = name
        if name == "linear":
            label = f"linear {args[1].shape[0]}x{args[1].shape[1]}"
        begin, end = cuda.event(), cuda.event()
        begin.record(ops.stream)
        result = fn(*args, **kwargs)
        end.record(ops.stream)
        records.append((label, begin, end))
        return result
    return wrapper


for name in OPS:
    setattr(ops, name, timed(name, getattr(ops, name)))
begin_step = ops.begin_step
sink = cuda.device_array(1, np.float32)


@cuda.jit
def _busy(out, rounds):
    # one thread on a dependent chain of multiply-adds (~2 ns each): holds the stream for seconds
    acc = float32(1.0)
    for _ in range(rounds):
        acc = acc * float32(1.0000001) + float32(1e-7)
    out[0] = acc


def begin_then_spin():
    begin_step()
    _busy[1, 1, ops.stream](sink, 1_500_000_000)  # ~3 s: longer than Python takes to enqueue a step (~0.6 s)


ops.begin_step = begin_then_spin
prompt = list(range(10, 42))
layers = model.ckpt.config.num_layers
for batch in batches:
    model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[len(prompt)] * batch, tokens=prompt * batch))
    steps, last = 3, [prompt[-1]] * batch
    totals, counts = defaultdict(float), defaultdict(int)
    for i in range(steps + 1):
        records.clear()
        out = model.step(StepBatch(slots=range(batch), starts=[len(prompt) + i] * batch, lengths=[1] * batch,
                                   tokens=last))
        last = [int(t) for t in out.tokens]
        ops.synchronize()
        if i < 1:
            continue  # warm-up
        for label, begin, end in records:
            totals[label] += cuda.event_elapsed_time(begin, end) * 1e3 / steps
            counts[label] += 1
    print(f"== batch {batch}, {layers} layers: GPU us per step by op (eager, events around each op)")
    for label, us in sorted(totals.items(), key=lambda kv: -kv[1]):
        per_call = us * steps / counts[label]
        print(f"{label:<24} {counts[label] // steps:>5} calls/step {us:>9.1f} us/step {per_call:>8.1f} us/call")
    print(f"{'sum':<24} {sum(counts.values()) // steps:>5} calls/step {sum(totals.values()):>9.1f} us/step")
