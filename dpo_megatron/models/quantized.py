"""Quantized Hugging Face checkpoints: the engine reads unquantized weights, and says how to make
them.

Some models are published quantized only (gpt-oss: MXFP4 experts; DeepSeek-V3: FP8 blocks). Their
``config.json`` holds a ``quantization_config``; transformers can load such a folder dequantized
and ``save_pretrained`` it unquantized, which is the copy the engine reads. One owner for the
check and the recipe: :func:`dpo_megatron.models.conversion.hf_config.model_config_from_hf`
(every folder the engine reads) and :mod:`dpo_megatron.models.presets` (a preset's local copy and
hub-name errors) both use it.

This module imports no torch / transformers (the config path reads it).
"""

from __future__ import annotations

from typing import Any

TRANSFORMERS_CONFIGS = {"mxfp4": ("MXFP4", "Mxfp4Config"), "fp8": ("FP8", "FineGrainedFP8Config")}
"""``quant_method`` -> (its name, the transformers config that loads it dequantized:
``<Config>(dequantize=True)``), for the methods of the models the engine has presets for."""


def quantization_method(config: Any) -> str | None:
    """The ``quant_method`` of a config's ``quantization_config`` (a transformers config object or
    the ``config.json`` dict), ``"unknown"`` when it names none, None when unquantized."""
    if isinstance(config, dict):
        quant = config.get("quantization_config")
    else:
        quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    if isinstance(quant, dict):
        return str(quant.get("quant_method") or "unknown")
    return str(getattr(quant, "quant_method", None) or quant)


def dequantize_recipe(source: str, method: str, target: str) -> str:
    """How to make an unquantized copy of ``source`` (a hub name or a folder) at ``target`` with
    transformers, for a ``method`` of :data:`TRANSFORMERS_CONFIGS` (others: the transformers
    quantizer's own dequantize option)."""
    _, config = TRANSFORMERS_CONFIGS.get(method, (method, "<its quantization config>"))
    load = f"AutoModelForCausalLM.from_pretrained({source!r}, quantization_config={config}"
    return (
        f"make an unquantized copy with transformers ({load}(dequantize=True)), then "
        f"save_pretrained to {target})"
    )


def refuse_quantized(config: Any, folder: str) -> None:
    """Raise when the config of ``folder`` is quantized.

    Raises:
        ValueError: naming the file, the method and the dequantize recipe
            (:func:`dequantize_recipe`) with ``model.hf_path`` pointed at the copy.
    """
    method = quantization_method(config)
    if method is None:
        return
    raise ValueError(
        f"{folder}/config.json: quantization_config ({method}) is not supported: the engine "
        f"reads unquantized weights; {dequantize_recipe(folder, method, 'NEW_FOLDER')} and set "
        "model.hf_path=NEW_FOLDER"
    )
