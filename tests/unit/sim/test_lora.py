"""LoRA adapters as vLLM 0.32 serves them: scheduling, adapter caches and load times, KV hashes and events,
metrics, the load/unload endpoints, ``/v1/models``, configuration and a policy pool's engines."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from litestar.testing import AsyncTestClient

from switchyard.kvcache.wire import BlockStored
from switchyard.policy import compile_policy
from switchyard.sim import EngineConfig, create_engine_app
from switchyard.sim.config import resolve, with_pool_adapters
from switchyard.sim.core import EngineCore
from switchyard.sim.lora import (
    DEFAULT_LORA_COSTS,
    LLAMA_8B_ADAPTER_BYTES,
    LoraAdapter,
    LoraEngine,
    LoraModule,
    LoraRegistry,
    LoraRequestError,
    LoraSettings,
    check_adapter_path,
    parse_lora_modules,
    runtime_updating_from_env,
    sanitize_message,
)
from switchyard.sim.measured import load_profile_file, profile_from_dict, profile_to_dict
from switchyard.sim.profiles import PROFILES
from switchyard.sim.request import SimRequest, Status
from tests.unit.policy.base import base, to_yaml
from tests.unit.sim.conftest import prompt_of

PROFILE = PROFILES["h100-8b"]
COSTS = DEFAULT_LORA_COSTS


def _core(max_loras: int = 1, max_cpu_loras: int | None = None, **limits: int) -> EngineCore:
    settings = LoraSettings(max_loras, max_cpu_loras or max_loras)
    return EngineCore(PROFILE, kv_cache_tokens=limits.get("kv_cache_tokens", 400_000),
                      max_num_seqs=limits.get("max_num_seqs", 256),
                      max_num_batched_tokens=limits.get("max_num_batched_tokens", 8192),
                      max_model_len=8192, frontend_overhead_s=0.0, lora=settings)


def _adapters(*names: str) -> list[LoraAdapter]:
    registry = LoraRegistry("m")
    return [registry.load(name, f"/adapters/{name}") for name in names]


_seq = iter(range(10**9))


def _req(adapter: LoraAdapter | None, prompt: list[int] | None = None, max_output: int = 3,
         priority: int = 0, arrival: float = 0.0, seed: int | None = None) -> SimRequest:
    i = next(_seq)
    return SimRequest(request_id=f"q{i}", prompt=prompt or prompt_of(40, i), max_output=max_output,
                      priority=priority, arrival=arrival, seed=i if seed is None else seed, lora=adapter)


# --- the scheduler ------------------------------------------------------------------------------------


def test_a_request_over_max_loras_is_skipped_and_later_ones_go_ahead() -> None:
    """vLLM's rule: with ``max_loras`` distinct adapters scheduled, a waiting request of another adapter is
    skipped (deferred), the ones behind it are still considered, base-model requests are never skipped."""
    a, b = _adapters("a", "b")
    core = _core(max_loras=1)
    first, blocked, same, plain = _req(a), _req(b), _req(a), _req(None)
    for r in (first, blocked, same, plain):
        core.add_request(r)
    core.step()
    assert core.running == [first, same, plain]
    assert blocked.status is Status.WAITING and core.num_waiting == 1
    lora = core.lora
    assert lora is not None and list(lora.deferred) == [blocked]
    # While adapter a runs (its requests are scheduled every step), b keeps waiting.
    core.step()
    assert blocked.status is Status.WAITING
    core.step()  # a's requests finish (3 tokens)
    assert first.status is Status.FINISHED and same.status is Status.FINISHED
    core.step()  # a new step counts only the adapters scheduled in it: b goes in
    assert core.running == [blocked] and not lora.deferred


def test_the_adapters_of_running_requests_count_only_when_scheduled() -> None:
    """The adapters counted are those of the running requests scheduled in the step (the token budget may
    leave some out), then of the waiting ones admitted in it."""
    a, b = _adapters("a", "b")
    core = _core(max_loras=2)
    reqs = [_req(a), _req(b), _req(None), _req(a)]
    for r in reqs:
        core.add_request(r)
    core.step()
    assert core.running == reqs  # two distinct adapters fit max_loras=2

    c, d = _adapters("c", "d")
    core = _core(max_loras=1)
    long = _req(c, prompt=prompt_of(300, 50), max_output=2)
    other = _req(d)
    core.max_num_batched_tokens = 100  # the long prefill takes the whole budget of each step
    core.add_request(long)
    core.add_request(other)
    core.step()
    assert core.running == [long] and other.status is Status.WAITING  # budget spent, not skipped
    assert core.lora is not None and not core.lora.deferred


def test_skipped_requests_keep_their_place_in_the_queue() -> None:
    a, b = _adapters("a", "b")
    core = _core(max_loras=1, max_num_seqs=2)
    running = _req(a, max_output=2)
    core.add_request(running)
    core.step()
    urgent_b = _req(b, priority=-1, arrival=core.now)
    later_a = _req(a, arrival=core.now)
    core.add_request(urgent_b)
    core.add_request(later_a)
    core.step()
    assert later_a in core.running and urgent_b.status is Status.WAITING
    while later_a.status is not Status.FINISHED:
        core.step()
        assert urgent_b.status is Status.WAITING
    core.step()
    assert core.running == [urgent_b]  # back in the queue, first in line once a's requests are done


# --- adapter caches and costs -------------------------------------------------------------------------


def test_loading_an_adapter_costs_its_load_time_in_the_step_that_loads_it() -> None:
    (a,) = _adapters("a")
    base_core, lora_core = _core(), _core()
    base_core.lora = None
    plain, tuned = _req(None, prompt=prompt_of(40, 7)), _req(a, prompt=prompt_of(40, 7))
    base_core.add_request(plain)
    lora_core.add_request(tuned)
    base_steps = [base_core.step().duration for _ in range(3)]
    lora_steps = [lora_core.step().duration for _ in range(3)]
    assert lora_steps[0] == pytest.approx(base_steps[0] + COSTS.load_s + COSTS.step_s, rel=1e-12)
    for plain_d, tuned_d in zip(base_steps[1:], lora_steps[1:], strict=True):
        assert tuned_d == pytest.approx(plain_d + COSTS.step_s, rel=1e-12)  # resident: only the kernels
    assert lora_core.lora is not None and lora_core.lora.loads == 1


def test_gpu_slots_and_cpu_cache_are_lru() -> None:
    a, b, c = _adapters("a", "b", "c")
    core = _core(max_loras=1, max_cpu_loras=2)
    lora = core.lora
    assert lora is not None

    def run(adapter: LoraAdapter) -> float:
        req = _req(adapter, max_output=1, arrival=core.now)
        core.add_request(req)
        return core.step().duration

    run(a)
    assert (list(lora.gpu), list(lora.cpu), lora.loads, lora.activations) == ([1], [1], 1, 1)
    run(b)  # read from disk; takes a's GPU slot
    assert (list(lora.gpu), list(lora.cpu), lora.loads, lora.activations) == ([2], [1, 2], 2, 2)
    d = run(a)  # still in the CPU cache: only copied back in
    assert (list(lora.gpu), list(lora.cpu), lora.loads, lora.activations) == ([1], [2, 1], 2, 3)
    assert COSTS.activate_s < d < COSTS.load_s
    run(c)  # the CPU cache is full: its least recently used adapter (b) goes
    assert (list(lora.gpu), list(lora.cpu), lora.loads) == ([3], [1, 3], 3)


def test_default_costs_are_an_8b_rank16_adapter_on_an_h100() -> None:
    assert LLAMA_8B_ADAPTER_BYTES == 83_886_080  # 32 layers x 1,310,720 rank-16 parameters x 2 bytes
    assert 0.03 < COSTS.load_s < 0.1
    assert COSTS.activate_s < 0.01 and COSTS.step_s < 1e-4
    assert (PROFILE.lora_load_s, PROFILE.lora_activate_s, PROFILE.lora_step_overhead_s) == (
        COSTS.load_s, COSTS.activate_s, COSTS.step_s)
    big = PROFILES["h100-70b"]
    assert big.lora_load_s > PROFILE.lora_load_s  # a 70B adapter is five times larger


def test_batched_advance_is_identical_to_single_steps_with_adapters() -> None:
    def scenario(use_advance: bool) -> tuple[object, ...]:
        adapters = _adapters("a", "b", "c")
        core = _core(max_loras=2, max_cpu_loras=2, kv_cache_tokens=16 * 400, max_num_seqs=12,
                     max_num_batched_tokens=1024)
        # Waves of requests for one adapter after another (and some for the base model).
        reqs = [_req(adapters[(i // 8) % 3] if i % 5 else None, prompt=prompt_of(30 + (i * 37) % 300, i),
                     max_output=5 + (i * 53) % 60, priority=i % 3, arrival=0.02 * i, seed=i) for i in range(80)]
        pending = list(reqs)
        deferred = 0
        while pending or core.has_work():
            while pending and (pending[0].arrival <= core.now or not core.has_work()):
                core.add_request(pending.pop(0))
            deferred += len(core.lora.deferred) if core.lora else 0
            if use_advance:
                core.advance(until=pending[0].arrival if pending else float("inf"))
            else:
                core.step()
        lora = core.lora
        assert lora is not None
        return (core.now, core.steps, core.busy_seconds, [(r.output, r.first_token_at, r.finished_at) for r in reqs],
                lora.loads, lora.activations, list(lora.gpu), list(lora.cpu), lora.info, core.stats.preemptions,
                None if use_advance else deferred)

    stepped = scenario(False)
    assert stepped[:-1] == scenario(True)[:-1]
    assert isinstance(stepped[4], int) and stepped[4] > 3  # adapters were evicted and read again
    assert stepped[-1]  # and requests were skipped for the adapter limit


# --- prefix caching and KV events ---------------------------------------------------------------------


def test_kv_block_hashes_differ_per_adapter() -> None:
    a, b = _adapters("a", "b")
    prompt = prompt_of(64, 3)
    hashes = [_req(x, prompt=prompt).full_block_hashes(4, 16) for x in (None, a, b)]
    assert len({h for hs in hashes for h in hs}) == 12  # no block is shared between the three
    assert _req(a, prompt=prompt).full_block_hashes(4, 16) == hashes[1]
    moved = LoraAdapter("a", a.int_id, "/elsewhere/a", "m")  # vLLM hashes the path too
    assert _req(moved, prompt=prompt).full_block_hashes(1, 16) != hashes[1][:1]


def test_prefix_cache_is_not_shared_between_adapters() -> None:
    a, b = _adapters("a", "b")
    core = _core(max_loras=2)
    prompt = prompt_of(200, 4)
    for adapter, cached in ((a, 0), (b, 0), (None, 0), (a, 192)):
        req = _req(adapter, prompt=prompt, max_output=1, arrival=core.now)
        core.add_request(req)
        core.step()
        assert req.num_cached_tokens == cached, adapter


def test_kv_events_carry_the_adapter() -> None:
    (a,) = _adapters("a")
    core = _core()
    batches: list[list[Any]] = []
    core.enable_kv_events(batches.append)
    req = _req(a, prompt=prompt_of(40, 9), max_output=1)
    req.cache_salt = "s"
    core.add_request(req)
    core.step()
    stored = [e for batch in batches for e in batch if isinstance(e, BlockStored)]
    assert len(stored) == 1
    event = stored[0]
    assert (event.lora_id, event.lora_name) == (a.int_id, "a")
    assert event.extra_keys == [("a", "s"), ("a",)]  # vLLM's event keys: name in each block, salt in the first


# --- the registry and its configuration ---------------------------------------------------------------


def test_registry_answers_as_vllm() -> None:
    registry = LoraRegistry("m", [LoraModule("x", "/a/x"), LoraModule("y", "hub/y")])
    assert [(a.name, a.int_id, a.parent) for a in registry.adapters.values()] == [("x", 1, "m"), ("y", 2, "m")]
    with pytest.raises(LoraRequestError, match="has already been loaded") as info:
        registry.load("x", "/a/x2")
    assert info.value.status == 400 and info.value.err_type == "InvalidUserInput"
    assert registry.load("x", "/a/x2", load_inplace=True).int_id == 1  # in place: same id
    with pytest.raises(LoraRequestError, match="conflicts with a served base model"):
        registry.load("m", "/p")
    with pytest.raises(LoraRequestError, match="Both 'lora_name' and 'lora_path' must be provided"):
        registry.load("z", "")
    with pytest.raises(LoraRequestError, match="cannot be found") as missing:
        registry.unload("nope")
    assert missing.value.status == 404 and missing.value.err_type == "NotFoundError"
    registry.unload("y")
    registry.spend_id()  # an unknown model looked up through the resolvers
    assert registry.load("y", "hub/y").int_id == 4  # ids are never reused


def test_lora_flags_are_read_and_checked_as_vllm_does() -> None:
    assert parse_lora_modules(["a=/p/a", "", '{"name": "b", "path": "/p/b", "base_model_name": "m"}']) == (
        LoraModule("a", "/p/a"), LoraModule("b", "/p/b", "m"))
    with pytest.raises(ValueError, match="Invalid JSON format for --lora-modules"):
        parse_lora_modules(["{oops"])
    with pytest.raises(ValueError, match="Invalid fields for --lora-modules"):
        parse_lora_modules(['{"name": "b"}'])
    cfg = resolve(EngineConfig(served_model="m", port=1, enable_lora=True, max_loras=2,
                               lora_modules=(LoraModule("a", "/p/a"),), allow_runtime_lora=False))
    assert cfg.lora == LoraSettings(2, 2, (LoraModule("a", "/p/a"),)) and not cfg.allow_runtime_lora
    assert "lora 1 adapters (max_loras 2)" in cfg.describe()
    for bad, message in (
        ({"max_loras": 2, "max_cpu_loras": 1}, r"max_cpu_loras \(1\) must be >= max_loras \(2\)"),
        ({"lora_modules": (LoraModule("m", "/p"),)}, "conflicts with a served base model"),
        ({"lora_modules": (LoraModule("a", "/p"), LoraModule("a", "/q"))}, "already been loaded"),
    ):
        with pytest.raises(ValueError, match=message):
            resolve(EngineConfig(served_model="m", port=1, enable_lora=True, **bad))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs --enable-lora"):
        resolve(EngineConfig(served_model="m", port=1, lora_modules=(LoraModule("a", "/p"),)))
    plain = resolve(EngineConfig(served_model="m", port=1, allow_runtime_lora=False))
    assert plain.lora is None and "lora" not in plain.describe()
    assert runtime_updating_from_env({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": " True "})
    assert not runtime_updating_from_env({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "yes"})
    assert not runtime_updating_from_env({})


def test_profile_files_load_with_and_without_lora_costs(tmp_path: Any) -> None:
    shipped = PROFILES["h100-8b"]
    doc = {"format": "switchyard.sim.profile/1", "name": "p", "model": "x", "hardware": "h",
           "limits": {"block_size": 16, "kv_cache_tokens": 1024, "max_model_len": 512, "max_num_seqs": 8,
                      "max_num_batched_tokens": 256, "vocab_size": 1000},
           "step_time": shipped.step_time.as_dict(), "frontend_overhead_s": 0.001}
    old = profile_from_dict(doc)
    assert (old.lora_load_s, old.lora_step_overhead_s) == (COSTS.load_s, COSTS.step_s)
    assert "lora" not in profile_to_dict(old)
    path = tmp_path / "p.json"
    path.write_text(msgspec.json.encode({**doc, "lora": {"load_s": 0.5, "step_s": 0.001}}).decode())
    loaded = load_profile_file(path)
    assert (loaded.lora_load_s, loaded.lora_activate_s, loaded.lora_step_overhead_s) == (0.5, COSTS.activate_s, 0.001)
    assert profile_to_dict(loaded)["lora"]["load_s"] == 0.5


def test_a_policy_pool_with_adapters_gets_lora_engines() -> None:
    doc = base()
    doc["pools"][0]["max_loras"] = 2
    doc["pools"][1]["runtime_lora_loading"] = True
    doc["models"] += [
        {"name": "small-sql", "adapter_of": "small-us", "adapter": "sql", "adapter_path": "/lora/sql",
         "context_window": 8192, "price": {"input_per_mtok": 0.1, "output_per_mtok": 0.2}},
        {"name": "small-chat", "adapter_of": "small-us", "context_window": 8192,
         "price": {"input_per_mtok": 0.1, "output_per_mtok": 0.2}},
        {"name": "eu-sql", "adapter_of": "small-eu", "adapter": "sql", "adapter_path": "/lora/sql",
         "context_window": 8192, "price": {"input_per_mtok": 0.1, "output_per_mtok": 0.2}},
    ]
    snapshot = compile_policy(to_yaml(doc))

    def engine(pool_name: str) -> EngineConfig:
        pool = snapshot.pools[pool_name]
        adapters = [(m.served_name, m.adapter_path) for m in snapshot.models.values()
                    if m.adapter_of == pool.name and m.served_name is not None]
        config = EngineConfig(served_model=pool.served_model, port=0, pool=pool.name)
        return with_pool_adapters(config, adapters, max_loras=pool.max_loras,
                                  runtime_loading=pool.runtime_lora_loading)

    static = resolve(engine("small-us"))
    assert static.lora == LoraSettings(2, 2, (LoraModule("sql", "/lora/sql"), LoraModule("small-chat",
                                                                                         "small-chat")))
    assert not static.allow_runtime_lora
    runtime = resolve(engine("small-eu"))
    assert runtime.lora == LoraSettings(1, 1, ()) and runtime.allow_runtime_lora
    untouched = EngineConfig(served_model="llama-70b", port=0, pool="large-us")
    assert engine("large-us") == untouched  # no adapters, no max_loras: nothing changes


# --- the HTTP surface ---------------------------------------------------------------------------------


def _config(**lora: Any) -> EngineConfig:
    return EngineConfig(served_model="m", port=1, time_scale=1000, seed=1, **lora)


@pytest.fixture
async def client() -> AsyncIterator[AsyncTestClient]:  # type: ignore[type-arg]
    app = create_engine_app(_config(enable_lora=True, max_loras=2, max_cpu_loras=3, allow_runtime_lora=True,
                                    lora_modules=(LoraModule("sql", "/lora/sql"),)))
    async with AsyncTestClient(app=app) as c:
        yield c


async def test_requests_naming_an_adapter_are_served_with_it(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        done = await client.post(path, json={**body, "model": "sql", "max_tokens": 3})
        assert done.status_code == 200 and done.json()["model"] == "sql"
        streamed = await client.post(path, json={**body, "model": "sql", "max_tokens": 3, "stream": True})
        chunks = [msgspec.json.decode(line.removeprefix("data: ")) for line in streamed.text.split("\n\n")
                  if line and line != "data: [DONE]"]
        assert chunks and all(c["model"] == "sql" for c in chunks)
        base_model = await client.post(path, json={**body, "model": "m", "max_tokens": 1})
        assert base_model.json()["model"] == "m"
    unknown = await client.post("/v1/completions", json={"prompt": "hi", "model": "nope"})
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {"message": "The model `nope` does not exist. Valid aliases: m.",
                                       "type": "NotFoundError", "param": "model", "code": 404}
    state = (await client.get("/sim/state")).json()["lora"]
    assert state["gpu"] == ["sql"] and state["cpu"] == ["sql"] and state["loads"] == 1
    assert state["registered"] == [{"name": "sql", "id": 1, "path": "/lora/sql"}]


async def test_models_lists_adapters_under_their_base(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    data = (await client.get("/v1/models")).json()["data"]
    assert [(c["id"], c["root"], c["parent"], c["max_model_len"]) for c in data] == [
        ("m", PROFILE.model, None, 8192), ("sql", "/lora/sql", "m", None)]
    assert data[1]["object"] == "model" and data[1]["owned_by"] == "vllm"
    assert data[1]["permission"][0]["object"] == "model_permission"


async def test_load_and_unload_answer_as_vllm(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    loaded = await client.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/lora/chat"})
    assert loaded.status_code == 200
    assert loaded.text == "Success: LoRA adapter 'chat' added successfully."
    assert "content-type" not in loaded.headers
    assert [c["id"] for c in (await client.get("/v1/models")).json()["data"]] == ["m", "sql", "chat"]
    state = (await client.get("/sim/state")).json()["lora"]
    assert state["registered"][1] == {"name": "chat", "id": 2, "path": "/lora/chat"}
    assert state["cpu"] == ["sql", "chat"] and state["gpu"] == ["sql", "chat"]  # add_lora preloads it
    served = await client.post("/v1/completions", json={"prompt": "hi", "model": "chat", "max_tokens": 1})
    assert served.json()["model"] == "chat"

    async def error(path: str, body: Any, **kwargs: Any) -> tuple[int, dict[str, Any]]:
        resp = await client.post(path, json=body, **kwargs)
        return resp.status_code, resp.json()["error"]

    assert await error("/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": "/x"}) == (400, {
        "message": "The lora adapter 'chat' has already been loaded. If you want to load the adapter in place, "
                   "set 'load_inplace' to True.", "type": "InvalidUserInput", "param": None, "code": 400})
    assert await error("/v1/load_lora_adapter", {"lora_name": "m", "lora_path": "/x"}) == (400, {
        "message": "The lora adapter 'm' conflicts with a served base model.", "type": "InvalidUserInput",
        "param": None, "code": 400})
    assert await error("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "/x"}) == (400, {
        "message": "Both 'lora_name' and 'lora_path' must be provided.", "type": "InvalidUserInput",
        "param": None, "code": 400})
    status, missing = await error("/v1/load_lora_adapter", {"lora_name": "x"})
    assert (status, missing["type"], missing["param"]) == (400, "Bad Request", "body.lora_path")
    assert missing["message"] == ("1 validation error:\n  {'type': 'missing', 'loc': 'body.lora_path', "
                                  "'msg': 'Field required', 'input': '<dict of 1 items>'}")
    text = await client.post("/v1/load_lora_adapter", content=b'{"lora_name": "x", "lora_path": "/y"}',
                             headers={"content-type": "text/plain"})
    assert text.status_code == 400 and text.json()["error"]["message"] == (
        "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed")
    assert await error("/v1/unload_lora_adapter", {"lora_name": "nope"}) == (404, {
        "message": "The lora adapter 'nope' cannot be found.", "type": "NotFoundError", "param": None, "code": 404})

    unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'chat' removed successfully.")
    gone = await client.post("/v1/completions", json={"prompt": "hi", "model": "chat"})
    assert gone.status_code == 404
    state = (await client.get("/sim/state")).json()["lora"]
    assert [a["name"] for a in state["registered"]] == ["sql"] and "chat" in state["cpu"]  # weights stay cached
    again = await client.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/lora/chat"})
    assert again.status_code == 200
    state = (await client.get("/sim/state")).json()["lora"]
    assert state["registered"][1]["id"] == 4  # 3 went to the request for the unknown model "chat"
    assert (await client.get("/v1/load_lora_adapter")).json() == {"detail": "Method Not Allowed"}


async def test_without_runtime_updating_the_endpoints_do_not_exist() -> None:
    app = create_engine_app(_config(enable_lora=True, allow_runtime_lora=False))
    async with AsyncTestClient(app=app) as c:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            resp = await c.post(path, json={"lora_name": "a", "lora_path": "/a"})
            assert (resp.status_code, resp.json()) == (404, {"detail": "Not Found"})
        assert (await c.get("/sim/state")).json()["lora"]["registered"] == []


async def test_runtime_updating_without_enable_lora_fails_in_the_engine() -> None:
    app = create_engine_app(_config(allow_runtime_lora=True))
    async with AsyncTestClient(app=app) as c:
        resp = await c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
        assert resp.status_code == 500
        assert resp.json()["error"]["message"] == ("Call to add_lora method failed: LoRA is not enabled. "
                                                   "Use --enable-lora to enable LoRA.")


async def test_metrics_show_lora_requests_info(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    before = time.time()
    await client.post("/v1/completions", json={"prompt": "hi", "model": "sql", "max_tokens": 2})
    text = (await client.get("/metrics")).text
    lines = [line for line in text.splitlines() if "lora_requests_info" in line]
    assert lines[:2] == ["# HELP vllm:lora_requests_info Running stats on lora requests.",
                         "# TYPE vllm:lora_requests_info gauge"]
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines[2:]}
    assert list(samples) == [
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters="sql"}',
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}']
    assert all(before - 1 <= t <= time.time() for t in samples.values())  # Unix times, as vLLM sets them
    assert 'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"} 0.0' in text


async def test_no_lora_no_lora_metrics() -> None:
    app = create_engine_app(_config(allow_runtime_lora=False))
    async with AsyncTestClient(app=app) as c:
        await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert "lora" not in (await c.get("/metrics")).text
        state = (await c.get("/sim/state")).json()
        assert state["lora"] is None
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["m"]


def test_adapters_loaded_at_start_cost_no_serving_time() -> None:
    engine = LoraEngine(LoraSettings(2, 4, ()), DEFAULT_LORA_COSTS)
    for i in range(3):
        engine.preload(LoraAdapter(f"a{i}", i + 1, f"/a{i}", "base"))
    assert engine.loads == 3 and engine.load_seconds == 0.0


async def test_tokenize_detokenize_and_embeddings_accept_adapter_names(
        client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    """vLLM answers ``/tokenize``, ``/detokenize`` and ``/v1/embeddings`` for a registered adapter as for the
    base model (an adapter tokenizes alike); an unknown name is a 404 (the pooling server's own, for
    embeddings) and, with runtime updating, spends an adapter id (vLLM asks its LoRA resolvers)."""
    base = (await client.post("/tokenize", json={"model": "m", "prompt": "hi there"})).json()
    adapter = await client.post("/tokenize", json={"model": "sql", "prompt": "hi there"})
    assert adapter.status_code == 200 and adapter.json() == base
    text = await client.post("/detokenize", json={"model": "sql", "tokens": base["tokens"]})
    assert (text.status_code, text.json()) == (200, {"prompt": "<|begin_of_text|>hi there"})
    embedded = await client.post("/v1/embeddings", json={"model": "sql", "input": "hi there"})
    assert embedded.status_code == 200 and embedded.json()["model"] == "sql"
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
        unknown = await client.post(path, json={**body, "model": "nope"})
        assert (unknown.status_code, unknown.json()["error"]) == (404, {
            "message": "The model `nope` does not exist. Valid aliases: m.", "type": "NotFoundError",
            "param": "model", "code": 404})
    unknown = await client.post("/v1/embeddings", json={"model": "nope", "input": "hi"})
    assert (unknown.status_code, unknown.json()["error"]) == (404, {
        "message": "The model `nope` does not exist.", "type": "NotFoundError", "param": None, "code": 404})
    loaded = await client.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/lora/chat"})
    assert loaded.status_code == 200
    state = (await client.get("/sim/state")).json()["lora"]
    assert state["registered"][1] == {"name": "chat", "id": 5, "path": "/lora/chat"}  # 2-4: the three 404s


def _adapter_dir(root: Any, name: str = "adapter") -> Any:
    """A directory vLLM would load: a PEFT config and a weights file (whose content is not read)."""
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16}')
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path


def test_adapter_paths_on_this_machine_are_read_as_vllm_reads_them(tmp_path: Any) -> None:
    """A path that exists here, or would be in a directory that does, must hold an adapter; a made-up path
    in a directory this machine does not have, directly under the root, or a relative (Hugging Face) name
    is a simulated adapter."""
    for made_up in ("/adapters/support-v1", "/lora/sql", "/a", "hub/y", "support-v1"):
        check_adapter_path("x", made_up)
    check_adapter_path("x", str(_adapter_dir(tmp_path)))

    def refused(path: Any) -> tuple[int, str, str]:
        with pytest.raises(LoraRequestError) as info:
            check_adapter_path("bad", str(path))
        return info.value.status, info.value.err_type, info.value.message

    def worker(error: str) -> tuple[int, str, str]:
        return (500, "InternalServerError", f"Call to add_lora method failed: Worker failed with error '{error}', "
                                            "please check the stack trace above for the root cause")

    empty = tmp_path / "empty"
    empty.mkdir()
    for missing in (empty, tmp_path / "nowhere"):
        assert refused(missing) == (404, "NotFoundError", f"Loading lora bad failed: No adapter found for {missing}")
    file = tmp_path / "weights.bin"
    file.write_bytes(b"x")
    assert refused(file) == worker(f"[Errno 20] Not a directory: '{file}/adapter_config.json'")
    config_dir = tmp_path / "config-dir"
    (config_dir / "adapter_config.json").mkdir(parents=True)
    assert refused(config_dir) == worker(f"[Errno 21] Is a directory: '{config_dir}/adapter_config.json'")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{oops")
    assert refused(broken) == worker("Expecting property name enclosed in double quotes: line 1 column 2 (char 1)")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text('{"r": 8}')
    assert refused(no_weights) == worker(f"{no_weights} doesn't contain tensors")
    (no_weights / "adapter_model.bin").write_bytes(b"")
    check_adapter_path("ok", str(no_weights))


async def test_loading_a_path_without_an_adapter_registers_nothing(client: AsyncTestClient,  # type: ignore[type-arg]
                                                                   tmp_path: Any) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    file = tmp_path / "notes.txt"
    file.write_text("not an adapter")
    for path, status, message in (
        (empty, 404, f"Loading lora bad failed: No adapter found for {empty}"),
        (tmp_path / "nowhere", 404, f"Loading lora bad failed: No adapter found for {tmp_path / 'nowhere'}"),
        (file, 500, f"Call to add_lora method failed: Worker failed with error '[Errno 20] Not a directory: "
                    f"'{file}/adapter_config.json'', please check the stack trace above for the root cause"),
    ):
        resp = await client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(path)})
        assert resp.headers["content-type"] == "application/json"
        assert (resp.status_code, resp.json()) == (status, {"error": {
            "message": sanitize_message(message), "type": "NotFoundError" if status == 404 else "InternalServerError",
            "param": None, "code": status}})
    # In place over a registered adapter: refused the same way, and the old registration stays.
    resp = await client.post("/v1/load_lora_adapter",
                             json={"lora_name": "sql", "lora_path": str(empty), "load_inplace": True})
    assert resp.status_code == 404
    state = (await client.get("/sim/state")).json()["lora"]
    assert state["registered"] == [{"name": "sql", "id": 1, "path": "/lora/sql"}]
    assert state["cpu"] == ["sql"] and state["loads"] == 1
    assert [c["id"] for c in (await client.get("/v1/models")).json()["data"]] == ["m", "sql"]
    real = _adapter_dir(tmp_path, "real")
    loaded = await client.post("/v1/load_lora_adapter", json={"lora_name": "real", "lora_path": str(real)})
    assert loaded.status_code == 200
    # Each failed load of a new name spent an id, as in vLLM.
    assert (await client.get("/sim/state")).json()["lora"]["registered"][1] == {
        "name": "real", "id": 5, "path": str(real)}


def test_start_up_refuses_lora_modules_without_an_adapter(tmp_path: Any) -> None:
    """vLLM loads every ``--lora-modules`` entry before it serves and stops at the first it cannot load,
    with the load's (sanitized) message; made-up paths stay simulated adapters."""
    empty = tmp_path / "empty"
    empty.mkdir()
    modules = (LoraModule("a", "/adapters/a"), LoraModule("b", str(empty)))
    expected = sanitize_message(f"Loading lora b failed: No adapter found for {empty}")
    with pytest.raises(ValueError, match="No adapter found") as info:
        resolve(EngineConfig(served_model="m", port=1, enable_lora=True, lora_modules=modules))
    assert str(info.value) == f"sim: --lora-modules: {expected}"
    real = _adapter_dir(tmp_path)
    cfg = resolve(EngineConfig(served_model="m", port=1, enable_lora=True,
                               lora_modules=(LoraModule("a", "/adapters/a"), LoraModule("b", str(real)))))
    assert cfg.lora is not None and [m.name for m in cfg.lora.modules] == ["a", "b"]
