"""planekv.orchestration: PlaneWorker (a model with PlaneKV caches; a Ray actor's body), the stack on one machine
(`planekv up / down / status`) and a handle on running workers (:func:`connect`). Builds on every other component.
"""

from .client import Cluster, WorkerLost, connect
from .stack import StackError
from .worker import PlaneWorker

__all__ = ["Cluster", "PlaneWorker", "StackError", "WorkerLost", "connect"]
