"""Train, quantize and evaluate the embedded default model in ONE run on a GPU machine (issue #8).

    python3 -m tools.train_default_model --data tools/out/data.npz --out "$OUT"

Stages (each prints progress; OUT/results.json is rewritten after every stage, so a late failure
keeps what was done):
  1. train a transformers Qwen3_5MoeForCausalLM of tools/model_config.py on the token file of
     tools/build_data.py: AdamW, linear warm-up + cosine, bf16 autocast over f32 master weights,
     fixed seed, MoE load-balancing loss; GDN/delta-rule kernels are flash-linear-attention's when
     `import fla` works (transformers picks them up), else transformers' torch path; routed experts
     run as two grouped GEMMs (torch grouped_mm) where available. The number of steps is fixed from
     the throughput of the first steps to fill --train-seconds (or given by --steps, to reproduce).
  2. save the bf16 HF checkpoint to --work (local scratch, not returned: too big);
  3. quantize it with linrnn_serve.checkpoint.quantize to NVFP4 (routed experts + shared expert,
     compressed-tensors layout) into OUT/model, re-sharded below 15 MB a file (if that fails, the
     bf16 checkpoint goes to OUT/bf16 instead, so the training is never lost);
  4. validation loss / perplexity on the held-out tokens, chunks of --eval-ctx from an empty state:
     unigram baseline, bf16 by transformers, bf16 by our engine, NVFP4 by our engine (+ the
     in-memory f32 model under autocast); engine vs transformers must agree within 0.5 %;
  5. greedy continuations of "def fibonacci(n):" (transformers bf16, engine NVFP4);
  6. [KL-GATE HOOK] with --kl-gate: kl_gate_hook() runs `linrnn-serve kl-gate` (NVFP4 vs bf16, tau sweep).
Everything returned lies in OUT: model/ (config.json, generation_config.json,
model.safetensors.index.json, 2-3 shards) and results.json: at most 8 files, each < 16 MB.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import traceback

T_START = time.time()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tools import model_config as mc  # noqa: E402
from tools import tokenizer as tk  # noqa: E402
from tools.build_data import load_data  # noqa: E402

FIB_PROMPT = "def fibonacci(n):"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(msg: str) -> None:
    print(f"[{time.time() - T_START:7.1f}s] {msg}", flush=True)


# ---- results ---------------------------------------------------------------------------------
class Results:
    def __init__(self, path: str):
        self.path, self.data = path, {"stages": {}, "errors": {}}

    def stage(self, name: str, value) -> None:
        self.data["stages"][name] = value
        self.save()

    def error(self, name: str, exc: BaseException) -> None:
        log(f"stage {name} FAILED: {exc!r}")
        self.data["errors"][name] = "".join(traceback.format_exception(exc))[-4000:]
        self.save()

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)


# ---- model -----------------------------------------------------------------------------------
def realistic_timescales(model: torch.nn.Module, seed: int) -> None:
    """SPEC §3's recommended A_log / dt_bias init (FLA / Mamba-2): A ~ U(1, 16), dt ~ logU(1e-3, 1e-1)
    floored at 1e-4, dt_bias = softplus^-1(dt), so the heads start with a spread of timescales
    (HF's dt_bias = 1 makes ~94 % of heads forget almost everything every step)."""
    g = torch.Generator().manual_seed(seed)
    for mod in model.modules():
        if hasattr(mod, "A_log") and hasattr(mod, "dt_bias"):
            n = mod.A_log.numel()
            A = torch.empty(n).uniform_(1, 16, generator=g)
            dt = torch.exp(torch.empty(n).uniform_(math.log(1e-3), math.log(0.1), generator=g)).clamp(min=1e-4)
            with torch.no_grad():
                mod.A_log.copy_(torch.log(A))
                mod.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


def build_hf_model(cfg: dict, seed: int):
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(mc.hf_config(cfg))
    realistic_timescales(model, seed)
    return model


def _grouped_mm_fn():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_works(device: torch.device) -> bool:
    """Probe torch's grouped GEMM (bf16, forward + backward) on `device` once."""
    fn = _grouped_mm_fn()
    if fn is None or device.type != "cuda":
        return False
    try:
        x = torch.randn(48, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(3, 64, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
        offs = torch.tensor([16, 32, 48], device=device, dtype=torch.int32)
        y = fn(x, w, offs=offs)
        y.float().sum().backward()
        ref = torch.cat([x[:16] @ w[0], x[16:32] @ w[1], x[32:] @ w[2]])
        return bool(torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-2))
    except Exception as e:  # noqa: BLE001 - any failure means "use the loop"
        log(f"grouped_mm unavailable ({e!r}); experts run as a per-expert loop")
        return False


def experts_forward_train(self, hidden_states, top_k_index, top_k_weights):
    """Same math as transformers' Qwen3_5MoeExperts.forward (SPEC §1.8), for training: tokens sorted by
    expert, gate_up and down as two grouped GEMMs in the autocast dtype (f32 master weights are cast,
    so gradients reach them), combined per token in f32."""
    T, K = top_k_index.shape
    H = hidden_states.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))  # bincount would sync with the host on CUDA
    x = hidden_states[order // K]
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    w13, w2 = self.gate_up_proj.to(dtype), self.down_proj.to(dtype)
    x = x.to(dtype)
    if getattr(self, "_linrnn_grouped_mm", False):
        fn = _grouped_mm_fn()
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = fn(x, w13.transpose(1, 2), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        y = fn(self.act_fn(gate) * up, w2.transpose(1, 2), offs=offs)
    else:
        ys = []
        for e, xe in enumerate(torch.split(x, counts.tolist())):
            if xe.shape[0]:
                gate, up = F.linear(xe, w13[e]).chunk(2, dim=-1)
                ys.append(F.linear(self.act_fn(gate) * up, w2[e]))
        y = torch.cat(ys)
    y = y.float() * top_k_weights.reshape(-1)[order].float().unsqueeze(-1)
    out = torch.empty_like(y)
    out[order] = y
    return out.view(T, K, H).sum(1).to(hidden_states.dtype)


def patch_experts_for_training(model, use_grouped_mm: bool) -> int:
    import types

    n = 0
    for mod in model.modules():
        if type(mod).__name__ == "Qwen3_5MoeExperts":
            mod._linrnn_grouped_mm = use_grouped_mm
            mod.forward = types.MethodType(experts_forward_train, mod)
            n += 1
    return n


def unpatch_experts(model) -> None:
    for mod in model.modules():
        if type(mod).__name__ == "Qwen3_5MoeExperts" and "forward" in mod.__dict__:
            del mod.forward


# ---- training --------------------------------------------------------------------------------
def lr_at(step: int, total: int, lr: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)  # norms, A_log, dt_bias: no decay
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train(model, train_tokens: torch.Tensor, dev_chunks: torch.Tensor, args, device, res: Results) -> dict:
    """Returns training stats. Every --val-every steps the loss on `dev_chunks` (a slice of the training
    stream kept out of training, not the held-out text) is measured; if the final dev loss is worse
    than the best one seen (over-fitting after many epochs), the best weights are restored."""
    use_amp = device.type == "cuda"
    amp_dtype = torch.bfloat16
    V = model.config.vocab_size
    coef = model.config.router_aux_loss_coef
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            **({"fused": True} if device.type == "cuda" else {}))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    n_tok = train_tokens.numel()
    span = args.seq_len + 1
    if n_tok <= span:
        raise ValueError(f"{n_tok} training tokens are fewer than one sequence of {span}")
    offsets = torch.arange(span, device=device)
    budget = args.train_seconds
    total = args.steps
    calib_steps = 0 if total else args.calib_steps
    curve, dev_curve = [], []
    best = {"loss": math.inf, "step": 0, "state": None}
    model.train()
    t_train = time.time()
    t_calib = None
    step = 0
    tokens_seen = 0
    log(f"training: budget {budget:.0f} s, batch {args.batch} x {args.seq_len}, lr {args.lr}, "
        f"{'steps ' + str(total) if total else 'steps from measured throughput'}")
    while True:
        if total is None and step == args.calib_warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_calib = time.time()
        if total is None and step == args.calib_warmup + calib_steps:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - t_calib) / calib_steps
            total = max(step + 1, int((budget - (time.time() - t_train)) / per_step) + step)
            cap = int(args.max_epochs * n_tok / (args.batch * args.seq_len))
            log(f"throughput {args.batch * args.seq_len / per_step:,.0f} tok/s, {per_step * 1000:.0f} ms/step "
                f"-> {total} steps{f', capped at {cap} ({args.max_epochs:g} epochs)' if cap < total else ''}")
            total = max(step + 1, min(total, cap))
        if total is not None and step >= total:
            break
        if time.time() - t_train > budget * 1.15 + 5:
            log(f"time budget exceeded at step {step}: stopping early")
            break
        sched_total = total if total is not None else 10 ** 9
        lr = lr_at(step, sched_total, args.lr, args.warmup, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, n_tok - span, (args.batch,), device=device, generator=gen)
        seq = train_tokens[starts[:, None] + offsets]
        x, y = seq[:, :-1], seq[:, 1:]
        with torch.autocast(device.type, dtype=amp_dtype, enabled=use_amp):
            out = model(input_ids=x, use_cache=False, output_router_logits=True)
        ce = F.cross_entropy(out.logits.float().view(-1, V), y.reshape(-1))
        loss = ce + coef * out.aux_loss.float() if out.aux_loss is not None else ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        tokens_seen += x.numel()
        if step % args.log_every == 0 or step == 1 or step == total:
            ce_v = ce.item()
            el = time.time() - t_train
            curve.append({"step": step, "loss": round(ce_v, 4), "lr": lr, "grad_norm": round(gnorm.item(), 3),
                          "seconds": round(el, 1)})
            log(f"step {step}/{total or '?'} loss {ce_v:.4f} lr {lr:.2e} gnorm {gnorm.item():.2f} "
                f"{tokens_seen / el:,.0f} tok/s")
            if not math.isfinite(ce_v):
                raise FloatingPointError(f"training loss is {ce_v} at step {step}")
        if args.val_every and (step % args.val_every == 0 or step == total):
            from tools.evaluate import eval_hf

            v = eval_hf(model, dev_chunks, batch=args.eval_batch, autocast_dtype=amp_dtype if use_amp else None)
            dev_curve.append({"step": step, "dev_loss": round(v["loss"], 4)})
            log(f"step {step}: dev loss {v['loss']:.4f} (ppl {v['ppl']:.2f})")
            if v["loss"] < best["loss"]:
                snapshot = None if step == total else {k: t.detach().clone() for k, t in model.state_dict().items()}
                best.update(loss=v["loss"], step=step, state=snapshot)
            res.data["train_progress"] = {"curve": curve, "dev_curve": dev_curve}
            res.save()
    restored = None
    if best["state"] is not None and dev_curve and dev_curve[-1]["dev_loss"] > best["loss"] + 0.002:
        model.load_state_dict(best["state"])
        restored = best["step"]
        log(f"dev loss rose after step {best['step']} ({best['loss']:.4f} -> {dev_curve[-1]['dev_loss']:.4f}): "
            f"restored the weights of step {best['step']}")
    best["state"] = None
    seconds = time.time() - t_train
    return {"steps": step, "planned_steps": total, "seconds": round(seconds, 1), "tokens": tokens_seen,
            "tokens_per_second": round(tokens_seen / max(seconds, 1e-9)), "epochs": round(tokens_seen / n_tok, 2),
            "curve": curve, "dev_curve": dev_curve, "restored_best_step": restored}


# ---- checkpoint ------------------------------------------------------------------------------
def save_bf16(model, out_dir: str) -> list[str]:
    from transformers import GenerationConfig

    unpatch_experts(model)
    model.config.output_router_logits = False
    model.generation_config = GenerationConfig(eos_token_id=[tk.IM_END_ID, tk.EOT_ID], pad_token_id=tk.EOT_ID)
    model_bf16 = model.to(torch.bfloat16)
    model_bf16.config.dtype = torch.bfloat16
    os.makedirs(out_dir, exist_ok=True)
    model_bf16.save_pretrained(out_dir, max_shard_size="1GB")
    return sorted(os.listdir(out_dir))


def quantize_checkpoint(src: str, dst: str, fmt: str = "compressed-tensors") -> None:
    """NVFP4 (routed experts + shared expert; everything else bf16) with the project's quantizer,
    linrnn_serve.checkpoint.quantize, in shards below MAX_SHARD_BYTES. compressed-tensors layout by
    default: its quantization_config lives in config.json (ModelOpt exports add hf_quant_config.json,
    one more file to return), and it is the layout of llm-compressor's public Qwen3.5 NVFP4
    checkpoints (SPEC §2.3)."""
    from linrnn_serve.checkpoint.quantize import quantize_checkpoint as quantize

    quantize(src, dst, fmt, "experts+shared", max_shard_bytes=mc.MAX_SHARD_BYTES, overwrite=True, progress=False)


def reshard(model_dir: str, max_bytes: int = mc.MAX_SHARD_BYTES) -> list[str]:
    """Rewrite the safetensors of `model_dir` as shards of at most `max_bytes` (+ index), in tensor-name
    order, keeping each tensor whole and the file metadata. Returns the shard names."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    tensors, meta = {}, None
    for fn in files:
        with safe_open(os.path.join(model_dir, fn), "pt") as f:
            meta = meta or f.metadata()
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
    groups, cur, cur_bytes = [], [], 0
    for name in sorted(tensors):
        nb = tensors[name].numel() * tensors[name].element_size() + 128
        if cur and cur_bytes + nb > max_bytes:
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append(name)
        cur_bytes += nb
    groups.append(cur)
    for fn in files:
        os.remove(os.path.join(model_dir, fn))
    idx = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(idx):
        os.remove(idx)
    weight_map, names = {}, []
    total = 0
    for i, g in enumerate(groups):
        fn = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in g}, os.path.join(model_dir, fn),
                  metadata=meta or {"format": "pt"})
        weight_map.update({k: fn for k in g})
        names.append(fn)
        total += sum(tensors[k].numel() * tensors[k].element_size() for k in g)
    with open(idx, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return names


def dir_listing(d: str) -> dict[str, int]:
    out = {}
    for root, _, files in os.walk(d):
        for fn in files:
            p = os.path.join(root, fn)
            out[os.path.relpath(p, d)] = os.path.getsize(p)
    return dict(sorted(out.items()))


# ---- KL gate ---------------------------------------------------------------------------------
def kl_gate_hook(args, bf16_dir: str, nvfp4_dir: str | None, text_path: str, res: Results) -> None:
    """[KL-GATE HOOK] with --kl-gate, `linrnn-serve kl-gate` (linrnn_bench.kl_gate) runs here on the
    held-out text: NVFP4 vs bf16 (both by our engine), and hybrid state vs all-f32 (tau sweep) on the
    NVFP4 model. Reports land in results.json (the gate's PNG/markdown stay in --work: the device
    returns at most 8 files). It runs last: nothing of the checkpoint depends on it."""
    if not args.kl_gate:
        return
    import linrnn_bench.kl_gate as kl

    runs = [("sweep_tau", ["--model", nvfp4_dir or bf16_dir, "--sweep-tau", args.kl_taus])]
    if nvfp4_dir:
        runs.insert(0, ("nvfp4_vs_bf16", ["--model", bf16_dir, "--ref", "impl=ours", "--test", f"model={nvfp4_dir}"]))
    for name, argv in runs:
        if time.time() - T_START > args.time_limit - 20:
            res.stage(f"kl_gate_{name}", {"skipped": "out of time"})
            continue
        out = os.path.join(args.work, "kl", name)
        p = argparse.ArgumentParser()
        kl.add_arguments(p)
        a = p.parse_args(argv + ["--text", text_path, "--ctx", args.kl_ctx, "--out", out])
        log(f"kl-gate {name}: {' '.join(argv)}")
        status = kl.run(a)
        with open(os.path.join(out, "kl_gate.json")) as f:
            res.stage(f"kl_gate_{name}", {"status": status, "report": json.load(f)})


# ---- pipeline --------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join("tools", "out", "data.npz"), help="token file of tools.build_data")
    p.add_argument("--out", required=True, help="output folder (the device's $OUT): model/ + results.json")
    p.add_argument("--work", default="/tmp/linrnn-default-model", help="local scratch for the bf16 checkpoint")
    p.add_argument("--preset", default="default", choices=["default", "tiny"],
                   help="model size (tools/model_config.py)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-seconds", type=float, default=360.0, help="training time budget")
    p.add_argument("--time-limit", type=float, default=560.0,
                   help="whole-run wall-clock limit (s): training shrinks to leave --reserve-seconds")
    p.add_argument("--reserve-seconds", type=float, default=150.0, help="time kept for save/quantize/eval")
    p.add_argument("--steps", type=int, default=None,
                   help="fixed step count (reproduce a run); default: from throughput")
    p.add_argument("--max-epochs", type=float, default=16.0,
                   help="cap on passes over the training tokens when the step count comes from throughput")
    p.add_argument("--calib-warmup", type=int, default=5)
    p.add_argument("--calib-steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--val-every", type=int, default=500, help="dev-loss interval (steps)")
    p.add_argument("--dev-tokens", type=int, default=65536,
                   help="tail of the training stream kept out of training to watch over-fitting")
    p.add_argument("--max-train-tokens", type=int, default=None, help="use only a prefix of the train tokens (tests)")
    p.add_argument("--eval-ctx", type=int, default=512, help="n_ctx of the evaluation chunks (KL-gate default)")
    p.add_argument("--eval-tokens", type=int, default=None, help="cap on evaluated held-out tokens (default all)")
    p.add_argument("--eval-batch", type=int, default=16)
    p.add_argument("--quant-format", default="compressed-tensors", choices=["compressed-tensors", "modelopt"])
    p.add_argument("--no-engine", action="store_true", help="skip our engine's evaluations")
    p.add_argument("--sample-tokens", type=int, default=64)
    p.add_argument("--kl-gate", action="store_true", help="run the KL gate stage (kl_gate_hook)")
    p.add_argument("--kl-ctx", default="512,2048", help="n_ctx list of the KL gate stage")
    p.add_argument("--kl-taus", default="0,1,4,16,64,256", help="tau sweep of the KL gate stage")
    p.add_argument("--heldout", default=os.path.join(REPO, "linrnn_serve", "assets", "default-model", "heldout.txt"),
                   help="held-out text (the KL gate's text; its tokens are data.npz's val)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    res = Results(os.path.join(args.out, "results.json"))
    res.data["args"] = vars(args)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    env = {"python": sys.version.split()[0], "torch": torch.__version__, "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        import fla  # noqa: F401  (transformers uses its chunk_gated_delta_rule when importable)

        env["fla"] = getattr(fla, "__version__", "yes")
    except Exception as e:  # noqa: BLE001
        env["fla"] = f"not available ({type(e).__name__}): transformers' torch GDN path"
    res.data["env"] = env
    log(f"env: {env}")

    # data
    train_np, val_np, meta = load_data(args.data)
    if args.max_train_tokens:
        train_np = train_np[: args.max_train_tokens]
    res.data["data"] = {k: meta[k] for k in ("python", "tokenizer_sha256", "manifest_sha256", "heldout_sha256",
                                             "vocab_size", "train_tokens", "val_tokens") if k in meta}
    tok_json = os.path.join(tk.assets_dir(), "tokenizer.json")
    if os.path.isfile(tok_json):
        from tools.build_data import sha256_file

        if sha256_file(tok_json) != meta.get("tokenizer_sha256"):
            raise RuntimeError(f"{args.data} was tokenized with a different tokenizer than {tok_json}: rebuild it")
    cfg = mc.text_config(args.preset, vocab_size=meta["vocab_size"])
    res.data["model_config"] = cfg
    res.data["byte_budget"] = mc.nvfp4_checkpoint_bytes(cfg)
    from tools.evaluate import make_chunks

    n_dev = min(args.dev_tokens, train_np.size // 10)
    dev_len = min(args.seq_len, n_dev)
    dev_chunks = make_chunks(train_np[train_np.size - n_dev:], dev_len).to(device)
    train_np = train_np[: train_np.size - n_dev]
    train_t = torch.from_numpy(train_np.astype(np.int64)).to(device)
    log(f"data: {train_np.size:,} train / {val_np.size:,} val tokens; model {args.preset}: "
        f"{res.data['byte_budget']['params']['total'] / 1e6:.1f} M params, NVFP4 checkpoint "
        f"~{res.data['byte_budget']['total'] / 1e6:.1f} MB")

    # 1. train
    model = build_hf_model(cfg, args.seed).to(device)
    use_gmm = grouped_mm_works(device)
    n_patched = patch_experts_for_training(model, use_gmm)
    env["experts_path"] = ("grouped_mm" if use_gmm else "loop") if n_patched else "transformers eager (not patched)"
    log(f"experts: {env['experts_path']} in {n_patched} layers")
    elapsed = time.time() - T_START
    args.train_seconds = max(5.0, min(args.train_seconds, args.time_limit - elapsed - args.reserve_seconds))
    stats = train(model, train_t, dev_chunks, args, device, res)
    res.stage("train", {k: v for k, v in stats.items()})
    del train_t

    eval_chunks = make_chunks(val_np, args.eval_ctx, args.eval_tokens)
    try:
        from tools.evaluate import eval_hf

        r = eval_hf(model, eval_chunks, args.eval_batch, torch.bfloat16 if device.type == "cuda" else None)
        res.stage("eval_f32_master_autocast", r)
        log(f"val (f32 master weights, autocast): loss {r['loss']:.4f} ppl {r['ppl']:.2f}")
    except Exception as e:  # noqa: BLE001
        res.error("eval_f32_master_autocast", e)

    # 2. bf16 checkpoint (local scratch)
    bf16_dir = os.path.join(args.work, "bf16")
    shutil.rmtree(bf16_dir, ignore_errors=True)
    files = save_bf16(model, bf16_dir)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    res.stage("save_bf16", {"dir": bf16_dir, "files": dir_listing(bf16_dir)})
    log(f"saved bf16 checkpoint: {files}")

    # 3. NVFP4 checkpoint into OUT/model (the other layout if the first fails; bf16 as a last resort)
    nvfp4_dir = os.path.join(args.out, "model")
    other = "modelopt" if args.quant_format == "compressed-tensors" else "compressed-tensors"
    for fmt in (args.quant_format, other):
        try:
            quantize_checkpoint(bf16_dir, nvfp4_dir, fmt)
            listing = dir_listing(nvfp4_dir)
            if any(b >= 16 * 10**6 for b in listing.values()):
                reshard(nvfp4_dir)
                listing = dir_listing(nvfp4_dir)
            weights = sum(b for f, b in listing.items() if f.endswith(".safetensors"))
            res.stage("quantize", {"format": fmt, "files": listing, "total_bytes": sum(listing.values()),
                                   "safetensors_bytes": weights})
            log(f"NVFP4 checkpoint ({fmt}): {sum(listing.values()) / 1e6:.2f} MB in {len(listing)} files")
            break
        except Exception as e:  # noqa: BLE001 - keep the training whatever happens
            res.error(f"quantize_{fmt}", e)
            shutil.rmtree(nvfp4_dir, ignore_errors=True)
    else:
        nvfp4_dir = None
        fb = os.path.join(args.out, "bf16")
        shutil.rmtree(fb, ignore_errors=True)
        shutil.copytree(bf16_dir, fb)
        reshard(fb)
        res.stage("bf16_fallback", {"files": dir_listing(fb), "note": "~64 MB: may exceed what the device returns"})
        log(f"quantization failed; bf16 checkpoint written to {fb} instead")
    n_files = len(dir_listing(args.out)) + (0 if os.path.exists(res.path) else 1)
    if n_files > 8:
        log(f"WARNING: {n_files} files under {args.out}: more than the 8 the device returns")

    # 4. evaluation
    from tools import evaluate as ev

    res.stage("unigram", ev.unigram(train_np, eval_chunks, meta["vocab_size"]))
    eval_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    evals = [("hf_bf16", "hf", bf16_dir), ("engine_bf16", "engine", bf16_dir)]
    if nvfp4_dir:
        evals.append(("engine_nvfp4", "engine", nvfp4_dir))
    for name, kind, d in evals:
        if kind == "engine" and args.no_engine:
            continue
        if time.time() - T_START > args.time_limit - 15:
            res.stage(name, {"skipped": "out of time (--time-limit)"})
            continue
        try:
            if kind == "hf":
                m = ev.load_hf(d, eval_dtype, device)
                r = ev.eval_hf(m, eval_chunks, args.eval_batch)
            else:
                m = ev.load_engine(d, eval_dtype, device)
                r = ev.eval_engine(m, eval_chunks, args.eval_batch)
            del m
            r["dtype"] = str(eval_dtype)
            res.stage(name, r)
            log(f"val {name}: loss {r['loss']:.4f} ppl {r['ppl']:.3f} (second half {r['ppl_second_half']:.3f}) "
                f"in {r['seconds']} s")
        except Exception as e:  # noqa: BLE001
            res.error(name, e)
    st = res.data["stages"]
    if "hf_bf16" in st and "engine_bf16" in st:
        d = ev.rel_diff(st["engine_bf16"]["ppl"], st["hf_bf16"]["ppl"])
        res.stage("agreement", {"engine_vs_transformers_ppl_rel": d, "pass": d < 0.005})
        log(f"engine vs transformers (bf16) ppl: {d * 100:.3f} % {'PASS' if d < 0.005 else 'FAIL'} (< 0.5 %)")

    # 5. samples
    try:
        if time.time() - T_START > args.time_limit - 10:
            raise TimeoutError("out of time (--time-limit)")
        samples = {}
        tok = tk.load()
        prompt = tok.encode(FIB_PROMPT, add_special_tokens=False).ids
        stop = (tk.IM_END_ID, tk.EOT_ID)
        m = ev.load_hf(bf16_dir, eval_dtype, device)
        with torch.no_grad():
            gen = m.generate(torch.tensor([prompt], device=device), max_new_tokens=args.sample_tokens,
                             do_sample=False, eos_token_id=list(stop), pad_token_id=tk.EOT_ID)
        samples["hf_bf16_greedy"] = tok.decode(gen[0, len(prompt):].tolist(), skip_special_tokens=False)
        del m
        if not args.no_engine:
            m = ev.load_engine(nvfp4_dir or bf16_dir, eval_dtype, device)
            ids = ev.engine_greedy(m, prompt, args.sample_tokens, stop)
            samples["engine_nvfp4_greedy" if nvfp4_dir else "engine_bf16_greedy"] = tok.decode(
                ids, skip_special_tokens=False)
            del m
        res.stage("samples", {"prompt": FIB_PROMPT, **samples})
        for k, v in samples.items():
            log(f"sample {k}: {FIB_PROMPT}{v}")
    except Exception as e:  # noqa: BLE001
        res.error("samples", e)

    # 6. KL gate (optional)
    try:
        kl_gate_hook(args, bf16_dir, nvfp4_dir, args.heldout, res)
    except Exception as e:  # noqa: BLE001
        res.error("kl_gate", e)

    res.data["out_files"] = dir_listing(args.out)
    res.data["wall_seconds"] = round(time.time() - T_START, 1)
    res.save()
    log(f"done in {res.data['wall_seconds']} s; outputs: {res.data['out_files']}")
    return 0 if not res.data["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
