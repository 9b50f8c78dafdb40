"""Tests of kvbench.models.random_llama: seeded random Llama checkpoints that transformers loads."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from kvbench.models import random_llama as checkpoint
from kvbench.models.random_llama import (
    CONFIG_FILE,
    PRESETS,
    WEIGHTS_FILE,
    build_config,
    build_weights,
    measure_margins,
    repeated_token_states,
    write_checkpoint,
)

transformers = pytest.importorskip("transformers")

# Floors for the tiny preset's greedy margins (top-1 minus top-2 logit), stated in the module's
# terms: float32 noise is ~1e-5..1e-4, so a p1 of 1e-2 is >= 100x above it.
MEDIAN_MARGIN_FLOOR = 1.0
P1_MARGIN_FLOOR = 1e-2


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=0)


def load_hf(path: pathlib.Path) -> tuple[torch.nn.Module, dict]:
    model, info = transformers.LlamaForCausalLM.from_pretrained(str(path), output_loading_info=True)
    return model.eval(), info


def assert_loaded_cleanly(info: dict) -> None:
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    assert not info["error_msgs"], info


def test_transformers_loads_tiny_with_intended_config(tiny_dir: pathlib.Path) -> None:
    model, info = load_hf(tiny_dir)
    assert_loaded_cleanly(info)
    cfg = model.config
    preset = PRESETS["tiny"]
    assert cfg.model_type == "llama"
    assert model.dtype == torch.float32
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
    ):
        assert getattr(cfg, key) == preset[key], key
    assert cfg.rms_norm_eps == pytest.approx(preset["rms_norm_eps"])
    assert cfg.rope_parameters["rope_theta"] == pytest.approx(preset["rope_theta"])
    assert cfg.tie_word_embeddings is False
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)
    # GQA: fewer KV heads than query heads, and the projections have the matching shapes.
    head_dim = preset["hidden_size"] // preset["num_attention_heads"]
    assert cfg.head_dim == head_dim
    assert preset["num_key_value_heads"] < preset["num_attention_heads"]
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (preset["num_attention_heads"] * head_dim, preset["hidden_size"])
    assert attn.k_proj.weight.shape == (preset["num_key_value_heads"] * head_dim, preset["hidden_size"])
    # The weights transformers holds are the file's, untouched by its own init.
    tensors = load_file(str(tiny_dir / WEIGHTS_FILE))
    state = model.state_dict()
    for name, tensor in tensors.items():
        assert torch.equal(state[name], tensor), name


def test_rope_theta_reaches_transformers(tmp_path: pathlib.Path) -> None:
    # 10000 is also transformers' default, so only a non-default value proves it is read from the file.
    theta = 123456.0
    model, info = load_hf(write_checkpoint(tmp_path, preset="tiny", rope_theta=theta))
    assert_loaded_cleanly(info)
    assert model.config.rope_parameters["rope_theta"] == pytest.approx(theta)
    head_dim = model.config.head_dim
    expected = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq.float(), expected)


def test_config_json_is_plain_llama(tiny_dir: pathlib.Path) -> None:
    config = json.loads((tiny_dir / CONFIG_FILE).read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert config["hidden_act"] == "silu"
    assert config["rope_scaling"] is None
    # tiny has the biases some real models have (small, as Llama, none): every loader must compute them
    assert config["attention_bias"] is True and config["mlp_bias"] is True
    assert build_config("small")["attention_bias"] is False and build_config("small")["mlp_bias"] is False
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # grouped-query attention
    assert config["kvbench_init"]["seed"] == 0 and config["kvbench_init"]["preset"] == "tiny"


def test_biases_are_written_where_the_config_asks_for_them(tiny_dir: pathlib.Path) -> None:
    """Llama's layout: attention_bias puts a bias on q, k, v and o; mlp_bias on gate, up and down; never on
    lm_head or the norms. Each is a real draw (not zeros), at about BIAS_SCALE of its projection's output."""
    tensors = load_file(str(tiny_dir / WEIGHTS_FILE))
    biases = sorted(name for name in tensors if name.endswith(".bias"))
    layers = PRESETS["tiny"]["num_hidden_layers"]
    projections = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert biases == sorted(f"model.layers.{i}.{p}.bias" for i in range(layers) for p in projections)
    for name in biases:
        weight = tensors[name.removesuffix(".bias") + ".weight"]
        assert tensors[name].shape == (weight.shape[0],), name
        gain = PRESETS["tiny"]["qk_gain"] if ("q_proj" in name or "k_proj" in name) else 1.0
        assert 0.3 < tensors[name].std().item() / (checkpoint.BIAS_SCALE * gain) < 3, name
    for overrides, absent in ((dict(attention_bias=False), "self_attn"), (dict(mlp_bias=False), "mlp.")):
        config = build_config("tiny", **overrides)
        assert not [n for n in build_weights(config) if n.endswith(".bias") and absent in n], overrides


def test_the_bias_free_twin_shares_the_weight_matrices(tiny_dir: pathlib.Path) -> None:
    """Biases are drawn after everything else: the same seed without them gives the same matrices, but for the
    output rows the repeated-token repair moves (it sees the biases)."""
    with_biases = load_file(str(tiny_dir / WEIGHTS_FILE))
    twin = build_weights(build_config("tiny", attention_bias=False, mlp_bias=False))
    assert set(twin) == {n for n in with_biases if not n.endswith(".bias")}
    for name in twin:
        if name != "lm_head.weight":
            assert torch.equal(twin[name], with_biases[name]), name
    moved = (twin["lm_head.weight"] != with_biases["lm_head.weight"]).any(-1).sum().item()
    assert moved < PRESETS["tiny"]["vocab_size"] // 10


def test_same_seed_gives_identical_bytes(tmp_path: pathlib.Path) -> None:
    first = write_checkpoint(tmp_path / "a", preset="tiny", seed=7)
    second = write_checkpoint(tmp_path / "b", preset="tiny", seed=7)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_different_seed_gives_different_weights(tmp_path: pathlib.Path) -> None:
    a = load_file(str(write_checkpoint(tmp_path / "a", preset="tiny", seed=0) / WEIGHTS_FILE))
    b = load_file(str(write_checkpoint(tmp_path / "b", preset="tiny", seed=1) / WEIGHTS_FILE))
    assert a.keys() == b.keys()
    for name in a:
        assert not torch.equal(a[name], b[name]), name


def test_config_json_alone_regenerates_the_weights(tiny_dir: pathlib.Path) -> None:
    config = json.loads((tiny_dir / CONFIG_FILE).read_text())
    regenerated = build_weights(config)
    stored = load_file(str(tiny_dir / WEIGHTS_FILE))
    assert regenerated.keys() == stored.keys()
    for name, tensor in stored.items():
        assert torch.equal(regenerated[name], tensor), name


def test_tied_variant_has_no_lm_head_and_loads(tmp_path: pathlib.Path) -> None:
    out = write_checkpoint(tmp_path, preset="tiny", tie_word_embeddings=True)
    tensors = load_file(str(out / WEIGHTS_FILE))
    assert "lm_head.weight" not in tensors
    model, info = load_hf(out)
    assert_loaded_cleanly(info)
    assert model.config.tie_word_embeddings is True
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_repeated_token_analysis_matches_transformers_and_has_no_fixed_point(
    tiny_dir: pathlib.Path,
) -> None:
    """Every context "t t ... t" is followed greedily by a token other than t (no run-forever token)."""
    model, _ = load_hf(tiny_dir)
    vocab = model.config.vocab_size
    contexts = torch.arange(vocab)[:, None].expand(vocab, 8)  # [vocab, 8]: row t is t repeated
    with torch.inference_mode():
        hf_logits = model(contexts).logits[:, -1]  # [vocab, vocab]
    config = json.loads((tiny_dir / CONFIG_FILE).read_text())
    weights = load_file(str(tiny_dir / WEIGHTS_FILE))
    predicted = repeated_token_states(config, weights) @ weights["lm_head.weight"].T
    torch.testing.assert_close(predicted, hf_logits, atol=1e-3, rtol=1e-4)
    assert (hf_logits.argmax(-1) != torch.arange(vocab)).all()


def test_tiny_margins_meet_the_floor(tiny_dir: pathlib.Path) -> None:
    result = measure_margins(tiny_dir, num_prompts=4, prompt_len=32, new_tokens=32)
    assert result["num_positions"] == 4 * 32
    assert result["median"] >= MEDIAN_MARGIN_FLOOR, result
    assert result["p1"] >= P1_MARGIN_FLOOR, result
    assert result["p1"] >= 100 * result["float32_noise"], result
    assert result["argmax_flips"] == 0, result
    # Greedy output keeps moving: no single token repeated for long, most tokens distinct.
    assert result["longest_repeat"] <= 4, result
    assert result["distinct_per_prompt_min"] >= 32 // 2, result


def test_unknown_preset_names_the_allowed_ones(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=r"unknown preset 'huge'.*\['small', 'tiny'\]"):
        write_checkpoint(tmp_path, preset="huge")


def test_bad_overrides_are_rejected_with_the_reason(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=r"unknown override.*hiden_size.*expected keys among"):
        build_config("tiny", hiden_size=32)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        build_config("tiny", num_key_value_heads=3)
    with pytest.raises(ValueError, match="seed=-1"):
        build_config("tiny", seed=-1)
    with pytest.raises(ValueError, match="attention_bias=1 is invalid: expected True or False"):
        build_config("tiny", attention_bias=1)


def test_builtin_variants_are_named_by_what_differs_from_the_preset() -> None:
    from kvbench.models.builtin import variant_name

    assert variant_name("tiny") == variant_name("tiny", attention_bias=True) == "tiny"
    assert variant_name("tiny", 32, attention_bias=False, mlp_bias=False) == "tiny-hd32-noattnbias-nomlpbias"
    assert variant_name("small", tie_word_embeddings=True, mlp_bias=True) == "small-mlpbias-tied"
    with pytest.raises(ValueError, match=r"unknown variant setting\(s\) \['qk_gain'\]"):
        variant_name("tiny", qk_gain=1.0)
    with pytest.raises(ValueError, match="mlp_bias='yes' is invalid"):
        variant_name("tiny", mlp_bias="yes")


def test_cli_writes_and_reports(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert checkpoint.main([str(tmp_path), "--preset", "tiny", "--seed", "3", "--tie-word-embeddings"]) == 0
    printed = capsys.readouterr().out
    assert str(tmp_path / WEIGHTS_FILE) in printed and "tied=True" in printed
    assert json.loads((tmp_path / CONFIG_FILE).read_text())["kvbench_init"]["seed"] == 3


def test_cli_turns_biases_off(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert checkpoint.main([str(tmp_path), "--preset", "tiny", "--no-attention-bias", "--no-mlp-bias"]) == 0
    assert "attention_bias=False mlp_bias=False" in capsys.readouterr().out
    assert not [n for n in load_file(str(tmp_path / WEIGHTS_FILE)) if n.endswith(".bias")]


def test_cli_rejects_unknown_preset(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        checkpoint.main([str(tmp_path), "--preset", "huge"])
    assert "['small', 'tiny']" in capsys.readouterr().err


def test_module_does_not_import_transformers() -> None:
    code = "import sys, kvbench.models.random_llama; sys.exit('transformers' in sys.modules)"
    root = pathlib.Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, check=False).returncode == 0
