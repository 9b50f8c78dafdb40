"""The HTTP client kvbench speaks to an OpenAI-compatible server with: ``/v1/completions`` (streamed
and not), ``/metrics``, ``/health``, ``/v1/models``.

Requests go out as token ids (``prompt: [ids]``, as vLLM, SGLang and the reference server accept) with
vLLM's extra fields (``ignore_eos``, ``top_k``, ``seed``, ``priority``, ``return_token_ids``), and the
output's token ids are read back exactly from ``choices[0].token_ids`` (vLLM's ``return_token_ids``).
A server that returns only text gets its text tokenised with the checkpoint's own ``tokenizer.json``
(``TextTokens``): exact for the built-in checkpoints, whose tokenizer round-trips.

Dialects (:data:`DIALECTS`): ``vllm`` (the default: token-id prompts and vLLM's extras, as above) and
``transformers`` (``transformers serve``, checked against 5.24's source: it refuses unknown fields
with a 422 and a prompt that is not a string with a 400). In that dialect the prompt goes as the
checkpoint tokenizer's text of the ids (special tokens written out, so they round-trip), no
``return_token_ids`` (ids come back from the text), and what vLLM says with extras goes through its
``generation_config`` JSON field, which it applies per request: ``ignore_eos`` as ``eos_token_id=-1``
(no EOS), ``stop_token_ids`` as the ``eos_token_id`` list (plus the model's EOS unless ``ignore_eos``),
``top_k`` as ``top_k``. ``priority`` has no equivalent and is not sent.

``llamacpp`` (llama.cpp's ``llama-server``, checked against its sources, tools/server/ at 0c1e570): its
``/v1/completions`` takes token-id prompts, ``ignore_eos``, ``seed`` and ``top_k``, ignores fields it does not
know, and returns text only; but a request with ``return_tokens`` and ``verbose`` carries llama.cpp's own
result beside OpenAI's (``__verbose``), whose ``tokens`` are the exact generated ids, one per streamed chunk
(every sampled token is its own chunk, even one whose text is held back) and all of them in a non-streamed
answer; its ``truncated`` says a request was cut short by a full context. The ids are read from there
(:attr:`Completion.token_ids`, never from text). Its sampler defaults are not OpenAI's (``top_k`` 40, ``top_p``
0.95, ``min_p`` 0.05), so every request states the neutral values kvbench means (``top_k`` 0, ``top_p`` 1,
``min_p`` 0); ``priority``, ``stop_token_ids`` and ``cache_salt`` have no equivalent and are not sent (the
preset declares them lacking, so no check relies on them being honoured).

What a user reads is kept beside the ids: :attr:`Completion.text` is the choice's ``text`` (a stream's
deltas joined in arrival order), as the server wrote it, so a check can hold it to the checkpoint
tokenizer's decoding of the ids (``suites/conformance/test_user_view.py``).

Errors: an HTTP error with OpenAI's envelope ``{"error": {"message": ...}}`` becomes a
:class:`Completion` with ``finish_reason="rejected"`` (4xx) or ``"error"`` (5xx, transport) and the
server's message, so one bad request never hides the others' outputs. A stream that began and then
carries an error event (vLLM's way, and the reference server's, of failing a request mid-stream) keeps
every token that arrived before it, ends ``"error"`` with the event's message and
:attr:`Completion.error_event` set; nothing after the event changes that. A 401 is not one request's
fault but the run's: it raises :class:`CredentialError`, one message naming the credential.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvbench.core.errors import EngineUnavailable
from kvbench.core.tls import client_context
from kvbench.drivers.http_stream import StreamError, stream_events

#: (arrival clock time of the chunk, token ids it carried) for every streamed chunk with tokens
OnTokens = Callable[[float, list[int]], None]


@dataclass
class Completion:
    """What one request produced, as the server said it."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "rejected" | "error"
    error: str | None = None
    status: int | None = None  # the HTTP status
    ids_from_text: bool = False  # token ids were recovered by tokenising the returned text
    #: tokens the server says it generated (``usage.completion_tokens``), where it says so: differs from
    #: ``len(token_ids)`` when text lost tokens (special tokens skipped in the text)
    server_token_count: int | None = None
    #: times the server preempted this request, where it says so (the reference server's extension
    #: field ``num_preemptions`` on the finishing choice); None otherwise
    num_preemptions: int | None = None
    #: prompt tokens the server says it served from its prefix cache for this request
    #: (``usage.prompt_tokens_details.cached_tokens``: vLLM with --enable-prompt-tokens-details, the
    #: reference server), where it says so
    cached_tokens: int | None = None
    #: the text the server wrote (a stream's deltas joined in arrival order); None when it wrote none at all
    text: str | None = None
    #: True when a response that had begun (HTTP 200) ended in an error event (``error`` holds its message)
    error_event: bool = False
    #: the server says it cut the request short because its context was full (llama.cpp's ``truncated``), where
    #: it says so; None otherwise
    truncated: bool | None = None


class TextTokens:
    """Text -> token ids with a checkpoint's ``tokenizer.json`` (the fallback when a server returns
    no ids). Loaded on first use; raises FileNotFoundError naming the file if it is missing."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._tok: Any = None

    def _tokenizer(self) -> Any:
        if self._tok is None:
            if not self.path.is_file():
                raise FileNotFoundError(f"{self.path} does not exist: it is needed to turn token ids into text "
                                        "and back for a server that speaks text only")
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(self.path))
        return self._tok

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer().encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` with special tokens written out (so :meth:`encode` gives them back)."""
        return self._tokenizer().decode(list(ids), skip_special_tokens=False)


DIALECTS = ("vllm", "transformers", "llamacpp")


def in_dialect(body: dict[str, Any], dialect: str, text_tokens: TextTokens | None = None,
               eos_token_id: int | None = None) -> dict[str, Any]:
    """``body`` (vLLM's dialect, from :func:`completion_body`) said the way ``dialect`` servers take it
    (see the module docstring). ValueError naming what is missing (a tokenizer for text prompts)."""
    if dialect == "vllm":
        return body
    if dialect == "llamacpp":
        out = {k: v for k, v in body.items()
               if k not in ("return_token_ids", "priority", "stop_token_ids", "cache_salt")}
        # neutral sampling stated outright: llama-server's own defaults would truncate the distribution
        out.update(return_tokens=True, verbose=True, top_k=int(body.get("top_k") or 0),
                   top_p=float(body.get("top_p", 1.0)), min_p=0.0)
        return out
    if dialect != "transformers":
        raise ValueError(f"dialect must be one of {', '.join(DIALECTS)}, got {dialect!r}")
    if text_tokens is None:
        raise ValueError("dialect transformers sends prompts as text: a tokenizer.json is needed")
    out = {k: v for k, v in body.items()
           if k not in ("prompt", "return_token_ids", "ignore_eos", "stop_token_ids", "top_k", "priority",
                         "cache_salt")}
    out["prompt"] = text_tokens.decode(body["prompt"])
    stops = [int(t) for t in body.get("stop_token_ids") or ()]
    if not body.get("ignore_eos", False) and eos_token_id is not None:
        stops = [eos_token_id, *stops]
    gen: dict[str, Any] = {"eos_token_id": stops or -1}  # -1: no end-of-sequence token at all
    if body.get("top_k"):
        gen["top_k"] = int(body["top_k"])
    gen["do_sample"] = float(body.get("temperature") or 0.0) > 0
    out["generation_config"] = json.dumps(gen)
    return out


def completion_body(model: str | None, prompt_token_ids: list[int], max_tokens: int, *, stream: bool,
                    temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                    ignore_eos: bool = True, priority: int = 0,
                    stop_token_ids: list[int] | None = None, cache_salt: str | None = None) -> dict[str, Any]:
    """The JSON body of one ``/v1/completions`` request. Fields at their neutral value are left out,
    so a server that lacks a vLLM extra still takes the request unless the request needs it.
    ``cache_salt`` (vLLM's extra): the request shares cached prefix blocks only with requests of the same salt."""
    body: dict[str, Any] = {"prompt": list(prompt_token_ids), "max_tokens": max_tokens, "temperature": temperature,
                            "stream": stream, "return_token_ids": True, "ignore_eos": ignore_eos}
    if model:
        body["model"] = model
    if top_p != 1.0:
        body["top_p"] = top_p
    if top_k:
        body["top_k"] = top_k
    if seed is not None:
        body["seed"] = seed
    if priority:
        body["priority"] = priority
    if stop_token_ids:
        body["stop_token_ids"] = list(stop_token_ids)
    if cache_salt:
        body["cache_salt"] = cache_salt
    return body


def _message_from(status: int, raw: bytes) -> str:
    """The server's own words for an HTTP error (OpenAI envelope, FastAPI ``detail``, or the raw body)."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return f"HTTP {status}: {raw[:500].decode('utf-8', 'replace')}"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return f"HTTP {status}: {err['message']}"
        if isinstance(err, str):
            return f"HTTP {status}: {err}"
        if "detail" in data:
            return f"HTTP {status}: {data['detail']}"
    return f"HTTP {status}: {str(data)[:500]}"


def error_message(response: httpx.Response) -> str:
    """The server's own words for an HTTP error response."""
    return _message_from(response.status_code, response.content)


class CredentialError(EngineUnavailable):
    """The server answered 401: kvbench's credential (the engine option ``api_key``) is missing or wrong."""


def credential_error(base_url: str, api_key: str | None, status: int = 401, body: bytes = b"") -> CredentialError:
    """The one message a 401 gives: which credential, missing or refused, and how to pass it (never its value)."""
    said = _message_from(status, body) if body else f"HTTP {status}"
    if api_key:
        said = said.replace(api_key, "***")
        return CredentialError(f"{base_url} refused the credential given as the engine option api_key ({said}): "
                               "it is not a key this server accepts; pass the server's key as api_key=...")
    return CredentialError(f"{base_url} demands a credential ({said}) and none was given: pass the server's key "
                           f"as the engine option api_key, e.g. --engine openai:url={base_url},api_key=...")


def _failed(response: httpx.Response) -> Completion:
    reason = "rejected" if 400 <= response.status_code < 500 else "error"
    return Completion(finish_reason=reason, error=error_message(response), status=response.status_code)


def _event_error(error: Any) -> str:
    """An error event's message: OpenAI's ``{"message": ...}`` object, or whatever else the server sent."""
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    return str(error)


def _count(raw: Any) -> int | None:
    return raw if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0 else None


def _choice(data: dict[str, Any]) -> dict[str, Any]:
    """The first choice; llama.cpp's exact ids (``__verbose.tokens``, dialect ``llamacpp``) as its ``token_ids``."""
    choices = data.get("choices") or [{}]
    choice = choices[0] or {}
    native = data.get("__verbose")
    if isinstance(native, dict) and "token_ids" not in choice and isinstance(native.get("tokens"), list):
        choice = {**choice, "token_ids": native["tokens"]}
    return choice


def _truncated(data: dict[str, Any]) -> bool | None:
    native = data.get("__verbose")
    flag = native.get("truncated") if isinstance(native, dict) else None
    return flag if isinstance(flag, bool) else None


class CompletionClient:
    """Async calls to one server. Share one ``httpx.AsyncClient`` (made by :meth:`session`) across
    concurrent requests: its pool holds every connection open at once (no limit), so N concurrent
    requests are N connections, all in flight together."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None,
                 text_tokens: TextTokens | None = None, timeout: float = 600.0, dialect: str = "vllm",
                 eos_token_id: int | None = None):
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {', '.join(DIALECTS)}, got {dialect!r}")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.model = model
        self.text_tokens = text_tokens
        self.timeout = timeout
        self.dialect = dialect
        self.eos_token_id = eos_token_id
        #: put in every request's body while set (the adapter sets a fresh one per run, where the server takes
        #: it): the run's requests share cached prefixes among themselves, never with an earlier run's
        self.cache_salt: str | None = None

    def body(self, prompt_token_ids: list[int], max_tokens: int, *, stream: bool, **sampling: Any) -> dict[str, Any]:
        """One request's JSON body in this server's dialect (``sampling``: :func:`completion_body`'s keywords)."""
        if self.cache_salt and "cache_salt" not in sampling:
            sampling["cache_salt"] = self.cache_salt
        vllm = completion_body(self.model, prompt_token_ids, max_tokens, stream=stream, **sampling)
        return in_dialect(vllm, self.dialect, self.text_tokens, self.eos_token_id)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def session(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        return httpx.AsyncClient(base_url=self.base_url, headers=self.headers(), limits=limits,
                                 timeout=httpx.Timeout(self.timeout, connect=30.0), verify=client_context())

    def _ids(self, choice: dict[str, Any], completion: Completion) -> list[int]:
        ids = choice.get("token_ids")
        if ids is not None:
            return [int(t) for t in ids]
        text = choice.get("text") or ""
        if not text:
            return []
        if self.text_tokens is None:
            raise ValueError("the server returned text without token_ids (return_token_ids unsupported) and no "
                             "tokenizer.json was given to recover the ids")
        completion.ids_from_text = True
        return self.text_tokens.encode(text)

    async def complete(self, http: httpx.AsyncClient, body: dict[str, Any]) -> Completion:
        """One non-streamed completion."""
        try:
            response = await http.post("/v1/completions", json={**body, "stream": False})
        except httpx.HTTPError as e:
            return Completion(finish_reason="error", error=f"{type(e).__name__}: {e}")
        if response.status_code == 401:
            raise credential_error(self.base_url, self.api_key, 401, response.content)
        if response.status_code != 200:
            return _failed(response)
        data = response.json()
        out = Completion(status=200)
        choice = _choice(data)
        out.token_ids = self._ids(choice, out)
        if isinstance(choice.get("text"), str):
            out.text = choice["text"]
        out.finish_reason = choice.get("finish_reason")
        out.num_preemptions = _count(choice.get("num_preemptions"))
        out.truncated = _truncated(data)
        usage = data.get("usage") or {}
        if isinstance(usage.get("completion_tokens"), int):
            out.server_token_count = usage["completion_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            out.cached_tokens = _count(details.get("cached_tokens"))
        return out

    async def stream(self, body: dict[str, Any], on_tokens: OnTokens, clock: Callable[[], float] = time.perf_counter,
                     started: asyncio.Event | None = None) -> Completion:
        """One streamed completion (Server-Sent Events) on its own connection
        (:mod:`kvbench.drivers.http_stream`). ``on_tokens(t, ids)`` is called as each chunk with tokens
        arrives, ``t`` read from ``clock`` when its bytes arrived; ``started`` is set once the server has
        answered with the response's head. Cancelling the calling task closes the
        connection (how a client aborts a request)."""
        out = Completion()
        texts: list[str] = []

        def on_event(t: float, data: Any) -> None:
            if isinstance(data, dict) and "error" in data:  # an error after the stream began (vLLM's way)
                out.finish_reason, out.error, out.error_event = "error", _event_error(data["error"]), True
                return
            choice = _choice(data)
            ids = self._ids(choice, out)
            if isinstance(choice.get("text"), str):
                texts.append(choice["text"])
            if ids:
                out.token_ids.extend(ids)
                on_tokens(t, ids)
            if choice.get("finish_reason") and not out.error_event:  # an error is the end, whatever follows
                out.finish_reason = choice["finish_reason"]
                out.num_preemptions = _count(choice.get("num_preemptions"))
                out.truncated = _truncated(data)

        try:
            await stream_events(self.base_url, {**body, "stream": True}, self.headers(), on_event, clock, started)
            out.status = 200
            out.text = "".join(texts) if texts else None
        except StreamError as e:
            if e.status == 401:
                raise credential_error(self.base_url, self.api_key, 401, e.body) from None
            out.status = e.status
            out.finish_reason = "rejected" if 400 <= e.status < 500 else "error"
            out.error = _message_from(e.status, e.body)
        except (OSError, ValueError) as e:
            out.finish_reason, out.error = "error", f"{type(e).__name__}: {e}"
        return out

    # --- plain GETs (sync: used outside the event loop, between runs)

    def get(self, path: str, timeout: float = 10.0) -> httpx.Response:
        """GET ``path``; a 401 raises :class:`CredentialError`."""
        response = httpx.get(self.base_url + path, headers=self.headers(), timeout=timeout, verify=client_context())
        if response.status_code == 401:
            raise credential_error(self.base_url, self.api_key, 401, response.content)
        return response

    def metrics_text(self) -> str | None:
        """``/metrics`` as text, or None when the server has none (404)."""
        response = self.get("/metrics")
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.text

    def served_model(self) -> str | None:
        """The first model ``/v1/models`` lists (the name requests must carry), or None."""
        try:
            response = self.get("/v1/models")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        data = response.json().get("data") or []
        return data[0].get("id") if data else None
