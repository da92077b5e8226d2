"""STEP -> a real BrokerLink in a worker process -> STEP_REPLY, the path `moebus bench hop` times."""
import re

from moebus.bench import hop


def test_steps_round_trip_through_a_worker_link(capsys):
    assert hop.main(["--steps", "30", "--warmup", "5"]) == 0
    line = capsys.readouterr().out
    median_us = float(re.search(r"median (\d+) us", line).group(1))
    assert "30 steps" in line and 0 < median_us < 1e6
