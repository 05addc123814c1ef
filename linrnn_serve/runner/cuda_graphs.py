"""CUDA-graph capture and replay of the decode step, one graph per batch bucket.

Buckets are 1, 2, 4, 8, 16, 24, 32, ... (every multiple of 8), up to the first bucket >= max_num_seqs. A live batch of B rows runs in the smallest bucket >= B; padded
rows point at dummy state slot 0 and dummy KV block 0 (see batch.py), so they need no branching.

Per bucket two kinds of graph share one memory pool, captured largest bucket first so smaller
ones reuse its memory:
  * the step graph: embedding -> layers -> lm_head -> logits into the runner's static buffer ->
    argmax (greedy ids). A greedy batch is one replay.
  * sampler graphs (without / with the top-k/top-p sort) that read the same static logits and
    write sampled ids. A sampling batch replays the step graph then one sampler graph, back to
    back with no host sync in between.
The eager path (enforce_eager, CPU, or a failed capture) runs the very same functions on the same
static buffers padded to the same bucket, so graphs on / off run identical kernels on identical
shapes and give bit-identical logits and tokens.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

log = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> list[int]:
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    out, b = [], 1
    while True:
        out.append(b)
        if b >= max_num_seqs:
            return out
        b = b * 2 if b < 8 else b + 8


def bucket_for(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"batch of {n} exceeds the largest decode bucket {buckets[-1]}")


class GraphSet:
    """Captured graphs keyed by (bucket, kind). `capture(fns)` takes, per kind, a function of the
    bucket size that runs that part of the step on the static buffers."""

    def __init__(self):
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def __contains__(self, key) -> bool:
        return key in self.graphs

    def replay(self, bucket: int, kind: str) -> None:
        self.graphs[(bucket, kind)].replay()

    def capture(self, buckets: list[int], kinds: dict[str, Callable[[int], None]], device: torch.device,
                warmup: int = 2, progress: bool = True, note: Callable[[str], None] | None = None,
                prepare: Callable[[int], None] | None = None, desc: str = "capturing CUDA graphs") -> None:
        """Every rank of a tensor-parallel group captures the same (bucket, kind) list in the same
        order: the step graphs hold its collectives, warmed up eagerly (on the side stream) right
        before each capture. `note(what)` marks progress before each warm-up and capture.
        `prepare(bucket)`, if given, runs before each bucket's warm-up (e.g. writes its static inputs)."""
        note = note or (lambda what: None)
        torch.cuda.synchronize(device)
        free0 = torch.cuda.mem_get_info(device)[0]
        t0 = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        order = sorted(buckets, reverse=True)
        it = order
        if progress:
            try:
                from tqdm.auto import tqdm

                it = tqdm(order, desc=desc, unit="bucket")
            except ImportError:  # pragma: no cover
                pass
        stream = torch.cuda.Stream(device)
        for b in it:
            if prepare is not None:
                prepare(b)
            for kind, fn in kinds.items():
                # warm up on a side stream (Triton compilation / autotuning, cuBLAS handles) ...
                note(f"graph bucket {b} {kind}: warm-up")
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    for _ in range(warmup):
                        fn(b)
                torch.cuda.current_stream(device).wait_stream(stream)
                torch.cuda.synchronize(device)
                note(f"graph bucket {b} {kind}: capture")
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    fn(b)
                self.graphs[(b, kind)] = g
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = free0 - torch.cuda.mem_get_info(device)[0]
        log.info("captured %d CUDA graphs (%d buckets: %s) in %.1f s using %.2f GiB", len(self.graphs),
                 len(buckets), _fmt_buckets(buckets), self.capture_seconds, self.capture_bytes / (1 << 30))


def _fmt_buckets(b: list[int]) -> str:
    return ", ".join(map(str, b)) if len(b) <= 8 else f"{b[0]}, {b[1]}, ..., {b[-1]}"
