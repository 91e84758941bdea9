"""compat.mla_rope_key_grad: megatron-core 0.16's multi-latent attention gathers its
column-parallel key/value down projection over TP and shares the RoPE key among heads that live
on different TP ranks. On 2 ranks, the down projection's gradient through megatron-core's own
gather (as its layer runs it: gather, split, each rank's heads using the RoPE key) is compared
with the same function on one rank: without the patch the RoPE columns keep one rank's share
(and the latent columns are right); with it every column equals one rank's gradient. The whole
model is checked at TP 2 x PP 2 x EP 2 against one rank in ``training/test_moe_dpo``."""

import torch

from tests.multirank import run_ranks

LATENT, ROPE, HEADS, S, H = 6, 4, 4, 5, 3


def _weights():
    g = torch.Generator().manual_seed(0)
    down = torch.randn(LATENT + ROPE, H, generator=g, dtype=torch.float64)
    up = torch.randn(HEADS, LATENT, generator=g, dtype=torch.float64)  # latent -> one value/head
    rope_use = torch.randn(HEADS, ROPE, generator=g, dtype=torch.float64)  # each head's key use
    x = torch.randn(S, H, generator=g, dtype=torch.float64)
    return down, up, rope_use, x


def _loss(latent, rope, up, rope_use, heads):
    """The heads ``heads`` of an MLA-like layer: each uses the whole latent through its up
    projection and the shared RoPE key (a scalar stand-in for attention)."""
    return (latent @ up[heads].t()).tanh().sum() + (rope @ rope_use[heads].t()).sin().sum()


def _two_ranks(patched: bool):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )
    from megatron.core.transformer import multi_latent_attention as mla

    from dpo_megatron.compat import mla_rope_key_grad
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed

    initialize_distributed(ParallelConfig(tensor_model_parallel_size=2))
    if patched:
        assert mla_rope_key_grad.enable() and mla_rope_key_grad.enable()  # idempotent
    rank, width = ps.get_tensor_model_parallel_rank(), (LATENT + ROPE) // 2
    down, up, rope_use, x = _weights()
    shard = down[rank * width : (rank + 1) * width].clone().requires_grad_()
    kv_shard = x @ shard.t()  # ColumnParallelLinear's output: this rank's columns
    if patched:
        mla_rope_key_grad.mark_rope_key_source(kv_shard, ROPE)
    kv_combined = mla.gather_from_tensor_model_parallel_region(kv_shard)
    latent, rope = kv_combined.split([LATENT, ROPE], dim=-1)
    # the latent enters a column-parallel up projection (its input gradient summed over TP);
    # the RoPE key is used as it is, by this rank's heads only
    latent = copy_to_tensor_model_parallel_region(latent)
    heads = list(range(rank * HEADS // 2, (rank + 1) * HEADS // 2))
    loss = reduce_from_tensor_model_parallel_region(_loss(latent, rope, up, rope_use, heads))
    loss.backward()
    grads = [torch.empty_like(shard.grad) for _ in range(2)]
    dist.all_gather(grads, shard.grad)
    return torch.cat(grads)


def test_rope_key_gradient_over_tp_equals_one_rank():
    down, up, rope_use, x = _weights()
    whole = down.clone().requires_grad_()
    latent, rope = (x @ whole.t()).split([LATENT, ROPE], dim=-1)
    _loss(latent, rope, up, rope_use, list(range(HEADS))).backward()
    want = whole.grad
    unpatched = run_ranks(_two_ranks, world_size=2, patched=False)[0]
    patched = run_ranks(_two_ranks, world_size=2, patched=True)[0]
    assert torch.allclose(unpatched[:LATENT], want[:LATENT])  # the latent's gradient is whole
    assert not torch.allclose(unpatched[LATENT:], want[LATENT:])  # the fault: one rank's share
    assert torch.allclose(patched, want, rtol=1e-12, atol=1e-12)
