"""Evidence without secrets: an engine option that is a credential (``api_key``, or one an adapter lists in
``secret_options``) never reaches the terminal, test ids, results.json or junitxml; a server's 401 is one
message naming the credential, not a traceback."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from kvbench.drivers.http_client import CompletionClient, CredentialError
from kvbench.engines.base import DEFAULT_KNOBS, EngineAdapter, GenOutput, GenRequest, GenResult, Knobs
from kvbench.engines.registry import EngineSpecError, make_adapter, parse_engine_spec

pytest_plugins = ["pytester"]

KEY, TOKEN = "s3cret-key-4711", "t0ken-0815"


class KeyedAdapter(EngineAdapter):
    """Echoes prompts; takes an api_key and a token of its own that it marks secret."""

    kind = "keyed"
    option_keys = {"api_key": "bearer token", "token": "another credential", "mode": "anything"}  # noqa: RUF012
    secret_options = frozenset({"token"})

    @classmethod
    def validate_options(cls, options: dict[str, str]) -> None:
        super().validate_options(options)
        if options.get("mode") == "bad":
            raise ValueError(f"mode=bad is not allowed together with token={options.get('token')}")

    def generate(self, requests: Sequence[GenRequest], knobs: Knobs = DEFAULT_KNOBS) -> GenResult:
        return GenResult([GenOutput(r.request_id, list(r.prompt_token_ids), "length", 0) for r in requests])


SPEC = f"tests.kvbench.test_secrets:KeyedAdapter:api_key={KEY},token={TOKEN},mode=x"


def test_a_spec_keeps_its_secrets_for_the_adapter_and_shows_them_to_nobody(tmp_path):
    spec = parse_engine_spec(SPEC)
    assert spec.options == {"api_key": KEY, "token": TOKEN, "mode": "x"}  # the adapter needs them
    assert spec.name == "tests.kvbench.test_secrets:KeyedAdapter:api_key=***,mode=x,token=***"
    assert spec.public_options == {"api_key": "***", "token": "***", "mode": "x"}
    assert KEY not in repr(spec) and TOKEN not in repr(spec)
    adapter = make_adapter(spec, str(tmp_path))
    assert adapter.options["token"] == TOKEN
    assert adapter.name == spec.name
    assert adapter.describe()["options"] == {"api_key": "***", "token": "***", "mode": "x"}


@pytest.mark.parametrize("text", [
    f"tests.kvbench.test_secrets:KeyedAdapter:api_key={KEY},token={TOKEN},nope=1",  # unknown option
    f"tests.kvbench.test_secrets:KeyedAdapter:api_key={KEY},api_key={KEY}",  # given twice
    f"tests.kvbench.test_secrets:KeyedAdapter:token={TOKEN},mode=bad",  # the adapter's own error quotes it
    f"no_such_kind:api_key={KEY}",  # unknown kind
])
def test_a_bad_spec_is_refused_without_quoting_a_secret(text):
    with pytest.raises(EngineSpecError) as info:
        parse_engine_spec(text)
    assert KEY not in str(info.value) and TOKEN not in str(info.value)
    assert "***" in str(info.value).splitlines()[0]


def test_no_secret_reaches_the_terminal_test_ids_results_or_junitxml(pytester: pytest.Pytester, monkeypatch):
    # the root, so that tests.kvbench.test_secrets:KeyedAdapter imports
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    pytester.makepyfile(test_checks="""
        import pytest

        pytestmark = pytest.mark.conformance(pressured=False)  # what is checked here is where secrets go


        def test_echo(engine):
            assert engine.generate([]).outputs == []


        def test_refused(engine):
            pytest.skip(f"{engine.name} lacks capability swap")
    """)
    result = pytester.runpytest_subprocess("--engine", SPEC, "--report-dir", "out", "--junitxml", "junit.xml",
                                           "-v", "-rs", "-p", "no:cacheprovider", "-p", "no:benchmark",
                                           "--rootdir", str(pytester.path), "--kvbench-model", str(pytester.path))
    result.assert_outcomes(passed=1, skipped=1)
    [results] = (pytester.path / "out").glob("*/results.json")
    written = {"terminal": result.stdout.str() + result.stderr.str(), "results.json": results.read_text(),
               "junit.xml": (pytester.path / "junit.xml").read_text()}
    for where, text in written.items():
        assert KEY not in text and TOKEN not in text, f"a secret reached {where}"
    expected = "test_echo[tests.kvbench.test_secrets:KeyedAdapter:api_key=***,mode=x,token=***] PASSED"
    assert expected in written["terminal"]
    assert json.loads(written["results.json"])["engines"][0]["options"] == {"api_key": "***", "mode": "x",
                                                                            "token": "***"}


# ------------------------------------------------------------------------------------------ HTTP 401
class _Refuses(BaseHTTPRequestHandler):
    def _refuse(self) -> None:
        body = json.dumps({"error": {"message": "Unauthorized", "code": 401}}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _refuse

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def refusing_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refuses)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(("api_key", "message"), [
    (None, r"demands a credential \(HTTP 401: Unauthorized\) and none was given: .*api_key"),
    (KEY, r"refused the credential given as the engine option api_key \(HTTP 401: Unauthorized\)"),
])
def test_a_401_is_one_error_naming_the_credential(refusing_server, api_key, message):
    client = CompletionClient(refusing_server, api_key=api_key)
    body = client.body([1, 2, 3], 2, stream=False)

    async def complete():
        async with client.session() as http:
            return await client.complete(http, body)

    for call in (lambda: client.metrics_text(), lambda: client.served_model(), lambda: asyncio.run(complete()),
                 lambda: asyncio.run(client.stream(client.body([1, 2, 3], 2, stream=True), lambda t, ids: None))):
        with pytest.raises(CredentialError, match=message) as info:
            call()
        assert KEY not in str(info.value)


def test_other_http_errors_stay_one_requests_rejection(refusing_server, monkeypatch):
    """Only 401 is the run's fault; a 400 stays the request's ("rejected", the server's words)."""
    def bad_request(self) -> None:
        self.send_response(400)
        self.send_header("Content-Length", "0")
        self.end_headers()

    monkeypatch.setattr(_Refuses, "do_POST", bad_request)
    client = CompletionClient(refusing_server)

    async def complete():
        async with httpx.AsyncClient(base_url=refusing_server) as http:
            return await client.complete(http, client.body([1], 1, stream=False))

    assert asyncio.run(complete()).finish_reason == "rejected"


def test_a_credential_error_in_a_check_is_one_message_and_stops_the_run(pytester: pytest.Pytester):
    pytester.makepyfile(test_checks="""
        import pytest
        from kvbench.drivers.http_client import credential_error

        pytestmark = pytest.mark.conformance


        def test_first(engine_spec):
            raise credential_error("http://127.0.0.1:9", None)


        def test_second(engine_spec):
            pass
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:benchmark", "--report-dir", "out")
    result.assert_outcomes(failed=2)  # the second check never ran; the other failure: nothing was proven
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["CredentialError: http://127.0.0.1:9 demands a credential (HTTP 401) and none "
                                 "was given: pass the server's key as the engine option api_key*"])
    assert "Traceback" not in out and "raise credential_error" not in out
