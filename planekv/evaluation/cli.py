"""``planekv calibrate`` and ``planekv eval ...`` (registered by planekv.cli)."""

from __future__ import annotations

import argparse
from typing import Any


def _runner(module: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        import importlib

        return int(importlib.import_module(module).run(args) or 0)
    return run


def register(subparsers: Any) -> None:
    """Add ``calibrate`` and ``eval {all,perplexity,passkey,split,report}``."""
    from . import calibrate, passkey, perplexity, split_search, suite

    c = subparsers.add_parser("calibrate", help="calibration artifact from text (registers it with the control "
                                                 "plane when one is reachable)")
    calibrate.add_arguments(c)
    c.set_defaults(func=_runner("planekv.evaluation.calibrate"))

    e = subparsers.add_parser("eval", help="real-model quality: perplexity, passkey, K/V split search, report")
    esub = e.add_subparsers(dest="eval_job", required=True)
    for name, mod, help_ in (
            ("all", suite, "calibration, split search, perplexity and passkey, then the report"),
            ("perplexity", perplexity, "teacher-forced perplexity of every system and budget"),
            ("passkey", passkey, "passkey retrieval at 2K/4K/8K"),
            ("split", split_search, "flexible reader K/V split search on the dev text")):
        sp = esub.add_parser(name, help=help_)
        mod.add_arguments(sp)
        sp.set_defaults(func=_runner(mod.__name__))
    from . import ray_jobs

    sub = esub.add_parser("submit", help="run one of these jobs on a Ray cluster (Ray Job Submission) and "
                                         "follow its log")
    ray_jobs.add_arguments(sub)
    sub.set_defaults(func=_runner("planekv.evaluation.ray_jobs"))
    r = esub.add_parser("report", help="rebuild report.md and the plot from a run's JSON")
    r.add_argument("out")
    r.set_defaults(func=lambda a: (__import__("planekv.evaluation.report", fromlist=["x"]).write_report(a.out), 0)[1])
