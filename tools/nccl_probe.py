"""All-reduce bandwidth of the torch.distributed backend between N local ranks (the bus-bandwidth
number nccl-tests reports), for comparison with the engine's per-step communication time.

    python -m tools.nccl_probe --ranks 2                 # NCCL on cuda:0..1
    python -m tools.nccl_probe --ranks 2 --device cpu    # gloo smoke run

For each message size: time per all-reduce (median of --iters after a warm-up), algorithm bandwidth
bytes / time and bus bandwidth algbw * 2 (N - 1) / N.
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


def _rank(rank: int, n: int, port: int, device: str, iters: int, out: str, sizes: list[int]) -> None:
    import torch.distributed as dist

    dev = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=n)
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
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.nccl_probe")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--max-bytes", type=int, default=256 << 20)
    p.add_argument("--out", default="/tmp/nccl_probe.json")
    a = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sizes = [b for b in SIZES if b <= a.max_bytes]
    mp.start_processes(_rank, args=(a.ranks, port, a.device, a.iters, a.out, sizes), nprocs=a.ranks,
                       start_method="spawn")
    with open(a.out) as f:
        rows = json.load(f)
    print(f"all-reduce over {a.ranks} ranks ({a.device}):")
    print("| bytes | time us | algbw GB/s | busbw GB/s |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['bytes']} | {r['us']:.1f} | {r['algbw_GBs']:.2f} | {r['busbw_GBs']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
