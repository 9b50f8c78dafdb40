"""Adapters over HTTP: ``openai`` (a running OpenAI-compatible server) and ``server`` (one launched per knob
set from a preset), with what they share: the client, the streamed request, the timed driver, a
server's ``/metrics``, the watchdog, the server process, the peers' installs, and two servers for tests
(the stub and the patched reference server). Imports ``kvbench.core`` and ``kvbench.engines.base``,
never another family."""
