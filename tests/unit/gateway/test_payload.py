"""The body each pool gets: its served model name, and a priority only where it is honoured."""

from __future__ import annotations

import json

import msgspec

from switchyard.decide.classes import ClassDecision
from switchyard.decide.decision import Ask, Caller, Decision
from switchyard.decide.features import chat_features
from switchyard.gateway.request import PendingRequest
from switchyard.policy import compile_policy
from switchyard.policy.fleet import Model, Pool
from switchyard.policy.tiers import PriorityClass
from switchyard.store.keys import KeyIdentity
from tests.unit.policy.base import base, to_yaml


def pool(served: str, priority_scheduling: bool) -> Pool:
    return Pool(name="p", region="r", served_model=served, endpoints=["http://127.0.0.1:1"],
                kv_cache_tokens=1000, priority_scheduling=priority_scheduling)


SNAPSHOT = compile_policy(to_yaml(base()))
BASE = next(iter(SNAPSHOT.models.values()))


def request(body: dict[str, object], priority: int) -> PendingRequest:
    raw = msgspec.json.encode(body)
    decision = Decision(SNAPSHOT, Ask("chat", body, chat_features(body, {}), Caller("pro", "1", "1")))
    decision.cls = ClassDecision("standard", PriorityClass(max_queue_ms=1000), 0, priority, "standard",
                                 "class standard")
    return PendingRequest("chat", body, raw, False, "rid", 0.0, KeyIdentity(1, 1, "tenant", "pro"), decision)


def test_priority_goes_only_to_priority_scheduling_pools() -> None:
    body = {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "priority": 3}
    req = request(body, 10)
    with_priority = json.loads(req.payload_for(pool("llama", True), BASE))
    assert with_priority["model"] == "llama" and with_priority["priority"] == 10
    without = json.loads(req.payload_for(pool("llama", False), BASE))
    assert without["model"] == "llama" and "priority" not in without
    assert body["model"] == "auto" and body["priority"] == 3  # the parsed body is not changed


def test_the_client_bytes_are_forwarded_untouched_when_nothing_changes() -> None:
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}
    req = request(body, 0)
    assert req.payload_for(pool("llama", False), BASE) is req.raw
    assert json.loads(req.payload_for(pool("llama", True), BASE))["priority"] == 0
    # Encoded once per kind of pool.
    assert req.payload_for(pool("llama", True), BASE) is req.payload_for(pool("llama", True), BASE)


def test_a_class_name_never_reaches_an_engine() -> None:
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "priority": "standard"}
    req = request(body, 10)
    assert json.loads(req.payload_for(pool("llama", True), BASE))["priority"] == 10
    assert "priority" not in json.loads(req.payload_for(pool("llama", False), BASE))


def test_an_adapter_is_named_by_its_served_adapter_name() -> None:
    body = {"model": "support", "messages": [{"role": "user", "content": "hi"}]}
    req = request(body, 0)
    adapter = Model(name="support", adapter_of="p", adapter="support-lora-v2", context_window=4096,
                    price={"input_per_mtok": 1, "output_per_mtok": 2})
    assert adapter.pools == ["p"] and adapter.served_name == "support-lora-v2"
    assert json.loads(req.payload_for(pool("llama", False), adapter))["model"] == "support-lora-v2"
    unnamed = Model(name="support", adapter_of="p", context_window=4096,
                    price={"input_per_mtok": 1, "output_per_mtok": 2})
    assert req.payload_for(pool("llama", False), unnamed) is req.raw  # served under its own name: untouched
    assert json.loads(req.payload_for(pool("llama", False), BASE))["model"] == "llama"
