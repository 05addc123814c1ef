"""GPT-2's byte <-> printable-character map of byte-level BPE tokenizers (Qwen's, ours)."""
from __future__ import annotations

import functools


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """Byte value -> the printable character that stands for it in a byte-level BPE vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
