"""Evaluation workers on a stack share its GPUs with the PlaneWorkers: `planekv up` gives each PlaneWorker
``worker_gpu_share`` of its GPU and `planekv eval --workers N --address stack` asks for what is left, instead of
waiting for a whole GPU that the stack's workers hold (what a one-GPU H100 showed, 2026-12-05). The Ray cluster
here declares one GPU that does not exist: only Ray's bookkeeping is under test, no CUDA."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from planekv.orchestration.eval_workers import _start_actors, stack_gpu_share  # noqa: E402
from planekv.orchestration.stack import StackError, StackState, up  # noqa: E402
from tests.orchestration.local_ray import local_ray  # noqa: E402


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
    with local_ray(__name__, num_gpus=1) as ray:
        yield ray


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
