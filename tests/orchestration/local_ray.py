"""A local Ray for a test module: loopback, no token auth, the module's classes and functions pickled by value (the
workers cannot import a test module), everything the module changed in this process put back afterwards."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from planekv.orchestration.worker_host import NAMESPACE


@contextlib.contextmanager
def local_ray(module: str, num_gpus: int = 0) -> Iterator[Any]:
    """``ray``, initialised with 2 CPUs and ``num_gpus`` declared GPUs (bookkeeping only: none need exist)."""
    import ray
    from ray._raylet import AuthenticationTokenLoader, Config

    if ray.is_initialized():
        ray.shutdown()
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    Config.initialize("")  # the auth mode another test's connect() may have set in this process
    AuthenticationTokenLoader.instance().reset_cache()
    ray.cloudpickle.register_pickle_by_value(sys.modules[module])
    ray.init(num_cpus=2, num_gpus=num_gpus, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[module])
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
