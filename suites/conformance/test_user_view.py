"""What users read. The text a server writes is what its token ids say: the checkpoint tokenizer's decoding
of the ids it returns (in the prompt's context, special tokens left out), streamed (the deltas joined) and
not, under pressure. And a stream that fails mid-way has delivered, before its error event, every token the
engine produced.

Both judge what a client reads, so they need an engine whose adapter reads responses (the HTTP adapters,
through :mod:`kvbench.drivers.http_driver`); an engine that returns no text or no streams (the reference
engine in process) is skipped, saying so.
"""

from __future__ import annotations

import pytest

from kvbench.conformance.preconditions import note_pool_ran_dry
from kvbench.conformance.prove import (
    conformance_requests,
    pressured_knobs,
    timed_trigger_missed,
    together_knobs,
    until_triggered,
)
from kvbench.conformance.user_text import CheckpointText
from kvbench.conformance.verdict import claim, record_proof, undecided
from kvbench.core.evidence import record_evidence
from kvbench.core.trace import Trace, TraceRecorder
from kvbench.drivers.http_driver import ClientRequest

pytestmark = pytest.mark.conformance

#: how many differing requests a failure shows
SHOWN = 3
#: the streams of the mid-stream error check, all at once
STREAMS = 5


def client_requests(requests, streamed) -> list[ClientRequest]:
    """``requests`` (GenRequests) all at once, each streamed where ``streamed(index)`` says so."""
    return [ClientRequest(r.request_id, list(r.prompt_token_ids), r.max_tokens, 0.0, temperature=r.temperature,
                          seed=r.seed, stream=bool(streamed(i))) for i, r in enumerate(requests)]


def served(engine, requests, knobs, scenario: str) -> Trace:
    recorder = TraceRecorder(engine.name, scenario, keep_outputs=True)
    engine.serve(requests, recorder, knobs)
    return recorder.finish()


def _reads_responses(trace: Trace) -> bool:
    return any(r.output_text is not None or r.output_token_ids is not None for r in trace.requests.values())


def test_text_is_the_decoding_of_the_token_ids(engine, model_dir, requests_greedy):
    requests = client_requests(requests_greedy, streamed=lambda i: i % 2 == 0)
    knobs = pressured_knobs(engine, requests_greedy)

    def attempt():  # one pressured run, its outputs judged: served again over HTTP while it preempted nothing
        trace = served(engine, requests, knobs, "user-view-text")
        if not _reads_responses(trace):
            pytest.skip(f"{engine.name} returns no text or token ids of its own to a client: users read nothing "
                        "from it that could differ from its tokens")
        if all(r.output_text is None for r in trace.requests.values()):
            pytest.skip(f"{engine.name} writes no text: there is nothing a user reads beside the token ids")
        if all(r.output_token_ids is None for r in trace.requests.values()):
            pytest.skip(f"{engine.name} returns no token ids (its ids were read back from its text): the text could "
                        "only be compared with itself")

        # --- the outputs: each request's text against the tokenizer's decoding of its ids
        failed = {rid: r.finish_reason for rid, r in trace.requests.items()
                  if r.finish_reason not in ("length", "stop")}
        # what a pin on losing work when the pool runs dry needs to be put to the test (preconditions.pool_ran_dry)
        note_pool_ran_dry(trace, (knobs.num_gpu_blocks or 0) * (knobs.block_size or 0), engine.says_pool_full)
        # with the server's words, so that a pin on one cause of failure excuses that cause and no other
        said = {rid: f"{reason}: {trace.requests[rid].error}" if trace.requests[rid].error else reason
                for rid, reason in failed.items()}
        claim(not failed, f"requests did not finish (request: finish reason: the server's words): {said}")
        text = CheckpointText(model_dir)
        differ: dict[bool, list[str]] = {True: [], False: []}
        compared = {True: 0, False: 0}
        for req in requests:
            got = trace.requests[req.request_id]
            if got.output_token_ids is None or req.request_id in failed:
                continue
            want = text.after(req.prompt_token_ids, got.output_token_ids)
            if want is None:
                continue  # the prompt's text ends inside a character: no text is the output's alone
            compared[req.stream] += 1
            if (got.output_text or "") != want:
                differ[req.stream].append(f"{req.request_id} ({len(got.output_token_ids)} ids): wrote "
                                          f"{_excerpt(got.output_text or '', want)}")
        record_evidence("text_compared_streamed", compared[True])
        record_evidence("text_compared_not_streamed", compared[False])
        for stream, how in ((True, "streamed text (the deltas joined)"), (False, "non-streamed text")):
            bad = differ[stream]
            claim(not bad, f"{how} is not the checkpoint tokenizer's decoding of the token ids for {len(bad)} of "
                           f"{compared[stream]} requests on {engine.name}: " + "; ".join(bad[:SHOWN]))
        if not compared[True] or not compared[False]:
            undecided(f"no {'streamed' if not compared[True] else 'non-streamed'} output of {engine.name} had text of "
                      "its own to compare (each prompt's text ended inside a character, or none finished)")
        return trace

    trace = until_triggered(engine, ("preemptions_recompute", "preemptions_swap"), attempt)
    # --- under pressure: the run preempted
    counters = trace.counters
    if "preemptions_recompute" not in counters and "preemptions_swap" not in counters:
        undecided(f"{engine.name} exposes no preemption counter: the text matched, but not provably under pressure")
    preemptions = counters.get("preemptions_recompute", 0) + counters.get("preemptions_swap", 0)
    if preemptions == 0:
        timed_trigger_missed(engine, f"the run preempted nothing on {engine.name} (the text matched, but not "
                                     "provably under pressure)")
    claim(preemptions > 0, f"the run preempted nothing on {engine.name}: the text was not read under pressure")
    if preemptions > 0:
        record_proof("preemptions", preemptions)


def _excerpt(got: str, want: str, width: int = 24) -> str:
    """Where ``got`` first differs from ``want``, with a little context on each side."""
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    start = max(0, at - width // 2)
    return (f"{got[start:at + width]!r} where the ids decode to {want[start:at + width]!r} (character {at}; "
            f"{len(got)} vs {len(want)} characters)")


def test_every_token_before_a_mid_stream_error_is_delivered(engine, model_dir):
    # five requests of at most three 32-token blocks each, in a pool that holds them all at once: on vLLM's CPU build
    # the 16-block launch most checks share, so the check needs no launch of its own
    gen = conformance_requests(model_dir, n=STREAMS, prompt_len=(8, 40), output_len=(24, 40))
    trace = served(engine, client_requests(gen, streamed=lambda i: True), together_knobs(engine, gen),
                   "user-view-error")
    if not _reads_responses(trace):
        pytest.skip(f"{engine.name} has no streams of its own a client reads: no stream can fail mid-way")

    # --- the outputs: a stream that failed said so, after what it had delivered
    silent = [rid for rid, r in trace.requests.items() if r.finish_reason == "error" and r.error_event is None]
    claim(not silent, f"{len(silent)} streams on {engine.name} ended with neither a finish reason nor an error event: "
                      f"{silent[:SHOWN * 2]}")
    failed = {rid: r for rid, r in trace.requests.items() if r.error_event is not None}
    if not failed:
        undecided(f"no stream failed mid-way on {engine.name}: whether the tokens before an error reach the client "
                  "was not put to the test")
    received = sum(len(r.token_times) for r in trace.requests.values())
    if "generated_tokens" not in trace.counters:
        undecided(f"{engine.name} exposes no generated-token counter: nothing of its own says how many tokens it "
                  "produced before the failure")
    generated = trace.counters["generated_tokens"]
    shown = "; ".join(f"{rid} got {len(r.token_times)} tokens, then {r.error_event!r}"
                      for rid, r in list(failed.items())[:SHOWN])
    claim(received == generated,
          f"{engine.name} generated {generated} tokens but its clients received {received}: "
          f"{generated - received} tokens it produced never reached a client before its stream ended "
          f"({len(failed)} streams failed mid-way: {shown})")
    if received == generated:
        record_proof("mid_stream_failures", len(failed))
