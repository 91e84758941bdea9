"""The run's configuration: one typed tree, YAML files in ``configs/``, dotted CLI overrides.

    python -m dpo_megatron.train --config configs/dpo_smollm2_cpu.yaml loss.beta=0.2 \
        parallel.tensor_model_parallel_size=2

Each section is a dataclass owned by the package that uses it (``ParallelConfig``,
``ModelConfig``, ``DataConfig``, ``TrainConfig``); ``loss`` is a free mapping validated by
``dpo_megatron.losses.build_loss`` against the chosen loss's own parameters. ``${asset:NAME}``
in a YAML value resolves to a cached offline asset (``dpo_megatron.assets``).
"""

from __future__ import annotations

import argparse
import difflib
import os
import warnings
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from dpo_megatron.compat.expected_warnings import filter_expected_warnings

filter_expected_warnings()  # the launcher imports this module first: before megatron-core's import

from dpo_megatron.data.config import DataConfig
from dpo_megatron.data.packing import PackingConfig
from dpo_megatron.models.config import ModelConfig
from dpo_megatron.parallel.config import ParallelConfig
from dpo_megatron.training.config import LoggingConfig, ReferenceConfig, TrainConfig


@dataclass
class CheckpointConfig:
    """Where and when checkpoints are written."""

    save: str = ""
    """Checkpoint directory (empty: <run_dir>/checkpoints)."""
    save_interval: int = 0
    """Steps between checkpoints (0: only at the end)."""
    keep_last_n: int = 2
    """Checkpoints kept; older ones are deleted after a newer one is complete (0: keep all)."""
    resume: str = "none"
    """Continue a run: ``none`` (start fresh), ``auto`` (the latest complete checkpoint in the
    save directory, else start fresh), or a checkpoint folder (or a folder of them: its latest).
    Restores model, optimizer, LR scheduler, RNG, data position, loss state and step."""
    overwrite: bool = False
    """Start afresh (``resume=none``) in a run_dir that holds an earlier run's checkpoints or
    metrics by moving that run, untouched, to ``<run_dir>.replaced-<time>``; without it such a
    start is refused (``dpo_megatron/training/run_dir.py``)."""
    export_hf: bool = False
    """Also write the final policy as a Hugging Face folder (<save>/hf)."""
    export_dtype: str = "bfloat16"
    """dtype of the exported HF weights: bfloat16 or float32."""


@dataclass
class DPOConfig:
    """Root of the configuration tree."""

    run_dir: str = "runs/dpo"
    """Run directory: logs, TensorBoard events, metrics.jsonl, checkpoints."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor / pipeline / data parallel layout."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture and weights of policy (and reference)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Preference data and tokenization."""
    loss: dict[str, Any] = field(default_factory=lambda: {"name": "sigmoid", "beta": 0.1})
    """Loss name and its parameters (``loss.name=ipo loss.beta=0.5``); see dpo_megatron.losses."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Batch sizes, optimizer, LR schedule."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint saving and resuming."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """TensorBoard and Weights & Biases."""
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    """Reference log-probs: frozen model each step, or precomputed once (and offload)."""
    packing: PackingConfig = field(default_factory=PackingConfig)
    """Padding-free packing of each micro-batch's sequences."""


def _resolve_asset(name: str) -> str:
    from dpo_megatron import assets

    getters = {
        "smollm2": assets.ensure_smollm2,
        "dpo_en_demo": assets.ensure_dpo_en_demo,
        "alpaca_en_demo": assets.ensure_alpaca_en_demo,
        "sentencepiece": assets.ensure_sentencepiece_model,
    }
    if name not in getters:
        raise ValueError(f"unknown asset {name!r}; known: {sorted(getters)}")
    return str(getters[name]())


if not OmegaConf.has_resolver("asset"):
    with warnings.catch_warnings():  # omegaconf 2.4 renames it; 2.1-2.3 only have this name
        warnings.simplefilter("ignore")
        OmegaConf.register_new_resolver("asset", _resolve_asset)


def _valid_keys(node_type: type, prefix: str = "") -> list[str]:
    keys = []
    for f in fields(node_type):
        sub = f.default_factory() if callable(f.default_factory) else None  # type: ignore[misc]
        if is_dataclass(sub):
            keys += _valid_keys(type(sub), f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def _unknown_key_message(bad_key: str, source: str) -> str:
    """Name the key and its source, suggest close matches, list the section's valid keys."""
    keys = _valid_keys(DPOConfig)
    close = difflib.get_close_matches(bad_key, keys, n=3, cutoff=0.6)
    section = bad_key.split(".")[0]
    in_section = [k for k in keys if k.startswith(section + ".")]
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    listing = (f"Valid keys of {section}: {', '.join(in_section)}" if in_section else
               f"Valid sections: {', '.join(sorted({k.split('.')[0] for k in keys}))}")
    return f"unknown config key {bad_key!r} (from {source}).{hint} {listing}"


def _merge_layer(merged, layer, source: str):
    """``merged`` <- ``layer`` with type checks, errors naming ``source``.

    A layer that names a loss (``loss.name``) starts that loss's section afresh: the loss takes
    its own paper defaults, not the parameters of the loss it replaces (``loss.name=sft`` must
    not inherit sigmoid's beta; ``loss.name=simpo`` must get SimPO's beta 2.0).
    """
    try:
        fresh_loss = "loss" in layer and "name" in layer.loss
        if fresh_loss:
            merged.loss = {}
        return OmegaConf.merge(merged, layer)
    except (ConfigKeyError, ConfigAttributeError) as e:
        raise ValueError(_unknown_key_message(e.full_key or str(e), source)) from None
    except ValidationError as e:
        raise ValueError(f"invalid value for config key {e.full_key!r} (from {source}): "
                         f"{str(e.msg).splitlines()[0]}") from None


def load_config(config_file: Optional[str], overrides: Sequence[str] = ()) -> DPOConfig:
    """Defaults <- YAML file <- dotted overrides, type-checked against DPOConfig.

    Raises:
        ValueError: an unknown key (naming where it came from, close matches and the valid
            keys of its section), a value of the wrong type, or a conflicting combination
            (see :func:`validate`).
    """
    merged = OmegaConf.structured(DPOConfig)
    if config_file:
        if not os.path.exists(config_file):
            raise ValueError(f"config file {config_file} does not exist")
        merged = _merge_layer(merged, OmegaConf.load(config_file), config_file)
    try:
        cli = OmegaConf.from_dotlist(list(overrides))
    except Exception as e:  # omegaconf's grammar errors
        raise ValueError(f"cannot parse overrides {list(overrides)}: {e}") from None
    merged = _merge_layer(merged, cli, "command line")
    try:
        OmegaConf.resolve(merged)
        cfg: DPOConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except ValidationError as e:
        raise ValueError(f"invalid value for config key {e.full_key!r}: "
                         f"{str(e.msg).splitlines()[0]}") from None
    validate(cfg)
    return cfg


def validate(cfg: DPOConfig) -> None:
    """Reject combinations that cannot run, before any process group or model is built.

    Raises:
        ValueError: naming the conflicting fields and what to do.
    """
    t = cfg.train
    if t.micro_batch_size < 1 or t.global_batch_size < 1:
        raise ValueError("train.micro_batch_size and train.global_batch_size must be >= 1")
    if t.global_batch_size % t.micro_batch_size:
        raise ValueError(f"train.global_batch_size={t.global_batch_size} must be divisible by "
                         f"train.micro_batch_size={t.micro_batch_size}")
    names = cfg.loss.get("name") if isinstance(cfg.loss, dict) else None
    names = names if isinstance(names, list) else [names]
    sorting = sorted({"aot", "aot_unpaired"} & set(names))
    if sorting and t.micro_batch_size < 2:
        raise ValueError(f"loss {sorting[0]} sorts the log-ratios of the pairs within one "
                         f"micro-batch, so train.micro_batch_size=1 would make it plain DPO: set "
                         f"train.micro_batch_size >= 2 (its value depends on that size)")
    cfg.data.validate()
    dp = cfg.parallel.data_parallel_size
    if dp is not None and t.global_batch_size % (t.micro_batch_size * dp):
        raise ValueError(
            f"train.global_batch_size={t.global_batch_size} must be divisible by "
            f"train.micro_batch_size={t.micro_batch_size} x parallel.data_parallel_size={dp}")
    if not cfg.model.hf_path and not cfg.model.load and not cfg.data.tokenizer:
        raise ValueError("set model.hf_path (weights + tokenizer) or data.tokenizer for a "
                         "randomly initialised model")
    if not isinstance(cfg.loss, dict) or "name" not in cfg.loss:
        raise ValueError("loss.name is required (e.g. loss.name=sigmoid)")
    from dpo_megatron.losses import build_loss

    build_loss(cfg.loss)  # unknown loss names / parameters fail here, listing the valid ones
    cfg.reference.validate()
    from dpo_megatron.models.transformer_config import use_transformer_engine

    # 'auto' picks transformer-engine on a CUDA machine that has it: check the resolved choice.
    if cfg.packing.enabled and use_transformer_engine(cfg.model.transformer_impl):
        raise ValueError("packing.enabled=true builds a block-diagonal attention mask for the "
                         "local layer spec (transformer-engine's packed THD path is not wired): "
                         "set model.transformer_impl=local")


def world_size_for(cfg: DPOConfig) -> int:
    """Ranks the launcher should start: TP x PP x DP (DP defaults to 1)."""
    return cfg.parallel.model_parallel_size() * (cfg.parallel.data_parallel_size or 1)


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[Optional[str], list[str]]:
    """``--config FILE`` plus ``key=value`` overrides."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="YAML file under configs/")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = parser.parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides must look like key=value, got {bad}")
    return args.config, args.overrides


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m dpo_megatron.config --config F [k=v...]``: resolve the config (fetching its
    assets once, in this single process) and print the world size it needs (for launchers)."""
    config_file, overrides = parse_args(argv)
    try:
        cfg = load_config(config_file, overrides)
        check_model_layout(cfg)
    except ValueError as e:
        raise SystemExit(f"config error: {e}") from None
    print(world_size_for(cfg))


def check_model_layout(cfg: DPOConfig) -> None:
    """The architecture against the layout (heads / TP, layers / PP), from config.json alone:
    launchers call this before starting any rank.

    Raises:
        ValueError: naming the model and parallel fields that conflict.
    """
    from dpo_megatron.models import build_transformer_config
    from dpo_megatron.training.model_setup import resolve_model_config

    build_transformer_config(resolve_model_config(cfg), cfg.parallel)


if __name__ == "__main__":
    main()
