"""The ``server`` marker rule (:mod:`tests.server_marker`): which commands start a server, and a test that
starts one (or any ``ServerProcess``) without the marker fails, from its body or from a module fixture,
while a marked one runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.server_marker import server_command

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv", [
    [sys.executable, "-m", "reference_engine.serve", "--model", "m", "--port", "0"],
    [sys.executable, "-m", "kvbench.testing.stub_server", "--port", "1"],
    [sys.executable, "-m", "kvbench.testing.patched_server", "--patch", "m:f", "--model", "m"],
    [sys.executable, "-mreference_engine.serve"],
    ["/opt/venv/bin/vllm", "serve", "m"],
    ["/opt/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"],
    ["bash", "-c", "python -m kvbench.testing.stub_server --port 8000 &"],
    [sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-m', 'reference_engine.serve'])"],
    "python -m reference_engine.serve --model m",
])
def test_server_commands_are_recognised(argv):
    assert server_command(argv)


@pytest.mark.parametrize("argv", [
    [sys.executable, "-m", "reference_engine.serve", "--help"],
    [sys.executable, "-m", "pytest", "suites", "--engine", "reference"],
    [sys.executable, "-c", "import vllm; print(vllm.__version__)"],
    ["pip", "show", "vllm"],
    ["bash", "-c", "kvbench engines"],
    ["vllm", "--version"],
    [sys.executable, "-m", "kvbench", "report", "results.json"],
])
def test_other_commands_are_not(argv):
    assert not server_command(argv)


def test_a_test_that_starts_a_server_without_the_marker_fails(pytester: pytest.Pytester):
    """In a child pytest that uses the hooks: the unmarked body and the unmarked module fixture fail at the
    launch, naming the test and the marker; the marked test launches (a harmless command that only looks
    like a server's, so that nothing serves) and passes. Nothing is started in the failing cases."""
    pytester.makeini("[pytest]\nmarkers =\n    server: starts a server\n")
    pytester.makeconftest(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.server_marker import pytest_runtest_call, pytest_runtest_setup
    """)
    pytester.makepyfile("""
        import subprocess, sys
        import pytest

        LOOKS_LIKE_A_SERVER = [sys.executable, "-c", "pass", "-m", "kvbench.testing.stub_server"]

        @pytest.fixture(scope="module")
        def started():
            subprocess.run(LOOKS_LIKE_A_SERVER, check=True)

        def test_body_unmarked():
            subprocess.run(LOOKS_LIKE_A_SERVER, check=True)

        def test_fixture_unmarked(started):
            pass

        @pytest.mark.server
        def test_marked():
            assert subprocess.run(LOOKS_LIKE_A_SERVER).returncode == 0

        def test_other_commands_unmarked():
            assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0

        def test_server_process_unmarked(tmp_path):
            from kvbench.launch.process import ServerProcess

            ServerProcess([sys.executable, "-c", "pass"], tmp_path / "log").start()
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:kvbench", "-rfE")
    result.assert_outcomes(passed=2, failed=2, errors=1)
    result.stdout.fnmatch_lines(["*test_server_process_unmarked starts a server (*'-c', 'pass'*) without*"])
    result.stdout.fnmatch_lines(["*ERROR at setup of test_fixture_unmarked*",
                                 "*test_fixture_unmarked starts a server*without @pytest.mark.server*"])
    result.stdout.fnmatch_lines(["*test_body_unmarked starts a server (*kvbench.testing.stub_server*) without "
                                 "@pytest.mark.server*"])
