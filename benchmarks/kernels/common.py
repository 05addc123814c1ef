"""Plumbing shared by the kernel benchmarks: graph-replay timing, copy bandwidth, run environment."""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys

import torch


def time_graph(calls, iters: int = 20, warmup: int = 3, queued: bool = False) -> float:
    """Median ms per call: capture all `calls` once into a CUDA graph, replay, divide by len(calls).
    queued: each timed replay is queued behind an untimed one, so the CPU's graph launch latency is off the
    clock (the engine's step graph launches once for every layer; a 2-call graph pays one launch per 2 calls)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued:
            graph.replay()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return statistics.median(times)


def copy_bandwidth_gbs(device) -> float:
    """Copy bandwidth in GB/s (read + write counted), after bringing the clocks up: a GPU idles at a
    few hundred MHz and a short measurement from idle read 2.7 instead of 4.2 TB/s on an H200."""
    from linrnn_bench.floor import copy_bandwidth, warm_up_gpu

    warm_up_gpu(device)
    return copy_bandwidth(device) / 1e9


def env_info(**extra) -> dict:
    """Date, versions, GPU, commit and command line of this run (plus `extra`)."""
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "python": platform.python_version(), "command": " ".join(sys.argv)}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    # the device machine gets a copy of the tree without .git: the caller passes the commit
    info["commit"] = os.environ.get("LINRNN_COMMIT", "")
    if not info["commit"]:
        try:
            info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
        except OSError:
            info["commit"] = "unknown"
    info.update(extra)
    return info
