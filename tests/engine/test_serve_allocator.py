"""The engine process's allocator (``--engine-malloc``, :mod:`reference_engine.serve.allocator`): TCMalloc
where the system has it, the system's otherwise, a clear error where it is demanded and missing, and the
environment of the server itself left as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from reference_engine.config import EngineConfig
from reference_engine.serve.allocator import (
    AllocatorMissing,
    engine_preload,
    find_tcmalloc,
    loaded_allocator,
    preloading,
)
from reference_engine.serve.engine_process import EngineProcess


def _fake_lib(folder: Path, name: str = "libtcmalloc_minimal.so.4") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(b"\x7fELF")
    return folder / name


def test_auto_takes_tcmalloc_where_found_and_the_system_allocator_where_not(tmp_path: Path) -> None:
    empty, with_lib = str(tmp_path / "none"), tmp_path / "lib"
    lib = _fake_lib(with_lib)
    assert engine_preload("auto", [empty]) is None
    assert engine_preload("auto", [empty, str(with_lib)]) == lib, "folders tried in order"
    assert engine_preload("tcmalloc", [str(with_lib)]) == lib
    assert engine_preload("system", [str(with_lib)]) is None
    _fake_lib(with_lib, "libtcmalloc.so.4")
    assert find_tcmalloc([str(with_lib)]) == lib, "the minimal build first"


def test_tcmalloc_demanded_where_there_is_none_says_how_to_install_it(tmp_path: Path) -> None:
    with pytest.raises(AllocatorMissing, match=r"libtcmalloc-minimal4.*--engine-malloc=system"):
        engine_preload("tcmalloc", [str(tmp_path)])
    with pytest.raises(ValueError, match="--engine-malloc='jemalloc' is invalid"):
        engine_preload("jemalloc")


def test_the_preload_is_only_for_the_process_started_in_the_block(monkeypatch) -> None:
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", raising=False)
    with preloading(Path("/x/libtcmalloc.so.4")):
        assert os.environ["LD_PRELOAD"] == "/x/libtcmalloc.so.4"
        assert int(os.environ["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) > 1 << 40, "a KV pool is no news"
    assert "LD_PRELOAD" not in os.environ and "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD" not in os.environ
    monkeypatch.setenv("LD_PRELOAD", "/y/libother.so")
    with preloading(Path("/x/libtcmalloc.so.4")):
        assert os.environ["LD_PRELOAD"] == "/y/libother.so /x/libtcmalloc.so.4", "one already there is kept"
    assert os.environ["LD_PRELOAD"] == "/y/libother.so"
    with preloading(None):
        assert os.environ["LD_PRELOAD"] == "/y/libother.so"


def test_the_allocator_is_read_from_the_process_maps() -> None:
    assert loaded_allocator("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4\n") == \
        "tcmalloc"
    assert loaded_allocator("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n") == "system"


@pytest.mark.skipif(find_tcmalloc() is None, reason="no TCMalloc library on this machine (libtcmalloc-minimal4)")
def test_the_engine_process_runs_on_the_library_it_was_started_with(tiny_ckpt: str) -> None:
    """Started with TCMalloc, the engine process has it mapped; started without, it has not; this process
    (the server's) is not given it either way."""
    before = loaded_allocator()
    seen = {}
    for preload in (find_tcmalloc(), None):
        engine = EngineProcess.spawn(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=64), threads=1,
                                     preload=preload)
        try:
            seen[preload is not None] = engine.info.allocator
        finally:
            engine.stop()
    assert seen == {True: "tcmalloc", False: "system"}
    assert loaded_allocator() == before and os.environ.get("LD_PRELOAD") != str(find_tcmalloc())


def test_tcmalloc_without_an_engine_process_is_refused_naming_the_flag(tiny_ckpt: str, capsys) -> None:
    from reference_engine.serve.command_line import main

    with pytest.raises(SystemExit) as exit_:
        main(["--model", tiny_ckpt, "--engine-malloc", "tcmalloc", "--no-engine-process"])
    assert exit_.value.code == 2
    assert "--engine-malloc=tcmalloc needs the engine in its own process" in capsys.readouterr().err
