"""Secrets stay secret: a gateway that logs everything it logs (debug level, JSON, a line per request) and
exports traces is sent every kind of request with keys, wrong keys, the admin token and console
passwords; none of them may reach its log, its spans, the request log (database rows, admin API, console)
or an answer's headers. The session-wide check (``tests/conftest.py``) greps every test's captured output
and log files for the same; the last test here shows that check finding a planted leak.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from switchyard.store.keys import generate_key
from tests.conftest import SECRETS, SecretWatch
from tests.integration.conftest import (
    ADMIN_TOKEN,
    CONSOLE_PASSWORD,
    Engines,
    Gateway,
    eventually,
    http_json,
    start_gateway,
    stop,
)
from tests.integration.test_tracing import Receiver, attrs

#: A key of the right form that no tenant has (what a guesser or a leaked, revoked key looks like).
UNKNOWN_KEY = generate_key()
WRONG_ADMIN_TOKEN = ADMIN_TOKEN + "-but-wrong"
WRONG_PASSWORD = "wrong horse battery staple"
for _secret in (UNKNOWN_KEY, WRONG_ADMIN_TOKEN, WRONG_PASSWORD):
    SECRETS.add(_secret)


@pytest.fixture(scope="module")
def loud(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Receiver, Path]]:
    """A gateway logging at debug level in JSON with a line per request, exporting traces, on SQLite."""
    receiver = Receiver()
    data_dir = tmp_path_factory.mktemp("gw-secrets")
    log_file = data_dir / "gateway.log"
    gw = start_gateway(engines, f"sqlite:///{data_dir / 'switchyard.db'}", data_dir, "sqlite",
                       extra_env={"SWITCHYARD_LOG_LEVEL": "debug", "SWITCHYARD_LOG_FORMAT": "json",
                                  "SWITCHYARD_LOG_REQUESTS": "true", "SWITCHYARD_OTLP_TRACES_ENDPOINT": receiver.url,
                                  "OTEL_BSP_SCHEDULE_DELAY": "100", "SWITCHYARD_BATCH_WORKER": "false",
                                  "SWITCHYARD_REQUEST_LOG_FLUSH_INTERVAL_S": "0.2"},
                       log_file=log_file)
    try:
        gw.keys = {"a": gw.new_key("secret-a", "pro"), "b": gw.new_key("secret-b", "free")}
        yield gw, receiver, log_file
    finally:
        assert stop(gw.proc)
        receiver.server.shutdown()


def _traffic(gw: Gateway) -> list[str]:
    """Every kind of request, with good and bad credentials; the request ids the gateway answered."""
    ids: list[str] = []
    sdk = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=gw.keys["a"], max_retries=0, timeout=60)
    messages: Any = [{"role": "user", "content": "hello"}]
    raw = sdk.chat.completions.with_raw_response.create(model="small", messages=messages, max_tokens=3)
    ids.append(raw.headers["x-request-id"])
    for _chunk in sdk.chat.completions.create(model="small", messages=messages, max_tokens=3, stream=True):
        pass
    sdk.completions.create(model="small", prompt="hello", max_tokens=3)
    sdk.models.list()
    uploaded = sdk.files.create(file=("in.jsonl", b'{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions",'
                                b' "body": {"model": "small", "messages": [{"role": "user", "content": "x"}]}}\n',
                                      "application/jsonl"), purpose="batch")
    sdk.files.content(uploaded.id)
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    sdk.batches.cancel(batch.id)
    for header in (f"Bearer {UNKNOWN_KEY}", f"Basic {gw.keys['b']}", gw.keys["b"], f"Bearer {gw.keys['b']}x"):
        code, headers, _ = http_json("POST", gw.base_url + "/v1/chat/completions",
                                     {"model": "small", "messages": messages, "max_tokens": 3},
                                     {"Authorization": header})
        assert code == 401
        ids.append(headers["x-request-id"])
    assert http_json("GET", gw.base_url + "/v1/nowhere", headers={"Authorization": f"Bearer {gw.keys['a']}"})[0] == 404
    assert http_json("GET", gw.base_url + "/admin/api/endpoints")[0] == 200
    assert http_json("GET", gw.base_url + "/admin/api/endpoints",
                     headers={"Authorization": f"Bearer {WRONG_ADMIN_TOKEN}"})[0] == 401
    console = gw.console("admin")  # a login with CONSOLE_PASSWORD
    console.close()
    with httpx.Client(base_url=gw.base_url) as stranger:
        stranger.get("/admin/login")
        stranger.post("/admin/login", data={"username": "ada-admin", "password": WRONG_PASSWORD},
                      headers={"x-csrftoken": stranger.cookies.get("switchyard_csrf") or ""})
    return ids


def _secrets(gw: Gateway) -> list[str]:
    return [*gw.keys.values(), UNKNOWN_KEY, ADMIN_TOKEN, WRONG_ADMIN_TOKEN, CONSOLE_PASSWORD, WRONG_PASSWORD]


def _assert_clean(what: str, text: str, secrets: list[str]) -> None:
    """Fail, naming the place and the line but not the secret, when ``text`` holds one (no assertion rewriting:
    it would print the secret)."""
    __tracebackhide__ = True
    for secret in [*secrets, "Bearer "]:
        if secret in text:
            line = next(line for line in text.splitlines() if secret in line)
            pytest.fail(f"{what} holds a secret ({secret[:8]}…) in: {line.replace(secret, '<SECRET>')[:300]}",
                        pytrace=False)


def test_no_secret_reaches_the_log_the_traces_or_the_request_log(loud: tuple[Gateway, Receiver, Path]) -> None:
    gw, receiver, log_file = loud
    ids = _traffic(gw)
    secrets = _secrets(gw)

    # The request log: every row the database holds of the traffic, whole.
    db_path = Path(gw.env["SWITCHYARD_DATABASE_URL"].removeprefix("sqlite:///"))

    def rows() -> list[Any]:
        with sqlite3.connect(db_path) as conn:
            found = conn.execute("SELECT * FROM request_log").fetchall()
        return found if {r for row in found for r in row if isinstance(r, str)} >= set(ids) else []

    logged = eventually(rows)
    assert logged, "the request log never held the traffic's requests"
    _assert_clean("the request_log table", repr(logged), secrets)
    # ... as the admin API and the console show it.
    _assert_clean("/admin/api/requests", json.dumps(http_json("GET", gw.base_url + "/admin/api/requests")[2]),
                  secrets)
    console = gw.console("admin")
    try:
        for rid in ids:
            _assert_clean(f"/admin/api/requests/{rid}",
                          json.dumps(http_json("GET", f"{gw.base_url}/admin/api/requests/{rid}")[2]), secrets)
            page = console.get(f"/admin/requests/{rid}")
            assert page.status_code == 200
            _assert_clean(f"the console's page of {rid}", page.text, secrets)
        _assert_clean("the console's requests page", console.get("/admin/requests").text, secrets)
    finally:
        console.close()

    # The traces: every attribute, event and resource attribute of every span.
    def spans() -> list[Any]:
        with receiver.lock:
            seen = {attrs(s).get("switchyard.request_id") for s in receiver.spans}
            return list(receiver.spans) if set(ids) <= seen else []

    exported = eventually(spans)
    assert exported, "the traces never held the traffic's requests"
    _assert_clean("the spans", repr([(s.name, attrs(s), [(e.name, list(e.attributes)) for e in s.events])
                                     for s in exported]), secrets)

    # The log: at debug level, a line per request; it has the requests, not their credentials.
    def requests_logged() -> str:
        text = log_file.read_text()
        return text if all(rid in text for rid in ids) else ""

    text = eventually(requests_logged)
    assert text, "the log never had a line for each request"
    assert '"level": "debug"' in text or '"level":"debug"' in text, "the gateway did not log at debug level"
    _assert_clean(str(log_file), text, secrets)


def test_no_answer_echoes_the_key(loud: tuple[Gateway, Receiver, Path]) -> None:
    """Nothing a client gets back (headers or body, success or refusal) repeats a key it sent."""
    gw, _, _ = loud
    for key in (gw.keys["a"], UNKNOWN_KEY):
        for path, body in (("/v1/chat/completions", {"model": "small", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "x"}]}),
                           ("/v1/chat/completions", {"model": "no-such-model", "messages": []}),
                           ("/v1/models", None)):
            code, headers, answer = http_json("POST" if body else "GET", gw.base_url + path, body,
                                              {"Authorization": f"Bearer {key}"})
            assert key not in json.dumps(headers) + json.dumps(answer), (code, path)


def test_the_session_check_finds_a_leak() -> None:
    """The check tests/conftest.py runs over the session's logs: a registered secret or any whole key in a line
    is reported with where it was and the line (the secret masked), and nothing else is."""
    watch = SecretWatch()
    token = "an-admin-token-of-the-test"
    watch.add(token)
    key = generate_key()  # registered by the session's wrapper, not by this watch: found as a whole key
    clean = "INFO switchyard.requests: request abc tenant acme status 200\nno secrets here sk-sy-short\n"
    assert watch.scan("clean.log", clean) == []
    leaks = watch.scan("gateway.log", f"{clean}DEBUG headers: authorization=Bearer {key}\nadmin {token} used\n")
    assert [leak.split(": a secret")[0] for leak in leaks] == ["gateway.log:3", "gateway.log:4"]
    assert key not in "".join(leaks) and token not in "".join(leaks) and "<SECRET>" in leaks[0]
    assert key in SECRETS.secrets, "keys this process makes are watched from the moment they exist"


def test_the_session_check_sees_what_gateways_write(loud: tuple[Gateway, Receiver, Path],
                                                   capfd: pytest.CaptureFixture[str]) -> None:
    """What a process the fixtures start writes to its (inherited) standard error is in the output pytest
    captures for the test that was running, which the session check scans: checked here with a child process
    writing a marker, exactly as a gateway started without ``log_file`` does."""
    import subprocess

    marker = f"marker-{time.monotonic_ns()}"
    subprocess.run([sys.executable, "-c", f"import sys; print({marker!r}, file=sys.stderr)"], check=True)
    assert marker in capfd.readouterr().err
