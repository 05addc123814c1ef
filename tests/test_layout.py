"""Package layout rules (DESIGN.md): import names, and imports that flow one way."""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# import name -> folder; each may import only packages of a lower rank
PACKAGES = {"linrnn_kernels": "kernels", "linrnn_serve": "linrnn_serve", "linrnn_server": "server",
            "linrnn_bench": "benchmarks"}
# within linrnn_serve: server -> engine -> runner/scheduler -> models -> layers -> kernels
RANK = {
    "linrnn_kernels": 0,
    "linrnn_serve.config": 1, "linrnn_serve.batch": 1, "linrnn_serve.sampling_params": 1,
    "linrnn_serve.engine.outputs": 1, "linrnn_serve.engine.errors": 1, "linrnn_serve.byte_level": 1, "linrnn_serve.parallel": 1,
    "linrnn_serve.engine_args": 1, "linrnn_serve.generation_config": 1,
    "linrnn_serve.cache": 2, "linrnn_serve.layers": 2,
    "linrnn_serve.checkpoint": 3, "linrnn_serve.models": 3, "linrnn_serve.classifier": 4,
    "linrnn_serve.presets": 4,
    "linrnn_serve.runner": 5, "linrnn_serve.scheduler": 5,
    "linrnn_serve.engine": 6, "linrnn_serve.llm": 7,
    "linrnn_server": 8, "linrnn_bench": 8,
    "linrnn_serve.cli": 9, "linrnn_serve.__main__": 9,
}


def _rank(mod: str) -> int | None:
    best = None
    for prefix, r in RANK.items():
        if mod == prefix or mod.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, r)
    return None if best is None else best[1]


def _module_name(path: pathlib.Path) -> str:
    for name, folder in PACKAGES.items():
        base = ROOT / folder
        if base in path.parents:
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            return ".".join([name, *parts])
    raise ValueError(path)


def _top_level_imports(path: pathlib.Path):
    """Module-level imports (function-local imports are allowed lazily for optional paths)."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_imports_flow_one_way():
    bad = []
    for folder in PACKAGES.values():
        for path in (ROOT / folder).rglob("*.py"):
            if "results" in path.parts:
                continue
            me = _module_name(path)
            my_rank = _rank(me)
            if my_rank is None:
                continue
            for imp in _top_level_imports(path):
                r = _rank(imp)
                if r is not None and r > my_rank:
                    bad.append(f"{me} (rank {my_rank}) imports {imp} (rank {r})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_kernels_package_never_imports_linrnn_serve():
    """Not even lazily inside functions."""
    for path in (ROOT / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("linrnn_serve") for n in names), f"{path} imports linrnn_serve"


def test_transformers_not_fooled_by_kernels_folder():
    """`kernels` is a PyPI package transformers probes for (hub kernels). Run from the repository root,
    where `kernels/` is importable by path: transformers must still see no hub-kernels package (it
    checks installed metadata), and its Qwen3.5 model, decorated with hub-kernel hooks, must run."""
    code = ("import torch, transformers.utils.import_utils as iu; "
            "from transformers import Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM; "
            "assert not iu.is_kernels_available(); "
            "import importlib.metadata as md; "
            "ok = False\ntry: md.version('kernels')\nexcept md.PackageNotFoundError: ok = True\n"
            "assert ok; "
            "c = Qwen3_5MoeTextConfig(vocab_size=32, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, "
            "num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, "
            "linear_key_head_dim=8, linear_value_head_dim=8, moe_intermediate_size=8, "
            "shared_expert_intermediate_size=8, num_experts=4, num_experts_per_tok=2); "
            "m = Qwen3_5MoeForCausalLM(c); m(torch.tensor([[1, 2, 3]])); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "linrnn_serve", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "synth" in out.stdout and "kl-gate" in out.stdout
