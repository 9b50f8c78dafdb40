"""The layout's one direction, checked from the source. Bottom up: core -> models, drivers, launch ->
engines -> testing, bench -> sim -> conformance, report -> the faces (plugin, cli); conformance uses only
the workloads of bench and nothing of sim. Inside engines each family of adapters (inprocess, hf, http)
is its own room: it imports the engines' shared modules (base) and itself, never another family.
reference_engine never imports kvbench, and no two modules of kvbench and reference_engine share a file
name. Inside reference_engine: serve and sim -> the engine's core modules (policies/ among them) -> costs
and kernels, which import nothing of the engine above them.

Imports inside functions count too: a lazy import is still an arrow.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: part -> the kvbench parts it may import (itself always allowed)
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "models": {"core"},
    "drivers": {"core"},
    "launch": {"core"},
    # models: an adapter may convert the checkpoint into the format its engine loads (llama.cpp's GGUF)
    "engines": {"core", "drivers", "launch", "models"},
    "testing": {"core", "drivers", "launch", "models"},
    "bench": {"core", "drivers", "engines", "models"},
    "sim": {"core", "drivers", "engines", "bench", "models"},
    "conformance": {"core", "drivers", "engines", "testing", "models", "bench.workloads"},
    "report": {"core", "bench", "sim"},
}
#: the families of adapters, each a subpackage of kvbench.engines that imports no other
ENGINE_FAMILIES = ("inprocess", "hf", "http")
#: the modules of kvbench.engines outside every family: what the families share, and the registry
ENGINES_SHARED = {"kvbench.engines.base", "kvbench.engines.registry"}
#: modules of kvbench allowed to import reference_engine: the in-process adapter, the patched reference
#: server, the simulator's side, the checkpoints (written with the engine's model, noise measured on it), the
#: demo, and the white-box timings of the reference engine's CUDA paths (kvbench measure-gpu)
REFERENCE_ENGINE_USERS = ("kvbench.engines.inprocess.", "kvbench.testing.patched_server", "kvbench.sim.",
                          "kvbench.models.", "kvbench.demo", "kvbench.bench.gpu_measure")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            # "from kvbench import metrics" names a submodule through the package
            names += [f"{node.module}.{a.name}" for a in node.names
                      if node.module == "kvbench" and not a.name.startswith("__")]
    return names


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "kvbench" else None


def _family(module: str) -> str | None:
    """The engines family ``module`` belongs to (``kvbench.drivers.http_client`` -> "http"), or None."""
    parts = module.split(".")
    if len(parts) > 3 and parts[:2] == ["kvbench", "engines"] and parts[2] in ENGINE_FAMILIES:
        return parts[2]
    return None


def _allowed(source_part: str, target: str) -> bool:
    target_rest = target.removeprefix("kvbench.")
    allowed = ALLOWED[source_part] | {source_part}
    return any(target_rest == a or target_rest.startswith(a + ".") for a in allowed)


KVBENCH_FILES = sorted((ROOT / "kvbench").rglob("*.py"))


@pytest.mark.parametrize("path", KVBENCH_FILES, ids=lambda p: _module(p))
def test_kvbench_imports_point_one_way(path: Path) -> None:
    module = _module(path)
    part = _part(module)
    bad = []
    for target in _imports(path):
        if target.startswith("reference_engine") and not module.startswith(REFERENCE_ENGINE_USERS):
            bad.append(target)
        if part in ALLOWED and target.startswith("kvbench.") and _part(target + ".x") and not _allowed(part, target):
            bad.append(target)
    assert not bad, f"{module} ({part}) imports against the layout's direction: {bad}"


ENGINES_FILES = sorted((ROOT / "kvbench" / "engines").rglob("*.py"))


@pytest.mark.parametrize("path", ENGINES_FILES, ids=lambda p: _module(p))
def test_engine_families_never_import_each_other(path: Path) -> None:
    module = _module(path)
    family = _family(module)
    bad = [t for t in _imports(path)
           if t.startswith("kvbench.engines.") and t not in ENGINES_SHARED and _family(t + ".x") != family]
    assert not bad, f"{module} (family {family or 'none: shared'}) imports another family: {bad}"


def test_every_engines_module_is_shared_or_in_a_family() -> None:
    loose = [m for m in map(_module, ENGINES_FILES) if m not in ENGINES_SHARED and _family(m) is None]
    assert not loose, f"modules of kvbench.engines outside {ENGINE_FAMILIES} and {sorted(ENGINES_SHARED)}: {loose}"


def _shared_file_names() -> dict[str, list[str]]:
    by_name: dict[str, list[str]] = defaultdict(list)
    for package in ("kvbench", "reference_engine"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name not in ("__init__.py", "__main__.py"):
                by_name[path.name].append(str(path.relative_to(ROOT)))
    return {name: paths for name, paths in by_name.items() if len(paths) > 1}


def test_every_module_is_named_once() -> None:
    """No two modules of kvbench and reference_engine share a file name: a name finds one file."""
    shared = _shared_file_names()
    assert not shared, f"file names used twice (rename one of each): {shared}"


@pytest.mark.parametrize("path", sorted((ROOT / "reference_engine").rglob("*.py")), ids=lambda p: _module(p))
def test_reference_engine_never_imports_kvbench(path: Path) -> None:
    assert not [t for t in _imports(path) if t == "kvbench" or t.startswith("kvbench.")]


def test_every_kvbench_module_belongs_to_a_part_or_is_a_face() -> None:
    faces = {"kvbench", "kvbench.__main__", "kvbench.cli", "kvbench.plugin", "kvbench.demo", "kvbench.__init__"}
    loose = [_module(p) for p in KVBENCH_FILES
             if _part(_module(p)) is None and _module(p) not in faces and not _module(p).startswith("kvbench.cli.")]
    assert not loose, f"modules outside {sorted(ALLOWED)}: {loose}"


def test_no_name_shadows_a_package() -> None:
    """A function or class named like a top-level package (``reference_engine``, ``kvbench``, ``torch``...)
    hides that package from readers of the module."""
    shadowed = {"reference_engine", "kvbench", "torch", "pandas", "numpy", "jinja2", "pytest", "transformers"}
    hits = []
    for path in KVBENCH_FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in shadowed:
                hits.append(f"{_module(path)}.{node.name}")
    assert not hits


REFERENCE_ENGINE_FILES = sorted((ROOT / "reference_engine").rglob("*.py"))
#: reference_engine's own floors: what stands above the engine's core modules, and what below them
ABOVE_CORE = ("reference_engine.sim", "reference_engine.serve")
BELOW_CORE = "reference_engine.costs"
KERNELS = "reference_engine.kernels"
#: subpackages that are rooms of the engine's core (the scheduler's policies), not floors of their own
CORE_ROOMS = ("policies",)


def _reference_engine_part(module: str) -> str:
    """"costs", "kernels", "sim" or "serve" for a module of those subpackages, "core" for the engine's own
    modules (those of its core rooms included)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] not in CORE_ROOMS else "core"


def _names(target: str, prefix: str) -> bool:
    return target == prefix or target.startswith(prefix + ".")


@pytest.mark.parametrize("path", [p for p in REFERENCE_ENGINE_FILES
                                  if _reference_engine_part(_module(p)) == "core"], ids=lambda p: _module(p))
def test_engine_core_never_imports_the_simulator_or_the_server(path: Path) -> None:
    """The engine stands alone: the simulator and the server are built on it, never the other way
    (the simulator composes the engine's parts; the engine does not know it exists)."""
    bad = [t for t in _imports(path) if any(_names(t, above) for above in ABOVE_CORE)]
    assert not bad, f"{_module(path)} imports above the engine's core: {bad}"


@pytest.mark.parametrize("path", [p for p in REFERENCE_ENGINE_FILES
                                  if _reference_engine_part(_module(p)) == "costs"], ids=lambda p: _module(p))
def test_costs_import_nothing_above_them(path: Path) -> None:
    """Costs (cost model, model shapes, hardware profiles) stand below both the engine and the simulator."""
    bad = [t for t in _imports(path) if _names(t, "reference_engine") and not _names(t, BELOW_CORE)]
    assert not bad, f"{_module(path)} imports above the costs: {bad}"


@pytest.mark.parametrize("path", [p for p in REFERENCE_ENGINE_FILES
                                  if _reference_engine_part(_module(p)) == "kernels"], ids=lambda p: _module(p))
def test_kernels_import_nothing_above_them(path: Path) -> None:
    """Kernels stand below the engine's core: a kernel knows tensors, not the model, the scheduler or the
    engine that use it (what binds a kernel to the model's layers lives in the model)."""
    bad = [t for t in _imports(path) if _names(t, "reference_engine") and not _names(t, KERNELS)]
    assert not bad, f"{_module(path)} imports above the kernels: {bad}"


def test_the_core_rooms_and_kernels_exist() -> None:
    """The rules above name these rooms: a rename that left them checking nothing would fail here."""
    parts = {_reference_engine_part(_module(p)) for p in REFERENCE_ENGINE_FILES}
    assert {"core", "costs", "kernels", "sim", "serve"} <= parts
    assert all((ROOT / "reference_engine" / room).is_dir() for room in CORE_ROOMS)


def test_the_simulator_never_imports_the_server() -> None:
    bad = {_module(p): t for p in REFERENCE_ENGINE_FILES if _reference_engine_part(_module(p)) == "sim"
           for t in _imports(p) if _names(t, "reference_engine.serve")}
    assert not bad


def test_reference_engine_module_names_are_unique() -> None:
    """Within reference_engine a module name means one module (``engine`` is the engine, not also the
    simulator)."""
    faces = {"__init__", "__main__"}
    seen: dict[str, list[str]] = {}
    for path in REFERENCE_ENGINE_FILES:
        if path.stem not in faces:
            seen.setdefault(path.stem, []).append(_module(path))
    assert not {name: mods for name, mods in seen.items() if len(mods) > 1}
