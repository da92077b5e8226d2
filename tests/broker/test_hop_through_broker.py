"""`moebus bench hop --broker DIR`: a real `moebus broker` drives the bench's worker link and a real
client streams through it; the bench's figure is the PARTIAL interval at that client."""
import re

from moebus.bench import hop


def test_a_generation_streams_through_a_real_broker_and_the_bench_worker(tiny_model, capsys):
    assert hop.main(["--broker", str(tiny_model), "--steps", "30", "--warmup", "5"]) == 0
    line = capsys.readouterr().out
    median_us = float(re.search(r"median (-?\d+) us", line).group(1))
    assert "through the broker" in line and "30 steps" in line and 0 < median_us < 1e6
