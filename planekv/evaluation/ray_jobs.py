"""Submit an evaluation job to a Ray cluster (Ray Job Submission) and follow it to the end.

Every job of ``planekv.evaluation`` is a plain module that runs directly
(``python -m planekv.evaluation.perplexity ...``); on a cluster the same command line is the Ray job
entrypoint. This module wraps the submission so that a long evaluation shows its progress here:

    planekv eval submit --address http://127.0.0.1:8265 perplexity -- --calibration C.pt --out results/x

The entrypoint is the job's ``planekv`` command (``python -m planekv.cli eval perplexity ...``), so the job's
own ``--workers N`` runs its units on N workers of the cluster it was submitted to. The job runs in the cluster's
Python environment (the package must be installed on its nodes);
``--env`` adds environment variables (``HF_HUB_OFFLINE=1`` is always set: no weights are ever
downloaded). Polling is bounded by ``--timeout``; on timeout or interruption the job is stopped.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# each job's `planekv` command (run as `python -m planekv.cli ...`: the command registers the Ray executor, so a
# job's own `--workers N` spreads its units over N workers of the cluster the job runs on)
JOBS = {"perplexity": ("eval", "perplexity"), "passkey": ("eval", "passkey"), "split": ("eval", "split"),
        "all": ("eval", "all"), "calibrate": ("calibrate",)}
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


@dataclass
class JobResult:
    job_id: str
    status: str
    logs: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == "SUCCEEDED"


def entrypoint(job: str, args: Sequence[str], python: str = "python") -> str:
    """The shell command Ray runs for ``job`` (a key of JOBS) with ``args``."""
    if job not in JOBS:
        raise ValueError(f"unknown job {job!r}; one of {sorted(JOBS)}")
    return " ".join([shlex.quote(python), "-m", "planekv.cli", *JOBS[job], *map(shlex.quote, args)])


def submit_and_wait(address: str, job: str, args: Sequence[str], env: dict[str, str] | None = None,
                    timeout_s: float = 3600.0, poll_s: float = 1.0,
                    on_log: Callable[[str], None] | None = None, python: str = "python") -> JobResult:
    """Submit ``job`` to the Ray dashboard at ``address``, stream its new log lines to ``on_log``,
    and return when it ends or ``timeout_s`` passes (then the job is stopped: status STOPPED).
    ``python`` is the interpreter on the cluster's nodes that has planekv installed."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(address)
    env_vars = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    job_id = client.submit_job(entrypoint=entrypoint(job, args, python), runtime_env={"env_vars": env_vars})
    t0 = time.monotonic()
    seen = 0
    status = "PENDING"
    try:
        while True:
            status = str(client.get_job_status(job_id).value)
            logs = client.get_job_logs(job_id)
            if on_log and len(logs) > seen:
                on_log(logs[seen:])
            seen = len(logs)
            if status in TERMINAL:
                break
            if time.monotonic() - t0 > timeout_s:
                client.stop_job(job_id)
                status = "STOPPED"
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        client.stop_job(job_id)
        raise
    return JobResult(job_id, status, client.get_job_logs(job_id), time.monotonic() - t0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="http://127.0.0.1:8265", help="Ray dashboard (job server) address")
    p.add_argument("--timeout", type=float, default=24 * 3600.0, help="stop the job after this many seconds")
    p.add_argument("--python", default="python", help="interpreter on the cluster's nodes (with planekv installed)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment variable")
    p.add_argument("job", choices=sorted(JOBS), help="which evaluation job")
    p.add_argument("job_args", nargs=argparse.REMAINDER, help="the job's own arguments (after --)")


def run(args: argparse.Namespace) -> int:
    env = {}
    for kv in args.env:
        if "=" not in kv:
            raise SystemExit(f"--env needs KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        env[k] = v
    res = submit_and_wait(args.address, args.job, args.job_args, env, timeout_s=args.timeout,
                          on_log=lambda s: print(s, end="", flush=True), python=args.python)
    print(f"\nray job {res.job_id}: {res.status} after {res.seconds:.0f} s", file=sys.stderr)
    return 0 if res.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m planekv.evaluation.ray_jobs", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
