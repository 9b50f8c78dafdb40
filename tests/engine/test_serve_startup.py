"""What a server start-up costs: the reference server's HTTP process imports no torch (its engine runs in a
process of its own), the engine process imports no FastAPI, and a small checkpoint is built without the
meta device (whose first use imports torch._dynamo, ~1.2 s). kvbench's ``server`` adapter starts a server
per knob set, so these seconds are paid once per knob set of a run (docs/engines.md, "Reusing servers").

Each import check runs in a fresh interpreter: this test process has long imported everything.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    done = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, check=True)
    return set(done.stdout.split())


def test_the_http_process_imports_no_torch():
    loaded = _modules_after("import reference_engine.serve.command_line, reference_engine.serve.app, uvicorn")
    assert "fastapi" in loaded, "the probe imported the HTTP stack"
    assert "torch" not in loaded, "the server's HTTP process would pay torch's import (its engine is elsewhere)"


def test_the_engine_process_imports_no_http_stack():
    # what the spawned engine process imports to reach its entry point (the pickled _engine_main)
    loaded = _modules_after("import reference_engine.serve.engine_process")
    assert "fastapi" not in loaded and "uvicorn" not in loaded


def test_reference_engine_names_llm_engine_on_first_use():
    loaded = _modules_after("import reference_engine")
    assert "torch" not in loaded
    loaded = _modules_after("from reference_engine import LLMEngine, RequestRejected\n"
                            "from reference_engine.engine import RequestRejected as R\nassert R is RequestRejected")
    assert "torch" in loaded


def test_a_small_checkpoint_is_built_without_the_meta_device(tiny_ckpt):
    loaded = _modules_after(f"from reference_engine.model import load_model; load_model({tiny_ckpt!r})")
    assert "torch._dynamo" not in loaded, "meta tensors' decompositions imported torch._dynamo"


def test_both_ways_of_building_load_the_same_model(tiny_ckpt, monkeypatch: pytest.MonkeyPatch):
    from reference_engine import model as model_module

    direct = model_module.load_model(tiny_ckpt)
    monkeypatch.setattr(model_module, "BUILD_ON_META_ABOVE_BYTES", 0)  # every checkpoint counts as large
    via_meta = model_module.load_model(tiny_ckpt)
    a, b = direct.state_dict(), via_meta.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].device.type == "cpu" and torch.equal(a[name], b[name]), name
    for got in (direct, via_meta):  # the RoPE tables are buffers outside the state dict
        assert torch.equal(got.model.rotary_emb.cos, direct.model.rotary_emb.cos)
        assert not got.model.rotary_emb.cos.is_meta
