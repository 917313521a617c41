"""A PlaneWorker killed mid-decode (reliability issue 32): the handle (``planekv.orchestration.Cluster``, what
``connect()`` returns) runs the request once more on a live worker, and the tokens are the fault-free run's; with no
live worker, a second loss or a hung worker it raises WorkerLost naming the worker and what to do, within a bound.
The evaluation executor (``--workers N``) reruns the units of a worker killed for good on the others, or fails
naming the units not run.

Ray runs here as in a user's process: a local cluster of 2 CPUs (token auth off: a loopback test cluster), CPU
workers with the reference reader and the tiny model. A worker is killed at a known point of a generation: after
its third token, by the failpoint ``worker.decode_step`` (``PLANEKV_FAILPOINTS``, SIGKILL) or by the test's
``GatedWorker``, which SIGKILLs itself once, or stops there until the test has killed it (``ray.kill``)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("ray")
pytest.importorskip("transformers")

from planekv.orchestration import Cluster, WorkerLost  # noqa: E402
from planekv.orchestration.worker import PlaneWorker  # noqa: E402
from planekv.orchestration.worker_host import NAMESPACE  # noqa: E402
from tests.orchestration.local_ray import local_ray  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

PROMPTS = ["It was a truth universally acknowledged, that a single man in possession of a good fortune",
           "The weather at Hartfield was"]
NEW_TOKENS = 8
AT = 3  # the token after which a worker is killed: mid-decode
WAIT_S = 120.0  # every wait of these tests is bounded by this


class GatedWorker(PlaneWorker):
    """A PlaneWorker that, after its AT-th token of a generation, looks in ``gate``: ``kill`` there (taken once)
    SIGKILLs its process; ``pause`` (taken once) writes ``reached`` (its pid) and waits, at most WAIT_S, for ``go``."""

    def __init__(self, *args, gate: str, **kw) -> None:
        super().__init__(*args, **kw)
        self.gate = Path(gate)

    def _decode_step(self, tokens: int) -> None:
        super()._decode_step(tokens)
        if tokens != AT:
            return
        if _take(self.gate / "kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        if _take(self.gate / "pause"):
            (self.gate / "reached").write_text(str(os.getpid()))
            deadline = time.monotonic() + WAIT_S
            while not _take(self.gate / "go") and time.monotonic() < deadline:
                time.sleep(0.05)


def _take(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def _wait_for(path: Path) -> str:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear in {WAIT_S:.0f} s"
        time.sleep(0.05)
    text = path.read_text()
    path.unlink()
    return text


def _tokens(results: list[dict]) -> list[tuple]:
    """What must not change under a fault: each prompt's text, token counts and bits read (not its seconds)."""
    return [(r["text"], r["new_tokens"], r["prompt_tokens"], r["bits_per_scalar"]) for r in results]


@pytest.fixture(scope="module")
def ray_local():
    with local_ray(__name__, num_gpus=0) as ray:
        yield ray


def _start(ray, name: str, model, calib, gate: Path, max_restarts: int = 0, env: dict | None = None):
    """A GatedWorker actor ``name`` as worker_host.start_actor starts a PlaneWorker (one CPU, no task retries)."""
    gate.mkdir(parents=True, exist_ok=True)
    opts = dict(name=name, namespace=NAMESPACE, num_cpus=1, num_gpus=0, max_restarts=max_restarts, max_task_retries=0)
    if env:
        opts["runtime_env"] = {"env_vars": env}
    return ray.remote(GatedWorker).options(**opts).remote(model=str(model), calibration=str(calib), device="cpu",
                                                         name=name, gate=str(gate))


@pytest.mark.slow  # two model-loading Ray workers on 2 cores
def test_a_worker_sigkilled_mid_decode_is_retried_on_the_other_worker_with_the_same_tokens(
        ray_local, tiny_model_dir, calib_path, tmp_path):
    ray = ray_local
    w0 = _start(ray, "worker-0", tiny_model_dir, calib_path, tmp_path / "g0",
                env={"PLANEKV_FAILPOINTS": f"worker.decode_step=kill@{AT}"})  # every generation dies at token AT
    w1 = _start(ray, "worker-1", tiny_model_dir, calib_path, tmp_path / "g1")
    try:
        cluster = Cluster([w0, w1], ["worker-0", "worker-1"], request_timeout_s=WAIT_S, restart_timeout_s=WAIT_S)
        cluster.wait_ready(timeout=WAIT_S)
        fault_free = Cluster([w1], ["worker-1"]).generate(PROMPTS, max_new_tokens=NEW_TOKENS, rate=4.0, chat=False)
        t0 = time.monotonic()
        out = cluster.generate(PROMPTS, max_new_tokens=NEW_TOKENS, rate=4.0, chat=False)  # PROMPTS[0] on worker-0
        assert time.monotonic() - t0 < WAIT_S
        assert _tokens(out) == _tokens(fault_free) and all(r["new_tokens"] == NEW_TOKENS for r in out)
        assert [(r["worker"], r["request"], r["retried_on"]) for r in cluster.retries] == [("worker-0", 0, "worker-1")]
        with pytest.raises(ray.exceptions.ActorDiedError):  # killed for good (no restarts): not a silent success
            ray.get(w0.ping.remote(), timeout=WAIT_S)
        # the handle no longer sends worker-0 anything: both prompts run on worker-1, nothing retried
        again = cluster.generate(PROMPTS, max_new_tokens=NEW_TOKENS, rate=4.0, chat=False)
        assert _tokens(again) == _tokens(fault_free) and len(cluster.retries) == 1
    finally:
        ray.kill(w0)
        ray.kill(w1)


@pytest.mark.slow  # a model-loading Ray worker, restarted once
def test_a_lone_worker_killed_mid_decode_is_retried_after_its_restart_or_reported(
        ray_local, tiny_model_dir, calib_path, tmp_path):
    """One worker (Ray restarts it once): SIGKILLed after its third token, the request runs again on it once it is
    back, with the fault-free tokens. Hung, the call fails after the request timeout; killed for good
    (``ray.kill``) mid-decode, it fails at once; both errors name the worker and what to do."""
    ray, gate = ray_local, tmp_path / "g"
    w = _start(ray, "worker-0", tiny_model_dir, calib_path, gate, max_restarts=1)
    pool = ThreadPoolExecutor(1)
    try:
        cluster = Cluster([w], ["worker-0"], request_timeout_s=WAIT_S, restart_timeout_s=WAIT_S)
        cluster.wait_ready(timeout=WAIT_S)
        fault_free = cluster.generate(PROMPTS, max_new_tokens=NEW_TOKENS, rate=4.0, chat=False)

        (gate / "kill").touch()  # SIGKILL after token AT, once
        out = cluster.generate(PROMPTS, max_new_tokens=NEW_TOKENS, rate=4.0, chat=False)
        assert not (gate / "kill").exists()  # it fired
        assert _tokens(out) == _tokens(fault_free)
        # prompt 0's request, and prompt 1's if it was already queued at the worker, ran again on it once back
        assert {(r["worker"], r["retried_on"]) for r in cluster.retries} == {("worker-0", "worker-0")}
        assert 0 in {r["request"] for r in cluster.retries} and len(cluster.retries) <= 2  # in either order
        stats = cluster.stats()[0]  # a fresh process: only what it served since its restart
        assert stats["requests"]["generate"] == 2 and stats["tokens_generated"] == sum(r["new_tokens"] for r in out)

        (gate / "pause").touch()  # hung after token AT (until "go")
        hung = Cluster([w], ["worker-0"], request_timeout_s=3.0)
        t0 = time.monotonic()
        with pytest.raises(WorkerLost, match=r"no generate request answered in 3 s: request 0 on worker-0") as err:
            hung.generate(PROMPTS[:1], max_new_tokens=NEW_TOKENS, rate=4.0, chat=False)
        assert 3.0 <= time.monotonic() - t0 < 30.0 and "planekv status" in str(err.value)
        assert err.value.worker == "worker-0"
        _wait_for(gate / "reached")
        (gate / "go").touch()
        assert _tokens(cluster.generate(PROMPTS, max_new_tokens=NEW_TOKENS, rate=4.0, chat=False)) == \
            _tokens(fault_free)  # the hung request finished first; the worker serves on

        (gate / "pause").touch()
        pending = pool.submit(cluster.generate, PROMPTS[:1], max_new_tokens=NEW_TOKENS, rate=4.0, chat=False)
        _wait_for(gate / "reached")  # mid-decode, after token AT
        t0 = time.monotonic()
        ray.kill(w)  # gone for good: no restart
        with pytest.raises(WorkerLost, match=r"worker-0 died while serving generate request 0") as err:
            pending.result(timeout=WAIT_S)
        assert time.monotonic() - t0 < 30.0
        assert "no worker of this handle is alive" in str(err.value) and "planekv status" in str(err.value)
    finally:
        (gate / "go").touch()
        pool.shutdown(wait=False, cancel_futures=True)
        ray.kill(w)


class _Recipe:
    """An evaluation worker's Setup stand-in: the units below need no model."""

    device = "cpu"

    def build(self) -> SimpleNamespace:
        return SimpleNamespace(device="cpu", pid=os.getpid())


def _square_unit(setup: SimpleNamespace, spec: dict) -> dict:
    """A unit: x squared; unit ``spec["pause"]`` writes ``reached`` (the worker's pid) in ``spec["gate"]`` and waits
    for ``go`` (at most WAIT_S) the first time it runs."""
    gate = Path(spec["gate"])
    if spec["x"] == spec["pause"] and _take(gate / "pause"):
        (gate / "reached").write_text(str(setup.pid))
        deadline = time.monotonic() + WAIT_S
        while not _take(gate / "go") and time.monotonic() < deadline:
            time.sleep(0.05)
    return {"x": spec["x"], "y": spec["x"] ** 2}


@pytest.mark.slow  # a Ray cluster's evaluation workers (no model)
def test_an_evaluation_worker_killed_for_good_mid_unit_has_its_units_rerun_or_named(ray_local, tmp_path):
    """``--workers 2``: one worker ``ray.kill``ed (no restart) in the middle of a unit; its units run on the other
    and every unit's result comes once, right. Then the last worker killed mid-unit: the run fails naming the units
    not run, never a short table."""
    from planekv.evaluation.units import Unit
    from planekv.orchestration.eval_workers import RayExecutor

    ray = ray_local
    ex = RayExecutor(_Recipe(), workers=2, address=None, unit_timeout_s=WAIT_S)
    pool = ThreadPoolExecutor(1)
    try:
        by_pid = {ray.get(a.ready.remote(), timeout=WAIT_S)["pid"]: a for a in ex.actors}
        units = [Unit(f"u{x}", {"x": x, "pause": 3, "gate": str(tmp_path)}) for x in range(8)]
        (tmp_path / "pause").touch()
        running = pool.submit(lambda: list(ex.run(_square_unit, units)))
        ray.kill(by_pid[int(_wait_for(tmp_path / "reached"))])  # the worker running u3, gone for good
        got = running.result(timeout=WAIT_S)
        assert sorted((u.key, r["y"]) for u, r in got) == [(f"u{x}", x * x) for x in range(8)]  # each once, right

        (tmp_path / "pause").touch()
        running = pool.submit(lambda: list(ex.run(_square_unit, units)))
        ray.kill(by_pid[int(_wait_for(tmp_path / "reached"))])  # the last worker
        with pytest.raises(RuntimeError, match=r"every evaluation worker died .*not run: .*u3") as err:
            running.result(timeout=WAIT_S)
        assert "--resume" in str(err.value)
    finally:
        (tmp_path / "go").touch()
        pool.shutdown(wait=False, cancel_futures=True)
        ex.close()
