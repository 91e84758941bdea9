"""The run's data: tokenizer, tokenized train / eval items, and the pad id, loaded once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dpo_megatron.data.config import DataConfig
from dpo_megatron.data.pairs import DataSummary
from dpo_megatron.models.config import ModelConfig
from dpo_megatron.parallel.device import get_device
from dpo_megatron.utils import ranks


@dataclass
class RunData:
    """Tokenized items of a run.

    Attributes:
        train, eval: preference pairs, SFT examples for a loss that reads no rejected
            completion, or unpaired examples (``data.pairs.UnpairedPair``) for KTO.
        pad_token_id: fills padding positions (never scored).
        tokenizer: the tokenizer (None when the caller brings its own token ids, e.g. tests and
            benchmarks).
        summary: the data pipeline's start-up summary (None when the caller brings its own
            items).
    """

    train: list
    eval: list
    pad_token_id: int
    tokenizer: Any = None
    summary: DataSummary | None = None


def load_run_data(data: DataConfig, *, model: ModelConfig, kind) -> RunData:
    """Load the ``data`` section's tokenizer (``data.tokenizer``, else ``model.hf_path``'s, the
    resolved model section's) and tokenized items (collective): rank 0 first, so the others hit
    its cache; its failure reaches every rank, or they would wait in a collective until the
    timeout.

    ``kind``: what the loss trains on (a ``data.kinds.ItemKind``, or its name: the loss's
    ``item_kind``).

    Raises:
        DataError: no training items left after filtering, or bad input (the pipeline's error
            on rank 0, "rank 0 failed" on the others).
    """
    from dpo_megatron.data import DataError, load_tokenizer
    from dpo_megatron.data.pipeline import load_items
    from dpo_megatron.training.run_models import check_vocab_fits

    tokenizer = load_tokenizer(data.tokenizer or model.hf_path)
    check_vocab_fits(tokenizer, model)

    def load(data_cfg, tokenizer):
        return load_items(data_cfg, tokenizer, kind)

    failure, dataset = None, None
    if ranks.is_rank0():
        try:
            dataset = load(data, tokenizer)
        except Exception as e:  # re-raised below, after telling the other ranks
            failure = e
    ok = torch.tensor([0 if failure else 1], device=get_device())
    dist.broadcast(ok, src=0)
    if failure is not None:
        raise failure
    if not ok.item():
        raise DataError("rank 0 failed to load the data; it reports why")
    if dataset is None:
        dataset = load(data, tokenizer)
    if not dataset.train:
        raise DataError(
            f"no training pairs left in {data.path or data.datasets} "
            f"after filtering: {dataset.summary.dropped}"
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return RunData(dataset.train, dataset.eval, pad, tokenizer, dataset.summary)
