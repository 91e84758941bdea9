"""The layout an offline converter (``scripts/convert_*.py``) runs at, checked before
megatron-core starts."""

from __future__ import annotations

import os
import re

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.moe import moe_needs_sequence_parallel
from dpo_megatron.models.transformer_config import build_transformer_config
from dpo_megatron.parallel import ParallelConfig


def converter_layout(model: ModelConfig, flags: dict) -> ParallelConfig:
    """The layout of the converter's ``--*-parallel-size`` flags (``flags``: its parsed
    arguments, ``vars(args)``; the ``*_parallel_size`` ones are ``ParallelConfig`` fields) for
    ``model``, with sequence parallelism on for a mixture-of-experts model at TP > 1
    (megatron-core's MoE layer refuses TP without it), checked against the model (heads / TP,
    layers / PP, experts / EP: ``build_transformer_config``), then against the ranks launched
    (``WORLD_SIZE``, 1 without a launcher).

    Raises:
        ValueError: naming the converter's flags and the model fields that conflict, or the
            world size.
    """
    sizes = {k: v for k, v in flags.items() if k.endswith("_parallel_size")}
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    tp = sizes.get("tensor_model_parallel_size") or 1
    parallel = ParallelConfig(**sizes, sequence_parallel=moe_needs_sequence_parallel(model, tp))
    try:
        build_transformer_config(model, parallel)
        parallel.validate(world_size)
    except ValueError as e:
        raise ValueError(as_converter_flags(str(e))) from None
    return parallel


def as_converter_flags(message: str) -> str:
    """A config check's message in the converters' words: ``parallel.X_size=N`` is their
    ``--X-size N`` and ``model.pad_attention_heads=true`` their ``--pad-attention-heads``."""
    message = message.replace("model.pad_attention_heads=true", "--pad-attention-heads")
    return re.sub(
        r"parallel\.(\w+_size)(=?)",
        lambda m: "--" + m.group(1).replace("_", "-") + (" " if m.group(2) else ""),
        message,
    )
