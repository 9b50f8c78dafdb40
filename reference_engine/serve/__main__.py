"""``python -m reference_engine.serve --model DIR [flags]``: see ``reference_engine.serve.cli``."""

from __future__ import annotations

import sys

from reference_engine.serve.cli import main

sys.exit(main())
