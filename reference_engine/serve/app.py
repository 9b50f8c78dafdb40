"""The FastAPI application: ``/v1/completions``, ``/v1/models``, ``/health``, ``/metrics``, and
``POST /kvbench/reconfigure`` where the server allows it (``--allow-reconfigure``).

Errors follow OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``. Bad input is a 400
whose ``param`` and message name the field (malformed JSON: ``body``; unknown field: that field; an
over-long prompt or an id outside the vocabulary: ``prompt``; ...), an oversized body a 413 naming the
limit, a missing or wrong API key a 401. None of them touches the engine's other requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from reference_engine.outputs import RequestOutput
from reference_engine.request import RequestRejected
from reference_engine.sampling_params import SamplingParams, TokenLogprobs
from reference_engine.serve.detokenize import TextCodec, load_codec
from reference_engine.serve.disconnect import (
    LAST_EVENT,
    SERVER_SEND,
    AbortOnDisconnectStream,
    ClientGone,
    race_disconnect,
)
from reference_engine.serve.engine_loop import EngineFailure, EngineLoop
from reference_engine.serve.engine_process import EngineBusy, EngineInfo, EngineProcess, EngineStartError
from reference_engine.serve.prometheus import ServerMetrics
from reference_engine.serve.protocol import (
    DEFAULT_MAX_BODY_BYTES,
    BadEngineArgs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    ReconfigureRequest,
    UnsupportedField,
    Usage,
    error_body,
    refuse_unsupported,
)

if TYPE_CHECKING:  # the HTTP process never imports the engine (nor torch): its engine runs in its own process
    from collections.abc import Callable

    from reference_engine.config import EngineConfig
    from reference_engine.engine import LLMEngine

_CHOICE_ORDER = tuple(CompletionChoice.model_fields)  # the order model_dump writes a choice's fields in


class BadRequest(Exception):
    def __init__(self, param: str | None, message: str, code: int = 400, type_: str = "BadRequestError"):
        super().__init__(message)
        self.param, self.message, self.code, self.type = param, message, code, type_


def _error(param: str | None, message: str, code: int = 400, type_: str = "BadRequestError") -> JSONResponse:
    return JSONResponse(error_body(message, param, code, type_), status_code=code)


class _Guard:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it would hide disconnects from the handlers):
    the API key on every path but ``/health``, and a cap on the request body size."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"] != "/health":
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                await _error("authorization", "missing or invalid API key: send 'Authorization: Bearer <key>'",
                             401, "AuthenticationError")(scope, receive, send)
                return
        limit = self.max_body_bytes
        too_big = _error("max_body_bytes", f"request body larger than the server's limit of {limit} bytes "
                                           "(--max-body-bytes)", 413, "RequestTooLarge")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            await too_big(scope, receive, send)
            return
        # Chunked bodies carry no length: count as they arrive.
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge()
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            # body chunks of a stream skip the layers between (see AbortOnDisconnectStream); its start passes
            await self.app({**scope, SERVER_SEND: send}, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await too_big(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def build_app(engine: LLMEngine | EngineProcess, *, served_model_name: str | None = None,
              api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, on_ready=None,
              reconfigure: Callable[[list[str]], EngineConfig] | None = None,
              coalesce_stream: bool = True) -> ServeApp:
    """The ASGI application serving ``engine``: an ``LLMEngine`` that nothing else may touch from now on
    (stepped on a thread of this process), or an :class:`EngineProcess` (the engine in its own process).

    Its engine loop starts and stops with the app's lifespan (run it under uvicorn, or under
    ``starlette.testclient.TestClient`` as a context manager). ``on_ready()`` is called once the
    engine loop runs (the CLI prints its "listening" line there). Text prompts use the
    ``tokenizer.json`` of the model directory, if it has one. ``coalesce_stream``: a stream sends the
    tokens that queued up while it was writing in one event (see :func:`_sse`); False: one event per
    engine step, however far behind the stream is.

    ``reconfigure(args)`` (an :class:`EngineProcess` only; the CLI's ``--allow-reconfigure`` passes
    :func:`~reference_engine.serve.command_line.reconfigure_args`) turns a reconfigure's engine flags into
    an ``EngineConfig`` or raises :class:`BadEngineArgs`; with it, ``POST /kvbench/reconfigure`` answers
    200 with the new engine's config and pools, 400 naming a flag the parser or the engine refuses (the
    old engine serves on), 409 while requests are in flight, 503 when the engine is not serving.
    Without it the path does not exist (404).
    """
    if reconfigure is not None and not isinstance(engine, EngineProcess):
        raise TypeError("reconfigure needs the engine in its own process (an EngineProcess)")
    if isinstance(engine, EngineProcess):
        engine_loop: EngineLoop | EngineProcess = engine
        info = engine.info
    else:
        engine_loop, info = EngineLoop(engine), EngineInfo.of(engine)
    model_dir = info.config.model
    served_model_name = served_model_name or model_dir
    codec = load_codec(model_dir)
    engine_loop.metrics = ServerMetrics(served_model_name, info.config, info.num_gpu_blocks, info.num_cpu_blocks,
                                        snapshot=engine_loop.stats)
    vocab_size = info.vocab_size  # the model's: a reconfigure keeps the model

    def current() -> EngineInfo:  # a reconfigure replaces the engine process's info
        return engine_loop.info if isinstance(engine_loop, EngineProcess) else info

    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine_loop.start(asyncio.get_running_loop())
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            # The engine thread runs a step at a time; joining it off the event loop keeps shutdown responsive.
            await asyncio.to_thread(engine_loop.stop)

    app = FastAPI(title="reference_engine.serve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(*_describe_validation_error(exc))

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(exc.param, exc.message, exc.code, exc.type)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        return _error(None, str(exc.detail), exc.status_code, type_)

    @app.get("/health")
    async def health() -> Response:
        if engine_loop.broken is not None:  # as vLLM's /health once its engine core is dead
            return _error(None, f"the engine is not serving: {engine_loop.broken}", 503, "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": created, "owned_by": "reference_engine",
            "root": model_dir, "parent": None, "max_model_len": current().config.max_model_len}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(engine_loop.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if reconfigure is not None:
        assert isinstance(engine_loop, EngineProcess)

        @app.post("/kvbench/reconfigure")
        async def reconfigure_engine(body: ReconfigureRequest) -> JSONResponse:
            try:
                config = reconfigure(body.args)
            except BadEngineArgs as e:
                raise BadRequest(e.flag, str(e)) from None
            started = time.perf_counter()
            try:
                new = await engine_loop.reconfigure(config)
            except EngineBusy as e:
                raise BadRequest(None, f"cannot reconfigure now: {e}", 409, "ConflictError") from None
            except EngineStartError as e:
                flag = "--" + e.field.replace("_", "-") if e.field else None
                raise BadRequest(flag, f"the engine refused the new configuration ({e}); the old one serves on") \
                    from None
            except EngineFailure as e:
                raise BadRequest(None, str(e), 503, "ServiceUnavailableError") from None
            return JSONResponse({"config": dataclasses.asdict(new.config), "num_gpu_blocks": new.num_gpu_blocks,
                                 "num_cpu_blocks": new.num_cpu_blocks,
                                 "seconds": round(time.perf_counter() - started, 4)})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        try:
            refuse_unsupported(body)
        except UnsupportedField as e:
            raise BadRequest(e.field, str(e)) from None
        if body.model is not None and body.model not in (served_model_name, model_dir):
            raise BadRequest("model", f"The model `{body.model}` does not exist: this server serves "
                                      f"`{served_model_name}`", 404, "NotFoundError")
        prompt_ids = _prompt_ids(body.prompt, codec, vocab_size)
        params = _sampling_params(body, vocab_size)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        abort = _once(lambda: engine_loop.abort(request_id))
        try:
            outputs = await race_disconnect(
                request, engine_loop.add(request_id, prompt_ids, params, priority=body.priority,
                                         cache_salt=body.cache_salt), abort)
        except RequestRejected as e:
            raise BadRequest("prompt", str(e)) from None
        except EngineFailure as e:
            raise BadRequest(None, str(e), 503, "ServiceUnavailableError") from None
        except ClientGone:
            return Response(status_code=499)
        render = _Renderer(body, prompt_ids, codec)
        reply = dict(id=request_id, created=int(time.time()), model=served_model_name)
        if body.stream:
            return AbortOnDisconnectStream(_sse(outputs, render, reply, body, abort, coalesce_stream), on_close=abort,
                                           media_type="text/event-stream")
        try:
            final = await race_disconnect(request, _until_finished(outputs), abort)
        except ClientGone:
            return Response(status_code=499)
        except EngineFailure as e:
            raise BadRequest(None, str(e), 500, "InternalServerError") from None
        abort.disarm()
        choice = render.choice(final.token_ids, final, final=True)
        response = CompletionResponse(**reply, choices=[choice], usage=render.usage(final))
        return JSONResponse(response.model_dump(exclude_none=True))

    return ServeApp(_Guard(app, api_key, max_body_bytes), engine_loop)


class ServeApp:
    """The ASGI app plus the parts tests and the CLI look at."""

    def __init__(self, asgi: ASGIApp, engine_loop: EngineLoop | EngineProcess):
        self.asgi, self.engine_loop = asgi, engine_loop

    @property
    def metrics(self) -> ServerMetrics:
        """The current engine's metrics (a reconfigure starts fresh ones)."""
        return self.engine_loop.metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.asgi(scope, receive, send)


class _once:
    """A callable that runs ``fn`` at most once, and not at all once disarmed (the request finished)."""

    def __init__(self, fn):
        self.fn, self.armed = fn, True

    def __call__(self) -> None:
        if self.armed:
            self.armed = False
            self.fn()

    def disarm(self) -> None:
        self.armed = False


async def _until_finished(outputs: asyncio.Queue) -> RequestOutput:
    while True:
        item = await outputs.get()
        if isinstance(item, EngineFailure):
            raise item
        if item.finished:
            return item


def _latest(outputs: asyncio.Queue, item: RequestOutput | EngineFailure) -> tuple[RequestOutput | EngineFailure,
                                                                                 EngineFailure | None]:
    """``item`` advanced to the newest output already queued behind it (outputs are cumulative, so the
    newest says everything the skipped ones did), and a failure queued after it, if any."""
    while isinstance(item, RequestOutput) and not item.finished and not outputs.empty():
        following = outputs.get_nowait()
        if isinstance(following, EngineFailure):
            return item, following
        item = following
    return item, None


async def _sse(outputs: asyncio.Queue, render: _Renderer, reply: dict[str, Any], body: CompletionRequest,
               abort: _once, coalesce: bool = True) -> AsyncIterator[bytes]:
    """Server-sent events: a chunk per step that produced tokens, the finish reason on the last one,
    then usage (if ``stream_options.include_usage``) and ``[DONE]``, those three in one piece (the
    stream's last, ending in :data:`LAST_EVENT`, as an error event is). ``abort`` is disarmed once the
    request is over, so closing the stream afterwards aborts nothing.

    Each chunk is what ``CompletionResponse(**reply, choices=[choice]).model_dump(exclude_none=True)``
    would serialise to, byte for byte, but written as bytes around a pre-encoded head: a chunk is sent
    for every token of every request, and pydantic per chunk cost as much CPU as the engine's step
    (the event loop shares the GIL with the engine thread, so that CPU comes out of the steps).

    ``coalesce``: the tokens of several steps that queued up while this stream was writing go out in one
    chunk, as vLLM's front end sends them. A stream that keeps up still sends a chunk per step; one that
    falls behind (many streams on few cores) does one chunk's work for several tokens instead of falling
    further behind, at the price of the client seeing those tokens arrive together."""
    head, tail = _chunk_frame(reply)
    sent = 0
    failure: EngineFailure | None = None
    while True:
        item = failure or await outputs.get()
        failure = None
        if coalesce:
            item, failure = _latest(outputs, item)
        if isinstance(item, EngineFailure):
            abort.disarm()  # the engine loop has aborted it already
            yield _event(error_body(str(item), None, 500, "InternalServerError")) + LAST_EVENT
            return
        new = item.token_ids[sent:]
        chunk = b""
        if new or item.finished:
            fields = render.choice_fields(new, item, final=item.finished)
            if sent == 0 and body.return_token_ids:
                fields = _with_prompt_ids(fields, render.prompt_ids)
            chunk = head + _json(fields).encode() + tail
            sent = len(item.token_ids)
        if item.finished:
            abort.disarm()
            if body.stream_options is not None and body.stream_options.include_usage:
                chunk += _event(CompletionResponse(**reply, choices=[], usage=render.usage(item)).model_dump(
                    exclude_none=True))
            yield chunk + LAST_EVENT  # one write for the end of the stream
            return
        if chunk:
            yield chunk


_ENCODER = json.JSONEncoder(separators=(",", ":"))  # one encoder, not one per call as json.dumps makes


def _json(payload: Any) -> str:
    return _ENCODER.encode(payload)


def _event(payload: dict[str, Any]) -> bytes:
    return f"data: {_json(payload)}\n\n".encode()


def _chunk_frame(reply: dict[str, Any]) -> tuple[bytes, bytes]:
    """The bytes of a streamed chunk before and after its one choice: ``_event`` of a
    ``CompletionResponse`` with ``reply``'s fields is ``head + json(choice) + tail`` (JSON nests)."""
    marker = "\x00choice\x00"
    whole = _json(CompletionResponse(**reply, choices=[]).model_dump(exclude_none=True) | {"choices": [marker]})
    before, _, after = whole.partition(_json(marker))
    return f"data: {before}".encode(), f"{after}\n\n".encode()


def _with_prompt_ids(fields: dict[str, Any], prompt_ids: list[int]) -> dict[str, Any]:
    """``fields`` with ``prompt_token_ids`` in its place in :class:`CompletionChoice`'s field order."""
    fields = {**fields, "prompt_token_ids": prompt_ids}
    return {k: fields[k] for k in _CHOICE_ORDER if k in fields}


class _Renderer:
    """Builds choices from engine outputs: text deltas, logprobs, token ids, finish reasons.

    Keeps the text already produced (a :class:`~reference_engine.serve.detokenize.TextStream`), so streamed
    deltas concatenate to exactly the non-streamed text; the last choice (``final``) ends the text.
    """

    def __init__(self, body: CompletionRequest, prompt_ids: list[int], codec: TextCodec | None):
        self.body, self.prompt_ids, self.codec = body, prompt_ids, codec
        self.ids: list[int] = []
        self._continuation = codec.after(prompt_ids) if codec is not None else None
        self._stream = codec.stream(prompt_ids) if codec is not None else None

    def _text_of(self, ids: list[int]) -> str:
        return self._continuation(ids) if self._continuation is not None else ""

    def choice(self, new_ids: list[int], out: RequestOutput, final: bool) -> CompletionChoice:
        return CompletionChoice(**self.choice_fields(new_ids, out, final))

    def choice_fields(self, new_ids: list[int], out: RequestOutput, final: bool) -> dict[str, Any]:
        """The choice as ``CompletionChoice(...).model_dump(exclude_none=True)`` gives it: the fields in
        the model's order, those that are None left out (the streaming path serialises this directly)."""
        start = len(self.ids)
        logprobs = None
        if self.body.logprobs is not None:
            entries = (out.logprobs or [])[start:start + len(new_ids)]
            logprobs = self._logprobs(new_ids, entries)
        self.ids.extend(new_ids)
        stream = self._stream
        delta = "" if stream is None else stream.finish(new_ids) if final else stream.push(new_ids)
        fields: dict[str, Any] = {"index": 0, "text": delta}
        if logprobs is not None:
            fields["logprobs"] = logprobs.model_dump()
        if final and out.finish_reason is not None:
            fields["finish_reason"] = out.finish_reason
        if self.body.return_token_ids:
            if not self.body.stream:
                fields["prompt_token_ids"] = self.prompt_ids
            fields["token_ids"] = list(new_ids)
        if final and out.num_preemptions is not None:
            fields["num_preemptions"] = out.num_preemptions
        return fields

    def _logprobs(self, new_ids: list[int], entries: list[TokenLogprobs]) -> CompletionLogprobs:
        """OpenAI's completions format. A token's text is what it adds to the text before it, so
        ``"".join(tokens)`` is the completion text and ``text_offset`` indexes into it; the keys of
        ``top_logprobs`` are the candidates' texts in the same position."""
        result = CompletionLogprobs()
        before_ids, before_text = list(self.ids), self._text_of(self.ids)
        for token, entry in zip(new_ids, entries, strict=False):
            result.tokens.append(self._text_after(before_ids, before_text, token))
            result.token_logprobs.append(entry.logprob)
            result.top_logprobs.append({self._text_after(before_ids, before_text, t): lp for t, lp in entry.top})
            result.text_offset.append(len(before_text))
            before_ids.append(token)
            before_text = before_text + result.tokens[-1]
        return result

    def _text_after(self, before_ids: list[int], before_text: str, candidate: int) -> str:
        """The text ``candidate`` would add after ``before_ids`` (whose text is ``before_text``)."""
        if self.codec is None:
            return f"token_id:{candidate}"  # vLLM's spelling for a token it cannot decode
        full = self._text_of([*before_ids, candidate])
        return full[len(before_text):] if full.startswith(before_text) else full

    def usage(self, out: RequestOutput) -> Usage:
        n_prompt, n_out = len(self.prompt_ids), len(out.token_ids)
        return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


def _prompt_ids(prompt: str | list[int], codec: TextCodec | None, vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        if codec is None:
            raise BadRequest("prompt", "this model directory has no tokenizer.json: send the prompt as a list "
                                       "of token ids")
        try:
            ids = codec.encode(prompt)
        except ValueError as e:
            raise BadRequest("prompt", f"prompt text could not be tokenised: {e}") from None
    else:
        ids = list(prompt)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest("prompt", f"prompt token id {bad[0]} is out of vocabulary: expected integers in "
                                   f"[0, {vocab_size})")
    if not ids:
        raise BadRequest("prompt", "the prompt is empty: expected at least one token")
    return ids


def _sampling_params(body: CompletionRequest, vocab_size: int) -> SamplingParams:
    stop_ids = tuple(body.stop_token_ids or ())
    bad = [t for t in stop_ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest("stop_token_ids", f"stop_token_ids: id {bad[0]} is out of vocabulary: expected integers in "
                                           f"[0, {vocab_size})")
    try:
        return SamplingParams(max_tokens=body.max_tokens, temperature=body.temperature,
                              top_k=max(body.top_k, 0),  # vLLM's -1 means off, as our 0
                              top_p=body.top_p, seed=body.seed, ignore_eos=body.ignore_eos,
                              stop_token_ids=stop_ids, logprobs=body.logprobs)
    except ValueError as e:
        # SamplingParams names the field: "SamplingParams.<field>=..."
        message = str(e)
        field = message.split("=", 1)[0].removeprefix("SamplingParams.") if message.startswith("Sampling") else None
        raise BadRequest(field, message) from None


def _describe_validation_error(exc: RequestValidationError) -> tuple[str, str]:
    """(param, message) for the first pydantic error, naming the field."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    kind = err.get("type", "")
    if kind == "json_invalid":
        return "body", f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}"
    if not loc:
        if kind == "missing":
            return "body", "request body is missing: expected a JSON object"
        return "body", f"invalid request body: {err.get('msg')}"
    # A union (prompt: str | list[int]) reports its branch in the location; name the field itself.
    field = loc[0]
    path = ".".join(p for p in loc if p not in ("str", "list[int]", "int"))
    if kind == "extra_forbidden":
        return path, f"unknown field '{path}': this server refuses fields it does not know"
    if kind == "missing":
        return path, f"field '{path}' is required"
    return field if field == "prompt" else path, f"invalid value for '{path}': {err.get('msg')}"
