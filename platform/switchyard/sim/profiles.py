"""Hardware profiles: what one simulated vLLM deployment costs per engine step.

Every number below is either a published figure (NVIDIA datasheet, the model's ``config.json``
on Hugging Face, vLLM's own defaults) or a stated efficiency assumption; derived numbers are
computed here from those, never typed in, so a reader can check the arithmetic.

The step-time model is a roofline: a step (one forward pass over every scheduled token) is
bound either by HBM traffic (all weights once, plus the KV cache every scheduled sequence
attends over) or by tensor-core FLOPs (two per parameter per token, plus attention over the
context), whichever is larger, plus a fixed per-step and per-sequence CPU/launch overhead.
Prefill chunks are FLOP-bound, so their cost is proportional to the *uncached* tokens
computed; decode batches are bandwidth-bound, so their cost grows with batch size and with
the context each decoding sequence reads.

Besides these built-ins, a profile can be *measured*: ``switchyard sim calibrate`` fits the
same step-time shape, in seconds, to a real engine and writes a profile file (``measured.py``).
Files shipped in ``calibrated/`` are known by name like the built-ins; ``get_profile`` also
takes a path to any profile file. The engine core reads any of them through ``EngineProfile``.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Protocol

from switchyard.sim.lora import DEFAULT_LORA_COSTS, LoraCosts, adapter_bytes, lora_costs
from switchyard.sim.measured import (
    PROFILE_SUFFIXES,
    StepTimeModel,
    load_profile_file,
)

# --- NVIDIA H100 SXM5 80GB (datasheet: nvidia.com/en-us/data-center/h100) -----------------
#: HBM3 bandwidth, bytes/s ("GPU memory bandwidth 3.35TB/s").
H100_SXM_HBM_BANDWIDTH = 3.35e12
#: Dense BF16 tensor-core throughput, FLOP/s (datasheet 1,979 TFLOPS is *with sparsity*).
H100_SXM_BF16_FLOPS = 989e12
#: Memory the CUDA runtime reports as total on an 80GB H100 (vLLM logs "79.11 GiB").
H100_MEMORY_BYTES = int(79.11 * 2**30)

# --- vLLM serving defaults (vllm/engine/arg_utils.py, get_batch_defaults) ------------------
#: ``--gpu-memory-utilization`` default: the fraction of GPU memory vLLM may use.
VLLM_GPU_MEMORY_UTILIZATION = 0.9
#: For devices with >= 70 GiB (H100) and the OpenAI API server usage context.
VLLM_H100_MAX_NUM_SEQS = 1024
VLLM_H100_MAX_NUM_BATCHED_TOKENS = 8192
#: vLLM's paged-attention block size (tokens per KV block) on CUDA.
VLLM_BLOCK_SIZE = 16

#: Memory vLLM cannot give to the KV cache besides the weights, per GPU: the activation peak
#: of a max_num_batched_tokens=8192 profiling run, CUDA graphs, NCCL buffers and non-torch
#: allocations. Assumption: 4 GiB per GPU (vLLM's start-up log typically shows 3-5 GiB).
RESERVED_BYTES_PER_GPU = 4 * 2**30

BF16_BYTES = 2


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int) -> int:
    """KV-cache bytes one token occupies across all GPUs (K and V, every layer, BF16)."""
    return 2 * layers * kv_heads * head_dim * BF16_BYTES


def attention_flops_per_pair(layers: int, heads: int, head_dim: int) -> int:
    """FLOPs for one query token attending to one context token (QK^T and PV, 2 FLOPs/MAC)."""
    return 2 * 2 * heads * head_dim * layers


def rank16_lora_costs(*, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                      gpus: int, hbm_bandwidth: float, bandwidth_efficiency: float) -> LoraCosts:
    """The costs of a rank-16 adapter on every linear layer of the model (see ``lora.lora_costs``)."""
    size = adapter_bytes(hidden=hidden, intermediate=intermediate, layers=layers, q_dim=heads * head_dim,
                         kv_dim=kv_heads * head_dim)
    return lora_costs(size, gpus=gpus, hbm_bytes_s=hbm_bandwidth * bandwidth_efficiency)


def derived_kv_cache_tokens(gpus: int, weight_bytes: int, kv_per_token: int) -> int:
    """KV capacity vLLM would report: usable memory minus weights and reserve, in whole blocks."""
    usable = gpus * (H100_MEMORY_BYTES * VLLM_GPU_MEMORY_UTILIZATION - RESERVED_BYTES_PER_GPU)
    tokens = int((usable - weight_bytes) // kv_per_token)
    return tokens - tokens % VLLM_BLOCK_SIZE


@dataclass(frozen=True)
class HardwareProfile:
    """One model on one GPU configuration: its cost parameters and vLLM defaults.

    Attributes:
        name: Profile name used on the command line (``--profile``).
        model: The Hugging Face model id the profile describes (reported as ``root``).
        hardware: Human-readable hardware description.
        gpus: GPUs in the tensor-parallel group.
        weight_bytes: Bytes of weights read once per step (all GPUs together).
        matmul_params: Parameters multiplied per token (total minus the input embedding).
        kv_bytes_per_token: KV-cache bytes per token (all GPUs together).
        attn_flops_per_pair: FLOPs per (query token, context token) pair.
        hbm_bandwidth: Aggregate HBM bandwidth, bytes/s.
        peak_flops: Aggregate dense BF16 FLOP/s.
        bandwidth_efficiency: Achieved fraction of HBM bandwidth in decode.
        compute_efficiency: Achieved fraction of peak FLOPs (model FLOPs utilisation).
        step_overhead_s: Fixed cost per step (scheduling, kernel launches, TP all-reduces).
        per_seq_overhead_s: CPU cost per scheduled sequence per step (inputs, sampling).
        frontend_overhead_s: API-server time before a request reaches the engine core
            (HTTP parsing, chat template, tokenisation, IPC); counted in TTFT, not in steps.
        idle_wakeup_s: Extra delay before the first step of an idle engine (0: none).
        vocab_size: Token ids accepted in a prompt are ``0 <= id < vocab_size``.
        kv_cache_tokens: Default KV-cache capacity in tokens.
        max_model_len: Default context window.
        max_num_seqs: Default maximum running sequences.
        max_num_batched_tokens: Per-step token budget (chunked prefill).
        block_size: Tokens per KV block.
        lora_load_s: Reading a LoRA adapter that is not in the CPU cache into a GPU slot (``lora.py``).
        lora_activate_s: Copying a CPU-cached adapter into a GPU slot.
        lora_step_overhead_s: Added to a step per distinct adapter in its batch.
    """

    name: str
    model: str
    hardware: str
    gpus: int
    weight_bytes: int
    matmul_params: int
    kv_bytes_per_token: int
    attn_flops_per_pair: int
    hbm_bandwidth: float
    peak_flops: float
    bandwidth_efficiency: float
    compute_efficiency: float
    step_overhead_s: float
    per_seq_overhead_s: float
    frontend_overhead_s: float
    vocab_size: int
    kv_cache_tokens: int
    max_model_len: int
    max_num_seqs: int = VLLM_H100_MAX_NUM_SEQS
    max_num_batched_tokens: int = VLLM_H100_MAX_NUM_BATCHED_TOKENS
    block_size: int = VLLM_BLOCK_SIZE
    idle_wakeup_s: float = 0.0
    lora_load_s: float = DEFAULT_LORA_COSTS.load_s
    lora_activate_s: float = DEFAULT_LORA_COSTS.activate_s
    lora_step_overhead_s: float = DEFAULT_LORA_COSTS.step_s

    def step_seconds(self, num_tokens: int, num_seqs: int, kv_read_tokens: int,
                     attn_pairs: int) -> float:
        """Simulated duration of one engine step.

        Args:
            num_tokens: Tokens computed this step (prefill chunks plus one per decode).
            num_seqs: Sequences scheduled this step.
            kv_read_tokens: Context tokens whose KV is read (each sequence's full context).
            attn_pairs: Sum over computed tokens of the context length each attends to.

        Returns:
            Seconds of simulated time; 0 for an empty step.
        """
        if num_tokens <= 0:
            return 0.0
        flops = 2.0 * self.matmul_params * num_tokens + self.attn_flops_per_pair * attn_pairs
        compute_s = flops / (self.peak_flops * self.compute_efficiency)
        traffic = self.weight_bytes + self.kv_bytes_per_token * kv_read_tokens
        memory_s = traffic / (self.hbm_bandwidth * self.bandwidth_efficiency)
        return self.step_overhead_s + self.per_seq_overhead_s * num_seqs + max(compute_s, memory_s)

    @property
    def step_time(self) -> StepTimeModel:
        """The same cost model with every term in seconds (what calibration measures)."""
        flops_s = self.peak_flops * self.compute_efficiency
        bytes_s = self.hbm_bandwidth * self.bandwidth_efficiency
        return StepTimeModel(
            step_s=self.step_overhead_s, per_seq_s=self.per_seq_overhead_s,
            per_token_s=2.0 * self.matmul_params / flops_s,
            per_attn_pair_s=self.attn_flops_per_pair / flops_s,
            weights_s=self.weight_bytes / bytes_s,
            per_kv_token_s=self.kv_bytes_per_token / bytes_s)


class EngineProfile(Protocol):
    """What the engine core and the server read from a profile, built-in or measured."""

    @property
    def name(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def hardware(self) -> str: ...
    @property
    def step_overhead_s(self) -> float: ...
    @property
    def frontend_overhead_s(self) -> float: ...
    @property
    def idle_wakeup_s(self) -> float: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def kv_cache_tokens(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def lora_load_s(self) -> float: ...
    @property
    def lora_activate_s(self) -> float: ...
    @property
    def lora_step_overhead_s(self) -> float: ...

    @property
    def step_time(self) -> StepTimeModel: ...

    def step_seconds(self, num_tokens: int, num_seqs: int, kv_read_tokens: int,
                     attn_pairs: int) -> float:
        """Simulated duration of one engine step (see ``HardwareProfile.step_seconds``)."""


def _llama31_8b() -> HardwareProfile:
    # meta-llama/Llama-3.1-8B-Instruct config.json: hidden_size 4096, num_hidden_layers 32,
    # num_attention_heads 32, num_key_value_heads 8, head_dim 128, vocab_size 128256,
    # max_position_embeddings 131072; 8,030,261,248 parameters (model card: 8.03B).
    # intermediate_size 14336 (the rank-16 LoRA adapter size below needs it).
    params = 8_030_261_248
    embedding = 128_256 * 4096  # the input embedding is a lookup, not a matmul
    weights = params * BF16_BYTES  # 16.06 GB; vLLM logs "Model loading took 14.99 GiB"
    kv = kv_bytes_per_token(layers=32, kv_heads=8, head_dim=128)  # 131,072 B = 128 KiB
    lora = rank16_lora_costs(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                             head_dim=128, gpus=1, hbm_bandwidth=H100_SXM_HBM_BANDWIDTH, bandwidth_efficiency=0.80)
    return HardwareProfile(
        name="h100-8b",
        model="meta-llama/Llama-3.1-8B-Instruct",
        hardware="1x H100 SXM5 80GB, BF16",
        gpus=1,
        weight_bytes=weights,
        matmul_params=params - embedding,
        kv_bytes_per_token=kv,
        attn_flops_per_pair=attention_flops_per_pair(layers=32, heads=32, head_dim=128),
        hbm_bandwidth=H100_SXM_HBM_BANDWIDTH,
        peak_flops=H100_SXM_BF16_FLOPS,
        # Assumption: decode GEMV/attention kernels reach ~80% of HBM peak on one GPU;
        # prefill GEMMs reach ~55% MFU. Gives ~6.4 ms/token at batch 1 (16.06 GB / 2.68 TB/s
        # + overhead), in line with the ~150 tokens/s vLLM reaches on one H100.
        bandwidth_efficiency=0.80,
        compute_efficiency=0.55,
        step_overhead_s=0.0004,  # CUDA-graph replay + scheduler; assumption
        per_seq_overhead_s=5e-6,  # per-sequence input prep and sampling; assumption
        frontend_overhead_s=0.006,  # HTTP + template + tokenise + IPC; assumption
        vocab_size=128_256,
        kv_cache_tokens=derived_kv_cache_tokens(1, weights, kv),  # ~430k tokens
        # vLLM would default to 131072 (max_position_embeddings); deployments of the small
        # model usually pass --max-model-len 8192, which is what this profile models.
        max_model_len=8192,
        lora_load_s=lora.load_s,
        lora_activate_s=lora.activate_s,
        lora_step_overhead_s=lora.step_s,
    )


def _qwen25_32b() -> HardwareProfile:
    # Qwen/Qwen2.5-32B-Instruct config.json: hidden_size 5120, num_hidden_layers 64,
    # num_attention_heads 40, num_key_value_heads 8, head_dim 128, vocab_size 152064,
    # max_position_embeddings 32768; 32,763,876,352 parameters (model card: 32.5B).
    # intermediate_size 27648.
    # 65.5 GB of BF16 weights do not leave room for a KV cache on one 80GB GPU: TP=2.
    params = 32_763_876_352
    embedding = 152_064 * 5120
    weights = params * BF16_BYTES
    kv = kv_bytes_per_token(layers=64, kv_heads=8, head_dim=128)  # 262,144 B = 256 KiB
    lora = rank16_lora_costs(hidden=5120, intermediate=27648, layers=64, heads=40, kv_heads=8,
                             head_dim=128, gpus=2, hbm_bandwidth=2 * H100_SXM_HBM_BANDWIDTH, bandwidth_efficiency=0.77)
    return HardwareProfile(
        name="h100-32b",
        model="Qwen/Qwen2.5-32B-Instruct",
        hardware="2x H100 SXM5 80GB, tensor parallel 2, BF16",
        gpus=2,
        weight_bytes=weights,
        matmul_params=params - embedding,
        kv_bytes_per_token=kv,
        attn_flops_per_pair=attention_flops_per_pair(layers=64, heads=40, head_dim=128),
        hbm_bandwidth=2 * H100_SXM_HBM_BANDWIDTH,
        peak_flops=2 * H100_SXM_BF16_FLOPS,
        # Assumption: TP=2 loses a little to all-reduce bubbles (NVLink 900 GB/s).
        bandwidth_efficiency=0.77,
        compute_efficiency=0.52,
        step_overhead_s=0.0009,  # 128 all-reduces/step (2 per layer) at a few us each
        per_seq_overhead_s=5e-6,
        frontend_overhead_s=0.006,
        vocab_size=152_064,
        kv_cache_tokens=derived_kv_cache_tokens(2, weights, kv),  # ~300k tokens
        max_model_len=16384,
        lora_load_s=lora.load_s,
        lora_activate_s=lora.activate_s,
        lora_step_overhead_s=lora.step_s,
    )


def _llama31_70b() -> HardwareProfile:
    # meta-llama/Llama-3.1-70B-Instruct config.json: hidden_size 8192, num_hidden_layers 80,
    # num_attention_heads 64, num_key_value_heads 8, head_dim 128, vocab_size 128256,
    # max_position_embeddings 131072; 70,553,706,496 parameters (model card: 70.6B).
    # intermediate_size 28672.
    params = 70_553_706_496
    embedding = 128_256 * 8192
    weights = params * BF16_BYTES  # 141.1 GB, 35.3 GB per GPU at TP=4
    kv = kv_bytes_per_token(layers=80, kv_heads=8, head_dim=128)  # 327,680 B = 320 KiB
    lora = rank16_lora_costs(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8,
                             head_dim=128, gpus=4, hbm_bandwidth=4 * H100_SXM_HBM_BANDWIDTH, bandwidth_efficiency=0.75)
    return HardwareProfile(
        name="h100-70b",
        model="meta-llama/Llama-3.1-70B-Instruct",
        hardware="4x H100 SXM5 80GB, tensor parallel 4, BF16",
        gpus=4,
        weight_bytes=weights,
        matmul_params=params - embedding,
        kv_bytes_per_token=kv,
        attn_flops_per_pair=attention_flops_per_pair(layers=80, heads=64, head_dim=128),
        hbm_bandwidth=4 * H100_SXM_HBM_BANDWIDTH,
        peak_flops=4 * H100_SXM_BF16_FLOPS,
        # Assumption: TP=4 reaches ~75% of aggregate HBM peak and ~50% MFU; with 160
        # all-reduces per step (2 per layer, ~8 us each over NVLink) this gives ~15.5 ms
        # per token at batch 1 (141.1 GB / 10.05 TB/s + 1.5 ms).
        bandwidth_efficiency=0.75,
        compute_efficiency=0.50,
        step_overhead_s=0.0015,
        per_seq_overhead_s=5e-6,
        frontend_overhead_s=0.006,
        vocab_size=128_256,
        kv_cache_tokens=derived_kv_cache_tokens(4, weights, kv),  # ~450k tokens
        max_model_len=32768,
        lora_load_s=lora.load_s,
        lora_activate_s=lora.activate_s,
        lora_step_overhead_s=lora.step_s,
    )


#: The built-in profiles (rooflines of published figures) by name.
PROFILES: dict[str, HardwareProfile] = {
    p.name: p for p in (_llama31_8b(), _qwen25_32b(), _llama31_70b())
}


#: Measured profiles shipped with the package (``calibrated/NAME.json``), known by name.
CALIBRATED_DIR = "calibrated"


def shipped_profile_names() -> list[str]:
    """Names of the measured profiles shipped in ``calibrated/``."""
    folder = resources.files("switchyard.sim").joinpath(CALIBRATED_DIR)
    if not folder.is_dir():
        return []
    return sorted(p.name[:-len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def looks_like_profile_path(name: str) -> bool:
    """Whether ``name`` is meant as a profile file rather than a profile name."""
    return "/" in name or "\\" in name or name.lower().endswith(PROFILE_SUFFIXES)


def get_profile(name: str) -> EngineProfile:
    """Look a profile up: a built-in name, a shipped measured profile's name, or a file path.

    Raises:
        ValueError: The name is not a known profile (the message lists the known ones), or
            the file is missing or invalid (``ProfileFileError``, naming file and field).
    """
    if name in PROFILES:
        return PROFILES[name]
    if name in shipped_profile_names():
        ref = resources.files("switchyard.sim").joinpath(CALIBRATED_DIR, f"{name}.json")
        with resources.as_file(ref) as path:
            return load_profile_file(path)
    if looks_like_profile_path(name) or Path(name).is_file():
        return load_profile_file(name)
    known = ", ".join([*sorted(PROFILES), *shipped_profile_names()])
    raise ValueError(f"sim: unknown profile {name!r}; known profiles: {known} "
                     "(or give the path of a profile file, .json or .yaml)")

