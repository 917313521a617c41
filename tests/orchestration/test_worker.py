"""PlaneWorker without Ray (the actor's body): it loads a local model in the background, generates and scores
through PlaneKV caches, follows a placement policy into a tiered cache, and reports what it did."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from planekv.orchestration.worker import PlaneWorker  # noqa: E402
from planekv.tiering import PlacementPolicy  # noqa: E402

PROMPT = "It was a truth universally acknowledged, that a single man in possession of a good fortune"


@pytest.fixture(scope="module")
def worker(tiny_model_dir) -> PlaneWorker:
    w = PlaneWorker(model=str(tiny_model_dir), calib_tokens=512, device="cpu", name="w0")
    assert w.wait_ready(timeout=300)["state"] == "ready"
    return w


def test_a_worker_generates_through_planekv_and_at_full_depth_as_dense(worker):
    full = worker.generate([PROMPT], max_new_tokens=6, rate=8.0, chat=False)[0]
    dense = worker.generate([PROMPT], max_new_tokens=6, system="dense", chat=False)[0]
    assert full["new_tokens"] == 6 and full["text"] == dense["text"]
    low = worker.generate([PROMPT], max_new_tokens=6, rate=2.0, chat=False)[0]
    assert 1.5 < low["bits_per_scalar"] < 2.5 < full["bits_per_scalar"]
    assert low["cap_rate"] is None and low["tier_bytes"] == {}  # no placement policy: every plane on the device


def test_under_a_placement_policy_refinement_planes_leave_the_device(worker):
    worker.set_placement(PlacementPolicy(hot_planes={"k": 2, "v": 2}).model_dump(mode="json"))
    try:
        out = worker.generate([PROMPT * 4], max_new_tokens=4, rate=4.0, chat=False)[0]
    finally:
        worker.set_placement(None)
    assert out["hot_planes"] == 2
    assert out["tier_bytes"]["host"] > 0 and out["tier_bytes"]["hot"] > 0
    assert 0.0 <= out["cap_rate"] <= 1.0


def test_scoring_a_text_or_its_ids_gives_the_same_likelihood(worker):
    tok = worker.setup.lm.tokenizer
    ids = tok(PROMPT * 3, add_special_tokens=False)["input_ids"]
    by_text = worker.score(PROMPT * 3, window=32, rate=4.0)
    by_ids = worker.score(ids, window=32, rate=4.0)
    assert by_text["tokens"] == by_ids["tokens"] == len(ids) - 1
    assert by_text["nll"] == pytest.approx(by_ids["nll"])
    dense = worker.score(ids, window=32, system="dense")
    assert dense["ppl"] > 1.0 and by_ids["bits_per_scalar"] < 16.0


def test_stats_and_metrics_count_the_requests(worker):
    before = worker.stats()
    worker.generate([PROMPT], max_new_tokens=3, rate=4.0, chat=False)
    after = worker.stats()
    assert after["state"] == "ready" and after["tokens_generated"] == before["tokens_generated"] + 3
    assert after["requests"]["generate"] == before["requests"].get("generate", 0) + 1
    text = worker.metrics()
    assert 'planekv_worker_ready{worker="w0"} 1.0' in text
    assert f'planekv_worker_tokens_generated_total{{worker="w0"}} {float(after["tokens_generated"])}' in text


def test_bad_requests_are_refused_with_a_reason(worker):
    with pytest.raises(ValueError, match="at least one prompt"):
        worker.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match="window"):
        worker.score(PROMPT, window=1)
    with pytest.raises(ValueError, match="hot_planes"):
        worker.set_placement({"hot_planes": {"k": 9, "v": 2}})
    assert worker.generate([PROMPT], max_new_tokens=2, chat=False)[0]["cap_rate"] is None  # nothing changed


def test_a_model_that_cannot_load_is_reported_not_hung(tmp_path):
    w = PlaneWorker(model=str(tmp_path / "missing"), device="cpu", name="bad")
    with pytest.raises(RuntimeError, match="failed to load"):
        w.wait_ready(timeout=60)
    assert w.ping()["state"] == "failed" and w.ping()["error"]


def test_prompts_of_one_request_decode_together_as_each_alone(worker):
    """Three prompts of different lengths in one request (left-padded into one cache, two per batch with
    max_batch = 2) give each prompt's tokens alone, at full depth and at R = 4."""
    prompts = [PROMPT, "The weather", PROMPT[:40]]
    worker.max_batch = 2
    try:
        for rate in (8.0, 4.0):
            together = worker.generate(prompts, max_new_tokens=5, rate=rate, chat=False)
            alone = [worker.generate([p], max_new_tokens=5, rate=rate, chat=False)[0] for p in prompts]
            assert [r["text"] for r in together] == [r["text"] for r in alone]
            assert [r["batch_size"] for r in together] == [2, 2, 1]
            assert [r["prompt_tokens"] for r in together] == [r["prompt_tokens"] for r in alone]
    finally:
        worker.max_batch = 8


def test_a_batch_under_a_placement_policy_is_tiered_and_finished(worker):
    worker.set_placement(PlacementPolicy(hot_planes={"k": 2, "v": 2}).model_dump(mode="json"))
    try:
        out = worker.generate([PROMPT * 4, PROMPT * 2], max_new_tokens=4, rate=4.0, chat=False)
    finally:
        worker.set_placement(None)
    assert [r["batch_size"] for r in out] == [2, 2] and all(r["new_tokens"] >= 1 for r in out)
    assert out[0]["tier_bytes"]["host"] > 0 and 0.0 <= out[0]["cap_rate"] <= 1.0
