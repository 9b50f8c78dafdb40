"""docs/results.md as a generated page: the current tables of a set of results files, each table with the
command, commit and machine of the run it comes from.

What :func:`results_page` writes, from results files only (nothing is re-run, nothing is typed by hand):

* **Conformance**: one matrix, check x engine (:func:`kvbench.report.conformance_table.conformance_table`),
  from the ``conformance`` records of every file given. An engine checked in several files shows, per
  check, the newest record (a later run of one check on one engine replaces an earlier one), and the
  runs it was read from are listed under the matrix.
* **Storm headlines**: per file with benchmark results, the report's first-screen verdict of every
  scenario (:func:`kvbench.report.first_screen.verdicts`: who leads on the scenario's metric, by how much,
  with the noise measured from repeats, at what cost), so the page and the report say one thing.
* **Engine against engine**: per file with two engines or more on a scenario, each engine's value of the
  scenario's own metric and its ratio to the reference engine with the same noise the headlines use
  (:func:`kvbench.bench.repeats.honest_ratio_noise`). Engines measured on different clocks are not set side
  by side (:mod:`kvbench.bench.clock_rule`).
* **Simulator against measured**: per file that holds a simulated engine beside the engine it simulates
  (what ``kvbench validate-sim --out DIR`` writes), the simulator's error per scenario
  (:func:`kvbench.report.sim_validation.section`).

A section none of the files holds is not written as an empty table: the page's last lines name what the
given files did not hold. A file without a recorded command (written before results.json kept its command
line) says so and describes what it holds instead (engines, test files, scale, repeats).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.bench import gate, repeats
from kvbench.bench.formatting import fmt_noisy_ratio
from kvbench.bench.results import Results
from kvbench.bench.scenarios.declare import num, within_noise
from kvbench.report import first_screen, scoreboard, sim_validation
from kvbench.report.conformance_table import conformance_table
from kvbench.report.figures import clock_of, fmt_value

#: the command that regenerates the page, as the page states it (the files are the caller's)
COMMAND = "python3 -m kvbench results-page"


@dataclass(frozen=True)
class Source:
    """One results file given to the page: ``path`` as given, its results."""

    path: str
    results: Results

    @property
    def created(self) -> str:
        return str(self.results.data.get("created") or "")


def cell(text: Any) -> str:
    """``text`` safe inside a Markdown table cell: one line, no "|" (it would end the cell)."""
    return " ".join(str(text).split()).replace("|", "/")


def when(created: str) -> str:
    """"2026-12-06 10:44 UTC" from an ISO time in UTC; the text as it is otherwise; "date not recorded"."""
    if not created:
        return "date not recorded"
    if len(created) >= 16 and created[10] == "T" and created.endswith("+00:00"):
        return f"{created[:10]} {created[11:16]} UTC"
    return created


def commit_words(results: Results) -> str:
    """"commit 6b7a3b7" (with "and uncommitted changes" when the checkout was dirty), or "commit not recorded"."""
    commit = results.data.get("commit") or {}
    if not commit.get("id"):
        return "commit not recorded"
    return f"commit {commit['id'][:7]}" + (" with uncommitted changes" if commit.get("dirty") else "")


def machine_words(results: Results) -> str:
    """"vm: 2 CPUs, cpu, torch 2.13.0+cpu, Python 3.11.7, Linux-6.18...": what the file says of its machine."""
    m = results.machine or {}
    if not m:
        return "machine not recorded"
    bits = [f"{m['cpu_count']} CPUs" if m.get("cpu_count") else "", str(m.get("device") or ""),
            f"torch {m['torch']}" if m.get("torch") else "", f"Python {m['python']}" if m.get("python") else "",
            str(m.get("platform") or "")]
    return f"{m.get('hostname') or 'unnamed host'}: " + ", ".join(b for b in bits if b)


def described(results: Results) -> str:
    """What a file without a recorded command holds, in the words of its own fields (no command is made up)."""
    bits = []
    engines = list(dict.fromkeys([*results.engine_names(), *(r["engine"] for r in results.conformance)]))
    if engines:
        bits.append("engines " + ", ".join(f"`{e}`" for e in engines))
    files = sorted({r["nodeid"].split("::", 1)[0] for r in results.conformance})
    if files:
        bits.append("conformance checks from " + ", ".join(f"`{f}`" for f in files))
    scales = sorted({str(sc["parameters"]["scale"]) for sc in results.scenarios if sc["parameters"].get("scale")})
    if scales:
        bits.append("benchmarks at scale " + ", ".join(scales))
    counts = sorted({len(r["repeats"]) for _, r in results.iter_results() if r.get("repeats")})
    if counts:
        bits.append(f"{'/'.join(map(str, counts))} repeats")
    rule = results.data.get("clock_rule")
    if isinstance(rule, Mapping) and rule.get("clock"):
        bits.append(f"all on the {rule['clock']} clock")
    return "; ".join(bits)


def source_line(source: Source) -> str:
    """The run a table comes from: command, commit, machine, date and the file, one Markdown line."""
    command = source.results.data.get("command")
    said = (f"`{command}`" if command else
            "command not recorded (the file predates its record); it holds " + (described(source.results) or "nothing"))
    return (f"{said}; {commit_words(source.results)}; {machine_words(source.results)}; "
            f"{when(source.created)}; file `{source.path}`")


# --------------------------------------------------------------------------------------------
# the sections


def conformance_section(sources: Sequence[Source]) -> list[str]:
    """The matrix over every file's conformance records (the newest record per engine and check), and the
    runs each engine's column was read from; [] when no file has a record."""
    newest: dict[tuple[str, str], tuple[Source, dict[str, Any]]] = {}
    for source in sorted(sources, key=lambda s: s.created):  # later runs replace earlier ones
        for record in source.results.conformance:
            newest[(record["engine"], record["check"])] = (source, record)
    if not newest:
        return []
    # a reason may name a file by its absolute path in the checkout that ran it: the page names it from the root
    root = str(Path(__file__).resolve().parents[2]) + "/"
    records = [{**record, "reason": (record.get("reason") or "").replace(root, "") or None}
               for _, record in newest.values()]
    lines = ["## Conformance", "",
             "Each check's verdict on each engine (the newest run of it among the files); reasons as numbered "
             "notes under the table.", "",
             conformance_table(records, footnotes=True), "", "Runs:", ""]
    for engine in dict.fromkeys(e for e, _ in newest):
        used = [s for s in dict.fromkeys(s for (e, _), (s, _) in newest.items() if e == engine)]
        for s in used:
            n = sum(1 for (e, _), (src, _) in newest.items() if e == engine and src is s)
            lines.append(f"- `{engine}`, {n} check{'s' if n != 1 else ''}: {source_line(s)}")
    return [*lines, ""]


def headline_rows(results: Results) -> list[list[str]]:
    """The first screen's verdict of every scenario of ``results`` that ranks engines, as table cells."""
    rows = []
    for v in first_screen.verdicts(results):
        if not v["metric"]:
            continue  # a scenario comparing one engine's settings: no ranking to state
        verdict = f"{v['winner']} {v['status']}" if v["winner"] else v["status"]
        rows.append([v["title"], v["metric"], verdict, v["margin"] or "–", v["noise"] or "–", v["cost"] or "–"])
    return rows


def engine_rows(results: Results) -> tuple[list[str], list[list[str]]]:
    """(engines, rows): per scenario that ranks engines and has two or more of them on one clock, each
    engine's value of the scenario's metric and its ratio to the reference engine with its noise."""
    reference = gate.reference_engine_name(results) or next(iter(results.engine_names()), None)
    drift = repeats.identical_schedule_drift(results.scenarios)
    engines: list[str] = []
    rows: list[tuple[str, str, dict[str, str]]] = []
    for sc in results.scenarios:
        decl = scoreboard.declaration(sc["name"])
        score = decl.score if decl is not None else scoreboard.DEFAULT_SCORE
        if score is None:
            continue
        entries = {r["engine"]: r for r in sc["results"]
                   if r.get("mode") == score.mode and num(r["metrics"].get(score.metric)) is not None}
        if len(entries) < 2 or len({clock_of(r) for r in entries.values()}) > 1:
            continue
        unranked = first_screen.not_rankable(sc, score)  # a failed or undecided run: its value, no ratio
        ref = entries.get(reference or "") if reference not in unranked else None
        idle = ({e for e, r in entries.items() if num(r["metrics"].get("preemptions")) == 0}
                if score.metric in scoreboard.PREEMPTION_COSTS else set())
        cells: dict[str, str] = {}
        for engine, res in entries.items():
            text = fmt_value(score.metric, res)
            if engine in unranked:
                text += f" ({unranked[engine].partition(' (')[0]}; see the run's report)"
            elif engine in idle:
                text += " (did not preempt: the cost did not arise)"  # a 0.00x "win" is no win
            elif ref is not None and engine != reference and reference not in idle:
                text += " (" + ratio_words(res, ref, score.metric, score.higher_is_better, drift) + ")"
            cells[engine] = text
            if engine not in engines:
                engines.append(engine)
        title = decl.title if decl is not None and decl.title else sc["name"]
        rows.append((title, score.label or score.metric, cells))
    if reference in engines:
        engines.remove(reference)
        engines.insert(0, reference)
    return engines, [[t, m, *(c.get(e, "–") for e in engines)] for t, m, c in rows]


def ratio_words(res: Mapping[str, Any], ref: Mapping[str, Any], metric: str, higher_is_better: bool,
                drift: Mapping[str, repeats.Drift]) -> str:
    """"0.52× ±95% of the reference, worse": ``res`` ÷ ``ref`` with the noise the headlines use, and which
    way it points beyond that noise."""
    a, b = num(res["metrics"].get(metric)), num(ref["metrics"].get(metric))
    if a is None or not b:
        return "no ratio: the reference's value is 0"
    ratio = a / b
    noise, _ = repeats.honest_ratio_noise(res, ref, metric, repeats.drift_for(drift, metric))
    better = (ratio > 1) == higher_is_better
    word = "within noise" if within_noise(ratio, noise) else ("better" if better else "worse")
    return f"{fmt_noisy_ratio(ratio, noise)} of the reference, {word}"


def sim_rows(results: Results) -> list[tuple[str, list[str], list[list[str]]]]:
    """Per simulated/measured pairing: (its heading line, header, rows of per-scenario errors)."""
    out = []
    for view in sim_validation.section(results) or []:
        equal = {True: "yes", False: "no", None: "not judged"}[view["counts_equal"]]
        heading = (f"`{view['simulated']}` against `{view['measured']}` ({view['clock']} clock): median error "
                   f"{view['median']} (goal {view['goal']}), counts equal: {equal}")
        header = ["scenario", *view["timing_labels"]]
        rows = [[r["scenario"] + (f" [{r['mode']}]" if r["mode"] else ""),
                 *(f"{t['simulated']} vs {t['measured']} ({t['error']})" for t in r["timings"])]
                for r in view["rows"]]
        out.append((heading, header, rows))
    return out


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return (["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows])


def run_heading(source: Source) -> str:
    engines = ", ".join(source.results.engine_names())
    return f"### {when(source.created)}: {engines}"


def results_page(sources: Sequence[Source], paths_as_given: Sequence[str] = ()) -> str:
    """The whole page (Markdown) from ``sources`` (see the module docstring). ValueError when no file holds
    any table (a page of nothing would read as "no results")."""
    if not sources:
        raise ValueError("no results files given")
    regenerate = shlex.join([*COMMAND.split(), *(paths_as_given or [s.path for s in sources]), "-o",
                             "docs/results.md"])
    body: list[str] = []
    missing: list[str] = []

    body += conformance_section(sources) or []
    if not any(s.results.conformance for s in sources):
        missing.append("conformance records (`pytest suites/conformance --engine SPEC` writes them)")

    runs = sorted((s for s in sources if s.results.scenarios), key=lambda s: s.created, reverse=True)
    headline = [(s, rows) for s in runs if (rows := headline_rows(s.results))]
    if headline:
        body += ["## Storm headlines", "",
                 "Per scenario, the report's first-screen verdict: who leads on the metric the scenario is about, "
                 "by how much, with the noise measured from repeats (a lead inside the noise is \"level\"), and at "
                 "what cost.", ""]
        for s, rows in headline:
            body += [run_heading(s), "", f"Run: {source_line(s)}", "",
                     *table(["scenario", "ranked on", "verdict", "margin", "noise", "cost"], rows), ""]
    else:
        missing.append("benchmark results (`pytest suites/benchmarks --benchmark --engine SPEC ...` writes them)")

    pairs = [(s, engines, rows) for s in runs for engines, rows in [engine_rows(s.results)] if rows]
    if pairs:
        body += ["## Engine against engine", "",
                 "Each engine's value of the scenario's own metric in one run, and its ratio to the reference "
                 "engine with the same noise as the headlines (engines measured on one clock only).", ""]
        for s, engines, rows in pairs:
            body += [run_heading(s), "", f"Run: {source_line(s)}", "",
                     *table(["scenario", "metric", *engines], rows), ""]
    else:
        missing.append("two engines or more on one scenario (an engine-against-engine table)")

    sims = [(s, views) for s in sources if (views := sim_rows(s.results))]
    if sims:
        body += ["## Simulator against measured", "",
                 "The simulator's figures against the engine it simulates, served side by side "
                 "(error: simulated against measured).", ""]
        for s, views in sims:
            body += [run_heading(s), "", f"Run: {source_line(s)}", ""]
            for heading, header, rows in views:
                body += [heading, "", *table(header, rows), ""]
    else:
        missing.append("a simulator beside the engine it simulates (`kvbench validate-sim --out DIR` writes it)")

    if not body:
        raise ValueError("none of the results files holds a table (no conformance records, no benchmark results, "
                         "no simulator validation)")
    head = ["# Results", "",
            f"<!-- generated by `{regenerate}`: edit the generator or give it newer results files, not this page -->",
            "",
            "The current tables, generated from results files: each names the command, commit and machine of "
            "the run it comes from. Figures not held in a results file, and every earlier run with its date, "
            "are in the [journal](journal/README.md).", "", f"Regenerate: `{regenerate}`", ""]
    tail = ["## Not in these files", "", *(f"- {m}" for m in missing), ""] if missing else []
    return "\n".join(head + body + tail).rstrip() + "\n"
