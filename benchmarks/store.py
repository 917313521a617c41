"""Store service throughput: PUT and GET of 4 MiB blocks over loopback, N concurrent clients.

    python benchmarks/store.py --clients 8 --blocks 128 --seconds 10 --json out.json

Starts a real store process (uvicorn, one worker) on a free port with a temporary data dir, then:
  PUT  every client PUTs its share of ``--blocks`` distinct frames (4 MiB payload each);
  GET  every client GETs random blocks for ``--seconds`` (memory tier; the checksum is verified on
       every read by the store);
  GET file tier (``--file-tier``): the same against a store whose memory tier is too small, so every
       GET reads (and verifies) a file (from the page cache after the first touch).
Throughput counts frame bytes moved; latency is per request (send to last body byte). Clients are
threads of this process with a minimal keep-alive HTTP/1.1 client (``--client raw``: sendmsg and
recv_into a preallocated buffer, so the client's own copies are not what is measured) or httpx
(``--client httpx``). ``--redis`` also starts a private redis-server and publishes the block index.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planekv.tiering import BlockKey, encode_frame

FID = "00000000000000be"
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RawClient:
    """Keep-alive HTTP/1.1 over one socket: sendmsg of header + body, recv_into a reused buffer."""

    def __init__(self, port: int, max_body: int) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(max_body + 65536)
        self.view = memoryview(self.buf)

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, memoryview]:
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        if body is not None:
            head += f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n"
        parts = [(head + "\r\n").encode()] + ([memoryview(body)] if body is not None else [])
        for p in parts:
            self.sock.sendall(p)
        got = 0
        while True:  # read until the end of the response head
            n = self.sock.recv_into(self.view[got:], 65536)
            if not n:
                raise ConnectionError("server closed the connection")
            got += n
            end = self.buf.find(b"\r\n\r\n", 0, got)
            if end >= 0:
                break
        head_text = bytes(self.view[:end]).decode("latin-1")
        status = int(head_text.split(" ", 2)[1])
        length = 0
        for line in head_text.split("\r\n")[1:]:
            name, _, val = line.partition(":")
            if name.lower() == "content-length":
                length = int(val)
        start = end + 4
        total = start + length
        if total > len(self.buf):
            raise ValueError(f"response of {length} bytes exceeds the client buffer")
        while got < total:
            n = self.sock.recv_into(self.view[got:total])
            if not n:
                raise ConnectionError("server closed the connection mid-body")
            got += n
        return status, self.view[start:total]

    def close(self) -> None:
        self.sock.close()


class HttpxClient:
    def __init__(self, port: int, max_body: int) -> None:
        import httpx

        self.c = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, memoryview]:
        r = self.c.request(method, path, content=body,
                           headers={"content-type": "application/octet-stream"} if body is not None else None)
        return r.status_code, memoryview(r.content)

    def close(self) -> None:
        self.c.close()


CLIENTS: dict[str, Callable[[int, int], Any]] = {"raw": RawClient, "httpx": HttpxClient}


def start(cmd: list[str], env: dict[str, str], port: int, timeout: float = 60) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                if "redis" in cmd[0]:
                    return proc
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return proc
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError(f"{cmd} did not come up on port {port} in {timeout} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_clients(n: int, work: Callable[[int], list[tuple[float, int]]]) -> tuple[float, list[tuple[float, int]]]:
    """Run ``work(client_index)`` on n threads at once; (wall seconds, all (latency s, bytes))."""
    results: list[list[tuple[float, int]]] = [[] for _ in range(n)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(n + 1)

    def body(i: int) -> None:
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return wall, [x for r in results for x in r]


def summarize(phase: str, wall: float, samples: list[tuple[float, int]]) -> dict[str, Any]:
    lat = sorted(s[0] for s in samples)
    nbytes = sum(s[1] for s in samples)
    return {"phase": phase, "requests": len(samples), "seconds": wall, "bytes": nbytes,
            "gb_per_s": nbytes / wall / 1e9, "req_per_s": len(samples) / wall,
            "p50_ms": 1e3 * statistics.median(lat), "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "max_ms": 1e3 * lat[-1]}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="planekv-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    rows: list[dict[str, Any]] = []
    try:
        env = {**os.environ, "PLANEKV_DATA_DIR": str(tmp), "PLANEKV_LOG_LEVEL": "WARNING"}
        env.pop("PLANEKV_API_TOKEN", None)
        if args.redis:
            rport = free_port()
            procs.append(start([shutil.which("redis-server") or "redis-server", "--port", str(rport),
                                "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"], env, rport))
            env["PLANEKV_REDIS_URL"] = f"redis://127.0.0.1:{rport}/0"
            env["PLANEKV_STORE__REQUIRE_REGISTERED_FORMAT"] = "false"  # no control plane registers FID here
        payload = os.urandom(args.block_mib * MiB)
        keys = [BlockKey(FID, f"bench-{i // 64}", "v", i % 64, 0, 0, 64, 2, 8) for i in range(args.blocks)]
        frames = [encode_frame(k, payload) for k in keys]
        frame_bytes = len(frames[0])
        client_cls = CLIENTS[args.client]
        per = -(-len(keys) // args.clients)  # blocks each client PUTs
        configs = [("memory", args.blocks * frame_bytes + 64 * MiB, 0)]
        if args.file_tier:
            configs.append(("file", 0, args.blocks * frame_bytes + 64 * MiB))
        for tier, mem, fil in configs:
            port = free_port()
            cmd = [sys.executable, "-m", "planekv.services.store", "--port", str(port), "--memory-bytes", str(mem),
                   "--file-bytes", str(fil), "--spill-dir", str(tmp / f"spill-{tier}")]
            if not args.redis:
                cmd.append("--no-redis-index")
            proc = start(cmd, env, port)
            procs.append(proc)

            def put_work(i: int, port: int = port) -> list[tuple[float, int]]:
                c = client_cls(port, frame_bytes)
                out = []
                for j in range(i * per, min(len(keys), (i + 1) * per)):
                    t0 = time.perf_counter()
                    status, _ = c.request("PUT", f"/v1/blocks/{keys[j]}", frames[j])
                    out.append((time.perf_counter() - t0, len(frames[j])))
                    if status not in (200, 201):
                        raise RuntimeError(f"PUT answered {status}")
                c.close()
                return out

            def get_work(i: int, port: int = port) -> list[tuple[float, int]]:
                c = client_cls(port, frame_bytes)
                rnd = random.Random(i)
                out = []
                end = time.perf_counter() + args.seconds
                while time.perf_counter() < end:
                    k = keys[rnd.randrange(len(keys))]
                    t0 = time.perf_counter()
                    status, body = c.request("GET", f"/v1/blocks/{k}")
                    out.append((time.perf_counter() - t0, len(body)))
                    if status != 200 or len(body) != frame_bytes:
                        raise RuntimeError(f"GET answered {status} with {len(body)} bytes")
                c.close()
                return out

            rows.append(summarize(f"PUT ({tier} tier)", *run_clients(args.clients, put_work)))
            get_work(0)  # warm: first touch of every file, connection setup
            rows.append(summarize(f"GET ({tier} tier)", *run_clients(args.clients, get_work)))
            stop(proc)
            procs.remove(proc)
    finally:
        for p in procs:
            stop(p)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"rows": rows, "meta": {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "host": platform.node(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "client": args.client,
        "clients": args.clients, "block_payload_bytes": args.block_mib * MiB, "frame_bytes": frame_bytes,
        "blocks": args.blocks, "redis_index": args.redis}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--blocks", type=int, default=128, help="distinct blocks PUT, then read at random")
    p.add_argument("--block-mib", type=int, default=4, help="payload MiB per block")
    p.add_argument("--seconds", type=float, default=10.0, help="duration of each GET phase")
    p.add_argument("--client", choices=sorted(CLIENTS), default="raw")
    p.add_argument("--redis", action="store_true", help="publish the block index to a private redis-server")
    p.add_argument("--file-tier", action="store_true", help="also measure a store whose blocks live on files")
    p.add_argument("--json", help="write the rows and the run's facts here")
    args = p.parse_args(argv)
    res = bench(args)
    m = res["meta"]
    print(f"store service, {m['clients']} clients ({m['client']}), {m['block_payload_bytes'] // MiB} MiB blocks "
          f"(frame {m['frame_bytes']} B), redis index {'on' if m['redis_index'] else 'off'}, {m['cpus']} CPUs")
    print("| phase | requests | GB/s | req/s | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['phase']} | {r['requests']} | {r['gb_per_s']:.2f} | {r['req_per_s']:.0f} | {r['p50_ms']:.1f} "
              f"| {r['p99_ms']:.1f} | {r['max_ms']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
