"""The gateway's recent-activity recorder: outcomes, per-second buckets, the recent-requests ring, record JSON."""

from __future__ import annotations

import gc
import weakref

import pytest

from switchyard.admin.overview import summary
from switchyard.decide.decision import Later
from switchyard.gateway.activity import TTFT_SAMPLES, Activity, outcome_of
from tests.unit.gateway.helpers import T0, finish, rows


@pytest.mark.parametrize(("status", "shed", "broken", "outcome"), [
    (200, False, False, "ok"), (200, False, True, "error"), (503, True, False, "shed"), (503, False, False, "error"),
    (502, False, False, "error"), (429, False, False, "limited"), (400, False, False, "refused"),
    (404, False, False, "refused"), (499, False, False, "client_closed"),
])
def test_outcomes(status: int, shed: bool, broken: bool, outcome: str) -> None:
    assert outcome_of(status, shed=shed, broken=broken) == outcome


def test_ttft_samples_per_bucket_are_capped() -> None:
    activity = Activity(started=T0 - 10_000, seed=1)
    for i in range(TTFT_SAMPLES * 4):
        finish(activity, T0 + 0.5, ttft=i / 1000)
    series = activity._series["small-us"]
    bucket = series.bucket(int(T0))
    assert len(bucket.ttft) == TTFT_SAMPLES and bucket.ttft_seen == TTFT_SAMPLES * 4
    # A uniform sample: its median lies near the true one (255.5 ms), not among the first 128 values.
    p50 = rows(summary(activity, window_s=10, now=T0 + 1))["small-us"]["ttft_p50_ms"]
    assert 150 < p50 < 360


def test_the_ring_is_bounded_and_newest_first() -> None:
    activity = Activity(recent=5)
    for i in range(12):
        finish(activity, T0 + i, rid=f"r{i}")
    assert [r.request_id for r in activity.recent()] == ["r11", "r10", "r9", "r8", "r7"]
    assert activity.recent(limit=2)[-1].request_id == "r10"
    assert activity.get("r3") is None and activity.get("r9") is not None


def test_requests_are_listed_by_the_time_they_show_not_the_order_they_finished() -> None:
    activity = Activity()
    long = activity.begin("long", "chat", started=0.0, now=T0)  # arrives first, answers last
    finish(activity, T0 + 1, rid="short")
    finish(activity, T0 + 2, rid="batch-line", batch=True)
    activity.finish(long, 200, now=T0 + 30)
    assert [r.request_id for r in activity.recent()] == ["batch-line", "short", "long"]
    assert [r.request_id for r in activity.recent(lane="interactive")] == ["short", "long"]


def test_a_record_is_kept_once() -> None:
    activity = Activity()
    record = finish(activity, T0, 502)
    activity.finish(record, 500, now=T0)
    assert [r.status for r in activity.recent()] == [502]
    assert summary(activity, now=T0)["total"]["requests"] == 1


def test_record_json_has_no_secrets_and_is_plain() -> None:
    activity = Activity()
    record = finish(activity, T0, 200, rid="req-1", tenant="acme", tenant_id=1, key_id=2, tier="free",
                    model="small", ttft=0.0123, prompt_tokens=5, completion_tokens=7, cached_tokens=0,
                    moved_on=["http://x 503"], trace=["model small requested directly"])
    data = record.as_dict()
    assert data["time"] == "2027-01-15T08:00:00.000Z"
    assert data["ttft_ms"] == 12.3 and data["duration_ms"] == 500.0 and data["outcome"] == "ok"
    assert data["status"] == 200 and data["cache"] == "none" and data["moved_on"] == ["http://x 503"]
    assert not {"started", "shed", "broken", "authorization", "api_key", "prompt", "messages"} & set(data)




def test_only_streams_give_ttft_and_batch_lines_are_counted_apart() -> None:
    """A non-streamed answer's first byte is its whole body: its time is no TTFT. Batch lines stay out of the
    interactive figures (and out of their memory), counted on their own."""
    activity = Activity(started=T0 - 100, seed=1)
    finish(activity, T0, ttft=0.05, rid="stream")
    finish(activity, T0, ttft=4.0, stream=False, rid="whole")
    for i in range(7):
        finish(activity, T0, 200 if i else 429, ttft=9.0, batch=True, rid=f"batch-{i}")
    total = summary(activity, window_s=10, now=T0 + 1)["total"]
    assert (total["requests"], total["ok"], total["limited"]) == (2, 2, 0)
    assert total["ttft_p50_ms"] == total["ttft_p99_ms"] == 50.0
    assert (total["batch_lines"], total["batch_ok"]) == (7, 6)
    assert [r.request_id for r in activity.recent(lane="interactive")] == ["whole", "stream"]
    assert [r.request_id for r in activity.recent(lane="batch", limit=2)] == ["batch-6", "batch-5"]
    assert len(activity.recent(limit=100)) == 9 and activity.get("batch-0") is not None


def test_batch_lines_do_not_push_interactive_requests_out() -> None:
    activity = Activity(recent=5)
    finish(activity, T0, rid="interactive")
    for i in range(50):
        finish(activity, T0 + 1 + i, batch=True, rid=f"line-{i}")
    assert [r.request_id for r in activity.recent(lane="interactive")] == ["interactive"]
    assert activity.recent()[0].request_id == "line-49" and activity.recent()[-1].request_id == "interactive"


def test_the_cache_hit_rate_comes_with_its_base() -> None:
    activity = Activity(started=T0 - 100)
    for i, cache in enumerate(("hit", "hit", "miss", "none", "none")):
        finish(activity, T0, cache=cache, rid=f"r{i}")
    total = summary(activity, window_s=10, now=T0 + 1)["total"]
    assert (total["cache_hit_rate"], total["cache_lookups"], total["requests"]) == (0.6667, 3, 5)


def test_a_record_handed_to_the_request_log_has_its_trace_in_words_and_lets_go_of_its_objects() -> None:
    class Choice:  # stands for what a lazy line describes (an endpoint chosen and its scores)
        def __init__(self, url: str) -> None:
            self.url = url

    def describe(choice: Choice) -> str:
        return f"endpoint {choice.url}"

    handed: list[list[object]] = []
    logged = Activity()
    logged.sink = lambda record: handed.append(list(record.trace))
    choice = Choice("http://a")
    gone = weakref.ref(choice)
    record = logged.begin("r1", "chat")
    record.trace += ["model: small", Later(describe, choice)]
    del choice
    logged.finish(record, 200)
    gc.collect()
    assert handed == [["model: small", "endpoint http://a"]]  # (the sink sees words only)
    assert record.trace == ["model: small", "endpoint http://a"]
    assert gone() is None  # nothing the record keeps holds the choice any more

    # Without a request log the line stays lazy (put into words only if the console reads it).
    quiet = Activity()
    kept = Choice("http://b")
    record = quiet.begin("r2", "chat")
    record.trace.append(Later(describe, kept))
    quiet.finish(record, 200)
    assert isinstance(record.trace[0], Later)
    assert record.as_dict()["trace"] == ["endpoint http://b"]


def test_a_trace_line_that_cannot_be_put_into_words_does_not_fail_the_request(
        caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> str:
        raise KeyError("gone")

    handed: list[list[object]] = []
    logged = Activity()
    logged.sink = lambda record: handed.append(list(record.trace))
    record = logged.begin("r1", "chat")
    record.trace += ["model: small", Later(broken), "route: model=small"]
    logged.finish(record, 200)
    assert record.status == 200 and logged.get("r1") is record
    assert handed == [["model: small", "(a trace line could not be put into words)", "route: model=small"]]
    assert "r1: a trace line could not be put into words" in caplog.text
