"""compat.rope_tables_once: megatron-core's unfused RoPE gives the same bits and gradients with
the table's cos / sin made once (queries and keys of every layer keep one pair) and no copy
into an empty concatenation."""

import pytest
import torch


def _enabled():
    from megatron.core.models.common.embeddings import rope_utils

    from dpo_megatron.compat import rope_tables_once

    rope_tables_once.enable()
    return rope_utils, rope_tables_once


@pytest.mark.parametrize(
    "rot_dim, interleaved, mla, mscale",
    [(8, False, False, 1.0), (4, False, False, 1.0), (8, True, False, 0.7), (8, False, True, 1.0)],
)
def test_same_bits_and_gradients_as_megatron_cores(rot_dim, interleaved, mla, mscale):
    from dpo_megatron.compat.registry import installed_version

    rope_utils, patched = _enabled()
    assert rope_utils._apply_rotary_pos_emb_bshd is patched.apply_rotary_pos_emb_bshd
    assert installed_version("megatron-core").startswith("0.16")
    g = torch.Generator().manual_seed(0)
    freqs = torch.randn(6, 2, 1, rot_dim, generator=g)  # [s, b, 1, rot_dim]: a per-row table
    outs = []
    for fn in (patched.MEGATRON_BSHD, patched.apply_rotary_pos_emb_bshd):
        t = torch.randn(6, 2, 3, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = fn(
            t, freqs, rotary_interleaved=interleaved, multi_latent_attention=mla, mscale=mscale
        )
        (grad,) = torch.autograd.grad(out, t, torch.ones_like(out) * 0.5)
        outs.append((out.detach(), grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_queries_and_keys_of_every_layer_keep_one_cos_and_one_sin():
    """Three calls with one table (queries and keys of two layers) keep the same two tensors;
    a new table, or the same one changed in place, is computed afresh."""
    _, patched = _enabled()
    freqs = torch.randn(5, 1, 1, 8)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        for _ in range(3):
            patched.apply_rotary_pos_emb_bshd(torch.randn(5, 1, 2, 8, requires_grad=True), freqs)
    tables = {t.data_ptr() for t in kept if t.shape == freqs.shape}
    assert len(tables) == 2  # cos and sin once, for all three
    cos, _ = patched._cos_sin(freqs, 1.0, torch.float32)
    assert patched._cos_sin(freqs.clone(), 1.0, torch.float32)[0] is not cos
    freqs.mul_(2)
    assert torch.equal(patched._cos_sin(freqs, 1.0, torch.float32)[0], torch.cos(freqs))
