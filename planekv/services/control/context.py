"""What the control plane's routes share, and how a route gets it.

The app's lifespan builds one :class:`ControlContext` once Redis answers and puts it on
``app.state.control``; a route takes it as a parameter typed :data:`Context` (a FastAPI
dependency, invisible in the OpenAPI schema). The Prometheus side lives on ``app.state.metrics``
from the start (``/metrics`` answers even while Redis is down).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, Request

from ...settings import Settings
from .metrics import ControlMetrics
from .scripts import ControlScripts


@dataclass(frozen=True)
class ControlContext:
    settings: Settings
    redis: aioredis.Redis
    scripts: ControlScripts
    calibration_dir: Path  # the calibration artifacts (metadata in Redis names each file)


def calibration_dir(settings: Settings) -> Path:
    return settings.data_dir / "control" / "calibrations"


def control_context(request: Request) -> ControlContext:
    return request.app.state.control


def control_metrics(request: Request) -> ControlMetrics:
    return request.app.state.metrics


Context = Annotated[ControlContext, Depends(control_context)]
Metrics = Annotated[ControlMetrics, Depends(control_metrics)]
