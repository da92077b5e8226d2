"""Where the vision worker goes (broker/vision_placement.py): auto picks a GPU whose cache can make
room, leaving the most; a fixed GPU is checked; when none can, the problem names the MiB missing on
each GPU and the setting that changes it; on cuda a start's measured footprint sizes the next
hand-back there."""
from types import SimpleNamespace

import pytest

from moebus.broker import vision_qwen3vl
from moebus.broker.vision_placement import (MEASURED_MARGIN_MIB, PlacementMixin, default_vram_mib, margin_mib_from_env,
                                            measured_reserve_mib, place, short_of)
from moebus.common import wire
from moebus.common.errors import ConfigError
from moebus.common.protocol import InfoReply

MIB = 1 << 20


def need(values):
    return lambda gpu: values[gpu]


def test_auto_picks_the_gpu_left_with_the_most_room():
    p = place("auto", 2, need([17, 17]), [12.3, 20.3], "cpu")
    assert (p.gpu, p.need_mib, p.problem) == (1, 17, None)
    p = place("auto", 3, need([2, 2, 2]), [10.0, 30.0, 30.0], "cpu")
    assert p.gpu == 1  # a tie goes to the lower index


def test_auto_weighs_each_gpus_own_need():
    assert place("auto", 2, need([1700, 600]), [1800.0, 1000.0], "cuda").gpu == 1  # 400 MiB left there, 100 on gpu0
    assert place("auto", 2, need([1700, 1700]), [1800.0, 1000.0], "cuda").gpu == 0  # the only one that fits


def test_a_fixed_gpu_is_checked_and_the_problem_says_what_changes_it():
    assert place(1, 2, need([17, 17]), [30.0, 20.3], "cpu").gpu == 1
    p = place(0, 2, need([17, 17]), [12.3, 20.3], "cpu")
    assert p.gpu is None and p.need_mib == 17
    assert "gpu0 can free at most 12.3 MiB of the 17.0 MiB it needs there (4.7 MiB missing)" in p.problem
    assert "vision.gpu: auto would place it on gpu1" in p.problem


def test_when_no_gpu_can_every_gpu_is_named_with_its_shortfall():
    p = place("auto", 2, need([17, 17]), [12.3, 11.0], "cpu")
    assert p.gpu is None
    assert "gpu0 can free at most 12.3 MiB" in p.problem and "gpu1 can free at most 11.0 MiB" in p.problem
    assert "(6.0 MiB missing)" in p.problem and "emulated_vram_mib" in p.problem
    assert "gpu_memory_mib" in place("auto", 1, need([1800]), [900.0], "cuda").problem
    assert p.to_dict() == {"gpu": None, "need_mib": 17, "max_free_mib": [12.3, 11.0], "problem": p.problem}


def test_a_gpu_that_has_not_reported_is_assumed_to_fit():
    assert place("auto", 2, need([17, 17]), [12.3, None], "cpu").gpu == 1
    assert place(0, 2, need([17, 17]), [None, None], "cpu").gpu == 0


def test_a_placed_start_that_found_no_room_says_how_much_was_missing():
    text = short_of(17.0, 12.5, 0, "cpu")
    assert "gpu0 had 12.5 MiB free after the hand-back, 4.5 MiB short of the 17.0 MiB" in text
    assert "vision.gpu" in text and "emulated_vram_mib" in text
    assert short_of(17.0, None, 0, "cpu") == ""


def test_default_reserves_follow_the_vision_gpu():
    assert default_vram_mib("cuda", 2, 1, 0) == [600, 1700]
    assert default_vram_mib("cpu", 2, 1, 15 * (1 << 20) + 1) == [0, 17]


class Lifecycle(PlacementMixin):
    """The state PlacementMixin reads (VisionLifecycle's), for a LLaVA tower on ``num_gpus`` GPUs."""

    def __init__(self, device="cuda", num_gpus=1, vram_mib=None):
        self.settings = SimpleNamespace(device=device)
        self.vision = SimpleNamespace(gpu="auto", vram_mib=vram_mib)
        self.num_gpus, self.placement, self.processor = num_gpus, None, None
        self.config = SimpleNamespace(tower="siglip")
        self.margin_mib = MEASURED_MARGIN_MIB
        self.zygote_info = {"charge_bytes": 1728 * MIB}
        self.measured_bytes = {}


def test_a_measured_start_sizes_the_next_hand_back_on_its_gpu():
    assert measured_reserve_mib(1433 * MIB) == 1505  # 5% above
    assert measured_reserve_mib(200 * MIB) == 216  # at least 16 MiB above (MEASURED_MARGIN_MIB)
    life = Lifecycle(num_gpus=2)
    assert life.reserves(0) == [1700.0, 600.0]  # nothing measured yet: the default
    life.measured_bytes[0] = 1100 * MIB
    assert life.reserves(0) == [1155.0, 600.0] and life._need_mib(0) == 1155.0
    assert life.reserves(1) == [600.0, 1700.0]  # measured on gpu0 only
    assert Lifecycle(vram_mib=[2000]).reserves(0) == [2000.0]  # the operator's setting wins
    cpu = Lifecycle(device="cpu")
    cpu.measured_bytes[0] = 1100 * MIB  # never sent on cpu: the ledger's charge is exact there
    assert cpu.reserves(0) == [1729.0]


def test_before_a_llava_start_is_measured_the_zygotes_reckoning_sizes_the_reserve(monkeypatch):
    monkeypatch.delenv("MOEBUS_CUDA_STACK_BYTES", raising=False)
    life = Lifecycle(num_gpus=2)
    life.zygote_info = {"charge_bytes": 1728 * MIB, "cuda_bytes": 938 * MIB}  # so400m bf16 + an encode's scratch
    # a context at the worker's 64 B stack limit (284 MiB; the H200 measured 277.6) + 938 + 5%: not the 1,700
    assert life.reserves(0) == [1284.0, 600.0]
    # its encoder layers streamed (two on the device), the first encode's 128 MiB of arrays and 116 of loads
    life.zygote_info["cuda_bytes"] = 312 * MIB
    assert life.reserves(0) == [626.0, 600.0]  # the H100's starts measured 602-604 after their first encode: 632
    monkeypatch.setenv("MOEBUS_CUDA_STACK_BYTES", "1024")  # the driver's limit: a 512 MiB context, as the seed's
    assert life.reserves(0) == [866.0, 600.0]
    monkeypatch.setenv("MOEBUS_CUDA_STACK_BYTES", "64k")  # refused at the worker's start; here the driver's
    assert life.reserves(0) == [866.0, 600.0]
    life.measured_bytes[0] = 800 * MIB  # a measured start wins
    assert life.reserves(0) == [840.0, 600.0]
    life.processor = object()  # Qwen3-VL's reserve comes from its tower (vision_qwen3vl.cuda_vision_mib)
    life.measured_bytes.clear()
    life.config = None
    monkeypatch.setattr(vision_qwen3vl, "cuda_vision_mib", lambda cfg, processor: 999)
    assert life.reserves(0) == [999.0, 600.0]


def test_a_first_encodes_measure_replaces_the_starts_reckoned_scratch():
    """A lazy start reckons its first encode's scratch in VISION_READY (the H200: 358 MiB measured + 128
    reckoned = 486); that encode's reply says what the worker then holds, and the next hand-back frees that
    (with the margin before the thirty-second session's default: 64 MiB or 5%)."""
    life = Lifecycle(num_gpus=2)
    life.margin_mib = 64.0
    life.record_measured(0, 486 * MIB, "start")
    assert life.reserves(0)[0] == 550.0
    life.record_measured(0, 0, "start and first encode")  # not measured (cpu, no NVML, a later encode)
    assert life.reserves(0)[0] == 550.0
    life.record_measured(0, 401 * MIB, "start and first encode")
    assert life.reserves(0) == [465.0, 600.0] and life.measured_mib() == [401.0, None]
    life.record_measured(0, 700 * MIB, "start and first encode")  # more than reckoned: the budget holds it
    assert life.reserves(0)[0] == 764.0


def test_the_margin_above_a_measured_footprint_is_a_setting():
    assert margin_mib_from_env({}) == 16 == MEASURED_MARGIN_MIB
    assert margin_mib_from_env({"MOEBUS_VISION_RESERVE_MARGIN_MIB": "16"}) == 16.0
    assert measured_reserve_mib(486 * MIB, 16) == 511  # 5% of 486 (24.3) is the larger
    assert measured_reserve_mib(200 * MIB, 16) == 216 and measured_reserve_mib(200 * MIB, 0) == 210
    life = Lifecycle()
    life.margin_mib = 16.0
    life.record_measured(0, 401 * MIB, "start and first encode")
    assert life.reserves(0) == [422.0]
    for text in ("-1", "x", "nan", "inf"):
        with pytest.raises(ConfigError, match=f"MOEBUS_VISION_RESERVE_MARGIN_MIB must be a number >= 0 .*{text!r}"):
            margin_mib_from_env({"MOEBUS_VISION_RESERVE_MARGIN_MIB": text})


def test_the_measured_figures_travel_in_info_as_a_list_per_gpu():
    life = Lifecycle(num_gpus=2)
    life.measured_bytes[1] = int(1735.6 * MIB)
    assert life.measured_mib() == [None, 1735.6]
    # the seventh session's H200 call: a map keyed by GPU number made every INFO_REPLY undecodable
    # (the wire's maps take string keys only), and the client waited for it until its timeout
    reply = wire.decode(wire.encode(InfoReply(id="i", stats={"vision": {"measured_mib": life.measured_mib(),
                                                                       "vram_mib": life.reserves(1)}})))
    assert reply.stats["vision"] == {"measured_mib": [None, 1735.6], "vram_mib": [600.0, 1823.0]}
