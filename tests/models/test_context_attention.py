"""The blockwise context-parallel attention kernel on one process (no CP group: keys are the
queries' own), against SDPA with the dense rule of ``models.attention.visible_keys``."""

import pytest
import torch
import torch.nn.functional as F

from dpo_megatron.models.attention import visible_keys
from dpo_megatron.models.context_attention import blockwise_attention, context_parallel_coordinates


def _inputs(rows, length, heads=4, groups=2, hn=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, length, hn, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(rows, groups, length, hn, generator=g, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    return q, k, v


def _reference(q, k, v, visible):
    rep = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(rep, 1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.3)


@pytest.mark.parametrize("block", [3, 4, 64])
def test_blockwise_equals_dense_rule_for_padded_packed_and_shared_rows(block):
    # Row 0: a shared-prompt unit (prompt 3, chosen 2, rejected 3) then a plain sequence of 2;
    # row 1: one sequence of 10 (a padded-style row).
    positions = torch.tensor([[0, 1, 2, 3, 4, 3, 4, 5, 0, 1], list(range(10))])
    segments = torch.tensor([[0] * 8 + [1, 1], [2] * 10])
    branches = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 0, 0], [0] * 10])
    q, k, v = _inputs(2, 10)
    coords = context_parallel_coordinates(positions, segments, branches)
    out = blockwise_attention(q, k, v, coords, 0.3, block)
    want = _reference(q, k, v, visible_keys(segments, branches))
    assert torch.allclose(out, want, atol=1e-12)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-10)


def test_positions_not_row_order_decide_causality():
    """Keys in a permuted (gathered) order: the rule reads positions, so the result is the same
    as the natural order's; a wrong position changes it."""
    perm = torch.tensor([0, 1, 6, 7, 2, 3, 4, 5])  # CP 2 gather order of an 8-token row
    positions = torch.arange(8)[None]
    q, k, v = _inputs(1, 8, seed=1)
    natural = blockwise_attention(q, k, v, context_parallel_coordinates(positions), 0.3, 3)
    permuted = blockwise_attention(
        q[:, :, perm],
        k[:, :, perm],
        v[:, :, perm],
        context_parallel_coordinates(positions[:, perm]),
        0.3,
        3,
    )
    assert torch.allclose(permuted, natural[:, :, perm], atol=1e-12)
    wrong = positions[:, perm].clone()
    wrong[0, 2] = 2  # token 6 claims position 2
    broken = blockwise_attention(
        q[:, :, perm], k[:, :, perm], v[:, :, perm], context_parallel_coordinates(wrong), 0.3, 3
    )
    assert not torch.allclose(broken, natural[:, :, perm], atol=1e-6)


class HostReads:
    """Counts the reads of device values by the host (``bool()``, ``item()``, ``tolist()``):
    on a GPU each one waits for every kernel queued before it."""

    def __init__(self, monkeypatch):
        self.count = 0
        self.inside = False
        for name in ("__bool__", "item", "tolist"):
            real = getattr(torch.Tensor, name)

            def counted(t, *args, _real=real, **kwargs):
                # A torch-function mode (compat.cuda_on_cpu, when an earlier test of this
                # process switched it on) calls the patched method again: count the outer call.
                if self.inside:
                    return _real(t, *args, **kwargs)
                self.count += 1
                self.inside = True
                try:
                    return _real(t, *args, **kwargs)
                finally:
                    self.inside = False

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_the_host_reads_the_tile_map_once_per_forward_not_per_tile(monkeypatch):
    """Block 3 on rows of 10 tokens: 16 tiles per pass. The forward reads which tiles to compute
    once; the backward and another layer's forward on the same coordinates read nothing."""
    positions = torch.tensor([[0, 1, 2, 3, 4, 3, 4, 5, 0, 1], list(range(10))])
    segments = torch.tensor([[0] * 8 + [1, 1], [2] * 10])
    branches = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 0, 0], [0] * 10])
    coords = context_parallel_coordinates(positions, segments, branches)
    q, k, v = _inputs(2, 10)
    want = _reference(q, k, v, visible_keys(segments, branches))
    reads = HostReads(monkeypatch)
    out = blockwise_attention(q, k, v, coords, 0.3, 3)
    assert reads.count == 1
    out.sum().backward()
    again = blockwise_attention(q, k, v, coords, 0.3, 3)  # the next layer
    assert reads.count == 1
    monkeypatch.undo()
    assert torch.allclose(out, want, atol=1e-12) and torch.allclose(again, want, atol=1e-12)


@pytest.mark.parametrize("kernel", ["sdpa", "flex", "auto"])
def test_context_parallelism_replaces_every_local_kernel(kernel):
    """ATTENTION.md: under CP > 1 the local layer spec attends with ContextParallelAttention
    whatever ``model.local_attention`` names (so flex trains on the CPU there); at CP 1 the name
    picks the kernel."""
    from dpo_megatron.models import ModelConfig, build_transformer_config
    from dpo_megatron.models.attention import LocalAttention, resolve_local_attention
    from dpo_megatron.models.context_attention import ContextParallelAttention
    from dpo_megatron.models.specs import _local_layer
    from dpo_megatron.parallel import ParallelConfig
    from tests.engine import TINY

    model = ModelConfig(**TINY, local_attention=kernel)

    def core(cp: int):
        config = build_transformer_config(model, ParallelConfig(context_parallel_size=cp))
        return _local_layer(model, config, None).submodules.self_attention.submodules

    assert core(2).core_attention is ContextParallelAttention
    spec = core(1).core_attention
    assert spec.module is LocalAttention
    assert spec.params == {"kernel": resolve_local_attention(kernel)}  # auto: sdpa on the CPU
