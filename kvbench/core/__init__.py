"""The bottom floor: the types the adapter protocol speaks.

Requests and outputs, knobs, the trace recorder, the counter contract, liveness limits and the errors
about an engine. Everything else in kvbench imports from here; nothing here imports the rest of kvbench.
"""
