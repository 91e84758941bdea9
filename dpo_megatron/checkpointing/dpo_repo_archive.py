"""The reference DPO repo's ``policy.pt`` (Rafailov et al. 2023, ``trainers.py``), read safely.

That repo saves the policy as ``torch.save({"step_idx": int, "state": <HF state_dict>,
"metrics": dict}, <run dir>/LATEST/policy.pt)`` and starts DPO from it with
``model.archive=<file>`` (policy and reference both load ``state``). This module:

- reads such a file with :func:`dpo_megatron.utils.torch_pickle.load_tensor_file`: only
  tensors and plain containers (dict, list, tuple, str, numbers, None) are unpickled; a file
  whose pickle names anything else (a class instance, a function, an ``OmegaConf`` node) is
  refused, read from its opcodes before anything is unpickled, with an error naming the file
  and what it would call;
- turns it into a Hugging Face folder (the base model's ``config.json`` and tokenizer, the
  archive's weights) through transformers' own model class, so that our importer
  (``models.conversion``) takes it like any other folder;
- writes one from a Hugging Face folder (our SFT export), in the same layout, so that the
  reference repo's two README lines chain on our engine.
"""

from __future__ import annotations

from typing import Any

import torch

from dpo_megatron.utils.files import atomic_file
from dpo_megatron.utils.torch_pickle import TorchFileError, UnsafePickleError, load_tensor_file

ARCHIVE_NAME = "policy.pt"

# Buffers older transformers versions kept in a state_dict (GPT-2 / GPT-NeoX causal masks, rotary
# frequencies): recomputed by the model, so an archive may hold them and they are not weights.
_RECOMPUTED_BUFFERS = (
    ".attn.bias",
    ".attn.masked_bias",
    ".attention.bias",
    ".attention.masked_bias",
    ".rotary_emb.inv_freq",
)


class ArchiveError(ValueError):
    """A ``policy.pt`` that cannot be used: the message names the file and what is wrong."""


def load_policy_archive(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The weights and the bookkeeping of a reference-repo ``policy.pt``.

    Returns:
        (state, info): ``state`` maps HF parameter names to CPU tensors; ``info`` holds the
        other top-level entries (``step_idx``: examples seen, ``metrics``).

    Raises:
        ArchiveError: a missing file, a file holding a pickled object other than tensors and
            plain containers (refused unread), or one without a ``state`` mapping of tensors.
    """
    try:
        blob = load_tensor_file(path)
    except UnsafePickleError as e:
        raise ArchiveError(
            f"model.archive={path}: refused: the file holds a pickled object other than tensors "
            f"and plain containers (dict, list, tuple, str, numbers): its pickle calls "
            f"{', '.join(e.globals[:5])}, and loading it would run that code. Save only the "
            f"state_dict (torch.save({{'state': model.state_dict()}}, path))"
        ) from None
    except TorchFileError as e:
        raise ArchiveError(f"model.archive={e}") from None
    if not isinstance(blob, dict) or "state" not in blob:
        keys = sorted(blob) if isinstance(blob, dict) else type(blob).__name__
        raise ArchiveError(
            f"model.archive={path}: expected the reference repo's layout "
            f"{{'step_idx', 'state', 'metrics'}}, got {keys}"
        )
    state = blob["state"]
    if not isinstance(state, dict) or not state:
        raise ArchiveError(
            f"model.archive={path}: 'state' must be a non-empty state_dict, got "
            f"{type(state).__name__}"
        )
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise ArchiveError(
                f"model.archive={path}: state[{name!r}] is a {type(value).__name__}, not a tensor"
            )
    return state, {k: v for k, v in blob.items() if k != "state"}


def save_policy_archive(
    path: str, state: dict[str, torch.Tensor], step_idx: int, metrics: dict | None = None
) -> str:
    """Write ``state`` (HF names -> tensors) as the reference repo does; returns ``path``."""
    with atomic_file(path) as tmp:  # a reader never sees half a file
        torch.save(
            {
                "step_idx": int(step_idx),
                "state": {k: v.detach().cpu().contiguous() for k, v in state.items()},
                "metrics": dict(metrics or {}),
            },
            tmp,
        )
    return path


def archive_to_hf_folder(
    archive: str, base: str, out_dir: str, tokenizer: str | None = None
) -> str:
    """A Hugging Face folder holding ``base``'s architecture (config.json) and tokenizer with the
    archive's weights, written with the model's own ``save_pretrained``.

    Args:
        archive: a reference-repo ``policy.pt``.
        base: the model the archive was trained from (HF folder or hub name): its config.json.
        out_dir: where the folder is written (returned).
        tokenizer: tokenizer to copy into the folder (default: ``base``'s, when it has one).

    Raises:
        ArchiveError: as :func:`load_policy_archive`; weights missing from the archive, tensors
            the architecture does not have, or shapes that differ from ``base``'s.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    state, _ = load_policy_archive(archive)
    config = AutoConfig.from_pretrained(base)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # size mismatches
        lines = [line.strip() for line in str(e).splitlines() if "size mismatch" in line]
        raise ArchiveError(
            f"model.archive={archive} does not fit {base}: {'; '.join(lines[:3]) or e}"
        ) from None
    tied = {
        k
        for k in result.missing_keys
        if k == "lm_head.weight" and getattr(config, "tie_word_embeddings", False)
    }
    missing = sorted(set(result.missing_keys) - tied)
    unexpected = sorted(k for k in result.unexpected_keys if not k.endswith(_RECOMPUTED_BUFFERS))
    if missing or unexpected:
        raise ArchiveError(
            f"model.archive={archive} does not fit {base} "
            f"({type(model).__name__}): missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}"
        )
    model.save_pretrained(out_dir)
    try:
        AutoTokenizer.from_pretrained(tokenizer or base).save_pretrained(out_dir)
    except (OSError, ValueError):
        if tokenizer:  # asked for explicitly: its failure is the user's to see
            raise
    return out_dir


def hf_folder_to_archive(hf_dir: str, path: str, step_idx: int, metrics: dict | None = None) -> str:
    """Write the weights of the HF folder ``hf_dir`` as a reference-repo ``policy.pt``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return save_policy_archive(path, model.state_dict(), step_idx, metrics)
