"""Hardware profiles: the numbers are sane and their derivations hold."""

from __future__ import annotations

import pytest

from switchyard.sim.config import EngineConfig, resolve
from switchyard.sim.profiles import PROFILES, HardwareProfile, get_profile, kv_bytes_per_token


def _tpot(p: HardwareProfile, context: int = 500) -> float:
    return p.step_seconds(1, 1, context, context)


def _ttft(p: HardwareProfile, prompt: int = 200) -> float:
    return p.frontend_overhead_s + p.step_seconds(prompt, 1, prompt, prompt * (prompt + 1) // 2)


def test_required_profiles_exist() -> None:
    assert {"h100-8b", "h100-70b"} <= set(PROFILES)
    with pytest.raises(ValueError, match=r"unknown profile 'nope'.*h100-8b"):
        get_profile("nope")


def test_llama_8b_on_h100_matches_published_figures() -> None:
    p = PROFILES["h100-8b"]
    assert p.kv_bytes_per_token == 128 * 1024  # 32 layers x 8 KV heads x 128 x K,V x bf16
    assert 16.0e9 < p.weight_bytes < 16.2e9
    assert 0.010 <= _ttft(p) <= 0.030
    assert 0.006 <= _tpot(p) <= 0.012
    # ~430k tokens of KV on one 80GB H100 at gpu_memory_utilization 0.9
    assert 380_000 < p.kv_cache_tokens < 470_000


def test_llama_70b_on_four_h100s() -> None:
    p = PROFILES["h100-70b"]
    assert p.gpus == 4
    assert p.kv_bytes_per_token == kv_bytes_per_token(80, 8, 128) == 320 * 1024
    assert 140e9 < p.weight_bytes < 142e9
    assert _tpot(PROFILES["h100-8b"]) < _tpot(p) < 0.025
    assert _ttft(PROFILES["h100-8b"]) < _ttft(p) < 0.05


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_is_consistent(name: str) -> None:
    p = PROFILES[name]
    assert p.max_model_len <= p.kv_cache_tokens
    assert p.kv_cache_tokens % p.block_size == 0
    assert p.max_num_batched_tokens >= 2048
    assert 0 < p.bandwidth_efficiency <= 1 and 0 < p.compute_efficiency <= 1
    # Prefill is compute-bound: a long prompt costs roughly in proportion to its length.
    t4k = p.step_seconds(4096, 1, 4096, 4096 * 4097 // 2)
    t8k = p.step_seconds(8192, 1, 8192, 8192 * 8193 // 2)
    assert 1.8 < t8k / t4k < 2.5
    # Decode is bandwidth-bound: batch 64 costs far less than 64 single decodes.
    assert p.step_seconds(64, 64, 64 * 500, 64 * 500) < 4 * _tpot(p)


def test_resolve_fills_defaults_and_rejects_bad_settings() -> None:
    r = resolve(EngineConfig(served_model="m", port=8000))
    assert r.kv_cache_tokens == PROFILES["h100-8b"].kv_cache_tokens
    assert "kv" in r.describe() and "max_model_len 8192" in r.describe()
    small = resolve(EngineConfig(served_model="m", port=8000, kv_cache_tokens=4000))
    assert small.max_model_len == 4000 - 4000 % 16  # the default shrinks to what fits
    with pytest.raises(ValueError, match="time_scale"):
        resolve(EngineConfig(served_model="m", port=8000, time_scale=0))
    with pytest.raises(ValueError, match="unknown profile"):
        resolve(EngineConfig(served_model="m", port=8000, profile="a100-1t"))
    with pytest.raises(ValueError, match="larger than the KV cache"):
        resolve(EngineConfig(served_model="m", port=8000, kv_cache_tokens=1000,
                             max_model_len=2000))
    with pytest.raises(ValueError, match="max_num_seqs"):
        resolve(EngineConfig(served_model="m", port=8000, max_num_seqs=0))
