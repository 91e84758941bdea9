"""The run's models: the architecture resolved from the config, the policy with its starting
weights (and, with ``lora.enabled``, its adapters), the reference (equal to the policy at the
start, or of its own: ``reference.hf_path`` / ``reference.load``), and what a training
checkpoint stores of the policy."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

from dpo_megatron.checkpointing.model_checkpoint import MODEL_CONFIG_FILE
from dpo_megatron.models import ModelConfig, build_model_chunks
from dpo_megatron.models.config import architecture_differences, with_run_settings
from dpo_megatron.models.lora_config import LoraConfig
from dpo_megatron.parallel.config import ParallelConfig
from dpo_megatron.training.config import ReferenceConfig
from dpo_megatron.training.optim import copy_weights, freeze


def resolve_model_load(path: str) -> str:
    """``model.load`` as a checkpoint folder: itself, or the latest checkpoint inside it (a run's
    ``checkpoints`` folder)."""
    from dpo_megatron.checkpointing.training_checkpoint import find_latest_checkpoint

    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    return find_latest_checkpoint(path) or path


def require_model_checkpoint(key: str, path: str) -> str:
    """The checkpoint ``key`` (``model.load`` / ``reference.load``) names: ``path`` itself or the
    latest checkpoint of a run's ``checkpoints`` folder (:func:`resolve_model_load`), checked to
    be a megatron-core distributed checkpoint before any rank loads it.

    Raises:
        FileNotFoundError: naming the key and the path, when it holds no checkpoint.
    """
    resolved = resolve_model_load(path)
    if not os.path.isfile(os.path.join(resolved, "metadata.json")):
        what = "no such folder" if not os.path.exists(path) else "no metadata.json there"
        if os.path.isfile(os.path.join(path, "config.json")):
            what += f"; a Hugging Face folder goes in {key.split('.')[0]}.hf_path"
        raise FileNotFoundError(
            f"{key}={path}: not a megatron-core distributed checkpoint ({what}), nor a run's "
            "checkpoints folder holding one"
        )
    return resolved


def built_from(load: str) -> str:
    """The ``model.hf_path`` the checkpoint ``load`` (a checkpoint, or a run's ``checkpoints``
    folder: its latest) was built from, as stored with it; '' when it stores none.

    Raises:
        ValueError / OSError: its ``model_config.json`` cannot be read.
    """
    from dpo_megatron.checkpointing import load_model_config

    stored = load_model_config(resolve_model_load(load)) if load else None
    return stored.hf_path if stored is not None else ""


def resolve_model_config(cfg) -> ModelConfig:
    """The model the run builds: the architecture from ``model.hf_path``'s config.json when
    given, else the one stored with the ``model.load`` checkpoint (its padding, source and head
    too), else the ``model.*`` fields; the run settings (``models.config.RUN_FIELDS``: dtype,
    kernels, recompute, ...) are always the run's own ``model.*`` keys. A conflict between the
    two sources is refused by :func:`check_checkpoint_models`."""
    if cfg.model.hf_path:
        from dpo_megatron.models.conversion import model_config_from_hf

        return model_config_from_hf(cfg.model.hf_path, cfg.model)
    if cfg.model.load:
        from dpo_megatron.checkpointing import load_model_config

        stored = load_model_config(resolve_model_load(cfg.model.load))
        if stored is not None:
            return with_run_settings(stored, cfg.model)
    return cfg.model


def check_checkpoint_models(cfg, stated: Iterable[str] = ()) -> None:
    """The architecture the run builds against the checkpoints it loads, before any rank loads
    one (megatron-core would stop at the first tensor of another shape, on every rank, or load
    a model other than the configured one):

    * ``model.load`` without ``model.hf_path``: the checkpoint's ``model_config.json`` gives the
      architecture; a ``model.*`` architecture key the config sets (``stated``: the field names
      the YAML file or the command line gave) to another value is refused, the same value is
      fine;
    * ``model.load`` with ``model.hf_path``: the checkpoint must hold config.json's architecture;
    * ``checkpoint.resume``: every checkpoint it may continue from must hold the run's;
    * ``model.load`` naming a LoRA checkpoint (adapters, no base weights) is refused here, before
      any rank starts, as ``build_policy`` would refuse it in every rank.

    Padding heads count through the key/value groups they make
    (``models.config.architecture_differences``); checkpoints saved without a
    ``model_config.json`` are not compared.

    Raises:
        ValueError: naming the key, the checkpoint, each field and both values; or
            ``model.load`` is a LoRA checkpoint.
        FileNotFoundError: ``checkpoint.resume`` names a folder without a complete checkpoint.
    """
    from dpo_megatron.checkpointing.training_checkpoint import resume_candidates
    from dpo_megatron.utils.run_layout import RunLayout

    if cfg.model.load:
        _refuse_adapter_checkpoint(resolve_model_load(cfg.model.load))
    model_cfg = resolve_model_config(cfg)
    stored = _stored_model(resolve_model_load(cfg.model.load)) if cfg.model.load else None
    if stored is not None and cfg.model.hf_path:
        differ = architecture_differences(model_cfg, stored)
        if differ:
            raise ValueError(
                f"model.load={cfg.model.load} holds a model with {_values(differ, 1)} (its "
                f"{MODEL_CONFIG_FILE}), but model.hf_path={cfg.model.hf_path} gives "
                f"{_values(differ, 0)} (its config.json): load a checkpoint of that model, or "
                f"drop model.hf_path to take the checkpoint's own architecture"
            )
    elif stored is not None:
        differ = architecture_differences(cfg.model, stored, names=stated)
        if differ:
            keys = ", ".join(f"model.{name}={values[0]}" for name, values in differ.items())
            raise ValueError(
                f"model.load={cfg.model.load} holds a model with {_values(differ, 1)} (its "
                f"{MODEL_CONFIG_FILE}), but {keys} is set: the checkpoint gives the "
                f"architecture; drop {', '.join('model.' + name for name in differ)} or load "
                f"a checkpoint of that architecture"
            )
    for path in resume_candidates(cfg.checkpoint.resume, RunLayout.of(cfg).checkpoints):
        stored = _stored_model(path)
        differ = {} if stored is None else architecture_differences(model_cfg, stored)
        if differ:
            raise ValueError(
                f"checkpoint.resume={cfg.checkpoint.resume}: {path} holds a model with "
                f"{_values(differ, 1)} (its {MODEL_CONFIG_FILE}), but this run builds "
                f"{_values(differ, 0)} (from {_architecture_source(cfg)}): resume with the "
                f"architecture it was saved with, or start the other model in another run_dir"
            )


def _stored_model(path: str) -> ModelConfig | None:
    """The model stored with a checkpoint; None when it has none or it cannot be read (the
    checkpoint's verification names that file)."""
    from dpo_megatron.checkpointing import load_model_config

    try:
        return load_model_config(path)
    except (OSError, ValueError, TypeError):
        return None


def _values(differ: dict, side: int) -> str:
    """``name=value, ...`` of one side of :func:`architecture_differences`."""
    return ", ".join(f"{name}={values[side]}" for name, values in differ.items())


def _architecture_source(cfg) -> str:
    if cfg.model.hf_path:
        return f"model.hf_path={cfg.model.hf_path}'s config.json"
    if cfg.model.load:
        return f"model.load={cfg.model.load}'s {MODEL_CONFIG_FILE}"
    return "the model.* keys"


def with_loss_head(model_cfg: ModelConfig, loss_fn) -> ModelConfig:
    """The architecture with the head the loss reads (``LossSpec.model_head``): a reward model's
    (``bradley_terry``) or the LM head. A causal LM's folder or checkpoint starts a reward model
    (``models.conversion.load_hf_weights``: its LM head is dropped).

    Raises:
        ValueError: a reward model (an HF ``*ForSequenceClassification`` folder, a reward
            model's checkpoint) given to a loss of log-probs.
    """
    if model_cfg.head == loss_fn.model_head:
        return model_cfg
    if model_cfg.head == "reward":
        source = model_cfg.hf_path or model_cfg.load
        raise ValueError(
            f"{source} is a reward model (no LM head): {loss_fn.describe()} needs a causal LM; "
            "start from a *ForCausalLM folder or an SFT / DPO checkpoint"
        )
    return dataclasses.replace(model_cfg, head=loss_fn.model_head)


def require_sequence_parallel(
    parallel: ParallelConfig, model_cfg: ModelConfig
) -> tuple[ParallelConfig, str | None]:
    """The layout ``parallel`` with ``sequence_parallel`` on where megatron-core requires it: a
    mixture-of-experts model at TP > 1 (its MoE layer refuses to train with TP but without
    sequence parallelism, so there is no other choice to respect). ``parallel`` is not changed;
    call it right after :func:`resolve_model_config` and read the returned layout from then on
    (row lengths become multiples of TP).

    Returns:
        The layout (``parallel`` itself when nothing changes), and the line that says what
        changed, or None.
    """
    from dpo_megatron.models.moe import moe_needs_sequence_parallel

    tp = parallel.tensor_model_parallel_size
    if parallel.sequence_parallel or not moe_needs_sequence_parallel(model_cfg, tp):
        return parallel, None
    return dataclasses.replace(parallel, sequence_parallel=True), (
        f"note: parallel.sequence_parallel turned on: megatron-core's mixture-of-experts "
        f"layer ({model_cfg.num_experts} experts) needs it at "
        f"parallel.tensor_model_parallel_size={tp}"
    )


def weights_source(
    model: ModelConfig, *, seed: int, resumed_from: str | None = None, lora: bool = False
) -> str:
    """Where the weights of ``model`` (the resolved model section) come from, in words (printed
    at start-up); ``seed``: ``train.seed``, which a random initialisation starts from.

    ``resumed_from``: the training checkpoint a resume loaded, whose weights replace the
    starting ones (with ``lora``, ``lora.enabled``, it holds the adapters only: the base weights
    are still the model section's). None: a fresh start, or the base's source alone (what a
    LoRA checkpoint records as its ``base``).
    """
    if model.load:
        start = f"checkpoint {resolve_model_load(model.load)}"
    elif model.hf_path:
        start = f"Hugging Face folder {model.hf_path}"
    else:
        start = f"random initialisation (seed {seed})"
    if not resumed_from:
        return start
    if lora:
        return f"LoRA adapters of the resumed checkpoint {resumed_from} on the base {start}"
    return f"the resumed checkpoint {resumed_from}"


def build_policy(
    model: ModelConfig, *, parallel: ParallelConfig, lora: LoraConfig, seed: int
) -> list:
    """Policy chunks of ``model`` (the model section as the run resolved it:
    :func:`resolve_model_config`) at the ``parallel`` layout, with their starting weights:
    ``model.load``, else ``model.hf_path``, else random (collective). A reward model
    (``model.head``) takes a causal LM's weights but its LM head. With ``lora.enabled`` the
    weights are then frozen and adapters attached (``dpo_megatron.models.lora``, initialised
    from ``seed``, ``train.seed``): only the adapters train.

    Raises:
        ValueError: ``model.load`` names a LoRA checkpoint (it holds adapters, no base weights).
    """
    policy = build_model_chunks(model, parallel)
    if model.load:
        path = resolve_model_load(model.load)
        _refuse_adapter_checkpoint(path)
        _load_checkpoint(policy, model, parallel, path)
    elif model.hf_path:
        from dpo_megatron.models.conversion import load_hf_weights

        load_hf_weights(policy, model, model.hf_path)
    if lora.enabled:
        from dpo_megatron.models.lora import attach_lora

        attach_lora(policy, lora, model, seed)
    return policy


def load_weights(chunks: list, model_cfg: ModelConfig, path: str) -> None:
    """Load ``path`` into this rank's ``chunks`` (collective): a Hugging Face folder (it has a
    ``config.json``) or a checkpoint folder (or a run's ``checkpoints`` folder: its latest)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        from dpo_megatron.models.conversion import load_hf_weights

        load_hf_weights(chunks, model_cfg, path)
    else:
        from dpo_megatron.checkpointing import load_model_checkpoint

        load_model_checkpoint(chunks, resolve_model_load(path))


def _load_checkpoint(policy: list, model_cfg: ModelConfig, parallel, path: str) -> None:
    """The checkpoint's weights into the policy. A reward model started from a causal LM's
    checkpoint (an SFT or DPO run's) takes every weight but the LM head: the checkpoint is read
    into the causal LM it holds, at this layout, and copied over; the reward head keeps its
    zero initialisation (``models.reward_head``)."""
    import torch

    from dpo_megatron.checkpointing import load_model_checkpoint, load_model_config

    stored = load_model_config(path)
    if model_cfg.head != "reward" or stored is None or stored.head == "reward":
        load_model_checkpoint(policy, path)
        return
    causal = build_model_chunks(dataclasses.replace(model_cfg, head="lm"), parallel)
    load_model_checkpoint(causal, path)
    with torch.no_grad():
        for src, dst in zip(causal, policy):
            state = {k: v for k, v in src.state_dict().items() if not k.startswith("output_layer.")}
            missing, unexpected = dst.load_state_dict(state, strict=False)
            if unexpected or any(not k.startswith("reward_head.") for k in missing):
                raise ValueError(
                    f"{path}: its causal LM does not fit the reward model (missing {missing}, "
                    f"unexpected {unexpected})"
                )


def _refuse_adapter_checkpoint(path: str, key: str = "model.load") -> None:
    from dpo_megatron.checkpointing.training_checkpoint import checkpoint_lora

    lora = checkpoint_lora(path)
    if lora:
        raise ValueError(
            f"{key}={path} is a LoRA checkpoint: it holds adapters, not base weights "
            f"(base: {lora.get('base')}). Continue it with checkpoint.resume={path}, or "
            "export it merged (checkpoint.export_hf=merged) and start from that folder"
        )


def reference_source(reference: ReferenceConfig) -> str:
    """The ``reference`` section's own weights in words ('' when the reference is the policy's
    starting weights)."""
    if reference.hf_path:
        return f"Hugging Face folder {reference.hf_path}"
    if reference.load:
        return f"checkpoint {resolve_model_load(reference.load)}"
    return ""


def reference_model_config(
    reference: ReferenceConfig, model: ModelConfig, *, seed: int
) -> ModelConfig | None:
    """The model of ``reference.hf_path`` / ``reference.load``, checked against the policy's
    (``model``, the resolved model section; ``seed``, ``train.seed``, names a random policy in
    the message): None when the reference is the policy's starting weights. Reads config.json
    or the checkpoint's records only (the launchers call it before any rank starts; the ranks
    again when they build the reference).

    Raises:
        FileNotFoundError: ``reference.hf_path`` has no config.json; ``reference.load`` holds no
            checkpoint (:func:`require_model_checkpoint`).
        ValueError: ``reference.load`` is a LoRA checkpoint (adapters, no base weights); the
            reference is a reward model; or its architecture differs from the
            policy's (``models.config.architecture_differences``: naming both sources and each
            field with both values). A checkpoint saved without its ``model_config.json`` is not
            compared (megatron-core checks the shapes as it loads).
    """
    if reference.hf_path:
        from dpo_megatron.models.conversion import model_config_from_hf

        key = f"reference.hf_path={reference.hf_path}"
        theirs = model_config_from_hf(reference.hf_path, model)
    elif reference.load:
        path = require_model_checkpoint("reference.load", reference.load)
        key = f"reference.load={path}"
        _refuse_adapter_checkpoint(path, "reference.load")
        stored = _stored_model(path)
        theirs = model if stored is None else with_run_settings(stored, model)
    else:
        return None
    if theirs.head == "reward":
        raise ValueError(
            f"{key} is a reward model (no LM head): a DPO reference is a causal LM "
            "(a *ForCausalLM folder, an SFT or DPO checkpoint)"
        )
    differ = architecture_differences(theirs, model)
    if differ:
        raise ValueError(
            f"{key} holds a model with {_values(differ, 0)}, but the policy "
            f"({weights_source(model, seed=seed)}) has {_values(differ, 1)}: the reference must "
            "be the policy's architecture, with other weights"
        )
    return theirs


def build_reference(
    reference: ReferenceConfig,
    *,
    policy: list,
    model: ModelConfig,
    parallel: ParallelConfig,
    lora: LoraConfig,
    seed: int,
    weights: str = "",
):
    """The run's reference object (``training.reference``) from the ``reference`` section: with
    ``lora.enabled`` the ``policy`` itself with its adapters bypassed
    (:class:`BaseModelReference`, no second model); else a frozen copy built as the policy was
    (``model``, the resolved model section, at the ``parallel`` layout), holding either the
    policy's starting weights (copied from it: each pipeline stage holds its layers of both, and
    step 0 has policy == reference) or a reference of its own (``reference.hf_path`` /
    ``reference.load``, checked by :func:`reference_model_config`, whose message ``seed`` serves,
    and loaded at this layout). ``weights`` (a checkpoint or Hugging Face folder; not with LoRA)
    loads those instead: online DPO's ``online.reference=initial``.

    Raises:
        ValueError: as :func:`reference_model_config`.
    """
    from dpo_megatron.training.reference import BaseModelReference, ReferenceModel

    if lora.enabled:
        return BaseModelReference(policy)
    chunks = freeze(build_model_chunks(model, parallel))
    if weights:
        load_weights(chunks, model, weights)
    elif reference_model_config(reference, model, seed=seed) is not None:
        load_weights(chunks, model, reference.hf_path or reference.load)
    else:
        copy_weights(policy, chunks)
    return ReferenceModel(chunks, offload=reference.offload)


def checkpointed_policy(cfg, model_cfg: ModelConfig, policy: list) -> tuple[list, dict | None]:
    """What a training checkpoint stores of the policy, and the LoRA record kept with it.

    Returns:
        (the chunks to checkpoint: the policy itself, or with LoRA its adapters only
        (``models.lora.AdapterCheckpoint``); None, or with LoRA ``{rank, alpha, dropout,
        target_modules, base}`` where ``base`` names the base weights' source, which a resume
        reads again).
    """
    if not cfg.lora.enabled:
        return policy, None
    from dataclasses import asdict

    from dpo_megatron.models.lora import AdapterCheckpoint

    record = {**asdict(cfg.lora), "base": weights_source(model_cfg, seed=cfg.train.seed)}
    record.pop("enabled")
    return [AdapterCheckpoint(chunk) for chunk in policy], record


def check_vocab_fits(tokenizer, model_cfg: ModelConfig) -> None:
    """A token id past the embedding table would fail deep inside the first forward.

    Raises:
        ValueError: the tokenizer has more ids than ``model.vocab_size``.
    """
    if tokenizer is None:
        return
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size
    if size > model_cfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {size} ids but model.vocab_size is "
            f"{model_cfg.vocab_size}: set model.vocab_size >= {size}"
        )
