"""The rule that a test which starts a server process carries the ``server`` marker, held by two hooks that
``tests/conftest.py`` imports: while a test without the marker sets up (its fixtures, module-scoped ones
included: they start in the setup of the first test that uses them) or runs, starting a
:class:`~kvbench.launch.process.ServerProcess` (whatever its command), or a ``subprocess.Popen`` whose command
starts a server (:func:`server_command`; ``subprocess.run`` goes through it), fails the test at the launch,
naming the command, before anything starts. A server started inside a child pytest (``pytester``, ``python
-m pytest``) is out of its sight: such a test is marked by hand.

Why a marker: server start-ups are most of the suite's wall time; ``pytest -m "not server"`` leaves every
one of them out, and ``-m server`` runs only them.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from kvbench.launch.process import ServerProcess

#: modules that serve when run with ``python -m`` (the reference server, kvbench's test servers, peers)
SERVER_MODULES = ("reference_engine.serve", "kvbench.testing.stub_server", "kvbench.testing.patched_server",
                  "vllm.entrypoints.openai.api_server", "sglang.launch_server")
#: programs that serve with the subcommand ``serve``
SERVING_PROGRAMS = ("vllm", "transformers")


def server_command(argv: Sequence[str | bytes | os.PathLike] | str) -> bool:
    """Whether a command line starts a server: one of :data:`SERVER_MODULES` run with ``-m``, ``vllm serve`` or
    ``transformers serve``, also inside ``bash -c "..."`` or ``python -c "..."``. A ``--help`` only prints,
    and starts nothing. A child pytest or kvbench run that a ``server:`` engine makes start one is not
    recognised here (whether it starts one depends on what it finds)."""
    text = argv if isinstance(argv, str) else " ".join(os.fsdecode(arg) for arg in argv)
    words = [w.strip("\"'[](),;&") for w in text.split()]  # the words of a script's own command lists too
    if "--help" in words or "-h" in words:
        return False
    for i, word in enumerate(words):
        following = words[i + 1] if i + 1 < len(words) else ""
        module = following if word == "-m" else word[2:] if word.startswith("-m") else ""
        if module.startswith(SERVER_MODULES):
            return True
        if os.path.basename(word) in SERVING_PROGRAMS and following == "serve":
            return True
    return False


@contextmanager
def servers_need_the_marker(item: pytest.Item) -> Iterator[None]:
    """While in this block, a server launched for ``item`` without the ``server`` marker fails it."""
    if item.get_closest_marker("server") is not None:
        yield
        return
    original_popen, original_start = subprocess.Popen.__init__, ServerProcess.start

    def refuse(command: Any) -> None:
        pytest.fail(f"{item.nodeid} starts a server ({command!r}) without @pytest.mark.server: mark it, so that "
                    "`-m 'not server'` leaves it out", pytrace=False)

    def guarded_popen(popen: subprocess.Popen, args: Any, *a: Any, **k: Any) -> None:
        if server_command([args] if isinstance(args, (str, bytes, os.PathLike)) else args):
            refuse(args)
        original_popen(popen, args, *a, **k)

    def guarded_start(server: ServerProcess) -> None:
        refuse(server.argv)

    subprocess.Popen.__init__ = guarded_popen  # type: ignore[method-assign]
    ServerProcess.start = guarded_start  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.__init__ = original_popen  # type: ignore[method-assign]
        ServerProcess.start = original_start  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with servers_need_the_marker(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with servers_need_the_marker(item):
        return (yield)
