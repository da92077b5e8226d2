"""tools/device/gap11_trace.py, the reader of a worker's chunk-step trace: a window's GPU activities
found by bisection (an activity that starts before the window counts for its part within it), and
the chunk steps' table by part."""
import importlib.util
import json
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "tools" / "device" / "gap11_trace.py"


def _reader():
    spec = importlib.util.spec_from_file_location("gap11_trace", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


EVENTS = [
    _x("user_annotation", "step 1 chunk 512", 0, 100), _x("user_annotation", "plan", 0, 40),
    _x("user_annotation", "group kernels", 40, 60), _x("user_annotation", "step 2 decode 2", 100, 50),
    _x("kernel", "early", -50, 60),  # from before the step into its plan: 10 us of it inside
    _x("kernel", "gemm", 30, 30),  # 10 us in the plan, 20 in the group kernels
    _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 70, 10, bytes=1 << 20),
    _x("kernel", "decode", 110, 30), _x("overhead", "Lazy Function Loading", 45, 1),
]


def test_a_windows_activities_include_one_that_started_before_it():
    reader = _reader()
    gpu = reader.Timeline(e for e in EVENTS if e["cat"] in reader.GPU_CATS)
    plan = reader.gpu_in(gpu, 0, 40)
    assert plan["busy"] == 20 and plan["launches"] == 2 and plan["idle"] == 20
    groups = reader.gpu_in(gpu, 40, 100)
    assert groups["kernels"] == 20 and groups["h2d"] == 10 and groups["h2d_mib"] == 1.0 and groups["idle"] == 30
    assert reader.gpu_in(gpu, 100, 150)["busy"] == 30


def test_the_chunk_steps_parts_are_printed(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": EVENTS}))
    _reader().main(str(path))
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()}
    assert rows["plan"].split("|")[0].split()[-1] == "0.04"  # 40 us of host time in the one chunk step
    assert rows["group"].split("|")[-1].strip() == "0.03"  # 30 us of it with the GPU idle
    assert "CUPTI overhead events: Lazy Function Loading 1" in out
