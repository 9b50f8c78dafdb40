"""How metric values read in the report: re-exported from :mod:`kvbench.bench.formatting`, where the
scenarios' own headlines (which live in ``bench``) format their figures the same way."""

from __future__ import annotations

from kvbench.bench.formatting import NOT_AVAILABLE, fmt_bytes, fmt_metric, fmt_ratio, fmt_time, metric_label

__all__ = ["NOT_AVAILABLE", "fmt_bytes", "fmt_metric", "fmt_ratio", "fmt_time", "metric_label"]
