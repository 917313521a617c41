"""`planekv control` and `planekv store`: run a service in the foreground (uvicorn, one process).

The flags live in :mod:`planekv.services.arguments`, free of web-framework imports, so `planekv
--help` stays fast; a service is imported only when it is run. Without the `services` extra the
subcommands are left out (the CLI skips modules whose import fails).
"""

from __future__ import annotations

import argparse
import importlib.util

from .arguments import add_control_arguments, add_store_arguments

_MISSING = [m for m in ("fastapi", "uvicorn", "redis", "prometheus_client") if importlib.util.find_spec(m) is None]
if _MISSING:
    raise ImportError(f"the services extra is not installed (missing {', '.join(_MISSING)}): "
                      "pip install 'planekv[services]'")


def _control(args: argparse.Namespace) -> int:
    from .control import serve

    return serve(args)


def _store(args: argparse.Namespace) -> int:
    from .store import serve

    return serve(args)


def register(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("control", help="run the control plane (formats, calibrations, policies, caches; Redis)")
    add_control_arguments(c)
    c.set_defaults(func=_control)
    s = sub.add_parser("store", help="run the store service (framed blocks: memory tier spilling to NVMe files)")
    add_store_arguments(s)
    s.set_defaults(func=_store)
