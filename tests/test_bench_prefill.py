"""`moebus bench prefill` on the cpu device: a row per prompt length whose figures add up, with the KV
cache's dtype resolved as the service resolves it (auto: fp32 on cpu) or as asked."""
import json

import pytest

from moebus.bench.prefill import main


@pytest.mark.parametrize("asked, resolved", [("auto", "fp32"), ("bf16", "bf16")])
def test_prefill_rows_and_kv_dtype(tiny_model, capsys, asked, resolved):
    assert main(["--model", str(tiny_model), "--tokens", "8,24", "--repeats", "2", "--kv-dtype", asked, "--json"]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert f"kv_dtype={resolved}" in header.split()
    rows = [json.loads(line) for line in lines]
    assert [r["tokens"] for r in rows] == [8, 24]
    assert all(r["tok_s"] == pytest.approx(r["tokens"] / r["seconds"]) and r["tflop"] > 0 for r in rows)
    # the figure is the median of the runs after the warm-up; the fastest beside it
    assert all(len(r["runs"]) == 2 and r["seconds_min"] == pytest.approx(min(r["runs"]), abs=1e-4) and r["best_tok_s"] >= r["tok_s"]
               for r in rows)
