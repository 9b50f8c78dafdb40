"""Code and output cite what a reader of the repository can open: a doc section (``docs/page.md#anchor``)
or a finding's reproduction under ``scripts/findings/``, never an issue number, a seed file (the source
documents are not shipped) or a section number of a source article.

Four checks, in the spirit of ``tests/test_layout.py`` (read from the source, so it stays that way):

* no file of ``kvbench/``, ``reference_engine/`` or ``suites/`` (code, docstrings, comments, messages, the
  report's templates, the C++ sources) matches :data:`UNOPENABLE`;
* every ``docs/<page>.md#<anchor>`` those files cite names a heading that page has;
* every ``tests/...py``, ``scripts/...`` and ``docs/...md`` path they cite exists (a file moved, its
  citations moved with it);
* a report rendered from a run's results (every declared scenario's description and parameters, the
  diagnosis a structural capacity gap produces, the policies' goal table) and the runs index
  show none of them either: the rendered text is what users read.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvbench.bench import scenarios as sc
from kvbench.bench.results import Results
from kvbench.report.render import render_report, write_index
from tests.kvbench.trace_factory import synthetic_results

ROOT = Path(__file__).resolve().parents[2]
#: where code and the text it shows live (the report's templates are under kvbench/report/templates)
SCANNED = ("kvbench", "reference_engine", "suites")
SUFFIXES = {".py", ".html", ".j2", ".jinja", ".css", ".js", ".toml", ".md", ".txt", ".json", ".cpp", ".h", ".cu",
            ".sh"}

#: (pattern, what it cites): each is a citation a reader of the repository cannot open
UNOPENABLE: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p, re.IGNORECASE), what) for p, what in (
    (r"\bissues? #?\d+", "an issue number"),
    (r"\bitems? \d+ of (?:the |an? )?issue\b|\(\s*item \d+\s*\)", "an issue's item"),
    (r"\bseeds? 0\d\d\b", "a seed file"),
    (r"\bseeds'|\b(?:of|from|in) the seeds\b", "the seed documents"),
    (r"\bseed (?:docs?|documents?|files?|notes?)\b|\bseed_doc\b", "the seed documents"),
    (r"\bsource (?:notes?|articles?|documents?)\b", "the source documents"),
    (r"\bsection \d+(?:\.\d+)*\b|§\s*\d", "a section number"),
))
#: ``docs/page.md#anchor`` as code cites it
DOC_LINK = re.compile(r"\bdocs/([\w.-]+\.md)#([\w-]+)")
#: a path of this repository as code cites it: a test module, a page of docs/, anything under scripts/ (a
#: trailing full stop is the sentence's); not part of a longer path (``kvbench/tests/...`` is not ``tests/...``)
CITED_PATH = re.compile(r"(?<![\w/.-])(tests/[\w/.-]*?\.py|docs/[\w/.-]*?\.md|scripts/[\w/.-]*[\w/])(?!\w)")


def unopenable(text: str) -> list[tuple[int, str, str]]:
    """(line number, what it cites, the line) of every unopenable citation in ``text``."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern, what in UNOPENABLE:
            if pattern.search(line):
                found.append((n, what, line.strip()))
    return found


def heading_anchors(page: Path) -> set[str]:
    """The anchors a Markdown page's headings get on GitHub: lower case, markup and punctuation dropped,
    spaces to hyphens (``## Preemption-aware policies`` -> ``preemption-aware-policies``)."""
    anchors = set()
    in_fence = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        if in_fence or not (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            continue
        text = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower())
        anchors.add(text.replace(" ", "-"))
    return anchors


def doc_link_opens(link: str) -> bool:
    """Whether ``docs/page.md#anchor`` names an existing page and one of its headings."""
    m = DOC_LINK.fullmatch(link)
    if m is None:
        return False
    page = ROOT / "docs" / m.group(1)
    return page.is_file() and m.group(2) in heading_anchors(page)


def _scanned_files() -> list[Path]:
    files = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts:
                files.append(path)
    return files


# ------------------------------------------------------------------------------------ the patterns


@pytest.mark.parametrize("text", [
    "(issue 19, item 7)", "Issue 11's goal", "issues #12", "seed 004, section 5", "(seeds 000 and 004)",
    "Seed 001: traffic doubles", "the seeds' order of checks", "one test per scenario of the seeds",
    "The order of checks from the source notes", "seed 004 (section 4.3)", "§3.4 of the article",
    "seed_doc = '004'",
])
def test_the_patterns_catch_each_kind_of_citation(text):
    assert unopenable(text), text


@pytest.mark.parametrize("text", [
    "WorkloadSpec('storm', 16, Uniform(32, 128), seed=3)", "its own 12 requests (seed 31)",
    "the engine ignores the seed", "color #444", "docs/benchmarks.md#diagnosis",
    "scripts/findings/vllm_repro.py", "a structural capacity gap (docs/benchmarks.md#diagnosis)",
])
def test_the_patterns_leave_ordinary_words_alone(text):
    assert not unopenable(text), text


def test_a_doc_link_opens_only_onto_a_heading_that_exists():
    assert doc_link_opens("docs/benchmarks.md#diagnosis")
    assert doc_link_opens("docs/simulator.md#preemption-aware-policies")
    assert not doc_link_opens("docs/benchmarks.md#no-such-section")
    assert not doc_link_opens("docs/no-such-page.md#scenarios")


@pytest.mark.parametrize(("text", "paths"), [
    ("(tests/kvbench/test_report_contrast.py)", ["tests/kvbench/test_report_contrast.py"]),
    ("// tests/test_cpu_elementwise.py holds these kernels", ["tests/test_cpu_elementwise.py"]),
    ("run bash scripts/peers.sh vllm.", ["scripts/peers.sh"]),
    ("under scripts/findings/, e.g. scripts/findings/vllm_repro.py", ["scripts/findings/",
                                                                       "scripts/findings/vllm_repro.py"]),
    ("docs/simulator.md#preemption-policies and docs/results.md.", ["docs/simulator.md", "docs/results.md"]),
    ("kvbench/tests/x.py, my_docs/a.md, tests/kvbench/data/main_job_results.json.gz", []),
])
def test_the_path_pattern_finds_what_code_cites(text, paths):
    assert CITED_PATH.findall(text) == paths


# ------------------------------------------------------------------------------------ the source


def test_code_and_templates_cite_nothing_a_reader_cannot_open():
    files = _scanned_files()
    assert any(p.name == "report.html" for p in files) and len(files) > 100  # the scan reached the tree
    bad = [f"{p.relative_to(ROOT)}:{n}: {what}: {line[:120]}"
           for p in files for n, what, line in unopenable(p.read_text(errors="replace"))]
    assert not bad, "cite a doc section (docs/page.md#anchor) or a finding under scripts/findings/:\n" + "\n".join(bad)


def test_every_doc_section_the_code_cites_exists():
    cited = {(p.relative_to(ROOT), m.group(0)) for p in _scanned_files()
             for m in DOC_LINK.finditer(p.read_text(errors="replace"))}
    assert cited  # the scenarios cite docs/benchmarks.md#scenarios at least
    broken = sorted(f"{path}: {link}" for path, link in cited if not doc_link_opens(link))
    assert not broken, "no such page or heading:\n" + "\n".join(broken)


def test_every_path_the_code_cites_exists():
    cited = {(p.relative_to(ROOT), n, path) for p in _scanned_files()
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             for path in CITED_PATH.findall(line)}
    assert any(path.startswith("tests/") for _, _, path in cited)  # the scan reached the citations
    assert any(str(where).endswith(".cpp") for where, _, _ in cited)  # the C++ sources among them
    missing = sorted(f"{where}:{n}: {path}" for where, n, path in cited if not (ROOT / path).exists())
    assert not missing, "no such file (moved? cite where it is now):\n" + "\n".join(missing)


@pytest.mark.parametrize("name", sorted(sc.SCENARIOS))
def test_every_scenario_names_a_doc_section_that_exists(name):
    scenario = sc.SCENARIOS[name]
    assert doc_link_opens(scenario.doc), scenario.doc
    assert not unopenable(scenario.description) and not unopenable(scenario.title)


# ------------------------------------------------------------------------------------ what users read


TINY = sc.Model("tiny-ckpt", "tiny", vocab_size=512, max_model_len=1024)


def _as_a_run_records_them() -> Results:
    """The synthetic run, with every declared scenario's description and parameters as a run records
    them, a flash crowd that preempted before its surge (the diagnosis's structural-gap finding), and
    the policies' admission part (the goal table)."""
    res = synthetic_results()
    ref = res.engines[0]
    storm = res.scenario("preemption_storm")["results"][0]["metrics"]
    for scenario in sc.SCENARIOS.values():
        res.scenario(scenario.name, create=True, parameters=scenario.parameters("quick", TINY),
                     description=scenario.description)
    res.add_scenario_result("flash_crowd", ref, {**storm, "preemptions": 9, "preemptions_before_surge": 4,
                                                 "preemptions_after_surge": 5},
                            checks={"the engine preempted": True})
    for mode, preemptions, tbt in (("evening_surge/static", 40, 0.2), ("evening_surge/watermark", 4, 0.08)):
        res.add_scenario_result("preemption_policies", ref, {"preemptions": preemptions, "tbt_p99": tbt,
                                                             "ttft_p99": 1.0, "output_throughput": 100.0},
                                mode=mode)
    return res


def test_the_rendered_report_and_index_show_no_unopenable_citation(tmp_path):
    res = _as_a_run_records_them()
    page = render_report(res)
    # the texts that used to cite the seeds and the issues are on the page
    assert "before the surge began (a structural capacity gap" in page  # the diagnosis's finding
    assert "the admission goal" in page and sc.SCENARIOS["flash_crowd"].description[:40] in page
    assert "docs/benchmarks.md#scenarios" in page  # a scenario's parameters name its doc section
    assert not unopenable(page), unopenable(page)[:5]
    run = tmp_path / "run1"
    run.mkdir()
    res.save(run / "results.json")
    index = write_index(tmp_path).read_text()
    assert "run1" in index and not unopenable(index), unopenable(index)[:5]
