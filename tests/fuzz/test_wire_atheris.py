"""Coverage-guided fuzz of ``wire.decode`` in CI: tools/fuzz_wire.py (atheris over libFuzzer) for a
bounded number of inputs, seeded with a valid encoding of every message type, with the inputs of
past findings (tests/fuzz/regressions/) replayed first. atheris instruments the interpreter and
ends its process with sys.exit, so it runs as a subprocess; it fails on anything but a WireError
that a check meant or a message that survives a second round trip (see the tool's docstring).
Long runs: ``PYTHONPATH=$PWD python tools/fuzz_wire.py --seed CORPUS -max_total_time=600 CORPUS``."""
import os
import re
import subprocess
import sys
from pathlib import Path

from moebus.common import protocol
from tests.common.test_wire import SAMPLES

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "fuzz_wire.py"
REGRESSIONS = Path(__file__).resolve().parent / "regressions"
CI_RUNS = 50_000  # a few seconds on a quiet core; max_total_time caps it on a loaded box
CAP_S = 90


def test_a_bounded_coverage_guided_run_finds_nothing(tmp_path):
    corpus = tmp_path / "corpus"
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this tree's moebus, also under a worktree
    args = [sys.executable, str(TOOL), "--seed", str(corpus), f"-runs={CI_RUNS}", "-seed=1",
            f"-max_total_time={CAP_S}", f"-artifact_prefix={tmp_path}/", str(corpus), str(REGRESSIONS)]
    run = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=CAP_S + 120)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("timeout-*")), log[-6000:]
    assert {type(m) for m in SAMPLES} == set(protocol.MESSAGES.values())
    assert f"wrote {len(SAMPLES)} seeds" in log
    regressions = len(list(REGRESSIONS.iterdir()))
    assert f"seed corpus: files: {len(SAMPLES) + regressions} " in log, log[:3000]  # every seed and regression ran
    done = re.search(r"Done (\d+) runs", log)
    assert done and int(done.group(1)) > len(SAMPLES) + regressions, log[-3000:]  # it mutated, not only replayed
