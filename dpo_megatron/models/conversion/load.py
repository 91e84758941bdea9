"""Load a Hugging Face folder's weights into this rank's megatron-core model chunks.

Every rank checks the whole folder against the architecture's table from names and shapes only
(file headers, no tensor data), so all ranks fail alike with the same message before any
parameter is touched. Then each rank reads only the slices its parameters own: its layers' TP
slices and, in mixture-of-experts layers, only its experts (expert-parallel rank) and their
expert-TP slices.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import torch
from megatron.core import parallel_state

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.conversion.architectures import (
    Architecture,
    TensorMap,
    dims,
    expand,
    is_expert_pattern,
    is_layer_pattern,
)
from dpo_megatron.models.conversion.hf_config import architecture_of, head_of
from dpo_megatron.models.conversion.hf_files import HFCheckpointReader
from dpo_megatron.models.conversion.tp_split import read_tp_shard
from dpo_megatron.models.reward_head import HEAD_PARAMETER

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
_AT = "decoder.layers.{i}."
TE_FUSED_NORMS = {
    _AT + "self_attention.linear_qkv.layer_norm_weight": _AT + "input_layernorm.weight",
    _AT + "self_attention.linear_qkv.layer_norm_bias": _AT + "input_layernorm.bias",
    _AT + "mlp.linear_fc1.layer_norm_weight": _AT + "pre_mlp_layernorm.weight",
    _AT + "mlp.linear_fc1.layer_norm_bias": _AT + "pre_mlp_layernorm.bias",
}
"""The transformer-engine layer spec fuses each pre-norm into the following linear layer
(``TELayerNormColumnParallelLinear``); its norm parameters map like the local spec's norm
modules."""
WEIGHT_BUFFERS = ("mlp.router.expert_bias",)
"""Buffers (name suffixes) that hold weights of the HF model and are loaded and exported like
parameters: DeepSeek-V3's expert score bias (``e_score_correction_bias``), a buffer in both
libraries (fixed in training: megatron-core's update rate is 0 here)."""


def expected_hf_shapes(arch: Architecture, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the table expects for ``cfg``, with its stored shape."""
    sizes = dims(cfg)
    out: dict[str, tuple[int, ...]] = {}
    for tmap in arch.table(cfg):
        layers = [None]
        if is_layer_pattern(tmap.megatron):
            layers = range(cfg.num_layers) if tmap.layers is None else tmap.layers
        experts = range(cfg.num_experts or 0) if is_expert_pattern(tmap.megatron) else [None]
        for layer in layers:
            for expert in experts:
                for name, symbols in zip(tmap.hf, tmap.shapes):
                    shape = tuple(sizes[s] for s in symbols)
                    if tmap.transposed and len(shape) == 2:
                        shape = shape[::-1]
                    out[expand(name, layer, expert)] = shape
    return out


def check_hf_folder(reader: HFCheckpointReader, arch: Architecture, cfg: ModelConfig) -> None:
    """Names and shapes of the folder's tensors against the table.

    Raises:
        KeyError: a tensor the table needs is missing (names it).
        ValueError: a tensor has the wrong shape, or the folder holds tensors the table does not
            map (names them).
    """
    expected = expected_hf_shapes(arch, cfg)
    present = set(reader.names())
    for name, shape in expected.items():
        if name not in present:
            raise KeyError(
                f"{reader.hf_path}: tensor {name!r} is missing ({arch.name} expects "
                f"it for this config.json)"
            )
        if reader.shape(name) != shape:
            raise ValueError(
                f"{reader.hf_path}: tensor {name!r} has shape "
                f"{list(reader.shape(name))}, config.json implies {list(shape)}"
            )
    allowed = {expand(p, i) for p in arch.ignored for i in range(cfg.num_layers)}
    if cfg.tie_word_embeddings:
        allowed.add("lm_head.weight")  # some tied checkpoints store the duplicate
    leftover = sorted(present - set(expected) - allowed)
    if leftover:
        raise ValueError(
            f"{reader.hf_path}: tensors not mapped by the {arch.name} table: "
            f"{leftover[:10]}{' ...' if len(leftover) > 10 else ''}"
        )


def iter_global_params(
    chunk: torch.nn.Module,
) -> Iterator[tuple[str, int | None, int | None, torch.Tensor]]:
    """(table pattern, global layer index or None, global expert index or None, parameter) for
    every parameter of a chunk, and every buffer of :data:`WEIGHT_BUFFERS`.

    Layer indices inside a chunk are local; the global index is ``layer.layer_number - 1``
    (megatron-core's 1-based global numbering, which accounts for pipeline and virtual stages).
    Expert indices are local to the expert-parallel rank; the global one is the MoE layer's
    ``local_expert_indices[local]``.
    """
    buffers = [(n, b) for n, b in chunk.named_buffers() if n.endswith(WEIGHT_BUFFERS)]
    for name, param in [*chunk.named_parameters(), *buffers]:
        m = _LAYER.match(name)
        if m is None:
            yield name, None, None, param
            continue
        layer = chunk.decoder.layers[int(m.group(1))]
        rest, expert = m.group(2), None
        e = _EXPERT.match(rest)
        if e is not None:
            expert = layer.mlp.local_expert_indices[int(e.group(1))]
            rest = "mlp.experts.local_experts.{e}." + e.group(2)
        yield "decoder.layers.{i}." + rest, layer.layer_number - 1, expert, param


def tp_layout(tmap: TensorMap) -> tuple[int, int]:
    """(rank, size) of the group that splits ``tmap``'s tensor: the expert tensor-parallel group
    for experts' tensors, the tensor-parallel group otherwise."""
    if tmap.expert:
        return (
            parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_world_size(),
        )
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


def table_entry(
    table: dict[str, TensorMap], pattern: str, cfg: ModelConfig, arch: Architecture
) -> TensorMap:
    """The table entry for a megatron parameter pattern; the last stage's copy of a tied output
    layer maps to the embedding, transformer-engine fused norms to the norm entries.

    Raises:
        KeyError: the parameter has no mapping (names it and the architecture).
    """
    if pattern == OUTPUT and cfg.tie_word_embeddings:
        pattern = EMBEDDING
    pattern = TE_FUSED_NORMS.get(pattern, pattern)
    if pattern not in table:
        raise KeyError(f"megatron parameter {pattern!r} has no mapping in the {arch.name} table")
    return table[pattern]


def open_hf_folder(hf_path: str, arch: Architecture) -> HFCheckpointReader:
    """A lazy reader of the folder's tensors, with HF's base-model prefix added when the folder
    was saved from the bare base model (no name carries the prefix), seen through the
    architecture's ``file_layout`` when it stores tensors otherwise than its table names them
    (gpt-oss's stacked experts)."""
    reader = HFCheckpointReader(hf_path)
    if arch.base_prefix and not any(n.startswith(arch.base_prefix) for n in reader.names()):
        reader.add_prefix(arch.base_prefix)
    return reader if arch.file_layout is None else arch.file_layout.view(reader)


def check_hf_weights(model_cfg: ModelConfig) -> None:
    """The weights of ``model_cfg.hf_path`` before any rank reads them (the launchers'
    pre-check): every file the folder's index names exists and is complete (a safetensors
    file's size against its header), a ``.bin`` holds only tensors (its pickle read from its
    opcodes first, refused unread otherwise), and every tensor's name and shape fit config.json
    (:func:`check_hf_folder`). Reads the files' headers only (a ``.bin`` is memory-mapped).

    Raises:
        FileNotFoundError: no weights, or a shard the index names is missing (named).
        ValueError: a damaged or unsafe file, a tensor missing, of another shape or unmapped
            (each names the file or tensor).
    """
    hf_path = model_cfg.hf_path
    arch = architecture_of(hf_path)
    folder_cfg = _folder_model(hf_path, model_cfg)
    reader = None
    try:
        reader = open_hf_folder(hf_path, arch)
        check_hf_folder(reader, arch, folder_cfg)
    except KeyError as e:  # the reader's and the table's "missing tensor" errors
        raise ValueError(e.args[0]) from None
    finally:
        if reader is not None:
            reader.close()


@torch.no_grad()
def load_hf_weights(chunks: list[torch.nn.Module], model_cfg: ModelConfig, hf_path: str) -> None:
    """Copy the HF folder's weights into this rank's chunks (current parallel_state layout,
    virtual pipeline chunks included), reading only the slices this rank owns.

    Works on DDP-unwrapped ``GPTModel`` chunks (copies into existing parameters; their dtype is
    kept). Call before wrapping in DDP.

    A reward model (``model_cfg.head == "reward"``) takes an HF ``*ForSequenceClassification``
    folder whole (its ``score.weight`` into the reward head), or starts from a causal LM's
    folder: every weight but the LM head, which is dropped; the reward head keeps its zero
    initialisation (``models.reward_head``).

    Raises:
        FileNotFoundError / KeyError: missing config.json, shard or tensor (named).
        ValueError: unknown architecture, shape mismatch, unmapped HF tensors (named), or a
            reward model's folder loaded into a causal LM.
    """
    arch = architecture_of(hf_path)
    reader = open_hf_folder(hf_path, arch)
    folder_cfg = _folder_model(hf_path, model_cfg)
    try:
        check_hf_folder(reader, arch, folder_cfg)
        table = {t.megatron: t for t in arch.table(folder_cfg)}
        for chunk in chunks:
            for pattern, layer, expert, param in iter_global_params(chunk):
                if pattern == HEAD_PARAMETER and folder_cfg.head != "reward":
                    continue  # a reward model started from a causal LM: the head keeps its init
                tmap = table_entry(table, pattern, model_cfg, arch)
                tp_rank, tp_size = tp_layout(tmap)
                names = [expand(n, layer, expert) for n in tmap.hf]
                shard = read_tp_shard(
                    tmap, names, reader, model_cfg, tp_rank, tp_size, tuple(param.shape)
                )
                if tuple(shard.shape) != tuple(param.shape):
                    raise ValueError(
                        f"{hf_path}: {names} give {list(shard.shape)} for megatron "
                        f"parameter {expand(pattern, layer, expert)} of shape "
                        f"{list(param.shape)} (TP rank {tp_rank}/{tp_size})"
                    )
                param.copy_(shard)
    finally:
        reader.close()


def _folder_model(hf_path: str, model_cfg: ModelConfig) -> ModelConfig:
    """``model_cfg`` with the head the folder holds, the one it is checked and read against: a
    causal LM's folder for a reward model is read as a causal LM (its LM head then dropped).

    Raises:
        ValueError: a reward model's folder (``*ForSequenceClassification``) for a causal LM.
    """
    head = head_of(hf_path)
    if head == model_cfg.head:
        return model_cfg
    if head == "reward":
        raise ValueError(
            f"{hf_path} is a reward model (*ForSequenceClassification, no LM head): a causal "
            "LM cannot load it; train it with loss.name=bradley_terry or score with it "
            "(python -m dpo_megatron.score)"
        )
    return dataclasses.replace(model_cfg, head=head)
