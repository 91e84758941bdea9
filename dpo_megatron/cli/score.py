"""Score a JSONL of (prompt, completion) rows with a reward model:
``python -m dpo_megatron.score [--config FILE] --input IN.jsonl --output OUT.jsonl [k=v ...]``.

The reward model is ``model.hf_path`` (an HF ``*ForSequenceClassification`` folder, e.g. a
reward run's export) or ``model.load`` (a ``loss.name=bradley_terry`` run's checkpoint); the
layout is ``parallel.*`` (a single process, or one process per rank under torchrun), the rows per
forward ``train.micro_batch_size``. The rows, their tokenization and the output are
:mod:`dpo_megatron.reward.rows`'s; other packages call :mod:`dpo_megatron.reward.scoring`
in-process. A mistake ends every rank with one line and status 2 (a bad row names the file, the
line and the field).
"""

from __future__ import annotations

from collections.abc import Sequence

from dpo_megatron.cli import command
from dpo_megatron.config import load_config


def main(argv: Sequence[str] | None = None) -> None:
    """One rank of the scoring command (module docstring)."""
    from dpo_megatron.utils.ranks import is_rank0

    p = command.parser(__doc__, "python -m dpo_megatron.score")
    p.add_argument("--input", required=True, help="JSONL of {prompt, completion} rows")
    p.add_argument("--output", required=True, help="JSONL to write: the rows plus score")
    args = command.parse(p, argv)
    with command.stops(config=True):
        cfg = load_config(args.config, args.overrides, check=False)
        command.check_start(cfg, run_folder=False)
        cfg.model.validate()
    from dpo_megatron.reward.rows import score_file

    scores = command.run_in_ranks(
        score_file,
        args.input,
        args.output,
        model=cfg.model,
        parallel=cfg.parallel,
        data=cfg.data,
        micro_batch_size=cfg.train.micro_batch_size,
        mistakes=(ValueError, FileNotFoundError),  # the rows and the model the command reads
    )
    if is_rank0():
        print(f"scored {len(scores)} rows -> {args.output}", flush=True)


if __name__ == "__main__":
    command.start(main, ranks=True)
