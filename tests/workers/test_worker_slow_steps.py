"""A GPU worker logs a decode step far slower than its recent ones (where a text stream's gap came
from, e.g. a vision worker starting on the same GPU), and nothing for steps of the usual time."""
import logging

from moebus.workers.gpu_worker import GpuWorker


def test_only_a_step_far_above_the_recent_median_is_logged(caplog):
    worker = GpuWorker(stage=None, link=None, gpu=0)
    with caplog.at_level(logging.INFO, logger="moebus.worker"):
        for i in range(7):
            worker.note_decode(i, 2, 0.5)  # fewer than 8 known: no median to compare with yet
        for i in range(7, 20):
            worker.note_decode(i, 2, 0.008 if i != 15 else 0.015)  # 1.9x: within the factor
        worker.note_decode(20, 2, 0.085)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["gpu0: decode step 20 took 85.0 ms (batch 2; median of the last 20: 8.0 ms)"], lines


def test_a_slow_info_and_a_step_long_after_the_last_are_logged(caplog, monkeypatch):
    """Where a gap is not a slow step: an INFO served between two steps (it holds the next one; its
    driver call named), or the worker without a step (the broker's time). Short ones are not logged."""
    from moebus.workers import gpu_worker

    worker = GpuWorker(stage=None, link=None, gpu=0)
    worker.driver_info_s = 0.0184
    clock = iter([1.0, 1.002, 2.0, 2.021])  # two INFOs: 2 ms, then 21 ms
    monkeypatch.setattr(gpu_worker.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(worker, "stats", lambda: {})
    with caplog.at_level(logging.INFO, logger="moebus.worker"):
        worker.info()
        worker.info()
        assert worker.note_idle(7, 5.0) is None  # the first step: nothing before it
        worker.last_step_end_s = 5.0
        assert round(worker.note_idle(8, 5.004), 6) == 0.004
        worker.last_step_end_s = 6.0
        worker.note_idle(9, 6.0255)
        worker.note_idle(10, 9.0)  # a worker idle between requests: not a gap of a stream
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["gpu0: INFO took 21.0 ms (the driver's free memory 18.4 ms)",
                     "gpu0: step 9 came 25.5 ms after the last one ended"], lines


def test_an_info_just_after_a_reserve_was_set_asks_the_driver_nothing():
    """On cuda, for RESERVE_KEPT_S after a VRAM request set a reserve (a vision worker makes its context
    then), INFO gives that request's sizes and driver figures; later, or after a bare VRAM, it asks again."""
    from types import SimpleNamespace

    from moebus.common.protocol import Vram, VramReply

    experts = SimpleNamespace(stats=lambda report=None: {"hits": 1, **(report or {"free_mib": 99.0})}, resize=None)
    stage = SimpleNamespace(ops=SimpleNamespace(name="cuda"), experts=experts, chunks_spanned=0, chunk_steps=0,
                            chunks_dropped=0, attention_dtype="bf16", lm_head_dtype="bf16", is_last=True,
                            use_graphs=False, graphs={}, graph_captures=0,
                            eager_short_steps=0)
    worker = GpuWorker(stage=stage, link=SimpleNamespace(dropped_messages=0), gpu=0)
    calls = []
    worker.driver_figures = lambda: calls.append(1) or {"max_free_mib": 5.0, "device_free_mib": 7.0 + len(calls)}
    reply = VramReply(id="1", reserve_mib=100, free_mib=120, expert_slots=10, expert_cache_mib=90)
    worker.keep_reserve_figures(Vram(reserve_mib=100), reply)  # the hand-back's last request: read here
    assert len(calls) == 1
    stats = worker.stats()  # the cold start's mark: no driver call
    assert len(calls) == 1 and stats["free_mib"] == 120 and stats["device_free_mib"] == 8.0 and "at" not in stats
    worker.keep_reserve_figures(Vram(query=True), reply)  # a query refreshes them
    assert len(calls) == 2 and worker.stats()["device_free_mib"] == 9.0
    worker.reserve_figures["at"] -= 10  # the window is over: the driver again
    assert worker.stats()["free_mib"] == 99.0 and len(calls) == 3 and worker.reserve_figures is None
    worker.keep_reserve_figures(Vram(reserve_mib=100), reply)
    worker.keep_reserve_figures(Vram(reserve_mib=None), reply)  # bare: back to start-up sizes, ask the driver
    assert worker.reserve_figures is None
    stage.ops.name = "cpu"  # the emulated ledger costs nothing to ask
    worker.keep_reserve_figures(Vram(reserve_mib=100), reply)
    assert worker.reserve_figures is None


def test_the_step_line_counts_the_cache_misses_and_pcie_bytes_between_two_reads():
    """MOEBUS_LOG_STEPS' line gives a step's misses and MiB over PCIe: the cache's counters read before and
    after it; a stage whose every expert is resident (no counters) reads 0, 0."""
    from types import SimpleNamespace

    import numpy as np

    experts = SimpleNamespace(misses=3, h2d_bytes=5 << 20)
    worker = GpuWorker(stage=SimpleNamespace(experts=experts), link=None, gpu=0)
    before = worker.cache_counts()
    experts.misses, experts.h2d_bytes = 10, 40 << 20
    assert tuple(int(v) for v in np.subtract(worker.cache_counts(), before)) == (7, 35 << 20)
    assert GpuWorker(stage=SimpleNamespace(experts=object()), link=None, gpu=0).cache_counts() == (0, 0)


def test_a_hand_back_steps_line_says_where_the_room_went():
    """The VRAM line's tail: free MiB before and after the request, the step scratch pool's MiB and what of it
    went back first (cuda); a bare VRAM (no free read before) gives the pool's figures alone; cpu only the free."""
    from types import SimpleNamespace

    pool = SimpleNamespace(allocated_bytes=96 << 20)
    worker = GpuWorker(stage=SimpleNamespace(ops=SimpleNamespace(device_pool=pool)), link=None, gpu=0)
    assert worker.room_figures(12.5, 76.5, 470 << 20) == ("; free 12.5 -> 76.5 MiB, step pool 96.0 MiB "
                                                          "(470.0 released first)")
    assert worker.room_figures(None, 76.5, 0) == "; step pool 96.0 MiB (0.0 released first)"
    cpu = GpuWorker(stage=SimpleNamespace(ops=SimpleNamespace()), link=None, gpu=0)
    assert cpu.room_figures(0.0, 64.0, 0) == "; free 0.0 -> 64.0 MiB"
    assert cpu.room_figures(None, 64.0, 0) == ""
