"""``moebus bench decode --schema FILE``: decode speed through the service with one sequence of a
batch of 8 under a JSON schema, against the same batch with none constrained. The other 7 streams are
greedy, ``ignore_eos`` and as long as ``--tokens``; the 8th is constrained (temperature 0.8, started
again whenever its grammar completes, so the batch always holds a constrained row) or, for the
baseline, plain answers of PLAIN_EIGHTH_TOKENS started again the same way (so both runs prefill a new
8th prompt as often). The figure is the 7 plain streams' tok/s: what the masks cost everyone else
(the target: >= 0.9x)."""
from __future__ import annotations

import json
import statistics
import threading
import time

BATCH = 8
WARM_TOKENS = 48  # long enough that the constrained 8th decodes beside all 7 plain streams (its graph)
MAX_CONSTRAINED_TOKENS = 256  # a bounded schema's answer ends well before (it finishes with stop)
PLAIN_EIGHTH_TOKENS = 32  # about a nested bounded schema's answer


def _plain_streams(client, prompt: list[int], tokens: int, count: int, counts: list[int]) -> list[threading.Thread]:
    def run(k: int) -> None:
        for part in client.generate(prompt_tokens=prompt, max_tokens=tokens, temperature=0, ignore_eos=True):
            counts[k] += len(part.tokens)

    return [threading.Thread(target=run, args=(k,), daemon=True) for k in range(count)]


def _eighth(client, prompt: list[int], tokens: int, constraint: dict | None, stop: threading.Event,
            answers: list[str]) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            text = ""
            kwargs = ({"constraint": constraint, "temperature": 0.8, "max_tokens": MAX_CONSTRAINED_TOKENS} if constraint
                      else {"temperature": 0.8, "max_tokens": PLAIN_EIGHTH_TOKENS, "ignore_eos": True})
            for part in client.generate(prompt_tokens=prompt, **kwargs):
                text += part.text
            if constraint:
                answers.append(text)

    return threading.Thread(target=run, daemon=True)


def _one_run(client, prompt, tokens: int, constraint: dict | None) -> tuple[float, list[str], dict]:
    """(the 7 plain streams' tok/s, the constrained answers, the broker's steps in the run: how many,
    their ms as the broker saw them and computing in the stages)."""
    counts, answers, stop = [0] * (BATCH - 1), [], threading.Event()
    before = client.info()
    threads = _plain_streams(client, prompt, tokens, BATCH - 1, counts)
    eighth = _eighth(client, prompt, tokens, constraint, stop, answers)
    start = time.perf_counter()
    for t in threads + [eighth]:
        t.start()
    for t in threads:
        t.join()
    elapsed_s = time.perf_counter() - start
    stop.set()
    steps = _steps(before, client.info())
    eighth.join(timeout=60)
    return sum(counts) / elapsed_s, answers, steps


def _worker_counts(client) -> dict:
    """The first worker's graph captures and eagerly run short steps so far (0 where it has no graphs):
    a run that recaptures or runs eagerly shows it beside its time."""
    from moebus.bench.decode import WORKER_INFO_S

    time.sleep(WORKER_INFO_S)  # the broker refreshes its workers' INFO every few seconds
    worker = client.info()["gpus"][0]
    return {k: worker.get(k) or 0 for k in ("graph_captures", "eager_short_steps")}


def _steps(before: dict, after: dict) -> dict:
    def delta(name):
        h0, h1 = before["histograms"][name], after["histograms"][name]
        return h1["sum"] - h0["sum"], sum(h1["counts"]) - sum(h0["counts"])

    total_s, count = delta("step_seconds")
    compute_s, _ = delta("step_compute_seconds")
    return {"steps": count, "step_ms": round(1e3 * total_s / max(count, 1), 2),
            "compute_ms": round(1e3 * compute_s / max(count, 1), 2)}


def compare(model_dir: str | None, device: str, prompt: list[int], tokens: int, schema_path: str,
            repeats: int) -> dict:
    """Plain tok/s of 7 streams beside an unconstrained and beside a constrained 8th (medians)."""
    from moebus.cli_generate import private_broker
    from moebus.client import Client

    schema_text = open(schema_path).read()
    json.loads(schema_text)  # a file that is not JSON fails here, not in the broker
    constraint = {"kind": "json_schema", "spec": schema_text, "param": "--schema"}
    flags = ["--device", device] + (["--model", model_dir] if model_dir else [])
    env = {"MOEBUS_MAX_CONTEXT": str(len(prompt) + max(tokens, MAX_CONSTRAINED_TOKENS) + 8),
           "MOEBUS_MAX_BATCH": str(BATCH)}
    with private_broker(flags, env=env) as address:
        client = Client(address)
        try:
            for warm in (None, constraint):  # graphs of both kinds captured before anything is timed
                _one_run(client, prompt, min(tokens, WARM_TOKENS), warm)
            plain, constrained, answers, runs = [], [], [], []
            counts = _worker_counts(client)
            for _ in range(repeats):
                for kind, eighth, rates in (("plain", None, plain), ("constrained", constraint, constrained)):
                    rate, texts, steps = _one_run(client, prompt, tokens, eighth)
                    rates.append(rate)
                    answers += texts
                    now = _worker_counts(client)
                    runs.append({"eighth": kind, "tok_s": round(rate, 1), **steps,
                                 **{k: now[k] - counts[k] for k in now}})
                    counts = now
        finally:
            client.close()
    valid = sum(_parses(t) for t in answers)
    return {"schema_plain_7_tok_s": statistics.median(plain), "schema_constrained_7_tok_s": statistics.median(constrained),
            "schema_ratio": statistics.median(constrained) / statistics.median(plain),
            "schema_answers": len(answers), "schema_answers_valid_json": valid,
            "schema_runs": json.dumps(runs)}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False
