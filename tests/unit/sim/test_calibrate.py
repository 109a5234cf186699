"""Calibration without an engine: the fit on synthetic measurements, the profile file format,
measured profiles in the engine core, the measurement plan and the replayed workload."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from switchyard.cli.run_cmds import engines_for_policy
from switchyard.figures import percentile
from switchyard.policy import compile_policy
from switchyard.sim.calibrate.client import StreamResult, metric_total
from switchyard.sim.calibrate.fit import (
    DecodeSample,
    PrefillSample,
    StepFit,
    busy_frontend,
    busy_ttft,
    fit_step_time,
    nnls,
)
from switchyard.sim.calibrate.probe import decode_run, make_plan
from switchyard.sim.calibrate.replay import CAPACITY_SHARE, make_workload, within_capacity
from switchyard.sim.config import EngineConfig, resolve
from switchyard.sim.core import EngineCore
from switchyard.sim.measured import (
    MeasuredProfile,
    ProfileFileError,
    StepTimeModel,
    load_profile_file,
    profile_to_dict,
    save_profile_file,
)
from switchyard.sim.profiles import PROFILES, get_profile, shipped_profile_names
from tests.unit.policy.base import base, to_yaml
from tests.unit.sim.conftest import make_request, prompt_of, run_until_done

#: A CPU-like engine: every step pays a fixed and a per-sequence cost, compute grows with tokens
#: and attention; there is no bandwidth-bound floor.
CPU_LIKE = StepTimeModel(step_s=0.004, per_seq_s=0.0003, per_token_s=4e-5, per_attn_pair_s=2e-8,
                         weights_s=0.0, per_kv_token_s=0.0)
H100_8B = PROFILES["h100-8b"].step_time


def _samples(model: StepTimeModel, frontend: float, noise: float = 0.0,
             seed: int = 1) -> tuple[list[PrefillSample], list[DecodeSample]]:
    rng = random.Random(seed)

    def jitter(v: float) -> float:
        return v * (1 + rng.gauss(0, noise))

    prefill = [PrefillSample(n, 0, jitter(frontend + model.seconds(n, 1, n, n * (n + 1) // 2)))
               for n in (16, 32, 64, 128, 256, 512, 1024, 1536, 2048) for _ in range(2)]
    decode = []
    for batch in (1, 2, 4, 8, 16, 32, 64):
        for prompt in (16, 512):
            kv = batch * (prompt + 24)
            decode.append(DecodeSample(batch, kv, jitter(model.seconds(batch, batch, kv, kv))))
    return prefill, decode


@pytest.mark.parametrize("model", [H100_8B, CPU_LIKE], ids=["roofline-h100-8b", "cpu-like"])
def test_fit_recovers_known_coefficients_exactly(model: StepTimeModel) -> None:
    prefill, decode = _samples(model, frontend=0.006)
    fit = fit_step_time(prefill, decode)
    for name, true in model.as_dict().items():
        assert getattr(fit.step_time, name) == pytest.approx(true, rel=1e-4, abs=1e-12), name
    assert fit.frontend_overhead_s == pytest.approx(0.006, rel=1e-4)
    assert fit.prefill.r2 > 0.9999 and fit.decode.max_rel_error < 1e-6


def test_fit_finds_the_roofline_regimes() -> None:
    fit = fit_step_time(*_samples(H100_8B, frontend=0.006))
    # Decode on an H100 is bandwidth-bound; short prompts too, long ones compute-bound.
    assert fit.memory_bound_decode == fit.decode.samples
    assert 0 < fit.memory_bound_prefill < fit.prefill.samples
    cpu = fit_step_time(*_samples(CPU_LIKE, frontend=0.01))
    assert cpu.memory_bound_decode == cpu.memory_bound_prefill == 0


@pytest.mark.parametrize("model", [H100_8B, CPU_LIKE], ids=["roofline-h100-8b", "cpu-like"])
def test_fit_with_noise_predicts_within_a_few_percent(model: StepTimeModel) -> None:
    prefill, decode = _samples(model, frontend=0.006, noise=0.02, seed=7)
    fit = fit_step_time(prefill, decode)
    for n in (16, 200, 1000, 2000):
        true = 0.006 + model.seconds(n, 1, n, n * (n + 1) // 2)
        assert fit.predict_ttft(n) == pytest.approx(true, rel=0.05), n
    for batch, kv in ((1, 40), (8, 4000), (64, 30000)):
        assert fit.predict_itl(batch, kv) == pytest.approx(model.seconds(batch, batch, kv, kv),
                                                           rel=0.05)
    # The well-identified combinations, not only the predictions.
    assert fit.step_time.per_token_s == pytest.approx(model.per_token_s, rel=0.15)
    assert (fit.step_time.step_s + fit.step_time.weights_s
            == pytest.approx(model.step_s + model.weights_s, rel=0.1))


def test_fit_needs_two_prompt_lengths_and_a_decode_sample() -> None:
    with pytest.raises(ValueError, match="two prompt lengths"):
        fit_step_time([PrefillSample(16, 0, 0.01)], [DecodeSample(1, 20, 0.005)])
    with pytest.raises(ValueError, match="decode"):
        fit_step_time([PrefillSample(16, 0, 0.01), PrefillSample(32, 0, 0.011)], [])
    with pytest.raises(ValueError, match="positive"):
        fit_step_time([PrefillSample(16, 0, 0.01), PrefillSample(32, 0, 0.0)],
                      [DecodeSample(1, 20, 0.005)])


def test_nnls_is_exact_when_it_can_be_and_never_negative() -> None:
    rows = [[1, x, x * x] for x in range(1, 8)]
    assert nnls(rows, [2 + 3 * x + 0.5 * x * x for x in range(1, 8)]) == pytest.approx([2, 3, 0.5])
    # The unconstrained optimum has a negative slope: the constrained one pins it at zero.
    x = nnls([[1, v] for v in range(1, 6)], [5.0, 4.0, 3.0, 2.0, 1.0])
    assert x[1] == 0 and x[0] == pytest.approx(3.0)


def test_busy_probes_split_the_frontend_overhead() -> None:
    probes = [(b, kv, 64, busy_ttft(CPU_LIKE, 0.004, b, kv, 64)) for b, kv in ((1, 40), (4, 300))]
    assert busy_frontend(CPU_LIKE, probes) == pytest.approx(0.004)
    assert busy_frontend(CPU_LIKE, []) is None


def _stream(prompt_len: int, sent: float, times: list[float]) -> StreamResult:
    return StreamResult(prompt_len=prompt_len, sent_at=sent, chunks=[(t, 1) for t in times],
                        prompt_tokens=prompt_len, completion_tokens=len(times))


def test_decode_run_from_requests_in_lockstep() -> None:
    step = 0.005
    runs = [_stream(16, 0.0, [0.02 + step * i for i in range(40)]) for _ in range(4)]
    run = decode_run(runs)
    assert run.concurrency == 4 and not run.bursty and run.sample is not None
    assert run.sample.batch == 4 and run.sample.itl_s == pytest.approx(step)
    assert run.sample.kv_tokens == pytest.approx(4 * (16 + 20), abs=4)  # context at mid-window


def test_decode_run_sees_max_num_seqs() -> None:
    # Four requests sent together, two run at a time: the second pair starts when the first ends.
    first = [_stream(16, 0.0, [0.01 + 0.005 * i for i in range(20)]) for _ in range(2)]
    second = [_stream(16, 0.0, [0.2 + 0.005 * i for i in range(20)]) for _ in range(2)]
    run = decode_run(first + second)
    assert run.concurrency == 2 and run.sample is not None and run.sample.batch == 2


def test_decode_run_flags_streams_that_arrived_in_bursts() -> None:
    # A stall, then everything at once: not a measurement of the engine.
    times = [0.01 + 0.005 * i for i in range(10)] + [0.5 + 1e-5 * i for i in range(30)]
    assert decode_run([_stream(16, 0.0, times)]).bursty
    # The whole stream unread until the end.
    assert decode_run([_stream(16, 0.0, [1.0 + 1e-5 * i for i in range(40)])]).bursty
    # Chunks that carry several tokens (the server catching up) are not bursts.
    merged = StreamResult(prompt_len=16, sent_at=0.0, completion_tokens=40,
                          chunks=[(0.01 + 0.01 * i, 2) for i in range(20)])
    run = decode_run([merged])
    assert not run.bursty and run.sample is not None
    assert run.sample.itl_s == pytest.approx(0.19 / 39)


def test_stream_itls_spread_a_chunk_over_its_tokens() -> None:
    r = StreamResult(prompt_len=4, sent_at=0.0, chunks=[(0.1, 1), (0.11, 1), (0.13, 2)])
    assert r.ttft == pytest.approx(0.1)
    assert r.itls() == pytest.approx([0.01, 0.01, 0.01])
    assert r.token_times() == [0.1, 0.11, 0.13, 0.13]


def test_metric_total_reads_counters() -> None:
    text = ('# HELP vllm:prefix_cache_hits_total x\nvllm:prefix_cache_hits_total{engine="0",'
            'model_name="m"} 384.0\nvllm:prefix_cache_hits_created{engine="0"} 1.7e9\n')
    assert metric_total(text, "vllm:prefix_cache_hits") == 384.0
    assert metric_total(text, "vllm:nothing") is None


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile(list(map(float, range(101))), 90) == 90.0


@pytest.mark.parametrize(("max_model_len", "block_size", "quick"),
                         [(512, 128, True), (512, 128, False), (8192, 16, True), (128, 16, True)])
def test_plan_fits_the_engine(max_model_len: int, block_size: int, quick: bool) -> None:
    plan = make_plan(max_model_len, block_size, budget=2048, quick=quick)
    assert max(plan.prefill_lengths) <= min(max_model_len - 2, 2048)
    assert len(plan.prefill_lengths) >= 5 and min(plan.prefill_lengths) == 16
    assert all(b * block_size + plan.prefix_suffix <= min(max_model_len, 2048)
               for b in plan.prefix_blocks)
    assert plan.long_prompt + plan.decode_output < max_model_len
    with pytest.raises(ValueError, match="too small"):
        make_plan(32, 16, 2048, quick)


def _fit(model: StepTimeModel = CPU_LIKE) -> StepFit:
    return fit_step_time(*_samples(model, frontend=0.01))


def test_workload_is_fixed_by_its_seed_and_fits_the_limits() -> None:
    kwargs = {"requests": 30, "max_model_len": 512, "block_size": 128, "max_num_seqs": 8,
              "vocab_size": 1536, "seed": 3}
    a, b = make_workload(_fit(), **kwargs), make_workload(_fit(), **kwargs)  # type: ignore[arg-type]
    assert a == b
    assert all(len(r.prompt) + r.max_tokens < 512 for r in a.requests)
    assert all(0 <= t < 1536 for r in a.requests for t in r.prompt)
    assert a.shared_prefix_tokens % 128 == 0
    shared = [r for r in a.requests if r.shared_prefix]
    assert shared and all(r.prompt[:128] in ([s.prompt[:128] for s in shared]) for r in shared)
    arrivals = [r.at for r in a.requests]
    assert arrivals == sorted(arrivals) and a.rate > 0
    assert "30 requests" in a.describe()


def test_the_replay_stays_under_a_share_of_what_the_engine_completed() -> None:
    fast = make_workload(_fit(), requests=30, max_model_len=512, block_size=128, max_num_seqs=8,
                         vocab_size=1536, seed=3)
    # An engine slower than its fit (its API server and the client share two cores): the rate comes down,
    # the same requests arrive in the same order, every gap stretched by the same factor.
    capacity = fast.rate  # requests/s the pilot completed
    slow = within_capacity(fast, capacity, 8)
    assert slow.rate == pytest.approx(CAPACITY_SHARE * capacity)
    assert [(r.prompt, r.max_tokens) for r in slow.requests] == [(r.prompt, r.max_tokens) for r in fast.requests]
    factor = fast.rate / slow.rate
    assert [r.at for r in slow.requests] == pytest.approx([r.at * factor for r in fast.requests])
    assert f"40% of the {capacity:.2f}/s the engine completed with 8 in flight" in slow.describe()
    # An engine with room to spare keeps the rate its fit gave.
    roomy = within_capacity(fast, 10 * fast.rate, 8)
    assert roomy.rate == fast.rate and [r.at for r in roomy.requests] == [r.at for r in fast.requests]


# --- the profile file --------------------------------------------------------------------------

def _measured(**overrides: object) -> MeasuredProfile:
    fields: dict[str, object] = {
        "name": "cpu-test", "model": "tiny-llama", "hardware": "a test", "step_time": CPU_LIKE,
        "frontend_overhead_s": 0.008, "vocab_size": 1536, "kv_cache_tokens": 524288,
        "max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 2048,
        "block_size": 128, "idle_wakeup_s": 0.002,
        "provenance": {"method": "test", "sources": {"step_s": "made up"}}}
    fields.update(overrides)
    return MeasuredProfile(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_profile_file_round_trip(tmp_path: Path, suffix: str) -> None:
    profile = _measured()
    path = tmp_path / f"p{suffix}"
    save_profile_file(profile, path)
    loaded = load_profile_file(path)
    assert loaded == profile
    assert loaded.provenance == profile.provenance
    # get_profile takes a path like a name, and the engine configuration resolves it.
    assert get_profile(str(path)) == profile
    resolved = resolve(EngineConfig(served_model="tiny-llama", port=0, profile=str(path)))
    assert resolved.profile == profile
    assert (resolved.max_model_len, resolved.max_num_seqs, resolved.kv_cache_tokens,
            resolved.max_num_batched_tokens) == (512, 8, 524288, 2048)


def _write(tmp_path: Path, doc: object, name: str = "bad.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def _doc(**changes: object) -> dict[str, object]:
    doc = profile_to_dict(_measured())
    doc.update(changes)
    return doc


@pytest.mark.parametrize(("doc", "message"), [
    (_doc(format="something/2"), r"format must be 'switchyard\.sim\.profile/1'"),
    ([1, 2], "expected a mapping"),
    ({k: v for k, v in _doc().items() if k != "step_time"}, "missing required field `step_time`"),
    (_doc(step_time={**CPU_LIKE.as_dict(), "per_seq_s": -1.0}),
     r"step_time\.per_seq_s: Expected `float` >= 0"),
    (_doc(step_time={**CPU_LIKE.as_dict(), "warp_s": 1.0}),
     r"step_time: Object contains unknown field `warp_s`"),
    (_doc(limits={**_doc()["limits"], "block_size": "big"}),  # type: ignore[dict-item]
     r"limits\.block_size: Expected `int`, got `str`"),
    (_doc(limits={**_doc()["limits"], "max_model_len": 10**7}),  # type: ignore[dict-item]
     r"max_model_len \(10000000\) is larger than limits\.kv_cache_tokens"),
    (_doc(frontend_overhead_s=float("inf")), "frontend_overhead_s must be a finite number"),
])
def test_bad_profile_files_say_what_is_wrong(tmp_path: Path, doc: object, message: str) -> None:
    path = _write(tmp_path, doc)
    with pytest.raises(ProfileFileError, match=message) as info:
        load_profile_file(path)
    assert str(path) in str(info.value)


def test_unreadable_profile_files(tmp_path: Path) -> None:
    with pytest.raises(ProfileFileError, match="does not exist"):
        load_profile_file(tmp_path / "nope.json")
    (tmp_path / "broken.json").write_text("{ nope")
    with pytest.raises(ProfileFileError, match=r"not valid JSON: .* \(line 1, column 3\)"):
        load_profile_file(tmp_path / "broken.json")
    (tmp_path / "broken.yaml").write_text("a: [1, 2\n")
    with pytest.raises(ProfileFileError, match="not valid YAML"):
        load_profile_file(tmp_path / "broken.yaml")
    with pytest.raises(ValueError, match=r"profile file .*missing\.json does not exist"):
        resolve(EngineConfig(served_model="m", port=0, profile=str(tmp_path / "missing.json")))


def test_yaml_profile_errors_name_the_line(tmp_path: Path) -> None:
    good = tmp_path / "p.yaml"
    save_profile_file(_measured(), good)
    text = good.read_text().replace("per_token_s: 4e-05", "per_token_s: fast")
    assert "fast" in text
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "per_token_s: fast" in ln)
    with pytest.raises(ProfileFileError, match=rf"step_time\.per_token_s: .*\(line {line}\)"):
        load_profile_file(bad)


def test_unknown_profile_names_list_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown profile 'a100'.*h100-8b.*cpu-tiny-llama"):
        get_profile("a100")


def test_shipped_calibrated_profile_loads_by_name() -> None:
    assert "cpu-tiny-llama" in shipped_profile_names()
    profile = get_profile("cpu-tiny-llama")
    assert isinstance(profile, MeasuredProfile)
    assert profile.block_size == 128 and profile.max_model_len == 512 and profile.max_num_seqs == 8
    prov = profile.provenance
    assert prov["served_model"] == "tiny-llama" and prov["engine_version"]
    assert {"step_s", "per_token_s", "frontend_overhead_s", "max_num_seqs",
            "block_size"} <= set(prov["sources"])
    assert prov["fit"]["prefill_ttft"]["samples"] > 0 and "comparison" in prov
    r = resolve(EngineConfig(served_model="tiny-llama", port=0, profile="cpu-tiny-llama"))
    assert r.max_model_len == 512


def test_roofline_profiles_have_an_equivalent_step_time_model() -> None:
    for p in PROFILES.values():
        m = p.step_time
        for args in ((1, 1, 500, 500), (64, 64, 32000, 32000), (4096, 1, 4096, 4096 * 4097 // 2)):
            assert m.seconds(*args) == pytest.approx(p.step_seconds(*args), rel=1e-12)


# --- measured profiles in the engine core -------------------------------------------------------

def _core(profile: MeasuredProfile) -> EngineCore:
    return EngineCore(profile, kv_cache_tokens=profile.kv_cache_tokens,
                      max_num_seqs=profile.max_num_seqs,
                      max_num_batched_tokens=profile.max_num_batched_tokens,
                      max_model_len=profile.max_model_len)


def test_engine_core_steps_at_the_measured_speed() -> None:
    profile = _measured()
    core = _core(profile)
    req = make_request(prompt_of(100), max_output=5)
    core.add_request(req)
    results = run_until_done(core, [req])
    prefill = CPU_LIKE.seconds(100, 1, 100, 100 * 101 // 2)
    assert results[0].duration == pytest.approx(prefill)
    # The first step of an idle engine starts after the frontend overhead and the wake-up.
    assert results[0].start == pytest.approx(profile.frontend_overhead_s + profile.idle_wakeup_s)
    assert req.first_token_at == pytest.approx(0.010 + prefill)
    assert results[1].duration == pytest.approx(CPU_LIKE.seconds(1, 1, 101, 101))
    # Without a wake-up term the step starts right after the frontend overhead.
    plain = _core(dataclasses.replace(profile, idle_wakeup_s=0.0))
    req2 = make_request(prompt_of(100, offset=1), max_output=1)
    plain.add_request(req2)
    assert run_until_done(plain, [req2])[0].start == pytest.approx(0.008)


# --- policy pools may name a profile file ---------------------------------------------------------

def test_policy_sim_profile_paths_are_relative_to_the_policy_file(tmp_path: Path) -> None:
    doc = base()
    doc["pools"][1]["sim_profile"] = "profiles/cpu.json"
    doc["pools"][2]["sim_profile"] = str(tmp_path / "abs.json")
    snapshot = compile_policy(to_yaml(doc), "p.yaml")
    configs = engines_for_policy(snapshot, base_dir=tmp_path / "policies")
    by_port = {c.port: c.profile for c in configs}
    assert by_port[9001] == "h100-8b"  # a name stays a name
    assert by_port[9003] == str(tmp_path / "policies" / "profiles" / "cpu.json")
    assert by_port[9004] == str(tmp_path / "abs.json")
