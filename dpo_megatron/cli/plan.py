"""Which layout fits a run's model on a cluster, and how fast: the layout planner.

    python -m dpo_megatron.plan --config configs/gpu/llama3.1_8b_h100.yaml --gpu h100 \
        --nodes 1 --gpus-per-node 8
    scripts/pretrain_dpo.sh --plan --config FILE --gpu h200 --nodes 4 [key=value ...]
    python -m dpo_megatron.plan --config FILE --gpu h100 --json plan.json

Reads the run's config as the launcher does, enumerates every layout of the cluster that the
engine's own rules accept (``planning.search``) and prints them ranked with per-GPU memory by
part and the predicted step time, the reasons for the others, and the best as a config snippet
(``planning.report``; ``--json``: the same records). How the numbers are made and how far to
trust them: docs/PLANNER.md. Exit status: 0 when the config's own layout fits, 2 when it does
not (too big, or refused on this cluster), 1 for a config mistake (one ``config error:`` line).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dpo_megatron.cli import command
from dpo_megatron.config import load_config, validate
from dpo_megatron.planning.hardware import ACCELERATORS, cluster_from_options
from dpo_megatron.planning.report import TOP, plan_report

OPTIONS = (  # flag, type, default, help
    ("--gpu", str, "h100", f"accelerator: {', '.join(ACCELERATORS)}, a torch device name, or cpu"),
    ("--nodes", int, 1, None),
    ("--gpus-per-node", int, 8, None),
    ("--gpu-memory-gib", float, 0.0, "override the memory"),
    ("--peak-tflops", float, 0.0, "override the dense bf16 peak (--gpu cpu: the ranks' fp32, 0.1)"),
    ("--mfu", float, 0.35, "share of the peak the FLOPs run at"),
    ("--reserved-gib", float, 3.0, "per-GPU memory kept for the CUDA context and NCCL"),
    ("--margin", float, 0.10, "share of the peak kept for fragmentation and the estimate's error"),
    ("--expert-overhead-us", float, 50.0, "host time per expert and pass of SequentialMLP (us)"),
    ("--inter-node-gbps", float, 50.0, "per GPU and direction"),
    ("--intra-node-gbps", float, 0.0, "override the GPUs' link in a node (default: the table's)"),
    ("--prompt-fraction", float, None, "the prompt's share (default max_prompt_length/max_length)"),
    ("--train-pairs", int, None, "items in the training data (for reference.mode=auto)"),
    ("--top", int, TOP, "rows of the table"),
    ("--json", str, "", "write every layout's record to this file"),
    ("--json-top", int, 0, "only the first N records (ranked) in the JSON (0: all)"),
)


RECIPE = "configs/gpu/llama3.1_8b_h100.yaml"
"""The recipe a planner started without ``--config`` points to."""


def _run_config(config_file: str | None, overrides: list[str]):
    """The validated config of the run to plan (no tokenizer needed: the planner reads no text).

    Raises:
        ValueError: a config mistake; without ``config_file`` (the defaults and overrides alone
            are rarely a run) it says to pass ``--config FILE``.
    """
    try:
        cfg = load_config(config_file, overrides, check=False)
        if not (cfg.model.hf_path or cfg.model.load or cfg.data.tokenizer):
            # the tokenizer rule is the data path's: the planner reads no text
            cfg = dataclasses.replace(
                cfg, data=dataclasses.replace(cfg.data, tokenizer="(not needed to plan)")
            )
        validate(cfg)
    except ValueError as e:
        if config_file is not None:
            raise
        raise ValueError(
            f"{e} (no --config given: the planner plans a run's config; pass --config FILE, "
            f"e.g. {RECIPE} or another recipe of configs/gpu/)"
        ) from None
    return cfg


def run(argv: Sequence[str] | None = None) -> dict:
    """Plan (module docstring); returns the JSON document it prints or writes."""
    p = command.parser(__doc__, "python -m dpo_megatron.plan")
    for flag, kind, default, text in OPTIONS:
        p.add_argument(flag, type=kind, default=default, help=text)
    p.add_argument("--layout", action="store_true", help="only the config's own layout")
    args = p.parse_intermixed_args(argv)  # a bad override is the config's mistake (status 1)
    cfg = _run_config(args.config, args.overrides)
    cluster = cluster_from_options(args)
    document = plan_report(
        cfg,
        cluster,
        validate,
        layout_only=args.layout,
        top=args.top,
        prompt_fraction=args.prompt_fraction,
        train_pairs=args.train_pairs,
        json_top=args.json_top,
    )
    if args.json:
        from dpo_megatron.utils.files import write_json_atomic

        write_json_atomic(args.json, document)
    return document


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m dpo_megatron.plan``: a config mistake ends with one ``config error:`` line
    (exit status 1); otherwise the exit status says whether the config's own layout fits (0)
    or not (2: too big, or refused on this cluster)."""
    with command.stops(config=True, launcher=True):
        document = run(argv)
    if not document["config_layout"]["fits"]:
        raise SystemExit(2)


if __name__ == "__main__":
    command.start(main, ranks=False)
