"""PYTORCH_CUDA_ALLOC_CONF parsing: PyTorch's syntax and limits, clear errors."""

from __future__ import annotations

import dataclasses

import pytest

from telemetry.model.allocsim.config import SIZE_MAX, AllocatorConfigError, parse_alloc_conf

MIB = 1024 * 1024


def test_empty_is_the_defaults():
    config = parse_alloc_conf("")
    assert config.max_split_size == SIZE_MAX
    assert config.max_non_split_rounding_size == 20 * MIB
    assert config.roundup_power2_divisions == (0,) * 16
    assert not config.expandable_segments


def test_every_modelled_key():
    config = parse_alloc_conf(
        " max_split_size_mb:256, max_non_split_rounding_mb:64,garbage_collection_threshold:0.6,"
        "expandable_segments:True,roundup_power2_divisions:4,per_process_memory_fraction:0.5,backend:native"
    )
    assert config.max_split_size == 256 * MIB
    assert config.max_non_split_rounding_size == 64 * MIB
    assert config.garbage_collection_threshold == 0.6
    assert config.expandable_segments
    assert config.roundup_power2_divisions == (4,) * 16
    assert config.per_process_memory_fraction == 0.5


def test_roundup_list_form():
    config = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert config.roundup_power2_divisions[:8] == (1,) * 8
    assert config.roundup_power2_divisions[8:11] == (1, 2, 4)
    assert config.roundup_power2_divisions[11:] == (8,) * 5
    assert config.divisions_for(1200 * MIB) == 4
    assert config.divisions_for(100) == 1


def test_ignored_keys_are_accepted_and_change_nothing_the_simulator_models():
    config = parse_alloc_conf("release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:False")
    assert dataclasses.replace(config, source="") == parse_alloc_conf("")


@pytest.mark.parametrize(
    "text, words",
    [
        ("max_split_size_mb:5", ["max_split_size_mb", ">= 20"]),
        ("max_split_size_mb:lots", ["max_split_size_mb", "'lots'"]),
        ("expandable_segments:true", ["True/False", "expandable_segments"]),
        ("roundup_power2_divisions:3", ["power of 2"]),
        ("roundup_power2_divisions:[100:2]", ["intervals", "power of 2"]),
        ("roundup_power2_divisions:[256:2", ["']'"]),
        ("garbage_collection_threshold:1.5", ["(0.0, 1.0)"]),
        ("max_split_size_mb", ["':'", "max_split_size_mb"]),
        ("max_split_size_mb:", ["value", "max_split_size_mb"]),
        ("expandable_segment:True", ["unrecognized", "expandable_segment"]),
        ("backend:cudaMallocAsync", ["cudaMallocAsync"]),
        ("expandable_segments:True,", ["trailing"]),
        # spaces are dropped, as in PyTorch
        ("expandable_segments:True max_split_size_mb:30", ["True/False", "Truemax_split_size_mb"]),
    ],
)
def test_bad_configs_name_the_problem(text, words):
    with pytest.raises(AllocatorConfigError) as info:
        parse_alloc_conf(text)
    message = str(info.value)
    assert repr(text) in message
    for word in words:
        assert word in message
