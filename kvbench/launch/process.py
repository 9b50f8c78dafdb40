"""A server process kvbench started: launched in its own process group, waited for until ``/health``
answers, and stopped with its whole group, never leaving an orphan.

* Start: ``start_new_session=True``, so the server and everything it forks (uvicorn workers, engine
  cores) share one process group that kvbench alone signals. stdout and stderr go to a log file kept
  as evidence.
* Ready: ``GET /health`` answers 200 within ``startup_timeout``; if the process exits first, or the time
  runs out, :class:`ServerStartError` quotes the log's last lines (a server that refuses a bad
  configuration says why there).
* Stop: SIGTERM to the group, wait; SIGKILL to the group if it is still there; wait again (bounded).
  Every started server is also stopped at interpreter exit (``atexit``), which covers a failing test,
  an exception in a fixture and Ctrl-C (KeyboardInterrupt unwinds to a normal exit); SIGTERM and SIGHUP
  stop them too (a handler installed with the first server), then end the process as the signal would.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvbench.core.tls import client_context

_LIVE: set[ServerProcess] = set()
#: a logged error: "ValueError: ...", "pydantic_core...ValidationError: 2 validation errors for ..."
_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b:")


class ServerStartError(RuntimeError):
    """The server exited or stayed silent before ``/health`` answered. The message holds its log tail;
    ``engine_output`` is that tail alone (what the server said, without kvbench's command line), for a
    check that must judge the server's own words."""

    def __init__(self, message: str, engine_output: str = ""):
        super().__init__(message)
        self.engine_output = engine_output


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` still runs. A zombie does not count: it has exited and holds
    nothing but its exit status, waiting for its parent to collect it. The reference server's group ends
    that way (multiprocessing's resource tracker outlives the server that started it by a moment, and is
    left to PID 1, which here collected it 1-3 s later): counting it made every stop wait that long."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else (cannot be ours)
        return True
    members = group_members(pgid)
    return members is None or any(state != "Z" for _, state in members)


def group_members(pgid: int) -> list[tuple[int, str]] | None:
    """(pid, state) of each process of group ``pgid`` (states ``R``, ``S``, ``Z``...) from /proc, or None
    without /proc."""
    try:
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return None
    members = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and fields[2] == str(pgid):
            members.append((int(pid), fields[0]))
    return members


class ServerProcess:
    """One launched server. ``argv`` is the full command; ``log_path`` receives its output."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.pgid: int | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"$ {shlex.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=self.env)
        self.pgid = self.proc.pid  # a new session's leader: its pid is the group id
        _LIVE.add(self)
        _stop_servers_on_termination()

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def server_output(self, lines: int = 30) -> str:
        """What the server said about why it stopped: every error it logged with the few lines after it (a
        validation error names its field on the next line), then its last ``lines``; the ``$ command`` lines
        kvbench wrote are left out. The root cause is often far above the tail: vLLM's engine core logs it,
        then its API server's own traceback fills the last 30 lines."""
        try:
            logged = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        logged = [line for line in logged if not line.startswith("$ ")]
        errors: list[str] = []
        for i, line in enumerate(logged):
            if _ERROR_LINE.search(line):
                errors.extend(x for x in logged[i:i + 4] if x not in errors)
        return "\n".join([*errors[-60:], *logged[-lines:]])

    def wait_healthy(self, base_url: str, timeout: float) -> None:
        """Return once ``GET base_url/health`` answers 200; else stop the server and raise."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        # one client for the whole wait: a client per poll built a TLS context each time (kvbench.core.tls)
        with httpx.Client(timeout=2.0, verify=client_context()) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    self.stop()
                    raise self._start_error(f"the server exited with status {code} before /health answered.")
                try:
                    if client.get(base_url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise self._start_error(f"/health did not answer within {timeout:.0f} s (startup_timeout).")
                time.sleep(0.05)

    def _start_error(self, what: str) -> ServerStartError:
        said = self.server_output()
        return ServerStartError(f"{what}\ncommand: {shlex.join(self.argv)}\nlog {self.log_path}, last lines:\n"
                                f"{self.log_tail()}\nerrors it logged:\n{_errors_only(said)}", said)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM the whole group and return at once (:meth:`stop` waits, and kills what stays)."""
        if self.pgid is not None and self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGTERM)
                os.killpg(self.pgid, signal.SIGCONT)  # a paused group (:meth:`pause`) acts on it only once resumed

    def pause(self) -> bool:
        """SIGSTOP the whole group: it takes no CPU time until :meth:`resume` (a start ahead held while a
        timing-sensitive run serves). Returns whether a live group was paused."""
        if self.pgid is None or not self.running():
            return False
        try:
            os.killpg(self.pgid, signal.SIGSTOP)
        except ProcessLookupError:
            return False
        return True

    def resume(self) -> None:
        """SIGCONT the whole group (harmless on one that is not paused)."""
        if self.pgid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGCONT)

    def stop(self, term_timeout: float = 10.0, kill_timeout: float = 5.0) -> None:
        """SIGTERM the whole group, then SIGKILL what is left; reap the leader. Idempotent."""
        if self.proc is None or self.pgid is None:
            return
        try:
            if group_alive(self.pgid):
                os.killpg(self.pgid, signal.SIGTERM)
                os.killpg(self.pgid, signal.SIGCONT)  # a paused group (:meth:`pause`) acts on it only once resumed
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=term_timeout)
            # children may outlive a leader that exited on SIGTERM: give them a moment, then SIGKILL the rest
            grace = time.monotonic() + 1.0
            while group_alive(self.pgid) and time.monotonic() < grace:
                time.sleep(0.05)
            if group_alive(self.pgid):
                os.killpg(self.pgid, signal.SIGKILL)
            self.proc.wait(timeout=kill_timeout)
            end = time.monotonic() + kill_timeout
            while group_alive(self.pgid) and time.monotonic() < end:
                time.sleep(0.05)
        except ProcessLookupError:
            pass
        finally:
            _LIVE.discard(self)


#: signals that end a run without unwinding it (``kill``, a CI runner's time limit, a closed terminal)
TERMINATION_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _stop_servers_on_termination() -> None:
    """Make SIGTERM/SIGHUP stop our servers first: their default action ends the process without
    ``atexit``, which would leave every server's group running. Only where the signal still has its
    default action (an application's own handler is left alone), and only from the main thread
    (the only one that may set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in TERMINATION_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _on_termination)


def _on_termination(signum: int, frame: Any) -> None:
    stop_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # end as the signal would have, exit status included


def stop_servers(servers: list[ServerProcess], term_timeout: float = 10.0, kill_timeout: float = 5.0) -> None:
    """Stop ``servers``, each with its whole group as :meth:`ServerProcess.stop` does, all at once: every
    group gets its SIGTERM first, so their shutdowns overlap instead of adding up."""
    for server in servers:
        server.terminate()
    for server in servers:
        server.stop(term_timeout=term_timeout, kill_timeout=kill_timeout)


@atexit.register
def stop_all() -> None:
    """Stop every server this process started and has not stopped (at exit, whatever the cause)."""
    stop_servers(list(_LIVE), term_timeout=5.0, kill_timeout=5.0)


def _errors_only(output: str) -> str:
    """The error lines of :meth:`ServerProcess.server_output` (its tail is already in the message)."""
    return "\n".join(line for line in output.splitlines() if _ERROR_LINE.search(line))[-4000:] or "(none)"
