"""The ``"ray"`` executor of the evaluation jobs: ``planekv eval perplexity|passkey|all ... --workers N``.

N ``EvalWorker`` actors (one GPU each when the cluster has GPUs and --device is not cpu, else one CPU each, whose
torch then runs one thread; restarted by Ray up to ACTOR_MAX_RESTARTS times) each build the driver's Setup from its
recipe (the driver calibrated once; every worker uses its calibration) and run units; the driver keeps at most
IN_FLIGHT_PER_ACTOR units queued at each actor and yields results as they finish. A unit whose actor died under it
(``RayActorError``) runs again once the actor is back (at most UNIT_TRIES tries in all); an actor Ray no longer
restarts (``ray.kill``, its restarts spent) leaves the pool and its units run on the others. No unit is lost
silently: the run yields every unit's result, or raises naming the units not run (every worker gone, a unit's
worker dead UNIT_TRIES times, a timeout), which ``--resume`` runs. Every wait is bounded: the workers' start by
START_TIMEOUT_S, the units by the job's ``--unit-timeout`` (no unit finished for that long).

The Ray cluster: with ``address`` None, the one in ``RAY_ADDRESS`` when it is set (a Ray job's driver has it: a
job submitted with ``planekv eval submit`` runs its units on the cluster it was submitted to), else one started
on this machine for the job (``num_cpus`` = N, its GPUs) and
stopped after it; ``"stack"``: the one ``planekv up`` started (its token auth, ``client.join_stack``); else any Ray
address (``host:port``, ``auto``), with Ray's own environment (e.g. ``RAY_AUTH_TOKEN``) for auth. An already
connected Ray (``ray.is_initialized()``) is used as it is. Actors live in the ``planekv`` namespace.

Importing this module registers the executor (``planekv.orchestration.cli`` does, so every ``planekv`` command
has it).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from ..evaluation.executors import WORKERS_EXECUTOR, SetupRecipe, register_executor
from ..evaluation.units import Result, Unit, UnitFunction
from .worker_host import NAMESPACE

log = logging.getLogger(__name__)

ACTOR_MAX_RESTARTS = 3
UNIT_TRIES = 3  # runs of one unit whose actor died under it, in all
IN_FLIGHT_PER_ACTOR = 2  # one running, one queued at the actor
START_TIMEOUT_S = 600.0  # an actor's start or restart: the model load
RESTART_POLL_S = 0.5


class EvalWorker:
    """A Ray actor's body: the driver's Setup, rebuilt from its recipe, running the job's units."""

    def __init__(self, recipe: SetupRecipe) -> None:
        self.setup = recipe.build()

    def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "device": str(self.setup.device)}

    def run(self, fn: UnitFunction, spec: dict[str, Any]) -> Result:
        return fn(self.setup, spec)


class RayExecutor:
    """``workers`` EvalWorker actors on the Ray cluster at ``address`` (module docstring)."""

    def __init__(self, recipe: SetupRecipe, workers: int, address: str | None, unit_timeout_s: float) -> None:
        import ray

        self.unit_timeout_s = unit_timeout_s
        self._connected_here = not ray.is_initialized()
        gpu_share = 1.0  # an already connected Ray is used as it is: a GPU each
        if self._connected_here:
            gpu_share = _init_ray(workers, address)
        self.actors: list[Any] = []
        try:
            self.actors = _start_actors(recipe, workers, gpu_share)
        except BaseException:
            self.close()
            raise

    def run(self, fn: UnitFunction, units: Sequence[Unit]) -> Iterator[tuple[Unit, Result]]:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        pending = deque(units)
        tries: dict[str, int] = {}
        in_flight: dict[Any, tuple[Unit, int]] = {}  # ObjectRef -> (unit, actor index)
        live = list(range(len(self.actors)))
        while pending or in_flight:
            for i in live:
                while pending and sum(a == i for _, a in in_flight.values()) < IN_FLIGHT_PER_ACTOR:
                    unit = pending.popleft()
                    in_flight[self.actors[i].run.remote(fn, unit.spec)] = (unit, i)
            ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=self.unit_timeout_s)
            if not ready:
                raise TimeoutError(f"no unit finished in {self.unit_timeout_s:.0f} s (--unit-timeout); "
                                   f"{len(in_flight)} running, {len(pending)} waiting; not run: "
                                   f"{_keys([u for u, _ in in_flight.values()] + list(pending))} "
                                   "(`--resume` runs them)")
            unit, i = in_flight.pop(ready[0])
            try:
                result = ray.get(ready[0], timeout=self.unit_timeout_s)
            except RayActorError as exc:
                tries[unit.key] = tries.get(unit.key, 0) + 1
                if tries[unit.key] >= UNIT_TRIES:
                    raise RuntimeError(f"unit {unit.key}: its worker died under it {UNIT_TRIES} times; not run: "
                                       f"{_keys([unit, *(u for u, _ in in_flight.values()), *pending])} "
                                       "(`--resume` runs them)") from exc
                log.warning("evaluation worker %d died during unit %s; it runs again once a worker is back",
                            i, unit.key)
                if i in live and not self._back(i):
                    live.remove(i)
                if not live:
                    raise RuntimeError("every evaluation worker died (Ray restarts each at most "
                                       f"{ACTOR_MAX_RESTARTS} times); not run: "
                                       f"{_keys([unit, *(u for u, _ in in_flight.values()), *pending])} "
                                       "(`--resume` runs them)") from exc
                pending.appendleft(unit)
                continue
            except RayTaskError as exc:
                raise RuntimeError(f"unit {unit.key} failed in evaluation worker {i}: {exc}") from exc
            yield unit, result

    def _back(self, i: int) -> bool:
        """Whether actor ``i`` is alive again (Ray restarted it), waiting up to START_TIMEOUT_S for its restart;
        False if it is gone for good."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError

        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                info = ray.get(self.actors[i].ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
            except ActorUnavailableError:  # restarting
                if time.monotonic() > deadline:
                    raise TimeoutError(f"evaluation worker {i} did not come back in {START_TIMEOUT_S:.0f} s") from None
                time.sleep(RESTART_POLL_S)
                continue
            except ActorDiedError:
                log.warning("evaluation worker %d is gone for good (Ray restarts it no more)", i)
                return False
            log.info("evaluation worker %d is back (pid %d)", i, info["pid"])
            return True

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self._connected_here:
            ray.shutdown()


def _keys(units: list[Unit], most: int = 20) -> str:
    """The units' keys, for an error (the first ``most``)."""
    keys = [u.key for u in units]
    return ", ".join(keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")


def _init_ray(workers: int, address: str | None) -> float:
    """Join or start the cluster (module docstring); returns the GPU share each evaluation worker asks for: what
    the stack's PlaneWorkers leave of a GPU on ``"stack"``, else a whole GPU."""
    import ray

    if address is None and os.environ.get("RAY_ADDRESS"):  # inside a Ray job (or told so): its cluster
        ray.init(address=os.environ["RAY_ADDRESS"], namespace=NAMESPACE, log_to_driver=False)
        log.info("joined the Ray cluster of this job (RAY_ADDRESS %s)", os.environ["RAY_ADDRESS"])
        return 1.0
    if address is None:
        import torch

        ray.init(num_cpus=workers, num_gpus=torch.cuda.device_count(), include_dashboard=False, namespace=NAMESPACE,
                 log_to_driver=False)
        return 1.0
    share = 1.0
    if address == "stack":
        from .client import join_stack_state

        address, state = join_stack_state()
        share = stack_gpu_share(state.worker_gpu_share)
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    return share


def stack_gpu_share(worker_share: float) -> float:
    """The GPU share an evaluation worker asks for on a stack whose PlaneWorkers take ``worker_share`` of their
    GPU: what they leave (0 when they take it whole: the evaluation workers then run where the cluster has a GPU
    of its own, or on CPUs where it has none)."""
    return round(max(0.0, 1.0 - worker_share), 6)


def worker_request(workers: int, gpu_share: float | None, have: float, free: float) -> float:
    """What each of ``workers`` evaluation workers asks for of the resource it runs on: ``gpu_share`` of a GPU (a
    whole one for 0), or one CPU (``gpu_share`` None); ``have`` / ``free``: the cluster's total and free amount of
    it. Refuses what can never fit, and a stack whose PlaneWorkers hold their GPUs whole (``gpu_share`` 0) with too
    few free; warns where the workers will wait."""
    need = "CPU" if gpu_share is None else "GPU"
    per_worker = 1.0 if gpu_share is None else (gpu_share or 1.0)
    if workers > int(have // per_worker):
        raise ValueError(f"--workers {workers} needs {workers * per_worker:g} {need}s ({per_worker:g} per worker); "
                         f"the cluster has {have:g}")
    if gpu_share == 0 and free < workers:
        raise ValueError(f"the stack's PlaneWorkers hold its GPUs whole ({free:g} free): start it with "
                         "`planekv up --worker-gpu-share 0.5` to leave room for evaluation workers, or run the "
                         "evaluation without --address stack")
    if workers * per_worker > free:
        log.warning("%g of the cluster's %ss are free now; the evaluation workers wait for %g (at most %.0f s)",
                    free, need, workers * per_worker, START_TIMEOUT_S)
    return per_worker


def _start_actors(recipe: SetupRecipe, workers: int, gpu_share: float = 1.0) -> list[Any]:
    """``workers`` EvalWorkers, each on ``gpu_share`` of a GPU when the cluster has GPUs (and --device is not cpu),
    else on a CPU; all ready, or raises. ``gpu_share`` 0 (a stack whose workers hold their GPUs whole): a whole GPU
    where one is free, else refused with what to do."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    use_gpus = recipe.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= 1
    need = "GPU" if use_gpus else "CPU"
    per_worker = worker_request(workers, gpu_share if use_gpus else None, ray.cluster_resources().get(need, 0),
                                ray.available_resources().get(need, 0))
    cls = ray.remote(EvalWorker).options(num_cpus=1, num_gpus=per_worker if use_gpus else 0,
                                         max_restarts=ACTOR_MAX_RESTARTS, max_task_retries=0)
    actors = [cls.remote(recipe) for _ in range(workers)]
    try:
        infos = ray.get([a.ready.remote() for a in actors], timeout=START_TIMEOUT_S)
    except GetTimeoutError:
        for a in actors:
            ray.kill(a)
        raise TimeoutError(f"{workers} evaluation workers did not start in {START_TIMEOUT_S:.0f} s (free in the "
                           f"cluster: {ray.available_resources()})") from None
    except RayActorError as exc:
        for a in actors:
            ray.kill(a)
        raise RuntimeError(f"an evaluation worker failed to start: {exc}") from exc
    log.info("%d evaluation workers ready: %s", workers, ", ".join(f"pid {x['pid']} on {x['device']}" for x in infos))
    return actors


register_executor(WORKERS_EXECUTOR, RayExecutor)
