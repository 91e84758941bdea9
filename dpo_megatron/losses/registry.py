"""Name -> loss registry, so that `loss.name` in the config selects a pure loss function.

A registered function has the signature

    fn(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps,
       *, chosen_tokens, rejected_tokens, **params) -> (losses [B], metrics dict[str, Tensor[B]])

Its keyword-only parameters with defaults (other than the token counts and the runtime values a
loss state supplies, e.g. BCO's running reward mean) are the config keys the loss accepts under
`loss.`; their defaults are the paper defaults. Reading them off the signature keeps one source of
truth for valid keys and defaults. A loss state's own keyword-only constructor parameters (e.g.
beta-DPO's momentum) are config keys of the loss too, read the same way.

Model heads: a loss states what the model computes for it (`LossSpec.model_head`): "lm", per-token
log-probs of the completions through the LM head (every loss above), or "reward", one scalar per
sequence from a reward head (`bradley_terry`, `losses.reward`), whose function takes the chosen
and rejected rewards in place of the policy log-probs. The run builds the model and runs the step
for what the loss declares; nothing else says whether a model is a reward model.

Step statistics: a loss whose formula uses a statistic of the whole optimizer step's batch (all
micro-batches, all data-parallel ranks), e.g. beta-DPO's batch-level beta, has a state that is also
a :class:`StepStatistic`. The engine then runs a forward-only policy pass before the step's
forward-backward, gathers the per-pair values the state asks for over the global batch, and hands
the state's answer (scalars and per-pair values) to every micro-batch's loss call (`training.step`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dpo_megatron.utils.loss_names import LOSS_ALIASES, canonical_loss_name

LossOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]
LossFn = Callable[..., LossOutput]

# Keyword-only arguments every loss function takes that are data, not config.
TOKEN_COUNT_ARGS = ("chosen_tokens", "rejected_tokens")
# Data argument of unpaired losses (`LossSpec.unpaired`): [B] 1.0 desirable, 0.0 undesirable.
LABEL_ARG = "desirable"


class LossState(Protocol):
    """Cross-step state of a loss (e.g. BCO's running reward mean), kept outside the pure
    function."""

    def loss_kwargs(self) -> dict[str, Any]:
        """Runtime keyword arguments to pass to the loss function this step."""

    def update(self, global_metrics: dict[str, float]) -> None:
        """Fold in one optimizer step's globally averaged metrics."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StepStatistic(Protocol):
    """A loss state whose loss needs a statistic of the whole step's batch before any gradient.

    The engine calls, per training step: `item_values` on every micro-batch of a forward-only policy
    pass (after the reference pass); then `begin_step` once on every rank with the values of all
    pairs of the global batch; then the loss function of each micro-batch with the per-pair slice of
    what `begin_step` returned. The statistic thus never depends on micro-batch size, data-parallel
    size or pipeline layout. Evaluation steps call the loss with the state's `loss_kwargs()` only.
    """

    def item_values(
        self,
        policy_chosen_logps,
        policy_rejected_logps,
        reference_chosen_logps,
        reference_rejected_logps,
    ) -> torch.Tensor:
        """[B] detached per-pair values the statistic is computed from."""

    sides: tuple[str, ...]
    """Optional: the sequences `item_values` reads ("chosen", "rejected"); both when absent. The
    engine's statistic pass computes only these (`LossFunction.statistic_sides`)."""

    def begin_step(
        self, values: torch.Tensor, keys: torch.Tensor, training: bool
    ) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """Statistic of the global batch -> (scalar runtime kwargs, per-pair runtime kwargs [N]).

        Args:
            values: [N] float64 `item_values` of every pair of the step, all ranks together.
            keys: [N] int64 a layout-independent key per pair (its dataset index), so that any
                randomness can be drawn in an order that does not depend on the layout.
            training: False for an evaluation step (state must then not change).
        """


@dataclass(frozen=True)
class ParamRange:
    """The interval a loss parameter's value must lie in; ``str()`` writes it as ``[0.0, 0.5)``."""

    low: float
    high: float = float("inf")
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        return (
            f"{'(' if self.low_open else '['}{self.low}, {self.high}"
            f"{')' if self.high_open else ']'}"
        )


COMMON_RANGES: dict[str, ParamRange] = {
    "beta": ParamRange(0.0, low_open=True),
    "label_smoothing": ParamRange(0.0, 0.5, high_open=True),
}
"""Ranges of the parameters many losses share, for every loss that takes them unless its
``@register_loss(ranges=...)`` says otherwise."""


@dataclass(frozen=True)
class LossSpec:
    """One registered loss."""

    name: str
    """Config name (`loss.name`)."""
    fn: LossFn
    """Pure per-sequence function (see module docstring)."""
    needs_reference: bool
    """True when the formula uses reference-model log-probs (can be switched off by
    `reference_free`)."""
    state_factory: Callable[[], LossState] | None = None
    """Builds the loss's cross-step state; None for stateless losses."""
    runtime_params: tuple[str, ...] = ()
    """Keyword arguments supplied by the state at call time; not config keys."""
    uses_rejected: bool = True
    """False when the loss reads only the chosen completions (`sft`; `kto`, whose mismatched
    completions reach it only through its step statistic)."""
    unpaired: bool = False
    """True for losses of unpaired examples (KTO): the "chosen" sequence is the example's
    completion, the "rejected" one the mismatched completion of the KL estimate, and `fn` takes
    `desirable`."""
    model_head: str = "lm"
    """What the model computes for this loss (module docstring): "lm" (per-token log-probs)
    or "reward" (one scalar per sequence; `fn` takes the chosen and rejected rewards [B] as
    its first two arguments, None for the reference and token counts)."""
    ranges: Mapping[str, ParamRange] = field(default_factory=dict)
    """The loss's own parameter ranges (`@register_loss(ranges=...)`); with `COMMON_RANGES`
    they make `param_ranges`."""
    sorts_batch: bool = False
    """True when the loss's i-th entry is a batch quantile, not pair i (it sorts the pairs of a
    micro-batch: `aot`), so per-pair weights do not apply and one pair a micro-batch makes it
    plain DPO."""
    params: dict[str, Any] = field(init=False)
    """Config keys this loss accepts -> paper defaults (read from `fn`'s and the state's
    signatures)."""
    fn_params: tuple[str, ...] = field(init=False)
    """The keys of `params` that `fn` takes."""
    state_params: tuple[str, ...] = field(init=False)
    """The keys of `params` that `state_factory` takes."""
    param_ranges: dict[str, ParamRange] = field(init=False)
    """Each parameter with a range -> its range."""

    def __post_init__(self) -> None:
        fn_params = _keyword_defaults(
            self.name, self.fn, skip=(*TOKEN_COUNT_ARGS, LABEL_ARG, *self.runtime_params)
        )
        state_params = (
            _keyword_defaults(self.name, self.state_factory) if self.state_factory else {}
        )
        for key in fn_params.keys() & state_params.keys():
            if fn_params[key] != state_params[key]:
                raise TypeError(
                    f"loss {self.name!r}: {key!r} defaults to {fn_params[key]} in the loss "
                    f"and {state_params[key]} in its state"
                )
        params = {**fn_params, **state_params}
        strays = sorted(set(self.ranges) - set(params))
        if strays:
            raise TypeError(f"loss {self.name!r}: a range for {strays}, which it does not take")
        ranges = {k: r for k, r in COMMON_RANGES.items() if k in params}
        object.__setattr__(self, "param_ranges", {**ranges, **self.ranges})
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "fn_params", tuple(fn_params))
        object.__setattr__(self, "state_params", tuple(state_params))


def _keyword_defaults(name: str, fn: Callable, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """`fn`'s keyword-only parameters (except `skip`) -> their defaults.

    Raises:
        TypeError: a keyword-only parameter without a default.
    """
    params = {}
    for arg in inspect.signature(fn).parameters.values():
        if arg.kind is not inspect.Parameter.KEYWORD_ONLY or arg.name in skip:
            continue
        if arg.default is inspect.Parameter.empty:
            raise TypeError(f"loss {name!r}: config parameter {arg.name!r} needs a default")
        params[arg.name] = arg.default
    return params


LOSSES: dict[str, LossSpec] = {}
"""All registered losses by name. Filled when `dpo_megatron.losses` is imported."""


def register_loss(
    name: str,
    *,
    needs_reference: bool,
    state_factory: Callable[[], LossState] | None = None,
    runtime_params: tuple[str, ...] = (),
    uses_rejected: bool = True,
    unpaired: bool = False,
    model_head: str = "lm",
    ranges: Mapping[str, ParamRange] | None = None,
    sorts_batch: bool = False,
) -> Callable[[LossFn], LossFn]:
    """Decorator registering `fn` under `name` in `LOSSES` (the arguments: `LossSpec`'s fields).

    Raises:
        ValueError: `name` is already registered.
    """

    def decorate(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(
                f"loss {name!r} is registered twice ({LOSSES[name].fn.__qualname__}, "
                f"{fn.__qualname__})"
            )
        LOSSES[name] = LossSpec(
            name,
            fn,
            needs_reference,
            state_factory,
            runtime_params,
            uses_rejected,
            unpaired,
            model_head,
            dict(ranges or {}),
            sorts_batch,
        )
        return fn

    return decorate


def parameter_owners() -> dict[str, dict[str, Any]]:
    """Each loss parameter -> {name: default} of the registered losses that take it, by name."""
    owners: dict[str, dict[str, Any]] = {}
    for name in sorted(LOSSES):
        for key, default in LOSSES[name].params.items():
            owners.setdefault(key, {})[name] = default
    return owners


def parameter_lines() -> list[str]:
    """One line per loss parameter (``loss.<parameter>``): its default in each registered loss
    that takes it, the losses grouped by default, and its range, e.g.
    ``loss.rpo_alpha (default 1.0: rpo; range [0.0, inf])``; names in order."""
    lines = []
    for key, owners in sorted(parameter_owners().items()):
        by_default: dict[str, list[str]] = {}
        for name, default in owners.items():
            by_default.setdefault(repr(default), []).append(name)
        defaults = "; ".join(f"{d}: {', '.join(names)}" for d, names in by_default.items())
        ranges = sorted(
            {str(LOSSES[n].param_ranges[key]) for n in owners if key in LOSSES[n].param_ranges}
        )
        span = f"; range {' or '.join(ranges)}" if ranges else ""
        lines.append(f"loss.{key} (default {defaults}{span})")
    return lines


def get_loss_spec(name: str) -> LossSpec:
    """The spec registered under `name`.

    Raises:
        ValueError: unknown name; the message lists the known ones.
    """
    name = canonical_loss_name(name)
    if name not in LOSSES:
        aliases = ", ".join(f"{a} (= {n})" for a, n in sorted(LOSS_ALIASES.items()))
        raise ValueError(
            f"unknown loss.name {name!r}; valid names: {sorted(LOSSES)}; aliases: {aliases}"
        )
    return LOSSES[name]
