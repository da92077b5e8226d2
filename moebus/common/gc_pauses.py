"""Python's cyclic garbage collector stops its process for as long as a collection takes: in a GPU worker
between or inside two steps, in the broker between two tokens of every stream, in a client between a
token's arrival and its time. A full collection walks every object the process holds, most of them made
at its start (the model's arrays and kernels, the tokenizer) and never freed.

- ``MOEBUS_LOG_GC_MS=N`` (default 0: off): a collection that took more than N ms is logged with its
  generation, so a text stream's long gap that no step explains names its cause (issue 20;
  tools/device/gap15.sh).
- ``MOEBUS_GC_FREEZE`` (default 1; 0: off): once a process has started (a GPU worker at READY, the broker
  before its loop), ``gc.freeze()`` moves what it holds to the permanent generation: later collections
  walk only what was made since. H200, fifteenth session (8 x 128 A3B LLaVA cycle): a GPU worker's full
  collections took 231-327 ms without it (four in 10 s while text streams decoded) and 18-51 ms with it
  (351,240 objects frozen); a 51 ms one still fell inside a prompt chunk's step (the chunk's steps leave
  ~160,000 objects in cycles)."""
from __future__ import annotations

import gc
import logging
import os
import time


def watch(log: logging.Logger, who: str) -> None:
    """At the end of a process's start: freeze what it holds (MOEBUS_GC_FREEZE), log long collections."""
    if os.environ.get("MOEBUS_GC_FREEZE", "1") == "1":
        started = time.perf_counter()
        gc.collect()  # what the start left unreachable goes now, not frozen for good
        took_ms = 1e3 * (time.perf_counter() - started)  # what a full collection costs this process now
        gc.freeze()
        log.info("%s: %d objects frozen out of the garbage collector's walks (a full collection took %.1f ms)",
                 who, gc.get_freeze_count(), took_ms)
    log_long_collections(log, who)


def log_long_collections(log: logging.Logger, who: str, threshold_ms: float | None = None) -> bool:
    """Log each collection of this process longer than ``threshold_ms`` (None: MOEBUS_LOG_GC_MS);
    False when off."""
    if threshold_ms is None:
        threshold_ms = float(os.environ.get("MOEBUS_LOG_GC_MS", "0") or 0)
    if threshold_ms <= 0:
        return False
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif (took_ms := 1e3 * (time.perf_counter() - started[0])) > threshold_ms:
            log.info("%s: a garbage collection of generation %d took %.1f ms (%d objects collected)", who,
                     info["generation"], took_ms, info["collected"])
    gc.callbacks.append(timed)
    return True
