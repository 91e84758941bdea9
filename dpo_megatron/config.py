"""The run's configuration: one typed tree, YAML files in ``configs/``, dotted CLI overrides.

    python -m dpo_megatron.train --config configs/dpo_smollm2_cpu.yaml loss.beta=0.2 \
        parallel.tensor_model_parallel_size=2
    python -m dpo_megatron.config --list-keys          # every key: type, default, valid range
    python -m dpo_megatron.config --config F --print-config [k=v ...]

Each section is a dataclass owned by the package that uses it (``ParallelConfig``,
``ModelConfig``, ``DataConfig``, ``TrainConfig``, ...), and each checks the ranges of its own
fields in its ``validate()``; :func:`validate` runs them and then the rules that span sections.
``loss`` is a free mapping validated by ``dpo_megatron.losses.build_loss`` against the chosen
loss's own parameters. ``${asset:NAME}`` in a YAML value resolves to a cached offline asset
(``dpo_megatron.utils.cache.asset_path``; ``scripts/assets.py`` builds them).

Shorthands: ``loss=ipo`` is ``loss.name=ipo`` (a fresh loss section, as ``loss.name`` always
is); ``model=NAME`` (YAML ``model: NAME``, or ``model: {preset: NAME, ...}`` with further model
keys) expands a preset of ``models.presets.MODEL_PRESETS``; ``key=`` clears a string
key (``''``), a list key (``[]``) or an optional key (null). Any other scalar given to a section is
an error that says what the section takes.

This module imports no torch and no megatron-core until the loss is checked (torch) and the
layout is checked (megatron-core, :func:`check_model_layout`), so that the launchers' pre-check
(``python -m dpo_megatron.config``: :mod:`dpo_megatron.cli.check`) reports a config mistake
within seconds.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import inspect
import os
import re
import textwrap
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from typing import Any, get_type_hints

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from dpo_megatron.checkpointing.config import CheckpointConfig
from dpo_megatron.compat import before_megatron_import
from dpo_megatron.data.config import DataConfig, PackingConfig
from dpo_megatron.generation.config import GenerationConfig
from dpo_megatron.models.config import MODEL_PRESETS, ModelConfig, model_preset_keys, preset_name
from dpo_megatron.models.lora_config import LoraConfig, export_mode
from dpo_megatron.online.config import OnlineConfig
from dpo_megatron.parallel.config import ParallelConfig
from dpo_megatron.training.config import LoggingConfig, ReferenceConfig, TrainConfig
from dpo_megatron.utils.loss_names import canonical_loss_section

# Programs that build the engine themselves (benchmarks, converters, tests) load a config
# first; the imports above are light (no megatron-core), so this still comes before its import.
before_megatron_import()


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
    """Loss name and its parameters (``loss.name=ipo loss.beta=0.5``, or ``loss=ipo``); see
    dpo_megatron.losses. ``dpo`` is an alias of ``sigmoid``: the config holds ``sigmoid``."""
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
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full training; the frozen base is then the reference."""
    online: OnlineConfig = field(default_factory=OnlineConfig)
    """Iterative (online) DPO rounds (``scripts/iterative_dpo.sh``); unused with rounds 0."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Sampling from the policy (``python -m dpo_megatron.generate``)."""

    def __post_init__(self) -> None:
        # Built normalized: a loss's other name (``dpo``) is its registered one here, so that
        # validation only checks and the run, config.yaml and --print-config read one name.
        self.loss = canonical_loss_section(self.loss)


def _resolve_asset(name: str) -> str:
    """``${asset:NAME}``: the cached offline asset (built by ``scripts/assets.py``)."""
    from dpo_megatron.utils import cache

    return str(cache.asset_path(name))


if not OmegaConf.has_resolver("asset"):
    with warnings.catch_warnings():  # omegaconf 2.4 renames it; 2.1-2.3 only have this name
        warnings.simplefilter("ignore")
        OmegaConf.register_new_resolver("asset", _resolve_asset)


# ----------------------------------------------------------------------------------------------
# the tree's keys


def _sections() -> dict[str, type]:
    """Section name -> its dataclass (``loss`` is a mapping, not a dataclass)."""
    hints = get_type_hints(DPOConfig)
    return {f.name: hints[f.name] for f in fields(DPOConfig) if is_dataclass(hints[f.name])}


def _valid_keys(node_type: type, prefix: str = "") -> list[str]:
    keys = []
    for f in fields(node_type):
        sub = f.default_factory() if callable(f.default_factory) else None  # type: ignore[misc]
        if is_dataclass(sub):
            keys += _valid_keys(type(sub), f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def _field_of(key: str):
    """The dataclass field and its resolved type for a dotted key, or (None, None)."""
    node: type = DPOConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not is_dataclass(node):
            return None, None
        match = [f for f in fields(node) if f.name == part]
        if not match:
            return None, None
        hint = get_type_hints(node)[part]
        if i == len(parts) - 1:
            return match[0], hint
        node = hint
    return None, None


def _field_docs(node_type: type) -> dict[str, str]:
    """Field name -> its docstring (the string literal after the field in the class body, or
    in the body of the base dataclass that declares it: ``GenerationConfig``'s sampling fields
    are ``SamplingConfig``'s)."""
    docs: dict[str, str] = {}
    for base in reversed([c for c in node_type.__mro__ if is_dataclass(c)]):
        docs.update(_own_field_docs(base))
    return docs


def _own_field_docs(node_type: type) -> dict[str, str]:
    """Field name -> docstring, for the fields declared in ``node_type``'s own class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(node_type)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _file_values(config_file: str | Sequence[str]) -> dict[str, Any]:
    """Dotted key -> the value the file(s) give it, merged in order, where that differs from
    the built-in default (interpolations such as ``${asset:smollm2}`` as written, not resolved).

    Raises:
        ValueError: as :func:`load_config` for the files.
    """
    merged = OmegaConf.structured(DPOConfig)
    for path in config_files(config_file):
        merged = _merge_layer(merged, _load_yaml(path), path)
    given = OmegaConf.to_container(merged, resolve=False)
    defaults = OmegaConf.to_container(OmegaConf.structured(DPOConfig), resolve=False)
    out = {}
    for key in _valid_keys(DPOConfig):
        value, default = given, defaults
        for part in key.split("."):
            value, default = value[part], default[part]
        if key == "checkpoint.export_hf":  # a YAML boolean arrives as 'False' / 'True'
            value = export_mode(value)
        if value != default:
            out[key] = value
    return out


def list_keys(config_file: str | Sequence[str] | None = None) -> str:
    """Every key of the tree with its type, default and documentation (valid range included),
    one block per key; ``loss.*`` keys depend on the loss (``dpo_megatron.losses``). With
    ``config_file`` (the launchers pass their default config), a key the file sets shows the
    file's value as its default, beside the built-in one.

    Raises:
        ValueError: ``config_file`` does not load (as :func:`load_config`).
    """
    lines = []
    from_file = _file_values(config_file) if config_file else {}
    source = " + ".join(
        os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
        for path in config_files(config_file)
    )

    def walk(node_type: type, prefix: str) -> None:
        docs = _field_docs(node_type)
        hints = get_type_hints(node_type)
        for f in fields(node_type):
            default = (
                f.default_factory()
                if f.default_factory is not MISSING  # type: ignore[misc]
                else f.default
            )
            if is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")
                continue
            hint = hints[f.name]
            kind = (
                str(hint).replace("typing.", "")
                if getattr(hint, "__args__", None)
                else getattr(hint, "__name__", str(hint))
            )
            key = prefix + f.name
            if key in from_file:
                default = f"{from_file[key]!r} in {source}; {default!r} without a config file"
            else:
                default = repr(default)
            lines.append(f"{key} ({kind}, default {default})")
            if f.name in docs:
                lines.extend("    " + line for line in textwrap.wrap(docs[f.name], 92))

    walk(DPOConfig, "")
    from dpo_megatron.losses import parameter_lines

    lines.append("loss.<parameter>: the parameters of the chosen loss.name (see docs/LOSSES.md):")
    for line in parameter_lines():
        lines.extend(textwrap.wrap(line, 96, initial_indent="    ", subsequent_indent="        "))
    return "\n".join(lines)


def _unknown_key_message(bad_key: str, source: str) -> str:
    """Name the key and its source, suggest close matches, list the section's valid keys."""
    keys = _valid_keys(DPOConfig)
    section = bad_key.split(".")[0]
    # A misspelt section ('trainn') is matched against the sections and top-level keys, not
    # against every dotted key (which would suggest 'train.lr' for it).
    top = sorted({k.split(".")[0] for k in keys})
    close = difflib.get_close_matches(bad_key, keys if "." in bad_key else top, n=3, cutoff=0.6)
    in_section = [k for k in keys if k.startswith(section + ".")]
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    listing = (
        f"Valid keys of {section}: {', '.join(in_section)}"
        if in_section
        else f"Valid sections: {', '.join(sorted({k.split('.')[0] for k in keys}))}"
    )
    return f"unknown config key {bad_key!r} (from {source}).{hint} {listing}"


# ----------------------------------------------------------------------------------------------
# shorthands: a scalar given to a section, and ``key=`` with no value


def _section_scalar(section: str, value: Any, source: str) -> dict:
    """What ``section=value`` stands for, as that section's keys.

    Raises:
        ValueError: a section that takes no scalar, or an unknown model preset.
    """
    if section == "loss":
        if value == "" or isinstance(value, (dict, DictConfig)):
            raise ValueError(
                f"loss= needs a loss name (from {source}), e.g. loss=ipo or "
                f"loss.name=sigmoid loss.beta=0.1"
            )
        return {"name": value}
    if section == "model":
        if isinstance(value, str) and preset_name(value):
            return model_preset_keys(value)
        presets = ", ".join(sorted(MODEL_PRESETS)) or "none yet"
        what = (
            f"{value!r} is not a model preset"
            if isinstance(value, str) and value
            else "model is a section, not a value"
        )
        raise ValueError(
            f"model={value} (from {source}): {what}. Give it a preset "
            f"name ({presets}) or its keys: model.hf_path=<Hugging Face folder> for pretrained "
            f"weights, model.load=<checkpoint folder>, or the architecture of a random model "
            f"(model.num_layers=..., model.hidden_size=...; --list-keys lists them all)"
        )
    example = next(iter(_valid_keys(_sections()[section], f"{section}.")), f"{section}.<key>")
    raise ValueError(
        f"{section}={value} (from {source}): {section} is a section, not a value; "
        f"set its keys, e.g. {example}=... (python -m dpo_megatron.config "
        f"--list-keys lists them)"
    )


def _expand_override(item: str) -> list[str]:
    """One command-line ``key=value`` as the dotted overrides it stands for."""
    key, _, value = item.partition("=")
    key = key.strip()
    if key == "model.preset":  # the YAML spelling of model=NAME
        key = "model"
    if key in _sections() or key == "loss":
        expanded = _section_scalar(key, value, "command line")
        return [f"{key}.{k}={_dotlist_value(v)}" for k, v in expanded.items()]
    if value == "":
        f, hint = _field_of(key)
        if f is not None:
            if hint is str:
                return [f"{key}=''"]
            if getattr(hint, "__origin__", None) is list:
                return [f"{key}=[]"]
    return [item]


def _dotlist_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _expand_layer(layer, source: str):
    """A YAML layer with its section scalars (``loss: ipo``, ``model: smollm2``) expanded, and a
    model section's ``preset: NAME`` replaced by that preset's keys under the section's own
    (``model: {preset: qwen3-30b-a3b, recompute_granularity: full}``)."""
    raw = OmegaConf.to_container(layer, resolve=False)  # no interpolation resolved yet
    for section in [*_sections(), "loss"]:
        value = raw.get(section)  # type: ignore[union-attr]
        if value is not None and not isinstance(value, dict):
            layer[section] = _section_scalar(section, value, source)
        elif section == "model" and isinstance(value, dict) and "preset" in value:
            name = value.pop("preset")
            layer[section] = {**_section_scalar(section, name, source), **value}
    return layer


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
        key = e.full_key or "?"
        raise ValueError(
            f"invalid value for config key {key!r} (from {source}): {str(e.msg).splitlines()[0]}"
        ) from None


def _load_yaml(config_file: str):
    if not os.path.exists(config_file):
        raise ValueError(f"config file {config_file} does not exist")
    try:
        layer = OmegaConf.load(config_file)
    except Exception as e:  # yaml's scanner / parser errors carry the line and column
        detail = " ".join(str(e).split())
        raise ValueError(f"config file {config_file} is not valid YAML: {detail}") from None
    if not isinstance(layer, DictConfig):
        raise ValueError(
            f"config file {config_file} must be a mapping of sections (run_dir, "
            f"parallel, model, data, loss, train, ...), got a "
            f"{type(layer).__name__.replace('Config', '').lower()}"
        )
    return _expand_layer(layer, config_file)


def config_files(config_file: str | Sequence[str] | None) -> list[str]:
    """The YAML files of a command line, in the order they merge: one path, several (``--config
    base.yaml --config ipo.yaml``: a later file's keys override an earlier one's), or None."""
    if config_file is None:
        return []
    return [config_file] if isinstance(config_file, str) else list(config_file)


def _layers(
    config_file: str | Sequence[str] | None, overrides: Sequence[str]
) -> list[tuple[Any, str]]:
    """(layer, source) of each YAML file and of the command line, section scalars (presets,
    ``loss=ipo``) and ``key=`` expanded, in the order they merge."""
    layers = [(_load_yaml(path), path) for path in config_files(config_file)]
    dotted = [expanded for item in overrides for expanded in _expand_override(item)]
    try:
        layers.append((OmegaConf.from_dotlist(dotted), "command line"))
    except Exception as e:  # omegaconf's grammar errors
        raise ValueError(f"cannot parse overrides {list(overrides)}: {e}") from None
    return layers


def stated_model_keys(
    config_file: str | Sequence[str] | None, overrides: Sequence[str] = ()
) -> frozenset:
    """The ``model.*`` fields the YAML file or the command line set (a preset's included), as
    opposed to the defaults: what the user stated about the model, which a ``model.load``
    checkpoint must not silently override (``training.run_models.check_checkpoint_models``).

    Raises:
        ValueError: as :func:`load_config`, for a file or overrides that do not parse.
    """
    stated: set[str] = set()
    for layer, _ in _layers(config_file, overrides):
        model = layer.get("model")
        if isinstance(model, DictConfig):
            stated.update(str(k) for k in model.keys())
    return frozenset(stated)


def check_model_sources(
    cfg: DPOConfig, config_file: str | Sequence[str] | None, overrides: Sequence[str] = ()
) -> None:
    """``model.load`` and ``checkpoint.resume`` against the model the run builds and the
    ``model.*`` keys the config states, before any checkpoint is loaded
    (``training.run_models.check_checkpoint_models``): the launchers' pre-check and every rank.

    Raises:
        ValueError: naming the key, the checkpoint and the fields that conflict.
        OSError: ``checkpoint.resume`` names no complete checkpoint, or a model folder cannot
            be read.
    """
    from dpo_megatron.training.run_models import check_checkpoint_models

    check_checkpoint_models(cfg, stated_model_keys(config_file, overrides))


def load_config(
    config_file: str | Sequence[str] | None, overrides: Sequence[str] = (), check: bool = True
) -> DPOConfig:
    """Defaults <- YAML file <- dotted overrides, type-checked against DPOConfig.

    ``check=False`` leaves out :func:`validate` (the cross-field rules and the loss registry,
    which imports torch): for checks that read a few plain fields first, such as the run
    folder's (:func:`dpo_megatron.training.run_dir.check_run_dir`); :func:`validate` the result
    before using it for more.

    Raises:
        ValueError: an unknown key (naming where it came from, close matches and the valid
            keys of its section), a value of the wrong type or out of its range, a YAML file
            that does not parse or is not a mapping, or a conflicting combination (see
            :func:`validate`).
    """
    merged = OmegaConf.structured(DPOConfig)
    layers = _layers(config_file, overrides)
    for layer, source in layers:
        merged = _merge_layer(merged, layer, source)
    sources = _key_sources(layers)
    try:
        OmegaConf.resolve(merged)
        cfg: DPOConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise ValueError(_resolve_error_message(e, sources)) from None
    # Where each key was set, for validate's messages (not a field: never printed or saved).
    cfg._key_sources = sources  # type: ignore[attr-defined]
    if check:
        validate(cfg)
    return cfg


def _resolve_error_message(error: OmegaConfBaseException, sources: dict[str, str]) -> str:
    """One line for an error met while resolving the merged tree: an interpolation to a key that
    is not there (``${train.nope}``), an unknown resolver, an unset environment variable
    (``${oc.env:VAR}``), a ``???`` left unset, or a value of the wrong type once resolved; it
    names the key, the file (or the command line) that set it (``sources``: :func:`_key_sources`),
    and what to do."""
    key = getattr(error, "full_key", None) or "?"
    what = " ".join(str(getattr(error, "msg", None) or error).splitlines()[0].split())
    if isinstance(error, InterpolationResolutionError):
        fix = (
            "an interpolation names a full dotted key of the tree (e.g. "
            "${train.micro_batch_size}) or a resolver (${asset:NAME}, ${oc.env:VAR,default})"
        )
    elif isinstance(error, MissingMandatoryValue):
        fix = f"set {key} (in the YAML file or as {key}=... on the command line)"
    else:
        fix = "give it a value of its type (--list-keys shows each key's type)"
    source = sources.get(key, "the defaults")
    return f"config key {key!r} (from {source}): {what}: {fix}"


def config_from_mapping(sections: dict, check: bool = True) -> DPOConfig:
    """A DPOConfig from nested plain values, e.g. ``{"model": {"num_layers": 2}, "loss":
    {"name": "ipo"}}``: the defaults, then ``sections``, type-checked like a YAML file.

    Args:
        check: run :func:`validate`. Programs that bring their own token ids (tests,
            ``scripts/gpu_bench.py``) pass False: the data and tokenizer rules do not apply.

    Raises:
        ValueError: as :func:`load_config`.
    """
    source = "config_from_mapping"
    layer = _expand_layer(OmegaConf.create(sections), source)
    merged = _merge_layer(OmegaConf.structured(DPOConfig), layer, source)
    cfg: DPOConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    if check:
        validate(cfg)
    return cfg


# ----------------------------------------------------------------------------------------------
# validation


def data_parallel_size(cfg: DPOConfig) -> int | None:
    """The data-parallel size of this job: ``parallel.data_parallel_size``, else what the
    launcher's ``WORLD_SIZE`` leaves after TP x PP, else None (not known yet)."""
    if cfg.parallel.data_parallel_size is not None:
        return cfg.parallel.data_parallel_size
    world = os.environ.get("WORLD_SIZE")
    mp = cfg.parallel.model_parallel_size()
    if world and world.isdigit() and int(world) % mp == 0:
        return int(world) // mp
    return None


def validate(cfg: DPOConfig) -> None:
    """Reject values and combinations that cannot run, before any process group or model is
    built: every section's own ranges first (no heavy import), then the rules that span
    sections, then the loss (``build_loss``, which imports torch).

    Raises:
        ValueError: naming the field(s) and what to do; for a config built by
            :func:`load_config`, also the file (or the command line) that set each key the
            message names.
    """
    with _naming_sources(cfg):
        _validate(cfg)


@contextlib.contextmanager
def _naming_sources(cfg: DPOConfig) -> Iterator[None]:
    """A ValueError raised in the block gets where each key it names was set, for a config built
    by :func:`load_config` (``cfg._key_sources``; a ``dataclasses.replace`` copy has none, so
    the checks that validate a copy run in a block of the original)."""
    try:
        yield
    except ValueError as error:
        where = _where_set(str(error), getattr(cfg, "_key_sources", {}))
        if where and len(error.args) == 1:
            error.args = (f"{error.args[0]} ({where})",)
        raise


def _key_sources(layers: list[tuple[Any, str]]) -> dict[str, str]:
    """Dotted key -> the last layer (YAML file or command line) that sets it."""
    sources: dict[str, str] = {}

    def walk(node: Any, prefix: str, source: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.", source)
            else:
                sources[f"{prefix}{key}"] = source

    for layer, source in layers:
        walk(OmegaConf.to_container(layer, resolve=False), "", source)
    return sources


def _where_set(message: str, sources: dict[str, str]) -> str:
    """Where each dotted key ``message`` names was set, for those a layer set ('' if none):
    ``train.global_batch_size set in a.yaml, train.micro_batch_size set on the command line``."""
    named = dict.fromkeys(re.findall(r"\b[a-z_]+(?:\.[a-z_0-9]+)+", message))
    return ", ".join(
        f"{key} set {'on the' if sources[key] == 'command line' else 'in'} {sources[key]}"
        for key in named
        if key in sources
    )


def _validate(cfg: DPOConfig) -> None:
    """:func:`validate`'s rules, in order."""
    cfg.parallel.validate()
    cfg.model.validate()
    cfg.data.validate()
    cfg.train.validate()
    cfg.checkpoint.validate()
    cfg.reference.validate()
    cfg.packing.validate()
    cfg.online.validate()
    cfg.generation.validate()

    t, p = cfg.train, cfg.parallel
    dp = data_parallel_size(cfg)
    if dp is not None and t.global_batch_size % (t.micro_batch_size * dp):
        raise ValueError(
            f"train.global_batch_size={t.global_batch_size} must be divisible by "
            f"train.micro_batch_size={t.micro_batch_size} x data-parallel size {dp}"
        )
    if p.virtual_pipeline_model_parallel_size is not None and dp is not None:
        micro_batches = t.global_batch_size // (t.micro_batch_size * dp)
        if micro_batches % p.pipeline_model_parallel_size:
            raise ValueError(
                f"the interleaved pipeline (parallel.virtual_pipeline_model_parallel_size="
                f"{p.virtual_pipeline_model_parallel_size}) needs the micro-batches per step, "
                f"train.global_batch_size / (train.micro_batch_size x DP) = "
                f"{t.global_batch_size} / ({t.micro_batch_size} x {dp}) = {micro_batches}, to "
                f"be a multiple of parallel.pipeline_model_parallel_size="
                f"{p.pipeline_model_parallel_size} (megatron-core's interleaved schedule): "
                f"change the batch sizes or drop virtual_pipeline_model_parallel_size"
            )
    if not cfg.model.hf_path and not cfg.model.load and not cfg.data.tokenizer:
        raise ValueError(
            "set model.hf_path (weights + tokenizer) or data.tokenizer for a "
            "randomly initialised model"
        )
    if cfg.packing.may_pack() and cfg.packing.row_length and cfg.model.transformer_impl != "local":
        from dpo_megatron.models.transformer_config import use_transformer_engine

        # 'auto' picks transformer-engine on a CUDA machine that has it: check the resolved choice.
        if use_transformer_engine(cfg.model.transformer_impl):
            raise ValueError(
                "transformer-engine takes packed rows in THD form, one row per "
                f"micro-batch: leave packing.row_length=0 (got "
                f"{cfg.packing.row_length}) or set model.transformer_impl=local"
            )
    _validate_context_parallel(cfg)
    _validate_loss(cfg)
    _check_reference_used(cfg)
    cfg.lora.validate(
        loss=cfg.loss,
        loss_reads_reference=_loss_reads_reference(cfg) if cfg.lora.enabled else True,
        reference=cfg.reference,
        model=cfg.model,
        export_hf=cfg.checkpoint.export_hf,
        parallel=cfg.parallel,
    )


def _check_reference_used(cfg: DPOConfig) -> None:
    """A ``reference.*`` choice of weights or of how the log-probs are obtained is refused with
    a loss that reads no reference (SimPO, ORPO, SFT, a reward model): the run would ignore it
    (the start-up line says ``reference none``).

    Raises:
        ValueError: naming the first such key and the loss.
    """
    ref = cfg.reference
    chosen = [
        (ref.weights_key(), ref.weights()),
        ("reference.mode", ref.mode if ref.mode != "auto" else ""),
        ("reference.offload", "true" if ref.offload else ""),
    ]
    given = [(key, value) for key, value in chosen if value]
    if given and not _loss_reads_reference(cfg):  # builds the loss: only when a key is set
        key, value = given[0]
        raise ValueError(
            f"{key}={value}, but loss.name={cfg.loss['name']} reads no reference model: drop {key}"
        )


def _loss_reads_reference(cfg: DPOConfig) -> bool:
    """Whether the configured loss reads the reference log-probs (``needs_reference``)."""
    from dpo_megatron.losses import build_loss

    return build_loss(cfg.loss).needs_reference


def _validate_context_parallel(cfg: DPOConfig) -> None:
    """What context parallelism (``parallel.context_parallel_size`` > 1) needs of the other
    sections: rows cut into 2 x CP equal chunks (x TP under sequence parallelism), the local
    context-parallel attention (SDPA over all-gathered keys/values), no greedy sampling."""
    p = cfg.parallel
    cp = p.context_parallel_size
    if cp == 1:
        return
    granule = p.sequence_granule()
    row = cfg.packing.row_length
    # A row_length auto leaves unused (SFT) is refused too: naming it costs nothing.
    if cfg.packing.may_pack() and row and row % granule:
        why = f"2 x parallel.context_parallel_size={cp}" + (
            f" x parallel.tensor_model_parallel_size={p.tensor_model_parallel_size} "
            f"(sequence parallelism)"
            if p.sequence_parallel
            else ""
        )
        raise ValueError(
            f"packing.row_length={row} cannot be cut into equal context-parallel chunks: every "
            f"packed row is split into {why} = {granule} pieces: set packing.row_length to a "
            f"multiple of {granule} (e.g. {-(-row // granule) * granule}), or 0 (the step's "
            f"longest micro-batch, rounded up automatically)"
        )
    local = cfg.model.transformer_impl != "transformer_engine"
    if cfg.model.local_attention == "megatron" and local:
        raise ValueError(
            "parallel.context_parallel_size > 1 attends with the context-parallel "
            "SDPA attention (models.context_attention); model.local_attention="
            "megatron has no context-parallel form: set model.local_attention=sdpa"
        )
    if cfg.train.sample_during_eval:
        raise ValueError(
            "train.sample_during_eval=true decodes greedily one token at a time, "
            "which is not split across context-parallel ranks: set "
            "train.sample_during_eval=false or parallel.context_parallel_size=1"
        )


def _validate_loss(cfg: DPOConfig) -> None:
    """``loss.name`` present, the sorting losses' micro-batch rule, then ``build_loss`` (unknown
    names / parameters, listing the valid ones). Aliases were replaced when the config was built
    (``DPOConfig``)."""
    if not isinstance(cfg.loss, dict) or "name" not in cfg.loss:
        raise ValueError("loss.name is required (e.g. loss.name=sigmoid, or loss=ipo)")
    from dpo_megatron.losses import build_loss

    loss_fn = build_loss(cfg.loss)
    sorting = sorted(c.spec.name for c in loss_fn.components if c.spec.sorts_batch)
    if sorting and cfg.train.micro_batch_size < 2:
        raise ValueError(
            f"loss {sorting[0]} sorts the log-ratios of the pairs within one "
            f"micro-batch, so train.micro_batch_size=1 would make it plain DPO: set "
            f"train.micro_batch_size >= 2 (its value depends on that size)"
        )
    # The kind's rule, which the batch builder also applies on the ranks (after the data is
    # read): here it is the pre-check's one line.
    from dpo_megatron.data.kinds import item_kind

    item_kind(loss_fn.item_kind).check_packing(cfg.packing, f"loss.name={cfg.loss['name']}")
    if loss_fn.model_head == "reward":
        _validate_reward_model(cfg)
    elif cfg.train.reward_head_lr is not None:
        raise ValueError(
            f"train.reward_head_lr={cfg.train.reward_head_lr:g} is the learning rate of a "
            f"reward model's head, but loss.name={cfg.loss['name']} trains a language model: "
            f"drop it (or train a reward model: loss.name=bradley_terry)"
        )


def _validate_reward_model(cfg: DPOConfig) -> None:
    """What a reward model's loss (``bradley_terry``) rules out: it has no LM head to sample
    from, no context-parallel form (its rows' last tokens are not split across ranks) and no
    adapters (the whole model and its new head train)."""
    for bad, fix in (
        (cfg.train.sample_during_eval, "train.sample_during_eval=false"),
        (cfg.parallel.context_parallel_size > 1, "parallel.context_parallel_size=1"),
        (cfg.lora.enabled, "lora.enabled=false"),
    ):
        if bad:
            raise ValueError(
                f"loss.name={cfg.loss['name']} trains a reward model, which does not support "
                f"this setting: set {fix}"
            )


def validate_online_config(cfg: DPOConfig, world_size: int | None = None) -> None:
    """An online run's config: everything :func:`validate` checks of a training run, then the
    rules that span ``online.*`` and the rest (``online.checks.validate_online``; with
    ``world_size``, both layouts against it). An online run trains on its own pairs: ``data.*``
    gives the tokenizer, the chat template and the prompt length, and needs no ``data.path``
    (the prompts file stands in for it in the data checks).

    Raises:
        ValueError: naming the fields and what to do.
    """
    from dpo_megatron.online.checks import validate_online

    checked = cfg
    if not (cfg.data.path or cfg.data.datasets):
        stand_in = cfg.online.prompts or "online.prompts"
        checked = replace(cfg, data=replace(cfg.data, path=stand_in))
    with _naming_sources(cfg):  # the copy has no record of where its keys were set
        _validate(checked)
        validate_online(cfg, world_size)


def world_size_for(cfg: DPOConfig) -> int:
    """Ranks the launcher should start: TP x PP x DP (DP defaults to 1, or to what the expert
    layout needs: ``ParallelConfig.launch_world_size``)."""
    return cfg.parallel.launch_world_size()


# ----------------------------------------------------------------------------------------------
# the config against the files it names (the launchers' pre-check: dpo_megatron.cli.check)


def check_model_layout(cfg: DPOConfig) -> None:
    """The architecture against the layout (heads / TP, layers / PP), and LoRA's targets against
    the layers it has, from config.json alone: launchers call this before starting any rank (it
    imports megatron-core).

    Raises:
        ValueError: naming the model and parallel fields that conflict.
    """
    from dpo_megatron.models import build_transformer_config
    from dpo_megatron.models.lora_config import check_targets_of_model
    from dpo_megatron.training.run_models import resolve_model_config

    model = resolve_model_config(cfg)
    build_transformer_config(model, cfg.parallel)
    if cfg.lora.enabled:
        check_targets_of_model(cfg.lora.target_modules, model)


def check_model_weights(cfg: DPOConfig) -> None:
    """The starting weights of ``model.hf_path`` (when no ``model.load`` replaces them), and a
    reference of its own (``reference.hf_path`` / ``reference.load``, first checked to be the
    policy's architecture: ``training.run_models.reference_model_config``), before any rank
    reads them: every file present and complete, tensors only, names and shapes as config.json
    implies (``models.conversion.check_hf_weights``, headers only). A checkpoint
    (``model.load`` / ``reference.load``) must be there (``run_models.require_model_checkpoint``);
    the ranks verify it against its manifest.

    Raises:
        OSError / ValueError: naming the key, the folder or the file.
    """
    from dpo_megatron.models.conversion import check_hf_weights
    from dpo_megatron.training.run_models import (
        reference_model_config,
        require_model_checkpoint,
        resolve_model_config,
    )

    if cfg.model.load:  # reference.load: reference_model_config checks it below
        require_model_checkpoint("model.load", cfg.model.load)
    model_cfg = resolve_model_config(cfg)
    if cfg.model.hf_path and not cfg.model.load:
        check_hf_weights(model_cfg)
    reference = reference_model_config(cfg.reference, model_cfg, seed=cfg.train.seed)
    if cfg.reference.hf_path:
        check_hf_weights(reference)


def _item_kind(cfg: DPOConfig):
    """What the loss trains on (``LossFunction.item_kind``, as a ``data.kinds.ItemKind``): a loss
    that reads no rejected completion (sft) trains on SFT examples and may read SFT-only formats
    (alpaca); an unpaired loss (kto) reads unpaired formats only."""
    from dpo_megatron.data.kinds import item_kind
    from dpo_megatron.losses import build_loss

    return item_kind(build_loss(cfg.loss).item_kind)


def check_data(cfg: DPOConfig) -> None:
    """Every local data source, training and eval, exists and its rows fit their format,
    without a tokenizer (``dpo_megatron.data.pipeline.check_sources``): the launchers'
    pre-check.

    Raises:
        DataError: naming the file, the line or row, and the field (or the format the file
            looks like).
    """
    from dpo_megatron.data.pipeline import check_sources

    check_sources(cfg.data, _item_kind(cfg))


def prepare_data(cfg: DPOConfig) -> bool:
    """Tokenize the data once, in the launcher, into the cache rank 0 then reads instead of
    tokenizing again: so that a data error found only while tokenizing (a chat template that
    does not fit, no pair left) also stops the launcher before any rank starts. Only with the
    cache on (``data.cache_dir`` not ``none``) and local sources; returns whether it ran.

    Raises:
        DataError: as the run's data load would.
        ValueError: the tokenizer has more ids than the model's vocabulary.
    """
    import dataclasses

    from dpo_megatron.data.pipeline import load_items
    from dpo_megatron.data.sources import DataError, is_local_source
    from dpo_megatron.data.tokenizer import load_tokenizer
    from dpo_megatron.training.run_models import check_vocab_fits, resolve_model_config

    if cfg.data.cache_dir.lower() == "none" or not all(
        is_local_source(name) for name, _ in cfg.data.sources() + cfg.data.eval_sources()
    ):
        return False
    model_cfg = resolve_model_config(cfg)
    tokenizer = load_tokenizer(cfg.data.tokenizer or model_cfg.hf_path)
    check_vocab_fits(tokenizer, model_cfg)
    dataset = load_items(
        dataclasses.replace(cfg.data, verbose=False),
        tokenizer,  # not in the cache key
        _item_kind(cfg),
    )
    if not dataset.train:
        raise DataError(
            f"no training pairs left in {cfg.data.path or cfg.data.datasets} after "
            f"filtering: {dataset.summary.dropped}"
        )
    return True


def predicted_memory_warning(cfg: DPOConfig, cluster=None) -> str | None:
    """On a CUDA launch (or for ``cluster``), one line when the layout planner predicts more
    memory per GPU than the device has (``planning.from_config.memory_warning``); None otherwise.
    A warning, not a refusal: the prediction is an estimate."""
    from dpo_megatron.parallel.device import resolve_backend
    from dpo_megatron.planning.from_config import local_cluster, memory_warning, resolved_model

    if cluster is None:
        if resolve_backend(cfg.parallel.backend) != "nccl":
            return None
        cluster = local_cluster(world_size_for(cfg))
        if cluster is None:
            return None
    from dpo_megatron.losses import build_loss

    loss_fn = build_loss(cfg.loss)
    return memory_warning(cfg, loss_fn, resolved_model(cfg, loss_fn), cluster)


if __name__ == "__main__":  # the pre-check's first name: the command, by its module name
    import runpy

    runpy.run_module("dpo_megatron.cli.check", run_name="__main__", alter_sys=True)
