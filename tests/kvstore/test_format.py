"""FormatSpec (DESIGN 5): the identity of stored data and its validation."""

from __future__ import annotations

import dataclasses

import pytest

from planekv.kvstore import FormatMismatch, FormatSpec

BASE = dict(model_id="m", n_layers=2, n_q_heads=8, n_kv_heads=2, head_dim=64, calibration_id="abc")


def test_format_id_is_stable_and_canonical():
    a = FormatSpec(**BASE)
    b = FormatSpec(**dict(reversed(list(BASE.items()))))
    assert a.format_id == b.format_id
    assert len(a.format_id) == 16 and int(a.format_id, 16) >= 0
    assert FormatSpec.from_json(a.canonical_json()) == a
    assert FormatSpec.from_dict(a.to_dict()).format_id == a.format_id
    assert a.group_size == 4


@pytest.mark.parametrize("field,value", [
    ("model_id", "m2"), ("n_layers", 3), ("n_q_heads", 4), ("n_kv_heads", 1), ("head_dim", 128),
    ("calibration_id", "abd"), ("model_revision", "r1"), ("position", "none"), ("rope_theta", 500000.0),
    ("seed_k", 1), ("seed_v", 1), ("width", 7), ("page_size", 128), ("v_run", 4),
])
def test_every_field_is_part_of_the_identity(field, value):
    a = FormatSpec(**BASE)
    b = dataclasses.replace(a, **{field: value})
    assert a.format_id != b.format_id


def test_check_raises_on_other_format():
    a = FormatSpec(**BASE)
    a.check(a.format_id)
    with pytest.raises(FormatMismatch):
        a.check(dataclasses.replace(a, width=4).format_id)


@pytest.mark.parametrize("bad", [
    {"n_layers": 0}, {"n_q_heads": 0}, {"n_kv_heads": 0}, {"head_dim": 0}, {"n_q_heads": 6, "n_kv_heads": 4},
    {"head_dim": 60}, {"width": 0}, {"width": 9}, {"page_size": 32}, {"codebook": "uniform"},
    {"position": "alibi"}, {"layout_version": 2}, {"v_run": 3}, {"v_run": 16}, {"v_run": 0},
    {"width": 6, "v_run": 4},
])
def test_validation(bad):
    with pytest.raises(ValueError):
        FormatSpec(**{**BASE, **bad})


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError):
        FormatSpec.from_dict({**BASE, "colour": "blue"})


def test_non_power_of_two_head_dims_are_allowed():
    assert FormatSpec(**{**BASE, "head_dim": 96}).head_dim == 96
    assert FormatSpec(**{**BASE, "head_dim": 80}).head_dim == 80


def test_integer_and_float_rope_theta_are_one_format() -> None:
    from planekv.kvstore import FormatSpec

    base = dict(model_id="m", n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=64, calibration_id="c")
    assert FormatSpec(**base, rope_theta=10000).format_id == FormatSpec(**base, rope_theta=10000.0).format_id


def test_v_run_1_keeps_the_ids_of_formats_written_before_it() -> None:
    """``v_run`` joined the spec after the first formats: at 1 it is left out of the canonical JSON (their ids
    stay), at g > 1 it is in it and survives the round trip."""
    a = FormatSpec(**BASE)
    assert "v_run" not in a.canonical_json()
    assert a.format_id == "be80a89141285f6d"  # this spec's id before v_run existed
    assert FormatSpec.from_json(a.canonical_json()).v_run == 1
    g = dataclasses.replace(a, v_run=4)
    assert '"v_run":4' in g.canonical_json()
    assert FormatSpec.from_json(g.canonical_json()) == g
