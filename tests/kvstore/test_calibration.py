"""Calibration statistics and their versioned artifact (DESIGN 1.2): what calibrate computes, streaming
equals one-shot, calibration_id, save/load round trip, and rejection of bad artifacts."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from planekv.kvstore import Calibration, CalibrationBuilder, CalibrationError, calibrate
from planekv.kvstore.calibration import CALIBRATION_VERSION, SIGMA_FLOOR
from planekv.kvstore.transform import HadamardSign

SEED_K, SEED_V = 101, 202


def _sample(gen: torch.Generator, layers: int = 2, heads: int = 2, t: int = 300, d: int = 64):
    k = torch.randn(layers, heads, t, d, generator=gen) * 3 + torch.randn(layers, heads, 1, d, generator=gen)
    v = torch.randn(layers, heads, t, d, generator=gen) * 0.5
    return k, v


def _calib(gen: torch.Generator) -> Calibration:
    k, v = _sample(gen)
    return calibrate(k, v, SEED_K, SEED_V, meta={"source": "test", "n": 3})


def _payload(c: Calibration, **override) -> dict:
    """The artifact's documented contents (module docstring + save())."""
    data = {"format": "planekv-calibration", "version": CALIBRATION_VERSION, "calibration_id": c.calibration_id,
            "seed_k": c.seed_k, "seed_v": c.seed_v, "meta_json": json.dumps(c.meta, sort_keys=True),
            "mu_k": c.mu_k, "sigma_k": c.sigma_k, "mu_v": c.mu_v, "sigma_v": c.sigma_v}
    data.update(override)
    return data


def _write(path: Path, data: dict) -> Path:
    torch.save(data, path)
    return path


def _assert_same(a: Calibration, b: Calibration) -> None:
    assert a.calibration_id == b.calibration_id
    for name in ("mu_k", "sigma_k", "mu_v", "sigma_v"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert (a.seed_k, a.seed_v, a.meta) == (b.seed_k, b.seed_v, b.meta)


def test_calibrate_statistics(gen):
    k, v = _sample(gen)
    c = calibrate(k, v, SEED_K, SEED_V)
    assert c.mu_k.shape == (2, 2, 64) and c.mu_k.dtype == torch.float32
    kt = HadamardSign(64, SEED_K).forward(k.double())
    vt = HadamardSign(64, SEED_V).forward(v.double())
    torch.testing.assert_close(c.mu_k, kt.mean(2).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c.sigma_k, kt.std(2, correction=0).float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c.mu_v, vt.mean(2).float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c.sigma_v, vt.std(2, correction=0).float(), rtol=1e-5, atol=1e-6)
    assert c.meta["n_tokens"] == 300
    assert (c.n_layers, c.n_kv_heads, c.head_dim) == (2, 2, 64)


def test_statistics_are_of_transformed_data(gen):
    """K and V use their own signs: swapping the seeds changes the statistics."""
    k, v = _sample(gen, layers=1)
    a = calibrate(k, v, SEED_K, SEED_V)
    b = calibrate(k, v, SEED_V, SEED_K)
    assert not torch.allclose(a.mu_k, b.mu_k)


def test_builder_streaming_equals_calibrate(gen):
    k, v = _sample(gen, layers=3, t=257)
    whole = calibrate(k, v, SEED_K, SEED_V)
    b = CalibrationBuilder(3, 2, 64, SEED_K, SEED_V)
    cuts = [0, 1, 50, 51, 200, 257]
    # layers interleaved, uneven chunks, half precision input promoted
    for s, e in pairwise(cuts):
        for layer in (2, 0, 1):
            b.add(layer, k[layer, :, s:e], v[layer, :, s:e])
    streamed = b.build()
    for name in ("mu_k", "sigma_k", "mu_v", "sigma_v"):
        torch.testing.assert_close(getattr(streamed, name), getattr(whole, name), rtol=1e-6, atol=1e-7)
    assert streamed.meta["n_tokens"] == 257


def test_builder_rejects_bad_input(gen):
    b = CalibrationBuilder(2, 2, 64, SEED_K, SEED_V)
    with pytest.raises(CalibrationError):
        b.add(0, torch.zeros(3, 10, 64), torch.zeros(3, 10, 64))
    with pytest.raises(CalibrationError):
        b.add(0, torch.zeros(2, 10, 64), torch.zeros(2, 11, 64))
    with pytest.raises(CalibrationError):
        b.add(0, torch.zeros(2, 10, 32), torch.zeros(2, 10, 32))
    b.add(0, torch.randn(2, 10, 64, generator=gen), torch.randn(2, 10, 64, generator=gen))
    with pytest.raises(CalibrationError):  # layer 1 saw nothing
        b.build()
    b.add(1, torch.randn(2, 1, 64, generator=gen), torch.randn(2, 1, 64, generator=gen))
    with pytest.raises(CalibrationError):  # layer 1 saw one token
        b.build()


def test_sigma_floor_for_dead_channels():
    k = torch.zeros(1, 1, 16, 64)
    v = torch.ones(1, 1, 16, 64)
    c = calibrate(k, v, SEED_K, SEED_V)
    assert torch.equal(c.sigma_k, torch.full_like(c.sigma_k, SIGMA_FLOOR))
    assert bool((c.sigma_v > 0).all()) and bool(torch.isfinite(c.sigma_v).all())


def test_calibration_id(gen):
    c = _calib(gen)
    cid = c.calibration_id
    assert len(cid) == 16 and int(cid, 16) >= 0
    same = Calibration(c.mu_k.clone(), c.sigma_k.clone(), c.mu_v.clone(), c.sigma_v.clone(), c.seed_k, c.seed_v,
                       meta={"other": "meta"})
    assert same.calibration_id == cid  # meta is not part of what decodes
    for name in ("mu_k", "sigma_k", "mu_v", "sigma_v"):
        tensors = {n: getattr(c, n).clone() for n in ("mu_k", "sigma_k", "mu_v", "sigma_v")}
        tensors[name][0, 0, 0] += 0.25
        assert Calibration(**tensors, seed_k=c.seed_k, seed_v=c.seed_v).calibration_id != cid
    assert Calibration(c.mu_k, c.sigma_k, c.mu_v, c.sigma_v, c.seed_k + 1, c.seed_v).calibration_id != cid
    assert Calibration(c.mu_k, c.sigma_k, c.mu_v, c.sigma_v, c.seed_k, c.seed_v + 1).calibration_id != cid
    assert c.nbytes() == 4 * 4 * 2 * 2 * 64


def test_calibration_validates():
    z = torch.zeros(1, 2, 8)
    o = torch.ones(1, 2, 8)
    with pytest.raises(CalibrationError):
        Calibration(torch.zeros(2, 8), torch.ones(2, 8), torch.zeros(2, 8), torch.ones(2, 8), 1, 2)
    with pytest.raises(CalibrationError):
        Calibration(z, o, z, torch.ones(1, 2, 4), 1, 2)
    with pytest.raises(CalibrationError):
        Calibration(z, o * 0, z, o, 1, 2)
    with pytest.raises(CalibrationError):
        Calibration(z, o, z, -o, 1, 2)
    with pytest.raises(CalibrationError):
        Calibration(z + float("nan"), o, z, o, 1, 2)
    with pytest.raises(CalibrationError):
        Calibration(z, o + float("inf"), z, o, 1, 2)
    c = Calibration(z.double(), o.double(), z, o, 1, 2)
    assert c.mu_k.dtype == torch.float32


def test_save_load_roundtrip(gen, tmp_path):
    c = _calib(gen)
    path = c.save(tmp_path / "sub" / "calib.pt")
    assert path.exists()
    loaded = Calibration.load(path)
    _assert_same(loaded, c)
    # no temporary files left behind
    assert [p.name for p in path.parent.iterdir()] == ["calib.pt"]


def test_bytes_roundtrip(gen):
    c = _calib(gen)
    _assert_same(Calibration.from_bytes(c.to_bytes()), c)


def test_load_of_a_documented_artifact(gen, tmp_path):
    c = _calib(gen)
    _assert_same(Calibration.load(_write(tmp_path / "c.pt", _payload(c))), c)


def test_load_missing_file(tmp_path):
    with pytest.raises(CalibrationError):
        Calibration.load(tmp_path / "nope.pt")


def test_load_garbage(tmp_path):
    p = tmp_path / "garbage.pt"
    p.write_bytes(b"this is not a torch file" * 10)
    with pytest.raises(CalibrationError):
        Calibration.load(p)
    p.write_bytes(b"")
    with pytest.raises(CalibrationError):
        Calibration.load(p)


def test_load_truncated(gen, tmp_path):
    c = _calib(gen)
    p = _write(tmp_path / "c.pt", _payload(c))
    blob = p.read_bytes()
    for cut in (len(blob) // 2, len(blob) - 30, 100):
        q = tmp_path / f"trunc{cut}.pt"
        q.write_bytes(blob[:cut])
        with pytest.raises(CalibrationError):
            Calibration.load(q)


def test_load_corrupted_bytes(gen, tmp_path):
    c = _calib(gen)
    p = _write(tmp_path / "c.pt", _payload(c))
    blob = bytearray(p.read_bytes())
    # flip bytes in the middle (tensor data or zip records): must never load silently different stats
    for i in range(len(blob) // 3, len(blob) // 3 + 64):
        blob[i] ^= 0xFF
    q = tmp_path / "flipped.pt"
    q.write_bytes(bytes(blob))
    try:
        loaded = Calibration.load(q)
    except CalibrationError:
        return
    _assert_same(loaded, c)


@pytest.mark.parametrize("version", [CALIBRATION_VERSION + 1, 0, None, "1"])
def test_load_wrong_version(gen, tmp_path, version):
    c = _calib(gen)
    with pytest.raises(CalibrationError):
        Calibration.load(_write(tmp_path / "c.pt", _payload(c, version=version)))


def test_load_wrong_format_tag(gen, tmp_path):
    c = _calib(gen)
    with pytest.raises(CalibrationError):
        Calibration.load(_write(tmp_path / "c.pt", _payload(c, format="planekv-cache")))
    with pytest.raises(CalibrationError):
        Calibration.load(_write(tmp_path / "list.pt", [1, 2, 3]))  # type: ignore[arg-type]


def test_load_tampered_statistics(gen, tmp_path):
    c = _calib(gen)
    with pytest.raises(CalibrationError):
        Calibration.load(_write(tmp_path / "c.pt", _payload(c, mu_k=c.mu_k + 1.0)))
    with pytest.raises(CalibrationError):
        Calibration.load(_write(tmp_path / "d.pt", _payload(c, seed_k=c.seed_k + 1)))
    with pytest.raises(CalibrationError):
        Calibration.load(_write(tmp_path / "e.pt", _payload(c, sigma_v=-c.sigma_v)))


@pytest.mark.parametrize("field", ["seed_k", "mu_v", "meta_json", "calibration_id"])
def test_load_artifact_missing_a_field(gen, tmp_path, field):
    """A malformed artifact is a CalibrationError ("anything unexpected"), not a KeyError."""
    c = _calib(gen)
    data = _payload(c)
    del data[field]
    with pytest.raises(CalibrationError):
        Calibration.load(_write(tmp_path / "c.pt", data))


def test_load_artifact_with_malformed_fields(gen, tmp_path):
    c = _calib(gen)
    with pytest.raises(CalibrationError):
        Calibration.load(_write(tmp_path / "a.pt", _payload(c, meta_json="{not json")))
    with pytest.raises(CalibrationError):
        Calibration.load(_write(tmp_path / "b.pt", _payload(c, mu_k=[0.0, 1.0])))
