"""Silence the warnings that are expected on every run, so real ones stand out.

megatron-core 0.16 warns on import about each optional GPU extra it cannot find, recommends a CUDA
environment variable even on CPU, and calls torch.distributed functions (and, loading a
checkpoint, torch DCP's ``load_state_dict`` and ShardedTensor) that torch 2.13 marks deprecated.
None of these is actionable for a user; everything else still prints.

Switched on by the entry points (trainer, launcher's config check, converters) before
megatron-core is imported. Imports nothing heavy: the config check must stay fast.
"""

from __future__ import annotations

import warnings

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="expected_warnings",
        why="megatron-core prints import-time and per-call warnings that no user can act on",
        versions={"megatron-core": ">=0.16.0,<0.17"},
        switched_on="at every entry point, before megatron-core is imported",
        off_on_other_versions=False,  # filters of unknown messages are harmless
    )
)

_EXPECTED = [
    # (category, message regex)
    (UserWarning, r".*(Transformer Engine|Apex).*(is|are) not installed"),
    (UserWarning, r"full scope is deprecated"),  # megatron-core's own config default
    # megatron-core's advice for transformer-engine's fused attention, printed for every selective
    # recompute of core_attn (the engine's local kernels are not TE's)
    (UserWarning, r"If you are using transformer_engine as the transformer implementation"),
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`"),
    # megatron-core's schedules read .grad of received activations (non-leaf on some stages).
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf"),
    # megatron-core's checkpoint loader calls torch DCP's deprecated entry point and builds
    # ShardedTensors: two FutureWarnings per rank on every checkpoint load (resume, model.load,
    # scripts/convert_megatron_to_hf.py), about megatron-core's code, not the user's.
    (FutureWarning, r"`load_state_dict` is deprecated and will be removed in future versions"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
]
_CPU_ONLY = [
    # CUDA performance advice: actionable on a GPU, printed on CPU runs too.
    (
        UserWarning,
        r"When using .* it is recommended to set the environment variable "
        r"CUDA_DEVICE_MAX_CONNECTIONS",
    ),
]


def filter_expected_warnings(cpu: bool = False) -> None:
    """Install the filters (idempotent); ``cpu`` also drops the CUDA-only performance advice
    (the device owner passes it once the device is known to be the CPU)."""
    for category, message in _EXPECTED + (_CPU_ONLY if cpu else []):
        warnings.filterwarnings("ignore", message=message, category=category)
