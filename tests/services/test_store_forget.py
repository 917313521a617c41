"""A store that never comes back (killed -9, its data directory gone) leaves block index entries that no
store can delete, so the control plane refused to delete their caches. The way out
(``POST /v1/stores/{store_id}/forget``) works only once the store's heartbeat is older than the grace
period; a live store cannot be forgotten, and one forgotten while hung republishes its blocks."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from .conftest import Proc, client, start_store
from .test_store_reconcile import a_block

GRACE_S = 5.0  # the shortest grace the route accepts (planekv.services.index.FORGET_MIN_GRACE_S)
WAIT_S = 90.0  # every wait below is bounded by this, in time and in polls


def poll(what: str, call: Callable[[], bool]) -> None:
    """Call ``call`` every 0.25 s until it is true, at most WAIT_S seconds (and 4 * WAIT_S calls)."""
    deadline = time.monotonic() + WAIT_S
    for _ in range(int(4 * WAIT_S)):
        if call():
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.25)
    raise AssertionError(f"{what}: not within {WAIT_S} s")


def forget(ctl: httpx.Client, store_id: str, grace_s: float = GRACE_S) -> httpx.Response:
    return ctl.post(f"/v1/stores/{store_id}/forget", params={"grace_s": grace_s})


def stored_block(s: Proc) -> tuple[str, str, bytes]:
    """A block PUT at store ``s``: (its store id, the block key, the frame)."""
    k, f = a_block()
    with client(s.url) as st:
        assert st.put(f"/v1/blocks/{k}", content=f).status_code == 201
        return st.get("/v1/stats").json()["store_id"], str(k), f


def test_a_store_killed_with_its_data_gone_is_forgotten_so_its_cache_can_be_deleted(tmp_path: Path, redis_url,
                                                                                    ctl, control: Proc):
    spill = tmp_path / "spill"
    gone = start_store(tmp_path, redis_url, "--spill-dir", str(spill), "--write-through")
    try:
        store_id, k, _ = stored_block(gone)
        seq = k.split(":")[1]
        assert ctl.get(f"/v1/caches/{seq}").json()["tiers"]["file"]["stores"] == [store_id]
        listed = {s["store_id"]: s for s in ctl.get("/v1/stores").json()["stores"]}
        assert listed[store_id]["index_entries"] == 1 and listed[store_id]["record"]["url"] == gone.url
        os.kill(gone.proc.pid, signal.SIGKILL)
        gone.proc.wait(30)
        shutil.rmtree(spill)  # its blocks exist nowhere now; no store will ever delete them
    finally:
        gone.stop(signal.SIGKILL)
    # the stuck state: the control plane refuses, and no store can delete the entry
    r = ctl.delete(f"/v1/caches/{seq}")
    assert r.status_code == 409 and "stores still hold 1 blocks" in r.json()["detail"]
    # within the grace period the store counts as alive: refused, nothing removed
    r = forget(ctl, store_id, grace_s=3600)
    assert r.status_code == 409 and "alive" in r.json()["detail"] and "DELETE its blocks" in r.json()["detail"]
    assert ctl.get(f"/v1/caches/{seq}").json()["tiers"]["file"]["blocks"] == 1
    # the token protects it like every other mutating route
    with client(control.url, token=None) as anonymous:
        assert anonymous.post(f"/v1/stores/{store_id}/forget").status_code == 401
    # once the heartbeat is older than the grace period, the store id is forgotten with its entries
    answers: list[httpx.Response] = []
    poll("forgetting the killed store", lambda: answers.append(forget(ctl, store_id)) or answers[-1].status_code != 409)
    r = answers[-1]
    assert r.status_code == 200, r.text
    assert r.json()["index_entries_removed"] == 1 and r.json()["heartbeat_age_s"] >= GRACE_S
    assert ctl.get(f"/v1/caches/{seq}").json()["tiers"] == {}
    assert ctl.delete(f"/v1/caches/{seq}").status_code == 204
    assert store_id not in [s["store_id"] for s in ctl.get("/v1/stores").json()["stores"]]
    assert store_id not in ctl.get("/v1/stats").json()["stores"]
    # forgotten once: the id is unknown now
    assert forget(ctl, store_id).status_code == 404


def test_a_live_store_is_not_forgotten_and_keeps_its_blocks(ctl, st):
    k, f = a_block()
    assert st.put(f"/v1/blocks/{k}", content=f).status_code == 201
    store_id = st.get("/v1/stats").json()["store_id"]
    r = forget(ctl, store_id)
    assert r.status_code == 409 and store_id in r.json()["detail"] and "alive" in r.json()["detail"]
    assert st.get(f"/v1/blocks/{k}").content == f
    assert ctl.get(f"/v1/caches/{k.sequence_id}").json()["tiers"]["memory"]["stores"] == [store_id]
    r = ctl.delete(f"/v1/caches/{k.sequence_id}")
    assert r.status_code == 409 and "forget" not in r.json()["detail"]  # nothing to forget: delete at the store
    assert forget(ctl, "no-such-store:1").status_code == 404
    assert forget(ctl, store_id, grace_s=1).status_code == 422  # below the minimum grace


def test_a_hung_store_that_was_forgotten_republishes_its_blocks_when_it_resumes(tmp_path: Path, redis_url, ctl):
    hung = start_store(tmp_path, redis_url, "--spill-dir", str(tmp_path / "spill"))
    try:
        store_id, k, f = stored_block(hung)
        seq = k.split(":")[1]
        os.kill(hung.proc.pid, signal.SIGSTOP)
        try:
            answers: list[httpx.Response] = []
            poll("forgetting the stopped store",
                 lambda: answers.append(forget(ctl, store_id)) or answers[-1].status_code != 409)
            assert answers[-1].status_code == 200 and answers[-1].json()["index_entries_removed"] == 1
            assert ctl.get(f"/v1/caches/{seq}").json()["tiers"] == {}
        finally:
            os.kill(hung.proc.pid, signal.SIGCONT)
        # at its next heartbeat it finds its record gone and republishes what it holds
        poll("the resumed store republishing",
             lambda: ctl.get(f"/v1/caches/{seq}").json()["tiers"].get("memory", {}).get("stores") == [store_id])
        with client(hung.url) as st:
            assert st.get(f"/v1/blocks/{k}").content == f
        assert forget(ctl, store_id).status_code == 409
    finally:
        hung.stop()
