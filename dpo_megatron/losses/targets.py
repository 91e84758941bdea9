"""What a loss reads of one micro-batch: the targets of its item kind, and the sequence scores.

Each item kind brings its own typed targets, built on the host with the micro-batch
(``data.targets``) and read by the loss (``LossFunction.__call__``, which dispatches on
``Targets.kind`` once):

* :class:`PairTargets`: preference pairs, 2B sequences (rows 0..B-1 chosen, B..2B-1 rejected);
* :class:`SFTTargets`: SFT examples, B sequences (no rejected row);
* :class:`UnpairedTargets`: unpaired examples (KTO), 2B sequences: rows 0..B-1 each example's
  own completion, rows B..2B-1 its KL completion (another example's completion after this
  prompt: the mismatched pair of KTO's KL estimate, ``data.unpaired``), and the labels;
* :class:`RewardTargets`: a reward model's pairs, one score per sequence at its last token.

The log-prob kinds share a per-sequence layout [N, S] (:class:`TokenTargets`): ``loss_mask`` (1
where the label of that sequence position is a completion token) and ``score_index`` [n], the
flat position ``i * S + t`` of each scored token, in the order of the model's [n] log-probs.

:class:`SequenceScores` is the one record the engine hands the loss: the targets, the policy's
scores in the kind's layout, the reference's (returned by the reference pass, or carried by the
data), and the step statistic's share (returned by the statistic pass). Pure tensors: no process
group, no model, no config.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

import torch

from dpo_megatron.parallel.device import to_device

Tensor = torch.Tensor


class Targets:
    """The targets of one micro-batch of one item kind (see the module docstring).

    Class attributes:
        kind: the item kind (``LossFunction.item_kind``): "pairs", "sft", "unpaired" or
            "reward".
        reference_logps: [N, S] fp32 precomputed reference log p(label) at the scored positions
            (0 elsewhere) when the items carry them, else None (a reference pass computes them).
    """

    kind: ClassVar[str]
    reference_logps: Tensor | None = None

    @property
    def num_items(self) -> int:
        """B: items in the micro-batch."""
        raise NotImplementedError

    def to_device(self):
        """The same targets with every tensor on the engine's device."""
        return replace(
            self,
            **{
                f.name: to_device(getattr(self, f.name))
                for f in fields(self)
                if isinstance(getattr(self, f.name), Tensor)
            },
        )

    def model_scores(
        self, output_index: Tensor, target_ids: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """What the model scores for these targets, given the builder's scored tokens
        (``output_index`` [n] flat model positions, ``target_ids`` [n] their labels): the model's
        ``output_index`` and ``target_ids`` (None: the model's own head reads the positions)."""
        return output_index, target_ids

    def policy_values(self, output: Any, log_sum_p2: bool = False):
        """The model's last-stage output for these targets' micro-batch in the loss's layout:
        ``(policy, log_sum_p2)``, each a tensor or None (this rank's values; the engine sums
        them over the context-parallel group)."""
        raise NotImplementedError


@dataclass
class TokenTargets(Targets):
    """The per-sequence layout of a log-prob kind (see the module docstring).

    Attributes:
        loss_mask: [N, S] fp32, 1 where the label of that sequence position is a completion
            token.
        score_index: [n] int64 flat positions (``i * S + t``) of the scored tokens in [N, S], in
            the order of the model's [n] outputs (under context parallelism: the tokens this
            rank scores).
    """

    loss_mask: Tensor
    score_index: Tensor

    sequences_per_item: ClassVar[int] = 2

    @property
    def num_items(self) -> int:
        return self.loss_mask.shape[0] // self.sequences_per_item

    def sequence_layout(self, values: Tensor) -> Tensor:
        """[n] values of the scored tokens -> [N, S] (zero elsewhere); differentiable."""
        mask = self.loss_mask
        flat = values.new_zeros(mask.numel()).index_put((self.score_index,), values.reshape(-1))
        return flat.view(mask.shape)

    def policy_values(self, output: Any, log_sum_p2: bool = False):
        """``output`` is the log-prob head's ``HeadLogps`` ([n] ``token_logps``, ``log_sum_p2``):
        both as [N, S] (``log_sum_p2`` only when asked for)."""
        p2 = self.sequence_layout(output.log_sum_p2) if log_sum_p2 else None
        return self.sequence_layout(output.token_logps), p2


@dataclass
class PairTargets(TokenTargets):
    """Preference pairs: 2B sequences, rows 0..B-1 chosen, B..2B-1 the rejected completions of
    the same pairs.

    Attributes:
        margin: [B] fp32 per-pair margins from the data (``PreferencePair.margin``, 0 where a
            pair has none), None when no pair has one.
        reference_logps: [2B, S] precomputed reference log-probs, or None.
    """

    kind: ClassVar[str] = "pairs"

    margin: Tensor | None = None
    reference_logps: Tensor | None = None


@dataclass
class SFTTargets(TokenTargets):
    """SFT examples: B sequences (prompt + completion), ``loss_mask`` [B, S]."""

    kind: ClassVar[str] = "sft"
    sequences_per_item: ClassVar[int] = 1


@dataclass
class UnpairedTargets(TokenTargets):
    """Unpaired examples (KTO): 2B sequences, rows 0..B-1 each example's completion, rows
    B..2B-1 its KL completion (the same prompt with another example's completion: the
    mismatched pair of KTO's KL estimate), ``loss_mask`` [2B, S].

    Attributes:
        desirable: [B] fp32 labels (1.0 desirable, 0.0 undesirable).
        reference_logps: [2B, S] precomputed reference log-probs, or None.
    """

    kind: ClassVar[str] = "unpaired"

    desirable: Tensor
    reference_logps: Tensor | None = None


@dataclass
class RewardTargets(Targets):
    """A reward model's sequences: pairs (2B sequences, chosen then rejected) for its loss, or
    single sequences to score (``sequences_per_item`` 1).

    Attributes:
        last_index: [N] int64 flat model position (``r * L + t``) of the token the reward head
            reads for each sequence, in per-sequence order (``data.collate.reward_position``:
            its last token that is not padding); the model's ``output_index``.
        margin: [B] fp32 per-pair margins from the data, None when no pair has one.
        sequences_per_item: 2 for pairs, 1 for single sequences.
    """

    kind: ClassVar[str] = "reward"

    last_index: Tensor
    margin: Tensor | None = None
    sequences_per_item: int = 2

    @property
    def num_items(self) -> int:
        return self.last_index.shape[0] // self.sequences_per_item

    def model_scores(self, output_index: Tensor, target_ids: Tensor) -> tuple[Tensor, None]:
        """The reward head reads each sequence's ``last_index``, with no label."""
        return self.last_index, None

    def policy_values(self, output: Any, log_sum_p2: bool = False):
        """``output`` is the reward head's [N] fp32 rewards: as they are (no ``log_sum_p2``)."""
        return output, None


@dataclass
class StatisticShare:
    """One micro-batch's share of a step statistic (``registry.StepStatistic.begin_step``):
    keyword arguments of the loss that has the statistic.

    Attributes:
        scalars: the step's scalars (e.g. KTO's ``kl``, beta-DPO's batch ``beta``).
        per_item: [B] values of this micro-batch's items (e.g. beta-DPO's ``keep`` mask).
    """

    scalars: dict[str, float] = field(default_factory=dict)
    per_item: dict[str, Tensor] = field(default_factory=dict)

    def kwargs(self) -> dict[str, Any]:
        """The loss function's keyword arguments."""
        return {**self.scalars, **self.per_item}


@dataclass
class SequenceScores:
    """One micro-batch's scores and targets: what the loss reads (``LossFunction.__call__``).

    Attributes:
        targets: the item kind's targets.
        policy: the policy's scores: [N, S] per-token log p(label) in nats (zero off the scored
            positions) for a log-prob kind; [N] rewards for ``reward``.
        reference: [N, S] the reference's log-probs (no gradient), None when the loss reads no
            reference.
        log_sum_p2: [N, S] log sum_v p_v^2 of the policy per position (WPO), else None.
        statistic: this micro-batch's share of the step statistic, None without one (or in
            evaluation, where the loss state's remembered values apply).
    """

    targets: Targets
    policy: Tensor
    reference: Tensor | None = None
    log_sum_p2: Tensor | None = None
    statistic: StatisticShare | None = None
