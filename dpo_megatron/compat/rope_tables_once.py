"""megatron-core's unfused RoPE with the table's cosines and sines made once per forward.

``megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_bshd`` (0.16), the
rotation every layer applies to its queries and to its keys without transformer-engine's fused
kernel, computes ``cos(freqs) * mscale`` and ``sin(freqs) * mscale`` of the whole table at every
call: twice per layer, [tokens, rotary dim] each, and the multiplications keep each pair for
backward, so a 30-layer model holds 60 copies of the same two tensors through the step. It then
concatenates the rotated part with the part left unrotated, a copy of the whole tensor even when
that part is empty (RoPE over the whole head, every model here but partial-rotary ones).

:func:`enable` puts in the same function with the cosines and sines of the last table kept
(the same tensor object at the same version, the same ``mscale`` and dtype: the model passes
one table to every layer of a forward, ``models.gpt.ScoringGPTModel``) and the concatenation
skipped when nothing is left unrotated. The operations and their operands are the same, so the
values are bit for bit megatron-core's (tested); the layers' multiplications keep one pair.

Switched on by ``dpo_megatron.models.gpt.build_model_chunks``; on megatron-core 0.16 only.
"""

from __future__ import annotations

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="rope_tables_once",
        why="megatron-core's unfused RoPE makes the table's cos / sin at every call (queries and "
        "keys of every layer) and keeps each for backward, and copies the rotated tensor into a "
        "concatenation with an empty unrotated part",
        versions={"megatron-core": "==0.16.*"},
        switched_on="when model chunks are built",
    )
)

MEGATRON_BSHD = None
"""megatron-core's own ``_apply_rotary_pos_emb_bshd``, kept by :func:`enable` (the tests'
reference)."""

_LAST: list = []
"""[(freqs, its version, mscale, dtype, cos, sin)] of the last call (one entry at most)."""


def _cos_sin(freqs, mscale: float, dtype):
    """``(cos(freqs) * mscale, sin(freqs) * mscale)`` in ``dtype``, as megatron-core makes
    them, reused while the same table comes back unchanged."""
    import torch

    if _LAST:
        table, version, scale, kind, cos, sin = _LAST[0]
        if table is freqs and version == freqs._version and scale == mscale and kind == dtype:
            return cos, sin
    cos = (torch.cos(freqs) * mscale).to(dtype)
    sin = (torch.sin(freqs) * mscale).to(dtype)
    _LAST[:] = [(freqs, freqs._version, mscale, dtype, cos, sin)]
    return cos, sin


def apply_rotary_pos_emb_bshd(
    t, freqs, rotary_interleaved: bool = False, multi_latent_attention: bool = False, mscale=1.0
):
    """megatron-core 0.16's ``_apply_rotary_pos_emb_bshd``: t [s, ..., dim] rotated by the
    angles ``freqs`` [s, ..., rot_dim] (Su et al. 2021, RoFormer, eq. 34) in its first rot_dim
    channels, the same operations, the table's cos / sin reused (module docstring)."""
    import torch
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    if multi_latent_attention:
        x1 = t[..., 0::2]
        x2 = t[..., 1::2]
        t = torch.cat((x1, x2), dim=-1)
    cos_, sin_ = _cos_sin(freqs, mscale, t.dtype)
    t = (t * cos_) + (_rotate_half(t, rotary_interleaved) * sin_)
    if t_pass.shape[-1] == 0:
        return t
    return torch.cat((t, t_pass), dim=-1)


def enable() -> bool:
    """Put :func:`apply_rotary_pos_emb_bshd` in megatron-core's ``rope_utils`` (idempotent);
    returns True when the patch is applied."""
    if not PATCH.applies_to_installed():
        return False
    global MEGATRON_BSHD
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils._apply_rotary_pos_emb_bshd is not apply_rotary_pos_emb_bshd:
        MEGATRON_BSHD = rope_utils._apply_rotary_pos_emb_bshd
        rope_utils._apply_rotary_pos_emb_bshd = apply_rotary_pos_emb_bshd
    return True
