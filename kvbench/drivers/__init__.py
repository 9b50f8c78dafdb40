"""The timed drivers: how kvbench hands a workload to an engine and records what happened, when.

* :mod:`~kvbench.drivers.step_loop`: an in-process engine's step loop, on the wall clock or a step clock;
* :mod:`~kvbench.drivers.lockstep`: several in-process engines served one step each in turn;
* :mod:`~kvbench.drivers.http_driver`: a server fed over streamed ``/v1/completions`` (load generation),
  with its client (:mod:`~kvbench.drivers.http_client`, :mod:`~kvbench.drivers.http_stream`), its
  ``/metrics`` reading (:mod:`~kvbench.drivers.server_metrics`) and its watchdog
  (:mod:`~kvbench.drivers.http_watchdog`).

All of them release a workload's requests the same way and write the same trace
(:mod:`kvbench.core.trace`). Imports ``kvbench.core`` only.
"""
