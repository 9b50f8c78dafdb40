"""The bottom floor: the types the adapter protocol speaks.

Requests and outputs, knobs, the trace recorder, the counter contract and the in-process step
driver. Everything else in kvbench imports from here; nothing here imports the rest of kvbench.
"""
