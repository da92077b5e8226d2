import pytest

from moebus.broker.launch import layer_ranges
from moebus.common.errors import ConfigError
from moebus.common.layer_split import proportional_split, split_layers
from moebus.common.settings import load_settings


def test_split_layers_is_contiguous_and_covers_the_model():
    assert split_layers(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]
    assert split_layers(48, [24, 24]) == [range(0, 24), range(24, 48)]
    with pytest.raises(ValueError):
        split_layers(8, [4, 3])


@pytest.mark.parametrize("layers,weights,want", [
    (48, [80, 80], [24, 24]), (8, [56, 56], [4, 4]), (4, [24, 16, 16], [2, 1, 1]), (3, [1, 100], [1, 2]),
    (10, [3, 1], [8, 2]),
])
def test_proportional_split(layers, weights, want):
    assert proportional_split(layers, weights) == want


def test_layer_ranges_from_settings():
    cpu = load_settings(emulated_vram_mib=[64, 32], device="cpu")
    assert layer_ranges(cpu, 6, "cpu") == [range(0, 4), range(4, 6)]
    explicit = load_settings(emulated_vram_mib=[64, 32], layer_split=[1, 5], device="cpu")
    assert layer_ranges(explicit, 6, "cpu") == [range(0, 1), range(1, 6)]
    for bad in ([3, 2], [6], [0, 6]):
        with pytest.raises(ConfigError, match="layer_split"):
            layer_ranges(load_settings(emulated_vram_mib=[64, 32], layer_split=bad, device="cpu"), 6, "cpu")
    with pytest.raises(ConfigError, match="at least one layer per GPU"):
        layer_ranges(load_settings(emulated_vram_mib=[8, 8, 8], device="cpu"), 2, "cpu")
