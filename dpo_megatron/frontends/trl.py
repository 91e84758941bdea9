"""A TRL ``DPOConfig`` YAML (trl 1.16 field names, as ``trl dpo --config FILE`` reads it) as our
overrides: ``python -m dpo_megatron.frontends.dpo_repo --trl FILE.yaml [our key=value ...]``
prints the equivalent ``scripts/pretrain_dpo.sh`` command and runs it (docs/COMING_FROM.md, "TRL").

Field names and defaults: ``trl.trainer.dpo_config.DPOConfig`` and
``transformers.TrainingArguments`` (trl 1.16.0). A field that is not in :data:`RENAMES` /
:data:`SPECIAL` / :data:`UNSUPPORTED` is an error listing the known ones; an unsupported one is
accepted only at its TRL default.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import yaml

from dpo_megatron.frontends.common import count_items
from dpo_megatron.models.lora_config import LORA_TARGETS

TRL_BASE_CONFIG = os.path.join("configs", "from_trl_base.yaml")
"""TRL's defaults in our keys: the base of the printed command."""

RENAMES: dict[str, str] = {
    "beta": "loss.beta",
    "label_smoothing": "loss.label_smoothing",
    "use_weighting": "loss.use_weighting",
    "ld_alpha": "loss.ld_alpha",
    "discopop_tau": "loss.discopop_tau",
    "loss_weights": "loss.weights",
    "max_length": "data.max_length",
    "max_prompt_length": "data.max_prompt_length",
    "truncation_mode": "data.truncation_mode",
    "dataset_num_proc": "data.num_proc",
    "model_name_or_path": "model.hf_path",
    "dataset_name": "data.path",
    "dataset_train_split": "data.split",
    "output_dir": "run_dir",
    "learning_rate": "train.lr",
    "weight_decay": "train.weight_decay",
    "adam_beta1": "train.adam_beta1",
    "adam_beta2": "train.adam_beta2",
    "adam_epsilon": "train.adam_eps",
    "max_grad_norm": "train.clip_grad",
    "seed": "train.seed",
    "save_steps": "checkpoint.save_interval",
    "logging_steps": "train.log_interval",
    "save_total_limit": "checkpoint.keep_last_n",
    "pad_to_multiple_of": "train.seq_length_multiple",
    "precompute_ref_batch_size": "reference.micro_batch_size",
    "router_aux_loss_coef": "model.moe_aux_loss_coeff",  # None: the model config's, both sides
}
"""TRL field -> our key, same value."""

SPECIAL = (
    "loss_type",
    "rpo_alpha",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_train_epochs",
    "max_steps",
    "lr_scheduler_type",
    "warmup_steps",
    "warmup_ratio",
    "precompute_ref_log_probs",
    "padding_free",
    "gradient_checkpointing",
    "bf16",
    "optim",
    "disable_dropout",
    "pad_token",
    "report_to",
    "use_peft",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "eval_strategy",
    "eval_steps",
    "per_device_eval_batch_size",
    "dataset_test_split",
)
"""TRL fields translated by a rule of :func:`translate_trl` (the ``lora_*`` and ``use_peft``
ones are TRL's ``ModelConfig``, read from the same YAML by ``trl dpo --config``); none is in
:data:`RENAMES` too, or its key would be written twice (``per_device_train_batch_size`` is the
batch rule's, with ``gradient_accumulation_steps`` and the devices)."""

PEFT_MODULES = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "qkv_proj": "linear_qkv",
    "query_key_value": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}
"""PEFT target module names (Llama / Qwen / Mistral / GPT-NeoX) -> the megatron-core linear
layer that holds them (q, k and v are one fused layer; gate and up another)."""

UNSUPPORTED: dict[str, Any] = {
    "sync_ref_model": False,
    "ref_model_mixup_alpha": 0.6,
    "ref_model_sync_steps": 512,
    "f_divergence_type": "reverse_kl",
    "f_alpha_divergence_coef": 0.5,
    "activation_offloading": False,
    "trust_remote_code": False,
    "model_init_kwargs": None,
}
"""TRL fields with no counterpart here, and the only (default) value accepted."""

SCHEDULES = {
    "linear": "linear",
    "cosine": "cosine",
    "constant": "constant",
    "constant_with_warmup": "constant",
}


def known_fields() -> list[str]:
    return [*RENAMES, *SPECIAL, *UNSUPPORTED]


def read_trl_yaml(path: str) -> dict:
    """The YAML mapping at ``path``. Raises ValueError (naming the file) for anything else."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such TRL config file")
    with open(path) as f:
        fields = yaml.safe_load(f) or {}
    if not isinstance(fields, dict):
        raise ValueError(f"{path}: a TRL config is a mapping of DPOConfig fields")
    return fields


def translate_trl(fields: dict, source: str, devices: int) -> tuple[list[str], list[str], dict]:
    """TRL fields -> (our overrides, notes, step facts for the step count).

    Raises:
        ValueError: an unknown field (lists the known ones) or an unsupported one set away from
            TRL's default, naming ``source``.
    """
    unknown = sorted(set(fields) - set(known_fields()))
    if unknown:
        raise ValueError(
            f"{source}: unknown TRL DPOConfig field(s) {unknown}; known: "
            f"{', '.join(known_fields())}"
        )
    for name, default in UNSUPPORTED.items():
        if name in fields and fields[name] != default:
            raise ValueError(
                f"{source}: {name}={fields[name]!r} is not supported here (only "
                f"TRL's default {default!r})"
            )
    o = [f"{RENAMES[k]}={_dotlist(v)}" for k, v in fields.items() if k in RENAMES]
    notes: list[str] = []
    f = dict(fields)
    names = f.get("loss_type", ["sigmoid"])
    names = [names] if isinstance(names, str) else list(names)
    if f.get("rpo_alpha") is not None:  # trl < 1: sigmoid + alpha x NLL of the chosen
        o.append(f"loss.sft_weight={f['rpo_alpha']}")
    o.append(f"loss.name=[{','.join(names)}]" if len(names) > 1 else f"loss.name={names[0]}")
    micro = int(f.get("per_device_train_batch_size", 8))
    accum = int(f.get("gradient_accumulation_steps", 1))
    o += [
        f"train.micro_batch_size={micro}",
        f"train.global_batch_size={micro * accum * devices}",
        f"parallel.data_parallel_size={devices}",
    ]
    notes.append(
        f"{devices} visible device(s): data parallel {devices}, global batch "
        f"{micro} x {accum} x {devices} = {micro * accum * devices} pairs"
    )
    schedule = f.get("lr_scheduler_type", "linear")
    if schedule not in SCHEDULES:
        raise ValueError(
            f"{source}: lr_scheduler_type={schedule!r}; translated: {', '.join(SCHEDULES)}"
        )
    o.append(f"train.lr_decay_style={SCHEDULES[schedule]}")
    warmup = f.get("warmup_ratio", f.get("warmup_steps", 0)) or 0
    optim = str(f.get("optim", "adamw_torch_fused"))
    if optim.startswith("adamw") or optim.startswith("adam"):
        o.append("train.optimizer=adam")
    elif optim == "sgd":
        o.append("train.optimizer=sgd")
    else:
        raise ValueError(f"{source}: optim={optim!r}: megatron-core offers adam(w) and sgd")
    o += _truncation_overrides(f, notes)
    if f.get("precompute_ref_log_probs"):
        o.append("reference.mode=precomputed")
    if f.get("padding_free"):
        o.append("packing.enabled=true")
    if f.get("gradient_checkpointing", True):
        o += [
            "model.recompute_granularity=full",
            "model.recompute_method=uniform",
            "model.recompute_num_layers=1",
        ]
    if f.get("bf16"):
        o.append("model.params_dtype=bfloat16")
    notes += _noted_fields(f)
    report = f.get("report_to", "none")
    report = [report] if isinstance(report, str) else list(report)
    if "wandb" in report:
        o.append("logging.wandb_project=trl")
    o.append(f"logging.tensorboard={'true' if 'tensorboard' in report else 'false'}")
    o += _peft_overrides(f, source, notes)
    o += _eval_overrides(f, source, devices, notes)
    facts = {
        "max_steps": int(f.get("max_steps", -1)),
        "epochs": float(f.get("num_train_epochs", 3.0)),
        "global_batch": micro * accum * devices,
        "warmup": warmup,
        "eval_each_epoch": f.get("eval_strategy") == "epoch",
    }
    return o, notes, facts


def _noted_fields(f: dict) -> list[str]:
    """The notes of the fields that change nothing here."""
    notes = []
    if f.get("pad_token") is not None:
        notes.append(
            f"pad_token={f['pad_token']!r}: padding is never attended to or scored here, so "
            "the token changes nothing"
        )
    if f.get("disable_dropout") is False:
        notes.append("disable_dropout=false: dropout is always 0 here")
    return notes


def _truncation_overrides(f: dict, notes: list[str]) -> list[str]:
    """TRL 1.x's ``max_length`` truncation (``DataCollatorForPreference``): with
    ``keep_start`` (its default) each prompt + completion keeps its first ``max_length``
    tokens and a pair whose prompt alone fills ``max_length`` is dropped before training
    (``DPOTrainer._prepare_dataset``): exactly ``data.max_prompt_length=0`` with
    ``keep_start`` here (the base config), nothing to add. With ``keep_end`` (deprecated in TRL
    1.x) TRL keeps each sequence's last ``max_length`` tokens, so no pair is dropped: here the
    prompt is cut keeping its end to half of ``max_length`` (unless ``max_prompt_length`` is
    given), so long prompts are cut, not dropped (noted: the cut point differs)."""
    if f.get("truncation_mode") != "keep_end" or "max_prompt_length" in f:
        return []
    max_length = int(f.get("max_length") or 1024)
    notes.append(
        f"truncation_mode=keep_end: TRL keeps each sequence's last {max_length} "
        f"tokens; here a long prompt keeps its end, cut to data.max_prompt_length="
        f"{max_length // 2}, and the completions their start"
    )
    return [f"data.max_prompt_length={max_length // 2}"]


def _eval_overrides(f: dict, source: str, devices: int, notes: list[str]) -> list[str]:
    """``eval_strategy`` (TrainingArguments, default 'no'), ``eval_steps`` (default: every
    ``logging_steps``), ``per_device_eval_batch_size`` (8) and ``trl dpo``'s
    ``dataset_test_split`` ('test') -> ``data.eval_*`` and ``train.eval_*``: as ``trl dpo``,
    the eval set is the test split of ``dataset_name``, evaluated whole. 'epoch' sets its
    interval once the pairs are counted (:func:`prepare_trl`). Raises ValueError for another
    strategy, or an evaluation without ``dataset_name``."""
    strategy = str(f.get("eval_strategy", "no"))
    named = [
        k for k in ("eval_steps", "per_device_eval_batch_size", "dataset_test_split") if k in f
    ]
    if strategy == "no":
        if named:
            notes.append(f"{', '.join(named)} ignored: eval_strategy is 'no' (as in TRL)")
        return []
    if strategy not in ("steps", "epoch"):
        raise ValueError(f"{source}: eval_strategy={strategy!r}; translated: no, steps, epoch")
    if "dataset_name" not in f:
        raise ValueError(
            f"{source}: eval_strategy={strategy} evaluates on the test split of "
            f"dataset_name, which is not set"
        )
    split = f.get("dataset_test_split", "test")
    batch = int(f.get("per_device_eval_batch_size", 8)) * devices
    o = [
        f"data.eval_datasets=[{f['dataset_name']}]",
        f"data.eval_split={split}",
        f"train.eval_global_batch_size={batch}",
        "train.eval_iters=0",
        "train.eval_at_start=false",
    ]  # TrainingArguments.eval_on_start defaults to False
    if strategy == "steps":
        o.append(f"train.eval_interval={int(f.get('eval_steps') or f.get('logging_steps', 10))}")
    notes.append(
        f"eval_strategy={strategy}: the {split!r} split of {f['dataset_name']}, whole, "
        f"in batches of {batch} pairs, every "
        + ("epoch" if strategy == "epoch" else "train.eval_interval steps")
    )
    return o


def _peft_overrides(f: dict, source: str, notes: list[str]) -> list[str]:
    """``use_peft`` + ``lora_*`` (TRL ``ModelConfig``, defaults r 16, alpha 32, dropout 0.05,
    PEFT's targets for Llama: q_proj, v_proj) -> ``lora.*``. Raises ValueError naming a target
    module with no megatron-core layer here."""
    if not f.get("use_peft"):
        ignored = [
            k for k in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules") if k in f
        ]
        if ignored:
            notes.append(f"{', '.join(ignored)} ignored: use_peft is not true (as in TRL)")
        return []
    targets = f.get("lora_target_modules") or ["q_proj", "v_proj"]
    targets = [targets] if isinstance(targets, str) else list(targets)
    if targets == ["all-linear"]:
        layers = list(LORA_TARGETS)
    else:
        unknown = [t for t in targets if t not in PEFT_MODULES]
        if unknown:
            raise ValueError(
                f"{source}: lora_target_modules {unknown}: translated are "
                f"all-linear and {', '.join(PEFT_MODULES)}"
            )
        layers = list(dict.fromkeys(PEFT_MODULES[t] for t in targets))
    fused = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_fc1": ("gate_proj", "up_proj")}
    for layer, parts in fused.items():
        named = [t for t in targets if t in parts]
        if named and len(named) < len(parts):
            notes.append(
                f"lora_target_modules {named}: {layer} fuses {', '.join(parts)}, so "
                f"its one adapter covers all of them"
            )
    return [
        "lora.enabled=true",
        f"lora.rank={int(f.get('lora_r', 16))}",
        f"lora.alpha={f.get('lora_alpha', 32)}",
        f"lora.dropout={f.get('lora_dropout', 0.05)}",
        f"lora.target_modules=[{','.join(layers)}]",
    ]


def trl_steps(facts: dict, items: int | None) -> tuple[int, int]:
    """(optimizer steps, warm-up steps) as transformers' Trainer counts them: ``max_steps`` when
    > 0, else ``ceil(num_train_epochs x ceil(pairs / global batch))``; a warm-up below 1 is a
    ratio of the steps."""
    if facts["max_steps"] > 0:
        steps = facts["max_steps"]
    else:
        assert items is not None
        steps = math.ceil(facts["epochs"] * math.ceil(items / facts["global_batch"]))
    warmup = facts["warmup"]
    warmup = math.ceil(warmup * steps) if 0 < warmup < 1 else int(warmup)
    return steps, warmup


def _dotlist(value: Any) -> str:
    if value is None:  # YAML's null, as OmegaConf reads it (str(None) would be the text None)
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_dotlist(v) for v in value) + "]"
    return str(value)


def prepare_trl(path: str, extra: Sequence[str], devices: int) -> tuple[list[str], list[str]]:
    """The overrides (with ``train.train_iters`` and ``train.lr_warmup_iters``) for the TRL YAML
    at ``path`` plus our own ``extra`` overrides, and the notes."""
    overrides, notes, facts = translate_trl(read_trl_yaml(path), path, devices)
    overrides += list(extra)
    items = count_items(overrides, config=TRL_BASE_CONFIG) if facts["max_steps"] <= 0 else None
    steps, warmup = trl_steps(facts, items)
    if facts["eval_each_epoch"]:  # transformers: after each epoch's last step
        items = items if items is not None else count_items(overrides, config=TRL_BASE_CONFIG)
        overrides.append(f"train.eval_interval={math.ceil(items / facts['global_batch'])}")
    return [*overrides, f"train.lr_warmup_iters={warmup}", f"train.train_iters={steps}"], notes
