"""Run the ``tests:`` section of a policy through the same decisions the gateway makes."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from switchyard.decide.dryrun import DryRun, dry_run
from switchyard.decide.features import RequestFeatures, request_features
from switchyard.decide.resolve import unreachable_rules
from switchyard.decide.tokens import estimate_chat_tokens
from switchyard.policy.errors import PolicyError, PolicyIssue, issues_at
from switchyard.policy.load import parse_yaml
from switchyard.policy.policy_tests import PolicyTest, PolicyTestExpect, PolicyTestRequest
from switchyard.policy.snapshot import PolicySnapshot, compile_policy


@dataclass(frozen=True, slots=True)
class PolicyTestResult:
    """One policy test's outcome."""

    index: int
    name: str
    passed: bool
    expected: str
    got: str

    @property
    def loc(self) -> tuple[str | int, ...]:
        """Where the test sits in the document."""
        return ("tests", self.index, "expect")

def features_of_test(test: PolicyTest) -> RequestFeatures:
    """The features of a policy test's request."""
    return features_of_request(test.request)


def features_of_request(req: PolicyTestRequest) -> RequestFeatures:
    """The features of a request described as a policy test's (also the console's dry-run form)."""
    headers = {k.lower(): v for k, v in req.headers.items()}
    if req.kind != "chat":  # read off the body it describes, as the gateway reads one
        features = request_features(req.kind, body_of_request(req), headers)
        if req.prompt_tokens is not None:
            features = replace(features, prompt_tokens=req.prompt_tokens)
        return replace(features, has_tools=req.tools, json_mode=req.json_mode, has_images=req.images)
    texts = [req.prompt] + ([req.system] if req.system else [])
    texts += [""] * max(0, req.messages - len(texts))
    return RequestFeatures(
        model=req.model,
        prompt_tokens=req.prompt_tokens if req.prompt_tokens is not None else estimate_chat_tokens(texts),
        messages=req.messages,
        last_user_text=req.prompt,
        system_text=req.system or "",
        max_tokens=req.max_tokens,
        has_tools=req.tools,
        json_mode=req.json_mode,
        has_images=req.images,
        headers=headers,
    )


def body_of_test(test: PolicyTest) -> dict[str, Any]:
    """A chat request body for a policy test's request (what the response cache's rules look at)."""
    return body_of_request(test.request)


def body_of_request(req: PolicyTestRequest) -> dict[str, Any]:
    """The request body (of its ``kind``: a chat by default) for a request described as a policy test's."""
    if req.kind != "chat":
        return _body_of_kind(req)
    messages = ([{"role": "system", "content": req.system}] if req.system else [])
    messages += [{"role": "user", "content": ""}] * max(0, req.messages - 1 - len(messages))
    messages.append({"role": "user", "content": req.prompt})
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.max_tokens is not None:
        body["max_tokens"] = req.max_tokens
    return body


def _body_of_kind(req: PolicyTestRequest) -> dict[str, Any]:
    """The body of a request of another kind than chat: its ``prompt`` as the text the API takes."""
    body: dict[str, Any] = {"model": req.model}
    if req.kind == "embedding":
        body["input"] = req.prompt or " "
        return body
    if req.kind == "detokenize":
        body["tokens"] = []
        return body
    if req.kind == "responses":
        body["input"] = req.prompt
        if req.system:
            body["instructions"] = req.system
        if req.max_tokens is not None:
            body["max_output_tokens"] = req.max_tokens
    else:
        body["prompt"] = req.prompt
        if req.max_tokens is not None and req.kind == "completion":
            body["max_tokens"] = req.max_tokens
    if req.temperature is not None and req.kind in ("responses", "completion"):
        body["temperature"] = req.temperature
    return body


def _expected(expect: PolicyTestExpect) -> list[tuple[str, object]]:
    return [(name, value) for name in ("status", "limit", "model", "pool", "region", "priority")
            if (value := getattr(expect, name)) is not None]


def _got(run: DryRun, with_priority: bool) -> str:
    if run.status != 200:
        return f"status {run.status} ({run.code}" + (f", limit {run.limit})" if run.limit else ")")
    got = f"status 200, model {run.model}, pool {run.pool}, region {run.region}"
    return got + f", priority {run.priority}" if with_priority else got


def run_policy_tests(snapshot: PolicySnapshot) -> list[PolicyTestResult]:
    """Every test of the snapshot's document, in order, through the gateway's decisions (:func:`dry_run`)."""
    results = []
    for index, test in enumerate(snapshot.document.tests):
        wanted = _expected(test.expect)
        run = dry_run(snapshot, test.request.tier, features_of_test(test), priority=test.request.priority,
                      body=body_of_test(test), kind=test.request.kind)
        passed = all(getattr(run, name) == value for name, value in wanted)
        expected = ", ".join(f"{name} {value}" for name, value in wanted)
        got = _got(run, test.expect.priority is not None)
        results.append(PolicyTestResult(index, test.name or f"tests[{index}]", passed, expected, got))
    return results


def failing_tests(snapshot: PolicySnapshot, source: str) -> list[PolicyIssue]:
    """A located issue per failing policy test (empty when all pass)."""
    failed = [r for r in run_policy_tests(snapshot) if not r.passed]
    if not failed:
        return []
    raw = parse_yaml(snapshot.text, source)
    return issues_at(raw, source, [
        (r.loc, f"policy test {r.name!r} failed: expected {r.expected}, got {r.got}") for r in failed
    ])


def policy_warnings(snapshot: PolicySnapshot, source: str) -> list[PolicyIssue]:
    """What a valid document does that its author likely did not mean, located: a route rule (or default) that a
    tier allowed to call the route can never take, because the tier may not use the rule's model."""
    found = unreachable_rules(snapshot)
    return issues_at(parse_yaml(snapshot.text, source), source, found) if found else []


def compile_checked(text: str, source: str = "<policy>", version: int | None = None) -> PolicySnapshot:
    """Validate a document, compile it, and run its tests; the gate every policy passes.

    Raises:
        PolicyError: the document is invalid or one of its tests fails.
    """
    snapshot = compile_policy(text, source, version)
    issues = failing_tests(snapshot, source)
    if issues:
        raise PolicyError(issues)
    return snapshot
