"""Faults injected into real vLLM, and kvbench's checks shown failing on them.

``--engine "server:preset=vllm,fault=NAME"`` launches vLLM with one function of its V1 scheduler, KV-cache
manager or metrics replaced (:mod:`kvbench.launch.vllm_faults`). The first tests hold the hook itself without
vLLM: the option's validation, the launch environment, and the start-up hook reaching spawned and forked
processes of a stand-in ``vllm`` package. Then, with vLLM's environment (``bash scripts/peers.sh vllm``), each
fault's function exists in the installed vLLM, and the conformance check that guards the property runs
against the faulted server as a user runs it (``pytest suites/conformance --engine server:preset=vllm,fault=NAME
--kvbench-expectations vllm -k CHECK``, in a subprocess, judged from its ``results.json``): it must fail, for
the reason that names the property, and the server's log must show that the fault fired in the process it
patches. A fault the check does not catch is a finding about kvbench, kept as a strict expected failure
that says why (:class:`NotCaught`), never as a pass.

Each case starts vLLM once or twice (about a minute each on 2 cores). The default run takes the cases of
:data:`CI_FAULTS` (three vLLM starts); ``KVBENCH_VLLM_FAULTS=all`` runs every case, and
``KVBENCH_VLLM_FAULTS=name,name`` the ones named. Skipped, saying why, where vLLM's CPU build is missing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvbench.engines.http.server import ServerAdapter
from kvbench.launch.vllm_faults import FAULT_ENV, FAULTS, HOOK_DIR, LOG_PREFIX, fault_environment, fired_in
from kvbench.launch.vllm_faults.hook import kvbench_vllm_faults as hook

ROOT = Path(__file__).resolve().parents[2]
#: the environment variable that widens the default run: "all", or fault names separated by commas
SELECT_ENV = "KVBENCH_VLLM_FAULTS"


# ------------------------------------------------------------------------------ the option, without vLLM
def test_an_unknown_fault_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"option fault: unknown vLLM fault 'nope'; the faults: (\w+, )+\w+") as info:
        ServerAdapter.validate_options({"preset": "vllm", "fault": "nope"})
    assert all(name in str(info.value) for name in FAULTS)


def test_a_fault_is_for_preset_vllm_only():
    with pytest.raises(ValueError, match=r"option fault is for preset=vllm"):
        ServerAdapter.validate_options({"preset": "reference", "fault": "ignores_abort"})


def test_the_launch_carries_the_hook_and_the_fault(tmp_path, monkeypatch):
    """The launch environment of a faulted vLLM: the hook's folder first on PYTHONPATH (ahead of what the
    server would have had), the fault named; part of the launch key, so no plain server is reused for it.
    ``cmd=`` stands in for vLLM's launcher, so no vLLM is needed."""
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    spec = {"preset": "vllm", "cmd": "python -m some.server --port {port}", "log_dir": str(tmp_path)}
    faulted = ServerAdapter(str(tmp_path), {**spec, "fault": "ignores_abort"})
    plain = ServerAdapter(str(tmp_path), spec)
    assert faulted.env_overrides["PYTHONPATH"].split(os.pathsep) == [str(HOOK_DIR), "/somewhere/else"]
    assert faulted.env_overrides[FAULT_ENV] == "ignores_abort"
    assert faulted.describe()["fault"]["name"] == "ignores_abort"
    assert FAULT_ENV not in plain.env_overrides
    from kvbench.engines.base import Knobs

    assert faulted.launch_key(Knobs()) != plain.launch_key(Knobs())


def test_fault_environment_keeps_an_empty_pythonpath_out():
    assert fault_environment("ignores_abort", {})["PYTHONPATH"] == str(HOOK_DIR)


def test_every_fault_patches_the_function_its_catalogue_names():
    for name, fault in FAULTS.items():
        patched = [(module, qualname) for module, qualname, _ in hook._PATCHES[name]]
        assert (fault.module, fault.qualname) in patched, f"{name}: the catalogue and the patches disagree"
    assert set(hook._PATCHES) == set(FAULTS)


def test_docs_list_every_vllm_fault():
    page = (ROOT / "docs" / "checks.md").read_text(encoding="utf-8")
    section = page[page.index("## Faults in real vLLM"):]
    for name, fault in FAULTS.items():
        row = next((line for line in section.splitlines() if line.startswith(f"| `{name}` ")), None)
        assert row is not None, f"docs/checks.md's vLLM fault table has no row for {name}"
        assert fault.qualname in row and fault.check in row, f"{name}'s row names another function or check: {row}"


# ------------------------------------------------------------------------------ the hook, on a stand-in vLLM
_STAND_IN = {
    "vllm/__init__.py": "",
    "vllm/v1/__init__.py": "",
    "vllm/v1/core/__init__.py": "",
    "vllm/v1/core/block_pool.py": """
        class Block:
            def __init__(self, ref_cnt):
                self.ref_cnt, self.is_null = ref_cnt, False

        class BlockPool:
            def touch(self, blocks):
                for b in blocks:
                    b.ref_cnt += 1

            def free_blocks(self, blocks):
                for b in blocks:
                    b.ref_cnt -= 1
        """,
}

_PROBE = """
    import multiprocessing as mp
    import sys


    def counts():
        from vllm.v1.core.block_pool import Block, BlockPool
        held = Block(1)
        BlockPool().touch([held])  # a hit on a held block: the fault takes no reference
        return held.ref_cnt


    def child(queue):
        queue.put(counts())


    if __name__ == "__main__":
        for method in ("spawn", "fork"):  # the parent imports nothing of vllm before either start
            ctx = mp.get_context(method)
            queue = ctx.Queue()
            process = ctx.Process(target=child, args=(queue,), name=f"child-{method}")
            process.start()
            print(method, queue.get(timeout=60))
            process.join(60)
        print("parent", counts())
    """


def _stand_in(tmp_path: Path) -> Path:
    for rel, text in _STAND_IN.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    (tmp_path / "probe.py").write_text(textwrap.dedent(_PROBE))
    return tmp_path


def _run_hooked(tmp_path: Path, fault: str | None, *argv: str, pythonpath: list[Path] | None = None):
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in [HOOK_DIR, *(pythonpath or []), tmp_path])
    if fault is not None:
        env[FAULT_ENV] = fault
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=120)


def test_the_hook_patches_spawned_and_forked_processes(tmp_path):
    """vLLM starts its EngineCore with multiprocessing, spawn or fork (``VLLM_WORKER_MULTIPROC_METHOD``):
    the fault must reach the process either way, and say so in its log."""
    done = _run_hooked(_stand_in(tmp_path), "hit_takes_no_reference", "probe.py")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["spawn", "1", "fork", "1", "parent", "1"], done.stdout  # no reference taken
    fired = fired_in(done.stderr, "hit_takes_no_reference")
    assert {re.search(r"pid \d+, ([\w-]+)\)", line).group(1) for line in fired} == \
        {"child-spawn", "child-fork", "MainProcess"}, done.stderr


def test_without_a_fault_the_hook_changes_nothing(tmp_path):
    done = _run_hooked(_stand_in(tmp_path), None, "probe.py")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["spawn", "2", "fork", "2", "parent", "2"], done.stdout
    assert LOG_PREFIX not in done.stderr


def test_the_hook_refuses_an_unknown_fault_at_start_up(tmp_path):
    done = _run_hooked(tmp_path, "nope", "-c", "print('ran')")
    assert done.returncode == 2 and "ran" not in done.stdout
    assert "'nope' is not a vLLM fault" in done.stderr


def test_the_hook_runs_the_sitecustomize_it_shadows(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_RAN'] = 'yes'\n")
    done = _run_hooked(tmp_path, "ignores_abort", "-c", "import os; print(os.environ.get('SHADOWED_RAN'))",
                       pythonpath=[other])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "yes"
    assert f"{LOG_PREFIX} ignores_abort armed" in done.stderr


# ------------------------------------------------------------------------------ real vLLM
def _vllm_python() -> Path | None:
    """vLLM's interpreter, or None (the peers script's record, or $KVBENCH_VLLM)."""
    from kvbench.launch.peers import PeerMissing, find_vllm

    try:
        install = find_vllm()
    except PeerMissing:
        return None
    python = Path(install.launcher[0])
    return python if python.name.startswith("python") else None


def _vllm_ready() -> str | None:
    """None when vLLM's environment is there; else why not (the peers script's own words)."""
    if os.environ.get("KVBENCH_VLLM"):
        return None
    done = subprocess.run(["bash", str(ROOT / "scripts" / "peers.sh"), "vllm", "--check"], capture_output=True,
                          text=True, cwd=ROOT)
    return None if done.returncode == 0 else (done.stderr.strip() or f"peers.sh exited {done.returncode}")


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    why = _vllm_ready()
    python = _vllm_python() if why is None else None
    if python is None:
        pytest.skip(f"vLLM's CPU build is not available here: {why or 'no vLLM interpreter found'}")
    return python


@pytest.mark.slow
def test_every_fault_names_a_function_of_the_installed_vllm(vllm_python):
    """The functions the faults replace exist in the vLLM kvbench launches (a new release that renames one
    fails here, not as a check that passes on an unfaulted server)."""
    script = "import importlib, json, sys\nout = {}\n" + "".join(
        f"m = importlib.import_module({module!r})\n"
        f"o = m\nfor part in {qualname!r}.split('.'): o = getattr(o, part, None)\n"
        f"out[{module + '.' + qualname!r}] = callable(o)\n"
        for patches in hook._PATCHES.values() for module, qualname, _ in patches) + "print(json.dumps(out))\n"
    done = subprocess.run([str(vllm_python), "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found and all(found.values()), f"missing in the installed vLLM: {[k for k, v in found.items() if not v]}"


class NotCaught(AssertionError):
    """The check did not fail on vLLM with the fault in effect: a finding about kvbench."""


@dataclass(frozen=True)
class Case:
    """A fault and the check that must catch it: ``select``, the ``-k`` expression that runs just that check;
    ``match``, what its failure must say; ``where``, the vLLM process the fault must fire in."""

    fault: str
    select: str
    match: str
    where: str
    finding: str | None = None  # why kvbench misses it, where it does (the case is then a strict xfail)


ENGINE_CORE, FRONT_END = "EngineCore", "MainProcess"

CASES = [
    Case("resume_keeps_computed_tokens", "recompute_preemption_equivalence", r"differ from the ground truth",
         ENGINE_CORE),
    Case("eviction_keeps_hash", "recompute_preemption_equivalence", r"differ from the ground truth", ENGINE_CORE),
    Case("registers_block_under_wrong_hash", "prefix_caching_equivalence_and_hits", r"differ from the ground truth",
         ENGINE_CORE),
    # caught by vLLM dying under it (the next request is refused), not by a token mismatch
    Case("hit_takes_no_reference", "shared_blocks_survive_pressure_from_outside",
         r"differ from the ground truth|ConnectError|Connection refused", ENGINE_CORE),
    # the early-abort check reads what an ignored abort leaves: the aborted requests still waiting in the engine
    Case("ignores_abort", "an_abort_before_the_first_token_stops_the_request",
         r"still counted \d+ waiting requests after every aborted one was closed", ENGINE_CORE),
    Case("preemptions_counted_twice", "counts_told_twice_agree",
         r"request_preemptions=\d+ .*but the engine's preemption count is \d+", FRONT_END),
    Case("prefix_hits_counted_twice", "prefix_caching_equivalence_and_hits",
         r"prefix_cache_hits=\d+ but the responses' cached tokens add up to \d+", ENGINE_CORE),
    Case("generation_tokens_overcounted", "counts_told_twice_agree",
         r"generated_tokens=\d+ but the output tokens received = \d+", FRONT_END),
]
#: the faults the default run takes: three vLLM starts in all (the prefix check starts one with caching off, one on)
CI_FAULTS = ("resume_keeps_computed_tokens", "registers_block_under_wrong_hash")


def _failure_messages(junit: Path) -> dict[str, str]:
    """Test name -> its whole failure message, from a pytest ``--junitxml`` report."""
    import xml.etree.ElementTree as ET

    if not junit.exists():
        return {}
    messages = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failure = case.find("failure")
        if failure is not None:
            messages[case.get("name", "")] = f"{failure.get('message', '')}\n{failure.text or ''}"
    return messages


def _selected(fault: str) -> bool:
    wanted = os.environ.get(SELECT_ENV, "")
    return fault in CI_FAULTS or wanted == "all" or fault in wanted.split(",")


def _case(case: Case):
    marks = [pytest.mark.xfail(raises=NotCaught, strict=True, reason=case.finding)] if case.finding else []
    return pytest.param(case, id=case.fault, marks=marks)


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.parametrize("case", [_case(c) for c in CASES])
def test_the_check_fails_on_vllm_with_the_fault(case: Case, vllm_python, tmp_path: Path) -> None:
    if not _selected(case.fault):
        pytest.skip(f"{case.fault}: not in the default run ({', '.join(CI_FAULTS)}); "
                    f"{SELECT_ENV}=all or {SELECT_ENV}={case.fault} runs it")
    logs, reports = tmp_path / "logs", tmp_path / "reports"
    cmd = [sys.executable, "-m", "pytest", "suites/conformance", "-p", "no:cacheprovider", "-q",
           "--engine", f"server:preset=vllm,fault={case.fault},log_dir={logs}", "--kvbench-expectations", "vllm",
           "-k", case.select, "--report-dir", str(reports), "--timeout", "600",
           "--junitxml", str(tmp_path / "junit.xml")]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1500)
    said = f"{' '.join(cmd)}\nexited {done.returncode}:\n" + "\n".join(done.stdout.splitlines()[-30:])
    results = sorted(reports.glob("*/results.json"))
    assert results, f"no results.json was written:\n{said}\n{done.stderr[-2000:]}"
    records = [r for r in json.loads(results[0].read_text())["conformance"] if r["check"].startswith(case.select)]
    assert records, f"{case.select} did not run:\n{said}"
    # the fault must have been in effect, in the process it patches, before the check's verdict means anything
    log = "\n".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.log")))
    fired = fired_in(log, case.fault)
    assert fired, f"{case.fault} never fired in the server: the run proves nothing about it\n{said}"
    assert any(f", {case.where}" in line for line in fired), f"{case.fault} fired elsewhere than {case.where}: {fired}"
    # caught: the check failed saying what the fault broke (a failure for another reason, a stale pin say,
    # is not the fault caught); said in full in the JUnit report (results.json keeps a message's first 300
    # characters, and the engine's name, log folder and all, takes most of them)
    said_in_full = _failure_messages(tmp_path / "junit.xml")
    caught = [r for r in records if r["outcome"] == "failed"
              and re.search(case.match, said_in_full.get(r["nodeid"].split("::")[-1], r["reason"] or ""))]
    if not caught:
        outcomes = [(r["nodeid"].split("::")[-1], r["outcome"], r["reason"]) for r in records]
        raise NotCaught(f"{case.select} did not fail on vLLM with {case.fault} ({FAULTS[case.fault].breaks}) for "
                        f"that reason ({case.match}); the fault fired ({fired[0]}); outcomes: {outcomes}")
    assert done.returncode != 0, f"the check failed, yet the run exited 0:\n{said}"
