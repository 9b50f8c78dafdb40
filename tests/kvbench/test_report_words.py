"""The report's words for a reader who has not read kvbench's source: scenario titles, not keys; each engine
kind explained once; a note every result carries said once; no empty "Every result (0)"; no
"Reference reference" (kvbench/report/words.py)."""

from __future__ import annotations

import re

from kvbench.report import words
from kvbench.report.render import render_report
from tests.kvbench.test_report_figures import page_text
from tests.kvbench.trace_factory import synthetic_results


def test_scenarios_are_titled_not_keyed():
    assert words.scenario_title("preemption_storm") == "Preemption storm"  # its declared title
    assert words.scenario_title("swap_space_exhaustion") == "Swap-space exhaustion"
    assert words.scenario_title("a_new_one") == "A new one"  # no declaration: the key in words
    res = synthetic_results()
    page = render_report(res)
    nav = page[page.index('<nav class="toc">'):page.index("</nav>")]
    headings = re.findall(r"<h3>([^<]+)</h3>", page[page.index('<section id="scenarios">'):])
    for name in res.scenario_names():
        assert f">{name}<" not in nav and name not in headings
        assert words.scenario_title(name) in nav and words.scenario_title(name) in headings


def test_each_engine_kind_is_explained_once():
    engines = [{"name": "reference", "kind": "reference"}, {"name": "reference:preemption_mode=swap",
                                                           "kind": "reference"}, {"name": "hf-cb", "kind": "hf-cb"}]
    glossary = words.engine_glossary(engines)
    assert [k for k, _ in glossary] == ["reference", "hf-cb"]
    assert "Hugging Face transformers' continuous batching" in dict(glossary)["hf-cb"]
    res = synthetic_results(engines=("reference", "hf-cb"))
    text = page_text(render_report(res))
    assert text.count("Hugging Face transformers' continuous batching") == 1


def test_the_header_names_what_ratios_are_against():
    text = page_text(render_report(synthetic_results()))
    assert "Reference reference" not in text and "Ratios against reference" in text


def test_a_note_every_result_carries_is_said_once():
    res = synthetic_results()
    sc = res.scenarios[0]
    note = "the storm at concurrency 16, the top of the sweep"
    for r in sc["results"]:
        r["notes"] = [note, f"{r['engine']}'s own note"]
    assert words.common_notes(sc["results"]) == [note]
    text = page_text(render_report(res))
    assert text.count(note) == 1
    assert all(f"{r['engine']}'s own note" in text for r in sc["results"])


def test_no_empty_every_result_list():
    res = synthetic_results()
    names = [sc["name"] for sc in res.scenarios if not sc["results"]]
    assert names  # the synthetic run has a sweep-only scenario (swap vs recompute)
    page = render_report(res)
    assert "Every result (0)" not in page
