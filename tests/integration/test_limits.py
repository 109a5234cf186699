"""Limits on everything a client controls, against a real gateway process over the test engines.

Body shape (JSON depth, messages), prompts longer than the model's context window and ``max_tokens``
above what it allows (400 before any engine sees them), request heads (size, slow heads), stalled
bodies, idle kept-alive connections, abandoned streams (the engine aborts, the reservation is
released) and batch uploads over their limit. The gateway here runs with short client timeouts so
that the slow clients are cut off within seconds.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from switchyard.decide.tokens import TokenCounter
from tests.integration.conftest import (
    Engines,
    Gateway,
    gateway_counter,
    http_json,
    metric_sum,
    start_gateway,
    stop,
)
from tests.unit.decide.test_tokens import make_tokenizer

HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 1.5
MAX_HEADER_BYTES = 64 * 1024
MAX_FILE_BYTES = 20_000
MAX_MESSAGES = 100
FREE_TOKENS_PER_MINUTE = 6000


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module")
def gw(engines: Engines, tmp_path_factory: pytest.TempPathFactory, tokenizer_file: Path) -> Iterator[Gateway]:
    """A gateway whose model ``small`` counts prompts with a tokenizer, whose ``large`` produces at most 4096
    tokens, whose free tier has a small token budget, and with short client timeouts."""
    text = engines.policy_file.read_text()
    for old, new in [
        ("- {name: small, pools: [small-us, small-eu], context_window: 8192,",
         f"- {{name: small, pools: [small-us, small-eu], context_window: 8192, tokenizer: {tokenizer_file},"),
        ("- {name: large, pools: [large-us], context_window: 16384,",
         "- {name: large, pools: [large-us], context_window: 16384, max_output_tokens: 4096,"),
        ("- {name: free, priority: sheddable, models: [auto, small]}",
         f"- {{name: free, priority: sheddable, models: [auto, small], "
         f"limits: {{tokens_per_minute: {FREE_TOKENS_PER_MINUTE}}}}}"),
    ]:
        assert old in text
        text = text.replace(old, new)
    data_dir = tmp_path_factory.mktemp("limits")
    policy = data_dir / f"limits-{uuid.uuid4().hex[:8]}.yaml"
    policy.write_text(text)
    gateway = start_gateway(
        Engines(policy, engines.ports, engines.dead_port), f"sqlite:///{data_dir / 'sy.db'}", data_dir, "sqlite",
        {"SWITCHYARD_CLIENT_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
         "SWITCHYARD_CLIENT_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
         "SWITCHYARD_MAX_HEADER_BYTES": str(MAX_HEADER_BYTES),
         "SWITCHYARD_MAX_MESSAGES": str(MAX_MESSAGES),
         "SWITCHYARD_BATCH_MAX_FILE_BYTES": str(MAX_FILE_BYTES),
         "SWITCHYARD_BATCH_WORKER": "false"})
    try:
        gateway.keys = {"free": gateway.new_key("limits-free", "free"), "pro": gateway.new_key("limits-pro", "pro")}
        yield gateway
    finally:
        assert stop(gateway.proc), "the gateway must stop cleanly on SIGTERM"


def assert_error(body: Any, code: str, param: str | None) -> dict[str, Any]:
    """``body`` is OpenAI's error object with ``code`` and ``param``; returns its ``error``."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param), error
    return error


def post(gw: Gateway, path: str, body: Any = None, tier: str = "pro", raw: bytes | None = None,
         ) -> tuple[int, dict[str, str], Any]:
    return http_json("POST", f"{gw.base_url}{path}", body, {"Authorization": f"Bearer {gw.keys[tier]}"}, raw=raw)


def upstream_attempts(gw: Gateway) -> float:
    """Requests the gateway has sent to any engine."""
    return gateway_counter(gw, "switchyard_upstream_attempts_total")


def address(gw: Gateway) -> tuple[str, int]:
    host, port = gw.base_url.removeprefix("http://").split(":")
    return host, int(port)


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (or ``timeout`` passes)."""
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"the connection stayed open; got {data[:200]!r}") from None
        if not chunk:
            return data
        data += chunk


def parse(response: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, json.loads(body)


# --- body shape ------------------------------------------------------------------------------------

def test_deep_json_and_too_many_messages_are_400(gw: Gateway) -> None:
    deep = b'{"model": "small", "messages": [{"role": "user", "content": "x"}], "metadata": ' + b"[" * 70 + \
        b"]" * 70 + b"}"
    status, _, body = post(gw, "/v1/chat/completions", raw=deep)
    assert status == 400
    assert "more than 64 deep" in assert_error(body, "json_too_deep", None)["message"]
    deeper = b'{"model": "small", "metadata": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"  # beyond msgspec's recursion
    status, _, body = post(gw, "/v1/chat/completions", raw=deeper)
    assert status == 400, body
    assert_error(body, "json_too_deep", None)

    messages = [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)
    status, _, body = post(gw, "/v1/chat/completions", {"model": "small", "messages": messages, "max_tokens": 1})
    assert status == 400
    assert_error(body, "too_many_messages", "messages")
    status, _, body = post(gw, "/v1/chat/completions", {"model": "small", "messages": messages[1:], "max_tokens": 1})
    assert status == 200, body


# --- context window and max_tokens -----------------------------------------------------------------

def test_a_prompt_longer_than_the_context_window_is_refused_before_any_engine_sees_it(gw: Gateway) -> None:
    before = upstream_attempts(gw)
    status, _, body = post(gw, "/v1/completions", {"model": "small", "prompt": [7] * 8193, "max_tokens": 1})
    assert status == 400
    error = assert_error(body, "context_length_exceeded", "prompt")
    assert error["message"] == ("This model's maximum context length is 8192 tokens. However, your prompt contains "
                                "8193 input tokens, which exceeds this limit even without any output tokens. "
                                "Please reduce the length of the input prompt.")
    # Several prompts: each is a sequence of its own, and the longest decides.
    status, _, body = post(gw, "/v1/completions", {"model": "small", "prompt": [[7] * 10, [7] * 9000]})
    assert status == 400
    assert_error(body, "context_length_exceeded", "prompt")
    # Prompt plus max_tokens beyond the window.
    status, _, body = post(gw, "/v1/completions", {"model": "small", "prompt": [7] * 8000, "max_tokens": 500})
    assert status == 400
    assert "you requested 8500 tokens (8000 in the prompt, 500 in the completion)" in assert_error(
        body, "context_length_exceeded", "prompt")["message"]
    assert upstream_attempts(gw) == before, "no engine may see a request the gateway refused"
    # What fits goes on.
    status, _, body = post(gw, "/v1/completions", {"model": "small", "prompt": [7] * 8000, "max_tokens": 100})
    assert status == 200, body
    assert upstream_attempts(gw) == before + 1


def test_a_chat_counted_with_the_models_tokenizer_is_refused_when_its_count_is_over(gw: Gateway,
                                                                                     tokenizer_file: Path) -> None:
    """The estimate (four characters a token) would let this prompt through; the tokenizer knows better."""
    prompt = "qzj vkx wpf " * 1000  # letters the test tokenizer never merged: about a token each
    exact = TokenCounter(Tokenizer.from_file(str(tokenizer_file))).count_chat([prompt])
    assert exact > 8192 + 5 and len(prompt) // 4 // 4 < 8192
    before = upstream_attempts(gw)
    status, _, body = post(gw, "/v1/chat/completions",
                           {"model": "small", "messages": [{"role": "user", "content": prompt}]})
    assert status == 400
    error = assert_error(body, "context_length_exceeded", "messages")
    assert f"your prompt contains {exact} input tokens" in error["message"]
    assert upstream_attempts(gw) == before


def test_an_estimated_prompt_is_refused_by_the_gateway_only_when_far_over(gw: Gateway, engines: Engines) -> None:
    """``large`` has no tokenizer: a prompt the estimate puts a little over the window goes to the engine,
    which has the last word; one four times over cannot fit whatever the tokenizer and is refused here."""
    before = upstream_attempts(gw)
    little_over = "word " * 14_000  # estimated 17,504 tokens > 16,384; the engine counts about 14,000
    status, _, body = post(gw, "/v1/chat/completions",
                           {"model": "large", "max_tokens": 5, "messages": [{"role": "user", "content": little_over}]})
    assert status == 200, body
    assert upstream_attempts(gw) == before + 1
    far_over = "x" * (4 * 4 * 16_384 + 100)
    status, _, body = post(gw, "/v1/chat/completions",
                           {"model": "large", "messages": [{"role": "user", "content": far_over}]})
    assert status == 400
    assert "an estimated" in assert_error(body, "context_length_exceeded", "messages")["message"]
    assert upstream_attempts(gw) == before + 1


def test_max_tokens_above_what_the_model_allows_is_400_not_clamped(gw: Gateway) -> None:
    client = openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key=gw.keys["pro"], max_retries=0)
    before = upstream_attempts(gw)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="large", messages=[{"role": "user", "content": "x"}], max_tokens=4097)
    assert (caught.value.code, caught.value.param) == ("invalid_value", "max_tokens")
    assert "max_tokens=4097 cannot be greater than 4096" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="small", messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=9000)
    assert (caught.value.code, caught.value.param) == ("invalid_value", "max_completion_tokens")
    assert "max_completion_tokens=9000 cannot be greater than max_model_len=8192" in caught.value.message
    assert upstream_attempts(gw) == before
    ok = client.chat.completions.create(model="large", messages=[{"role": "user", "content": "x"}], max_tokens=5)
    assert ok.choices and upstream_attempts(gw) == before + 1


# --- request heads, slow clients, idle connections -------------------------------------------------

def test_a_head_over_the_limit_is_431_and_the_connection_closed(gw: Gateway) -> None:
    with socket.create_connection(address(gw), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (100 * 1024) + b"\r\n\r\n")
        status, headers, body = parse(read_until_closed(sock, 10))
    assert status == 431 and headers["connection"] == "close"
    assert_error(body, "headers_too_large", None)
    # A header that never ends is cut off once it is over the limit, not buffered for ever.
    with socket.create_connection(address(gw), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        for _ in range(20):
            try:
                sock.sendall(b"a" * 8192)
            except OSError:
                break
        status, _, body = parse(read_until_closed(sock, 10))
    assert status == 431
    # Within the limit all is well.
    with socket.create_connection(address(gw), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Fine: " + b"a" * 30_000 + b"\r\nConnection: close\r\n\r\n")
        assert read_until_closed(sock, 10).startswith(b"HTTP/1.1 200")


def test_a_slowloris_is_cut_off_after_the_header_timeout(gw: Gateway) -> None:
    """A header line every half second never completes the head: 408 after the timeout, connection closed."""
    with socket.create_connection(address(gw), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        sock.settimeout(0.5)
        answer = b""
        while time.monotonic() - started < 10:
            try:
                answer = sock.recv(65536)
                break
            except TimeoutError:
                sock.sendall(b"X-Still-Here: 1\r\n")
        answer += read_until_closed(sock, 5)
        elapsed = time.monotonic() - started
    assert HEADER_TIMEOUT_S - 0.1 <= elapsed < HEADER_TIMEOUT_S + 2, elapsed
    status, headers, body = parse(answer)
    assert status == 408 and headers["connection"] == "close"
    assert_error(body, "request_timeout", None)


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(gw: Gateway) -> None:
    with socket.create_connection(address(gw), timeout=10) as sock:
        started = time.monotonic()
        assert read_until_closed(sock, 10) == b""
        elapsed = time.monotonic() - started
    assert HEADER_TIMEOUT_S - 0.1 <= elapsed < HEADER_TIMEOUT_S + 2, elapsed


def test_an_idle_kept_alive_connection_outlives_the_header_timeout(gw: Gateway) -> None:
    """The header timeout starts with a request's first byte, not when the previous answer ended."""
    conn = http.client.HTTPConnection(*address(gw), timeout=10)
    try:
        conn.request("GET", "/healthz")
        assert conn.getresponse().read() is not None
        sock = conn.sock
        time.sleep(HEADER_TIMEOUT_S + 0.5)
        conn.request("GET", "/healthz")
        response = conn.getresponse()
        response.read()
        assert response.status == 200 and conn.sock is sock
    finally:
        conn.close()


def chat_head(gw: Gateway, length: int) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {gw.keys['pro']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def test_a_stalled_body_is_408_and_the_connection_closed(gw: Gateway) -> None:
    with socket.create_connection(address(gw), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(chat_head(gw, 1000) + b'{"model": "small", ')
        answer = read_until_closed(sock, 10)
        elapsed = time.monotonic() - started
    assert BODY_TIMEOUT_S - 0.1 <= elapsed < BODY_TIMEOUT_S + 2, elapsed
    status, headers, body = parse(answer)
    assert status == 408 and headers["connection"] == "close"
    assert "stopped arriving" in assert_error(body, "request_timeout", None)["message"]


def test_a_slow_but_steady_body_is_served(gw: Gateway) -> None:
    """Pauses shorter than the body timeout are fine, however long the whole body takes."""
    body = json.dumps({"model": "small", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).encode()
    pieces = [body[i:i + 12] for i in range(0, len(body), 12)][:4]
    pieces.append(body[sum(map(len, pieces)):])
    with socket.create_connection(address(gw), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(chat_head(gw, len(body)))
        for piece in pieces:
            time.sleep(BODY_TIMEOUT_S * 0.6)
            sock.sendall(piece)
        response = http.client.HTTPResponse(sock)
        response.begin()
        answer = json.loads(response.read())
    assert time.monotonic() - started > BODY_TIMEOUT_S * 2
    assert response.status == 200, answer
    assert answer["object"] == "chat.completion"


# --- abandoned streams -----------------------------------------------------------------------------

def test_an_abandoned_stream_aborts_the_engine_request_and_releases_its_reservation(gw: Gateway,
                                                                                    engines: Engines) -> None:
    """Free tier: 6000 tokens a minute. A stream reserving about 4000 is left after a few chunks; a request
    reserving 3000 is then admitted at once, which it could not be while the first one's reservation held."""
    key = gw.keys["free"]
    hi = [{"role": "user", "content": "Tell me everything."}]
    small = [f"http://127.0.0.1:{port}" for pool in ("small-us", "small-eu") for port in engines.ports[pool]]
    produced = generated(small)
    with httpx.stream("POST", f"{gw.base_url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "small", "messages": hi, "max_tokens": 4000, "stream": True,
                            "ignore_eos": True}) as response:
        assert response.status_code == 200
        reserved = FREE_TOKENS_PER_MINUTE - int(response.headers["x-ratelimit-remaining-tokens"])
        assert reserved > 4000
        endpoint = dict(p.split("=", 1) for p in response.headers["x-switchyard-route"].split("; "))["endpoint"]
        aborted = json.loads(httpx.get(f"{endpoint}/sim/state").text)["aborted"]
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
    left_at = time.monotonic()
    deadline = left_at + 5
    while json.loads(httpx.get(f"{endpoint}/sim/state").text)["aborted"] == aborted:
        assert time.monotonic() < deadline, "the engine must see the client leave"
        time.sleep(0.05)
    # What the engine produced before it saw the client leave (more, the later it saw it; the gateway charges
    # the tokens that reached it, at most these).
    produced = generated(small) - produced
    assert produced < 4000, "the engine stops generating when the client leaves"
    # Without the release, 3000 more would need ~1000 tokens refilled: 10 s at 100 a second.
    status, headers, body = 0, dict[str, str](), None
    while time.monotonic() < left_at + 3:
        status, headers, body = post(gw, "/v1/chat/completions",
                                     {"model": "small", "messages": hi, "max_tokens": 3000}, tier="free")
        if status != 429:
            break
        time.sleep(0.1)
    assert status == 200, body
    prompt = reserved - 4000
    # What the abandoned stream was charged, less what the bucket refilled since (100 tokens a second).
    charged = FREE_TOKENS_PER_MINUTE - int(headers["x-ratelimit-remaining-tokens"]) - prompt - 3000
    assert charged <= prompt + produced, "the abandoned stream is charged what it used, not what it reserved"


def generated(endpoints: list[str]) -> float:
    """The tokens ``endpoints``' engines have generated so far (``vllm:generation_tokens_total``, aborted requests'
    too)."""
    return sum(metric_sum(endpoint, "vllm:generation_tokens_total") for endpoint in endpoints)


# --- batch uploads ---------------------------------------------------------------------------------

def multipart(content: bytes) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            f"Content-Type: application/jsonl\r\n\r\n").encode() + content + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def test_an_upload_over_the_file_limit_is_413_with_an_openai_error(gw: Gateway) -> None:
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "small", "messages": [{"role": "user", "content": "x" * 100}]}}).encode()
    fits, fits_type = multipart(b"\n".join([line] * (MAX_FILE_BYTES // (len(line) + 1))))
    too_big, content_type = multipart(b"\n".join([line] * (2 * MAX_FILE_BYTES // len(line))))
    auth = {"Authorization": f"Bearer {gw.keys['pro']}"}
    with httpx.Client(base_url=gw.base_url, headers=auth, timeout=30) as client:
        ok = client.post("/v1/files", content=fits, headers={"Content-Type": fits_type})
        assert ok.status_code == 200, ok.text
        # Announced by Content-Length: refused before it is read.
        announced = client.post("/v1/files", content=too_big, headers={"Content-Type": content_type})
        assert announced.status_code == 413
        assert_error(announced.json(), "request_too_large", "file")
        # Chunked (no Content-Length): refused as soon as it is over.
        chunked = client.post("/v1/files", content=iter([too_big[i:i + 4096] for i in range(0, len(too_big), 4096)]),
                              headers={"Content-Type": content_type})
        assert "content-length" not in chunked.request.headers
        assert chunked.status_code == 413
        assert_error(chunked.json(), "request_too_large", "file")
