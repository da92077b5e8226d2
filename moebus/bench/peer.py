"""The peer to beat, timed in the same call as moebus: HF transformers decoding a model of the same
shapes (the script lives outside the package, in .peer/, and builds its own random weights)."""
from __future__ import annotations

import re
import subprocess
import sys

RATE = re.compile(r"=\s*([0-9.]+)\s*tok/s")


def hf_peer_tok_s(script: str, num_layers: int, timeout_s: float = 900) -> float | None:
    """Batch-1 greedy tok/s of ``script a LAYERS`` (all on the GPU); None when it did not run."""
    try:
        run = subprocess.run([sys.executable, script, "a", str(num_layers)], capture_output=True, text=True,
                             timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"hf peer did not run: {e}", file=sys.stderr)
        return None
    found = RATE.findall(run.stdout)
    if run.returncode != 0 or not found:
        print(f"hf peer failed (exit {run.returncode}): {run.stderr[-2000:]}", file=sys.stderr)
        return None
    return float(found[-1])
