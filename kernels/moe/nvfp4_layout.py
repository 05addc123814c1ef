"""The MMA-fragment layout of NVFP4 expert weights (load-time repack for nvfp4_mma.py).

The decode kernel puts weight rows on the M side of `mma.sync m16n8k16` (bf16, k_width 8) and an
expert's tokens on N (8). In that operand layout lane l = 4g + t of a warp holds, for a 16-row tile
and 64 k, rows g and g + 8 in four 32-bit words of 8 codes (cb = 0, 1 for each row); the MMA j (of 4)
takes the code pairs 2j, 2j + 1 of the cb = 0 words as its low k half and of the cb = 1 words as its
high k half, against the activation register pairs of the same k. `pack` stores the four words as the
lane's 16 bytes, so one coalesced 512-byte warp load of a "unit" (16 rows x 64 k) is the whole A
fragment; no layout conversion at run time. Which k each code stands for is chosen so that the
activations can stay in natural order: the lane's word cb holds, for j = 0..3 and h = 0, 1, the code of
k = 16 t + 4 j + 2 cb + h, so MMA j's low and high k pairs are k = 16 t + 4 j + (0, 1) and (2, 3): one
16-byte activation load of 8 consecutive k (16 t .. 16 t + 7, or + 8 .. + 15) is two MMAs' ready B
register pairs, and a word's 8 codes lie in one 16-k scale block (block t).

  codes  int32 [E, T, U, 128]  T = rows / 16 tiles, U = K / 64 units; word (lane, wi) at lane * 4 + wi,
                               wi = 2 cb + r8 (r8: row g or g + 8); code e = 2 j + h of the word is
                               k = 16 t + 4 j + 2 cb + h of the unit
  scales uint8 [E, T, U, 64]   the E4M3 block scale of (row 8 r8 + g, block t) re-encoded (below) at
                               byte (4 g + t) * 2 + r8: a lane's two scales (both its words of a row
                               share one), 64 bytes per unit; lane l reads the 4-byte word l // 2
  row_scale f32 [E, N]         unchanged (the kernel reads it by the original row)

Gated (w13 = [gate; up], 2I rows): tile i holds gate rows 8i .. 8i + 7 as r8 = 0 and the matching up
rows as r8 = 1, so a thread's two accumulator rows are gate and up of one output column and SiLU * up
is done in registers. I is padded to 8, other row counts to 16, K to 64 (zero codes, zero scales).

Nibble placement (the cheapest exact decode found, 11 integer ops per 8 codes): code e = 2j + h of a
word has its 3 magnitude bits at 16 h + (0, 3, 6, 9)[j] and its sign at 16 h + (13, 12, 15, 14)[j];
with q the word,
  out2 = q & 0x81C081C0                          out1 = (q << 3) & 0x81C081C0
  out0 = ((q << 2) & 0x80008000) | ((q << 6) & 0x01C001C0)
  out3 = ((q << 1) & 0x80008000) | ((q >> 3) & 0x01C001C0)
and out_j is the bf16 pair (e = 2j, 2j + 1), each E2M1 value x 2^-126 (bf16 subnormals for 0.5).

Scales: a positive finite E4M3 value v = (1 + m/8) 2^(E' - 18) is stored as x = E' << 3 | m
(E' = 9 .. 26; subnormals normalised). One IMAD `x * 0x100010 + 0x72007200` makes the bf16 pair
[v, v] x 2^119, so code x scale = W x 2^-7, exact in bf16 and normal (>= 2^-17); the kernel multiplies
the f32 accumulator by DECODE_GAIN = 2^7 with the row scale. A zero scale is stored as 0 and its
block's codes are zeroed (unpack then returns zero codes there); a negative or NaN scale is an error.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

DECODE_GAIN = 128.0
SCALE_BIAS = 0x72007200     # IMAD addend: exponent bias 228 in both bf16 halves
SCALE_MUL = 0x100010        # IMAD multiplier: x << 4 into both halves
MAG_SHIFT = (0, 3, 6, 9)    # by j, plus 16 h
SIGN_BIT = (13, 12, 15, 14)  # by j, plus 16 h
UNIT_K = 64
TILE_ROWS = 16
# codes / scales are views into buffers this much longer, so a kernel that prefetches the next K step
# may read one step past the last unit without a bounds check
SLACK_BYTES = 8192


class PackedNvfp4(NamedTuple):
    codes: torch.Tensor      # int32 [E, T, U, 128]
    scales: torch.Tensor     # uint8 [E, T, U, 64]
    row_scale: torch.Tensor  # f32 [E, N]
    n: int                   # logical rows (2I when gated)
    k: int                   # logical in_features
    gated: bool


def padded_rows(n: int, gated: bool) -> int:
    if gated:
        if n % 2:
            raise ValueError(f"gated weights need an even row count (gate | up), got {n}")
        return 2 * (-(-(n // 2) // 8) * 8)
    return -(-n // TILE_ROWS) * TILE_ROWS


def padded_k(k: int) -> int:
    return -(-k // UNIT_K) * UNIT_K


# ---- scale re-encoding -----------------------------------------------------------------------
def _scale_table() -> torch.Tensor:
    """E4M3 bits (0..255) -> re-encoded byte; -1 for invalid (negative, NaN)."""
    t = torch.full((256,), -1, dtype=torch.int32)
    t[0] = 0
    for b in range(1, 0x7F):
        e, m = b >> 3, b & 7
        if e:
            ep, mp = e + 11, m
        else:  # subnormal m * 2^-9, normalised
            ep = 9 + (m.bit_length() - 1)
            mp = ((m << (3 - (m.bit_length() - 1))) & 7)
        t[b] = ep << 3 | mp
    return t


_ENCODE = _scale_table()
_DECODE = torch.zeros(256, dtype=torch.uint8)
for _b in range(0x7F):
    _DECODE[int(_ENCODE[_b])] = _b


def encode_scales(block_scale: torch.Tensor, name: str = "block_scale") -> torch.Tensor:
    """E4M3 scales -> re-encoded bytes (uint8); negative / NaN scales raise ValueError naming `name`."""
    bits = block_scale.contiguous().view(torch.uint8).long()
    enc = _ENCODE.to(bits.device)[bits]
    bad = enc < 0
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        val = float(block_scale[idx].float())
        raise ValueError(f"{name}: block scale {val} at {idx} is negative or NaN (a valid NVFP4 checkpoint "
                         f"has non-negative finite E4M3 block scales)")
    return enc.to(torch.uint8)


def decode_scales(enc: torch.Tensor) -> torch.Tensor:
    return _DECODE.to(enc.device)[enc.long()].view(torch.float8_e4m3fn)


# ---- pack / unpack ---------------------------------------------------------------------------
def _tile_rows(t: torch.Tensor, gated: bool) -> torch.Tensor:
    """[E, Np, X] -> [E, T, 2 (r8), 8 (g), X] in kernel row order."""
    E, Np, X = t.shape
    if gated:  # [gate | up] halves -> per tile (gate 8 rows, up 8 rows)
        return t.reshape(E, 2, Np // 16, 8, X).transpose(1, 2)
    return t.reshape(E, Np // 16, 2, 8, X)


def _untile_rows(t: torch.Tensor, gated: bool) -> torch.Tensor:
    E, T, _, _, X = t.shape
    if gated:
        return t.transpose(1, 2).reshape(E, T * 16, X)
    return t.reshape(E, T * 16, X)


def _pad_rows(t: torch.Tensor, n: int, np_: int, gated: bool) -> torch.Tensor:
    if np_ == n:
        return t
    E, _, X = t.shape
    out = t.new_zeros(E, np_, X)
    if gated:
        i, ip = n // 2, np_ // 2
        out[:, :i] = t[:, :i]
        out[:, ip:ip + i] = t[:, i:]
    else:
        out[:, :n] = t
    return out


def _unpad_rows(t: torch.Tensor, n: int, gated: bool) -> torch.Tensor:
    if gated:
        i, ip = n // 2, t.shape[1] // 2
        return torch.cat([t[:, :i], t[:, ip:ip + i]], dim=1)
    return t[:, :n]


def pack(packed: torch.Tensor, block_scale: torch.Tensor, row_scale: torch.Tensor, gated: bool,
         name: str = "weight") -> PackedNvfp4:
    """In-model NVFP4 tensors ([(E,) N, K/2] uint8, [(E,) N, K/16] E4M3, [(E,) N] f32) -> kernel layout."""
    lead = packed.dim() == 2
    if lead:
        packed, block_scale, row_scale = packed[None], block_scale[None], row_scale[None]
    E, n, kh = packed.shape
    k = 2 * kh
    if tuple(block_scale.shape) != (E, n, k // 16):
        raise ValueError(f"{name}: block_scale shape {tuple(block_scale.shape)} does not match codes {(E, n, kh)}")
    enc = encode_scales(block_scale, name)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(E, n, k)
    codes = codes.reshape(E, n, k // 16, 16) * (enc != 0)[..., None]  # zero-scale blocks: zero codes
    codes = codes.reshape(E, n, k)
    np_, kp = padded_rows(n, gated), padded_k(k)
    codes = _pad_rows(torch.nn.functional.pad(codes, (0, kp - k)), n, np_, gated)
    enc = _pad_rows(torch.nn.functional.pad(enc, (0, (kp - k) // 16)), n, np_, gated)
    T, U = np_ // 16, kp // 64
    # codes [E, T, r8, g, U, t, j, cb, h] (k = 16 t + 4 j + 2 cb + h) -> [.., U, cb, t, j, h] -> words
    c = _tile_rows(codes, gated).reshape(E, T, 2, 8, U, 4, 4, 2, 2).permute(0, 1, 2, 3, 4, 7, 5, 6, 8).long()
    mag, sign = c & 7, c >> 3
    h = torch.arange(2, device=c.device).view(1, 2)
    word = ((mag << (16 * h + torch.tensor(MAG_SHIFT, device=c.device).view(4, 1)))
            | (sign << (16 * h + torch.tensor(SIGN_BIT, device=c.device).view(4, 1)))).sum(dim=(-1, -2))
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)  # [E, T, r8, g, U, cb, t]
    words = word.permute(0, 1, 4, 3, 6, 5, 2).reshape(E, T, U, 128)  # lane = 4g + t, wi = 2cb + r8
    s = _tile_rows(enc, gated).reshape(E, T, 2, 8, U, 4)  # [E, T, r8, g, U, t (block)]
    scales = s.permute(0, 1, 4, 3, 5, 2).reshape(E, T, U, 64)  # (4g + t) * 2 + r8
    rs = row_scale.float().contiguous()
    return PackedNvfp4(_with_slack(words), _with_slack(scales), rs, n, k, gated)


def _with_slack(t: torch.Tensor) -> torch.Tensor:
    flat = t.new_zeros(t.numel() + SLACK_BYTES // t.element_size())
    flat[:t.numel()] = t.reshape(-1)
    return flat[:t.numel()].view(t.shape)


def has_slack(t: torch.Tensor) -> bool:
    end = (t.storage_offset() + t.numel()) * t.element_size()
    return t.is_contiguous() and t.untyped_storage().nbytes() >= end + SLACK_BYTES


def unpack(p: PackedNvfp4):
    """Kernel layout -> (packed uint8 [E, N, K/2], block_scale E4M3 [E, N, K/16], row_scale [E, N]):
    the original tensors bit for bit, except that codes of zero-scale blocks come back as 0."""
    E, T, U, _ = p.codes.shape
    w = p.codes.reshape(E, T, U, 8, 4, 2, 2).permute(0, 1, 6, 3, 2, 5, 4).long() & 0xFFFFFFFF  # [E,T,r8,g,U,cb,t]
    h = torch.arange(2, device=w.device).view(1, 2)
    w = w[..., None, None]
    mag = (w >> (16 * h + torch.tensor(MAG_SHIFT, device=w.device).view(4, 1))) & 7
    sign = (w >> (16 * h + torch.tensor(SIGN_BIT, device=w.device).view(4, 1))) & 1
    c = (mag | sign << 3).permute(0, 1, 2, 3, 4, 6, 7, 5, 8).reshape(E, T, 2, 8, U * 64)  # [.., U, t, j, cb, h]
    codes = _unpad_rows(_untile_rows(c, p.gated), p.n, p.gated)[..., :p.k].to(torch.uint8)
    s = p.scales.reshape(E, T, U, 8, 4, 2).permute(0, 1, 5, 3, 2, 4).reshape(E, T, 2, 8, U * 4)
    enc = _unpad_rows(_untile_rows(s, p.gated), p.n, p.gated)[..., :p.k // 16]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), decode_scales(enc.contiguous()), p.row_scale


# ---- the in-register decode, emulated bit for bit ---------------------------------------------
def decode_words(q: torch.Tensor) -> list[torch.Tensor]:
    """int64 words (0 .. 2^32-1) -> [out0, out1, out2, out3] (uint32 as int64): the kernel's 11 ops."""
    m32 = 0xFFFFFFFF
    out2 = q & 0x81C081C0
    out1 = (q << 3) & 0x81C081C0
    out0 = ((q << 2) & 0x80008000) | ((q << 6) & 0x01C001C0)
    out3 = ((q << 1) & 0x80008000) | ((q >> 3) & 0x01C001C0)
    return [o & m32 for o in (out0, out1, out2, out3)]


def scale_pair(x: torch.Tensor) -> torch.Tensor:
    """Re-encoded scale byte -> the bf16 pair register (the kernel's IMAD)."""
    return (x.long() * SCALE_MUL + SCALE_BIAS) & 0xFFFFFFFF


def bf16_half(bits: torch.Tensor, hi: bool) -> torch.Tensor:
    """f32 value of the low / high bf16 half of 32-bit registers (held as int64)."""
    b = (bits >> 16 if hi else bits) & 0xFFFF
    return (b.to(torch.int32) << 16).view(torch.float32)


def emulate_kernel_decode(p: PackedNvfp4) -> torch.Tensor:
    """The kernels' in-register decode of every packed word, emulated bit for bit and placed by the layout
    above (written from the lane's view, independently of pack): f32 [E, N, K] = code value x block scale
    x 2^-7 (DECODE_GAIN; the row scale not applied). Lane l = 4 g + t reads code word wi = 2 cb + r8 and
    scale word l // 2 (byte 2 (l % 2) + r8); output pair j of the word is k = 16 t + 4 j + 2 cb + (0, 1)."""
    E, T, U, _ = p.codes.shape
    idx = torch.arange(128)
    lane, wi = idx // 4, idx % 4
    g, t, cb, r8 = lane // 4, lane % 4, wi // 2, wi % 2
    words = p.codes.long() & 0xFFFFFFFF  # [E, T, U, 128]
    sbytes = p.scales.reshape(E, T, U, 16, 4)[:, :, :, lane // 2, 2 * (lane % 2) + r8]  # [E, T, U, 128]
    s = bf16_half(scale_pair(sbytes), False)
    out = torch.zeros(E, T, 2, 8, U * 64)
    u = torch.arange(U).view(U, 1)
    for j, o in enumerate(decode_words(words)):
        for h in (0, 1):
            v = (bf16_half(o, bool(h)) * s).bfloat16().float()  # the kernel's bf16x2 FMA (exact: tested)
            k = u * 64 + (16 * t + 4 * j + 2 * cb + h).view(1, 128)  # [U, 128]
            out[:, :, r8.view(1, 128).expand(U, 128), g.view(1, 128).expand(U, 128), k] = v
    return _unpad_rows(_untile_rows(out, p.gated), p.n, p.gated)[..., :p.k]
