"""`make demo`'s job on the embedded stack, on the tiny model: the policy changed through the REST API reaches the
worker version by version, fewer hot planes move bytes from the device to the host, the JSON and the plot are
written, and the stack is down afterwards."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray")
pytest.importorskip("matplotlib")

from planekv.orchestration import stack  # noqa: E402
from planekv.orchestration.stack_demo import TABLE_COLUMNS, run_stack_demo, table_rows  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_demo_follows_each_policy_version_and_moves_planes_off_the_device(tmp_path, tiny_model_dir):
    data_dir = tmp_path / "stack"
    res = run_stack_demo(tmp_path / "out", context=512, rates=(4.0, 2.0), hots=(8, 4, 2), model=str(tiny_model_dir),
                         calib_tokens=512, promotion_mib=1.0, data_dir=data_dir, say=lambda s: None)
    assert [ph["policy_version"] for ph in res["phases"]] == [1, 2, 3]
    assert [ph["hot_planes"]["k"] for ph in res["phases"]] == [8, 4, 2]
    dense = [r for ph in res["phases"] for r in ph["rows"] if r["system"] == "dense"]
    assert len(dense) == 1 and dense[0]["tier_bytes"] is None  # dense once, on the device
    tiered = {(ph["hot_planes"]["k"], r["rate"]): r for ph in res["phases"] for r in ph["rows"]
              if r["system"] != "dense"}
    for rate in (4.0, 2.0):
        host = [tiered[(h, rate)]["tier_bytes"]["host"] for h in (8, 4, 2)]
        hot = [tiered[(h, rate)]["tier_bytes"]["hot"] for h in (8, 4, 2)]
        assert host[0] == 0 < host[1] < host[2]  # all 8 planes hot: nothing in the host tier
        assert hot[0] > hot[1] > hot[2]
        assert tiered[(8, rate)]["cap_rate"] == 0.0  # everything resident: nothing capped
    assert len(table_rows(res)) == 7 and all(len(r) == len(TABLE_COLUMNS) for r in table_rows(res))
    assert json.loads((tmp_path / "out" / "stack_demo.json").read_text())["phases"] == res["phases"]
    assert (tmp_path / "out" / "stack_demo.png").stat().st_size > 10_000
    assert stack.running(data_dir) is None and stack.status(data_dir) == []
