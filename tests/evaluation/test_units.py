"""The unit journal and --resume (in this process, no Ray): a resumed job runs only the units its journal lacks and
gives the table of an uninterrupted run; a unit journaled twice counts once; an unfinished last line is dropped;
other settings are refused; --workers without the Ray executor is refused before anything loads."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from planekv.evaluation import common, executors, passkey, perplexity  # noqa: E402
from planekv.evaluation.units import Journal  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames past_key_values


def _without_seconds(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


def _counting(monkeypatch, module, name: str) -> list[str]:
    """Replace module.name (a unit function) by one that records the units it runs."""
    ran: list[str] = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda s, spec: ran.append(spec) or real(s, spec))
    return ran


def test_journal_keeps_each_unit_once_and_refuses_other_settings(tmp_path):
    path = tmp_path / "job.units.jsonl"
    j = Journal(path, {"job": "x", "window": 64})
    assert j.start(resume=True) == {}  # nothing to resume: a new journal
    j.append("a", {"v": 1})
    j.append("b", {"v": 2})
    j.append("a", {"v": 1})  # a retried unit whose first try also finished
    with path.open("a") as f:
        f.write('{"key": "c", "fingerp')  # the process died mid-write
    assert Journal(path, {"job": "x", "window": 64}).start(resume=True) == {"a": {"v": 1}, "b": {"v": 2}}
    assert path.read_text().endswith("}\n")  # the unfinished line is gone: appends start on a line of their own
    with pytest.raises(ValueError, match=r"other settings \(window: 64 then, 96 now\)"):
        Journal(path, {"job": "x", "window": 96}).start(resume=True)
    assert Journal(path, {"job": "x", "window": 96}).start(resume=False) == {}  # without --resume: afresh
    assert len(path.read_text().splitlines()) == 1  # the header only
    path.write_text("not json\n")
    with pytest.raises(ValueError, match="line 1 .* is not a journal entry"):
        Journal(path, {"job": "x"}).start(resume=True)


def test_perplexity_resume_runs_only_the_missing_windows(tiny_model_dir, calib_path, tmp_path, monkeypatch):
    args = ["--model", str(tiny_model_dir), "--calibration", str(calib_path), "--out", str(tmp_path),
            "--window", "64", "--windows", "2", "--texts", "pride_and_prejudice", "--systems", "dense",
            "readkv-flexible", "--rates", "2", "--device", "cpu"]
    assert perplexity.main(args) == 0
    full = json.loads((tmp_path / "perplexity.json").read_text())
    journal = tmp_path / "perplexity.units.jsonl"
    header, *units = journal.read_text().splitlines(keepends=True)
    assert len(units) == 6  # (the model's own loss, dense, flexible) x 2 windows
    journal.write_text(header + units[0] + units[1] + units[1] + units[2])  # 3 kept, one of them twice
    ran = _counting(monkeypatch, perplexity, "window_unit")
    assert perplexity.main([*args, "--resume"]) == 0
    assert len(ran) == 3
    again = json.loads((tmp_path / "perplexity.json").read_text())
    assert again["model_ppl"] == full["model_ppl"] and again["tokens_per_row"] == full["tokens_per_row"]
    assert _without_seconds(again["rows"]) == _without_seconds(full["rows"])
    assert len(journal.read_text().splitlines()) == 1 + 4 + 3
    ran.clear()
    assert perplexity.main([*args, "--resume"]) == 0  # everything journaled: nothing runs
    assert not ran
    with pytest.raises(ValueError, match="window: 64 then, 96 now"):
        perplexity.main([*args, "--window", "96", "--resume"])


@pytest.mark.slow  # about 30 s; the perplexity resume test covers the journal in `make test`
def test_passkey_resume_runs_only_the_missing_trials(tiny_model_dir, calib_path, tmp_path, monkeypatch):
    args = ["--model", str(tiny_model_dir), "--calibration", str(calib_path), "--out", str(tmp_path),
            "--contexts", "200", "--trials", "3", "--systems", "dense", "readkv-constrained", "--rates", "2",
            "--long-systems", "--device", "cpu"]
    assert passkey.main(args) == 0
    full = json.loads((tmp_path / "passkey.json").read_text())
    journal = tmp_path / "passkey.units.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:2]))  # the header and trial 0
    ran = _counting(monkeypatch, passkey, "trial_unit")
    assert passkey.main([*args, "--resume"]) == 0
    assert [spec["trial"]["key"] for spec in ran] == [d["key"] for d in full["details"][2:6:2]]  # trials 1, 2
    again = json.loads((tmp_path / "passkey.json").read_text())
    assert _without_seconds(again["rows"]) == _without_seconds(full["rows"])
    assert again["details"] == full["details"]
    with pytest.raises(ValueError, match="seed: 0 then, 1 now"):
        passkey.main([*args, "--seed", "1", "--resume"])


def test_workers_need_the_planekv_command(tiny_model_dir, tmp_path, monkeypatch):
    """`python -m planekv.evaluation.perplexity --workers 2` has no Ray executor (only the `planekv` command loads
    it): refused with the command to use, before the model loads; so is --address without --workers."""
    monkeypatch.setattr(executors, "_EXECUTORS", {})
    monkeypatch.setattr(common, "setup", lambda *a, **k: pytest.fail("the model loaded"))
    base = ["--model", str(tiny_model_dir), "--out", str(tmp_path), "--device", "cpu"]
    with pytest.raises(ValueError, match="planekv eval <job> ... --workers N"):
        perplexity.main([*base, "--workers", "2"])
    with pytest.raises(ValueError, match="--address needs --workers"):
        passkey.main([*base, "--address", "auto"])
    with pytest.raises(ValueError, match="--workers must be >= 1"):
        passkey.main([*base, "--workers", "-1"])
