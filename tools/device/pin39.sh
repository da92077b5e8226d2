#!/usr/bin/env bash
# One GPU (thirty-fifth session; issue 20): does another process's pinning stall this one's CUDA calls? No moebus:
# jitter37.py's host-side step loop (a tiny kernel, a 9 MiB copy from pinned memory, an event) for 16 s while a
# second process pins (cuMemHostAlloc), fills and frees 785 MiB, the streamed so400m tower's host buffer, 5 times
# 2.5 s apart; the loop's slow iterations and the pinning windows on one wall clock. (~2 min)
#   bash tools/device/pin39.sh 2>&1 | tail -30      (carry .whl)
source tools/device/setup.sh > /dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 tools/device/jitter37.py --pin-mib 785 --pin-count 5 --pin-every-s 2.5 2>&1 | grep "^pinned" &
python3 tools/device/jitter37.py --mib 9 --api-s 16 2>&1 | grep -vi warn
wait
# the same pinning beside mapped reads of 108 MiB (a decode step's misses read in place)
python3 tools/device/jitter37.py --pin-mib 785 --pin-count 5 --pin-every-s 2.5 2>&1 | grep "^pinned" &
python3 tools/device/jitter37.py --mib 108 --mapped-s 16 2>&1 | grep -vi warn
wait
