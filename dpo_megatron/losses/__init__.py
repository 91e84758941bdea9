"""The DPO loss family: pure functions of per-sequence log-probs, registered by name.

    from dpo_megatron.losses import build_loss, LOSSES
    from dpo_megatron.losses.targets import PairTargets, SequenceScores
    loss_fn = build_loss({"name": "sigmoid", "beta": 0.1})
    targets = PairTargets(loss_mask, score_index)
    losses, metrics = loss_fn(SequenceScores(targets, policy_token_logps, reference_token_logps))

Modules: `registry` (name -> spec), `terms` (shared formula pieces), `dpo_family` (reference-based
losses), `reference_free` (SimPO, CPO, ORPO, SFT), `reductions` (per-token -> per-sequence
reductions, LD-DPO, WPO weights), `running_mean` (BCO's reward shift), `step_statistics` (beta-DPO's
statistic of the whole step's batch), `kto` (KTO, unpaired examples), `reward` (Bradley-Terry
reward models), `targets` (each item kind's targets and the one record the loss reads),
`loss_function` (build_loss, the dispatch on the item kind).
"""

# Importing the formula modules registers their losses in LOSSES.
from dpo_megatron.losses import dpo_family, kto, reference_free, reward  # noqa: F401
from dpo_megatron.losses.loss_function import LossFunction, LossModifiers, build_loss
from dpo_megatron.losses.registry import LOSSES, LossSpec, parameter_lines, register_loss

__all__ = [
    "LOSSES",
    "LossFunction",
    "LossModifiers",
    "LossSpec",
    "build_loss",
    "parameter_lines",
    "register_loss",
]
