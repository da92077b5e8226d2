"""Decode speed in-process and through the service, and the broker's added latency per step."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path



def _in_process(model_dir: str, device: str, prompt: list[int], tokens: int, batch: int, repeats: int) -> dict:
    from moebus.workers.batch import StepBatch
    from moebus.workers.local import LocalModel

    model = LocalModel(model_dir, device=device, num_slots=max(batch, 1), max_context=len(prompt) + tokens + 8)
    rates = []
    for _ in range(repeats):
        model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[len(prompt)] * batch,
                             tokens=prompt * batch))
        last = [prompt[-1]] * batch
        start = time.perf_counter()
        for i in range(tokens):
            out = model.step(StepBatch(slots=range(batch), starts=[len(prompt) + i] * batch, lengths=[1] * batch,
                                       tokens=last))
            last = [int(t) for t in out.tokens]
        rates.append(tokens * batch / (time.perf_counter() - start))
    return {"tok_s": statistics.median(rates), "runs": rates}


def _through_service(model_dir: str | None, device: str, prompt: list[int], tokens: int, repeats: int) -> dict:
    from moebus.cli_generate import private_broker
    from moebus.client import Client

    flags = ["--device", device] + (["--model", model_dir] if model_dir else [])
    with private_broker(flags, env={"MOEBUS_MAX_CONTEXT": str(len(prompt) + tokens + 8)}) as address:
        client = Client(address)
        try:
            rates, steps = [], []
            for _ in range(repeats + 1):
                before = client.info()
                stream = client.generate(prompt_tokens=prompt, max_tokens=tokens, temperature=0, ignore_eos=True)
                first = next(stream)
                start, n = time.perf_counter(), len(first.tokens)
                for part in stream:
                    n += len(part.tokens)
                rates.append((n - 1) / (time.perf_counter() - start))
                steps.append(_step_overhead(before, client.info()))
            return {"tok_s": statistics.median(rates[1:]), "runs": rates[1:],
                    "broker_step_ms": statistics.median(s[0] for s in steps[1:]),
                    "worker_step_ms": statistics.median(s[1] for s in steps[1:])}
        finally:
            client.close()


def _step_overhead(before: dict, after: dict) -> tuple[float, float]:
    """(ms per step seen by the broker, ms per step computing in the stages) between two INFOs."""
    def delta(name):
        h0, h1 = before["histograms"][name], after["histograms"][name]
        return h1["sum"] - h0["sum"], sum(h1["counts"]) - sum(h0["counts"])

    total_s, steps = delta("step_seconds")
    compute_s, _ = delta("step_compute_seconds")
    return total_s / max(steps, 1) * 1e3, compute_s / max(steps, 1) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moebus bench decode")
    p.add_argument("--model", help="model directory (default: the embedded demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-service", action="store_true")
    args = p.parse_args(argv)
    from moebus.common.demo_model import demo_model_dir

    model_dir = args.model or str(demo_model_dir())
    prompt = [(7 * i + 3) % 200 + 10 for i in range(args.prompt_tokens)]
    results = {"model": Path(model_dir).name, "device": args.device}
    for batch in (int(b) for b in args.batch.split(",")):
        r = _in_process(model_dir, args.device, prompt, args.tokens, batch, args.repeats)
        results[f"in_process_batch{batch}_tok_s"] = round(r["tok_s"], 1)
    if not args.no_service:
        s = _through_service(args.model, args.device, prompt, args.tokens, args.repeats)
        results["service_batch1_tok_s"] = round(s["tok_s"], 1)
        results["service_step_ms"] = round(s["broker_step_ms"], 2)
        results["worker_step_ms"] = round(s["worker_step_ms"], 2)
        results["broker_added_ms_per_step"] = round(s["broker_step_ms"] - s["worker_step_ms"], 2)
    width = max(len(k) for k in results)
    for key, value in results.items():
        print(f"{key:<{width}}  {value}")
    print(json.dumps(results))
    return 0
