"""Package layout only; metadata lives in pyproject.toml.

`kernels/` is also the name of a PyPI package that transformers probes for (Hugging Face's
kernel hub), so the folder installs under the import name `linrnn_kernels`; `server/`
installs as `linrnn_server`, `benchmarks/` (its Python code; results/ is data) as `linrnn_bench`. tests/test_layout.py checks that transformers is not fooled.
"""
from setuptools import find_packages, setup

FOLDERS = {
    "linrnn_serve": "linrnn_serve",
    "linrnn_kernels": "kernels",
    "linrnn_server": "server",
    "linrnn_bench": "benchmarks",
}


def _packages(import_name: str, folder: str) -> list[str]:
    return [import_name] + [f"{import_name}.{p}" for p in find_packages(folder)]


setup(
    packages=[p for name, folder in FOLDERS.items() for p in _packages(name, folder)],
    package_dir=FOLDERS,
)
