"""Option ``preload`` of preset=vllm: the libraries vLLM's CPU installation page asks to have in ``LD_PRELOAD``,
found in vLLM's environment first, then the system's folders; an unknown name or a library found nowhere is an
error that names the option. Nothing is launched here."""

from __future__ import annotations

import pytest

from kvbench.engines.http.presets import preload_names, vllm_preload
from kvbench.engines.http.server import ServerAdapter


def test_each_library_is_found_in_vllms_environment_before_the_systems(tmp_path):
    env, system = tmp_path / "env", tmp_path / "system"
    (env / "lib").mkdir(parents=True)
    system.mkdir()
    (env / "lib" / "libiomp5.so").write_bytes(b"")
    (system / "libiomp5.so").write_bytes(b"")
    (system / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert vllm_preload("tcmalloc+iomp", str(env), [str(system)]) == (
        f"{system}/libtcmalloc_minimal.so.4:{env}/lib/libiomp5.so")
    assert vllm_preload("iomp", None, [str(system)]) == f"{system}/libiomp5.so"


def test_a_library_found_nowhere_says_how_to_install_it(tmp_path):
    with pytest.raises(ValueError, match=r"option preload: no tcmalloc library .*apt-get install libtcmalloc-minimal4"):
        vllm_preload("tcmalloc", str(tmp_path), [])


@pytest.mark.parametrize("choice", ["jemalloc", "", "tcmalloc+omp"])
def test_an_unknown_name_is_refused_naming_the_option(choice):
    with pytest.raises(ValueError, match="option preload="):
        preload_names(choice)


def test_the_option_is_for_preset_vllm_only():
    with pytest.raises(ValueError, match="option preload is for preset=vllm"):
        ServerAdapter.validate_options({"preset": "reference", "preload": "iomp"})
    with pytest.raises(ValueError, match="option preload='jemalloc'"):
        ServerAdapter.validate_options({"preset": "vllm", "preload": "jemalloc"})
