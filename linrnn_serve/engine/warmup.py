"""Start-up warm-up: run a few tiny requests through every path a first user request can take, so
that Triton/Gluon JIT compilation happens before the server takes traffic, not inside a user's
TTFT (measured on the H200: the first prefix-cache hits of a fresh server waited ~9 s on kernel
compilation; every later turn took 0.3-0.5 s).

Paths covered: prefill from position 0 (a token count that is a multiple of the block size and one
that is not), prefill continuing at a non-zero start, decode, greedy and seeded sampling after a
prefill, a batch of two prefills at once, a full-budget step of 16 prompts, a full-budget step beside a
decode row; with prefix caching also a full-budget step of 16 restored rows, a snapshot restore, a divergence point inside a KV block
(copy-on-write), a finish snapshot and a full hit served from stored logits. Afterwards the prefix cache
is emptied and every counter reset: metrics start at zero and nothing of the warm-up can be hit later.
"""
from __future__ import annotations

import logging
import os
import time

from linrnn_serve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

ENV = "LINRNN_WARMUP"  # "0" skips it (default: on for CUDA devices, off on the CPU)


def enabled(device) -> bool:
    flag = os.environ.get(ENV)
    return flag != "0" if flag is not None else device.type == "cuda"


def warm_up(engine) -> None:
    t0 = time.perf_counter()
    bs = engine.config.block_size
    V = engine.model_config.vocab_size
    budget = engine.config.max_num_batched_tokens
    room = engine.max_model_len - 4  # prompt + 3 output tokens must fit
    n = min(3 * bs + 5, room, budget)
    if n < 4:
        return
    tok = lambda i: (7919 * i + 13) % V  # noqa: E731 - a fixed, non-trivial token pattern
    prompt = [tok(i) for i in range(n)]
    cut = min(2 * bs, n - 2)
    rounds = [
        [prompt],  # from 0; finish snapshot
        [prompt[:cut] + [tok(n + i) for i in range(7)]],  # divergence at a block boundary, then a continuation
        [prompt[:cut] + [tok(2 * n + i) for i in range(9)]],  # restore at the boundary
        [prompt[:cut + 1] + [tok(3 * n + i) for i in range(5)]],  # divergence inside a block (copy-on-write)
        [list(prompt)],  # a full hit from the prompt-end snapshot's logits
        [[tok(4 * n + i) for i in range(bs)], [tok(5 * n + i) for i in range(bs + 3)]],  # two prefills at once
    ]
    seeded = len(rounds) - 1  # the two prefills sample with a seed
    # a full-budget step of many prompts (a burst that arrived together, engine/burst.py): Triton specializes
    # integer arguments that are multiples of 16 (the prompt count) apart, and above the prefill graphs' largest
    # bucket the step runs eagerly; the profile run covered one long prompt only (on the H200 a first 64-prompt
    # step of a fresh server stalled a c = 64 wave by ~2 s)
    k = min(16, engine.config.max_num_seqs)
    m = min(budget // k, room)
    if m >= 2:
        rounds.append([[tok(6 * n + j * m + i) for i in range(m)] for j in range(k)])
    if engine.prefix_cache is not None:
        # the same many-row step made of restored rows (a turn of multi-turn users: each restores the shared
        # prompt's snapshot and prefills its own continuation with context); on the H200 its first one above the
        # prefill graphs compiled for 1.7 s inside a user's turn (benchmarks/results/prefix/h200_seventh_run)
        s = min(budget // k - 1, room - n)
        if s >= 2:
            rounds.append([prompt + [tok(7 * n + budget + j * s + i) for i in range(s)] for j in range(k)])
    rid = 0
    for k, prompts in enumerate(rounds):
        for p in prompts:  # explicit seeds: the engine's own seed stream is not consumed
            params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, ignore_eos=True, seed=0) \
                if k == seeded else SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, seed=0)
            engine.add_request(f"warmup-{rid}", p[:room], params)
            rid += 1
        while engine.has_unfinished_requests():
            engine.step_requests()
    # a step of the whole token budget beside a decode row: steps beyond the largest prefill CUDA graph run
    # eagerly, and their first one compiled for 2.8 s inside turn 1 on the H200 (8192-token budget)
    big, base = min(budget - 1, room), 6 * n + budget  # (ids no earlier round used)
    if big > n:
        engine.add_request(f"warmup-{rid}", [tok(base + i) for i in range(bs)],
                           SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, seed=0))
        engine.step_requests()  # its prefill: it decodes in the next step, beside the long prompt
        engine.add_request(f"warmup-{rid + 1}", [tok(base + bs + i) for i in range(big)],
                           SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, seed=0))
        rid += 2
        while engine.has_unfinished_requests():
            engine.step_requests()
    engine.drain_snapshot_saves()
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    engine.reset_stats()
    log.info("warm-up: %d requests through every prefill/decode/prefix-cache path in %.1f s", rid,
             time.perf_counter() - t0)
