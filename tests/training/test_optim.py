"""training.optim.fuse_torch_adam_on_cpu: megatron-core's torch Adam(W) takes torch's fused CPU
kernel, with the updates of torch's per-parameter loop to rounding."""

import copy
from types import SimpleNamespace

import torch

from dpo_megatron.training.optim import fuse_torch_adam_on_cpu


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((7, 5), (5,), (3,))]


def _step(optimizer, params, grads) -> None:
    for p, grad in zip(params, grads):
        p.grad = grad.clone()
    optimizer.step()


def test_fused_cpu_adam_follows_torchs_loop_and_switches_only_fresh_cpu_groups():
    loop_params = _params(0)
    fused_params = copy.deepcopy(loop_params)

    def adamw(params):
        groups = [{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)

    loop = adamw(loop_params)
    # megatron-core's wrappers hold torch's optimizer as .optimizer, chained or alone
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adamw(fused_params))])
    assert fuse_torch_adam_on_cpu(chained) == 2
    fused = chained.chained_optimizers[0].optimizer
    assert [g["fused"] for g in fused.param_groups] == [True, True]
    assert [g["fused"] for g in loop.param_groups] == [None, None]  # torch's default: the loop
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in loop_params]
        _step(loop, loop_params, grads)
        _step(fused, fused_params, grads)
    for a, b, start in zip(fused_params, loop_params, _params(0)):
        assert (a - start).abs().max() > 1e-3  # three steps of lr 1e-2 moved every tensor
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    state = fused.state[fused_params[0]]
    assert state["step"].item() == 3.0 and state["step"].device == fused_params[0].device
    # once the state exists (a checkpoint loaded into it), it is left as made
    assert fuse_torch_adam_on_cpu(SimpleNamespace(optimizer=loop)) == 0
    assert [g["fused"] for g in loop.param_groups] == [None, None]
    # not torch's Adam (apex's / TE's fused Adam): untouched
    assert fuse_torch_adam_on_cpu(SimpleNamespace(optimizer=torch.optim.SGD(_params(2)))) == 0
