"""`planekv.orchestration.connect`: a handle on the PlaneWorkers of a running stack (or any Ray cluster running them).

    from planekv.orchestration import connect
    cluster = connect()                                   # the stack `planekv up` started (its data dir)
    cluster.generate(["Name three colours."], max_new_tokens=16, rate=2.0)
    cluster.stats()

Requests are spread over the workers round-robin and gathered in order. The handle reads the stack's record
(``<data_dir>/stack/stack.json``) for the cluster's address and Ray's token; ``connect(address=...)`` joins another
cluster whose workers run in the ``planekv`` namespace.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .stack import StackError, port_busy, running, stack_dir
from .worker_host import NAMESPACE

READY_TIMEOUT_S = 600.0


class Cluster:
    """PlaneWorker actors: ``workers`` are Ray actor handles."""

    def __init__(self, workers: list[Any]) -> None:
        if not workers:
            raise StackError("no PlaneWorker is running in this cluster (`planekv up` starts them)")
        self.workers = workers

    def _spread(self, method: str, items: list[Any], **kw: Any) -> list[Any]:
        import ray

        refs = [getattr(self.workers[i % len(self.workers)], method).remote(*item, **kw)
                for i, item in enumerate(items)]
        return ray.get(refs)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> list[dict[str, Any]]:
        import ray

        return ray.get([w.wait_ready.remote(timeout) for w in self.workers])

    def generate(self, prompts: list[str], **kw: Any) -> list[dict[str, Any]]:
        """One result per prompt (PlaneWorker.generate's), in the prompts' order."""
        return [r[0] for r in self._spread("generate", [([p],) for p in prompts], **kw)]

    def score(self, texts: list[str], **kw: Any) -> list[dict[str, Any]]:
        return self._spread("score", [(t,) for t in texts], **kw)

    def stats(self) -> list[dict[str, Any]]:
        import ray

        return ray.get([w.stats.remote() for w in self.workers])

    def set_placement(self, placement: dict | None) -> None:
        import ray

        ray.get([w.set_placement.remote(placement) for w in self.workers])


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
    from ..settings import load_settings

    dd = Path(data_dir).expanduser() if data_dir else load_settings().data_dir
    state = running(dd)
    if state is None:
        raise StackError(f"no PlaneKV stack is running from {stack_dir(dd)}: `planekv up` starts one")
    address = f"127.0.0.1:{state.ports['ray_gcs']}"
    _use_stack_ray_settings(stack_dir(dd) / "ray-token")
    if not port_busy(state.ports["ray_gcs"]):
        raise StackError(f"the stack's Ray head does not answer on {address} (`planekv status` shows its state)")
    return address, [c.name for c in state.components if c.name.startswith("worker-")]


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
    return Cluster([ray.get_actor(n, namespace=NAMESPACE) for n in sorted(names)])
