"""A round's preference pairs from its scored samples: best vs worst per prompt.

Pure functions of plain values (no torch, no process group), as the losses are: the rule is the
iterative-DPO recipe's (Xiong et al. 2024; Llama 3's rejection-sampled pairs): among the K
completions of a prompt the highest-scored one is chosen, the lowest-scored one rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """One sampled completion of a round.

    Attributes:
        prompt: index of the prompt in the round (0 .. prompts_per_round - 1).
        sample: index of the completion among the prompt's K (0 .. K - 1).
        completion_ids: the generated token ids (prompt excluded; the stop token kept when the
            completion ended on one).
    """

    prompt: int
    sample: int
    completion_ids: tuple[int, ...]


@dataclass(frozen=True)
class Pair:
    """Best (chosen) vs worst (rejected) completion of one prompt, with their scores."""

    prompt: int
    chosen_sample: int
    rejected_sample: int
    chosen_score: float
    rejected_score: float

    @property
    def margin(self) -> float:
        return self.chosen_score - self.rejected_score


@dataclass
class PairCounts:
    """What pair building kept and dropped (the round summary's counts).

    Attributes:
        prompts: prompts of the round.
        samples: completions scored.
        pairs: pairs kept.
        ties: prompts whose best and worst completion scored the same (or are the same tokens).
        near_ties: prompts with 0 < best - worst < ``min_margin``.
        empty: completions with no token (never chosen nor rejected).
        too_few: prompts with fewer than two non-empty completions.
    """

    prompts: int = 0
    samples: int = 0
    pairs: int = 0
    ties: int = 0
    near_ties: int = 0
    empty: int = 0
    too_few: int = 0


def penalize_missing_eos(
    samples: Sequence[Sample], scores: Sequence[float], stop_ids: Sequence[int], penalty: float
) -> tuple[list[float], int]:
    """The scores the pairs are chosen by: ``penalty`` subtracted from the score of every
    sample whose completion does not end with one of ``stop_ids`` (cut at ``max_new_tokens``),
    as TRL's online DPO trainer applies ``missing_eos_penalty`` (a completion that never ends
    is then less often chosen); an empty completion is left as it is.

    Returns:
        (the scores, in the order of ``samples``; how many samples end without a stop id,
        counted whatever ``penalty``).
    """
    stops = set(stop_ids)
    cut = [bool(s.completion_ids) and s.completion_ids[-1] not in stops for s in samples]
    return [float(v) - penalty * c for v, c in zip(scores, cut)], sum(cut)


def build_pairs(
    samples: Sequence[Sample], scores: Sequence[float], min_margin: float = 0.0
) -> tuple[list[Pair], PairCounts]:
    """Best vs worst completion per prompt.

    Args:
        samples: the round's completions, any order; ``scores[i]`` is the score of
            ``samples[i]``.
        min_margin: a pair is kept when best - worst > 0 and >= ``min_margin``.

    Returns:
        (the kept pairs in prompt order, the counts). Ties are broken by sample index, so the
        result does not depend on the order of ``samples``: the best is the lowest-indexed of
        the completions with the highest score, the worst the highest-indexed of those with the
        lowest score. A prompt whose best and worst are the same tokens counts as a tie.

    Raises:
        ValueError: ``scores`` and ``samples`` differ in length, or a score is not finite.
    """
    if len(scores) != len(samples):
        raise ValueError(f"{len(scores)} scores for {len(samples)} samples")
    by_prompt: dict[int, list[tuple[Sample, float]]] = {}
    for sample, score in zip(samples, scores):
        score = float(score)
        if score != score or score in (float("inf"), float("-inf")):
            raise ValueError(
                f"prompt {sample.prompt} sample {sample.sample}: score {score} is not finite"
            )
        by_prompt.setdefault(sample.prompt, []).append((sample, score))
    counts = PairCounts(prompts=len(by_prompt), samples=len(samples))
    pairs = []
    for prompt in sorted(by_prompt):
        scored = sorted(by_prompt[prompt], key=lambda x: x[0].sample)
        candidates = [(s, v) for s, v in scored if s.completion_ids]
        counts.empty += len(scored) - len(candidates)
        if len(candidates) < 2:
            counts.too_few += 1
            continue
        # max() / min() keep the first of equal keys: index order breaks ties (worst: the last).
        best = max(candidates, key=lambda x: x[1])
        worst = min(reversed(candidates), key=lambda x: x[1])
        margin = best[1] - worst[1]
        if margin <= 0 or best[0].completion_ids == worst[0].completion_ids:
            counts.ties += 1
            continue
        if margin < min_margin:
            counts.near_ties += 1
            continue
        pairs.append(Pair(prompt, best[0].sample, worst[0].sample, best[1], worst[1]))
    counts.pairs = len(pairs)
    return pairs, counts
