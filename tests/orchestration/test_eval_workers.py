"""`planekv eval perplexity|passkey --workers 2`, run as the command (a process of its own that starts a local Ray, as
a user's run does): the units run on two Ray actors and the tables equal the one-process run's; a worker killed in
the middle of a unit is restarted, the unit runs again, and the result is the same, every unit journaled once."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")
pytest.importorskip("transformers")

from planekv.evaluation import passkey, perplexity  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


PLANEKV = "import sys; from planekv.cli import main; sys.exit(main(sys.argv[1:]))"
# the same command, its perplexity window unit replaced by one that kills its worker process (SIGKILL) the first time
# it runs a kivi window; defined in __main__, the function is pickled by value into the workers
PLANEKV_KILLING_A_WORKER = """
import os, signal, sys
from pathlib import Path
from planekv.cli import main
from planekv.evaluation import perplexity

killed, driver, real = Path(sys.argv[1]), os.getpid(), perplexity.window_unit

def dies_once(s, spec):
    if os.getpid() != driver and spec["row"] and spec["row"]["name"] == "kivi" and not killed.exists():
        killed.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return real(s, spec)

perplexity.window_unit = dies_once
sys.exit(main(sys.argv[2:]))
"""


def _run(code: str, *args: str) -> str:
    """``python -c code args``, its log; the local Ray it starts is a loopback test cluster: no token auth."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc.stderr


def _same(a, b) -> bool:
    """Equal, floats to a relative 1e-9 (a worker's torch runs one thread, this process several)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def _table(path, drop=("seconds", "workers")) -> dict:
    """A job's JSON without what depends on how long it took or where it ran."""
    res = json.loads(path.read_text())
    res["rows"] = [{k: v for k, v in r.items() if k != "seconds"} for r in res["rows"]]
    return {k: v for k, v in res.items() if k not in drop}


def _journaled_keys(path) -> list[str]:
    return [json.loads(line)["key"] for line in path.read_text().splitlines()[1:]]


def _perplexity_args(model, calib, out) -> list[str]:
    return ["--model", str(model), "--calibration", str(calib), "--out", str(out), "--window", "64", "--windows",
            "2", "--texts", "pride_and_prejudice", "--systems", "dense", "readkv-flexible", "kivi", "--rates", "2",
            "--device", "cpu"]


@pytest.mark.slow  # a Ray cluster and two model-loading workers: about a minute
def test_perplexity_on_two_workers_equals_one_process(tiny_model_dir, calib_path, tmp_path):
    assert perplexity.main(_perplexity_args(tiny_model_dir, calib_path, tmp_path / "one")) == 0
    _run(PLANEKV, "eval", "perplexity", *_perplexity_args(tiny_model_dir, calib_path, tmp_path / "two"),
         "--workers", "2")
    one, two = _table(tmp_path / "one" / "perplexity.json"), _table(tmp_path / "two" / "perplexity.json")
    assert _same(one, two), (one, two)
    assert json.loads((tmp_path / "two" / "perplexity.json").read_text())["workers"] == 2
    assert sorted(_journaled_keys(tmp_path / "two" / "perplexity.units.jsonl")) == \
        sorted(_journaled_keys(tmp_path / "one" / "perplexity.units.jsonl"))


@pytest.mark.slow  # a Ray cluster and two model-loading workers: about a minute
def test_passkey_on_two_workers_equals_one_process(tiny_model_dir, calib_path, tmp_path):
    args = ["--model", str(tiny_model_dir), "--calibration", str(calib_path), "--contexts", "256", "200", "--trials",
            "2", "--systems", "dense", "readkv-flexible", "--rates", "2", "--long-systems", "--device", "cpu"]
    assert passkey.main([*args, "--out", str(tmp_path / "one")]) == 0
    _run(PLANEKV, "eval", "passkey", *args, "--out", str(tmp_path / "two"), "--workers", "2")
    one, two = _table(tmp_path / "one" / "passkey.json"), _table(tmp_path / "two" / "passkey.json")
    assert [(r["key"], r["context"], r["hits"], r["trials"]) for r in one["rows"]] == \
        [(r["key"], r["context"], r["hits"], r["trials"]) for r in two["rows"]]
    assert one["details"] == two["details"]  # every answer, token for token
    assert _same(one, two)


@pytest.mark.slow  # about 30 s on an idle 2-core machine, minutes on a busy one
def test_a_worker_killed_mid_unit_is_restarted_and_the_unit_counted_once(tiny_model_dir, calib_path, tmp_path):
    """The window unit of one kivi window kills its worker process the first time it runs; Ray restarts the actor,
    the unit runs again, and the table is the one-process run's."""
    killed = tmp_path / "killed"
    assert perplexity.main(_perplexity_args(tiny_model_dir, calib_path, tmp_path / "one")) == 0
    log = _run(PLANEKV_KILLING_A_WORKER, str(killed), "eval", "perplexity",
               *_perplexity_args(tiny_model_dir, calib_path, tmp_path / "two"), "--workers", "2")
    assert killed.exists() and "died during unit kivi@2|pride_and_prejudice" in log and " is back (pid " in log
    assert _same(_table(tmp_path / "one" / "perplexity.json"), _table(tmp_path / "two" / "perplexity.json"))
    keys = _journaled_keys(tmp_path / "two" / "perplexity.units.jsonl")
    assert len(keys) == len(set(keys)) == 8  # (own loss, dense, flexible, kivi) x 2 windows, each once
