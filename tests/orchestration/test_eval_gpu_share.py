"""Evaluation workers on a stack share its GPUs with the PlaneWorkers: `planekv up` gives each PlaneWorker
``worker_gpu_share`` of its GPU and `planekv eval --workers N --address stack` asks for what is left, instead of
waiting for a whole GPU that the stack's workers hold (what a one-GPU H100 showed, 2026-12-05). The Ray cluster
here declares one GPU that does not exist: only Ray's bookkeeping is under test, no CUDA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")

from planekv.orchestration.eval_workers import stack_gpu_share, worker_request  # noqa: E402
from planekv.orchestration.stack import StackError, StackState, up  # noqa: E402

# A process of its own (nothing another test set in this process's Ray or environment reaches it): a Ray with one
# declared GPU, half of it held as a stack's PlaneWorker holds it, then an evaluation worker asking for the other half.
BESIDE_A_PLANE_WORKER = """
import ray
from planekv.orchestration import eval_workers
from planekv.orchestration.worker_host import NAMESPACE

eval_workers.START_TIMEOUT_S = 180.0

class Setup:
    device = "cuda"

class Recipe:  # a SetupRecipe of a CUDA run whose build loads nothing
    device = "cuda"
    def build(self):
        return Setup()

class Holder:
    def ping(self):
        return True

ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
half = ray.remote(Holder).options(num_cpus=0, num_gpus=0.5).remote()
assert ray.get(half.ping.remote(), timeout=120)
(actor,) = eval_workers._start_actors(Recipe(), 1, 0.5)
print("GPU free", ray.available_resources().get("GPU", 0))
ray.shutdown()
"""


def test_what_the_stack_leaves_of_a_gpu() -> None:
    assert stack_gpu_share(0.5) == 0.5 and stack_gpu_share(0.25) == 0.75 and stack_gpu_share(1.0) == 0.0
    assert StackState("d", 0.0, {}, None).worker_gpu_share == 1.0  # a state file from before the share: whole GPUs
    with pytest.raises(StackError, match="worker_gpu_share must be in"):
        up("/nonexistent-planekv-test", worker_gpu_share=0.0)


def test_what_an_evaluation_worker_asks_for_and_what_is_refused() -> None:
    assert worker_request(1, 0.5, have=1.0, free=0.5) == 0.5  # beside a PlaneWorker holding the other half
    assert worker_request(2, 0.5, have=1.0, free=0.0) == 0.5  # fits once the GPU frees: waits (warned)
    assert worker_request(2, None, have=2.0, free=2.0) == 1.0  # a CPU each
    with pytest.raises(ValueError, match="needs 1.5 GPUs"):  # more than the cluster has, even empty
        worker_request(3, 0.5, have=1.0, free=1.0)
    with pytest.raises(ValueError, match="worker-gpu-share 0.5"):  # workers holding the GPU whole: said, no wait
        worker_request(1, 0.0, have=1.0, free=0.0)
    assert worker_request(1, 0.0, have=2.0, free=1.0) == 1.0  # a whole GPU the stack left free


def test_an_evaluation_worker_takes_the_share_a_plane_worker_leaves() -> None:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, "-c", BESIDE_A_PLANE_WORKER], env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "GPU free 0" in proc.stdout  # the two halves: the PlaneWorker's and the evaluation worker's
