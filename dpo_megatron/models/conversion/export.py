"""Export live megatron-core model chunks (any TP x PP x VPP layout) for Hugging Face: the model
as an HF folder (:func:`export_hf`; LoRA adapters merged into the weights), or a LoRA policy's
adapters in PEFT's layout (:func:`export_peft_adapter`).

Collective over all ranks. Within each TP group the slices of every parameter are all-gathered
and merged back to HF tensors (:func:`merge_tp_shards`), experts over their expert-TP and
expert-parallel groups as well; the first TP/DP rank of each pipeline
stage then sends its stage's tensors to global rank 0, one stage at a time, and rank 0 writes
them as they arrive (so it holds at most one stage plus one shard in memory).
Rank 0 writes into a temporary folder next to ``out_dir`` and renames it into place at the end:
a failed export leaves no partial folder. The outcome is broadcast so every rank returns or
raises together.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from dpo_megatron.models import lora
from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.conversion.architectures import REPLICATED, expand, interleave_rows
from dpo_megatron.models.conversion.hf_config import hf_config_dict, infer_architecture
from dpo_megatron.models.conversion.hf_files import write_safetensors_shards
from dpo_megatron.models.conversion.load import OUTPUT, iter_global_params, table_entry
from dpo_megatron.models.conversion.tp_split import merge_tp_shards
from dpo_megatron.models.lora_config import EXPERT_TARGETS
from dpo_megatron.parallel.layout import is_stage_writer
from dpo_megatron.utils import ranks
from dpo_megatron.utils.files import atomic_dir
from dpo_megatron.utils.modules import unwrap

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
"""Files copied from the tokenizer folder when present."""


def _gather(local: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """Every rank's ``local`` (same shape everywhere) in group-rank order."""
    if size == 1:
        return [local]
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return shards


def _group_shards(local: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """Every group rank's ``local`` (collective over ``group``), detached, on the CPU."""
    return [s.cpu() for s in _gather(local.detach(), group, size)]


def stage_hf_tensors(
    chunks: list[torch.nn.Module], cfg: ModelConfig, dtype: torch.dtype, keep: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """This rank's pipeline stage as (HF name, full tensor) pairs in ``dtype``, on the CPU.

    LoRA adapters, when attached, are merged: each adapted weight is exported as
    W + (alpha / r) B A (``models.lora``), the adapters themselves are not written.

    Collective over the stage: every TP-split parameter is all-gathered over the TP group (an
    expert's over the expert-TP group), and every expert's merged tensors over the
    expert-parallel group (EP rank k holds experts ``[k * E/EP, (k + 1) * E/EP)``), so the
    stage's first rank has all of them. Ordered by global layer (embedding first, final norm and
    output layer last). ``keep=False``: take part in the collectives, return nothing (ranks that
    do not send).
    """
    arch = infer_architecture(cfg)
    table = {t.megatron: t for t in arch.table(cfg)}
    tp = (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )
    expert_tp = (
        parallel_state.get_expert_tensor_parallel_group(),
        parallel_state.get_expert_tensor_parallel_world_size(),
    )
    ep_group = parallel_state.get_expert_model_parallel_group()
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    out: list[tuple[tuple[int, int], str, torch.Tensor]] = []
    for chunk in map(unwrap, chunks):
        adapter_params = lora.adapter_parameter_ids(chunk)
        adapted = lora.adapters_by_base_weight(chunk)
        for pattern, layer, expert, param in iter_global_params(chunk):
            if id(param) in adapter_params:
                continue  # merged into its base weight below
            if pattern == OUTPUT and cfg.tie_word_embeddings:
                continue  # the last stage's copy of the tied embedding
            tmap = table_entry(table, pattern, cfg, arch)
            group, size = expert_tp if tmap.expert else tp
            local = (adapted[id(param)].merged_weight() if id(param) in adapted else param).detach()
            shards = [local] if tmap.split == REPLICATED else _gather(local, group, size)
            tensors = merge_tp_shards(tmap, [s.cpu() for s in shards], cfg)
            # HF order: embeddings, layers by global index, then final norm and output layer.
            position = (
                -1
                if pattern.startswith("embedding")
                else (layer if layer is not None else cfg.num_layers)
            )
            for name, tensor in zip(tmap.hf, tensors):
                # A copy: a replicated tensor is the parameter itself, under DDP a view of the
                # whole contiguous parameter buffer, and pickling it to rank 0 (or writing it)
                # would carry that whole buffer for every such tensor (an fp32 export of
                # SmolLM2 at TP 2 x PP 2 from a run: 16 GB on rank 0).
                tensor = tensor.to(dtype, copy=True).contiguous()
                if not tmap.expert:
                    named = [(expand(name, layer), tensor)]
                else:  # the same local expert of every EP rank: global experts k * E/EP + j
                    # (E / EP; not read off layer 0, which may be dense: DeepSeek-V3)
                    local_experts = (cfg.num_experts or 0) // ep_size
                    j = expert % local_experts
                    named = [
                        (expand(name, layer, k * local_experts + j), t)
                        for k, t in enumerate(_gather(tensor, ep_group, ep_size))
                    ]
                if keep:
                    out += [
                        ((position, len(out) + n), hf_name, t)
                        for n, (hf_name, t) in enumerate(named)
                    ]
    out.sort(key=lambda item: item[0])
    return [(name, tensor) for _, name, tensor in out]


class _StageReceiver:
    """Global rank 0's view of every stage's tensors: its own stage, then each other stage as
    the stage's sender delivers it. :meth:`drain` receives whatever is still pending after a
    failure, so no sender stays blocked."""

    def __init__(self):
        self.pending = dist.get_process_group_ranks(
            parallel_state.get_pipeline_model_parallel_group()
        )[1:]
        self.own: list[tuple[str, torch.Tensor]] = []

    def collect_own(self, stage_fn: Callable, chunks, cfg: ModelConfig, dtype: torch.dtype) -> None:
        """Stage 0's tensors, gathered before writing starts: its TP all-gathers must complete
        even if writing then fails."""
        self.own = stage_fn(chunks, cfg, dtype)

    def _receive(self, src: int):
        box = [None]
        dist.recv_object_list(box, src=src)
        return box[0]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.own
        self.own = []
        while self.pending:
            src = self.pending.pop(0)
            status, payload = self._receive(src)
            if status != "ok":
                raise RuntimeError(f"rank {src}: {payload}")
            yield from payload

    def drain(self) -> None:
        while self.pending:
            self._receive(self.pending.pop(0))


def stage_adapter_tensors(
    chunks: list[torch.nn.Module], cfg: ModelConfig, dtype: torch.dtype, keep: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """This rank's pipeline stage's LoRA adapters as PEFT tensors (name, full tensor), in
    ``dtype`` on the CPU, ordered by global layer.

    A fused megatron layer maps to its HF modules through the architecture's table: the fused
    ``linear_qkv`` update B A becomes q/k/v updates B_q A, B_k A, B_v A (each module gets A and
    its rows of B), a gated ``linear_fc1`` becomes gate/up the same way, so the PEFT model
    computes exactly the fused update. A row-parallel layer's A is gathered over TP (padded
    head columns dropped), a column-parallel layer's B likewise; names are
    ``base_model.model.<HF module>.lora_A.weight`` / ``lora_B.weight`` (PEFT's saved layout).
    The routed experts of an MoE layer become one adapter per stacked HF parameter
    (:func:`_stacked_expert_tensors`), each expert's A and B gathered over the expert-TP group
    and then over the expert-parallel group.

    Collective over the TP group (and the expert-TP / expert-parallel groups for experts);
    ``keep=False``: take part, return nothing (as :func:`stage_hf_tensors`).
    """
    arch = infer_architecture(cfg)
    table = {t.megatron: t for t in arch.table(cfg)}
    groups = {  # is_expert -> the group that splits an adapter's matrices
        False: (
            parallel_state.get_tensor_model_parallel_group(),
            parallel_state.get_tensor_model_parallel_world_size(),
        ),
        True: (
            parallel_state.get_expert_tensor_parallel_group(),
            parallel_state.get_expert_tensor_parallel_world_size(),
        ),
    }
    ep = (
        parallel_state.get_expert_model_parallel_group(),
        parallel_state.get_expert_model_parallel_world_size(),
    )
    per_rank = (cfg.num_experts or 0) // ep[1]
    out: list[tuple[tuple[int, int], str, torch.Tensor]] = []
    for chunk in map(unwrap, chunks):
        where = {id(p): (pat, layer, e) for pat, layer, e, p in iter_global_params(chunk)}
        experts: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for _, adapter in lora.adapters(chunk):
            pattern, layer, expert = where[id(adapter.base.weight)]
            # PEFT stores A [r, in] and B [out, r] whatever HF's weight orientation.
            tmap = dataclasses.replace(table_entry(table, pattern, cfg, arch), transposed=False)
            group, size = groups[tmap.expert]
            if adapter.parallel_mode == "column":
                b_parts = merge_tp_shards(tmap, _group_shards(adapter.lora_b, group, size), cfg)
                a_parts = [adapter.lora_a.detach().cpu()] * len(b_parts)
            else:
                a_parts = merge_tp_shards(tmap, _group_shards(adapter.lora_a, group, size), cfg)
                b_parts = [adapter.lora_b.detach().cpu()] * len(a_parts)
            if tmap.expert:  # local expert j of every EP rank k: global experts k * E/EP + j
                stack = experts.setdefault((layer, _stacked_name(tmap, arch)), {})
                a_all = _group_shards(a_parts[0], *ep)
                # a gated fc1's [gate; up] (gpt-oss: its gate and up rows interleaved)
                rows = interleave_rows(b_parts) if tmap.hf_interleaved else torch.cat(b_parts)
                b_all = _group_shards(rows, *ep)
                for k, (a, b) in enumerate(zip(a_all, b_all)):
                    stack[k * per_rank + expert % per_rank] = (a, b)
                continue
            for hf_name, a, b in zip(tmap.hf, a_parts, b_parts):
                module = "base_model.model." + expand(hf_name, layer).removesuffix(".weight")
                out += [
                    ((layer, len(out) + n), f"{module}.{suffix}.weight", tensor)
                    for n, (suffix, tensor) in enumerate((("lora_A", a), ("lora_B", b)))
                ]
        out += [
            ((layer, len(out) + n), name, tensor)
            for n, (layer, name, tensor) in enumerate(_stacked_expert_tensors(experts, cfg))
        ]
    out.sort(key=lambda item: item[0])
    # A copy each: the q/k/v (gate/up) modules share A, safetensors refuses tensors that share
    # memory.
    return [(name, t.to(dtype, copy=True).contiguous()) for _, name, t in out] if keep else []


def _stacked_name(tmap, arch) -> str:
    """The stacked HF parameter (``{i}`` pattern) an expert tensor of ``arch`` belongs to.

    Raises:
        ValueError: the architecture's table names none (its experts have no PEFT form).
    """
    if tmap.hf_stacked is None:
        raise ValueError(
            f"{arch.name}: the table names no stacked expert parameter for {tmap.megatron}, so "
            "its expert adapters have no PEFT form (checkpoint.export_hf=merged merges them)"
        )
    return tmap.hf_stacked


def _stacked_expert_tensors(
    experts: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]], cfg: ModelConfig
) -> Iterator[tuple[int, str, torch.Tensor]]:
    """(layer, PEFT name, tensor) of the adapters on transformers' stacked expert parameters.

    ``experts[(layer, stacked name)][e] = (A_e [r, in], B_e [out, r])`` for every global expert
    e of the layer, B_e's rows in the stacked parameter's output order. PEFT's LoRA on a 3-D
    parameter (``target_parameters``: ``lora.ParamWrapper`` of peft 0.21) holds
    ``lora_A.weight`` [E * r, in], whose rows ``e * r .. e * r + r - 1`` are A_e, and
    ``lora_B.weight`` [out, r * E], whose column ``k * E + e`` is column k of B_e; it adds
    ``(alpha / r) B_e A_e`` to expert e's matrix when the parameter is [E, out, in] (Qwen3-MoE,
    Mixtral, DeepSeek-V3) and its transpose when transformers marks the experts
    ``is_transposed`` and the parameter is [E, in, out] (gpt-oss), so both take the same A and B.
    PEFT wraps the targeted parameters of one module in the order the module registers them,
    each wrapper around the previous one: transformers registers ``gate_up_proj`` before
    ``down_proj``, so with both adapted ``gate_up_proj``'s names have one ``base_layer.`` more.

    Raises:
        ValueError: a layer's experts are incomplete (every EP rank sends its own).
    """
    by_layer: dict[int, list[str]] = {}
    for layer, stacked in experts:
        by_layer.setdefault(layer, []).append(stacked)
    for (layer, stacked), factors in experts.items():
        if sorted(factors) != list(range(cfg.num_experts or 0)):
            raise ValueError(f"layer {layer}: adapters of experts {sorted(factors)} only")
        a = torch.cat([factors[e][0] for e in sorted(factors)])
        b = torch.stack([factors[e][1] for e in sorted(factors)], dim=2).flatten(1)
        inner_first = sorted(by_layer[layer], key=lambda name: name.endswith("down_proj"))
        depth = len(inner_first) - 1 - inner_first.index(stacked)
        module = expand(stacked, layer).rpartition(".")[0]
        prefix = f"base_model.model.{module}." + "base_layer." * depth
        yield layer, f"{prefix}lora_A.weight", a
        yield layer, f"{prefix}lora_B.weight", b


def peft_adapter_config(model_cfg: ModelConfig, lora_cfg) -> dict:
    """PEFT's ``adapter_config.json`` for these adapters: LoRA, r, lora_alpha, lora_dropout, and
    the HF modules they sit on as name suffixes (``self_attn.q_proj``, ...; suffixes, not leaf
    names, so GPT-2's ``attn.c_proj`` is not confused with ``mlp.c_proj``). An MoE model's MLP
    adapters are ``target_parameters``, with ``lora_dropout`` 0 (PEFT refuses dropout there): the
    routed experts' stacked parameters (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``)
    and the weights of a dense or shared-expert MLP (``mlp.shared_experts.gate_proj.weight``:
    peft 0.21 rewrites such modules in ``target_modules`` to the routed experts).

    Raises:
        ValueError: experts targeted in an architecture whose table names no stacked expert
            parameter.
    """
    arch = infer_architecture(model_cfg)
    targets, parameters, fan_in_fan_out = [], [], False
    for tmap in arch.table(model_cfg):
        leaf = tmap.megatron.removesuffix(".weight").rsplit(".", 1)[-1]
        if not (tmap.megatron.endswith(".weight") and leaf in lora_cfg.target_modules):
            continue
        if tmap.expert:  # routed experts: transformers' stacked parameters
            parameters.append(_stacked_name(tmap, arch).split("{i}.", 1)[1])
        elif model_cfg.num_experts and leaf in EXPERT_TARGETS:
            # An MoE model's dense / shared-expert MLP by its weight: peft (0.21) reads
            # target_modules named like transformers 4's experts (gate_proj, up_proj, down_proj)
            # as the stacked experts of transformers 5 (transformers_weight_conversion).
            parameters += [n.split("{i}.", 1)[1] for n in tmap.hf]
        else:
            targets += [n.split("{i}.", 1)[1].removesuffix(".weight") for n in tmap.hf]
            fan_in_fan_out |= tmap.transposed  # GPT-2's Conv1D stores weights [in, out]
    extra = {}
    if parameters:
        # PEFT refuses dropout on parameter targets (it folds B A into the weight); dropout
        # only acts in training, the exported function is the same.
        extra = {"target_parameters": sorted(parameters), "lora_dropout": 0.0}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model_cfg.hf_path or None,
        "r": lora_cfg.rank,
        "lora_alpha": lora_cfg.alpha,
        "lora_dropout": lora_cfg.dropout,
        "target_modules": sorted(targets),
        "fan_in_fan_out": fan_in_fan_out,
        "bias": "none",
        "use_rslora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        **extra,
    }


def export_peft_adapter(
    chunks: list[torch.nn.Module],
    model_cfg: ModelConfig,
    lora_cfg,
    out_dir: str,
    dtype: str = "float32",
) -> None:
    """Write a LoRA policy's adapters as a PEFT folder: ``adapter_config.json`` +
    ``adapter_model.safetensors``, loadable with ``peft.PeftModel.from_pretrained(hf_base,
    out_dir)`` onto the HF model of ``model_cfg.hf_path``. Collective (every rank, its chunks).

    Raises:
        ValueError: unknown dtype or chunks without adapters, before any communication.
        RuntimeError: whatever a rank hit while gathering or writing (on every rank).
    """
    if not lora.has_adapters([unwrap(c) for c in chunks]):
        raise ValueError(
            "export_peft_adapter: the model has no LoRA adapters "
            "(checkpoint.export_hf=adapter needs lora.enabled=true)"
        )

    def write(tensors: Iterator[tuple[str, torch.Tensor]], tmp: str) -> None:
        from safetensors.torch import save_file

        save_file(
            dict(tensors), os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"}
        )
        os.chmod(os.path.join(tmp, "adapter_model.safetensors"), 0o644)
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump(peft_adapter_config(model_cfg, lora_cfg), f, indent=2, sort_keys=True)

    _export(chunks, stage_adapter_tensors, write, model_cfg, out_dir, dtype)


def export_hf(
    chunks: list[torch.nn.Module],
    model_cfg: ModelConfig,
    out_dir: str,
    dtype: str = "bfloat16",
    tokenizer_dir: str | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    pad_token_id: int | None = None,
) -> None:
    """Write the model as an HF folder at ``out_dir``: config.json (the source folder's, with
    ``dtype``), ``model-0000x-of-0000y.safetensors`` + index (vocab padding removed; LoRA
    adapters merged into their weights), the source generation_config.json and the tokenizer
    files of ``tokenizer_dir`` (default: the model's ``hf_path``). Replaces an existing
    ``out_dir`` only once the new folder is complete.

    A reward model (``model_cfg.head == "reward"``) is written as the family's
    ``*ForSequenceClassification`` with ``num_labels=1`` and its ``score.weight``, no LM head;
    its config.json gets ``pad_token_id`` (transformers scores the last token that is not the
    pad, as ``data.collate.reward_position`` does): ``pad_token_id`` when given (the run's
    data pad), else the source config.json's, else the tokenizer's pad (its EOS when it has
    none, as the data path pads).

    Collective: every rank of the job calls it with its chunks (DDP-wrapped or not).

    Raises:
        ValueError: unknown dtype (before any communication), or whatever rank 0 hit while
            writing (re-raised on every rank as RuntimeError), e.g. a reward model whose pad
            token no source names.
    """

    def write(tensors: Iterator[tuple[str, torch.Tensor]], tmp: str) -> None:
        _write_folder(
            tensors,
            model_cfg,
            tmp,
            dtype,
            tokenizer_dir or model_cfg.hf_path,
            max_shard_bytes,
            pad_token_id,
        )

    _export(chunks, stage_hf_tensors, write, model_cfg, out_dir, dtype)


def _export(
    chunks: list,
    stage_fn: Callable,
    write_fn: Callable,
    model_cfg: ModelConfig,
    out_dir: str,
    dtype: str,
) -> None:
    """Gather every stage's ``stage_fn`` tensors on rank 0, where ``write_fn(tensors, tmp)``
    fills a temporary folder that then replaces ``out_dir``; errors reach every rank."""
    if dtype not in DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    torch_dtype = DTYPES[dtype]
    is_rank0 = ranks.is_rank0()
    sender = is_stage_writer()
    error = None
    if is_rank0:
        receiver = _StageReceiver()
        try:
            receiver.collect_own(stage_fn, chunks, model_cfg, torch_dtype)
            with atomic_dir(out_dir) as tmp:
                write_fn(receiver.tensors(), tmp)
        except Exception as exc:  # reported to every rank below
            error = f"{type(exc).__name__}: {exc}"
        finally:
            receiver.drain()
    else:
        try:
            payload = ("ok", stage_fn(chunks, model_cfg, torch_dtype, keep=sender))
        except Exception as exc:  # a sender must always answer rank 0
            payload = ("error", f"{type(exc).__name__}: {exc}")
        if sender:
            dist.send_object_list([payload], dst=0)
        elif payload[0] != "ok":
            error = payload[1]
    box = [error if is_rank0 else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise RuntimeError(f"export to {out_dir} failed on rank 0: {box[0]}")
    if error is not None:
        raise RuntimeError(f"export to {out_dir} failed on rank {dist.get_rank()}: {error}")


def _write_folder(
    tensors: Iterator[tuple[str, torch.Tensor]],
    cfg: ModelConfig,
    tmp: str,
    dtype: str,
    tokenizer_dir: str,
    max_shard_bytes: int,
    pad_token_id: int | None = None,
) -> None:
    """Rank 0's part of :func:`export_hf`: the HF folder's files into ``tmp``."""
    config = hf_config_dict(cfg, dtype)
    if cfg.head == "reward":
        config["pad_token_id"] = _reward_pad_token_id(config, pad_token_id, tokenizer_dir)
    layout = infer_architecture(cfg).file_layout
    if layout is not None:  # the table's tensors as the architecture stores them (gpt-oss)
        tensors = layout.pack(tensors, cfg)
    write_safetensors_shards(tensors, tmp, max_shard_bytes)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if cfg.hf_path and os.path.isfile(os.path.join(cfg.hf_path, "generation_config.json")):
        shutil.copy2(os.path.join(cfg.hf_path, "generation_config.json"), tmp)
    if tokenizer_dir:
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(tokenizer_dir, name)):
                shutil.copy2(os.path.join(tokenizer_dir, name), tmp)


def _reward_pad_token_id(config: dict, pad_token_id: int | None, tokenizer_dir: str | None) -> int:
    """The pad id a reward model's config.json states (:func:`export_hf`).

    Raises:
        ValueError: none given, none in the config and no tokenizer to ask.
    """
    if pad_token_id is not None:
        return int(pad_token_id)
    if config.get("pad_token_id") is not None:
        return int(config["pad_token_id"])
    if tokenizer_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        found = tokenizer.pad_token_id
        found = tokenizer.eos_token_id if found is None else found
        if found is not None:
            return int(found)
    raise ValueError(
        "a reward model's config.json needs pad_token_id (transformers scores the last "
        "non-pad token): pass pad_token_id, or a tokenizer folder that has a pad or EOS token"
    )
