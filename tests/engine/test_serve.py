"""reference_engine.serve: run as a subprocess, driven with the official ``openai`` client and httpx.

Two servers per module, started together: ``main`` (a roomy pool, an API key, a small body limit) and
``pressured`` (a pool so small that concurrent requests preempt each other). Each runs in its own
process group, killed at teardown; its log is printed if it fails to start.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from reference_engine import EngineConfig, LLMEngine, SamplingParams
from reference_engine.serve.app import build_app
from reference_engine.serve.command_line import READY_PREFIX
from reference_engine.tokenizer import TOKENIZER_FILE

API_KEY = "test-key"
MODEL = "tiny"
MAX_BODY = 100_000
START_TIMEOUT_S = 60
AUTH = {"Authorization": f"Bearer {API_KEY}"}

VLLM_METRICS = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:cache_config_info",
)


class Server:
    def __init__(self, name: str, ckpt: str, log_dir: Path, *flags: str):
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        cmd = [sys.executable, "-m", "reference_engine.serve", "--model", ckpt, "--served-model-name", MODEL,
               "--port", "0", *flags]
        # One torch thread per server: two servers and the test process share two cores.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                     start_new_session=True)
        self.url = ""

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        line = self.proc.stdout.readline()  # the ready line (or EOF if the server died)
        if not line.startswith(READY_PREFIX):
            self.fail(f"no ready line, got {line!r}")
        self.url = line[len(READY_PREFIX):].strip()
        assert self.url.startswith("http://127.0.0.1:"), self.url
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.fail("/health never answered 200")

    def fail(self, why: str) -> None:
        self.stop()
        pytest.fail(f"server did not start: {why}\n--- log {self.log_path}:\n{self.log_path.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        self.proc.stdout.close()
        self.log.close()


@pytest.fixture(scope="module")
def servers(tiny_ckpt: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    log_dir = tmp_path_factory.mktemp("serve-logs")
    started = {
        "main": Server("main", tiny_ckpt, log_dir, "--api-key", API_KEY, "--max-body-bytes", str(MAX_BODY),
                       "--num-gpu-blocks-override", "512", "--max-num-seqs", "256"),
        # 12 blocks of 8 tokens: four requests of 6 + 30 tokens need 20 blocks: preemptions certain.
        "pressured": Server("pressured", tiny_ckpt, log_dir, "--num-gpu-blocks-override", "12", "--block-size", "8",
                            "--enable-prefix-caching", "--max-num-seqs", "8"),
    }
    try:
        for s in started.values():
            s.wait_ready()
        yield started
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def main_url(servers) -> str:
    return servers["main"].url


@pytest.fixture(scope="module")
def client(main_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=main_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def local_engine(tiny_ckpt: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=256))


PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 60)), [300] * 3, [42]]


def metrics_of(url: str) -> dict[str, float]:
    """Samples keyed by name, plus name{label=value,...} for labelled ones other than model_name."""
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(url: str, deadline_s: float = 20.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and the pool is whole."""
    deadline = time.monotonic() + deadline_s
    while True:
        m = metrics_of(url)
        idle = (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                and m["vllm:kv_cache_usage_perc"] == 0
                and m["reference_engine:num_free_gpu_blocks"] == m["reference_engine:num_gpu_blocks"])
        if idle:
            return m
        assert time.monotonic() < deadline, f"server not idle in {deadline_s} s: {m}"
        time.sleep(0.1)


# ---------------------------------------------------------------------- (a) (b) (c) (d): outputs
@pytest.mark.server
def test_openai_client_greedy_matches_in_process_engine(client: openai.OpenAI, local_engine: LLMEngine) -> None:
    expected = [o.token_ids for o in local_engine.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))]
    for prompt, want in zip(PROMPTS, expected, strict=True):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
        choice = resp.choices[0]
        assert choice.token_ids == want
        assert choice.prompt_token_ids == prompt
        assert choice.finish_reason == "length"
        assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(prompt), 12)
        # The checkpoint's words; the leading space separates them from the prompt's last word.
        assert choice.text == "".join(f" t{t}" for t in want if t > 2)

        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
        ids, text, reasons, usage = [], "", [], None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                ids += c.token_ids or []
                text += c.text
                reasons.append(c.finish_reason)
        assert ids == want and text == choice.text
        assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}
        assert usage is not None and usage.completion_tokens == 12


@pytest.mark.server
def test_text_prompt_round_trips_through_the_tokenizer(client: openai.OpenAI, local_engine: LLMEngine,
                                                       tiny_ckpt: str) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tiny_ckpt) / TOKENIZER_FILE))
    prompt_ids = [17, 230, 45, 45, 9]
    prompt_text = tok.decode(prompt_ids)
    resp = client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = resp.choices[0]
    assert choice.prompt_token_ids == prompt_ids
    [want] = local_engine.generate([prompt_ids], SamplingParams(max_tokens=10, ignore_eos=True))
    assert choice.token_ids == want.token_ids
    # prompt text + completion text re-tokenises to exactly prompt + output ids
    assert tok.encode(prompt_text + choice.text).ids == prompt_ids + want.token_ids


@pytest.mark.server
def test_seeded_sampling_matches_in_process_engine(client: openai.OpenAI, local_engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    [want] = local_engine.generate([PROMPTS[1]], params)
    for stream in (False, True):
        resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=1.0, top_p=0.9,
                                         seed=1234, stream=stream,
                                         extra_body={"top_k": 50, "ignore_eos": True, "return_token_ids": True})
        chunks = list(resp) if stream else [resp]
        assert [t for c in chunks for ch in c.choices for t in ch.token_ids or []] == want.token_ids


@pytest.mark.server
def test_logprobs_top_k_and_greedy_token_is_top_1(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == resp.choices[0].text
    for i, (token, logprob, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)):
        assert len(top) == 3 and logprob <= 0
        best = max(top, key=top.get)
        assert best == token and top[best] == pytest.approx(logprob)
        assert lp.text_offset[i] == len("".join(lp.tokens[:i]))
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3,
                                       stream=True, extra_body={"ignore_eos": True})
    streamed = [t for chunk in stream for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    assert streamed == lp.tokens


# ---------------------------------------------------------------------- (e) bad input
BAD_INPUTS = [
    ("malformed JSON", b'{"prompt": [5, 6', "body"),
    ("unknown field", {"prompt": [5], "max_token": 3}, "max_token"),
    ("over-long prompt", {"prompt": [5] * 1100, "max_tokens": 2}, "prompt"),
    ("id out of vocabulary", {"prompt": [5, 512], "max_tokens": 2}, "prompt"),
    ("negative max_tokens", {"prompt": [5], "max_tokens": -1}, "max_tokens"),
    ("echo", {"prompt": [5], "echo": True}, "echo"),
    ("stop strings", {"prompt": [5], "stop": ["t7"]}, "stop"),
    ("min_tokens", {"prompt": [5], "min_tokens": 3}, "min_tokens"),
    ("bad stop id", {"prompt": [5], "stop_token_ids": [9999]}, "stop_token_ids"),
    ("logprobs too many", {"prompt": [5], "logprobs": 1000}, "logprobs"),
    ("empty prompt", {"prompt": [], "max_tokens": 2}, "prompt"),
]


@pytest.mark.server
def test_any_text_is_served(main_url: str) -> None:
    """Words outside the checkpoint's vocabulary read as its unknown token (reference_engine.tokenizer), as a
    real tokenizer's would: a user's "Hello world" is served, not refused."""
    r = httpx.post(main_url + "/v1/completions", json={"model": MODEL, "prompt": "Hello world", "max_tokens": 2,
                                                        "temperature": 0}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 2


@pytest.mark.server
@pytest.mark.parametrize(("what", "payload", "param"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_a_400_naming_the_field_and_the_server_keeps_serving(main_url: str, what: str, payload,
                                                                          param: str) -> None:
    url = main_url + "/v1/completions"
    if isinstance(payload, bytes):
        r = httpx.post(url, content=payload, headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    else:
        r = httpx.post(url, json={"model": MODEL, **payload}, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400 and err["type"] == "BadRequestError"
    assert param in err["message"] or param in {"body"} or what in {"over-long prompt"}, err
    if what == "over-long prompt":
        assert "max_model_len" in err["message"]
    good = httpx.post(url, json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2, "temperature": 0},
                      headers=AUTH, timeout=30)
    assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.server
def test_oversized_body_is_refused_naming_the_limit(main_url: str) -> None:
    r = httpx.post(main_url + "/v1/completions", json={"prompt": [5] * (MAX_BODY // 2)}, headers=AUTH, timeout=30)
    assert r.status_code == 413
    assert r.json()["error"]["param"] == "max_body_bytes" and str(MAX_BODY) in r.json()["error"]["message"]
    assert httpx.get(main_url + "/v1/models", headers=AUTH, timeout=10).status_code == 200


@pytest.mark.server
def test_unknown_model_is_a_404(main_url: str) -> None:
    r = httpx.post(main_url + "/v1/completions", json={"model": "gpt-9", "prompt": [5]}, headers=AUTH, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


# ---------------------------------------------------------------------- (f) api key
@pytest.mark.server
def test_api_key_required_except_on_health(main_url: str) -> None:
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(main_url + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        assert httpx.get(main_url + path, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
        assert httpx.get(main_url + path, headers=AUTH, timeout=10).status_code == 200
    r = httpx.post(main_url + "/v1/completions", json={"prompt": [5]}, timeout=10)
    assert r.status_code == 401
    assert httpx.get(main_url + "/health", timeout=10).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=main_url + "/v1", api_key="wrong", max_retries=0).completions.create(
            model=MODEL, prompt=[5], max_tokens=1)
    models = httpx.get(main_url + "/v1/models", headers=AUTH, timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


# ---------------------------------------------------------------------- (g) metrics under pressure
@pytest.mark.server
def test_metrics_have_vllm_names_and_counters_move_under_pressure(servers, local_engine: LLMEngine) -> None:
    url = servers["pressured"].url
    before = metrics_of(url)
    for name in VLLM_METRICS:
        assert any(k == name or k.startswith(name + "{") for k in before), name
    info = next(k for k in before if k.startswith("vllm:cache_config_info{"))
    for label in ("block_size=8", "num_gpu_blocks=12", "enable_prefix_caching=True", "preemption_mode=recompute",
                  "max_num_seqs=8", "enable_chunked_prefill=False", "scheduling_policy=fcfs", "max_model_len=1024"):
        assert label in info, (label, info)

    prompts = [list(range(20 + 7 * i, 26 + 7 * i)) for i in range(4)]
    want = local_engine.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))

    async def run_all() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            rs = await asyncio.gather(*[c.post("/v1/completions", json={
                "prompt": p, "max_tokens": 30, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
                for p in prompts])
        return [r.json()["choices"][0]["token_ids"] for r in rs]

    assert asyncio.run(run_all()) == [o.token_ids for o in want]  # preempted, yet token-exact
    after = wait_idle(url)
    assert after["vllm:num_preemptions_total"] > before["vllm:num_preemptions_total"]
    assert after["reference_engine:preemptions_recompute_total"] > 0
    assert after["reference_engine:preemptions_recompute_total"] == after["vllm:num_preemptions_total"]
    assert after["reference_engine:recomputed_tokens_total"] > before["reference_engine:recomputed_tokens_total"]
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 24
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 120
    assert after["vllm:request_success_total{finished_reason=length}"] - before.get(
        "vllm:request_success_total{finished_reason=length}", 0) == 4
    assert after["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"] == 4
    assert after["vllm:inter_token_latency_seconds_count"] - before["vllm:inter_token_latency_seconds_count"] == 116
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]


# ---------------------------------------------------------------------- (h) many streams
@pytest.mark.server
def test_256_concurrent_streams_all_served_and_the_pool_is_whole_after(main_url: str) -> None:
    n = 256

    async def one(c: httpx.AsyncClient, i: int) -> tuple[list[int], str | None]:
        body = {"model": MODEL, "prompt": [3 + i % 500, 7, 11 + i % 400], "max_tokens": 4, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        ids, reason = [], None
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    ids += choice.get("token_ids", [])
                    reason = choice.get("finish_reason") or reason
        return ids, reason

    async def run_all():
        limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
        async with httpx.AsyncClient(base_url=main_url, headers=AUTH, timeout=120, limits=limits) as c:
            return await asyncio.gather(*[one(c, i) for i in range(n)])

    results = asyncio.run(run_all())
    assert all(len(ids) == 4 and reason == "length" for ids, reason in results)
    wait_idle(main_url)


# ---------------------------------------------------------------------- (i) disconnects
ABORTED = "vllm:request_success_total{finished_reason=abort}"
FINISHED = "vllm:request_success_total{finished_reason=length}"
#: hang-ups tried before concluding that the server never aborts (each lost race costs one 900-token run)
HANG_UP_TRIES = 5


def post_then_hang_up_once_running(url: str, body: dict) -> None:
    """POST ``body`` on a raw socket, wait until the server runs it, then close the socket.

    Hanging up on an event (the request is running) rather than after a fixed client timeout keeps
    the test independent of how fast the machine generates: on an idle CI box the tiny model wrote
    900 tokens in under the one second a timeout-based version waited, so nothing was aborted.
    If the response arrives first (the request finished before a poll saw it running), this returns
    at once instead of waiting for a "running" that will never come; the caller sees it finished.
    """
    parsed = httpx.URL(url)
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {parsed.host}:{parsed.port}\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    deadline = time.monotonic() + 20
    with socket.create_connection((parsed.host, parsed.port), timeout=10) as sock:
        sock.sendall(head.encode() + payload)
        while metrics_of(url)["vllm:num_requests_running"] < 1:
            if select.select([sock], [], [], 0.002)[0]:
                return  # the response (or the server's close) is here: nothing left to hang up on
            assert time.monotonic() < deadline, "the request never started running"


def hang_up_mid_request(url: str, body: dict) -> bool:
    """Send ``body`` and hang up while it runs (streaming: after its first chunk; otherwise once
    /metrics shows it running). True when the server aborted it; False when it had finished (every
    token generated) before the hang-up reached it: a lost race that proves nothing either way.
    Fails if the server counted neither, or did not end up idle with its whole pool free."""
    before = metrics_of(url)
    if body["stream"]:
        with httpx.Client(base_url=url, headers=AUTH, timeout=30) as c, \
                c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # one chunk, then hang up
    else:
        post_then_hang_up_once_running(url, body)
    after = wait_idle(url)
    aborted = after.get(ABORTED, 0) - before.get(ABORTED, 0)
    finished = after.get(FINISHED, 0) - before.get(FINISHED, 0)
    assert (aborted, finished) in ((1, 0), (0, 1)), f"one request, counted {aborted} aborted, {finished} finished"
    if aborted:
        assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < body["max_tokens"]
    return bool(aborted)


@pytest.mark.server
@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_client_gone_mid_request_aborts_it_and_frees_its_blocks(main_url: str, stream: bool) -> None:
    # 900 tokens (the most a 57-token prompt leaves under max_model_len 1024) take hundreds of steps;
    # the hang-up comes after one. Still, a machine fast enough could finish them before the server
    # hears the socket close: such a try is told apart by /metrics (finished, not aborted) and repeated.
    # A server that never aborts fails every try.
    body = {"model": MODEL, "prompt": list(range(3, 60)), "max_tokens": 900, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    outcomes = []
    while len(outcomes) < HANG_UP_TRIES and not any(outcomes):
        outcomes.append(hang_up_mid_request(main_url, body))
    assert any(outcomes), f"the request finished before each of {HANG_UP_TRIES} hang-ups: never aborted"


# ---------------------------------------------------------------------- in process: a failing step
def test_a_failing_step_fails_in_flight_requests_and_the_server_recovers(tiny_ckpt: str) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=64))
    real_step, calls = engine.step, {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected step failure")
        return real_step()

    engine.step = flaky_step
    with TestClient(build_app(engine, served_model_name=MODEL)) as c:
        r = c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3, "temperature": 0, "stream": True})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        assert re.search(r'"finish_reason":"length"', r.text)
    assert engine.block_manager.is_whole() and not engine.has_unfinished_requests()
