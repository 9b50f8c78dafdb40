"""A third-party adapter, installed as a package would be, drives the real conformance suite.

The adapter is the example of docs/engines.md, taken from that page itself (so the documented code is
the tested code). "Installed" = a ``.dist-info`` folder with ``entry_points.txt`` beside the module on
``PYTHONPATH``: what ``importlib.metadata`` finds for a pip-installed distribution, without pip or a
network. Both live under ``tmp_path`` and go with it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvbench.engines import registry
from kvbench.engines.registry import EngineSpecError, parse_engine_spec

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]


def documented_example() -> str:
    """The code block that follows ``<!-- example-adapter: toy_engines.py -->`` in docs/engines.md."""
    found = re.search(r"<!-- example-adapter: toy_engines.py -->\n```python\n(.*?)```",
                      (ROOT / "docs" / "engines.md").read_text(), re.S)
    assert found, "docs/engines.md lost its example adapter (marker <!-- example-adapter: toy_engines.py -->)"
    return found.group(1)


@pytest.fixture
def toy_package(tmp_path: Path) -> Path:
    """A folder holding the module and its distribution metadata, as site-packages would."""
    root = tmp_path / "site"
    root.mkdir()
    (root / "toy_engines.py").write_text(documented_example())
    info = root / "toy_engines-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-engines\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvbench.engines]\ntoy = toy_engines:ToyAdapter\n")
    return root


def test_the_installed_kind_is_found_and_its_options_checked_by_the_engine(toy_package, monkeypatch):
    monkeypatch.syspath_prepend(str(toy_package))
    assert registry.engine_kinds()["toy"] == "toy_engines:ToyAdapter"
    assert parse_engine_spec("toy:preemption_mode=swap").options == {"preemption_mode": "swap"}
    with pytest.raises(EngineSpecError, match=r"EngineConfig.preemption_mode='swapp' is invalid"):
        parse_engine_spec("toy:preemption_mode=swapp")
    with pytest.raises(EngineSpecError, match=r"toy has no option 'block_size'"):
        parse_engine_spec("toy:block_size=16")


def test_the_conformance_suite_runs_on_the_installed_adapter(toy_package, pytester: pytest.Pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(toy_package))
    result = pytester.runpytest_subprocess(
        str(ROOT / "suites" / "conformance" / "test_equivalence.py"), "-v", "-p", "no:cacheprovider",
        "--engine", "toy:preemption_mode=swap", "-k", "recompute_preemption_equivalence",
        "--report-dir", str(pytester.path / "out"), "--rootdir", str(ROOT))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_recompute_preemption_equivalence?toy:preemption_mode=swap? PASSED*",
                                 "*toy:preemption_mode=swap: 1 passed*",
                                 "*toy:preemption_mode=swap: the checks' knob preemption_mode replaced the option "
                                 "value swap in 1 check(s): recompute_preemption_equivalence (recompute)*"])
    (run,) = (pytester.path / "out").iterdir()
    data = json.loads((run / "results.json").read_text())
    (record,) = data["conformance"]
    assert record["engine"] == "toy:preemption_mode=swap" and record["kind"] == "toy"
    assert record["check"] == "recompute_preemption_equivalence" and record["outcome"] == "passed"
    assert record["evidence"]["preemptions_recompute"] > 0  # the toy's own counter proved it
    assert record["knob_overrides"] == {"preemption_mode": ["swap", "recompute"]}
    assert data["engines"] == [{"name": "toy:preemption_mode=swap", "kind": "toy",
                                "options": {"preemption_mode": "swap"},
                                "capabilities": ["chunked_prefill", "prefix_caching", "recompute", "swap"]}]


def test_the_class_by_import_path_needs_no_registration(toy_package, pytester: pytest.Pytester, monkeypatch):
    (toy_package / "toy_engines-0.1.dist-info" / "entry_points.txt").unlink()
    monkeypatch.setenv("PYTHONPATH", str(toy_package))
    pytester.makepyfile("""
        def test_engine(engine):
            assert type(engine).__name__ == "ToyAdapter" and engine.options == {"preemption_mode": "swap"}
    """)
    result = pytester.runpytest_subprocess("-v", "-p", "no:benchmark", "--kvbench-model", str(pytester.path),
                                           "--engine", "toy_engines:ToyAdapter:preemption_mode=swap")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_engine?toy_engines:ToyAdapter:preemption_mode=swap? PASSED*"])
    bad = pytester.runpytest_subprocess("--engine", "toy:preemption_mode=swap")  # no longer registered
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*unknown engine kind 'toy'*"])
