"""The speed settings left to the engine: what auto chooses and why, and that the new
default gives the old default's losses (1e-5 per step) on a tiny model."""

from __future__ import annotations

import math

import pytest

from tests.engine import engine_config, random_pairs, tiny_trainer
from tests.multirank import run_cases

OLD_DEFAULT = dict(packing=False, share_prompt=False, reference_mode="model")
NEW_DEFAULT = dict(packing=None, share_prompt=None, reference_mode="auto")


def _resolve(loss=None, model=None, steps=2, num_train=8, **config):
    """The resolved config and the start-up line, from a frozen config (nothing may write
    into the config the user built)."""
    from dpo_megatron.losses import build_loss
    from dpo_megatron.training.auto_settings import resolve_auto_settings
    from dpo_megatron.utils.frozen import freeze

    cfg = freeze(engine_config(loss=loss, model=model, steps=steps, **{**NEW_DEFAULT, **config}))
    settings = resolve_auto_settings(cfg, build_loss(cfg.loss), cfg.model, num_train)
    return settings.config, settings.line


def test_the_config_built_is_never_changed_and_the_resolved_one_is_new_and_frozen():
    """The auto settings leave the (frozen) config the user built as it was and return a new
    frozen config and architecture with the choices; resolving the resolved one changes
    nothing (idempotent)."""
    import dataclasses

    from dpo_megatron.losses import build_loss
    from dpo_megatron.training.auto_settings import resolve_auto_settings
    from dpo_megatron.utils.frozen import freeze, is_frozen

    built = freeze(engine_config(steps=2, **NEW_DEFAULT))
    loss_fn = build_loss(built.loss)
    settings = resolve_auto_settings(built, loss_fn, built.model, 8)
    assert (built.packing.enabled, built.packing.share_prompt) == (None, None)
    assert built.reference.mode == "auto" and built.model.fused_lm_head is None
    resolved = settings.config
    assert resolved is not built and is_frozen(resolved) and is_frozen(resolved.packing)
    assert (resolved.packing.enabled, resolved.packing.share_prompt) == (True, True)
    assert resolved.reference.mode == "precomputed" and resolved.model.fused_lm_head is False
    assert settings.model_config.fused_lm_head is False and is_frozen(settings.model_config)
    with pytest.raises(dataclasses.FrozenInstanceError, match="dataclasses.replace"):
        resolved.packing.enabled = False
    again = resolve_auto_settings(resolved, loss_fn, settings.model_config, 8)
    assert again.config == resolved and again.model_config == settings.model_config
    # without the train pairs' count (--print-config) the reference is left to the run
    unread = resolve_auto_settings(built, loss_fn, built.model)
    assert unread.config.reference.mode == "auto" and "reference auto (decided at" in unread.line


def test_auto_on_the_cpu_for_a_paired_loss():
    cfg, line = _resolve(steps=2, num_train=8)  # 2 steps x 4 pairs cover the 8 pairs
    assert cfg.packing.enabled is True and cfg.packing.share_prompt is True
    assert cfg.model.fused_lm_head is False  # the host CPU: unfused
    assert cfg.reference.mode == "precomputed"
    assert line.startswith("speed: packing shared-prompt (auto: ")
    assert "LM head unfused (auto on cpu: " in line
    assert "reference precomputed (auto: 2 steps x 4 pairs cover the 8 train pairs" in line
    assert "precision fp32 (auto: fp32 on the CPU" in line


def test_the_line_names_the_attention_that_runs_and_context_parallelisms_kernel():
    """The start-up line names the layers' core attention: the configured local kernel, and
    under context parallelism the blockwise kernel, which replaces the one named."""
    _, line = _resolve()
    assert line.endswith(" | attention sdpa (set in the config)")
    _, line = _resolve(model={"local_attention": "auto"})
    assert line.endswith(" | attention sdpa (auto: sdpa on this device)")
    _, line = _resolve(cp=2, model={"local_attention": "flex"})
    assert line.endswith(
        " | attention context-parallel blockwise (CP 2: gathers the keys and values; "
        "model.local_attention=flex applies without CP)"
    )


def test_auto_reference_is_the_model_when_the_run_sees_part_of_its_pairs():
    cfg, line = _resolve(steps=2, num_train=9)
    assert cfg.reference.mode == "model"
    assert "reference model (auto: 2 steps x 4 pairs = 8 < 9 train pairs" in line
    _, line = _resolve(steps=1, num_train=9)
    assert "reference model (auto: 1 step x 4 pairs = 4 < 9 train pairs" in line


def test_auto_keeps_explicit_values_and_refuses_by_name():
    cfg, line = _resolve(packing=False, share_prompt=False, reference_mode="model")
    assert not cfg.packing.enabled and not cfg.packing.share_prompt
    assert "packing off (set in the config)" in line and "reference model (set in the" in line
    cfg, _ = _resolve(model={"fused_lm_head": True})
    assert cfg.model.fused_lm_head is True
    # SFT trains on single completions: no packing; KTO rows have no pair to share a prompt in
    cfg, line = _resolve(loss={"name": "sft"})
    assert cfg.packing.enabled is False and cfg.packing.share_prompt is False
    assert "packing off (auto: off: an SFT loss" in line
    assert "reference none (the loss reads none)" in line
    cfg, line = _resolve(loss={"name": "kto", "beta": 0.1})
    assert cfg.packing.enabled is True and cfg.packing.share_prompt is False
    # KTO counts examples, not pairs
    assert "(auto: 2 steps x 4 examples cover the 8 train examples: " in line
    _, line = _resolve(loss={"name": "kto", "beta": 0.1}, global_batch_size=1, steps=1)
    assert "(auto: 1 step x 1 example = 1 < 8 train examples: " in line
    # a mixture of experts: the router's balancing loss counts tokens, so packing stays off
    cfg, line = _resolve(model={"num_experts": 4, "moe_ffn_hidden_size": 32})
    assert cfg.packing.enabled is False and "MoE model" in line
    # share_prompt=true alone turns packing on with it
    cfg, _ = _resolve(share_prompt=True)
    assert cfg.packing.enabled is True


def test_cpu_bf16_flag_is_read_from_cpuinfo(tmp_path):
    from dpo_megatron.training.auto_settings import cpu_has_native_bf16

    (tmp_path / "yes").write_text("processor: 0\nflags\t: fpu sse avx512f avx512_bf16 avx2\n")
    (tmp_path / "no").write_text("processor: 0\nflags\t: fpu sse avx512f avx2\n")
    assert cpu_has_native_bf16(str(tmp_path / "yes"))
    assert not cpu_has_native_bf16(str(tmp_path / "no"))
    assert not cpu_has_native_bf16(str(tmp_path / "missing"))


@pytest.mark.parametrize("native", [True, False])
def test_precision_line_says_what_bf16_costs_on_this_cpu(monkeypatch, native):
    """bf16 set by hand on a CPU without native bf16 is named as many times slower (torch
    emulates its products there: 8-60x per matmul measured, docs/BENCHMARKS.md); auto keeps
    fp32 on the CPU either way."""
    from dpo_megatron.training import auto_settings

    monkeypatch.setattr(auto_settings, "cpu_has_native_bf16", lambda: native)
    _, line = _resolve(model={"params_dtype": "bfloat16"})
    assert "precision bf16 (set in the config" in line
    assert ("its bf16 matmuls are emulated" in line) is (not native)
    _, line = _resolve()
    assert "precision fp32 (auto: fp32 on the CPU; this CPU has " in line
    assert ("(bf16 would be many times slower)" in line) is (not native)


def _losses(num_pairs: int, steps: int, settings: dict) -> dict:
    # prompts of 3-9 tokens, completions of 2-7: shared prompts and padding both matter
    pairs = random_pairs(num_pairs, seed=5, lengths=lambda i: (3 + i % 7, 2 + i % 5, 7 - i % 6))
    trainer = tiny_trainer(pairs, steps=steps, micro_batch_size=2, global_batch_size=4, **settings)
    chosen = (
        trainer.cfg.packing.share_prompt,
        trainer.cfg.reference.mode,
        trainer.policy[0].module.fused_lm_head,
    )
    losses = [trainer.train_step()[0].metrics["loss"] for _ in range(2)]
    inner = [o.optimizer for o in getattr(trainer.optimizer, "chained_optimizers", [])]
    return {
        "losses": losses,
        "chosen": chosen,
        "line": trainer.auto_settings.line,
        # torch's fused AdamW on the CPU (training.optim.fuse_torch_adam_on_cpu), state made
        "fused_adam": [g["fused"] for o in inner for g in o.param_groups],
        "adam_steps": sorted({float(s["step"]) for o in inner for s in o.state.values()}),
    }


def test_new_default_gives_the_old_default_losses():
    """12 pairs, 2 steps (the run sees 8: reference model) and 3 steps (it sees all 12:
    precomputed); both with shared prompts and the unfused head, against the old explicit
    settings (padded, reference model every step, fused head): losses within 1e-5."""
    runs = run_cases(
        1,
        {
            "old": (
                _losses,
                dict(
                    num_pairs=12,
                    steps=2,
                    settings={**OLD_DEFAULT, "model": {"fused_lm_head": True}},
                ),
            ),
            "new_model": (_losses, dict(num_pairs=12, steps=2, settings=NEW_DEFAULT)),
            "new_precomputed": (_losses, dict(num_pairs=12, steps=3, settings=NEW_DEFAULT)),
        },
    )
    old, model, precomputed = (runs[k][0] for k in ("old", "new_model", "new_precomputed"))
    assert old["chosen"] == (False, "model", True)
    assert model["chosen"] == (True, "model", False)
    assert precomputed["chosen"] == (True, "precomputed", False)
    assert old["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    for run in (old, model, precomputed):
        assert run["fused_adam"] and all(run["fused_adam"]), run["fused_adam"]
        assert run["adam_steps"] == [2.0]
    for new in (model, precomputed):
        for a, b in zip(new["losses"], old["losses"], strict=True):
            assert abs(a - b) < 1e-5, (new["losses"], old["losses"])
    assert old["losses"][1] != pytest.approx(old["losses"][0], abs=1e-4)  # the step moved it


def test_one_packing_key_set_against_auto_is_named_not_called_auto():
    """A packing key set in the config that overrides auto's choice (packing.enabled=true on a
    mixture-of-experts model, packing.enabled=false on a dense one) is named on the start-up
    line beside auto's reason; the line never gives auto's reason for a choice auto did not
    make ('packing on (auto: off: ...)')."""
    moe = {"num_experts": 4, "moe_ffn_hidden_size": 32}
    cfg, line = _resolve(model=moe, packing=True)
    assert cfg.packing.enabled is True and cfg.packing.share_prompt is False
    assert "packing on (packing.enabled=true in the config; auto: off: MoE model" in line
    cfg, line = _resolve(packing=False)
    assert cfg.packing.enabled is False
    assert "packing off (packing.enabled=false in the config; auto: shared-prompt pairs" in line
    _, line = _resolve(model=moe)  # auto's own choice keeps its reason alone
    assert "packing off (auto: off: MoE model" in line
