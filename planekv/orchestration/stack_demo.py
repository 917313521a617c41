"""`make demo` (``planekv demo --stack``): the main job on the embedded stack, start to finish.

1. ``planekv up`` on free loopback ports (redis, Ray head, control plane, store, one PlaneWorker);
2. the worker loads SmolLM2 (or ``--model``) and calibrates it;
3. a placement policy is created through the control plane's REST API, then changed twice (a new version, activated),
   the hot planes going from all W = 8 (everything on the device) to ``hots`` (refinement planes in host memory);
4. after each change the worker, following the active version, prefills a passkey prompt of ``context`` tokens and
   decodes its answer at each read rate R: the answer, bits read, device and host bytes, caps;
5. the table is printed, written as JSON and plotted; ``planekv down`` stops everything, whatever happened.

Bounded: every wait has a timeout; the stack is brought down in all cases.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .stack import Ports

MiB = float(1 << 20)
POLICY = "default"  # the policy name `planekv up`'s workers follow


def run_stack_demo(out: Path, context: int = 2048, rates: tuple[float, ...] = (4.0, 2.0),
                   hots: tuple[int, ...] = (8, 4, 2), model: str | None = None, calib_tokens: int = 1024,
                   promotion_mib: float = 4.0, data_dir: Path | None = None,
                   say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the demo; returns (and writes to ``out/stack_demo.json``) the phases with their rows."""
    from ..services.clients import ControlClient
    from ..tiering import PlacementPolicy
    from . import stack
    from .client import connect

    if not hots or any(not 0 <= h <= 8 for h in hots):
        raise ValueError(f"hot planes must be in [0, 8], got {hots}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="planekv-demo-"))
    worker_args = ["--calib-tokens", str(calib_tokens), "--promotion-mib", str(promotion_mib)]
    worker_args += ["--model", model] if model else []
    t0 = time.perf_counter()
    ports = Ports.free()
    state = stack.up(data_dir, ports, workers=1, worker_args=worker_args, say=say)
    say(f"stack healthy in {time.perf_counter() - t0:.1f} s (data in {data_dir})")
    control = next(c.url for c in state.components if c.name == "control")
    try:
        cluster = connect(data_dir)
        worker = cluster.workers[0]
        ready = cluster.wait_ready(timeout=600)[0]
        say(f"worker ready: {ready['model']} on {ready['device']}, format {ready['format_id']} "
            f"({time.perf_counter() - t0:.1f} s)")
        phases = []
        with ControlClient(control, timeout_s=10.0) as api:  # the REST API, through its typed client
            for i, h in enumerate(hots):
                policy = PlacementPolicy(hot_planes={"k": h, "v": h})
                comment = f"demo: {h} hot planes"
                version = (api.create_policy(POLICY, policy, comment).active_version if i == 0
                           else api.update_policy(POLICY, policy, comment, activate=True).version)
                say(f"policy {POLICY!r} v{version} active through the REST API: {h} hot planes")
                phase = _passkey_under(worker, version, context, rates, with_dense=i == 0)
                phases.append(phase)
                for row in phase["rows"]:
                    say("  " + _row_line(phase, row))
        result = {"context": context, "rates": list(rates), "hots": list(hots), "promotion_mib": promotion_mib,
                  "model": ready["model"], "device": ready["device"], "phases": phases,
                  "worker": cluster.stats()[0], "seconds": time.perf_counter() - t0}
    finally:
        import ray

        ray.shutdown()
        stack.down(data_dir, say=say)
    (out / "stack_demo.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "stack_demo.png")
    return result


def _passkey_under(worker: Any, version: int, context: int, rates: tuple[float, ...], with_dense: bool,
                   tries: int = 20) -> dict[str, Any]:
    """The worker's passkey trial once it follows policy ``version`` (it looks the active version up again after
    POLICY_TTL_S)."""
    import ray

    from .worker import POLICY_TTL_S

    for _ in range(tries):
        time.sleep(POLICY_TTL_S + 0.1)
        res = ray.get(worker.passkey.remote(context, rates, with_dense=with_dense), timeout=900)
        if res["policy_version"] == version:
            return res
    raise RuntimeError(f"the worker did not take policy version {version} in {tries} tries")


def _gpu_bytes(row: dict[str, Any]) -> float | None:
    tb = row["tier_bytes"]
    return None if tb is None else tb["hot"] + tb["open"] + tb["promotion"]


def _row_line(phase: dict[str, Any], row: dict[str, Any]) -> str:
    name = "dense" if row["system"] == "dense" else f"R = {row['rate']:g}"
    gpu, tb = _gpu_bytes(row), row["tier_bytes"]
    where = "" if gpu is None else f", device {gpu / MiB:.1f} MiB, host {tb['host'] / MiB:.1f} MiB, " \
                                   f"caps {100 * row['cap_rate']:.2f}%"
    return (f"{name}: answer {row['answer']} ({'right' if row['hit'] else 'wrong'}), "
            f"{row['bits_per_scalar']:.2f} bits/scalar{where}")


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    """The demo table: policy version, hot planes, reader, answer, bits, device / host MiB, caps."""
    rows = []
    for ph in result["phases"]:
        h = ph["hot_planes"]
        for r in ph["rows"]:
            gpu = _gpu_bytes(r)
            rows.append([f"v{ph['policy_version']}", "-" if r["system"] == "dense" else f"{h['k']}/{h['v']}",
                         "dense" if r["system"] == "dense" else f"{r['system']} R = {r['rate']:g}",
                         f"{r['answer']} ({'right' if r['hit'] else 'wrong'})", f"{r['bits_per_scalar']:.2f}",
                         "-" if gpu is None else f"{gpu / MiB:.1f}",
                         "-" if r["tier_bytes"] is None else f"{r['tier_bytes']['host'] / MiB:.1f}",
                         "-" if r["cap_rate"] is None else f"{100 * r['cap_rate']:.2f}"])
    return rows


TABLE_COLUMNS = ("policy", "hot K/V", "reader", "answer", "bits read / scalar", "device MiB", "host MiB", "caps %")


def plot(result: dict[str, Any], path: Path) -> Path:
    """Device and host MiB of each tiered read, per policy version and rate; right answers marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, dev, host, right = [], [], [], []
    for ph in result["phases"]:
        for r in ph["rows"]:
            if r["tier_bytes"] is None:
                continue
            labels.append(f"h={ph['hot_planes']['k']}\nR={r['rate']:g}")
            dev.append(_gpu_bytes(r) / MiB)
            host.append(r["tier_bytes"]["host"] / MiB)
            right.append(r["hit"])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels)), 4.0))
    x = range(len(labels))
    ax.bar(x, dev, label="device (hot + open + promotion)")
    ax.bar(x, host, bottom=dev, label="host (refinement planes)")
    for i, ok in enumerate(right):
        ax.text(i, dev[i] + host[i], "key found" if ok else "missed", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("MiB")
    ax.set_ylim(0, 1.3 * max(d + h for d, h in zip(dev, host, strict=True)))  # room for the legend
    ax.set_title(f"PlaneKV tiers: passkey at {result['context']} tokens\n{result['model']}, {result['device']}")
    ax.legend(loc="upper left", ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
