"""The checkpoint variants real models have, each computed as transformers computes it: attention biases
(Llama's ``attention_bias``: q, k, v and o), MLP biases (``mlp_bias``), tied and untied embeddings, grouped-query
and plain multi-head attention; in prefill and decode, on the plain and the packed (oneDNN) matmul paths and
the fused elementwise kernels. The biases are shown to matter, so agreeing on them is not agreeing on nothing.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.models.random_llama import write_checkpoint
from reference_engine import EngineConfig, LLMEngine, SamplingParams
from reference_engine.kernels import cpu_linear
from reference_engine.model import UnsupportedModelError, load_model

# name -> overrides of the tiny preset (which has GQA, attention and MLP biases, untied embeddings)
VARIANTS = {
    "no-bias": dict(attention_bias=False, mlp_bias=False),
    "attention-bias": dict(mlp_bias=False),
    "mlp-bias": dict(attention_bias=False),
    "both-biases-tied": dict(tie_word_embeddings=True),
    "both-biases-mha": dict(num_key_value_heads=4),  # as many KV heads as query heads
}
PROMPT_LENGTHS = (5, 37, 60, 90)
#: blocks of 4 tokens: every prompt is admitted at once (50 blocks), and their growth preempts (62 at the end)
POOL_BLOCKS = 52
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("variants")
    return {name: str(write_checkpoint(root / name, preset="tiny", seed=0, num_hidden_layers=1, **overrides))
            for name, overrides in VARIANTS.items()}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _hf(model_dir: str):
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def _hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


def _engine_greedy(model_dir: str, prompts: list[list[int]], **config) -> list[list[int]]:
    # a pool that preempts, so decodes after a recompute are compared too
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=4, num_gpu_blocks_override=POOL_BLOCKS, **config))
    for setting, path in config.items():  # the paths asked for by name are the ones that ran
        assert path == "auto" or getattr(engine, setting) == path, (setting, getattr(engine, setting))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert engine.counters().preemptions > 0
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_transformers(variant, checkpoints, prompts) -> None:
    """A batch of prompts of different lengths, paged: every position's logits within 1e-4 of transformers'."""
    model_dir = checkpoints[variant]
    hf = _hf(model_dir)
    engine = LLMEngine(EngineConfig(model=model_dir, num_gpu_blocks_override=64))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=1))
    out = engine.scheduler.schedule()
    assert [c.num_tokens for c in out.chunks] == [len(p) for p in prompts]
    with torch.inference_mode():
        input_ids, positions, meta, _ = engine.runner.prepare(out.chunks)
        ours = engine.model.compute_logits(engine.model(input_ids, positions, engine.kv_cache.device_cache, meta))
        row = 0
        for prompt in prompts:
            theirs = hf(torch.tensor([prompt])).logits[0]
            diff = (ours[row : row + len(prompt)] - theirs).abs().max().item()
            assert diff <= 1e-4, f"{variant}, prompt of {len(prompt)} tokens: max abs logit difference {diff}"
            row += len(prompt)
    engine.scheduler.update(out, {})  # computed, nothing sampled
    for i in range(len(prompts)):
        engine.abort_request(f"p{i}")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_outputs_equal_transformers_on_every_cpu_path(variant, checkpoints, prompts, monkeypatch) -> None:
    """Prefill and decode, under preemption: the torch paths, and the packed matmuls (every weight packed, as
    bfloat16 packs tiny's) with the fused elementwise kernels, each token-equal to transformers."""
    model_dir = checkpoints[variant]
    expected = _hf_greedy(_hf(model_dir), prompts)
    assert _engine_greedy(model_dir, prompts, linear_backend="torch", elementwise_backend="torch",
                          attention_backend="torch") == expected
    if cpu_linear.why_unavailable(torch.float32):
        pytest.skip(cpu_linear.why_unavailable(torch.float32))
    biased = []
    real = cpu_linear._packed_matmul

    def noting_bias(x, packed, bias):
        biased.append(bias is not None)
        return real(x, packed, bias)

    monkeypatch.setattr(cpu_linear, "_packed_matmul", noting_bias)
    monkeypatch.setattr(cpu_linear, "PACKED_MIN_FLOAT32_WEIGHT", 0)  # tiny's weights would stay unpacked
    # "auto": the C++ elementwise and attention kernels where they build, else their torch fallbacks
    assert _engine_greedy(model_dir, prompts, linear_backend="onednn", elementwise_backend="auto",
                          attention_backend="auto") == expected
    has_bias = VARIANTS[variant].get("attention_bias", True) or VARIANTS[variant].get("mlp_bias", True)
    assert biased and any(biased) == has_bias, "the packed matmuls did not get the checkpoint's biases"


def test_biases_are_loaded_into_the_fused_projections(checkpoints) -> None:
    from safetensors.torch import load_file

    model_dir = checkpoints["attention-bias"]
    model, tensors = load_model(model_dir), load_file(f"{model_dir}/model.safetensors")
    attn = model.model.layers[0].self_attn
    want = torch.cat([tensors[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(attn.qkv.bias, want)
    assert torch.equal(attn.o_proj.bias, tensors["model.layers.0.self_attn.o_proj.bias"])
    assert model.model.layers[0].mlp.gate_up.bias is None  # mlp_bias off: no bias, not a zero one


def test_the_biases_change_the_tokens(checkpoints, prompts) -> None:
    """The model with its q/k/v biases zeroed gives other greedy tokens: matching transformers above is
    evidence that the biases were computed, not that they were too small to matter."""
    model_dir = checkpoints["attention-bias"]
    hf = _hf(model_dir)
    expected = _hf_greedy(hf, prompts)
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    assert _hf_greedy(hf, prompts) != expected


def test_a_checkpoint_whose_biases_disagree_with_its_config_is_refused(checkpoints, tmp_path) -> None:
    """config.json says attention_bias but the tensors are missing (or the other way round): refused, naming
    the keys, never silently computed without them (or with zeros)."""
    import json
    import shutil

    for source, flip in (("attention-bias", False), ("no-bias", True)):
        target = tmp_path / source
        shutil.copytree(checkpoints[source], target)
        config = json.loads((target / "config.json").read_text())
        config["attention_bias"] = flip
        (target / "config.json").write_text(json.dumps(config))
        with pytest.raises(UnsupportedModelError, match=r"missing .*bias|unexpected .*bias"):
            load_model(target)
