"""Tensor-parallel LoRA adapters beside megatron-core's linear layers, attached after the model is
built (no layer spec is forked), and merged back for export.

LoRA (Hu et al. 2021, eq. 3) replaces ``h = W x`` by ``h = W x + (alpha / r) B A x`` with W frozen,
A [r, in] and B [out, r] trained, B = 0 at the start. On megatron-core's parallel layers the
adapter is sharded like its base weight, so no rank ever holds a full-size matrix
(PEFT's ``LoraParallelLinear`` and Megatron-Bridge's ``ParallelLinearAdapter`` shard the same way):

* **column-parallel** (``linear_qkv``, ``linear_fc1``; W split along its output): A replicated,
  B split along the output like W. ``x A^T`` [s, b, r] is the same on every TP rank; its
  backward sums the partial ``dY_r B_r`` of all ranks (``copy_to_tensor_model_parallel_region``:
  identity forward, all-reduce backward), so the gradients of A and x are complete on every rank.
  Under sequence parallelism x is this rank's slice of the sequence: ``x A^T`` is all-gathered
  along the sequence (reduce-scatter backward) and A's gradient, a partial sum over the
  sequence, is marked ``sequence_parallel`` so that megatron-core's ``finalize_model_grads``
  all-reduces it over TP, as it does for norm weights.
* **row-parallel** (``linear_proj``, ``linear_fc2``; W split along its input): A split along the
  input like W, B replicated. The partial ``x_r A_r^T`` are summed over TP exactly like the base
  layer's output (all-reduce, or reduce-scatter under sequence parallelism, where B's gradient
  is then marked ``sequence_parallel``).

The update is computed in a forward hook of the base layer and added to its output, so the base
layer keeps its class, its parameter names and its own communication; the adapter module sits
beside it in the same parent (``linear_qkv`` -> ``linear_qkv_lora``), where megatron-core's
``sharded_state_dict`` recursion finds it: adapters are saved and resharded by the same
distributed checkpointing as the weights (B of a gated ``linear_fc1`` with megatron-core's
SwiGLU factory, like the weight, so [gate_r; up_r] shards reshard across TP).

Adapters are found by module name (``lora.target_modules``) in every chunk after it is built,
so pipeline / virtual pipeline chunks, activation recompute and any layer that uses these
megatron-core classes under these names (the routed experts of megatron-core's
``SequentialMLP``, shared experts, dense MLPs) get them without a special case.

MoE experts (``is_expert``): megatron-core's token dispatcher does an expert layer's TP
communication (``explicit_expert_comm``): under expert tensor parallelism (ETP) the input of
``linear_fc1`` is the same on the ETP ranks, the input gradient and the output of
``linear_fc2`` are partial sums that the dispatcher reduces. The adapter follows: no
communication of activations; its replicated matrix (A of fc1, B of fc2) gets a gradient that is
a partial sum over the ETP ranks, all-reduced over them in backward
(``copy_to_tensor_model_parallel_region`` on the parameter). Expert adapters reduce over the
expert data-parallel group like the expert weights, and are saved under their global expert
index (megatron-core's ``SequentialMLP.sharded_state_dict``), so checkpoints reshard across EP.

Initialisation is layout-independent: A (Kaiming-uniform with a = sqrt(5), PEFT's default) is
drawn in full from a generator seeded by ``train.seed`` and the layer's global name (global
layer index and, in an MoE layer, global expert index: never the rank's local index or RNG
state), and each TP rank keeps its slice; so every layout (TP, PP, EP, expert TP) trains the
same adapters. With zero-padded attention heads
(``model.pad_attention_heads``) the columns of ``linear_proj``'s A that read padded heads are
zero: padded heads then stay exactly zero through training and drop out on export.
"""

from __future__ import annotations

import contextlib
import math
import weakref
import zlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from megatron.core.utils import get_pg_rank, get_pg_size

from dpo_megatron.models.lora_config import (
    LoraConfig,
    check_expert_tensor_parallel,
    check_targets_of_model,
    lora_targets_of,
)
from dpo_megatron.utils.modules import unwrap

ADAPTER_SUFFIX = "_lora"
"""An adapter of ``<parent>.linear_qkv`` is the module ``<parent>.linear_qkv_lora``."""
_PARALLEL_MODE = {
    "linear_qkv": "column",
    "linear_fc1": "column",
    "linear_proj": "row",
    "linear_fc2": "row",
}
_LAYER_CLASS = {"column": ColumnParallelLinear, "row": RowParallelLinear}


class LoRAAdapter(torch.nn.Module):
    """The low-rank update of one megatron-core parallel linear layer.

    Args:
        base: the ``ColumnParallelLinear`` / ``RowParallelLinear`` it adapts (frozen).
        parallel_mode: ``"column"`` or ``"row"``.
        rank, alpha, dropout: ``lora.*``.
        gated: the base is a gated ``linear_fc1`` ([gate; up] fused): B shards like its weight.
        name: the base layer's global name (``decoder.layers.<global i>...``): with the seed, it
            keys the initialisation.
        zero_input_from: global input index from which A's columns stay zero (the inputs of
            zero-padded attention heads), or None.

    Parameters (this TP rank's shards, base dtype and device):
        lora_a: column [r, in]; row [r, in / TP].
        lora_b: column [out / TP, r]; row [out, r].

    ``forward(x)`` is the update for the base layer's input x ([s, b, in] column, [s, b, in/TP]
    row; the sequence dim divided by TP under sequence parallelism), shaped like the base output
    before its bias: column [s, b, out/TP]; row [s(/TP), b, out].
    """

    def __init__(
        self,
        base: torch.nn.Module,
        parallel_mode: str,
        rank: int,
        alpha: float,
        dropout: float,
        gated: bool = False,
        name: str = "",
        zero_input_from: int | None = None,
    ):
        super().__init__()
        if getattr(base, "gather_output", False):
            raise ValueError(
                "LoRA on a ColumnParallelLinear with gather_output=True is not "
                "supported (megatron-core's transformer layers never gather)"
            )
        self.parallel_mode = parallel_mode
        self.rank, self.scaling, self.dropout, self.gated = rank, alpha / rank, dropout, gated
        self.global_name, self.zero_input_from = name, zero_input_from
        self.tp_group = base.tp_group  # an expert's: the expert tensor-parallel group
        self.tp_size, self.tp_rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
        # Expert layers leave TP communication to the token dispatcher (explicit_expert_comm).
        self.expert = bool(getattr(base, "is_expert", False))
        self.explicit_comm = bool(getattr(base, "explicit_expert_comm", False))
        self.sequence_parallel = base.sequence_parallel and self.tp_size > 1 and not self.expert
        self._base = weakref.ref(base)  # not a submodule: its weights keep their names
        self.enabled = True
        out_local, in_local = base.weight.shape
        column = parallel_mode == "column"
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.in_features = in_local * (1 if column else self.tp_size)
        self.out_features = out_local * (self.tp_size if column else 1)
        self.lora_a = torch.nn.Parameter(torch.zeros(rank, in_local, **like))
        self.lora_b = torch.nn.Parameter(torch.zeros(out_local, rank, **like))
        split, replicated = (self.lora_b, self.lora_a) if column else (self.lora_a, self.lora_b)
        set_tensor_model_parallel_attributes(split, True, 0 if column else 1, 1)
        if self.expert:
            # megatron-core's gradient norm counts an unmarked parameter on dense TP rank 0 only;
            # an expert's replicated matrix belongs to this EP rank's experts, so it is counted on
            # expert-TP rank 0 (with expert TP dividing TP, the other ETP ranks are not TP rank 0).
            set_tensor_model_parallel_attributes(replicated, self.tp_rank == 0, 0, 1)
        # Partial over the sequence slices under sequence parallelism: finalize_model_grads
        # all-reduces parameters marked so over TP.
        setattr(replicated, "sequence_parallel", self.sequence_parallel)
        for p in (self.lora_a, self.lora_b):  # expert-parallel params reduce over their own DP
            setattr(p, "allreduce", getattr(base.weight, "allreduce", True))
        self.hook = base.register_forward_hook(self._add_update)

    @property
    def base(self) -> torch.nn.Module:
        return self._base()

    # ------------------------------------------------------------------------------------------
    # initialisation

    @torch.no_grad()
    def reset_parameters(self, seed: int, b_std: float = 0.0) -> None:
        """Draw A (and B) in full from a generator keyed by ``seed`` and the layer's global
        name, and keep this rank's shard: the same adapters at every layout.

        Args:
            b_std: B ~ N(0, b_std^2) instead of zeros (an adapter that already changes the
                model, for tests).
        """
        key = zlib.crc32(self.global_name.encode())
        g = torch.Generator().manual_seed((seed * 1_000_003 + key) % 2**63)
        bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)) as in PEFT
        a = torch.empty(self.rank, self.in_features).uniform_(-bound, bound, generator=g)
        if self.zero_input_from is not None:
            a[:, self.zero_input_from :] = 0
        b = torch.empty(self.out_features, self.rank).normal_(0.0, 1.0, generator=g) * b_std
        self.lora_a.copy_(self._local(a, dim=1) if self.parallel_mode == "row" else a)
        self.lora_b.copy_(self._local(b, dim=0) if self.parallel_mode == "column" else b)

    def _local(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This TP rank's shard of a full adapter matrix along ``dim`` (a gated fc1's output is
        [gate; up] in full and [gate_r; up_r] per rank)."""
        if self.gated and dim == 0:
            return torch.cat(
                [h.chunk(self.tp_size, dim=0)[self.tp_rank] for h in full.chunk(2, dim=0)]
            )
        return full.chunk(self.tp_size, dim=dim)[self.tp_rank]

    # ------------------------------------------------------------------------------------------
    # forward

    def _add_update(self, module, args, output):
        """Forward hook of the base layer: (out, bias) -> (out + update, bias)."""
        if not self.enabled:
            return None
        out, bias = output
        return out + self(args[0]), bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._dropout(x)
        if self.explicit_comm:
            return self._expert_update(x)
        h = F.linear(x, self.lora_a)
        if self.parallel_mode == "column":
            if self.sequence_parallel:
                h = gather_from_sequence_parallel_region(
                    h, tensor_parallel_output_grad=True, group=self.tp_group
                )
            elif self.tp_size > 1:
                h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        elif self.sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
        elif self.tp_size > 1:
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return F.linear(h, self.lora_b) * self.scaling

    def _expert_update(self, x: torch.Tensor) -> torch.Tensor:
        """An expert layer's update, communicating as the expert layer does (not at all: the
        token dispatcher gathers the ETP ranks' tokens before fc1 and reduces fc2's partial
        outputs after it). Column: ``B_r (A x)`` with x the same on every ETP rank; row:
        ``B (A_r x_r)``, a partial sum like the base output. The replicated matrix's gradient
        (``dY_r B_r``-weighted for A, ``A_r x_r``-weighted for B) is partial on each ETP rank:
        all-reduced over the ETP group in backward, the input's is left partial for the
        dispatcher to sum, as the base layer's is."""
        a, b = self.lora_a, self.lora_b
        if self.tp_size > 1:
            if self.parallel_mode == "column":
                a = copy_to_tensor_model_parallel_region(a, group=self.tp_group)
            else:
                b = copy_to_tensor_model_parallel_region(b, group=self.tp_group)
        return F.linear(F.linear(x, a), b) * self.scaling

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """PEFT's ``lora_dropout`` on the adapter input. An input that is the same on every TP
        rank (column layer) uses the default generator, the same on all of them; a partitioned
        one (row layer, or sequence-parallel slices) megatron-core's model-parallel generator,
        which differs per TP rank (as megatron-core does for its own dropouts)."""
        if not self.training or self.dropout == 0.0:
            return x
        partitioned = self.parallel_mode == "row" or self.sequence_parallel
        fork = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if partitioned
            else contextlib.nullcontext()
        )
        with fork:
            return F.dropout(x, self.dropout, training=True)

    # ------------------------------------------------------------------------------------------
    # merge and checkpoint

    def delta_weight(self) -> torch.Tensor:
        """(alpha / r) B A: this rank's shard of the weight update, shaped like the base weight
        shard ([out/TP, in] column, [out, in/TP] row)."""
        return (self.lora_b @ self.lora_a) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """W + (alpha / r) B A for this rank's shard (the base weight is left unchanged)."""
        w = self.base.weight
        return (w.float() + self.delta_weight().float()).to(w.dtype)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """megatron-core distributed-checkpoint entries: the split matrix along its TP axis (a
        gated fc1's B through the SwiGLU factory), the replicated one once."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        axis = {"lora_b": 0} if self.parallel_mode == "column" else {"lora_a": 1}
        sharded = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            axis,
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )
        if self.gated:
            key = f"{prefix}lora_b"
            sharded[key] = apply_swiglu_sharded_factory(
                sharded[key], sharded_offsets, metadata.get("singleton_local_shards", False)
            )
        return sharded

    def extra_repr(self) -> str:
        return (
            f"{self.parallel_mode}, in={self.in_features}, out={self.out_features}, "
            f"rank={self.rank}, scaling={self.scaling:g}, TP={self.tp_size}"
        )


# ----------------------------------------------------------------------------------------------
# attaching


def global_module_name(model: torch.nn.Module, name: str) -> str:
    """``decoder.layers.<local i>.rest`` -> ``decoder.layers.<global i>.rest`` (megatron-core's
    1-based ``layer_number`` counts pipeline and virtual stages), and in an MoE layer
    ``mlp.experts.local_experts.<local j>`` -> ``...local_experts.<global e>`` (the MoE layer's
    ``local_expert_indices``: EP rank k holds experts ``k * E/EP + j``): the same name for the
    same layer at every TP x PP x EP layout."""
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["decoder", "layers"]:
        layer = model.decoder.layers[int(parts[2])]
        parts[2] = str(layer.layer_number - 1)
        if len(parts) > 6 and parts[3:6] == ["mlp", "experts", "local_experts"]:
            parts[6] = str(layer.mlp.local_expert_indices[int(parts[6])])
    return ".".join(parts)


def _padded_head_inputs(model_cfg, tp_size: int) -> int | None:
    """First input column of ``linear_proj`` that reads a zero-padded head, or None."""
    from dpo_megatron.models.transformer_config import attention_heads

    heads, _, head_dim = attention_heads(model_cfg, tp_size)
    real = model_cfg.num_attention_heads
    return real * head_dim if heads > real else None


def attach_lora(chunks: list, lora: LoraConfig, model_cfg, seed: int) -> list[LoRAAdapter]:
    """Freeze every parameter of ``chunks`` and put an adapter beside each targeted layer.

    Call after the weights are loaded and before DDP wrapping (megatron-core DDP and optimizer
    then hold only the adapters). With ``recompute_granularity=full`` the embedding output is
    made to require grad: a checkpointed block whose input needs no gradient would return an
    output that needs none, and its adapters would get no gradient.

    Returns:
        the adapters, in module order.

    Raises:
        ValueError: a targeted name is not a megatron-core Column/RowParallelLinear (e.g. a
            transformer-engine layer), a chunk with transformer layers got no adapter, or an
            MoE expert layer whose expert tensor parallelism does not divide TP
            (:func:`~dpo_megatron.models.lora_config.check_expert_tensor_parallel`).
    """
    adapters = []
    for chunk in chunks:
        model = unwrap(chunk)
        if any(isinstance(m, LoRAAdapter) for m in model.modules()):
            raise ValueError("LoRA adapters are already attached to this model")
        for p in model.parameters():
            p.requires_grad_(False)
        found = 0
        for name, layer in list(model.named_modules()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in lora.target_modules:
                continue
            mode = _PARALLEL_MODE[leaf]
            if not isinstance(layer, _LAYER_CLASS[mode]):
                raise ValueError(
                    f"lora.target_modules: {name} is a {type(layer).__name__}; adapters attach "
                    f"to megatron-core's {_LAYER_CLASS[mode].__name__} (set "
                    "model.transformer_impl=local)"
                )
            if getattr(layer, "is_expert", False):
                check_expert_tensor_parallel(
                    model.config.tensor_model_parallel_size, get_pg_size(layer.tp_group)
                )
            gated = leaf == "linear_fc1" and layer.config.gated_linear_unit
            zero_from = (
                _padded_head_inputs(model_cfg, get_pg_size(layer.tp_group))
                if leaf == "linear_proj"
                else None
            )
            adapter = LoRAAdapter(
                layer,
                mode,
                lora.rank,
                lora.alpha,
                lora.dropout,
                gated,
                global_module_name(model, name),
                zero_from,
            )
            adapter.reset_parameters(seed)
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            parent.add_module(leaf + ADAPTER_SUFFIX, adapter)
            adapters.append(adapter)
            found += 1
        if not found and len(getattr(getattr(model, "decoder", None), "layers", [])):
            check_targets_of_model(lora.target_modules, model_cfg)  # names the reason
            raise ValueError(
                f"lora.target_modules={list(lora.target_modules)} matched no layer "
                f"of this model (its targets: {', '.join(lora_targets_of(model_cfg))})"
            )
        if model.config.recompute_granularity == "full" and getattr(model, "pre_process", False):
            model.embedding.register_forward_hook(_input_requires_grad)
    return adapters


def _input_requires_grad(module, args, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.requires_grad_()
    return None


def reset_adapters(chunks: list, seed: int, b_std: float = 0.0) -> None:
    """Re-draw every adapter (:meth:`LoRAAdapter.reset_parameters`); ``b_std`` > 0 gives
    adapters that already change the model (B = 0 otherwise)."""
    for chunk in chunks:
        for _, adapter in adapters(chunk):
            adapter.reset_parameters(seed, b_std)


def adapters(chunk: torch.nn.Module) -> Iterator[tuple[str, LoRAAdapter]]:
    """(local module name, adapter) of one chunk (DDP-wrapped or not), in module order."""
    for name, module in unwrap(chunk).named_modules():
        if isinstance(module, LoRAAdapter):
            yield name, module


def has_adapters(chunks: list) -> bool:
    return any(True for c in chunks for _ in adapters(c))


@contextlib.contextmanager
def adapters_disabled(chunks: list):
    """Within the block the chunks compute the base model: every adapter is bypassed."""
    found = [a for c in chunks for _, a in adapters(c)]
    previous = [a.enabled for a in found]
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a, was in zip(found, previous):
            a.enabled = was


@torch.no_grad()
def merge_adapters(chunks: list) -> None:
    """Fold every adapter into its base weight (W <- W + (alpha / r) B A) and remove it: the
    chunks become a plain dense model computing what the adapted one computed."""
    for chunk in chunks:
        model = unwrap(chunk)
        for name, adapter in list(adapters(model)):
            adapter.base.weight.copy_(adapter.merged_weight())
            adapter.hook.remove()
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            delattr(parent, name.rsplit(".", 1)[-1])


def adapter_parameter_ids(chunk: torch.nn.Module) -> set[int]:
    """ids of the adapter parameters of a chunk (to tell them from base weights)."""
    return {id(p) for _, a in adapters(chunk) for p in a.parameters()}


def adapters_by_base_weight(chunk: torch.nn.Module) -> dict[int, LoRAAdapter]:
    """id(base weight) -> its adapter, for one chunk."""
    return {id(a.base.weight): a for _, a in adapters(chunk)}


def is_adapter_key(key: str) -> bool:
    """Whether a (sharded) state-dict key belongs to an adapter."""
    module, _, param = key.rpartition(".")
    return param in ("lora_a", "lora_b") and module.endswith(ADAPTER_SUFFIX)


class AdapterCheckpoint:
    """A LoRA policy chunk as a training checkpoint sees it: its adapters only.

    It answers the two calls ``checkpointing.training_checkpoint`` makes on a chunk
    (``sharded_state_dict()`` and ``load_state_dict()``), so a LoRA checkpoint holds adapters
    and their optimizer state and no base weights (these come from the run's weights source
    again on resume).
    """

    def __init__(self, chunk: torch.nn.Module):
        self._chunk = chunk  # not ``module``: the checkpoint code unwraps ``.module`` chains

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        full = unwrap(self._chunk).sharded_state_dict(prefix, sharded_offsets, metadata)
        return {k: v for k, v in full.items() if is_adapter_key(k)}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Load adapter tensors; with ``strict``, exactly this chunk's adapters must be given.

        Raises:
            KeyError: missing or unexpected adapter keys (e.g. other target modules or rank).
        """
        model = unwrap(self._chunk)
        wanted = {k for k in model.state_dict() if is_adapter_key(k)}
        missing, unexpected = sorted(wanted - set(state)), sorted(set(state) - wanted)
        if strict and (missing or unexpected):
            raise KeyError(
                f"LoRA checkpoint does not match the model's adapters: missing "
                f"{missing[:4]}, unexpected {unexpected[:4]}"
            )
        model.load_state_dict({k: v for k, v in state.items() if k in wanted}, strict=False)


__all__ = [
    "ADAPTER_SUFFIX",
    "AdapterCheckpoint",
    "LoRAAdapter",
    "adapter_parameter_ids",
    "adapters",
    "adapters_by_base_weight",
    "adapters_disabled",
    "attach_lora",
    "global_module_name",
    "has_adapters",
    "is_adapter_key",
    "merge_adapters",
    "reset_adapters",
]
