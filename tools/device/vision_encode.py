"""Warm encode of one image by the vision tower on cuda, tensor cores on and off (same process,
same weights), and how far apart the two outputs are. Usage: vision_encode.py MODEL_DIR"""
import statistics
import sys
import time

import numpy as np

from moebus.workers.local import LocalModel

model = LocalModel(sys.argv[1], device="cuda", num_slots=1, max_context=64)
vision = model.vision
cfg = vision.cfg
pixels = np.random.default_rng(0).standard_normal((1, cfg.num_channels, cfg.image_size, cfg.image_size)).astype(np.float32)
tensor_cores, outputs = model.backend.tensor_cores, {}
for name, tc in (("tensor cores", tensor_cores), ("gemv/tiled kernels", None)):
    model.backend.tensor_cores = tc
    outputs[name] = vision.encode(pixels)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        vision.encode(pixels)
        times.append(time.perf_counter() - start)
    print(f"{cfg.tower} {cfg.image_size}px, {len(vision.layers)} layers, hidden {cfg.hidden_size}: warm encode "
          f"{statistics.median(times) * 1e3:.1f} ms median of 5 ({name})")
a, b = outputs.values()
print(f"max |difference| of the two encodings {np.abs(a - b).max():.2e} (max |value| {np.abs(b).max():.2f})")
