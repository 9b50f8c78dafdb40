"""The timed drivers: how kvbench hands a workload to an engine and records what happened, when.

* :mod:`~kvbench.drivers.release`: the rule they share: which request is released when (open loop at
  its arrival's point on the driver's clock, closed loop when a slot frees) and when each is aborted
  (:class:`~kvbench.drivers.release.ReleaseSchedule`), and how an arrival is recorded;
* :mod:`~kvbench.drivers.step_loop`: an in-process engine's step loop, on the wall clock or a step clock;
* :mod:`~kvbench.drivers.lockstep`: several in-process engines served one step each in turn;
* :mod:`~kvbench.drivers.http_driver`: a server fed over streamed ``/v1/completions`` (load generation),
  with its client (:mod:`~kvbench.drivers.http_client`, :mod:`~kvbench.drivers.http_stream`), its
  ``/metrics`` reading (:mod:`~kvbench.drivers.server_metrics`) and its watchdog
  (:mod:`~kvbench.drivers.http_watchdog`).

The contract every driver keeps: given the engine (or server), the workload's requests and a
:class:`~kvbench.core.trace.TraceRecorder`, release the requests by one
:class:`~kvbench.drivers.release.ReleaseSchedule`, record each arrival
(:func:`~kvbench.drivers.release.record_arrival`), token and finish into the one trace
(:mod:`kvbench.core.trace`), call ``progress(1)`` per finished request, and return only once every
request has finished (aborted and failed ones included, with their reason), or raise
:class:`~kvbench.core.liveness.LivenessError` naming the requests stuck under the run's
:class:`~kvbench.core.liveness.Liveness` limits.

What stays apart, and why:

* **Polling between steps, or asyncio.** The step loop *is* the engine's loop: it releases and aborts
  only between two steps (:meth:`~kvbench.drivers.release.ReleaseSchedule.release_due`), which is what
  makes the step clock's counts exact. Over HTTP the server steps on its own and the client must hold
  every stream open at once and stamp each chunk as it arrives, so the HTTP driver is asyncio: one
  task per request, waiting for its release point on a timer
  (:meth:`~kvbench.drivers.release.ReleaseSchedule.planned`), a closed-loop slot passed from a
  finished request to the next on the same task, and each abort on its own stream's timer. Same rule,
  same release points; the waiting is each world's own.
* **Two watchdogs, one set of limits.** In process, progress is seen per step (the report's tokens and
  state changes: :class:`~kvbench.core.liveness.DriverWatchdog`); over HTTP only streamed tokens, ended
  responses and ``/metrics`` are (:class:`~kvbench.drivers.http_watchdog.HttpWatchdog`). Both read the
  same :class:`~kvbench.core.liveness.Liveness` and raise the same error.
* **Lockstep is not a third loop.** It runs several step loops (:func:`~kvbench.drivers.step_loop.drive`,
  through each adapter's ``serve``) on threads, passing a baton at every recorded step, each engine's
  times read from its own clock; it composes the step loop instead of repeating it.
* **Two kinds of clock.** The recorder's clock says what a time *is* (the wall clock, a simulator's
  virtual clock, a lockstep participant's own clock); the schedule's clock says when a request is
  *due* (seconds, or the step index on the step clock).
* **What a run returns.** The trace is the result. The HTTP driver also returns
  :class:`~kvbench.drivers.http_driver.DriverStats` (how far the client lagged behind the workload,
  how long the scrapes took): over HTTP the client is a party of its own, whose lateness must not be
  blamed on the server; in process the driver's time is inside the measured steps.

Imports ``kvbench.core`` only.
"""
