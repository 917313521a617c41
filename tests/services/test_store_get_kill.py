"""The store killed with SIGKILL while GETs are in flight (issue 32, item 3: "store killed mid-GET"),
in write-through and write-back mode, then restarted on the same data dir and port.

What a user would notice: every GET answered 200 before the kill carried exactly the bytes that were PUT;
after the restart every acknowledged block is served byte-exact in write-through mode, and in write-back
mode a block is either served byte-exact or is a miss (404) -- never other bytes, never a 5xx."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from .conftest import client, start_store
from .test_store_lifecycle import blocks

N_BLOCKS = 4
FRAME = 4096 + 303104  # the frame of a 300 000-byte payload (test_store_lifecycle.blocks)
N_THREADS = 3
GETS_PER_THREAD = 400  # bounded: each reader stops after this many GETs or at the first transport error


def _reader(url: str, bs, results: list, started: threading.Event) -> None:
    with client(url) as c:
        for i in range(GETS_PER_THREAD):
            k, f = bs[i % len(bs)]
            try:
                r = c.get(f"/v1/blocks/{k}", timeout=10.0)
            except httpx.TransportError:
                results.append(("dead", str(k), None))
                return
            results.append((r.status_code, str(k), r.content if r.status_code == 200 else r.text))
            started.set()


@pytest.mark.parametrize("write_through,memory_bytes", [(True, 8 << 20), (False, 8 << 20), (False, 2 * FRAME)],
                         ids=["write-through", "write-back", "write-back-spilled"])
def test_a_store_killed_mid_get_never_served_wrong_bytes_and_keeps_acknowledged_blocks(
        tmp_path, redis_url, write_through, memory_bytes):
    """write-back-spilled: a memory tier of two frames, so two of the four blocks are spilled to the file tier
    before the kill; those must survive it."""
    spill = tmp_path / "spill"
    args = ["--spill-dir", str(spill), "--memory-bytes", str(memory_bytes), "--file-bytes", str(64 << 20)]
    if write_through:
        args.append("--write-through")
    bs = blocks(N_BLOCKS)
    want = {str(k): f for k, f in bs}
    s = start_store(tmp_path, redis_url, *args)
    with client(s.url) as c:
        for k, f in bs:
            assert c.put(f"/v1/blocks/{k}", content=f).status_code == 201  # acknowledged
        on_file = {str(k) for k, _ in bs
                   if "file" in c.head(f"/v1/blocks/{k}").headers.get("x-planekv-tiers", "").split(",")}
    if write_through:
        assert on_file == set(want), "write-through: every acknowledged block is on the file tier"
    elif memory_bytes < N_BLOCKS * FRAME:
        assert len(on_file) >= N_BLOCKS - 2, f"expected spilled blocks on the file tier, got {on_file}"

    results: list = []
    started = threading.Event()
    threads = [threading.Thread(target=_reader, args=(s.url, bs, results, started), daemon=True)
               for _ in range(N_THREADS)]
    for t in threads:
        t.start()
    assert started.wait(30), "no GET was answered within 30 s"
    time.sleep(0.2)  # let GETs pile up in flight
    s.stop(signal.SIGKILL)
    assert s.proc.returncode == -signal.SIGKILL
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a reader did not finish within 30 s of the kill"

    answered = [r for r in results if r[0] != "dead"]
    assert any(r[0] == "dead" for r in results), "the kill came after every reader finished: not mid-GET"
    assert answered, "no GET was answered before the kill"
    for status, key, body in answered:
        assert status == 200, f"GET {key} answered {status} before the kill: {body}"
        assert body == want[key], f"GET {key} answered 200 with other bytes than were PUT"

    s2 = start_store(tmp_path, redis_url, *args, port=s.port)
    try:
        with client(s2.url) as c:
            for k, f in bs:
                r = c.get(f"/v1/blocks/{k}")
                if write_through or str(k) in on_file:
                    assert r.status_code == 200, f"block {k}, on file before the kill, lost: {r.text}"
                else:
                    assert r.status_code in (200, 404), f"GET {k} after restart answered {r.status_code}: {r.text}"
                if r.status_code == 200:
                    assert r.content == f, f"block {k} served with other bytes after the restart"
    finally:
        s2.stop()
