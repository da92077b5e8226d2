"""`moebus bench decode --schema FILE` on the cpu device through a real private broker: the 7 plain
streams' tok/s beside a plain and a constrained 8th, every constrained answer valid JSON, and each
timed run's steps, graph captures and eager short steps printed beside its time."""
import json

from moebus.bench.decode import main
from tests.structured_schemas import SCHEMAS


def test_schema_bench_reports_both_kinds_and_valid_answers(tiny_model, tmp_path, capsys):
    schema = tmp_path / "enum.json"
    schema.write_text(json.dumps(SCHEMAS["enum"]))
    assert main(["--model", str(tiny_model), "--batch", "1", "--tokens", "6", "--repeats", "1", "--no-service",
                 "--schema", str(schema), "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    extra = next(line for line in lines if "schema_ratio" in line)
    assert extra["kv_dtype"] == "fp32"  # auto on cpu, as the service resolves it
    assert extra["schema_plain_7_tok_s"] > 0 and extra["schema_constrained_7_tok_s"] > 0
    assert extra["schema_answers"] >= 1 and extra["schema_answers_valid_json"] == extra["schema_answers"]
    runs = json.loads(extra["schema_runs"])
    assert [r["eighth"] for r in runs] == ["plain", "constrained"]
    assert all(r["steps"] > 0 and r["graph_captures"] == 0 and r["eager_short_steps"] == 0 for r in runs)  # cpu: none
