"""Baselines behind one interface (DESIGN 7): shapes, closeness to dense attention, error falling with
bits, KIVI's fp16 residual window, SparQ reading everything equals dense, FP8's per-head scale, and the
documented bits per scalar."""

from __future__ import annotations

import math

import pytest
import torch

from planekv.kvstore import Codec, ReadPolicy
from planekv.kvstore.baselines import FP8, KIVI, Dense, FullReader, KVSystem, SparQ, TurboQuant, attention
from planekv.kvstore.reference import SYSTEM_NAMES, ReadKV, make_system

HQ, HK, D = 8, 2, 64


def _data(gen: torch.Generator, t: int = 256, m: int = 4):
    """Gaussian K/V (the unit codec's calibration fits them) and moderately peaked queries."""
    q = torch.randn(HQ, m, D, generator=gen) * 1.5
    k = torch.randn(HK, t, D, generator=gen)
    v = torch.randn(HK, t, D, generator=gen)
    return q, k, v


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture
def codec(unit_codec) -> Codec:
    return unit_codec(n_q_heads=HQ, n_kv_heads=HK, head_dim=D)


def _run(system: KVSystem, q, k, v, lengths):
    enc = system.encode(k, v, 0)
    return system.attend(q, enc, lengths)


@pytest.mark.parametrize("name", SYSTEM_NAMES)
@pytest.mark.parametrize("rate", [2.0, 4.0])
def test_every_system_runs(codec, gen, name, rate):
    q, k, v = _data(gen, t=200)
    lengths = torch.tensor([200, 150, 37, 1])
    system = make_system(name, rate, codec)
    assert isinstance(system, KVSystem) and isinstance(system.name, str)
    assert isinstance(system.describe(), dict)
    out, st = _run(system, q, k, v, lengths)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert bool(torch.isfinite(out).all())
    assert st.k_bits.shape == st.v_bits.shape == (4,)
    assert st.tokens.tolist() == [200.0, 150.0, 37.0, 1.0]
    assert bool((st.total_bits > 0).all())
    dense = attention(q, k, v, lengths)
    assert _rel(out, dense) < 0.7
    cap = system.capacity_bits(200, D)
    assert 0 < cap <= 16


def test_make_system_needs_a_codec_for_tree_systems_and_a_known_name(codec):
    for name in ("readkv-flexible", "readkv-constrained", "full-reader"):
        with pytest.raises(ValueError):
            make_system(name, 4.0)
    with pytest.raises(ValueError):
        make_system("h2o", 4.0, codec)
    flex = make_system("readkv-flexible", 3.0, codec, k_share=0.4)
    assert isinstance(flex, ReadKV) and flex.policy == ReadPolicy.flexible(3.0, 0.4)
    assert make_system("readkv-constrained", 3.0, codec).policy == ReadPolicy.constrained(3.0)
    assert make_system("full-reader", 3.4, codec).bits == 3
    assert make_system("turboquant", 2.6).bits == 3
    assert make_system("kivi", 4.0).bits == 4
    assert make_system("sparq", 2.5).rate == 2.5
    assert isinstance(make_system("fp8", 1.0), FP8) and isinstance(make_system("dense", 1.0), Dense)


def test_dense_is_fp16_attention(gen):
    q, k, v = _data(gen)
    lengths = torch.tensor([256, 100, 3, 256])
    out, st = _run(Dense(), q, k, v, lengths)
    torch.testing.assert_close(out, attention(q, k.half().float(), v.half().float(), lengths), rtol=1e-5, atol=1e-6)
    assert _rel(out, attention(q, k, v, lengths)) < 2e-3
    assert st.bits_per_scalar == 16.0
    out_bf, st_bf = _run(Dense(torch.bfloat16), q, k, v, lengths)
    torch.testing.assert_close(out_bf, attention(q, k.bfloat16().float(), v.bfloat16().float(), lengths))
    with pytest.raises(ValueError):
        Dense(torch.float32)


def test_fixed_bit_systems_improve_with_bits(codec, gen):
    q, k, v = _data(gen)
    lengths = torch.full((4,), 256)
    dense = attention(q, k, v, lengths)
    for make in (lambda b: FullReader(codec, b), lambda b: TurboQuant(b), lambda b: KIVI(b)):
        e2 = _rel(_run(make(2), q, k, v, lengths)[0], dense)
        e4 = _rel(_run(make(4), q, k, v, lengths)[0], dense)
        assert e4 < 0.6 * e2, (make(2).name, e2, e4)
        assert e4 < 0.3
    e8 = _rel(_run(KIVI(8), q, k, v, lengths)[0], dense)
    assert e8 < 0.1 * _rel(_run(KIVI(4), q, k, v, lengths)[0], dense)


def test_full_reader_is_the_tree_at_fixed_depth(codec, gen):
    q, k, v = _data(gen, t=100)
    lengths = torch.full((4,), 100)
    out, st = _run(FullReader(codec, 3), q, k, v, lengths)
    kd = codec.decode(codec.encode_k(k, 0), 3, 0, "k")
    vd = codec.decode(codec.encode_v(v, 0), 3, 0, "v")
    torch.testing.assert_close(out, attention(q, kd, vd, lengths))
    # the same as the two-stage reader with every depth forced to 3
    pol = ReadPolicy(rate=None, budget_k=3 * D, budget_v=3 * 100, min_depth_k=3, min_depth_v=3)
    two, _ = ReadKV(codec, pol).attend(q, ReadKV(codec, pol).encode(k, v, 0), lengths)
    torch.testing.assert_close(out, two, rtol=1e-5, atol=1e-5)
    assert st.bits_per_scalar == 3.0
    with pytest.raises(ValueError):
        FullReader(codec, 9)


def test_turboquant_norm_and_bits(gen):
    q, k, v = _data(gen, t=64)
    tq = TurboQuant(3, seed=7)
    kq, vq = tq.encode(k, v, 0)
    # per-token norms survive (fp16-rounded) up to the quantizer's norm distortion
    ratio = kq.norm(dim=-1) / k.norm(dim=-1)
    assert float((ratio - 1).abs().mean()) < 0.05
    _, st = tq.attend(q, (kq, vq), torch.full((4,), 64))
    assert st.bits_per_scalar == pytest.approx(3 + 16 / D)
    assert tq.capacity_bits(64, D) == pytest.approx(3 + 16 / D)
    assert _rel(kq, k) < 0.25


@pytest.mark.parametrize("length", [1, 50, 127])
def test_kivi_short_rows_are_fp16_exact(gen, length):
    q, k, v = _data(gen, t=256)
    for bits in (2, 4):
        kivi = KIVI(bits)
        out, st = _run(kivi, q, k, v, torch.full((4,), length))
        want = attention(q, k.half().float(), v.half().float(), torch.full((4,), length))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        assert st.bits_per_scalar == 16.0


def test_kivi_residual_window(gen):
    q, k, v = _data(gen, t=256)
    kivi = KIVI(2)
    enc = kivi.encode(k, v, 0)
    # tokens [0, 128) quantized (one K group of 128 per channel), [128, 200) kept at fp16
    first = kivi.encode(k[:, :128], v[:, :128], 0)
    assert torch.equal(enc["kq"][:, :128], first["kq"])
    k_eff = torch.cat([first["kq"], k[:, 128:200].half().float()], 1)
    v_eff = torch.cat([first["vq"], v[:, 128:200].half().float()], 1)
    out, st = kivi.attend(q, enc, torch.full((4,), 200))
    torch.testing.assert_close(out, attention(q, k_eff, v_eff, torch.full((4,), 200)), rtol=1e-5, atol=1e-5)
    # a row of exactly 128 tokens has no residual: it differs from fp16
    out128, _ = kivi.attend(q, enc, torch.full((4,), 128))
    assert _rel(out128, attention(q, k.half().float(), v.half().float(), torch.full((4,), 128))) > 0.01
    # documented bits: b bits + 32/128 (K) or 32/32 (V) metadata bits per quantized scalar, 16 for the rest
    nq, nf = 128, 72
    assert st.k_bits.tolist() == [HK * D * (nq * (2 + 32 / 128) + nf * 16.0)] * 4
    assert st.v_bits.tolist() == [HK * D * (nq * (2 + 1.0) + nf * 16.0)] * 4
    assert kivi.capacity_bits(200, D) == pytest.approx((nq * 2.25 + nq * 3 + 2 * nf * 16) / 400)
    with pytest.raises(ValueError):
        KIVI(3)


def test_kivi_minmax_error_is_bounded(gen):
    _, k, v = _data(gen, t=256)
    enc = KIVI(4).encode(k, v, 0)
    # per-channel groups of 128 tokens: error at most half a step (+ fp16 rounding of scale and zero)
    kg = k.reshape(HK, 2, 128, D)
    step = (kg.amax(2) - kg.amin(2)) / 15
    err = (enc["kq"] - k).reshape(HK, 2, 128, D).abs().amax(2)
    assert bool((err <= 0.5 * step * 1.01 + 2e-3).all())
    vg = v.reshape(HK, 256, 2, 32)
    vstep = (vg.amax(3) - vg.amin(3)) / 15
    verr = (enc["vq"] - v).reshape(HK, 256, 2, 32).abs().amax(3)
    assert bool((verr <= 0.5 * vstep * 1.01 + 2e-3).all())


def test_sparq_reading_everything_is_dense(gen):
    q, k, v = _data(gen, t=200)
    lengths = torch.tensor([200, 150, 37, 1])
    sp = SparQ(rate=32.0)  # r = min(d, 32 d / 16) = d channels, k = 32 T / 32 = T tokens
    out, st = _run(sp, q, k, v, lengths)
    want = attention(q, k.half().float(), v.half().float(), lengths)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert st.extra["r"] == D and st.extra["k"].tolist() == [200, 150, 37, 1]


def test_sparq_bits_and_selection(gen):
    q, k, v = _data(gen, t=256)
    lengths = torch.full((4,), 256)
    sp = SparQ(rate=4.0)
    out, st = _run(sp, q, k, v, lengths)
    r, kk = 4 * D // 16, 4 * 256 // 32
    assert st.extra["r"] == r and st.extra["k"].tolist() == [kk] * 4
    # documented: 16-bit r channels of every key, then K and V of the top-k tokens, plus the mean V
    assert st.k_bits.tolist() == [HK * (16.0 * r * 256 + 16.0 * D * kk)] * 4
    assert st.v_bits.tolist() == [HK * (16.0 * D * kk + 16.0 * D)] * 4
    assert st.bits_per_scalar == pytest.approx(4.0 + 16.0 * D / (2 * 256 * D))
    assert sp.capacity_bits(256, D) == 16.0
    dense = attention(q, k, v, lengths)
    e_lo = _rel(_run(SparQ(1.0), q, k, v, lengths)[0], dense)
    assert _rel(out, dense) < e_lo
    with pytest.raises(ValueError):
        SparQ(0.0)


def test_fp8_per_head_scale(gen):
    q, k, v = _data(gen, t=128)
    lengths = torch.full((4,), 128)
    fp8 = FP8()
    kq, vq = fp8.encode(k, v, 0)
    k2, v2 = k.clone(), v.clone()
    k2[1] *= 100
    v2[1] *= 100
    kq2, vq2 = fp8.encode(k2, v2, 0)
    assert torch.equal(kq2[0], kq[0]) and torch.equal(vq2[0], vq[0])  # head 0 untouched
    torch.testing.assert_close(kq2[1], kq[1] * 100, rtol=1e-5, atol=0)
    out, st = fp8.attend(q, (kq, vq), lengths)
    out2, _ = fp8.attend(q, (kq2, vq2), lengths)
    torch.testing.assert_close(out2[:4], out[:4], rtol=0, atol=0)  # query heads of KV head 0
    # e4m3: 3 mantissa bits, relative error <= 2^-4 for normal values
    big = k.abs() > k.abs().amax((1, 2), keepdim=True) / 448 * 2**-6 * 4
    assert float(((kq - k).abs() / k.abs())[big].max()) <= 2**-4 + 1e-6
    assert st.bits_per_scalar == 8.0 and fp8.capacity_bits(128, D) == 8.0
    assert _rel(out, attention(q, k, v, lengths)) < 0.1


def test_rows_with_starts(gen, codec):
    """A row reads tokens [starts, lengths): every system masks the same way as attention()."""
    q, k, v = _data(gen, t=100)
    lengths = torch.tensor([100, 60, 30, 10])
    starts = torch.tensor([50, 0, 20, 9])
    for system in (Dense(), FP8(), TurboQuant(4), FullReader(codec, 4)):
        enc = system.encode(k, v, 0)
        out, st = system.attend(q, enc, lengths, starts)
        assert st.tokens.tolist() == [50.0, 60.0, 10.0, 1.0]
        ek, ev = enc
        torch.testing.assert_close(out, attention(q, ek, ev, lengths, starts))
    # one token: the output is that token's value
    o1, _ = Dense().attend(q[:, 3:4], Dense().encode(k, v, 0), torch.tensor([10]), torch.tensor([9]))
    torch.testing.assert_close(o1[:, 0], v[:, 9].half().float().repeat_interleave(HQ // HK, 0))
    assert math.isclose(Dense().capacity_bits(10, D), 16.0)
