"""Adapters over HTTP: ``openai`` (a running OpenAI-compatible server) and ``server`` (one launched per knob
set from a preset, :mod:`~kvbench.engines.http.presets`). They speak to the server through the timed HTTP
driver (:mod:`kvbench.drivers`) and start servers through :mod:`kvbench.launch`; they import no other
family of adapters."""
