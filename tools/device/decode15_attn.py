"""decode14_attn.py's table (CUPTI GPU us a call of the decode attention at b1, 1k / 4k / 32k, per setting of
attention_decode's constants; BEST lines), then each setting's us by kernel (the split kernel, a separate
merge where MERGE_IN_SPLIT=0), so the split phase and the merge are seen apart.

    decode15_attn.py CALLS SETTING...    (as decode14_attn.py; CALLS 0: compile and run once only)"""
import sys
from collections import defaultdict

import decode14_attn as base

_last = {}
_by_kernel: dict = defaultdict(dict)  # setting -> {(context, kernel): us a call}
_run_case, _profile = base.run_case, base.profile


def _recording_profile(*args, **kwargs):
    _last["prof"] = _profile(*args, **kwargs)
    return _last["prof"]


def _short(name: str) -> str:
    for key in ("merge_splits", "attention_split_merge", "attention_split"):
        if key in name:
            return key
    return name[:30]


def _setting() -> str:
    """The constants of attention_decode that differ from its defaults now (base.main set them)."""
    return ",".join(f"{k}={getattr(base.decode, k)}" for k, v in base.DEFAULTS.items()
                    if getattr(base.decode, k) != v) or "defaults"


def run_case(context: int, calls: int, rng, stream):
    _last.pop("prof", None)
    result = _run_case(context, calls, rng, stream)
    prof = _last.get("prof")
    if prof is not None:
        row = _by_kernel[_setting()]
        for e in prof.events():
            if e.device_type.name == "CUDA" and "attention" in e.name and e.device_time_total > 0:
                key = (context, _short(e.name))
                row[key] = row.get(key, 0.0) + e.device_time_total / calls
    return result


def main() -> None:
    base.profile, base.run_case = _recording_profile, run_case
    base.main()
    if _by_kernel:
        print("by kernel (us a call at each context; the setting's constants past the defaults)")
        for name, row in _by_kernel.items():
            print("  " + "  ".join(f"{c // 1024}k {k.replace('attention_', '')} {us:.1f}"
                                   for (c, k), us in sorted(row.items())) + f"  [{name}]", flush=True)


if __name__ == "__main__":
    main()
