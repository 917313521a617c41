"""Timing on the GPU: CUDA-graph replays (median of single replays, rotating over input sets) and the per-kernel
timeline of one captured step (torch.profiler). Off the GPU (Triton's interpreter, plumbing checks only) a
step runs once on the host clock."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


def time_graphs(steps: list[Callable[[], Any]], reps: int) -> tuple[float, list[torch.cuda.CUDAGraph]]:
    """Capture each step in a CUDA graph; replay round-robin; median ms of single replays, and the
    graphs (for :func:`_timeline`).

    Off the GPU (Triton's interpreter, for plumbing checks) each step runs once on the host clock."""
    if not torch.cuda.is_available():
        times = []
        for f in steps:
            t0 = time.perf_counter()
            f()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times), []
    graphs = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in steps:
            for _ in range(2):
                f()  # warm up: compile, autotune, allocate
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for f in steps:
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            f()
        graphs.append(gr)
    for gr in graphs:
        gr.replay()
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        gr = graphs[i % len(graphs)]
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        gr.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times), graphs


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timeline_or_error(graph: torch.cuda.CUDAGraph) -> dict[str, Any]:
    try:
        return timeline(graph)
    except Exception as exc:  # the profiler is a diagnostic: its failure must not lose the row
        log.exception("timeline failed")
        return {"error": f"{type(exc).__name__}: {exc}", "kernels_us": {}, "kernel_sum_us": 0.0, "graph_us": 0.0}


def timeline(gr: torch.cuda.CUDAGraph, reps: int = 20) -> dict[str, Any]:
    """Per-kernel GPU time of one step's captured graph (from :func:`time_graphs`), from the
    profiler's kernel records over ``reps`` replays: {kernel: [launches per step, microseconds per
    step]}, their sum, and the graph's wall time per replay (the difference is launch gaps and tails
    between dependent kernels)."""
    from torch.profiler import ProfilerActivity, profile

    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        e0.record()
        for _ in range(reps):
            gr.replay()
        e1.record()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            name = ev.name.split("(")[0]
            per.setdefault(name, []).append(ev.device_time_total)
    kernels = {k: [round(len(v) / reps, 2), round(sum(v) / reps, 2)] for k, v in
               sorted(per.items(), key=lambda kv: -sum(kv[1]))}
    return {"kernels_us": kernels, "kernel_sum_us": round(sum(v[1] for v in kernels.values()), 1),
            "graph_us": round(1e3 * e0.elapsed_time(e1) / reps, 1)}
