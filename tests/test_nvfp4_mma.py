"""The MMA-fragment NVFP4 decode path (kernels/moe/nvfp4_layout.py, nvfp4_mma.py).

CPU: pack -> unpack bit-exact (both checkpoint flavours, gated and plain, odd shapes needing
padding), the in-register decode emulated bit for bit over every code x position x every positive
finite E4M3 scale (and zero blocks), bad scales rejected by name, and an sm_90 compile of the Gluon
kernel (no GPU needed) checked for shared-memory traffic, spills and instructions per weight.
GPU (`-m gpu`): equality with the naive oracle on the exactly dequantized weights for many batch
sizes and per-expert loads, NaN-poisoned buffers, bitwise reproducibility and CUDA-graph replays.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch
import triton

from linrnn_kernels.moe import experts, naive, nvfp4_layout as lay, nvfp4_mma
from linrnn_kernels.moe import grouped_gemm as gg
from linrnn_kernels.quant import WeightTensor, nvfp4

CUDA = torch.cuda.is_available()

# Instructions per weight in the K loop (sm_90, triton 3.6 and 3.9; thread instructions / weights a thread
# consumes; 11 decode + 4 FMA ops per 8 codes, 2 scale ops per row and K step, 1 HMMA per 8 weights, the loads
# and their addresses). Issue #13 aims at <= 2.8 at the 8-token tile. The codes are packed so that the natural
# activation order gives ready MMA B register pairs (no register moves), a lane's two words of a row share one
# scale, the code words stay int32 (no 16-bit repacking of the loop-carried prefetch) and the evict-first L2
# policy is made once outside the loop: the default tile (1 unit per step, two steps per iteration with
# prefetch, 48 registers) issues 154 per 64 weights = 2.41 on triton 3.6 (155 = 2.42 on 3.9), either cache
# hint; the fused split-K reduction's tile 2.47, 2 units 2.37, 4 units without prefetch 2.44; the 16-token
# tile 2.78-2.80 at 62 registers (was 79). Budget: 2.5 at 8 tokens, 2.85 at 16. The adaptive 16-token kernel
# (experts.MMA_ADAPTIVE_16: a 16- and an 8-token K loop in one kernel, 62 registers) compiles its 16-token loop to
# 183 per 64 weights = 2.86 on triton 3.9 (address arithmetic the standalone loop folds; 3.00 on triton 3.6, the
# benchmark's column on the H200), its 8-token loop to the standalone 2.42 (2.53 on 3.6): budget 3.0 for that
# 16-token loop, 2.5 for its 8-token loop on 3.9 (the 8-token budget). Triton 3.6 (the GPU image) compiles that
# adaptive kernel's 8-token loop to 2.53-2.55 at 66 registers (62 on 3.9) and, with two row tiles per warp, to 104
# registers (88 on 3.9): those options are off by default for it (round6/, round7/ of
# benchmarks/results/kernels/moe/); their compile tests take 3.6's numbers there (ADAPTIVE_*, MREP_ADAPTIVE_REGS),
# every default tile keeps the budgets above.
def ipw_budget(tokens: int, adaptive: bool = False) -> float:
    return 2.5 if tokens == 8 else (3.0 if adaptive else 2.85)


_TRITON_BEFORE_3_9 = tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 9)
ADAPTIVE_8_BUDGET = 2.56 if _TRITON_BEFORE_3_9 else ipw_budget(8)
ADAPTIVE_REGS = 66 if _TRITON_BEFORE_3_9 else 64
MREP_ADAPTIVE_REGS = 104 if _TRITON_BEFORE_3_9 else 88


def _random_nvfp4(E, n, k, gen, zero_frac=0.05):
    packed = torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, generator=gen)
    bits = torch.randint(1, 0x7F, (E, n, k // 16), dtype=torch.uint8, generator=gen)
    bits[torch.rand(bits.shape, generator=gen) < zero_frac] = 0
    return packed, bits.view(torch.float8_e4m3fn), torch.rand(E, n, generator=gen) + 0.5


@pytest.mark.parametrize("E,n,k,gated", [(3, 1024 // 16, 128, True), (2, 48, 192, False), (1, 24, 32, True),
                                         (2, 33, 160, False), (2, 2 * 13, 96, True), (1, 16, 64, False)])
def test_pack_unpack_bit_exact(E, n, k, gated):
    gen = torch.Generator().manual_seed(n * k)
    packed, bs, rs = _random_nvfp4(E, n, k, gen)
    p = lay.pack(packed, bs, rs, gated)
    assert p.codes.shape == (E, lay.padded_rows(n, gated) // 16, lay.padded_k(k) // 64, 128)
    assert p.codes.dtype == torch.int32 and p.scales.dtype == torch.uint8
    assert lay.has_slack(p.codes) and lay.has_slack(p.scales) and not lay.has_slack(p.codes.clone())
    up, ubs, urs = lay.unpack(p)
    zero = (bs.view(torch.uint8) == 0).repeat_interleave(8, -1)
    assert torch.equal(up, torch.where(zero, 0, packed))  # zero-scale blocks come back with zero codes
    assert torch.equal(ubs.view(torch.uint8), bs.view(torch.uint8))
    assert torch.equal(urs, rs)


@pytest.mark.parametrize("flavour", ["modelopt", "compressed-tensors"])
def test_pack_real_quantizers_2d(flavour):
    """Per-expert 2-D tensors as both quantizers produce them; dequantization is unchanged."""
    W = torch.randn(40, 96) * 0.02
    if flavour == "modelopt":
        packed, bs, g = nvfp4.quantize(W)
        rs = g.expand(40).contiguous()
    else:
        packed, bs, gscale = nvfp4.quantize_compressed_tensors(W)
        rs = (1.0 / gscale).expand(40).float().contiguous()
    p = lay.pack(packed, bs, rs, gated=True)
    up, ubs, urs = lay.unpack(p)
    ref = nvfp4.dequantize(packed, bs, rs)
    assert torch.equal(nvfp4.dequantize(up[0], ubs[0], urs[0]), ref)


def test_pack_rejects_bad_scales():
    packed = torch.zeros(1, 16, 32, dtype=torch.uint8)
    bits = torch.full((1, 16, 4), 0x38, dtype=torch.uint8)
    for bad in (0xB8, 0x7F, 0xFF, 0x80):  # negative, NaN, -NaN, -0
        b = bits.clone()
        b[0, 3, 1] = bad
        with pytest.raises(ValueError, match="layers.7.mlp.experts.w13.*negative or NaN"):
            lay.pack(packed, b.view(torch.float8_e4m3fn), torch.ones(1, 16), True, name="layers.7.mlp.experts.w13")


def test_decode_emulation_exhaustive():
    """Every code at every k of a unit (so at every position of every lane's words) x every positive finite
    E4M3 scale (and 0), packed and then decoded as the kernels do (nvfp4_layout.emulate_kernel_decode: the
    lane's bit operations, its scale byte and IMAD, the k each output pair stands for): code x scale x 2^-7
    exactly, as a normal bf16, signed zeros kept."""
    k = torch.arange(64)
    fields = (torch.arange(16).view(16, 1) + k.view(1, 64)) % 16  # row c: code (c + k) % 16 at k
    fields = torch.cat([fields, fields.flip(-1)], 0)  # 32 rows: two tiles
    packed = (fields[:, 0::2] | (fields[:, 1::2] << 4)).to(torch.uint8)[None]
    for gated in (False, True):
        for sbits in range(0, 0x7F):
            bs = torch.full((1, 32, 4), sbits, dtype=torch.uint8)
            bs[0, :, 1] = (sbits + 37) % 0x7F  # blocks of one row with different scales
            bs = bs.view(torch.float8_e4m3fn)
            got = lay.emulate_kernel_decode(lay.pack(packed, bs, torch.ones(1, 32), gated=gated))[0]
            ref = nvfp4.e2m1_lut()[fields.long()] * bs[0].float().repeat_interleave(16, -1)
            assert torch.equal(got, ref / lay.DECODE_GAIN), (gated, sbits)
            assert torch.equal(got.bfloat16().float(), got)  # exact in bf16
            nz = got != 0
            assert (got[nz].abs() >= 2.0 ** -126).all()  # normal: no subnormal product
            # signed zeros survive: -0 codes give -0 (fma with a -0 addend keeps them)
            neg0 = (fields == 8) & (bs[0].float().repeat_interleave(16, -1) != 0)
            assert torch.equal(torch.signbit(got[neg0]), torch.ones(int(neg0.sum()), dtype=torch.bool))


def test_emulated_decode_equals_dequant_random():
    """Random odd-shaped experts (padding of rows and K, zero-scale blocks): the emulated kernel decode is the
    reference dequantization without the row scale (nvfp4.dequantize with row scale 1) exactly."""
    gen = torch.Generator().manual_seed(3)
    for E, n, k, gated in ((2, 40, 160, True), (1, 33, 96, False), (3, 2 * 24, 64, True)):
        packed, bs, rs = _random_nvfp4(E, n, k, gen)
        dec = lay.emulate_kernel_decode(lay.pack(packed, bs, rs, gated))
        assert torch.equal(dec * lay.DECODE_GAIN, nvfp4.dequantize(packed, bs, torch.ones_like(rs)))


def test_decode_asm_matches_emulation_text():
    """The PTX the kernel runs is the emulated sequence: 11 integer ops per word, 4 bf16x2 FMAs,
    one PRMT + one IMAD per scale (two per lane: both words of a row share its block scale)."""
    asm = nvfp4_mma.DECODE_ASM
    assert asm.count("fma.rn.bf16x2") == 16 and asm.count("prmt.b32") == 2 and asm.count("mad.lo.u32") == 2
    # 13 PTX ops per word; ptxas fuses the and/or pairs into LOP3: 11 SASS (the compile test counts)
    assert sum(asm.count(op) for op in ("and.b32", "or.b32", "shl.b32", "shr.b32")) == 52
    assert "0x81C081C0" in asm and f"{lay.SCALE_BIAS:#x}" in asm


@pytest.mark.skipif(not nvfp4_mma.HAVE_GLUON, reason="triton without Gluon")
@pytest.mark.parametrize("gated,split,units,prefetch,fused,hint,tokens", [
    (True, 1, 1, True, False, "evict_first", 8), (True, 1, 1, True, False, "none", 8),
    (False, 2, 1, True, False, "evict_first", 8), (True, 4, 1, True, True, "evict_first", 8),
    (True, 1, 2, True, False, "none", 8), (True, 1, 4, False, False, "none", 8), (False, 1, 1, True, False, "evict_first", 16)])
def test_sm90_compile_k_loop(gated, split, units, prefetch, fused, hint, tokens):
    """Compiled for sm_90 on the CPU: the decoded weights never touch shared memory (the
    regrouping into the MMA operand layout is asserted trivial at compile time), no spills, and
    the K loop stays within the instruction budget at the 8-token tile. The fused split-K reduction
    adds one integer ticket atomic per CTA (its result broadcast through 4 bytes of shared memory)
    and no float atomics."""
    st = nvfp4_mma.k_loop_stats(gated=gated, split=split, units=units, prefetch=prefetch, fused_reduce=fused,
                                weight_hint=hint, tokens=tokens)
    assert st["smem_ops_in_loop"] == 0, st["ops"]
    assert st["shared"] == (4 if fused else 0)
    assert st["atomics"] == (1 if fused else 0)
    assert st["spill_ops"] == 0
    assert st["regs"] <= 64  # 8 CTAs of 4 warps per SM, the 16-token tile too
    k_per_iter = 64 * units * (2 if prefetch else 1)
    assert st["ops"].get("HMMA", 0) == k_per_iter // 16 * tokens // 8  # one m16n8k16 per 16 k, 16 rows and 8 tokens
    # 16-byte code, 4-byte scale and 16-byte activation loads (two per 8 tokens)
    assert st["ops"].get("LDG", 0) <= k_per_iter // 64 * (2 + 2 * tokens // 8), st["ops"]
    assert st["ops"].get("UMOV", 0) == 0, st["ops"]  # no cache policy made in the loop
    assert st["per_weight"] <= ipw_budget(tokens), st


@pytest.mark.skipif(not nvfp4_mma.HAVE_GLUON, reason="triton without Gluon")
@pytest.mark.parametrize("gated,split,units8", [(True, 1, 1), (False, 1, 1), (True, 4, 1), (False, 1, 2)])
def test_sm90_compile_adaptive(gated, split, units8):
    """The adaptive 16-token kernel (16-token blocks with <= 8 tokens on an 8-token K loop of units8 units per step,
    in the same kernel): both K loops present (told apart by the 16-token loop's HMMA pairs sharing one decoded A
    fragment), neither touches shared memory, no spills, the MMA counts of their tiles, each within its
    instruction budget; 8 CTAs of 4 warps per SM at units8 = 1."""
    st = nvfp4_mma.k_loop_stats(gated=gated, split=split, units=1, prefetch=True, fused_reduce=gated and split > 1,
                                tokens=16, adaptive=True, units8=units8)
    assert st["smem_ops_in_loop"] == 0 and st["smem_ops_in_loop_8"] == 0, st
    assert st["spill_ops"] == 0, st
    assert st["ops"]["HMMA"] == 16, st  # two K steps x 4 k16 x two n8 MMAs
    assert st["per_weight"] <= ipw_budget(16, adaptive=True), st
    assert st["per_weight_8"] <= ADAPTIVE_8_BUDGET, st
    assert st["regs"] <= (ADAPTIVE_REGS if units8 == 1 else 72), st


@pytest.mark.skipif(not nvfp4_mma.HAVE_GLUON, reason="triton without Gluon")
@pytest.mark.parametrize("units,maxnreg,mrep", sorted({tile[1:] for tile in experts.MMA_TILES if tile[2]}))
@pytest.mark.parametrize("gated,split", [(True, 4), (False, 2), (True, 1)])
def test_sm90_compile_register_budget(units, maxnreg, mrep, gated, split):
    """The tiles experts.MMA_TILES compiles with a register budget (small batches: B = 1 runs gate_up at split 4,
    down at 2): ptxas takes the registers to issue the loop's loads early, at least the 8 of a 1-unit iteration
    (both K steps' activations, the next steps' codes and scales) before the first MMA (44 registers and 1 load
    before it without a budget at split 4, the round-3 B = 1 regression), within the budget, no spills, the
    instruction budget kept."""
    st = nvfp4_mma.k_loop_stats(gated=gated, split=split, units=units, fused_reduce=gated and split > 1,
                                maxnreg=maxnreg, mrep=mrep)
    assert st["regs"] <= maxnreg and st["spill_ops"] == 0 and st["smem_ops_in_loop"] == 0, st
    assert st["loads_before_mma"] >= 8, st
    assert st["per_weight"] <= ipw_budget(8), st


@pytest.mark.skipif(not nvfp4_mma.HAVE_GLUON, reason="triton without Gluon")
@pytest.mark.parametrize("gated,split,units,tokens,hint", [(True, 1, 1, 8, "evict_first"), (False, 2, 1, 8, "none"),
                                                         (True, 4, 2, 8, "evict_first"), (False, 1, 1, 16, "evict_first")])
def test_sm90_ptx_operand_wiring(gated, split, units, tokens, hint):
    """The MMA operands in the compiled PTX (sm_90) come straight from the decode and the activation loads in the
    packed layout's order (nvfp4_layout; emulated above): A = pair j of the lane's four code words of one load in
    order, each with its row's scale, B = a ready register pair of one activation load (no register moves).
    The convert_layout trivial-assert cannot see a relabelled register, this can."""
    res = nvfp4_mma.ptx_operand_wiring(gated=gated, split=split, units=units, tokens=tokens, weight_hint=hint)
    assert res["mmas"] == 8 * units * tokens // 8 and res["errors"] == [], res


@pytest.mark.skipif(not nvfp4_mma.HAVE_GLUON, reason="triton without Gluon")
@pytest.mark.parametrize("gated,split,tokens,adaptive", [(True, 1, 8, False), (False, 2, 8, False), (True, 4, 8, False),
                                                        (False, 1, 16, True)])
def test_sm90_compile_two_row_tiles_per_warp(gated, split, tokens, adaptive):
    """mrep = 2 (two 16-row tiles per warp, the MMA layout repeated along M in registers; one activation load feeds
    both tiles' MMAs): the regrouping stays trivial (it compiles), no shared memory in the K loop(s), no spills, the
    operand wiring of every MMA checked against the layout, twice the MMAs per K step, within the budget (8 tokens:
    2.35 per weight on triton 3.9 at 72 registers; 16 tokens 2.57 at 88)."""
    st = nvfp4_mma.k_loop_stats(gated=gated, split=split, units=1, prefetch=True, fused_reduce=gated and split > 1,
                                tokens=tokens, adaptive=adaptive, mrep=2)
    assert st["smem_ops_in_loop"] == 0 and st.get("smem_ops_in_loop_8", 0) == 0 and st["spill_ops"] == 0, st
    assert st["ops"]["HMMA"] == 2 * 2 * 4 * tokens // 8, st  # two K steps x 4 k16 x two row tiles x tokens / 8
    assert st["per_weight"] <= ipw_budget(tokens, adaptive), st
    assert st.get("per_weight_8", 0) <= ipw_budget(8), st
    assert st["regs"] <= (72 if tokens == 8 else MREP_ADAPTIVE_REGS if adaptive else 88), st
    res = nvfp4_mma.ptx_operand_wiring(gated=gated, split=split, units=1, tokens=tokens, mrep=2, adaptive=adaptive)
    assert res["errors"] == [] and res["mmas"] == 8 * 2 * (tokens // 8 + (1 if adaptive else 0)), res


@pytest.mark.skipif(not nvfp4_mma.HAVE_GLUON, reason="triton without Gluon")
@pytest.mark.parametrize("splits", [(1, 1), (4, 2)])
def test_sm90_compile_persistent(splits):
    """The persistent two-GEMM kernel: no spills in either K loop at its register cap (8 CTAs of 4 warps per
    SM; triton 3.6 spills nowhere, 3.9 a few registers around the split-K epilogue), shared memory only for
    broadcasting atomics' results, integer atomics only (work counter, waits, tickets)."""
    st = nvfp4_mma.persistent_compile_stats(splits)
    assert st["regs"] <= nvfp4_mma.PERSISTENT_MAXNREG and 8 * 128 * st["regs"] <= 65536
    assert st["k_loops"] >= 2  # gate_up's and down's
    assert st["k_loop_spills"] == 0
    assert st["shared"] <= 16
    atoms = st["atomics"]
    assert atoms and all(".ADD" in a and ".F" not in a.replace(".E.", ".") for a in atoms), atoms


@pytest.mark.skipif(not nvfp4_mma.HAVE_GLUON, reason="triton without Gluon")
@pytest.mark.parametrize("gated,split,maxnreg,wait", [(False, 2, 80, True), (False, 1, None, True), (True, 4, 80, False),
                                                      (True, 1, None, False)])
def test_sm90_compile_pdl_order(gated, split, maxnreg, wait):
    """Programmatic dependent launch in the compiled kernel (sm_90): launch_dependents before any load; the down
    kernel (wait) issues its first K step's code and scale loads before the grid dependency wait and no activation
    load before it, and every exit follows a wait (an empty expert block's CTA too); the K loop is the one without
    PDL (instructions, registers within the budget, no spills, no shared memory)."""
    st = nvfp4_mma.pdl_order_stats(gated=gated, split=split, maxnreg=maxnreg, pdl_wait=wait, pdl_trigger=True)
    plain = nvfp4_mma.pdl_order_stats(gated=gated, split=split, maxnreg=maxnreg, pdl_wait=False, pdl_trigger=False)
    assert st["trigger_first"] and not plain["trigger_first"], (st, plain)
    if wait:
        assert st["weight_loads_before_wait"] == 2 and st["activation_loads_before_wait"] == 0, st
        assert st["exits_without_wait"] == 0 and plain["waits"] == 0, (st, plain)
    else:
        assert st["waits"] == 0, st
    assert st["loop_instructions"] == plain["loop_instructions"] and st["per_weight"] <= ipw_budget(8), (st, plain)
    assert st["spill_ops"] == 0 and st["smem_ops_in_loop"] == 0 and st["regs"] <= (maxnreg or 64), st


@pytest.mark.skipif(not nvfp4_mma.HAVE_GLUON, reason="triton without Gluon")
@pytest.mark.parametrize("B", [1, 16])
def test_bench_mma_ipw_and_candidates(B):
    """The `moe` benchmark's instructions-per-weight column (the default tile at B tokens, compiled for sm_90 on the
    CPU) and its candidate table: every MMA_CANDIDATES entry is a set of moe_experts_mma keywords (a typo would only
    fail on the GPU, after the machine was paid for)."""
    import inspect

    from linrnn_bench.kernels import moe as bench

    E, k, H, I = 16, 8, 512, 256  # small experts (the tile and split-K follow the pairs per expert: B = 16 -> 8)
    w13, w2 = _weights(E, H, I, "cpu")
    cell = bench.mma_ipw(B * k, w13, w2, num_sms=132)
    parts = cell.split(" / ")
    assert len(parts) == 2 and all(0 < float(p.split()[0]) <= ipw_budget(16, True) for p in parts), cell
    params = set(inspect.signature(experts.moe_experts_mma).parameters)
    for key, opts in bench.MMA_CANDIDATES.items():
        assert "," not in key and set(opts) - {"env"} <= params, (key, opts)  # env: set around the capture


def test_bench_profile_per_launch():
    """The `moe` benchmark's profile tells the MMA kernel's two launches of a call apart (gate_up, then down) by
    launch order; other kernels and a profiler without events leave it empty."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from linrnn_bench.kernels import moe as bench

    def ev(name, start, us, dev=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=dev, time_range=SimpleNamespace(start=start, elapsed_us=lambda: us))
    evs = []
    for c in range(3):  # 3 calls: route, gate_up (10 us), down (4 us), a host event
        t = 100 * c
        evs += [ev("_route_kernel", t, 2), ev("_nvfp4_mma_kernel", t + 10, 10), ev("_nvfp4_mma_kernel", t + 30, 4),
                ev("cudaLaunchKernel", t, 1, DeviceType.CPU)]
    got = bench._by_launch(SimpleNamespace(events=lambda: evs[::-1]), 3)
    assert got == {"_nvfp4_mma_kernel [1]": 10.0, "_nvfp4_mma_kernel [2]": 4.0}, got
    assert bench._by_launch(SimpleNamespace(events=lambda: evs[:4]), 3) == {}  # 1 launch in 3 calls: not per launch
    assert bench._by_launch(SimpleNamespace(), 3) == {}


@pytest.mark.skipif(not nvfp4_mma.HAVE_GLUON, reason="triton without Gluon")
@pytest.mark.parametrize("split,maxnreg", [(4, 80), (1, None)])
def test_sm90_compile_gate_up_waits_first(split, maxnreg):
    """gate_up launched with PDL behind the router (pdl_wait_first): the grid dependency wait comes before every
    load and before launch_dependents (so the down kernel's pre-wait loads of the alignment see the router's
    stores); one wait; the K loop is the plain kernel's (instructions, no spills, no shared memory)."""
    st = nvfp4_mma.pdl_order_stats(gated=True, split=split, maxnreg=maxnreg, pdl_wait=False, pdl_trigger=True,
                                   pdl_wait_first=True)
    plain = nvfp4_mma.pdl_order_stats(gated=True, split=split, maxnreg=maxnreg, pdl_wait=False, pdl_trigger=False)
    assert st["wait_before_trigger"] and st["loads_before_wait"] == 0 and st["waits"] == 1, st
    assert st["loop_instructions"] == plain["loop_instructions"] and st["spill_ops"] == 0, (st, plain)
    assert st["smem_ops_in_loop"] == 0 and st["regs"] <= (maxnreg or 64), st


def test_split_k_fills_sms():
    assert nvfp4_mma.split_k(32, 8 * 16, 132) == 4  # B = 1 gate_up: 8 experts x 16 CTAs
    assert nvfp4_mma.split_k(8, 8 * 32, 132) == 2   # B = 1 down
    assert nvfp4_mma.split_k(32, 256 * 16, 132) == 1
    assert nvfp4_mma.units_per_step(8, 2) == 4 and nvfp4_mma.units_per_step(8, 4) == 2
    assert nvfp4_mma.DEFAULT_UNITS == 1 and nvfp4_mma.DEFAULT_PREFETCH
    assert experts.mma_tokens(8 * 256 - 1, 256) == 8 and experts.mma_tokens(8 * 256, 256) == 16  # B = 256 at top-8
    lows = [tile[0] for tile in experts.MMA_TILES]
    assert lows[0] == 0 and lows == sorted(lows)
    assert experts.mma_tile(8, 256) == experts.MMA_TILES[0][1:]  # B = 1 at top-8
    assert experts.mma_tile(8 * 256, 256) == experts.MMA_TILES[-1][1:]  # B = 256


def test_mma_down_tile_by_batch(monkeypatch):
    """The down GEMM's own tile (experts.MMA_DOWN_TILES) from 1 pair per expert (B = 32 at top-8 over 256 experts)
    while the blocks hold 8 tokens; the 16-token tile (B >= 256) and B < 32 keep the common tile; the A/B switch."""
    E = 256
    assert experts.mma_down_tile(16 * 8, E) == {}  # B = 16
    tile = {"units": 1, "maxnreg": 40, "smem_x": True}
    assert experts.mma_down_tile(32 * 8, E) == experts.mma_down_tile(255 * 8, E) == tile
    assert experts.mma_down_tile(256 * 8, E) == {}  # 16-token blocks
    monkeypatch.setenv("LINRNN_MMA_SMEM_X", "0")
    assert experts.mma_down_tile(64 * 8, E) == {"units": 1, "maxnreg": 40}
    monkeypatch.setenv("LINRNN_MMA_DOWN_TILES", "0")
    assert experts.mma_down_tile(64 * 8, E) == {}


@pytest.mark.skipif(not nvfp4_mma.HAVE_GLUON, reason="triton without Gluon")
@pytest.mark.parametrize("lo,units,maxnreg", experts.MMA_DOWN_TILES)
def test_sm90_compile_down_tile(lo, units, maxnreg):
    """The down GEMM's tiles (8 tokens, split 1, route-weighted): within the budget, no spills, the 8-token
    instruction budget kept (2.44 per weight at 40 registers on triton 3.9; see staged_x_stats with the staged
    activations, whose K steps are unrolled). Without
    the staged activations (MMA_DOWN_SMEM_X) no shared memory at all; with them the K loop only reads it (two LDS.128 per
    K step and unit: a lane's 16 k of its token), stores nothing there and has no barrier: the decoded weights never
    pass through shared memory."""
    st = nvfp4_mma.k_loop_stats(gated=False, split=1, units=units, maxnreg=maxnreg)
    assert st["regs"] <= maxnreg and st["spill_ops"] == 0 and st["smem_ops_in_loop"] == 0, st
    assert st["per_weight"] <= ipw_budget(8), st
    st = nvfp4_mma.staged_x_stats(units=units, xsu=8, maxnreg=maxnreg)  # K = 512: 8 units, unrolled
    assert st["regs"] <= maxnreg and st["spill_ops"] == 0 and st["shared"] == 8 * 1024, st
    assert st["sts_before"] > 0 and st["bar_before"] > 0 and st["smem_stores_in_k"] == 0, st
    assert st["hmma"] == 8 * 4 and st["lds_in_k"] == 2 * 8, st  # 4 MMAs and 2 LDS.128 per unit
    assert st["per_weight"] <= ipw_budget(8), st


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the alignment kernel runs on CPU tensors "
                    "(interpreter); on a CUDA machine the GPU tests cover the chain")
@pytest.mark.parametrize("fused_reduce,combine,gate_up_pdl", [
    (True, True, False), (False, True, False), (True, False, False), (True, True, True), (False, True, True),
    (True, False, True)])
def test_mma_pdl_chain_launch_flags(monkeypatch, fused_reduce, combine, gate_up_pdl):
    """The launch order PDL relies on (recorded on the CPU with the launches stubbed): gate_up is launched plainly
    (it reads the router's output) or, with gate_up_pdl, with PDL waiting before anything else, and lets the next
    kernel start early; the down kernel waits (its pre-wait loads read what was written before gate_up began) and
    triggers the combine, which waits; nothing is launched between gate_up (or its separate reduction) and the down
    kernel. pdl=False: no PDL anywhere."""
    E, H, I = 4, 128, 64
    w13, w2 = _weights(E, H, I, "cpu", seed=9)
    x = torch.randn(3, H).bfloat16()
    ids = torch.tensor([[0, 1], [1, 2], [3, 0]])
    topw = torch.rand(3, 2).bfloat16()
    for pdl in (True, False):
        log = []
        monkeypatch.setattr(nvfp4_mma, "num_sms", lambda device: 132)
        monkeypatch.setattr(nvfp4_mma, "launch", lambda x, w, out, **kw: log.append(
            ("gate_up" if w.gated else "down", kw.get("pdl_wait", False) or kw.get("pdl_wait_first", False) and "first",
             kw.get("pdl_trigger", False))))
        monkeypatch.setattr(gg, "silu_mul_reduce", lambda ws, h: log.append(("silu_mul_reduce", False, False)))
        monkeypatch.setattr(gg, "sum_reduce", lambda part, out, group, pdl=False: log.append(("sum_reduce", pdl, False)))
        experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, splits=(2, 1), fused_reduce=fused_reduce,
                                combine=combine, pdl=pdl, pdl_gate_up=gate_up_pdl)
        want = [("gate_up", pdl and gate_up_pdl and "first", pdl)]
        want += [] if fused_reduce else [("silu_mul_reduce", False, False)]
        want += [("down", pdl, pdl)] + ([("sum_reduce", pdl, False)] if combine else [])
        assert log == want, (pdl, log)


def test_mma_pdl_default_off_without_cuda(monkeypatch):
    """PDL for the chain needs sm_90+ and can be switched off alone (LINRNN_MMA_PDL=0) or with every PDL launch."""
    assert not nvfp4_mma.pdl_default("cpu")
    monkeypatch.setattr(nvfp4_mma, "pdl_available", lambda device: True)
    assert nvfp4_mma.pdl_default("cpu") == nvfp4_mma.DEFAULT_PDL
    for var in ("LINRNN_MMA_PDL", "LINRNN_PDL"):
        monkeypatch.setenv(var, "0")
        assert not nvfp4_mma.pdl_default("cpu")
        monkeypatch.delenv(var)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only selection")
def test_mma_path_not_selected_on_cpu():
    assert not nvfp4_mma.available()


# ------------------------------------------------------------------------------------------ GPU

@pytest.fixture
def nan_buffers(monkeypatch):
    def alloc(*shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max
        return torch.full(shape, fill, dtype=dtype, device=device)
    monkeypatch.setattr(gg, "alloc", alloc)


@functools.lru_cache(maxsize=4)
def _weights(E, H, I, device, seed=0):
    """Qwen-style NVFP4 experts (gate and up with their own global scale), quantized and repacked
    on the device."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for n, k, parts, gated in ((2 * I, H, 2, True), (H, I, 1, False)):
        W = torch.randn(E, n, k, generator=g, device=device) * 0.02
        pk, sb, rs = [], [], []
        for Wp in W.chunk(parts, dim=-2):
            p_, s_, g_ = nvfp4.quantize(Wp)
            pk.append(p_), sb.append(s_), rs.append(g_[..., None].expand(*Wp.shape[:-1]))
        data, bs, row = torch.cat(pk, -2).contiguous(), torch.cat(sb, -2).contiguous(), torch.cat(rs, -1).float()
        row = row.contiguous()
        out.append(WeightTensor("nvfp4", data, bs, row, lay.pack(data, bs, row, gated)))
    return out


def _check(x, topw, ids, w13, w2):
    y = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed)
    ref = naive.moe_experts(x, topw, ids, w13, w2)
    assert not y.isnan().any()
    err = float((y.double() - ref.double()).norm() / ref.double().norm())
    # the same exactly dequantized weights; only the summation order and the bf16 rounding of
    # the SiLU * up intermediate differ
    assert err <= 1e-2, err
    return y


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 2, 3, 8, 31, 64, 128, 255, 256, 2048])  # 2048: prefill (64 pairs / expert)
def test_mma_matches_naive_qwen_shapes(nan_buffers, B):
    E, k, H, I = 256, 8, 2048, 512
    w13, w2 = _weights(E, H, I, "cuda")
    x = torch.randn(B, H, device="cuda").bfloat16()
    logits = x.float() @ (torch.randn(E, H, device="cuda") * 0.02).t()
    topw, ids = naive.route(logits, k, True)
    _check(x, topw.bfloat16(), ids, w13, w2)


@pytest.mark.gpu
def test_mma_per_expert_loads(nan_buffers):
    """Experts with 0 / 1 / 7 / 8 / 9 / 15 / 16 / 17 tokens (block edges of the 8-token tile; with 16-token blocks
    the adaptive tile runs the <= 8-token blocks (1, 7, 8, the tail of 17) on the 8-token path, the rest on the 16)."""
    E, H, I = 16, 512, 256
    w13, w2 = _weights(E, H, I, "cuda", seed=1)
    loads = [0, 1, 7, 8, 9, 15, 16, 17] * 2
    ids = torch.cat([torch.full((n,), e) for e, n in enumerate(loads)])
    ids = ids[torch.randperm(ids.numel())].view(-1, 1).cuda()
    x = torch.randn(ids.shape[0], H, device="cuda").bfloat16()
    topw = torch.rand(ids.shape[0], 1, device="cuda").bfloat16()
    _check(x, topw, ids, w13, w2)
    ref = naive.moe_experts(x, topw, ids, w13, w2)
    for tokens, groups, prefetch, adaptive, mrep in ((8, (1, 1), False, False, 1), (16, (1, 1), False, True, 1),
                                                     (16, (1, 1), True, False, 1), (8, (2, 4), False, False, 1),
                                                     (8, (1, 1), True, False, 1), (8, (1, 2), True, False, 2),
                                                     (16, (1, 1), True, True, 2)):
        for splits in ((1, 1), (2, 2), (4, 2)):  # every split-K path
            outs = []
            for fused in (True, False):  # gate_up's partials reduced by its last split / by a separate launch
                y = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, splits=splits, tokens=tokens,
                                            groups=groups, prefetch=prefetch, fused_reduce=fused, adaptive=adaptive,
                                            mrep=mrep)
                assert not y.isnan().any()
                err = float((y.double() - ref.double()).norm() / ref.double().norm())
                assert err <= 1e-2, (tokens, groups, splits, fused, err)
                outs.append(y)
            assert torch.equal(outs[0], outs[1])  # the same sums in the same order
            if tokens == 16 or mrep > 1:  # 16-token (adaptive or not) and 2-tile warps: the bits of the 8-token tile
                y8 = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, splits=splits, tokens=8,
                                             prefetch=prefetch, mrep=1)
                assert torch.equal(outs[0], y8), (splits, adaptive, mrep)
    for splits in ((1, 1), (2, 2), (4, 2)):  # the persistent two-GEMM launch: the same sums in the same order
        y = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, splits=splits)
        yp = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, splits=splits, persistent=True)
        assert torch.equal(yp, y), splits
    assert not nvfp4_mma.tickets("cuda").any()  # every ticket back to 0
    assert not nvfp4_mma._sync("cuda").any()  # and the persistent kernel's counters


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 64, 256])
def test_mma_tiles_bitwise_equal(nan_buffers, B):
    """Every tile shape runs the same MMAs in the same k order per token column: 8- and 16-token blocks (adaptive or
    not), 1 / 2 / 4 units per K step, 1 / 2 row tiles per warp, with and without the prefetch, with and without a
    register budget (experts.MMA_TILES), 4 or 8 warps, the down GEMM's own tile (MMA_DOWN_TILES) give the same bits (and the oracle within tolerance)."""
    E, k, H, I = 256, 8, 2048, 512
    w13, w2 = _weights(E, H, I, "cuda", seed=6)
    x = torch.randn(B, H, device="cuda").bfloat16()
    topw, ids = naive.route(x.float() @ (torch.randn(E, H, device="cuda") * 0.02).t(), k, True)
    topw = topw.bfloat16()
    y0 = _check(x, topw, ids, w13, w2)
    for tokens, adaptive in ((8, False), (16, True), (16, False)):  # adaptive: <= 8-token blocks on the 8 tile
        for units in (1, 2, 4):
            for prefetch, maxnreg in ((True, 0), (False, 0), (True, 80)):
                if maxnreg and units == 4:
                    continue
                y = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, tokens=tokens, units=units,
                                            prefetch=prefetch, maxnreg=maxnreg, adaptive=adaptive, mrep=1)
                assert torch.equal(y, y0), (tokens, adaptive, units, prefetch, maxnreg)
    # fewer, longer CTAs pick a deeper split-K at small batches (another summation order): the default's splits here
    splits = experts.mma_splits(B * k, w13.packed, w2.packed, nvfp4_mma.num_sms("cuda"))
    for tokens, units, mrep, warps in ((8, 1, 2, 4), (8, 2, 2, 4), (16, 1, 2, 4), (8, 1, 1, 8), (16, 1, 1, 8)):
        y = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, tokens=tokens, units=units, maxnreg=0,
                                    mrep=mrep, warps=warps, splits=splits)
        assert torch.equal(y, y0), (tokens, units, mrep, warps)
    for down in ({}, {"units": 1, "maxnreg": 40}, {"units": 4, "maxnreg": 0}, {"mrep": 2}):  # the down GEMM's own tile
        y = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, tokens=8, down_tile=down, splits=splits)
        assert torch.equal(y, y0), down


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 31, 64, 128, 256])
def test_mma_smem_activations_bitwise_equal(nan_buffers, B):
    """The down GEMM's activations staged in shared memory (XSU; 8- and 16-token blocks, split-K or not, register
    budgets) change no result bit."""
    E, k, H, I = 256, 8, 2048, 512
    w13, w2 = _weights(E, H, I, "cuda", seed=14)
    x = torch.randn(B, H, device="cuda").bfloat16()
    topw, ids = naive.route(x.float() @ (torch.randn(E, H, device="cuda") * 0.02).t(), k, True)
    topw = topw.bfloat16()
    _check(x, topw, ids, w13, w2)
    for tokens in (8, 16):
        base = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, tokens=tokens)
        for down in ({"units": 1, "maxnreg": 0, "smem_x": True}, {"units": 1, "maxnreg": 40, "smem_x": True},
                     {"units": 2, "maxnreg": 0, "smem_x": True}):
            if tokens == 16 and down["maxnreg"]:
                continue
            y = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, tokens=tokens, down_tile=down)
            assert torch.equal(y, base), (tokens, down)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 64, 256])
@pytest.mark.parametrize("persistent", [False, True])
def test_mma_bitwise_reproducible_and_graphs(B, persistent):
    E, k, H, I = 256, 8, 2048, 512
    w13, w2 = _weights(E, H, I, "cuda", seed=2)
    x = torch.randn(B, H, device="cuda").bfloat16()
    topw, ids = naive.route(torch.randn(B, E, device="cuda"), k, True)
    topw = topw.bfloat16()

    def run():
        return experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, persistent=persistent)

    y0 = run()
    assert torch.equal(y0, experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed))  # either launch, same bits
    for _ in range(3):
        assert torch.equal(run(), y0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = run()
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, y0)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 2, 3, 5, 8])
def test_mma_pair_blocks_bit_identical(nan_buffers, B):
    """Pair blocks (align.moe_pair_blocks: block b = pair b, token n in column n; what the fused router hands
    the experts at <= 8 tokens): every token's output and uncombined partials equal those of the expert-sorted
    alignment bit for bit (the same MMA column math), and the naive oracle within tolerance; NaN-poisoned
    buffers, every split-K path, the dispatcher, a CUDA-graph replay."""
    from linrnn_kernels.moe import align

    E, k, H, I = 256, 8, 2048, 512
    w13, w2 = _weights(E, H, I, "cuda", seed=4)
    x = torch.randn(B, H, device="cuda").bfloat16()
    # hot experts (a biased router) so tokens share experts: blocks with several tokens, repeated experts skipped
    logits = x.float() @ (torch.randn(E, H, device="cuda") * 0.02).t() + torch.linspace(0, 3, E, device="cuda")
    topw, ids = naive.route(logits, k, True)
    topw, ids = topw.bfloat16(), ids.int()
    assert B == 1 or ids.unique().numel() < B * k
    pb = experts.Alignment(*align.moe_pair_blocks(ids, 8), 8, pair_blocks=True)
    ref = naive.moe_experts(x, topw, ids.long(), w13, w2)
    for splits in (None, (1, 1), (2, 2), (4, 2)):
        y_al = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, splits=splits)
        y = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, splits=splits, alignment=pb)
        assert torch.equal(y, y_al), splits
        assert float((y.double() - ref.double()).norm() / ref.double().norm()) <= 1e-2
        p_al = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, splits=splits, combine=False)
        p = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, splits=splits, combine=False, alignment=pb)
        assert torch.equal(p.part, p_al.part), splits
    assert not nvfp4_mma.tickets("cuda").any()
    y0 = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, alignment=pb)
    assert torch.equal(experts.moe_experts(x, topw, ids, w13, w2, alignment=pb), y0)  # the dispatcher takes them
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, alignment=pb)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, alignment=pb)
    for _ in range(2):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(yg, y0)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [3, 12])
def test_mma_adaptive_pair_blocks_16(nan_buffers, B):
    """The adaptive 16-token tile on 16-slot pair blocks (a token's pair may sit in any slot 0..15, not at the
    front): the bits of the expert-sorted 8-token alignment, eager and split-K, NaN-poisoned buffers."""
    from linrnn_kernels.moe import align

    E, k, H, I = 256, 8, 2048, 512
    w13, w2 = _weights(E, H, I, "cuda", seed=8)
    x = torch.randn(B, H, device="cuda").bfloat16()
    logits = x.float() @ (torch.randn(E, H, device="cuda") * 0.02).t() + torch.linspace(0, 3, E, device="cuda")
    topw, ids = naive.route(logits, k, True)
    topw, ids = topw.bfloat16(), ids.int()
    pb = experts.Alignment(*align.moe_pair_blocks(ids, 16), 16, pair_blocks=True)
    for splits in ((1, 1), (4, 2)):
        y8 = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, splits=splits, tokens=8)
        for adaptive in (True, False):
            y = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, splits=splits, tokens=16, alignment=pb,
                                        adaptive=adaptive)
            assert torch.equal(y, y8), (splits, adaptive)
    assert not nvfp4_mma.tickets("cuda").any()


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 64, 256])
def test_mma_pdl_bitwise_equal(nan_buffers, B):
    """The launches chained with programmatic dependent launch (gate_up -> down -> combine) give the bits of the
    plain launches, eager and in CUDA-graph replays, the output and the uncombined partials, with the gate_up
    split-K reduced in the kernel or by its own launch; the oracle within tolerance; tickets back to 0."""
    from linrnn_kernels.gemv.config import pdl_available

    if not pdl_available(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs an sm_90+ GPU and a Triton with gdc_wait (3.6+); "
                    "the chain then runs without it, which the other GPU tests cover")
    E, k, H, I = 256, 8, 2048, 512
    w13, w2 = _weights(E, H, I, "cuda", seed=7)
    x = torch.randn(B, H, device="cuda").bfloat16()
    topw, ids = naive.route(x.float() @ (torch.randn(E, H, device="cuda") * 0.02).t(), k, True)
    topw = topw.bfloat16()
    y0 = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, pdl=False)
    ref = naive.moe_experts(x, topw, ids, w13, w2)
    assert float((y0.double() - ref.double()).norm() / ref.double().norm()) <= 1e-2
    for kw in ({}, {"fused_reduce": False}, {"splits": (4, 2)}, {"splits": (1, 1)}):
        base = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, pdl=False, **kw)
        for _ in range(2):
            assert torch.equal(experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, pdl=True, **kw), base), kw
        p0 = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, pdl=False, combine=False, **kw)
        p1 = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, pdl=True, combine=False, **kw)
        assert torch.equal(p1.part, p0.part), kw
    assert torch.equal(experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed), y0)  # the default
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, pdl=True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, pdl=True)
    for _ in range(3):
        yg.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(yg, y0)
    assert not nvfp4_mma.tickets("cuda").any()


@pytest.mark.gpu
def test_mma_dispatch_selected_on_hopper():
    """moe_experts picks the MMA path for decode batches and short prefills, below WGMMA_MIN_MEAN_PAIRS pairs
    per expert (from there the wgmma kernel runs: test_nvfp4_wgmma), when packed weights are present."""
    E, k, H, I = 256, 8, 2048, 512
    w13, w2 = _weights(E, H, I, "cuda", seed=3)
    top = experts.WGMMA_MIN_MEAN_PAIRS * E // k - 1  # the largest batch below the wgmma threshold
    for B in (4, top):
        x = torch.randn(B, H, device="cuda").bfloat16()
        topw, ids = naive.route(torch.randn(B, E, device="cuda"), k, True)
        y = experts.moe_experts(x, topw.bfloat16(), ids, w13, w2)
        assert torch.equal(y, experts.moe_experts_mma(x, topw.bfloat16(), ids, w13.packed, w2.packed))


def test_loader_repacks_nvfp4_experts():
    """Experts.repack_for_kernels (called by the loader after every row is in) builds the MMA layout
    of both expert tensors from the loaded ones; WeightTensor.packed carries it to the kernels."""
    from types import SimpleNamespace

    from linrnn_serve.layers.moe import Experts
    from linrnn_serve.layers.quant import Nvfp4Weights

    cfg = SimpleNamespace(num_experts=3, moe_intermediate_size=48, hidden_size=80)  # K pads to 64 and 128
    ex = Experts(cfg, torch.bfloat16, Nvfp4Weights.for_layout("modelopt"))
    gen = torch.Generator().manual_seed(5)
    for w in (ex.w13, ex.w2):
        p, bs, rs = _random_nvfp4(3, w.n, w.k, gen, zero_frac=0.0)
        w.packed.data.copy_(p), w.block_scale.data.copy_(bs), w.row_scale.data.copy_(rs)
    ex.repack_for_kernels("model.layers.0.mlp.experts")
    assert ex.w13.weight_tensor().packed is None  # no MMA kernel on this machine: nothing built
    ex.repack_for_kernels("model.layers.0.mlp.experts", force=True)
    for w, gated in ((ex.w13, True), (ex.w2, False)):
        wt = w.weight_tensor()
        assert wt.packed.gated == gated
        up, ubs, urs = lay.unpack(wt.packed)
        assert torch.equal(up, w.packed) and torch.equal(ubs.view(torch.uint8), w.block_scale.view(torch.uint8))
    ex.w2.block_scale.data[1, 2, 2] = -1.0
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts.w2 .down_proj.*negative or NaN"):
        ex.repack_for_kernels("model.layers.0.mlp.experts", force=True)


@pytest.mark.parametrize("shape", [(3, 48, 64), (40, 96)])
def test_dequant_kernel_bit_exact(shape):
    """The prefill path's NVFP4 -> bf16 kernel equals WeightTensor.dequantize bit for bit
    (interpreter on the CPU; the GPU run covers the compiled kernel)."""
    from linrnn_kernels.moe import dequant

    gen = torch.Generator().manual_seed(11)
    lead, (n, k) = shape[:-2], shape[-2:]
    packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, generator=gen)
    bits = torch.randint(0, 0x7F, (*lead, n, k // 16), dtype=torch.uint8, generator=gen)
    w = WeightTensor("nvfp4", packed, bits.view(torch.float8_e4m3fn), torch.rand(*lead, n, generator=gen) * 1e-2)
    if torch.cuda.is_available():  # the compiled kernel takes device tensors
        w = WeightTensor("nvfp4", w.data.cuda(), w.block_scale.cuda(), w.row_scale.cuda())
    d = dequant.dequantize(w, torch.float32)
    assert torch.equal(d.data, w.dequantize(torch.float32))


@pytest.mark.gpu
def test_prefill_dequant_path_matches_naive(nan_buffers):
    """Large batches take the dequantize-to-bf16 path; it matches the oracle like the other paths."""
    E, k, H, I = 256, 8, 2048, 512
    w13, w2 = _weights(E, H, I, "cuda")
    T = experts.DEQUANT_MIN_MEAN_PAIRS * E // k
    x = torch.randn(T, H, device="cuda").bfloat16()
    topw, ids = naive.route(x.float() @ (torch.randn(E, H, device="cuda") * 0.02).t(), k, True)
    y = experts.moe_experts(x, topw.bfloat16(), ids, w13, w2)
    ref = naive.moe_experts(x, topw.bfloat16(), ids, w13, w2)
    assert not y.isnan().any()
    assert float((y.double() - ref.double()).norm() / ref.double().norm()) <= 1e-2
    from linrnn_kernels.moe import dequant

    assert torch.equal(dequant.dequantize(w13).data, w13.dequantize(torch.bfloat16))
