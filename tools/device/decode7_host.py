"""Host work of a decode step outside the kernels, piece by piece (median us of many calls), on a
model of the given depth and experts (its widths do not matter here: the cpu backend, nothing runs
on a GPU): the step's batch, the stage's checks and inputs, and the expert cache's ``observe`` of the
step's routing choices (expert_ids, L x T x top-8), which every routed step runs. Usage:
decode7_host.py MODEL_DIR [BATCH...]"""
import statistics
import sys
import time

import numpy as np

from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel


def median_us(fn, calls: int = 400) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    model_dir, batches = sys.argv[1], [int(b) for b in sys.argv[2:]] or [1, 8]
    model = LocalModel(model_dir, device="cpu", num_slots=max(batches), max_context=256)
    stage, cfg = model.stages[0], model.ckpt.config
    rng = np.random.default_rng(0)
    for batch in batches:
        def make():
            return StepBatch(slots=range(batch), starts=[40] * batch, lengths=[1] * batch, tokens=[5] * batch)
        step = make()
        ids = np.stack([np.stack([rng.permutation(cfg.num_experts)[:8] for _ in range(batch)])
                        for _ in range(cfg.num_layers)]).astype(np.int32)
        figures = {"StepBatch": median_us(make), "check": median_us(lambda: stage.check(step)),
                   "host inputs": median_us(lambda: stage._host_inputs(step, None)),
                   "experts.observe": median_us(lambda: stage.experts.observe(ids), 200)}
        print(f"batch {batch}, {cfg.num_layers} layers x {cfg.num_experts} experts: "
              + ", ".join(f"{k} {v:.1f} us" for k, v in figures.items()), flush=True)


if __name__ == "__main__":
    main()
