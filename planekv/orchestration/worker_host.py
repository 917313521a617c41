"""The process `planekv up` starts per worker: a Ray driver that owns one PlaneWorker actor and serves its health.

    python -m planekv.orchestration.worker_host --address 127.0.0.1:6380 --index 0 --port 8095 [--gpus 1]

It connects to the cluster (namespace ``planekv``), starts the named actor ``worker-<index>`` (restarted by Ray if
its process dies; ``max_restarts``), and serves on ``host:port`` (loopback unless told):

- ``/healthz``: 200 while the actor answers ``ping`` (loading or ready), 503 otherwise, with the ping as JSON;
- ``/metrics``: the actor's Prometheus metrics.

SIGTERM (``planekv down``) kills the actor and leaves the cluster. The actor belongs to this process: if the process
dies, Ray removes the actor with it, so nothing outlives the stack.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

NAMESPACE = "planekv"
PING_TIMEOUT_S = 5.0


def actor_name(index: int) -> str:
    return f"worker-{index}"


def start_actor(index: int, gpus: float, worker_kwargs: dict[str, Any]) -> Any:
    """The Ray actor ``worker-<index>`` running a PlaneWorker (needs ``ray.init`` first)."""
    import ray

    from .worker import PlaneWorker

    cls = ray.remote(PlaneWorker)
    return cls.options(name=actor_name(index), namespace=NAMESPACE, num_gpus=gpus, num_cpus=1, max_restarts=3,
                       max_task_retries=0).remote(name=actor_name(index), **worker_kwargs)


def _handler(actor: Any) -> type[BaseHTTPRequestHandler]:
    import ray

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            try:
                if self.path == "/healthz":
                    body, code, ctype = self._health()
                elif self.path == "/metrics":
                    body = ray.get(actor.metrics.remote(), timeout=PING_TIMEOUT_S).encode()
                    code, ctype = 200, "text/plain; version=0.0.4"
                else:
                    body, code, ctype = b'{"detail": "not found: /healthz or /metrics"}', 404, "application/json"
            except Exception as exc:  # the actor is gone or slow
                body, code, ctype = json.dumps({"detail": f"{type(exc).__name__}: {exc}"}).encode(), 503, \
                    "application/json"
            self.send_response(code)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _health(self) -> tuple[bytes, int, str]:
            ping = ray.get(actor.ping.remote(), timeout=PING_TIMEOUT_S)
            return json.dumps(ping).encode(), 503 if ping["state"] == "failed" else 200, "application/json"

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug(fmt, *args)

    return Handler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m planekv.orchestration.worker_host", description=__doc__)
    p.add_argument("--address", required=True, help="the Ray cluster's GCS address, host:port")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--port", type=int, required=True, help="serve /healthz and /metrics on HOST:PORT")
    p.add_argument("--host", default="127.0.0.1", help="the address to serve on (a container's: 0.0.0.0, so that "
                                                       "Prometheus can scrape it; default loopback)")
    p.add_argument("--gpus", type=float, default=0.0, help="GPUs the actor takes (0: the CPU path)")
    p.add_argument("--model", default=None, help="a .gguf, an HF directory, or the default SmolLM2")
    p.add_argument("--calibration", default=None, help="a calibration artifact (.pt); default: calibrate at load")
    p.add_argument("--calib-tokens", type=int, default=1024)
    p.add_argument("--policy", default="default", help="follow the control plane's active version of this policy")
    p.add_argument("--control-url", default=None)
    p.add_argument("--reader", default="reference", choices=("reference", "triton"))
    p.add_argument("--promotion-mib", type=float, default=64.0, help="a tiered cache's promotion cache on the device")
    p.add_argument("--max-batch", type=int, default=8, help="the most prompts of a request decoding in one cache")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import os

    import ray

    ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False)
    kwargs = dict(model=args.model, calibration=args.calibration, calib_tokens=args.calib_tokens,
                  device="cuda" if args.gpus > 0 else "cpu", reader=args.reader, policy=args.policy,
                  control_url=args.control_url, promotion_mib=args.promotion_mib, max_batch=args.max_batch,
                  api_token=os.environ.get("PLANEKV_API_TOKEN"))
    actor = start_actor(args.index, args.gpus, kwargs)
    server = ThreadingHTTPServer((args.host, args.port), _handler(actor))
    stop = threading.Event()

    def on_term(signum: int, frame: Any) -> None:
        stop.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    log.info("worker-%d: serving /healthz and /metrics on %s:%d", args.index, args.host, args.port)
    server.serve_forever(poll_interval=0.5)
    try:
        ray.kill(actor)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
