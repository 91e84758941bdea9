"""Silence the warnings that are expected on every run, so real ones stand out.

megatron-core 0.16 warns on import about each optional GPU extra it cannot find, recommends a CUDA
environment variable even on CPU, and calls torch.distributed functions that torch 2.13 marks
deprecated. None of these is actionable for a user; everything else still prints.
"""

from __future__ import annotations

import warnings

import torch

_EXPECTED = [
    # (category, message regex)
    (UserWarning, r".*(Transformer Engine|Apex).*(is|are) not installed"),
    (UserWarning, r"full scope is deprecated"),  # megatron-core's own config default
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`"),
    # megatron-core's schedules read .grad of received activations (non-leaf on some stages).
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf"),
]
_CPU_ONLY = [
    (UserWarning, r"When using .* it is recommended to set the environment variable "
                  r"CUDA_DEVICE_MAX_CONNECTIONS"),
]


def filter_expected_warnings() -> None:
    """Install the filters (idempotent). On CPU also drops CUDA-only performance advice."""
    rules = _EXPECTED + ([] if torch.cuda.is_available() else _CPU_ONLY)
    for category, message in rules:
        warnings.filterwarnings("ignore", message=message, category=category)
