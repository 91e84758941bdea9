"""Score token sequences with a reward model (or read a causal LM's log-probabilities of them),
in-process and collective over the world, at any TP x PP x DP layout: the library function behind
``python -m dpo_megatron.score`` (:mod:`dpo_megatron.reward.rows`) and what other packages
(iterative DPO) call between training phases.

* :func:`build_reward_chunks`: this rank's chunks of a reward model from an HF
  ``*ForSequenceClassification`` folder or a reward model's checkpoint, at the current layout.
* :func:`score_sequences`: every rank passes the same list; the sequences are sharded over the
  data-parallel ranks, run through the pipeline schedule forward-only (``training.step
  .reward_scores``) and the scores gathered, so every rank returns the full list in input order.
* :func:`completion_logps`: the same for a causal LM's log p(completion | prompt) (the
  forward-only pass of a frozen reference, ``training.step.reference_token_logps``).

A sequence's score is the reward head's value at its last token that is not the pad id
(``data.collate.reward_position``, as transformers' ``*ForSequenceClassification`` reads it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from dpo_megatron.data.collate import SFTExamples
from dpo_megatron.data.pairs import SFTExample
from dpo_megatron.models import ModelConfig, build_model_chunks
from dpo_megatron.parallel.config import ParallelConfig
from dpo_megatron.parallel.device import get_device
from dpo_megatron.training.step import reference_token_logps, reward_scores

SEQUENCES_PER_CALL = 8
"""Micro-batches per schedule call: a call's rows are padded to its longest sequence, and the
sequences are sorted by length first, so the padding stays small."""


def score_sequences(
    chunks,
    sequences: Sequence[Sequence[int]],
    completion_starts: Sequence[int],
    *,
    micro_batch_size: int,
    pad_id: int,
) -> list[float]:
    """The reward of every sequence (collective: every rank of the world calls it with the same
    arguments).

    Args:
        chunks: this rank's chunks of a reward model (:func:`build_reward_chunks`, or a
            reward-model Trainer's ``policy``), at the current megatron-core layout.
        sequences: token ids of prompt + completion, one list per sequence (the same on every
            rank).
        completion_starts: index of each sequence's first completion token (>= 1, < its
            length): the prompt is ``seq[:start]``.
        micro_batch_size: sequences per micro-batch (rows of one forward).
        pad_id: the padding id; also the id the reward position skips at a sequence's end
            (transformers' ``pad_token_id`` rule).
    Returns:
        One fp32 reward per sequence as Python floats, in input order, on every rank.
    Raises:
        ValueError: lengths of the two lists differ, a start outside [1, len), or
            micro_batch_size < 1 (every rank alike, before any communication).
    """
    return _per_sequence(
        reward_scores, "reward", chunks, sequences, completion_starts, micro_batch_size, pad_id
    )


def completion_logps(
    chunks,
    sequences: Sequence[Sequence[int]],
    completion_starts: Sequence[int],
    *,
    micro_batch_size: int,
    pad_id: int,
) -> list[float]:
    """log p(completion | prompt) of every sequence under a causal LM, in nats: the sum over
    its completion tokens y_t of log softmax(logits_t)[y_t] (temperature 1), as the DPO losses
    read a sequence (collective, arguments as :func:`score_sequences`).

    Args:
        chunks: this rank's chunks of a causal LM (``model.head=lm``) at the current layout.
        sequences, completion_starts, micro_batch_size, pad_id: as :func:`score_sequences`
            (here the pad id only fills rows: every completion token is scored).
    Returns:
        One log-probability per sequence as Python floats (summed in fp64 from the fp32
        per-token values), in input order, on every rank.
    Raises:
        ValueError: as :func:`score_sequences`.
    """
    return _per_sequence(
        _summed_logps, "sft", chunks, sequences, completion_starts, micro_batch_size, pad_id
    )


def _summed_logps(chunks, batch) -> list[torch.Tensor]:
    """Per micro-batch, the [B] sums of each row's completion log-probs (last stage; empty
    elsewhere): a frozen reference's forward-only pass."""
    return [
        (token_logps.double() * targets.loss_mask.double()).sum(-1)
        for targets, token_logps in zip(batch.targets, reference_token_logps(chunks, batch))
    ]


def _per_sequence(
    values_of, kind: str, chunks, sequences, completion_starts, micro_batch_size: int, pad_id: int
) -> list[float]:
    """One value per sequence from ``values_of(chunks, step_batch)`` (the last stage's [B]
    tensor per micro-batch, rows in per-sequence order), the sequences one row each with
    ``kind``'s targets ("reward": the reward head reads the last token; "sft": the completion's
    tokens are scored), sharded over the data-parallel ranks and gathered back in input order on
    every rank."""
    if len(sequences) != len(completion_starts):
        raise ValueError(
            f"{len(sequences)} sequences but {len(completion_starts)} completion starts"
        )
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    for i, (ids, start) in enumerate(zip(sequences, completion_starts)):
        if not 1 <= start < len(ids):
            raise ValueError(
                f"sequence {i}: completion start {start} is outside [1, {len(ids)}): the prompt "
                "and the completion need a token each"
            )
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    # This DP rank's contiguous share, then by length so that each call's rows pad little.
    share = math.ceil(len(sequences) / dp_size) if sequences else 0
    mine = range(dp_rank * share, min((dp_rank + 1) * share, len(sequences)))
    order = sorted(mine, key=lambda i: len(sequences[i]))
    values = torch.zeros(len(sequences), dtype=torch.float64, device=get_device())
    per_call = micro_batch_size * SEQUENCES_PER_CALL
    builder = SFTExamples(pad_id, _row_multiple(chunks), kind)
    for begin in range(0, len(order), per_call):
        indices = order[begin : begin + per_call]
        examples = [
            SFTExample(
                prompt_ids=tuple(sequences[i][: completion_starts[i]]),
                completion_ids=tuple(sequences[i][completion_starts[i] :]),
            )
            for i in indices
        ]
        # Whole micro-batches (the schedule's buffers have one shape): the last one is filled
        # with copies of its last sequence, whose values are dropped.
        filler = -len(examples) % micro_batch_size
        examples += [examples[-1]] * filler
        groups = [
            list(range(k, k + micro_batch_size)) for k in range(0, len(examples), micro_batch_size)
        ]
        batch = builder.build(examples, groups).to_device()
        got = values_of(chunks, batch)
        if got and _reports():
            got = torch.cat(got)[: len(indices)]
            values[torch.tensor(indices, device=values.device)] = got.to(values.dtype)
    # Each sequence's value is written by exactly one rank (its DP rank's last stage, TP rank
    # 0): a sum over the world gives every rank every value.
    dist.all_reduce(values)
    return values.tolist()


def _reports() -> bool:
    """The rank that writes its DP rank's scores: on the last pipeline stage, TP rank 0."""
    return (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
    )


def _row_multiple(chunks) -> int:
    """Row lengths' granule: a multiple of TP under sequence parallelism (rows are split along
    the sequence), 8 otherwise."""
    config = chunks[0].config
    return math.lcm(8, config.tensor_model_parallel_size if config.sequence_parallel else 1)


def reward_model_config(source: str, base: ModelConfig | None = None) -> ModelConfig:
    """The architecture of the reward model in ``source`` (an HF folder's ``config.json`` or a
    checkpoint's ``model_config.json``), read without building it: what
    :func:`build_reward_chunks` builds, and what a launcher's pre-check checks before any rank
    starts.

    Raises:
        ValueError: ``source`` holds a causal LM, not a reward model.
        FileNotFoundError: no config.json and no checkpoint there.
    """
    base = base or ModelConfig()
    if _is_hf_folder(source):
        from dpo_megatron.models.conversion import model_config_from_hf

        model_cfg = model_config_from_hf(source, base)
    else:
        from dpo_megatron.checkpointing import load_model_config
        from dpo_megatron.training.run_models import resolve_model_load

        model_cfg = load_model_config(resolve_model_load(source))
        if model_cfg is None:
            raise FileNotFoundError(
                f"{source}: neither an HF folder (config.json) nor a checkpoint with its "
                "model_config.json"
            )
    _require_reward(model_cfg, source)
    return model_cfg


def build_reward_chunks(
    source: str, parallel: ParallelConfig, base: ModelConfig | None = None
) -> tuple[list, ModelConfig]:
    """This rank's chunks of the reward model in ``source``, at the current layout (collective;
    megatron-core's parallel state must be initialised with ``parallel``).

    Args:
        source: an HF ``*ForSequenceClassification`` folder (``num_labels=1``), or a reward
            model's checkpoint (a run's ``checkpoints`` folder or one ``iter_*`` folder of a
            ``loss.name=bradley_terry`` run).
        parallel: the layout the chunks are built for.
        base: for an HF folder, the non-architecture settings (dtype, attention kernel,
            ``pad_attention_heads``); default ``ModelConfig()``. A checkpoint brings its own
            (its ``model_config.json``).
    Returns:
        (the chunks in eval mode, their ``ModelConfig``).
    Raises:
        ValueError: ``source`` holds a causal LM, not a reward model.
        FileNotFoundError: no config.json and no checkpoint there.
    """
    model_cfg = reward_model_config(source, base)
    chunks = build_model_chunks(model_cfg, parallel)
    if _is_hf_folder(source):
        from dpo_megatron.models.conversion import load_hf_weights

        load_hf_weights(chunks, model_cfg, source)
    else:
        from dpo_megatron.checkpointing import load_model_checkpoint
        from dpo_megatron.training.run_models import resolve_model_load

        load_model_checkpoint(chunks, resolve_model_load(source))
    for chunk in chunks:
        chunk.eval()
    return chunks, model_cfg


def reward_pad_id(source: str, tokenizer) -> int:
    """The pad id a reward model scores with, which also marks the position it scores (the
    last token that is not the pad, ``data.collate.reward_position``): an HF folder's
    ``config.json`` ``pad_token_id``, as transformers' ``*ForSequenceClassification`` reads it;
    else (a checkpoint trained here, or a config without one) ``tokenizer``'s pad, the one a
    reward run trains with and its export writes as ``pad_token_id``."""
    if _is_hf_folder(source):
        from dpo_megatron.models.conversion.hf_config import read_hf_config_json

        pad = read_hf_config_json(source).get("pad_token_id")
        if isinstance(pad, int):
            return pad
    return tokenizer.pad_token_id


def _is_hf_folder(source: str) -> bool:
    return os.path.isfile(os.path.join(source, "config.json"))


def _require_reward(model_cfg: ModelConfig, source: str) -> None:
    if model_cfg.head != "reward":
        raise ValueError(
            f"{source} holds a causal LM, not a reward model: train one with "
            "loss.name=bradley_terry, or give an HF *ForSequenceClassification folder"
        )
