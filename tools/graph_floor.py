"""The MoE layer benchmark's timing floor: one CUDA-graph replay of a single 1-element kernel, timed as
benchmarks/kernels/moe.py times a layer (read flush before each call, CUDA events around the replay), so a layer's
time can be read as this floor plus the layer's own work. Prints one line of JSON."""
import json

import torch

from linrnn_bench.kernels.moe import _bench_read_flush, graphed

x = torch.ones(1, device="cuda")
replay, mode = graphed(lambda: x.add_(1.0), True)
times = [_bench_read_flush(replay, 25, 100) for _ in range(3)]
print(json.dumps({"graph_floor_us": times, "mode": mode, "device": torch.cuda.get_device_name(0)}))
