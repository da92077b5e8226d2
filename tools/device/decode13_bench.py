"""One decode setting in a process of its own (thirteenth session: a setting whose graph capture failed
used to leave the stage eager for every later setting of the same process). The setting comes from the
environment (MOEBUS_PDL, MOEBUS_PDL_TRIGGER: kernels/pdl.py) and from KEY=VALUE arguments
("linear.PREFETCH_BEFORE_WAIT=1": a constant of moebus.cuda.kernels, as decode10_sweep's settings).
Batch 1: REPEATS runs of bench decode's own `_in_process` (greedy after a 32-token prompt, median step of
the second of 2 repeats of 64 tokens, launched ahead, all resident), each run's ms and their median;
then each other batch once; the graphs' PDL edge counts; PROFILE_STEPS (env, 0) replayed batch-1 steps
under CUPTI (decode10_sweep.profile_batch: us a call and idle before it, by kernel) into PROFILE_FILE.
THEN (env): further settings of kernel constants only ("KEY=VALUE KEY=VALUE; KEY=VALUE": each group
applied on top of the ones before it), each then timed at batch 1 the same way after the graphs are
recaptured (decode7_bench.drop_graphs), in this process: constants cannot leave the stage eager.
Usage: decode13_bench.py MODEL_DIR NAME REPEATS BATCHES [KEY=VALUE ...]   (BATCHES: "1" or "1,8")"""
import contextlib
import io
import json
import os
import statistics
import sys
import time

from decode7_bench import PROMPT, TOKENS, constant, drop_graphs
from decode8_sweep import print_profile
from decode10_sweep import profile_batch
from moebus.bench.decode import _in_process
from moebus.workers.local import LocalModel


def parse(value: str):
    return json.loads(value) if value not in ("1", "0") else value == "1"


def apply(items) -> None:
    for item in items:
        key, value = item.split("=", 1)
        setattr(*constant(key), parse(value))


def batch_one(model, repeats: int) -> str:
    ms = [_in_process(model, PROMPT, TOKENS, 1, 2)["ms_per_step"] for _ in range(repeats)]
    median = statistics.median(ms)
    return f"b1 {1e3 / median:7.1f} tok/s {median:6.3f} ms (runs {' '.join(f'{m:.3f}' for m in ms)})"


def main() -> None:
    model_dir, name, repeats, batches = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    batches = [int(b) for b in batches.split(",")]
    apply(sys.argv[5:])
    started = time.perf_counter()
    model = LocalModel(model_dir, device="cuda", num_slots=max(batches), max_context=len(PROMPT) + TOKENS + 32,
                       kv_dtype="bf16")
    loaded_s = time.perf_counter() - started
    setting = f"MOEBUS_PDL={os.environ.get('MOEBUS_PDL', '-')} TRIGGER={os.environ.get('MOEBUS_PDL_TRIGGER', '-')} " \
              + " ".join(sys.argv[5:])
    cells = []
    for batch in batches:
        if batch == 1:
            cells.append(batch_one(model, repeats))
            continue
        r = _in_process(model, PROMPT, TOKENS, batch, 2)
        cells.append(f"b{batch} {r['tok_s']:7.1f} tok/s {r['ms_per_step']:6.3f} ms")
    graphs = [g for s in model.stages for g in s.graphs.values()]
    print(f"{name:<26} " + "  ".join(cells) + f"   [{setting.strip()}; load {loaded_s:.0f} s, "
          f"{time.perf_counter() - started - loaded_s:.0f} s]", flush=True)
    edges = [g.pdl for g in graphs if getattr(g, "pdl", None)]
    refused = [e.get("refused") for e in edges if e.get("refused")]
    types = {}  # the graphs' nodes other than kernels, by type (MEM_ALLOC / MEM_FREE: the driver refuses edits)
    for e in edges:
        for kind, count in e.get("types", {}).items():
            types[kind.replace("CU_GRAPH_NODE_TYPE_", "")] = types.get(kind.replace("CU_GRAPH_NODE_TYPE_", ""), 0) + count
    print(f"   {name}: {len(graphs)} graphs, pdl converted {[e['converted'] for e in edges]} of edges "
          f"{[e['edges'] for e in edges]}, other nodes {types}" + (f", refused: {refused[:2]}" if refused else ""),
          flush=True)
    profile(model, name)
    for group in filter(None, (g.split() for g in os.environ.get("THEN", "").split(";"))):
        apply(group)
        drop_graphs(model)
        print(f"{'  then ' + ' '.join(group):<26} {batch_one(model, repeats)}", flush=True)
        edges = [g.pdl for s in model.stages for g in s.graphs.values() if getattr(g, "pdl", None)]
        print(f"   {len([g for s in model.stages for g in s.graphs.values()])} graphs, pdl converted "
              f"{[e['converted'] for e in edges]}", flush=True)
        profile(model, f"{name} then {' '.join(group)}")


def profile(model, name: str) -> None:
    """PROFILE_STEPS replayed batch-1 steps under CUPTI: the whole table into PROFILE_FILE, its top to stdout."""
    steps = int(os.environ.get("PROFILE_STEPS", "0"))
    if not steps:
        return
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            p = profile_batch(model, 1, steps)
            if p is not None:
                print_profile(f"{name}, batch 1", p)
    except Exception as e:  # noqa: BLE001 - a profile that fails leaves the settings after it to run
        text.write(f"-- {name}: profile FAILED {type(e).__name__}: {e}\n")
    with open(os.environ["PROFILE_FILE"], "a") as out:
        out.write(text.getvalue())
    print("\n".join(text.getvalue().splitlines()[:int(os.environ.get("PROFILE_LINES", "24"))]), flush=True)


if __name__ == "__main__":
    main()
