"""Evaluation workers on a stack share its GPUs with the PlaneWorkers: `planekv up` gives each PlaneWorker
``worker_gpu_share`` of its GPU and `planekv eval --workers N --address stack` asks for what is left, instead of
waiting for a whole GPU that the stack's workers hold (what a one-GPU H100 showed, 2026-12-05). The Ray cluster
here declares one GPU that does not exist: only Ray's bookkeeping is under test, no CUDA."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("ray")

from planekv.orchestration.eval_workers import _start_actors, stack_gpu_share  # noqa: E402
from planekv.orchestration.stack import StackError, StackState, up  # noqa: E402
from planekv.orchestration.worker_host import NAMESPACE  # noqa: E402


class _Setup:
    device = "cuda"


class _Recipe:
    """Stands for a SetupRecipe of a CUDA run: building it loads nothing."""

    device = "cuda"

    def build(self) -> _Setup:
        return _Setup()


class _Holder:
    """Stands for a stack's PlaneWorker holding its share of the GPU."""

    def ping(self) -> bool:
        return True


@pytest.fixture(scope="module")
def ray_one_gpu():
    import ray
    from ray._raylet import AuthenticationTokenLoader, Config

    if ray.is_initialized():
        ray.shutdown()
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def test_what_the_stack_leaves_of_a_gpu() -> None:
    assert stack_gpu_share(0.5) == 0.5 and stack_gpu_share(0.25) == 0.75 and stack_gpu_share(1.0) == 0.0
    assert StackState("d", 0.0, {}, None).worker_gpu_share == 1.0  # a state file from before the share: whole GPUs
    with pytest.raises(StackError, match="worker_gpu_share must be in"):
        up("/nonexistent-planekv-test", worker_gpu_share=0.0)


def test_an_evaluation_worker_takes_the_share_a_plane_worker_leaves(ray_one_gpu) -> None:
    ray = ray_one_gpu

    def hold(share: float):
        h = ray.remote(_Holder).options(num_cpus=0, num_gpus=share).remote()
        assert ray.get(h.ping.remote(), timeout=60)
        return h

    whole = hold(1.0)
    with pytest.raises(ValueError, match="worker-gpu-share 0.5"):  # workers holding the GPU whole: said, no wait
        _start_actors(_Recipe(), 1, 0.0)
    ray.kill(whole)
    half = hold(0.5)
    with pytest.raises(ValueError, match="needs 1.5 GPUs"):  # more than the cluster has, even empty
        _start_actors(_Recipe(), 3, 0.5)
    (actor,) = _start_actors(_Recipe(), 1, 0.5)
    assert ray.available_resources().get("GPU", 0) == 0  # the two halves: the PlaneWorker's and the evaluation's
    ray.kill(actor)
    ray.kill(half)
