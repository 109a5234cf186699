"""Make a tiny Llama that a real vLLM server can load and serve on the CPU, in a few seconds.

    ENV/bin/python deploy/vllm-cpu/make_tiny_model.py OUT_DIR
    python deploy/vllm-cpu/make_tiny_model.py --lora SEED OUT_DIR

Run the first with the vLLM environment's python (``setup-env.sh`` builds it): it needs torch,
transformers and tokenizers. Nothing is downloaded: the tokenizer is a byte-level BPE trained
here on generated English-ish text, and the weights are random (fixed seeds), so the same
script always writes the same model. Its output is noise; send ``ignore_eos: true`` for exact
output lengths.

The shape is the smallest the CPU backend serves: a head dimension of 32 (hidden size 128,
4 heads) is the least its attention kernels accept. The chat template is Llama 3's, with the
same special tokens the simulator's template uses, so chat prompts are built the same way.

``--lora SEED OUT_DIR`` writes a LoRA adapter of that model in PEFT's on-disk format,
``adapter_config.json`` and ``adapter_model.safetensors`` (rank 8 on every layer's ``q_proj`` and
``v_proj``), with the standard library alone: any python runs it, no peft, torch or safetensors
package needed. Its weights are random too (A and B both non-zero, drawn from SEED), large enough
that the adapter's output differs from the base model's, and two seeds give two adapters whose
outputs differ. vLLM serves it with ``--enable-lora --lora-modules NAME=OUT_DIR``.
"""

from __future__ import annotations

import json
import random
import struct
import sys
from array import array
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

SEED = 1234
VOCAB_SIZE = 1536
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"]
BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MODEL_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
}

_WORDS = (
    "the", "a", "of", "to", "and", "in", "is", "it", "that", "for", "on", "with", "as", "this",
    "be", "at", "by", "from", "or", "an", "we", "can", "will", "each", "model", "data", "time",
    "value", "state", "cache", "token", "batch", "queue", "load", "node", "path", "rule", "limit",
    "cost", "route", "pool", "block", "shows", "keeps", "uses", "makes", "runs", "holds", "gives",
    "finds", "moves", "first", "next", "small", "large", "fast", "same", "other", "new", "old",
    "more", "less", "every", "which", "request", "server", "engine", "prompt", "answer",
    "question", "river", "mountain", "city", "garden", "window", "kitchen", "morning", "evening",
    "winter", "summer", "light", "water", "stone", "people", "house", "school", "market", "letter",
    "story", "number", "table", "paper", "music", "friend", "family", "country", "walk", "read",
    "write", "speak", "think", "build", "carry", "open", "close", "begin", "finish", "travel",
    "listen", "remember", "quickly", "slowly", "often", "never", "always", "quietly", "carefully",
    "together", "almost", "really", "very",
)
_PUNCT = (".", ".", ".", ",", ",", "?", "!", ";", ":")


def corpus(lines: int = 4000) -> list[str]:
    """Deterministic English-ish training text: sentences of common words, digits, punctuation."""
    rng = random.Random(SEED)
    out: list[str] = []
    for _ in range(lines):
        sentences = []
        for _ in range(rng.randint(1, 4)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
            if rng.random() < 0.2:
                words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
            sentences.append(" ".join(words).capitalize() + rng.choice(_PUNCT))
        out.append(" ".join(sentences))
    return out


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (any text encodes) that puts ``<|begin_of_text|>`` first, as Llama 3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   chat_template=CHAT_TEMPLATE, model_max_length=2048)


def make_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A two-layer Llama with random weights (fixed seed)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
                         rms_norm_eps=1e-5, **MODEL_SHAPE)
    return LlamaForCausalLM(config).to(torch.float32).eval()


def _ensure_chat_template_in_config(out: Path) -> None:
    # Newer transformers write the template to chat_template.jinja only; older vLLM code paths
    # and tools read it from tokenizer_config.json, so it is put there too.
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


LORA_RANK = 8
LORA_ALPHA = 16
LORA_TARGETS = ("q_proj", "v_proj")


def lora_tensors(seed: int) -> dict[str, tuple[list[int], list[float]]]:
    """The adapter's weights as (shape, row-major values), named as PEFT saves them, from ``seed`` alone.

    PEFT's own initialisation leaves B at zero (an adapter that changes nothing); here both factors
    are random, so that ``B @ A * alpha / r`` is of the order of the base model's weights.
    """
    rng = random.Random(seed)
    hidden = MODEL_SHAPE["hidden_size"]
    head_dim = hidden // MODEL_SHAPE["num_attention_heads"]
    out_dims = {"q_proj": hidden, "v_proj": MODEL_SHAPE["num_key_value_heads"] * head_dim}
    tensors: dict[str, tuple[list[int], list[float]]] = {}
    for layer in range(MODEL_SHAPE["num_hidden_layers"]):
        for module in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = [rng.gauss(0.0, hidden ** -0.5) for _ in range(LORA_RANK * hidden)]
            b = [rng.gauss(0.0, 0.5) for _ in range(out_dims[module] * LORA_RANK)]
            tensors[f"{prefix}.lora_A.weight"] = ([LORA_RANK, hidden], a)
            tensors[f"{prefix}.lora_B.weight"] = ([out_dims[module], LORA_RANK], b)
    return tensors


def safetensors_bytes(tensors: dict[str, tuple[list[int], list[float]]]) -> bytes:
    """float32 tensors in the safetensors format: an 8-byte little-endian header length, the JSON
    header (names, dtypes, shapes, byte ranges; padded with spaces to 8 bytes), the raw data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    chunks: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        shape, values = tensors[name]
        data = array("f", values)
        if sys.byteorder == "big":
            data.byteswap()
        raw = data.tobytes()
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + b"".join(chunks)


def write_lora(out: Path, seed: int) -> None:
    """A LoRA adapter of the tiny model in PEFT's on-disk format."""
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "base_model_name_or_path": "tiny-llama", "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "r": LORA_RANK, "lora_alpha": LORA_ALPHA, "lora_dropout": 0.0,
        "target_modules": list(LORA_TARGETS), "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
        "use_rslora": False, "use_dora": False, "revision": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "adapter_model.safetensors").write_bytes(safetensors_bytes(lora_tensors(seed)))


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[1] == "--lora" and argv[2].isdigit():
        write_lora(Path(argv[3]), int(argv[2]))
        print(f"tiny LoRA adapter (seed {argv[2]}, rank {LORA_RANK} on {', '.join(LORA_TARGETS)}) "
              f"written to {argv[3]}")
        return 0
    if len(argv) != 2 or argv[1].startswith("-"):
        print(f"usage: {argv[0]} OUT_DIR\n       {argv[0]} --lora SEED OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(out)
    _ensure_chat_template_in_config(out)
    model = make_model(tokenizer)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    print(f"tiny llama written to {out} (vocab {len(tokenizer)}, "
          f"{sum(p.numel() for p in model.parameters())} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
