"""Engine counters and latency histograms, snapshotted for the server's Prometheus /metrics.

Histograms are cumulative (Prometheus semantics: `buckets` are (upper bound, count of observations
<= bound) pairs, plus sum and count), so any number of scrapers can read them.
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

# vLLM's bucket bounds (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(bounds) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1

    def snapshot(self) -> dict:
        cum, out = 0, []
        for b, c in zip(self.bounds + (float("inf"),), self.counts):
            cum += c
            out.append((b, cum))
        return {"buckets": out, "sum": self.sum, "count": self.count}


@dataclass
class EngineMetrics:
    ttft = None
    itl = None
    e2e = None
    requests_finished: dict = field(default_factory=dict)  # finish_reason -> count
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
