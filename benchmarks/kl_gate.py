"""`linrnn-serve kl-gate`: the fidelity gate between a reference and a test configuration of one
checkpoint (BENCH.md "KL gate", llama-perplexity --kl-divergence conventions).

Configurations are comma-separated key=value overrides of the base (--model, --dtype, --device):
  ssm-bf16-tau=T   hybrid recurrent state threshold (inf = all f32)
  model=PATH       another checkpoint of the same model (e.g. its NVFP4 quantization)
  impl=ours|transformers
  dtype=..., device=...
Examples:
  kl-gate --model default --ref ssm-bf16-tau=inf --test ssm-bf16-tau=64
  kl-gate --model ./bf16 --ref impl=ours --test model=./nvfp4
  kl-gate --model default --sweep-tau 0,1,4,16,64,256     (ref: all f32)
Text is split into chunks of n_ctx tokens, each run from an empty state, and only the second half
of each chunk is scored; --ctx sweeps n_ctx to show drift with context length. Scored positions are
decoded token by token by default (see LogprobSource.logprobs).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import os
import time

import torch

from linrnn_bench.kl_stats import KLAccumulator, KLResult, chunks, scored_positions
from linrnn_bench.plotting import pyplot

log = logging.getLogger("kl-gate")


@dataclasses.dataclass
class RunConfig:
    model: str
    tau: float = math.inf
    impl: str = "ours"
    dtype: str = "auto"
    device: str = "auto"

    def label(self) -> str:
        parts = [f"model={os.path.basename(self.model.rstrip('/')) or self.model}"]
        if self.impl != "ours":
            parts.append(f"impl={self.impl}")
        parts.append(f"tau={self.tau:g}")
        return ",".join(parts)


def parse_config(spec: str, base: RunConfig) -> RunConfig:
    cfg = dataclasses.replace(base)
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if "=" not in item:
            raise SystemExit(f"configuration item {item!r} is not key=value")
        k, v = item.split("=", 1)
        if k in ("ssm-bf16-tau", "tau"):
            cfg.tau = float(v)
        elif k == "model":
            cfg.model = v
        elif k == "impl":
            if v not in ("ours", "transformers"):
                raise SystemExit(f"impl must be ours or transformers, got {v!r}")
            cfg.impl = v
        elif k in ("dtype", "device"):
            setattr(cfg, k, v)
        else:
            raise SystemExit(f"unknown configuration key {k!r} (ssm-bf16-tau, model, impl, dtype, device)")
    return cfg


class LogprobSource:
    """Scored-position log-probabilities of one configuration."""

    def __init__(self, cfg: RunConfig, batch: int = 32, scoring: str = "decode"):
        from linrnn_serve.models.loading import load_model, resolve_device, resolve_dtype
        from linrnn_serve.presets import resolve_model

        self.cfg, self.batch, self.scoring = cfg, batch, scoring
        self.resolved = resolve_model(cfg.model)
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        if cfg.impl == "transformers":
            from transformers import AutoModelForCausalLM

            if self.resolved.model_dir is None:
                raise SystemExit("impl=transformers needs a checkpoint directory")
            self.model = AutoModelForCausalLM.from_pretrained(self.resolved.model_dir, dtype=self.dtype).to(
                self.device).eval()
        else:
            self.model = load_model(self.resolved.cfg, self.resolved.model_dir, self.dtype, self.device,
                                    progress=False)
        self.bf16_heads, self.state_note = None, "all f32"
        self.set_tau(cfg.tau)

    def set_tau(self, tau: float) -> None:
        self.cfg.tau = tau
        if self.cfg.impl != "ours":
            return
        from linrnn_serve.classifier import build_head_map

        self.bf16_heads, self.state_note = build_head_map(self.model, tau, checkpoint_dir=self.resolved.model_dir)

    def state_info(self, n_ctx: int) -> dict:
        if self.cfg.impl != "ours":
            return {}
        from linrnn_serve.runner.session import Session

        s = Session(self.model, 1, 16, bf16_heads=self.bf16_heads)
        return {"f32_fraction": s.caches.state.f32_fraction(), "state_bytes_per_seq": s.caches.state.bytes_per_seq()}

    @torch.inference_mode()
    def logprobs(self, chunk_list: list[list[int]], n_ctx: int):
        """Yield (log-probs [n_scored, V] f32 on CPU, targets [n_scored]) per chunk.

        scoring "decode" (default) runs a chunk as serving does: the unscored first half is one prefill,
        then each scored position is a decode step, so it reads recurrent state that was stored in its
        partition's dtype after the previous token (this is where a bf16 state shows). "prefill" runs the
        whole chunk as one prefill (llama-perplexity's way; the state stays f32 inside the kernel).
        """
        first, last = scored_positions(n_ctx)
        for i in range(0, len(chunk_list), self.batch):
            group = chunk_list[i: i + self.batch]
            if self.cfg.impl == "transformers":
                ids = torch.tensor(group, device=self.device)
                lps = list(torch.log_softmax(self.model(ids).logits[:, first:last].float(), -1).cpu())
            else:
                lps = self._ours(group, n_ctx, first, last)
            for c, lp in zip(group, lps):
                yield lp, torch.tensor(c[first + 1: last + 1])

    def _ours(self, group, n_ctx, first, last):
        from linrnn_serve.runner.session import Session

        s = Session(self.model, len(group), n_ctx, bf16_heads=self.bf16_heads)
        sids = [s.new_seq() for _ in group]
        if self.scoring == "prefill":
            rows = [j * n_ctx + p for j in range(len(group)) for p in range(first, last)]
            out = s.forward(sids, group, rows=rows).float()
            return list(torch.log_softmax(out, -1).cpu().view(len(group), last - first, -1))
        steps = [torch.log_softmax(s.forward(sids, [c[: first + 1] for c in group]).float(), -1).cpu()]
        for p in range(first + 1, last):
            steps.append(torch.log_softmax(s.forward(sids, [[c[p]] for c in group]).float(), -1).cpu())
        return list(torch.stack(steps, 1))

    def close(self):
        del self.model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def tokenize_text(resolved, path: str) -> list[int]:
    from tokenizers import Tokenizer

    if resolved.tokenizer_dir is None:
        raise SystemExit("the model has no tokenizer files")
    tok = Tokenizer.from_file(os.path.join(resolved.tokenizer_dir, "tokenizer.json"))
    with open(path, encoding="utf-8") as f:
        return tok.encode(f.read(), add_special_tokens=False).ids


def default_text(resolved) -> str | None:
    for d in (resolved.model_dir, resolved.tokenizer_dir):
        for name in ("kl_gate_text.txt", "heldout.txt", "validation.txt"):
            if d and os.path.isfile(os.path.join(d, name)):
                return os.path.join(d, name)
    return None


def run_gate(ref: LogprobSource | dict, test: LogprobSource, tokens: list[int], ctx_list: list[int],
             max_scored: int, keep_ref: bool = False):
    """Returns ({n_ctx: KLResult}, saved reference {n_ctx: (chunks, f32 log-probs)})."""
    results, saved = {}, {}
    for n_ctx in ctx_list:
        first, last = scored_positions(n_ctx)
        cl = chunks(tokens, n_ctx)[: max(1, max_scored // (last - first))]
        if not cl:
            log.warning("text too short for n_ctx=%d", n_ctx)
            continue
        acc = KLAccumulator()
        ref_lps = []
        if isinstance(ref, dict):
            stored_chunks, stored = ref[n_ctx]
            if stored_chunks != cl:
                raise SystemExit(f"saved reference for n_ctx={n_ctx} was computed on different tokens")
            ref_iter = ((stored[i].float(), torch.tensor(c[first + 1: last + 1])) for i, c in enumerate(cl))
        else:
            ref_iter = ref.logprobs(cl, n_ctx)
        for (lr, tgt), (lt, _) in zip(ref_iter, test.logprobs(cl, n_ctx)):
            acc.add(lr, lt, tgt)
            if keep_ref:
                ref_lps.append(lr.clone())
        results[n_ctx] = acc.result()
        if keep_ref:
            saved[n_ctx] = (cl, torch.stack(ref_lps))
        log.info("n_ctx %d: %s", n_ctx, _fmt(results[n_ctx]))
    return results, saved


class SelfRef:
    """Reference log-probs from the same loaded model at another tau (sweep mode), cached."""

    def __init__(self, source: LogprobSource, tau: float):
        self.source, self.tau, self.cache = source, tau, {}

    def logprobs(self, cl, n_ctx):
        key = (n_ctx, len(cl))
        if key not in self.cache:
            saved_tau = self.source.cfg.tau
            saved_heads = (self.source.bf16_heads, self.source.state_note)
            self.source.set_tau(self.tau)
            # f32: fp16 rounding of log-probs (~1e-3) would swamp the small KLDs being measured
            self.cache[key] = list(self.source.logprobs(cl, n_ctx))
            self.source.cfg.tau = saved_tau
            self.source.bf16_heads, self.source.state_note = saved_heads
        yield from self.cache[key]


def _fmt(r: KLResult) -> str:
    return (f"Mean KLD {r.mean_kld:.3e} +- {r.mean_kld_se:.1e} | p99 {r.kld_p99:.2e} p99.9 {r.kld_p999:.2e} "
            f"max {r.kld_max:.2e} | same top p {100 * r.same_top_p:.3f} +- {100 * r.same_top_p_se:.3f} % | "
            f"RMS dp {100 * r.rms_dp:.3f} % | PPL ref {r.ppl_ref:.4f} test {r.ppl_test:.4f}")


def table(results: dict[int, KLResult], max_kld: float, min_top: float) -> str:
    lines = ["| n_ctx | positions | Mean KLD +- s.e. | KLD p99 | KLD p99.9 | KLD max | Same top p % +- s.e. | "
             "RMS dp % | PPL ref | PPL test | gate |", "|" + "---:|" * 11]
    for n_ctx, r in results.items():
        lines.append(f"| {n_ctx} | {r.n} | {r.mean_kld:.3e} +- {r.mean_kld_se:.1e} | {r.kld_p99:.2e} | "
                     f"{r.kld_p999:.2e} | {r.kld_max:.2e} | {100 * r.same_top_p:.3f} +- {100 * r.same_top_p_se:.3f} | "
                     f"{100 * r.rms_dp:.3f} | {r.ppl_ref:.4f} | {r.ppl_test:.4f} | "
                     f"{'pass' if r.passes(max_kld, min_top) else 'FAIL'} |")
    return "\n".join(lines)


def plot(path: str, series: dict[str, dict[int, KLResult]], title: str) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in series.items():
        xs = list(res)
        a.errorbar(xs, [res[x].mean_kld for x in xs], yerr=[res[x].mean_kld_se for x in xs], marker="o", label=name)
        b.errorbar(xs, [100 * res[x].same_top_p for x in xs], yerr=[100 * res[x].same_top_p_se for x in xs],
                   marker="o", label=name)
    for ax, yl in ((a, "mean KLD (nats)"), (b, "same top p (%)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("n_ctx")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    a.set_yscale("symlog", linthresh=1e-7)  # KLD may be exactly 0 (bit-identical configs)
    a.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="checkpoint dir, preset or HF repo (the base config)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--ref", default="ssm-bf16-tau=inf", help="reference overrides, e.g. ssm-bf16-tau=inf")
    p.add_argument("--test", default=None, help="test overrides, e.g. ssm-bf16-tau=64 or model=./nvfp4")
    p.add_argument("--sweep-tau", default=None, help="comma list of tau values tested against --ref")
    p.add_argument("--text", default=None, help="UTF-8 text file (default: the model's held-out text)")
    p.add_argument("--ctx", default="256,1024,2048,4096", help="comma list of n_ctx values")
    p.add_argument("--max-scored", type=int, default=32768, help="scored positions per n_ctx at most")
    p.add_argument("--batch", type=int, default=32, help="chunks run together")
    p.add_argument("--scoring", choices=["decode", "prefill"], default="decode",
                   help="decode: prefill the unscored half, decode the scored half token by token (as served: "
                        "the recurrent state round-trips through its partition dtype); prefill: one prefill per chunk")
    p.add_argument("--max-mean-kld", type=float, default=1e-3)
    p.add_argument("--min-same-top-p", type=float, default=0.995, help="fraction, e.g. 0.995")
    p.add_argument("--save-ref", default=None, help="save the reference log-probs (f32) to this file")
    p.add_argument("--compare-ref", default=None, help="use reference log-probs saved by --save-ref")
    p.add_argument("--out", default=None, help="directory for JSON, markdown and PNG results")


def run(args) -> int:
    base = RunConfig(model=args.model, dtype=args.dtype, device=args.device)
    ctx_list = [int(c) for c in args.ctx.split(",")]
    out_dir = args.out
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    ref_cfg = parse_config(args.ref, base)
    t0 = time.time()
    report = {"args": vars(args), "ref": ref_cfg.label(), "runs": []}
    plots: list[tuple[str, dict, str]] = []  # drawn after the JSON / markdown are written
    tables: list[str] = []

    if args.sweep_tau:
        taus = [float(t) for t in args.sweep_tau.split(",")]
        src = LogprobSource(dataclasses.replace(ref_cfg), args.batch, args.scoring)
        text = args.text or default_text(src.resolved)
        if not text:
            raise SystemExit("no --text given and the model ships no held-out text")
        tokens = tokenize_text(src.resolved, text)
        ref = SelfRef(src, ref_cfg.tau)
        series, rows = {}, []
        for tau in taus:
            src.set_tau(tau)
            info = src.state_info(ctx_list[0])
            res, _ = run_gate(ref, src, tokens, ctx_list, args.max_scored)
            ok = all(r.passes(args.max_mean_kld, args.min_same_top_p) for r in res.values())
            rows.append({"tau": tau, **info, "pass": ok, "results": {k: v.to_dict() for k, v in res.items()}})
            series[f"tau={tau:g} (f32 {100 * info['f32_fraction']:.0f}%)"] = res
            print(f"tau={tau:g}: f32 heads {100 * info['f32_fraction']:.1f} %, state "
                  f"{info['state_bytes_per_seq'] / 2**20:.2f} MiB/seq, gate {'pass' if ok else 'FAIL'}", flush=True)
            print(table(res, args.max_mean_kld, args.min_same_top_p), flush=True)
            tables.append(f"tau={tau:g}: f32 heads {100 * info['f32_fraction']:.1f} %, gate {'pass' if ok else 'FAIL'}"
                          f"\n\n{table(res, args.max_mean_kld, args.min_same_top_p)}\n")
        passing = [r for r in rows if r["pass"]]
        best = min(passing, key=lambda r: r["f32_fraction"]) if passing else None
        report.update(sweep=rows, picked_tau=best["tau"] if best else None)
        print(f"picked tau: {best['tau']:g} (f32 fraction {100 * best['f32_fraction']:.1f} %)" if best
              else "no tau passes the gate")
        tables.append(f"picked tau: {best['tau']:g}\n" if best else "no tau passes the gate\n")
        plots.append((os.path.join(out_dir or "", "kl_tau_sweep.png"), series,
                      f"KL gate tau sweep vs {ref_cfg.label()}"))
        status = 0 if best else 1
    else:
        if not args.test and not args.save_ref:
            raise SystemExit("give --test (or --sweep-tau, or --save-ref to only store the reference)")
        if args.compare_ref:
            saved = torch.load(args.compare_ref)
            ref = saved["ctx"]
            report["ref"] = saved["label"]
            resolved_from = None
        else:
            ref = LogprobSource(ref_cfg, args.batch, args.scoring)
            resolved_from = ref.resolved
        test = LogprobSource(parse_config(args.test, base), args.batch, args.scoring) if args.test else None
        resolved = resolved_from or test.resolved
        text = args.text or default_text(resolved)
        if not text:
            raise SystemExit("no --text given and the model ships no held-out text")
        tokens = tokenize_text(resolved, text)
        if test is None:  # only store the reference
            res, saved = run_gate(ref, ref, tokens, ctx_list, args.max_scored, keep_ref=True)
        else:
            res, saved = run_gate(ref, test, tokens, ctx_list, args.max_scored, keep_ref=bool(args.save_ref))
            report["test"] = test.cfg.label()
        if args.save_ref:
            torch.save({"label": ref_cfg.label(), "ctx": saved}, args.save_ref)
        print(table(res, args.max_mean_kld, args.min_same_top_p))
        report["runs"].append({k: v.to_dict() for k, v in res.items()})
        ok = all(r.passes(args.max_mean_kld, args.min_same_top_p) for r in res.values())
        report["pass"] = ok
        print(f"KL gate {'PASS' if ok else 'FAIL'} (mean KLD < {args.max_mean_kld:g}, same top p >= "
              f"{100 * args.min_same_top_p:g} % at every n_ctx)")
        tables.append(table(res, args.max_mean_kld, args.min_same_top_p) + "\n")
        plots.append((os.path.join(out_dir or "", "kl_gate.png"), {report.get("test", "ref"): res},
                      f"KL gate: {report.get('test', '')} vs {report['ref']}"))
        status = 0 if ok else 1
    report["seconds"] = time.time() - t0
    if out_dir:
        with open(os.path.join(out_dir, "kl_gate.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
        with open(os.path.join(out_dir, "kl_gate.md"), "w") as f:
            f.write(f"ref: {report['ref']}  \ntest: {report.get('test')}\n\n" + "\n".join(tables))
        for path, series, title in plots:  # last: an optional extra must not cost the results
            plot(path, series, title)
    return status
