"""The control plane (DESIGN section 6): formats, calibrations, placement policies, the cache
registry and stats, over Redis (metadata only).

- **formats** keyed by ``format_id`` (the hash of a FormatSpec's canonical JSON): registering the
  same spec again is idempotent (200); a spec whose id is not the one it is registered under, whose
  calibration is not registered (register it first), or that contradicts its calibration, is a
  conflict (409).
- **calibrations** are immutable and content-addressed (``calibration_id``); each registration gets
  a version number. Artifact bytes live in ``<data_dir>/control/calibrations/`` (written, fsynced,
  renamed, *then* published in Redis); Redis holds their metadata and sha256.
- **placement policies** are named, versioned documents: create, update (a new version), activate,
  roll back (undo the last activation), history. Activation is published on ``pkv:policy-activated``.
- **caches**: sequences, their format, and the planes each tier holds (from the stores' block index).
- **stores**: the store ids the block index knows (their heartbeat age and entries); a store id whose
  heartbeat is older than a grace period can be forgotten, its entries removed (``routes_stores``).

Where things are: ``app`` (``create_app``, ``serve``, ``main``) composes the routers
``routes_formats``, ``routes_calibrations``, ``routes_policies``, ``routes_caches``,
``routes_stores`` and ``routes_ops`` (health, metrics, stats); ``schemas`` holds the request and response bodies,
``params`` the path parameters, ``context`` what the routes share (Redis, its Lua ``scripts``
from ``lua/*.lua``, the artifact directory), ``metrics`` the Prometheus gauges and ``body_limit``
the upload size limit.

Run: ``planekv control`` or ``python -m planekv.services.control``.
"""

from .app import create_app, main, serve

__all__ = ["create_app", "main", "serve"]
