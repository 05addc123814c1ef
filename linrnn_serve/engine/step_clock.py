"""Late binding of the overlapped loop's next step: when the engine core may still wait for arrivals.

With overlapped steps (LLMEngine.async_scheduling) the core schedules and launches step N+1 while step N
runs on the device. Bound at N's start, N+1 misses every request that arrives while N runs: such a request
waits for the rest of N, for N+1 and then for its own N+2. Bound late (scheduled just before N ends: N's
predicted end minus the host's time to schedule and launch a step, with a margin), N+1 takes it: one
step less before its first token. Meanwhile the core reads its socket (engine/core.py), so an arrival is
queued when it comes, not when the step ends.

StepClock predicts a step's device time from the steps measured: per decode-row bucket (2^k rows) the
time of a step without prefill tokens, plus a time per prefill token (exponential moving averages). A
step's device time is measured from its predecessor's end (or its launch, if nothing was in flight) to
the host's first sight of its sampled ids: while the host blocks on them (exact) or while the core's
arrival window polls PendingStep.done() (to the poll's granularity). A step whose end nobody saw is not
measured. A prediction that is too long costs at most the host's own schedule + launch time plus one
poll: the window closes as soon as the step in flight is done. One that is too short binds early, as
without late binding. The per-token part is one average over all prefill steps, so on the H200 (sixth
prefix run) it predicts too short for a lone 129-token row beside decode rows (a 19 ms step) and too long
for a 2k-token burst (55 ms): the first closes the window early, the second ends it by the done() poll.
"""
from __future__ import annotations

ALPHA = 0.25  # weight of the newest measurement in the moving averages
MARGIN_S = 0.0005  # launch the next step this much before the predicted end, beyond the host's own time


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


class StepClock:
    """Device-time model of launched steps (oldest first) and the late-binding deadline of the next one."""

    def __init__(self):
        self.base: dict[int, float] = {}  # decode-row bucket (bit length of the row count) -> seconds
        self.per_token: float | None = None  # seconds per prefill token beyond the base
        self.host: float | None = None  # seconds from schedule() to the launch returning, decode-only steps
        self.host_per_row: float | None = None  # more per prefill row (what arrivals add to the next step's lead)
        self._launched: list[list] = []  # [rows, prefill tokens, launch returned at, start or None, seen or None]
        self.measured = 0

    def launched(self, rows: int, prefill_tokens: int, t_schedule: float, t_launched: float,
                 prefill_rows: int = 0) -> None:
        """A step with `rows` decode rows and `prefill_rows` rows of `prefill_tokens` to prefill was scheduled at
        t_schedule; its launch returned at t_launched."""
        host = t_launched - t_schedule
        if not prefill_rows:  # the lead the next step needs when nothing new arrives
            self.host = _ema(self.host, host)
        elif self.host is not None:
            self.host_per_row = _ema(self.host_per_row, max(host - self.host, 0.0) / prefill_rows)
        # it starts when the step before it ends (set then), or now if the device is idle
        self._launched.append([rows, prefill_tokens, t_launched, None if self._launched else t_launched, None])

    def seen_done(self, t: float) -> None:
        """The oldest launched step was found done at t (the core's window polls it)."""
        if self._launched and self._launched[0][4] is None:
            self._launched[0][4] = t

    def completed(self, t_done: float | None) -> None:
        """The oldest launched step's ids reached the host. t_done: when it ended if the host saw it end
        (it was blocked on it), else None (then the time seen by the window, if any)."""
        if not self._launched:
            return
        rows, tokens, _, start, seen = self._launched.pop(0)
        end = seen if seen is not None else t_done
        if start is not None and end is not None:
            self.observe(rows, tokens, end - start)
        if self._launched:  # the next one ran right after it (queued behind it), or from its launch if that
            nxt = self._launched[0]  # came later: an unseen end was before the host got here, i.e. (nearly
            nxt[3] = max(end, nxt[2]) if end is not None else nxt[2]  # always) before that launch returned

    def observe(self, rows: int, prefill_tokens: int, seconds: float) -> None:
        self.measured += 1
        k = rows.bit_length()
        if prefill_tokens == 0:
            self.base[k] = _ema(self.base.get(k), seconds)
        elif self._base(k) is not None:
            self.per_token = _ema(self.per_token, max(seconds - self._base(k), 0.0) / prefill_tokens)

    def _base(self, k: int) -> float | None:
        if k in self.base:
            return self.base[k]
        if not self.base:
            return None
        return self.base[min(self.base, key=lambda b: abs(b - k))]  # the nearest bucket measured

    def estimate(self, rows: int, prefill_tokens: int) -> float | None:
        """Predicted device seconds of a step; None until comparable steps were measured."""
        base = self._base(rows.bit_length())
        if base is None or (prefill_tokens and self.per_token is None):
            return None
        return base + prefill_tokens * (self.per_token or 0.0)

    def deadline(self, waiting_rows: int = 0) -> float | None:
        """When the host must start scheduling the next step so that it is launched before the step in flight
        ends (the one launched step, running); None: nothing to wait for, or no prediction. The lead: twice
        the host time of a decode step and of `waiting_rows` prefill rows (the requests queued so far),
        plus MARGIN_S."""
        if len(self._launched) != 1 or self.host is None:
            return None
        rows, tokens, _, start, seen = self._launched[0]
        est = self.estimate(rows, tokens)
        if start is None or seen is not None or est is None:
            return None
        return start + est - 2 * (self.host + waiting_rows * (self.host_per_row or 0.0)) - MARGIN_S
