# Issue 15 items 1-2, call 1 (one H200): where a decode step's GPU time goes, by kernel, on a 4-layer
# A3B-shaped model (48 x 32's layers are the same): torch.profiler over replayed graphs at batch 1
# and 8, then ncu's DRAM throughput, registers and occupancy of one batch-1 step's kernels.
source tools/device/setup.sh
python3 -m moebus.cli init-model /tmp/m4 --preset a3b --layers 4 --experts 32 2>&1 | tail -1
timeout 120 python3 tools/device/decode_profile.py /tmp/m4 1 8 2>&1 | grep -v Warn | tee $OUT/profile.txt
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,launch__registers_per_thread,launch__grid_size,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active
M=$M,launch__occupancy_limit_registers,sm__maximum_warps_per_active_cycle_pct
PROFILE_PLAIN=1 timeout 150 ncu --clock-control none --launch-skip 150 --launch-count 60 --metrics $M --csv \
  --print-units base python3 tools/device/decode_profile.py /tmp/m4 1 > $OUT/ncu.csv 2> $OUT/ncu.err
echo "ncu rc $?"; tail -3 $OUT/ncu.err
python3 - <<'PY'
import csv, os, re, collections
rows = list(csv.reader(l for l in open(os.environ["OUT"] + "/ncu.csv") if l.startswith('"')))
head, rows = rows[0], rows[1:]
k, m, v = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value")
i = head.index("ID")
per = collections.OrderedDict()
for r in rows:
    per.setdefault(r[i], {"name": r[k]})[r[m]] = r[v]
short = lambda n: ".".join([p for p in re.findall(r"\d+([A-Za-z_][A-Za-z0-9_]*)", n) if p not in ("cudapy", "moebus", "cuda", "kernels") and not p.startswith("_3c")][:2]) or n[:40]
print(f"{'kernel':<40} {'us':>7} {'MB read':>8} {'GB/s':>7} {'dram%':>6} {'regs':>5} {'grid':>6} {'blk':>5} {'warps%':>6} {'occ%':>5}")
for d in per.values():
    us = float(d.get("gpu__time_duration.sum", 0)) / 1e3
    mb = float(d.get("dram__bytes_read.sum", 0)) / 1e6
    print(f"{short(d['name'])[:40]:<40} {us:7.2f} {mb:8.2f} {mb / us * 1e3 if us else 0:7.0f} "
          f"{float(d.get('dram__throughput.avg.pct_of_peak_sustained_elapsed', 0)):6.1f} {d.get('launch__registers_per_thread', '')[:5]:>5} "
          f"{d.get('launch__grid_size', '')[:6]:>6} {d.get('launch__block_size', '')[:5]:>5} "
          f"{float(d.get('sm__warps_active.avg.pct_of_peak_sustained_active', 0)):6.1f} {float(d.get('sm__maximum_warps_per_active_cycle_pct', 0)):5.1f}")
PY
