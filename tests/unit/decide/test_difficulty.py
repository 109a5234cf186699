"""The built-in difficulty classifier, its offline fit, and the labelled prompt set it is fitted on."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from switchyard.bench.labelled import LabelledPrompt, Quality, load_prompts
from switchyard.decide.difficulty import BIAS, FEATURE_NAMES, WEIGHTS, difficulty_features, difficulty_score
from switchyard.decide.dryrun import dry_run
from switchyard.decide.features import MAX_MATCH_CHARS, RequestFeatures
from switchyard.decide.tokens import estimate_chat_tokens
from switchyard.policy import compile_policy
from switchyard.whatif.difficulty_fit import (
    choose_l2,
    feature_matrix,
    features_of,
    fit,
    main,
    weights_source,
)
from tests.unit.policy.base import base, to_yaml

#: The shipped weights' accuracy on the test split is 0.908 (see difficulty.py); a little under it.
TEST_ACCURACY_FLOOR = 0.88

CODE = '''Why does this return the wrong total?

```python
def cart_total(items, discounts={}):
    total = 0
    for item in items:
        total += item["price"] * item.get("qty", 1)
    return total
```'''
PARAGRAPH = ("Our company was founded in 2009 by two freinds who shared a pasion for sustainable design. Since then "
             "we have grown to a team of fourty people across three offices, and we have compleated more then 300 "
             "projects for clients ranging from small familly businesses to large public institutions.")


def request(text: str, *, messages: int = 1, has_tools: bool = False, json_mode: bool = False,
            system_text: str = "") -> RequestFeatures:
    return RequestFeatures(model="auto", prompt_tokens=estimate_chat_tokens([text] + [""] * (messages - 1)),
                           messages=messages, last_user_text=text, system_text=system_text, has_tools=has_tools,
                           json_mode=json_mode)


def score(text: str) -> float:
    return difficulty_score(request(text))


def test_scores_are_probabilities_whatever_the_input() -> None:
    odd = ["", " ", "\n" * 5000, "é" * 9000, "\ud800 lone surrogate", "{" * MAX_MATCH_CHARS,
           ("prove derive theorem lemma " * 2000)[:MAX_MATCH_CHARS], "hi" * 8000, "1. a\n2. b\n- c\n• d"]
    for text in odd:
        for features in (request(text), request(text, has_tools=True, json_mode=True, messages=40,
                                                 system_text="x" * 20_000)):
            assert 0.0 <= difficulty_score(features) <= 1.0
            assert len(difficulty_features(features)) == len(FEATURE_NAMES) == len(WEIGHTS)
    assert all(0.0 <= difficulty_score(features_of(p)) <= 1.0 for p in load_prompts())


def test_easy_requests_score_below_hard_ones() -> None:
    easy = ["hi there", "What is the capital of Australia?", "Translate to Spanish: Where is the train station?",
            "Fix the typos in this, don't change anything else:\n\n" + PARAGRAPH]
    hard = ["Prove there are infinitely many primes.", CODE,
            "Design a URL shortener that handles 100k writes/s across two regions; cover caching and failover.",
            "A patient on warfarin needs an antibiotic: which ones interact, by what mechanism, and how should "
            "INR monitoring change?"]
    assert max(score(t) for t in easy) < 0.5 < min(score(t) for t in hard)
    assert score("hi there") < score("What is the capital of Australia?") < 0.01


def test_the_score_moves_the_way_the_features_say() -> None:
    question = "Why does my job run twice?"
    # Pasted code, and words of engineering or maths, make a message look harder.
    assert score(question + "\n\n" + CODE) > score(question)
    assert score("Compare the tradeoffs of these two approaches.") > score("Compare these two.")
    assert score("Derive the closed form.") > score("Give the closed form.")
    # A long paste around an easy instruction stays easy; the same paste with a reasoning question is harder.
    assert score("Fix the typos: " + PARAGRAPH) < 0.5
    assert score("Analyze the strategy and the risks in this: " + PARAGRAPH) > score("Fix the typos: " + PARAGRAPH)
    # Only the message's text counts: a prompt of many tokens with no text (token ids) is not called hard.
    assert difficulty_score(RequestFeatures(model="auto", prompt_tokens=2000)) < 0.1


def test_keywords_outside_the_word_window_are_not_split() -> None:
    paste = "x " * 4000
    assert difficulty_features(request(paste + "prove it" + paste)) == difficulty_features(request(paste + paste[:8]
                                                                                                   + paste))


def test_the_shipped_weights_hold_their_accuracy_on_the_test_split() -> None:
    test = [p for p in load_prompts() if p.split == "test"]
    quality = Quality.of([difficulty_score(features_of(p)) >= 0.5 for p in test], [p.hard for p in test])
    assert quality.n >= 80
    assert quality.accuracy >= TEST_ACCURACY_FLOOR
    assert quality.precision >= 0.8 and quality.recall >= 0.8


def test_refitting_on_the_train_split_reproduces_the_shipped_weights() -> None:
    train = [p for p in load_prompts() if p.split == "train"]
    x, y = feature_matrix(train)
    l2, _ = choose_l2(x, y)
    model = fit(x, y, l2)
    assert model.weights == pytest.approx(WEIGHTS, abs=5e-4)
    assert model.bias == pytest.approx(BIAS, abs=5e-4)
    assert weights_source(model).splitlines()[1].endswith(f"# {FEATURE_NAMES[0]}")


def test_the_fit_prints_accuracy_and_pasteable_weights(capsys: pytest.CaptureFixture[str]) -> None:
    main([])
    out = capsys.readouterr().out
    assert "# test: n=" in out and "accuracy" in out
    namespace: dict[str, object] = {}
    exec(out[out.index("WEIGHTS"):], namespace)  # our own output
    assert namespace["WEIGHTS"] == pytest.approx(WEIGHTS, abs=1e-6)


def test_the_labelled_set_is_large_stratified_and_sane() -> None:
    prompts = load_prompts()
    assert len(prompts) >= 240
    assert len({p.id for p in prompts}) == len(prompts)
    assert len({p.prompt for p in prompts}) == len(prompts)
    by = Counter((p.label, p.split) for p in prompts)
    for label in ("easy", "hard"):
        total = by[label, "train"] + by[label, "test"]
        assert total >= 100
        assert 0.25 <= by[label, "test"] / total <= 0.4
    for p in prompts:
        assert p.messages >= 1 and p.output_tokens > 0
        assert (300 <= p.output_tokens <= 1500) if p.hard else (5 <= p.output_tokens <= 200)
    # The tricky ones both ways are there: short hard prompts and long easy ones.
    assert sum(1 for p in prompts if p.hard and len(p.prompt) < 60) >= 5
    assert sum(1 for p in prompts if not p.hard and len(p.prompt) > 500) >= 5


def test_a_bad_line_of_a_labelled_set_is_named(tmp_path: Path) -> None:
    path = tmp_path / "set.jsonl"
    good = {"id": "a", "label": "easy", "split": "train", "prompt": "hi", "output_tokens": 10}
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, "label": "medium"}) + "\n")
    with pytest.raises(ValueError, match=r"set\.jsonl:3: label must be easy or hard"):
        load_prompts(path)
    path.write_text(json.dumps({"id": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"set\.jsonl:1: not a labelled prompt"):
        load_prompts(path)
    path.write_text(json.dumps(good) + "\n")
    (only,) = load_prompts(path)
    assert features_of(only).last_user_text == "hi" and not only.hard


def test_quality_counts_precision_and_recall_for_hard() -> None:
    q = Quality.of([True, True, False, False, True], [True, False, True, False, True])
    assert (q.n, q.accuracy) == (5, 0.6)
    assert q.precision == pytest.approx(2 / 3) and q.recall == pytest.approx(2 / 3)


# --- a `features` classifier in a routing rule ---------------------------------------------

HARD = "Prove there are infinitely many primes, then show the gaps between consecutive primes are unbounded."
EASY = "What is the capital of Australia?"

def _classifier_policy(**spec: object) -> str:
    doc = base()
    doc["classifiers"] = {"hard": {"type": "features", **spec}}
    doc["routes"][0]["rules"] = [{"name": "hard", "when": {"classifier": "hard"}, "model": "large"}]
    doc["routes"][0]["default"] = "small"
    doc["tests"] = []
    del doc["tiers"][1]["model_limits"]  # (pro's 500 tokens a minute on large would refuse the request first)
    return to_yaml(doc)


def test_a_classifier_rule_sends_hard_prompts_to_large_and_easy_ones_to_small() -> None:
    snapshot = compile_policy(_classifier_policy())
    prompts = [LabelledPrompt("h", "hard", "test", HARD), LabelledPrompt("e", "easy", "test", EASY)]
    hard, easy = (dry_run(snapshot, "pro", features_of(p)) for p in prompts)
    assert (hard.status, hard.model, easy.status, easy.model) == (200, "large", 200, "small")
    for decided, p in ((hard, prompts[0]), (easy, prompts[1])):
        score = difficulty_score(features_of(p))
        assert decided.trace[0] == f"classifier hard (features): score {score:.2f} vs threshold 0.5"
    assert "route auto: no rule matched → default small" in easy.trace[1]
    # The threshold is the policy's: a higher one than the prompt's score does not match.
    strict = compile_policy(_classifier_policy(threshold=0.9999999))
    decided = dry_run(strict, "pro", features_of(prompts[0]))
    assert decided.model == "small" and decided.trace[0].endswith("vs threshold 1")
