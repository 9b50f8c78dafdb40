#!/usr/bin/env bash
# Installs everything kvbench needs on a fresh machine: the package with its dependencies, with
# torch held to the CPU build 2.13.0 by constraints/cpu.txt (pyproject.toml only asks for a range,
# so that `pip install` into an engine's environment keeps its own torch) and, where we are root
# on Debian/Ubuntu, Chromium for the report's browser tests, and the real peers (vLLM's CPU build and llama.cpp's
# llama-server, once per machine in ~/.cache/kvbench/peers/{vllm,llamacpp}, found again by every clone: see
# scripts/peers.sh). Idempotent.
# KVBENCH_CONSTRAINTS=FILE uses other pins (an empty value: none, keep whatever torch is installed).
set -euo pipefail
cd "$(dirname "$0")/.."
constraints="${KVBENCH_CONSTRAINTS-constraints/cpu.txt}"
# Real peers, each in its own environment, made once per machine (scripts/peers.sh): the test command runs a
# conformance subset against vLLM's CPU build where the platform allows it (Linux x86_64 with AVX2), and against
# llama.cpp's llama-server, built from the llama-cpp-python source distribution where cmake and a C++ compiler are
# (the first build: 7.6 minutes on an idle 2-core machine, about 17 minutes of CPU; skipped afterwards).
# KVBENCH_PEERS= (empty) makes none; a peer that cannot be made here is said, and its tests skip saying why.
# They are made side by side with each other and with kvbench's own install: the build keeps both cores busy,
# while the installs mostly unpack files, so on a fresh machine the set-up takes about the build's time instead
# of the sum (a fresh 2-core machine: vLLM's environment 2.7 minutes, then the build 7.6, one after the other).
peer_jobs=()
for peer in ${KVBENCH_PEERS-vllm llamacpp}; do
  { bash scripts/peers.sh "$peer" || echo "bootstrap: peer $peer not made; its tests will be skipped" >&2; } &
  peer_jobs+=("$!")
done
python3 -m pip install --quiet --disable-pip-version-check ${constraints:+-c "$constraints"} -e ".[dev]"
for job in "${peer_jobs[@]}"; do
  wait "$job"
done
# TCMalloc: the reference server's engine process runs on it where the system has it (--engine-malloc auto),
# and vLLM's preload=tcmalloc asks for it; without it both use the system's malloc
if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4 >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null) \
    || echo "bootstrap: could not install libtcmalloc-minimal4; the reference server uses the system's malloc" >&2
fi
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing Chromium for the report's browser tests" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "bootstrap: could not install chromium; the browser tests will be skipped" >&2
  else
    echo "bootstrap: chromium not found and not root: the browser tests will be skipped" >&2
  fi
fi
