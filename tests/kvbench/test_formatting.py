"""One formatter per kind of figure: shares and plain figures read the same in every table, and a missing
figure reads as the table marks it (``n/a`` by default, ``-`` where the simulator's tables say so)."""

from __future__ import annotations

import math

from kvbench.bench.formatting import NOT_AVAILABLE, fmt_figure, fmt_share


def test_a_share_is_a_whole_percentage() -> None:
    assert fmt_share(0.2) == "20%"
    assert fmt_share(0.004) == "0%"
    assert fmt_share(1.5) == "150%"  # a range wider than the median is not clipped


def test_a_missing_figure_reads_as_the_table_marks_it() -> None:
    for missing in (None, math.nan):
        assert fmt_share(missing) == NOT_AVAILABLE == "n/a"
        assert fmt_share(missing, "-") == "-"
        assert fmt_figure(missing, "{:.2f}", "-") == "-"


def test_a_figure_goes_through_its_template() -> None:
    assert fmt_figure(12345.678) == "1.235e+04"  # the default: four significant digits
    assert fmt_figure(1234.5, "{:,.4g}") == "1,234"
    assert fmt_figure(2, "{:.2f}") == "2.00"
    assert fmt_figure(0.0, "{:.0f}") == "0"  # zero is a figure, not a missing one
