"""Does the order in which a CTA's warps walk the packed NVFP4 codes cost DRAM bandwidth? (issue #13, round 8)

The MMA kernel's CTA holds 4 row tiles (one per warp); the repacked layout stores each tile's K units one after the
other (nvfp4_layout: [expert, tile, unit, lane, 4 words]), so per K step a CTA reads four 512-byte pieces 16 KB apart
(gate_up: 32 units per tile). This probe reads a code-sized buffer with nothing but loads and an XOR per word, at a
fixed number of CTAs per SM (a persistent grid striding over the 4-tile groups), in three orders:
  tile-major   the kernel's: warp w streams its own tile, 512 B per step (UNITS = 1) or 1 KB (UNITS = 2)
  unit-major   the same bytes laid out [group, unit, warp, lane]: a CTA's 4 warps read 2 KB contiguous per step
and prints GB/s against a torch copy of the same buffer; then the one-tile grid's CTAs (one per 4-tile group and
chunk of K units, no persistent loop): does a short CTA (down_proj's 8 units) cost bandwidth by itself?
Needs a CUDA GPU: python tools/moe_access_probe.py [out.json]"""
import json
import sys

import torch
import triton
import triton.language as tl

SENTINEL = tl.constexpr(0x7FFFFFFF)  # an XOR result the stores wait for: none are written, the loads stay


@triton.jit
def _probe_tiles(src, out, U: tl.constexpr, CHUNK: tl.constexpr):
    """One CTA per (4-tile group, CHUNK units): the one-tile grid's short CTAs (down_proj: K = 512 is 8 units), tile-major
    order, 512 B per warp per step, two steps per pass; the hardware schedules the CTAs (no persistent loop)."""
    t = tl.arange(0, 4 * 32 * 4)
    e = t % 4
    lane = (t // 4) % 32
    w = t // 128
    offs = tl.max_contiguous(tl.multiple_of(w * U * 128 + lane * 4 + e, 4), 4)
    g = tl.program_id(0) // (U // CHUNK)
    c = tl.program_id(0) % (U // CHUNK)
    base = src + g * (4 * U * 128) + c * CHUNK * 128
    acc = tl.zeros([4 * 32 * 4], tl.int32)
    for s in range(0, CHUNK, 2):
        a = tl.load(base + s * 128 + offs, eviction_policy="evict_first")
        b = tl.load(base + (s + 1) * 128 + offs, eviction_policy="evict_first")
        acc ^= a ^ b
    tl.store(out + tl.program_id(0) * 512 + t, acc, mask=acc == SENTINEL)  # (almost) never: no write traffic


@triton.jit
def _probe(src, out, n_groups, U: tl.constexpr, UNITS: tl.constexpr, UNIT_MAJOR: tl.constexpr):
    # 4 warps x 32 lanes x 4 words (16 B per lane per unit): one K step of a 4-tile CTA group
    t = tl.arange(0, 4 * 32 * 4 * UNITS)
    e = t % 4
    lane = (t // 4) % 32
    u = (t // 128) % UNITS
    w = t // (128 * UNITS)
    if UNIT_MAJOR:  # [group, unit, warp, lane, 4]
        offs = (u * 4 + w) * 128 + lane * 4 + e
        step = 4 * 128 * UNITS
    else:  # [group, warp (tile), unit, lane, 4]: the repacked layout
        offs = (w * U + u) * 128 + lane * 4 + e
        step = 128 * UNITS
    offs = tl.max_contiguous(tl.multiple_of(offs, 4), 4)  # 16-byte vectors per lane
    acc = tl.zeros([4 * 32 * 4 * UNITS], tl.int32)
    for g in range(tl.program_id(0), n_groups, tl.num_programs(0)):
        base = src + g * (4 * U * 128)  # < 2^31 words here
        for s in range(0, U // UNITS, 2):  # two steps per pass: the next step's loads in flight, as the kernel's
            a = tl.load(base + s * step + offs, eviction_policy="evict_first")
            b = tl.load(base + (s + 1) * step + offs, eviction_policy="evict_first")
            acc ^= a ^ b
    tl.store(out + tl.program_id(0) * (4 * 32 * 4 * UNITS) + t, acc, mask=acc == SENTINEL)  # keeps the loads


def main() -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    U = 32  # gate_up: K = 2048 = 32 units of 64
    n_groups = 256 * 64 // 4  # 256 experts x 64 row tiles (1024 rows) / 4 warps
    words = n_groups * 4 * U * 128
    src = torch.randint(-2 ** 31, 2 ** 31 - 1, (words,), dtype=torch.int32, device=dev)
    dst = torch.empty_like(src)
    rows = []

    def timed(fn, reps=20):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        return sorted(times)[reps // 2] * 1e-3

    nbytes = words * 4
    copy_s = timed(lambda: dst.copy_(src))
    copy_gbs = 2 * nbytes / copy_s / 1e9
    for per_sm in (6, 9, 12, 16):
        for units in (1, 2):
            for unit_major in (False, True):
                out = torch.empty(sms * per_sm * 512 * units, dtype=torch.int32, device=dev)
                fn = lambda: _probe[(sms * per_sm,)](src, out, n_groups, U=U, UNITS=units, UNIT_MAJOR=unit_major,
                                                    num_warps=4)
                s = timed(fn)
                rows.append({"ctas_per_sm": per_sm, "units": units, "order": "unit-major" if unit_major else "tile-major",
                             "us": round(s * 1e6, 1), "gbs": round(nbytes / s / 1e9),
                             "pct_copy": round(100 * nbytes / s / 1e9 / copy_gbs, 1)})
                print(json.dumps(rows[-1]), flush=True)
    for chunk in (32, 16, 8, 4):  # one CTA per (group, chunk): 32 = gate_up's whole K, 8 = down_proj's
        out = torch.empty(n_groups * (U // chunk) * 512, dtype=torch.int32, device=dev)
        fn = lambda: _probe_tiles[(n_groups * (U // chunk),)](src, out, U=U, CHUNK=chunk, num_warps=4)
        s = timed(fn)
        rows.append({"one_cta_per_tile_group_units": chunk, "us": round(s * 1e6, 1), "gbs": round(nbytes / s / 1e9),
                     "pct_copy": round(100 * nbytes / s / 1e9 / copy_gbs, 1)})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"copy_gbs": round(copy_gbs), "bytes": nbytes, "device": torch.cuda.get_device_name(dev)}))
    json.dump({"copy_gbs": copy_gbs, "rows": rows}, open(sys.argv[1], "w") if len(sys.argv) > 1 else sys.stdout)


if __name__ == "__main__":
    main()
