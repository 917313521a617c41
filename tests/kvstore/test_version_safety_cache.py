"""Version safety in the cache and the block frame (issue 32, item 6).

Each change a deployment can make -- a model upgrade (model_id, model_revision), a new calibration, W, the
page size, the codebook, v_run -- gives a different FormatSpec.format_id, and data written under the old
format is refused under the new one with FormatMismatch, never read as if it were the new format:
a PlaneKVCache and a TieredCache read through readkv_decode, a saved cache file loaded, a Codec built
from another format's calibration, and a block frame decoded expecting the new format's key."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from planekv.kvstore import Calibration, Codec, FormatMismatch, PlaneKVCache, ReadPolicy
from planekv.kvstore.reference import readkv_decode
from planekv.kvstore.synthetic import make_synthetic
from planekv.tiering import BlockKey, PlacementPolicy, decode_frame, encode_frame, verify_frame
from planekv.tiering.placement import HotPlanes
from planekv.tiering.tiered_cache import TieredCache

N_TOKENS = 150  # two sealed 64-token pages and an open one


@pytest.fixture(scope="module")
def old():
    """Format A: a synthetic model's codec, its codes and a query."""
    syn = make_synthetic(n_tokens=N_TOKENS, n_rows=1, n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=32, seed=5)
    codec = Codec(syn.spec, syn.calibration)
    kc, vc = codec.encode_k(syn.k[0], 0), codec.encode_v(syn.v[0], 0)  # [Hkv, n, d] of row 0
    q = syn.q[0].transpose(0, 1).contiguous()  # [1, Hq, d]: one decode step of one sequence
    return codec, kc[None], vc[None], q


def _other_calibration(c: Calibration) -> Calibration:
    return Calibration(c.mu_k + 0.25, c.sigma_k, c.mu_v, c.sigma_v * 1.5, c.seed_k, c.seed_v)


def _changed(codec: Codec, change: str) -> Codec:
    """The codec of format B: format A with one change of the given class."""
    spec, calib = codec.spec, codec.calibration
    if change == "calibration":
        calib = _other_calibration(calib)
        return Codec(dataclasses.replace(spec, calibration_id=calib.calibration_id), calib)
    field, value = {
        "model_id": ("model_id", spec.model_id + "-v2"),
        "model_revision": ("model_revision", "rev-2"),
        "width": ("width", 6),
        "page_size": ("page_size", 128),
        "codebook": ("codebook", "uniform-linear-c3"),
        "v_run": ("v_run", 2),
    }[change]
    assert getattr(spec, field) != value
    return Codec(dataclasses.replace(spec, **{field: value}), calib)


CHANGES = ["model_id", "model_revision", "calibration", "width", "page_size", "codebook", "v_run"]


def test_every_change_class_gives_a_distinct_format_id(old):
    codec = old[0]
    ids = {"original": codec.format_id}
    for change in CHANGES:
        ids[change] = _changed(codec, change).format_id
    assert len(set(ids.values())) == len(ids), ids  # all distinct, from the original and from each other


@pytest.mark.parametrize("change", CHANGES)
def test_a_plane_cache_of_the_old_format_refuses_reads_under_the_new(old, change, tmp_path):
    codec, kc, vc, q = old
    new = _changed(codec, change)
    cache = PlaneKVCache(codec.spec, 1, initial_pages=4)
    cache.append(0, kc, vc)
    # the old codec reads it
    out, _ = readkv_decode(q, cache, 0, codec, ReadPolicy.flexible(4.0))
    assert torch.isfinite(out).all()
    # the new one is refused, in memory and from a saved file
    cache.check_format(codec.format_id)
    with pytest.raises(FormatMismatch, match=codec.format_id):
        cache.check_format(new.format_id)
    with pytest.raises(FormatMismatch):
        readkv_decode(q, cache, 0, new, ReadPolicy.flexible(4.0))
    path = cache.save(tmp_path / "cache.pt")
    assert PlaneKVCache.load(path, codec.spec).length(0, 0) == N_TOKENS
    with pytest.raises(FormatMismatch):
        PlaneKVCache.load(path, new.spec)


@pytest.mark.parametrize("change", CHANGES)
def test_a_tiered_cache_of_the_old_format_refuses_reads_under_the_new(old, change):
    codec, kc, vc, q = old
    new = _changed(codec, change)
    policy = PlacementPolicy(hot_planes=HotPlanes(k=4, v=2), block_bytes=1 << 20)
    tiered = TieredCache(codec.spec, 1, policy, max_tokens=256)
    tiered.append(0, kc[0], vc[0], seq=0)
    tiered.check_format(codec.format_id)
    with pytest.raises(FormatMismatch, match=codec.format_id):
        tiered.check_format(new.format_id)
    with pytest.raises(FormatMismatch):
        readkv_decode(q, tiered, 0, new, ReadPolicy.flexible(4.0))
    # a placement policy bound to the old format (its W matching the new one, so only the binding differs) is
    # refused by a cache of the new format
    bound = PlacementPolicy(width=new.spec.width, hot_planes=HotPlanes(k=4, v=2), block_bytes=1 << 20,
                            format_id=codec.format_id)
    with pytest.raises(FormatMismatch):
        TieredCache(new.spec, 1, bound, max_tokens=256)


def test_a_codec_refuses_a_calibration_of_another_format(old):
    codec = old[0]
    with pytest.raises(FormatMismatch):
        Codec(codec.spec, _other_calibration(codec.calibration))


@pytest.mark.parametrize("change", CHANGES)
def test_a_frame_of_the_old_format_is_refused_under_the_new(old, change):
    codec = old[0]
    new = _changed(codec, change)
    key_a = BlockKey(codec.format_id, "seq-1", "k", 0, 1, 0, 2, 4, 8)
    key_b = dataclasses.replace(key_a, format_id=new.format_id)
    payload = bytes(range(256)) * 40
    frame = encode_frame(key_a, payload)
    assert bytes(decode_frame(frame, key_a)[1]) == payload
    with pytest.raises(FormatMismatch, match=new.format_id):
        decode_frame(frame, key_b)
    with pytest.raises(FormatMismatch):
        verify_frame(frame, key_b)
