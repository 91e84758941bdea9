"""Test helper: call a registered pure loss on per-pair numbers."""

from __future__ import annotations

from typing import Sequence, Union

import torch

from dpo_megatron.losses import LOSSES

Numbers = Union[float, Sequence[float]]

INPUT_NAMES = (
    "policy_chosen_logps",
    "policy_rejected_logps",
    "reference_chosen_logps",
    "reference_rejected_logps",
    "chosen_tokens",
    "rejected_tokens",
)


def as_tensor(values: Numbers, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values if isinstance(values, (list, tuple)) else [values], dtype=dtype)


def call_loss(
    name: str,
    pc: Numbers,
    pr: Numbers,
    rc: Numbers,
    rr: Numbers,
    ct: Numbers,
    rt: Numbers,
    dtype: torch.dtype = torch.float64,
    **params,
):
    """LOSSES[name].fn on [B] tensors of `dtype` built from the given numbers; returns (losses,
    metrics)."""
    pc, pr, rc, rr, ct, rt = (as_tensor(v, dtype) for v in (pc, pr, rc, rr, ct, rt))
    return LOSSES[name].fn(pc, pr, rc, rr, chosen_tokens=ct, rejected_tokens=rt, **params)
