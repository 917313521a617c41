"""An evaluation job submitted to a real single-node Ray cluster (Ray Job Submission) runs to the end
and writes the same outputs as when run directly. The fixture starts ``ray start --head --block`` on
loopback with free ports and stops it by its pid (process group)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("ray.job_submission")

from planekv.evaluation import calibrate, ray_jobs  # noqa: E402
from planekv.orchestration.stack import ray_internal_port_args  # noqa: E402
from planekv.services.launch import free_ports  # noqa: E402  (free ports: no clash with another Ray)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def ray_dashboard():
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.exists():
        ray_bin = Path(shutil.which("ray") or "ray")
    gcs, dash = free_ports(2)
    # a short path: Ray's Unix sockets live under it (107 bytes at most), and pytest's temp paths grow long
    # (a worker's directory under xdist)
    tmp = Path(tempfile.mkdtemp(prefix="pkv-ray-", dir="/tmp"))
    env = dict(os.environ, RAY_AUTH_MODE="disabled",  # a loopback-only test cluster
               RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=str(tmp),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # nodes' python
    env.pop("TRITON_INTERPRET", None)
    log = open(tmp / "ray-head.log", "w")
    proc = subprocess.Popen([str(ray_bin), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                             f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                             "--include-dashboard=true", "--num-cpus=2", "--num-gpus=0",
                             "--object-store-memory=100000000", "--disable-usage-stats",
                             f"--temp-dir={tmp}", *ray_internal_port_args()],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        import httpx

        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ray head exited: {(tmp / 'ray-head.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{address}/api/version", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"ray dashboard not up in 120 s: {(tmp / 'ray-head.log').read_text()[-3000:]}")
            time.sleep(1)
        yield address
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:  # a clean stop takes Ray over 30 s on a busy 2-core machine; the cluster is this test's alone
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
def test_perplexity_job_runs_as_a_ray_job_on_a_worker_of_its_cluster(ray_dashboard, tiny_model_dir, tmp_path):
    """`planekv eval submit ... perplexity -- ... --workers 1`: the job's units run on an EvalWorker actor of the
    cluster the job was submitted to (not a cluster of its own)."""
    calib_dir = tmp_path / "calib"
    assert calibrate.main(["--model", str(tiny_model_dir), "--max-tokens", "512", "--window", "256",
                           "--out", str(calib_dir), "--no-register", "--device", "cpu"]) == 0
    (calib,) = calib_dir.glob("calibration-*.pt")
    out = tmp_path / "ppl"
    lines: list[str] = []
    res = ray_jobs.submit_and_wait(
        ray_dashboard, "perplexity",
        ["--model", str(tiny_model_dir), "--calibration", str(calib), "--out", str(out), "--window", "64",
         "--windows", "1", "--texts", "pride_and_prejudice", "--systems", "dense", "readkv-flexible",
         "--rates", "2", "--device", "cpu", "--workers", "1"],
        env={"TRITON_INTERPRET": "1"}, timeout_s=600, poll_s=0.5, on_log=lines.append)
    assert res.ok, res.logs[-4000:]
    rows = {r["name"]: r for r in json.loads((out / "perplexity.json").read_text())["rows"]}
    assert set(rows) == {"dense", "readkv-flexible"}
    assert rows["readkv-flexible"]["read_fraction"] == pytest.approx(2 / 16, abs=0.01)
    assert (out / "report.md").exists()
    assert "".join(lines)  # the job's log reached us while it ran
    assert "joined the Ray cluster of this job" in res.logs


def test_unknown_job_is_refused_before_submission():
    with pytest.raises(ValueError, match="unknown job"):
        ray_jobs.entrypoint("train", [])
    assert ray_jobs.entrypoint("passkey", ["--out", "a b"]) == "python -m planekv.cli eval passkey --out 'a b'"
    assert ray_jobs.entrypoint("calibrate", []) == "python -m planekv.cli calibrate"
