"""Which layout fits a run's model on a cluster, and how fast: the layout planner.

    python -m dpo_megatron.plan --config configs/gpu/llama3.1_8b_h100.yaml --gpu h100 \
        --nodes 1 --gpus-per-node 8
    scripts/pretrain_dpo.sh --plan --config FILE --gpu h200 --nodes 4 [key=value ...]
    python -m dpo_megatron.plan --config FILE --gpu h100 --json plan.json

Reads the run's config as the launcher does (the model from ``model.hf_path``, a preset or
``model.*``; lengths, batch sizes, loss, packing, reference, LoRA, MoE, recompute), enumerates
every layout of the cluster that the engine's own rules accept (``dpo_megatron.planning.search``)
and prints them ranked, with per-GPU memory by part, the predicted step time and the reason for
every layout left out; then the best one as a config snippet. ``--json`` writes the same table.
Memory is what the ranks allocate (``torch.cuda.max_memory_allocated``); a layout fits when its
peak plus ``--margin`` of it (the allocator's fragmentation, the estimate's error) plus
``--reserved-gib`` (the CUDA context, NCCL) is within the device's memory. Times are estimates at
``--mfu``, every sequence as long as ``data.max_length`` allows (an upper bound for real data).
Exit status: 0 when the config's own layout fits, 2 when it does not (too big, or refused on
this cluster), 1 for a config mistake (one ``config error:`` line).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from typing import Optional, Sequence

from dpo_megatron.config import load_config, validate
from dpo_megatron.planning.hardware import (
    ACCELERATORS,
    GIB,
    Cluster,
    find_accelerator,
    host_cluster,
)

TOP = 12


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="the run's YAML file")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    p.add_argument(
        "--gpu",
        default="h100",
        help=f"accelerator: {', '.join(ACCELERATORS)}, a torch device name, or cpu",
    )
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory-gib", type=float, default=0.0, help="override the memory")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=0.0,
        help="override the dense bf16 peak (with --gpu cpu: the ranks' fp32 rate together, "
        "default 0.1)",
    )
    p.add_argument("--mfu", type=float, default=0.35, help="share of the peak the FLOPs run at")
    p.add_argument(
        "--reserved-gib",
        type=float,
        default=3.0,
        help="per-GPU memory kept for the CUDA context and NCCL",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=0.10,
        help="share of the predicted peak kept for the allocator's fragmentation and the "
        "estimate's error",
    )
    p.add_argument(
        "--expert-overhead-us",
        type=float,
        default=50.0,
        help="host time per expert and pass of megatron-core's SequentialMLP (microseconds)",
    )
    p.add_argument("--inter-node-gbps", type=float, default=50.0, help="per GPU and direction")
    p.add_argument(
        "--intra-node-gbps",
        type=float,
        default=0.0,
        help="override the GPUs' link to each other in a node (per direction; default the "
        "table's NVLink / PCIe)",
    )
    p.add_argument(
        "--prompt-fraction",
        type=float,
        default=None,
        help="the prompt's share of a sequence (default data.max_prompt_length / max_length)",
    )
    p.add_argument(
        "--train-pairs",
        type=int,
        default=None,
        help="items in the training data (resolves reference.mode=auto as the run would)",
    )
    p.add_argument("--layout", action="store_true", help="only the config's own layout")
    p.add_argument("--top", type=int, default=TOP, help="rows of the table")
    p.add_argument("--json", default="", help="write every layout's record to this file")
    p.add_argument(
        "--json-top",
        type=int,
        default=0,
        help="only the first N records (ranked) in the JSON (0: all)",
    )
    return p


def cluster_from_args(args) -> Cluster:
    """The cluster the options describe.

    Raises:
        ValueError: an unknown ``--gpu`` without ``--gpu-memory-gib`` and ``--peak-tflops``.
    """
    import dataclasses

    for name, value, low in (
        ("--nodes", args.nodes, 1),
        ("--gpus-per-node", args.gpus_per_node, 1),
    ):
        if value < low:
            raise ValueError(f"{name}={value} must be >= {low}")
    if not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu={args.mfu} must be in (0, 1]: a share of the peak")
    if args.margin < 0 or args.reserved_gib < 0:
        raise ValueError("--margin and --reserved-gib must be >= 0")
    ranks = args.nodes * args.gpus_per_node
    if args.gpu.lower() == "cpu":
        import psutil

        memory = args.gpu_memory_gib or psutil.virtual_memory().total / GIB
        return host_cluster(ranks, memory, args.peak_tflops or 0.1)
    accelerator = find_accelerator(args.gpu)
    if accelerator is None:
        if not (args.gpu_memory_gib and args.peak_tflops):
            given = [
                flag
                for flag, v in (
                    ("--gpu-memory-gib", args.gpu_memory_gib),
                    ("--peak-tflops", args.peak_tflops),
                )
                if v
            ]
            raise ValueError(
                f"--gpu {args.gpu!r} is not in the table ({', '.join(ACCELERATORS)}): give both "
                f"--gpu-memory-gib and --peak-tflops (given: {', '.join(given) or 'neither'}; "
                "--intra-node-gbps for its links)"
            )
        accelerator = find_accelerator("h100")
        accelerator = dataclasses.replace(accelerator, sku=args.gpu, device_names=())
    if args.gpu_memory_gib:
        accelerator = dataclasses.replace(accelerator, memory_gib=args.gpu_memory_gib)
    if args.peak_tflops:
        accelerator = dataclasses.replace(accelerator, bf16_tflops=args.peak_tflops)
    if args.intra_node_gbps:
        accelerator = dataclasses.replace(accelerator, intra_node_gbps=args.intra_node_gbps)
    return Cluster(
        args.nodes,
        args.gpus_per_node,
        accelerator,
        inter_node_gbps=args.inter_node_gbps,
        reserved_gib=args.reserved_gib,
        margin=args.margin,
        mfu=args.mfu,
        expert_overhead_us=args.expert_overhead_us,
    )


def check(cfg) -> None:
    """The launcher's pre-check rules for a whole config (``config.validate``)."""
    validate(cfg)


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def _row(label: str, plan) -> str:
    p = plan.parallel
    layout = (
        f"{p.tensor_model_parallel_size:>2} {p.pipeline_model_parallel_size:>2} "
        f"{p.virtual_pipeline_model_parallel_size or '-':>3} {p.context_parallel_size:>2} "
        f"{p.expert_model_parallel_size:>2} {p.data_parallel_size:>3}"
    )
    m, t = plan.memory, plan.time
    parts = " ".join(
        f"{_gib(v):>6}"
        for v in (
            m.weights,
            m.grads,
            m.optimizer,
            m.reference,
            m.activations,
            m.logits,
            m.workspace,
        )
    )
    tok = plan.tokens_per_step / t.total_s / (p.launch_world_size())
    return (
        f"{label:>4} {layout} {plan.micro_batch_size:>3} {plan.recompute:>9} {parts} "
        f"{_gib(m.total):>6} {t.total_s:>7.2f} {tok:>8.0f}  {plan.status}"
    )


HEADER = (
    "   #  TP PP VPP CP EP  DP mbs recompute weight  grads  optim    ref   acts logits   work "
    " total  step s tok/s/GPU fits\n"
    "                                          (GiB per GPU, for the stage that needs most)"
)


def _model_line(model, name: str) -> str:
    from dpo_megatron.parallel.config import ParallelConfig
    from dpo_megatron.planning.parameters import stage_parameter_count

    total = stage_parameter_count(model, ParallelConfig(), 0)
    experts = (
        f", {model.num_experts} experts (top {model.moe_router_topk})"
        if (model.num_experts)
        else ""
    )
    return (
        f"model: {name} ({model.num_layers} layers, hidden {model.hidden_size}{experts}; "
        f"{total / 1e9:.2f} B parameters)"
    )


def _work_line(loss_fn, workload, numerics) -> str:
    through = (
        f", {workload.item_tokens()} through the layers with the prompt once"
        if workload.share_prompt
        else ""
    )
    if workload.reference == "none":
        reference = "no reference"
    else:
        reference = f"reference {workload.reference}"
        reference += " (the LoRA base)" if workload.reference_is_base else ""
        reference += " offloaded" if workload.reference_offload else ""
    head = (
        ("fused" if numerics.fused_lm_head else "unfused") + " LM head"
        if workload.lm_head
        else "reward head"
    )
    return (
        f"work: {loss_fn.describe()}; {workload.global_batch_size} items per step, each "
        f"{workload.sequences_per_item} x {workload.max_length} tokens at most (prompt "
        f"{workload.prompt_fraction:.0%}{through}); {reference}; "
        f"{'bf16' if numerics.bf16 else 'fp32'}, {head}"
    )


def _cluster_line(cluster: Cluster) -> str:
    a = cluster.accelerator
    if cluster.host:
        return (
            f"cluster: {cluster.world_size} ranks on this CPU: {cluster.budget()}; "
            f"{a.bf16_tflops * cluster.world_size:g} TFLOP/s fp32 together (--peak-tflops)"
        )
    return (
        f"cluster: {cluster.nodes} x {cluster.gpus_per_node} {a.sku}: {cluster.budget()}; "
        f"{a.bf16_tflops:g} TFLOP/s peak at MFU {cluster.mfu:.0%}; links "
        f"{a.intra_node_gbps:g} GB/s in a node, {cluster.inter_node_gbps:g} GB/s between nodes"
    )


def _snippet(plan) -> str:
    """The plan as YAML sections to paste into the config."""
    sections: dict[str, list[str]] = {}
    for item in plan.overrides():
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        line = f"  {name}: {value}"
        if name == "data_parallel_size":
            line += "   # what this cluster leaves; null lets any allocation decide (SLURM)"
        sections.setdefault(section, []).append(line)
    return "\n".join(f"{s}:\n" + "\n".join(lines) for s, lines in sections.items())


def _short_reason(reason: str, width: int = 150) -> str:
    """The rule's first sentence, cut to ``width`` characters."""
    first = reason.split(". ")[0]
    return first if len(first) <= width else first[: width - 3] + "..."


def _nothing_fits(plans, cluster, cfg, workload) -> str:
    """Why no layout fits, and what to change."""
    estimated = [p for p in plans if p.valid]
    if not estimated:
        reasons = Counter(_short_reason(p.reason) for p in plans)
        reason, count = reasons.most_common(1)[0]
        return (
            f"no layout fits: the engine's rules refuse all {len(plans)}; the most common reason "
            f"({count}): {reason}"
        )
    smallest = min(estimated, key=lambda p: p.memory.total)
    m = smallest.memory
    static = m.weights + m.grads + m.optimizer + m.reference
    if static > cluster.usable_bytes:
        advice = ["more GPUs (more pipeline stages, or data-parallel ranks to shard the optimizer)"]
    else:
        advice = ["a shorter data.max_length", "more GPUs"]
        if cfg.model.recompute_granularity != "full":
            advice.insert(1, "full recompute (model.recompute_granularity=full)")
    if not cfg.lora.enabled:
        advice.append("LoRA (lora.enabled=true)")
    if workload.reference == "model" and not workload.reference_is_base:
        advice.append("reference.mode=precomputed")
    return (
        f"no layout fits: the smallest needs {_gib(m.total)} GiB per GPU "
        f"({' '.join(smallest.overrides())}), of which {_gib(static)} GiB are weights, "
        f"gradients, optimizer state and reference; {cluster.budget()}. Try "
        + ", ".join(advice[:-1])
        + (" or " if len(advice) > 1 else "")
        + advice[-1]
    )


def run(argv: Optional[Sequence[str]] = None) -> dict:
    """Plan (module docstring); returns the JSON document it prints or writes."""
    from dpo_megatron.losses import build_loss
    from dpo_megatron.planning.from_config import (
        config_layout,
        numerics_for,
        resolved_model,
        workload_for,
    )
    from dpo_megatron.planning.search import Plan, plan_layouts

    args = _parser().parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides, check=False)
    if not (cfg.model.hf_path or cfg.model.load or cfg.data.tokenizer):
        # the tokenizer rule is the data path's: the planner reads no text
        cfg.data.tokenizer = "(not needed to plan)"
    validate(cfg)
    cluster = cluster_from_args(args)
    loss_fn = build_loss(cfg.loss)
    model = resolved_model(cfg, loss_fn)
    numerics = numerics_for(model, cluster)

    def workload_of(parallel, mbs):
        return workload_for(cfg, loss_fn, model, mbs, args.prompt_fraction, args.train_pairs)

    as_configured = {model.recompute_granularity or "none": {}}
    try:
        own = config_layout(cfg, model, cluster.world_size)
        mine = plan_layouts(
            cfg,
            model,
            workload_of,
            numerics,
            cluster,
            check,
            own,
            cfg.train.micro_batch_size,
            as_configured,
        )[0]
    except ValueError as e:  # the layout does not fit the cluster's rank count
        mine = Plan(cfg.parallel, cfg.train.micro_batch_size, next(iter(as_configured)))
        mine.reason = str(e)
    plans = [] if args.layout else plan_layouts(cfg, model, workload_of, numerics, cluster, check)
    # a cached asset's folder is machine-specific: its name is enough
    name = os.path.basename(model.hf_path) if os.path.isabs(model.hf_path) else model.hf_path
    name = name or "model.* keys"
    workload = workload_of(cfg.parallel, cfg.train.micro_batch_size)
    print(_model_line(model, name))
    print(_work_line(loss_fn, workload, numerics))
    print(_cluster_line(cluster))
    print()
    if mine.valid:
        verdict = {"yes": "fits", "tight": "fits, within 10% of the limit"}.get(
            mine.status, f"does not fit: {mine.reason}"
        )
        print(f"the config's layout: {verdict}\n")
        print(HEADER)
        print(_row("cfg", mine))
    else:
        print(f"the config's layout is refused: {mine.reason}")
    if plans:
        print()
        print(HEADER)
        estimated = [p for p in plans if p.valid]
        for i, plan in enumerate(estimated[: args.top], 1):
            print(_row(str(i), plan))
        fitting = sum(p.fits for p in plans)
        tight = sum(p.tight for p in plans)
        refused = Counter(_short_reason(p.reason) for p in plans if not p.valid)
        print(
            f"\n{len(plans)} candidates (layout x micro-batch size x recompute) judged: "
            f"{fitting} fit ({tight} of them tight: within 10% of the limit, listed after the "
            f"others), {len(estimated) - fitting} too big, {sum(refused.values())} refused by "
            "the engine's rules" + (":" if refused else "")
        )
        for reason, count in refused.most_common(8):
            print(f"  {count:>5}  {reason}")
        best = next((p for p in plans if p.fits), None)
        if best is None:
            print("\n" + _nothing_fits(plans, cluster, cfg, workload))
        else:
            print(
                f"\nbest: {_gib(best.memory.total)} GiB per GPU, {best.time.total_s:.2f} s per "
                "step. Paste into the config:\n"
            )
            print(_snippet(best))
            print(f"\nor on the command line:\n  {' '.join(best.overrides())}")
    records = [p.record() for p in plans]
    document = {
        "model": {"name": name, "num_layers": model.num_layers, "hidden_size": model.hidden_size},
        "cluster": {
            "nodes": cluster.nodes,
            "gpus_per_node": cluster.gpus_per_node,
            "gpu": cluster.accelerator.sku,
            "memory_gib": cluster.accelerator.memory_gib,
            "usable_gib": cluster.usable_bytes / GIB,
            "peak_tflops": cluster.accelerator.bf16_tflops,
            "mfu": cluster.mfu,
        },
        "workload": workload.__dict__,
        "config_layout": mine.record(),
        "best": next((r for r in records if r["fits"]), None),
        "layouts": records[: args.json_top or None],
    }
    if args.json:
        from dpo_megatron.utils.files import write_json_atomic

        write_json_atomic(args.json, document)
    return document


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m dpo_megatron.plan``: a config mistake ends with one ``config error:`` line
    (exit status 1); otherwise the exit status says whether the config's own layout fits (0)
    or not (2: too big, or refused on this cluster)."""
    try:
        document = run(argv)
    except (OSError, ValueError) as e:
        raise SystemExit(f"config error: {e}") from None
    if not document["config_layout"]["fits"]:
        raise SystemExit(2)


if __name__ == "__main__":
    sys.exit(main())
