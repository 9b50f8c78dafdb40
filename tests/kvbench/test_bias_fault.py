"""The unpressured equivalence check fails on an engine whose q/k/v matmul leaves out its bias, in process and
inside the reference server, on the built-in ``tiny`` checkpoint (which has attention and MLP biases).

On a checkpoint without attention biases the same fault changes nothing, and the check cannot notice it:
the last test here shows that on tiny's bias-free twin. That is why the suites' default checkpoint has biases.
"""

from __future__ import annotations

import pytest

from kvbench.conformance.prove import roomy_knobs
from kvbench.engines.registry import make_adapter, parse_engine_spec
from kvbench.models.builtin import builtin_checkpoint
from suites.conformance import test_equivalence
from tests.kvbench import fault_test_fixtures as _shared
from tests.kvbench.test_checks_can_fail import assert_fails, faulty

# the shared fixtures (tests/kvbench/fault_test_fixtures.py), bound here so that pytest finds them for this module
model_dir = _shared.model_dir
one_torch_thread = _shared.one_torch_thread
requests_greedy = _shared.requests_greedy
truth = _shared.truth
truth_engine = _shared.truth_engine


FAULT = "drops_attention_bias"


def _unpressured_check_fails(engine, truth, requests_greedy, truth_engine) -> str:
    unpressured = engine.generate(requests_greedy, roomy_knobs(engine, requests_greedy))
    return assert_fails(test_equivalence.test_unpressured_matches_ground_truth, r"differ from the ground truth",
                        engine=engine, unpressured=unpressured, truth=truth, requests_greedy=requests_greedy,
                        truth_engine=truth_engine, near_ties=[])


def test_the_fault_takes_the_bias_out_of_the_matmul_each_forward_pass_calls(model_dir):
    """The fault is in the engine's matmul, not in the checkpoint: the called projection has no bias left, the
    unfused views keep theirs (the weights as loaded)."""
    engine = faulty(FAULT, model_dir).build_engine()
    attn = engine.model.model.layers[0].self_attn
    assert attn.qkv is not None and attn.qkv.bias is None
    assert attn.q_proj.bias is not None and attn.o_proj.bias is not None


def test_unpressured_equivalence_fails_when_the_engine_drops_its_attention_bias(model_dir, truth, requests_greedy,
                                                                              truth_engine):
    """Caught only because tiny has attention biases (``attention_bias: true``): on a bias-free checkpoint the
    fault is a no-op (the next test)."""
    _unpressured_check_fails(faulty(FAULT, model_dir), truth, requests_greedy, truth_engine)


@pytest.mark.server
def test_unpressured_equivalence_fails_over_http_when_the_server_drops_its_attention_bias(
        model_dir, truth, requests_greedy, truth_engine, tmp_path):
    """The same fault inside the reference server (:class:`~kvbench.conformance.faults.FaultyServerAdapter`)."""
    from kvbench.conformance.faults import FaultyServerAdapter

    engine = FaultyServerAdapter(model_dir, {"fault": FAULT, "log_dir": str(tmp_path)})
    try:
        _unpressured_check_fails(engine, truth, requests_greedy, truth_engine)
    finally:
        engine.close()


def test_without_attention_biases_the_fault_goes_unnoticed(requests_greedy):
    """tiny's bias-free twin (the same weight matrices, no biases): the fault leaves nothing out, so the
    unpressured check passes on it. A suite run on a bias-free checkpoint cannot tell this engine from a correct
    one; the default checkpoint has biases for this reason."""
    twin = str(builtin_checkpoint("tiny", attention_bias=False, mlp_bias=False))
    truth_engine = make_adapter(parse_engine_spec("hf"), twin)
    try:
        engine = faulty(FAULT, twin)
        assert engine.build_engine().model.model.layers[0].self_attn.qkv.bias is None
        unpressured = engine.generate(requests_greedy, roomy_knobs(engine, requests_greedy))
        test_equivalence.test_unpressured_matches_ground_truth(
            engine=engine, unpressured=unpressured, truth=truth_engine.generate(requests_greedy),
            requests_greedy=requests_greedy, truth_engine=truth_engine, near_ties=[], tolerance=0.0)
    finally:
        truth_engine.close()
