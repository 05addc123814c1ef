"""All-reduce bandwidth of the torch.distributed backend between N local ranks (the bus-bandwidth
number nccl-tests reports), for comparison with the engine's per-step communication time.

    python -m tools.nccl_probe --ranks 2                 # NCCL on cuda:0..1
    python -m tools.nccl_probe --ranks 2 --device cpu    # gloo smoke run

For each message size: time per all-reduce (median of --iters after a warm-up), algorithm bandwidth
bytes / time and bus bandwidth algbw * 2 (N - 1) / N.

`--graph` then checks what the engine's decode graphs rely on, in isolation: the group bound to each
rank's device (as the engine joins it), an all-reduce and an all-gather captured in one CUDA graph
through torch.distributed after an eager warm-up on a side stream (as runner/cuda_graphs.py
captures), replayed and checked, with the replay time per collective at decode sizes. Each rank
prints its steps as it goes (flushed), so a hang shows where.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


GRAPH_SIZES = [8 << 10, 512 << 10, 4 << 20]  # decode-step all-reduces: B x hidden x 2 bytes


def _say(rank: int, what: str) -> None:
    print(f"[probe rank {rank} {time.strftime('%H:%M:%S')}] {what}", flush=True)


def _graph_check(rank: int, n: int, dev: torch.device, iters: int) -> list[dict]:
    import torch.distributed as dist

    rows = []
    for size in GRAPH_SIZES:
        x = torch.empty(size // 2, dtype=torch.bfloat16, device=dev)
        y = torch.empty(n * 8, dtype=torch.float32, device=dev)
        z = torch.full((8,), float(rank), dtype=torch.float32, device=dev)

        def step():
            x.fill_(rank + 1)
            dist.all_reduce(x)
            dist.all_gather_into_tensor(y, z)

        _say(rank, f"graph {size} B: eager warm-up on a side stream")
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for _ in range(2):
                step()
        torch.cuda.current_stream(dev).wait_stream(s)
        torch.cuda.synchronize(dev)
        _say(rank, f"graph {size} B: capture")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        torch.cuda.synchronize(dev)
        _say(rank, f"graph {size} B: replay")
        x.zero_()
        g.replay()
        torch.cuda.synchronize(dev)
        want = n * (n + 1) / 2
        ok = bool((x.float() == want).all()) and y.view(n, 8)[:, 0].tolist() == [float(r) for r in range(n)]
        times = []
        for i in range(iters + 3):
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            g.replay()
            torch.cuda.synchronize(dev)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        rows.append({"bytes": size, "graph_replay_us": 1e6 * statistics.median(times), "correct": ok})
        _say(rank, f"graph {size} B: {'correct' if ok else 'WRONG'}, replay {rows[-1]['graph_replay_us']:.1f} us")
    return rows


def _rank(rank: int, n: int, port: int, device: str, iters: int, out: str, sizes: list[int], graph: bool) -> None:
    import datetime

    import torch.distributed as dist

    dev = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    _say(rank, "joining the group")
    kw = {"device_id": dev} if dev.type == "cuda" else {}
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=n, timeout=datetime.timedelta(seconds=90), **kw)
    _say(rank, "joined")
    rows = []
    for size in sizes:
        x = torch.ones(size // 2, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float16, device=dev)
        times = []
        for i in range(iters + 3):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        alg = size / t
        rows.append({"bytes": size, "us": 1e6 * t, "algbw_GBs": alg / 1e9, "busbw_GBs": alg * 2 * (n - 1) / n / 1e9})
    _say(rank, "bandwidth sweep done")
    graph_rows = _graph_check(rank, n, dev, iters) if graph and dev.type == "cuda" else []
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"all_reduce": rows, "graph": graph_rows}, f)
    dist.barrier()
    _say(rank, "done")
    if dev.type == "cuda":  # destroy_process_group can hang after a capture (pytorch#115388): abort
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
    else:
        dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.nccl_probe")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--max-bytes", type=int, default=256 << 20)
    p.add_argument("--out", default="/tmp/nccl_probe.json")
    p.add_argument("--graph", action="store_true", help="also check collectives captured in a CUDA graph")
    a = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sizes = [b for b in SIZES if b <= a.max_bytes]
    from linrnn_serve.parallel import set_nccl_env_defaults

    set_nccl_env_defaults()  # what the engine's ranks run with
    mp.start_processes(_rank, args=(a.ranks, port, a.device, a.iters, a.out, sizes, a.graph), nprocs=a.ranks,
                       start_method="spawn")
    with open(a.out) as f:
        res = json.load(f)
    print(f"all-reduce over {a.ranks} ranks ({a.device}):")
    print("| bytes | time us | algbw GB/s | busbw GB/s |\n|---:|---:|---:|---:|")
    for r in res["all_reduce"]:
        print(f"| {r['bytes']} | {r['us']:.1f} | {r['algbw_GBs']:.2f} | {r['busbw_GBs']:.2f} |")
    if res["graph"]:
        print("all-reduce + all-gather captured in one CUDA graph (torch.distributed):")
        print("| all-reduce bytes | correct | replay us |\n|---:|---|---:|")
        for r in res["graph"]:
            print(f"| {r['bytes']} | {r['correct']} | {r['graph_replay_us']:.1f} |")
        if not all(r["correct"] for r in res["graph"]):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
