"""decode15_attn.py's tables (CUPTI GPU us a call of the decode attention at b1 per setting, then by kernel),
then each setting's output against the first setting's, bit for bit or the largest difference, at each
context: TC_MERGE_IN_SPLIT (the merge in the tensor-core split kernel) must give the merge apart's bits.

    decode16_attn.py CALLS SETTING...    (as decode14_attn.py; CONTEXTS env, e.g. "64,96,1024,32768")"""
import numpy as np

import decode14_attn as base
import decode15_attn as timed

_outs: dict = {}  # (setting, context) -> the output of the last call, on the host
_last = {}
_attention_cuda, _run_case = base.attention.attention_cuda, timed.run_case


def _recording_attention(*args, **kwargs):
    _last["out"] = args[7]  # decode14_attn's call: (q, k, v, slots, positions, scale, window, out, scratch)
    return _attention_cuda(*args, **kwargs)


def run_case(context: int, calls: int, rng, stream):
    result = _run_case(context, calls, rng, stream)
    _outs[timed._setting(), context] = _last["out"].copy_to_host(stream=stream)
    stream.synchronize()
    return result


def main() -> None:
    base.attention.attention_cuda = _recording_attention
    timed.run_case = run_case  # decode15_attn.main installs its module's run_case: this one, around its own
    timed.main()
    settings = list(dict.fromkeys(s for s, _ in _outs))
    for setting in settings[1:]:
        cells = []
        for context in base.CONTEXTS:
            a, b = _outs.get((setting, context)), _outs.get((settings[0], context))
            if a is None or b is None:
                continue
            same = np.array_equal(a.view(np.uint32), b.view(np.uint32))
            cells.append(f"{context}: " + ("same bits" if same else f"max diff {np.max(np.abs(a - b)):.1e}"))
        print(f"bits [{setting}] vs [{settings[0]}]: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
