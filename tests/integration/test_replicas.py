"""Several replicas, one truth: three `switchyard serve` processes on one PostgreSQL database and one
Redis, a client spreading its requests over all three.

- a tenant's request budget holds exactly cluster-wide (Redis token buckets);
- a policy published through one replica's admin API is served by all three within a second;
- an answer cached by one replica is served by another (the Redis response cache);
- a batch created on a replica without a batch worker is run by the other two, each line once;
- a replica killed with SIGKILL while a batch runs and requests flow loses nothing.

Replica A runs no batch worker (``SWITCHYARD_BATCH_WORKER=false``); B and C do, with short leases (3 s)
and a small concurrency, so that both take part in a batch and a killed one's lines come back soon.
The policy source is the database (``SWITCHYARD_POLICY_SOURCE=db``) with the default 0.5 s poll.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from sqlalchemy import text

from switchyard.store import db
from tests.integration.conftest import ADMIN_AUTH, Engines, Gateway, eventually, http_json, start_gateway, stop
from tests.integration.test_batch_worker import batch_results, wait_done

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

REDIS = "redis://127.0.0.1:6379/0"
LIMIT = 10  # requests per minute of the budget tenant, across the three replicas
PUBLISH_SLA_S = 1.0  # the bound: a publish is served by every replica within a second
LEASE_S = 3  # a killed replica's batch lines are claimed again after this
NAMES = "ABC"  # the replicas, in the order of Cluster.replicas
SMALL_POOLS = ("small-us", "small-eu")  # the pools of the models `small` and `cached`


def _policy(engines: Engines) -> str:
    """The integration policy plus a cached model (`cached`, exact cache rule) and a batch-lane class."""
    text_ = engines.policy_file.read_text()
    models = "models:\n"
    assert models in text_ and "priorities:\n" in text_ and "cache:" not in text_
    text_ = text_.replace(models, models + "  - {name: cached, pools: [small-us, small-eu], context_window: 8192,\n"
                          "      price: {input_per_mtok: 0.1, output_per_mtok: 0.2}}\n", 1)
    priorities = "priorities:\n"
    text_ = text_.replace(priorities, priorities + "  batch: {lane: batch}\n", 1)
    return text_ + "cache:\n  - {name: exact, match: {models: [cached]}, ttl: 1h}\n"


@dataclass
class Cluster:
    replicas: list[Gateway]  # A (no batch worker), B, C
    engines: Engines
    database_url: str
    policy: str

    def engine_requests(self) -> float:
        """Requests the engines of the small pools have finished (`vllm:request_success_total`)."""
        total = 0.0
        for pool in SMALL_POOLS:
            for port in self.engines.ports[pool]:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    total += sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                                 if line.startswith("vllm:request_success_total{"))
        return total


@pytest.fixture(scope="module")
def cluster(engines: Engines, tmp_path_factory: pytest.TempPathFactory,
            pg_database: Callable[[], str]) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("replicas")
    policy_file = tmp / "policies.yaml"
    policy_file.write_text(_policy(engines))
    ours = Engines(policy_file, engines.ports, engines.dead_port)
    url = pg_database()
    env = {"SWITCHYARD_POLICY_SOURCE": "db", "SWITCHYARD_REDIS_URL": REDIS,
           "SWITCHYARD_REDIS_KEY_PREFIX": f"replicas-{uuid.uuid4().hex[:10]}:",
           "SWITCHYARD_BATCH_LEASE_S": str(LEASE_S), "SWITCHYARD_BATCH_CONCURRENCY": "4"}
    replicas: list[Gateway] = []
    try:
        # A first: it migrates the fresh database and records the file's policy as v1; B and C then
        # start together and find both.
        replicas.append(start_gateway(ours, url, tmp / "a", "postgresql", {**env, "SWITCHYARD_BATCH_WORKER": "false"}))
        with ThreadPoolExecutor(2) as pool:
            starting = [pool.submit(start_gateway, ours, url, tmp / name, "postgresql", env) for name in "bc"]
            replicas += [future.result() for future in starting if future.exception() is None]
        for future in starting:
            future.result()  # raises what failed, once the other one is in ``replicas`` to be stopped
        yield Cluster(replicas, engines, url, policy_file.read_text())
    finally:
        for gw in replicas:
            if gw.proc.returncode is None:  # not the one the last test killed
                assert stop(gw.proc), f"replica {gw.base_url} must stop cleanly on SIGTERM"


def _version(gw: Gateway) -> str:
    return str(http_json("GET", f"{gw.base_url}/readyz")[2]["checks"]["policy"]["version"])


def _sdk(gw: Gateway, key: str, timeout: float = 30) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def _chat(gw: Gateway, key: str, content: str, model: str = "small", **extra: Any) -> tuple[str, dict[str, str]]:
    raw = _sdk(gw, key).chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=5, **extra)
    return raw.parse().choices[0].message.content or "", {k.lower(): v for k, v in raw.headers.items()}


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _lines(count: int, tag: str, max_tokens: int = 4) -> list[dict[str, Any]]:
    return [{"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "small", "max_tokens": max_tokens,
                      "messages": [{"role": "user", "content": f"{tag} {i}"}]}}
            for i in range(count)]


def _submit(gw: Gateway, key: str, lines: list[dict[str, Any]]) -> tuple[openai.OpenAI, str]:
    client = _sdk(gw, key)
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert batch.status == "in_progress", batch
    return client, batch.id


def _check_every_line_once(client: openai.OpenAI, done: Any, lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The batch completed, with one 200 result per line, in input order, and no error file."""
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
        len(lines), len(lines), 0), done.request_counts
    out = batch_results(client, done.output_file_id)
    ids = [r["custom_id"] for r in out]
    assert len(ids) == len(set(ids)), "a custom_id is in the output twice"
    assert ids == [line["custom_id"] for line in lines], "lines missing or out of order"
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in out)
    assert batch_results(client, done.error_file_id) == []
    return out


def _served_here(gw: Gateway, tenant: str) -> list[str]:
    """The request ids this replica process finished lately for ``tenant`` (its activity, the last 500)."""
    status, _, body = http_json("GET", f"{gw.base_url}/admin/api/requests?tenant={tenant}&limit=500")
    assert status == 200, body
    return [r["request_id"] for r in body["requests"]]


# --- 1. limits --------------------------------------------------------------------------------------------------


async def _spread_burst(replicas: list[Gateway], key: str, count: int) -> list[tuple[int, int, str]]:
    """``count`` requests at once, the i-th to replica ``i % 3``, each on its own connection:
    (replica, status, error code) each."""

    async def one(i: int) -> tuple[int, int, str]:
        gw = replicas[i % len(replicas)]
        api = openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0, timeout=30)
        try:
            raw = await api.chat.completions.with_raw_response.create(
                model="small", messages=[{"role": "user", "content": f"budget {i}"}], max_tokens=3)
            return i % len(replicas), raw.status_code, ""
        except openai.APIStatusError as err:
            code = err.body.get("code", "") if isinstance(err.body, dict) else ""
            return i % len(replicas), err.status_code, str(code)
        finally:
            await api.close()

    return list(await asyncio.gather(*(one(i) for i in range(count))))


def test_a_request_budget_holds_exactly_across_the_three_replicas(cluster: Cluster) -> None:
    a = cluster.replicas[0]
    key = a.new_key("budget-co", "pro")
    a.cli("tenants", "set-limits", "budget-co", f'{{"requests_per_minute": {LIMIT}}}')
    started = time.monotonic()
    answers = asyncio.run(_spread_burst(cluster.replicas, key, 3 * LIMIT))
    elapsed = time.monotonic() - started
    statuses = [status for _, status, _ in answers]
    admitted = statuses.count(200)
    per_replica = {NAMES[r]: sum(1 for rr, s, _ in answers if rr == r and s == 200) for r in range(3)}
    print(f"\nbudget {LIMIT}/min, {3 * LIMIT} requests over 3 replicas in {elapsed:.2f} s: {admitted} admitted "
          f"({per_replica}), {statuses.count(429)} refused")
    assert set(statuses) <= {200, 429}, statuses
    assert {code for _, status, code in answers if status == 429} == {"rate_limit_exceeded"}
    # The bucket refills continuously (one request every 60/LIMIT s): a slow burst may earn more.
    refill = int(elapsed * LIMIT / 60)
    assert LIMIT <= admitted <= LIMIT + refill, (admitted, elapsed)
    assert statuses.count(429) == 3 * LIMIT - admitted
    # One bucket per replica would have admitted up to 3 * LIMIT: every replica took part in the burst.
    assert all(sum(1 for r, _, _ in answers if r == i) == LIMIT for i in range(3))


# --- 2. policy publish ------------------------------------------------------------------------------------------


def test_a_publish_through_one_replica_is_served_by_all_three_within_a_second(cluster: Cluster) -> None:
    a = cluster.replicas[0]
    assert {_version(gw) for gw in cluster.replicas} == {"v1"}
    key = a.new_key("publish-co", "pro")
    worst: list[float] = []
    for n in range(2, 5):
        changed = cluster.policy.replace("standard: {max_queue_ms: 1000}", f"standard: {{max_queue_ms: {1000 + n}}}")
        assert changed != cluster.policy
        seen: dict[int, float] = {}
        status, _, body = http_json("POST", f"{a.base_url}/admin/api/policy/versions",
                                    {"yaml": changed, "message": f"replicas test {n}"}, ADMIN_AUTH)
        published = time.monotonic()
        assert status == 201, body
        assert body["version"]["number"] == n

        def watch(i: int, want: str = f"v{n}", since: float = published, seen: dict[int, float] = seen) -> None:
            while _version(cluster.replicas[i]) != want:
                if time.monotonic() - since > 5:
                    return  # never: the assertion below says so
                time.sleep(0.005)
            seen[i] = time.monotonic()

        watchers = [threading.Thread(target=watch, args=(i,)) for i in range(3)]
        for w in watchers:
            w.start()
        for w in watchers:
            w.join()
        assert set(seen) == {0, 1, 2}, f"v{n} not served by replicas {set('ABC') - {'ABC'[i] for i in seen}}"
        delays = [max(0.0, seen[i] - published) for i in range(3)]
        print(f"\nv{n} published through A; served by A, B, C after "
              f"{', '.join(f'{1000 * d:.0f} ms' for d in delays)}")
        worst.append(max(delays))
        # A request to each replica is decided under the new version.
        for gw in cluster.replicas:
            _, headers = _chat(gw, key, "which version?")
            assert f"policy=v{n}" in headers["x-switchyard-route"].split("; "), headers["x-switchyard-route"]
    print(f"publish → every replica: worst {1000 * max(worst):.0f} ms")
    assert max(worst) <= PUBLISH_SLA_S, worst


# --- 3. the shared response cache -------------------------------------------------------------------------------


def _cache_entries(gw: Gateway) -> int:
    status, _, body = http_json("GET", f"{gw.base_url}/admin/api/cache")
    assert status == 200, body
    return int(body["entries"])


def test_an_answer_cached_by_one_replica_is_served_by_the_others(cluster: Cluster) -> None:
    a, b, c = cluster.replicas
    key = a.new_key("cache-co", "pro")
    question = f"What is the capital of France? ({uuid.uuid4().hex[:8]})"
    before = cluster.engine_requests()
    first, h1 = _chat(a, key, question, model="cached", temperature=0)
    assert h1["x-switchyard-cache"].split(";")[0] == "miss", h1["x-switchyard-cache"]
    # The miss reached an engine; the store runs in the background once the answer was sent.
    assert eventually(lambda: cluster.engine_requests() >= before + 1, timeout=5)
    assert eventually(lambda: _cache_entries(b) >= 1, timeout=5), http_json("GET", f"{b.base_url}/admin/api/cache")
    engines_after_miss = cluster.engine_requests()
    for other in (b, c):
        answer, headers = _chat(other, key, question, model="cached", temperature=0)
        assert headers["x-switchyard-cache"].split(";")[0] == "hit", headers["x-switchyard-cache"]
        assert "cache=exact" in headers["x-switchyard-route"].split("; ")
        assert answer == first
    time.sleep(0.3)  # an engine's counter would move at the end of its request
    assert cluster.engine_requests() == engines_after_miss, "a hit reached an engine"


# --- 4. a batch created on A is run by B and C --------------------------------------------------------------------


def test_a_batch_created_on_a_replica_without_worker_is_run_by_the_others(cluster: Cluster) -> None:
    a, b, c = cluster.replicas
    key = a.new_key("batch-co", "pro")
    # Long enough that one worker alone cannot finish before the other's next idle poll (every 1 s): a busy
    # worker claims again as soon as a line ends, and 96 lines took one worker 1.0-1.1 s (16 or 64 tokens: the
    # simulated answers end early), the other never claiming one. 320 lines take one worker over 3 s.
    lines = _lines(320, "spread", max_tokens=64)
    started = time.monotonic()
    client, batch_id = _submit(a, key, lines)
    done = wait_done(client, batch_id, timeout=120)
    out = _check_every_line_once(client, done, lines)
    print(f"\n{len(lines)} lines in {time.monotonic() - started:.1f} s")
    # Which process served each line: every replica's own activity (a batch line keeps the request id
    # the output file names).
    answered = [r["response"]["request_id"] for r in out]
    assert len(set(answered)) == len(lines)
    served = {name: _served_here(gw, "batch-co") for name, gw in zip("ABC", (a, b, c), strict=True)}
    print(f"lines served: A {len(served['A'])}, B {len(served['B'])}, C {len(served['C'])}")
    assert served["A"] == [], "A runs no batch worker"
    assert served["B"] and served["C"], "both workers take part"
    assert not set(served["B"]) & set(served["C"]), "a line served by two replicas"
    assert sorted(served["B"] + served["C"]) == sorted(answered)


# --- 5. one replica killed --------------------------------------------------------------------------------------


@dataclass
class Sent:
    replica: int
    started: float
    ok: bool
    error: str = ""


def _leases(database_url: str, batch_id: str) -> dict[int, tuple[str, int | None]]:
    """Each line of the batch (by row id): its state and the process id of its last lease's owner
    (``host:pid:random``), read from the database the replicas share."""
    engine = db.create_db_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT id, state, lease_owner FROM batch_request WHERE batch_id = :b"),
                                {"b": batch_id}).all()
    finally:
        engine.dispose()
    return {row.id: (row.state, int(row.lease_owner.split(":")[-2]) if row.lease_owner else None) for row in rows}


@pytest.mark.alone  # it compares timings (or orders) that a busy second worker would shift
def test_a_replica_killed_mid_batch_under_load_loses_nothing(cluster: Cluster) -> None:
    a, b, c = cluster.replicas
    batch_key = a.new_key("crash-co", "pro")
    flow_key = a.new_key("flow-co", "pro")
    # Answers long enough that a worker holds lines most of the time: with 4 tokens each it finished its four in a
    # few milliseconds and slept between claims, and C, frozen at any moment, was seldom holding one.
    lines = _lines(240, "crash", max_tokens=256)
    rotation = {"alive": (0, 1, 2)}  # the replicas the client spreads its requests over
    sent: list[Sent] = []
    stopping = threading.Event()

    def flow(worker: int) -> None:
        clients = {i: _sdk(gw, flow_key, timeout=10) for i, gw in enumerate(cluster.replicas)}
        n = worker
        while not stopping.is_set():
            alive = rotation["alive"]
            target = alive[n % len(alive)]
            n += 1
            at = time.monotonic()
            try:
                clients[target].chat.completions.create(
                    model="small", messages=[{"role": "user", "content": f"flow {worker} {n}"}], max_tokens=4)
                sent.append(Sent(target, at, True))
            except openai.APIError as err:
                sent.append(Sent(target, at, False, f"{type(err).__name__}: {err}"))
            time.sleep(0.01)

    def c_held_lines() -> set[int]:
        return {row for row, (state, pid) in _leases(db_url, batch_id).items()
                if state == "running" and pid == c.proc.pid}

    def freeze_c_holding_lines(timeout: float) -> set[int]:
        """Stop C (SIGSTOP) and read the lines it holds while it cannot finish one; go on (SIGCONT) and
        try again until it holds some. A plain look-then-kill raced C's own progress: it once finished
        its lines between the two."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            os.kill(c.proc.pid, signal.SIGSTOP)
            held = c_held_lines()
            if held:
                return held
            os.kill(c.proc.pid, signal.SIGCONT)
            time.sleep(0.05)
        return set()

    db_url = cluster.database_url
    flows = [threading.Thread(target=flow, args=(w,)) for w in range(3)]
    for t in flows:
        t.start()
    try:
        client, batch_id = _submit(a, batch_key, lines)
        reached = eventually(lambda: client.batches.retrieve(batch_id).request_counts.completed >= len(lines) // 4,
                             timeout=30)
        assert reached, client.batches.retrieve(batch_id)
        orphaned = freeze_c_holding_lines(timeout=10)
        assert orphaned, "C's worker holds no line"
        # The load balancer takes C out as it dies: from here on, requests go to A and B.
        rotation["alive"] = (0, 1)
        killed_at = time.monotonic()
        c.proc.kill()
        c.proc.wait(timeout=10)
        progress = client.batches.retrieve(batch_id).request_counts.completed
        assert c_held_lines() == orphaned, "a frozen process finished a line"
        done = wait_done(client, batch_id, timeout=40)
        finished_at = time.monotonic()
        time.sleep(0.5)  # a little more traffic after the batch
    finally:
        stopping.set()
        for t in flows:
            t.join(timeout=30)
    _check_every_line_once(client, done, lines)
    # The lines C held when it died ran again, on B (A runs no worker), once.
    after = _leases(db_url, batch_id)
    assert all(after[row] == ("succeeded", b.proc.pid) for row in orphaned), {row: after[row] for row in orphaned}
    survivors = [s for s in sent if s.replica != 2]
    at_c = [s for s in sent if s.replica == 2]
    lost = [s for s in at_c if not s.ok]
    print(f"\nC killed at {progress}/{len(lines)} lines holding {len(orphaned)} leased lines; batch completed "
          f"{finished_at - killed_at:.1f} s later. Requests: {len(survivors)} to A and B "
          f"({sum(s.started > killed_at for s in survivors)} after the kill), {len(at_c)} to C, "
          f"{len(lost)} failed at C: {[s.error for s in lost]}")
    failed = [s for s in survivors if not s.ok]
    assert not failed, [s.error for s in failed]
    assert sum(s.started > killed_at for s in survivors) >= 10, "requests flowed after the kill"
    # Only requests already on their way to C when it died may fail: at most one per client thread.
    assert len(lost) <= len(flows), lost
