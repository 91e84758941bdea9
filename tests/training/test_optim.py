"""training.optim.fuse_torch_adam_on_cpu: megatron-core's torch Adam(W) takes torch's fused CPU
kernel, with the updates of torch's per-parameter loop to rounding, and every data-parallel
rank the same settings: replicas stay bit-identical."""

import copy
from types import SimpleNamespace

import pytest
import torch

from dpo_megatron.training.optim import fuse_torch_adam_on_cpu
from tests.multirank import run_in_turn, run_ranks

CPU = torch.device("cpu")


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
    assert fuse_torch_adam_on_cpu(chained, CPU) == 2
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
    assert fuse_torch_adam_on_cpu(SimpleNamespace(optimizer=loop), CPU) == 0
    assert [g["fused"] for g in loop.param_groups] == [None, None]
    # not torch's Adam (apex's / TE's fused Adam): untouched
    assert fuse_torch_adam_on_cpu(SimpleNamespace(optimizer=torch.optim.SGD(_params(2))), CPU) == 0


def test_every_group_of_a_cpu_run_is_switched_an_empty_one_too():
    """The run's device decides, not the parameters a rank holds: with the distributed optimizer
    a data-parallel rank's share of a group can be empty, and it must get the settings the other
    ranks' share gets (a CUDA run keeps torch's default everywhere)."""

    def adamw():
        return torch.optim.AdamW([{"params": _params(0)}, {"params": [], "weight_decay": 0.0}])

    fused = adamw()
    assert fuse_torch_adam_on_cpu(SimpleNamespace(optimizer=fused), CPU) == 2
    assert [(g["fused"], g["foreach"]) for g in fused.param_groups] == [(True, False)] * 2
    kept = adamw()
    assert fuse_torch_adam_on_cpu(SimpleNamespace(optimizer=kept), torch.device("cuda", 0)) == 0
    assert [(g["fused"], g["foreach"]) for g in kept.param_groups] == [(None, None)] * 2


class _Records(list):
    """A logging handler's records, as a list (megatron-core warns through ``logging``)."""

    level = 0

    def handle(self, record) -> None:
        self.append(record.getMessage())


def _dp2_replicas(run_dir: str, use_distributed_optimizer: bool) -> dict:
    """3 steps of the tiny model at DP 2 and the final save: this rank's weights (bytes), its
    Adam settings per group and what megatron-core's save said about the ranks' common state."""
    import logging

    from tests.engine import SHALLOW, tiny_pairs, tiny_trainer

    records = _Records()
    logging.getLogger("megatron.core.dist_checkpointing").addHandler(records)
    trainer = tiny_trainer(
        tiny_pairs(12),
        model={**SHALLOW, "vocab_size": 4096},  # an embedding that fills a rank's shard
        run_dir=run_dir,
        steps=3,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    start = [p.detach().clone() for p in trainer.policy[0].module.parameters()]
    trainer.train()  # 3 steps, then the final checkpoint
    params = list(trainer.policy[0].module.parameters())
    trainer.close()
    inner = [o.optimizer for o in getattr(trainer.optimizer, "chained_optimizers", [])]
    return {
        "weights": b"".join(p.detach().numpy().tobytes() for p in params),
        "moved": min(float((p.detach() - s).abs().max()) for p, s in zip(params, start)),
        "groups": [
            {k: v for k, v in g.items() if k != "params"} for o in inner for g in o.param_groups
        ],
        "group_sizes": [len(g["params"]) for o in inner for g in o.param_groups],
        "warnings": [m for m in records if "differs" in m],
    }


@pytest.mark.slow
def test_data_parallel_replicas_stay_bit_identical_with_and_without_distributed_optimizer(
    tmp_path,
):
    """At DP 2 the two replicas hold bit-identical weights after 3 steps, with Adam's state
    sharded over the ranks (distributed optimizer) and with each rank stepping all of it; both
    ranks' Adam groups have the same settings (fused on the CPU), an empty share of a group
    included, so megatron-core's save finds the ranks' common state equal (no "Rank 1 common
    state dict differs ... 'fused'" warning)."""
    cases = {
        name: {"run_dir": str(tmp_path / name), "use_distributed_optimizer": dist}
        for name, dist in (("distributed", True), ("replicated", False))
    }
    ranks = run_ranks(run_in_turn, world_size=2, each=_dp2_replicas, cases=cases)
    for name in cases:
        rank0, rank1 = ranks[0][name], ranks[1][name]
        assert rank0["moved"] > 0 and rank1["moved"] > 0, name  # every tensor was updated
        assert rank0["weights"] == rank1["weights"], name
        assert rank0["groups"] == rank1["groups"], name
        assert all(g["fused"] is True and g["foreach"] is False for g in rank0["groups"]), name
        assert rank0["warnings"] == rank1["warnings"] == [], name
    # The case this guards: the no-decay group (norms) lies wholly in rank 0's shard
    sizes = ranks[0]["distributed"]["group_sizes"], ranks[1]["distributed"]["group_sizes"]
    assert 0 in sizes[1] and 0 not in sizes[0], sizes
