"""benchmarks/tools/compare_eval.py: the GPU stack check's comparison of an evaluation over workers with one process."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "compare_eval", Path(__file__).resolve().parents[2] / "benchmarks" / "tools" / "compare_eval.py")
compare_eval = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_eval)

PPL = {"job": "perplexity", "rows": [{"key": "dense@16", "ppl": 16.14114}, {"key": "readkv@2", "ppl": 17.78281}]}
PASSKEY = {"job": "passkey", "rows": [{"key": "dense@16", "context": 8192, "hits": 2, "trials": 4}],
           "details": [{"system": "dense@16", "context": 8192, "key": "12345", "depth": 0.5, "offset": 7,
                        "answer": "12345"}]}


def _run(tmp_path: Path, a: dict, b: dict) -> int:
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    return compare_eval.main([str(pa), str(pb)])


def test_equal_results_agree_and_a_moved_perplexity_or_missing_row_does_not(tmp_path, capsys):
    assert _run(tmp_path, PPL, copy.deepcopy(PPL)) == 0
    moved = copy.deepcopy(PPL)
    moved["rows"][1]["ppl"] *= 1.001
    assert _run(tmp_path, PPL, moved) == 1
    assert "row readkv@2 differs" in capsys.readouterr().out
    short = copy.deepcopy(PPL)
    short["rows"].pop()
    assert _run(tmp_path, PPL, short) == 1
    assert "row readkv@2 only in the first" in capsys.readouterr().out


def test_passkey_needs_the_same_hits_and_the_same_answers(tmp_path, capsys):
    assert _run(tmp_path, PASSKEY, copy.deepcopy(PASSKEY)) == 0
    other = copy.deepcopy(PASSKEY)
    other["details"][0]["answer"] = "12346"
    assert _run(tmp_path, PASSKEY, other) == 1
    assert "'12345' and '12346'" in capsys.readouterr().out
