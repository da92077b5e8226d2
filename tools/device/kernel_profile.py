"""GPU time of one long prefill step on cuda by kernel (torch.profiler's CUPTI trace sees numba's
and cuBLAS's kernels alike) beside its wall time. Usage: kernel_profile.py MODEL_DIR TOKENS..."""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel

model_dir, lengths = sys.argv[1], [int(t) for t in sys.argv[2:]]
model = LocalModel(model_dir, device="cuda", num_slots=1, max_context=max(lengths) + 8)
for num_tokens in lengths:
    batch = StepBatch(slots=[0], starts=[0], lengths=[num_tokens],
                      tokens=[(7 * i + 3) % 1000 + 10 for i in range(num_tokens)])
    model.step(batch)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        model.step(batch)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in events) / 1e3
    print(f"== {num_tokens} tokens: wall {wall * 1e3:.1f} ms, GPU kernels {gpu_ms:.1f} ms")
    print(events.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=64))
