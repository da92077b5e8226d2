"""``moebus bench decode --pipeline on|off|both``: throughput of N concurrent greedy streams through
a private broker whose model is split over two stages, pipelined (``broker.pipeline``) and not, and
the same model on one stage, printed side by side. On the cpu device the stages are emulated GPUs
(``emulated_vram_mib``); on cuda they are ``gpus`` 0 and 1."""
from __future__ import annotations

import json
import statistics
import time

EMULATED_MIB = 56  # per emulated GPU, the demo's default


def _stage_env(device: str, num_stages: int, pipeline: bool) -> dict:
    env = {"MOEBUS_BROKER__PIPELINE": json.dumps(pipeline)}
    if device == "cuda":
        env["MOEBUS_GPUS"] = json.dumps(list(range(num_stages)))
    else:  # one stage gets the memory of both, so that the caches hold the same experts
        env["MOEBUS_EMULATED_VRAM_MIB"] = json.dumps([EMULATED_MIB * 2 // num_stages] * num_stages)
    return env


def streams_tok_s(model_dir: str | None, device: str, env: dict, prompt: list[int], tokens: int, streams: int,
                  repeats: int) -> dict:
    """Median tokens/s of ``streams`` streams at once, and how many steps overlapped another."""
    from moebus.cli_generate import private_broker
    from moebus.client import Client

    flags = ["--device", device] + (["--model", model_dir] if model_dir else [])
    env = {**env, "MOEBUS_MAX_CONTEXT": str(len(prompt) + tokens + 8), "MOEBUS_MAX_BATCH": str(streams)}
    with private_broker(flags, env=env) as address:
        client = Client(address)
        try:
            rates, before = [], client.info()["counters"]
            for _ in range(repeats + 1):  # the first run warms up
                rates.append(_one_run(client, prompt, tokens, streams))
            overlapped = client.info()["counters"].get("pipelined_steps_total", 0) - \
                before.get("pipelined_steps_total", 0)
            return {"tok_s": statistics.median(rates[1:]), "pipelined_steps": overlapped}
        finally:
            client.close()


def _one_run(client, prompt: list[int], tokens: int, streams: int) -> float:
    """Generated tokens per second of wall time, from sending the first request to the last token
    (the prompts' prefill included: it is a small part at 32 prompt tokens and 64 generated)."""
    start = time.perf_counter()
    # distinct prompts: no two streams are the same sequence
    runs = [client.generate(prompt_tokens=[(t + i) % 200 + 10 for t in prompt], max_tokens=tokens, temperature=0,
                            ignore_eos=True) for i in range(streams)]
    n = sum(len(part.tokens) for stream in runs for part in stream)
    return n / (time.perf_counter() - start)


def compare(model_dir: str | None, device: str, prompt: list[int], tokens: int, streams: int, repeats: int,
            modes: str) -> dict:
    """The figures ``bench decode`` prints for ``--pipeline``: tokens/s per mode, and the ratios."""
    out = {}
    for mode in (["on", "off"] if modes == "both" else [modes]):
        r = streams_tok_s(model_dir, device, _stage_env(device, 2, mode == "on"), prompt, tokens, streams, repeats)
        out[f"split_pipeline_{mode}_{streams}_streams_tok_s"] = r["tok_s"]
        out[f"split_pipeline_{mode}_overlapped_steps"] = r["pipelined_steps"]
    if modes == "both":
        one = streams_tok_s(model_dir, device, _stage_env(device, 1, True), prompt, tokens, streams, repeats)
        out[f"one_stage_{streams}_streams_tok_s"] = one["tok_s"]
        on, off = out[f"split_pipeline_on_{streams}_streams_tok_s"], out[f"split_pipeline_off_{streams}_streams_tok_s"]
        out["pipeline_on_over_off"] = on / off
        out["pipeline_on_over_one_stage"] = on / one["tok_s"]
    return out
