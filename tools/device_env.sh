# Source on the GPU machine (repo root as cwd): installs the carried wheels (.whl/) into /tmp/site
# and exposes the repo's packages under their import names without building anything there.
#   . tools/device_env.sh
set -e
# once per machine (a script that sources this per stage, as gpu_ttft.sh -> gpu_prefix.sh does, paid ~10 s a time)
WHEELS_KEY=$(ls .whl | md5sum | cut -c1-16)
if [ "$(cat /tmp/site/.wheels_key 2>/dev/null)" != "$WHEELS_KEY" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  echo "$WHEELS_KEY" > /tmp/site/.wheels_key
fi
ROOT=$(pwd)
for pair in linrnn_serve:linrnn_serve linrnn_kernels:kernels linrnn_server:server linrnn_bench:benchmarks; do
  ln -sfn "$ROOT/${pair#*:}" "/tmp/site/${pair%%:*}"
done
export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
linrnn-serve() { python3 -m linrnn_serve "$@"; }
if [ -z "$LINRNN_ENV_CHECKED" ]; then  # the versions line, once per shell tree (importing them takes seconds)
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
export LINRNN_ENV_CHECKED=1
fi
set +e
