"""On the GPU, one process, one load of MODEL (48 x 32 A3B-shaped bf16) at a 25% cache, twelfth session
(issue 15: a 25% cache at >= 0.90 / 0.85 of the PCIe bound of its misses at batch 1 / 8):

(1) link: the raw H2D rate from the host store's own (mapped, pinned) buffers, over rows spread across
    the first third of the store (what a 16-layer store spans) and across all of it (48 layers): the
    copy engine (one expert a cuMemcpyHtoDAsync) and the prefetch's copy kernel (mapped reads), CUDA
    events; and where the store's pages are (/proc/self/numa_maps, smaps: NUMA node, page size);
(2) check (CHECK=1): graph + the first CHECKED variants with a flag (``after``, ``logits``), or those
    CHECK_VARIANTS lists, == graph without the prefetch, same tokens and bit-identical logprobs at batch 1 and 8;
(3) variants: bench decode's own figures (``_in_process`` + ``_bounds``) per SLOTS:RANKS[:flags], off[:flags]
    or ``default`` (the tree's own prefetch; make() lists the flags; the timelines run after the first
    TIMELINES_AFTER of them);
(4) timeline (torch.profiler's CUPTI trace of replayed steps) per PROFILED variant (``V@B``: batch B
    only; else every batch): the step's GPU span, the time some kernel reading the link runs (the
    expert GEMVs' mapped reads, the prefetch's copy kernel, admissions on the copy engine), the time
    none does, the bytes the steps moved over that time (the link's rate while read), the prefetch's
    copies alone vs beside expert kernels, and how long the expert kernels wait after the compute
    stream's last kernel (the join on the copies, and launch latency).
Usage: miss12_check.py MODEL [TOKENS] [VARIANTS] [PROFILED]; CHECK_BUDGET seconds in all."""
import os
import sys
import time

import numpy as np

from moebus.bench.decode import _bounds, _in_process
from moebus.workers.local import LocalModel
from moebus.cuda.kernels import prefetch as prefetch_kernels
from moebus.workers import prefetch as prefetch_module
from moebus.workers.prefetch import DEFAULT_SLOTS_PER_LAYER, PREDICTED_PER_TOKEN, Prefetch
from decode_tokens import decode_tokens  # noqa: E402 - beside this script
from miss_timeline import analyse  # noqa: E402 - beside this script

model_dir, tokens = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 32
variants = [v.split(":") for v in (sys.argv[3] if len(sys.argv) > 3 else "off,2:2").split(",") if v]
profiled = [v for v in (sys.argv[4] if len(sys.argv) > 4 else "").split(",") if v]
BATCHES = [int(b) for b in os.environ.get("BATCHES", "1,8").split(",") if b]
SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
deadline = time.time() + float(os.environ.get("CHECK_BUDGET", "1e9"))
# ``default``: the tree's own prefetch (slots, ranks, flags as the modules set them), the others given
variants = [[str(DEFAULT_SLOTS_PER_LAYER), str(PREDICTED_PER_TOKEN), "default"] if v == ["default"] else v
            for v in variants]
DEFAULT_FLAGS = (prefetch_module.PLAN_FROM_LOGITS, prefetch_module.COPY_AFTER_EXPERTS)
slots = max([int(v[0]) for v in variants if v[0] != "off"] + [2])  # the banks' size at load: the same cache for all
prompt = [(7 * i + 3) % 200 + 10 for i in range(int(os.environ.get("PROMPT_TOKENS", "32")))]
t0 = time.perf_counter()
model = LocalModel(model_dir, device="cuda", num_slots=8, max_context=len(prompt) + tokens + 40, cache_fraction=0.25,
                   prefetch_slots=slots, kv_dtype="bf16")
stage, cfg = model.stages[0], model.ckpt.config
cache = stage.experts
if SIM:  # a dry run of this script: the simulator has no memory info
    cache.arena.memory_info = lambda: (0, 0)
print(f"loaded in {time.perf_counter() - t0:.1f}s: {cfg.num_layers} x {cfg.num_experts}, {cache.num_slots} slots, "
      f"{cache.num_reserved} banks, store {cache.store.total_bytes / 1e9:.2f} GB, graphs {stage.use_graphs}", flush=True)


def store_pages() -> None:
    """The VMA holding the store: its page sizes (smaps) and NUMA nodes (numa_maps)."""
    address = cache.store.blobs.ctypes.data
    try:
        smaps = open("/proc/self/smaps").read().splitlines()
        numa = open("/proc/self/numa_maps").read().splitlines()
    except OSError as e:
        print(f"no /proc/self maps: {e}")
        return
    for n, line in enumerate(smaps):
        head = line.split()[0]
        if "-" not in head or head.endswith(":"):
            continue
        lo, hi = (int(x, 16) for x in head.split("-"))
        if lo <= address < hi:
            fields = {ln.split(":")[0]: ln.split(":")[1].strip() for ln in smaps[n + 1:n + 30] if ":" in ln}
            print(f"smaps: {head} ({(hi - lo) / 1e9:.2f} GB) {line.split()[-1][:40]} "
                  + " ".join(f"{k}={fields.get(k)}" for k in ("Rss", "AnonHugePages", "KernelPageSize", "MMUPageSize",
                                                               "Locked", "THPeligible")))
            print("numa_maps:", next((ln[:300] for ln in numa if int(ln.split()[0], 16) == lo), "(none)"), flush=True)
            return
    print("store's VMA not found in smaps", flush=True)


def link_probe() -> None:
    """GB/s from the store's rows to the arena: copy engine and mapped reads, 16-layer span vs all."""
    from numba import cuda

    from moebus.cuda.kernels import prefetch as kernels

    ops, store, blob = stage.ops, cache.store, cache.store.blob_bytes
    stream = cuda.stream()
    dst = cuda.device_array((8, store.blob_elems), store.dtype)
    for label, span in (("16-layer span", store.num_blobs // 3), ("48-layer span", store.num_blobs)):
        rows = np.linspace(0, span - 1, 8).astype(np.int64)
        for rep in range(2):  # the first warms
            begin, end = cuda.event(), cuda.event()
            begin.record(stream)
            for i, row in enumerate(rows):
                dst[i].copy_to_device(store.blobs[row], stream=stream)
            end.record(stream)
            end.synchronize()
        s = begin.elapsed_time(end) / 1e3
        line = f"link {label}: copy engine 8 x 1 expert {8 * blob / s / 1e9:.1f} GB/s"
        for k in (1, 2, 4):
            keys = ops.persist(rows[:: 8 // k][:k].astype(np.int32))
            kernels.copy_prefetch_cuda(keys, store.device_blobs, cache.array, 0)
            begin, end = cuda.event(), cuda.event()
            begin.record()
            for _ in range(4):
                kernels.copy_prefetch_cuda(keys, store.device_blobs, cache.array, 0)
            end.record()
            end.synchronize()
            s = begin.elapsed_time(end) / 1e3 / 4
            line += f"; mapped reads {k} experts {k * blob / s / 1e9:.1f} GB/s"
        for flag in ("b4u16", "b2u32"):  # fewer blocks (fewer SMs held beside the compute), as many bytes in flight
            copy_kernel(flag)
            keys = ops.persist(rows[:2].astype(np.int32))
            kernels.copy_prefetch_cuda(keys, store.device_blobs, cache.array, 0)
            begin, end = cuda.event(), cuda.event()
            begin.record()
            for _ in range(4):
                kernels.copy_prefetch_cuda(keys, store.device_blobs, cache.array, 0)
            end.record()
            end.synchronize()
            line += f"; 2 experts {flag} {2 * blob / (begin.elapsed_time(end) / 4e3) / 1e9:.1f} GB/s"
        copy_kernel(COPY_DEFAULT)
        print(line, flush=True)


MAX_ADMISSIONS = cache.max_admissions  # the cache's own (slots / 16)
COPY_DEFAULT = f"b{prefetch_kernels.COPY_BLOCKS_PER_SLOT}u{prefetch_kernels.COPY_UNROLL}"  # the tree's own


def copy_kernel(flag: str) -> None:
    """``bNuM``: the prefetch's copy kernel at N blocks a slot, M words a thread in flight."""
    prefetch_kernels.COPY_BLOCKS_PER_SLOT, prefetch_kernels.COPY_UNROLL = (int(x) for x in flag[1:].split("u"))


def gemv_probe() -> None:
    """The expert GEMVs (gate|up + down, one token, 8 pairs) with 0-4 of the 8 experts read from the
    host store: the misses' PCIe rate as the kernels get it, (t(m) - t(0)) / m experts; the copy
    kernel gets ~50 GB/s for one expert (link_probe), a layer's kernels read 2-3 (is the rate lower
    with fewer misses in flight?)."""
    from numba import cuda

    from moebus.cuda.kernels import moe_ffn

    store, blob = cache.store, cache.store.blob_bytes
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    x = cuda.to_device(np.full((1, hidden), 0.01, np.float32))
    out, scratch = cuda.device_array((8, hidden), np.float32), cuda.device_array((8, inter), np.float32)
    token, pair_out = cuda.to_device(np.zeros(8, np.int32)), cuda.to_device(np.arange(8, dtype=np.int32))
    rows = np.linspace(0, store.num_blobs - 1, 8).astype(np.int64)
    first = cache.num_reserved  # resident slots past the banks (whatever they hold: only the time counts)
    times = []
    for missed in range(5):
        slots = np.array([-1 - int(rows[j]) if j < missed else first + j for j in range(8)], np.int32)
        pair_slot = cuda.to_device(slots)
        run = lambda: moe_ffn.expert_ffn_cuda(x, token, pair_slot, pair_out, cache.array, hidden, inter, out,  # noqa: E731
                                              scratch, store=store.device_blobs)
        run()
        begin, end = cuda.event(), cuda.event()
        begin.record()
        for _ in range(4):
            run()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 4 * 1e3)  # us
    print("expert GEMVs, 1 token x 8 pairs, m of them from the host: " + ", ".join(
        f"m={m} {t:.0f} us" + (f" ({m * blob / ((t - times[0]) * 1e3):.1f} GB/s)" if m else "")
        for m, t in enumerate(times)), flush=True)


def make(v):
    """(label, prefetch or None) of a variant SLOTS:RANKS[:flags] or off[:flags], flags (while the variant
    runs): ``logits``, top-k and plan in one kernel (workers/prefetch.PLAN_FROM_LOGITS); ``after``, the
    next layer's copies after this layer's expert kernels (workers/prefetch.COPY_AFTER_EXPERTS); ``aN``,
    at most N admissions a step (ExpertCache.max_admissions; else the cache's own); ``bNuM``, the copy
    kernel's blocks a slot and words a thread in flight (copy_kernel)."""
    if v == ["default"]:
        v = [str(DEFAULT_SLOTS_PER_LAYER), str(PREDICTED_PER_TOKEN), "default"]
    prefetch_module.PLAN_FROM_LOGITS, prefetch_module.COPY_AFTER_EXPERTS = (
        DEFAULT_FLAGS if "default" in v else ("logits" in v, "after" in v))
    cache.max_admissions = next((int(f[1:]) for f in v[1:] if f[:1] == "a" and f[1:].isdigit()), MAX_ADMISSIONS)
    copy_kernel(next((f for f in v[1:] if f[:1] == "b" and "u" in f), COPY_DEFAULT))
    if v[0] == "off":
        return ":".join(v), None
    return ":".join(v), Prefetch(int(v[0]), len(cache.store.layers), cfg.num_experts, int(v[1]),
                                 cache.store.blob_bytes)


def use(prefetch) -> None:
    """The prefetch on or off; the captured graphs go (they hold the old kernels)."""
    cache.prefetch = prefetch
    for graph in stage.graphs.values():
        graph.close()
    stage.graphs.clear()


def check() -> bool:
    ok = True
    flagged = [v for v in variants if v[0] != "off" and len(v) > 2] or [v for v in variants if v[0] != "off"]
    flagged = flagged[:int(os.environ.get("CHECKED", "1"))]  # the first CHECKED variants with a flag
    if os.environ.get("CHECK_VARIANTS"):  # or these (``default``: the tree's own)
        flagged = [[str(DEFAULT_SLOTS_PER_LAYER), str(PREDICTED_PER_TOKEN), "default"] if v == "default" else v.split(":")
                   for v in os.environ["CHECK_VARIANTS"].split(",")]
    for batch in BATCHES:
        use(None)
        plain = decode_tokens(model, prompt, batch, 8)[:2]
        for v in flagged:
            label, prefetch = make(v)
            use(prefetch)
            graph = decode_tokens(model, prompt, batch, 8)[:2]
            same, dlp = np.array_equal(graph[0], plain[0]), float(np.abs(graph[1] - plain[1]).max())
            ok &= same and dlp == 0.0 and stage.use_graphs
            print(f"batch {batch}: graph+prefetch {label} vs graph without: same tokens {same}, max |dlogprob| "
                  f"{dlp:.1e}, graphs {stage.use_graphs}", flush=True)
    print("PREFETCH CHECK", "OK" if ok else "FAILED", flush=True)
    return ok


def timeline(label, prefetch, batch, steps=8) -> None:
    from torch.profiler import ProfilerActivity, profile

    from moebus.workers.batch import StepBatch

    use(prefetch)
    decode_tokens(model, prompt, batch, 4)  # captured, warm
    model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[len(prompt)] * batch, tokens=prompt * batch))
    last = [prompt[-1]] * batch
    before = cache.stats()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            out = model.step(StepBatch(slots=range(batch), starts=[len(prompt) + i] * batch, lengths=[1] * batch,
                                       tokens=last))
            last = [int(t) for t in out.tokens]
    moved = cache.stats()["h2d_bytes"] - before["h2d_bytes"]  # misses read, admissions, prefetches (used or not)
    events = [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0]
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in events]
    print(analyse(kernels, moved, steps, f"{label} batch {batch}"), flush=True)


ok = True
if not SIM:
    store_pages()
    link_probe()
    try:
        gemv_probe()
    except Exception as e:  # the rest stands
        print("no GEMV probe:", type(e).__name__, e, flush=True)
if os.environ.get("CHECK", "0") == "1":
    ok = check()
rows = []


def bench(v) -> None:
    label, prefetch = make(v)
    use(prefetch)
    for batch in BATCHES:
        if time.time() > deadline - 12:
            print("(budget: variants cut here)", flush=True)
            return
        r = _in_process(model, prompt, tokens, batch, 2)
        r.update(_bounds(r, cfg, cfg.num_layers, cache.store.blob_bytes, 50.0, 4800.0))
        r["of_bound"] = r["tok_s"] / r["pcie_bound_tok_s"] if r["pcie_bound_tok_s"] else float("nan")
        misses = r["unique_experts_per_step"] * (1 - r["hit_rate"])  # distinct experts read from the host a step
        used = r["prefetch_used_per_step"]
        rows.append((label, r))
        print(f"{label:>10} b{batch}: {r['tok_s']:.1f} tok/s, {r['ms_per_step']:.2f} ms, hit {r['hit_rate']:.3f}, bound "
              f"{r['pcie_bound_tok_s'] or float('nan'):.1f}, OF BOUND {r['of_bound']:.3f}, {r['h2d_gb_s']:.1f} GB/s, "
              f"needed {r['h2d_bytes_per_step'] / 1e6:.0f} MB, experts prefetched {r['prefetched_per_step']:.1f} used "
              f"{used:.1f} (of {misses:.0f} misses: {used / max(misses, 1e-9):.2f}) wasted "
              f"{r['prefetch_wasted_mb_per_step']:.1f} MB", flush=True)


def timelines() -> None:
    try:
        for v in profiled:
            for batch in BATCHES:
                if time.time() > deadline - 10:
                    print("(budget: timelines cut here)", flush=True)
                    return
                if "@" not in v or int(v.split("@")[1]) == batch:
                    timeline(*make(v.split("@")[0].split(":")), batch)
    except Exception as e:  # no torch, or no CUPTI: the rest stands
        print("no timeline:", type(e).__name__, e, flush=True)


# the first TIMELINES_AFTER variants, then the timelines, then the other variants (what the budget allows)
for n, v in enumerate(variants):
    if n == int(os.environ.get("TIMELINES_AFTER", "1")):
        timelines()
    bench(v)
if len(variants) <= int(os.environ.get("TIMELINES_AFTER", "1")):
    timelines()
sys.exit(0 if ok else 1)
