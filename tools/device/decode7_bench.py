"""Decode tok/s of one loaded model under several settings of the kernels' constants, the decode
graphs recaptured for each (bench decode's own timing: greedy after a 32-token prompt, median step
of the second of 2 repeats of 64 tokens, in-process, all resident). Usage:
decode7_bench.py MODEL_DIR BATCHES SETTINGS.json — SETTINGS: a list of [name, {"module.CONSTANT": value}],
each applied on top of the defaults (an empty dict: the defaults)."""
import importlib
import json
import sys
import time

from moebus.bench.decode import _in_process
from moebus.workers.local import LocalModel

PROMPT = [(7 * i + 3) % 200 + 10 for i in range(32)]
TOKENS, REPEATS = 64, 2


def constant(key: str):
    module, name = key.rsplit(".", 1)
    return importlib.import_module(f"moebus.cuda.kernels.{module}"), name


def drop_graphs(model) -> None:
    for stage in model.stages:
        for graph in stage.graphs.values():
            graph.close()
        stage.graphs.clear()


def main() -> None:
    model_dir, batches = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
    with open(sys.argv[3]) as f:
        settings = json.load(f)
    model = LocalModel(model_dir, device="cuda", num_slots=max(batches), max_context=len(PROMPT) + TOKENS + 8,
                       kv_dtype="bf16")
    layers = model.ckpt.config.num_layers
    defaults = {key: getattr(*constant(key)) for _, values in settings for key in values}
    rows = []
    for name, values in settings:
        for key, value in {**defaults, **values}.items():
            setattr(*constant(key), value)
        drop_graphs(model)
        start = time.perf_counter()
        figures = [_in_process(model, PROMPT, TOKENS, batch, REPEATS) for batch in batches]
        line = "  ".join(f"b{r['batch']} {r['tok_s']:7.1f} tok/s {r['ms_per_step']:6.3f} ms "
                         f"{r['ms_per_step'] * 1e3 / layers:5.1f} us/layer" for r in figures)
        rows.append(f"{name:<28} {line}")
        print(f"{rows[-1]}   ({time.perf_counter() - start:.0f} s, {values})", flush=True)
    print("== decode7_bench", model_dir, layers, "layers")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
