"""Progress log and hang watchdog of one tensor-parallel rank (the engine core's in-process rank 0 and
each worker process own one RankWatch).

    watch = RankWatch(rank, dump_dir, hang_s)
    watch.stage("loading weights")      # INFO line "TP rank 1 [+12.3 s] loading weights" on every rank
    watch.note("graph bucket 32 step")  # a finer mark: the rank's log file only
    watch.busy("step") ... watch.idle() # around each step: the watchdog only counts while busy

A hang becomes an error that says where every rank was:
  * a daemon thread checks once a second; when a busy rank has made no progress for `hang_s` seconds
    (and no rank's stage log has grown meanwhile: a rank waiting for a peer that is still loading waits)
    it writes the Python stacks of all its threads to <dump_dir>/rank<r>.stacks (and stderr), asks
    the other ranks to do the same (SIGUSR1: every rank registers faulthandler on it), then calls
    `on_hang(reason)` (rank 0: kill the workers, so the engine's failure path aborts the collectives
    and raises; a worker: exit with status 3, which rank 0 reports with the reason);
  * in a worker process, SIGTERM (e.g. `timeout` ending a stuck run) and fatal signals (SIGSEGV,
    SIGABRT from the NCCL watchdog) dump the stacks into the same file before the process ends (rank 0
    lives in the engine's process and leaves its signal handling alone: the watchdog dumps its stacks);
  * <dump_dir>/rank<r>.log keeps every stage line with its time, so the last line of each rank is
    where it stopped.
The watchdog thread makes no CUDA calls (it never disturbs a CUDA-graph capture in progress).
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

log = logging.getLogger("linrnn_serve.tp")

HANG_S_ENV = "LINRNN_TP_HANG_S"  # seconds without progress before the stacks are dumped
DUMP_DIR_ENV = "LINRNN_TP_DUMP_DIR"  # where the ranks' stage logs and stacks go
DEFAULT_HANG_S = 300.0


def hang_seconds() -> float:
    v = os.environ.get(HANG_S_ENV)
    try:
        return float(v) if v else DEFAULT_HANG_S
    except ValueError:
        raise ValueError(f"{HANG_S_ENV}={v!r}: expected seconds") from None


class RankWatch:
    def __init__(self, rank: int, dump_dir: str, hang_s: float, peers: Callable[[], list[int]] = lambda: [],
                 on_hang: Callable[[str], None] | None = None, own_process: bool = True):
        """`peers()`: pids to send SIGUSR1 to on a hang; `on_hang(reason)` runs after the dumps
        (default: exit the process with status 3). `own_process`: a worker process, whose fatal-signal
        dumps go to the stacks file too (rank 0 lives in the engine's process and leaves those alone)."""
        self.rank, self.dump_dir, self.hang_s = rank, dump_dir, hang_s
        self.peers, self.on_hang = peers, on_hang
        self.t0 = time.monotonic()
        self.what = "starting"
        self.last = self.t0
        self.busy_since: float | None = self.t0  # start-up counts as busy
        self.fired = False
        self._closed = False
        os.makedirs(dump_dir, exist_ok=True)
        self.stacks_path = os.path.join(dump_dir, f"rank{rank}.stacks")
        self._stacks = open(self.stacks_path, "a", buffering=1)
        self._log = open(os.path.join(dump_dir, f"rank{rank}.log"), "a", buffering=1)
        self.own_process = own_process
        faulthandler.register(signal.SIGUSR1, self._stacks, all_threads=True, chain=False)
        if own_process:  # rank 0 leaves the engine process's fatal-signal and SIGTERM handling alone
            faulthandler.enable(self._stacks, all_threads=True)
            faulthandler.register(signal.SIGTERM, self._stacks, all_threads=True, chain=True)
        self._thread = threading.Thread(target=self._run, name=f"linrnn-tp-watch{rank}", daemon=True)
        self._thread.start()

    # ---- marks (cheap: attribute writes) ---------------------------------------------------------
    def stage(self, what: str) -> None:
        """A start-up (or rare) stage begins: logged on every rank with the time since start."""
        now = time.monotonic()
        self.what, self.last = what, now
        line = f"TP rank {self.rank} [+{now - self.t0:.1f} s] {what}"
        log.info("%s", line)
        try:
            self._log.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        except ValueError:  # closed
            pass

    def note(self, what: str) -> None:
        """A fine-grained progress mark (a graph bucket, a profile forward): the rank's log file only."""
        now = time.monotonic()
        self.what, self.last = what, now
        try:
            self._log.write(f"{time.strftime('%H:%M:%S')} TP rank {self.rank} [+{now - self.t0:.1f} s] {what}\n")
        except ValueError:
            pass

    def busy(self, what: str) -> None:
        self.what = what
        self.last = self.busy_since = time.monotonic()

    def idle(self) -> None:
        self.busy_since = None
        self.last = time.monotonic()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.own_process:
            for sig in (signal.SIGUSR1, signal.SIGTERM):
                faulthandler.unregister(sig)
            faulthandler.disable()
        else:  # a late SIGUSR1 from a worker must not end the engine's process (the default action)
            try:
                faulthandler.register(signal.SIGUSR1, sys.__stderr__, all_threads=True, chain=False)
            except (AttributeError, ValueError, OSError, RuntimeError):  # no usable stderr: ignore it
                signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        for f in (self._stacks, self._log):
            f.close()

    # ---- the watchdog ------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closed and not self.fired:
            time.sleep(1.0)
            if self.busy_since is None or self._closed:
                continue
            stalled = min(time.monotonic() - self.last, self._since_peer_progress())
            if stalled >= self.hang_s:
                self.fired = True
                self._fire(stalled)

    def dump_stacks(self, why: str, also_stderr: bool = False) -> None:
        """This process's Python stacks (every thread) into the rank's stacks file, under a header."""
        for f in (self._stacks, sys.stderr) if also_stderr else (self._stacks,):
            try:
                f.write(f"\n==== {time.strftime('%H:%M:%S')} {why}\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
                f.flush()
            except (ValueError, OSError):
                pass

    def _since_peer_progress(self) -> float:
        """Seconds since any rank's stage log last grew: a rank waiting in a collective for a peer that is
        still loading (and marking progress) is not hung."""
        newest = 0.0
        try:
            with os.scandir(self.dump_dir) as it:
                for e in it:
                    if e.name.startswith("rank") and e.name.endswith(".log"):
                        newest = max(newest, e.stat().st_mtime)
        except OSError:
            return float("inf")
        return time.time() - newest if newest else float("inf")

    def _fire(self, stalled: float) -> None:
        reason = (f"TP rank {self.rank}: no progress for {stalled:.0f} s in '{self.what}' "
                  f"(+{time.monotonic() - self.t0:.0f} s since start); Python stacks of every rank in "
                  f"{self.dump_dir}/rank*.stacks")
        self.dump_stacks(reason, also_stderr=True)
        try:
            self._log.write(f"{time.strftime('%H:%M:%S')} HANG {reason}\n")
        except ValueError:  # closed meanwhile
            pass
        for pid in self.peers():
            try:
                os.kill(pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(2.0)  # let the peers write their stacks
        log.error("%s", reason)
        if self.on_hang is not None:
            self.on_hang(reason)
        else:
            os._exit(3)


__all__ = ["RankWatch", "hang_seconds", "HANG_S_ENV", "DUMP_DIR_ENV", "DEFAULT_HANG_S"]
