"""Router kernel launch shapes on the model's strided logits view (gate GEMM output has E + 1
columns: router | shared_expert_gate). Prints us per call, CUDA-graph replays, do_bench median."""
import torch
import triton

from linrnn_kernels.moe import naive
from linrnn_kernels.moe.router import route


def main() -> None:
    E = 256
    for T in (1, 8, 128):
        gate = torch.randn(T, E + 1, device="cuda", dtype=torch.bfloat16)
        logits = gate[:, :E]
        ref_w, ref_i = naive.route(logits, 8, True)
        for bt, nw in ((16, 4), (1, 1), (1, 2), (4, 1)):
            w, i = route(logits, 8, True, block_t=bt, num_warps=nw)
            ok = torch.allclose(w, ref_w, atol=1e-5) and torch.equal(i.long().sort(1)[0], ref_i.sort(1)[0])
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(40):
                    route(logits, 8, True, block_t=bt, num_warps=nw)
            us = triton.testing.do_bench(g.replay, return_mode="median") * 1000 / 40
            print(f"T={T:4d} block_t={bt:2d} warps={nw}: {us:7.2f} us/call  correct={ok}", flush=True)


if __name__ == "__main__":
    main()
