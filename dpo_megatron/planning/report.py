"""The layout planner's report: the model, work and cluster lines, the config's own layout, the
ranked table of every layout that fits (memory by part per GPU, step time, tokens per GPU), the
reasons the others were refused, the best one as a config snippet (or why nothing fits), and the
same as a JSON document (``python -m dpo_megatron.plan``: :mod:`dpo_megatron.cli.plan`).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable

from dpo_megatron.planning.hardware import GIB, Cluster

TOP = 12
"""Rows of the table by default."""


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


def plan_report(
    cfg,
    cluster: Cluster,
    check: Callable,
    *,
    layout_only: bool = False,
    top: int = TOP,
    prompt_fraction: float | None = None,
    train_pairs: int | None = None,
    json_top: int = 0,
) -> dict:
    """Plan ``cfg``'s model on ``cluster`` and print the report (module docstring): every
    layout ``check`` (the config's rules: ``config.validate``) and the engine's own rules
    accept, unless ``layout_only`` (the config's own layout alone); ``top`` rows of the table;
    ``prompt_fraction`` / ``train_pairs`` as in :func:`~dpo_megatron.planning.from_config.
    workload_for`. Returns the JSON document (``json_top``: its first records only, 0 all).

    Raises:
        ValueError: the config's model cannot be resolved (named).
    """
    from dpo_megatron.losses import build_loss
    from dpo_megatron.planning.from_config import (
        config_layout,
        numerics_for,
        resolved_model,
        workload_for,
    )
    from dpo_megatron.planning.search import Plan, plan_layouts

    loss_fn = build_loss(cfg.loss)
    model = resolved_model(cfg, loss_fn)
    numerics = numerics_for(model, cluster)

    def workload_of(parallel, mbs):
        return workload_for(cfg, loss_fn, model, mbs, prompt_fraction, train_pairs)

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
    plans = [] if layout_only else plan_layouts(cfg, model, workload_of, numerics, cluster, check)
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
        for i, plan in enumerate(estimated[:top], 1):
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
        "layouts": records[: json_top or None],
    }
    return document
