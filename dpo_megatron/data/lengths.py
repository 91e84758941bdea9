"""Length limits on tokenized pairs: cut the prompt, then the completions, or drop the pair."""

from __future__ import annotations

from collections.abc import Sequence

from dpo_megatron.data.config import DataConfig
from dpo_megatron.data.formats import Filtered


def cut_prompt(
    prompt_ids: Sequence[int],
    max_prompt_length: int,
    truncation_mode: str,
    bos_token_id: int | None = None,
) -> list[int]:
    """The prompt cut to ``max_prompt_length`` tokens (0 = no cut).

    ``keep_end`` keeps the last tokens (the turn being answered), ``keep_start`` the first. A
    prompt that starts with ``bos_token_id`` keeps it at position 0 either way: ``keep_end``
    then keeps the BOS and the last ``max_prompt_length - 1`` tokens (a model trained with a
    BOS first never sees a sequence without one).
    """
    prompt_ids = list(prompt_ids)
    if not max_prompt_length or len(prompt_ids) <= max_prompt_length:
        return prompt_ids
    if truncation_mode == "keep_end":
        if bos_token_id is not None and prompt_ids[0] == bos_token_id:
            return [bos_token_id, *prompt_ids[len(prompt_ids) - max_prompt_length + 1 :]]
        return prompt_ids[-max_prompt_length:]
    if truncation_mode == "keep_start":
        return prompt_ids[:max_prompt_length]
    raise ValueError(f"data.truncation_mode={truncation_mode!r}; expected keep_end or keep_start")


def fit_lengths(
    prompt_ids: Sequence[int],
    chosen_ids: Sequence[int],
    rejected_ids: Sequence[int] | None,
    cfg: DataConfig,
    bos_token_id: int | None = None,
) -> tuple[list[int], list[int], list[int] | None]:
    """Apply ``max_prompt_length`` then ``max_length`` (see DataConfig for the rules); a BOS
    at the prompt's start stays there (:func:`cut_prompt`).

    Each completion keeps its first ``max_length - len(prompt)`` tokens; one that is cut loses its
    EOS (the model is not taught to stop mid-answer). Raises Filtered("prompt_too_long") when the
    prompt leaves fewer than ``min_completion_tokens`` tokens for a completion.
    """
    prompt = cut_prompt(prompt_ids, cfg.max_prompt_length, cfg.truncation_mode, bos_token_id)
    room = cfg.max_length - len(prompt)
    if room < cfg.min_completion_tokens:
        raise Filtered("prompt_too_long")
    chosen = list(chosen_ids)[:room]
    rejected = None if rejected_ids is None else list(rejected_ids)[:room]
    if rejected is not None and chosen == rejected:
        raise Filtered("identical_after_cut")  # the pair would carry no preference signal
    return prompt, chosen, rejected
