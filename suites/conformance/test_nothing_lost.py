"""Check 6: nothing lost. Under storms with random aborts, in every mode, every request finishes exactly
once with a finish reason, unaborted ones get all their tokens, every abort that reached a running request
provably happened in the engine, and no block leaks (wherever the engine exposes its blocks). And an abort
that comes before a request's first token stops it in the engine.

Each assertion is a :func:`~kvbench.conformance.verdict.claim`, so a pinned failure (vLLM's uncounted client
aborts) excuses that one assertion and the leak and preemption assertions still run. What cannot be decided
(no abort confirmed, blocks not readable at idle, no preemption counter) ends the check undecided, saying why,
once every assertion has run.
"""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from kvbench.bench.workloads import Aborts, Poisson, Uniform, WorkloadSpec
from kvbench.conformance.aborts import confirmed_aborts
from kvbench.conformance.preconditions import record_precondition
from kvbench.conformance.prove import TIMED_TRIES, model_vocab, pressured_knobs, quietly, roomy_knobs
from kvbench.conformance.verdict import claim, record_proof, undecided
from kvbench.core.evidence import record_evidence
from kvbench.core.requests import GenRequest
from kvbench.core.trace import Trace, TraceRecorder
from kvbench.drivers.http_driver import ClientRequest
from kvbench.engines.base import Knobs
from kvbench.plugin import require

pytestmark = pytest.mark.conformance

MODES = {
    "recompute": (("recompute",), Knobs(preemption_mode="recompute")),
    "swap": (("swap",), Knobs(preemption_mode="swap", num_cpu_blocks=512)),
    "prefix+chunked": (("recompute", "prefix_caching", "chunked_prefill"),
                       Knobs(preemption_mode="recompute", enable_prefix_caching=True, enable_chunked_prefill=True,
                             max_num_batched_tokens=64)),
}
#: Workload seconds per engine step for engines kvbench steps itself (``steppable``). On the wall clock
#: the storm's outcome followed the machine's speed: at ~1 ms a step (a 2-core box) 2 of the 8 aborts
#: landed before their requests finished, and a machine a few times faster could finish all 8 first
#: (and, with arrivals spread thinner over its steps, preempt nothing), failing the check for no fault
#: of the engine. On the step clock arrivals and aborts are released by step index: the same seeded
#: storm every run, on any machine. Engines with their own loop thread stay on the wall clock.
STEP_SECONDS = 0.005
#: The storm's outputs (tokens) and when its aborts come (seconds after release). Aborts come early and to
#: long requests, so that each reaches a request far from its end: on the step clock 10-30 ms is 2-6
#: steps, far fewer than the tokens an aborted request asks for; over HTTP the client closes a stream once
#: its first token has come (``ClientRequest.abort_after_tokens``), with over a hundred to go. (With the
#: storm's own 8-48 tokens, the reference server at a millisecond a token finished a request in the time
#: its closed stream took to reach the engine.) An abort whose request may have finished first is not
#: counted (:mod:`kvbench.conformance.aborts`).
OUTPUT_LEN = (8, 48)
ABORTED_OUTPUT_TOKENS = 128
ABORT_AFTER = (0.01, 0.03)


def storm(mode: str, vocab: int):
    """The seeded storm of check 6: 32 requests, Poisson arrivals, a quarter of them long and aborted
    mid-stream."""
    workload = WorkloadSpec(name=f"storm-{mode}", num_requests=32, input_len=Uniform(8, 160),
                            output_len=Uniform(*OUTPUT_LEN), arrival=Poisson(200.0),
                            aborts=Aborts(fraction=0.25, after=ABORT_AFTER), seed=6).build(vocab)
    longer = [r if r.abort_at is None else replace(r, max_tokens=ABORTED_OUTPUT_TOKENS) for r in workload.requests]
    return replace(workload, requests=[mid_stream(r) for r in longer])


def mid_stream(request, after_tokens: int = 1) -> ClientRequest:
    """``request`` whose abort an HTTP client sends only once ``after_tokens`` tokens have come."""
    return ClientRequest(**{f.name: getattr(request, f.name) for f in fields(request)},
                         abort_after_tokens=after_tokens)


def _last_sample(trace: Trace):
    samples = [s for s in trace.steps if s.sampled]
    return samples[-1] if samples else None


def _storm_served(engine, workload, knobs, mode: str, by_id) -> Trace:
    """One serve of check 6's storm, its outputs judged: none lost, none finished twice, none aborted unasked,
    none short, none ended for another reason (a claim here fails the check: it is never served again)."""
    recorder = TraceRecorder(engine.name, f"nothing-lost-{mode}")
    engine.serve(workload, recorder, knobs, **({"step_seconds": STEP_SECONDS} if engine.steppable else {}))
    trace = recorder.finish()
    claim(set(trace.requests) == set(by_id), f"requests went missing: {sorted(set(by_id) - set(trace.requests))}")
    unfinished = [rid for rid, r in trace.requests.items() if r.finished is None or r.finish_reason is None]
    claim(not unfinished, f"never finished: {unfinished}")
    twice = trace.finished_more_than_once()
    claim(not twice, f"finished more than once (request: finishes): {twice}")
    unasked = sorted(rid for rid, r in trace.requests.items()
                     if r.finish_reason == "abort" and by_id[rid].abort_at is None)
    claim(not unasked, f"aborted by the engine, not asked for: {unasked}")
    short = [rid for rid, r in trace.requests.items()
             if r.finish_reason != "abort" and len(r.token_times) != by_id[rid].max_tokens]
    claim(not short, f"finished without all their tokens: {short}")
    odd = {rid: r.finish_reason for rid, r in trace.requests.items()
           if r.finish_reason not in ("length", "stop", "abort")}
    claim(not odd, f"finished for a reason other than length, stop or abort: {odd}")
    return trace


@pytest.mark.parametrize("mode", list(MODES))
def test_every_request_finishes_exactly_once(mode, engine, model_dir):
    caps, mode_knobs = MODES[mode]
    require(engine, *caps, "abort")
    vocab, _ = model_vocab(model_dir)
    workload = storm(mode, vocab)
    knobs = pressured_knobs(engine, workload.requests).merged(mode_knobs)
    by_id = {r.request_id: r for r in workload.requests}
    races = getattr(engine, "aborts_race_finishes", False)
    # over HTTP whether a closed stream lands on a running request depends on the moment (a front end short of CPU
    # wrote a whole stream at once, finished before its close: 0 of 8 sent): the storm runs quietly, and a try in
    # which no abort was confirmed is served again, each try's outputs judged first (prove.TIMED_TRIES in all)
    tries = 1 if getattr(engine, "steppable", False) else TIMED_TRIES
    with quietly(engine):
        attempt = 1
        trace = _storm_served(engine, workload, knobs, mode, by_id)
        seen = confirmed_aborts(trace, workload.requests, races)
        while not seen.confirmed and attempt < tries:
            attempt += 1
            trace = _storm_served(engine, workload, knobs, mode, by_id)
            seen = confirmed_aborts(trace, workload.requests, races)
    record_evidence("storm_tries", attempt)
    undecided_because: list[str] = []

    # --- the aborts: every one that reached a running request happened in the engine
    for what, ids in (("aborts_asked", seen.asked), ("aborts_sent", seen.sent), ("aborts_confirmed", seen.confirmed)):
        record_evidence(what, len(ids))
    # what a pin on the engine's count of aborts needs to be put to the test (kvbench.conformance.preconditions)
    record_precondition("aborts_reach_running_requests", bool(seen.confirmed))
    if not seen.confirmed:
        undecided_because.append(
            f"none of the {len(seen.asked)} aborts the workload asked for could be confirmed to reach a request "
            f"still running on {engine.name} ({len(seen.sent)} sent; confirmed: {seen.how}"
            f"{f'; in each of {attempt} tries' if attempt > 1 else ''}), so whether aborts reach the engine was not "
            "decided")
    else:
        if not races:  # in process the finish reasons are the engine's own
            missed = [rid for rid in seen.confirmed if trace.requests[rid].finish_reason != "abort"]
            shown = ", ".join(f"{rid} finished {trace.requests[rid].finish_reason!r}" for rid in missed[:5])
            claim(not missed, f"{len(missed)} of the {len(seen.confirmed)} aborts sent to requests still running "
                              f"({seen.how}) did not end them on {engine.name} ({shown}): the aborts never reached "
                              "the engine")
        if "aborts" in trace.counters:
            counted = trace.counters["aborts"]
            record_evidence("aborts", counted)
            if races:
                # a close the engine may have raced (sent, not confirmed) may or may not count there; a
                # confirmed one must, and nothing the client never closed may
                claim(counted >= len(seen.confirmed),
                      f"aborts counter {counted} but {len(seen.confirmed)} requests were aborted by the client while "
                      f"still running ({seen.how})")
                claim(counted <= len(seen.sent),
                      f"aborts counter {counted} but the client closed only {len(seen.sent)} streams before they ended")
            else:
                aborted = sum(r.finish_reason == "abort" for r in trace.requests.values())
                claim(counted == aborted, f"aborts counter {counted} but {aborted} requests finished aborted")
            if counted >= len(seen.confirmed):
                record_proof("aborts", counted)
        elif races:
            undecided_because.append(f"{engine.name} exposes no aborts counter: nothing of its own says the "
                                     f"{len(seen.confirmed)} confirmed aborts reached it")
        elif not [rid for rid in seen.confirmed if trace.requests[rid].finish_reason != "abort"]:
            record_proof("aborts", len(seen.confirmed))

    # --- no block leaked, nothing left running or waiting
    if "leaked_blocks" in trace.counters:
        leaked = trace.counters["leaked_blocks"]
        record_evidence("leaked_blocks", leaked)
        claim(leaked == 0, f"{leaked} blocks are still held after every request finished")
    elif "block_introspection" in engine.capabilities:
        claim(False, f"{engine.name} exposes its blocks but no leaked_blocks counter: the pool cannot be proved whole")
    else:
        last = _last_sample(trace)
        if last is not None and last.num_running + last.num_waiting + last.num_swapped > 0:
            undecided_because.append(
                f"{engine.name} still held {last.num_running} running and {last.num_waiting} waiting request(s) at "
                f"the last /metrics sample after the run, and its adapter read no leaked_blocks (it reads them only "
                "from a server holding nothing, within its settle time): whether blocks leaked was not decided")
        elif last is None:
            undecided_because.append(f"{engine.name} reported no leaked_blocks and no /metrics sample was taken after "
                                     "the run to say whether it still held requests: whether blocks leaked was not "
                                     "decided")
        else:
            undecided_because.append(f"{engine.name} held nothing after the run but publishes no KV usage that kvbench "
                                     "reads, so whether blocks leaked was not decided")

    # --- the storm preempted something
    if "preemptions_recompute" not in trace.counters and "preemptions_swap" not in trace.counters:
        undecided_because.append(f"{engine.name} exposes no preemption counter: cannot prove the storm preempted "
                                 "anything")
    else:
        preemptions = trace.counters.get("preemptions_recompute", 0) + trace.counters.get("preemptions_swap", 0)
        if preemptions == 0 and not getattr(engine, "steppable", False):
            # over a network the storm's arrivals spread with the machine's load: on vLLM the same workload
            # preempted in three runs and not in a fourth. A trigger that depends on timing is undecided, not failed
            undecided_because.append(f"the storm preempted nothing on {engine.name} in this run (its requests reach "
                                     "the engine over HTTP, spread by the machine's load): nothing proved")
        else:
            claim(preemptions > 0, "the storm preempted nothing: this check proved nothing")
            record_proof("preemptions", preemptions)
    if undecided_because:
        undecided("; ".join(undecided_because))


# ---------------------------------------------------------------------------- an abort before the first token
#: Two long requests hold both of the engine's slots (``max_num_seqs=2``) while the targets arrive and wait;
#: each target is aborted while it waits, before its first token. Seconds; on the step clock, steps of
#: STEP_SECONDS: the targets arrive at step 10, are aborted at step 70, and the bystanders hold the slots
#: for 600 steps (over HTTP: 0.6 s on the reference server at its fastest, several seconds on vLLM's CPU
#: build), while /metrics is sampled every 0.1 s: the targets are seen waiting, then gone.
#: Over HTTP, on a server that withholds its head until the first token, a target's stream is closed at its time
#: whether or not the server has answered with the response's head (``abort_before_head``): llama-server sends its
#: head only with a request's first token, so a client
#: that waited for the head closed only once the token was made, and whether it had read that token by then
#: decided the verdict (seen passing, failing and undecided from run to run). That the server held the targets
#: when they were closed is proved from /metrics (the waiting gauge) instead.
BYSTANDER_TOKENS = 600
TARGETS = 4
TARGET_TOKENS = 48
TARGETS_ARRIVE = 0.05
TARGETS_ABORTED_AFTER = 0.3
#: seconds after a close from which a server's gauges must show its request gone, and for which the slots must
#: still be full of bystanders for the close to be judged (an engine acts on a close a little after it)
GAUGE_LAG = 0.2
#: the engine's slots (``max_num_seqs``), each held by a bystander
SLOTS = 2
#: Waves of bystanders tried in turn over HTTP (each wave SLOTS bystanders, all sent at 0 s, ahead of the targets),
#: until the streams show the slots still full of bystanders GAUGE_LAG after the last close. One wave of 600 tokens
#: took 0.2-0.5 s on llama-server (one thread, 0.5 ms a step on tiny), so the bystanders were sometimes done before
#: the targets' closes at 0.3 s; on vLLM's CPU build one wave takes seconds and the first try decides.
HOLD_WAVES = (1, 2, 4)
#: Over HTTP, the targets must also be seen waiting in the engine before their closes: at least one /metrics sample
#: between their arrival and the first close. That window is 0.25 s at first, two or three samples at 10 Hz, and a
#: loaded client took none in it (vLLM, run 10 of docs/engines.md). A try that caught none closes the targets twice
#: as late, up to CLOSE_LATEST, with twice the waves so that the bystanders still hold the slots.
CLOSE_LATEST = 1.2


def early_abort_workload(vocab: int, waves: int = 1, before_head: bool = False,
                         close_after: float = TARGETS_ABORTED_AFTER) -> list[ClientRequest]:
    """``waves`` x SLOTS bystanders at 0 s, then the targets, each aborted ``close_after`` seconds in, before its
    first token can come (``before_head``: closed at their time without waiting for the response's head, for a
    server that sends its head only with the first token)."""
    def prompt(i: int) -> list[int]:
        return [3 + (7 * i + j) % (vocab - 3) for j in range(16)]

    bystanders = [ClientRequest(f"bystander{i}", prompt(i), BYSTANDER_TOKENS, 0.0) for i in range(SLOTS * waves)]
    targets = [ClientRequest(f"target{i}", prompt(10 + SLOTS * (waves - 1) + i), TARGET_TOKENS, TARGETS_ARRIVE,
                             abort_at=close_after, abort_before_head=before_head) for i in range(TARGETS)]
    return bystanders + targets


def slots_held_until(bystanders: list) -> float | None:
    """Until when the engine's SLOTS slots were provably all held by bystanders: they came first, so a freed slot
    went to a waiting bystander while one waited; the finish that left fewer than SLOTS of them unfinished. None
    if one never finished."""
    ends = sorted(b.finished for b in bystanders if b.finished is not None)
    return ends[len(bystanders) - SLOTS] if len(ends) == len(bystanders) else None


def _serve_early_aborts(engine, vocab: int, waves: int,
                        close_after: float = TARGETS_ABORTED_AFTER) -> tuple[list[ClientRequest], Trace]:
    # only where the server withholds its head until a token exists: elsewhere the close follows the head, so the
    # server has registered the request it is closing (a close before that raced the server's own bookkeeping)
    before_head = getattr(engine, "head_with_first_token", False)
    requests = early_abort_workload(vocab, waves, before_head, close_after)

    def gen(of: list[ClientRequest]) -> list[GenRequest]:
        return [GenRequest(r.request_id, r.prompt_token_ids, r.max_tokens) for r in of]

    # the pool holds the most waves any try sends, so that every try is served by one launch (on a peer each new
    # pool is a fresh start of tens of seconds)
    most = early_abort_workload(vocab, HOLD_WAVES[-1], before_head, close_after)
    knobs = roomy_knobs(engine, gen(most), sent=gen(requests), max_num_seqs=SLOTS)
    recorder = TraceRecorder(engine.name, "early-abort")
    engine.serve(requests, recorder, knobs, **({"step_seconds": STEP_SECONDS} if engine.steppable else {}))
    return requests, recorder.finish()


def _targets_waiting(bystanders: list):
    """A /metrics sample's waiting requests less the bystanders of later waves still waiting then (those not yet
    finished, beyond the SLOTS that run), as the client saw them finish."""
    def waiting(sample) -> int:
        unfinished = sum(b.finished is None or b.finished > sample.t for b in bystanders)
        return sample.num_waiting - max(0, unfinished - SLOTS)

    return waiting


def _seen_waiting(requests: list[ClientRequest], trace: Trace) -> bool:
    """Whether a /metrics sample between the targets' arrival and their first close counted them waiting (see
    :func:`_targets_waiting`); False where no target was closed. On an engine with no sampled steps (in process,
    stepped): True, since its step records are exact and the check reads its counters instead."""
    if not any(s.sampled for s in trace.steps):
        return True
    closes = [trace.requests[r.request_id].abort_sent for r in requests if r.abort_at is not None]
    closes = [c for c in closes if c is not None]
    if not closes:
        return False
    bystanders = [trace.requests[r.request_id] for r in requests if r.abort_at is None]
    waiting = _targets_waiting(bystanders)
    return any(waiting(s) > 0 for s in trace.steps if s.sampled and TARGETS_ARRIVE < s.t < min(closes))


def _outputs_hold(engine, requests: list[ClientRequest], trace: Trace, races: bool) -> None:
    """The claims of one try that need no timing, made on every try (a later try never stands in for a failed
    one): the bystanders got all their tokens, and no target closed before its first token went on."""
    bystanders = [trace.requests[r.request_id] for r in requests if r.abort_at is None]
    short = [f"{b.request_id}: {len(b.token_times)} tokens, {b.finish_reason!r}" for b in bystanders
             if b.finish_reason != "length" or len(b.token_times) != BYSTANDER_TOKENS]
    claim(not short, f"the requests beside the aborted ones did not get all their tokens: {short}")
    targets = [trace.requests[r.request_id] for r in requests if r.abort_at is not None]
    # which targets were closed before their first token: over HTTP the client saw it; on the step clock all were;
    # an engine on the wall clock that records no closes does not say (the check is then undecided)
    early = [t for t in targets if t.tokens_at_abort == 0] if races else \
        targets if trace.step_seconds is not None else []
    ran_on = {t.request_id: (len(t.token_times), t.finish_reason) for t in early
              if t.finish_reason != "abort" or t.token_times}
    claim(not ran_on, f"{engine.name} went on with requests aborted before their first token (request: (tokens, finish "
                      f"reason)): {ran_on}")


def _closed_while_held(requests: list[ClientRequest], trace: Trace) -> tuple[float | None, float | None]:
    """(the last target's close, until when the bystanders held every slot), from the client's streams."""
    closes = [trace.requests[r.request_id].abort_sent for r in requests if r.abort_at is not None]
    last_close = max((c for c in closes if c is not None), default=None)
    return last_close, slots_held_until([trace.requests[r.request_id] for r in requests if r.abort_at is None])


def test_an_abort_before_the_first_token_stops_the_request(engine, model_dir):
    require(engine, "abort")
    vocab, _ = model_vocab(model_dir)
    races = getattr(engine, "aborts_race_finishes", False)
    # over HTTP the targets must be closed while every slot is still held, with GAUGE_LAG to spare: confirmed from
    # the streams, with more waves of bystanders until it is (a close the engine had no time for proves nothing)
    # and seen waiting in the engine before the first close, with later closes until they are
    waves, close_after = HOLD_WAVES[0], TARGETS_ABORTED_AFTER
    for _ in HOLD_WAVES if races else HOLD_WAVES[:1]:
        with quietly(engine):  # closes placed against waiting requests: nothing else of the engine's starts meanwhile
            requests, trace = _serve_early_aborts(engine, vocab, waves, close_after)
        _outputs_hold(engine, requests, trace, races)  # every try is judged on what needs no timing: none dropped
        last_close, held_until = _closed_while_held(requests, trace)
        held = last_close is not None and held_until is not None and held_until > last_close + GAUGE_LAG
        seen = _seen_waiting(requests, trace)
        if (held and seen) or waves == HOLD_WAVES[-1]:
            break
        waves = HOLD_WAVES[HOLD_WAVES.index(waves) + 1]
        if not seen:
            close_after = min(close_after * 2, CLOSE_LATEST)
    record_evidence("bystander_waves", waves)
    record_evidence("targets_closed_after_s", close_after)
    targets = [r.request_id for r in requests if r.abort_at is not None]

    # --- the outputs (judged on every try above): the bystanders whole; the targets got nothing after their abort
    bystanders = [trace.requests[r.request_id] for r in requests if r.abort_at is None]
    if races:
        early = [rid for rid in targets if trace.requests[rid].tokens_at_abort == 0]
        late = [rid for rid in targets if rid not in early]
        # what a pin on an engine that runs closed requests needs to be put to the test (preconditions)
        record_precondition("closed_while_waiting", bool(early) and last_close is not None
                            and held_until is not None and held_until > last_close + GAUGE_LAG)
        if not early:
            undecided(f"no abort on {engine.name} came before its request's first token ({len(late)} came after "
                      "it, or the request ended first): nothing was decided")
        if last_close is None or held_until is None or held_until <= last_close + GAUGE_LAG:
            freed = "never" if held_until is None else f"at {held_until:.2f} s"
            undecided(f"with {waves} waves of bystanders, {engine.name}'s slots were not seen held for {GAUGE_LAG} s "
                      f"after the last close (at {last_close} s; a slot freed {freed}): the engine had no time to act "
                      "on the closes, so nothing was decided")
        record_evidence("slots_held_after_last_close_s", round(held_until - last_close, 3))
    elif trace.step_seconds is not None:  # aborted on the step clock at step 30; both slots are held until 200
        early = targets
    else:
        undecided(f"{engine.name} runs on the wall clock and records no closes: whether its aborts came before "
                  "the first token is not known")
    # --- the engine's own word: no token made for them, and they left its queues
    counters = trace.counters
    if not races:
        if "aborts" in counters:
            claim(counters["aborts"] == len(early), f"aborts counter {counters['aborts']} but {len(early)} requests "
                                                    "were aborted before their first token")
        if "leaked_blocks" in counters:
            claim(counters["leaked_blocks"] == 0, f"{counters['leaked_blocks']} blocks are still held after the run")
        record_proof("early_aborts", len(early))
        return
    received = sum(len(r.token_times) for r in trace.requests.values())
    if "generated_tokens" not in counters:
        undecided(f"{engine.name} exposes no generated-token counter: nothing of its own says the aborted requests "
                  "made no tokens")
    made = counters["generated_tokens"] - received
    claim(made <= 0, f"{engine.name} generated {counters['generated_tokens']} tokens but its clients received "
                     f"{received}: {made} tokens were made for the {len(early)} requests aborted before their first "
                     "token, which should have stopped")
    # the gauges a while after the last close (an abort reaches the engine a little after its stream closes)
    # and before the bystanders finish; none may fall in that window on a fast engine, and then the count
    # above is the evidence
    closed = max(trace.requests[rid].abort_sent for rid in early) + GAUGE_LAG
    targets_waiting = _targets_waiting(bystanders)
    window = [s for s in trace.steps if s.sampled and closed < s.t < held_until]
    still_queued = [targets_waiting(s) for s in window if targets_waiting(s) > 0]
    claim(not still_queued, f"{engine.name}'s /metrics still counted {max(still_queued, default=0)} waiting requests "
                            "after every aborted one was closed, while the bystanders still ran: the aborted requests "
                            "never left its queue")
    last = _last_sample(trace)
    if last is not None:
        claim(last.num_running + last.num_waiting == 0,
              f"{engine.name} still held {last.num_running} running and {last.num_waiting} waiting requests at the "
              "last /metrics sample after the run")
    # the mechanism: the engine held the targets (waiting behind the bystanders) when their aborts came
    first_close = min(trace.requests[rid].abort_sent for rid in early)
    held = [targets_waiting(s) for s in trace.steps if s.sampled and TARGETS_ARRIVE < s.t < first_close]
    if not any(held):
        undecided(f"no /metrics sample of {engine.name} caught the aborted requests waiting in the engine before "
                  f"their aborts ({len(held)} samples then): nothing shows that the aborts stopped requests it held")
    record_proof("early_aborts", len(early))
