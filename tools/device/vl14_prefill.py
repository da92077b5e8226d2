"""A Qwen3-VL image prompt's prefill by part, in this process on cuda (issue 18: call 2's deep cycle
spent 973.5 ms in the prefill of a 1024 px image at 48 x 8 a3b). The prompt is the service's shape: a
few text tokens, the image's (PX / 32)^2 tokens, a few more, fed in steps of STEP tokens (the broker's
max_step_tokens less the decode rows) from slot 0. Three variants of the same steps, timed warm:
``text`` (plain tokens: the text path), ``mrope`` (+ M-RoPE positions), ``full`` (+ the image's
embeddings and its DeepStack rows, random: the tower is not run), and ``full1``: ``full`` in one step
(MOEBUS_IMAGE_STEP_TOKENS, common/image_steps.py). Then the ``full`` prefill once under
torch.profiler (its kernels by GPU time against its wall time) and once under cProfile (host time by
function). No expert cache loan here (LocalModel has no step scratch): the service's misses are not in
these figures. Usage: vl14_prefill.py MODEL_DIR [PX] [STEP] [REPEATS]; the tables also go to $OUT."""
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import numpy as np

from moebus.common.qwen3vl_config import load_raw, parse_qwen3_vision_config
from moebus.common.qwen3vl_positions import rope_index
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel

TEXT_BEFORE, TEXT_AFTER = 14, 12  # chat template and question around the image (the bench's prompt)


def image_prompt(vision, px: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(ids, rope positions (T, 3), the image's rows, the grid side in patches) of one square image."""
    grid = px // vision.patch_size
    count = (grid // vision.merge_size) ** 2
    ids = np.concatenate([np.arange(TEXT_BEFORE) + 10, [vision.vision_start_token_id],
                          np.full(count, vision.image_token_id), [vision.vision_end_token_id],
                          np.arange(TEXT_AFTER) + 40]).astype(np.int32)
    positions, _ = rope_index(ids, vision.image_token_id, [(grid, grid)], vision.merge_size)
    return ids, positions, np.flatnonzero(ids == vision.image_token_id).astype(np.int32), grid


def steps(variant: str, ids, positions, rows, embeds, deepstack, step_tokens: int) -> list[StepBatch]:
    """The prompt's steps as the broker sends them (each with its own rows of the image arrays)."""
    out = []
    for lo in range(0, len(ids), step_tokens):
        hi = min(lo + step_tokens, len(ids))
        extra = {}
        if variant in ("mrope", "full"):
            extra["rope_positions"] = positions[lo:hi]
        inside = (rows >= lo) & (rows < hi)
        if variant == "full" and inside.any():
            extra.update(embeds=embeds[inside], embed_rows=rows[inside] - lo, deepstack=deepstack[:, inside],
                         deepstack_rows=rows[inside] - lo)
        out.append(StepBatch(slots=[0], starts=[lo], lengths=[hi - lo], tokens=ids[lo:hi], temperature=[0.0], **extra))
    return out


def prefill(model, batches) -> list[float]:
    """Each step's wall ms (the step returns its sampled token to the host: the device is done)."""
    times = []
    for batch in batches:
        began = time.perf_counter()
        model.step(batch)
        times.append(1e3 * (time.perf_counter() - began))
    return times


def main():
    model_dir = sys.argv[1]
    px = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    step_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 510
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    out_dir = os.environ.get("OUT", "/tmp")
    vision = parse_qwen3_vision_config(load_raw(model_dir), model_dir)
    ids, positions, rows, grid = image_prompt(vision, px)
    began = time.perf_counter()
    model = LocalModel(model_dir, device=os.environ.get("DEVICE", "cuda"), num_slots=1, max_context=len(ids) + 16, kv_dtype="bf16")
    cfg = model.ckpt.config
    print(f"loaded {model_dir} in {time.perf_counter() - began:.1f} s: {cfg.num_layers} layers x {cfg.num_experts} "
          f"experts, top {cfg.top_k}; prompt {len(ids)} tokens ({len(rows)} image, grid {grid}), steps of {step_tokens}")
    rng = np.random.default_rng(0)
    hidden = cfg.hidden_size
    embeds = rng.standard_normal((len(rows), hidden), dtype=np.float32) * 0.02
    deepstack = rng.standard_normal((len(vision.deepstack_layers), len(rows), hidden), dtype=np.float32) * 0.02
    variants = {v: steps(v, ids, positions, rows, embeds, deepstack, step_tokens) for v in ("text", "mrope", "full")}
    variants["full1"] = steps("full", ids, positions, rows, embeds, deepstack, len(ids))  # in one step
    for name, batches in variants.items():
        began = time.perf_counter()
        prefill(model, batches)  # compiles what is new, first cuBLAS calls of these shapes
        first_s = time.perf_counter() - began
        runs = [prefill(model, batches) for _ in range(repeats)]
        per_step = [statistics.median(r[i] for r in runs) for i in range(len(batches))]
        print(f"{name:5s}: prefill {sum(per_step):7.1f} ms (median of {repeats}; steps "
              f"{' / '.join(f'{t:.1f}' for t in per_step)}; the first pass {first_s:.2f} s)")
    full = variants["full"]
    last = [model.step(b) for b in full][-1], [model.step(b) for b in variants["full1"]][-1]
    print(f"full vs full1 (the prompt in one step): first token {int(last[0].tokens[0])} / {int(last[1].tokens[0])}, "
          f"its logprob {float(last[0].logprobs[0]):.5f} / {float(last[1].logprobs[0]):.5f}")
    try:
        import torch  # noqa: F401
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            wall = sum(prefill(model, full))
        events = prof.key_averages()
        gpu_ms = sum(e.self_device_time_total for e in events) / 1e3
        table = events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70)
        with open(os.path.join(out_dir, "prefill_kernels.txt"), "w") as f:
            f.write(f"full prefill: wall {wall:.1f} ms, GPU kernels {gpu_ms:.1f} ms\n{table}\n")
        print(f"full under the profiler: wall {wall:.1f} ms, GPU kernels {gpu_ms:.1f} ms; the top kernels (ms, calls):")
        top = sorted(events, key=lambda e: -e.self_device_time_total)[:8]
        for e in top:
            print(f"  {e.self_device_time_total / 1e3:7.1f} {e.count:6d}  {e.key[:80]}")
    except Exception as e:  # noqa: BLE001 - the kernel table is optional
        print(f"no kernel table ({type(e).__name__}: {e})")
    profile_ = cProfile.Profile()
    profile_.enable()
    wall = sum(prefill(model, full))
    profile_.disable()
    text = io.StringIO()
    pstats.Stats(profile_, stream=text).sort_stats("tottime").print_stats(30)
    with open(os.path.join(out_dir, "prefill_host.txt"), "w") as f:
        f.write(f"full prefill under cProfile: wall {wall:.1f} ms\n{text.getvalue()}")
    stats = pstats.Stats(profile_).stats
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:8]
    print(f"full under cProfile: wall {wall:.1f} ms; host time by function (ms self, calls):")
    for (path, line, name), (_, calls, tottime, _, _) in top:
        print(f"  {1e3 * tottime:7.1f} {calls:6d}  {os.path.basename(path)}:{line} {name}"[:100])


if __name__ == "__main__":
    main()
