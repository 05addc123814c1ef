"""#15 H3: micro-benchmark of the fused router (kernels/moe/router_fused.py) alone at 35B-A3B shapes (E = 256, top-8,
hidden 2048, the shared expert's gate row and gate_up in the same launch, pair blocks of 8 tokens as the engine
aligns for the MMA experts), PDL off (LINRNN_PDL=0 is set here before any kernel import).

For each M and variant (tile config x RouterTail): every output (logits, weights, ids, alignment, h) is checked
bit for bit against the first variant of that M (the current default) and that one against the naive composition;
then timed as CUDA-graph replays of 24 calls over rotating weight copies (> L2): `us/call` (graph time / calls,
launch gaps included) and `kernel us` (the kernel's own duration from the profiler over the same replays).
`tail` rows: route_align_logits (the finishing program's routing + alignment as its own one-program launch) at
1 / 4 / 8 warps, the tail's cost without the GEMM.

    python tools/gpu_router.py --m 1,2,4,8 --set sweep --out $OUT/router
Writes router.md (the table) and router.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ["LINRNN_PDL"] = "0"

import torch  # noqa: E402

E, TOP_K, H, NI, BLOCK_M_ALIGN = 256, 8, int(os.environ.get("ROUTER_H", 2048)), int(os.environ.get("ROUTER_NI", 512)), 8
COPIES, CALLS = 12, 24


def tails():
    from linrnn_kernels.moe.router_fused import RouterTail

    return {"base": RouterTail(), "rep": RouterTail(True), "rep+reg": RouterTail(True, True),
            "rep+keys": RouterTail(True, False, True), "all": RouterTail(True, True, True),
            "reg+keys": RouterTail(False, True, True)}


# (bn, bk, split, warps) FMA tiles worth trying per M (tuned.json's router entry comes first, added at run time)
SWEEP_CFGS = {1: [(1, 2048, 1, 8), (2, 2048, 1, 4), (2, 1024, 2, 4), (1, 1024, 2, 4)],
              2: [(1, 2048, 1, 4), (2, 2048, 1, 8), (2, 1024, 2, 4)],
              4: [(1, 2048, 1, 8), (2, 1024, 1, 8), (4, 512, 1, 8), (4, 256, 2, 8), (2, 2048, 1, 8)],
              8: [(1, 2048, 1, 8), (2, 1024, 1, 8), (4, 512, 1, 8), (4, 256, 2, 4), (2, 512, 2, 8)]}


def _diag_tiles(M: int):
    """Other tiles tried by --set final at 4-8 rows (the table's FMA tiles at 8 rows need 121-245 registers: 1-2
    programs per SM, 2-3 waves of 386 programs): FMA tiles that fit one wave, tensor-core tiles."""
    from linrnn_kernels.gemv.config import SkinnyConfig

    fma = [SkinnyConfig(4, 128, 2, 4, 1, False), SkinnyConfig(2, 256, 2, 4, 1, False)] if M == 8 else []
    return fma + [SkinnyConfig(32, 256, 8, 4, 3, True)]


TAIL_ALONE = [(1, "base"), (4, "base"), (8, "base"), (4, "all"), (8, "all"), (4, "rep+reg")]


def variants(M: int, which: str):
    """[(name, SkinnyConfig, RouterTail)]: the table's config with every tail, the other tiles with `all`."""
    from linrnn_kernels.gemv import config as gcfg
    from linrnn_kernels.gemv.config import SkinnyConfig

    if which == "final":  # the tree's default (main's or the branch's); on the branch also the plain tail
        cfg = gcfg.router_config(M, E + 1 + NI, H, torch.device("cuda"))
        out = [(f"default {cfg.astuple()}", cfg, None)]
        if M in (1, 8):
            out.append(("diag: default without the shared gate_up", cfg, None))
        try:
            from linrnn_kernels.moe.router_fused import RouterTail
        except ImportError:  # main's tree
            return out
        if M > 1:  # main's kernel (at one row the single-token pair blocks differ from main's)
            out.append((f"plain tail RouterTail() {cfg.astuple()}", cfg, RouterTail()))
        for c in _diag_tiles(M) if M >= 4 else ():  # other tiles: other summation orders (logits may differ)
            out.append((f"tiles {c.astuple()}", c, None))
        return out
    t = tails()
    tuned = gcfg.router_config(M, E + 1 + NI, H, torch.device("cuda"))
    if H != 2048:  # --dry: small shapes
        tuned = SkinnyConfig(16, 64, 2, tuned.num_warps, 1, False)
    out = [(f"{tuned.astuple()} {n}", tuned, tail) for n, tail in t.items()]
    for bn, bk, split, warps in SWEEP_CFGS.get(M, []):
        c = SkinnyConfig(bn, min(bk, H // 2), split, warps, 1, False)
        if c != tuned:
            out += [(f"{c.astuple()} all", c, t["all"]), (f"{c.astuple()} rep+reg", c, t["rep+reg"])]
    return out


class Inputs:
    def __init__(self, M: int, dev):
        from linrnn_kernels.quant import WeightTensor

        torch.manual_seed(100 + M)
        bf = torch.bfloat16
        self.M = M
        self.x = torch.randn(M, H, device=dev).to(bf)
        self.gw = [WeightTensor("dense", (torch.randn(E + 1, H, device=dev) / H ** 0.5).to(bf)) for _ in range(COPIES)]
        self.w13 = [WeightTensor("dense", (torch.randn(2 * NI, H, device=dev) / H ** 0.5).to(bf))
                    for _ in range(COPIES)]

    def call(self, i: int, cfg, tail, shared: bool = True):
        from linrnn_kernels.moe import router_fused

        kw = {} if tail is None else {"tail": tail}  # main's route_align has no tail argument
        return router_fused.route_align(self.x, self.gw[i], E, TOP_K, True, BLOCK_M_ALIGN, cfg,
                                        shared_w13=None if shared is False else self.w13[i], pair_blocks=True, **kw)


def flat(out) -> list[torch.Tensor]:
    logits, w, ids, (s, e, n), h = out
    return [logits, w, ids, s[: ids.numel() * BLOCK_M_ALIGN], e[: ids.numel()], n, h]


def check_naive(inp: Inputs, out) -> None:
    from linrnn_kernels.moe import naive
    from linrnn_kernels.moe.router_fused import naive_route_align, naive_shared_gate_up

    logits, w, ids, (s, e, n), h = out
    ref_l = naive_route_align(inp.x, inp.gw[0], E, TOP_K, True, BLOCK_M_ALIGN)[0]
    assert (logits.float() - ref_l.float()).norm() <= 1e-2 * ref_l.float().norm(), "logits"
    ref_h = naive_shared_gate_up(inp.x, inp.w13[0])
    assert (h.float() - ref_h.float()).norm() <= 2e-2 * ref_h.float().norm(), "h"
    rw, rids = naive.route(logits[:, :E], TOP_K, True)
    p = torch.softmax(logits[:, :E].float(), -1)
    assert torch.equal(p.gather(1, ids.long()), p.gather(1, rids)), "ids"
    exact = w.is_cuda  # the CPU interpreter's f32 -> bf16 cast truncates (one ulp)
    assert torch.allclose(w.float(), rw.to(w.dtype).float(), rtol=0 if exact else 2 ** -7, atol=0), "weights"
    rs, re_, rn = naive.moe_pair_blocks(ids, BLOCK_M_ALIGN)
    assert torch.equal(s[: rs.numel()], rs) and torch.equal(e[: re_.numel()], re_) and int(n) == rn, "pair blocks"


def kernel_us(calls, name_part: str) -> float:
    """Mean duration of the kernels whose name contains name_part over graph replays (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
    from torch.autograd import DeviceType

    durs = [e.time_range.elapsed_us() for e in prof.events()
            if e.device_type == DeviceType.CUDA and name_part in e.name]
    if not durs:  # kernels inside graph replays not reported: the same calls eagerly
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for c in calls:
                c()
            torch.cuda.synchronize()
        durs = [e.time_range.elapsed_us() for e in prof.events()
                if e.device_type == DeviceType.CUDA and name_part in e.name]
    return statistics.median(durs) if durs else float("nan")


def _compile(args):
    ms, which = args
    import warnings

    warnings.filterwarnings("ignore")
    dev = torch.device("cuda")
    errs = []
    for M in ms:
        inp = Inputs(M, dev)
        for name, cfg, tail in variants(M, which):
            try:
                inp.call(0, cfg, tail, "without the shared" not in name)
            except Exception as e:  # noqa: BLE001 - reported and skipped
                errs.append(f"M={M} {name}: {type(e).__name__}: {str(e)[:300]}")
        if which == "sweep":
            from linrnn_kernels.moe import router_fused

            lg = torch.randn(M, E + 1, device=dev).to(torch.bfloat16)
            for warps, tname in TAIL_ALONE:
                router_fused.route_align_logits(lg, E, TOP_K, True, BLOCK_M_ALIGN, torch.bfloat16, pair_blocks=True,
                                                tail=tails()[tname], num_warps=warps)
    torch.cuda.synchronize()
    return errs


def pick(rows: list[dict], path: str) -> None:
    from linrnn_kernels.gemv import config as gcfg

    with open(gcfg.TUNED) as f:
        table = json.load(f)
    for M in (4, 8):
        mine = [r for r in rows if r["M"] == M and "kernel_us" in r]
        default = next((r for r in mine if r["variant"].startswith("default")), None)
        cands = [r for r in mine if r["variant"].startswith("tiles ") and r["check"].startswith("naive ok")]
        if default is None or not cands:
            continue
        best = min(cands, key=lambda r: r["kernel_us"])
        if best["kernel_us"] <= default["kernel_us"] - 0.5:
            spec = json.loads(best["variant"][len("tiles "):])
            table["router"][str(M)] = spec
            print(f"PICK M={M}: {spec} {best['kernel_us']:.2f} us (table's {default['kernel_us']:.2f})", flush=True)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)


def dry(args) -> int:
    global COPIES
    COPIES = 1
    dev = torch.device("cpu")
    for M in [int(v) for v in args.m.split(",")]:
        inp = Inputs(M, dev)
        ref = None
        for name, cfg, tail in variants(M, args.set):
            out = inp.call(0, cfg, tail, "without the shared" not in name)
            if ref is None:
                check_naive(inp, out)
                ref = flat(out)
            print(M, name, all(torch.equal(a, b) for a, b in zip(flat(out)[:6], ref[:6])), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="1,2,4,8")
    p.add_argument("--set", default="sweep", choices=["sweep", "final"])
    p.add_argument("--out", default="/tmp/router")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--pick-table", default=None, metavar="JSON",
                   help="--set final: write tuned.json with the router's tile at 4 / 8 rows replaced by the fastest "
                        "tile that passed the checks, where it beat the table's by >= 0.5 us")
    p.add_argument("--dry", action="store_true", help="CPU interpreter: the checks only (ROUTER_H / ROUTER_NI small)")
    args = p.parse_args()
    if args.dry:
        return dry(args)
    from linrnn_bench.kernels.common import time_graph
    from linrnn_kernels.moe import router_fused

    ms = [int(v) for v in args.m.split(",")]
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    if args.workers > 1:  # fill the Triton cache in parallel (one process per M)
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(min(args.workers, len(ms))) as pool:
            errs = [e for part in pool.map(_compile, [([M], args.set) for M in ms]) for e in part]
        for e in errs:
            print("COMPILE-ERROR", e, flush=True)
    print(f"compiled in {time.time() - t0:.0f} s", flush=True)
    dev = torch.device("cuda")
    rows = []
    for M in ms:
        inp = Inputs(M, dev)
        ref = None
        for name, cfg, tail in variants(M, args.set):
            row = {"M": M, "variant": name}
            try:
                shared = "without the shared" not in name
                out = inp.call(0, cfg, tail, shared)
                torch.cuda.synchronize()
                if not shared:
                    same = all(torch.equal(a, b) for a, b in zip(flat(out)[:6], ref[:6]))
                    row["check"] = "== first (no h)" if same else "DIFFERS"
                elif ref is None:
                    check_naive(inp, out)
                    ref = [t.clone() for t in flat(out)]
                    row["check"] = "naive ok"
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        captured = inp.call(0, cfg, tail)
                    g.replay()
                    torch.cuda.synchronize()
                    same = all(torch.equal(a, b) for a, b in zip(flat(captured), ref))
                    row["check"] += ", graph == eager" if same else ", GRAPH DIFFERS"
                else:
                    check_naive(inp, out)
                    same = all(torch.equal(a, b) for a, b in zip(flat(out), ref))
                    row["check"] = "naive ok, == first" if same else "naive ok, differs from first"
                calls = [lambda i=i, cfg=cfg, tail=tail, shared=shared: inp.call(i % COPIES, cfg, tail, shared)
                         for i in range(CALLS)]
                row["us_call"] = 1000 * time_graph(calls, iters=20)
                row["kernel_us"] = kernel_us(calls, "_router_kernel")
            except Exception as e:  # noqa: BLE001
                row["check"] = f"ERROR {type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(f"M={M} {name:40s} {row.get('us_call', float('nan')):7.2f} us/call  "
                  f"{row.get('kernel_us', float('nan')):7.2f} kernel us  {row['check']}", flush=True)
        # the tail alone: routing + pair blocks from the logits, one program
        lg = torch.randn(M, E + 1, device=dev).to(torch.bfloat16)
        for warps, tname in TAIL_ALONE if args.set == "sweep" else ():
            tail = tails()[tname]
            name = f"tail alone, {warps} warps, {tname}"
            row = {"M": M, "variant": name}
            try:
                calls = [lambda tail=tail, warps=warps: router_fused.route_align_logits(
                    lg, E, TOP_K, True, BLOCK_M_ALIGN, torch.bfloat16, pair_blocks=True, tail=tail, num_warps=warps)
                    for _ in range(CALLS)]
                row["us_call"] = 1000 * time_graph(calls, iters=20)
                row["kernel_us"] = kernel_us(calls, "_route_align_kernel")
                row["check"] = ""
            except Exception as e:  # noqa: BLE001
                row["check"] = f"ERROR {type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(f"M={M} {name:40s} {row.get('us_call', float('nan')):7.2f} us/call  "
                  f"{row.get('kernel_us', float('nan')):7.2f} kernel us  {row['check']}", flush=True)
    if args.pick_table:
        pick(rows, args.pick_table)
    env = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": os.environ.get("LINRNN_COMMIT", "?"),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv}
    import triton

    env["triton"] = triton.__version__
    with open(os.path.join(args.out, "router.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    lines = [f"# Fused router alone, PDL off ({env['gpu']}, commit {env['commit']}, {env['date']}, torch {env['torch']}, "
             f"triton {env['triton']})", "",
             "E = 256, top-8, hidden 2048, gate rows 257 + shared gate_up 1024, pair blocks of 8; "
             f"CUDA-graph replays of {CALLS} calls over {COPIES} weight copies; config = (block_n, block_k, split, "
             "warps, stages, dot); tails: rep = rows replicated to one per warp, reg = pair blocks from registers, "
             "keys = 32-bit logit keys", "",
             "| M | variant | us/call (graph) | kernel us | check |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['M']} | {r['variant']} | {r.get('us_call', float('nan')):.2f} | "
                     f"{r.get('kernel_us', float('nan')):.2f} | {r['check']} |")
    with open(os.path.join(args.out, "router.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
