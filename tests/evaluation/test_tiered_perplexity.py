"""Perplexity through the tiered reader (``--tiered-hot``): each ReadKV row read as decode steps, all-GPU and from
a tiered cache; with every plane hot the tiered row is the all-GPU row exactly, with fewer the caps are counted; bad
hot depths are refused before anything loads; the units run on a worker as in this process."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")

from planekv.evaluation import common, executors, passkey, perplexity, suite  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames past_key_values

WINDOW = ["--window", "96", "--windows", "1", "--texts", "pride_and_prejudice"]  # a sealed page of 64 and an open one


def _rows(res: dict) -> dict[str, dict]:
    """The ReadKV rows by kind: 'tf' (teacher-forced), 'decode' (all-GPU decode steps), 'h<N>' (tiered)."""
    return {f"h{r['hot']}" if r["hot"] is not None else ("decode" if r["decode"] else "tf"): r for r in res["rows"]
            if r["name"].startswith("readkv")}


def test_tiered_perplexity_with_every_plane_hot_is_the_all_gpu_decode(tiny_model_dir, calib_path, tmp_path):
    """h = W: the tiered row's NLL equals the all-GPU decode-step row's bit for bit and caps nothing; h = 2 with a tiny
    promotion cache caps some of the bits asked for, reads the same logical budget and reports a finite perplexity
    beside the all-GPU row; the report's tiered table shows both."""
    rc = perplexity.main(["--model", str(tiny_model_dir), "--calibration", str(calib_path), "--out", str(tmp_path),
                          *WINDOW, "--systems", "readkv-flexible", "--rates", "4", "--tiered-hot", "8", "2",
                          "--promotion-mib", "0.01", "--device", "cpu"])
    assert rc == 0
    res = json.loads((tmp_path / "perplexity.json").read_text())
    rows = _rows(res)
    assert set(rows) == {"tf", "decode", "h8", "h2"} and res["promotion_mib"] == 0.01
    assert res["tokens_per_row"] == 95
    assert rows["h8"]["texts"] == rows["decode"]["texts"]  # NLL sums equal exactly
    assert rows["h8"]["ppl"] == rows["decode"]["ppl"] and rows["h8"]["vs_all_gpu_pct"] == 0.0
    assert rows["h8"]["cap_bits"] == 0 and rows["h8"]["wanted_bits"] > 0 and rows["h8"]["cap_rate"] == 0
    assert rows["h8"]["k_bits"] == rows["decode"]["k_bits"] and rows["h8"]["v_bits"] == rows["decode"]["v_bits"]
    # decode steps read what teacher forcing reads (token 0 too): the same perplexity up to float rounding
    assert rows["decode"]["ppl"] == pytest.approx(rows["tf"]["ppl"], rel=1e-4)
    assert rows["decode"]["read_fraction"] == pytest.approx(rows["tf"]["read_fraction"], rel=1e-3)
    h2 = rows["h2"]
    assert 0 < h2["cap_bits"] < h2["wanted_bits"] and 0 < h2["cap_rate"] < 1
    assert 0 < h2["served_bits"] < h2["beyond_hot_bits"] and 0 < h2["promotion_hit_rate"] < 1
    assert math.isfinite(h2["ppl"]) and h2["all_gpu_key"] == rows["decode"]["key"]
    assert h2["vs_all_gpu_pct"] == pytest.approx(100 * (h2["ppl"] / rows["decode"]["ppl"] - 1))
    assert h2["vs_all_gpu_pp"] is None  # no dense row to take percentage points of
    assert h2["k_bits"] + h2["v_bits"] + h2["cap_bits"] == pytest.approx(h2["wanted_bits"])  # read + capped
    assert h2["read_fraction"] < rows["decode"]["read_fraction"]  # a capped increment is not read
    assert "readkv-flexible@4" in h2["key"] and h2["key"].endswith("/decode/h2")
    md = (tmp_path / "report.md").read_text()
    assert "decode steps, tiered h = 2" in md and "Tiered reads (decode steps)" in md
    assert f"{100 * h2['cap_rate']:.2f}%" in md


def test_tiered_perplexity_in_points_of_dense(tiny_model_dir, calib_path, tmp_path):
    """With a dense row the tiered row's difference is also given in percentage points of dense perplexity; Key
    refinement rows are tiered too; a tiered row's journal records its promotion cache, so another one is refused
    on --resume."""
    args = ["--model", str(tiny_model_dir), "--calibration", str(calib_path), "--out", str(tmp_path), *WINDOW,
            "--systems", "dense", "readkv-flexible-kr", "--rates", "2", "--tiered-hot", "4", "--device", "cpu"]
    assert perplexity.main(args) == 0
    res = json.loads((tmp_path / "perplexity.json").read_text())
    rows = _rows(res)
    assert set(rows) == {"tf", "decode", "h4"} and len(res["rows"]) == 4  # dense: teacher-forced only
    dense = next(r for r in res["rows"] if r["name"] == "dense")
    h4, base = rows["h4"], rows["decode"]
    assert h4["name"] == "readkv-flexible-kr" and h4["cap_rate"] is not None
    assert h4["vs_all_gpu_pp"] == pytest.approx(100 * (h4["ppl"] - base["ppl"]) / dense["ppl"])
    with pytest.raises(ValueError, match="promotion_mib: 64.0 then, 1.0 now"):
        perplexity.main([*args, "--promotion-mib", "1", "--resume"])


def test_key_page_slots_reach_the_tiered_rows(tiny_model_dir, calib_path, tmp_path):
    """--key-page-mib gives a Key refinement row's tiered cache Key page slots: the refined tokens of the sealed page
    read at full depth instead of capped (fewer caps than without slots), the result and the journal record the
    budget, and --resume with another one is refused."""
    def run(out, *extra):
        args = ["--model", str(tiny_model_dir), "--calibration", str(calib_path), "--out", str(out), *WINDOW,
                "--systems", "readkv-flexible-kr", "--rates", "2", "--tiered-hot", "4", "--device", "cpu", *extra]
        assert perplexity.main(args) == 0
        return json.loads((out / "perplexity.json").read_text()), args

    without, _ = run(tmp_path / "none")
    with_pages, args = run(tmp_path / "pages", "--key-page-mib", "16")
    assert "key_page_mib" not in without and with_pages["key_page_mib"] == 16.0
    assert _rows(with_pages)["h4"]["cap_bits"] < _rows(without)["h4"]["cap_bits"]
    with pytest.raises(ValueError, match="key_page_mib"):
        perplexity.main([*args[:-2], "--key-page-mib", "8", "--resume"])
    with pytest.raises(ValueError, match="--key-page-mib must be >= 0"):
        perplexity.main([*args[:-2], "--key-page-mib", "-1"])


@pytest.mark.parametrize("job", [perplexity, passkey, suite])
@pytest.mark.parametrize("hot", ["9", "-1"])
def test_bad_hot_planes_are_refused_before_the_model_loads(job, hot, tmp_path):
    with pytest.raises(ValueError, match=r"--tiered-hot takes hot planes h in \[0, 8\].*got \[" + hot + r"\]"):
        job.main(["--model", str(tmp_path / "no-such-model"), "--out", str(tmp_path), "--tiered-hot", "4", hot,
                  "--device", "cpu"])


def test_tiered_rows_are_refused_for_a_negative_promotion_cache(tmp_path):
    with pytest.raises(ValueError, match="--promotion-mib must be >= 0"):
        perplexity.main(["--model", str(tmp_path / "no-such-model"), "--out", str(tmp_path), "--tiered-hot", "4",
                         "--promotion-mib", "-1", "--device", "cpu"])


def test_tiered_units_run_on_a_worker_as_in_this_process(tiny_model_dir, calib_path):
    """A worker (--workers N) gets each unit as JSON and builds its Setup from the driver's recipe: the decode and
    tiered windows give the same results there."""
    s = common.setup(str(tiny_model_dir), calib_path, "cpu")
    rows = perplexity.decode_rows(common.system_rows(["readkv-flexible"], [2.0]), [3])
    units = perplexity.window_units(rows[1:], ["pride_and_prejudice"], 96, 1, promotion_mib=0.01)
    assert [u.spec["row"]["decode"] for u in units] == [True, True] and units[1].spec["promotion_mib"] == 0.01
    worker = executors.SetupRecipe.of(s, str(tiny_model_dir), "cpu", s.codec.spec.codebook).build()
    for unit in units:
        here = perplexity.window_unit(s, unit.spec)
        there = perplexity.window_unit(worker, json.loads(json.dumps(unit.spec)))
        here.pop("seconds"), there.pop("seconds")
        assert here == there
    assert "cap_bits" in here and "cap_bits" not in perplexity.window_unit(s, units[0].spec)


def test_the_suite_reads_perplexity_and_passkey_through_the_tiered_cache(tiny_model_dir, calib_path, tmp_path):
    """``planekv eval all --tiered-hot H --promotion-mib M``: perplexity gets the decode and tiered rows, passkey the
    tiered rows, both with the promotion cache given."""
    rc = suite.main(["--model", str(tiny_model_dir), "--calibration", str(calib_path), "--out", str(tmp_path),
                     "--no-split-search", "--window", "96", "--windows", "1", "--texts", "pride_and_prejudice",
                     "--contexts", "200", "--trials", "1", "--systems", "readkv-flexible", "--rates", "4",
                     "--long-systems", "--tiered-hot", "2", "--promotion-mib", "0.01", "--device", "cpu"])
    assert rc == 0
    ppl = json.loads((tmp_path / "perplexity.json").read_text())
    pk = json.loads((tmp_path / "passkey.json").read_text())
    assert set(_rows(ppl)) == {"tf", "decode", "h2"} and ppl["promotion_mib"] == 0.01
    assert [r["hot"] for r in pk["rows"]] == [None, 2] and pk["promotion_mib"] == 0.01
    assert 0 < _rows(ppl)["h2"]["cap_rate"] < 1 and "cap_rate" in pk["rows"][1]
