"""Naive PyTorch reference for the Gated-DeltaNet ops (SPEC §1.5). The oracle for kernels/gdn/*.

Shapes (one flattened varlen batch of T tokens, B sequences):
  q, k  [T, Hk, Dk]   post-conv query/key (not yet L2-normalised)
  v     [T, Hv, Dv]   post-conv value; value head h uses key head h // (Hv // Hk) (SPEC §1.5.6)
  a, b  [T, Hv]       decay input and beta logits
  state orientation [Dk, Dv] per head (transformers / fla), f32 arithmetic throughout; the pools hold
  it in each partition's layout (layout.py: the bf16 partition blocked), converted at gather / scatter.
Pools are the hybrid per-head partitions described in linrnn_serve/batch.py::GDNLayerState.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from linrnn_kernels.gdn.layout import from_bf16_blocked, to_bf16_blocked


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """g = -exp(A_log) * softplus(a + dt_bias) (log-decay, <= 0) and beta = sigmoid(b), both f32."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    return g, beta


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim, in f32 (SPEC §1.4 #3)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _expand_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[.., Hk, D] -> [.., Hv, D]: consecutive value heads share a key head."""
    return x.repeat_interleave(hv // x.shape[-2], dim=-2)


def recurrent_gated_delta_rule(q, k, v, g, beta, state, scale):
    """Token-by-token delta rule for one sequence.

    q, k [T, Hv, Dk] (already L2-normalised, f32), v [T, Hv, Dv], g/beta [T, Hv], state [Hv, Dk, Dv]
    (f32, updated copy returned). o_t = S_t^T (scale * q_t).
    """
    S = state.clone().float()
    out = torch.empty(q.shape[0], v.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    for t in range(q.shape[0]):
        S = S * torch.exp(g[t])[:, None, None]
        kv_mem = (S * k[t][:, :, None]).sum(1)  # [Hv, Dv] = S^T k
        u = (v[t].float() - kv_mem) * beta[t][:, None]
        S = S + k[t][:, :, None] * u[:, None, :]
        out[t] = (S * (q[t] * scale)[:, :, None]).sum(1)
    return out, S


def chunk_gated_delta_rule(q, k, v, g, beta, state, scale, chunk_size: int = 64):
    """Chunked (UT-transform) form of the same recurrence for one sequence; same I/O as recurrent.

    Mathematically identical to `recurrent_gated_delta_rule`; follows transformers'
    `torch_chunk_gated_delta_rule` (WY/UT representation, chunk 64).
    """
    T, H, Dk = q.shape
    Dv = v.shape[-1]
    pad = (chunk_size - T % chunk_size) % chunk_size
    q = F.pad(q.float() * scale, (0, 0, 0, 0, 0, pad)).transpose(0, 1)  # [H, Tp, Dk]
    k = F.pad(k.float(), (0, 0, 0, 0, 0, pad)).transpose(0, 1)
    v = F.pad(v.float(), (0, 0, 0, 0, 0, pad)).transpose(0, 1)
    g = F.pad(g.float(), (0, 0, 0, pad)).transpose(0, 1)  # [H, Tp]
    beta = F.pad(beta.float(), (0, 0, 0, pad)).transpose(0, 1)
    n = (T + pad) // chunk_size
    q, k, v = (x.reshape(H, n, chunk_size, -1) for x in (q, k, v))
    g, beta = g.reshape(H, n, chunk_size), beta.reshape(H, n, chunk_size)

    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    gc = g.cumsum(-1)  # cumulative log-decay inside each chunk
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(upper, float("-inf")).exp()
    A = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)  # strictly lower part of the UT system
    eye = torch.eye(chunk_size, dtype=torch.float32, device=q.device)
    T_inv = torch.linalg.solve_triangular(A + eye, eye.expand_as(A), upper=False, unitriangular=True)
    w = T_inv @ (k_beta * gc.exp()[..., None])  # decayed keys that read the old state
    u = T_inv @ v_beta
    attn = (q @ k.transpose(-1, -2)) * decay  # decay is 0 above the diagonal

    S = state.clone().float()
    out = torch.empty(H, n, chunk_size, Dv, dtype=torch.float32, device=q.device)
    for c in range(n):
        v_new = u[:, c] - w[:, c] @ S
        out[:, c] = (q[:, c] * gc[:, c, :, None].exp()) @ S + attn[:, c] @ v_new
        k_dec = k[:, c] * (gc[:, c, -1:, None] - gc[:, c, :, None]).exp()
        S = S * gc[:, c, -1].exp()[:, None, None] + k_dec.transpose(-1, -2) @ v_new
    out = out.reshape(H, n * chunk_size, Dv)[:, :T].transpose(0, 1)
    return out, S


# ---- hybrid pool access ------------------------------------------------------------------------


def gather_states(ssm_f32, ssm_bf16, head_is_bf16, head_local, slots) -> torch.Tensor:
    """Read full f32 states [B, Hv, Dk, Dv] for `slots` from the two partitions (the bf16 one converted
    from its blocked layout, layout.py)."""
    slots = slots.long()
    is_b = head_is_bf16.bool()
    loc = head_local.long()
    Hv = head_is_bf16.numel()
    nb, dk, w = ssm_bf16.shape[2:]
    out = torch.empty(slots.numel(), Hv, dk, nb * w, dtype=torch.float32, device=ssm_f32.device)
    fh, bh = (~is_b).nonzero().flatten(), is_b.nonzero().flatten()
    if fh.numel():
        out[:, fh] = ssm_f32[slots][:, loc[fh]]
    if bh.numel():
        out[:, bh] = from_bf16_blocked(ssm_bf16[slots][:, loc[bh]]).float()
    return out


def scatter_states(states, ssm_f32, ssm_bf16, head_is_bf16, head_local, slots) -> None:
    """Write f32 states [B, Hv, Dk, Dv] back into each head's partition (cast to its dtype and layout)."""
    slots = slots.long()
    is_b = head_is_bf16.bool()
    loc = head_local.long()
    fh, bh = (~is_b).nonzero().flatten(), is_b.nonzero().flatten()
    if fh.numel():
        ssm_f32[slots[:, None], loc[fh][None, :]] = states[:, fh].to(ssm_f32.dtype)
    if bh.numel():
        ssm_bf16[slots[:, None], loc[bh][None, :]] = to_bf16_blocked(states[:, bh].to(ssm_bf16.dtype))


# ---- layer-level ops (the signatures the Triton kernels implement) ------------------------------


def gdn_decode(q, k, v, a, b, A_log, dt_bias, ssm_f32, ssm_bf16, head_is_bf16, head_local, state_indices):
    """One token per sequence (q/k [B, Hk, Dk], v [B, Hv, Dv], a/b [B, Hv]); updates pools in place.

    Returns o [B, Hv, Dv] in v.dtype.
    """
    return _gdn_varlen(
        q, k, v, a, b, A_log, dt_bias,
        torch.arange(q.shape[0] + 1, device=q.device, dtype=torch.int32),
        ssm_f32, ssm_bf16, head_is_bf16, head_local, state_indices, chunked=False,
    )


def gdn_prefill(q, k, v, a, b, A_log, dt_bias, cu_seqlens, ssm_f32, ssm_bf16, head_is_bf16, head_local,
                state_indices, chunk_size: int = 64):
    """Varlen prefill from each sequence's pooled state (zeroed by the allocator for new requests).

    Chunked form; final states written back to the pools in each head's partition dtype.
    """
    return _gdn_varlen(q, k, v, a, b, A_log, dt_bias, cu_seqlens, ssm_f32, ssm_bf16, head_is_bf16,
                       head_local, state_indices, chunked=True, chunk_size=chunk_size)


def _gdn_varlen(q, k, v, a, b, A_log, dt_bias, cu_seqlens, ssm_f32, ssm_bf16, head_is_bf16, head_local,
                state_indices, chunked: bool, chunk_size: int = 64):
    Hv, Dk = v.shape[1], q.shape[-1]
    scale = Dk ** -0.5
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    qn = _expand_heads(l2norm(q), Hv)
    kn = _expand_heads(l2norm(k), Hv)
    states = gather_states(ssm_f32, ssm_bf16, head_is_bf16, head_local, state_indices)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    cu = cu_seqlens.tolist()
    rule = chunk_gated_delta_rule if chunked else recurrent_gated_delta_rule
    kw = {"chunk_size": chunk_size} if chunked else {}
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        if e == s:
            continue
        out[s:e], states[i] = rule(qn[s:e], kn[s:e], v[s:e], g[s:e], beta[s:e], states[i], scale, **kw)
    scatter_states(states, ssm_f32, ssm_bf16, head_is_bf16, head_local, state_indices)
    return out.to(v.dtype)


# ---- causal depthwise conv1d + SiLU over the q/k/v channels (SPEC §1.5.2) ------------------------


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor):
    """One sequence: x [T, C], weight [C, K], state [K-1, C] (previous pre-conv inputs, oldest first).

    y_t = silu(sum_j w[:, j] * xx[t + j]) with xx = cat(state, x); returns (y [T, C] in x.dtype,
    new state [K-1, C] = last K-1 rows of xx).
    """
    K = weight.shape[1]
    xx = torch.cat([state.to(x.dtype), x], 0).float()
    w = weight.float()
    y = sum(xx[j: j + x.shape[0]] * w[:, j] for j in range(K))
    return F.silu(y).to(x.dtype), xx[-(K - 1):].to(state.dtype)


def conv1d_varlen(x, weight, conv_state, cu_seqlens, state_indices):
    """Flattened varlen conv: x [T, C]; conv_state pool [slots, K-1, C] updated in place."""
    y = torch.empty_like(x)
    cu = cu_seqlens.tolist()
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        slot = int(state_indices[i])
        if e == s:
            continue
        y[s:e], conv_state[slot] = causal_conv1d(x[s:e], weight, conv_state[slot])
    return y


def conv1d_decode(x, weight, conv_state, state_indices):
    """One token per sequence: x [B, C]."""
    cu = torch.arange(x.shape[0] + 1, device=x.device, dtype=torch.int32)
    return conv1d_varlen(x, weight, conv_state, cu, state_indices)
