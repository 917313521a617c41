"""`planekv.orchestration.connect`: a handle on the PlaneWorkers of a running stack (or any Ray cluster running them).

    from planekv.orchestration import connect
    cluster = connect()                                   # the stack `planekv up` started (its data dir)
    cluster.generate(["Name three colours."], max_new_tokens=16, rate=2.0)
    cluster.stats()

Requests are spread over the workers round-robin and gathered in order; a request whose worker dies under it
(killed, crashed) runs once more on a live worker, or raises :class:`WorkerLost` naming the worker and what to do
(``Cluster``'s docstring); no call waits without bound. The handle reads the stack's record
(``<data_dir>/stack/stack.json``) for the cluster's address and Ray's token; ``connect(address=...)`` joins another
cluster whose workers run in the ``planekv`` namespace.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from .stack import StackError, StackState, port_busy, running, stack_dir
from .worker_host import NAMESPACE

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 600.0  # the longest a call waits with no request of it answered (a hung worker: WorkerLost)
RESTART_TIMEOUT_S = 60.0  # the longest a retry waits for a dead worker's restart (Ray's) to answer again
PING_TIMEOUT_S = 5.0
RESTART_POLL_S = 0.5
WHAT_TO_DO = ("`planekv status` shows the workers' state and logs; `planekv down` then `planekv up` restarts the "
              "stack, or connect() again once the worker is back")


class WorkerLost(RuntimeError):
    """A request's worker died (or stopped answering) and the request could not be answered by another: the
    message names the worker(s), the request and what to do. ``worker``: the name of the worker that failed
    last."""

    def __init__(self, message: str, worker: str) -> None:
        super().__init__(message)
        self.worker = worker


class Cluster:
    """PlaneWorker actors: ``workers`` are Ray actor handles, ``names`` their names (``worker-<i>``).

    **A worker that dies under a request** (its process killed, ``ray.kill``, a crash; Ray's ``RayActorError``):
    :meth:`generate` and :meth:`score` run that request once more, on a live worker: the next one of the handle
    that is alive (answers ``ping``, or is busy with a request), else the dead one itself once Ray has restarted it
    (waiting up to ``restart_timeout_s``; a stack's workers restart up to 3 times). Requests are deterministic
    (greedy decoding, teacher-forced scoring), so the retried answer is the one the dead worker would have given; a
    placement set with :meth:`set_placement` is set again on a restarted worker before it serves. A request whose
    worker dies a second time, or with no live worker to retry on, raises :class:`WorkerLost` naming the worker(s)
    and what to do; so does a call in which no request was answered for ``request_timeout_s`` (a hung worker).
    Every retry is logged and recorded in ``retries`` (worker, method, request index, error, the worker it was
    retried on). A request's own error (a bad argument: RayTaskError) is raised as it is, never retried."""

    def __init__(self, workers: list[Any], names: list[str] | None = None,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, restart_timeout_s: float = RESTART_TIMEOUT_S) -> None:
        if not workers:
            raise StackError("no PlaneWorker is running in this cluster (`planekv up` starts them)")
        if names is not None and len(names) != len(workers):
            raise ValueError(f"{len(names)} names for {len(workers)} workers")
        self.workers = workers
        self.names = list(names) if names is not None else [f"worker #{i}" for i in range(len(workers))]
        self.request_timeout_s = request_timeout_s
        self.restart_timeout_s = restart_timeout_s
        self.retries: list[dict[str, Any]] = []
        self._placement: tuple[dict | None] | None = None  # (the document set through this handle,) if any
        self._restarted: set[int] = set()  # workers that died: set the placement again before they serve

    def _spread(self, method: str, items: list[Any], **kw: Any) -> list[Any]:
        """``method(*item, **kw)`` for each item, spread round-robin over the workers, in the items' order; a
        request whose worker died runs once more on a live worker (the class docstring)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        live = [i for i in range(len(self.workers)) if i not in self._restarted or self._live(i, wait_s=0.0)]
        live = live or list(range(len(self.workers)))  # none answers: each request finds out (and retries)
        results: list[Any] = [None] * len(items)
        tries = [0] * len(items)
        failed: list[list[str]] = [[] for _ in items]  # per item, the workers that died under it
        in_flight: dict[Any, tuple[int, int]] = {}  # ObjectRef -> (item index, worker index)

        def submit(j: int, i: int) -> None:
            tries[j] += 1
            in_flight[getattr(self.workers[i], method).remote(*items[j], **kw)] = (j, i)

        for j in range(len(items)):
            submit(j, live[j % len(live)])
        while in_flight:
            ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=self.request_timeout_s)
            if not ready:
                waiting = sorted(in_flight.values())
                raise WorkerLost(
                    f"no {method} request answered in {self.request_timeout_s:.0f} s: "
                    + ", ".join(f"request {j} on {self.names[i]}" for j, i in waiting)
                    + f" still running (a hung or overloaded worker); {WHAT_TO_DO}", self.names[waiting[0][1]])
            j, i = in_flight.pop(ready[0])
            try:
                results[j] = ray.get(ready[0], timeout=self.request_timeout_s)
            except GetTimeoutError:  # not expected: the object is ready
                raise WorkerLost(f"{self.names[i]}: {method} request {j} answered but could not be fetched in "
                                 f"{self.request_timeout_s:.0f} s; {WHAT_TO_DO}", self.names[i]) from None
            except RayActorError as exc:
                self._restarted.add(i)
                failed[j].append(self.names[i])
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                if tries[j] >= 2:
                    raise WorkerLost(f"{method} request {j} lost its worker twice ({', '.join(failed[j])}; last: "
                                     f"{why}); nothing is retried more than once: {WHAT_TO_DO}", self.names[i]) from exc
                k = self._retry_target(i)
                if k is None:
                    raise WorkerLost(
                        f"{self.names[i]} died while serving {method} request {j} ({why}) and no worker of this "
                        f"handle is alive to retry it on (of {', '.join(self.names)}; {self.names[i]} not restarted "
                        f"within {self.restart_timeout_s:.0f} s); {WHAT_TO_DO}",
                        self.names[i]) from exc
                log.warning("%s died while serving %s request %d (%s); retrying it once on %s", self.names[i],
                            method, j, why, self.names[k])
                self.retries.append({"worker": self.names[i], "method": method, "request": j, "error": why,
                                     "retried_on": self.names[k]})
                submit(j, k)
        return results

    def _retry_target(self, dead: int) -> int | None:
        """A live worker for a request whose worker ``dead`` died: the next other one that answers, else ``dead``
        itself once Ray has restarted it; None if none does."""
        n = len(self.workers)
        for k in ((dead + d) % n for d in range(1, n)):
            if self._live(k, wait_s=0.0):
                return k
        return dead if self._live(dead, wait_s=self.restart_timeout_s) else None

    def _live(self, i: int, wait_s: float) -> bool:
        """Whether worker ``i`` is alive: it answers ``ping`` (not failed), or is busy (its ping queued behind a
        request for PING_TIMEOUT_S: a dead actor fails at once instead); polling up to ``wait_s`` while Ray restarts
        it. A worker that died gets this handle's placement again (sent ahead of the next request: one caller's
        tasks run in order)."""
        import ray
        from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

        deadline = time.monotonic() + wait_s
        while True:
            try:
                ping = ray.get(self.workers[i].ping.remote(), timeout=PING_TIMEOUT_S)
                if ping.get("state") == "failed":
                    return False
                break
            except GetTimeoutError:  # busy with a request (an actor runs one at a time)
                break
            except ActorDiedError:  # gone for good: Ray restarts it no more
                return False
            except RayActorError:  # restarting (ActorUnavailableError)
                if time.monotonic() + RESTART_POLL_S > deadline:
                    return False
                time.sleep(RESTART_POLL_S)
        if i in self._restarted:
            if self._placement is not None:
                self.workers[i].set_placement.remote(self._placement[0])
            self._restarted.discard(i)
        return True

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> list[dict[str, Any]]:
        import ray

        return ray.get([w.wait_ready.remote(timeout) for w in self.workers], timeout=timeout + PING_TIMEOUT_S)

    def generate(self, prompts: list[str], **kw: Any) -> list[dict[str, Any]]:
        """One result per prompt (PlaneWorker.generate's), in the prompts' order; a prompt whose worker dies under
        it is generated once more on a live worker, else :class:`WorkerLost` (the class docstring)."""
        return [r[0] for r in self._spread("generate", [([p],) for p in prompts], **kw)]

    def score(self, texts: list[str], **kw: Any) -> list[dict[str, Any]]:
        """One result per text (PlaneWorker.score's), in order; retried as :meth:`generate` is."""
        return self._spread("score", [(t,) for t in texts], **kw)

    def stats(self) -> list[dict[str, Any]]:
        import ray

        return ray.get([w.stats.remote() for w in self.workers], timeout=self.request_timeout_s)

    def set_placement(self, placement: dict | None) -> None:
        """Every worker's placement document from the next request on (PlaneWorker.set_placement); kept by the
        handle, which sets it again on a worker Ray restarted before the handle sends it a request."""
        import ray

        ray.get([w.set_placement.remote(placement) for w in self.workers], timeout=self.request_timeout_s)
        self._placement = (placement,)


def _use_stack_ray_settings(token_path: Path) -> None:
    """Make this process's Ray join the stack's head as its own processes do: token authentication with the
    stack's token, and 127.0.0.1 kept as it is (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; otherwise Ray rewrites a
    loopback address into the host's routable one, where the stack does not listen). Ray reads these when it is
    imported, so an already imported Ray is refreshed too, the token it may have read for another cluster (a local
    one that `ray.init()` started) forgotten (private switches: the only ones Ray has)."""
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path),
                      RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    import ray._private.ray_constants as ray_constants
    from ray._private.authentication.authentication_token_setup import _enable_token_auth
    from ray._raylet import AuthenticationTokenLoader

    ray_constants.ENABLE_RAY_CLUSTER = False
    _enable_token_auth()
    AuthenticationTokenLoader.instance().reset_cache()


def join_stack(data_dir: str | os.PathLike[str] | None = None) -> tuple[str, list[str]]:
    """(the Ray address, the PlaneWorker actors' names) of the stack recorded under ``data_dir`` (default: settings'
    data_dir), with this process's Ray set up to join it (``_use_stack_ray_settings``)."""
    address, state = join_stack_state(data_dir)
    return address, [c.name for c in state.components if c.name.startswith("worker-")]


def join_stack_state(data_dir: str | os.PathLike[str] | None = None) -> tuple[str, StackState]:
    """:func:`join_stack`, with the stack's recorded state (its PlaneWorkers' GPU share among others)."""
    from ..settings import load_settings

    dd = Path(data_dir).expanduser() if data_dir else load_settings().data_dir
    state = running(dd)
    if state is None:
        raise StackError(f"no PlaneKV stack is running from {stack_dir(dd)}: `planekv up` starts one")
    address = f"127.0.0.1:{state.ports['ray_gcs']}"
    _use_stack_ray_settings(stack_dir(dd) / "ray-token")
    if not port_busy(state.ports["ray_gcs"]):
        raise StackError(f"the stack's Ray head does not answer on {address} (`planekv status` shows its state)")
    return address, state


def connect(data_dir: str | os.PathLike[str] | None = None, address: str | None = None) -> Cluster:
    """Join the stack recorded under ``data_dir`` (default: settings' data_dir), or the cluster at ``address``."""
    names: list[str] = []
    if address is None:
        address, names = join_stack(data_dir)
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    if not names:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == NAMESPACE and a["name"].startswith("worker-")]
    names = sorted(names)
    return Cluster([ray.get_actor(n, namespace=NAMESPACE) for n in names], names)
