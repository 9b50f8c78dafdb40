"""Drive headless Chromium from the tests with the Python standard library only.

Two ways in:

* :func:`screenshot`: ``chromium --headless --screenshot=PNG --window-size=W,H file://...`` (proves
  the page renders; the PNG is checked and can be looked at).
* :func:`load_page`: the DevTools protocol over ``--remote-debugging-pipe`` (fd 3: commands in,
  fd 4: replies and events out, NUL-separated JSON), no websocket library needed. It opens the
  page, then reports every console error, uncaught exception, log error and network request, and
  can evaluate expressions in the page.

The flags keep Chromium off the network and out of the user's profile; it runs as root, hence
``--no-sandbox``.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INSTALL_HINT = "install it with: apt-get update && apt-get install -y chromium"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--disable-default-apps", "--mute-audio", "--hide-scrollbars")


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; raises ValueError if ``data`` is not a PNG."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG file")
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def screenshot(binary: str, url: str, png: Path, width: int = 1400, height: int = 2400,
               timeout: float = 90) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="kvbench-chromium-") as profile:
        return subprocess.run([binary, *FLAGS, f"--user-data-dir={profile}", f"--screenshot={png}",
                               f"--window-size={width},{height}", url],
                              capture_output=True, text=True, timeout=timeout, check=False)


@dataclass
class PageReport:
    """What happened while a page loaded."""

    console_errors: list[str] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)
    log_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # every URL the page asked for, the page's own included
    evaluated: dict[str, Any] = field(default_factory=dict)


class _Pipe:
    """One DevTools session over the two pipes: send commands, collect events."""

    def __init__(self, proc: subprocess.Popen, to_browser: int, from_browser: int):
        self.proc, self.out, self.inp = proc, to_browser, from_browser
        self.next_id = 0
        self.replies: dict[int, dict] = {}
        self.events: list[dict] = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self.inp, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                with self.cond:
                    self.cond.notify_all()
                return
            buf += chunk
            *messages, buf = buf.split(b"\0")
            with self.cond:
                for raw in messages:
                    msg = json.loads(raw)
                    if "id" in msg:
                        self.replies[msg["id"]] = msg
                    else:
                        self.events.append(msg)
                self.cond.notify_all()

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 30) -> dict:
        self.next_id += 1
        msg: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.out, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.next_id not in self.replies:
                left = deadline - time.monotonic()
                if left <= 0 or not self.reader.is_alive():
                    raise TimeoutError(f"no reply to {method} from Chromium")
                self.cond.wait(left)
            reply = self.replies.pop(self.next_id)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def wait_event(self, method: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for ev in self.events:
                    if ev.get("method") == method:
                        return ev
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"Chromium sent no {method}")
                self.cond.wait(left)


def load_page(binary: str, url: str, expressions: dict[str, str] | None = None, settle: float = 1.0,
              timeout: float = 60, width: int = 1400, height: int = 2400,
              shots: dict[str | os.PathLike[str], str] | None = None) -> PageReport:
    """Open ``url`` in headless Chromium over the DevTools pipe and report what happened.

    ``expressions`` ({name: JavaScript}) are evaluated after the load event; their values land in
    ``PageReport.evaluated``. ``settle`` seconds after the load catch late errors and requests. The
    window is ``width`` x ``height`` CSS pixels. ``shots`` ({png path: CSS selector}) saves a
    screenshot of the window scrolled to each selector's element (the top of the page for "body").
    """
    cmd_r, cmd_w = os.pipe()  # we write commands, the browser reads them on fd 3
    ev_r, ev_w = os.pipe()  # the browser writes on fd 4, we read

    def child_fds() -> None:
        # Runs in the child before exec. Copy both ends above 10 first so that placing one on 3 or 4
        # cannot clobber the other; dup2 leaves 3 and 4 inheritable. (Popen closes other fds after this.)
        high_r, high_w = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 10), fcntl.fcntl(ev_w, fcntl.F_DUPFD, 10)
        os.dup2(high_r, 3)
        os.dup2(high_w, 4)

    with tempfile.TemporaryDirectory(prefix="kvbench-chromium-") as profile:
        proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe",
                                 f"--window-size={width},{height}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                pass_fds=(3, 4), preexec_fn=child_fds)
        os.close(cmd_r)
        os.close(ev_w)
        pipe = _Pipe(proc, cmd_w, ev_r)
        try:
            return _drive(pipe, url, expressions or {}, settle, timeout, shots or {})
        finally:
            with contextlib.suppress(OSError, TimeoutError, RuntimeError):
                pipe.call("Browser.close", timeout=5)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()  # only the browser we started
                proc.wait(timeout=10)
            os.close(cmd_w)
            os.close(ev_r)


def _drive(pipe: _Pipe, url: str, expressions: dict[str, str], settle: float, timeout: float,
           shots: dict[str | os.PathLike[str], str]) -> PageReport:
    targets = pipe.call("Target.getTargets")["targetInfos"]
    page = next(t for t in targets if t["type"] == "page")
    session = pipe.call("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})["sessionId"]
    for domain in ("Page", "Runtime", "Log", "Network"):
        pipe.call(f"{domain}.enable", session=session)
    with pipe.cond:
        pipe.events.clear()  # forget about:blank
    pipe.call("Page.navigate", {"url": url}, session=session)
    pipe.wait_event("Page.loadEventFired", timeout=timeout)
    time.sleep(settle)
    report = PageReport()
    for name, js in expressions.items():
        res = pipe.call("Runtime.evaluate", {"expression": js, "returnByValue": True}, session=session)
        if "exceptionDetails" in res:
            report.exceptions.append(f"{name}: {res['exceptionDetails'].get('text')}")
        report.evaluated[name] = res.get("result", {}).get("value")
    for path, selector in shots.items():
        pipe.call("Runtime.evaluate", {"expression": f"document.querySelector({json.dumps(selector)})"
                                                     ".scrollIntoView(); window.scrollBy(0, -60); 0"}, session=session)
        time.sleep(0.2)
        png = pipe.call("Page.captureScreenshot", {"format": "png"}, session=session)["data"]
        Path(path).write_bytes(base64.b64decode(png))
    time.sleep(0.2)
    with pipe.cond:
        events = list(pipe.events)
    for ev in events:
        method, params = ev.get("method"), ev.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert", "warning"):
            report.console_errors.append(" ".join(str(a.get("value", a.get("description", "")))
                                                  for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            report.exceptions.append(details.get("exception", {}).get("description") or details.get("text", ""))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") in ("error", "warning"):
            report.log_errors.append(params["entry"].get("text", ""))
        elif method == "Network.requestWillBeSent":
            report.requests.append(params.get("request", {}).get("url", ""))
    return report
