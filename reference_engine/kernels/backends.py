"""Which path each ``EngineConfig.*_backend`` setting resolves to on a device: one table, one resolver.

Every setting offers plain torch paths (always runnable: the oracle, and for attention the sliced path),
one or more kernels, and ``"auto"``. The rule is the same for all three settings:

- a plain path is used as asked;
- a kernel asked for by name runs where it can, and is refused otherwise with a ``ValueError`` that names
  the setting, the value and why (the wrong device, or the kernel's own reason: no compiler, no oneDNN
  kernels for the dtype, triton not importable), and what to use instead;
- ``"auto"`` takes the first kernel of the table that auto picks on this device (and dtype) and can run,
  else that kernel's fallback path (after one warning naming why, where the table says to warn); a device
  no kernel is picked on gets the first plain path.

A kernel's availability is asked of its own module, imported only when asked, so resolving ``"torch"``
never imports triton or builds C++. (The table reads the elementwise kernels' dtypes from their module at
import: that module builds its C++ on first use, not when imported.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from reference_engine.kernels.cpu_elementwise import DTYPES as ELEMENTWISE_DTYPES

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernel:
    """One kernel a backend setting may name, and how ``"auto"`` treats it."""

    name: str  # the setting's value that names it: "cpp", "triton", "onednn"
    devices: tuple[str, ...]  # device types it may run on (asked by name elsewhere: refused)
    why_not: Callable[[torch.device, torch.dtype], str]  # "" when it can run here (may build it on first call)
    auto_devices: tuple[str, ...]  # device types "auto" picks it on
    auto_dtypes: tuple[torch.dtype, ...] | None = None  # dtypes "auto" tries it in (None: any); others: fallback
    fallback: str = "torch"  # what "auto" uses where it cannot run
    fallback_note: str | None = None  # logged after the reason when "auto" falls back; None: silent
    names_dtype: bool = False  # a refusal says "cannot run in <dtype>" (the kernel's support is per dtype)
    elsewhere: str = "'torch' or 'auto'"  # what a refusal for the wrong device suggests
    instead: str = "'torch' or 'auto'"  # what a refusal for the kernel's own reason suggests


@dataclass(frozen=True)
class Backend:
    """One backend setting: the plain paths it offers and its kernels, in the order "auto" tries them."""

    plain: tuple[str, ...]
    kernels: tuple[Kernel, ...]


def _cpu_attention_why_not(device: torch.device, dtype: torch.dtype) -> str:
    from reference_engine.kernels import cpu_attention  # builds the C++ kernel on first use

    # cpu_kernel_available logs the reason once when the build fails, as "auto" falls back to sliced
    return "" if cpu_attention.cpu_kernel_available() else cpu_attention.why_unavailable()


def _triton_why_not(device: torch.device, dtype: torch.dtype) -> str:
    from reference_engine.kernels import triton_attention  # imports triton only when asked

    return "" if triton_attention.triton_available(device) else triton_attention.why_unavailable(device)


def _onednn_why_not(device: torch.device, dtype: torch.dtype) -> str:
    from reference_engine.kernels import cpu_linear

    return cpu_linear.why_unavailable(dtype)


def _cpu_elementwise_why_not(device: torch.device, dtype: torch.dtype) -> str:
    from reference_engine.kernels import cpu_elementwise  # builds the C++ kernels on first use

    return cpu_elementwise.why_unavailable(dtype)


#: the settings, by ``EngineConfig`` field: each value of that field's accepted list but "auto" appears here
BACKENDS: dict[str, Backend] = {
    # decode attention; prefills always take the torch path. The interpreter would run triton on the CPU,
    # but far too slowly to be picked by "auto".
    "attention_backend": Backend(("torch", "sliced"), (
        Kernel("cpp", ("cpu",), _cpu_attention_why_not, auto_devices=("cpu",), fallback="sliced",
               elsewhere="'triton' or 'auto'", instead="'sliced' or 'auto'"),
        Kernel("triton", ("cuda", "cpu"), _triton_why_not, auto_devices=("cuda",)),
    )),
    "linear_backend": Backend(("torch",), (
        Kernel("onednn", ("cpu",), _onednn_why_not, auto_devices=("cpu",), names_dtype=True,
               fallback_note="matmuls use torch's plain path"),
    )),
    "elementwise_backend": Backend(("torch",), (
        Kernel("cpp", ("cpu",), _cpu_elementwise_why_not, auto_devices=("cpu",),
               auto_dtypes=ELEMENTWISE_DTYPES, names_dtype=True,
               fallback_note="RMSNorm and SwiGLU use the torch path"),
    )),
}


def resolve_backend(setting: str, choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """The path ``setting`` (a key of :data:`BACKENDS`, e.g. ``"attention_backend"``) set to ``choice``
    takes on ``device`` in ``dtype``: a plain path or a kernel's name, never ``"auto"``. Raises
    ``ValueError`` naming the setting and why when a kernel asked for by name cannot run here."""
    if setting not in BACKENDS:
        raise ValueError(f"backend setting {setting!r} is unknown: expected one of {sorted(BACKENDS)}")
    backend = BACKENDS[setting]
    if choice in backend.plain:
        return choice
    if choice == "auto":
        for kernel in backend.kernels:
            if device.type not in kernel.auto_devices:
                continue
            if kernel.auto_dtypes is not None and dtype not in kernel.auto_dtypes:
                return kernel.fallback
            why = kernel.why_not(device, dtype)
            if not why:
                return kernel.name
            if kernel.fallback_note is not None:
                _log.warning("%s=auto: %s; %s", setting, why, kernel.fallback_note)
            return kernel.fallback
        return backend.plain[0]
    for kernel in backend.kernels:
        if kernel.name != choice:
            continue
        if device.type not in kernel.devices:
            runs_on = " or ".join(d.upper() for d in kernel.devices)
            raise ValueError(f"{setting}={choice!r} runs on the {runs_on}, not on {device}; use {kernel.elsewhere}")
        why = kernel.why_not(device, dtype)
        if why:
            where = f" in {dtype}" if kernel.names_dtype else ""
            raise ValueError(f"{setting}={choice!r} cannot run{where}: {why}; use {kernel.instead}")
        return choice
    accepted = (*backend.plain, *(k.name for k in backend.kernels), "auto")
    raise ValueError(f"{setting}={choice!r} is invalid: expected one of {accepted}")
