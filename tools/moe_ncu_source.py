"""Reads tools/gpu_moe_ncu.sh MODE=source's source.csv (Nsight Compute warp-state samples per SASS instruction of each
profiled _nvfp4_mma_kernel launch) and says what the stalled warps wait on: every long-scoreboard sample is charged to
the global load that last wrote a register the stalled instruction reads (searched backwards in program order, around
the K loop's back edge), classified by the load's kind:
  weight codes  LDG.E.EF.128 (the evict-first 16-byte code loads)    weight scales  LDG.E.EF (4-byte scale words)
  activations   LDG.E.128 (16-byte loads of x / h)                   other          ids, expert ids, row scales, ...
    python tools/moe_ncu_source.py source.csv[.gz] [labels, comma-separated, one per launch]"""
import csv
import io
import re
import sys

KINDS = (("weight codes", r"LDG\.E\.EF\.128"), ("weight scales", r"LDG\.E\.EF\b"), ("activations", r"LDG\.E\.128"),
         ("other loads", r"LDG"))


def kernels(path: str) -> list[list[dict]]:
    out = []
    import gzip

    text = (gzip.open(path, "rt") if path.endswith(".gz") else open(path)).read()
    for part in text.split('"Kernel Name","_nvfp4_mma_kernel",\n')[1:]:
        rows = list(csv.reader(io.StringIO(part)))
        hdr = rows[0]
        out.append([dict(zip(hdr, r)) for r in rows[1:] if len(r) == len(hdr)])
    return out


def regs(text: str) -> list[str]:
    return re.findall(r"\bR\d+\b", text)


def written(op: str) -> set[str]:
    """Registers an instruction writes: its first operand (and the pairs / quads of wide loads)."""
    body = re.sub(r"^@!?U?P\w+\s+", "", op.strip())
    m = re.match(r"(\S+)\s+(R\d+)", body)
    if not m or body.startswith(("ST", "RED", "BRA", "EXIT", "BAR", "HMMA")) and not body.startswith("HMMA"):
        return set()
    base = int(m.group(2)[1:])
    width = 4 if ".128" in m.group(1) else 2 if ".64" in m.group(1) else 1
    if body.startswith("HMMA"):
        width = 4
    return {f"R{base + i}" for i in range(width)}


def read_regs(op: str) -> list[str]:
    body = re.sub(r"^@!?U?P\w+\s+", "", op.strip())
    rs = regs(body)
    if body.startswith(("ST", "RED")):
        return rs
    return rs[1:]


def charge(rows: list[dict]) -> dict:
    ops = [r["Source"].strip() for r in rows]
    out = {k: 0 for k, _ in KINDS}
    out.update(total=0, long_sb=0, unattributed=0)
    for i, r in enumerate(rows):
        out["total"] += int(r.get("Warp Stall Sampling (All Samples)", 0) or 0)
        n = int(r.get("stall_long_sb", 0) or 0)
        if not n:
            continue
        out["long_sb"] += n
        need = set(read_regs(ops[i]))
        kind = None
        for j in list(range(i - 1, -1, -1)) + list(range(len(ops) - 1, i, -1)):  # backwards, then around the loop
            w = written(ops[j]) & need
            if not w:
                continue
            if ops[j].lstrip("@!P0123456789 ").startswith("LDG") or "LDG" in ops[j].split()[0:2][-1]:
                kind = next(k for k, pat in KINDS if re.search(pat, ops[j]))
                break
            need -= w  # written by a non-load: follow no further for those registers
            if not need:
                break
        if kind is None:
            out["unattributed"] += n
        else:
            out[kind] += n
    return out


def main() -> None:
    ks = kernels(sys.argv[1])
    labels = sys.argv[2].split(",") if len(sys.argv) > 2 else [str(i) for i in range(len(ks))]
    print("| launch | samples | long scoreboard | weight codes | weight scales | activations | other loads | unattributed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for lab, rows in zip(labels, ks):
        c = charge(rows)
        ls = max(c["long_sb"], 1)
        print(f"| {lab} | {c['total']} | {c['long_sb']} ({100 * c['long_sb'] / max(c['total'], 1):.0f} %) | "
              + " | ".join(f"{100 * c[k] / ls:.0f} %" for k in ("weight codes", "weight scales", "activations",
                                                                 "other loads", "unattributed")) + " |")


if __name__ == "__main__":
    main()
