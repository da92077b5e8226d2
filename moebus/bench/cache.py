"""``moebus bench cache``: routing traces replayed through the expert cache's decode path (observe:
hits, misses, admissions) for each policy and cache fraction; prints hit rates. Pure CPU.

Traces are (steps, MoE layers, T, A) expert ids:
- ``synthetic``: per sequence and layer, each pick repeats one of the previous token's experts with
  probability ``--repeat`` (0.28), else one from 2..8 tokens back with ``--recent`` (0.22), else a
  draw from a skewed per-layer popularity (which lands on recent experts too). The defaults give the
  reuse reported for Qwen3-30B-A3B (~45% of picks repeat at the next token, ~80% within 8); the
  reuse actually realised is printed beside the hit rates.
- ``recorded``: the choices of a real decode run of ``--model`` (the demo model by default) on cpu.
- ``streams``: the same, but the text streams of ``bench vision-cycle`` (their prompts, greedy), one a
  batch row: the trace that run's decode steps read (twenty-eighth session: replayed at 0.9 through
  the 8 × 128 A3B LLaVA's 675 slots with ``--landing ahead``, 15.5 misses and 19.3 experts a step;
  the H200's logs of that cycle, 15.5 and 20.4).

Policies: ``freq`` (default; ``freq:D`` with D as its decay a step, ``MOEBUS_CACHE_DECAY`` otherwise),
``lru`` (both with the cache's admission cap per step) and ``lru-all`` (LRU admitting every miss at
once, as the cache did before misses could be read in place); ``min`` is no policy but the bound:
the fewest misses any cache could have, knowing every later step (cache_bound.py).

``--slots N`` sizes the cache in slots (instead of ``--fractions``), ``--shrink-at S --shrink-to M``
makes it M slots from step S (an image's hand-back: the cache keeps its hottest, as a VRAM reserve
does), and the figures after S are printed apart. ``--landing ahead`` lands admissions two steps
later, as on a GPU where each step is launched while the one before runs (workers/overlap.py: the
copies start after the step in flight); ``now`` (default) lands them at once, as on cpu.

``--step-model MS,MS,MS`` models each step's ms from its misses and admissions (a fixed part, each miss
read in place, each admission copied in: fitted to the GPU worker's step lines, tools/device/resid41.py)
and prints the routing's own tail, the largest step of ``--window`` steps (256: a cold image's start)
over the median: what ``bench vision-cycle``'s gap ratio would be with no machine beside the routing
(thirty-sixth session: 1.65-1.91 at 753 slots, 1.32-1.44 at 298: a step that reads more experts over
PCIe varies less for its size)."""
from __future__ import annotations

import argparse
import json
import mmap
import os

import numpy as np

from moebus.bench.cache_bound import min_misses
from moebus.cuda.memory.arena import HostArena
from moebus.common.errors import ConfigError
from moebus.workers.eviction import FreqPolicy, cache_decay_from_env
from moebus.workers.expert_cache import ExpertCache

# the bytes do not matter here: a page a slot keeps the arena small, and a shrink can give back any count
BLOB_ELEMS = mmap.PAGESIZE // 2
# --window: about the decode steps a cold image's start holds until encoded (bench vision-cycle's --control-tokens)
WINDOW_STEPS = 256


class TraceStore:
    """A host store of placeholder blobs, keyed as HostStore keys (layer row * E + expert)."""

    def __init__(self, num_layers: int, num_experts: int):
        self.num_experts = num_experts
        self.layers = list(range(num_layers))
        self.dtype = np.dtype(np.uint16)
        self.blob_bytes = BLOB_ELEMS * 2
        self.blobs = np.zeros((num_layers * num_experts, BLOB_ELEMS), np.uint16)

    def key(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + int(expert)

    def blob(self, key: int) -> np.ndarray:
        return self.blobs[key]


def synthetic_trace(steps: int, layers: int, experts: int, batch: int, top_k: int, repeat: float, recent: float,
                    seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    popularity = rng.dirichlet(np.full(experts, 0.3), size=layers)  # skewed, as trained routers are
    trace = np.empty((steps, layers, batch, top_k), np.int32)
    for step in range(steps):
        for layer in range(layers):
            for seq in range(batch):
                trace[step, layer, seq] = _picks(rng, trace[max(0, step - 8):step, layer, seq], popularity[layer],
                                                 top_k, repeat, recent)
    return trace


def _picks(rng, history: np.ndarray, popularity: np.ndarray, top_k: int, repeat: float, recent: float):
    chosen: list[int] = []
    previous = history[-1].tolist() if len(history) else []
    older = history[:-1].reshape(-1).tolist() if len(history) > 1 else []
    while len(chosen) < top_k:
        r = rng.random()
        pool = previous if r < repeat else older if r < repeat + recent else None
        pool = [e for e in pool if e not in chosen] if pool else None
        e = int(rng.choice(pool)) if pool else int(rng.choice(len(popularity), p=popularity))
        if e not in chosen:
            chosen.append(e)
    return chosen


def reuse(trace: np.ndarray) -> tuple[float, float]:
    """(share of picks also chosen by the previous token, share chosen within the 8 before)."""
    steps = trace.shape[0]
    next_hits = within = total = 0
    for step in range(1, steps):
        now = trace[step]
        prev = trace[step - 1]
        window = trace[max(0, step - 8):step]
        for layer in range(now.shape[0]):
            for seq in range(now.shape[1]):
                picks = now[layer, seq]
                next_hits += np.isin(picks, prev[layer, seq]).sum()
                within += np.isin(picks, window[:, layer, seq]).sum()
                total += len(picks)
    return next_hits / max(total, 1), within / max(total, 1)


def streams_trace(model_dir: str, steps: int, batch: int) -> np.ndarray:
    """The routing of ``batch`` greedy text streams with bench vision-cycle's prompts, decoding together."""
    from moebus.bench.vision_gaps import stream_prompt
    from moebus.workers.batch import StepBatch
    from moebus.workers.local import LocalModel

    prompts = [stream_prompt(i) for i in range(batch)]
    model = LocalModel(model_dir, device="cpu", num_slots=batch, max_context=len(prompts[0]) + steps + 8)
    cache = model.stages[0].experts
    greedy = {"temperature": [0.0] * batch, "u": np.zeros(batch)}
    out = model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[len(p) for p in prompts],
                               tokens=[t for p in prompts for t in p], **greedy))
    cache.trace = []  # decode steps only
    for i in range(steps):
        out = model.step(StepBatch(slots=range(batch), starts=[len(prompts[0]) + i] * batch, lengths=[1] * batch,
                                   tokens=[int(t) for t in out.tokens], **greedy))
    return np.stack(cache.trace)


def recorded_trace(model_dir: str, steps: int, batch: int) -> np.ndarray:
    from moebus.workers.batch import StepBatch
    from moebus.workers.local import LocalModel

    model = LocalModel(model_dir, device="cpu", num_slots=batch, max_context=steps + 40)
    cache = model.stages[0].experts
    prompt = [(7 * i + 3) % 200 + 10 for i in range(16)]
    model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[16] * batch, tokens=prompt * batch))
    cache.trace = []  # decode steps only
    last = [prompt[-1] + s for s in range(batch)]
    for i in range(steps):
        out = model.step(StepBatch(slots=range(batch), starts=[16 + i] * batch, lengths=[1] * batch, tokens=last,
                                   temperature=[0.8] * batch, u=np.random.default_rng(i).random(batch)))
        last = [int(t) for t in out.tokens]
    return np.stack(cache.trace)


class LandingAhead:
    """The copier of a decode with launch-ahead, on the host: the admissions of step t's observe are
    copied after step t+1 (in flight then) and land at step t+2's observe; step t+3 was launched before
    that, so step t+4 is the first to read them (``replay`` gives each step the table as it was before
    the observe of the step before it, as workers/overlap.py launches it)."""

    fences = False

    def __init__(self, arena):
        self.arena = arena
        self.age: int | None = None  # steps since the copies in flight started; None: none in flight

    def copy(self, slot: int, blob, after=None) -> bool:
        self.arena.write(slot, blob)
        self.age = 0
        return False

    def step(self) -> None:
        if self.age is not None:
            self.age += 1

    def is_done(self) -> bool:
        return self.age is None or self.age >= 2

    def wait(self) -> None:
        self.age = None

    sync = wait

    def mark(self) -> None:
        pass

    def move(self, src: int, dst: int) -> None:
        self.arena.array[dst] = self.arena.array[src]


def policy_of(spec: str, num_keys: int):
    """``freq``, ``freq:D`` (D: the decay a step), ``lru`` or ``lru-all`` -> (policy, uncapped)."""
    name, _, decay = spec.partition(":")
    if name == "freq" and decay:
        return FreqPolicy(num_keys, decay=float(decay)), False
    if name == "lru-all":
        return "lru", True
    return name, False


def replay(trace: np.ndarray, num_experts: int, fraction: float | None, policy: str, slots: int | None = None,
           shrink_at: int | None = None, shrink_to: int | None = None, landing: str = "now",
           step_model: tuple[float, float, float] | None = None, window: int = WINDOW_STEPS) -> dict:
    """Replay ``trace`` through a cache of ``slots`` (or ``fraction`` of the experts); hit rate and experts
    over PCIe a step after the first 10% of the steps (before ``shrink_at`` where one is given), and with
    a shrink the same from it on, the slowest 10% of those steps' experts (``after_p90``) too. With a
    ``step_model`` the routing's own tail as well (``tail_ratios``)."""
    per_step = replay_steps(trace, num_experts, fraction, policy, slots, shrink_at, shrink_to, landing)
    warmup = len(trace) // 10
    out = _summary(per_step, warmup, shrink_at)
    if step_model is not None:
        out.update(tail_ratios(per_step, step_model, window, warmup, shrink_at))
    return out


def replay_steps(trace: np.ndarray, num_experts: int, fraction: float | None, policy: str, slots: int | None = None,
                 shrink_at: int | None = None, shrink_to: int | None = None, landing: str = "now") -> np.ndarray:
    """(steps, 3): each step's hits, misses and experts over PCIe (misses read in place plus admissions)."""
    layers = trace.shape[1]
    store = TraceStore(layers, num_experts)
    slots = slots or max(trace.shape[3], int(layers * num_experts * fraction))
    if policy == "min":  # the offline bound: its misses are all it moves (cache_bound.py)
        counts = min_misses(trace, num_experts, slots, shrink_at, shrink_to)
        return np.column_stack([counts, counts[:, 1]])
    # one segment a slot (a page each, so a shrink can give any count back)
    arena = HostArena(store.blob_bytes, store.dtype, [store.blob_bytes] * slots)
    arena.grow()
    chosen_policy, uncapped = policy_of(policy, layers * num_experts)
    copier = LandingAhead(arena) if landing == "ahead" else None
    cache = ExpertCache(store, arena, copier=copier, policy=chosen_policy,
                        max_admissions=slots if uncapped else None)
    cache.preload()
    per_step = np.zeros((len(trace), 3), np.int64)  # hits, misses, experts over PCIe
    launched = None  # landing ahead: the table the next step was launched with (before this step's observe)
    for step, chosen in enumerate(trace):
        if step == shrink_at and shrink_to is not None and shrink_to < cache.num_slots:
            # a VRAM request runs between steps, with none in flight: the next step reads the table after it
            cache._shrink_for((cache.num_slots - shrink_to) * store.blob_bytes)
            launched = None
        read = launched
        if copier is not None:
            copier.step()
            launched = cache.placement.copy()  # step + 1 is launched now, before this step's outputs are read
        before = cache.hits, cache.misses, cache.h2d_bytes // store.blob_bytes
        cache.observe(chosen, read=read)
        per_step[step] = np.subtract((cache.hits, cache.misses, cache.h2d_bytes // store.blob_bytes), before)
    return per_step


def step_ms(per_step: np.ndarray, model: tuple[float, float, float]) -> np.ndarray:
    """Each step's modelled ms: a fixed part, plus each miss read in place, plus each admission copied in."""
    fixed, per_miss, per_admission = model
    return fixed + per_miss * per_step[:, 1] + per_admission * (per_step[:, 2] - per_step[:, 1])


def tail_ratios(per_step: np.ndarray, model: tuple[float, float, float], window: int, warmup: int,
                shrink_at: int | None) -> dict:
    """The routing's own tail, as ``bench vision-cycle`` measures a cold image's gaps: the largest modelled
    step of a ``window`` of steps over the median of every step after the warm-up. Without a shrink, over
    windows a quarter-window apart (``tail_min`` / ``tail_median`` / ``tail_max``); with one, the window from
    ``shrink_at`` on (``tail_after_shrink``: the steps an image's cold start holds, at the smaller cache)."""
    ms = step_ms(per_step, model)[warmup:]
    median = float(np.median(ms))
    out = {"step_ms_median": median}
    if shrink_at is not None:
        start = max(shrink_at - warmup, 0)
        out["tail_after_shrink"] = float(ms[start:start + window].max()) / median
        return out
    starts = range(0, max(len(ms) - window, 0) + 1, max(window // 4, 1))
    ratios = [float(ms[i:i + window].max()) / median for i in starts]
    out.update(tail_min=min(ratios), tail_median=float(np.median(ratios)), tail_max=max(ratios))
    return out


def _summary(per_step: np.ndarray, warmup: int, shrink_at: int | None) -> dict:
    """(steps, 3) hits, misses, experts over PCIe -> the figures ``replay`` gives."""
    end = shrink_at if shrink_at is not None else len(per_step)
    out = _figures(per_step[warmup:end])
    if shrink_at is not None:
        after = per_step[shrink_at:]
        out.update({f"after_{k}": v for k, v in _figures(after).items()},
                   after_p90=float(np.percentile(after[:, 2], 90)) if len(after) else 0.0)
    return out


def _figures(rows: np.ndarray) -> dict:
    lookups = max(int(rows[:, 0].sum() + rows[:, 1].sum()), 1)
    return {"hit_rate": float(rows[:, 0].sum()) / lookups,
            "h2d_experts_per_step": float(rows[:, 2].mean()) if len(rows) else 0.0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moebus bench cache")
    p.add_argument("--trace", default="synthetic,recorded", help="synthetic, recorded, streams (comma list)")
    p.add_argument("--model", help="model for the recorded and streams traces (default: the embedded demo model)")
    p.add_argument("--trace-file", help="recorded / streams: read the trace from this .npy file where it exists, "
                                        "else record it and write it there (an A3B-sized model takes ~0.7 s a step)")
    p.add_argument("--steps", type=_count(1), default=200)
    p.add_argument("--batch", default="1,8", help="sequences a step (streams: text streams)")
    p.add_argument("--layers", type=int, default=12, help="synthetic: MoE layers")
    p.add_argument("--experts", type=int, default=128, help="synthetic: experts per layer")
    p.add_argument("--top-k", type=int, default=8, help="synthetic: experts per token")
    p.add_argument("--repeat", type=float, default=0.28)
    p.add_argument("--recent", type=float, default=0.22)
    p.add_argument("--fractions", default="0.1,0.25,0.5")
    p.add_argument("--slots", type=_count(1), help="the cache's slots (in place of --fractions)")
    p.add_argument("--shrink-at", type=_count(0), help="the step from which the cache holds --shrink-to slots")
    p.add_argument("--shrink-to", type=_count(1), help="slots from --shrink-at on (an image's hand-back)")
    p.add_argument("--landing", choices=("now", "ahead"), default="now",
                   help="admissions land at once (cpu) or two steps later (a GPU launching each step ahead)")
    p.add_argument("--policies", default="freq,lru,lru-all",
                   help="freq, freq:DECAY, lru, lru-all, min (the offline bound; comma list)")
    p.add_argument("--step-model", type=_step_model, metavar="MS,MS,MS",
                   help="each step's ms as a fixed part, per miss read in place, per admission copied in (the "
                        "H100's 8 x 128 A3B: 1.39,0.165,0.22): print the routing's own tail, the largest step of a "
                        "--window over the median, as bench vision-cycle's gap ratios")
    p.add_argument("--window", type=_count(1), default=WINDOW_STEPS,
                   help=f"steps a window for --step-model (default {WINDOW_STEPS}: a cold image's start)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if (args.shrink_at is None) != (args.shrink_to is None):
        p.error("--shrink-at and --shrink-to go together")
    sizes = [None] if args.slots else [float(f) for f in args.fractions.split(",")]
    policies = args.policies.split(",")
    for pol in policies:
        name, _, decay = pol.partition(":")
        if name not in ("freq", "lru", "lru-all", "min") or (decay and (name != "freq" or not _decay_ok(decay))):
            p.error(f"--policies: {pol!r} is not freq, freq:DECAY (0 < DECAY <= 1), lru, lru-all or min")
    shrink = {"shrink_at": args.shrink_at, "shrink_to": args.shrink_to, "landing": args.landing}
    tail = {"step_model": args.step_model, "window": args.window}
    for kind in args.trace.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            trace, experts = _trace(kind, args, batch)
            if args.slots and args.slots > trace.shape[1] * experts:
                p.error(f"--slots {args.slots}: the trace has {trace.shape[1]} layers x {experts} experts")
            if args.shrink_at is not None and args.shrink_at >= trace.shape[0]:
                p.error(f"--shrink-at {args.shrink_at}: the trace has {trace.shape[0]} steps")
            next_share, window_share = reuse(trace)
            print(f"== {kind} trace: {trace.shape[0]} steps, {trace.shape[1]} layers x {experts} experts, batch "
                  f"{batch}, top-{trace.shape[3]}; picks repeating at the next token {next_share:.2f}, "
                  f"within 8 {window_share:.2f}; admissions landing {args.landing}")
            size_name = "slots" if args.slots else "fraction"
            print(f"{size_name:>8}  " + "  ".join(f"{pol:>16}" for pol in policies)
                  + ("" if args.shrink_at is None else f"   (then {args.shrink_to} slots from step {args.shrink_at}: "
                                                        f"hit rate, experts a step, the slowest 10%'s)"))
            for fraction in sizes:
                rows = {pol: replay(trace, experts, fraction, pol, slots=args.slots, **shrink, **tail)
                        for pol in policies}
                line = f"{args.slots or fraction:>8}  " + "  ".join(
                    f"{r['hit_rate']:>7.3f} ({r['h2d_experts_per_step']:>5.1f}/st)" for r in rows.values())
                if args.shrink_at is not None:
                    line += "   then " + "  ".join(f"{r['after_hit_rate']:.3f} ({r['after_h2d_experts_per_step']:.1f}/st, "
                                                   f"p90 {r['after_p90']:.0f})" for r in rows.values())
                print(line)
                if args.step_model:
                    print(_tail_line(rows, args))
                if args.json:
                    for pol, r in rows.items():
                        print(json.dumps({"trace": kind, "batch": batch, "fraction": fraction, "slots": args.slots,
                                          "policy": pol, **shrink, **r}))
    if args.step_model:
        print("(the routing's own tail: each step's ms modelled from its misses and admissions, the largest of "
              f"{args.window} steps over the median of every step after the first 10%"
              + ("; windows a quarter apart: median (min-max))" if args.shrink_at is None else
                 f", the window from step {args.shrink_at}: the smaller cache's steps)"))
    print("(hit rate over the steps after the first 10%; in brackets: experts over PCIe per step, misses read in "
          "place plus admissions)")
    return 0


def _count(least: int):
    """An argparse type: a whole number >= ``least``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}")
        return value
    return parse


def _tail_line(rows: dict, args) -> str:
    if args.shrink_at is not None:
        figures = (f"{pol} {r['tail_after_shrink']:.2f}" for pol, r in rows.items())
    else:
        figures = (f"{pol} {r['tail_median']:.2f} ({r['tail_min']:.2f}-{r['tail_max']:.2f})"
                   for pol, r in rows.items())
    return "    tail: " + "  ".join(figures) + "   (step ms median: " + "  ".join(
        f"{r['step_ms_median']:.2f}" for r in rows.values()) + ")"


def _step_model(text: str) -> tuple[float, float, float]:
    """An argparse type: three ms, none negative, the per-miss one above 0."""
    try:
        model = tuple(float(x) for x in text.split(","))
    except ValueError:
        model = ()
    if len(model) != 3 or min(model) < 0 or model[1] <= 0 or not all(np.isfinite(model)):
        raise argparse.ArgumentTypeError(f"expected three ms, a fixed part, per miss and per admission "
                                         f"(e.g. 1.39,0.165,0.22), got {text!r}")
    return model


def _decay_ok(text: str) -> bool:
    """Is ``text`` a decay the policy takes (the setting's own check: eviction.cache_decay_from_env)?"""
    try:
        cache_decay_from_env({"MOEBUS_CACHE_DECAY": text})
    except ConfigError:
        return False
    return True


def _trace(kind: str, args, batch: int) -> tuple[np.ndarray, int]:
    if kind == "synthetic":
        return synthetic_trace(args.steps, args.layers, args.experts, batch, args.top_k, args.repeat,
                               args.recent), args.experts
    if kind in ("recorded", "streams"):
        from moebus.common.checkpoint import Checkpoint
        from moebus.common.demo_model import demo_model_dir

        model_dir = args.model or str(demo_model_dir())
        experts = Checkpoint(model_dir).config.num_experts
        if args.trace_file and os.path.exists(args.trace_file):
            try:
                trace = np.load(args.trace_file)  # (no pickles: allow_pickle stays off)
            except (OSError, ValueError) as e:
                raise SystemExit(f"{args.trace_file}: not a trace this command wrote ({e})") from None
            if trace.ndim != 4 or trace.shape[2] != batch:
                raise SystemExit(f"{args.trace_file}: a trace of shape {trace.shape}, not (steps, layers, {batch}, top-k)")
            return trace, experts
        record = streams_trace if kind == "streams" else recorded_trace
        trace = record(model_dir, args.steps, batch)
        if args.trace_file:
            np.save(args.trace_file, trace)
        return trace, experts
    raise ValueError(f"unknown trace {kind!r}")
