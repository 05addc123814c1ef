"""A hang of a tensor-parallel rank becomes an error with every rank's stacks (runner/rank_watch.py,
engine/multiproc_executor.py), on the CPU (gloo): a busy rank without progress dumps its Python
stacks, signals its peers to dump theirs and exits with status 3; a stopped worker (SIGSTOP: alive,
its sockets open, so gloo alone would wait) makes the engine's step fail with WorkerDiedError naming
the stage, not hang, and leaves rank 0's stacks inside the collective."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

WATCHED = textwrap.dedent("""
    import os, sys, time
    from linrnn_serve.runner.rank_watch import RankWatch
    peer = [int(sys.argv[3])] if len(sys.argv) > 3 else []
    w = RankWatch(int(sys.argv[1]), sys.argv[2], 1.5, peers=lambda: peer)
    w.stage("loading weights")
    if sys.argv[1] == "1":   # the peer: idle (never fires), dumps its stacks on SIGUSR1
        w.idle()
        def waiting_for_the_core():
            time.sleep(30)
        waiting_for_the_core()
    w.busy("step 7")
    def stuck_in_a_collective():
        time.sleep(30)
    stuck_in_a_collective()
""")


def test_rank_watch_dumps_stacks_signals_peers_and_exits(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    peer = subprocess.Popen([sys.executable, "-c", WATCHED, "1", str(tmp_path)], env=env)
    time.sleep(1.0)  # the peer registers its SIGUSR1 handler
    try:
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-c", WATCHED, "0", str(tmp_path), str(peer.pid)], env=env,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 3, p.stderr
        assert time.monotonic() - t0 < 20
        assert "no progress for" in p.stderr and "'step 7'" in p.stderr
        stacks0 = (tmp_path / "rank0.stacks").read_text()
        assert "stuck_in_a_collective" in stacks0
        for _ in range(50):  # the peer writes asynchronously
            if "waiting_for_the_core" in (tmp_path / "rank1.stacks").read_text():
                break
            time.sleep(0.1)
        assert "waiting_for_the_core" in (tmp_path / "rank1.stacks").read_text()
        assert peer.poll() is None  # an idle peer is only asked for its stacks
        log0 = (tmp_path / "rank0.log").read_text()
        assert "loading weights" in log0 and "HANG" in log0
    finally:
        peer.kill()
        peer.wait()


@pytest.mark.timeout(300)
def test_stopped_worker_fails_the_step_with_stacks_instead_of_hanging(tmp_path, monkeypatch):
    from linrnn_serve.engine.llm_engine import LLMEngine
    from linrnn_serve.engine.multiproc_executor import WorkerDiedError
    from linrnn_serve.sampling_params import SamplingParams

    monkeypatch.setenv("LINRNN_TP_DUMP_DIR", str(tmp_path))
    eng = LLMEngine.from_engine_args("tiny", device="cpu", tensor_parallel_size=2, max_num_seqs=2,
                                     max_model_len=64, progress=False)
    eng.executor.watch.hang_s = 4  # start-up on a loaded machine keeps the default; the steps get 4 s
    try:
        eng.add_request("a", [5, 17, 300], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        eng.step()
        worker = eng.executor.procs[0]
        os.kill(worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="no progress for"):
            for _ in range(50):
                eng.step()
        assert time.monotonic() - t0 < 60
        assert not worker.is_alive()
        stacks0 = (tmp_path / "rank0.stacks").read_text()
        assert "all_reduce" in stacks0 or "all_gather" in stacks0, stacks0[-3000:]
    finally:
        eng.shutdown()


def test_worker_that_cannot_start_fails_the_engine_at_once(tmp_path):
    """A spawned rank that dies before joining the group (here: spawn cannot re-import a main module
    read from stdin) fails the start-up at once with the rank and its exit status, instead of leaving
    rank 0 in the rendezvous."""
    script = textwrap.dedent("""
        import time
        from linrnn_serve.engine.llm_engine import LLMEngine
        t0 = time.monotonic()
        try:
            LLMEngine.from_engine_args("tiny", device="cpu", tensor_parallel_size=2, max_num_seqs=2,
                                       max_model_len=64, progress=False)
        except Exception as e:
            print("RAISED", type(e).__name__, round(time.monotonic() - t0), str(e)[:300])
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), LINRNN_TP_DUMP_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-"], input=script, env=env, capture_output=True, text=True, timeout=120)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RAISED")), "")
    assert line.startswith("RAISED WorkerDiedError"), p.stdout + p.stderr[-3000:]
    assert int(line.split()[2]) < 30, line
    assert "rank 1 exited (status 1) before 'started'" in line, line
