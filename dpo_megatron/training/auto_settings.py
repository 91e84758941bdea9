"""The speed settings left to the engine (``null`` / ``auto`` in the config), decided once per run.

A newcomer should get the fastest *exact* setting without reading about it. Four settings are
chosen here, each by a rule stated in docs/PERFORMANCE.md ("Fast by default") and reported on the
start-up line with its reason (``Trainer`` prints :attr:`AutoSettings.line`):

* **packing** (``packing.enabled`` / ``packing.share_prompt`` = null): shared-prompt pairs
  (each pair one ``[prompt | chosen | rejected]`` unit, the prompt computed once) for paired
  losses; plain packing for unpaired losses (KTO rows have no pair to share a prompt in); off
  for SFT losses (packing packs preference pairs) and for mixture-of-experts models (the
  router's load-balancing loss counts the tokens it routes, padding and repeated prompts
  included, so any other layout changes the loss). Log-probs equal the padded path's (fp32,
  1e-6 relative; ``tests/training/test_shared_prompt.py`` at every layout).
* **LM head** (``model.fused_lm_head`` = null): the rule is
  :func:`dpo_megatron.models.gpt.lm_head_is_fused` (unfused on the host CPU, fused on an
  accelerator).
* **reference** (``reference.mode=auto``): ``precomputed`` when the loss reads a reference and
  the run's steps cover every train pair at least once (``train_iters x global_batch_size >=``
  train pairs): the precompute pass then costs no more reference forwards than running the
  reference every step, saves them from the second epoch (or a cached rerun) on, and frees the
  reference weights before the optimizer state exists (a lower peak). Otherwise ``model``: a
  run that sees only part of its data would pay a pass over pairs it never trains on.
* **precision** (``model.params_dtype=auto``, decided in ``models.transformer_config``): bf16
  on CUDA, fp32 on the CPU; reported here with whether the CPU has native bf16 (AVX512-BF16 /
  AMX), where ``model.params_dtype=bfloat16`` is about twice as fast (log-probs ~1e-3 apart).
* **attention**, reported only (``models.specs.core_attention_choice``): the core attention the
  layers run, with context parallelism's blockwise kernel in place of ``model.local_attention``.

Nothing else is decided here; an explicit value in the config is always kept. Nothing is
written into the config given: :func:`resolve_auto_settings` returns a new, frozen config
(``utils.frozen``) with the choices made, which the run then reads everywhere (its start-up line,
``config.yaml``, ``--print-config``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.utils.frozen import freeze


@dataclass(frozen=True)
class AutoSettings:
    """What :func:`resolve_auto_settings` chose, and why (for the start-up line)."""

    config: object
    """The run's config with every choice made: a new, frozen tree (``utils.frozen``)."""
    model_config: ModelConfig
    """The architecture with ``fused_lm_head`` decided: a new, frozen one."""
    reasons: tuple[str, ...]
    """One ``what (why)`` phrase per setting, in start-up line order."""

    @property
    def line(self) -> str:
        """The start-up line: ``speed: <setting> (<why>) | ...``."""
        return "speed: " + " | ".join(self.reasons)


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU advertises bf16 arithmetic (``avx512_bf16`` or ``amx_bf16`` flags in
    ``cpuinfo``); False when it does not or the file cannot be read (not Linux)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    words = set(flags.split())
    return bool(words & {"avx512_bf16", "amx_bf16"})


def resolve_packing(cfg, loss_fn, model_cfg: ModelConfig):
    """``cfg.packing`` with ``enabled`` / ``share_prompt`` left at null decided (a new
    ``PackingConfig``; ``cfg`` is not changed), and the reason: a key set in the config that
    overrode auto's choice is named beside auto's (never auto's reason alone for a choice auto
    did not make)."""
    p = cfg.packing
    explicit = p.enabled is not None and p.share_prompt is not None
    if loss_fn.item_kind == "sft":
        why = "off: an SFT loss trains on single completions"
        enable, share = False, False
    elif model_cfg.num_experts:
        why = (
            "off: MoE model (its load-balancing loss counts routed tokens, a shared prompt "
            "once; packed MoE is not checked equal to padded)"
        )
        enable, share = False, False
    elif loss_fn.unpaired:
        why = "packed, prompt not shared: unpaired (KTO) rows have no pair"
        enable, share = True, False
    else:
        why = "shared-prompt pairs: exact, the prompt computed once"
        enable, share = True, True
    enabled = p.enabled
    if enabled is None:
        enabled = enable if p.share_prompt is not True else True
    share_prompt = p.share_prompt
    if share_prompt is None:
        share_prompt = share and enabled
    stated = ", ".join(
        f"packing.{key}={str(value).lower()}"
        for key, value in (("enabled", p.enabled), ("share_prompt", p.share_prompt))
        if value is not None
    )
    p = dataclasses.replace(p, enabled=enabled, share_prompt=share_prompt)
    if explicit:
        return p, f"packing {_packing_name(p)} (set in the config)"
    if (enabled, share_prompt) != (enable, share):  # the key set overrode auto's choice
        return p, f"packing {_packing_name(p)} ({stated} in the config; auto: {why})"
    return p, f"packing {_packing_name(p)} (auto: {why})"


def _packing_name(p) -> str:
    if p.share_prompt:
        return "shared-prompt"
    return "on" if p.enabled else "off"


def _lm_head(model_cfg: ModelConfig) -> tuple[bool | None, str]:
    """``model.fused_lm_head`` decided (as set when set), and the reason."""
    from dpo_megatron.models.gpt import lm_head_is_fused
    from dpo_megatron.parallel.device import get_device

    if model_cfg.head == "reward":
        return model_cfg.fused_lm_head, "LM head none (a reward model: models.reward_head)"
    chosen = lm_head_is_fused(model_cfg.fused_lm_head)
    name = "fused" if chosen else "unfused"
    if model_cfg.fused_lm_head is not None:
        return model_cfg.fused_lm_head, f"LM head {name} (set in the config)"
    where = get_device().type
    why = (
        "the second LM-head matmul in backward costs less than keeping the logits"
        if chosen
        else "keeping the logits for backward is faster than a second LM-head matmul"
    )
    return chosen, f"LM head {name} (auto on {where}: {why})"


def resolve_reference(cfg, loss_fn, num_train: int | None):
    """``cfg.reference`` with ``mode=auto`` decided (a new ``ReferenceConfig``; ``cfg`` is not
    changed), and the reason. ``num_train`` None (the data not read: ``--print-config``) leaves
    ``auto`` where the loss reads a reference."""
    ref = cfg.reference
    if not loss_fn.needs_reference:
        # Never built, and left as given ('auto'): a mode named with such a loss is refused
        # (config._check_reference_used), so --print-config and config.yaml must not write one.
        return ref, "reference none (the loss reads none)"
    offload = " + offload" if ref.offload else ""
    if ref.mode != "auto":
        return ref, f"reference {ref.mode}{offload} (set in the config)"
    if num_train is None:
        return ref, (
            f"reference auto{offload} (decided at start: precomputed when the steps cover "
            "the train pairs, else model)"
        )
    from dpo_megatron.data.kinds import item_kind

    unit = item_kind(loss_fn.item_kind).unit  # pairs, or KTO's examples
    steps, per_step = cfg.train.train_iters, cfg.train.global_batch_size
    seen = steps * per_step
    run = f"{steps} step{'s' * (steps != 1)} x {per_step} {unit if per_step != 1 else unit[:-1]}"
    if seen >= num_train:
        mode = "precomputed"
        why = f"{run} cover the {num_train} train {unit}: one pass costs no more, then none"
    else:
        mode = "model"
        why = f"{run} = {seen} < {num_train} train {unit}: a pass over all would cost more"
    return dataclasses.replace(ref, mode=mode), f"reference {mode}{offload} (auto: {why})"


def _precision(cfg, model_cfg: ModelConfig) -> str:
    """The precision that runs and why (nothing is changed: ``model.params_dtype`` is resolved
    by ``models.transformer_config.resolve_params_dtype``)."""
    from dpo_megatron.models.transformer_config import resolve_params_dtype
    from dpo_megatron.parallel.device import is_host

    dtype = resolve_params_dtype(model_cfg.params_dtype)
    name = {"torch.float32": "fp32", "torch.bfloat16": "bf16"}.get(str(dtype), str(dtype))
    if model_cfg.params_dtype != "auto":
        why = "set in the config"
        if name == "bf16" and is_host() and not cpu_has_native_bf16():
            # torch emulates bf16 products there: many times slower than fp32 (docs/BENCHMARKS.md)
            why += "; this CPU has no native bf16: its bf16 matmuls are emulated, many times "
            why += "slower than fp32 (model.params_dtype=auto keeps fp32 here)"
    elif not is_host():
        why = "auto: bf16 on an accelerator"
    elif cpu_has_native_bf16():
        why = (
            "auto: fp32 on the CPU; this CPU has native bf16 (AVX512-BF16): "
            "model.params_dtype=bfloat16 runs about 2x faster, log-probs ~1e-3 apart"
        )
    else:
        why = "auto: fp32 on the CPU; this CPU has no native bf16 (bf16 would be many times slower)"
    return f"precision {name} ({why})"


def _attention(cfg, model_cfg: ModelConfig) -> str:
    """The core attention that runs and why (nothing is changed: ``models.specs`` builds it)."""
    from dpo_megatron.models.specs import core_attention_choice

    kernel, why = core_attention_choice(model_cfg, cfg.parallel.context_parallel_size)
    return f"attention {kernel} ({why})"


def resolve_auto_settings(
    cfg, loss_fn, model_cfg: ModelConfig, num_train: int | None = None
) -> AutoSettings:
    """Decide every speed setting left to the engine: a new, frozen config and architecture
    with the choices made; ``cfg`` and ``model_cfg`` are not changed (a frozen ``cfg`` is
    fine).

    Call it after the loss, the architecture and the data are known and before the batch
    builder, the models or the reference source are built (``Trainer.__init__``), and read the
    returned config from then on. Idempotent: its own result resolves to an equal config.

    Args:
        cfg: the run's ``DPOConfig`` (``packing``, ``reference``, ``train`` read).
        loss_fn: the built loss (``item_kind``, ``unpaired``, ``needs_reference``).
        model_cfg: the resolved architecture (``num_experts``, ``fused_lm_head``,
            ``params_dtype``).
        num_train: train pairs (or examples) of the run; None (the data not read) leaves
            ``reference.mode=auto`` undecided (the reference rule needs the count).

    Returns:
        The resolved config and architecture, and the choices' reasons
        (:attr:`AutoSettings.line` is the start-up line).
    """
    packing, packing_why = resolve_packing(cfg, loss_fn, model_cfg)
    fused, lm_head_why = _lm_head(model_cfg)
    reference, reference_why = resolve_reference(cfg, loss_fn, num_train)
    model = cfg.model
    if model.fused_lm_head is None:
        model = dataclasses.replace(model, fused_lm_head=fused)
    resolved = dataclasses.replace(cfg, packing=packing, reference=reference, model=model)
    return AutoSettings(
        config=freeze(resolved),
        model_config=freeze(dataclasses.replace(model_cfg, fused_lm_head=fused)),
        reasons=(
            packing_why,
            lm_head_why,
            reference_why,
            _precision(cfg, model_cfg),
            _attention(cfg, model_cfg),
        ),
    )
