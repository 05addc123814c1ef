"""sm_90 SASS of the default decode kernels, compiled on the CPU (no GPU): snapshot before a refactor, compare after.

Kernels: the GDN decode kernel as gdn_decode launches it with its default config (all-f32 / 50 % f32 hybrid,
partition-major / all-bf16 heads at B = 1, 8, 64, 256: the [Dk, 16] / [Dk, 32] / [Dk, 64] tiles), and the NVFP4
MMA expert kernel (nvfp4_mma.compile_offline: gated gate_up and route-weighted down, split 1 and split-K with the
prefetch / fused reduction, at the default units / weight hint). Each kernel's SASS is kept as its instruction
text with the kernel-parameter constant-bank offsets renamed by first use (c[0x0][0x210] -> c[0x0][P0]), so a
removed or added unused parameter does not count as a change, while any other difference (an instruction, an
operand, their order, which parameter is read where) does.
    python tools/sass_snapshot.py save /tmp/sass_before      # on the old tree
    python tools/sass_snapshot.py compare /tmp/sass_before   # on the new tree: one line per kernel, exit 1 if any differ
"""
from __future__ import annotations

import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # real compilation (the interpreter patches triton.language)

import torch  # noqa: E402

GDN_BATCHES = (1, 8, 64, 256)
GDN_FRACTIONS = {"all-f32": 1.0, "hybrid-50": 0.5, "all-bf16": 0.0}
MMA_CASES = {  # name: compile_offline kwargs
    "mma gated split1": dict(gated=True, split=1),
    "mma gated split4 prefetch fused": dict(gated=True, split=4, units=1, prefetch=True, fused_reduce=True),
    "mma down split1 routed": dict(gated=False, split=1, route_weighted=True),
    "mma down split4 routed prefetch": dict(gated=False, split=4, units=1, route_weighted=True, prefetch=True),
}


def normalized_sass(cubin: bytes) -> list[str]:
    """Instruction texts of a cubin (addresses and encodings dropped), parameter offsets renamed by first use."""
    from linrnn_kernels.moe.nvfp4_mma import _sass

    names: dict[str, str] = {}

    def rename(m):
        off = int(m.group(1), 16)
        if off < 0x210:  # driver constants (grid size, stack pointer, ...), not kernel parameters
            return m.group(0)
        return "c[0x0][P%d]" % names.setdefault(m.group(1), len(names))

    out = []
    for line in _sass(cubin).splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            out.append(re.sub(r"c\[0x0\]\[(0x[0-9a-f]+)\]", rename, m.group(1)))
    return out


def snapshot() -> dict[str, list[str]]:
    from linrnn_bench.kernels.gdn import captured_launches, compile_sm90, head_mask, make_pools, make_step_inputs
    from linrnn_kernels.gdn import decode
    from linrnn_kernels.moe import nvfp4_mma

    res = {}
    for label, frac in GDN_FRACTIONS.items():
        for B in GDN_BATCHES:
            q, k, v, a, b, A_log, dt_bias = make_step_inputs(B, device="cpu")
            f32, bf, isb, loc = make_pools(head_mask(frac), B + 1, device="cpu")
            idx = torch.arange(1, B + 1, dtype=torch.int32)
            (fn, _, args, kw), = captured_launches(decode, ["_gdn_decode_kernel"], lambda: decode.gdn_decode(
                q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, idx))
            res[f"gdn decode {label} B={B}"] = normalized_sass(compile_sm90(fn, args, kw)[0].asm["cubin"])
            print(f"compiled gdn decode {label} B={B}", file=sys.stderr, flush=True)
    for name, kw in MMA_CASES.items():
        res[name] = normalized_sass(nvfp4_mma.compile_offline(**kw).asm["cubin"])
        print(f"compiled {name}", file=sys.stderr, flush=True)
    return res


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in ("save", "compare"):
        print(__doc__.strip().splitlines()[-2:], file=sys.stderr)
        return 2
    cmd, path = sys.argv[1:]
    res = snapshot()
    if cmd == "save":
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "sass.json"), "w") as f:
            json.dump(res, f)
        print(f"saved {len(res)} kernels' SASS to {path}/sass.json")
        return 0
    with open(os.path.join(path, "sass.json")) as f:
        old = json.load(f)
    bad = 0
    for name in sorted(set(old) | set(res)):
        a, b = old.get(name), res.get(name)
        if a == b:
            print(f"identical  {name}: {len(b)} instructions")
            continue
        bad += 1
        if a is None or b is None:
            print(f"DIFFERS    {name}: only in {'the new' if a is None else 'the saved'} snapshot")
            continue
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"DIFFERS    {name}: {len(a)} -> {len(b)} instructions, first at #{first}: "
              f"{a[first] if first < len(a) else '-'} | {b[first] if first < len(b) else '-'}")
    print(f"{len(set(old) | set(res)) - bad} identical, {bad} different")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
