"""Waking up after idle: what a step costs more after the engine sat idle (``wake_s``, ``wake_tau_s``),
how the simulator charges it, how calibration measures it, and the wall-clock driver's wait for an
arrival (slept, the last ``ARRIVAL_SPIN_S`` spun, so a lone request's TTFT does not carry the sleep's
lateness)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from kvbench.drivers import step_loop as stepping
from kvbench.models.builtin import builtin_checkpoint
from reference_engine.config import EngineConfig
from reference_engine.costs import Coefficients, CostModel, HardwareProfile, StepShape, load_model_shape
from reference_engine.sampling_params import SamplingParams
from reference_engine.sim.calibrate import Design, IntervalSample, WakeFit, fit_intervals, fit_wake, fit_wake_curve
from reference_engine.sim.sim_engine import SimEngine

BASE = HardwareProfile("synthetic", 1e11, 5e9, 5e9, 1e10, combine="sum", dtype="float32",
                       coefficients=Coefficients(fixed_s=1e-3, dense=2.0, memory=1.0))


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(builtin_checkpoint("tiny"))


# ------------------------------------------------------------------------------ the cost term
def test_wake_grows_with_the_idle_spell_towards_wake_s():
    c = Coefficients(wake_s=2e-3, wake_tau_s=0.05)
    assert c.wake_seconds(0.0) == 0.0
    assert c.wake_seconds(0.05) == pytest.approx(2e-3 * (1 - math.exp(-1)))
    assert c.wake_seconds(0.01) < c.wake_seconds(0.05) < c.wake_seconds(1.0) < 2e-3
    assert c.wake_seconds(10.0) == pytest.approx(2e-3)
    assert Coefficients().wake_seconds(10.0) == 0.0  # the default: no such cost


def test_a_wake_without_its_time_constant_is_refused_naming_it():
    with pytest.raises(ValueError, match="wake_tau_s"):
        Coefficients(wake_s=1e-3)
    with pytest.raises(ValueError, match="wake_s"):
        Coefficients(wake_s=-1.0, wake_tau_s=0.1)


def test_a_profile_file_keeps_its_wake_terms(tmp_path):
    profile = BASE.with_coefficients(Coefficients(fixed_s=1e-3, wake_s=1.4e-3, wake_tau_s=0.03))
    loaded = HardwareProfile.load(profile.save(tmp_path / "p.json"))
    assert loaded.coefficients == profile.coefficients
    # an older file without them loads with none
    data = profile.to_dict()
    del data["coefficients"]["wake_s"], data["coefficients"]["wake_tau_s"]
    assert HardwareProfile.from_dict(data).coefficients.wake_seconds(1.0) == 0.0


# ------------------------------------------------------------------------------ the simulator charges it
def _lone_step_seconds(engine: SimEngine, request_id: str, idle_s: float) -> float:
    """Simulated seconds of a lone 32-token prefill added after the clock waited ``idle_s``."""
    engine.clock.advance_to(engine.clock.now() + idle_s)
    engine.add_request(request_id, [5] * 32, SamplingParams(max_tokens=1, ignore_eos=True))
    t0 = engine.clock.now()
    while engine.has_unfinished_requests():
        engine.step()
    return engine.clock.now() - t0


@pytest.mark.parametrize("fast", [False, True])
def test_the_sim_charges_wake_after_an_idle_spell_and_not_back_to_back(tiny, fast):
    shape = load_model_shape(tiny)
    woken = BASE.with_coefficients(Coefficients(fixed_s=1e-3, dense=2.0, memory=1.0, wake_s=5e-3, wake_tau_s=0.02))
    engine = SimEngine(EngineConfig(model=tiny, dtype="float32"), shape, woken)
    if fast:
        engine.step = engine.step_fast  # the fast path prices through the same runner
    plain = CostModel(shape, BASE).step_seconds(StepShape.prefill(32))
    assert _lone_step_seconds(engine, "a", 0.0) == pytest.approx(plain)  # right after the start: no idle spell
    assert _lone_step_seconds(engine, "b", 1.0) == pytest.approx(plain + 5e-3)  # 50 time constants idle
    assert _lone_step_seconds(engine, "c", 0.0) == pytest.approx(plain)  # back to back again
    assert _lone_step_seconds(engine, "d", 0.02) == pytest.approx(plain + 5e-3 * (1 - math.exp(-1)))
    # the same spells on a profile without the term: nothing added (the term is what makes the difference)
    cold = SimEngine(EngineConfig(model=tiny, dtype="float32"), shape, BASE)
    assert _lone_step_seconds(cold, "a", 1.0) == pytest.approx(plain)


def test_taking_a_request_in_is_work_not_idleness(tiny):
    shape = load_model_shape(tiny)
    profile = BASE.with_coefficients(Coefficients(fixed_s=1e-3, per_request_s=0.5, wake_s=5e-3, wake_tau_s=0.02))
    engine = SimEngine(EngineConfig(model=tiny, dtype="float32"), shape, profile)
    engine.add_request("r", [5] * 32, SamplingParams(max_tokens=1, ignore_eos=True))  # 0.5 s on the clock
    assert engine.clock.take_idle() == 0.0


# ------------------------------------------------------------------------------ calibration measures it
def test_the_curve_fit_recovers_a_known_wake_and_finds_none_in_noise():
    gaps = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
    truth = Coefficients(wake_s=1.4e-3, wake_tau_s=0.04)
    wake_s, tau = fit_wake_curve({g: truth.wake_seconds(g) for g in gaps}, warm_s=1.2e-3)
    assert wake_s == pytest.approx(1.4e-3, rel=0.05) and tau == pytest.approx(0.04, rel=0.15)
    rng = np.random.default_rng(0)
    noise = {g: float(rng.normal(0.0, 2e-5)) for g in gaps}  # +-20 us around nothing, on a 1.2 ms step
    assert fit_wake_curve(noise, warm_s=1.2e-3) == (0.0, 0.0)
    assert fit_wake_curve({}, warm_s=1.2e-3) == (0.0, 0.0)
    # still rising at the longest spell: the time constant stops there rather than running off the grid
    rising = {g: 1e-3 * g / 0.2 for g in gaps}
    assert fit_wake_curve(rising, warm_s=1.2e-3)[1] <= 0.2


def test_the_interval_fit_keeps_the_profiles_wake_terms(tiny):
    shape = load_model_shape(tiny)
    base = BASE.with_coefficients(Coefficients(wake_s=1e-3, wake_tau_s=0.03, link=2.0, per_copy_s=1e-5))
    cost = CostModel(shape, base)
    samples = [IntervalSample(StepShape.decode_batch(b, c), 0, 1e-3 + 1e-5 * b + 1e-7 * c)
               for b in (1, 4, 16) for c in (16, 64, 256)]
    fitted = fit_intervals(cost, samples)
    assert (fitted.wake_s, fitted.wake_tau_s, fitted.link, fitted.per_copy_s) == (1e-3, 0.03, 2.0, 1e-5)


def test_the_design_names_a_bad_wake_setting():
    for bad in ((), (0.0,), (-0.01,), (float("nan"),)):
        with pytest.raises(ValueError, match="wake_gaps"):
            Design(wake_gaps=bad)
    with pytest.raises(ValueError, match="wake_repeats"):
        Design(wake_repeats=0)
    with pytest.raises(ValueError, match="wake_prompt"):
        Design(wake_prompt=0)


def test_fit_wake_times_the_reference_engine(tiny):
    """Served for real on the tiny model: one probe per spell (figures not asserted: this machine's)."""
    fit = fit_wake(tiny, Design(wake_gaps=(0.001, 0.03), wake_repeats=1))
    assert set(fit.extra_s) == {0.001, 0.03} and fit.warm_s > 0
    assert (fit.wake_s > 0) == (fit.wake_tau_s > 0)
    text = fit.describe()
    assert "1 ms" in text and "30 ms" in text and f"{fit.warm_s * 1e3:.2f} ms warm" in text
    saved = WakeFit.from_fit(Coefficients(wake_s=fit.wake_s, wake_tau_s=fit.wake_tau_s),
                             {"warm_s": fit.warm_s, "extra_s": {f"{g:g}": e for g, e in fit.extra_s.items()}})
    assert saved == fit


# ------------------------------------------------------------------------------ the driver's wait
def test_the_driver_never_releases_before_an_arrival_within_its_spin():
    for lead in (0.0002, stepping.ARRIVAL_SPIN_S / 2, stepping.ARRIVAL_SPIN_S):
        t = time.perf_counter() + lead
        stepping._wait_for(t, time.perf_counter, idle_sleep=0.001)
        assert time.perf_counter() >= t


def test_the_driver_sleeps_a_far_arrival_in_turns_of_at_most_50_ms():
    """Far off, the wait returns early (sleeping at most 50 ms) so the loop looks at aborts meanwhile."""
    t = time.perf_counter() + 5.0
    stepping._wait_for(t, time.perf_counter, idle_sleep=0.001)
    assert time.perf_counter() < t - 4.0
