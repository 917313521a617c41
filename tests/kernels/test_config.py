"""ReaderConfig: every field checked when the config is made (a clear error naming the field and what it takes),
and the rules that turn "auto" into one step shape's choices (planekv.kernels.config.resolve)."""

from __future__ import annotations

import dataclasses

import pytest

from planekv.kernels import ReaderConfig, TritonReader
from planekv.kernels.config import Target, resolve
from planekv.kvstore import ReadPolicy

from .test_reader import _setup

H200 = Target(True, 132)
CPU = Target(False, 132)


@pytest.mark.parametrize("field,bad", [
    ("assembly", "serial"), ("assembly", "lut"), ("key_int8", "auto"), ("value_int8", "sometimes"),
    ("compact_values", 1), ("fuse_transforms", "always"), ("value_alloc", "sort"), ("prep_radix", None),
    ("key_walk", 2), ("cand_cap", 100), ("cand_cap", 1), ("exact_split", 48), ("exact_split", -1),
    ("exact_keep", 0), ("sample_slack", float("nan")), ("sample_z", -1.0), ("gated_splits", 0),
    ("num_warps", 3), ("alloc_warps", 3), ("batch_streams", 0), ("batch_streams", 1.5), ("batch_streams", True),
    ("stream_priority", 1),
])
def test_bad_values_are_refused_when_the_config_is_made(field: str, bad: object) -> None:
    with pytest.raises(ValueError, match=f"ReaderConfig.{field} must be"):
        ReaderConfig(**{field: bad})


def test_the_config_is_frozen_and_its_defaults_are_valid() -> None:
    cfg = ReaderConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_warps = 8  # type: ignore[misc]
    assert dataclasses.replace(cfg, num_warps=8).num_warps == 8
    assert set(ReaderConfig.field_names()) == {f.name for f in dataclasses.fields(ReaderConfig)}


def test_value_allocation_and_launch_widths_follow_the_step_size() -> None:
    """Two-pass from 2^19 (sequence, KV head, token) triples; 4 allocation warps from 2^22, else 8; explicit
    choices win; the two-pass histogram counts 1 in 16 tokens (one run of 8 per block at most) and the
    candidate buffer holds 65536 keys, fewer for smaller groups."""
    codec, _, _ = _setup(seed=1, lengths=[64])  # 2 KV heads, d = 64
    auto = TritonReader(codec, ReadPolicy.flexible(2.0))
    small, large = auto.choices(1, 4096, "cpu"), auto.choices(256, 8192, "cpu")
    assert not small.two_pass and large.two_pass and small.sample == 1 and large.sample == 16
    assert TritonReader(codec, ReadPolicy.flexible(2.0), ReaderConfig(value_alloc="two-pass")).choices(
        1, 64, "cpu").two_pass
    assert auto.choices(64, 32768, "cpu").alloc_warps == 4 and auto.choices(4, 8192, "cpu").alloc_warps == 8
    assert TritonReader(codec, ReadPolicy.flexible(2.0), ReaderConfig(alloc_warps=8)).choices(
        64, 32768, "cpu").alloc_warps == 8
    assert auto.choices(256, 8192, "cpu", block_tokens=64).sample == 8  # 64 tokens: one run of 8
    assert large.cand_cap == 65536 and auto.choices(1, 64, "cpu").cand_cap < 65536
    assert TritonReader(codec, ReadPolicy.flexible(2.0), ReaderConfig(cand_cap=8)).choices(1, 64, "cpu").cand_cap == 8


def test_key_allocation_by_radix_passes_for_small_groups() -> None:
    """prep_radix="auto": 8 radix passes for groups of <= 2048 keys, the 32-step bisection above."""
    codec, _, _ = _setup(seed=1, lengths=[64])
    assert TritonReader(codec, ReadPolicy.flexible(2.0)).choices(1, 64, "cpu").prep_radix  # 2 x 64 x 8 = 1024 keys
    big = _setup(seed=1, lengths=[64], hq=16, hk=8, d=128)[0]
    assert not TritonReader(big, ReadPolicy.flexible(2.0)).choices(1, 64, "cpu").prep_radix  # 8 x 128 x 8
    assert TritonReader(big, ReadPolicy.constrained(2.0)).choices(1, 64, "cpu").prep_radix  # one head per group
    forced = TritonReader(big, ReadPolicy.flexible(2.0), ReaderConfig(prep_radix=True))
    assert forced.choices(1, 64, "cpu").prep_radix


def test_split_exact_pass_where_few_groups_hold_many_candidates() -> None:
    """exact_split="auto": programs of 4096 candidates where groups x programs make at most 4 per SM (the
    flexible reader's 32 groups at B = 32), one program per group otherwise (the constrained reader's 256)."""
    big = _setup(seed=1, lengths=[64], hq=32, hk=8, d=128)[0]
    flex = resolve(ReaderConfig(), TritonReader(big, ReadPolicy.flexible(2.0)).shape, 32, 32768, H200)
    cons = resolve(ReaderConfig(), TritonReader(big, ReadPolicy.constrained(2.0)).shape, 32, 32768, H200)
    assert flex.two_pass and flex.exact_chunk == 4096
    assert cons.two_pass and cons.exact_chunk == 0
    one = ReaderConfig(exact_split=0)
    assert resolve(one, TritonReader(big, ReadPolicy.flexible(2.0)).shape, 32, 32768, H200).exact_chunk == 0


def test_program_sizes_and_choices_of_small_and_large_steps() -> None:
    """A step with fewer than two 1024-token programs per SM is small: 128-token FMA Key programs and
    256-token Value blocks; a large one 1024 and 1024. The Full Reader never allocates."""
    codec, _, _ = _setup(seed=1, lengths=[64], hq=32, hk=8, d=128)
    shape = TritonReader(codec, ReadPolicy.flexible(2.0)).shape
    b1 = resolve(ReaderConfig(), shape, 1, 8192, H200)
    b32 = resolve(ReaderConfig(), shape, 32, 32768, H200)
    assert b1.small and (b1.pages_per_program, b1.block_tokens) == (2, 256)
    assert not b32.small and (b32.pages_per_program, b32.block_tokens) == (16, 1024)
    assert (b1.key_stage, b1.value_stage, b32.key_stage, b32.value_stage) == ("fma", "fma", "fma", "fma")
    full = TritonReader(codec, fixed_depth=4).shape
    assert not resolve(ReaderConfig(), full, 32, 32768, H200).two_pass
    with pytest.raises(ValueError, match="pages_per_program"):
        resolve(ReaderConfig(), shape, 1, 64, CPU, pages_per_program=3)
    with pytest.raises(ValueError, match="block_tokens"):
        resolve(ReaderConfig(), shape, 1, 64, CPU, block_tokens=100)
    with pytest.raises(ValueError, match="2048"):
        resolve(ReaderConfig(), shape, 1, 8192, CPU, block_tokens=4096)
    with pytest.raises(ValueError, match="batch >= 1"):
        TritonReader(codec, ReadPolicy.flexible(2.0)).plan(0, 64, "cpu")
