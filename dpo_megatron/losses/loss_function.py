"""`build_loss(config)`: the loss the engine calls, built from the `loss:` config section.

The engine hands per-token log-probs; this module reduces them to per-sequence sums and token
counts (`sequence.py`), calls the selected pure functions (`dpo_family.py`, `reference_free.py`),
and applies the modifiers that act across losses (SFT term, WPO weights, LD-DPO, reference-free).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dpo_megatron.losses.kto import finish_kto_metrics, one_label_advice, weight_advice
from dpo_megatron.losses.reductions import (
    length_desensitized_logps,
    sequence_logps,
    sequence_token_counts,
    split_pairs,
    wpo_weights,
)
from dpo_megatron.losses.registry import (
    LABEL_ARG,
    LossSpec,
    LossState,
    ParamRange,
    get_loss_spec,
    parameter_owners,
)
from dpo_megatron.losses.targets import SequenceScores
from dpo_megatron.losses.terms import add_nll_term

Tensor = torch.Tensor


@dataclass(frozen=True)
class LossModifiers:
    """Config keys under `loss.` that apply to any selected loss."""

    reference_free: bool = False
    """Replace the reference log-probs by 0 in reference-based losses (an implicit uniform
    reference); no reference model is then built or run. Valid only when a selected loss uses a
    reference."""
    sft_weight: float = 0.0
    """Weight of an added per-token NLL of the chosen completion (reported as `nll_loss`)."""
    use_weighting: bool = False
    """WPO (Zhou et al. 2024, arXiv:2406.11827): multiply each pair's loss by its detached weight;
    the engine must then pass `policy_token_log_sum_p2`."""
    ld_alpha: float | None = None
    """LD-DPO (Liu et al. 2024, arXiv:2409.06411): weight in [0, 1] of the tokens past the pair's
    shared length, in policy and reference log-probs alike (as TRL 1.x); None = off, 1 = plain
    sums."""


# Modifier key -> value type checked by `_coerce` (field annotations are strings under
# `annotations`).
_MODIFIER_KINDS: dict[str, type] = {
    field.name: bool if field.type == "bool" else float
    for field in dataclasses.fields(LossModifiers)
}


# The modifiers' ranges (a loss's own parameters have theirs at its @register_loss).
_MODIFIER_RANGES: dict[str, ParamRange] = {
    "ld_alpha": ParamRange(0.0, 1.0),
    "sft_weight": ParamRange(0.0),
}


def _coerce(key: str, value: Any, kind: type) -> Any:
    """Check a config value's type: bool keys take bools, float keys take ints or floats.

    Raises:
        ValueError: wrong type.
    """
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"loss.{key} must be true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"loss.{key} must be a number, got {value!r}")
    return float(value)


def _check_value(loss_name: str, key: str, value: Any, ranges: Mapping[str, ParamRange]) -> None:
    rule = ranges.get(key)
    if rule is not None and value not in rule:
        raise ValueError(f"loss.{key}={value} is out of range {rule} for loss {loss_name!r}")


@dataclass
class LossComponent:
    """One selected loss with its weight, resolved parameters and cross-step state."""

    spec: LossSpec
    weight: float
    params: dict[str, Any]
    state: LossState | None

    @property
    def fn_params(self) -> dict[str, Any]:
        """The parameters the pure function takes (the others configure the state)."""
        return {key: self.params[key] for key in self.spec.fn_params}


class LossFunction:
    """Per-item loss of one micro-batch's scores and targets; see `__call__`.

    Attributes:
        needs_reference: the engine must run the reference model and pass its log-probs.
        needs_token_log_sum_p2: the engine must pass the policy's `log_sum_p2` (WPO).
        needs_rejected: False when the loss reads only chosen completions (`sft`; `kto`, whose
            KL completions reach it through its step statistic only): the engine may then
            compute chosen rows only (`loss_sides`; SFT: `SFTTargets`).
        unpaired: the loss trains on unpaired examples (KTO: `UnpairedTargets`, each example's
            completion and its KL completion, with the labels).
        model_head: what the model computes for the loss (`LossSpec.model_head`): "lm"
            (per-token log-probs) or "reward" (one scalar per sequence: `RewardTargets`).
    """

    def __init__(self, components: Sequence[LossComponent], modifiers: LossModifiers) -> None:
        self.components = list(components)
        self.modifiers = modifiers
        self._any_reference_based = any(c.spec.needs_reference for c in self.components)
        self.needs_reference = self._any_reference_based and not modifiers.reference_free
        self.needs_token_log_sum_p2 = modifiers.use_weighting
        self.needs_rejected = (
            any(c.spec.uses_rejected for c in self.components)
            or modifiers.use_weighting
            or modifiers.ld_alpha is not None
        )
        self.unpaired = any(c.spec.unpaired for c in self.components)
        self.model_head = self.components[0].spec.model_head

    def __repr__(self) -> str:
        parts = [
            f"{c.weight:g}*{c.spec.name}({', '.join(f'{k}={v}' for k, v in c.params.items())})"
            for c in self.components
        ]
        return f"LossFunction({' + '.join(parts)}, {self.modifiers})"

    def config_section(self) -> dict[str, Any]:
        """The ``loss`` config section of this function with every parameter written out, the
        defaults included (``--print-config``): ``build_loss`` of it gives the same function.
        ``weights`` appears when several losses are combined; ``reference_free`` only where a
        selected loss uses a reference (elsewhere it is not a key)."""
        names = [c.spec.name for c in self.components]
        section: dict[str, Any] = {"name": names[0] if len(names) == 1 else names}
        if len(names) > 1:
            section["weights"] = [c.weight for c in self.components]
        for c in self.components:
            section.update(c.params)
        modifiers = dataclasses.asdict(self.modifiers)
        if not any(c.spec.needs_reference for c in self.components):
            modifiers.pop("reference_free")
        if self.model_head == "reward":  # no log-probs to modify (build_loss refuses them)
            modifiers = {}
        return {**section, **modifiers}

    def describe(self) -> str:
        """One readable line for the start-up log: each loss with every parameter (defaults
        included; weighted when there are several) and the modifiers that are on, e.g.
        ``loss sigmoid(beta=0.1, label_smoothing=0)`` or ``loss 1 x sigmoid(beta=0.1, ...) +
        0.5 x sft() | reference-free``."""

        def params(c: LossComponent) -> str:
            return ", ".join(
                f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in c.params.items()
            )

        single = len(self.components) == 1
        parts = [
            (f"{c.spec.name}" if single else f"{c.weight:g} x {c.spec.name}") + f"({params(c)})"
            for c in self.components
        ]
        m, mods = self.modifiers, []
        if m.reference_free:
            mods.append("reference-free")
        if m.sft_weight:
            mods.append(f"+ {m.sft_weight:g} x NLL of the chosen (sft_weight)")
        if m.use_weighting:
            mods.append("WPO weighting (use_weighting)")
        if m.ld_alpha is not None:
            mods.append(f"LD-DPO (ld_alpha={m.ld_alpha:g})")
        return "loss " + " + ".join(parts) + (" | " + ", ".join(mods) if mods else "")

    def __call__(self, scores: SequenceScores) -> tuple[Tensor, dict[str, Tensor]]:
        """Per-item losses and metrics of one micro-batch, dispatched once on its item kind
        (``scores.targets.kind``: :meth:`_pairs`, :meth:`_sft`, :meth:`_unpaired`,
        :meth:`_reward`).

        Args:
            scores: the micro-batch's targets and scores (``losses.targets.SequenceScores``):
                per-token log-probs [N, S] of the policy (and of the reference, when
                `needs_reference`; ``log_sum_p2`` with WPO), or a reward model's [N] rewards;
                the step statistic's share in a training step of a loss with one.
        Returns:
            losses: [B] per-item loss (nats for the likelihood-based losses; squared or
                unitless log-ratio margins for ipo, sppo_hard, hinge, apo_*); the engine sums
                over items and divides by the global item count.
            metrics: name -> [B] detached per-item values (the engine averages them over all
                items).
        Raises:
            ValueError: targets of a kind this loss does not train on (:attr:`item_kind`; an SFT
                loss also reads pairs' chosen rows), shapes that disagree, a reference missing or
                given when not used, or WPO's ``log_sum_p2`` missing.
        """
        kind = scores.targets.kind
        if kind not in self.accepted_kinds:
            raise ValueError(
                f"{self!r} trains on {self.item_kind} items, got {kind} targets "
                f"(accepted: {', '.join(self.accepted_kinds)})"
            )
        if kind != "reward":
            self._check_inputs(scores)
        return getattr(self, f"_{kind}")(scores)

    @property
    def accepted_kinds(self) -> tuple[str, ...]:
        """The target kinds :meth:`__call__` takes: :attr:`item_kind`, and pairs for a loss that
        reads no rejected completion (their chosen rows)."""
        return (self.item_kind, "pairs") if self.item_kind == "sft" else (self.item_kind,)

    def _pairs(self, scores: SequenceScores) -> tuple[Tensor, dict[str, Tensor]]:
        """Preference pairs: rows 0..B-1 chosen, B..2B-1 rejected."""
        policy, loss_mask = scores.policy, scores.targets.loss_mask.to(scores.policy.dtype)
        policy_chosen, policy_rejected = split_pairs(self._sequence_logps(policy, loss_mask))
        chosen_tokens, rejected_tokens = split_pairs(sequence_token_counts(loss_mask, policy.dtype))
        return self._combine(
            scores, loss_mask, (policy_chosen, policy_rejected), (chosen_tokens, rejected_tokens)
        )

    def _unpaired(self, scores: SequenceScores) -> tuple[Tensor, dict[str, Tensor]]:
        """Unpaired examples: rows 0..B-1 each example's completion, B..2B-1 its KL completion;
        the loss function takes them as its first and second sequences, with the labels."""
        policy, loss_mask = scores.policy, scores.targets.loss_mask.to(scores.policy.dtype)
        completion, kl_completion = split_pairs(self._sequence_logps(policy, loss_mask))
        completion_tokens, kl_completion_tokens = split_pairs(
            sequence_token_counts(loss_mask, policy.dtype)
        )
        return self._combine(
            scores,
            loss_mask,
            (completion, kl_completion),
            (completion_tokens, kl_completion_tokens),
            {LABEL_ARG: scores.targets.desirable},
        )

    def _sft(self, scores: SequenceScores) -> tuple[Tensor, dict[str, Tensor]]:
        """SFT examples: B completions, no rejected row (its log-prob reads 0, its count 1)."""
        policy, loss_mask = scores.policy, scores.targets.loss_mask.to(scores.policy.dtype)
        chosen_tokens = sequence_token_counts(loss_mask, policy.dtype)
        policy_chosen = sequence_logps(policy, loss_mask)
        return self._combine(
            scores,
            loss_mask,
            (policy_chosen, torch.zeros_like(policy_chosen)),
            (chosen_tokens, torch.ones_like(chosen_tokens)),
        )

    def _combine(
        self,
        scores: SequenceScores,
        loss_mask: Tensor,
        policy_logps: tuple[Tensor, Tensor],
        tokens: tuple[Tensor, Tensor],
        data_kwargs: Mapping[str, Tensor] | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The selected losses of a log-prob kind's [B] first and second sequence log-probs and
        token counts, weighted and summed, then the modifiers (SFT term, WPO weights)."""
        policy_chosen, policy_rejected = policy_logps
        chosen_tokens, rejected_tokens = tokens
        reference_chosen = reference_rejected = None
        if self.needs_reference:
            reference_chosen, reference_rejected = split_pairs(
                self._sequence_logps(scores.reference, loss_mask)
            )
        elif self._any_reference_based:  # reference_free: an implicit reference with log-prob 0
            reference_chosen, reference_rejected = (
                torch.zeros_like(policy_chosen),
                torch.zeros_like(policy_rejected),
            )

        total: Tensor = torch.zeros_like(policy_chosen)
        metrics: dict[str, Tensor] = {}
        for component in self.components:
            runtime = component.state.loss_kwargs() if component.state is not None else {}
            if scores.statistic is not None and component is self._statistic_component:
                runtime = {**runtime, **scores.statistic.kwargs()}
            if component.spec.unpaired:
                runtime.update(data_kwargs or {})
            losses, component_metrics = component.spec.fn(
                policy_chosen,
                policy_rejected,
                reference_chosen,
                reference_rejected,
                chosen_tokens=chosen_tokens,
                rejected_tokens=rejected_tokens,
                **component.fn_params,
                **runtime,
            )
            total = total + component.weight * losses
            for name, value in component_metrics.items():
                metrics.setdefault(
                    name, value
                )  # shared names (rewards/*) come from the first loss listed
            if len(self.components) > 1:
                metrics[f"loss/{component.spec.name}"] = losses.detach()
        total = add_nll_term(
            total, metrics, self.modifiers.sft_weight, policy_chosen, chosen_tokens
        )
        if self.modifiers.use_weighting:
            weights = wpo_weights(scores.policy, scores.log_sum_p2, loss_mask)
            total = total * weights
            metrics["wpo/weights"] = weights
        return total, metrics

    def _reward(self, scores: SequenceScores) -> tuple[Tensor, dict[str, Tensor]]:
        """A reward model's pairs: ``scores.policy`` [2B] fp32 one reward per sequence (0..B-1
        chosen, B..2B-1 the rejected sequences of the same pairs), with the pairs' margins.

        Raises:
            ValueError: rewards that are not [2B].
        """
        rewards = scores.policy
        if rewards.dim() != 1 or rewards.shape[0] % 2:
            raise ValueError(f"rewards must be [2B] (chosen, then rejected), got {rewards.shape}")
        chosen, rejected = split_pairs(rewards)
        component = self.components[0]
        return component.spec.fn(
            chosen,
            rejected,
            None,
            None,
            chosen_tokens=None,
            rejected_tokens=None,
            margin=scores.targets.margin,
            **component.fn_params,
        )

    @property
    def item_kind(self) -> str:
        """What the loss trains on (`data.kinds`, `losses.targets`): a reward model's "reward"
        pairs, "unpaired" examples (KTO), "sft" examples (no rejected completion read) or
        preference "pairs"."""
        if self.model_head == "reward":
            return "reward"
        if self.unpaired:
            return "unpaired"
        return "pairs" if self.needs_rejected else "sft"

    @property
    def loss_sides(self) -> tuple[str, ...]:
        """The sequences of an item the loss's pass reads ("chosen", "rejected"): the chosen
        one alone when no part of the loss reads the rejected one (`needs_rejected`)."""
        return ("chosen", "rejected") if self.needs_rejected else ("chosen",)

    @property
    def statistic_sides(self) -> tuple[str, ...] | None:
        """The sequences the step statistic reads (its state's ``sides``, else both), or None
        without a step statistic."""
        component = self._statistic_component
        if component is None:
            return None
        return tuple(getattr(component.state, "sides", ("chosen", "rejected")))

    def needs_step_statistic(self, training: bool) -> bool:
        """True when the engine must run the step-statistic pass (`registry.StepStatistic`) before
        this step: a training step (``training``) of a loss with a step statistic."""
        return training and self._statistic_component is not None

    def item_statistics(self, scores: SequenceScores) -> Tensor:
        """[B] detached per-item values of one micro-batch for the step statistic.

        Args: as `__call__` (rows [2B, S]: a pair's chosen then rejected, or an unpaired
            example's completion then its KL completion); ``scores.statistic`` unused.
        """
        with torch.no_grad():
            policy = scores.policy
            loss_mask = scores.targets.loss_mask.to(policy.dtype)
            policy_first, policy_second = split_pairs(self._sequence_logps(policy, loss_mask))
            if self.needs_reference:
                reference = self._sequence_logps(scores.reference, loss_mask)
            else:  # reference_free: an implicit reference with log-prob 0
                reference = torch.zeros_like(policy[:, 0])
            reference_first, reference_second = split_pairs(reference)
            return self._statistic_component.state.item_values(
                policy_first, policy_second, reference_first, reference_second
            )

    def begin_step(
        self, values: Tensor, keys: Tensor, training: bool
    ) -> tuple[dict[str, float], dict[str, Tensor]]:
        """The step statistic of the global batch: `StepStatistic.begin_step` of the loss that has
        one.
        Call it on every rank with the same values, so that every rank's state stays the same."""
        return self._statistic_component.state.begin_step(values, keys, training)

    @property
    def _statistic_component(self) -> LossComponent | None:
        for component in self.components:
            if component.state is not None and hasattr(component.state, "begin_step"):
                return component
        return None

    def _sequence_logps(self, token_logps: Tensor, loss_mask: Tensor) -> Tensor:
        """[2B, S] -> [2B] summed log-probs, LD-DPO-weighted when ld_alpha is set."""
        if self.modifiers.ld_alpha is None:
            return sequence_logps(token_logps, loss_mask)
        return length_desensitized_logps(token_logps, loss_mask, self.modifiers.ld_alpha)

    def _check_inputs(self, scores: SequenceScores) -> None:
        policy, reference, log_sum_p2 = scores.policy, scores.reference, scores.log_sum_p2
        loss_mask = scores.targets.loss_mask
        if policy.dim() != 2 or policy.shape != loss_mask.shape:
            raise ValueError(
                f"policy log-probs {tuple(policy.shape)} and loss_mask {tuple(loss_mask.shape)} "
                "must both be [N, S]"
            )
        if scores.targets.kind == "unpaired" and scores.targets.desirable.shape != (
            policy.shape[0] // 2,
        ):
            raise ValueError(
                f"{self!r} trains on unpaired examples: desirable labels must be [B] for the "
                f"{policy.shape[0]} rows, got {tuple(scores.targets.desirable.shape)}"
            )
        if self.needs_reference:
            if reference is None:
                raise ValueError(f"{self!r} needs the reference log-probs, got None")
            if reference.shape != policy.shape:
                raise ValueError(
                    f"reference log-probs {tuple(reference.shape)} != policy log-probs "
                    f"{tuple(policy.shape)}"
                )
        elif reference is not None:
            raise ValueError(
                f"{self!r} uses no reference model; pass no reference log-probs "
                "(and do not run one)"
            )
        if self.needs_token_log_sum_p2 and (log_sum_p2 is None or log_sum_p2.shape != policy.shape):
            raise ValueError(
                "loss.use_weighting (WPO) needs the policy's log_sum_p2 of shape "
                f"{tuple(policy.shape)}, got "
                f"{None if log_sum_p2 is None else tuple(log_sum_p2.shape)}"
            )

    def data_advice(self, train_items: Sequence) -> str | None:
        """A warning about the training data for this loss, or None: for KTO, training examples
        of one label only (`kto.one_label_advice`), else the paper's check of
        lambda_D n_D / (lambda_U n_U) in [1, 4/3] (`kto.weight_advice`) over the items' labels."""
        if not self.unpaired:
            return None
        params = self.components[0].params
        n_desirable = sum(1 for item in train_items if item.desirable)
        n_undesirable = len(train_items) - n_desirable
        return one_label_advice(n_desirable, n_undesirable) or weight_advice(
            n_desirable, n_undesirable, params["desirable_weight"], params["undesirable_weight"]
        )

    def finish_metrics(self, means: Mapping[str, float], count: int) -> dict[str, float]:
        """The step's (or evaluation's) reported metrics from the means over `count` items of the
        per-item metrics: unchanged, except for unpaired losses, whose per-side means are taken
        over that side's examples (TRL's KTO metrics, `kto.finish_kto_metrics`)."""
        return finish_kto_metrics(means, count) if self.unpaired else dict(means)

    def on_step_end(self, global_metrics: Mapping[str, float]) -> None:
        """After each optimizer step: fold the step's globally averaged metrics into loss states
        (BCO)."""
        for component in self.components:
            if component.state is not None:
                component.state.update(dict(global_metrics))

    def state_dict(self) -> dict[str, Any]:
        """Cross-step loss state for checkpoints, keyed by loss name; {} for stateless losses."""
        return {c.spec.name: c.state.state_dict() for c in self.components if c.state is not None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()` output.

        Raises:
            ValueError: the saved losses' states do not match the configured ones.
        """
        expected = sorted(self.state_dict())
        if sorted(state) != expected:
            raise ValueError(
                f"loss state in checkpoint has {sorted(state)}, the configured loss expects "
                f"{expected}"
            )
        for component in self.components:
            if component.state is not None:
                component.state.load_state_dict(dict(state[component.spec.name]))


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, (str, int, float)):
        return [value]
    return list(value)


def build_loss(config: Mapping[str, Any]) -> LossFunction:
    """Build the loss selected by the `loss:` config section.

    Args:
        config: plain mapping (e.g. `OmegaConf.to_container(cfg.loss)`): `name` (a registered name
            or a list of names), optional `weights` (one per name, default 1.0 each), and the
            parameters of the selected losses and of `LossModifiers`. Keys whose value is None count
            as unset. A parameter shared by several listed losses (e.g. beta) is passed to each that
            takes it; a loss whose parameter is not set uses its own paper default.
    Returns:
        The `LossFunction`.
    Raises:
        ValueError: missing or unknown name (lists valid names), a key no selected loss takes (lists
            the valid keys), wrong type or out-of-range value, or weights not matching the names.
    """
    config = {key: value for key, value in dict(config).items() if value is not None}
    if "name" not in config:
        raise ValueError("loss.name is required")
    names = [str(name) for name in _as_list(config.pop("name"))]
    if not names:
        raise ValueError("loss.name lists no loss")
    if len(set(names)) != len(names):
        raise ValueError(f"loss.name lists a loss twice: {names}")
    specs = [get_loss_spec(name) for name in names]

    weights = [
        _coerce("weights", w, float) for w in _as_list(config.pop("weights", [1.0] * len(names)))
    ]
    if len(weights) != len(names):
        raise ValueError(f"loss.weights has {len(weights)} entries for {len(names)} losses {names}")

    modifier_kinds = dict(_MODIFIER_KINDS)
    if not any(spec.needs_reference for spec in specs):
        del modifier_kinds["reference_free"]
    valid = sorted(
        {"name", "weights", *modifier_kinds, *(key for spec in specs for key in spec.params)}
    )
    unknown = sorted(key for key in config if key not in valid)
    if unknown:
        named = names[0] if len(names) == 1 else names  # as the config wrote it
        close = {
            key: match
            for key in unknown
            for match in difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        }
        hint = "".join(f" Did you mean loss.{match} for {key}?" for key, match in close.items())
        # A parameter of another loss (simpo_gamma given to sigmoid): name the losses taking it.
        hint += "".join(
            f" {key} is a parameter of loss {', '.join(owners)}, not of {named}."
            for key in unknown
            if key not in close and (owners := list(parameter_owners().get(key, ())))
        )
        raise ValueError(
            f"loss.name={named} takes no parameter(s) {unknown}.{hint} Valid keys: {valid}"
        )

    components = [
        _component(spec, weight, config) for spec, weight in zip(specs, weights, strict=True)
    ]
    modifier_values = {
        key: _coerce(key, config[key], kind)
        for key, kind in modifier_kinds.items()
        if key in config
    }
    for key, value in modifier_values.items():
        _check_value(",".join(names), key, value, _MODIFIER_RANGES)
    _check_combination(components, modifier_values)
    return LossFunction(components, LossModifiers(**modifier_values))


def _component(spec: LossSpec, weight: float, config: Mapping[str, Any]) -> LossComponent:
    """One listed loss: its parameters from ``config`` (or its defaults), checked against its
    ranges, and its cross-step state built from them."""
    params = {}
    for key, default in spec.params.items():
        params[key] = _coerce(key, config[key], type(default)) if key in config else default
        _check_value(spec.name, key, params[key], spec.param_ranges)
    state = (
        spec.state_factory(**{key: params[key] for key in spec.state_params})
        if spec.state_factory is not None
        else None
    )
    return LossComponent(spec, weight, params, state)


def _check_combination(components: list[LossComponent], modifier_values: dict[str, Any]) -> None:
    """The losses and modifiers listed together can be combined.

    Raises:
        ValueError: two losses with a step statistic; an unpaired or reward-model loss with
            other losses or modifiers; per-pair weights with a loss that sorts its batch.
    """
    specs = [c.spec for c in components]
    names = [spec.name for spec in specs]
    with_statistic = [
        c.spec.name for c in components if c.state is not None and hasattr(c.state, "begin_step")
    ]
    if len(with_statistic) > 1:
        raise ValueError(
            f"loss.name lists {with_statistic}: at most one loss with a step statistic can be "
            "combined"
        )
    unpaired = [spec.name for spec in specs if spec.unpaired]
    if unpaired and len(specs) > 1:
        raise ValueError(
            f"loss.name={names}: {unpaired} trains on unpaired examples and cannot be combined "
            "with other losses"
        )
    misfits = sorted(
        k for k in ("sft_weight", "use_weighting", "ld_alpha") if modifier_values.get(k)
    )
    reward = [spec.name for spec in specs if spec.model_head == "reward"]
    if reward and (len(specs) > 1 or misfits):
        raise ValueError(
            f"loss.name={names}: {reward[0]} trains a reward model (one score per sequence, no "
            "log-probs) and cannot be combined with other losses or with "
            f"{misfits or 'loss modifiers'}"
        )
    if unpaired and misfits:
        raise ValueError(
            f"loss.{misfits[0]} does not apply to unpaired examples ({unpaired[0]}): its rows are "
            "a completion and a mismatched completion, not a chosen and a rejected answer"
        )
    sorting = sorted(spec.name for spec in specs if spec.sorts_batch)
    if modifier_values.get("use_weighting") and sorting:
        raise ValueError(
            f"loss.use_weighting (WPO) cannot be combined with {sorting}: they sort pairs within "
            "the micro-batch, so per-pair weights would not line up with the losses"
        )
