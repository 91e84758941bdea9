"""The run's config as the run uses it: the architecture it builds and every parameter of its
loss (``--print-config``, and the run config given to W&B)."""

from __future__ import annotations

from omegaconf import OmegaConf

from dpo_megatron.losses import build_loss
from dpo_megatron.training.run_models import resolve_model_config


def resolved_config(cfg, model_config=None, loss_fn=None) -> dict:
    """The tree as the run uses it (``--print-config``, and the config the Trainer gives to
    W&B): ``model`` is the architecture the run builds (``model.hf_path``'s config.json, or the
    one stored with the ``model.load`` checkpoint; ``training.run_models.
    resolve_model_config``), ``loss`` every parameter of the chosen loss(es) and the modifiers
    with their defaults (``LossFunction.config_section``). ``model_config`` / ``loss_fn``: the
    run's own, when it has built them.

    Raises:
        OSError / ValueError: the model folder or checkpoint cannot be read.
    """
    if model_config is None:
        model_config = resolve_model_config(cfg)
    if loss_fn is None:
        loss_fn = build_loss(cfg.loss)
    tree = OmegaConf.to_container(OmegaConf.structured(cfg))
    tree["model"] = OmegaConf.to_container(OmegaConf.structured(model_config))
    tree["loss"] = loss_fn.config_section()
    return tree
