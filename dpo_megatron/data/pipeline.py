"""Raw rows -> the items a loss trains on: the data path's stages, run for every source.

``load_items`` (and the per-kind ``load_preference_pairs``, ``load_sft_examples``,
``load_unpaired_examples``) reads top to bottom, for an item kind chosen once from the loss
(``kinds.ItemKind``):

1. read (``read``): each source is read and its format resolved (``auto``: detected from its
   columns) and checked against the kind;
2. tokenize (``tokenization``, cached by ``cache``): every row is converted and tokenized in a
   ``datasets.map``; malformed rows stop the load (``on_error=raise``) or are counted (``skip``);
3. select (``selection``): per-post caps, duplicates, length limits, each source's eval share;
   the items of the kind are made here; the training items of several sources are then mixed by
   ``weights``, and the kind finishes each split (unpaired: KTO's mismatched completions); the
   sources of ``eval_datasets`` (read at ``eval_split``) go through steps 1-3 the same way, their
   kept items making the eval set;
4. summarise (``summary``): rows read, items kept, drops by reason, cuts by kind, notes,
   duplicates, length percentiles, printed on rank 0.

``check_sources`` (``read``) runs step 1 and the conversion of step 2 without a tokenizer: the
launchers' pre-check.
"""

from __future__ import annotations

import logging

from dpo_megatron.data.config import DataConfig, as_data_config
from dpo_megatron.data.encode import encode_settings
from dpo_megatron.data.kinds import PAIRS_KIND, SFT_KIND, UNPAIRED_KIND, ItemKind, item_kind
from dpo_megatron.data.pairs import DataSummary, PreferenceDataset, SFTDataset, UnpairedDataset
from dpo_megatron.data.read import check_sources, read
from dpo_megatron.data.selection import mix, select_source
from dpo_megatron.data.summary import drop_warning, format_summary, summarize
from dpo_megatron.data.tokenization import tokenize_source
from dpo_megatron.data.tokenizer import resolve_chat_template
from dpo_megatron.utils.ranks import is_rank0

__all__ = [
    "check_sources",
    "load_items",
    "load_preference_pairs",
    "load_sft_examples",
    "load_unpaired_examples",
]

logger = logging.getLogger(__name__)


def load_preference_pairs(cfg: DataConfig, tokenizer) -> PreferenceDataset:
    """Preference pairs for DPO: ``.train``, ``.eval`` (lists of PreferencePair) and ``.summary``.

    Raises DataError for malformed input (message: file, row/line, field), ValueError for an
    invalid config or an undetectable format.
    """
    return load_items(cfg, tokenizer, PAIRS_KIND)


def load_sft_examples(cfg: DataConfig, tokenizer) -> SFTDataset:
    """The SFT view of the same files: prompt + chosen (or an Alpaca file's output) per example."""
    return load_items(cfg, tokenizer, SFT_KIND)


def load_unpaired_examples(cfg: DataConfig, tokenizer) -> UnpairedDataset:
    """Unpaired examples for KTO (formats ``kto_messages``, ``unpaired``,
    ``unpaired_conversational``), each with its mismatched completion for the KL estimate
    (``unpaired.with_kl_completions``, within the train and the eval split); the summary adds
    ``labels`` (desirable / undesirable counts of the training split). Same errors as
    :func:`load_preference_pairs`."""
    return load_items(cfg, tokenizer, UNPAIRED_KIND)


def load_items(cfg: DataConfig, tokenizer, kind: ItemKind | str):
    """The items a loss trains on, as the ``kind``'s dataset (``.train``, ``.eval``,
    ``.summary``); ``kind`` is an :class:`~dpo_megatron.data.kinds.ItemKind` or its name (the
    loss's ``item_kind``: ``pairs``, ``sft`` or ``unpaired``).

    Raises:
        DataError: malformed input (message: file, row/line, field).
        ValueError: an invalid config or an undetectable format.
    """
    kind = item_kind(kind)
    cfg = as_data_config(cfg)
    cfg.validate()
    settings = encode_settings(tokenizer, resolve_chat_template(cfg.chat_template))
    bos = settings.bos_token_id if settings.add_bos else None

    def load_source(index: int, name: str, fmt: str, split: str, role: str):
        source = read(index, name, fmt, split, cfg, kind, role)
        return select_source(
            tokenize_source(source, tokenizer, settings, cfg, kind), cfg, kind, bos
        )

    # formats already checked by validate(); eval sources hold no eval share (validate())
    per_source = [
        load_source(i, name, fmt, cfg.split, "train") for i, (name, fmt) in enumerate(cfg.sources())
    ]
    eval_sources = [
        load_source(i, name, fmt, cfg.eval_split, "eval")
        for i, (name, fmt) in enumerate(cfg.eval_sources())
    ]
    eval_ = [x for s in per_source for x in s.eval] + [x for s in eval_sources for x in s.kept]
    train = mix([s.train for s in per_source], cfg)
    summary = summarize(per_source + eval_sources, train, eval_, cfg, kind)
    _report(summary, cfg)
    train, eval_ = (kind.finish(x, cfg.max_length) for x in (train, eval_))
    return kind.dataset(train, eval_, summary, verbose=cfg.verbose and is_rank0())


def _report(summary: DataSummary, cfg: DataConfig) -> None:
    """Print the summary (and its drop warning) on rank 0, log it, and warn once about text
    prompts that end with a space."""
    warning = drop_warning(summary)
    if cfg.verbose and is_rank0():
        print(format_summary(summary), flush=True)
        if warning:
            print(warning, flush=True)
    logger.info("%s", format_summary(summary))
    spaced = summary.notes.get("prompt_ends_with_space", 0)
    if spaced and is_rank0():  # once per load, with the count (TRL warns per row)
        logger.warning(
            "%d text prompt(s) end with a space: the space becomes a token of its own at the end "
            "of the prompt, a boundary the model rarely sees before an answer (completions then "
            "start without their usual space-led token). Move the space into the completions or "
            "strip it.",
            spaced,
        )
