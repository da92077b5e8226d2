"""Issue 18, fifteenth session (branch vl15): vltower8_fidelity.py's wider bf16 Qwen3-VL-MoE (head dim 72, 8
blocks, hidden 288: its LayerNorm rows are held, its GELU rows of 1152 split in two parts; images of ~400
patches on the tensor cores) at the default precision, with this branch's switches off (integ15) and on
(vl15_encode.SWITCHES): greedy tokens and logprobs against float32 transformers (bar 1e-3), each prompt
twice (a new size's eager encode, then its captured graph), and the two ways' outputs against each other.
Correctness only (vl15.sh runs it beside the other branches' warm phases)."""
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
DEVICE = os.environ.get("VL15_DEVICE", "cuda")  # cpu: a dry run of the script (the switches then do nothing)


def main() -> bool:
    from qwen3vl_check import _hf_greedy
    from vl15_encode import ALL, set_switches
    from vltower8_fidelity import NUM_TOKENS, WIDER
    from vltower_fidelity import images, models, prompt

    ok, first = True, {}
    with tempfile.TemporaryDirectory() as tmp:
        d, hf, ours = models(Path(tmp), DEVICE, WIDER)
        prompts = []
        for n in (1, 2):
            ids, patches = prompt(ours, d, images()[:n])
            prompts.append((n, ids, patches, _hf_greedy(hf, ids, patches, NUM_TOKENS)))
        for label, on in (("old", ()), ("all", ALL)):
            set_switches(on)
            ours.vision.graph.close()
            for n, ids, patches, (ref_tokens, ref_logprobs) in prompts:
                for run in ("eager", "graph"):
                    out = ours.generate(ids, NUM_TOKENS, patches)
                    worst = float(np.abs(np.array(out.logprobs) - ref_logprobs).max())
                    good = out.tokens == ref_tokens and worst <= 1e-3
                    ok &= good
                    key = (n, run)
                    same = "" if label == "old" else "; against old: " + (
                        "equal" if (out.tokens, out.logprobs) == first[key] else
                        f"logprobs {float(np.abs(np.array(out.logprobs) - first[key][1]).max()):.2e} apart")
                    first.setdefault(key, (out.tokens, out.logprobs))
                    print(f"fidelity {label}, {n} image(s), {run} ({ours.vision.graph.last_path}): tokens "
                          f"{'equal' if out.tokens == ref_tokens else 'DIFFER'}, max |logprob diff| {worst:.2e} "
                          f"{'ok' if good else 'FAIL'}{same}")
    set_switches(())
    return ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
