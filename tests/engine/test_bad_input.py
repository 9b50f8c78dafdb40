"""Bad input is refused at the door, with a message naming what is wrong, and harms nobody else.

Requests: refused by ``add_request`` with :class:`RequestRejected` (a ``rejected`` event is recorded,
nothing else in the engine changes, the other requests run on to the same tokens). Checkpoints: a
config the model code does not implement raises :class:`UnsupportedModelError` naming the key; a
pickle-only directory is refused without ever being unpickled.
"""

from __future__ import annotations

import json
import pathlib
import pickle
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import torch

from reference_engine import EngineConfig, LLMEngine, RequestRejected, SamplingParams
from reference_engine.model import UnsupportedModelError
from tests.engine.engine_steps import finished_outputs

VOCAB = 512  # the tiny checkpoint's
MAX_MODEL_LEN = 128


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _snapshot(engine: LLMEngine) -> tuple:
    s = engine.scheduler
    return (engine.stats(), engine.counters(), sorted(s.requests), [r.request_id for r in s.waiting],
            [r.request_id for r in s.running], {k: list(v) for k, v in engine.block_manager.block_tables.items()})


def assert_rejected(engine: LLMEngine, request_id: Any, prompt: Any, params: Any, *fragments: str) -> str:
    """``add_request`` raises RequestRejected whose message holds every fragment; a ``rejected`` event
    records it and nothing else about the engine changes. Returns the message."""
    before, num_events = _snapshot(engine), len(engine.events)
    with pytest.raises(RequestRejected) as info:
        engine.add_request(request_id, prompt, params)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert _snapshot(engine) == before, "a rejection changed the engine's state"
    assert len(engine.events) == num_events + 1
    event = engine.events[-1]
    assert (event.kind, event.request_id, event.data) == ("rejected", str(request_id), {"reason": message})
    return message


# ---------------------------------------------------------------------- requests
@pytest.mark.parametrize("length", [MAX_MODEL_LEN, MAX_MODEL_LEN + 1, 500])
def test_over_long_prompt_is_rejected_and_the_others_run_on_unchanged(make_engine, length: int) -> None:
    before, after = _prompt(20, seed=1), _prompt(30, seed=2)
    engine = make_engine(num_gpu_blocks_override=64, max_model_len=MAX_MODEL_LEN)
    engine.add_request("before", before, _greedy(12))
    engine.step(), engine.step()
    assert_rejected(engine, "too-long", _prompt(length, seed=3), _greedy(4),
                    "'too-long'", f"prompt of {length} tokens", f"max_model_len={MAX_MODEL_LEN}")
    engine.add_request("after", after, _greedy(10))
    outputs = finished_outputs(engine)
    assert "too-long" not in outputs

    # the same two requests, added at the same steps, in an engine that never saw the bad one
    control = make_engine(num_gpu_blocks_override=64, max_model_len=MAX_MODEL_LEN)
    control.add_request("before", before, _greedy(12))
    control.step(), control.step()
    control.add_request("after", after, _greedy(10))
    expected = finished_outputs(control)
    for rid, n in (("before", 12), ("after", 10)):
        assert outputs[rid].finish_reason == "length" and len(outputs[rid].token_ids) == n
        assert outputs[rid].token_ids == expected[rid].token_ids, rid


def test_the_longest_prompt_that_fits_gets_exactly_one_token(make_engine) -> None:
    engine = make_engine(num_gpu_blocks_override=64, max_model_len=MAX_MODEL_LEN)
    engine.add_request("edge", _prompt(MAX_MODEL_LEN - 1, seed=4), _greedy(50))
    (out,) = finished_outputs(engine).values()
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_a_request_larger_than_the_whole_pool_is_rejected_with_both_numbers(make_engine) -> None:
    engine = make_engine(num_gpu_blocks_override=8)  # block_size 16: 128 tokens of KV in all
    # 100 prompt + 60 output tokens: the last one is never fed back, so 159 tokens of KV = 10 blocks
    message = assert_rejected(engine, "huge", _prompt(100, seed=5), _greedy(60), "'huge'", "needs 10 KV blocks",
                              "has 8", "block_size=16")
    assert "even alone" in message
    # 100 + 29 -> 128 tokens of KV = exactly the pool: accepted, and it runs to the end
    engine.add_request("exact", _prompt(100, seed=5), _greedy(29))
    (out,) = finished_outputs(engine).values()
    assert len(out.token_ids) == 29


@pytest.mark.parametrize(
    ("prompt", "fragments"),
    [
        ([], ("'bad'", "prompt is empty")),
        ([5, VOCAB, 6], ("'bad'", f"integers in [0, {VOCAB})")),
        ([5, -1], ("'bad'", f"integers in [0, {VOCAB})")),
        ([5, 1.0], ("'bad'", "integers")),
        ([5, "7"], ("'bad'", "integers")),
        ([5, None], ("'bad'", "integers")),
    ],
    ids=["empty", "vocab_size", "negative", "float", "str", "none"],
)
def test_malformed_prompts_are_rejected(make_engine, prompt: list, fragments: tuple[str, ...]) -> None:
    engine = make_engine(num_gpu_blocks_override=16)
    assert_rejected(engine, "bad", prompt, _greedy(4), *fragments)
    assert not engine.has_unfinished_requests()


def test_duplicate_request_id_is_rejected_and_the_first_is_untouched(make_engine) -> None:
    engine = make_engine(num_gpu_blocks_override=16)
    prompt = _prompt(10, seed=6)
    engine.add_request("dup", prompt, _greedy(5))
    engine.step()
    assert_rejected(engine, "dup", _prompt(12, seed=7), _greedy(3), "'dup'", "already in use")
    out = finished_outputs(engine)["dup"]
    assert out.prompt_token_ids == prompt and len(out.token_ids) == 5
    engine.add_request("dup", prompt, _greedy(5))  # a finished id may be used again
    assert finished_outputs(engine)["dup"].token_ids == out.token_ids


def test_sampling_params_must_be_sampling_params(make_engine) -> None:
    engine = make_engine(num_gpu_blocks_override=16)
    assert_rejected(engine, "r", _prompt(4, seed=8), {"max_tokens": 4}, "'r'", "sampling_params")


@pytest.mark.parametrize(("field", "value"), [("max_tokens", 0), ("temperature", -1.0), ("temperature", float("nan")),
                                              ("top_p", 0.0), ("top_k", -5), ("seed", "s")])
def test_invalid_sampling_params_raise_value_error_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_a_near_zero_temperature_samples_the_argmax_instead_of_crashing_the_step(make_engine) -> None:
    """Regression: logits / 1e-40 overflowed to inf, softmax gave NaN and torch.multinomial raised,
    taking the whole step (every other request's token) down with it."""
    engine = make_engine(num_gpu_blocks_override=32)
    prompt = _prompt(24, seed=9)
    engine.add_request("greedy", prompt, _greedy(8))
    engine.add_request("cold", prompt, SamplingParams(max_tokens=8, temperature=1e-40, seed=1, ignore_eos=True))
    outputs = finished_outputs(engine)
    assert outputs["cold"].token_ids == outputs["greedy"].token_ids


def test_aborting_an_unknown_or_finished_request_returns_false(make_engine) -> None:
    engine = make_engine(num_gpu_blocks_override=16)
    before = engine.stats(), engine.counters()
    assert engine.abort_request("nobody") is False
    assert (engine.stats(), engine.counters()) == before and not engine.has_unfinished_requests()
    engine.add_request("r", _prompt(4, seed=10), _greedy(2))
    assert engine.abort_request("r") is True
    assert engine.abort_request("r") is False, "aborting twice"
    assert [o.finish_reason for o in engine.step().outputs] == ["abort"]
    assert engine.counters().aborts == 1, "only the abort of an unfinished request counts"


# ---------------------------------------------------------------------- checkpoints
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0}


def _set(key: str, value: Any) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        config[key] = value
    return edit


def _v4_rope_scaling(config: dict) -> None:
    """A transformers-v4 style config: no rope_parameters, a linear rope_scaling."""
    del config["rope_parameters"]
    config["rope_scaling"] = {"type": "linear", "factor": 2.0}


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        (_set("rope_parameters", YARN), ("rope_parameters", "'yarn'")),
        # transformers v5 applies rope_scaling over a default rope_parameters: it must be refused too
        (_set("rope_scaling", YARN), ("rope_scaling", "'yarn'")),
        (_set("rope_scaling", {"rope_type": "llama3", "factor": 8.0}), ("rope_scaling", "'llama3'")),
        (_v4_rope_scaling, ("rope_scaling", "'linear'")),
        (_set("hidden_act", "gelu"), ("hidden_act", "'gelu'", "silu")),
        (_set("model_type", "gpt2"), ("model_type", "'gpt2'", "llama")),
    ],
    ids=["rope_parameters_yarn", "rope_scaling_yarn", "rope_scaling_llama3", "v4_linear", "gelu", "gpt2"],
)
def test_unsupported_checkpoint_config_is_refused_naming_the_key(tiny_ckpt: str, tmp_path: pathlib.Path,
                                                                 edit: Callable[[dict], None],
                                                                 fragments: tuple[str, ...]) -> None:
    model_dir = pathlib.Path(shutil.copytree(tiny_ckpt, tmp_path / "model"))
    config = json.loads((model_dir / "config.json").read_text())
    edit(config)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as info:
        LLMEngine(EngineConfig(model=str(model_dir), num_gpu_blocks_override=8))
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


class _Tripwire:
    """Unpickling this creates ``path``: proof that someone loaded the pickle."""

    def __init__(self, path: pathlib.Path):
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


def test_pickle_only_checkpoint_is_refused_and_never_unpickled(tiny_ckpt: str, tmp_path: pathlib.Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = tmp_path / "pickled"
    model_dir.mkdir()
    shutil.copy(pathlib.Path(tiny_ckpt) / "config.json", model_dir / "config.json")
    marker = tmp_path / "unpickled"
    (model_dir / "pytorch_model.bin").write_bytes(pickle.dumps(_Tripwire(marker)))

    def forbidden(*args, **kwargs):
        raise AssertionError("the pickle checkpoint was loaded")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    with pytest.raises(FileNotFoundError) as info:
        LLMEngine(EngineConfig(model=str(model_dir), num_gpu_blocks_override=8))
    message = str(info.value)
    assert "no *.safetensors" in message and str(model_dir) in message and "pickle" in message
    assert not marker.exists()


@pytest.mark.parametrize("bad_id", [7, "", None])
def test_request_id_must_be_a_non_empty_string(make_engine, bad_id):
    from reference_engine import RequestRejected, SamplingParams

    engine = make_engine(num_gpu_blocks_override=32)
    with pytest.raises(RequestRejected, match="request id"):
        engine.add_request(bad_id, [5, 6, 7], SamplingParams(max_tokens=2))
