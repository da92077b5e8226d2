"""A spanning chunk's steps by part (workers/step_parts.py) and the trace of a worker's steps
(workers/step_trace.py): the bookkeeping only (how long a part takes is measured on the GPU)."""
from moebus.workers import step_parts
from moebus.workers.step_parts import StepParts
from moebus.workers.step_trace import step_kind


def test_parts_add_up_per_step_and_keep_the_order_they_first_ran():
    parts = StepParts()
    for _ in range(2):
        parts.begin("decode rows (sync)")
        parts.begin("route (sync)")
        parts.begin("decode rows (sync)")  # a part may come back within a step: it adds up
        parts.end_step()
    assert parts.steps == 2 and list(parts.totals) == ["decode rows (sync)", "route (sync)"]
    assert all(parts.most[name] <= parts.totals[name] for name in parts.totals)
    assert [item.split(" ")[0] for item in parts.summary().split(", ")] == ["decode", "route"]


def test_each_part_is_a_range_while_a_trace_runs(monkeypatch):
    opened = []

    class Range:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            opened.append(("enter", self.name))

        def __exit__(self, *exc):
            opened.append(("exit", self.name))
    monkeypatch.setattr(step_parts, "RANGES", Range)
    parts = StepParts()
    parts.begin("a")
    parts.begin("b")
    parts.end_step()
    assert opened == [("enter", "a"), ("exit", "a"), ("enter", "b"), ("exit", "b")]


def test_step_kinds():
    assert step_kind([1, 1], 64) == "decode"
    assert step_kind([1, 510], 64) == "chunk"
    assert step_kind([510], 64) == "prompt" and step_kind([1, 40], 64) == "prompt"


def test_the_trace_runs_from_the_chunks_second_step_until_its_request_is_over(tmp_path):
    """The chunk's second step starts it; a look-ahead step without the prompt's slot between two
    chunks of the prompt does not stop it; three steps in a row without the slot, no chunk held, do
    (before the third). Each traced step is a range named by its id, kind and tokens."""
    import json

    import pytest

    pytest.importorskip("torch")
    from moebus.workers.step_trace import StepTrace

    trace = StepTrace(400, str(tmp_path), 0, 64)
    steps = [([0, 1], [1, 1], None), ([0, 1, 2], [1, 1, 510], None), ([0, 1], [1, 1], 2),
             ([0, 1, 2], [1, 1, 510], 2), ([0, 1], [1, 1], None), ([0, 1, 2], [1, 1, 246], None),
             ([0, 1, 2], [1, 1, 1], None)] + [([0, 1], [1, 1], None)] * 4
    for step_id, (slots, lengths, held) in enumerate(steps):
        trace.before(step_id, slots, lengths, held)
        trace.after()
    assert trace.done and trace.traced == 7  # steps 2 ... 8: stopped before 9, the third without slot 2
    events = json.load(open(tmp_path / "chunk_trace_gpu0.json"))["traceEvents"]
    names = sorted(e["name"] for e in events if e.get("name", "").startswith("step "))
    assert names[0] == "step 2 decode 2" and "step 3 chunk 512" in names and "step 5 chunk 248" in names
    assert len(names) == 7


def test_slowest_steps_name_their_parts():
    parts = StepParts()
    for seconds in (0.002, 0.009, 0.004):
        parts._step = {"decode rows (sync)": seconds, "plan": 0.0001}
        parts.end_step()
    line = parts.slowest([3.0, 10.0, 5.0], 2)
    assert line == "#2 10.0 ms (decode rows (sync) 9.0); #3 5.0 ms (decode rows (sync) 4.0)"
