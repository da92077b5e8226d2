"""The issue's structured-output target, as one run: 200 answers (20 per schema of the 10 bounded ones
in tests/structured_schemas.py) at temperature 0.8 on the demo model (or --model), 8 at a time
through a private broker, each parsed, validated with jsonschema and checked to end with ``stop``.
Prints one line per schema and a total; exits 1 unless every answer passes (docs/api.md records it).
Usage: PYTHONPATH=. python tools/structured_run.py [--device cpu] [--per-schema 20]"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moebus.cli_generate import private_broker  # noqa: E402
from moebus.client import Client  # noqa: E402
from tests.structured_schemas import SCHEMAS  # noqa: E402

MAX_TOKENS = 256


def answer(client: Client, name: str, seed: int) -> tuple[str, str, str]:
    constraint = {"kind": "json_schema", "spec": json.dumps(SCHEMAS[name]), "param": "schema"}
    stream = client.chat([{"role": "user", "content": f"Give me a {name} object as JSON."}], max_tokens=MAX_TOKENS,
                         temperature=0.8, seed=seed, constraint=constraint)
    text = "".join(part.text for part in stream)
    return name, text, stream.final.finish_reason


def check(name: str, text: str, reason: str) -> str | None:
    try:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    except (ValueError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {str(e)[:120]}"
    return None if reason == "stop" else f"finish_reason {reason}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the embedded demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--per-schema", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args()
    flags = ["--device", args.device] + (["--model", args.model] if args.model else [])
    jobs = [(name, 1000 * k + i) for k, name in enumerate(SCHEMAS) for i in range(args.per_schema)]
    started = time.perf_counter()
    with private_broker(flags, env={"MOEBUS_MAX_BATCH": str(args.concurrency)}) as address:
        client = Client(address)
        try:
            with ThreadPoolExecutor(args.concurrency) as pool:
                results = list(pool.map(lambda job: answer(client, *job), jobs))
        finally:
            client.close()
    failures = 0
    for name in SCHEMAS:
        mine = [r for r in results if r[0] == name]
        bad = [(text, problem) for _, text, reason in mine if (problem := check(name, text, reason))]
        failures += len(bad)
        sample = mine[0][1][:70] if mine else ""
        print(f"{name:>16}: {len(mine) - len(bad)}/{len(mine)} valid, finished with stop   e.g. {sample}")
        for text, problem in bad[:2]:
            print(f"{'':>18}FAILED {problem}: {text[:100]!r}")
    print(f"total: {len(results) - failures}/{len(results)} parse, validate and stop; "
          f"{time.perf_counter() - started:.0f} s, {args.concurrency} at a time on {args.device}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
