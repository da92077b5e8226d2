"""The link's timeline from a CUPTI trace of decode steps (miss12_check.py's, shared with miss14_ahead.py):
which kernels read PCIe (the expert GEMVs' mapped reads, the prefetch's copy kernel, admissions on the copy
engine), the time none does, the bytes moved over the time it was read, the waits at the joins, and the
link's idle stretches by length."""
import numpy as np


def union(intervals) -> list:
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def minus(intervals, cut) -> list:
    """The parts of ``intervals`` (a union) outside ``cut`` (a union)."""
    out, j = [], 0
    for a, b in intervals:
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        k, start = j, a
        while k < len(cut) and cut[k][0] < b:
            if cut[k][0] > start:
                out.append([start, cut[k][0]])
            start = max(start, cut[k][1])
            k += 1
        if start < b:
            out.append([start, b])
    return out


def analyse(kernels, moved: int, steps: int, label: str) -> str:
    """The timeline's figures from CUPTI's (name, start us, end us) of ``steps`` steps that moved
    ``moved`` bytes over PCIe."""
    from decode_profile import short_name

    # the names as CUPTI gives them (numba's demangled: moebus::cuda::kernels::prefetch::_copy_kernel::...)
    is_prefetch = ["_copy_kernel" in n or "copy_rows" in n for n, _, _ in kernels]
    is_admission = ["Memcpy HtoD" in n for n, _, _ in kernels]
    is_expert = ["moe_ffn" in n or "moe_quant" in n for n, _, _ in kernels]  # the GEMVs (batch 8's gemms are dense)
    busy = union([(a, b) for _, a, b in kernels])
    experts = union([(a, b) for (_, a, b), e in zip(kernels, is_expert) if e])
    prefetches = union([(a, b) for (_, a, b), c in zip(kernels, is_prefetch) if c])
    admissions = union([(a, b) for (_, a, b), c in zip(kernels, is_admission) if c])
    link = union(experts + prefetches + admissions)
    span = (busy[-1][1] - busy[0][0]) if busy else 0.0
    # the wait before each join (remap_pairs: after the side branch's copies) and each gate|up kernel: from
    # the end of the last kernel before it that is neither a copy nor the side branch's plan to its start
    # (the side branch's router and top-k count as compute: a lower bound on the wait)
    compute = sorted(b for (n, a, b), c, d in zip(kernels, is_prefetch, is_admission) if not (c or d or "plan_" in n))

    def waits(word):
        out = []
        for n, a, b in kernels:
            if word in n:
                k = np.searchsorted(compute, a, side="right") - 1
                if k >= 0:
                    out.append(a - compute[k])
        return out

    joins, gate_ups = waits("remap_pairs"), waits("_gate_up")
    idle = minus([[busy[0][0], busy[-1][1]]], link) if busy else []  # the link's idle stretches, by length
    by_length = [(lo, hi, [b - a for a, b in idle if lo <= b - a < hi]) for lo, hi in ((0, 50), (50, 500), (500, 1e12))]
    idle_text = ", ".join(f"{len(g) / steps:.0f} of {lo:.0f}-{hi:.0f} us {sum(g) / steps:.0f}" if hi < 1e12 else
                          f"{len(g) / steps:.1f} over {lo:.0f} us {sum(g) / steps:.0f}" for lo, hi, g in by_length)
    text = (f"-- timeline {label}, per step (us): GPU span {span / steps:.0f}, busy {length(busy) / steps:.0f}, "
          f"link read {length(link) / steps:.0f} ({moved / steps / 1e6:.0f} MB: {moved / max(length(link), 1) / 1e3:.1f} GB/s "
          f"while read), none reading {(span - length(link)) / steps:.0f} (GPU busy {length(minus(busy, link)) / steps:.0f}); "
          f"expert GEMVs {length(experts) / steps:.0f}, prefetch copies {length(prefetches) / steps:.0f} (alone "
          f"{length(minus(prefetches, union(experts + admissions))) / steps:.0f}), admissions {length(admissions) / steps:.0f} "
          f"(alone {length(minus(admissions, union(experts + prefetches))) / steps:.0f}); waits after the compute stream: "
          f"joins {sum(joins) / steps:.0f} ({len(joins) / steps:.0f} a step, max {max(joins, default=0):.0f}), gate|up "
          f"{sum(gate_ups) / steps:.0f} ({len(gate_ups) / steps:.0f}); link idle a "
          f"step: {idle_text} (the last: between steps, the host's work)")
    by_name = {}
    for n, a, b in kernels:
        c = by_name.setdefault(short_name(n), [0, 0.0])
        c[0] += 1
        c[1] += b - a
    for n, (calls, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:8]:
        text += f"\n   {n[:50]:<50} {calls / steps:>6.1f}/step {us / calls:>8.1f} us {us / steps:>8.0f} us/step"
    return text
