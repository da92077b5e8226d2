"""`moebus bench decode-context` on the cpu device: one row per (kv dtype, context), figures that add up."""
import json

from moebus.bench.decode_context import main


def test_decode_context_prints_a_row_per_dtype_and_context(tiny_model, capsys):
    assert main(["--model", str(tiny_model), "--contexts", "8,40", "--kv-dtype", "bf16,fp32", "--tokens", "2",
                 "--repeats", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["kv_dtype"], r["context"]) for r in rows] == [("bf16", 8), ("bf16", 40), ("fp32", 8), ("fp32", 40)]
    assert all(r["tok_s"] > 0 and abs(r["ms_per_step"] * r["tok_s"] - 1e3) < 1e-6 for r in rows)
    assert rows[3]["kv_gb_per_step"] == 2 * rows[1]["kv_gb_per_step"]  # fp32: twice bf16's bytes
    assert rows[0]["share_of_shortest"] == rows[2]["share_of_shortest"] == 1.0
