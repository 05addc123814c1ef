"""Burst coalescing: new prompts wait briefly for the rest of their burst, so that the burst prefills in one step.

Under closed-loop load (each of c clients sends its next request when its previous one ends, as `bench serve`
does at concurrency c) requests that end together come back together: at c = 64, in 128 / out 128, a wave of 64
ends in one step and its 64 successors reach the core over 5-20 ms (the clients' and the API server's
turnaround). Admitting whatever has arrived at each step splits the wave's prefill into several steps, each a
forward with its own fixed cost, the later ones beside the decode of the early arrivals; and the split
persists, since requests prefilled a step early end a step early and their successors come back early again
(benchmarks/wave.py shows both on the CPU).

BurstHold holds the admission of waiting requests (their prefill; running sequences go on decoding) while
  - requests that finished in a burst (>= BURST_MIN in one step, aborts not counted) less than OWED_S ago
    have not all been replaced by arrivals (each arrival replaces one): their clients are on their way back;
  - requests are arriving in a burst: two or more wait and the last came less than GAP_S ago (unless they
    just replaced a whole burst: then they are all there);
  - >= BURST_MIN running sequences reach their length limit within IMMINENT_STEPS steps: a burst is about to
    end, and waiting for it (and then for its successors) puts a split wave back together;
and never longer than MAX_HOLD_S after the oldest waiting request arrived. A lone request with no burst
behind it (concurrency 1, a sparse open-loop arrival) is never held.

Head start (`head_start`, --burst-head-start): while a burst is held with nothing else running, the device idles
until its last request arrives (at c = 64 on the H200 a wave's arrivals spread over ~10-30 ms). Once the oldest has
waited HEAD_START_AFTER_S, the prompts already there (at least HEAD_START_MIN_TOKENS, whole prompts up to the
largest prefill bucket they fill, so the step is not padded) start prefilling; the rest prefill in one step when
the hold ends. The engine keeps the early ones from decoding until then (LLMEngine: parked), so the burst still
decodes, and ends, as one: a burst that ran ahead would split the next wave again. One head start per hold: a
prefill forward costs ~10 ms beyond its tokens on the H200 (all expert weights read, per-layer launches; the round-3
probe's 64 x 128 and 16 x 129 forwards fit 13.7 us per token + ~10 ms), so more, smaller steps cost more than they
hide; and only while bursts come back spread out (the last whole burst's first -> last arrival at the core >=
HEAD_START_MIN_SPREAD_S, or none measured yet): a burst that arrives within ~12 ms (the 2 ms delay + that fixed
cost) gains less than the extra forward costs. The core logs the bursts' mean spread at exit. The engine-core process turns it on
(--coalesce-bursts, default on there); the offline engine adds its requests at once and has nothing to wait for.
"""
from __future__ import annotations

from collections import deque

BURST_MIN = 4  # requests ending (or about to end) in one step that make a burst
OWED_S = 0.05  # a burst's clients that have not come back within this long are not waited for
GAP_S = 0.001  # arrivals this close together are one burst
IMMINENT_STEPS = 3  # a running burst this many steps from its length limit is waited for
MAX_HOLD_S = 0.05  # the longest a waiting request is held
HEAD_START_AFTER_S = 0.002  # a burst that has not all arrived this long after its first request gets a head start
HEAD_START_MIN_TOKENS = 1024  # ... of at least this many prompt tokens (a smaller forward hides less than it costs)
HEAD_START_MIN_SPREAD_S = 0.014  # ... while the last burst took at least this long to come back (first -> last)


class BurstHold:
    """When admission of waiting requests may go ahead (`until`), from recent finishes and arrivals."""

    def __init__(self):
        self._owed: deque[float] = deque()  # finish times of burst-finished requests not yet replaced
        self._last_arrival = -1.0
        self._repaid = -1.0  # when an arrival last replaced the last owed request
        self.holds = 0  # scheduling decisions that held admission back (stats)
        self.head_starts = 0  # early prefills of a held burst's first arrivals (stats)
        self._burst_first: float | None = None  # the first arrival that repaid the current burst
        self.last_spread: float | None = None  # first -> last arrival of the last burst that came back whole
        self.spreads = [0, 0.0]  # bursts that came back whole, their spreads' sum (stats)

    def finished(self, n: int, now: float) -> None:
        """n requests finished (not aborted) in the step postprocessed at `now`."""
        if n >= BURST_MIN:
            if not self._owed:
                self._burst_first = None
            self._owed.extend([now] * n)

    def arrived(self, now: float) -> None:
        self._expire(now)
        if self._owed:
            if self._burst_first is None:
                self._burst_first = now
            self._owed.popleft()
            if not self._owed:
                self._repaid = now
                self.last_spread = now - self._burst_first
                self.spreads[0] += 1
                self.spreads[1] += self.last_spread
        self._last_arrival = now

    def _expire(self, now: float) -> None:
        while self._owed and now - self._owed[0] > OWED_S:
            self._owed.popleft()

    def until(self, now: float, oldest_waiting: float | None, num_waiting: int, finishing_soon) -> float | None:
        """The time.monotonic() until which admission waits (re-ask then, or at the next arrival or step); None:
        admit now. `oldest_waiting`: the arrival time of the oldest waiting request (None: none waits);
        `finishing_soon()`: the running sequences within IMMINENT_STEPS steps of their length limit."""
        if oldest_waiting is None:
            return None
        limit = oldest_waiting + MAX_HOLD_S
        if now >= limit:
            return None
        self._expire(now)
        hold = None
        if self._owed:
            hold = self._owed[0] + OWED_S
        elif num_waiting >= 2 and now - self._last_arrival < GAP_S and now - self._repaid > OWED_S:
            hold = self._last_arrival + GAP_S
        elif finishing_soon() >= BURST_MIN:
            hold = limit
        if hold is None:
            return None
        self.holds += 1
        return min(hold, limit)

    def head_start(self, now: float, oldest_waiting: float, prompt_lens: list[int], buckets: list[int]) -> int | None:
        """While admission is held and nothing else runs: the prompt tokens to admit now (whole prompts, in queue
        order, up to the largest of `buckets` <= their sum), or None (keep waiting). `prompt_lens`: the waiting
        prompts' token counts in queue order; `buckets`: the prefill token buckets."""
        if now - oldest_waiting < HEAD_START_AFTER_S or (self.last_spread or 1.0) < HEAD_START_MIN_SPREAD_S:
            return None
        cap = max((b for b in buckets if b <= sum(prompt_lens)), default=0)
        if cap < HEAD_START_MIN_TOKENS:
            return None
        n = 0
        for k in prompt_lens:
            if n + k > cap:
                break
            n += k
        if n < HEAD_START_MIN_TOKENS:
            return None
        return n

    def owed(self, now: float) -> bool:
        """Whether clients of a burst that finished are still on their way back."""
        self._expire(now)
        return bool(self._owed)
