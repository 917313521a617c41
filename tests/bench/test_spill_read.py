"""`planekv bench spill` with the POSIX backend at a tiny size: rows for the tier and the plain loop, the bytes the
read list asks for, every page equal to what was written, the JSON, and bad flags refused (no timings asserted)."""

from __future__ import annotations

import json

import pytest

from planekv.bench.spill_read import SpillConfig, run_spill
from planekv.cli import main


def test_the_tier_and_the_plain_loop_read_the_same_bytes(tmp_path):
    cfg = SpillConfig(blocks=3, block_bytes=64 << 10, page_bytes=16 << 10, reps=3, backend="posix")
    rows = run_spill(cfg, str(tmp_path / "spill"))
    assert [(r.mode, r.system) for r in rows] == [("page", "tier"), ("page", "plain"), ("run", "tier"),
                                                   ("run", "plain"), ("block", "tier"), ("block", "plain")]
    for r in rows:
        assert r.backend == "posix" and r.compat_mode is None and r.dest == "host"
        assert r.read_bytes == 3 * (64 << 10) and r.reads == (12 if r.mode == "page" else 3)
        assert r.checked and r.first_gbps > 0 and r.warm_gbps > 0
        if r.system == "tier":
            assert r.ratio > 0 and r.ratio_first > 0
        else:
            assert r.ratio is None
    assert not list((tmp_path / "spill").glob("*/*.blk"))  # the tier closed and removed its files


def test_one_rep_has_no_warm_figure_and_the_ratio_is_the_first_passes(tmp_path):
    rows = run_spill(SpillConfig(blocks=1, block_bytes=8192, page_bytes=4096, reps=1, backend="posix",
                                 modes=("page",)))
    tier = rows[0]
    assert tier.warm_gbps is None and tier.ratio == tier.ratio_first > 0


def test_the_command_prints_the_table_and_writes_the_json(tmp_path, capsys):
    out = tmp_path / "spill.json"
    rc = main(["bench", "spill", "--backend", "posix", "--blocks", "2", "--block-mib", "0.0625", "--page-kib", "16",
               "--reps", "2", "--dir", str(tmp_path / "d"), "--json", str(out)])
    assert rc == 0
    assert "| mode | system |" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["meta"]["backend"] == "posix" and doc["meta"]["config"]["blocks"] == 2 and "date" in doc["meta"]
    assert len(doc["rows"]) == 6 and all(r["read_bytes"] == 2 * (64 << 10) for r in doc["rows"])


@pytest.mark.parametrize("flags", [["--blocks", "0"], ["--block-mib", "0.0625", "--page-kib", "128"],
                                   ["--backend", "gds"], ["--reps", "0"], ["--block-mib", "0"],
                                   ["--block-mib", "0.0625", "--page-kib", "24"]])
def test_bad_flags_are_refused(tmp_path, flags):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "spill", "--dir", str(tmp_path), *flags])
    assert exc.value.code != 0


def test_bad_settings_are_refused():
    for kw, match in (({"blocks": 0}, "blocks"), ({"page_bytes": 2 << 20}, "larger than a block"),
                      ({"backend": "gds"}, "backend"), ({"modes": ()}, "modes"), ({"page_bytes": 3000}, "whole")):
        with pytest.raises(ValueError, match=match):
            SpillConfig(**kw)
