"""A spanning chunk's steps by part (workers/step_parts.py) and the trace's step kinds
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
