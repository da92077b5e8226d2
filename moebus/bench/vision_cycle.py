"""``moebus bench vision-cycle``: the expert cache through one lazy-vision cycle, on the current
device. Resident expert slots summed over GPUs (a) with vision resident (``vision.lazy`` false),
(b) lazy with vision idle, (c) during an image request, (d) ``idle_s`` after it; and the cold image
request's time split: hand-back, start, encode, prefill (to the first token), first token at the
client; then the warm encode. Each row also gives the caches' MiB (from the workers) and, on cuda,
the driver's free VRAM per GPU. (c) is read after the image's answer, or, where the vision worker
stopped before it (a prefill longer than ``idle_s``), as the broker saw the caches at the hand-back's end.
``--gpu-memory-mib N`` gives each GPU a VRAM budget (settings ``gpu_memory_mib``), so a large GPU
shows the situation where not every expert fits.

Text streams decode from before the image until it has answered (bench/vision_gaps.py: each
stream's own gaps, by phase of the cold start, beside the broker's steps). ``--cold-starts 2``
measures a cold start as it recurs after ``idle_s`` (the first pays the processes' first-use costs).
Before their steady window the streams decode ``--control-tokens`` (256) tokens with no image: the
largest gap there, against the same medians, is the text's own tail (a decode whose experts do not all
fit misses more in some steps than others), printed beside the cold start's for comparison.

Expected: (b) == (d) > (a) ≈ (c); and the text streams' largest inter-token gap through the cold
start at most twice their median. ≈ allows, per GPU, one segment's slots either way (the hand-back
releases whole segments) and, below (a), the slots of the MiB that the GPU worker took beside its
cache between (b) and the image (the text streams' first steps: a CUDA graph per batch size with its
own buffers, the step pool's growth). The hand-back frees until the vision worker's MiB are free on
the device, so memory the worker took meanwhile comes out of the cache: (a) is read before any step
ran."""
from __future__ import annotations

import argparse
import io
import json
import logging
import math
import os
import statistics
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from moebus.bench.vision_gaps import (CONTROL_TOKENS, STEADY_TOKENS, WARM_TOKENS, TextStreams, gap_report,
                                      print_gap_report, steady_cache, steady_steps, worst_ratio)
from moebus.common.errors import ConfigError
from moebus.common.settings import Settings, load_settings
from moebus.cuda.memory.arena import segment_bytes_for


MIB = 1 << 20
WATCH_S = 0.02  # row (c)'s watch: the broker's INFO while the cold image runs (no worker is asked; the row holds
# from the hand-back's end, through the vision worker's start, until it stops idle_s after its encode at the earliest)
HANDED_BACK = ("starting", "ready")  # the broker's vision states after the hand-back's last VRAM reply


def _image_png(size: int, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _slots(client) -> list[int]:
    return list(client.vram(query=True)["expert_slots"])


def _row(client) -> dict:
    """Per GPU: expert slots and the caches' MiB (the workers' figures), free MiB within the budget
    and the driver's own free MiB (cuda; None on cpu)."""
    reply = client.vram(query=True)
    gpus = client.info().get("gpus") or []
    return {"slots": list(reply["expert_slots"]), "cache_mib": list(reply["expert_cache_mib"]),
            "free_mib": list(reply["free_mib"]), "device_free_mib": [g.get("device_free_mib") for g in gpus]}


def row_of_info(info: dict) -> dict | None:
    """A row from the broker's INFO alone: each worker's last VRAM reply (slots, cache MiB, free MiB in its
    budget) and its last INFO's driver figure; None where a worker has answered no VRAM request yet."""
    gpus = info.get("gpus") or []
    if not gpus or any("expert_slots" not in g for g in gpus):
        return None
    return {"slots": [int(g["expert_slots"]) for g in gpus],
            "cache_mib": [float(g["expert_cache_mib"]) for g in gpus],
            "free_mib": [float(g["free_mib"]) for g in gpus],
            "device_free_mib": [g.get("device_free_mib") for g in gpus]}


class VisionStartWatch:
    """Row (c) as the caches stand once the cold image's hand-back is done (the vision worker starting or
    ready), read from the broker's INFO every WATCH_S while the request runs, so no worker is asked while
    the text streams' gaps are measured. Where the image's prefill outlasts ``idle_s`` the vision worker stops and
    the caches regrow before the request answers (thirty-sixth session: at a 4096 MiB budget, a 1.4 s
    prefill against ``--idle-s 1``), and a row read after the answer is partly (d)'s."""

    def __init__(self, client):
        self.client = client
        self.row: dict | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="vision-start-watch", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._done.is_set():
            try:
                info = self.client.info()
            except Exception:  # noqa: BLE001 - a broker that does not answer: (c) is read after the answer instead
                return
            if (info.get("vision") or {}).get("state") in HANDED_BACK:
                self.row = row_of_info(info)
                return
            self._done.wait(WATCH_S)


def slots_per_segment(row: dict, segment_mib: float) -> list[int]:
    """How many slots one segment holds on each GPU (the cache's MiB per slot from the workers; 0: the
    segments follow the slot, cuda/memory/arena.segment_bytes_for)."""
    counts = []
    for slots, mib in zip(row["slots"], row["cache_mib"]):
        if not mib or not slots:
            counts.append(1)
            continue
        # (the cache's MiB is what is mapped, a little over its slots: a slot's MiB to two places absorbs that)
        segment = segment_bytes_for(int(segment_mib * MIB), int(round(mib / slots, 2) * MIB)) / MIB
        counts.append(max(1, math.ceil(segment * slots / mib)))
    return counts


def effective_segment_mib(flag: int | None) -> int:
    """The segment size the bench's broker runs with: MOEBUS_SEGMENT_MIB (the settings' own reading) over
    ``--segment-mib`` (the environment wins over a config file: settings.load_settings) over the default."""
    if "MOEBUS_SEGMENT_MIB" in os.environ:
        return load_settings().segment_mib
    return flag if flag is not None else Settings.model_fields["segment_mib"].default


def grown_slots(idle: dict, before: dict) -> list[int]:
    """Per GPU, the slots of the MiB the worker took beside its cache between the rows ``idle`` and
    ``before`` (same cache: what is no longer free went elsewhere), rounded up."""
    out = []
    for slots, mib, cache_before, free_idle, free_before in zip(idle["slots"], idle["cache_mib"], before["cache_mib"],
                                                                 idle["free_mib"], before["free_mib"]):
        taken = max(0.0, free_idle - free_before) if cache_before == mib else 0.0
        out.append(-(-int(taken * slots) // int(mib)) if mib and taken else 0)
    return out


def cycle_ok(resident: list[int], idle: list[int], during: list[int], after: list[int], tolerance: list[int],
             grown: list[int] | None = None) -> bool:
    """(b) == (d) > (a) ≈ (c): per GPU, (c) within ``tolerance`` slots of (a) (one segment's) and, below
    it, ``grown`` slots more (grown_slots: memory the worker took beside its cache before the image)."""
    grown = grown or [0] * len(resident)
    near = all(-t <= a - c <= t + g for a, c, t, g in zip(resident, during, tolerance, grown))
    return idle == after and sum(idle) > max(sum(resident), sum(during)) and near


def _wait(client, condition, timeout_s: float, what: str) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        info = client.info()
        if condition(info):
            return info
        if time.monotonic() > deadline:
            raise TimeoutError(f"vision-cycle: {what} not reached in {timeout_s:.0f} s: {info.get('vision')}")
        time.sleep(0.05)


def _chat(client, image: bytes, max_tokens: int = 2, started: float | None = None) -> float:
    """Seconds to the first token at the client."""
    started = started or time.monotonic()
    first = None
    content = [{"type": "image"}, {"type": "text", "text": "Describe the picture."}]
    for _ in client.chat([{"role": "user", "content": content}], images=[image], max_tokens=max_tokens,
                         temperature=0, ignore_eos=True):
        first = first or time.monotonic()
    return first - started


@contextmanager
def _broker(args, settings: dict):
    """A private broker (and its workers and vision zygote) with these settings; yields its address."""
    from moebus.cli_generate import private_broker

    with tempfile.TemporaryDirectory(prefix="moebus-vision-cycle-") as tmp:
        config = Path(tmp) / "settings.json"
        config.write_text(json.dumps(settings))
        flags = ["--config", str(config), "--device", args.device] + (["--model", args.model] if args.model else [])
        with private_broker(flags, quiet=not args.verbose, timeout_s=args.timeout_s) as address:
            yield address


def _settings(args, lazy: bool) -> dict:
    settings = {"vision": {"lazy": lazy, "idle_s": args.idle_s}}
    if args.emulated_vram_mib:
        settings["emulated_vram_mib"] = args.emulated_vram_mib
    if args.segment_mib is not None:  # (0: two slots a segment)
        settings["segment_mib"] = args.segment_mib
    if args.max_context:
        settings["max_context"] = args.max_context
    if args.gpu_memory_mib:
        settings["gpu_memory_mib"] = args.gpu_memory_mib
    if args.handback_step_mib is not None:  # 0 too: the settings refuse it (main), never a silent default
        settings["vision"]["handback_step_mib"] = args.handback_step_mib
    if args.max_batch is not None:
        settings["max_batch"] = args.max_batch
    if args.mps:
        settings["mps"] = True
    return settings


def _resident(args) -> dict:
    from moebus.client import Client

    with _broker(args, _settings(args, lazy=False)) as address:
        client = Client(address)
        try:
            _wait(client, lambda i: i.get("vision_loaded") == 1, args.timeout_s, "vision resident")
            return _row(client)
        finally:
            client.close()


def _steady_streams(client, args) -> tuple[TextStreams, tuple[float, float], dict, dict | None, tuple | None]:
    """Text streams in their steady state: (the streams, the steady window, the broker's steps in it,
    the caches' traffic per step over the next ~0.5 s, between two INFO replies asked for, the image-free
    window of ``--control-tokens`` before the steady one or None)."""
    # a first round captures every batch size's graph (the image request's decode joins the streams'
    # batch) and fills the cache; then the streams run until stopped, up to what the context allows
    TextStreams(client, args.text_streams + 1, WARM_TOKENS).join()
    max_tokens = args.text_tokens or client.info()["max_context"] - 8
    streams = TextStreams(client, args.text_streams, max_tokens)
    streams.wait_tokens(WARM_TOKENS)
    control = None
    if args.control_tokens:  # the text alone, as long as the cold start's window: the image's comparison
        began = time.monotonic()
        streams.wait_tokens(WARM_TOKENS + args.control_tokens)
        control = (began, time.monotonic())
    start, before = time.monotonic(), client.info()
    streams.wait_tokens(WARM_TOKENS + args.control_tokens + STEADY_TOKENS)
    end, after = time.monotonic(), client.info()
    return streams, (start, end), steady_steps(before, after, end - start), steady_cache(client), control


def _cold_request(client, image: bytes, args) -> tuple[dict, dict, dict, dict]:
    """The first image, with text streams decoding meanwhile until it has answered: (the row just
    before it is sent, the row while vision is loaded, the time split, the text streams' gaps)."""
    streams = None
    if args.text_streams:
        streams, steady, steps, cache, control = _steady_streams(client, args)
    before_image = _row(client)  # what the worker took beside its cache since (b) is not free for the hand-back
    sent = time.monotonic()
    with VisionStartWatch(client) as watch:
        first_s = _chat(client, image, started=sent)
    ended = streams.stop() if streams else None
    vision = client.info()["vision"]
    if vision["state"] == "ready" or watch.row is None:
        during = _row(client)  # the vision worker still loaded: the workers' own figures, after its first encode
    else:  # it stopped before the answer (the image's prefill outlasted idle_s): the caches as the hand-back left them
        during = dict(watch.row, read_at="at the hand-back's end, from the broker's INFO: the vision worker had "
                                         "stopped before the image's answer (the prefill outlasted idle_s)")
    split = dict(vision["last_cold_start"], first_token_s=first_s, vram_mib=vision["vram_mib"],
                 measured_mib=vision.get("measured_mib"))
    gaps = gap_report(streams, steady, sent, split, ended, steps, cache, control) if streams else {}
    return before_image, during, split, gaps


def _warm_encode_s(client, args) -> tuple[float | None, int]:
    """(the median encode of ``args.repeats`` images after the cold one, how many of them found the
    vision worker no longer ready: it had stopped after ``idle_s``, so theirs was a new worker's first
    encode; twenty-ninth session, where a cold request outlasted ``idle_s``)."""
    info = client.info()
    encode = info["histograms"]["vision_encode_seconds"]
    warm, cold = [], 0
    for i in range(args.repeats):
        cold += info["vision"]["state"] != "ready"
        _chat(client, _image_png(args.image_px, seed=i + 1), max_tokens=1)
        info = client.info()
        now = info["histograms"]["vision_encode_seconds"]
        warm.append(now["sum"] - encode["sum"])
        encode = now
    return (statistics.median(warm) if warm else None), cold


def _earlier_cold_starts(client, args) -> list[dict]:
    """``--cold-starts`` N: the first N - 1 cold images, without text streams, each until the vision
    worker is stopped and the caches regrown; their time splits. The measured one that follows is
    then a cold start as it recurs after every ``idle_s``: the processes' first-use costs (the vision
    worker's kernels compiled into the disk cache, the text worker's first image prefill) are paid."""
    splits = []
    for n in range(args.cold_starts - 1):
        sent = time.monotonic()
        first_s = _chat(client, _image_png(args.image_px, seed=100 + n), max_tokens=1, started=sent)
        vision = client.info()["vision"]
        splits.append(dict(vision["last_cold_start"], first_token_s=first_s, vram_mib=vision["vram_mib"],
                           measured_mib=vision.get("measured_mib")))
        _wait(client, lambda i: i["vision"]["state"] == "cold", args.idle_s + args.timeout_s, "vision unloaded")
    return splits


def _lazy_cycle(args, image: bytes) -> dict:
    from moebus.client import Client
    from moebus.common import gc_pauses

    gc_pauses.watch(logging.getLogger("moebus.bench"), "bench client")  # its pauses delay the tokens' times

    with _broker(args, _settings(args, lazy=True)) as address:
        client = Client(address)
        try:
            _wait(client, lambda i: i["vision"]["zygote_ready"], args.timeout_s, "vision zygote ready")
            _wait(client, lambda i: all("max_free_mib" in g for g in i["gpus"]), args.timeout_s, "workers' INFO")
            idle = _row(client)
            earlier = _earlier_cold_starts(client, args)
            before, during, split, gaps = _cold_request(client, image, args)
            warm_s, warm_cold = _warm_encode_s(client, args)
            _wait(client, lambda i: i["vision"]["state"] == "cold", args.idle_s + args.timeout_s, "vision unloaded")
            return {"idle": idle, "before_image": before, "during": during, "after": _row(client), "split": split,
                    "text_gaps": gaps, "warm_encode_s": warm_s, "warm_encode_cold": warm_cold, "earlier_splits": earlier}
        finally:
            client.close()


def _print_rows(rows: list[tuple[str, dict | None]]) -> None:
    print(f"{'stage':<36} {'expert slots':>12} {'cache MiB':>10}   per GPU: slots / cache MiB / free MiB "
          "(budget) / driver free MiB")
    for name, row in rows:
        if row is None:
            print(f"{name:<36} {'-':>12} (not run: --skip-resident)")
            continue
        per_gpu = "  ".join(f"{s}/{m:g}/{f:g}/{'-' if d is None else f'{d:g}'}" for s, m, f, d in
                            zip(row["slots"], row["cache_mib"], row["free_mib"], row["device_free_mib"]))
        print(f"{name:<36} {sum(row['slots']):>12} {sum(row['cache_mib']):>10.1f}   {per_gpu}")
        if row.get("read_at"):
            print(f"{'':<36} (read {row['read_at']})")


def _print_check(resident: dict | None, cycle: dict, segment_mib: int) -> bool:
    """(b) == (d) > (a) ≈ (c); True when (a) was not read (nothing to compare)."""
    if resident is None:
        print("(b) == (d) > (a) ≈ (c): not checked without (a)")
        return True
    tolerance = slots_per_segment(cycle["idle"], segment_mib)
    grown = grown_slots(cycle["idle"], cycle["before_image"])
    ok = cycle_ok(resident["slots"], cycle["idle"]["slots"], cycle["during"]["slots"], cycle["after"]["slots"],
                  tolerance, grown)
    taken = ",".join(f"{max(0.0, i - b):g}" for i, b in zip(cycle["idle"]["free_mib"], cycle["before_image"]["free_mib"]))
    print(f"(b) == (d) > (a) ≈ (c) (≈: per GPU (c) within one segment of (a), {','.join(map(str, tolerance))} slots, "
          f"and below it by the {','.join(map(str, grown))} slots of the {taken} MiB the worker took beside its cache "
          "before the image):", ok)
    return ok


def _print_gaps(gaps: dict, split: dict, num_streams: int) -> None:
    print_gap_report(gaps, num_streams, split.get("steps", {}))
    for key, what in (("ratio_until_encoded", "through hand-back, start and encode"),
                      ("ratio_cold", "through the whole cold start, to the image's last token")):
        for suffix, median in (("", "their median before"), ("_cycle", "their median over the cycle")):
            ratio = worst_ratio(gaps, key + suffix)
            if ratio is not None:
                print(f"text streams' largest gap {what} / {median} (worst stream): {ratio:.2f} (target <= 2):",
                      ratio <= 2)
    for suffix, median in (("", "their median before"), ("_cycle", "their median over the cycle")):
        ratio = worst_ratio(gaps, "ratio_control" + suffix)  # no target: what the text does alone, for the lines above
        if ratio is not None:
            gaps_alone = max(s["control_gaps"] for s in gaps["per_stream"])
            print(f"text streams' largest gap over {gaps_alone} gaps a stream without an image, before it / {median} "
                  f"(worst stream): {ratio:.2f} (the text's own tail)")
    ratio = worst_ratio(gaps, "ratio_until_encoded_control")
    if ratio is not None:  # what the image adds to the text's own largest gap
        print(f"text streams' largest gap through hand-back, start and encode / their largest without an image "
              f"(worst stream): {ratio:.2f} (the image's own share)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moebus bench vision-cycle", description=__doc__)
    p.add_argument("--model", help="a LLaVA model directory (default: the embedded demo model)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    p.add_argument("--idle-s", type=float, default=2.0)
    p.add_argument("--image-px", type=int, default=384, help="side of the test image (it is resized anyway)")
    p.add_argument("--emulated-vram-mib", type=float, nargs="*", help="cpu: the emulated GPUs' sizes")
    p.add_argument("--segment-mib", type=int, help="segment_mib (0: two expert slots a segment)")
    p.add_argument("--gpu-memory-mib", type=float, nargs="*",
                   help="cuda: each GPU's VRAM budget (gpu_memory_mib), e.g. 8192 on an H200")
    p.add_argument("--max-context", type=int)
    p.add_argument("--mps", action="store_true", help="cuda: the workers as clients of a private MPS server "
                   "(mps: true; the vision worker's kernels after the text's)")
    p.add_argument("--handback-step-mib", type=float, help="vision.handback_step_mib (default: the setting's)")
    p.add_argument("--max-batch", type=int, help="max_batch (default: the setting's); the decode graphs captured at "
                   "a worker's start are one per batch size up to it (fewer: a shorter start on a cold kernel cache)")
    p.add_argument("--repeats", type=int, default=5, help="warm encodes")
    p.add_argument("--text-streams", type=int, default=4, help="text streams decoding through the cold start")
    p.add_argument("--text-tokens", type=int, help="at most this many tokens a text stream (default: what the context "
                   "allows; they stop when the image request has answered)")
    p.add_argument("--control-tokens", type=int, default=CONTROL_TOKENS, help="each text stream's tokens in an "
                   "image-free window before the steady state: their largest gap against the same medians, the text's "
                   "own tail beside the cold start's (default %(default)s, about the H200's cold start until encoded; "
                   "0: none)")
    p.add_argument("--skip-resident", action="store_true", help="leave row (a) out (one broker start less)")
    p.add_argument("--cold-starts", type=int, default=1, help="cold images in the lazy run; the last is measured "
                   "with the text streams (2: a cold start as it recurs, the processes' first-use costs paid)")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.control_tokens < 0:
        p.error(f"--control-tokens {args.control_tokens}: a count of tokens, 0 for no image-free window")
    ahead = WARM_TOKENS + args.control_tokens + STEADY_TOKENS
    if args.text_streams and args.text_tokens is not None and args.text_tokens <= ahead:
        p.error(f"--text-tokens {args.text_tokens}: the text streams need more than {ahead} tokens ({WARM_TOKENS} to "
                f"warm, {args.control_tokens} without an image (--control-tokens), {STEADY_TOKENS} in the steady state "
                "before the image is sent) to still be decoding through the cold start; leave it out to decode as far "
                "as the context allows")
    try:  # the brokers' settings, refused here with the key's name rather than by a broker that cannot start
        load_settings(**_settings(args, lazy=True))
    except ConfigError as e:
        p.error(str(e))

    image = _image_png(args.image_px, seed=0)
    resident = None if args.skip_resident else _resident(args)
    cycle = _lazy_cycle(args, image)
    _print_rows([("(a) vision resident (lazy false)", resident), ("(b) lazy, vision idle", cycle["idle"]),
                 ("(c) during an image request", cycle["during"]), ("(d) idle_s after it", cycle["after"])])
    for i, split in enumerate(cycle["earlier_splits"] + [cycle["split"]]):
        what = "cold image request" + (f" {i + 1} of {args.cold_starts}" if args.cold_starts > 1 else "")
        print(f"{what}:", ", ".join(f"{k[:-2]} {1e3 * split[k]:.1f} ms" for k in
                                    ("handback_s", "start_s", "encode_s", "prefill_s", "first_token_s") if k in split),
              f"({split.get('handback_requests', '-')} hand-back requests)")
        if any(m is not None for m in split.get("measured_mib") or []):  # cuda: read after the image's reply
            print(f"  the vision worker's start and first encode took {split['measured_mib']} MiB (driver's count); "
                  f"the next hand-back frees {split.get('vram_mib')} MiB")
    split = cycle["split"]
    if cycle["text_gaps"]:
        _print_gaps(cycle["text_gaps"], split, args.text_streams)
    if cycle["warm_encode_s"] is not None:
        cold = cycle.get("warm_encode_cold", 0)
        print(f"warm image encode: {1e3 * cycle['warm_encode_s']:.1f} ms (median of {args.repeats}"
              + (f"; {cold} of them found the vision worker stopped after idle_s: a new worker's first encode, "
                 "not a warm one" if cold else "") + ")")
    ok = _print_check(resident, cycle, effective_segment_mib(args.segment_mib))
    print(json.dumps({"resident": resident, **cycle}))
    return 0 if ok else 1
