"""Pair building by hand: best vs worst, ties and near-ties dropped and counted, tie order."""

from __future__ import annotations

import pytest

from dpo_megatron.online.pairs import Pair, Sample, build_pairs, penalize_missing_eos


def _samples(spec):
    """spec: prompt -> list of (completion ids, score)."""
    samples, scores = [], []
    for prompt, rows in spec.items():
        for k, (ids, score) in enumerate(rows):
            samples.append(Sample(prompt, k, tuple(ids)))
            scores.append(score)
    return samples, scores


def test_best_vs_worst_and_every_drop_counted():
    samples, scores = _samples(
        {
            0: [((5,), 1.0), ((6,), 3.0), ((7,), -2.0), ((8,), 0.5)],  # best 1, worst 2
            1: [((5,), 2.0), ((6,), 2.0), ((7,), 2.0)],  # all tie
            2: [((5,), 1.0), ((6,), 1.25)],  # near-tie: margin 0.25 < 0.5
            3: [((5,), 0.0), ((), 9.0), ((6,), 0.5)],  # empty sample skipped: 2 vs 0, margin 0.5
            4: [((5,), 1.0), ((), 2.0)],  # one non-empty completion
            5: [((9, 9), 4.0), ((9, 9), 1.0)],  # same tokens, different scores: a tie
        }
    )
    pairs, counts = build_pairs(samples, scores, min_margin=0.5)
    assert pairs == [Pair(0, 1, 2, 3.0, -2.0), Pair(3, 2, 0, 0.5, 0.0)]
    assert pairs[0].margin == 5.0
    assert (counts.prompts, counts.samples, counts.pairs) == (6, 16, 2)
    assert (counts.ties, counts.near_ties, counts.empty, counts.too_few) == (2, 1, 2, 1)


def test_ties_broken_by_sample_index_whatever_the_order():
    samples, scores = _samples({0: [((1,), 2.0), ((2,), 0.0), ((3,), 2.0), ((4,), 0.0)]})
    pairs, _ = build_pairs(samples, scores)
    assert pairs == [Pair(0, 0, 3, 2.0, 0.0)]  # best: first of the highest; worst: last lowest
    shuffled = [3, 1, 0, 2]
    again, _ = build_pairs([samples[i] for i in shuffled], [scores[i] for i in shuffled])
    assert again == pairs


def test_zero_margin_keeps_any_positive_gap_and_drops_exact_ties():
    samples, scores = _samples({0: [((1,), 0.1), ((2,), 0.1 + 1e-9)], 1: [((1,), 1.0)] * 2})
    pairs, counts = build_pairs(samples, scores, min_margin=0.0)
    assert [p.prompt for p in pairs] == [0] and counts.ties == 1


def test_bad_scores_are_refused():
    samples, scores = _samples({0: [((1,), 0.0), ((2,), float("nan"))]})
    with pytest.raises(ValueError, match="prompt 0 sample 1: score nan is not finite"):
        build_pairs(samples, scores)
    with pytest.raises(ValueError, match="1 scores for 2 samples"):
        build_pairs(samples, scores[:1])


def test_a_completion_cut_without_a_stop_token_loses_the_penalty():
    """Stop ids 2 (EOS) and 0 (pad): the samples ending otherwise are cut at max_new_tokens and
    lose the penalty before the pairs are chosen, which here turns prompt 0's pair around; an
    empty completion is neither penalized nor counted. Penalty 0 counts them all the same."""
    samples, scores = _samples(
        {
            0: [((5, 6), 3.0), ((5, 2), 1.0), ((7, 0), 0.5)],  # cut, EOS, pad
            1: [((5,), 1.0), ((), 4.0), ((8, 2), 0.0)],
        }
    )
    ranked, cut = penalize_missing_eos(samples, scores, [0, 2], 2.5)
    assert ranked == [0.5, 1.0, 0.5, -1.5, 4.0, 0.0] and cut == 2
    pairs, _ = build_pairs(samples, ranked)
    assert pairs == [Pair(0, 1, 2, 1.0, 0.5), Pair(1, 2, 0, 0.0, -1.5)]
    assert penalize_missing_eos(samples, scores, [0, 2], 0.0) == ([float(v) for v in scores], 2)
