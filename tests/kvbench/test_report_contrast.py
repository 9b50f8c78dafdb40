"""WCAG AA contrast of the report's coloured text: every rule of report.css that sets both a text colour
and a background (status pills, dots, good/bad cells, outcomes, banners) reaches 4.5:1."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CSS = Path(__file__).resolve().parents[2] / "kvbench" / "report" / "templates" / "report.css"
#: WCAG 2 AA for normal-size text
AA = 4.5


def luminance(hex_color: str) -> float:
    h = hex_color.lstrip("#")
    if len(h) == 3:
        h = "".join(c * 2 for c in h)
    channels = [int(h[i:i + 2], 16) / 255 for i in (0, 2, 4)]
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast(a: str, b: str) -> float:
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def coloured_rules(css: str) -> list[tuple[str, str, str]]:
    """(selector, text colour, background) of every rule setting both, var() resolved from :root."""
    variables = dict(re.findall(r"(--[\w-]+):\s*(#[0-9a-fA-F]{3,6})", css))

    def resolve(value: str) -> str | None:
        value = value.strip()
        m = re.fullmatch(r"var\((--[\w-]+)\)", value)
        value = variables.get(m.group(1), "") if m else value
        return value if re.fullmatch(r"#[0-9a-fA-F]{3,6}", value) else None

    out = []
    for selector, body in re.findall(r"([^{}]+)\{([^{}]*)\}", re.sub(r"/\*.*?\*/", "", css, flags=re.S)):
        fg = re.search(r"(?:^|;)\s*color:\s*([^;]+)", body)
        bg = re.search(r"background(?:-color)?:\s*([^;]+)", body)
        if fg and bg and resolve(fg.group(1)) and resolve(bg.group(1)):
            out.append((selector.strip(), resolve(fg.group(1)), resolve(bg.group(1))))
    return out


def test_the_contrast_formula_matches_known_pairs():
    assert contrast("#000000", "#ffffff") == pytest.approx(21.0)
    assert contrast("#777777", "#ffffff") == pytest.approx(4.48, abs=0.01)  # the classic just-failing grey


def test_every_coloured_pill_dot_and_cell_meets_wcag_aa():
    rules = coloured_rules(CSS.read_text(encoding="utf-8"))
    selectors = " ".join(s for s, _, _ in rules)
    for needed in (".pill.ok", ".pill.watch", ".pill.problem", ".pill.na", ".dot.ok", ".dot.problem", "td.good",
                   "td.bad", "td.outcome.xfailed", ".banner.bad"):
        assert needed in selectors, f"{needed} sets no colour pair (the check below would not see it)"
    low = [(s, fg, bg, round(contrast(fg, bg), 2)) for s, fg, bg in rules if contrast(fg, bg) < AA]
    assert low == [], low


def test_the_check_catches_a_low_contrast_pill():
    bad = ":root { --ok: #2e9d6a; } .pill.ok { background: #e5f5ec; color: var(--ok); }"
    [(_, fg, bg)] = coloured_rules(bad)
    assert contrast(fg, bg) < AA
