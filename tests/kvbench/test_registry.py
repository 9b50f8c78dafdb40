"""The engine registry: kinds from the entry-point group, ``module:Class`` specs, options validated
by the engine's own rules, and the knob overrides an adapter reports."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvbench.core.evidence import EVIDENCE_PREFIX, collecting, evidence_of, record_evidence
from kvbench.engines import registry
from kvbench.engines.base import DEFAULT_KNOBS, EngineAdapter, GenOutput, GenRequest, GenResult, Knobs
from kvbench.engines.registry import EngineSpec, EngineSpecError, make_adapter, parse_engine_spec

ROOT = Path(__file__).resolve().parents[2]


class EchoAdapter(EngineAdapter):
    """Echoes each prompt back (a test adapter: no engine, no model)."""

    kind = "echo"
    option_keys = {"preemption_mode": "recompute or swap", "num_gpu_blocks_override": "pool size"}  # noqa: RUF012
    knob_options = {"num_gpu_blocks": "num_gpu_blocks_override"}  # noqa: RUF012

    @classmethod
    def validate_options(cls, options: dict[str, str]) -> None:
        super().validate_options(options)
        if options.get("preemption_mode", "recompute") not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode={options['preemption_mode']!r}: expected 'recompute' or 'swap'")

    def generate(self, requests: Sequence[GenRequest], knobs: Knobs = DEFAULT_KNOBS) -> GenResult:
        return GenResult([GenOutput(r.request_id, list(r.prompt_token_ids), "length", 0) for r in requests])


class NotAnAdapter:
    pass


class Abstract(EngineAdapter):
    kind = "abstract"


# ------------------------------------------------------------------------------------ registration
def test_builtin_kinds_are_exactly_the_entry_points_pyproject_registers():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["kvbench.engines"]
    assert declared == registry.BUILTIN_KINDS


def test_installed_entry_points_name_the_builtin_kinds():
    """The editable install's metadata carries the group (re-run `pip install -e .` if this fails)."""
    from importlib import metadata

    installed = {ep.name: ep.value for ep in metadata.entry_points(group=registry.ENTRY_POINT_GROUP)}
    assert {k: installed.get(k) for k in ("reference", "hf", "hf-cb")} == \
        {k: registry.BUILTIN_KINDS[k] for k in ("reference", "hf", "hf-cb")}


def _dist_info(root: Path, name: str, entry_points: str) -> Path:
    info = root / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)
    return root


def test_a_kind_registered_by_another_distribution_is_found(tmp_path, monkeypatch):
    root = _dist_info(tmp_path, "echo-engines", "[kvbench.engines]\necho = tests.kvbench.test_registry:EchoAdapter\n")
    monkeypatch.syspath_prepend(str(root))
    assert registry.engine_kinds()["echo"] == "tests.kvbench.test_registry:EchoAdapter"
    spec = parse_engine_spec("echo:preemption_mode=swap")
    assert spec == EngineSpec("echo", {"preemption_mode": "swap"})
    assert "echo: Echoes each prompt back" in registry.usage()


def test_one_kind_registered_twice_differently_is_an_error_naming_both(tmp_path, monkeypatch):
    for dist, target in (("one", "tests.kvbench.test_registry:EchoAdapter"),
                         ("two", "tests.kvbench.test_registry:Abstract")):
        monkeypatch.syspath_prepend(str(_dist_info(tmp_path / dist, dist, f"[kvbench.engines]\necho = {target}\n")))
    with pytest.raises(EngineSpecError, match=r"'echo' is registered twice") as info:
        registry.engine_kinds()
    assert "EchoAdapter (by one)" in str(info.value) and "Abstract (by two)" in str(info.value)


def test_a_broken_plugin_does_not_hide_the_other_kinds_in_the_usage(tmp_path, monkeypatch):
    root = _dist_info(tmp_path, "broken", "[kvbench.engines]\nbroken = no_such_module_xyz:Adapter\n")
    monkeypatch.syspath_prepend(str(root))
    text = registry.usage()
    assert "broken: (cannot be loaded:" in text and "No module named 'no_such_module_xyz'" in text
    assert "reference: reference_engine in-process" in text


# ----------------------------------------------------------------------------------- import paths
def test_a_class_by_import_path_with_options_after_a_second_colon():
    spec = parse_engine_spec("tests.kvbench.test_registry:EchoAdapter:preemption_mode=swap,num_gpu_blocks_override=8")
    assert spec.kind == "tests.kvbench.test_registry:EchoAdapter"
    assert spec.options == {"preemption_mode": "swap", "num_gpu_blocks_override": "8"}
    assert spec.name == "tests.kvbench.test_registry:EchoAdapter:num_gpu_blocks_override=8,preemption_mode=swap"
    assert parse_engine_spec(spec.name) == spec  # the display name parses back
    adapter = make_adapter(spec, "unused-model-dir")
    assert isinstance(adapter, EchoAdapter) and adapter.name == spec.name


@pytest.mark.parametrize(("text", "message"), [
    ("tests.kvbench.test_registry:NotAnAdapter", r"is not an engine adapter: it must be a subclass of .*EngineAdapter"),
    ("tests.kvbench.test_registry:Abstract", r"does not implement generate"),
    ("tests.kvbench.test_registry:Missing", r"module 'tests.kvbench.test_registry' has no attribute 'Missing'"),
    ("no_such_module_xyz.sub:Adapter", r"cannot import module 'no_such_module_xyz.sub': ModuleNotFoundError"),
    ("warp-drive", r"unknown engine kind 'warp-drive'"),
    ("warp-drive:fast=1", r"unknown engine kind 'warp-drive'"),
])
def test_a_bad_class_is_a_usage_error_naming_it(text, message):
    with pytest.raises(EngineSpecError, match=message) as info:
        parse_engine_spec(text)
    assert "MODULE:CLASS[:KEY=VALUE,...]" in str(info.value)  # the usage text follows


# ------------------------------------------------------------------------------ option validation
@pytest.mark.parametrize(("text", "message"), [
    ("reference:num_gpu_blocks_override=-3",
     r"num_gpu_blocks_override=-3 is invalid: expected None or an integer >= 1"),
    ("reference:preemption_mode=swapp", r"preemption_mode='swapp' is invalid: expected one of 'recompute', 'swap'"),
    ("reference:enable_prefix_caching=maybe", r"enable_prefix_caching='maybe' is invalid"),
    ("reference:block_size=24", r"block_size=24 is invalid: expected a power of two"),
    ("reference:preemption_mode=swap,preemption_mode=recompute", r"option 'preemption_mode' given twice"),
    ("hf-cb:scheduler=lifo", r"scheduler='lifo'; allowed: \['fifo', 'prefill_first'\]"),
    ("hf-cb:safety_margin=2", r"safety_margin='2'; expected a number from 0.0 to 1.0"),
    ("hf:device=tpu", r"device='tpu' is not supported"),
    ("tests.kvbench.test_registry:EchoAdapter:preemption_mode=swapp", r"preemption_mode='swapp': expected 'recompute'"),
])
def test_option_values_are_checked_when_the_spec_is_parsed(text, message):
    with pytest.raises(EngineSpecError, match=message):
        parse_engine_spec(text)


def test_reference_options_are_validated_by_engine_config_itself(monkeypatch):
    """Not a copy of the rules: a rule EngineConfig gains is enforced at parse time at once."""
    import reference_engine.config as config_module

    original = config_module.EngineConfig.__post_init__

    def stricter(self):
        original(self)
        if self.max_num_seqs > 100:
            raise config_module.ConfigError("max_num_seqs", self.max_num_seqs, "at most 100 (a test rule)")

    monkeypatch.setattr(config_module.EngineConfig, "__post_init__", stricter)
    parse_engine_spec("reference:max_num_seqs=100")
    with pytest.raises(EngineSpecError, match=r"max_num_seqs=101 is invalid: expected at most 100 \(a test rule\)"):
        parse_engine_spec("reference:max_num_seqs=101")


def test_valid_specs_parse_without_loading_a_model_or_transformers():
    code = ("import sys; from kvbench.engines.registry import parse_engine_spec; "
            "s = parse_engine_spec('reference:preemption_mode=swap,num_gpu_blocks_override=64,"
            "enable_prefix_caching=true'); print(sorted(s.options), 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['enable_prefix_caching',", "'num_gpu_blocks_override',", "'preemption_mode']",
                                   "False"]


# ---------------------------------------------------------------------------------- knob overrides
def test_knob_overrides_name_only_options_given_and_changed():
    adapter = EchoAdapter("m", {"preemption_mode": "swap", "num_gpu_blocks_override": "64"})
    assert adapter.knob_overrides(Knobs(preemption_mode="recompute", num_gpu_blocks=24, block_size=16)) == {
        "preemption_mode": ("swap", "recompute"), "num_gpu_blocks": ("64", 24)}
    assert adapter.knob_overrides(Knobs(preemption_mode="swap", num_gpu_blocks=64)) == {}
    assert EchoAdapter("m").knob_overrides(Knobs(preemption_mode="recompute")) == {}


def test_reference_maps_knobs_onto_its_option_names():
    from kvbench.engines.inprocess.reference import ReferenceAdapter

    adapter = ReferenceAdapter("m", {"num_gpu_blocks_override": "64", "enable_prefix_caching": "true"})
    assert adapter.knob_overrides(Knobs(num_gpu_blocks=24, enable_prefix_caching=True)) == {
        "num_gpu_blocks": ("64", 24)}
    assert adapter.knob_overrides(Knobs(enable_prefix_caching=False)) == {"enable_prefix_caching": ("true", False)}


def test_adapters_made_from_specs_report_overrides_to_the_running_test():
    adapter = make_adapter(parse_engine_spec("tests.kvbench.test_registry:EchoAdapter:preemption_mode=swap"), "m")
    request = GenRequest("r", [1, 2, 3], 2)
    adapter.generate([request])  # outside a test's collector: nothing to record, nothing breaks
    properties: list = []
    with collecting(properties) as collector:
        assert adapter.generate([request], Knobs(preemption_mode="recompute")).outputs[0].token_ids == [1, 2, 3]
        adapter.generate([request], knobs=Knobs(preemption_mode="swap"))
        adapter.generate([request], Knobs(preemption_mode="recompute"))
        record_evidence("preemptions_recompute", 7)
    assert collector.knob_overrides == {"preemption_mode": ["swap", "recompute"]}
    assert properties == [(EVIDENCE_PREFIX + "preemptions_recompute", 7)]
    assert evidence_of(properties) == {"preemptions_recompute": 7}
    record_evidence("preemptions_recompute", 8)  # after the block: no collector, no effect
    assert len(properties) == 1


def test_kvbench_own_stale_metadata_never_overrides_a_builtin_kind(tmp_path, monkeypatch):
    """An install made before a module moved still lists the old path for a built-in kind: the checkout's
    table wins, so ``--engine reference`` keeps working until the next ``pip install -e .``."""
    _dist_info(tmp_path, "kvbench", "[kvbench.engines]\nreference = kvbench.engines.reference:ReferenceAdapter\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert registry.engine_kinds()["reference"] == registry.BUILTIN_KINDS["reference"]


class KnobsSeen(EchoAdapter):
    """Keeps the knobs each generate call ran with."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list = []

    def generate(self, requests: Sequence[GenRequest], knobs: Knobs = DEFAULT_KNOBS) -> GenResult:
        self.seen.append(knobs)
        return super().generate(requests, knobs)


def test_run_settings_are_the_adapters_own_methods_not_patches():
    """configure_run sets data; the entry points the base class wraps at class definition apply it."""
    adapter = make_adapter(parse_engine_spec("tests.kvbench.test_registry:KnobsSeen:preemption_mode=swap"), "m")
    assert not {"generate", "serve"} & set(vars(adapter))  # nothing assigned onto the instance
    request = GenRequest("r", [1, 2], 1)
    adapter.generate([request])
    assert adapter.seen == [DEFAULT_KNOBS]  # not configured: the knobs as asked
    adapter.configure_run(admission_off_by_default=True)
    assert adapter.knobs_for(Knobs(block_size=16)) == Knobs(block_size=16, admission_policy="none")
    assert adapter.knobs_for(Knobs(admission_policy="watermark")).admission_policy == "watermark"
    with collecting([]) as collector:
        adapter.generate([request], knobs=Knobs(preemption_mode="recompute"))
        adapter.generate([request])
    assert adapter.seen[1:] == [Knobs(preemption_mode="recompute", admission_policy="none"),
                                Knobs(admission_policy="none")]
    assert collector.knob_overrides == {"preemption_mode": ["swap", "recompute"]}  # recorded once per call
