"""A running transformers cache follows the control plane's active placement policy: a version activated over the
REST API between two decode steps is read by the next step (``ControlPolicySource``), and the generation goes on
without a failed step; the control plane stopped mid-generation keeps the placement in use."""

from __future__ import annotations

import uuid

import pytest
import torch

pytest.importorskip("transformers")

from planekv.kvstore import ReadPolicy  # noqa: E402
from planekv.kvstore.reference import ReadKV  # noqa: E402
from planekv.models import hf  # noqa: E402
from planekv.orchestration.policy_source import ControlPolicySource  # noqa: E402
from planekv.services.clients import ControlClient  # noqa: E402
from planekv.tiering import PlacementPolicy  # noqa: E402
from tests.models.conftest import VOCAB, codec_for, tiny_llama  # noqa: E402

from .conftest import TOKEN  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

SHALLOW = PlacementPolicy(hot_planes={"k": 2, "v": 2}, block_bytes=1 << 20)
DEEP = PlacementPolicy(hot_planes={"k": 8, "v": 8}, block_bytes=1 << 20)


@pytest.fixture(scope="module")
def llama():
    m = tiny_llama()
    return m, codec_for(m)


class Activating:
    """A policy source that, before its ``at``-th answer, does what an operator would: ``act()`` over the API."""

    def __init__(self, inner: ControlPolicySource, at: int, act) -> None:
        self.inner, self.at, self.act, self.calls, self.seen = inner, at, act, 0, []

    def __call__(self):
        self.calls += 1
        if self.calls == self.at:
            self.act()
        got = self.inner()
        self.seen.append(None if got is None else got[0])
        return got


def _generate(model, codec, source, new: int = 6):
    ids = torch.randint(3, VOCAB, (1, 150), generator=torch.Generator().manual_seed(7))
    cache = hf.make_cache(model, ReadKV(codec, ReadPolicy.flexible(4.0)),
                          tiering=hf.Tiering(hot=2, max_tokens=200, placement=SHALLOW, policy_source=source))
    with torch.no_grad():
        model.generate(ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    return cache


def test_a_version_activated_between_steps_is_read_by_the_next_step(control, llama):
    model, codec = llama
    name = f"live-{uuid.uuid4().hex[:6]}"
    with ControlClient(control.url, TOKEN) as ctl:
        first = ctl.create_policy(name, SHALLOW)
        assert first.active_version == 1
        with ControlPolicySource(control.url, name, TOKEN) as inner:
            source = Activating(inner, 3, lambda: ctl.update_policy(name, DEEP, "deeper", activate=True))
            cache = _generate(model, codec, source)
    assert source.seen == [1, 1, 2, 2, 2]  # activated before the third step asked: read by that step
    assert cache.policy_version == 2 and cache.pages.hot_k == [8, 8] and cache.policy_refusals == {}


def test_the_control_plane_stopped_mid_generation_keeps_the_placement(tmp_path, redis_url, llama):
    from .conftest import start_control

    model, codec = llama
    proc = start_control(tmp_path, redis_url)
    name = f"away-{uuid.uuid4().hex[:6]}"
    with ControlClient(proc.url, TOKEN) as ctl:
        ctl.create_policy(name, SHALLOW)
    with ControlPolicySource(proc.url, name, TOKEN, timeout_s=1.0) as inner:
        source = Activating(inner, 3, proc.stop)
        try:
            cache = _generate(model, codec, source)
        finally:
            proc.stop()
    assert source.calls == 5 and source.seen == [1, 1]  # the later calls raised (unreachable); the steps went on
    assert cache.policy_version == 1 and cache.pages.hot_k == [2, 2]


def test_a_worker_reads_a_version_activated_mid_generation(control, tiny_model_dir):
    """A PlaneWorker following a control-plane policy gives its generation's cache the control plane as policy
    source: a version activated after the second token is read from the third on, the result row and the worker's
    stats record it."""
    from planekv.orchestration.worker import PlaneWorker

    name = f"worker-{uuid.uuid4().hex[:6]}"
    with ControlClient(control.url, TOKEN) as ctl:
        ctl.create_policy(name, SHALLOW)
        w = PlaneWorker(model=str(tiny_model_dir), calib_tokens=512, device="cpu", name="live", policy=name,
                        control_url=control.url, api_token=TOKEN)
        assert w.wait_ready(timeout=300)["state"] == "ready"
        tokens = []

        def after_each_token(n: int) -> None:
            tokens.append(n)
            if n == 2:
                ctl.update_policy(name, DEEP, "deeper mid-generation", activate=True)

        w._decode_step = after_each_token  # the worker's per-token hook (its failpoint in production)
        row = w.generate(["It was a truth universally acknowledged, " * 6], max_new_tokens=6, rate=4.0,
                         chat=False)[0]
    assert tokens[:3] == [1, 2, 3]
    assert row["policy_version"] == 2 and row["hot_planes"] == 8
    assert w.stats()["policy_version"] == 2
