"""Finding a peer engine (kvbench.launch.peers) and refusing, before any test runs, an engine that cannot be
had: one usage error that says how to get it, not a traceback per check."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kvbench.engines.base import EngineUnavailable
from kvbench.engines.http.openai import OpenAIAdapter
from kvbench.engines.http.presets import VLLM_CPU_LAYOUT, VLLM_GPU_LAYOUT
from kvbench.engines.http.server import ServerAdapter
from kvbench.launch import peers
from kvbench.launch.process import free_port

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No vLLM anywhere kvbench looks: an empty peers folder, no KVBENCH_VLLM, no vllm on PATH."""
    monkeypatch.setenv("KVBENCH_PEERS_DIR", str(tmp_path / "peers"))
    monkeypatch.delenv("KVBENCH_VLLM", raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")  # no vllm command there
    peers._probe_python.cache_clear()
    return tmp_path


def _fake_python(path: Path, distribution: str, version: str) -> Path:
    """An executable that answers kvbench's probe as a Python with ``distribution`` installed would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho {distribution} {version}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_nothing_found_says_how_to_make_one(no_vllm: Path) -> None:
    with pytest.raises(peers.PeerMissing, match=r"bash scripts/peers\.sh vllm"):
        peers.find_vllm()
    with pytest.raises(EngineUnavailable, match=r"peers\.sh vllm"):
        ServerAdapter.check_available({"preset": "vllm"})


def test_the_recorded_environment_is_launched_as_a_module(no_vllm: Path) -> None:
    python = _fake_python(no_vllm / "peers" / "vllm" / "bin" / "python", "vllm-cpu", "0.32.0")
    (no_vllm / "peers" / "vllm" / "kvbench-peer.env").write_text(f"PYTHON={python}\nVERSION=0.32.0\n")
    found = peers.find_vllm()
    assert found.launcher == (str(python), "-m", "vllm.entrypoints.openai.api_server", "--model")
    assert (found.version, found.cpu_build) == ("0.32.0", True)
    assert ServerAdapter.kv_layout_for({"preset": "vllm"}) == VLLM_CPU_LAYOUT


def test_the_option_wins_and_a_gpu_build_keeps_its_layout(no_vllm: Path) -> None:
    python = _fake_python(no_vllm / "elsewhere" / "python3", "vllm", "0.33.1")
    found = peers.find_vllm(str(python))
    assert (found.version, found.cpu_build) == ("0.33.1", False)
    assert ServerAdapter.kv_layout_for({"preset": "vllm", "vllm": str(python)}) == VLLM_GPU_LAYOUT


def test_a_broken_install_is_named(no_vllm: Path) -> None:
    broken = no_vllm / "broken" / "python"
    broken.parent.mkdir(parents=True)
    broken.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named vllm' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(peers.PeerMissing, match="finds no vllm to import"):
        peers.find_vllm(str(broken))


def test_nothing_listening_is_unavailable() -> None:
    port = free_port()
    with pytest.raises(EngineUnavailable, match=f"nothing answers at http://127.0.0.1:{port}"):
        OpenAIAdapter.check_available({"url": f"http://127.0.0.1:{port}"})


@pytest.mark.parametrize("engine", ["server:preset=vllm", "openai:url=http://127.0.0.1:{port}"])
def test_an_engine_that_cannot_be_had_is_one_usage_error(engine: str, no_vllm: Path,
                                                         pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="def test_x(engine):\n    pass\n")
    result = pytester.runpytest_subprocess("--engine", engine.format(port=free_port()), "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    text = "\n".join(result.errlines + result.outlines)
    assert ("peers.sh vllm" in text) or ("nothing answers" in text)
    assert "Traceback" not in text and "passed" not in text


def test_default_peers_dir_is_per_machine_and_follows_the_cache(monkeypatch, tmp_path):
    """scripts/peers.sh makes $KVBENCH_CACHE/peers (~/.cache/kvbench/peers): the default must point there, so
    that a fresh clone finds the peers made once on this machine; KVBENCH_PEERS_DIR overrides it."""
    monkeypatch.delenv("KVBENCH_PEERS_DIR", raising=False)
    monkeypatch.delenv("KVBENCH_CACHE", raising=False)
    assert peers.peers_dir() == Path.home() / ".cache" / "kvbench" / "peers"
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    assert peers.peers_dir() == tmp_path / "cache" / "peers"
    monkeypatch.setenv("KVBENCH_PEERS_DIR", str(tmp_path / "elsewhere"))
    assert peers.peers_dir() == tmp_path / "elsewhere"


def test_peers_sh_and_kvbench_agree_on_the_folder():
    """The shell script and the Python side compute the same default (they are two readers of one rule)."""
    script = (ROOT / "scripts" / "peers.sh").read_text()
    assert 'cache_root="${KVBENCH_CACHE:-$HOME/.cache/kvbench}"' in script
    assert 'peers_dir="${KVBENCH_PEERS_DIR:-$cache_root/peers}"' in script
