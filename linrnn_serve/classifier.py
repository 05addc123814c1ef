"""Per-(GDN layer, value head) decay timescales and the f32/bf16 recurrent-state map
(DESIGN "Hybrid recurrent state"; SPEC §1.5 step 4, §3).

A head's per-token decay is exp(g_t) with g_t = -exp(A_log) * softplus(a_t + dt_bias) (SPEC §1.5.4), so
its memory has timescale tau = -1 / mean(g) tokens. Long-memory heads accumulate the rounding of a bf16
state over many steps; short-memory heads forget it. So:

  tier 1 (weights only, a_t = 0):   tau_h = 1 / (|A_h| * softplus(dt_bias_h)),  A_h = -exp(A_log_h)
  tier 2 (opt-in calibration):      tau_h = -1 / mean_t(g_t,h) over the `a` inputs of real text,
                                    measured by forward hooks on each GDN layer's input projection.

Threshold T (EngineConfig.ssm_bf16_tau): a head keeps an f32 state iff tau_h > T, else bf16, with two
special values: T = inf turns the hybrid off (every head f32: the default, bit-identical to an all-f32
engine) and T = 0 makes every head bf16. (Read literally, "tau_h > T stays f32" would give the opposite
at both ends; the special values follow the documented defaults.)

Tier-2 results go to a sidecar JSON keyed by the checkpoint's content hash (`checkpoint_hash`), in
$LINRNN_CACHE_DIR (default ~/.cache/linrnn_serve), and are reused on the next start when the checkpoint
and the calibration tokens are the same.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import time

import torch
import torch.nn.functional as F

SIDECAR_FORMAT = "linrnn-gdn-calibration/1"
HASH_FORMAT = "linrnn-checkpoint-hash/1"
_SAMPLE = 64 * 1024  # bytes of tensor data hashed at each of 3 places per safetensors file


# ---- tier 1 -----------------------------------------------------------------------------------------


def gdn_modules(model) -> list:
    """The model's GatedDeltaNet modules in GDN-layer order (index n = state-pool layer n)."""
    return [model.layers[i].linear_attn for i in model.cfg.gdn_layers]


def head_timescales(model) -> list[torch.Tensor]:
    """Tier 1: tau_h = 1 / (exp(A_log_h) * softplus(dt_bias_h)) per GDN layer, [Hv] f32 on the CPU."""
    taus = []
    for m in gdn_modules(model):
        A = torch.exp(m.A_log.detach().float().cpu())
        taus.append(1.0 / (A * F.softplus(m.dt_bias.detach().float().cpu())))
    return taus


def bf16_head_map(taus: list[torch.Tensor], tau_threshold: float) -> list[list[bool]]:
    """The `bf16_heads` argument of HybridStateCache: True where head h of GDN layer n stores bf16.

    tau_threshold: inf -> every head f32; 0 -> every head bf16; otherwise bf16 iff tau_h <= T."""
    T = float(tau_threshold)
    if math.isnan(T) or T < 0:
        raise ValueError(f"ssm_bf16_tau must be >= 0 (0: all bf16, inf: all f32), got {tau_threshold!r}")
    if math.isinf(T):
        return [[False] * len(t) for t in taus]
    if T == 0:
        return [[True] * len(t) for t in taus]
    return [[bool(x <= T) for x in t.tolist()] for t in taus]


# ---- description for the startup log -----------------------------------------------------------------


def state_bytes_per_seq(cfg, bf16_heads: list[list[bool]], act_dtype: torch.dtype) -> dict[str, int]:
    """Recurrent-state bytes of one sequence: f32 ssm, bf16 ssm, conv (all GDN layers)."""
    per_head = cfg.linear_key_head_dim * cfg.linear_value_head_dim
    n_bf16 = sum(sum(m) for m in bf16_heads)
    n_f32 = sum(len(m) for m in bf16_heads) - n_bf16
    conv = len(bf16_heads) * (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * torch.empty(0, dtype=act_dtype
                                                                                           ).element_size()
    return {"ssm_f32": n_f32 * per_head * 4, "ssm_bf16": n_bf16 * per_head * 2, "conv": conv}


def describe(cfg, bf16_heads: list[list[bool]], act_dtype: torch.dtype, tau_threshold: float,
             taus: list[torch.Tensor] | None = None, source: str = "weights (tier 1)") -> str:
    """Startup log text: threshold, f32 fraction per GDN layer and in total, state bytes per sequence."""
    n_total = sum(len(m) for m in bf16_heads)
    n_f32 = sum(not b for m in bf16_heads for b in m)
    T = float(tau_threshold)
    mode = ("hybrid off: every head f32" if math.isinf(T) else "every head bf16" if T == 0
            else f"heads with tau <= {T:g} tokens store bf16")
    by = state_bytes_per_seq(cfg, bf16_heads, act_dtype)
    mib = 1 / 2**20
    lines = [
        f"GDN recurrent state: ssm_bf16_tau={T:g} ({mode}); timescales from {source}",
        f"  f32 heads: {n_f32}/{n_total} ({100 * n_f32 / max(n_total, 1):.1f} %)",
        "  f32 fraction per GDN layer: " + " ".join(
            f"L{li}:{sum(not b for b in m) / max(len(m), 1):.2f}" for li, m in zip(cfg.gdn_layers, bf16_heads)),
        f"  state per sequence: {sum(by.values()) * mib:.2f} MiB (ssm f32 {by['ssm_f32'] * mib:.2f} MiB, "
        f"ssm bf16 {by['ssm_bf16'] * mib:.2f} MiB, conv {by['conv'] * mib:.2f} MiB)",
    ]
    if taus:
        allt = torch.cat([t.float() for t in taus])
        q = torch.quantile(allt[torch.isfinite(allt)], torch.tensor([0.0, 0.5, 1.0])).tolist() \
            if torch.isfinite(allt).any() else [math.inf] * 3
        lines.append(f"  head timescales tau (tokens): min {q[0]:.3g}, median {q[1]:.3g}, max {q[2]:.3g}")
    return "\n".join(lines)


# ---- checkpoint content hash ------------------------------------------------------------------------


def checkpoint_hash(checkpoint_dir: str | os.PathLike) -> str:
    """sha256 over config.json and, per *.safetensors file (sorted by name): its name, size, JSON header
    and three 64 KiB samples of its tensor data (start, middle, end). Reads a few MB even for a 70 GB
    checkpoint; the data samples tell apart fine-tunes that share shapes and headers."""
    path = str(checkpoint_dir)
    h = hashlib.sha256(HASH_FORMAT.encode())
    cfg = os.path.join(path, "config.json")
    if os.path.isfile(cfg):
        with open(cfg, "rb") as f:
            h.update(b"config.json\0" + f.read())
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files and not os.path.isfile(cfg):
        raise ValueError(f"{path}: neither config.json nor *.safetensors to hash")
    for fn in files:
        full = os.path.join(path, fn)
        size = os.path.getsize(full)
        h.update(f"{fn}\0{size}\0".encode())
        with open(full, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{full}: truncated safetensors file")
            (n,) = struct.unpack("<Q", head)
            h.update(f.read(n))
            data0, data_len = 8 + n, max(size - 8 - n, 0)
            for off in sorted({data0, data0 + max(data_len // 2 - _SAMPLE // 2, 0), max(size - _SAMPLE, data0)}):
                f.seek(off)
                h.update(f.read(_SAMPLE))
    return h.hexdigest()


# ---- tier 2: calibration ----------------------------------------------------------------------------


@torch.inference_mode()
def calibrate(model, token_ids: list[int], seq_len: int = 512) -> list[dict]:
    """Run the model over token_ids (in sequences of seq_len tokens, each from an empty state) and
    measure per GDN layer and head: mean decay exp(g), mean log-decay g, mean per-token tau = -1/g,
    and tau = -1/mean(g) (the timescale of the product of decays, used for the map)."""
    from linrnn_serve.runner.session import Session  # runtime-only: the runner sits above us

    if not token_ids:
        raise ValueError("calibration needs at least one token")
    mods = gdn_modules(model)
    acc = [dict(n=0, decay=0.0, g=0.0, tau=0.0) for _ in mods]

    def hook(idx, mod):
        def fn(_module, _inputs, out):
            a = out[..., -mod.hv:].float()
            g = -torch.exp(mod.A_log.float()) * F.softplus(a + mod.dt_bias.float())  # [T, Hv], <= 0
            st = acc[idx]
            st["n"] += g.shape[0]
            st["decay"] = st["decay"] + torch.exp(g).sum(0)
            st["g"] = st["g"] + g.sum(0)
            st["tau"] = st["tau"] + (-1.0 / g).sum(0)
        return fn

    handles = [m.in_proj.register_forward_hook(hook(i, m)) for i, m in enumerate(mods)]
    try:
        for s in range(0, len(token_ids), seq_len):
            chunk = list(token_ids[s: s + seq_len])
            sess = Session(model, 1, len(chunk) + 1)
            sess.forward([sess.new_seq()], [chunk])
    finally:
        for hd in handles:
            hd.remove()
    out = []
    for st in acc:
        n = st["n"]
        mean_g = (st["g"] / n).cpu()
        out.append({"mean_decay": (st["decay"] / n).cpu().tolist(), "mean_log_decay": mean_g.tolist(),
                    "mean_tau": (st["tau"] / n).cpu().tolist(), "tau": (-1.0 / mean_g).tolist()})
    return out


def _cache_dir(cache_dir: str | None) -> str:
    return cache_dir or os.environ.get("LINRNN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                           "linrnn_serve")


def sidecar_path(ckpt_hash: str, cache_dir: str | None = None) -> str:
    return os.path.join(_cache_dir(cache_dir), f"gdn_calibration-{ckpt_hash[:32]}.json")


def calibrated_timescales(model, checkpoint_dir: str | None, token_ids: list[int], cache_dir: str | None = None,
                          seq_len: int = 512) -> tuple[list[torch.Tensor], str]:
    """Tier-2 taus, from the sidecar when it matches (checkpoint hash + tokens), else measured and saved.
    Returns (taus, source note). Without a checkpoint directory (dummy weights) nothing is cached."""
    tok_hash = hashlib.sha256(json.dumps([int(t) for t in token_ids]).encode()).hexdigest()
    ckpt = checkpoint_hash(checkpoint_dir) if checkpoint_dir else None
    path = sidecar_path(ckpt, cache_dir) if ckpt else None
    if path and os.path.isfile(path):
        try:
            with open(path) as f:
                side = json.load(f)
            if (side.get("format") == SIDECAR_FORMAT and side.get("checkpoint_hash") == ckpt
                    and side.get("tokens_sha256") == tok_hash and side.get("seq_len") == seq_len
                    and len(side["layers"]) == len(model.cfg.gdn_layers)):
                return ([torch.tensor(L["tau"], dtype=torch.float32) for L in side["layers"]],
                        f"calibration (tier 2, {side['num_tokens']} tokens, reused {path})")
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable or stale sidecar: measure again and overwrite it
    layers = calibrate(model, token_ids, seq_len)
    note = f"calibration (tier 2, {len(token_ids)} tokens"
    if path:
        side = {"format": SIDECAR_FORMAT, "checkpoint_hash": ckpt, "checkpoint_dir": os.path.abspath(checkpoint_dir),
                "tokens_sha256": tok_hash, "num_tokens": len(token_ids), "seq_len": seq_len,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "layers": [dict(layer=li, **L) for li, L in zip(model.cfg.gdn_layers, layers)]}
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(side, f)
            os.replace(tmp, path)
            note += f", saved {path}"
        except OSError as e:
            note += f", not saved: {e}"
    return [torch.tensor(L["tau"], dtype=torch.float32) for L in layers], note + ")"


# ---- the engine's entry point -----------------------------------------------------------------------


def build_head_map(model, tau: float, checkpoint_dir: str | None = None, calibration_tokens: list[int] | None = None,
                   cache_dir: str | None = None) -> tuple[list[list[bool]], str]:
    """(bf16_heads for HybridStateCache, startup-log description).

    tau = EngineConfig.ssm_bf16_tau (inf: all f32, 0: all bf16, else bf16 iff tau_h <= tau). With
    calibration_tokens the timescales come from tier 2 (cached per checkpoint), else from the weights.
    At inf or 0 the map does not depend on the timescales, so no calibration runs."""
    T = float(tau)
    taus = head_timescales(model)
    source = "weights (tier 1)"
    if calibration_tokens and 0 < T < math.inf:
        taus, source = calibrated_timescales(model, checkpoint_dir, calibration_tokens, cache_dir)
    elif calibration_tokens:
        source += "; calibration skipped (the map does not depend on it at this threshold)"
    heads = bf16_head_map(taus, T)
    return heads, describe(model.cfg, heads, model.dtype, T, taus, source)
