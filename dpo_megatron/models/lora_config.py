"""The ``lora.*`` section of the config tree: low-rank adapters on the policy's linear layers.

Imports nothing heavy; the adapters themselves are in :mod:`dpo_megatron.models.lora`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""megatron-core's linear layers an adapter can sit beside: the fused query/key/value and the
first MLP projection (column-parallel), the attention output and the second MLP projection
(row-parallel)."""

EXPERT_TARGETS = ("linear_fc1", "linear_fc2")
"""Targets that also adapt every routed expert of an MoE layer (and a shared expert)."""

EXPORT_MODES = ("none", "merged", "adapter")
"""``checkpoint.export_hf`` values (booleans keep their old meaning: true = merged)."""


def export_mode(value) -> str:
    """``checkpoint.export_hf`` as one of :data:`EXPORT_MODES`.

    ``false`` / ``none`` / empty: no export; ``true`` / ``merged``: the (merged) model as a
    Hugging Face folder; ``adapter``: the LoRA adapters in PEFT's layout. The config stores the
    field as a string, so a YAML ``true`` arrives as ``"True"``.

    Raises:
        ValueError: any other value (naming the valid ones).
    """
    text = str(value).strip().lower()
    aliases = {
        "": "none",
        "false": "none",
        "none": "none",
        "true": "merged",
        "merged": "merged",
        "adapter": "adapter",
    }
    if text not in aliases:
        raise ValueError(f"checkpoint.export_hf={value!r}; valid: false/none, true/merged, adapter")
    return aliases[text]


def check_expert_tensor_parallel(tp: int, etp: int) -> None:
    """Whether adapters on MoE experts can run with expert tensor parallelism ``etp`` beside
    tensor parallelism ``tp``: expert TP 1, or one that divides TP.

    An expert adapter's replicated matrix (A of ``linear_fc1``, B of ``linear_fc2``) is held by
    every rank of the expert-TP group; megatron-core's gradient norm counts such a parameter on
    dense TP rank 0 only (``param_is_not_tensor_parallel_duplicate``). The adapter marks it
    counted on expert-TP rank 0 (:class:`dpo_megatron.models.lora.LoRAAdapter`); the other
    expert-TP ranks are then never dense TP rank 0 only when expert TP divides TP (both groups
    are runs of consecutive ranks).

    Raises:
        ValueError: expert TP > 1 that does not divide TP (naming both fields).
    """
    if etp > 1 and tp % etp:
        raise ValueError(
            f"LoRA on MoE experts with parallel.expert_tensor_parallel_size={etp} and "
            f"parallel.tensor_model_parallel_size={tp}: expert TP must be 1 or divide TP "
            "(megatron-core counts a parameter replicated over an expert's TP ranks in the "
            "gradient norm by the dense TP rank); set expert_tensor_parallel_size=1"
        )


def lora_targets_of(model) -> tuple[str, ...]:
    """The :data:`LORA_TARGETS` a model of ``model`` (a resolved ``ModelConfig``) has: all four,
    but no ``linear_qkv`` with multi-latent attention (``model.kv_lora_rank`` set: DeepSeek-V3),
    whose query and latent key/value projections are separate layers that take no adapter."""
    if getattr(model, "kv_lora_rank", None) is not None:
        return tuple(t for t in LORA_TARGETS if t != "linear_qkv")
    return LORA_TARGETS


def check_targets_of_model(target_modules, model) -> None:
    """Whether ``lora.target_modules`` names at least one layer that the resolved model
    ``model`` has (:func:`lora_targets_of`): checked before any rank starts, as the adapters
    would otherwise match no layer in every rank.

    Raises:
        ValueError: no target exists in this model (naming the ones it has).
    """
    have = lora_targets_of(model)
    if set(target_modules).isdisjoint(have):
        why = (
            f" (multi-latent attention, model.kv_lora_rank={model.kv_lora_rank}, has no linear_qkv)"
            if "linear_qkv" not in have
            else ""
        )
        raise ValueError(
            f"lora.target_modules={list(target_modules)} names no layer of this model{why}; "
            f"its targets: {', '.join(have)}"
        )


@dataclass
class LoraConfig:
    """LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): each targeted
    linear layer W gets a trainable update ``(alpha / rank) * B A`` (eq. 3, with the scaling of
    sec. 4.1); W and everything else stay frozen. B starts at zero, so the step-0 policy is the
    base model, and the frozen base doubles as the reference model (no second copy)."""

    enabled: bool = False
    """Train adapters instead of the full model."""
    rank: int = 16
    """r, the inner dimension of B [out, r] and A [r, in]."""
    alpha: float = 32.0
    """The update is scaled by alpha / rank (PEFT's ``lora_alpha``)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (training passes only; PEFT's ``lora_dropout``)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Layers that get adapters, by megatron-core name: any of linear_qkv, linear_proj,
    linear_fc1, linear_fc2 (every transformer layer's; in an MoE layer linear_fc1 / linear_fc2
    adapt every routed expert and the shared expert, each expert its own A and B)."""

    def validate(
        self, *, loss: dict, loss_reads_reference: bool, reference, model, export_hf, parallel=None
    ) -> None:
        """Reject LoRA settings that cannot run, before any rank starts.

        Args:
            loss: the ``loss`` section (named in the messages).
            loss_reads_reference: whether the run's loss reads the reference (the loss
                object's ``needs_reference``; the config passes it, the models floor builds
                no loss).
            reference: the ``reference`` section.
            model: the ``model`` section (the layer implementation).
            export_hf: ``checkpoint.export_hf``.
            parallel: the ``parallel`` section (expert TP against TP), or None (not checked).

        Raises:
            ValueError: an unknown target module, rank <= 0, alpha <= 0, dropout outside [0, 1),
                ``export_hf=adapter`` without LoRA, ``reference.offload`` or a reference of its
                own (``reference.hf_path`` / ``reference.load``) with LoRA (the reference is the
                policy's own base weights: there is no copy to offload or to replace), a
                loss that reads no reference with ``reference.mode=precomputed`` (with LoRA the
                base is the reference only for losses that read one; nothing to precompute),
                transformer-engine layers (adapters attach to megatron-core's local layers), or
                MoE experts targeted with an expert TP that does not divide TP
                (:func:`check_expert_tensor_parallel`).
        """
        mode = export_mode(export_hf)
        if not self.enabled:
            if mode == "adapter":
                raise ValueError(
                    "checkpoint.export_hf=adapter writes LoRA adapters: set "
                    "lora.enabled=true, or export_hf=merged for the full model"
                )
            return
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        if unknown or not self.target_modules:
            raise ValueError(
                f"lora.target_modules={list(self.target_modules)}: "
                f"{'unknown ' + ', '.join(unknown) if unknown else 'empty'}; "
                f"valid: {', '.join(LORA_TARGETS)}"
            )
        if self.rank <= 0:
            raise ValueError(f"lora.rank={self.rank} must be >= 1")
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha={self.alpha} must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout={self.dropout} must be in [0, 1)")
        if reference.offload:
            raise ValueError(
                "reference.offload=true with lora.enabled=true: the reference is "
                "the policy's own frozen base weights, there is no reference copy "
                "to offload; drop reference.offload"
            )
        if reference.weights():
            key = reference.weights_key()
            raise ValueError(
                f"{key}={reference.weights()} with lora.enabled=true: a LoRA run's reference is "
                "the policy's own base with the adapters off (no second model is built); drop "
                f"{key}, or train without LoRA against that reference"
            )
        if not loss_reads_reference and reference.mode == "precomputed":
            raise ValueError(
                f"reference.mode=precomputed with lora.enabled=true and loss "
                f"{loss.get('name')!r}, which reads no reference: there is nothing "
                "to precompute (LoRA's base is the reference only for losses that "
                "read one); drop reference.mode"
            )
        from dpo_megatron.models.transformer_config import use_transformer_engine

        if use_transformer_engine(model.transformer_impl):
            raise ValueError(
                "lora.enabled=true attaches adapters to megatron-core's local "
                "ColumnParallelLinear / RowParallelLinear layers (transformer-"
                "engine fuses the norm into linear_qkv / linear_fc1, so the "
                "adapter would see the un-normalised input): set "
                "model.transformer_impl=local"
            )
        experts = model.num_experts and set(self.target_modules) & set(EXPERT_TARGETS)
        if experts and parallel is not None:
            check_expert_tensor_parallel(
                parallel.tensor_model_parallel_size, parallel.expert_tensor_parallel()
            )
