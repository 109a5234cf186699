"""Prompt token counts: the served model's tokenizer when the policy names one (read once per file by the
gateway's loader), else the estimate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from switchyard.decide import tokens
from switchyard.decide.tokens import (
    ESTIMATE,
    TEMPLATE_TOKENS_PER_MESSAGE,
    TEMPLATE_TOKENS_PER_PROMPT,
    TokenCounter,
    estimate_chat_tokens,
    estimate_text_tokens,
)
from switchyard.gateway import tokenizers
from switchyard.gateway.tokenizers import TokenizerCache, TokenizerError, load_token_counters
from switchyard.policy import compile_policy
from switchyard.policy.errors import PolicyError
from tests.unit.policy.base import base, to_yaml

BOS = "<|begin_of_text|>"
TEXTS = [
    "The router sends short questions to the small model.",
    "Every limit is counted in tokens, never in requests!",
    "Cache hits are cheap; prefill of a long prompt is not.",
    "unseen wörds and émojis 🚀 still encode byte by byte",
    "",
]


def make_tokenizer(path: Path, truncate_at: int | None = None) -> Path:
    """A byte-level BPE trained on a few sentences, with a BOS like Llama 3's, saved at ``path``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[BOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS[:3] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    if truncate_at is not None:
        tok.enable_truncation(max_length=truncate_at)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def policy_with_tokenizer(tokenizer: str) -> str:
    doc = base()
    doc["models"][0]["tokenizer"] = tokenizer
    return to_yaml(doc)


def test_text_is_counted_exactly_with_the_models_tokenizer(tmp_path: Path) -> None:
    path = make_tokenizer(tmp_path / "tokenizer.json")
    reference = Tokenizer.from_file(str(path))
    counter = TokenCounter(TokenizerCache().get(path))
    assert counter.exact
    for text in TEXTS:
        ids = reference.encode(text).ids
        assert ids[0] == reference.token_to_id(BOS)
        assert counter.count_text(text) == len(ids)
    assert counter.count_text(TEXTS[0]) != estimate_text_tokens(TEXTS[0])


def test_a_chat_prompt_counts_its_contents_plus_the_templates_tokens(tmp_path: Path) -> None:
    path = make_tokenizer(tmp_path / "tokenizer.json")
    reference = Tokenizer.from_file(str(path))
    counter = TokenCounter(TokenizerCache().get(path))
    content = sum(len(reference.encode(t, add_special_tokens=False).ids) for t in TEXTS)
    assert counter.count_chat(TEXTS) == content + TEMPLATE_TOKENS_PER_MESSAGE * len(TEXTS) + TEMPLATE_TOKENS_PER_PROMPT
    assert counter.count_chat([]) == TEMPLATE_TOKENS_PER_PROMPT


def test_truncation_saved_in_the_file_does_not_cap_the_count(tmp_path: Path) -> None:
    path = make_tokenizer(tmp_path / "tokenizer.json", truncate_at=4)
    assert len(Tokenizer.from_file(str(path)).encode(TEXTS[0]).ids) == 4
    full = len(Tokenizer.from_file(str(make_tokenizer(tmp_path / "full" / "tokenizer.json"))).encode(TEXTS[0]).ids)
    assert TokenCounter(TokenizerCache().get(path)).count_text(TEXTS[0]) == full > 4


def test_without_a_tokenizer_the_estimate_counts() -> None:
    assert not ESTIMATE.exact
    for text in TEXTS:
        assert ESTIMATE.count_text(text) == estimate_text_tokens(text) == -(-len(text) // 4)
    assert ESTIMATE.count_chat(TEXTS) == estimate_chat_tokens(TEXTS)
    assert ESTIMATE.count_chat(["abcd", "abcde"]) == 1 + 2 + 2 * tokens.TOKENS_PER_MESSAGE


class _CountingLoader:
    """Stands in for ``Tokenizer`` in the module under test, counting the files it reads."""

    def __init__(self) -> None:
        self.loads: list[str] = []

    def from_file(self, path: str) -> Tokenizer:
        self.loads.append(path)
        return Tokenizer.from_file(path)


def test_each_file_is_read_once_and_again_only_when_it_changes(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    loader = _CountingLoader()
    monkeypatch.setattr(tokenizers, "Tokenizer", loader)
    path = make_tokenizer(tmp_path / "models" / "small" / "tokenizer.json")
    cache = TokenizerCache()
    snapshot = compile_policy(policy_with_tokenizer("models/small/tokenizer.json"))
    first = load_token_counters(snapshot, tmp_path, cache)
    again = load_token_counters(snapshot, tmp_path, cache)
    assert cache.get(path) is cache.get(tmp_path / "models" / ".." / "models" / "small" / "tokenizer.json")
    assert loader.loads == [str(path)]
    assert first["small"].exact and first["large"] is ESTIMATE
    assert first["small"].count_text(TEXTS[0]) == again["small"].count_text(TEXTS[0])

    make_tokenizer(path, truncate_at=2)  # a new file at the same place (new mtime and size)
    load_token_counters(snapshot, tmp_path, cache)
    assert len(loader.loads) == 2


def test_an_absolute_path_ignores_the_base_folder(tmp_path: Path) -> None:
    path = make_tokenizer(tmp_path / "abs" / "tokenizer.json")
    counters = load_token_counters(compile_policy(policy_with_tokenizer(str(path))), tmp_path / "elsewhere",
                                   TokenizerCache())
    assert counters["small"].exact


@pytest.mark.parametrize(("make", "reason"), [
    (lambda p: None, "No such file or directory"),
    (lambda p: p.write_text("{not json"), "not a valid tokenizer.json"),
    (lambda p: p.mkdir(), "not a file"),
])
def test_an_unusable_tokenizer_file_is_a_located_policy_error(tmp_path: Path, make: Any, reason: str) -> None:
    path = tmp_path / "tokenizer.json"
    make(path)
    text = policy_with_tokenizer("tokenizer.json")
    with pytest.raises(PolicyError) as caught:
        load_token_counters(compile_policy(text, "policies.yaml"), tmp_path, TokenizerCache(), "policies.yaml")
    [issue] = caught.value.issues
    line = next(i for i, raw in enumerate(text.splitlines(), 1) if "tokenizer:" in raw)
    assert (issue.path, issue.line, issue.source) == ("models[small].tokenizer", line, "policies.yaml")
    assert str(path) in issue.message and reason in issue.message
    with pytest.raises(TokenizerError, match=reason):
        TokenizerCache().get(path)


@pytest.mark.parametrize("value", ["https://huggingface.co/meta-llama/tokenizer.json", ""])
def test_the_policy_refuses_a_tokenizer_that_is_not_a_local_path(value: str) -> None:
    with pytest.raises(PolicyError, match=r"models\[small\]\.tokenizer"):
        compile_policy(policy_with_tokenizer(value))
