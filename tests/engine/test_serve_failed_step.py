"""A step that fails after giving its requests tokens: the server delivers those tokens before each request's
error, whether the engine runs in its own process or on a thread of the server, and its stream shows them
ahead of the error event. The front end's deliberate faults (``--front-end-fault``) are shown breaking exactly
that, and the text of a stream, and nothing else."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import threading

import pytest
from starlette.testclient import TestClient

from reference_engine import EngineConfig, LLMEngine, SamplingParams
from reference_engine.outputs import RequestOutput
from reference_engine.serve import app as serve_app
from reference_engine.serve import detokenize
from reference_engine.serve.app import build_app
from reference_engine.serve.command_line import main as serve_main
from reference_engine.serve.engine_loop import EngineFailure, EngineLoop
from reference_engine.serve.engine_process import EngineInfo, EngineProcess, _EngineCore
from reference_engine.serve.front_end_faults import FRONT_END_FAULTS, apply_front_end_fault

FAILING_STEP = 3  # the step that fails, after its model run: by then a lone request holds 3 tokens


class _FailsAfterItsTokens:
    """An engine whose ``FAILING_STEP``-th step gives its requests their tokens and then raises."""

    def __init__(self, engine: LLMEngine):
        self._engine, self.steps = engine, 0

    def step(self):
        self.steps += 1
        result = self._engine.step()
        if self.steps == FAILING_STEP:
            raise RuntimeError("injected failure after the step's tokens")
        return result

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def _engine(ckpt: str) -> _FailsAfterItsTokens:
    return _FailsAfterItsTokens(LLMEngine(EngineConfig(model=ckpt, num_gpu_blocks_override=64)))


PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


async def _until_failed(outputs: asyncio.Queue) -> tuple[list[RequestOutput], EngineFailure]:
    seen: list[RequestOutput] = []
    while True:
        item = await asyncio.wait_for(outputs.get(), 60)
        if isinstance(item, EngineFailure):
            return seen, item
        seen.append(item)


def test_in_its_own_process_a_failed_steps_tokens_come_before_the_failure(tiny_ckpt: str) -> None:
    engine = _engine(tiny_ckpt)
    server_end, core_end = multiprocessing.Pipe(duplex=True)
    core = threading.Thread(target=lambda: _EngineCore(engine, core_end).run(), daemon=True)
    core.start()
    front = EngineProcess(server_end, EngineInfo.of(engine._engine))

    async def scenario():
        front.start(asyncio.get_running_loop())
        return await _until_failed(await front.add("a", [5, 6], PARAMS))

    try:
        seen, failure = asyncio.run(scenario())
    finally:
        front.stop()
        core.join(10)
    assert "injected failure after the step's tokens" in str(failure)
    assert seen and len(seen[-1].token_ids) == FAILING_STEP, "the failed step's token did not come before the failure"
    assert not engine.has_unfinished_requests() and engine.block_manager.is_whole()


def test_on_a_thread_of_the_server_a_failed_steps_tokens_come_before_the_failure(tiny_ckpt: str) -> None:
    engine = _engine(tiny_ckpt)
    loop = EngineLoop(engine)

    async def scenario():
        loop.start(asyncio.get_running_loop())
        return await _until_failed(await loop.add("a", [5, 6], PARAMS))

    try:
        seen, failure = asyncio.run(scenario())
    finally:
        loop.stop()
    assert "injected failure after the step's tokens" in str(failure)
    assert seen and len(seen[-1].token_ids) == FAILING_STEP


def _stream(ckpt: str) -> list[dict]:
    """The events of one streamed completion served by an engine whose step fails after its tokens."""
    with TestClient(build_app(_engine(ckpt), served_model_name="tiny")) as client:
        r = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 20, "temperature": 0, "stream": True,
                                                 "return_token_ids": True, "ignore_eos": True})
    assert r.status_code == 200
    return [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:") and "[DONE]" not in line]


def test_a_stream_shows_every_token_the_engine_gave_before_its_error_event(tiny_ckpt: str) -> None:
    events = _stream(tiny_ckpt)
    assert "error" in events[-1] and "injected failure" in events[-1]["error"]["message"]
    ids = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
    assert len(ids) == FAILING_STEP


def test_the_front_end_fault_drops_them(tiny_ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_app, "_latest", serve_app._latest)  # restored after the test
    apply_front_end_fault("drops_tokens_of_a_failed_step")
    events = _stream(tiny_ckpt)
    assert "error" in events[-1]
    assert len([t for e in events[:-1] for t in e["choices"][0]["token_ids"]]) < FAILING_STEP


def test_the_text_fault_breaks_streamed_deltas_only(tiny_ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(detokenize.TextStream, "push", detokenize.TextStream.push)  # restored after the test
    apply_front_end_fault("streams_text_without_leading_spaces")
    engine = LLMEngine(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=64))
    body = {"prompt": [5, 6], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with TestClient(build_app(engine, served_model_name="tiny", coalesce_stream=False)) as client:
        whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        streamed = client.post("/v1/completions", json={**body, "stream": True}).text
    deltas = "".join(json.loads(line[5:])["choices"][0]["text"] for line in streamed.splitlines()
                     if line.startswith("data:") and "[DONE]" not in line)
    assert whole.startswith(" t") and whole.count(" ") == 6, "non-streamed text is left right"
    assert deltas != whole and deltas.replace(" ", "") == whole.replace(" ", ""), "only the spaces are lost"


def test_an_unknown_front_end_fault_exits_2_naming_those_there_are(tiny_ckpt: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        serve_main(["--model", tiny_ckpt, "--front-end-fault", "nope"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--front-end-fault 'nope'" in err and all(name in err for name in FRONT_END_FAULTS)
