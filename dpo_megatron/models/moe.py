"""Mixture of experts: megatron-core's MoE layer, with the router's load-balancing loss weighted
for this engine's gradient normalisation, and the read-out of that loss for the step's log.

The layer itself is megatron-core's (``MoELayer``: top-k router, token dispatcher, experts run
one after another by ``SequentialMLP``); the layer spec (``models.specs``) only swaps the router
class for :class:`DPOTopKRouter`.

**The load-balancing loss.** Switch Transformer (Fedus et al. 2021, eq. 4), as transformers
computes it for Mixtral / Qwen3-MoE: per layer, ``LB = E * sum_e f_e P_e`` with ``f_e`` the
fraction of the k routing choices of the micro-batch's real (non-padding) tokens that go to
expert e, times k (transformers counts every choice), and ``P_e`` the mean router probability of
expert e. megatron-core computes ``LB / k`` per layer and micro-batch; its coefficient is set to
``coeff * k / num_layers`` (:func:`megatron_aux_loss_coeff`) so that the term added to the
objective is::

    coeff * mean over the step's micro-batches of  mean over layers of  LB(micro-batch, layer)

(transformers concatenates the router logits of all layers before taking ``f`` and ``P``; that
form does not split over pipeline stages, so the per-layer mean replaces it; the two agree for a
one-layer model). ``coeff`` is ``model.moe_aux_loss_coeff``.

megatron-core adds the term to the gradient through ``MoEAuxLossAutoScaler`` (a backward hook on
the routing probabilities), on every pipeline stage. With ``calculate_per_token_loss`` it weights
each micro-batch's term by its local token count, because its language-model loss is divided by
the global token count. This engine divides every gradient by the step's global *pair* count
(``dpo_megatron.training.step``), so :class:`DPOTopKRouter` weights each micro-batch's term by its
pairs instead: after the division the term is the mean above, on every layout (under sequence
parallelism every TP rank's share of a micro-batch gets the same weight, so the shares add up to
the micro-batch's loss exactly).

The preference loss, its metrics and the reference model never see this term: the reference
runs forward-only (megatron-core computes no auxiliary loss without gradients), and the term is
reported on its own (:func:`load_balancing_metrics`).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
    reduce_aux_losses_tracker_across_ranks,
    save_to_aux_losses_tracker,
)
from megatron.core.transformer.moe.router import TopKRouter

from dpo_megatron.models.config import ModelConfig

TRACKED = "load_balancing_loss"
"""megatron-core's name for the per-layer load-balancing loss in its logging tracker."""


def megatron_aux_loss_coeff(model: ModelConfig) -> float:
    """megatron-core's per-layer ``moe_aux_loss_coeff`` for ``model.moe_aux_loss_coeff`` (see the
    module docstring: ``coeff * k / num_layers``); 0 when off or not an MoE model."""
    coeff = model.moe_aux_loss_coeff or 0.0
    if not model.num_experts or coeff == 0.0:
        return 0.0
    return coeff * model.moe_router_topk / model.num_layers


class DPOTopKRouter(TopKRouter):
    """megatron-core's ``TopKRouter`` whose load-balancing loss is attached with weight
    :attr:`aux_loss_weight` (the micro-batch's pairs; set by ``ScoringGPTModel.forward``) instead of
    the micro-batch's local token count. Routing itself is unchanged (softmax, top-k, optional
    renormalisation).
    """

    aux_loss_weight: float = 1.0
    """What the step's final gradient division counts this micro-batch as (its pairs)."""

    def attach_and_log_load_balancing_loss(
        self,
        activation: torch.Tensor,
        aux_loss_coeff: float,
        aux_loss: torch.Tensor,
        aux_loss_name: str,
        reduce_group,
        reduce_group_has_dp: bool = False,
        valid_token_count=None,
    ) -> torch.Tensor:
        """Record ``aux_loss / aux_loss_coeff`` for logging (megatron-core's tracker) and attach
        ``aux_loss * aux_loss_weight`` to ``activation``'s backward. ``valid_token_count`` (the
        per-token weight megatron-core would use) is ignored."""
        num_layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
        save_to_aux_losses_tracker(
            aux_loss_name,
            aux_loss / aux_loss_coeff,
            self.layer_number,
            num_layers,
            reduce_group=reduce_group,
            reduce_group_has_dp=reduce_group_has_dp,
        )
        return MoEAuxLossAutoScaler.apply(activation, aux_loss * self.aux_loss_weight)


def set_aux_loss_weight(model: torch.nn.Module, weight: float) -> None:
    """Give every :class:`DPOTopKRouter` of ``model`` the weight of the micro-batch about to run
    (constant within a step: every micro-batch holds ``micro_batch_size`` items)."""
    routers = getattr(model, "_dpo_routers", None)
    if routers is None:
        routers = [m for m in model.modules() if isinstance(m, DPOTopKRouter)]
        model._dpo_routers = routers
    for router in routers:
        router.aux_loss_weight = weight


def load_balancing_metrics(config, num_micro_batches: int) -> dict[str, float]:
    """The step's load-balancing loss, reduced over every rank, then the tracker cleared.

    Collective over the world (megatron-core's tracker reduction: pipeline, TP, data-parallel
    groups); call it on every rank after a training step's schedule.

    Args:
        config: the policy's megatron-core ``TransformerConfig`` (experts, top-k, layers and the
            per-layer coefficient of :func:`megatron_aux_loss_coeff`).
        num_micro_batches: micro-batches of this data-parallel rank in the step (the same on
            every data-parallel rank).

    Returns:
        ``moe/load_balancing_loss`` (LB of the module docstring, mean over micro-batches and
        layers; 1.0 for perfectly balanced routing) and ``moe/aux_loss`` (``coeff`` times it:
        the term the gradient contains). Empty when the model has no MoE layers or the
        coefficient is 0 (megatron-core then computes nothing).
    """
    tracker = get_moe_layer_wise_logging_tracker()
    coeff = config.moe_aux_loss_coeff if config.num_moe_experts else 0.0
    if not coeff or TRACKED not in tracker:
        return {}
    reduce_aux_losses_tracker_across_ranks([TRACKED])
    # Each layer's entry sums megatron-core's LB / k over this rank's micro-batches.
    per_layer_sum = float(tracker[TRACKED]["values"].sum().item())
    clear_aux_losses_tracker()
    return {
        "moe/load_balancing_loss": per_layer_sum
        * config.moe_router_topk
        / config.num_layers
        / num_micro_batches,
        "moe/aux_loss": coeff * per_layer_sum / num_micro_batches,
    }


def moe_needs_sequence_parallel(model: ModelConfig, tensor_model_parallel_size: int) -> bool:
    """True for a mixture-of-experts model at TP > 1: megatron-core's MoE layer refuses to train
    with tensor parallelism but without sequence parallelism."""
    return bool(model.num_experts) and tensor_model_parallel_size > 1


def check_moe(
    model: ModelConfig,
    expert_model_parallel_size: int,
    expert_tensor_parallel_size: int,
    tensor_model_parallel_size: int,
    sequence_parallel: bool,
) -> int | None:
    """The expert width, after checking the MoE fields against the layout.

    Returns:
        moe_ffn_hidden_size (None for a dense model).

    Raises:
        ValueError: expert parallelism without experts, experts not divisible by EP, expert
            width not divisible by expert TP, experts copied over TP ranks (EP x expert TP not
            a multiple of TP), expert biases split over expert TP, top-k out of range, an
            unknown dispatcher, or
            TP > 1 without sequence parallelism (megatron-core's MoE layer refuses to train so).
    """
    ep, etp = expert_model_parallel_size, expert_tensor_parallel_size
    if not model.num_experts:
        if ep > 1:
            raise ValueError(
                f"parallel.expert_model_parallel_size={ep} needs a mixture-of-experts "
                "model (model.num_experts)"
            )
        return None
    experts, topk = model.num_experts, model.moe_router_topk
    if experts % ep:
        raise ValueError(
            f"model has {experts} experts, not divisible by "
            f"parallel.expert_model_parallel_size={ep}"
        )
    if not 1 <= topk <= experts:
        raise ValueError(
            f"model.moe_router_topk={topk} must be in [1, model.num_experts={experts}]"
        )
    if topk == 1 and model.moe_norm_topk_prob:
        raise ValueError(
            "model.moe_router_topk=1 with model.moe_norm_topk_prob=true gives every "
            "token weight 1; megatron-core's top-1 router weights by the softmax "
            "probability: set model.moe_norm_topk_prob=false"
        )
    width = model.moe_ffn_hidden_size or model.ffn_hidden_size
    if width % etp:
        raise ValueError(
            f"expert width {width} (model.moe_ffn_hidden_size) is not divisible by "
            f"parallel.expert_tensor_parallel_size={etp}"
        )
    tp = tensor_model_parallel_size
    if tp > 1 and (ep * etp) % tp:
        # Each expert then has copies on several TP ranks of a stage (its expert data-parallel
        # peers): measured, Qwen3-MoE and gpt-oss at TP 2 x PP 2 with EP 1 and expert TP 1
        # match one rank at step 1 and drift from it from step 2 on (1e-3 in the loss), while
        # EP 2 or expert TP 2 match to 1e-7.
        raise ValueError(
            f"parallel.expert_model_parallel_size={ep} x parallel.expert_tensor_parallel_size="
            f"{etp} is not a multiple of parallel.tensor_model_parallel_size={tp}: experts "
            "copied over TP ranks train differently from one rank here; raise the expert "
            "parallel size (or the expert TP size) to a multiple of the TP size"
        )
    if model.add_bias_linear and etp > 1:
        # megatron-core 0.16's expert fc2 (RowParallelLinear, explicit expert communication)
        # hands its bias to the MLP, which adds it on every expert-TP rank before the
        # dispatcher sums their partial outputs: the bias would count etp times.
        raise ValueError(
            f"model.add_bias_linear=true (experts with biases, gpt-oss) with parallel."
            f"expert_tensor_parallel_size={etp}: megatron-core adds an expert's output bias on "
            "every expert-TP rank; set parallel.expert_tensor_parallel_size=1 (and "
            "parallel.expert_model_parallel_size to a multiple of the TP size)"
        )
    if model.moe_token_dispatcher not in ("alltoall", "allgather"):
        raise ValueError(
            f"model.moe_token_dispatcher must be alltoall or allgather, got "
            f"{model.moe_token_dispatcher!r}"
        )
    if moe_needs_sequence_parallel(model, tensor_model_parallel_size) and not sequence_parallel:
        raise ValueError(
            "a mixture-of-experts model at parallel.tensor_model_parallel_size="
            f"{tensor_model_parallel_size} needs parallel.sequence_parallel=true "
            "(megatron-core's MoE layer refuses to train with TP but without it)"
        )
    if (model.moe_aux_loss_coeff or 0.0) < 0:
        raise ValueError(f"model.moe_aux_loss_coeff={model.moe_aux_loss_coeff} must be >= 0")
    check_deepseek_routing(model)
    return width


def check_deepseek_routing(model: ModelConfig) -> None:
    """DeepSeek-V3's routing options against what megatron-core's router computes.

    Raises:
        ValueError: sigmoid scores without renormalised top-k (megatron-core always renormalises
            them), an expert bias with softmax scores, expert groups that do not divide the
            experts or whose per-group ranking is not DeepSeek's top-2 sum (megatron-core ranks
            a group by its top ``topk / group_topk`` scores), dense first layers covering every
            layer, or a load-balancing loss with dense layers (its layer average counts MoE
            layers only in transformers' terms, not wired here).
    """
    experts, topk = model.num_experts, model.moe_router_topk
    if model.moe_router_score_function == "sigmoid" and topk > 1 and not model.moe_norm_topk_prob:
        raise ValueError(
            "model.moe_router_score_function=sigmoid with model.moe_norm_topk_prob=false: "
            "megatron-core renormalises the top-k sigmoid scores (DeepSeek-V3 norm_topk_prob="
            "true); set model.moe_norm_topk_prob=true"
        )
    if model.moe_router_expert_bias and model.moe_router_score_function != "sigmoid":
        raise ValueError(
            "model.moe_router_expert_bias=true needs model.moe_router_score_function=sigmoid"
        )
    groups, group_topk = model.moe_router_num_groups, model.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise ValueError(
            "model.moe_router_num_groups and model.moe_router_group_topk are set together"
        )
    if groups is not None:
        if experts % groups or not 1 <= group_topk <= groups:
            raise ValueError(
                f"model.moe_router_num_groups={groups} must divide model.num_experts={experts} "
                f"and model.moe_router_group_topk={group_topk} be in [1, {groups}]"
            )
        if topk // group_topk != 2 or experts // groups < 2:
            raise ValueError(
                f"model.moe_router_topk={topk} / model.moe_router_group_topk={group_topk}: "
                "megatron-core ranks each expert group by the sum of its top "
                f"{topk // group_topk} scores, DeepSeek-V3 by its top 2; only topk // "
                "group_topk == 2 (with at least 2 experts a group) computes the same routing"
            )
    dense = model.moe_first_dense_layers
    if dense >= model.num_layers:
        raise ValueError(
            f"model.moe_first_dense_layers={dense} must be below model.num_layers="
            f"{model.num_layers} (a model without MoE layers has model.num_experts=null)"
        )
    if dense and (model.moe_aux_loss_coeff or 0.0) > 0:
        raise ValueError(
            f"model.moe_aux_loss_coeff={model.moe_aux_loss_coeff} with "
            f"model.moe_first_dense_layers={dense}: the load-balancing loss is averaged over "
            "every layer here, not over the MoE layers; set model.moe_aux_loss_coeff=0"
        )
