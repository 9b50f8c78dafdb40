"""The faces tell the truth: every quick command the README and docs/ show runs as written, and what the
commands print about themselves is current and free of doc markup.

A quick command is a line of a fenced ``console`` block in README.md or docs/*.md (a trailing ``# ...``
is a comment). Each runs in a folder this test first fills with what the documented forms name:
``RESULTS.json`` (with the report.html a run writes beside it), ``BASELINE.json``, ``CURRENT.json`` and
two shards as ``--kvbench-shard`` writes them (``shards/<run>-shardIofN/results.json``). ``kvbench`` and
``python`` are this interpreter's, first on ``PATH``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kvbench.trace_factory import synthetic_results

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Sphinx roles (:class:`x`, :func:`x`), double backticks (``x``), reST directives and substitutions
MARKUP = re.compile(r":[a-z]+:`|``|\.\. [a-z]+::")


def console_commands() -> list[tuple[str, str]]:
    """(page, command) for every line of every ```console block, in page order."""
    found = []
    for page in PAGES:
        for block in re.findall(r"^```console\n(.*?)^```", page.read_text(encoding="utf-8"), re.S | re.M):
            for line in block.splitlines():
                command = re.sub(r"\s+#\s.*$", "", line).strip()
                if command:
                    found.append((page.name, command))
    return found


def test_the_docs_mark_their_quick_commands():
    commands = {c for _, c in console_commands()}
    for expected in ("kvbench --help", "kvbench engines", "python -m reference_engine.serve --help",
                     "kvbench report RESULTS.json"):
        assert expected in commands, f"no console block shows {expected!r}"
    assert any(c.startswith("kvbench merge ") for c in commands)
    assert any(c.startswith("kvbench compare ") for c in commands)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    d = tmp_path_factory.mktemp("docs-commands")
    results = synthetic_results(engines=("reference",))
    results.save(d / "RESULTS.json")
    (d / "report.html").write_text("<html>the report a run wrote beside its results</html>")
    results.save(d / "BASELINE.json")
    results.save(d / "CURRENT.json")
    for index, engine in ((1, "reference"), (2, "reference:preemption_mode=swap")):
        shard = synthetic_results(engines=(engine,))
        shard.data["shard"] = {"index": index, "count": 2}
        shard.save(d / "shards" / f"20261202-000000-shard{index}of2" / "results.json")
    bin_dir = d / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    kvbench = bin_dir / "kvbench"
    kvbench.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kvbench "$@"\n')
    kvbench.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return d, env


def run_command(command: str, workdir: tuple[Path, dict[str, str]]) -> subprocess.CompletedProcess[str]:
    cwd, env = workdir
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


@pytest.mark.parametrize(("page", "command"), console_commands(), ids=[f"{p}: {c}" for p, c in console_commands()])
def test_a_documented_quick_command_runs_as_written(page: str, command: str, workdir):
    done = run_command(command, workdir)
    assert done.returncode == 0, f"{page}: `{command}` exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    if command.endswith("--help"):
        assert not MARKUP.search(done.stdout), f"{page}: `{command}` prints doc markup:\n{done.stdout}"


def test_report_re_renders_beside_its_results_and_merge_reads_what_shards_write(workdir):
    cwd, _ = workdir
    assert "report written to" in run_command("kvbench report RESULTS.json", workdir).stdout
    assert "<html>the report a run wrote" not in (cwd / "report.html").read_text()
    done = run_command("kvbench merge shards/*-shard*/results.json -o again.json", workdir)
    assert done.returncode == 0 and "merged 2 results files" in done.stdout, done.stderr


# ------------------------------------------------------------------------------------ the help texts
def _kvbench_commands() -> list[str]:
    from kvbench.cli import build_parser, command_names

    return command_names(build_parser())


def test_kvbench_help_and_docstring_describe_every_subcommand():
    import kvbench.cli

    top = subprocess.run([sys.executable, "-m", "kvbench", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    for name in _kvbench_commands():
        assert re.search(rf"^\s+{name}\s+\S", top, re.M) or re.search(rf"^\s+{name}\n\s+\S", top, re.M), \
            f"kvbench --help does not describe {name}:\n{top}"
        assert f"kvbench {name}" in (kvbench.cli.__doc__ or ""), f"kvbench/cli/__init__.py's docstring omits {name}"


@pytest.mark.parametrize("command", _kvbench_commands())
def test_every_kvbench_subcommand_help_is_plain_text(command: str):
    done = subprocess.run([sys.executable, "-m", "kvbench", command, "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert not MARKUP.search(done.stdout), f"kvbench {command} --help prints doc markup:\n{done.stdout}"
    assert "%%" not in done.stdout, f"kvbench {command} --help prints an unformatted %%:\n{done.stdout}"


def test_the_server_help_says_what_each_engine_flag_means_and_accepts():
    from reference_engine.config import FIELD_DOCS, EngineConfig

    names = [f.name for f in dataclasses.fields(EngineConfig)]
    assert sorted(FIELD_DOCS) == sorted(names), "every EngineConfig field needs its FIELD_DOCS entry"
    done = subprocess.run([sys.executable, "-m", "reference_engine.serve", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    text = " ".join(done.stdout.split())
    for name in names:
        assert "--" + name.replace("_", "-") in text
        assert " ".join(FIELD_DOCS[name].split()) in text, f"--{name}'s help is not its FIELD_DOCS entry"
    assert "EngineConfig." not in text, "a flag's help names the field instead of saying what it means"
    assert not MARKUP.search(done.stdout) and "%%" not in done.stdout


def test_pytest_help_is_plain_text():
    done = subprocess.run([sys.executable, "-m", "pytest", "--help", "-p", "no:cacheprovider"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)
    kvbench_part = done.stdout[done.stdout.index("kvbench:"):]
    kvbench_part = kvbench_part[:kvbench_part.index("\n\n")]
    assert not MARKUP.search(kvbench_part) and "%%" not in kvbench_part, kvbench_part


# ------------------------------------------------------------------------------------ the pages
def test_the_configuration_table_is_field_docs():
    from reference_engine.config import FIELD_DOCS

    page = (ROOT / "docs" / "reference-engine.md").read_text(encoding="utf-8")
    for name, text in FIELD_DOCS.items():
        assert f"| `{name}` |" in page and text in page, f"docs/reference-engine.md: {name}'s row is stale"


def test_pytest_options_in_the_docs_exist():
    """Every --option on a documented pytest command line is one pytest knows (kvbench's or a plugin's)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--help", "-p", "no:cacheprovider"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)
    options = set()
    for page in PAGES:
        for line in page.read_text(encoding="utf-8").splitlines():
            line = line.strip().strip("`")
            if line.startswith(("pytest ", "python3 -m pytest ", "python -m pytest ")):
                unquoted = re.sub(r'"[^"]*"', "", line.split("  #")[0])  # an --engine value's own flags
                options |= set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", unquoted))
    assert options, "no pytest command line found in the docs"
    unknown = sorted(o for o in options if o not in done.stdout)
    assert not unknown, f"the docs pass options pytest does not know: {unknown}"


def test_no_issue_numbers_in_the_guide():
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        assert not re.search(r"\bissues? \d+|(?<![\w&])#\d+\b", text), f"{page.name} cites an issue number"
