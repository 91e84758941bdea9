"""The run's config as the run uses it: the architecture it builds and every parameter of its
loss (``--print-config``, and the run config given to W&B)."""

from __future__ import annotations

import dataclasses

from omegaconf import OmegaConf

from dpo_megatron.losses import build_loss
from dpo_megatron.models.presets import MODEL_PRESETS, preset_without_copy
from dpo_megatron.training.auto_settings import resolve_auto_settings
from dpo_megatron.training.run_models import resolve_model_config, with_loss_head


def resolved_config(cfg, model_config=None, loss_fn=None) -> dict:
    """The tree as the run uses it (``--print-config``, and the config the Trainer gives to
    W&B): ``model`` is the architecture the run builds (``model.hf_path``'s config.json, or the
    one stored with the ``model.load`` checkpoint; ``training.run_models.
    resolve_model_config``), ``loss`` every parameter of the chosen loss(es) and the modifiers
    with their defaults (``LossFunction.config_section``). ``model_config`` / ``loss_fn``: the
    run's own, when it has built them (``cfg`` is then the run's resolved config); without
    them the speed settings left to the engine are decided here as the run decides them
    (``training.auto_settings``; ``reference.mode=auto`` stays so: it needs the train pairs'
    count). A preset without a local copy (``model.hf_path`` is its hub name) shows the
    architecture the preset states (:func:`unresolved_model_note`).

    Raises:
        OSError / ValueError: the model folder or checkpoint cannot be read.
    """
    if loss_fn is None:
        loss_fn = build_loss(cfg.loss)
    preset = preset_without_copy(cfg.model.hf_path) if model_config is None else None
    if model_config is None:
        model = cfg.model if preset else resolve_model_config(cfg)
        settings = resolve_auto_settings(cfg, loss_fn, with_loss_head(model, loss_fn))
        cfg, model_config = settings.config, settings.model_config
    tree = OmegaConf.to_container(OmegaConf.structured(cfg))
    if preset:
        tree["model"] = _preset_model(cfg.model, preset)
    else:
        tree["model"] = OmegaConf.to_container(OmegaConf.structured(model_config))
    tree["loss"] = loss_fn.config_section()
    return tree


def _preset_model(model, preset: str) -> dict:
    """``model.*`` with the architecture preset ``preset`` states; the architecture fields its
    config.json would decide are left out (no folder to read them from)."""
    from dpo_megatron.models.conversion.hf_config import architecture_fields

    facts = MODEL_PRESETS[preset].facts()
    decided = architecture_fields(MODEL_PRESETS[preset].model_type)
    return {
        f.name: facts.get(f.name, getattr(model, f.name))
        for f in dataclasses.fields(model)
        if f.name in facts or f.name not in decided
    }


def unresolved_model_note(cfg) -> str | None:
    """For a preset without a local copy: one line saying where the rest of its architecture
    comes from (``--print-config`` prints it above the tree); else None."""
    preset = preset_without_copy(cfg.model.hf_path)
    if not preset:
        return None
    stated = ", ".join(MODEL_PRESETS[preset].facts())
    return (
        f"model: preset {preset} ({cfg.model.hf_path}) has no local copy here, so the model "
        f"section holds the architecture the preset states ({stated}); the rest is read from "
        f"its config.json once a copy is there ($DPO_MEGATRON_MODELS)"
    )
