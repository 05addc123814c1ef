# Source on the GPU machine (repo root as cwd): installs the carried wheels (.whl/) into /tmp/site
# and exposes the repo's packages under their import names without building anything there.
#   . tools/device_env.sh
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
ROOT=$(pwd)
for pair in linrnn_serve:linrnn_serve linrnn_kernels:kernels linrnn_server:server linrnn_bench:benchmarks; do
  ln -sfn "$ROOT/${pair#*:}" "/tmp/site/${pair%%:*}"
done
export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
linrnn-serve() { python3 -m linrnn_serve "$@"; }
python3 - <<'PY'
import torch, triton, transformers, fastapi, uvicorn, pydantic, openai
print(f"device: {torch.cuda.get_device_name(0)} | torch {torch.__version__} | triton {triton.__version__} | "
      f"transformers {transformers.__version__} | fastapi {fastapi.__version__} | openai {openai.__version__}")
try:  # uvicorn's fast event loop and HTTP parser (pyproject dependencies; wheels in .whl/)
    import httptools, uvloop
    print(f"uvloop {uvloop.__version__} | httptools {httptools.__version__}")
except ImportError as e:
    print("uvloop / httptools missing (uvicorn falls back to asyncio + h11):", e)
try:
    import fla
    print("fla-core", fla.__version__)
except Exception as e:  # the peer is optional
    print("fla-core unavailable:", e)
PY
set +e
