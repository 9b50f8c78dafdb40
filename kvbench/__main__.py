"""``python -m kvbench``: the same as the ``kvbench`` console script."""

from __future__ import annotations

from kvbench.cli import main

raise SystemExit(main())
