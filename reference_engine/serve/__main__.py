"""``python -m reference_engine.serve --model DIR [flags]``: see ``reference_engine.serve.command_line``."""

from __future__ import annotations

import sys

from reference_engine.serve.command_line import main

if __name__ == "__main__":  # the engine process is spawned: it imports this module as __mp_main__
    sys.exit(main())
