#!/usr/bin/env bash
# The GPU check, in one script, for a lent CUDA machine (written for the workplace's H200 box: python3
# 3.12 with torch 2.11+cu130, triton 3.6, transformers 5.17 preinstalled, and no network).
#
#   OUT=/some/dir bash scripts/gpu_check.sh        # default OUT: ./gpu-out
#
# 1. installs kvbench without touching the machine's packages: `pip install --no-deps
#    --no-build-isolation -e .` (nothing to download; pyproject's torch range, >=2.6,<2.14, admits 2.11
#    anyway); if that fails, the checkout is put on PYTHONPATH (the root conftest loads the plugin).
#    Packages kvbench needs that are missing are listed: the server's (fastapi, uvicorn) only matter to
#    tests that are not marked gpu.
# 2. runs every test marked `gpu` under tests/ and suites/, pytest selecting them (`-m gpu`): the CUDA
#    variants of the engine-output and Triton-kernel tests, and the swap-copy micro-benchmark on CUDA
#    against a plain pinned copy (suites/benchmarks/test_micro.py, measured: its figures in
#    $OUT/micro-benchmarks.json); JUnit XML in $OUT/gpu-tests.xml.
# 3. runs `kvbench measure-gpu`: HBM bandwidth, a ~1B bf16 model's decode step against the HBM
#    roofline, the Triton decode kernel against the torch path, and the preemption storm on the GPU
#    -> $OUT/results.json, $OUT/report.html, $OUT/gpu_measure.json.
# KVBENCH_GPU_DRY_RUN=1 rehearses the whole script on a machine without a GPU (the gpu tests skip,
# measurements --dry-run).
# Everything printed is also in $OUT/gpu_check.log. Meant to finish in under 8 minutes: each step has
# its own time limit. Exit status: non-zero if the gpu tests or the measurements failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
started=$(date +%s)
say() { echo "[gpu_check $(( $(date +%s) - started )) s] $*"; }

say "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || say "nvidia-smi not available"
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'

say "install (no dependencies, no build isolation: nothing is fetched)"
if ! python3 -m pip install --quiet --no-deps --no-build-isolation -e . ; then
  say "pip install failed: using the checkout through PYTHONPATH"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 - <<'PY'
import importlib.util
needed = ["torch", "triton", "safetensors", "numpy", "pandas", "jinja2", "pytest", "pytest_benchmark", "pytest_timeout",
          "packaging", "hypothesis", "tqdm", "transformers", "filelock", "xdist", "fastapi", "uvicorn",
          "prometheus_client", "httpx", "tokenizers"]
missing = [m for m in needed if importlib.util.find_spec(m) is None]
print("missing packages:", ", ".join(missing) or "none")
PY

status=0
say "pytest -m gpu"
# pytest selects the gpu-marked tests wherever they live; exit status 5 (none selected) is not a failure
timeout 240 python3 -m pytest tests suites -m gpu -p no:cacheprovider -q -rs --continue-on-collection-errors \
  --junitxml "$OUT/gpu-tests.xml" --benchmark-json "$OUT/micro-benchmarks.json" || status=$?
[ "$status" -eq 5 ] && status=0
say "pytest -m gpu exit status: $status"

say "measurements"
timeout 300 python3 -m kvbench measure-gpu --out "$OUT" ${KVBENCH_GPU_DRY_RUN:+--dry-run} || { rc=$?; say "kvbench measure-gpu exit status: $rc"; status=$rc; }
rm -rf "$OUT/model"  # the random checkpoint (GBs), if a killed run left it: not worth bringing back
say "done (exit status $status): $OUT"
ls -la "$OUT"
exit "$status"
