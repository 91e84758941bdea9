"""Stand-ins for the online tests: a judge callable (``online.judge=tests.online.standins:
char_judge``), a reward model (the tiny policy model at the reward model's layout, with a scorer
that records the layout it ran at), and the real generation with its calls counted."""

from __future__ import annotations

CALLS = {"generate": 0, "judge": 0}
"""Calls in this process (a resumed run must not sample a round again)."""


def char_judge(prompts: list[str], completions: list[str]) -> list[float]:
    """Score = sum of the completion's character codes mod 13: varied, with some ties."""
    CALLS["judge"] += 1
    assert len(prompts) == len(completions)
    return [float(sum(map(ord, c)) % 13) for c in completions]


def counting_generate(chunks, prompts, params, **kwargs):
    """``dpo_megatron.generation.generate``, counted, with the (TP, PP, DP) layout it ran at."""
    from megatron.core import parallel_state as ps

    from dpo_megatron.generation import generate

    CALLS["generate"] += 1
    CALLS["generate_layout"] = (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_world_size(),
    )
    return generate(chunks, prompts, params, **kwargs)


def eos_ending_generate(chunks, prompts, params, **kwargs):
    """:func:`counting_generate` with every odd-indexed sample of a prompt cut to its first
    token and the tiny tokenizer's EOS (2): a round of completions that stopped and
    completions cut at ``max_new_tokens``, for ``online.missing_eos_penalty``."""
    out = counting_generate(chunks, prompts, params, **kwargs)
    return [[[*ids[:1], 2] if j % 2 else ids for j, ids in enumerate(samples)] for samples in out]


def build_tiny_reward_model(cfg, path):
    """The 'reward model': the tiny policy model built at the current layout (the reward
    model's, set up by the loop) with the weights of ``path``."""
    from dpo_megatron.models import build_model_chunks
    from dpo_megatron.training import run_models

    model_cfg = run_models.resolve_model_config(cfg)
    chunks = build_model_chunks(model_cfg, cfg.online.reward_model.parallel)
    run_models.load_weights(chunks, model_cfg, path)
    return chunks


def layout_checking_scorer(chunks, sequences, completion_starts, *, micro_batch_size, pad_id):
    """Scores from the completion ids (sum mod 11), after checking that the loop switched to
    the reward model's layout: returns the layout it saw with the scores' first entry."""
    from megatron.core import parallel_state as ps

    CALLS["score"] = CALLS.get("score", 0) + 1
    CALLS["score_layout"] = (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_world_size(),
    )
    assert chunks, "no reward-model chunks"
    return [float(sum(s[c:]) % 11) for s, c in zip(sequences, completion_starts)]
