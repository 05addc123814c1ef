"""Which projection of a quantized checkpoint is stored how: `QuantPlan` (SPEC §2.2, §2.3).

`QuantPlan.from_model_config(cfg)` parses `cfg.quantization` (config.json `quantization_config`, or
the legacy ModelOpt `hf_quant_config.json` under {"hf_quant_config": ...}) and answers
`format_of(hf_module)` with a storage-format class (layers/linear.py DenseWeights, layers/quant.py
Nvfp4Weights / Fp8Weights) for the names the model asks about:
  model.layers.{i}.linear_attn.in_proj_{qkv,z,b,a} | out_proj, model.layers.{i}.self_attn.{q,k,v,o}_proj,
  model.layers.{i}.mlp.experts (all routed experts of the layer), model.layers.{i}.mlp.shared_expert.*,
  model.layers.{i}.mlp.{gate,up,down}_proj (Qwen3-Next dense layers), lm_head.
Qwen3-Next checkpoints name in_proj_qkvz / in_proj_ba: in_proj_qkv and in_proj_z are answered from
in_proj_qkvz, in_proj_b / in_proj_a from in_proj_ba. Names are matched with and without the Qwen3.5
`model.language_model.` prefix.

Supported:
  ModelOpt (quant_method "modelopt", or hf_quant_config.json): quant_algo NVFP4, W4A16_NVFP4, FP8,
    FP8_PER_CHANNEL_PER_TOKEN, MIXED_PRECISION (per-layer `quantized_layers`; layers not listed are
    unquantized). Exclusion (`exclude_modules` / `ignore`) follows vLLM's `is_layer_excluded`: exact
    name, substring, fnmatch wildcard, `module*` also meaning `module` + `module.*`; anything under a
    visual / vision_tower / vision_model prefix is unquantized.
  compressed-tensors (quant_method "compressed-tensors"): formats nvfp4-pack-quantized (weights
    num_bits 4, float, tensor_group, group_size 16) and float-quantized / naive-quantized FP8
    (strategy tensor or channel), per group or mixed-precision. Targets and `ignore` entries match as
    compressed-tensors' `match_name` does: exact module name, or "re:<regex>" with re.match (anchored at
    the start only), and the class name "Linear" matches every projection (names beat classes).
Activation quantization is ignored (weight-only kernels); FP8 KV-cache scales are ignored.
Anything else fails with ConfigError naming the field.
"""
from __future__ import annotations

import fnmatch
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from linrnn_serve.config import ConfigError, ModelConfig
from linrnn_serve.layers.linear import DenseWeights
from linrnn_serve.layers.quant import COMPRESSED_TENSORS, MODELOPT, Fp8Weights, Nvfp4Weights

log = logging.getLogger(__name__)

# scheme keys -> storage formats
NVFP4, FP8, FP8_CHANNEL = "nvfp4", "fp8", "fp8-channel"
MODELOPT_ALGOS = {"NVFP4": NVFP4, "W4A16_NVFP4": NVFP4, "FP8": FP8, "FP8_PER_CHANNEL_PER_TOKEN": FP8_CHANNEL}
VISION_MARKERS = ("visual", "vision_tower", "vision_model")
_LANG = "model.language_model."


# ---- module names ----------------------------------------------------------------------------------
def model_module_names(cfg: ModelConfig) -> list[str]:
    """Every projection name the model asks `format_of` about (see models/qwen3_5_moe.py)."""
    out = []
    for i in range(cfg.num_hidden_layers):
        P = f"model.layers.{i}."
        if cfg.layer_types[i] == "linear_attention":
            out += [P + f"linear_attn.in_proj_{p}" for p in ("qkv", "z", "b", "a")] + [P + "linear_attn.out_proj"]
        else:
            out += [P + f"self_attn.{p}_proj" for p in ("q", "k", "v", "o")]
        if cfg.is_moe_layer(i):
            out.append(P + "mlp.experts")
            if cfg.shared_expert_intermediate_size:
                out += [P + f"mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")]
        else:
            out += [P + f"mlp.{p}_proj" for p in ("gate", "up", "down")]
    return out + ["lm_head"]


def checkpoint_module(cfg: ModelConfig, name: str) -> str:
    """Our module name -> the HF Linear that holds it (Qwen3-Next fuses GDN input projections)."""
    if cfg.model_type == "qwen3_next":
        for ours, theirs in (("in_proj_qkv", "in_proj_qkvz"), ("in_proj_z", "in_proj_qkvz"),
                             ("in_proj_b", "in_proj_ba"), ("in_proj_a", "in_proj_ba")):
            if name.endswith("linear_attn." + ours):
                return name[: -len(ours)] + theirs
    return name


def name_candidates(name: str) -> tuple[str, ...]:
    """The spellings a checkpoint config may use for one module (Qwen3.5 nests the text model)."""
    if name.startswith("model.layers."):
        return name, _LANG + name[len("model."):]
    if name.startswith(_LANG):
        return name, "model." + name[len(_LANG):]
    return (name,)


def expert_names(module: str, num_experts: int) -> list[str]:
    """Per-expert Linear names of `...mlp.experts`, sampled at the first, middle and last expert
    (configs never split one layer's experts; the loader rejects a checkpoint that does)."""
    picks = sorted({0, num_experts // 2, num_experts - 1})
    return [f"{module}.{e}.{p}_proj" for e in picks for p in ("gate", "up", "down")]


# ---- matchers ----------------------------------------------------------------------------------------
class VllmExcludeMatcher:
    """vLLM `ModelOptQuantConfigBase.is_layer_excluded` (+ `apply_vllm_mapper`'s `module*` expansion),
    precompiled: exact, substring (also after stripping `language_model.`), fnmatch wildcards."""

    def __init__(self, patterns: list[str]):
        expanded = []
        for p in patterns:
            if len(p) >= 2 and p[-1] == "*" and p[-2] != ".":
                expanded += [p[:-1], p[:-1] + ".*"]
            else:
                expanded.append(p)
        self.patterns = expanded
        self.exact = set(expanded)
        self._substr = re.compile("|".join(re.escape(p) for p in expanded)) if expanded else None
        self._glob = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in expanded)) if expanded else None

    def __call__(self, name: str) -> bool:
        if not self.patterns:
            return False
        if name in self.exact:
            return True
        stripped = name.removeprefix("language_model.")
        if self._substr.search(name) or self._substr.search(stripped):
            return True
        return bool(self._glob.match(name))


class CtNameMatcher:
    """compressed-tensors `match_name` over a list: exact names, or "re:<regex>" via re.match."""

    def __init__(self, patterns: list[str]):
        self.exact = {p for p in patterns if not p.startswith("re:")}
        regs = [p[3:] for p in patterns if p.startswith("re:")]
        try:
            self._re = re.compile("|".join(f"(?:{r})" for r in regs)) if regs else None
        except re.error as e:
            raise ConfigError(f"quantization_config: invalid 're:' pattern ({e})") from None

    def __call__(self, name: str) -> bool:
        return name in self.exact or bool(self._re and self._re.match(name))


# ---- the plan ----------------------------------------------------------------------------------------
@dataclass
class QuantPlan:
    """Per-module storage formats of one checkpoint, from two rules over checkpoint module names:
    `excluded(name)` (exclude_modules / ignore) and `scheme_of(name)` -> NVFP4, FP8, FP8_CHANNEL or
    None (unquantized)."""

    cfg: ModelConfig
    method: str  # MODELOPT or COMPRESSED_TENSORS
    description: str
    excluded: Callable[[str], bool]
    scheme_of: Callable[[str], str | None]
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        layout = MODELOPT if self.method == MODELOPT else COMPRESSED_TENSORS
        self.formats = {None: DenseWeights, NVFP4: Nvfp4Weights.for_layout(layout), FP8: Fp8Weights,
                        FP8_CHANNEL: Fp8Weights.per_channel()}

    # ---- queries --------------------------------------------------------------------------------
    def scheme_for(self, name: str) -> str | None:
        """Scheme key of one of our module names (model_module_names)."""
        module = checkpoint_module(self.cfg, name)
        if not module.endswith(".mlp.experts"):
            return self._lookup(module)
        if any(self.excluded(c) for c in name_candidates(module)):  # vLLM checks the FusedMoE prefix
            return None
        found = {n: self._lookup(n) for n in expert_names(module, self.cfg.num_experts)}
        if len(set(found.values())) > 1:
            listed = ", ".join(f"{n}: {s or 'unquantized'}" for n, s in found.items())
            raise ConfigError(f"quantization_config: the routed experts of {module} do not share one format "
                              f"({listed}); per-expert formats are not supported")
        return next(iter(found.values()))

    def _lookup(self, module: str) -> str | None:
        cands = name_candidates(module)
        if any(self.excluded(c) for c in cands):
            return None
        found = {self.scheme_of(c) for c in cands} - {None}
        if len(found) > 1:
            raise ConfigError(f"quantization_config gives {module} two formats ({sorted(found)}) under its "
                              f"spellings {cands}")
        return found.pop() if found else None

    def format_of(self, name: str) -> type:
        """Storage-format class for one of our module names (called while building the model)."""
        return self.formats[self.scheme_for(name)]

    def counts(self) -> dict[str, Counter]:
        """{"linears": Counter(scheme -> non-expert projections), "experts": Counter(scheme -> layers)}."""
        lin, exp = Counter(), Counter()
        for n in model_module_names(self.cfg):
            (exp if n.endswith(".mlp.experts") else lin)[self.scheme_for(n) or "dense"] += 1
        return {"linears": lin, "experts": exp}

    def summary(self) -> str:
        """e.g. 'modelopt NVFP4, 242 exclude_modules entries; nvfp4: 96 linears + routed experts of 48
        layers (73728 linears), dense: 144 linears'."""
        c = self.counts()
        E = self.cfg.num_experts
        parts = []
        for k in sorted(set(c["linears"]) | set(c["experts"]), key=lambda k: (k == "dense", k)):
            what = [f"{c['linears'][k]} linears"] if c["linears"][k] else []
            if c["experts"][k]:
                n = c["experts"][k]
                what.append(f"routed experts of {n} layers ({n * E * 3} linears)")
            parts.append(f"{k}: " + " + ".join(what))
        return f"{self.description}; " + ", ".join(parts)

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> "QuantPlan":
        plan = cls.from_config(cfg.quantization or {}, cfg)
        log.info("Quantized checkpoint: %s", plan.summary())
        for note in plan.notes:
            log.info("Quantized checkpoint: %s", note)
        return plan

    @classmethod
    def from_config(cls, qcfg: dict[str, Any], cfg: ModelConfig) -> "QuantPlan":
        if not isinstance(qcfg, dict):
            raise ConfigError(f"quantization_config must be an object, got {type(qcfg).__name__}")
        if "hf_quant_config" in qcfg:  # legacy ModelOpt side file (config.py)
            return _modelopt_plan(cls, qcfg["hf_quant_config"], cfg, "hf_quant_config.json")
        method = str(qcfg.get("quant_method", "")).lower().replace("_", "-")
        if method.startswith("modelopt"):
            return _modelopt_plan(cls, qcfg, cfg, "quantization_config")
        if method == "compressed-tensors":
            return _compressed_tensors_plan(cls, qcfg, cfg)
        raise ConfigError(f"quantization_config.quant_method {qcfg.get('quant_method')!r} is not supported "
                          f"(supported: modelopt, compressed-tensors)")


# ---- ModelOpt ------------------------------------------------------------------------------------------
def _modelopt_plan(cls, raw: dict, cfg: ModelConfig, where: str) -> QuantPlan:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object")
    if "quantization" in raw:  # hf_quant_config.json (or config.json in that shape)
        q = raw["quantization"]
        if not isinstance(q, dict):
            raise ConfigError(f"{where}.quantization must be an object")
        where = f"{where}.quantization"
        exclude = q.get("exclude_modules") or []
        exclude_key = "exclude_modules"
    else:  # config.json quantization_config in compressed-tensors style
        q = raw
        exclude = q.get("ignore") or []
        exclude_key = "ignore"
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise ConfigError(f"{where}.{exclude_key} must be a list of module names / wildcards")
    algo = str(q.get("quant_algo") or "").upper()
    if not algo:
        raise ConfigError(f"{where}.quant_algo is missing")
    notes = []
    if q.get("kv_cache_quant_algo") or q.get("kv_cache_scheme"):
        notes.append("FP8 KV-cache scales (k_scale/v_scale) are ignored; the KV cache stays in the model dtype")
    excluded = VllmExcludeMatcher(exclude)

    def check_group_size(gs, field_name):
        if gs not in (None, 16):
            raise ConfigError(f"{field_name} {gs!r} is not supported (NVFP4 uses group_size 16)")

    if algo == "MIXED_PRECISION":
        layers = q.get("quantized_layers")
        if not isinstance(layers, dict) or not layers:
            raise ConfigError(f"{where}.quantized_layers must be a non-empty mapping for quant_algo MIXED_PRECISION")
        per_layer = {}
        for name, info in layers.items():
            a = str((info or {}).get("quant_algo", "")).upper()
            if a not in MODELOPT_ALGOS:
                raise ConfigError(f"{where}.quantized_layers[{name!r}].quant_algo {a or None!r} is not supported "
                                  f"(supported: {', '.join(MODELOPT_ALGOS)})")
            if MODELOPT_ALGOS[a] == NVFP4:
                check_group_size(info.get("group_size"), f"{where}.quantized_layers[{name!r}].group_size")
            per_layer[name] = MODELOPT_ALGOS[a]
        # a module's own entry, else one above it (e.g. "...mlp.experts" for a per-expert Linear), else the
        # entries below it when they agree (vLLM `_resolve_quant_algo`)
        children: dict[str, set] = {}
        for name, s in per_layer.items():
            parts = name.split(".")
            for j in range(1, len(parts)):
                children.setdefault(".".join(parts[:j]), set()).add(s)

        def algo_of(name: str) -> str | None:
            parts = name.split(".")
            for j in range(len(parts), 0, -1):
                hit = per_layer.get(".".join(parts[:j]))
                if hit is not None:
                    return hit
            below = children.get(name)
            return next(iter(below)) if below and len(below) == 1 else None
        counts = Counter(per_layer.values())
        desc = f"modelopt MIXED_PRECISION ({', '.join(f'{k} x{v}' for k, v in sorted(counts.items()))} entries)"
    elif algo in MODELOPT_ALGOS:
        if MODELOPT_ALGOS[algo] == NVFP4:
            check_group_size(q.get("group_size"), f"{where}.group_size")
        scheme = MODELOPT_ALGOS[algo]

        def algo_of(name: str) -> str | None:
            return scheme
        desc = f"modelopt {algo}"
    else:
        raise ConfigError(f"{where}.quant_algo {algo!r} is not supported "
                          f"(supported: {', '.join(list(MODELOPT_ALGOS) + ['MIXED_PRECISION'])})")
    if algo in ("NVFP4", "MIXED_PRECISION"):
        notes.append("NVFP4 activation scales are ignored: weight-only kernels (bf16 activations)")

    def excluded_or_vision(name: str) -> bool:
        return excluded(name) or any(m in name for m in VISION_MARKERS)

    return QuantPlan(cfg, MODELOPT, desc + f", {len(exclude)} {exclude_key} entries", excluded_or_vision, algo_of,
                     notes)


# ---- compressed-tensors --------------------------------------------------------------------------------
_CT_FORMATS = ("nvfp4-pack-quantized", "float-quantized", "naive-quantized")


def _ct_group_scheme(name: str, group: dict, fmt: str | None) -> str:
    where = f"quantization_config.config_groups.{name}"
    if not isinstance(group, dict):
        raise ConfigError(f"{where} must be an object")
    fmt = group.get("format") or fmt
    w = group.get("weights")
    if not isinstance(w, dict):
        raise ConfigError(f"{where}.weights is missing (weight quantization is required)")
    if fmt not in _CT_FORMATS:
        raise ConfigError(f"{where}: format {fmt!r} is not supported (supported: {', '.join(_CT_FORMATS)})")
    if w.get("type", "int") != "float":
        raise ConfigError(f"{where}.weights.type {w.get('type')!r} is not supported (only 'float')")
    if w.get("symmetric", True) is not True:
        raise ConfigError(f"{where}.weights.symmetric must be true (asymmetric weights are not supported)")
    if w.get("dynamic", False) not in (False, None):
        raise ConfigError(f"{where}.weights.dynamic {w.get('dynamic')!r} is not supported")
    if w.get("actorder") not in (None, False):
        raise ConfigError(f"{where}.weights.actorder {w.get('actorder')!r} is not supported")
    bits, strategy = w.get("num_bits"), w.get("strategy")
    if bits == 4:
        if fmt != "nvfp4-pack-quantized":
            raise ConfigError(f"{where}: 4-bit float weights need format 'nvfp4-pack-quantized', got {fmt!r}")
        if strategy != "tensor_group":
            raise ConfigError(f"{where}.weights.strategy {strategy!r} is not supported for FP4 "
                              f"(NVFP4 is 'tensor_group')")
        if w.get("group_size") != 16:
            raise ConfigError(f"{where}.weights.group_size {w.get('group_size')!r} is not supported (NVFP4: 16)")
        return NVFP4
    if bits == 8:
        if fmt == "nvfp4-pack-quantized":
            raise ConfigError(f"{where}: format 'nvfp4-pack-quantized' with 8-bit weights")
        if strategy == "tensor":
            return FP8
        if strategy == "channel":
            return FP8_CHANNEL
        raise ConfigError(f"{where}.weights.strategy {strategy!r} is not supported for FP8 (tensor, channel)")
    raise ConfigError(f"{where}.weights.num_bits {bits!r} is not supported (4: NVFP4, 8: FP8)")


def _compressed_tensors_plan(cls, q: dict, cfg: ModelConfig) -> QuantPlan:
    fmt = q.get("format")
    for key in ("sparsity_config", "transform_config"):
        if q.get(key):
            raise ConfigError(f"quantization_config.{key} is not supported (found {q[key]!r})")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError("quantization_config.config_groups must be a non-empty object")
    ignore = q.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise ConfigError("quantization_config.ignore must be a list of module names / 're:' patterns")
    by_name: list[tuple[CtNameMatcher, str]] = []  # name / regex targets, in order
    by_class: list[str] = []
    for gname, group in groups.items():
        scheme = _ct_group_scheme(gname, group, fmt if fmt != "mixed-precision" else None)
        targets = group.get("targets")
        if not isinstance(targets, list) or not targets:
            raise ConfigError(f"quantization_config.config_groups.{gname}.targets must be a non-empty list")
        for t in targets:
            if t == "Linear" or t.endswith("Linear"):  # class targets: every projection is an nn.Linear
                by_class.append(scheme)
            elif t[:1].isupper() and "." not in t and not t.startswith("re:"):
                raise ConfigError(f"quantization_config.config_groups.{gname}.targets: class target {t!r} "
                                  f"is not supported (only 'Linear')")
            else:
                by_name.append((CtNameMatcher([t]), scheme))
    ignored = CtNameMatcher(ignore)
    notes = []
    if q.get("kv_cache_scheme"):
        notes.append("FP8 KV-cache scales (k_scale/v_scale) are ignored; the KV cache stays in the model dtype")
    if any(isinstance(g, dict) and g.get("input_activations") for g in groups.values()):
        notes.append("activation quantization is ignored: weight-only kernels (bf16 activations)")

    def scheme_of(name: str) -> str | None:
        for match, scheme in by_name:
            if match(name):
                return scheme
        return by_class[0] if by_class else None

    desc = f"compressed-tensors {fmt} ({len(groups)} config groups, {len(ignore)} ignore entries)"
    return QuantPlan(cfg, COMPRESSED_TENSORS, desc, ignored, scheme_of, notes)


__all__ = ["QuantPlan", "model_module_names", "checkpoint_module", "VllmExcludeMatcher", "CtNameMatcher",
           "NVFP4", "FP8", "FP8_CHANNEL"]
