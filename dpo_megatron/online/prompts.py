"""The prompts of an online run: read once, tokenized as the model reads them, and cut into
rounds.

A prompt row is ``{"prompt": str | messages}``, ``{"messages": [...]}`` (trailing assistant turns
dropped: the model answers the last user turn) or a row of any preference format of the data
path (``data.formats``: its prompt). A text prompt is encoded as it stands, a chat prompt through
the chat template with the generation prompt, each starting with exactly one BOS where the
tokenizer adds one: what the data path does with the prompts of pairs (``data.encode``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from dpo_megatron.data.encode import encode_prompt, encode_settings
from dpo_megatron.data.format_registry import detect_format
from dpo_megatron.data.formats import get_format
from dpo_megatron.data.read import columns, first_row, rows
from dpo_megatron.data.sources import DataError, read_source
from dpo_megatron.data.summary import DROP_WARNING_SHARE
from dpo_megatron.data.tokenizer import resolve_chat_template

Prompt = str | list


@dataclass(frozen=True)
class PromptItem:
    """One prompt: its row in the file, as given (text or messages) and as token ids."""

    row: int
    prompt: Prompt
    prompt_ids: tuple[int, ...]


def _row_prompt(row: dict, where: str, fmt, data_cfg) -> Prompt:
    if "messages" in row and "prompt" not in row:
        messages = list(row["messages"] or [])
        while messages and messages[-1].get("role") == "assistant":
            messages.pop()
        if not messages:
            raise DataError(f"{where}: 'messages' has no user turn to answer")
        return messages
    if "prompt" in row:
        return row["prompt"]
    examples = fmt.convert(row, data_cfg)
    if not examples:
        raise DataError(f"{where}: the row makes no example with a prompt")
    return examples[0].prompt


def read_prompts(path: str, offset: int = 0, limit: int = 0, data_cfg=None) -> list[tuple]:
    """(row index, prompt) of the rows ``offset .. offset + limit - 1`` of ``path`` (``limit``
    0: to the end).

    Raises:
        DataError: the file is missing or malformed, a row has no prompt (naming the row), or
            no row is left after the offset.
    """
    from dpo_megatron.data.config import DataConfig

    data_cfg = data_cfg or DataConfig()
    source = read_source(path)
    cols = columns(source)
    fmt = None
    if "prompt" not in cols and "messages" not in cols:
        try:
            fmt = get_format(detect_format(cols, first_row(source), source.label))
        except ValueError as e:
            raise DataError(
                f"online.prompts={path}: rows need a 'prompt' or 'messages' field, or a "
                f"preference format ({e})"
            ) from None
    out, total = [], 0
    for index, (where, row) in enumerate(rows(source)):
        total += 1
        if index < offset or (limit and index >= offset + limit):
            continue
        try:
            out.append((index, _row_prompt(row, f"{source.label} {where}", fmt, data_cfg)))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, DataError):
                raise
            raise DataError(f"{source.label} {where}: no prompt ({e})") from None
    if not out:
        raise DataError(
            f"online.prompts={path}: no rows left after online.prompts_offset={offset}"
            f" and online.prompts_limit={limit} (the file has {total} rows)"
        )
    return out


def encode_prompts(
    prompts: list[tuple], tokenizer, chat_template: str = "", max_prompt_length: int = 0
) -> tuple[list[PromptItem], int]:
    """Token ids of each (row, prompt); prompts longer than ``max_prompt_length`` tokens (> 0)
    are left out.

    Returns:
        (the prompts kept, how many were too long).

    Raises:
        DataError: a chat prompt and a tokenizer without a chat template.
    """
    template = resolve_chat_template(chat_template) if chat_template else None
    settings = encode_settings(tokenizer, template)
    kept, too_long = [], 0
    for row, prompt in prompts:
        ids = encode_prompt(
            prompt if isinstance(prompt, list) else str(prompt), tokenizer, settings
        )
        if max_prompt_length and len(ids) > max_prompt_length:
            too_long += 1
            continue
        if ids:
            kept.append(PromptItem(row, prompt, tuple(ids)))
    return kept, too_long


def left_out_warning(too_long: int, total: int, max_prompt_length: int) -> str | None:
    """One ``WARNING:`` line when more than ``data.summary.DROP_WARNING_SHARE`` of the ``total``
    prompts read were left out for length (the data path's rule for dropped pairs); None
    otherwise."""
    if not total or too_long / total <= DROP_WARNING_SHARE:
        return None
    return (
        f"WARNING: {too_long} of {total} prompts ({100 * too_long / total:.0f}%) were left out: "
        f"longer than data.max_prompt_length={max_prompt_length} tokens (raise "
        "data.max_prompt_length, or pick other rows with online.prompts_offset / "
        "online.prompts_limit)"
    )


def split_prompts(items: list, held_out: int, shuffle: bool, seed: int) -> tuple[list, list]:
    """(the pool the rounds draw from, the ``held_out`` evaluation prompts): the prompt order
    (file order, or shuffled once with ``seed``), its first ``held_out`` prompts held out.

    Raises:
        DataError: ``held_out`` leaves no prompt for the rounds.
    """
    if held_out >= len(items):
        raise DataError(
            f"online.eval_prompts={held_out} holds out every one of the {len(items)} prompts: "
            "lower it or give more prompts"
        )
    order = list(range(len(items)))
    if shuffle:
        random.Random(seed).shuffle(order)
    ordered = [items[i] for i in order]
    return ordered[held_out:], ordered[:held_out]


def round_prompts(items: list, round_index: int, per_round: int, shuffle: bool, seed: int) -> list:
    """The prompts of round ``round_index``: the next ``per_round`` of the prompt order (file
    order, or shuffled once with ``seed``), wrapping around at its end; the same on every rank
    and in every resumed run."""
    order = list(range(len(items)))
    if shuffle:
        random.Random(seed).shuffle(order)
    start = round_index * per_round
    return [items[order[(start + i) % len(order)]] for i in range(per_round)]
