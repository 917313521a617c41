"""The control plane's active placement policy, as a running cache asks for it between decode steps.

``ControlPolicySource(control_url, name)`` is a ``planekv.models.hf.Tiering.policy_source``: called before every
decode step, it answers the active version of policy ``name`` as ``(version, PlacementPolicy)``, so a version
activated through the REST API (``PUT /v1/policies/{name}`` with ``activate``, or ``POST .../activate``) is read
by the next step. ``interval_s`` > 0 asks at most that often (the version last seen in between); 0 asks at every
step (one loopback GET). Errors raise: the cache logs them and keeps the placement it has (the control plane
away must not fail a decode step); a policy that does not exist (any more) answers None (keep the current one).
"""

from __future__ import annotations

import time

from ..services.clients import ControlClient
from ..tiering import PlacementPolicy


class ControlPolicySource:
    """``()`` -> (version, policy) of the active version of policy ``name`` at ``control_url``, or None."""

    def __init__(self, control_url: str, name: str, api_token: str | None = None, interval_s: float = 0.0,
                 timeout_s: float = 2.0) -> None:
        if interval_s < 0 or timeout_s <= 0:
            raise ValueError(f"interval_s must be >= 0 and timeout_s > 0, got {interval_s} and {timeout_s}")
        self.name = name
        self.interval_s = interval_s
        self._client = ControlClient(control_url, api_token, timeout_s=timeout_s, retries=0)
        self._last: tuple[int, PlacementPolicy] | None = None
        self._asked = -float("inf")

    def __call__(self) -> tuple[int, PlacementPolicy] | None:
        if time.monotonic() - self._asked < self.interval_s:
            return self._last
        active = self._client.active_policy(self.name)  # raises ServiceError: unreachable, or an error answer
        self._asked = time.monotonic()
        self._last = None if active is None else (active.version, active.policy)
        return self._last

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> ControlPolicySource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
