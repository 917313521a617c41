"""`planekv up`, `planekv down`, `planekv status`: the stack on one machine (:mod:`planekv.orchestration.stack`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from . import eval_workers  # noqa: F401 - registers the executor of `planekv eval ... --workers N`


def _data_dir(args: argparse.Namespace) -> Path:
    from ..settings import load_settings

    return Path(args.data_dir).expanduser() if args.data_dir else load_settings().data_dir


def _up(args: argparse.Namespace) -> int:
    from .stack import Ports, StackError, up

    console = Console()
    ports = Ports()
    if args.free_ports:
        ports = Ports.free()
    worker_args = ["--calib-tokens", str(args.calib_tokens), "--reader", args.reader, "--policy", args.policy,
                   "--promotion-mib", str(args.promotion_mib), "--max-batch", str(args.max_batch)]
    worker_args += ["--model", args.model] if args.model else []
    worker_args += ["--calibration", args.calibration] if args.calibration else []
    try:
        state = up(_data_dir(args), ports, args.workers, args.api_token, worker_args, args.timeout,
                   say=lambda s: console.print(f"[dim]{s}[/dim]"), worker_gpu_share=args.worker_gpu_share)
    except StackError as exc:
        console.print(f"[red]planekv up: {exc}[/red]")
        return 1
    _print_status(console, _data_dir(args))
    console.print(f"`planekv down` stops it; logs in {Path(state.components[0].log).parent}")
    return 0


def _down(args: argparse.Namespace) -> int:
    from .stack import down

    console = Console()
    stopped = down(_data_dir(args), say=lambda s: console.print(f"[dim]{s}[/dim]"))
    console.print(f"stopped {len(stopped)} processes" if stopped else "no PlaneKV stack was running")
    return 0


def _print_status(console: Console, data_dir: Path) -> bool:
    from .stack import status

    rows = status(data_dir)
    if not rows:
        console.print(f"no PlaneKV stack recorded under {data_dir}")
        return False
    t = Table(title=f"PlaneKV stack ({data_dir})")
    for col in ("process", "pid", "address", "state"):
        t.add_column(col)
    for r in rows:
        st = "healthy" if r["healthy"] else "running, not answering" if r["alive"] else "stopped"
        t.add_row(r["name"], str(r["pid"]), r["url"], st)
    console.print(t)
    return all(r["healthy"] for r in rows)


def _status(args: argparse.Namespace) -> int:
    return 0 if _print_status(Console(), _data_dir(args)) else 1


def register(sub: argparse._SubParsersAction) -> None:
    from .stack import WORKER_GPU_SHARE

    u = sub.add_parser("up", help="start the stack on this machine: redis, control, store, a Ray head, PlaneWorkers")
    u.add_argument("--data-dir", help="where state, logs and data live (default: settings data_dir, ~/.planekv)")
    u.add_argument("--workers", type=int, default=None, help="PlaneWorkers (default: one per GPU, one without)")
    u.add_argument("--worker-gpu-share", type=float, default=WORKER_GPU_SHARE,
                   help="of its GPU each PlaneWorker takes (default %(default)s: the rest is left to evaluation "
                        "workers of `planekv eval --workers N --address stack`; 1: the whole GPU)")
    u.add_argument("--free-ports", action="store_true", help="pick free loopback ports instead of the defaults "
                                                             "(redis 6381, control 8080, store 8090, Ray 6380/8265)")
    u.add_argument("--api-token", default=None, help="bearer token the REST services require")
    u.add_argument("--model", default=None, help="the workers' model (default: SmolLM2)")
    u.add_argument("--calibration", default=None, help="the workers' calibration artifact (default: calibrate)")
    u.add_argument("--calib-tokens", type=int, default=1024, help="calibration tokens when calibrating at load")
    u.add_argument("--policy", default="default", help="placement policy the workers follow (control plane)")
    u.add_argument("--reader", default="reference", choices=("reference", "triton"), help="the workers' reader")
    u.add_argument("--promotion-mib", type=float, default=64.0,
                   help="each tiered cache's promotion cache on the device, MiB (docs/TIERING.md)")
    u.add_argument("--max-batch", type=int, default=8,
                   help="the most prompts of one generate request that a worker decodes together")
    u.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for every process to be healthy")
    u.set_defaults(func=_up)
    d = sub.add_parser("down", help="stop exactly what `planekv up` started")
    d.add_argument("--data-dir")
    d.set_defaults(func=_down)
    s = sub.add_parser("status", help="every process of the stack with its address and health")
    s.add_argument("--data-dir")
    s.set_defaults(func=_status)
