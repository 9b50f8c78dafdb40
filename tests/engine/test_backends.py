"""The backend table (:mod:`reference_engine.kernels.backends`) builds nothing until a kernel is asked for:
resolving a plain path in a fresh interpreter imports neither torch's C++ extension tooling nor triton, and
the elementwise kernels' dtypes that ``auto`` tries are the kernels' own definition, not a copy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from reference_engine.kernels import cpu_elementwise
from reference_engine.kernels.backends import BACKENDS, resolve_backend

ROOT = Path(__file__).resolve().parents[2]


def test_resolving_a_plain_path_builds_and_imports_no_kernel() -> None:
    code = ("import sys, torch\n"
            "from reference_engine.kernels.backends import resolve_backend\n"
            "for setting in ('attention_backend', 'linear_backend', 'elementwise_backend'):\n"
            "    assert resolve_backend(setting, 'torch', torch.device('cpu'), torch.float32) == 'torch'\n"
            "print(' '.join(sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          check=True)
    loaded = set(done.stdout.split())
    assert "reference_engine.kernels.backends" in loaded, "the probe resolved through the table"
    assert "torch.utils.cpp_extension" not in loaded, "resolving 'torch' reached the C++ build tooling"
    assert "triton" not in loaded


def test_auto_tries_the_elementwise_kernels_in_their_own_dtypes() -> None:
    (kernel,) = BACKENDS["elementwise_backend"].kernels
    assert kernel.auto_dtypes is cpu_elementwise.DTYPES
    # a dtype the kernels do not take falls back before anything is built
    assert resolve_backend("elementwise_backend", "auto", torch.device("cpu"), torch.float16) == "torch"
