"""A stand-in for ``dpo_megatron.cli.train`` that the launcher tests start through
``scripts/pretrain_dpo.sh`` (``DPO_MEGATRON_ENTRY=tests.launcher_entry``), to end a job quickly
the way a real run ends: ``DPO_TEST_ENDING=mistake`` reports a user's mistake with
:func:`dpo_megatron.utils.exits.fail` (rank 0 a second after the others, the order in which torch
elastic would otherwise stop rank 0 before it printed), ``mistake_on_rank1`` on rank 1 alone
(rank 0 runs on), ``crash`` raises an exception on every rank. The others run the real
``dpo_megatron.cli.train`` (its own stops and messages) with one thing changed: ``nan_from_step_N``
a loss that is NaN from optimizer step N on; ``slow_steps`` a sleep of
``DPO_TEST_STEP_SLEEP`` seconds before each step (a signal then lands inside a step);
``sigterm_in_first_save`` a SIGTERM that rank 1 sends itself as its first checkpoint save
starts (the ranks agreed on "no signal" just before); ``fault_after_first_save`` the write of a
line into the file ``DPO_TEST_FAULT`` by rank 0 right after the first save (an ext4 file
system's ``trigger_fs_error``: the disk turns read-only)."""

import os
import signal
import time

from dpo_megatron.utils.exits import fail

MISTAKE = "error: data file pairs.jsonl, row 3: field 'chosen' is missing"
RANK1_GRACE_S = 4.0
"""``mistake_on_rank1``'s wait for rank 0 (:data:`dpo_megatron.utils.exits.RANK0_GRACE_S`, 20 s,
set shorter in the ranks): the wait and what follows it are the same at any length. Rank 1
writes the time its wait starts into the file ``DPO_TEST_FAIL_TIME``."""


def _train_with_nan_from(step_from: int) -> None:
    """dpo_megatron.cli.train.main (arguments from the command line) where every loss value of
    optimizer step ``step_from`` and later is NaN, on every rank."""
    import dpo_megatron.cli.train as train_module
    import dpo_megatron.training.trainer as trainer_module

    real_build_loss, real_step = trainer_module.build_loss, trainer_module.Trainer.train_step
    nan = {"on": False}

    def build_loss(cfg):
        loss_fn = real_build_loss(cfg)
        real_call = loss_fn.__call__

        class NaNLoss(type(loss_fn)):
            def __call__(self, *args, **kwargs):
                losses, metrics = real_call(*args, **kwargs)
                return (losses * float("nan") if nan["on"] else losses), metrics

        loss_fn.__class__ = NaNLoss
        return loss_fn

    def train_step(self):
        nan["on"] = self.counters.step + 1 >= step_from
        return real_step(self)

    trainer_module.build_loss = build_loss
    trainer_module.Trainer.train_step = train_step
    train_module.main()


def _train_with_slow_steps(seconds: float) -> None:
    """dpo_megatron.cli.train.main where each optimizer step starts with a sleep of ``seconds``."""
    import dpo_megatron.cli.train as train_module
    import dpo_megatron.training.trainer as trainer_module

    real_step = trainer_module.Trainer.train_step

    def train_step(self):
        time.sleep(seconds)
        return real_step(self)

    trainer_module.Trainer.train_step = train_step
    train_module.main()


def _train_around_first_save(before=None, after=None) -> None:
    """dpo_megatron.cli.train.main where ``before()`` runs as this process's first checkpoint save
    starts and ``after()`` once it is written (each on every rank; None: nothing)."""
    import dpo_megatron.checkpointing.run_checkpoint as run_checkpoint
    import dpo_megatron.cli.train as train_module

    real_save = run_checkpoint.Checkpointer.save
    saves = []

    def save(self, counters):
        first = not saves
        saves.append(counters.step)
        if first and before:
            before()
        path = real_save(self, counters)
        if first and after:
            after()
        return path

    run_checkpoint.Checkpointer.save = save
    train_module.main()


def _sigterm_on_rank_1() -> None:
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGTERM)


def _fault_on_rank_0() -> None:
    from dpo_megatron.utils import ranks

    if ranks.is_rank0():
        with open(os.environ["DPO_TEST_FAULT"], "w") as f:
            f.write("test\n")
    ranks.barrier()


def main() -> None:
    ending = os.environ["DPO_TEST_ENDING"]
    if ending.startswith("nan_from_step_"):
        return _train_with_nan_from(int(ending.rsplit("_", 1)[1]))
    if ending == "slow_steps":
        return _train_with_slow_steps(float(os.environ["DPO_TEST_STEP_SLEEP"]))
    if ending == "sigterm_in_first_save":
        return _train_around_first_save(before=_sigterm_on_rank_1)
    if ending == "fault_after_first_save":
        return _train_around_first_save(after=_fault_on_rank_0)
    rank = int(os.environ["RANK"])
    if ending == "mistake":
        if rank == 0:
            time.sleep(1.0)
        fail(MISTAKE)
    if ending == "mistake_on_rank1":  # rank 0 goes on (as if waiting in a collective)
        import dpo_megatron.utils.exits as exits

        exits.RANK0_GRACE_S = RANK1_GRACE_S
        if rank == 0:
            time.sleep(300)
        with open(os.environ["DPO_TEST_FAIL_TIME"], "w") as f:  # when rank 1's wait starts
            f.write(repr(time.time()))
        fail(MISTAKE)
    raise RuntimeError(f"a bug on rank {rank}")


if __name__ == "__main__":
    main()
