"""A stand-in for ``dpo_megatron.train`` that the launcher tests start through
``scripts/pretrain_dpo.sh`` (``DPO_MEGATRON_ENTRY=tests.launcher_entry``), to end a job quickly
the way a real run ends: ``DPO_TEST_ENDING=mistake`` reports a user's mistake with
:func:`dpo_megatron.launch.fail` (rank 0 a second after the others, the order in which torch
elastic would otherwise stop rank 0 before it printed), ``mistake_on_rank1`` on rank 1 alone
(rank 0 runs on), ``crash`` raises an exception on every rank."""

import os
import time

from dpo_megatron.launch import fail

MISTAKE = "error: data file pairs.jsonl, row 3: field 'chosen' is missing"


def main() -> None:
    rank = int(os.environ["RANK"])
    ending = os.environ["DPO_TEST_ENDING"]
    if ending == "mistake":
        if rank == 0:
            time.sleep(1.0)
        fail(MISTAKE)
    if ending == "mistake_on_rank1":  # rank 0 goes on (as if waiting in a collective)
        if rank == 0:
            time.sleep(300)
        fail(MISTAKE)
    raise RuntimeError(f"a bug on rank {rank}")


if __name__ == "__main__":
    main()
