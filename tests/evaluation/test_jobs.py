"""The evaluation jobs end to end on a tiny local model (Ray-free, as a job entrypoint would run them):
each writes its JSON, the Markdown table and the plot; the suite reproduces a report."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from planekv.evaluation import passkey, perplexity, split_search, suite  # noqa: E402
from planekv.kvstore import Calibration  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames past_key_values

TINY = ["--calib-tokens", "512", "--calib-window", "256", "--device", "cpu"]


def test_calibration_artifact_round_trips(calib_path):
    c = Calibration.load(calib_path)
    assert c.calibration_id in calib_path.name
    assert c.mu_k.shape == (2, 2, 32)
    assert c.meta["text"] == "northanger_abbey" and c.meta["position"] == "rope-before-cache"
    assert Calibration.from_bytes(c.to_bytes()).calibration_id == c.calibration_id


def test_perplexity_job_without_dense_row_and_with_variants(tiny_model_dir, calib_path, tmp_path):
    """A dev-text comparison of flexible variants (no dense row) still writes its report; each named
    variant reads at the budget."""
    rc = perplexity.main(["--model", str(tiny_model_dir), "--calibration", str(calib_path), "--out", str(tmp_path),
                          "--window", "64", "--windows", "1", "--texts", "mansfield_park", "--systems",
                          "readkv-flexible-kv", "readkv-flexible-sink", "readkv-flexible-kr", "--rates", "2",
                          "--device", "cpu"])
    assert rc == 0
    rows = json.loads((tmp_path / "perplexity.json").read_text())["rows"]
    assert {r["name"] for r in rows} == {"readkv-flexible-kv", "readkv-flexible-sink", "readkv-flexible-kr"}
    assert all(r["ppl_change_pct"] is None and r["read_fraction"] <= 2 / 16 + 1e-9 for r in rows)
    md = (tmp_path / "report.md").read_text()
    assert "+ key variance" in md and "+ 1 sink key" in md and "+ Key refinement 0.3" in md
    assert (tmp_path / "quality_vs_read.png").stat().st_size > 1000


def test_perplexity_job_writes_outputs(tiny_model_dir, calib_path, tmp_path):
    rc = perplexity.main(["--model", str(tiny_model_dir), "--calibration", str(calib_path), "--out", str(tmp_path),
                          "--window", "96", "--windows", "1", "--texts", "pride_and_prejudice",
                          "--systems", "dense", "readkv-flexible", "kivi", "--rates", "2", "--device", "cpu"])
    assert rc == 0
    res = json.loads((tmp_path / "perplexity.json").read_text())
    rows = {r["name"]: r for r in res["rows"]}
    assert set(rows) == {"dense", "readkv-flexible", "kivi"}
    assert rows["dense"]["read_fraction"] == pytest.approx(1.0)
    assert rows["readkv-flexible"]["read_fraction"] == pytest.approx(2 / 16, abs=0.01)
    assert rows["readkv-flexible"]["capacity_fraction"] == pytest.approx(0.5)
    assert rows["dense"]["ppl"] == pytest.approx(res["model_ppl"], rel=1e-3)  # fp16 K/V vs fp32
    md = (tmp_path / "report.md").read_text()
    assert "ReadKV (8,2) flexible" in md and "read % of dense" in md
    assert (tmp_path / "quality_vs_read.png").stat().st_size > 1000


def test_passkey_job_writes_outputs(tiny_model_dir, calib_path, tmp_path):
    rc = passkey.main(["--model", str(tiny_model_dir), "--calibration", str(calib_path), "--out", str(tmp_path),
                       "--contexts", "200", "--trials", "2", "--systems", "dense", "readkv-constrained",
                       "--rates", "2", "--long-systems", "--device", "cpu"])
    assert rc == 0
    res = json.loads((tmp_path / "passkey.json").read_text())
    assert {r["name"] for r in res["rows"]} == {"dense", "readkv-constrained"}
    assert all(r["trials"] == 2 for r in res["rows"])
    assert len(res["details"]) == 4
    assert (tmp_path / "report.md").read_text().count("| 200 |") == 2


def test_passkey_job_runs_a_named_variant_at_the_longest_context(tiny_model_dir, calib_path, tmp_path):
    """A variant (here Key refinement) can be the long-context row; the report and plot include it."""
    rc = passkey.main(["--model", str(tiny_model_dir), "--calibration", str(calib_path), "--out", str(tmp_path),
                       "--contexts", "200", "--trials", "2", "--systems", "dense", "readkv-flexible-kr",
                       "--rates", "2", "--long-systems", "dense", "readkv-flexible-kr", "--long-rates", "2",
                       "--device", "cpu"])
    assert rc == 0
    rows = json.loads((tmp_path / "passkey.json").read_text())["rows"]
    assert {r["name"] for r in rows} == {"dense", "readkv-flexible-kr"}
    kr = next(r for r in rows if r["name"] == "readkv-flexible-kr")
    assert 0 < kr["read_fraction"] <= 2 / 16 + 1e-9
    assert "+ Key refinement 0.3" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "quality_vs_read.png").stat().st_size > 1000


def test_passkey_through_a_tiered_cache(tiny_model_dir, calib_path, tmp_path):
    """--tiered-hot: each ReadKV row also decodes from a tiered cache; with every plane hot (h = 8) it answers as
    the all-GPU row and caps nothing, with h = 2 it counts caps; the report labels the tiered rows."""
    rc = passkey.main(["--model", str(tiny_model_dir), "--calibration", str(calib_path), "--out", str(tmp_path),
                       "--contexts", "200", "--trials", "2", "--systems", "readkv-flexible", "--rates", "4",
                       "--long-systems", "--tiered-hot", "8", "2", "--promotion-mib", "0.01", "--device", "cpu"])
    assert rc == 0
    res = json.loads((tmp_path / "passkey.json").read_text())
    rows = {r["key"].rsplit("/", 1)[-1] if r.get("hot") is not None else "all": r for r in res["rows"]}
    assert set(rows) == {"all", "h8", "h2"} and res["promotion_mib"] == 0.01
    answers = {}
    for d in res["details"]:
        answers.setdefault(d["system"].rsplit("/", 1)[-1] if "/h" in d["system"] else "all", []).append(d["text"])
    assert answers["h8"] == answers["all"]  # every plane hot: the all-GPU decode, token for token
    assert rows["h8"]["cap_rate"] == 0 and rows["h8"]["read_fraction"] == pytest.approx(rows["all"]["read_fraction"])
    assert 0 < rows["h2"]["cap_rate"] < 1
    assert "tiered h = 2" in (tmp_path / "report.md").read_text()


def test_split_search_job(tiny_model_dir, calib_path, tmp_path):
    rc = split_search.main(["--model", str(tiny_model_dir), "--calibration", str(calib_path), "--out", str(tmp_path),
                            "--rates", "2", "--grid", "0.25", "0.75", "--window", "64", "--windows", "1",
                            "--device", "cpu"])
    assert rc == 0
    res = json.loads((tmp_path / "split_search.json").read_text())
    assert len(res["rows"]) == 2 and res["rows"][0]["ppl"] != res["rows"][1]["ppl"]
    assert res["k_share"]["2"] == min(res["rows"], key=lambda r: r["ppl"])["k_share"]


def test_suite_end_to_end(tiny_model_dir, tmp_path):
    rc = suite.main(["--model", str(tiny_model_dir), "--out", str(tmp_path), *TINY, "--window", "64",
                     "--windows", "1", "--split-windows", "1", "--grid", "0.5", "0.625", "--contexts", "200",
                     "--trials", "1", "--systems", "dense", "readkv-flexible", "fp8", "--rates", "4", "2",
                     "--long-systems"])
    assert rc == 0
    for name in ("run.json", "split_search.json", "perplexity.json", "passkey.json", "report.md",
                 "quality_vs_read.png"):
        assert (tmp_path / name).is_file(), name
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["hardware"] and meta["date"] and set(meta["seconds"]) >= {"perplexity", "passkey", "total"}
    ppl = json.loads((tmp_path / "perplexity.json").read_text())
    chosen = json.loads((tmp_path / "split_search.json").read_text())["k_share"]
    flex = [r for r in ppl["rows"] if r["name"] == "readkv-flexible"]
    assert {r["rate"]: r["k_share"] for r in flex} == {4.0: chosen["4"], 2.0: chosen["2"]}


@pytest.mark.slow  # the whole suite twice: about 30 s
def test_suite_resume_keeps_finished_work(tiny_model_dir, tmp_path, monkeypatch):
    """An interrupted suite continues with --resume: the split search and perplexity results of the
    earlier run are kept (not recomputed), journaled passkey trials too, and only the missing
    ones run; a different command refuses to resume into the same directory."""
    args = ["--model", str(tiny_model_dir), "--out", str(tmp_path), *TINY, "--window", "64", "--windows", "1",
            "--split-windows", "1", "--grid", "0.5", "0.625", "--contexts", "300", "200", "--trials", "1",
            "--systems", "dense", "readkv-flexible", "--rates", "2", "--long-systems"]
    assert suite.main(args) == 0
    ppl = (tmp_path / "perplexity.json").read_text()
    full = json.loads((tmp_path / "passkey.json").read_text())
    # as if the run had stopped during the second context: its trial is not in the journal
    journal = tmp_path / "passkey.units.jsonl"
    journal.write_text("".join(x for x in journal.read_text().splitlines(keepends=True) if '"200|' not in x))

    def fail(*a, **k):
        raise AssertionError("finished work was recomputed")

    monkeypatch.setattr(suite, "run_perplexity", fail)
    monkeypatch.setattr(suite, "run_split_search", fail)
    ran: list[int] = []
    real = passkey.greedy_decode
    monkeypatch.setattr(passkey, "greedy_decode", lambda model, cache, first, tok: ran.append(1) or
                        real(model, cache, first, tok))
    assert suite.main([*args, "--resume"]) == 0
    assert (tmp_path / "perplexity.json").read_text() == ppl
    again = json.loads((tmp_path / "passkey.json").read_text())
    key = lambda r: (r["key"], r["context"])  # noqa: E731
    assert sorted(map(key, again["rows"])) == sorted(map(key, full["rows"]))
    assert [r for r in again["rows"] if r["context"] == 300] == [r for r in full["rows"] if r["context"] == 300]
    assert len(ran) == 2  # one trial of the 200-token context for each of the two systems
    assert len(json.loads((tmp_path / "run.json").read_text())["continued"]) == 1
    with pytest.raises(ValueError, match="differs in settings"):
        suite.main([*args, "--rates", "4", "--resume"])
