"""Judges shipped with the package (``online.judge=dpo_megatron.online.judges:NAME``) and the
prompts they read: verdicts computed from the text alone, no model.

``word_count`` scores how closely a completion keeps to the word count its prompt asks for
("... in exactly 9 words."), the kind of verifiable instruction of IFEval (Zhou et al. 2023,
"length constraints"). A small instruct model keeps to it sometimes and misses it often, by a
varying amount, so the best and the worst of a prompt's samples differ and their pair teaches
something a held-out evaluation can measure. :func:`word_count_prompts` makes its prompts
(offline, seeded: ``scripts/assets.py judge_prompts`` writes them to the asset cache).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence

WORD = re.compile(r"[A-Za-z0-9]+(?:['\u2019-][A-Za-z0-9]+)*")
"""A word: letters and digits, joined by inner apostrophes or hyphens ("don't", "well-known");
punctuation, markdown marks and bullets are not words."""

TARGET = re.compile(r"\bin exactly (\d+) words\b", re.IGNORECASE)
"""How a ``word_count`` prompt states its target."""

TEMPLATES = (
    "Describe {topic} in exactly {n} words.",
    "Explain what {topic} is in exactly {n} words.",
    "Tell me about {topic} in exactly {n} words.",
    "Write about {topic} in exactly {n} words.",
    "Give one fact about {topic} in exactly {n} words.",
)
TOPICS = (
    "the sea", "a cat", "winter", "coffee", "trains", "music", "the moon", "bread", "rain",
    "a library", "mountains", "bicycles", "the sun", "chess", "a forest", "tea", "snow",
    "a garden", "the desert", "honey", "a river", "clocks", "books", "volcanoes", "bees",
    "the wind", "a bridge", "photography", "pianos", "the ocean floor", "autumn", "a lighthouse",
    "dogs", "soup", "the night sky", "a market", "islands", "cheese", "a storm", "paper",
    "owls", "a city park", "glass", "rice", "thunder", "a castle", "spring", "maps", "apples",
    "a candle", "whales", "the radio", "salt", "a train station", "butterflies", "a kitchen",
    "stars", "wool", "a lake", "friendship",
)  # fmt: skip
MIN_WORDS, MAX_WORDS = 5, 15
"""Range of the targets :func:`word_count_prompts` draws."""


def count_words(text: str) -> int:
    """Words of ``text`` (:data:`WORD`)."""
    return len(WORD.findall(text))


def word_target(prompt: str) -> int:
    """The word count a prompt asks for ("in exactly N words", N >= 1).

    Raises:
        ValueError: the prompt states no such target (the message quotes its end).
    """
    match = TARGET.search(prompt)
    if not match or int(match.group(1)) < 1:
        raise ValueError(
            f"the prompt ...{prompt[-80:]!r} asks for no word count ('in exactly N words', "
            "N >= 1): the word_count judge scores prompts of word_count_prompts"
        )
    return int(match.group(1))


def word_count(prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
    """Score of each completion: ``max(0, 1 - |words - N| / N)`` for the target N its prompt
    asks for, in [0, 1]: 1 at exactly N words, 0 at none or at 2N and beyond, linear in
    between. A completion cut at ``max_new_tokens`` counts the words it has.

    Args:
        prompts: each completion's prompt text as the model read it (chat markup included).
        completions: the completion texts (special tokens skipped).

    Raises:
        ValueError: the lists differ in length, or a prompt states no target
            (:func:`word_target`).
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    scores = []
    for prompt, completion in zip(prompts, completions):
        n = word_target(prompt)
        scores.append(max(0.0, 1.0 - abs(count_words(completion) - n) / n))
    return scores


def word_count_prompts(count: int, seed: int = 0) -> list[dict]:
    """``count`` distinct prompts ``{"prompt": [{"role": "user", "content": text}]}`` (chat
    messages: the chat template frames them as the instruct model expects), each a template of
    :data:`TEMPLATES` with a topic of :data:`TOPICS` and a target drawn from
    [:data:`MIN_WORDS`, :data:`MAX_WORDS`]; the same list for the same arguments.

    Raises:
        ValueError: ``count`` exceeds the distinct (template, topic, target) combinations.
    """
    targets = range(MIN_WORDS, MAX_WORDS + 1)
    combos = [(t, topic, n) for t in TEMPLATES for topic in TOPICS for n in targets]
    if not 0 <= count <= len(combos):
        raise ValueError(f"count={count}: between 0 and {len(combos)} distinct prompts")
    rng = random.Random(seed)
    chosen = rng.sample(combos, count)
    return [
        {"prompt": [{"role": "user", "content": t.format(topic=topic, n=n)}]}
        for t, topic, n in chosen
    ]


def write_word_count_prompts(path, count: int = 600, seed: int = 0) -> None:
    """:func:`word_count_prompts` as JSON lines at ``path`` (the caller makes the write
    atomic)."""
    with open(path, "w", encoding="utf-8") as f:
        for row in word_count_prompts(count, seed):
            f.write(json.dumps(row) + "\n")
