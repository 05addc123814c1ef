"""`linrnn-serve quantize`: write an NVFP4 copy of a bf16 checkpoint in a real release layout.

    linrnn-serve quantize --in DIR --out DIR --format modelopt|compressed-tensors
                          [--scope experts|experts+shared|all-linear]

Reads any layout our loader reads (sharded or not, `model.language_model.*` names, fused 3-D
experts), streaming one tensor at a time, and writes safetensors shards + index whose names, dtypes
and scales follow the chosen producer (SPEC §2.2 ModelOpt `W4A16_NVFP4`, SPEC §2.3 compressed-tensors
`nvfp4-pack-quantized` / NVFP4A16). Routed experts are always written per expert
(`mlp.experts.{e}.{gate,up,down}_proj.*`), as real exports do, also when the input stores them fused.

Scope (what is quantized; everything else is copied unchanged):
  experts         routed experts
  experts+shared  + the shared expert (default; the layout of nvidia's and RedHat's releases)
  all-linear      + GDN in_proj_qkv / in_proj_z (Qwen3-Next in_proj_qkvz) / out_proj, attention q/k/v/o,
                  Qwen3-Next dense-layer MLPs
Never quantized (SPEC §2.2 table): routers, shared_expert_gate, GDN in_proj_a / in_proj_b (ModelOpt
default-disabled), lm_head, embeddings, norms, conv1d, A_log, dt_bias, MTP and vision tensors.

Global scales of fused siblings are shared so that vLLM, which fuses them into one GEMM with one
global scale, loads them exactly: q/k/v, the shared expert's and dense MLPs' gate/up, GDN in_proj_qkv
+ in_proj_z, and (compressed-tensors only, as llm-compressor does) each expert's gate/up. ModelOpt
keeps per-expert gate/up scales separate (its export only resmooths experts).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections import defaultdict
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from linrnn_kernels.quant import nvfp4
from linrnn_serve.checkpoint.errors import CheckpointError
from linrnn_serve.checkpoint.layout import canonical_name
from linrnn_serve.checkpoint.reader import INDEX, CheckpointReader, tensor_nbytes
from linrnn_serve.config import ModelConfig

log = logging.getLogger(__name__)

FORMATS = ("modelopt", "compressed-tensors")
SCOPES = ("experts", "experts+shared", "all-linear")
PRODUCER = {"name": "linrnn-serve", "version": "0.1.0"}
def _file_mode() -> int:
    """What open() gives the json / tokenizer files written beside the shards (0644 under umask 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


EXPERT_CHUNK = 16  # experts quantized at once from a fused 3-D tensor (bounds f32 temporaries)

_L = r"model\.layers\.(\d+)\."
_EXPERT = re.compile(_L + r"mlp\.experts\.(\d+)\.(gate|up|down)_proj")
_FUSED_EXPERTS = re.compile(_L + r"mlp\.experts\.(gate_up_proj|down_proj)")
_SHARED = re.compile(_L + r"mlp\.shared_expert\.(gate|up|down)_proj")
_DENSE_MLP = re.compile(_L + r"mlp\.(gate|up|down)_proj")
_GDN = re.compile(_L + r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_qkvz|out_proj)")
_ATTN = re.compile(_L + r"self_attn\.(q|k|v|o)_proj")
# Linear modules that stay unquantized whatever the scope (listed in exclude_modules / ignore)
_NEVER = re.compile(_L + r"(mlp\.gate|mlp\.shared_expert_gate|linear_attn\.in_proj_(?:a|b|ba))|lm_head")


def add_arguments(p) -> None:
    p.add_argument("--in", dest="src", required=True, help="bf16 (or f32) HF checkpoint directory")
    p.add_argument("--out", dest="dst", required=True, help="output directory (must not exist, or --overwrite)")
    p.add_argument("--format", required=True, choices=FORMATS, help="on-disk layout of the quantized weights")
    p.add_argument("--scope", default="experts+shared", choices=SCOPES, help="which Linear weights to quantize")
    p.add_argument("--max-shard-size", default="5GB", help="shard size limit, e.g. 5GB, 500MB")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    """User errors (missing or already-quantized input, existing output) raise CheckpointError: the
    console script prints them as one line with exit status 2."""
    quantize_checkpoint(_input_dir(args.src), args.dst, args.format, args.scope, parse_size(args.max_shard_size),
                        overwrite=args.overwrite, progress=not args.no_progress)
    return 0


def _input_dir(src: str) -> str:
    """--in as a directory: preset names are resolved so that `--in default` says what it is."""
    if os.path.isdir(src):
        return src
    from linrnn_serve import presets  # function-local: presets rank above checkpoint

    if src == "default" and presets.default_model_dir():
        return presets.default_model_dir()  # the embedded model: refused below as already quantized
    if src in presets.PRESETS:
        raise CheckpointError(f"--in {src}: a preset name, not a checkpoint directory (write one with "
                              f"`linrnn-serve synth --preset ... --out DIR` first)")
    raise CheckpointError(f"--in {src}: no such checkpoint directory")


def parse_size(s: str | int) -> int:
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", s.upper())
    if not m:
        raise ValueError(f"--max-shard-size {s!r}: expected e.g. 5GB, 500MB, 1000000")
    unit = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9, "T": 1e12, "TB": 1e12,
            "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[m[2]]
    return int(float(m[1]) * unit)


# ---- what gets quantized ---------------------------------------------------------------------------------
def selected(canon_module: str, scope: str) -> bool:
    """Whether a (canonical) Linear module name is quantized under `scope`."""
    if _EXPERT.fullmatch(canon_module):
        return True
    if _SHARED.fullmatch(canon_module):
        return scope != "experts"
    if scope == "all-linear":
        return bool(_GDN.fullmatch(canon_module) or _ATTN.fullmatch(canon_module)
                    or _DENSE_MLP.fullmatch(canon_module))
    return False


def fusion_key(canon_module: str, fmt: str) -> str:
    """Modules sharing one global scale share a key (see module docstring)."""
    m = _ATTN.fullmatch(canon_module)
    if m and m[2] in "qkv":
        return canon_module.rsplit(".", 1)[0] + ".qkv_proj"
    m = _GDN.fullmatch(canon_module)
    if m and m[2] in ("in_proj_qkv", "in_proj_z"):
        return canon_module.rsplit(".", 1)[0] + ".in_proj_qkvz"
    m = _SHARED.fullmatch(canon_module) or _DENSE_MLP.fullmatch(canon_module)
    if m and m[2] in ("gate", "up"):
        return canon_module.rsplit(".", 1)[0] + ".gate_up_proj"
    m = _EXPERT.fullmatch(canon_module)
    if m and m[3] in ("gate", "up") and fmt == "compressed-tensors":
        return canon_module.rsplit(".", 1)[0] + ".gate_up_proj"
    return canon_module


def _spell(canon: str, prefix: str) -> str:
    """Canonical `model.X` back in the source's spelling (`prefix` = 'model.' or 'model.language_model.')."""
    return prefix + canon[len("model."):] if canon.startswith("model.") else canon


class _Source:
    """One source tensor and the Linear modules it holds: [(canonical module, slice fn or None)]."""

    def __init__(self, name: str, cfg: ModelConfig, scope: str):
        self.name = name
        self.canon = canonical_name(name)
        self.prefix = "model.language_model." if name.startswith("model.language_model.") else "model."
        self.modules: list[tuple[str, object]] = []  # (canonical module, how to take it from the tensor)
        self.linear: list[str] = []  # Linear modules (canonical) this tensor holds, quantized or not
        if name.startswith(("mtp.",)) or "visual" in name:
            return
        m = _FUSED_EXPERTS.fullmatch(self.canon)
        if m:
            base = self.canon.rsplit(".", 1)[0]
            E, I = cfg.num_experts, cfg.moe_intermediate_size
            projs = [("gate", slice(0, I)), ("up", slice(I, 2 * I))] if m[2] == "gate_up_proj" else [("down", None)]
            for proj, rows in projs:
                names = [f"{base}.{e}.{proj}_proj" for e in range(E)]
                self.linear += names
                self.modules.append((names, rows))
            return
        if not self.canon.endswith(".weight"):
            return
        mod = self.canon[: -len(".weight")]
        if selected(mod, scope):
            self.modules.append(([mod], None))
            self.linear.append(mod)
        elif _NEVER.fullmatch(mod) or _GDN.fullmatch(mod) or _ATTN.fullmatch(mod) or _SHARED.fullmatch(mod) \
                or _DENSE_MLP.fullmatch(mod):
            self.linear.append(mod)

    def pieces(self, t: torch.Tensor) -> Iterator[tuple[list[str], torch.Tensor]]:
        """(modules, weights [len(modules), N, K]) for the quantized modules of tensor t."""
        for names, rows in self.modules:
            if len(names) == 1 and t.dim() == 2:
                yield names, t[None]
            else:
                yield names, (t if rows is None else t[:, rows])


def _read(reader: CheckpointReader, names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Only the named tensors, one at a time, file by file."""
    by_file = defaultdict(list)
    for n in sorted(names):
        by_file[reader.file_of[n]].append(n)
    for fn, ns in sorted(by_file.items()):
        with safe_open(os.path.join(reader.path, fn), framework="pt", device="cpu") as f:
            for n in ns:
                yield n, f.get_tensor(n)


# ---- the quantizer ------------------------------------------------------------------------------------------
def _quantize(fmt: str, w: torch.Tensor, amax: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantize W [E, N, K] with the fused-group amax [E]; per-matrix tensors by suffix, stacked over E."""
    if w.shape[-1] % nvfp4.BLOCK:
        raise CheckpointError(f"in_features {w.shape[-1]} is not a multiple of {nvfp4.BLOCK}")
    if fmt == "modelopt":
        packed, sb, ws2 = nvfp4.quantize(w, global_amax=amax)
        return {"weight": packed, "weight_scale": sb, "weight_scale_2": ws2}
    gs = nvfp4.compressed_tensors_global_scale(amax)
    packed, sb, g = nvfp4.quantize_compressed_tensors(w, global_scale=gs)
    return {"weight_packed": packed, "weight_scale": sb, "weight_global_scale": g[:, None]}


class _ShardWriter:
    def __init__(self, out: str, max_bytes: int):
        self.out, self.max_bytes = out, max_bytes
        self.buf: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.buf or any(name in names for _, names in self.files):
            raise CheckpointError(f"duplicate output tensor {name}")
        n = tensor_nbytes(t)
        if self.buf and self.size + n > self.max_bytes:
            self.flush()
        self.buf[name] = t.contiguous().clone()  # own storage: safetensors rejects shared views
        self.size += n
        self.total += n

    def flush(self) -> None:
        if not self.buf:
            return
        tmp = f"tmp-{len(self.files):05d}.safetensors"
        save_file(self.buf, os.path.join(self.out, tmp), metadata={"format": "pt"})
        os.chmod(os.path.join(self.out, tmp), _file_mode())  # safetensors writes 0600; the side files are 0644
        self.files.append((tmp, list(self.buf)))
        self.buf, self.size = {}, 0

    def close(self) -> None:
        self.flush()
        n = len(self.files)
        if n == 1:
            os.rename(os.path.join(self.out, self.files[0][0]), os.path.join(self.out, "model.safetensors"))
            return
        weight_map = {}
        for i, (tmp, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(os.path.join(self.out, tmp), os.path.join(self.out, final))
            weight_map.update({k: final for k in names})
        with open(os.path.join(self.out, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)


def quantize_checkpoint(src: str, dst: str, fmt: str, scope: str = "experts+shared", max_shard_bytes: int = 5 * 10**9,
                        overwrite: bool = False, progress: bool = True) -> dict[str, int]:
    """Write the quantized checkpoint; returns counts {"quantized": linears, "kept": unquantized linears}."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: expected one of {FORMATS}")
    if scope not in SCOPES:
        raise ValueError(f"--scope {scope!r}: expected one of {SCOPES}")
    if not os.path.isdir(src):
        raise CheckpointError(f"--in {src}: no such checkpoint directory")
    cfg = ModelConfig.from_pretrained(src)
    if cfg.quantization:
        raise CheckpointError(f"{src}: already quantized (config.json has quantization_config); "
                              f"quantize needs a bf16/f32 checkpoint")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise CheckpointError("--out must differ from --in")
    if os.path.exists(dst):
        if not overwrite:
            raise CheckpointError(f"{dst}: output directory exists (pass --overwrite to replace it)")
        shutil.rmtree(dst)
    os.makedirs(dst)
    reader = CheckpointReader(src)
    sources = {n: _Source(n, cfg, scope) for n in reader.names()}

    # pass 1: amax per quantized module (in the weight's dtype), then per fusion group
    amax: dict[str, torch.Tensor] = {}
    todo = {n for n, s in sources.items() if s.modules}
    with tqdm(total=len(todo), desc="Scanning amax", unit="tensor", disable=not progress) as bar:
        for name, t in _read(reader, todo):
            for names, w in sources[name].pieces(t):
                amax.update(zip(names, w.abs().amax(dim=(-2, -1))))
            bar.update(1)
    group_amax: dict[str, torch.Tensor] = {}
    for mod, a in amax.items():
        k = fusion_key(mod, fmt)
        group_amax[k] = a if k not in group_amax else torch.maximum(group_amax[k], a)

    # pass 2: quantize and write, in source order
    writer = _ShardWriter(dst, max_shard_bytes)
    quantized: list[str] = []
    with tqdm(total=reader.nbytes(), unit="B", unit_scale=True, desc=f"Quantizing ({fmt})",
              disable=not progress) as bar:
        for name, t, _ in reader.iter_tensors():
            s = sources[name]
            if not s.modules:
                writer.add(name, t)
            else:
                for names, w in s.pieces(t):
                    ga = torch.stack([group_amax[fusion_key(m, fmt)] for m in names])
                    for lo in range(0, len(names), EXPERT_CHUNK):
                        chunk = names[lo:lo + EXPERT_CHUNK]
                        try:
                            out = _quantize(fmt, w[lo:lo + len(chunk)], ga[lo:lo + len(chunk)])
                        except CheckpointError as e:
                            raise CheckpointError(f"{src}: tensor {name}: {e}") from None
                        for j, mod in enumerate(chunk):
                            for suffix, q in out.items():
                                writer.add(f"{_spell(mod, s.prefix)}.{suffix}", q[j])
                        quantized += chunk
            bar.update(tensor_nbytes(t))
    writer.close()

    qset = set(quantized)
    kept = sorted({_spell(m, s.prefix) for s in sources.values() for m in s.linear if m not in qset})
    has_mtp = any(n.startswith("mtp.") for n in sources)
    has_visual = any("visual" in n for n in sources)
    _write_configs(src, dst, fmt, kept, has_mtp, has_visual)
    _copy_side_files(src, dst)
    log.info("Wrote %s: %d linears quantized to NVFP4 (%s layout), %d kept unquantized", dst, len(qset), fmt,
             len(kept))
    return {"quantized": len(qset), "kept": len(kept)}


# ---- configs --------------------------------------------------------------------------------------------------
NVFP4A16_WEIGHTS = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
                    "block_structure": None, "dynamic": False, "actorder": None, "scale_dtype": "torch.float8_e4m3fn",
                    "zp_dtype": "torch.float8_e4m3fn", "observer": "minmax", "observer_kwargs": {}}


def modelopt_hf_quant_config(exclude: list[str]) -> dict:
    """hf_quant_config.json of a ModelOpt W4A16_NVFP4 export (SPEC §2.2)."""
    return {"producer": dict(PRODUCER),
            "quantization": {"quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                             "exclude_modules": exclude}}


def modelopt_quantization_config(exclude: list[str]) -> dict:
    """config.json `quantization_config` as ModelOpt's `convert_hf_quant_config_format` writes it."""
    return {"config_groups": {"group_0": {"weights": {"dynamic": False, "num_bits": 4, "type": "float",
                                                      "group_size": 16},
                                          "targets": ["Linear"]}},
            "ignore": exclude, "quant_algo": "W4A16_NVFP4", "group_size": 16, "producer": dict(PRODUCER),
            "quant_method": "modelopt"}


def compressed_tensors_quantization_config(ignore: list[str]) -> dict:
    """config.json `quantization_config` as compressed-tensors' `ModelCompressor.update_config` writes it
    for the NVFP4A16 preset (SPEC §2.3)."""
    return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(NVFP4A16_WEIGHTS),
                                          "input_activations": None, "output_activations": None,
                                          "format": "nvfp4-pack-quantized"}},
            "format": "nvfp4-pack-quantized", "global_compression_ratio": None, "ignore": ignore,
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": "0.20.0"}


def _write_configs(src, dst, fmt, kept, has_mtp, has_visual):
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if fmt == "modelopt":
        exclude = kept + (["mtp*"] if has_mtp else []) + (["model.visual*"] if has_visual else [])
        with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
            json.dump(modelopt_hf_quant_config(exclude), f, indent=4)
        config["quantization_config"] = modelopt_quantization_config(exclude)
    else:
        ignore = kept + (["re:^mtp\\..*"] if has_mtp else []) + (["re:.*visual.*"] if has_visual else [])
        config["quantization_config"] = compressed_tensors_quantization_config(ignore)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


_SKIP = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack)$|" + re.escape(INDEX) + r"|config\.json|"
                   r"hf_quant_config\.json|pytorch_model\.bin\.index\.json")


def _copy_side_files(src, dst):
    """Tokenizer, generation config, chat template, README ...: every other regular file."""
    for fn in sorted(os.listdir(src)):
        p = os.path.join(src, fn)
        if os.path.isfile(p) and not _SKIP.fullmatch(fn):
            shutil.copy2(p, os.path.join(dst, fn))


__all__ = ["add_arguments", "run", "quantize_checkpoint", "selected", "fusion_key", "modelopt_hf_quant_config",
           "modelopt_quantization_config", "compressed_tensors_quantization_config"]
