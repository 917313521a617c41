"""Command-line flags of the two services and the settings they give (flags over settings).

Free of web-framework imports: ``planekv --help`` parses these without loading FastAPI. Both the
``planekv control|store`` subcommands (:mod:`planekv.services.cli`) and ``python -m
planekv.services.control|store`` use them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..settings import Settings, load_settings


def add_common_arguments(p: argparse.ArgumentParser, what: str, port: int) -> None:
    p.add_argument("--host", help=f"bind address (default: settings {what}.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help=f"port (default: settings {what}.port, {port})")
    p.add_argument("--data-dir", type=Path, help="PlaneKV data dir (default: settings data_dir, ~/.planekv)")
    p.add_argument("--redis-url", help="Redis URL (default: settings redis_url, redis://127.0.0.1:6379/0)")
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument("--allow-no-token", action="store_true", default=None,
                   help="serve a non-loopback --host without PLANEKV_API_TOKEN (refused otherwise; logs a warning)")


def add_store_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, "store", 8090)
    p.add_argument("--spill-dir", type=Path, help="file tier directory (default: DATA_DIR/store-PORT)")
    p.add_argument("--memory-bytes", type=int, help="memory tier capacity in bytes (default 2 GiB)")
    p.add_argument("--file-bytes", type=int, help="file tier capacity in bytes (default 32 GiB; 0 = no file tier)")
    p.add_argument("--write-through", action="store_true", default=None,
                   help="put every block on the file tier before the PUT answers")
    p.add_argument("--no-redis-index", action="store_true", help="do not publish the block index to Redis")
    p.add_argument("--reconcile-interval-s", type=float,
                   help="seconds between reconciliations of the block index with the tiers (default 60)")
    p.add_argument("--min-free-bytes", type=int, help="/readyz fails below this free space on the spill disk "
                                                      "(default 1 GiB)")


def add_control_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, "control", 8080)


def _settings(args: argparse.Namespace, section: str, fields: tuple[str, ...],
              extra: dict[str, Any] | None = None) -> Settings:
    """Settings (defaults < YAML < env) with the flags that were given on top."""
    base = load_settings()
    sect = {**getattr(base, section).model_dump(), **(extra or {})}
    for name in fields:
        val = getattr(args, name, None)
        if val is not None:
            sect[name] = val
    over: dict[str, Any] = {section: sect}
    if args.data_dir is not None:
        over["data_dir"] = args.data_dir
    if args.redis_url is not None:
        over["redis_url"] = args.redis_url
    if args.allow_no_token is not None:
        over["allow_no_token"] = args.allow_no_token
    return load_settings(**over)


def store_settings(args: argparse.Namespace) -> Settings:
    return _settings(args, "store", ("host", "port", "spill_dir", "memory_bytes", "file_bytes", "write_through",
                                       "reconcile_interval_s", "min_free_bytes"),
                     {"redis_index": False} if args.no_redis_index else None)


def control_settings(args: argparse.Namespace) -> Settings:
    return _settings(args, "control", ("host", "port"))
